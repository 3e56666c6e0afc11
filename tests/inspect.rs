//! `kvprobe report show|diff`: the summary read back from a report is the one the command
//! printed, word for word; diff puts what changed first; bad files are exit 2.

use crate::common::{kvprobe, tmpdir};

/// Runs `kvprobe ARGS --report <tmp>/NAME.json`; returns (exit code, stdout, report path).
fn with_report(dir: &std::path::Path, name: &str, args: &[&str]) -> (i32, String, std::path::PathBuf) {
    let p = dir.join(format!("{name}.json"));
    let mut a = args.to_vec();
    a.extend(["--report", p.to_str().unwrap()]);
    let (code, out, err) = kvprobe(&a);
    assert!(!err.contains("panicked"), "{err}");
    (code, out, p)
}

/// The run's own stdout without the line that says where the report went.
fn summary_of(out: &str) -> String {
    out.lines().filter(|l| !l.starts_with("report:")).map(|l| format!("{l}\n")).collect()
}

#[test]
fn show_prints_what_the_run_printed() {
    let d = tmpdir("show");
    for (name, args) in [
        ("sweep", &["run", "--memory", "dram", "--iterations", "2", "--inject", "torn:1", "--inject", "misroute:1"][..]),
        ("clean", &["run", "--memory", "dram", "--layout", "hnd", "--iterations", "1"][..]),
        ("scenario", &["run", "--memory", "dram", "--race", "save-after-free", "--lockstep", "--requests", "150"][..]),
        ("ab", &["ab", "--memory", "dram", "--requests", "60", "--lockstep"][..]),
    ] {
        let (_, out, p) = with_report(&d, name, args);
        let (code, shown, err) = kvprobe(&["report", "show", p.to_str().unwrap()]);
        assert_eq!(code, 0, "{name}: {err}");
        assert_eq!(shown, summary_of(&out), "{name}");
        assert!(shown.contains("result"), "{name}: {shown}");
    }
}

#[test]
fn show_and_diff_refuse_what_is_not_a_kvprobe_document() {
    let d = tmpdir("show-bad");
    let files = [
        ("missing.json", None, "cannot read it"),
        ("text.json", Some(&b"hello"[..]), "not a kvprobe JSON document"),
        ("noschema.json", Some(&b"{\"a\": 1}"[..]), "no \"schema\" field"),
        ("other.json", Some(&b"{\"schema\": \"kvprobe.report/9\"}"[..]), "\"kvprobe.report/9\" is not one this version reads"),
        ("bundle.tar.gz", Some(&[0x1f, 0x8b, 8, 0][..]), "gzip"),
        ("truncated.json", Some(&b"{\"schema\": \"kvprobe.report/1\", \"config\": {}}"[..]), "does not fit its schema"),
        ("number.json", Some(&b"{\"schema\": 5}"[..]), "\"schema\" is 5, not a string"),
        // Made below: a sparse 300 MiB file, refused by its size without being read.
        ("huge.json", None, "larger than 256 MiB"),
    ];
    for (name, body, needle) in files {
        let p = d.join(name);
        if let Some(b) = body {
            std::fs::write(&p, b).unwrap();
        }
        if name == "huge.json" {
            std::fs::File::create(&p).unwrap().set_len(300 << 20).unwrap();
        }
        let (code, out, err) = kvprobe(&["report", "show", p.to_str().unwrap()]);
        assert_eq!(code, 2, "{name}: {out}{err}");
        assert!(err.contains(needle), "{name}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        if name != "truncated.json" {
            let (code, _, err) = kvprobe(&["report", "diff", p.to_str().unwrap(), p.to_str().unwrap()]);
            assert_eq!(code, 2, "{name}: {err}");
            assert!(err.contains(needle), "{name}: {err}");
        }
    }
}

#[test]
fn diff_lists_what_changed_first_and_exits_1() {
    let d = tmpdir("diff");
    let (c0, _, clean) = with_report(&d, "clean", &["run", "--memory", "dram", "--iterations", "2"]);
    let (c1, _, bad) =
        with_report(&d, "bad", &["run", "--memory", "dram", "--iterations", "2", "--inject", "torn:3", "--layers", "3"]);
    assert_eq!((c0, c1), (0, 1));
    let (code, out, err) = kvprobe(&["report", "diff", clean.to_str().unwrap(), bad.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}{err}");
    let (differ, same) = out.split_once("\nsame (").expect("two sections");
    let row = |section: &str, field: &str| -> Vec<String> {
        section
            .lines()
            .find(|l| l.split_whitespace().next() == Some(field))
            .unwrap_or_else(|| panic!("{field} not in {section}"))
            .split_whitespace()
            .skip(1)
            .map(str::to_string)
            .collect()
    };
    assert_eq!(row(differ, "outcome.status"), ["clean", "corrupt"]);
    assert_eq!(row(differ, "config.geometry.num_layers"), ["4", "3"]);
    // 3 torn slices in each of 2 iterations.
    assert_eq!(row(differ, "summary.by_class.torn"), ["0", "6"]);
    assert_eq!(row(same, "config.geometry.head_size"), ["64"]);
    assert_eq!(row(same, "config.seed"), ["1"]);
    // kvprobe's private scratch names differ on every run and are not a difference.
    assert!(!differ.contains("UCX_POSIX_DIR") && same.contains("UCX_POSIX_DIR"), "{out}");
    // Two clean runs of the same command: rates differ on every run and are shown apart, not
    // compared, so nothing differs (exit 0); the inject list is one value.
    let (_, _, clean2) = with_report(&d, "clean2", &["run", "--memory", "dram", "--iterations", "2"]);
    let (code, out2, _) = kvprobe(&["report", "diff", clean.to_str().unwrap(), clean2.to_str().unwrap()]);
    assert_eq!(code, 0, "{out2}");
    assert!(out2.contains("differences (0):") && out2.contains("rates (shown, not compared"), "{out2}");
    assert!(row(differ, "config.inject")[0] == "[]", "{differ}");
    // A document against itself: nothing differs, exit 0.
    let (code, out, _) = kvprobe(&["report", "diff", bad.to_str().unwrap(), bad.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("differences (0):"), "{out}");
}

/// `kvprobe ARGS` with stdout going to `stdout`, killed if it runs past a generous bound
/// (a hang must fail the test, never hang it): (exit code, or -1 when it had to be killed;
/// stderr).
fn kvprobe_bounded(args: &[&str], stdout: std::process::Stdio) -> (i32, String) {
    use std::io::Read;
    let mut c = std::process::Command::new(crate::common::bin())
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(stdout)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Generous: the bound only turns a hang into a failure, the exit code is what is asserted.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let code = loop {
        if let Some(s) = c.try_wait().unwrap() {
            break s.code().unwrap_or(-1);
        }
        if std::time::Instant::now() > until {
            let _ = c.kill();
            let _ = c.wait();
            break -1;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut err = String::new();
    c.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (code, err)
}

#[test]
fn show_and_diff_print_a_foreign_reports_strings_escaped() {
    let d = tmpdir("show-escape");
    let (code, _, p) = with_report(&d, "r", &["run", "--memory", "dram", "--iterations", "1"]);
    assert_eq!(code, 0);
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    // Clear the screen, set the window title, overwrite the line, forge a line, reorder text.
    let evil = "h\u{1b}]0;PWNED\u{7}\u{1b}[2J\rX\nkvprobe serve: run 00000000 from 10.9.9.9\u{202e}";
    v["environment"]["hostname"] = evil.into();
    v["config"]["backend"] = format!("UCX{evil}").into();
    v["outcome"]["error"] = serde_json::json!({"kind": "io", "message": format!("disk {evil}")});
    let foreign = d.join("foreign.json");
    std::fs::write(&foreign, serde_json::to_vec(&v).unwrap()).unwrap();
    for args in [
        vec!["report", "show", foreign.to_str().unwrap()],
        vec!["report", "diff", p.to_str().unwrap(), foreign.to_str().unwrap()],
    ] {
        let (code, out, err) = kvprobe(&args);
        assert!(code == 0 || code == 1, "{args:?}: {out}{err}");
        for bad in ['\u{1b}', '\r', '\u{7}', '\u{202e}'] {
            assert!(!out.contains(bad), "{args:?}: {bad:?} reached stdout: {out:?}");
        }
        assert!(!out.lines().any(|l| l.starts_with("kvprobe serve:")), "{args:?}: a forged line: {out}");
        // Escaped, not dropped: the reader sees what the file holds.
        assert!(out.contains(r"\u{1b}]0;PWNED\u{7}\u{1b}[2J\rX\nkvprobe serve"), "{args:?}: {out}");
    }
}

#[test]
fn show_diff_and_check_of_a_fifo_with_no_writer_exit_2() {
    let d = tmpdir("show-fifo");
    let f = d.join("fifo.json");
    assert!(std::process::Command::new("mkfifo").arg(&f).status().unwrap().success());
    let (_, _, p) = with_report(&d, "r", &["run", "--memory", "dram", "--iterations", "1"]);
    let (f, p) = (f.to_str().unwrap(), p.to_str().unwrap());
    for args in
        [vec!["report", "show", f], vec!["report", "diff", f, p], vec!["report", "diff", p, f], vec!["report", "check", f]]
    {
        let (code, err) = kvprobe_bounded(&args, std::process::Stdio::null());
        assert_eq!(code, 2, "{args:?} (-1: it hung and was killed): {err}");
        assert!(err.contains(f), "{args:?}: {err}");
    }
}

#[test]
fn show_and_diff_to_a_full_stdout_exit_7() {
    let d = tmpdir("show-full");
    let (_, _, p) = with_report(&d, "r", &["run", "--memory", "dram", "--iterations", "1"]);
    let p = p.to_str().unwrap();
    for args in [vec!["report", "show", p], vec!["report", "diff", p, p]] {
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
        let (code, err) = kvprobe_bounded(&args, full.into());
        assert_eq!(code, 7, "{args:?}: {err}");
        assert!(err.contains("stdout"), "{args:?}: {err}");
    }
}

#[test]
fn diff_counts_repeated_rows_as_differences() {
    let d = tmpdir("diff-dup");
    let row = |n: &str| serde_json::json!({"name": n, "verdict": "detected", "pass": true, "corrupt": 3, "unexplained": 0, "classes": {"torn": 3}});
    let rows: Vec<serde_json::Value> = ["stacked+a", "stacked+b", "stacked+c"].iter().map(|n| row(n)).collect();
    let doc = |rows: Vec<serde_json::Value>| serde_json::json!({"schema": "kvprobe.ab/1", "outcome": {"status": "clean", "exit_code": 0}, "rows": rows});
    let (a, b) = (d.join("a.json"), d.join("b.json"));
    std::fs::write(&a, doc(rows.clone()).to_string()).unwrap();
    // The same rows, repeated 50 times.
    std::fs::write(&b, doc(rows.iter().cycle().take(rows.len() * 50).cloned().collect()).to_string()).unwrap();
    let (code, out, err) = kvprobe(&["report", "diff", a.to_str().unwrap(), b.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("differences (735):"), "49 repeats x 3 rows x 5 fields: {out}");
    assert!(out.lines().any(|l| l.trim_start().starts_with("rows.stacked+a.verdict#2") && l.contains("(absent)")), "{out}");
    // Against itself: the same.
    let (code, out, _) = kvprobe(&["report", "diff", b.to_str().unwrap(), b.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
}

#[test]
fn show_of_a_large_report_stays_within_a_bounded_memory() {
    let d = tmpdir("show-large");
    let (code, _, p) = with_report(&d, "r", &["run", "--memory", "dram", "--iterations", "1", "--inject", "torn:1"]);
    assert_eq!(code, 1);
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    // About 64 MB of failures (a --max-failures of 100000 and more gives such reports).
    let one = v["failures"][0].clone();
    let n = (64 << 20) / one.to_string().len();
    v["failures"] = serde_json::Value::Array(vec![one; n]);
    v["summary"]["blocks_corrupt"] = n.into();
    let big = d.join("big.json");
    std::fs::write(&big, serde_json::to_vec(&v).unwrap()).unwrap();
    drop(v);
    // 768 MiB of address space: the report held as a JSON tree (and a copy of it) does not fit.
    let (code, out, err) = crate::dump::kvprobe_limited(768, &["report", "show", big.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("result:            corrupt (exit 1)"), "{out}{err}");
}
