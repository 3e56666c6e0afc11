//! Where results go: stdout or stderr, reports and JUnit written atomically, outputs checked
//! before a run, progress lines.

use super::*;

/// Writes the human output to stdout (stderr when stdout carries the JSON), ignoring
/// failures: a closed pipe (`kvprobe run | head`) must not cost the report or the exit code.
pub(crate) fn out(text: &str) {
    if HUMAN_TO_STDERR.load(std::sync::atomic::Ordering::Relaxed) {
        let _ = std::io::stderr().write_all(text.as_bytes());
    } else {
        let _ = std::io::stdout().write_all(text.as_bytes());
    }
}

/// Where a run's JSON report will be, in the words of the summary's pointer to its full
/// list of failures ([`kvprobe::report::render_with`]): the `--report` file, the JSON on
/// stdout, or the bundle's report.json; `None` when the run writes none.
pub(crate) fn json_named(report: &Option<PathBuf>, bundle: &Option<PathBuf>) -> Option<String> {
    match (report, bundle) {
        (Some(p), _) if is_stdout(p) => Some("on stdout".into()),
        (Some(p), _) => Some(p.display().to_string()),
        (None, Some(b)) => Some(format!("report.json in {}", b.display())),
        (None, None) => None,
    }
}

/// The clap ids among `flags` that were typed on the command line (not defaults).
pub(crate) fn typed_flags(m: &clap::ArgMatches, flags: impl IntoIterator<Item = String>) -> Vec<String> {
    flags.into_iter().filter(|f| m.value_source(f) == Some(clap::parser::ValueSource::CommandLine)).collect()
}

/// True when a `--report`/`--json` path is `-`: the JSON goes to stdout.
pub(crate) fn is_stdout(p: &Path) -> bool {
    p.as_os_str() == "-"
}

/// Sends the human output to stderr when `path` is `-` (the JSON then owns stdout).
pub(crate) fn claim_stdout(path: &Option<PathBuf>) {
    if path.as_deref().is_some_and(is_stdout) {
        HUMAN_TO_STDERR.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Writes a `--report`/`--json` document: pretty JSON on stdout for `-` (once, at the end),
/// else atomically to the file. Errors: [`Error::Io`] (exit 2).
pub(crate) fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<(), Error> {
    if !is_stdout(path) {
        return kvprobe::report::write_atomic(path, value);
    }
    let mut body = serde_json::to_vec_pretty(value).map_err(|e| Error::Io(format!("report: serialise: {e}")))?;
    body.push(b'\n');
    let mut o = std::io::stdout().lock();
    o.write_all(&body).and_then(|_| o.flush()).map_err(|e| Error::Io(format!("report: writing the JSON to stdout: {e}")))
}

/// Checkpoints rewrite a file; stdout takes the JSON only once, at the end.
pub(crate) fn checkpoints_to(path: &Option<PathBuf>) -> Option<PathBuf> {
    path.clone().filter(|p| !is_stdout(p))
}

/// Writes a line to stderr, ignoring failures.
pub(crate) fn err(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The spinner showing the current set-up or bench phase on a terminal (see [`show_phases`]).
pub(crate) static PHASE_BAR: std::sync::Mutex<Option<indicatif::ProgressBar>> = std::sync::Mutex::new(None);

/// Shows each phase the library announces ([`kvprobe::progress`]): on a terminal as one spinner
/// line (cleared by [`end_phases`] before anything else is printed), otherwise as one plain
/// line on stderr per phase. `setup_lines`: whether plain lines include `setup:` phases
/// (bench leaves its sweeps' set-up steps to the spinner).
pub(crate) fn show_phases(setup_lines: bool) {
    if std::io::stderr().is_terminal() {
        kvprobe::progress::set_sink(|msg| {
            let mut g = PHASE_BAR.lock().unwrap_or_else(|e| e.into_inner());
            let bar = g.get_or_insert_with(|| {
                let b = indicatif::ProgressBar::new_spinner();
                if let Ok(st) = indicatif::ProgressStyle::with_template("{spinner} {msg} [{elapsed}]") {
                    b.set_style(st);
                }
                b.enable_steady_tick(Duration::from_millis(100));
                b
            });
            bar.set_message(msg.to_string());
        });
    } else {
        kvprobe::progress::set_sink(move |msg| {
            if setup_lines || !msg.starts_with("setup:") {
                err(msg);
            }
        });
    }
}

/// Clears the phase spinner (before other output on the terminal).
pub(crate) fn end_phases() {
    if let Some(b) = PHASE_BAR.lock().unwrap_or_else(|e| e.into_inner()).take() {
        b.finish_and_clear();
    }
}

/// Live progress on stderr: a spinner line on a terminal, else a plain line every 10 s and
/// one as soon as the label changes (`ab`: a new row, `row 3/18 NAME: `), so a plain log
/// shows which row is running however short the rows are.
pub(crate) struct Display {
    pub(crate) bar: Option<indicatif::ProgressBar>,
    pub(crate) last_line: Option<Instant>,
    /// The label of the last plain line.
    pub(crate) last_label: String,
}

impl Display {
    pub(crate) fn new() -> Display {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = indicatif::ProgressBar::new_spinner();
            if let Ok(st) = indicatif::ProgressStyle::with_template("{spinner} {msg}") {
                b.set_style(st);
            }
            b
        });
        Display { bar, last_line: None, last_label: String::new() }
    }

    pub(crate) fn update(&mut self, label: &str, p: &Progress) {
        end_phases();
        let rate = if p.elapsed > 0.0 { p.requests as f64 / p.elapsed } else { 0.0 };
        let gbps = if p.elapsed > 0.0 { p.bytes as f64 / p.elapsed / 1e9 } else { 0.0 };
        let done = match (p.target_secs, p.target_requests) {
            _ if p.draining => " (draining)".to_string(),
            (Some(d), _) => format!(" ({:.0}%)", (100.0 * p.elapsed / d).min(100.0)),
            (None, Some(n)) if n > 0 => format!(" of {n}"),
            _ => String::new(),
        };
        let msg = format!(
            "{label}[{:.1} s] {} requests verified{done}, {rate:.1} req/s, {gbps:.3} GB/s over NIXL (over the wall time), {} corrupt slices",
            p.elapsed, p.requests, p.corrupt
        );
        match &self.bar {
            Some(b) => {
                b.set_message(msg);
                b.tick();
            }
            None => {
                if self.last_line.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) || self.last_label != label {
                    self.last_line = Some(Instant::now());
                    label.clone_into(&mut self.last_label);
                    err(&msg);
                }
            }
        }
    }

    pub(crate) fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

pub(crate) fn install_signals() -> Result<(), Exit> {
    kvprobe::interrupt::install().map_err(|e| {
        err(&format!("kvprobe: cannot install signal handlers: {e}"));
        Exit::Usage
    })?;
    // The watchdog also ends the run on a second signal (with the report so far).
    kvprobe::deadline::start_watchdog();
    Ok(())
}

pub(crate) fn check_report_path(path: &Option<PathBuf>) -> Result<(), Exit> {
    let checked = match path {
        Some(p) if is_stdout(p) => stdout_takes_json("--report"),
        Some(p) => kvprobe::report::check_writable(p),
        None => Ok(()),
    };
    checked.map_err(|e| {
        err(&format!("kvprobe: {e}"));
        e.exit()
    })
}

/// Where a path leads, for comparing output paths: the file's device and inode when it exists
/// (so a symlink or another spelling of the same file compares equal), else its parent directory
/// resolved (symlinks, `..`) joined with its name.
#[derive(PartialEq, Eq)]
pub(crate) enum Place {
    File(u64, u64),
    Path(PathBuf),
}

pub(crate) fn place(p: &Path) -> Place {
    place_at(p, 0)
}

pub(crate) fn place_at(p: &Path, depth: u32) -> Place {
    use std::os::unix::fs::MetadataExt;
    if let Ok(m) = std::fs::metadata(p) {
        return Place::File(m.dev(), m.ino());
    }
    let parent = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    // A dangling symlink: where it points (the file it would create).
    if depth < 8
        && let Ok(t) = std::fs::read_link(p)
    {
        return place_at(&parent.join(t), depth + 1);
    }
    Place::Path(absolute(parent).join(p.file_name().unwrap_or_default()))
}

/// `p` resolved: its longest existing ancestor canonicalised (symlinks, `..`), the rest joined
/// lexically (`.` dropped, `..` taking off a part).
pub(crate) fn absolute(p: &Path) -> PathBuf {
    use std::path::Component;
    let p = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let parts: Vec<Component> = p.components().collect();
    let mut k = parts.len();
    let mut out = loop {
        let prefix: PathBuf = parts[..k].iter().collect();
        if let Ok(c) = std::fs::canonicalize(&prefix) {
            break c;
        }
        if k == 0 {
            break PathBuf::from("/");
        }
        k -= 1;
    };
    for c in &parts[k..] {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(x) => out.push(x),
            _ => {}
        }
    }
    out
}

/// Refuses (exit 2, before anything runs) output flags that lead to the same file — one output
/// would silently replace another (`--report r.json --junit r.json`, also through a symlink or
/// another spelling) — or an output file inside the `--dump` directory (the dump holds only
/// its own files, and a bundle would carry that file as dump content). `-` (stdout) is not a
/// file and is left out.
pub(crate) fn check_distinct_outputs(files: &[(&str, &Option<PathBuf>)], dump: Option<&Path>) -> Result<(), Exit> {
    let given: Vec<(&str, &Path)> =
        files.iter().filter_map(|(f, p)| p.as_deref().filter(|p| !is_stdout(p)).map(|p| (*f, p))).collect();
    let refuse = |why: String| {
        err(&format!("kvprobe: {why}"));
        Err(Exit::Usage)
    };
    for (i, (fa, a)) in given.iter().enumerate() {
        for (fb, b) in &given[i + 1..] {
            if place(a) == place(b) {
                return refuse(format!(
                    "{fa} {} and {fb} {} are the same file: one would replace the other (give each its own path)",
                    a.display(),
                    b.display()
                ));
            }
        }
        if let Some(d) = dump {
            let (dd, pa) = (absolute(d), absolute(a));
            if pa.starts_with(&dd) {
                return refuse(format!(
                    "{fa} {} is inside --dump {}: the dump directory holds only the dump (put {fa} elsewhere)",
                    a.display(),
                    d.display()
                ));
            }
        }
    }
    Ok(())
}

/// The output checks of `run` and `ab` before anything runs: distinct output files, none inside
/// `--dump` ([`check_distinct_outputs`]), a writable `--report` and `--junit`.
pub(crate) fn check_outputs(pool: &PoolArgs) -> Result<(), Exit> {
    check_distinct_outputs(
        &[("--report", &pool.report), ("--junit", &pool.junit), ("--bundle", &pool.bundle)],
        pool.dump.as_deref(),
    )
    .and_then(|_| check_report_path(&pool.report))
    .and_then(|_| check_junit_path(&pool.junit))
}

/// Checks a `--junit` path before the run: a file (not `-`) that can be written.
pub(crate) fn check_junit_path(path: &Option<PathBuf>) -> Result<(), Exit> {
    let checked = match path {
        Some(p) if is_stdout(p) => Err(Error::Usage("--junit needs a file path (`-` is not supported)".into())),
        Some(p) => kvprobe::report::check_writable_for(p, "--junit"),
        None => Ok(()),
    };
    checked.map_err(|e| {
        err(&format!("kvprobe: {e}"));
        e.exit()
    })
}

/// Which JUnit document a command's JSON gives ([`kvprobe::junit`]).
pub(crate) type JunitOf = fn(&serde_json::Value) -> quick_junit::Report;

/// Writes the JUnit XML of `doc` to `path` (`--junit`), when given, and says where it went.
/// Returns `exit`, or 7 in place of 0 when it could not be written (the error on stderr): a
/// missing file must not pass for a clean run.
pub(crate) fn write_junit<T: serde::Serialize>(path: &Option<PathBuf>, of: JunitOf, doc: &T, exit: Exit) -> Exit {
    let Some(p) = path else { return exit };
    let written =
        serde_json::to_value(doc).map_err(|e| Error::Io(format!("--junit: {e}"))).and_then(|v| kvprobe::junit::write(p, &of(&v)));
    match written {
        Ok(()) => {
            out(&format!(
                "junit:             {}
",
                p.display()
            ));
            exit
        }
        Err(e) => {
            err(&format!("kvprobe: --junit {} was not written: {e}", p.display()));
            if exit == Exit::Clean { Exit::ReportNotWritten } else { exit }
        }
    }
}

/// Refuses `FLAG -` when stdout is /dev/null, as `FLAG /dev/null` is refused: the JSON would
/// be lost. That includes a closed stdout (`>&-`), which the Rust runtime reopens on /dev/null
/// at start-up. Errors: usage (exit 2).
pub(crate) fn stdout_takes_json(flag: &str) -> Result<(), Error> {
    use std::os::unix::fs::MetadataExt;
    let same = |a: &std::fs::Metadata, b: &std::fs::Metadata| a.dev() == b.dev() && a.ino() == b.ino();
    match (std::fs::metadata("/proc/self/fd/1"), std::fs::metadata("/dev/null")) {
        (Ok(out), Ok(null)) if same(&out, &null) => Err(Error::Usage(format!(
            "{flag} - writes the JSON to stdout, but stdout is closed or /dev/null: it would be lost (give a file, or keep stdout open)"
        ))),
        _ if std::env::var("UCX_LOG_FILE").is_ok_and(|v| v == "stdout") => Err(Error::Usage(format!(
            "{flag} - writes the JSON to stdout, and UCX_LOG_FILE=stdout would mix UCX's log into it: unset it or give a file"
        ))),
        _ => Ok(()),
    }
}

/// A call blocked past its deadline: the watchdog ([`kvprobe::deadline`]) ends the run from
/// its own thread (the stuck call is never joined). `finish` builds what to write and show
/// (the document, its exit code, the text for the human output); this clears the status
/// lines, writes `path` as the normal end does ([`write_json`], [`report_lost`]), prints, and
/// exits with the code. Helper processes die with kvprobe.
pub(crate) fn on_stall<T, F>(
    bar: Option<indicatif::ProgressBar>,
    path: Option<PathBuf>,
    junit: (Option<PathBuf>, JunitOf),
    label: &'static str,
    finish: F,
) where
    T: serde::Serialize,
    F: Fn(&Error) -> (T, Exit, String) + Send + Sync + 'static,
{
    kvprobe::deadline::on_expiry(std::sync::Arc::new(move |e: &Error| {
        if let Some(b) = &bar {
            b.finish_and_clear();
        }
        // try_lock: the stuck thread may be the one announcing a phase.
        if let Ok(mut g) = PHASE_BAR.try_lock()
            && let Some(b) = g.take()
        {
            b.finish_and_clear();
        }
        let (doc, exit, text) = finish(e);
        let lost = path.as_ref().and_then(|p| write_json(p, &doc).err());
        out(&text);
        err(&format!("kvprobe: {e}"));
        let exit = match (&path, lost) {
            (Some(p), None) => {
                if !is_stdout(p) {
                    out(&format!("{label}{}\n", p.display()));
                }
                exit
            }
            (Some(p), Some(we)) => report_lost(&format!("--report {}", p.display()), &doc, &we, exit),
            (None, _) => exit,
        };
        let exit = write_junit(&junit.0, junit.1, &doc, exit);
        kvprobe::nixl::exit_now(exit as u8)
    }));
}
