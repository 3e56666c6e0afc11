//! The human summary of a report, as `kvprobe run` prints it and `kvprobe report show`
//! prints it again: it reads what the run recorded and re-derives nothing.

use super::*;
use std::collections::BTreeMap;

/// Bytes in decimal units (B, kB, MB, GB; 1 GB = 1e9 B), three decimals.
fn human_bytes(b: u64) -> String {
    let x = b as f64;
    match b {
        0..1_000 => format!("{b} B"),
        1_000..1_000_000 => format!("{:.3} kB", x / 1e3),
        1_000_000..1_000_000_000 => format!("{:.3} MB", x / 1e6),
        _ => format!("{:.3} GB", x / 1e9),
    }
}

/// Bytes per second of wall time in GB/s (1e9 B/s); 0 for no time.
fn wall_gbps(bytes: u64, secs: f64) -> f64 {
    if secs > 0.0 { bytes as f64 / secs / 1e9 } else { 0.0 }
}

/// The human summary printed on stdout, for a run that wrote no JSON report
/// ([`render_with`]`(r, None)`).
pub fn render(r: &Report) -> String {
    render_with(r, None)
}

/// The human summary printed on stdout. `json` names where the run's JSON report is (e.g.
/// "kvprobe-report.json", "report.json in the bundle"): the summary shows at most 5 failures
/// and points there for the rest; `None` when there is none (it says `--report FILE` would
/// list them).
pub fn render_with(r: &Report, json: Option<&str>) -> String {
    let s = &r.summary;
    let mut out = String::new();
    if let Some(lib) = r.environment.as_ref().and_then(|e| e.nixl.library.as_ref()) {
        let backend = r.config.get("backend").and_then(|b| b.as_str()).unwrap_or("?");
        // How requests were made and the backend's parameters (reports before the flags
        // have neither).
        let mut how = String::new();
        if let Some(x) = r.config.get("xfer_req").and_then(|x| x.as_str()) {
            how += &format!(", {x} requests");
        }
        if let Some(p) = r.config.get("backend_params").and_then(|p| p.as_object()) {
            for (k, v) in p {
                how += &format!(", {k}={}", v.as_str().unwrap_or("?"));
            }
        }
        out += &format!("nixl:              {} (backend {backend}{how})\n", lib.display());
    }
    if let Some(m) = r.config.get("model").filter(|m| m.is_object()) {
        // `config.model` (--model-config): read as JSON, the report depends on nothing above it.
        let groups = m["layer_groups"].as_array().map(Vec::len).unwrap_or(0);
        out += &format!(
            "model:             {} ({}), tp {} ({} KV head(s) per rank), --kv-cache-dtype {}{}\n",
            m["path"].as_str().unwrap_or("?"),
            m["model_type"].as_str().unwrap_or("model_type not given"),
            m["tp"]["tp"],
            m["tp"]["kv_heads_per_rank"],
            m["kv_cache_dtype"].as_str().unwrap_or("?"),
            if groups > 1 { format!(", {groups} layer groups (every layer moved)") } else { String::new() }
        );
    }
    if let Ok(g) = serde_json::from_value::<crate::core::geometry::Geometry>(r.config["geometry"].clone()) {
        out += &format!(
            "pool:              {} per side, {} layers x {} x {} blocks, {}-byte block slices ({}){}\n",
            r.config["memory"].as_str().unwrap_or("?"),
            g.num_layers,
            if g.mla { "latent" } else { "K/V" },
            g.num_blocks,
            g.slice_bytes().unwrap_or(0),
            g.pool_bytes().map(|b| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)).unwrap_or_default(),
            if r.config["decode_process"] == true { "; prefill in a second process (--decode-process)" } else { "" }
        );
        if let Ok(d) = serde_json::from_value::<crate::core::geometry::Geometry>(r.config["decode_geometry"].clone()) {
            let lay = |g: &crate::core::geometry::Geometry| {
                if g.mla {
                    "MLA"
                } else if g.layout == crate::core::geometry::Layout::Hnd {
                    "HND"
                } else {
                    "NHD"
                }
            };
            out += &format!(
                "sides:             prefill {} blocks of {} tokens {}, decode {} blocks of {} tokens {}{}\n",
                g.num_blocks,
                g.block_size,
                lay(&g),
                d.num_blocks,
                d.block_size,
                lay(&d),
                {
                    // What decode's conversion on receive did, when it did anything (recorded
                    // by the run: `decode_converts`; vLLM's kv_postprocess_*_on_receive).
                    let converts = r.decode_converts == Some(true);
                    let chunks = (g.block_size < d.block_size)
                        .then(|| format!("chunks of {} tokens into blocks of {}", g.block_size, d.block_size));
                    match (converts, lay(&g) != lay(&d), chunks) {
                        (false, ..) => String::new(),
                        (true, true, c) => format!(
                            ", decode converts on receive (--permute-local-kv: {} into {}{})",
                            lay(&g),
                            lay(&d),
                            c.map(|c| format!(", {c}")).unwrap_or_default()
                        ),
                        (true, false, c) => {
                            format!(", decode converts on receive ({} {})", lay(&g), c.unwrap_or_else(|| "rows".into()))
                        }
                    }
                }
            );
        }
        if let Ok(t) = serde_json::from_value::<crate::core::pairing::tp::Tp>(r.config["tp"].clone()) {
            let side = |n: u32| {
                let per = t.heads_per_rank(n);
                let copies = if t.mla || n <= t.total_kv_heads {
                    String::new()
                } else {
                    format!(", each head on {} ranks", n / t.total_kv_heads)
                };
                if t.mla {
                    return format!("{n} rank{} (the MLA latent on each)", if n == 1 { "" } else { "s" });
                }
                format!(
                    "{n} rank{} ({per} KV head{} each{copies})",
                    if n == 1 { "" } else { "s" },
                    if per == 1 { "" } else { "s" }
                )
            };
            // Ranks on their own GPUs (`--prefill-device A,B`, `--decode-device A,B`).
            let gpus = |k: &str| {
                r.config[k].as_array().map(|v| {
                    let l: Vec<String> = v.iter().map(|x| x.to_string()).collect();
                    l.join(",")
                })
            };
            let placed = match (gpus("prefill_rank_devices"), gpus("decode_rank_devices")) {
                (None, None) => String::new(),
                (p, d) => format!(
                    "; GPUs by rank: prefill {}, decode {}",
                    p.unwrap_or_else(|| r.config["prefill_device"].to_string()),
                    d.unwrap_or_else(|| r.config["decode_device"].to_string())
                ),
            };
            let heads = if t.mla { "MLA".to_string() } else { format!("{} KV heads in all", t.total_kv_heads) };
            out += &format!(
                "tensor parallel:   prefill {}, decode {}; {heads}, one NIXL agent per rank{placed}\n",
                side(t.prefill),
                side(t.decode),
            );
        }
    }
    if let Some(p) = &r.peer {
        let mem = match p.memory {
            Some(crate::mem::pool::MemoryKind::Vram) => format!("VRAM on GPU {}", p.device),
            Some(crate::mem::pool::MemoryKind::Dram) => "DRAM".into(),
            None => "?".into(),
        };
        out += &format!(
            "pair:              {} on {} ({}, {mem}), run {}{}\n",
            p.role,
            if p.host.is_empty() { "?" } else { &p.host },
            p.address,
            p.run_id,
            if p.bye_missing { "; it sent no report at the end" } else { "" }
        );
        if let Some(t) = &p.transport_path {
            out += &format!("                   its UCX path: {}\n", crate::xfer::ucx::describe(t));
        }
    }
    match &r.scenario {
        None => out += &format!("iterations:        {}\n", s.iterations),
        Some(sc) => {
            let unf: Vec<&str> = sc
                .races
                .iter()
                .filter(|o| o.fencing == crate::core::mechanism::Fencing::Unfenced)
                .map(|o| o.mechanism.name())
                .collect();
            let tier = if sc.scenario.uses_tier() {
                format!(
                    "tier {}",
                    serde_json::to_value(sc.tier).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
                )
            } else {
                "no tier".to_string()
            };
            out += &format!(
                "scenario:          {}, {tier}, {}\n",
                sc.scenario.name(),
                if unf.is_empty() { "every race mechanism fenced".to_string() } else { format!("unfenced: {}", unf.join(", ")) }
            );
            out += &format!(
                "requests:          {} verified, {} aborted by the client; {} steps in {:.3} s\n",
                sc.requests_verified, sc.requests_aborted, sc.steps, sc.seconds
            );
            if sc.scenario.uses_tier() {
                out += &format!(
                    "tier:              {} prefix-hit blocks, {} saves, {} loads, {} evictions\n",
                    sc.tier_hit_blocks, sc.tier_saves, sc.tier_loads, sc.tier_evictions
                );
                if sc.tier_detail != "embedded" && !sc.tier_detail.is_empty() {
                    out += &format!("                   {}\n", sc.tier_detail);
                }
            }
            if let Some(n) = sc.transfers_failed.filter(|&n| n > 0) {
                let fenced = !sc.races.iter().any(|o| {
                    o.mechanism == crate::core::mechanism::Mechanism::FailedAsComplete
                        && o.fencing == crate::core::mechanism::Fencing::Unfenced
                });
                out += &format!(
                    "failed transfers:  {n} moved only some blocks (--fail-rate); {}\n",
                    if fenced {
                        "their failed blocks were read again"
                    } else {
                        "counted delivered (failed-as-complete unfenced)"
                    }
                );
            }
            if let Some(n) = sc.ownership_violations {
                let mut kinds: BTreeMap<&str, u64> = BTreeMap::new();
                for v in &sc.violations {
                    *kinds.entry(v.kind.as_str()).or_default() += 1;
                }
                let listed: Vec<String> = kinds.iter().map(|(k, c)| format!("{k} {c}")).collect();
                out += &format!(
                    "ownership:         {n} block-ownership violations{}\n",
                    if listed.is_empty() { String::new() } else { format!(" (listed: {})", listed.join(", ")) }
                );
            }
        }
    }
    out += &format!("block slices:      {} checked, {} corrupt\n", s.blocks_checked, s.blocks_corrupt);
    if s.blocks_corrupt > 0 {
        let parts: Vec<String> = s.by_class.iter().filter(|(_, n)| **n > 0).map(|(k, n)| format!("{k} {n}")).collect();
        out += &format!("corrupt by class:  {}\n", parts.join(", "));
    }
    if let Some(sc) = &r.scenario {
        for o in sc.races.iter().filter(|o| o.fencing == crate::core::mechanism::Fencing::Unfenced || o.corrupt_attributed > 0) {
            let classes: Vec<String> = o.classes.iter().map(|(k, n)| format!("{k} {n}")).collect();
            out += &format!(
                "race:              {}: {} ({} windows opened, {} corrupt slices attributed{}){}\n",
                o.mechanism,
                o.verdict,
                o.windows_opened,
                o.corrupt_attributed,
                if classes.is_empty() { String::new() } else { format!(": {}", classes.join(", ")) },
                o.why.as_ref().map(|w| format!(" - {w}")).unwrap_or_default()
            );
        }
        if sc.unexplained_corrupt > 0 {
            out += &format!(
                "UNEXPLAINED:       {} corrupt slices no kvprobe operation explains: a defect of the stack under test\n",
                sc.unexplained_corrupt
            );
        }
        if sc.intervals.len() > 1 && sc.intervals.iter().all(|i| i.corrupt == 0) {
            out += &format!("error rate:        {} intervals, 0 corrupt in each\n", sc.intervals.len());
        } else if sc.intervals.len() > 1 {
            let worst = sc.intervals.iter().max_by_key(|i| i.corrupt).expect("non-empty");
            out += &format!(
                "error rate:        {} intervals; worst {:.1}-{:.1} s with {} corrupt of {} slices\n",
                sc.intervals.len(),
                worst.start_s,
                worst.end_s,
                worst.corrupt,
                worst.slices_checked
            );
        }
        out += &format!(
            "transfer:          {} over NIXL: {:.3} GB/s while {} were in flight ({:.3} s), {:.3} GB/s over the wall time ({:.3} s)\n",
            human_bytes(s.bytes_transferred),
            s.transfer_gbps,
            if r.config["scenario"]["push"] == true { "prefill's WRITEs" } else { "READs" },
            s.transfer_seconds,
            wall_gbps(s.bytes_transferred, sc.seconds),
            sc.seconds
        );
    }
    if r.scenario.is_none() {
        out += &format!(
            "transfer:          {} in {:.3} s = {:.3} GB/s\n",
            human_bytes(s.bytes_transferred),
            s.transfer_seconds,
            s.transfer_gbps
        );
    }
    if let Some(p) = &s.transport_path {
        out += &format!("path:              {}\n", crate::xfer::ucx::describe(p));
        if let (Some(c), Some(r)) = (p.copy_gbps, p.ratio_to_copy) {
            let r = if r < 0.01 { format!("{r:.5}") } else { format!("{r:.3}") };
            out += &format!("                   transfer = {r} of a same-run copy of the pool ({c:.1} GB/s)\n");
        } else if r.scenario.is_none() && p.copy_gbps.is_none() && r.config["peer"].is_string() {
            out += "                   transfer not rated against a copy: the pools are on the two sides of a node pair (no copy between them to time)\n";
        } else if r.scenario.is_none()
            && p.copy_gbps.is_none()
            && r.config["decode_geometry"].is_object()
            && r.config["decode_geometry"]["num_kv_heads"] != r.config["geometry"]["num_kv_heads"]
        {
            out += "                   transfer not rated against a copy: a prefill rank's pool and a decode rank's differ in size (TP ranks hold different KV heads): no whole-pool copy to time\n";
        } else if r.scenario.is_none() && p.copy_gbps.is_none() {
            let pool = serde_json::from_value::<crate::core::geometry::Geometry>(r.config["geometry"].clone())
                .ok()
                .and_then(|g| g.pool_bytes().ok());
            out += &format!(
                "                   transfer not rated against a copy: a pool of {} is too small to time one (at least {} MiB per side)\n",
                pool.map(bytes_exact).unwrap_or_else(|| "this size".into()),
                crate::mem::pool::MIN_CEILING_BYTES >> 20
            );
        }
        if let Some(w) = &p.warning {
            out += &format!("warning:           {w}\n");
        }
        for f in &p.flags {
            out += &format!("path flag:         {f}\n");
        }
    }
    {
        out += &format!(
            "probe passes:      fill {:.3} s, poison {:.3} s, verify {:.3} s outside the transfers ({:.1} GB/s verified)\n",
            s.fill_seconds, s.poison_seconds, s.verify_seconds, s.verify_gbps
        );
        if r.scenario.is_none() && s.iterations > 0 {
            // The sweep fills and poisons for iteration 1 before it starts, and the last
            // iteration refills nothing: with one iteration both read 0.
            out += &format!(
                "set-up:            {:.3} s to the first transfer (NIXL, pools, agents, the copy ceiling if measured, and iteration 1's fill and poison, which the figures above leave out)\n",
                s.setup_seconds
            );
        }
        if s.pipeline_stages > 1 {
            out += &format!(
                "pipeline:          {} stages; {:.3} s of probe work hidden inside the transfers\n",
                s.pipeline_stages, s.overlapped_seconds
            );
        }
        // Sweeps check for stray and late writes whatever the stage count.
        if s.pipeline_stages > 0 {
            out += &format!(
                "stray writes:      {} found; {} block slices checked for their poison before their post, {} verified again before their re-poison or at the end ({:.3} s outside the transfers)\n",
                s.by_class.get(crate::core::verify::Class::Stray.name()).copied().unwrap_or(0),
                s.stray_poison_checked_slices,
                s.stray_reverified_slices,
                s.stray_check_seconds
            );
        }
        if let Some(b) = s.host_peak_bytes {
            out += &format!("host memory:       {:.1} MiB peak resident\n", b as f64 / (1u64 << 20) as f64);
        }
    }
    // A hybrid model's state and indexer regions, each on its own line; their names may come
    // from a report file (`report show`): escaped.
    let esc = |t: &str| crate::sys::text::escape_control(t).into_owned();
    for g in &r.regions {
        out += &format!(
            "region:            {} ({}, TP rank {}): {} layer(s) x {} {}s of {} bytes ({} descriptor(s) a page), {} bytes moved, {} page(s) compared, {} corrupt\n",
            esc(&g.name),
            esc(&g.kind),
            g.rank,
            g.layers,
            g.units,
            esc(&g.unit),
            g.page_bytes,
            g.descriptors_per_page,
            g.bytes_moved,
            g.pages_compared,
            g.pages_corrupt
        );
        if g.injections_planted > 0 {
            out += &format!(
                "  injections: {} planted, {} detected as predicted, {} unexpected failures\n",
                g.injections_planted, g.injections_detected, g.unexpected_failures
            );
        }
        for f in g.failures.iter().take(3) {
            out += &format!(
                "  {} layer {} {} {} {} (id {}{})\n",
                f.class.name(),
                f.layer,
                esc(&f.part),
                esc(&g.unit),
                f.unit,
                f.id,
                f.bit_flips.map(|b| format!(", {b} bit(s) flipped")).unwrap_or_default()
            );
        }
    }
    if s.injections_planted > 0 {
        out += &format!(
            "injections:        {} planted, {} detected as predicted, {} unexpected failures\n",
            s.injections_planted, s.injections_detected, s.unexpected_failures
        );
    }
    for f in r.failures.iter().take(5) {
        let at = match (f.request, f.tp_rank) {
            (Some(req), _) => format!("step {} request {req}", f.iteration),
            (None, Some(r)) => format!("iter {} decode TP rank {r}", f.iteration),
            (None, None) => format!("iter {}", f.iteration),
        };
        out += &format!(
            "  {at} layer {} {} block {}: {} (first bad byte {}, {} bad byte{}){}{}{}\n",
            f.layer,
            f.kv,
            f.block,
            f.class,
            f.first_bad_offset,
            f.bad_bytes,
            if f.bad_bytes == 1 { "" } else { "s" },
            // A layout slice: how its rows are displaced and the first wrong row.
            match (&f.displacement, f.rows.as_ref().and_then(|r| r.first())) {
                (d, Some(w)) => format!(
                    ", {}row {} holds token {} head {} (due token {} head {})",
                    d.as_ref().map(|d| format!("{d}; ")).unwrap_or_default(),
                    w.row,
                    w.token,
                    w.head,
                    w.due_token,
                    w.due_head
                ),
                (Some(d), None) => format!(", {d}"),
                (None, None) => String::new(),
            },
            // The identity its tags name, when it is another one than it should hold (a bit flip
            // still names its own).
            f.observed
                .filter(|o| *o != f.expected)
                .map(|o| format!(", holds layer {} {} logical block {} gen {}", o.layer, o.kv, o.block, o.generation))
                .unwrap_or_default(),
            match (f.request, f.attributed_to, f.injected) {
                (Some(_), Some(m), _) => format!(", attributed to {m}"),
                (Some(_), None, true) => ", injected (--inject), as predicted".to_string(),
                (Some(_), None, false) => ", UNEXPLAINED".to_string(),
                (None, _, true) => ", injected (--inject), as predicted".to_string(),
                (None, _, false) if s.injections_planted > 0 => ", not predicted by any --inject".to_string(),
                _ => String::new(),
            }
        );
    }
    let shown = r.failures.len().min(5) as u64;
    if s.blocks_corrupt > 0 && r.failures.is_empty() && r.peer.as_ref().is_some_and(|p| p.role == "decode") {
        // serve's report: decode verified, and its report lists the slices.
        out += &format!("  {} corrupt slices, listed in decode's report (run --peer --report)\n", s.blocks_corrupt);
    } else if s.blocks_corrupt > shown {
        let n = s.blocks_corrupt - shown;
        out += &format!(
            "  {} corrupt slice{}{}; {} {}{}\n",
            if shown == 0 { n.to_string() } else { format!("... {n} more") },
            if n == 1 { "" } else { "s" },
            if shown == 0 { " not listed" } else { "" },
            match json {
                Some(at) => format!("the JSON report ({at}) lists"),
                None => "--report FILE would list".to_string(),
            },
            r.failures.len(),
            if s.failures_omitted > 0 { format!(" ({} left out by --max-failures)", s.failures_omitted) } else { String::new() }
        );
    }
    if let (Some(m), 5) = (r.config.get("min_gbps").and_then(|v| v.as_f64()), r.outcome.exit_code) {
        out += &format!("min rate:          {m} GB/s required, {:.3} GB/s measured\n", s.transfer_gbps);
    }
    if r.config.get("self_test").and_then(|v| v.as_bool()) == Some(true) && r.outcome.status != "running" {
        out += &if r.outcome.status == super::SELF_TEST_PASSED {
            let races = r
                .scenario
                .as_ref()
                .map_or(0, |sc| sc.races.iter().filter(|o| o.fencing == crate::core::mechanism::Fencing::Unfenced).count());
            let plural = |n: u64| if n == 1 { "" } else { "s" };
            // The sweep's or scenario's planted faults and those of a hybrid model's regions.
            let in_regions: u64 = r.regions.iter().map(|g| g.injections_planted).sum();
            let planted = s.injections_planted + in_regions;
            format!(
                "self-test:         passed: {} planted fault{}{}{} detected as predicted, nothing else corrupt\n",
                planted,
                plural(planted),
                if in_regions > 0 { format!(" ({in_regions} in regions)") } else { String::new() },
                if races > 0 { format!(" and {races} unfenced race mechanism{}", plural(races as u64)) } else { String::new() }
            )
        } else {
            let why = r.outcome.error.as_ref().and_then(|e| e.message.split_once("self-test failed: ").map(|(_, w)| w));
            format!("self-test:         FAILED{}\n", why.map(|w| format!(": {w}")).unwrap_or_default())
        };
    }
    out += &format!("result:            {} (exit {})\n", r.outcome.status, r.outcome.exit_code);
    out
}
