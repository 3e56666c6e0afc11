//! `--junit PATH` on run, ab and bench: valid JUnit (read back with quick-junit's own parser)
//! whose cases match the JSON report written beside it, and an error case, not a missing file,
//! when the run fails.

use crate::common::{kvprobe, read_report, tmpdir};
use quick_junit::{NonSuccessKind, TestCaseStatus};
use serde_json::Value;

/// A JUnit case as (name, status kind: None for success, message).
pub type Case = (String, Option<NonSuccessKind>, String);

/// Reads a JUnit file with quick-junit's parser (so the XML is well-formed JUnit) and returns
/// its single suite's cases as (name, status kind, message).
pub fn cases(p: &std::path::Path) -> Vec<Case> {
    let xml = std::fs::read_to_string(p).expect("junit written");
    let r = quick_junit::Report::deserialize_from_str(&xml).unwrap_or_else(|e| panic!("not JUnit: {e}\n{xml}"));
    assert_eq!(r.test_suites.len(), 1, "{xml}");
    r.test_suites[0]
        .test_cases
        .iter()
        .map(|c| match &c.status {
            TestCaseStatus::Success { .. } => (c.name.to_string(), None, String::new()),
            TestCaseStatus::NonSuccess { kind, message, description, .. } => {
                let m = message.as_ref().map(|m| m.to_string()).unwrap_or_default();
                // The text too (GitLab shows the element's text, not the attribute).
                assert_eq!(description.as_ref().map(|d| d.to_string()).unwrap_or_default(), m, "{xml}");
                (c.name.to_string(), Some(*kind), m)
            }
            TestCaseStatus::Skipped { .. } => panic!("kvprobe writes no skipped case: {xml}"),
        })
        .collect()
}

fn run_with_junit(name: &str, cmd: &str, args: &[&str]) -> (i32, Value, Vec<Case>, String) {
    let d = tmpdir(name);
    let (r, j) = (d.join("r.json"), d.join("j.xml"));
    let mut a = vec![cmd, "--memory", "dram", "--report", r.to_str().unwrap(), "--junit", j.to_str().unwrap()];
    a.extend_from_slice(args);
    let (code, out, err) = kvprobe(&a);
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.contains(&format!("junit:             {}", j.display())), "{out}");
    (code, read_report(&r), cases(&j), format!("{out}{err}"))
}

#[test]
fn a_sweep_with_injections_gives_a_case_per_iteration_and_per_injection() {
    let (code, r, c, log) = run_with_junit(
        "junit-run",
        "run",
        &["--inject", "torn:2", "--inject", "bitflip:2", "--inject", "misroute:1", "--iterations", "3", "--seed", "7"],
    );
    assert_eq!(code, 1, "{log}");
    // 3 iterations + 5 injections × 3 iterations + the outcome.
    assert_eq!(c.len(), 3 + 15 + 1, "{c:?}");
    let failures = r["failures"].as_array().unwrap();
    for it in 1..=3u64 {
        let (_, kind, msg) = c.iter().find(|x| x.0 == format!("iteration {it}")).unwrap_or_else(|| panic!("{c:?}"));
        assert_eq!(*kind, Some(NonSuccessKind::Failure), "{msg}");
        // torn 2 + bitflip 2 + misroute (misplaced + unwritten) = 6 slices, by class.
        assert!(msg.starts_with("6 corrupt block slices ("), "{msg}");
        for part in ["bitflip 2", "torn 2", "misplaced 1", "unwritten 1"] {
            assert!(msg.contains(part), "{part} in {msg}");
        }
        // The first listed failure of that iteration, by its coordinates.
        let f = failures.iter().find(|f| f["iteration"] == it).unwrap();
        let at = format!(
            "first: layer {} {} block {} (slot {}): {}",
            f["layer"],
            f["kv"].as_str().unwrap(),
            f["block"],
            f["slot"],
            f["class"].as_str().unwrap()
        );
        assert!(msg.contains(&at), "{at} in {msg}");
    }
    let inj: Vec<_> = c.iter().filter(|x| x.0.starts_with("inject ")).collect();
    assert_eq!(inj.len(), 15);
    assert!(inj.iter().all(|x| x.1.is_none()), "every injection detected: {inj:?}");
    assert_eq!(inj.iter().filter(|x| x.0.starts_with("inject torn")).count(), 6);
    let (name, kind, _) = c.last().unwrap();
    assert_eq!((name.as_str(), *kind), ("outcome: corrupt (exit 1)", Some(NonSuccessKind::Failure)));
}

#[test]
fn a_clean_sweep_passes_every_case() {
    let (code, _, c, log) = run_with_junit("junit-clean", "run", &["--iterations", "2", "--layout", "hnd"]);
    assert_eq!(code, 0, "{log}");
    let names: Vec<&str> = c.iter().map(|x| x.0.as_str()).collect();
    assert_eq!(names, ["iteration 1", "iteration 2", "outcome: clean (exit 0)"]);
    assert!(c.iter().all(|x| x.1.is_none()), "{c:?}");
}

#[test]
fn a_failed_run_is_an_error_case_not_a_missing_file() {
    // A timeout (exit 4) and a geometry refused after parsing (exit 2): both leave the XML.
    for (args, code, status) in [(&["--timeout", "0.000001"][..], 4, "timeout"), (&["--layers", "70000"][..], 2, "error")] {
        let (got, r, c, log) = run_with_junit("junit-err", "run", args);
        assert_eq!(got, code, "{args:?}: {log}");
        let (name, kind, msg) = c.last().unwrap();
        assert_eq!(name, &format!("outcome: {status} (exit {code})"), "{c:?}");
        assert_eq!(*kind, Some(NonSuccessKind::Error), "{c:?}");
        assert_eq!(msg, r["outcome"]["error"]["message"].as_str().unwrap(), "{args:?}");
    }
}

#[test]
fn ab_gives_a_case_per_row() {
    let (code, r, c, log) = run_with_junit("junit-ab", "ab", &["--requests", "200", "--lockstep"]);
    let rows = r["rows"].as_array().unwrap();
    assert_eq!(c.len(), rows.len() + 1, "{log}");
    for (row, case) in rows.iter().zip(&c) {
        assert_eq!(case.0, row["name"].as_str().unwrap());
        assert_eq!(case.1.is_none(), row["pass"] == true, "{case:?} {row}");
    }
    assert_eq!(c.last().unwrap().0, format!("outcome: {} (exit {code})", r["outcome"]["status"].as_str().unwrap()));
}

#[test]
fn an_ab_row_that_fails_names_why() {
    // Without aborts unfenced-load's window never opens: that row fails, named with the reason.
    let (code, _, c, log) = run_with_junit("junit-ab6", "ab", &["--requests", "100", "--abort-rate", "0", "--lockstep"]);
    assert_eq!(code, 6, "{log}");
    let (_, kind, msg) = c.iter().find(|x| x.0 == "stacked+unfenced-load").unwrap();
    assert_eq!(*kind, Some(NonSuccessKind::Failure));
    assert!(msg.starts_with("not reproduced (expected detected)") && msg.contains("never opened"), "{msg}");
}

#[test]
fn a_scenario_gives_a_case_per_interval_and_race() {
    let (code, r, c, log) = run_with_junit(
        "junit-sc",
        "run",
        &["--race", "save-before-write", "--lockstep", "--requests", "300", "--interval", "1s"],
    );
    assert_eq!(code, 1, "{log}");
    let intervals = r["scenario"]["intervals"].as_array().unwrap();
    let iv: Vec<_> = c.iter().filter(|x| x.0.starts_with("interval ")).collect();
    assert_eq!(iv.len(), intervals.len(), "{c:?}");
    for (case, i) in iv.iter().zip(intervals) {
        assert_eq!(case.1.is_some(), i["corrupt"].as_u64().unwrap() > 0, "{case:?} {i}");
    }
    let races = r["scenario"]["races"].as_array().unwrap();
    for o in races {
        let name = format!("race {} ({})", o["mechanism"].as_str().unwrap(), o["fencing"].as_str().unwrap());
        let case = c.iter().find(|x| x.0 == name).unwrap_or_else(|| panic!("{name}: {c:?}"));
        // The unfenced mechanism detected, the fenced ones clean: every race case passes.
        assert!(case.1.is_none(), "{case:?}");
    }
}

#[test]
fn junit_paths_are_checked_before_the_run() {
    for (path, needle) in [("-", "--junit needs a file path"), ("/nonexistent-dir/j.xml", "--junit")] {
        let (code, out, err) = kvprobe(&["run", "--memory", "dram", "--junit", path]);
        assert_eq!(code, 2, "{out}{err}");
        assert!(err.contains(needle), "{err}");
        assert!(!out.contains("iteration"), "nothing ran: {out}");
    }
}

#[test]
fn a_run_refused_before_it_starts_still_leaves_its_junit_and_report() {
    // A dump directory that is not empty is refused before the run (exit 2): the report and
    // the JUnit error case say why, for run and for ab.
    for cmd in ["run", "ab"] {
        let d = tmpdir("junit-refused");
        let dump = d.join("dump");
        std::fs::create_dir_all(&dump).unwrap();
        std::fs::write(dump.join("old.bin"), b"x").unwrap();
        let (r, j) = (d.join("r.json"), d.join("j.xml"));
        let (code, out, err) = kvprobe(&[
            cmd,
            "--memory",
            "dram",
            "--dump",
            dump.to_str().unwrap(),
            "--report",
            r.to_str().unwrap(),
            "--junit",
            j.to_str().unwrap(),
        ]);
        assert_eq!(code, 2, "{cmd}: {out}{err}");
        let rep = read_report(&r);
        assert_eq!(rep["outcome"]["exit_code"], 2, "{cmd}");
        let why = rep["outcome"]["error"]["message"].as_str().unwrap().to_string();
        assert!(why.contains("--dump") && err.contains(&why), "{cmd}: {why} / {err}");
        let c = cases(&j);
        let (name, kind, msg) = c.last().unwrap();
        assert_eq!((name.as_str(), *kind), ("outcome: error (exit 2)", Some(NonSuccessKind::Error)), "{cmd}: {c:?}");
        assert_eq!(msg, &why);
    }
}

#[test]
fn outputs_that_lead_to_the_same_file_are_refused_before_the_run() {
    let d = tmpdir("same-file");
    let p = |n: &str| d.join(n).to_str().unwrap().to_string();
    std::fs::create_dir_all(d.join("sub")).unwrap();
    std::os::unix::fs::symlink(d.join("r3.json"), d.join("link.tgz")).unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["run".into(), "--report".into(), p("r1.json"), "--junit".into(), p("r1.json")], "are the same file"),
        (vec!["ab".into(), "--report".into(), p("r2.json"), "--bundle".into(), p("sub/../r2.json")], "are the same file"),
        // A dangling symlink to the report: writing the bundle would replace it.
        (vec!["run".into(), "--report".into(), p("r3.json"), "--bundle".into(), p("link.tgz")], "are the same file"),
        (vec!["run".into(), "--dump".into(), p("D"), "--report".into(), p("D/r.json")], "is inside --dump"),
        (vec!["run".into(), "--dump".into(), p("D"), "--junit".into(), p("D/x/j.xml")], "is inside --dump"),
        (vec!["bench".into(), "--json".into(), p("b.json"), "--junit".into(), p("b.json")], "are the same file"),
    ];
    for (args, needle) in cases {
        let mut a: Vec<&str> = args.iter().map(String::as_str).collect();
        a.extend(["--memory", "dram"]);
        let (code, out, err) = kvprobe(&a);
        assert_eq!(code, 2, "{a:?}: {out}{err}");
        assert!(err.contains(needle), "{a:?}: {err}");
        assert!(out.is_empty(), "nothing ran: {out}");
    }
    // Nothing was written: no report, no XML, no dump directory.
    for f in ["r1.json", "r2.json", "r3.json", "D", "b.json"] {
        assert!(!d.join(f).exists(), "{f} was written");
    }
}

/// `run --self-test` (CI's self-test, issue of the first hour, item 8): the same planted faults
/// that make a plain run exit 1 make a self-test exit 0 with status `self-test-passed`, every
/// failure record marked `injected`, and no failing JUnit case; the counts are the tests'
/// own table of classes per fault.
#[test]
fn a_self_test_passes_when_every_planted_fault_is_found_as_predicted() {
    let args = ["--inject", "torn:2", "--inject", "misroute", "--inject", "stale", "--iterations", "2", "--seed", "11"];
    let (plain, _, _, log) = run_with_junit("junit-selftest-plain", "run", &args);
    assert_eq!(plain, 1, "{log}");
    let mut st = args.to_vec();
    st.push("--self-test");
    let (code, r, c, log) = run_with_junit("junit-selftest", "run", &st);
    assert_eq!(code, 0, "{log}");
    assert_eq!(r["outcome"]["status"], "self-test-passed", "{log}");
    assert_eq!(r["config"]["self_test"], true);
    let want = crate::common::expected_by_class(&[("torn", 4), ("misroute", 2), ("stale", 2)]);
    let total: u64 = want.values().sum();
    assert_eq!(r["summary"]["blocks_corrupt"], total, "{log}");
    assert_eq!(r["summary"]["unexpected_failures"], 0);
    assert_eq!(r["summary"]["injections_planted"], 8);
    assert_eq!(r["summary"]["injections_detected"], 8);
    let failures = r["failures"].as_array().unwrap();
    assert_eq!(failures.len() as u64, total);
    assert!(failures.iter().all(|f| f["injected"] == true), "{failures:?}");
    for t in r["summary"]["per_iteration"].as_array().unwrap() {
        assert_eq!(t["unexpected"], 0, "{t}");
        assert_eq!(t["corrupt"], total / 2, "{t}");
    }
    assert!(c.iter().all(|x| x.1.is_none()), "no failing case: {c:?}");
    assert_eq!(c.len(), 2 + 8 + 1, "{c:?}");
    assert_eq!(c.last().unwrap().0, "outcome: self-test-passed (exit 0)");
    assert!(log.contains("self-test:         passed: 8 planted faults detected as predicted, nothing else corrupt"), "{log}");
    // `report show` prints the same verdict from the saved report.
    let d = crate::common::tmpdir("junit-selftest-show");
    let p = d.join("r.json");
    std::fs::write(&p, serde_json::to_vec(&r).unwrap()).unwrap();
    let (code, out, err) = kvprobe(&["report", "show", p.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("self-test:         passed: 8 planted faults"), "{out}");
    assert!(out.contains("injected (--inject), as predicted"), "{out}");
}

/// A self-test fails (exit 1, the reason as the run's error, a failing JUnit case for the
/// iteration) when something nothing planted predicts is corrupt: here a stray write into a
/// verified slot (the test-only late-write fault), beside a bitflip found as predicted.
#[test]
fn a_self_test_fails_on_corruption_nothing_planted_predicts() {
    let d = crate::common::tmpdir("junit-selftest-fail");
    let (r, j) = (d.join("r.json"), d.join("j.xml"));
    let (code, out, err) = crate::common::kvprobe_env(
        &[
            "run",
            "--memory",
            "dram",
            "--iterations",
            "2",
            "--inject",
            "bitflip",
            "--self-test",
            "--report",
            r.to_str().unwrap(),
            "--junit",
            j.to_str().unwrap(),
        ],
        &[("KVPROBE_TEST_LATE_WRITE", "repoison:1")],
    );
    assert_eq!(code, 1, "{out}{err}");
    let r = read_report(&r);
    assert_eq!(r["outcome"]["status"], "corrupt");
    let why = "self-test failed: 1 corrupt block slices that no planted fault predicts";
    assert!(r["outcome"]["error"]["message"].as_str().unwrap().ends_with(why), "{}", r["outcome"]);
    let failures = r["failures"].as_array().unwrap();
    let stray: Vec<_> = failures.iter().filter(|f| f["class"] == "stray").collect();
    assert_eq!(stray.len(), 1, "{failures:?}");
    assert!(stray[0].get("injected").is_none(), "{}", stray[0]);
    assert_eq!(failures.iter().filter(|f| f["class"] == "bitflip" && f["injected"] == true).count(), 2, "{failures:?}");
    assert!(out.contains("self-test:         FAILED: 1 corrupt block slices that no planted fault predicts"), "{out}");
    assert!(out.contains(", not predicted by any --inject"), "{out}");
    let c = cases(&j);
    let failing: Vec<&str> = c.iter().filter(|x| x.1.is_some()).map(|x| x.0.as_str()).collect();
    // The stray is found in iteration 1 (repoison:1); iteration 2's bitflip alone passes.
    assert_eq!(failing, ["iteration 1", "outcome: corrupt (exit 1)"], "{c:?}");
    let it1 = &c.iter().find(|x| x.0 == "iteration 1").unwrap().2;
    assert!(it1.starts_with("1 of 2 corrupt block slices") && it1.contains("stray 1"), "{it1}");
}

/// `--self-test` with nothing planted is a usage error (exit 2), before any set-up.
#[test]
fn a_self_test_with_nothing_planted_is_refused() {
    let (code, _, err) = kvprobe(&["run", "--memory", "dram", "--self-test"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--self-test judges planted faults: give --inject"), "{err}");
}

/// A scenario's self-test: faults planted in requests, found as predicted, pass every
/// interval case; the intervals count no unexplained slice.
#[test]
fn a_scenario_self_test_passes_its_intervals() {
    let (code, r, c, log) = run_with_junit(
        "junit-selftest-scenario",
        "run",
        &["--scenario", "nixl-only", "--requests", "40", "--inject", "bitflip:2", "--inject", "drop", "--self-test"],
    );
    assert_eq!(code, 0, "{log}");
    assert_eq!(r["summary"]["injections_planted"], 3, "{log}");
    let want = crate::common::expected_by_class(&[("bitflip", 2), ("drop", 1)]);
    assert_eq!(r["summary"]["blocks_corrupt"], want.values().sum::<u64>(), "{log}");
    let ivs = r["scenario"]["intervals"].as_array().unwrap();
    assert_eq!(ivs.iter().map(|i| i["corrupt"].as_u64().unwrap()).sum::<u64>(), want.values().sum::<u64>());
    assert!(ivs.iter().all(|i| i["unexplained"] == 0), "{ivs:?}");
    assert!(c.iter().all(|x| x.1.is_none()), "{c:?}");
}
