//! Real NIXL (UCX backend) between two agents on DRAM pools: clean runs and every
//! injection classified exactly. Needs the NIXL libraries (scripts/install-deps.sh).

use crate::common::{assert_exact_injection, read_report};
use serde_json::{Value, json};

fn run_report(name: &str, args: &[&str]) -> (i32, Value, String) {
    crate::common::run_with_report(name, "dram", args)
}

#[test]
fn clean_run_reports_zero_with_the_real_nixl_library() {
    let (code, r, log) = run_report("clean", &["--iterations", "4"]);
    assert_eq!(code, 0, "{log}");
    assert_eq!(r["schema"], "kvprobe.report/1");
    assert_eq!(r["summary"]["iterations"], 4);
    assert_eq!(r["summary"]["blocks_checked"], 4 * 4 * 2 * 64);
    // Counted by the CPU verify pass as it compared: every slice, every byte, every iteration.
    assert_eq!(r["summary"]["slices_compared"], 4 * 4 * 2 * 64);
    assert_eq!(r["summary"]["bytes_compared"], 4 * (2u64 << 20));
    assert_eq!(r["summary"]["blocks_corrupt"], 0);
    for class in ["unwritten", "stale", "misplaced", "layout", "torn", "bitflip", "garbage"] {
        assert_eq!(r["summary"]["by_class"][class], 0, "{class}");
    }
    // The pool: 4 layers × K/V × 64 blocks × 4096-byte slices = 2 MiB, moved once per iteration.
    let pool = 4 * 2 * 64 * 4096u64;
    assert_eq!(r["summary"]["bytes_transferred"], 4 * pool);
    // Rates recomputed from the raw per-iteration seconds and the geometry (not from the
    // report's own totals): GB/s = 1e9 B/s. One stage, nothing overlapped: verify_gbps is
    // the pool bytes verified over the verify passes' seconds.
    let s = &r["summary"];
    assert_eq!((s["pipeline_stages"].as_u64(), s["overlapped_seconds"].as_f64()), (Some(1), Some(0.0)));
    let per = s["per_iteration"].as_array().unwrap();
    assert_eq!(per.iter().map(|t| t["index"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2, 3, 4]);
    let sum = |k: &str| per.iter().map(|t| t[k].as_f64().unwrap()).sum::<f64>();
    let (transfer, verify) = (sum("transfer"), sum("verify"));
    assert!(transfer > 0.0 && verify > 0.0, "{s}");
    let near = |a: f64, b: f64| (a - b).abs() <= 1e-6 * a.abs().max(b.abs());
    assert!(near(s["transfer_seconds"].as_f64().unwrap(), transfer), "{s}");
    assert!(near(s["transfer_gbps"].as_f64().unwrap(), (4 * pool) as f64 / 1e9 / transfer), "{s}");
    assert!(near(s["verify_gbps"].as_f64().unwrap(), (4 * pool) as f64 / 1e9 / verify), "{s}");
    let nixl = &r["environment"]["nixl"];
    assert_eq!(nixl["stub"], false);
    assert!(nixl["library"].as_str().unwrap().ends_with("libnixl_capi.so"));
    assert!(nixl["plugins"].as_array().unwrap().iter().any(|p| p == "UCX"));
    // The wheel and version install-deps.sh pins (read from the script, not repeated here),
    // and the UCX library the agents loaded: "MAJOR.MINOR.PATCH".
    let script = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/install-deps.sh")).unwrap();
    let pin =
        |k: &str| script.lines().find_map(|l| l.strip_prefix(&format!("{k}=\""))).unwrap().trim_end_matches('"').to_string();
    assert_eq!(nixl["version"], format!("{} {}", pin("NIXL_WHEEL"), pin("NIXL_VERSION")));
    let ucx = nixl["ucx_version"].as_str().unwrap();
    assert!(ucx.split('.').count() == 3 && ucx.split('.').all(|p| p.parse::<u32>().is_ok()), "{ucx}");
    assert_eq!(r["outcome"]["status"], "clean");
    assert!(r["failures"].as_array().unwrap().is_empty());
}

#[test]
fn write_op_and_other_layouts_are_clean() {
    for args in [
        &["--op", "write", "--iterations", "2"][..],
        &["--layout", "hnd", "--iterations", "2"][..],
        &["--mla", "--head-size", "576", "--block-size", "4", "--layers", "3", "--blocks", "9", "--iterations", "2"][..],
        &[
            "--layers",
            "2",
            "--kv-heads",
            "5",
            "--head-size",
            "72",
            "--block-size",
            "3",
            "--blocks",
            "7",
            "--dtype",
            "fp16",
            "--iterations",
            "2",
        ][..],
        &["--layers", "1", "--blocks", "1", "--iterations", "2"][..],
    ] {
        let (code, r, log) = run_report("variants", args);
        assert_eq!(code, 0, "{args:?}: {log}");
        assert_eq!(r["summary"]["blocks_corrupt"], 0, "{args:?}");
    }
}

fn injection(kind: &str, class: &str) {
    let spec = format!("{kind}:3");
    let (code, r, log) = run_report(kind, &["--iterations", "3", "--inject", &spec, "--seed", "11"]);
    assert_eq!(code, 1, "{kind}: {log}");
    assert_eq!(r["outcome"]["status"], "corrupt");
    assert_eq!(r["summary"]["injections_planted"], 9);
    assert_exact_injection(&r, class);
    let per_injection = if kind == "misroute" { 2 } else { 1 };
    assert_eq!(r["summary"]["blocks_corrupt"], 9 * per_injection);
    // Every failure record is complete.
    for f in r["failures"].as_array().unwrap() {
        assert_eq!(f["expected_digest"].as_str().unwrap().len(), 64);
        assert_ne!(f["expected_digest"], f["actual_digest"]);
        assert!(f["bad_bytes"].as_u64().unwrap() > 0);
    }
}

#[test]
fn inject_bitflip_is_classified_bitflip() {
    injection("bitflip", "bitflip");
}

#[test]
fn inject_drop_is_classified_unwritten() {
    injection("drop", "unwritten");
}

#[test]
fn inject_misroute_is_misplaced_plus_unwritten() {
    injection("misroute", "misplaced");
    let (_, r, _) = run_report("misroute2", &["--iterations", "1", "--inject", "misroute"]);
    let by = &r["summary"]["by_class"];
    assert_eq!((by["misplaced"].as_u64(), by["unwritten"].as_u64()), (Some(1), Some(1)));
    let f = r["failures"].as_array().unwrap().iter().find(|f| f["class"] == "misplaced").unwrap();
    assert_ne!(f["observed"]["block"], f["expected"]["block"]);
}

#[test]
fn inject_stale_is_classified_stale() {
    injection("stale", "stale");
}

#[test]
fn inject_torn_is_classified_torn() {
    injection("torn", "torn");
    // Byte for byte: the planted prefix, then the slot's poison (computed here).
    let (_, r, log) = run_report("torn", &["--iterations", "3", "--inject", "torn:3", "--seed", "11"]);
    assert_eq!(crate::common::assert_torn_bytes_exact(&r, &log), 9);
}

#[test]
fn inject_torn_with_extra_damage_is_an_unexpected_failure() {
    // Test-only damage over each torn slice after its transfer (KVPROBE_TEST_DAMAGE_TORN):
    // garbage where the tear left poison, a flipped bit in the delivered prefix, another
    // block's rows as the prefix. Each slice is still classified torn — the class the tear
    // predicts, which is all a class-only match compares — but holds bytes the tear cannot
    // leave: an unexpected failure, and its injection is not detected as predicted.
    let cases: [(&str, &[&str]); 4] = [
        ("tail", &[]),
        ("prefix", &[]),
        ("foreign", &[]),
        // Unequal sides, HND chunks converted on receive: the prefix spreads over the slice.
        ("prefix", &["--layout", "hnd", "--block-size", "16", "--decode-block-size", "32"]),
    ];
    for (how, extra) in cases {
        let p = crate::common::tmpdir(&format!("torn-damage-{how}")).join("r.json");
        let mut a = vec!["run", "--memory", "dram", "--iterations", "2", "--inject", "torn", "--seed", "11"];
        a.extend_from_slice(extra);
        a.extend_from_slice(&["--report", p.to_str().unwrap()]);
        let (code, out, err) = crate::common::kvprobe_env(&a, &[("KVPROBE_TEST_DAMAGE_TORN", how)]);
        let ctx = format!("{how} {extra:?}: {out}{err}");
        assert_eq!(code, 1, "{ctx}");
        let r = crate::common::read_report(&p);
        let s = &r["summary"];
        assert_eq!(s["injections_planted"], 2, "{ctx}");
        // One torn slice per tear here (the decode block holds the group: 2 prefill blocks
        // of 16 tokens, or one of the same size).
        assert_eq!(s["by_class"]["torn"], 2, "{ctx}: still torn");
        assert_eq!(s["blocks_corrupt"], 2, "{ctx}");
        assert_eq!(s["unexpected_failures"], 2, "{ctx}");
        assert_eq!(s["injections_detected"], 0, "{ctx}");
        assert!(out.contains("2 planted, 0 detected as predicted, 2 unexpected failures"), "{ctx}");
        for inj in r["injections"].as_array().unwrap() {
            assert_eq!(inj["detected"], false, "{ctx}: {inj}");
            let f = r["failures"].as_array().unwrap().iter().find(|f| f["iteration"] == inj["iteration"]).unwrap();
            assert_ne!(f["actual_digest"], inj["predicted"][0]["digest"], "{ctx}");
        }
    }
}

#[test]
fn injections_combine_without_interference() {
    let (code, r, log) = run_report(
        "combined",
        &[
            "--iterations",
            "2",
            "--inject",
            "bitflip",
            "--inject",
            "drop:2",
            "--inject",
            "misroute",
            "--inject",
            "stale",
            "--inject",
            "torn",
            "--op",
            "write",
        ],
    );
    assert_eq!(code, 1, "{log}");
    // 2 iterations × (bitflip + drop:2 + misroute + stale + torn) = 12 faults.
    crate::common::assert_found_exactly(&r, 12, &log);
}

#[test]
fn max_failures_caps_the_list_but_not_the_counts() {
    let (code, r, _) = run_report("cap", &["--iterations", "2", "--inject", "drop:10", "--max-failures", "4"]);
    assert_eq!(code, 1);
    assert_eq!(r["failures"].as_array().unwrap().len(), 4);
    assert_eq!(r["summary"]["blocks_corrupt"], 20);
    assert_eq!(r["summary"]["failures_omitted"], 16);
}

#[test]
fn min_gbps_not_met_exits_5() {
    let (code, r, log) = run_report("slow", &["--iterations", "1", "--min-gbps", "1000000"]);
    assert_eq!(code, 5, "{log}");
    assert_eq!(r["outcome"]["status"], "below-min-gbps");
}

#[test]
fn unknown_backend_exits_2() {
    let (code, r, log) = run_report("backend", &["--iterations", "1", "--backend", "NOPE"]);
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("\"NOPE\" is not installed"), "{log}");
    assert_eq!(r["outcome"]["error"]["kind"], "environment");
}

#[test]
fn sigint_stops_cleanly_with_a_partial_report() {
    let d = crate::common::tmpdir("sigint");
    let p = d.join("r.json");
    let mut child = std::process::Command::new(crate::common::bin())
        .args(["run", "--memory", "dram", "--iterations", "1000000", "--report", p.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Under way (not a fixed sleep: set-up takes longer on a loaded machine).
    crate::common::wait_for_stderr_line(&mut child, "iteration 1/");
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130));
    let r = read_report(&p);
    assert_eq!(r["outcome"]["status"], "interrupted");
    assert!(r["summary"]["iterations"].as_u64().unwrap() >= 1);
    assert_eq!(r["summary"]["blocks_corrupt"], 0);
}

#[test]
fn a_backend_that_cannot_serve_the_pools_exits_2() {
    // In one process, and with prefill in a second one (--decode-process): the same refusal.
    for extra in [&[][..], &["--decode-process"][..]] {
        let (code, r, log) = run_report("posix", &[&["--iterations", "1", "--backend", "POSIX"], extra].concat());
        assert_eq!(code, 2, "{extra:?}: {log}");
        assert!(log.contains("NIXL backend POSIX cannot serve DRAM pools"), "{extra:?}: {log}");
        assert_eq!(r["outcome"]["error"]["kind"], "environment", "{extra:?}");
    }
}

#[test]
fn torn_is_classified_on_single_sector_slices() {
    let (code, r, log) = run_report(
        "torn-small",
        &[
            "--iterations",
            "3",
            "--inject",
            "torn:4",
            "--dtype",
            "fp8",
            "--head-size",
            "256",
            "--block-size",
            "1",
            "--kv-heads",
            "1",
            "--layers",
            "1",
            "--blocks",
            "8",
        ],
    );
    assert_eq!(code, 1, "{log}");
    assert_exact_injection(&r, "torn");
}

#[test]
fn the_report_names_the_ucx_path_and_rates_the_transfer_against_a_copy() {
    // 64 MiB per side: the smallest pool whose copy is timed as a ceiling.
    let (code, r, log) =
        crate::common::run_with_report("ucx-path", "dram", &["--iterations", "2", "--preset", "llama3-8b", "--blocks", "32"]);
    assert_eq!(code, 0, "{log}");
    let p = &r["summary"]["transport_path"];
    assert_eq!(p["backend"], "UCX");
    let sel = p["selections"].as_array().unwrap();
    assert!(!sel.is_empty(), "{p}");
    for s in sel {
        let op = s["operation"].as_str().unwrap();
        assert!(op.starts_with("remote memory read") && op.contains("host"), "{op}");
        assert!(!s["rows"].as_array().unwrap().is_empty());
    }
    let (c, ratio) = (p["copy_gbps"].as_f64().unwrap(), p["ratio_to_copy"].as_f64().unwrap());
    let gbps = r["summary"]["transfer_gbps"].as_f64().unwrap();
    assert!(c > 0.0 && (ratio - gbps / c).abs() <= 1e-9 * ratio.max(1.0), "{p}");
    assert!(log.contains("path:              UCX "), "{log}");
    // --decode-process: both pools are on this host (prefill's in the child), so the transfer
    // is still rated against a copy (from a scratch pool on prefill's side), READ and WRITE —
    // and WRITE's table, the child's, keeps kvprobe's ceiling.
    for op in ["read", "write"] {
        let args = ["--iterations", "2", "--preset", "llama3-8b", "--blocks", "32", "--decode-process", "--op", op];
        let (code, r, log) = crate::common::run_with_report("ucx-path-two", "dram", &args);
        assert_eq!(code, 0, "{op}: {log}");
        let p = &r["summary"]["transport_path"];
        assert!(!p["selections"].as_array().unwrap().is_empty(), "{op}: {p}");
        let (c, ratio) = (p["copy_gbps"].as_f64().unwrap(), p["ratio_to_copy"].as_f64().unwrap());
        let gbps = r["summary"]["transfer_gbps"].as_f64().unwrap();
        assert!(c > 0.0 && (ratio - gbps / c).abs() <= 1e-9 * ratio.max(1.0), "{op}: {p}");
        assert!(log.contains("of a same-run copy of the pool"), "{op}: {log}");
    }
    // Off on request: said so, nothing guessed.
    let (code, out, err) = crate::common::kvprobe_env(
        &["run", "--memory", "dram", "--report", &format!("{}/off.json", crate::common::tmpdir("ucx-off").display())],
        &[("KVPROBE_UCX_DIAG", "0")],
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("capture off"), "{out}");
}

#[test]
fn per_iteration_times_stop_at_a_thousand_but_totals_cover_every_iteration() {
    let (code, r, log) =
        crate::common::run_with_report("per-iter", "dram", &["--blocks", "2", "--layers", "1", "--iterations", "1003"]);
    assert_eq!(code, 0, "{log}");
    let s = &r["summary"];
    assert_eq!(s["iterations"], 1003);
    let per = s["per_iteration"].as_array().unwrap();
    assert_eq!(per.len(), 1000);
    let listed: f64 = per.iter().map(|t| t["iteration"].as_f64().unwrap()).sum();
    assert!(s["iteration_seconds"].as_f64().unwrap() > listed, "the totals include the unlisted iterations");
}

#[test]
fn pipelined_and_merged_sweeps_classify_every_injection_exactly() {
    // Forced pipeline stages on DRAM (the default there is 1), runs of blocks merged into
    // descriptors, NHD and HND, READ and WRITE: every planted fault shows where and as
    // predicted, and nothing else fails.
    for extra in [
        vec!["--pipeline-stages", "4"],
        vec!["--pipeline-stages", "3", "--layers", "7", "--op", "write"],
        vec!["--descriptor-blocks", "16"],
        vec!["--descriptor-blocks", "64", "--pipeline-stages", "2", "--layout", "hnd"],
        vec!["--descriptor-blocks", "8", "--mla"],
    ] {
        let mut args = vec!["--iterations", "3"];
        args.extend(crate::common::EVERY_INJECTION);
        args.extend(extra.iter());
        let (code, r, log) = run_report("pipelined", &args);
        assert_eq!(code, 1, "{extra:?}: {log}");
        let s = &r["summary"];
        assert_eq!(s["injections_planted"], 15, "{extra:?}");
        crate::common::assert_found_exactly(&r, 15, &format!("{extra:?}: {log}"));
        let want_stages = extra.iter().position(|a| *a == "--pipeline-stages").map_or(1, |i| extra[i + 1].parse().unwrap());
        assert_eq!(s["pipeline_stages"], want_stages, "{extra:?}");
        assert!(s["host_peak_bytes"].as_u64().unwrap() > 0);
        // Every iteration moves every slice but the dropped and misrouted-away ones, and
        // the torn one only in part.
        let per_it = r["config"]["geometry"]["num_layers"].as_u64().unwrap()
            * if extra.contains(&"--mla") { 1 } else { 2 }
            * r["config"]["geometry"]["num_blocks"].as_u64().unwrap();
        assert_eq!(s["blocks_checked"], 3 * per_it, "{extra:?}");
        // Faults or not, every slice is compared whole (slice bytes from the geometry's
        // fields: block_size * heads * head_size * element width).
        let geo = &r["config"]["geometry"];
        let width = match geo["dtype"].as_str().unwrap() {
            "fp8" => 1,
            "bf16" | "fp16" => 2,
            d => panic!("unexpected dtype {d}"),
        };
        let sb = ["block_size", "num_kv_heads", "head_size"].iter().map(|k| geo[k].as_u64().unwrap()).product::<u64>() * width;
        assert_eq!(s["slices_compared"], 3 * per_it, "{extra:?}");
        assert_eq!(s["bytes_compared"], 3 * per_it * sb, "{extra:?}");
    }
}

#[test]
fn clean_pipelined_and_merged_sweeps_stay_clean() {
    for extra in [["--pipeline-stages", "4"], ["--descriptor-blocks", "64"], ["--descriptor-blocks", "2"]] {
        let mut args = vec!["--iterations", "4"];
        args.extend(extra.iter());
        let (code, r, log) = run_report("pipelined-clean", &args);
        assert_eq!(code, 0, "{extra:?}: {log}");
        assert_eq!(r["summary"]["blocks_corrupt"], 0);
        assert_eq!(r["summary"]["per_iteration"].as_array().unwrap().len(), 4);
    }
}

#[test]
fn sweep_shape_flags_are_checked() {
    for (args, needle) in [
        (vec!["--descriptor-blocks", "7"], "--descriptor-blocks must be at least 1 and divide --blocks (64); got 7"),
        (vec!["--descriptor-blocks", "0"], "--descriptor-blocks must be at least 1"),
        (vec!["--pipeline-stages", "0"], "--pipeline-stages must be between 1 and the number of layers (4); got 0"),
        (vec!["--pipeline-stages", "5"], "--pipeline-stages must be between 1 and the number of layers (4); got 5"),
        (vec!["--pipeline-stages", "2", "--scenario", "nixl-only"], "--pipeline-stages applies to the whole-pool sweep"),
        (vec!["--descriptor-blocks", "2", "--scenario", "stacked"], "--descriptor-blocks applies to the whole-pool sweep"),
    ] {
        let mut a = vec!["run", "--memory", "dram"];
        a.extend(args.iter());
        let (code, out, err) = crate::common::kvprobe(&a);
        assert_eq!(code, 2, "{a:?}: {out}{err}");
        assert!(err.contains(needle), "{a:?}: expected {needle:?} in {err}");
    }
}

#[test]
fn env_probes_the_dram_path_in_a_child_run() {
    let (code, out, err) = crate::common::kvprobe(&["env", "--json"]);
    assert_eq!(code, 0, "{out}{err}");
    let e: Value = serde_json::from_str(&out).unwrap();
    let probes = e["transport_probes"].as_array().expect("transport_probes");
    let dram = probes.iter().find(|p| p["what"] == "READ DRAM -> DRAM").expect("a DRAM READ probe");
    assert_eq!(dram["exit_code"], 0, "{dram}");
    assert_eq!(dram["path"]["backend"], "UCX");
    let rows = dram["path"]["selections"][0]["rows"].as_array().expect("UCX protocol rows");
    assert!(!rows.is_empty(), "{dram}");
    assert!(dram["transfer_gbps"].as_f64().unwrap() > 0.0);
    let (code, out, _) = crate::common::kvprobe(&["env"]);
    assert_eq!(code, 0);
    assert!(out.contains("READ DRAM -> DRAM: UCX "), "{out}");
    let (code, out, _) = crate::common::kvprobe(&["env", "--json", "--no-probe"]);
    assert_eq!(code, 0);
    assert!(serde_json::from_str::<Value>(&out).unwrap().get("transport_probes").is_none());
}

#[test]
fn env_exits_with_a_failed_probe_transfers_code() {
    // A probe transfer that fails is a failure of `kvprobe env` (its CI examples start with
    // it): an internal error of the probe run (test hook: the verify pass skips a slice) is
    // exit 3, corruption it found (test hook: a write after the verdict) exit 1, each named.
    for (hook, value, code, says) in [
        ("KVPROBE_TEST_VERIFY_SKIP", "5", 3, "READ DRAM -> DRAM: failed (exit 3): internal error"),
        (
            "KVPROBE_TEST_LATE_WRITE",
            "repoison:1",
            1,
            "READ DRAM -> DRAM: failed (exit 1): corruption: 1 corrupt block slices (stray 1)",
        ),
    ] {
        let (got, out, err) = crate::common::kvprobe_env(&["env"], &[(hook, value)]);
        assert_eq!(got, code, "{hook}: {out}{err}");
        assert!(out.contains(says), "{hook}: wanted {says:?} in {out}");
    }
    // The rule itself: corruption wins, else the first failed probe's code.
    use kvprobe::Exit;
    use kvprobe::envinfo::{PathProbe, probes_exit};
    let p = |c: i32| PathProbe { what: String::new(), exit_code: c, path: None, transfer_gbps: None, error: None };
    assert_eq!(probes_exit(&[]), Exit::Clean);
    assert_eq!(probes_exit(&[p(0), p(0)]), Exit::Clean);
    assert_eq!(probes_exit(&[p(0), p(4), p(1)]), Exit::Corrupt);
    assert_eq!(probes_exit(&[p(0), p(4), p(3)]), Exit::Timeout);
    assert_eq!(probes_exit(&[p(2), p(3)]), Exit::Usage);
}

#[test]
fn two_processes_move_and_classify_like_one() {
    // --decode-process: prefill's NIXL agent and pool in a child `kvprobe serve`, driven over
    // the peer protocol: READ (kvprobe, decode, posts) and WRITE (the child posts; kvprobe
    // receives the notifications), pipelined.
    for op in ["read", "write"] {
        let mut args = vec!["--decode-process", "--iterations", "3", "--op", op, "--pipeline-stages", "2"];
        args.extend(crate::common::EVERY_INJECTION);
        let (code, r, log) = run_report("decode-process", &args);
        assert_eq!(code, 1, "{op}: {log}");
        crate::common::assert_found_exactly(&r, 15, &format!("{op}: {log}"));
        assert_eq!(r["config"]["decode_process"], true);
        // The child's part of the report: prefill, in a child process, which said goodbye.
        let peer = &r["peer"];
        assert_eq!(peer["role"], "prefill", "{op}: {peer}");
        assert!(peer["address"].as_str().unwrap().starts_with("child process "), "{op}: {peer}");
        assert_eq!(peer["exit_code"], 1, "{op}: the child took the run's outcome: {peer}");
        assert!(peer.get("bye_missing").is_none(), "{op}: {peer}");
        // The protocol table comes from whichever process initiated: kvprobe for READ, the
        // child for WRITE (sent with its goodbye).
        let p = &r["summary"]["transport_path"];
        let want = if op == "read" { "remote memory read" } else { "remote memory write" };
        let sel = p["selections"].as_array().cloned().unwrap_or_default();
        assert!(sel.iter().any(|s| s["operation"].as_str().unwrap_or("").starts_with(want)), "{op}: {p}");
        assert!(sel.iter().all(|s| !s["rows"].as_array().unwrap().is_empty()), "{op}: {p}");
        let (code, r, log) = run_report("decode-process-clean", &["--decode-process", "--iterations", "2", "--op", op]);
        assert_eq!(code, 0, "{op}: {log}");
        assert_eq!(r["summary"]["blocks_corrupt"], 0);
    }
    let (code, out, err) = crate::common::kvprobe(&["run", "--memory", "dram", "--decode-process", "--scenario", "nixl-only"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("--decode-process applies to the whole-pool sweep"), "{err}");
}

/// Starts a long `--decode-process` run, waits until it iterates, and sends its second
/// process (the child `kvprobe serve --fd N` holding prefill's agent and pool) `signal` (e.g.
/// "-KILL", "-STOP"). Returns (kvprobe child, report path, its child's pid, the run's TMPDIR).
fn run_and_signal_the_agent(
    name: &str,
    timeout: &str,
    signal: &str,
) -> (std::process::Child, std::path::PathBuf, String, std::path::PathBuf) {
    let d = crate::common::tmpdir(name);
    let report = d.join("r.json");
    let tmp = d.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let mut child = std::process::Command::new(crate::common::bin())
        .env("TMPDIR", &tmp)
        .args(["run", "--memory", "dram", "--decode-process", "--preset", "llama3-8b", "--blocks", "32"])
        .args(["--iterations", "100000", "--timeout", timeout, "--report"])
        .arg(&report)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let me = child.id().to_string();
    crate::common::wait_for_stderr_line(&mut child, "iteration 2/");
    let out = std::process::Command::new("pgrep").args(["-P", &me, "-f", "serve --fd"]).output().unwrap();
    let agent = String::from_utf8_lossy(&out.stdout).split_whitespace().next().expect("the prefill process").to_string();
    assert!(std::process::Command::new("kill").args([signal, &agent]).status().unwrap().success());
    (child, report, agent, tmp)
}

#[test]
fn a_prefill_process_that_dies_is_a_transport_error() {
    // Killed mid-run: exit 3 naming it, a report, and no child left behind.
    let (mut child, report, agent, tmp) = run_and_signal_the_agent("agent-dies", "60", "-KILL");
    let me = child.id().to_string();
    assert_eq!(child.wait().unwrap().code(), Some(3));
    let r: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(r["outcome"]["exit_code"], 3);
    assert!(r["outcome"]["error"]["message"].as_str().unwrap().contains("the prefill process"), "{}", r["outcome"]);
    assert_eq!(r["peer"]["bye_missing"], true, "{}", r["peer"]);
    let left = std::process::Command::new("pgrep").args(["-P", &me]).output().unwrap();
    assert!(left.stdout.is_empty(), "children left: {}", String::from_utf8_lossy(&left.stdout));
    // The killed child's private directories went with kvprobe's exit, not at a later start.
    let shm: Vec<_> = std::fs::read_dir("/dev/shm")
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    assert!(!shm.iter().any(|n| n.starts_with(&format!("kvprobe-{agent}."))), "left in /dev/shm: {shm:?}");
    let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "left in TMPDIR: {left:?}");
}

#[test]
fn a_frozen_prefill_process_times_out_and_ctrl_c_is_not_held_up_by_it() {
    // A stopped child neither reads its requests nor answers nor sends heartbeats: --timeout
    // ends the run (exit 4, report written).
    // The bounds below only tell "ended by the limit or the signal" from "waited out a far
    // longer one": generous, so a loaded machine cannot fail them.
    let (mut child, report, _, _) = run_and_signal_the_agent("frozen-timeout", "2", "-STOP");
    let t0 = std::time::Instant::now();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(4), "exit after {:?}", t0.elapsed());
    assert!(t0.elapsed() < std::time::Duration::from_secs(300), "{:?}", t0.elapsed());
    let r: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(r["outcome"]["status"], "timeout");
    // Ctrl-C while the transfer is stuck: 130 within seconds, not after --timeout (3600 s).
    let (mut child, report, _, _) = run_and_signal_the_agent("frozen-sigint", "3600", "-STOP");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let t0 = std::time::Instant::now();
    assert!(std::process::Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap().success());
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130));
    assert!(t0.elapsed() < std::time::Duration::from_secs(600), "{:?}", t0.elapsed());
    let r: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(r["outcome"]["status"], "interrupted");
}

#[test]
fn a_pool_too_small_to_time_a_copy_is_not_rated_against_one() {
    // 2 MiB per side (preset small): a copy that short times its fixed costs, not a ceiling.
    let (code, r, log) = crate::common::run_with_report("small-ceiling", "dram", &["--iterations", "1"]);
    assert_eq!(code, 0, "{log}");
    let p = &r["summary"]["transport_path"];
    assert!(p["copy_gbps"].is_null() && p["ratio_to_copy"].is_null(), "{p}");
    assert!(
        log.contains(&format!(
            "transfer not rated against a copy: a pool of 2.00 MiB (2097152 bytes) is too small to time one (at least {} MiB per side)",
            kvprobe::pool::MIN_CEILING_BYTES >> 20
        )),
        "{log}"
    );
    assert!(!log.contains("of a same-run copy"), "{log}");
}

#[test]
fn one_iteration_says_its_fill_and_poison_are_in_set_up() {
    let (code, r, log) = crate::common::run_with_report("one-iteration", "dram", &["--iterations", "1"]);
    assert_eq!(code, 0, "{log}");
    let s = &r["summary"];
    // The last iteration refills and re-poisons nothing; iteration 1's passes were set-up.
    assert_eq!(s["fill_seconds"], 0.0);
    let setup = s["setup_seconds"].as_f64().unwrap();
    assert!(setup > 0.0);
    let line = log.lines().find(|l| l.starts_with("set-up:")).unwrap_or_else(|| panic!("no set-up line: {log}"));
    assert!(line.starts_with(&format!("set-up:            {setup:.3} s to the first transfer")), "{line}");
    assert!(line.contains("iteration 1's fill and poison, which the figures above leave out"), "{line}");
    assert_eq!(s["per_iteration"][0]["index"], 1, "per_iteration[].index is the iteration; `iteration` holds seconds");
    assert!(s["per_iteration"][0]["iteration"].as_f64().unwrap() > 0.0);
}

#[test]
fn set_up_phases_are_named_on_stderr_before_the_first_iteration() {
    // Not a terminal: one plain line per phase on stderr, stdout untouched.
    let (code, out, err) =
        crate::common::kvprobe(&["run", "--memory", "dram", "--preset", "llama3-8b", "--blocks", "32", "--iterations", "2"]);
    assert_eq!(code, 0, "{out}{err}");
    let lines: Vec<&str> = err.lines().collect();
    let at = |p: &str| lines.iter().position(|l| l.starts_with(p)).unwrap_or_else(|| panic!("no {p:?} line: {err}"));
    let phases = [
        at("setup: loading NIXL"),
        at("setup: allocating pools (64.00 MiB DRAM per side)"),
        // On prefill's pool before it goes to the prefill thread (the protocol's in-process peer).
        at("setup: timing a copy of the prefill pool to the decode pool (the ceiling)"),
        at("setup: registering the pools with NIXL (backend UCX)"),
        at("setup: filling the prefill pool, poisoning the decode pool"),
        at("iteration 1/2"),
    ];
    assert!(phases.windows(2).all(|w| w[0] < w[1]), "phases out of order: {err}");
    assert_eq!(lines.iter().filter(|l| l.starts_with("setup:")).count(), 5, "one line per phase: {err}");
    assert!(!out.contains("setup:"), "{out}");
}

/// Issue 12.3, end to end: on the smallest slices the geometry accepts (one head row of 32
/// bytes: tag, check word and 3 body words; 48, 64, up to a unit and a 32-byte tail) every
/// injection class comes back exactly as predicted, in NHD, HND and MLA pools, over many
/// iterations (each a new plan and generation, so the poison's slot numbers meet the tags'
/// small generations and block ids) — and rows of 16 bytes, which could carry no check word,
/// are refused up front with the reason.
#[test]
fn every_injection_is_classified_exactly_on_the_smallest_slices() {
    // One layer of `blocks` blocks of one fp8 token of one head: slices of `head` bytes.
    fn tiny(head: u32, blocks: u32, extra: &[&str]) -> Vec<String> {
        let mut a: Vec<String> =
            ["--layers", "1", "--kv-heads", "1", "--block-size", "1", "--dtype", "fp8"].map(String::from).into();
        a.extend(["--head-size".into(), head.to_string(), "--blocks".into(), blocks.to_string()]);
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    }
    fn strs(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    // Issue 12.3's example (a stale slice whose old generation equalled the slot number was
    // read as torn), on the smallest slice now accepted: planted 4, detected 4.
    let args = tiny(32, 8, &["--iterations", "2", "--seed", "0", "--inject", "stale:2"]);
    let (code, r, log) = run_report("tiny-issue", &strs(&args));
    assert_eq!(code, 1, "{log}");
    crate::common::assert_found_exactly(&r, 4, &log);

    for head in [16u32, 264] {
        let mut refused = vec!["run".to_string(), "--memory".into(), "dram".into()];
        refused.extend(tiny(head, 16, &["--iterations", "1"]));
        let (code, out, err) = crate::common::kvprobe(&strs(&refused));
        assert_eq!(code, 2, "{out}{err}");
        assert!(err.contains(&format!("a head row is {head} bytes")) && err.contains("check word"), "{err}");
    }

    let layouts: [&[&str]; 3] = [&[], &["--layout", "hnd"], &["--mla"]];
    let iterations = 12u64;
    for (n, head) in [32u32, 48, 64, 112, 496, 512, 544, 1056].into_iter().enumerate() {
        for (k, seed) in [n as u64 + 1, u64::MAX - 15 - n as u64].into_iter().enumerate() {
            let layout = layouts[(n + k) % 3];
            let per_it = 11;
            let mut extra = vec!["--inject", "bitflip:2", "--inject", "drop:2", "--inject", "misroute:2", "--inject", "stale:3"];
            extra.extend(["--inject", "torn:2"]);
            let (its, sd) = (iterations.to_string(), seed.to_string());
            extra.extend(["--iterations", &its, "--seed", &sd]);
            extra.extend_from_slice(layout);
            let args = tiny(head, 16, &extra);
            let ctx = format!("{head}-byte slices, seed {seed}, {layout:?}");
            let (code, r, log) = run_report("tiny", &strs(&args));
            assert_eq!(code, 1, "{ctx}: {log}");
            assert_eq!(r["summary"]["injections_planted"], iterations * per_it, "{ctx}");
            crate::common::assert_found_exactly(&r, iterations * per_it, &format!("{ctx}: {log}"));
        }
    }
}

#[test]
fn write_mode_verifies_on_decode_notification_not_on_the_initiator_completion() {
    early_notification_is_caught("dram");
}

/// `run --memory MEMORY --op write` with the early-notification test fault in iteration 2:
/// exactly the slices of iteration 2 fail, all `unwritten`. Also run on VRAM (tests/gpu.rs).
pub fn early_notification_is_caught(memory: &str) {
    // Test-only fault: in iteration 2 prefill sends each stage's notification alone and
    // posts the WRITE only after decode has verified the stage. Decode verifies what it has
    // when the notification arrives, so every slice of iteration 2 still holds its poison
    // (unwritten) and the other iterations are clean. Verifying on the initiator's completion
    // instead would see the data (posted and complete by then) and report nothing.
    for (extra, slices) in [
        // layers × parts × blocks, computed here from the flags.
        (&["--layers", "3", "--blocks", "10"][..], 3 * 2 * 10u64),
        (&["--layers", "5", "--blocks", "7", "--pipeline-stages", "3", "--layout", "hnd"][..], 5 * 2 * 7),
        (
            &["--mla", "--head-size", "576", "--block-size", "4", "--layers", "4", "--blocks", "9", "--pipeline-stages", "4"][..],
            4 * 9,
        ),
    ] {
        let mut args = vec!["--op", "write", "--iterations", "3", "--max-failures", "1000"];
        args.extend(extra);
        let d = crate::common::tmpdir("early-notify");
        let p = d.join("report.json");
        let mut a = vec!["run", "--memory", memory, "--report", p.to_str().unwrap()];
        a.extend(&args);
        let (code, out, err) = crate::common::kvprobe_env(&a, &[("KVPROBE_TEST_EARLY_NOTIFY", "2")]);
        assert_eq!(code, 1, "{extra:?}: {out}{err}");
        assert!(err.contains("test fault: iteration 2's notifications are sent before their data"), "{err}");
        let r = read_report(&p);
        let s = &r["summary"];
        assert_eq!(s["iterations"], 3, "{extra:?}");
        assert_eq!(s["blocks_corrupt"], slices, "{extra:?}");
        assert_eq!(s["by_class"]["unwritten"], slices, "{extra:?}");
        assert_eq!(s["unexpected_failures"], slices, "{extra:?}");
        let f = r["failures"].as_array().unwrap();
        assert_eq!(f.len() as u64, slices, "{extra:?}");
        assert!(f.iter().all(|f| f["iteration"] == 2 && f["class"] == "unwritten" && f["poison_iteration"] == 2), "{extra:?}");
        // The late WRITE still moved every byte: the transfer count is the pool, 3 times.
        let pool = slices * r["config"]["geometry"]["slice_bytes"].as_u64().unwrap();
        assert_eq!(s["bytes_transferred"].as_u64().unwrap(), 3 * pool, "{extra:?}");
    }
}

#[test]
fn the_early_notification_fault_is_refused_where_it_cannot_apply() {
    for (op, value, needle) in
        [("read", "1", "needs --op write"), ("write", "0", "iteration number"), ("write", "x", "iteration number")]
    {
        let (code, out, err) =
            crate::common::kvprobe_env(&["run", "--memory", "dram", "--op", op], &[("KVPROBE_TEST_EARLY_NOTIFY", value)]);
        assert_eq!(code, 2, "{op} {value}: {out}{err}");
        assert!(err.contains("KVPROBE_TEST_EARLY_NOTIFY") && err.contains(needle), "{err}");
    }
}

/// docs/fingerprint.md's poison of (slot, iteration): little-endian u32 elements, `slot` at even
/// indices and 0x5A000000 | iteration at odd ones.
pub(crate) fn readme_poison(len: usize, slot: u32, iteration: u32) -> Vec<u8> {
    (0..len / 4).flat_map(|e| if e % 2 == 0 { slot } else { 0x5A00_0000 | iteration }.to_le_bytes()).collect()
}

fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

/// Issue 33 item 1 (audit W1): data that lands between the verify pass and the
/// classification (the test hook writes each failing slice's expected fingerprint into
/// stage 0 of iteration 2, right after its verify) is classified from the bytes the verify
/// judged — still the poison of (slot, 2) — and reported `late` with `judged_class`
/// `unwritten`, never `bitflip` with 0 bits (what a second read of the now intact slice gave).
/// The bundle's `report check` re-derives it. One stage (READ) and two stages (WRITE).
#[test]
fn data_landing_between_the_verify_and_the_classification_is_late_with_the_judged_class() {
    late_data_is_classified_from_the_judged_bytes("dram");
}

/// [`data_landing_between_the_verify_and_the_classification_is_late_with_the_judged_class`]
/// on `memory` (also run on VRAM by tests/gpu.rs: the verify kernel's capture).
pub fn late_data_is_classified_from_the_judged_bytes(memory: &str) {
    // (flags, layers of stage 0): docs/guide.md "--pipeline-stages", 4 layers.
    for (extra, stage0) in [(&[][..], 0..4u64), (&["--pipeline-stages", "2", "--op", "write"][..], 0..2)] {
        let d = crate::common::tmpdir("late-classify");
        let (p, b) = (d.join("report.json"), d.join("b.tgz"));
        let mut a = vec!["run", "--memory", memory, "--iterations", "3", "--inject", "drop:2", "--max-failures", "100"];
        a.extend(["--report", p.to_str().unwrap(), "--bundle", b.to_str().unwrap()]);
        a.extend(extra);
        let (code, out, err) = crate::common::kvprobe_env(&a, &[("KVPROBE_TEST_LATE_WRITE", "classify:2")]);
        let ctx = format!("{extra:?}: {out}{err}");
        assert_eq!(code, 1, "{ctx}");
        let r = read_report(&p);
        let sb = r["config"]["geometry"]["slice_bytes"].as_u64().unwrap() as usize;
        let f = r["failures"].as_array().unwrap();
        assert_eq!(f.len(), 6, "two drops per iteration: {ctx}");
        let mut late = 0;
        for x in f {
            assert_ne!(x["class"], "bitflip", "{x}");
            let (it, layer) = (x["iteration"].as_u64().unwrap(), x["layer"].as_u64().unwrap());
            if it == 2 && stage0.contains(&layer) {
                late += 1;
                assert_eq!((&x["class"], &x["judged_class"]), (&json!("late"), &json!("unwritten")), "{x}");
                // The judged bytes, not the intact ones read later: this iteration's poison.
                let poison = readme_poison(sb, x["slot"].as_u64().unwrap() as u32, 2);
                assert_eq!(x["actual_digest"], sha256_hex(&poison), "{x}");
            } else {
                assert_eq!(x["class"], "unwritten", "{x}");
                assert!(x.get("judged_class").is_none(), "{x}");
            }
        }
        if stage0 == (0..4) {
            assert_eq!(late, 2, "one stage: both drops of iteration 2 are late: {ctx}");
        }
        assert_eq!(r["summary"]["by_class"]["late"], late, "{ctx}");
        let (code, out, err) = crate::common::kvprobe(&["report", "check", b.to_str().unwrap()]);
        assert_eq!(code, 0, "{extra:?}: {out}{err}");
        assert!(out.contains("the bundle is consistent"), "{out}{err}");
    }
}

/// Issue 33 item 4 (audit M1): the slices and bytes the verify passes compared must be the
/// plan. The test hook makes the DRAM verify pass skip global slice 5: the run is an internal
/// error (exit 3) naming both counts — the plan computed here from the default geometry
/// (4 layers × K/V × 64 blocks of 4096-byte slices), not taken from the report.
#[test]
fn a_verify_that_skips_a_slice_is_an_internal_error_naming_both_counts() {
    let d = crate::common::tmpdir("verify-skip");
    let p = d.join("report.json");
    let (slices, sb) = (4 * 2 * 64u64, 4096u64);
    let a = ["run", "--memory", "dram", "--iterations", "2", "--report", p.to_str().unwrap()];
    let (code, out, err) = crate::common::kvprobe_env(&a, &[("KVPROBE_TEST_VERIFY_SKIP", "5")]);
    assert_eq!(code, 3, "{out}{err}");
    let want = format!(
        "compared {} block slices and {} bytes, but the plan is {slices} block slices and {} bytes",
        slices - 1,
        (slices - 1) * sb,
        slices * sb
    );
    assert!(err.contains(&want), "{want}\n{out}{err}");
    let r = read_report(&p);
    assert_eq!(r["outcome"]["exit_code"], 3);
    assert_eq!(r["outcome"]["error"]["kind"], "internal");
    assert_ne!(r["outcome"]["status"], "clean");
}
