//! Real NIXL (UCX backend) between two agents on DRAM pools: clean runs and every
//! injection classified exactly. Needs the NIXL libraries (scripts/install-deps.sh).

use crate::common::{assert_exact_injection, read_report};
use serde_json::Value;

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
    assert_eq!(r["summary"]["blocks_corrupt"], 0);
    for class in ["unwritten", "stale", "misplaced", "torn", "bitflip", "garbage"] {
        assert_eq!(r["summary"]["by_class"][class], 0, "{class}");
    }
    assert_eq!(r["summary"]["bytes_transferred"], 4 * (2u64 << 20));
    assert!(r["summary"]["transfer_gbps"].as_f64().unwrap() > 0.0);
    let nixl = &r["environment"]["nixl"];
    assert_eq!(nixl["stub"], false);
    assert!(nixl["library"].as_str().unwrap().ends_with("libnixl_capi.so"));
    assert!(nixl["plugins"].as_array().unwrap().iter().any(|p| p == "UCX"));
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
    assert_eq!(crate::common::failure_set(&r), crate::common::predicted_set(&r));
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
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(2500));
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
    let (code, r, log) = run_report("posix", &["--iterations", "1", "--backend", "POSIX"]);
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("NIXL backend POSIX cannot serve DRAM pools"), "{log}");
    assert_eq!(r["outcome"]["error"]["kind"], "environment");
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
    let (code, r, log) = crate::common::run_with_report("ucx-path", "dram", &["--iterations", "2"]);
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
