//! One function per subcommand: flags in, exit code out.

use super::*;

/// `kvprobe geometry`: prints what the geometry flags resolve to.
pub(crate) fn geometry_command(geo: &GeometryArgs, json: bool) -> Exit {
    let (g, model) = match geo.resolve_any() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvprobe: {e}");
            return e.exit();
        }
    };
    if let Err(e) = g.validate() {
        eprintln!("kvprobe: {e}");
        return Exit::Usage;
    }
    if json {
        #[derive(serde::Serialize)]
        struct Out<'a> {
            #[serde(serialize_with = "kvprobe::geometry::serialize_with_slice_bytes")]
            geometry: &'a kvprobe::geometry::Geometry,
            pool_bytes: u64,
            #[serde(skip_serializing_if = "Option::is_none")]
            model: Option<&'a kvprobe::model_config::ModelInfo>,
            /// A hybrid model's regions on one TP rank (kvprobe::hybrid::Region).
            #[serde(skip_serializing_if = "Option::is_none")]
            regions: Option<Vec<kvprobe::hybrid::Region>>,
        }
        let regions = match model.as_ref().filter(|m| m.kv.hybrid.as_ref().is_some_and(|h| h.any())) {
            Some(m) => match m.kv.rank_regions(&g, m.tp.tp) {
                Ok(r) => Some(r),
                Err(e) => {
                    eprintln!("kvprobe: {e}");
                    return Exit::Usage;
                }
            },
            None => None,
        };
        let out = Out { geometry: &g, pool_bytes: g.pool_bytes().unwrap_or(0), model: model.as_ref(), regions };
        println!("{}", serde_json::to_string_pretty(&out).expect("serialisable"));
        return Exit::Clean;
    }
    if let Some(m) = model.as_ref().filter(|m| m.kv.hybrid.as_ref().is_some_and(|h| h.any()))
        && let Err(e) = m.kv.rank_regions(&g, m.tp.tp)
    {
        eprintln!("kvprobe: {e}");
        return Exit::Usage;
    }
    print!("{}", kvprobe::model_config::describe(&g, model.as_ref()));
    Exit::Clean
}

pub(crate) fn run(args: RunArgs, typed: &[&str]) -> Exit {
    claim_stdout(&args.pool.report);
    if let Err(x) = check_outputs(&args.pool).and_then(|_| install_signals()) {
        return x;
    }
    let cfg = match args.config(typed) {
        Ok(c) => c,
        Err(e) => {
            return refused(&args.pool, &kvprobe::run::failed_report(&args.pool.config(), &e), kvprobe::junit::from_run, &e);
        }
    };
    let mut display = Display::new();
    let stall_cfg = cfg.clone();
    let json_at = json_named(&args.pool.report, &args.pool.bundle);
    let json_at_end = json_at.clone();
    on_stall(
        display.bar.clone(),
        args.pool.report.clone(),
        (args.pool.junit.clone(), kvprobe::junit::from_run),
        "report:            ",
        move |e| {
            let (r, exit) = kvprobe::run::expired_report(&stall_cfg, e);
            let text = if r.summary.iterations > 0 || r.scenario.is_some() {
                kvprobe::report::render_with(&r, json_at.as_deref())
            } else {
                String::new()
            };
            (r, exit, text)
        },
    );
    let mut ckpt_failed = false;
    let path = checkpoints_to(&args.pool.report);
    show_phases(true);
    let mut line = |l: &str| {
        end_phases();
        err(l)
    };
    let mut progress = |p: &Progress| display.update("", p);
    let mut checkpoint = |r: &Report| {
        if let Some(path) = &path
            && let Err(e) = kvprobe::report::write_atomic(path, r)
            && !ckpt_failed
        {
            ckpt_failed = true;
            err(&format!("kvprobe: checkpoint: {e}"));
        }
    };
    let mut dumper = match start_dump(&args.pool, &cfg, None) {
        Ok(d) => d,
        Err(e) => return refused(&args.pool, &kvprobe::run::failed_report(&cfg, &e), kvprobe::junit::from_run, &e),
    };
    let mut hooks = Hooks {
        line: &mut line,
        progress: &mut progress,
        checkpoint_secs: if cfg.scenario.is_some() { args.load.checkpoint } else { 0.0 },
        checkpoint: &mut checkpoint,
        dump: dumper.as_mut(),
    };
    let (mut report, exit) = kvprobe::run::run(&cfg, &mut hooks);
    if let Some(d) = dumper.as_mut() {
        report.dump = Some(d.finish());
    }
    end_phases();
    display.finish();
    let lost = args.pool.report.as_ref().and_then(|p| write_json(p, &report).err());
    if report.summary.iterations > 0 || report.outcome.error.is_none() || report.scenario.is_some() {
        out(&kvprobe::report::render_with(&report, json_at_end.as_deref()));
    }
    report_error(&report.outcome);
    let exit = report_outcome(&args.pool.report, lost, &report, exit, "report:            ");
    if let (Some(d), Some(_)) = (&report.dump, &args.pool.dump) {
        out(&format!(
            "dump:              {} ({} slices written, {} left out by --dump-max-bytes or a failed write)\n",
            d.dir, d.slices_written, d.slices_omitted
        ));
    }
    let exit = finish_bundle(&args.pool, &report, "report.json", exit);
    write_junit(&args.pool.junit, kvprobe::junit::from_run, &report, exit)
}

/// A run or ab refused before it started (`e`: bad flags, a dump directory that is not empty,
/// an unwritable bundle path): says why, and still leaves `doc` (a report saying why) at
/// `--report` (or on stderr when it cannot be written) and its `--junit` error case, as every
/// other error does. Returns the error's exit code.
pub(crate) fn refused<T: serde::Serialize>(pool: &PoolArgs, doc: &T, of: JunitOf, e: &Error) -> Exit {
    err(&format!("kvprobe: {e}"));
    if let Some(path) = &pool.report
        && let Err(w) = write_json(path, doc)
    {
        kvprobe::report::print_fallback(&format!("--report {}", path.display()), doc, &w);
    }
    write_junit(&pool.junit, of, doc, e.exit())
}

/// The dump directory of a run (`--dump`, or with `--bundle` alone a scratch one).
pub(crate) fn dump_dir(pool: &PoolArgs) -> Result<Option<PathBuf>, Error> {
    match (&pool.dump, &pool.bundle) {
        (Some(d), _) => Ok(Some(d.clone())),
        (None, Some(_)) => Ok(Some(kvprobe::tempdir::dir()?.join("dump"))),
        (None, None) => Ok(None),
    }
}

/// Checks `--dump`/`--bundle` before the run (exit 2: a non-empty dump directory, an
/// unwritable bundle path) and, for `run` (`row` None), starts the dump.
pub(crate) fn start_dump(pool: &PoolArgs, cfg: &RunConfig, row: Option<&str>) -> Result<Option<kvprobe::dump::Dumper>, Error> {
    if let Some(b) = &pool.bundle {
        if is_stdout(b) {
            return Err(Error::Usage("--bundle needs a file path (`-` is not supported)".into()));
        }
        kvprobe::report::check_writable_for(b, "--bundle")?;
    }
    let Some(dir) = dump_dir(pool)? else { return Ok(None) };
    kvprobe::dump::check_dir(&dir)?;
    if row.is_some() {
        return Ok(None);
    }
    let config = serde_json::to_value(cfg).unwrap_or_default();
    let geometry = kvprobe::dump::dumped_geometry(&config).clone();
    let sb = cfg.decode_geom().slice_bytes()?;
    let shape = kvprobe::fingerprint::RowShape::of(cfg.decode_geom());
    kvprobe::dump::Dumper::new(&dir, pool.dump_max_bytes, cfg.seed, geometry, sb, shape, config["tp"].clone()).map(Some)
}

/// `--bundle` at the end of run and ab: the report `doc` (as `name`), the dump, and the
/// environment captured now with the run's UCX log. A bundle that cannot be written is said on
/// stderr and turns a clean exit into 7 (as a report that cannot be written does).
pub(crate) fn finish_bundle<T: serde::Serialize>(pool: &PoolArgs, doc: &T, name: &'static str, exit: Exit) -> Exit {
    let Some(path) = &pool.bundle else { return exit };
    let result = serde_json::to_vec_pretty(doc).map_err(|e| Error::Io(format!("--bundle: {e}"))).and_then(|mut body| {
        body.push(b'\n');
        let dir = dump_dir(pool)?;
        let c = kvprobe::bundle::Contents {
            report: body,
            report_name: name,
            dump: dir.as_deref().filter(|d| d.is_dir()),
            capture_made: "run",
            ucx_log: None, // the capture reads this process's own UCX log
            redact: pool.redact,
        };
        kvprobe::bundle::write(path, &c)
    });
    match result {
        Ok(_) => {
            out(&format!("bundle:            {}\n", path.display()));
            exit
        }
        Err(e) => {
            err(&format!("kvprobe: --bundle {} was not written: {e}", path.display()));
            if exit == Exit::Clean { Exit::ReportNotWritten } else { exit }
        }
    }
}

/// `kvprobe bundle`: an existing report and dump into a bundle, the environment captured now.
pub(crate) fn bundle_command(report: &Path, dump: Option<&Path>, redact: bool, output: &Path) -> Exit {
    let made = (|| -> Result<PathBuf, Error> {
        let body =
            std::fs::read(report).map_err(|e| Error::Usage(format!("--report {}: cannot read it: {e}", report.display())))?;
        let v: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| Error::Usage(format!("--report {}: not a kvprobe report: {e}", report.display())))?;
        let name = match v.get("schema").and_then(|s| s.as_str()) {
            Some(s) if s == kvprobe::report::SCHEMA => "report.json",
            Some(s) if s == kvprobe::ab::AB_SCHEMA => "ab.json",
            other => {
                return Err(Error::Usage(format!(
                    "--report {}: {} is not a run or ab report ({} or {})",
                    report.display(),
                    other.map_or("no \"schema\" string".to_string(), |s| format!("schema {s:?}")),
                    kvprobe::report::SCHEMA,
                    kvprobe::ab::AB_SCHEMA
                )));
            }
        };
        if let Some(d) = dump
            && !d.is_dir()
        {
            return Err(Error::Usage(format!("--dump {}: not a directory", d.display())));
        }
        // Without --dump: the directory the report says it dumped into, when it is still there
        // (ab: the parent of the rows' folders).
        // A relative `dump.dir` was relative to where the run was started: the report's folder is
        // the best guess here, then the current directory.
        let recorded = match name {
            "report.json" => v["dump"]["dir"].as_str().map(PathBuf::from),
            _ => v["sections"][0]["dump"]["dir"].as_str().and_then(|d| Path::new(d).parent().map(Path::to_path_buf)),
        };
        let dumped: u64 = match name {
            "report.json" => v["dump"]["slices_written"].as_u64().unwrap_or(0),
            _ => v["sections"].as_array().into_iter().flatten().filter_map(|s| s["dump"]["slices_written"].as_u64()).sum(),
        };
        let found = |d: &Path| if name == "ab.json" { d.is_dir() } else { d.join("index.json").is_file() };
        let recorded = match recorded.filter(|_| dump.is_none()) {
            Some(d) if d.is_relative() => {
                let beside = report.parent().unwrap_or(Path::new(".")).join(&d);
                if found(&beside) { Some(beside) } else { Some(d).filter(|d| found(d)) }
            }
            Some(d) => Some(d).filter(|d| found(d)),
            None => None,
        };
        if dump.is_none() && recorded.is_none() && dumped > 0 {
            return Err(Error::Usage(format!(
                "--report {}: it says {dumped} slices were dumped into {}, which is not there (looked beside the report and \
                 in the current directory): give --dump DIR",
                report.display(),
                match name {
                    "report.json" => v["dump"]["dir"].as_str().unwrap_or("?").to_string(),
                    _ => v["sections"][0]["dump"]["dir"].as_str().unwrap_or("?").to_string(),
                }
            )));
        }
        let dump_given = dump;
        let dump = dump.or(recorded.as_deref());
        if is_stdout(output) {
            return Err(Error::Usage("-o needs a file path (`-` is not supported)".into()));
        }
        kvprobe::bundle::check_output(output, report, dump)?;
        kvprobe::report::check_writable_for(output, "--bundle")?;
        let c =
            kvprobe::bundle::Contents { report: body, report_name: name, dump, capture_made: "bundle", ucx_log: None, redact };
        kvprobe::bundle::write(output, &c).map_err(|e| match (e, &recorded) {
            // The dump was found from the report's `dump.dir`, not given: say so.
            (Error::Usage(m), Some(_)) if dump_given.is_none() => {
                Error::Usage(format!("{m} (the dump the report names, found without --dump: give --dump DIR)"))
            }
            (e, _) => e,
        })?;
        Ok(output.to_path_buf())
    })();
    match made {
        Ok(p) => {
            out(&format!("bundle: {}\n", p.display()));
            Exit::Clean
        }
        Err(e) => {
            err(&format!("kvprobe: {e}"));
            Exit::Usage
        }
    }
}

/// Prints the error that ended a run, if any, on stderr.
pub(crate) fn report_error(o: &kvprobe::report::Outcome) {
    if let Some(e) = &o.error {
        err(&format!("kvprobe: {}", e.message));
    }
}

/// A final report (`what`: "--report PATH") that could not be written (`why`): says so on
/// stdout, puts the report on stderr ([`kvprobe::report::print_fallback`]), and returns the
/// exit code: the run's own, or 7 (report not written) in place of 0, so neither a clean
/// verdict nor a missing file passes unnoticed.
/// The end of `run` and `ab`: says where the `--report` went (`label` then the path; nothing
/// for stdout), or, when writing it failed (`lost`), hands it to [`report_lost`]. Returns the
/// exit code.
pub(crate) fn report_outcome<T: serde::Serialize>(
    path: &Option<PathBuf>,
    lost: Option<Error>,
    doc: &T,
    exit: Exit,
    label: &str,
) -> Exit {
    match (path, lost) {
        (Some(path), None) => {
            if !is_stdout(path) {
                out(&format!("{label}{}\n", path.display()));
            }
            exit
        }
        (Some(path), Some(e)) => report_lost(&format!("--report {}", path.display()), doc, &e, exit),
        (None, _) => exit,
    }
}

pub(crate) fn report_lost<T: serde::Serialize>(what: &str, value: &T, why: &Error, exit: Exit) -> Exit {
    let exit = if exit == Exit::Clean { Exit::ReportNotWritten } else { exit };
    out(&format!("report:            NOT WRITTEN ({why}): the JSON report is on stderr; exit {}\n", exit as u8));
    kvprobe::report::print_fallback(what, value, why);
    exit
}

pub(crate) fn ab(args: AbArgs, typed: &[&str]) -> Exit {
    if !args.race.is_empty() || args.scenario.is_some() {
        let flag = if args.race.is_empty() { "--scenario" } else { "--race" };
        err(&format!(
            "kvprobe ab: {flag} is not an ab flag: ab runs nixl-only, tier-only and stacked, then stacked with each race \
             mechanism unfenced in turn (rows stacked+MECHANISM). For one scenario or one mechanism use `kvprobe run {flag} ...`"
        ));
        return Exit::Usage;
    }
    if args.load.host_staging {
        err("kvprobe ab: --host-staging is not an ab flag: ab runs its own rows with host staging (stacked-staged, \
             stacked+partial-staging); for a staged run use `kvprobe run --host-staging ...`");
        return Exit::Usage;
    }
    claim_stdout(&args.pool.report);
    if let Err(x) = check_outputs(&args.pool).and_then(|_| install_signals()) {
        return x;
    }
    let mut cfg = match args.pool.try_config() {
        Ok(c) => c,
        Err(e) => {
            return refused(&args.pool, &kvprobe::ab::expired_report(&args.pool.config(), &e).0, kvprobe::junit::from_ab, &e);
        }
    };
    cfg.scenario = Some(ScenarioConfig { matrix: true, ..args.load.config(Scenario::Stacked, Vec::new(), &cfg.geometry) });
    if let Err(e) = dram_takes_no_device(&cfg, typed).and_then(|_| args.pair.apply(&mut cfg, typed)) {
        return refused(&args.pool, &kvprobe::ab::expired_report(&cfg, &e).0, kvprobe::junit::from_ab, &e);
    }
    let dir = match start_dump(&args.pool, &cfg, Some("ab")).and_then(|_| dump_dir(&args.pool)) {
        Ok(d) => d,
        // expired_report makes the matrix's report of an error before any row (no row started).
        Err(e) => return refused(&args.pool, &kvprobe::ab::expired_report(&cfg, &e).0, kvprobe::junit::from_ab, &e),
    };
    let mut display = Display::new();
    let stall_cfg = cfg.clone();
    on_stall(
        display.bar.clone(),
        args.pool.report.clone(),
        (args.pool.junit.clone(), kvprobe::junit::from_ab),
        "report: ",
        move |e| {
            let (ab, exit) = kvprobe::ab::expired_report(&stall_cfg, e);
            let text = if ab.rows.is_empty() { String::new() } else { kvprobe::ab::render(&ab) };
            (ab, exit, text)
        },
    );
    let path = checkpoints_to(&args.pool.report);
    let mut ckpt_failed = false;
    let mut shown = 0;
    let rows = kvprobe::ab::cases().len();
    // `label`: the row's position and name (`row 3/18 stacked`).
    let mut progress = |label: &str, p: &Progress| display.update(&format!("{label}: "), p);
    show_phases(true);
    let mut after_row = |ab: &AbReport| {
        end_phases();
        if let Some(r) = ab.rows.get(shown) {
            shown += 1;
            err(&format!("row {shown}/{rows}: {} {} ({} requests, {} corrupt)", r.name, r.verdict, r.requests, r.corrupt));
        }
        if let Some(path) = &path
            && let Err(e) = kvprobe::report::write_atomic(path, ab)
            && !ckpt_failed
        {
            ckpt_failed = true;
            err(&format!("kvprobe: checkpoint: {e}"));
        }
    };
    let (ab, exit) =
        kvprobe::ab::run_ab(&cfg, &mut progress, &mut after_row, dir.as_deref().map(|d| (d, args.pool.dump_max_bytes)));
    end_phases();
    display.finish();
    let lost = args.pool.report.as_ref().and_then(|p| write_json(p, &ab).err());
    if !ab.rows.is_empty() {
        out(&kvprobe::ab::render(&ab));
    }
    report_error(&ab.outcome);
    let exit = report_outcome(&args.pool.report, lost, &ab, exit, "report: ");
    let exit = finish_bundle(&args.pool, &ab, "ab.json", exit);
    write_junit(&args.pool.junit, kvprobe::junit::from_ab, &ab, exit)
}

pub(crate) fn bench(a: BenchArgs, typed: &[&str]) -> Exit {
    if !(a.timeout.is_finite() && a.timeout > 0.0) {
        err("kvprobe: --timeout must be a positive number of seconds");
        return Exit::Usage;
    }
    if a.memory == Some(MemoryKind::Dram) && typed.contains(&"device") {
        err("kvprobe: --device and --decode-device apply to --memory vram only");
        return Exit::Usage;
    }
    let cfg = kvprobe::bench::BenchConfig {
        memory: a.memory.unwrap_or_else(MemoryKind::default_here),
        device: a.device,
        decode_device: a.decode_device,
        gpu_bytes: a.gpu_bytes,
        host_bytes: a.host_bytes,
        repeats: a.repeats,
        iterations: a.iterations,
        sweep_bytes: a.sweep_bytes,
        seed: a.seed,
        decode_process: a.decode_process,
        backend: a.backend,
        backend_params: a.backend_param.iter().cloned().collect(),
        timeout_secs: a.timeout,
    };
    claim_stdout(&a.json);
    let checked = match &a.json {
        Some(p) if is_stdout(p) => stdout_takes_json("--json"),
        Some(p) => kvprobe::report::check_writable_for(p, "--json"),
        None => Ok(()),
    };
    if let Err(e) = checked {
        err(&format!("kvprobe: {e}"));
        return e.exit();
    }
    if let Err(code) =
        check_distinct_outputs(&[("--json", &a.json), ("--junit", &a.junit)], None).and_then(|_| check_junit_path(&a.junit))
    {
        return code;
    }
    if let Err(e) = kvprobe::bench::check(&cfg) {
        err(&format!("kvprobe: {e}"));
        return e.exit();
    }
    if let Err(code) = install_signals() {
        return code;
    }
    show_phases(false);
    let mut r = kvprobe::bench::start(&cfg);
    let result = kvprobe::bench::run(&cfg, &mut r);
    end_phases();
    let exit = match &result {
        Ok(()) => Exit::Clean,
        Err(e) => e.exit(),
    };
    r.outcome = kvprobe::report::Outcome::of(exit, result.as_ref().err());
    if !r.figures.is_empty() || !r.breakdowns.is_empty() {
        out(&kvprobe::bench::render(&r));
    }
    if let Err(e) = &result {
        err(&format!("kvprobe: {e}"));
    }
    let exit = match &a.json {
        Some(p) => match write_json(p, &r) {
            Err(e) => report_lost(&format!("--json {}", p.display()), &r, &e, exit),
            Ok(()) => {
                if !is_stdout(p) {
                    out(&format!("results: {}\n", p.display()));
                }
                exit
            }
        },
        None => exit,
    };
    write_junit(&a.junit, kvprobe::junit::from_bench, &r, exit)
}

pub(crate) fn env(json: bool, probe: bool) -> Exit {
    let mut e = kvprobe::envinfo::gather(kvprobe::envinfo::nixl_info());
    if probe && e.nixl.library.is_some() && !e.nixl.plugins.is_empty() {
        if let Err(code) = install_signals() {
            return code;
        }
        e.transport_probes = kvprobe::envinfo::probe_paths(e.gpus.len(), &e.rdma);
    }
    let interrupted = kvprobe::interrupt::requested();
    if json {
        match serde_json::to_string_pretty(&e) {
            Ok(s) => out(&format!("{s}\n")),
            Err(x) => {
                err(&format!("kvprobe: env: {}", Error::Io(x.to_string())));
                return Exit::Usage;
            }
        }
    } else {
        out(&kvprobe::envinfo::render(&e));
    }
    if interrupted {
        return Exit::Interrupted;
    }
    if e.nixl.library.is_none() || e.nixl.plugins.is_empty() {
        return Exit::Usage;
    }
    kvprobe::envinfo::probes_exit(&e.transport_probes)
}

/// `kvprobe report show|diff|check` ([`kvprobe::show`], [`kvprobe::report_check`]). What they
/// print is their result: stdout that cannot take it (a full disk, `> /dev/full`) is said on
/// stderr and exits 7, as a report that cannot be written ([`report_out`]).
pub(crate) fn report_command(c: ReportCommand) -> Exit {
    let load = |p: &Path| {
        kvprobe::show::load(p).map_err(|e| {
            err(&format!("kvprobe: {e}"));
            e.exit()
        })
    };
    match c {
        ReportCommand::Show { file } => match kvprobe::show::show_file(&file) {
            Ok(text) => report_out(&text, Exit::Clean),
            Err(e) => {
                err(&format!("kvprobe: {e}"));
                e.exit()
            }
        },
        ReportCommand::Check { bundle } => match kvprobe::report_check::check(&bundle) {
            // Consistency, not cleanliness: a bundle of a corrupt run is consistent when its
            // corruption is exactly as its report says.
            Ok(c) if c.problems.is_empty() => report_out(
                &format!(
                    "{}: the bundle is consistent: {}{} ({} files match the manifest; {} dumped slices re-derived from their bytes)\n",
                    bundle.display(),
                    match c.corrupt {
                        0 => "no corrupt slice, as reported".to_string(),
                        1 => "its 1 corrupt slice is as reported".to_string(),
                        n => format!("its {n} corrupt slices are as reported"),
                    },
                    match c.region_pages_corrupt {
                        0 => String::new(),
                        n => format!("; {n} corrupt region page(s), as reported"),
                    },
                    c.files,
                    c.slices
                ),
                Exit::Clean,
            ),
            Ok(c) => {
                let mut text: String =
                    c.problems.iter().map(|p| format!("{}\n", kvprobe::show::escape_for_terminal(p))).collect();
                text += &format!("{}: {} disagreement(s)\n", bundle.display(), c.problems.len());
                report_out(&text, Exit::Corrupt)
            }
            Err(e) => {
                err(&format!("kvprobe: {}", kvprobe::show::escape_for_terminal(&e.to_string())));
                Exit::Usage
            }
        },
        ReportCommand::Diff { a, b } => {
            let (da, db) = match (load(&a), load(&b)) {
                (Ok(x), Ok(y)) => (x, y),
                (Err(x), _) | (_, Err(x)) => return x,
            };
            let exit = if kvprobe::show::diff(&da, &db).0.is_empty() { Exit::Clean } else { Exit::Corrupt };
            report_out(&kvprobe::show::render_diff(&a, &da, &b, &db), exit)
        }
    }
}

/// Writes `text` to stdout and flushes it: `exit` when it all went out, else (a full disk,
/// `> /dev/full`, a closed pipe) the failure said on stderr and exit 7 (README "Exit codes").
pub(crate) fn report_out(text: &str, exit: Exit) -> Exit {
    let mut o = std::io::stdout().lock();
    match o.write_all(text.as_bytes()).and_then(|_| o.flush()) {
        Ok(()) => exit,
        Err(e) => {
            err(&format!("kvprobe: stdout: {e}: the output was not written"));
            Exit::ReportNotWritten
        }
    }
}

/// `--race`'s long help: each mechanism with what its unfenced variant does.
pub(crate) fn race_help() -> String {
    let mut h = String::from(
        "Leave a race mechanism unfenced (the bug) or keep it fenced (the correct protocol); implies --scenario stacked (those marked \"also in nixl-only\" run with --scenario nixl-only too). Repeatable; MECHANISM alone means unfenced. Every mechanism not named is fenced.\n",
    );
    for m in Mechanism::ALL {
        h += &format!("\n  {}: {}\n", m.name(), m.explain());
    }
    h
}

/// What the NIXL agents of `command` need from the environment ([`kvprobe::nixl::EnvPlan`]),
/// from its flags alone; `None` for the subcommands that load no NIXL.
pub(crate) fn env_plan(command: &Command) -> Option<kvprobe::nixl::EnvPlan> {
    use kvprobe::nixl::EnvPlan;
    // Both pools on one GPU of this process: VRAM, or a default memory that may be VRAM.
    let same_gpu = |p: &PoolArgs, decode_process: bool| {
        p.memory != Some(MemoryKind::Dram) && p.prefill_device.first() == p.decode_device.first() && !decode_process
    };
    match command {
        Command::Run(a) => Some(EnvPlan {
            same_gpu_in_process: same_gpu(&a.pool, a.decode_process),
            diagnosis: true,
            one_host: a.pair.peer.is_none(),
        }),
        Command::Ab(a) => {
            Some(EnvPlan { same_gpu_in_process: same_gpu(&a.pool, false), diagnosis: true, one_host: a.pair.peer.is_none() })
        }
        Command::Bench(a) => {
            Some(EnvPlan { same_gpu_in_process: a.memory != Some(MemoryKind::Dram), diagnosis: true, one_host: true })
        }
        // The prefill process of `run --decode-process` (`--fd`) is on its parent's host.
        Command::Serve(a) => Some(EnvPlan { same_gpu_in_process: false, diagnosis: true, one_host: a.fd.is_some() }),
        Command::Env { .. } => Some(EnvPlan { same_gpu_in_process: false, diagnosis: false, one_host: false }),
        _ => None,
    }
}

/// `kvprobe serve`: the prefill side of a node pair ([`kvprobe::serve`]).
pub(crate) fn serve(a: ServeArgs, typed: &[&str]) -> Exit {
    if a.fd.is_some() {
        // The prefill process of `run --decode-process`: its parent decides when to stop (a
        // Ctrl-C reaches the whole process group), and its test-only stall hooks are
        // KVPROBE_TEST_STALL_AGENT_*.
        kvprobe::child::ignore_interrupts();
        kvprobe::deadline::set_agent_process();
    } else {
        claim_stdout(&a.report); // `--report -`: the JSON alone on stdout, serve's lines on stderr
        if let Err(x) = check_report_path(&a.report).and_then(|_| install_signals()) {
            return x;
        }
    }
    let fail = |e: Error| {
        err(&format!("kvprobe serve: {e}"));
        e.exit()
    };
    if !(a.timeout.is_finite() && a.timeout > 0.0 && a.timeout <= 1e9) {
        return fail(Error::Usage("--timeout must be a positive number of seconds (at most 1e9)".into()));
    }
    let memory = a.memory.unwrap_or_else(MemoryKind::default_here);
    if memory == MemoryKind::Dram && (a.device != 0 || typed.contains(&"device")) {
        return fail(Error::Usage("--device applies to --memory vram only (the pool is in host memory)".into()));
    }
    if memory == MemoryKind::Vram && a.device >= kvprobe::cuda::device_count() {
        return fail(Error::Environment(format!(
            "--device {}: this host has {} CUDA GPU(s) (use --memory dram for a host pool)",
            a.device,
            kvprobe::cuda::device_count()
        )));
    }
    // A hybrid model's block size follows the run's TP (vLLM raises it from each rank's state
    // slot): unless --block-size pins it, the run's is taken.
    // A model config's default block count follows the block size and TP (1 GiB a rank):
    // unless --blocks pins it, the run's is taken too.
    let (geometry, block_size_follows_tp, num_blocks_follow_run, hybrid_pin) =
        match a.geo.any().then(|| a.geo.resolve_any()).transpose() {
            Ok(g) => {
                let model = g.as_ref().and_then(|(_, m)| m.as_ref());
                let hybrid = model.and_then(|m| m.kv.hybrid.as_ref()).is_some_and(|h| h.any());
                let from_model = model.is_some() && a.geo.blocks.is_none();
                // Serve's model config pins the layout of its hybrid regions.
                let pin = model.map(|m| serde_json::to_value(m.kv.hybrid.as_ref()).unwrap_or_default());
                (g.map(|(g, _)| g), hybrid && a.geo.block_size.is_none(), from_model, pin)
            }
            Err(e) => return fail(e),
        };
    if let Some(g) = &geometry
        && let Err(e) = g.validate()
    {
        return fail(Error::Usage(e.to_string()));
    }
    // Everything a run needs on this side, checked before listening.
    if let Err(e) = kvprobe::nixl::check_ucx_log_file().and_then(|_| kvprobe::nixl::load().map(|_| ())) {
        return fail(e);
    }
    if let Some(fd) = a.fd {
        let stream = match kvprobe::child::inherited_socket(fd) {
            Ok(s) => s,
            Err(e) => return fail(Error::Usage(format!("--fd {fd}: {e}"))),
        };
        let token = match std::env::var(kvprobe::peer::TOKEN_VAR).ok().filter(|t| !t.is_empty()) {
            Some(t) => t,
            None => return fail(Error::Usage(format!("--fd needs the token in {}", kvprobe::peer::TOKEN_VAR))),
        };
        let cfg = kvprobe::serve::ServeConfig {
            listen: format!("fd {fd}"),
            token,
            memory,
            device: a.device,
            backend: a.backend.clone(),
            geometry,
            block_size_follows_tp,
            num_blocks_follow_run,
            hybrid: hybrid_pin.clone(),
            tp: a.geo.tp,
            keep_serving: false,
            idle_timeout: Duration::from_secs_f64(a.timeout),
            mode: kvprobe::serve::SessionMode::Child,
        };
        return kvprobe::serve::serve_child(&cfg, stream);
    }
    let listen = a.listen.clone().unwrap_or_default();
    let listener = match kvprobe::serve::bind(&listen) {
        Ok(l) => l,
        Err(e) => return fail(e),
    };
    let (token, made) = match a.token.clone().or_else(|| std::env::var(kvprobe::peer::TOKEN_VAR).ok()).filter(|t| !t.is_empty()) {
        Some(t) => {
            let source = if a.token.is_some() { "--token" } else { kvprobe::peer::TOKEN_VAR };
            if let Err(e) = kvprobe::peer::check_token(&t, source) {
                return fail(e);
            }
            (t, false)
        }
        None => match kvprobe::peer::random_hex(16) {
            Ok(t) => (t, true),
            Err(e) => return fail(e),
        },
    };
    // Said now, before listening: a client would otherwise meet it only when the session's
    // NIXL agent starts.
    if a.backend.as_deref().is_none_or(|b| b == "UCX")
        && let Err(e) = kvprobe::ucx::check_loopback()
    {
        return fail(e);
    }
    if let Some(p) = &a.token_file {
        // Readable by its owner alone: whoever reads it can drive this serve.
        let wrote = kvprobe::report::write_atomic_with(p, "--token-file", |f| {
            use std::io::Write;
            f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
            f.write_all(format!("{token}\n").as_bytes())
        });
        if let Err(e) = wrote {
            return fail(e);
        }
    }
    let cfg = kvprobe::serve::ServeConfig {
        listen: listen.clone(),
        token: token.clone(),
        memory,
        device: a.device,
        backend: a.backend.clone(),
        geometry,
        block_size_follows_tp,
        num_blocks_follow_run,
        hybrid: hybrid_pin,
        tp: a.geo.tp,
        keep_serving: a.keep_serving,
        idle_timeout: Duration::from_secs_f64(a.timeout),
        mode: kvprobe::serve::SessionMode::Listen,
    };
    let bound = listener.local_addr().map(|x| x.to_string()).unwrap_or_else(|_| listen.clone());
    out(&format!(
        "kvprobe serve: listening on {bound} (peer protocol {}; prefill pool on {}; {})\n",
        kvprobe::peer::PROTOCOL,
        if memory == MemoryKind::Vram { format!("VRAM, GPU {}", a.device) } else { "DRAM".into() },
        if a.keep_serving { "serving runs until stopped" } else { "one run, then exit" }
    ));
    // The address to give `--peer`: what serve listens on, or for an unspecified address
    // (0.0.0.0, ::) any address of this host the decode node reaches.
    let dial = match listener.local_addr() {
        Ok(a) if a.ip().is_unspecified() => format!("<an address of this host>:{}", a.port()),
        _ => bound.clone(),
    };
    if made {
        out(&format!("kvprobe serve: token {token} (run: KVPROBE_TOKEN={token} kvprobe run --peer {dial} ...)\n"));
    }
    let report_path = a.report.clone();
    let mut say = |l: &str| out(&format!("{l}\n"));
    let mut ended = |end: &kvprobe::serve::SessionEnd| -> Exit {
        let r = &end.report;
        match kvprobe::ab::matrix_of(r) {
            // `ab --peer`: the matrix's table and outcome, as decode printed them.
            Some(ab) => out(&kvprobe::ab::render(&ab)),
            None if r.summary.iterations > 0 || r.scenario.is_some() => {
                out(&kvprobe::report::render_with(r, json_named(&report_path, &None).as_deref()))
            }
            None => {}
        }
        report_error(&r.outcome);
        let lost = report_path.as_ref().and_then(|p| write_json(p, r).err());
        report_outcome(&report_path, lost, r, end.exit, "report:            ")
    };
    kvprobe::serve::serve(&cfg, listener, &mut say, &mut ended)
}
