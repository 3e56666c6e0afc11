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
