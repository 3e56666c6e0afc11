//! `--dump DIR` (run and ab), `--bundle`/`kvprobe bundle` and `kvprobe report check`
//! (issue 14 items 1–3), on DRAM.

use crate::common::{kvprobe, read_report, tmpdir};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

pub fn sha256_hex(b: &[u8]) -> String {
    Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

/// Checks a dump directory against the report section that wrote it: every slice file's
/// SHA-256 is its `actual_digest` (index and, when listed, report), every listed report
/// failure is dumped (the cap was not reached), and the per-class counts are complete.
pub fn assert_dump_matches(dir: &Path, r: &Value, ctx: &str) -> usize {
    let index: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("index.json")).expect("index.json")).unwrap();
    assert_eq!(index["schema"], "kvprobe.dump/1", "{ctx}");
    assert_eq!(index["seed"], r["config"]["seed"], "{ctx}");
    let slices = index["slices"].as_array().unwrap();
    let failures = r["failures"].as_array().unwrap();
    for s in slices {
        let bytes = std::fs::read(dir.join(s["file"].as_str().unwrap())).unwrap();
        assert_eq!(bytes.len() as u64, r["config"]["geometry"]["slice_bytes"].as_u64().unwrap(), "{ctx}");
        assert_eq!(sha256_hex(&bytes), s["actual_digest"].as_str().unwrap(), "{ctx}: {}", s["file"]);
        // Not listed: beyond --max-failures (the dump's cap is not reached in these runs).
        let Some(i) = s["report_index"].as_u64() else { continue };
        let f = &failures[i as usize];
        for k in ["iteration", "layer", "kv", "block", "class", "actual_digest", "expected_digest", "bad_bytes"] {
            assert_eq!(s[k], f[k], "{ctx}: {k} of {}", s["file"]);
        }
    }
    let listed = slices.iter().filter(|s| s["report_index"].is_u64()).count();
    assert_eq!(listed, failures.len(), "{ctx}: every listed failure dumped");
    for (class, n) in r["summary"]["by_class"].as_object().unwrap() {
        let c = &index["by_class"][class];
        assert_eq!(c["written"].as_u64().unwrap() + c["omitted"].as_u64().unwrap(), n.as_u64().unwrap(), "{ctx}: {class}");
    }
    assert_eq!(r["dump"]["slices_written"].as_u64().unwrap() as usize, slices.len(), "{ctx}");
    slices.len()
}

/// The run command with `--dump`: (dir, exit code, report, stdout + stderr).
pub fn run_dump(name: &str, extra: &[&str]) -> (PathBuf, i32, Value, String) {
    let d = tmpdir(name);
    let (dump, r, j) = (d.join("D"), d.join("r.json"), d.join("j.xml"));
    let mut a = vec![
        "run",
        "--memory",
        "dram",
        "--inject",
        "torn:2",
        "--inject",
        "bitflip:2",
        "--inject",
        "misroute:1",
        "--dump",
        dump.to_str().unwrap(),
        "--junit",
        j.to_str().unwrap(),
        "--report",
        r.to_str().unwrap(),
    ];
    a.extend_from_slice(extra);
    let (code, out, err) = kvprobe(&a);
    assert!(!err.contains("panicked"), "{err}");
    (d, code, read_report(&r), format!("{out}{err}"))
}

#[test]
fn run_dump_holds_every_failing_slice_as_it_arrived() {
    let (d, code, r, log) = run_dump("dump-run", &[]);
    assert_eq!(code, 1, "{log}");
    assert!(d.join("j.xml").exists());
    let n = assert_dump_matches(&d.join("D"), &r, "run");
    // 5 iterations × (torn 2 + bitflip 2 + misroute: misplaced 1 + unwritten 1).
    assert_eq!(n, 30, "{log}");
    // The regenerate command writes the expected bytes (its digest is expected_digest).
    let index: Value = serde_json::from_str(&std::fs::read_to_string(d.join("D/index.json")).unwrap()).unwrap();
    let s = &index["slices"][0];
    let o = std::process::Command::new("sh")
        .arg("-c")
        .arg(s["regenerate"].as_str().unwrap())
        .current_dir(d.join("D"))
        .output()
        .expect("sh");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), s["expected_digest"].as_str().unwrap());
    let file = Path::new(s["file"].as_str().unwrap()).file_name().unwrap().to_owned();
    let exp = std::fs::read(d.join("D/expected").join(file)).unwrap();
    assert_eq!(sha256_hex(&exp), s["expected_digest"].as_str().unwrap());
}

#[test]
fn ab_dump_has_a_directory_per_row() {
    let d = tmpdir("dump-ab");
    let (dump, r, j) = (d.join("D"), d.join("ab.json"), d.join("j.xml"));
    let (code, out, err) = kvprobe(&[
        "ab",
        "--memory",
        "dram",
        "--requests",
        "200",
        "--lockstep",
        "--dump",
        dump.to_str().unwrap(),
        "--junit",
        j.to_str().unwrap(),
        "--report",
        r.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let ab = read_report(&r);
    let mut dumped = 0;
    for (row, sec) in ab["rows"].as_array().unwrap().iter().zip(ab["sections"].as_array().unwrap()) {
        let name = row["name"].as_str().unwrap();
        dumped += assert_dump_matches(&dump.join(name), sec, name);
    }
    assert!(dumped > 0, "the unfenced rows corrupt slices: {out}");
}

#[test]
fn the_cap_keeps_every_class_and_the_counts_stay_complete() {
    // 4 KiB slices; room for 10 of the 200 failures (100 bitflip, 100 torn per iteration × 2).
    let (d, code, r, log) = run_dump(
        "dump-cap",
        &["--inject", "bitflip:50", "--inject", "torn:50", "--iterations", "2", "--dump-max-bytes", "40KiB"],
    );
    assert_eq!(code, 1, "{log}");
    let index: Value = serde_json::from_str(&std::fs::read_to_string(d.join("D/index.json")).unwrap()).unwrap();
    let slices = index["slices"].as_array().unwrap();
    assert!(index["bytes_written"].as_u64().unwrap() <= 40 * 1024);
    assert_eq!(slices.len() as u64 * 4096, index["bytes_written"].as_u64().unwrap());
    let files = std::fs::read_dir(d.join("D/slices")).unwrap().count();
    assert_eq!(files, slices.len());
    for class in ["bitflip", "torn", "misplaced", "unwritten"] {
        assert!(slices.iter().any(|s| s["class"] == class), "{class} dumped: {index}");
        let c = &index["by_class"][class];
        assert_eq!(
            c["written"].as_u64().unwrap() + c["omitted"].as_u64().unwrap(),
            r["summary"]["by_class"][class].as_u64().unwrap(),
            "{class}"
        );
    }
    assert!(r["dump"]["slices_omitted"].as_u64().unwrap() > 0);
    // A failure beyond the cap is still in the report, not dumped.
    for s in slices {
        let f = &r["failures"][s["report_index"].as_u64().unwrap() as usize];
        assert_eq!(f["actual_digest"], s["actual_digest"]);
    }
}

#[test]
fn a_non_empty_dump_directory_is_refused_before_the_run() {
    let d = tmpdir("dump-nonempty");
    std::fs::create_dir_all(d.join("D")).unwrap();
    std::fs::write(d.join("D/keep.txt"), "mine").unwrap();
    let r = d.join("r.json");
    let (code, out, err) =
        kvprobe(&["run", "--memory", "dram", "--dump", d.join("D").to_str().unwrap(), "--report", r.to_str().unwrap()]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("is not empty"), "{err}");
    assert!(!err.contains("setup:") && !out.contains("iteration"), "refused before the run: {out}{err}");
    assert_eq!(std::fs::read_dir(d.join("D")).unwrap().count(), 1);
    assert_eq!(std::fs::read_to_string(d.join("D/keep.txt")).unwrap(), "mine");
}

/// [`assert_dump_matches`] for a dump that reached its cap: every file is its
/// `actual_digest` and matches its listed record; counts complete.
pub fn assert_dump_matches_capped(dir: &Path, r: &Value, ctx: &str) -> usize {
    let index: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("index.json")).expect("index.json")).unwrap();
    let slices = index["slices"].as_array().unwrap();
    for s in slices {
        let bytes = std::fs::read(dir.join(s["file"].as_str().unwrap())).unwrap();
        assert_eq!(sha256_hex(&bytes), s["actual_digest"].as_str().unwrap(), "{ctx}: {}", s["file"]);
        if let Some(i) = s["report_index"].as_u64() {
            assert_eq!(r["failures"][i as usize]["actual_digest"], s["actual_digest"], "{ctx}");
        }
    }
    for (class, n) in r["summary"]["by_class"].as_object().unwrap() {
        let c = &index["by_class"][class];
        assert_eq!(c["written"].as_u64().unwrap() + c["omitted"].as_u64().unwrap(), n.as_u64().unwrap(), "{ctx}: {class}");
    }
    slices.len()
}
