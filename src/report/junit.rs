//! JUnit XML (`--junit PATH` on `run`, `ab` and `bench`) for CI on GPU runners: what GitHub
//! Actions, GitLab and Jenkins render as test results, built with the quick-junit crate.
//!
//! Each document is made from the JSON report as written (`kvprobe.report/1`,
//! `kvprobe.ab/1`, `kvprobe.bench/1`; docs/report.md "Report format"), so a saved report gives the same
//! XML as the live run, and this module depends on nothing but the report's published fields.
//! Cases:
//! - `run`, sweep: one per iteration (`summary.per_iteration`: the first 1000, then one case for
//!   the rest), failing when the iteration found corrupt slices: the message names the count,
//!   the classes and the first failing slice's coordinates;
//! - `run`, scenario: one per interval (`scenario.intervals`) and one per race mechanism;
//! - one per injection (`--inject`): passes when detected as predicted;
//! - `run --self-test` (`config.self_test`): an iteration or interval fails only on corrupt
//!   slices nothing planted predicts (`per_iteration[].unexpected`, `intervals[].unexplained`),
//!   so a self-test that passed (exit 0) has no failing case;
//! - `ab`: one per row, passing when the row passes;
//! - `bench`: one per goal (figures with a goal, and the sweep breakdowns' probe share where
//!   the goal applies), failing when missed;
//! - always an `outcome` case: success for exit 0, a failure for exits 1, 5, 6 and 7 and an
//!   error (not a missing file) for 2, 3, 4 and 130 with the run's error message.

use crate::error::{Error, Result};
use quick_junit::{NonSuccessKind, Property, Report, TestCase, TestCaseStatus, TestSuite};
use serde_json::Value;
use std::time::Duration;

/// Sweep iterations listed one case each (the report lists at most this many).
const LISTED_ITERATIONS: usize = crate::report::PER_ITERATION_MAX;

fn secs(v: &Value) -> Option<Duration> {
    v.as_f64().filter(|s| s.is_finite() && *s >= 0.0).map(Duration::from_secs_f64)
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// A failure or error with `message` both as the `message` attribute and as the element's
/// text (GitLab shows the text, Jenkins and most others the attribute).
fn failure(kind: NonSuccessKind, ty: &str, message: String) -> TestCaseStatus {
    let mut s = TestCaseStatus::non_success(kind);
    s.set_type(ty.to_string()).set_description(message.clone()).set_message(message);
    s
}

fn case(name: String, classname: &str, status: TestCaseStatus, time: Option<Duration>) -> TestCase {
    let mut c = TestCase::new(name, status);
    c.set_classname(classname.to_string());
    if let Some(t) = time {
        c.set_time(t);
    }
    c
}

/// "torn 2, misplaced 1" from a `{class: count}` object (zeros left out, largest first).
fn classes(v: &Value) -> String {
    let mut v: Vec<(String, u64)> = v
        .as_object()
        .map(|m| m.iter().filter_map(|(k, n)| n.as_u64().filter(|n| *n > 0).map(|n| (k.clone(), n))).collect())
        .unwrap_or_default();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    v.iter().map(|(k, n)| format!("{k} {n}")).collect::<Vec<_>>().join(", ")
}

/// "layer 3 K block 17 (slot 201): torn, first bad byte 2048, 2048 bad bytes" of a report failure.
fn coordinates(f: &Value) -> String {
    format!(
        "layer {} {} block {} (slot {}): {}, first bad byte {}, {}",
        text(&f["layer"]),
        text(&f["kv"]),
        text(&f["block"]),
        text(&f["slot"]),
        text(&f["class"]),
        text(&f["first_bad_offset"]),
        crate::sys::units::plural(f["bad_bytes"].as_u64().unwrap_or(0), "bad byte")
    )
}

/// The `outcome` case: exit 0 passes; 1, 5, 6, 7 are failures; anything else is an error
/// carrying the run's error message.
fn outcome_case(outcome: &Value, classname: &str) -> TestCase {
    let code = outcome["exit_code"].as_u64().unwrap_or(2);
    let status = text(&outcome["status"]);
    let why = outcome["error"]["message"].as_str().map(str::to_string);
    let st = match code {
        0 => TestCaseStatus::success(),
        1 | 5 | 6 | 7 => failure(NonSuccessKind::Failure, &status, why.unwrap_or_else(|| format!("{status} (exit {code})"))),
        _ => failure(NonSuccessKind::Error, &status, why.unwrap_or_else(|| format!("{status} (exit {code})"))),
    };
    case(format!("outcome: {status} (exit {code})"), classname, st, None)
}

/// The document: `suite` with the `outcome` case added last.
fn finish(mut suite: TestSuite, doc: &Value, classname: &str) -> Report {
    suite.add_test_case(outcome_case(&doc["outcome"], classname));
    let mut r = Report::new("kvprobe");
    r.add_test_suite(suite);
    r
}

fn suite(name: &str, doc: &Value) -> TestSuite {
    let mut s = TestSuite::new(name.to_string());
    let mut props = vec![Property::new("schema", text(&doc["schema"]))];
    for key in ["seed", "memory", "op", "backend"] {
        if !doc["config"][key].is_null() {
            props.push(Property::new(key, text(&doc["config"][key])));
        }
    }
    s.add_properties(props);
    s
}

/// The JUnit document of a `kvprobe run` report (`doc`: the report's JSON).
pub fn from_run(doc: &Value) -> Report {
    let scenario = doc["scenario"].is_object();
    let self_test = doc["config"]["self_test"].as_bool() == Some(true);
    let cls = if scenario { "kvprobe.run.scenario" } else { "kvprobe.run.sweep" };
    let mut suite = suite(if scenario { "kvprobe run (scenario)" } else { "kvprobe run" }, doc);
    let failures = doc["failures"].as_array().cloned().unwrap_or_default();
    let first_of = |pick: &dyn Fn(&Value) -> bool| failures.iter().find(|f| pick(f)).map(coordinates);
    let omitted = doc["summary"]["failures_omitted"].as_u64().unwrap_or(0);
    let note =
        if omitted > 0 { format!(" ({omitted} failures not listed in the report: --max-failures)") } else { String::new() };
    if let Some(sc) = doc["scenario"].as_object() {
        for (i, iv) in sc.get("intervals").and_then(Value::as_array).into_iter().flatten().enumerate() {
            let corrupt = iv["corrupt"].as_u64().unwrap_or(0);
            let (a, b) = (iv["start_s"].as_f64().unwrap_or(0.0), iv["end_s"].as_f64().unwrap_or(0.0));
            let st = if corrupt == 0 || (self_test && iv["unexplained"].as_u64() == Some(0)) {
                TestCaseStatus::success()
            } else {
                // Scenario failures carry the engine step, not a time: the interval's own slices
                // cannot be picked out, so the message names the run's classes and first listed one.
                failure(
                    NonSuccessKind::Failure,
                    "corrupt",
                    format!(
                        "{corrupt} corrupt block slices of {} checked in {} requests (whole run: {}){}{note}",
                        text(&iv["slices_checked"]),
                        text(&iv["requests"]),
                        classes(&doc["summary"]["by_class"]),
                        failures.first().map(|f| format!("; first listed: {}", coordinates(f))).unwrap_or_default()
                    ),
                )
            };
            suite.add_test_case(case(format!("interval {} [{a:.1} s, {b:.1} s)", i + 1), cls, st, secs(&Value::from(b - a))));
        }
        for race in sc.get("races").and_then(Value::as_array).into_iter().flatten() {
            let (m, fencing, verdict) = (text(&race["mechanism"]), text(&race["fencing"]), text(&race["verdict"]));
            let want = if fencing == "unfenced" { "detected" } else { "clean" };
            let st = if verdict == want {
                TestCaseStatus::success()
            } else {
                failure(
                    NonSuccessKind::Failure,
                    &verdict,
                    format!(
                        "{verdict} (expected {want}); corrupt attributed {}{}{}",
                        text(&race["corrupt_attributed"]),
                        Some(classes(&race["classes"])).filter(|c| !c.is_empty()).map(|c| format!(" ({c})")).unwrap_or_default(),
                        race["why"].as_str().map(|w| format!(": {w}")).unwrap_or_default()
                    ),
                )
            };
            suite.add_test_case(case(format!("race {m} ({fencing})"), cls, st, None));
        }
        let unexplained = sc.get("unexplained_corrupt").and_then(Value::as_u64).unwrap_or(0);
        if unexplained > 0 {
            let first = first_of(&|f| f["request"].is_u64() && f["attributed_to"].is_null());
            suite.add_test_case(case(
                "unexplained corruption".into(),
                cls,
                failure(
                    NonSuccessKind::Failure,
                    "unexplained",
                    format!(
                        "{unexplained} corrupt slices no race mechanism explains{}{note}",
                        first.map(|f| format!("; first: {f}")).unwrap_or_default()
                    ),
                ),
                None,
            ));
        }
    } else {
        let per = doc["summary"]["per_iteration"].as_array().cloned().unwrap_or_default();
        let (mut listed_corrupt, mut listed_unexpected) = (0, 0);
        for t in per.iter().take(LISTED_ITERATIONS) {
            let it = t["index"].as_u64().unwrap_or(0);
            let corrupt = t["corrupt"].as_u64().unwrap_or(0);
            // An older report has no `unexpected`: every corrupt slice counts.
            let unexpected = t["unexpected"].as_u64().unwrap_or(corrupt);
            listed_corrupt += corrupt;
            listed_unexpected += unexpected;
            let st = if corrupt == 0 {
                TestCaseStatus::success()
            } else if self_test && unexpected == 0 {
                // Only planted faults, each found as predicted (the injection cases say so).
                TestCaseStatus::success()
            } else if self_test {
                failure(
                    NonSuccessKind::Failure,
                    "unexpected",
                    format!(
                        "{unexpected} of {corrupt} corrupt block slices ({}) predicted by no planted fault{note}",
                        classes(&t["by_class"]),
                    ),
                )
            } else {
                let first = first_of(&|f| f["iteration"].as_u64() == Some(it));
                failure(
                    NonSuccessKind::Failure,
                    "corrupt",
                    format!(
                        "{corrupt} corrupt block slices ({}){}{note}",
                        classes(&t["by_class"]),
                        first.map(|f| format!("; first: {f}")).unwrap_or_default()
                    ),
                )
            };
            suite.add_test_case(case(format!("iteration {it}"), cls, st, secs(&t["iteration"])));
        }
        let iterations = doc["summary"]["iterations"].as_u64().unwrap_or(0);
        if iterations > per.len() as u64 {
            let rest = doc["summary"]["blocks_corrupt"].as_u64().unwrap_or(0).saturating_sub(listed_corrupt);
            let rest_unexpected =
                doc["summary"]["unexpected_failures"].as_u64().unwrap_or(rest).saturating_sub(listed_unexpected);
            let from = per.len() as u64 + 1;
            let st = if rest == 0 || (self_test && rest_unexpected == 0) {
                TestCaseStatus::success()
            } else {
                let first = first_of(&|f| f["iteration"].as_u64().is_some_and(|i| i >= from));
                failure(
                    NonSuccessKind::Failure,
                    "corrupt",
                    format!("{rest} corrupt block slices{}{note}", first.map(|f| format!("; first: {f}")).unwrap_or_default()),
                )
            };
            suite.add_test_case(case(format!("iterations {from} to {iterations}"), cls, st, None));
        }
    }
    for (i, inj) in doc["injections"].as_array().into_iter().flatten().enumerate() {
        let kind = text(&inj["kind"]);
        let st = if inj["detected"].as_bool() == Some(true) {
            TestCaseStatus::success()
        } else {
            let want: Vec<String> = inj["predicted"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| {
                    format!("{} at layer {} {} block {}", text(&p["class"]), text(&p["layer"]), text(&p["kv"]), text(&p["block"]))
                })
                .collect();
            failure(NonSuccessKind::Failure, "not-detected", format!("predicted {} not reported", want.join("; ")))
        };
        suite.add_test_case(case(
            format!("inject {kind} #{} (iteration {})", i + 1, text(&inj["iteration"])),
            "kvprobe.run.inject",
            st,
            None,
        ));
    }
    finish(suite, doc, cls)
}

/// The JUnit document of a `kvprobe ab` report: one case per row.
pub fn from_ab(doc: &Value) -> Report {
    let cls = "kvprobe.ab";
    let mut suite = suite("kvprobe ab", doc);
    for row in doc["rows"].as_array().into_iter().flatten() {
        let name = text(&row["name"]);
        let st = if row["pass"].as_bool() == Some(true) {
            TestCaseStatus::success()
        } else {
            let unexplained = row["unexplained"].as_u64().unwrap_or(0);
            failure(
                NonSuccessKind::Failure,
                &text(&row["verdict"]),
                format!(
                    "{} (expected {}): {} corrupt block slices{}{}{}",
                    text(&row["verdict"]),
                    text(&row["expect"]),
                    text(&row["corrupt"]),
                    Some(classes(&row["classes"])).filter(|c| !c.is_empty()).map(|c| format!(" ({c})")).unwrap_or_default(),
                    if unexplained > 0 { format!(", {unexplained} unexplained") } else { String::new() },
                    row["why"].as_str().map(|w| format!(": {w}")).unwrap_or_default()
                ),
            )
        };
        suite.add_test_case(case(name, cls, st, None));
    }
    finish(suite, doc, cls)
}

/// A bench goal's status: success when `met`, else a `goal-missed` failure saying `why`.
fn goal_case(met: bool, why: impl FnOnce() -> String) -> TestCaseStatus {
    if met { TestCaseStatus::success() } else { failure(NonSuccessKind::Failure, "goal-missed", why()) }
}

/// The JUnit document of a `kvprobe bench` result: one case per goal, and the outcome.
pub fn from_bench(doc: &Value) -> Report {
    let cls = "kvprobe.bench";
    let mut suite = suite("kvprobe bench", doc);
    for f in doc["figures"].as_array().into_iter().flatten() {
        let Some(goal) = f["goal"].as_f64() else { continue };
        let ratio = f["ratio"].as_f64();
        let st = goal_case(f["meets"].as_bool() == Some(true), || {
            format!(
                "ratio {} below the goal {goal:.2} ({} GB/s)",
                ratio.map_or("unknown".into(), |r| format!("{r:.3}")),
                f["gbps"].as_f64().map_or("?".into(), |g| format!("{g:.1}"))
            )
        });
        let to = f["ratio_to"].as_str().map(|t| format!(" of {t}")).unwrap_or_default();
        suite.add_test_case(case(format!("{} >= {goal:.2}{to}", text(&f["name"])), cls, st, secs(&f["seconds_median"])));
    }
    for b in doc["breakdowns"].as_array().into_iter().flatten() {
        let Some(meets) = b["meets"].as_bool() else { continue };
        let st = goal_case(meets, || {
            format!(
                "probe share {} above the goal",
                b["probe_share"].as_f64().map_or("?".into(), |s| format!("{:.1} %", 100.0 * s))
            )
        });
        suite.add_test_case(case(format!("{}: probe share", text(&b["label"])), cls, st, None));
    }
    finish(suite, doc, cls)
}

/// Writes `doc` (a JUnit document) to `path` atomically, as reports are
/// ([`crate::report::write_bytes_atomic`]). Errors: [`Error::Io`] (exit 2).
pub fn write(path: &std::path::Path, doc: &Report) -> Result<()> {
    let xml = doc.to_string().map_err(|e| Error::Io(format!("--junit: serialise: {e}")))?;
    crate::report::write_bytes_atomic(path, xml.as_bytes(), "--junit")
}
