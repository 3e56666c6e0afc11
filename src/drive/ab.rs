//! `kvprobe ab`: the isolation matrix in one command.
//!
//! Same seed, geometry and load, on one pair of connected endpoints, for: nixl-only,
//! tier-only, stacked (all fenced), then stacked with each race mechanism unfenced in turn.
//! The fenced rows must be clean (else the stack under test corrupts blocks: exit 1); each
//! unfenced row must be detected and attributed to its mechanism (else kvprobe could not
//! have seen that bug on this setup: exit 6).

use crate::core::mechanism::{Mechanism, Scenario};
use crate::drive::run::Probe;
use crate::env::envinfo::Environment;
use crate::error::{Error, Exit, Result};
use crate::report::{Outcome, Report, RunError};
use crate::scenario::config::{Progress, ScenarioConfig};
use crate::sweep::RunConfig;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// Schema of the `kvprobe ab` report.
pub const AB_SCHEMA: &str = "kvprobe.ab/1";

/// One row of the matrix.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct AbRow {
    /// Row name: the scenario, or `stacked+MECHANISM` for an unfenced mechanism.
    pub name: String,
    /// Scenario.
    pub scenario: Scenario,
    /// The mechanism left unfenced, if any.
    pub unfenced: Option<Mechanism>,
    /// Push mode: prefill WRITEs into decode's blocks (the `stacked-push` row and
    /// decode-abort-free's). Written only when set.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub push: bool,
    /// Host-buffer staging (the `stacked-staged` row and partial-staging's). Written only
    /// when set.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub staging: bool,
    /// Requests verified at decode.
    pub requests: u64,
    /// Block slices verified.
    pub slices_checked: u64,
    /// Corrupt slices.
    pub corrupt: u64,
    /// Corrupt slices by class (non-zero classes only).
    pub classes: BTreeMap<String, u64>,
    /// Corrupt slices no unfenced mechanism explains.
    pub unexplained: u64,
    /// Block-ownership violations (docs/scenarios.md "Block ownership"): 0 in a fenced row, more than 0
    /// in the row of a mechanism that breaks ownership; absent from reports before the checker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ownership_violations: Option<u64>,
    /// What the row must show: "clean" or "detected".
    pub expect: String,
    /// What it showed: "clean", "corrupt", "detected", "not reproduced".
    pub verdict: String,
    /// Why an unfenced mechanism was not reproduced.
    pub why: Option<String>,
    /// True when `verdict` meets `expect`, nothing is unexplained, the ownership checker
    /// agrees, and no mechanism but the row's own has corruption attributed to it.
    pub pass: bool,
}

/// The `kvprobe ab` report.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct AbReport {
    /// Always [`AB_SCHEMA`].
    pub schema: String,
    /// Unix time (seconds) the matrix started.
    pub started_unix: u64,
    /// Shared parameters (the load of every row).
    pub config: serde_json::Value,
    /// Machine, GPUs, NIXL.
    pub environment: Option<Environment>,
    /// The matrix.
    pub rows: Vec<AbRow>,
    /// One full run report per row, in row order.
    pub sections: Vec<Report>,
    /// How it ended: exit 0 all rows pass, 1 a fenced row is corrupt or corruption is
    /// unexplained, 6 an unfenced mechanism was not detected, or the error's code.
    pub outcome: Outcome,
    /// `ab --peer`: the prefill side (`kvprobe serve`: its host, environment, UCX path and
    /// exit code). Absent when prefill ran in this process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<crate::report::PeerSide>,
}

/// One row of the matrix: a scenario, in push mode or not, with at most one mechanism
/// unfenced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Case {
    /// Which connectors move the blocks.
    pub scenario: Scenario,
    /// Push mode (`--op write`): prefill WRITEs into decode's blocks.
    pub push: bool,
    /// Host-buffer staging (`--host-staging`).
    pub staging: bool,
    /// The mechanism left unfenced, if any.
    pub unfenced: Option<Mechanism>,
}

/// The rows, in order: nixl-only, tier-only, stacked, stacked in push mode and stacked
/// with host-buffer staging (all fenced), then stacked with each mechanism unfenced in turn
/// (decode-abort-free's in push mode, partial-staging's with staging: the only modes where
/// they can act).
pub fn cases() -> Vec<Case> {
    let fenced = |scenario, push, staging| Case { scenario, push, staging, unfenced: None };
    let mut v = vec![
        fenced(Scenario::NixlOnly, false, false),
        fenced(Scenario::TierOnly, false, false),
        fenced(Scenario::Stacked, false, false),
        fenced(Scenario::Stacked, true, false),
        fenced(Scenario::Stacked, false, true),
    ];
    v.extend(Mechanism::ALL.iter().map(|&m| Case {
        scenario: Scenario::Stacked,
        push: m.needs_push(),
        staging: m.needs_staging(),
        unfenced: Some(m),
    }));
    v
}

/// The row `name` of `case` as section report `r` shows it. An unfenced row passes only when
/// its own mechanism is detected, nothing is unexplained, the ownership checker agrees, and
/// no other mechanism had corruption attributed to it (such a cause cannot exist in that run:
/// it would be another row's bug excusing this one's); a fenced row passes only clean.
pub fn row_of(name: String, case: Case, r: &Report) -> AbRow {
    let Case { scenario, push, staging, unfenced } = case;
    let s = &r.summary;
    let sc = r.scenario.as_ref();
    let unexplained = sc.map_or(0, |x| x.unexplained_corrupt);
    let classes = s.by_class.iter().filter(|(_, n)| **n > 0).map(|(k, n)| (k.clone(), *n)).collect();
    let (expect, verdict, why) = match unfenced {
        None => ("clean", if s.blocks_corrupt == 0 { "clean" } else { "corrupt" }.to_string(), None),
        Some(m) => {
            let o = sc.and_then(|x| x.races.iter().find(|o| o.mechanism == m));
            ("detected", o.map_or("not reproduced".into(), |o| o.verdict.clone()), o.and_then(|o| o.why.clone()))
        }
    };
    let violations = sc.and_then(|x| x.ownership_violations);
    // The checker must agree: nothing in a fenced row, something where the unfenced
    // mechanism breaks ownership (reports before the checker have no count to judge).
    let ownership_ok = match (violations, unfenced) {
        (None, _) => true,
        (Some(n), None) => n == 0,
        (Some(n), Some(m)) => n > 0 || !m.breaks_ownership(),
    };
    // Corruption attributed to a mechanism other than the row's own.
    let foreign: Vec<String> = sc
        .map(|x| {
            x.races
                .iter()
                .filter(|o| Some(o.mechanism) != unfenced && o.corrupt_attributed > 0)
                .map(|o| format!("{} ({} slices)", o.mechanism, o.corrupt_attributed))
                .collect()
        })
        .unwrap_or_default();
    // The mechanism's own reason first; the checker's when the row would pass without it,
    // then corruption attributed elsewhere.
    let why = match (ownership_ok, unfenced) {
        (false, None) if verdict == "clean" => {
            Some(format!("{} block-ownership violations in a fenced row", violations.unwrap_or(0)))
        }
        (false, Some(_)) if verdict == "detected" => {
            Some("the block-ownership checker saw no violation of the unfenced ordering".to_string())
        }
        _ if !foreign.is_empty() && verdict == expect && ownership_ok => {
            Some(format!("corruption attributed to another mechanism: {}", foreign.join(", ")))
        }
        _ => why,
    };
    let pass = verdict == expect && unexplained == 0 && ownership_ok && foreign.is_empty();
    AbRow {
        name,
        scenario,
        unfenced,
        push,
        staging,
        requests: sc.map_or(0, |x| x.requests_verified),
        slices_checked: s.blocks_checked,
        corrupt: s.blocks_corrupt,
        classes,
        unexplained,
        ownership_violations: violations,
        expect: expect.into(),
        verdict,
        why,
        pass,
    }
}

/// The row name of `case`: the scenario (`SCENARIO-push` in push mode, `SCENARIO-staged`
/// with host-buffer staging), or `SCENARIO+MECHANISM` (a mechanism that needs a mode implies
/// it).
pub fn row_name(case: Case) -> String {
    match (case.unfenced, case.push, case.staging) {
        (Some(m), _, _) => format!("{}+{}", case.scenario.name(), m.name()),
        (None, true, _) => format!("{}-push", case.scenario.name()),
        (None, false, true) => format!("{}-staged", case.scenario.name()),
        (None, false, false) => case.scenario.name().to_string(),
    }
}

/// Where `row` disagrees with its section `sec` (for `kvprobe report check`), one line per
/// field: the name must be the one of the section's scenario and unfenced mechanism
/// ([`row_name`]), and every other field what [`row_of`] derives from the section (a row cut
/// short by an error: verdict the section's outcome status, pass false).
pub fn row_disagreements(row: &AbRow, sec: &Report) -> Vec<String> {
    let mut out = Vec::new();
    let sc = sec.config.get("scenario").cloned().unwrap_or_default();
    let scenario: Option<Scenario> = serde_json::from_value(sc["scenario"].clone()).ok();
    let unfenced: Option<Vec<Mechanism>> = serde_json::from_value(sc["unfenced"].clone()).ok();
    let (Some(scenario), Some(unfenced)) = (scenario, unfenced) else {
        out.push("section: config.scenario: no scenario and unfenced list".to_string());
        return out;
    };
    if unfenced.len() > 1 {
        out.push(format!("section: config.scenario.unfenced: {} mechanisms, a row leaves one", unfenced.len()));
    }
    let case = Case { scenario, push: sc["push"] == true, staging: sc["staging"] == true, unfenced: unfenced.first().copied() };
    let name = row_name(case);
    if row.name != name {
        out.push(format!("name: row {}, section {name}", row.name));
    }
    let mut want = row_of(name, case, sec);
    if sec.outcome.error.is_some() {
        want.verdict = sec.outcome.status.clone();
        want.pass = false;
        want.why = row.why.clone();
    }
    let (got, want) = (serde_json::to_value(row).unwrap_or_default(), serde_json::to_value(&want).unwrap_or_default());
    if let (Some(g), Some(w)) = (got.as_object(), want.as_object()) {
        for (k, w) in w {
            let g = g.get(k).cloned().unwrap_or_default();
            if k != "name" && &g != w {
                out.push(format!("{k}: row {g}, section {w}"));
            }
        }
    }
    out
}

/// Exit code of a finished matrix: 1 when a fenced row is corrupt or breaks a block's
/// ownership, or any corruption is unexplained, else 6 when an unfenced row was not detected
/// (or its ownership violations not seen), else 0.
pub fn matrix_exit(rows: &[AbRow]) -> Exit {
    let fenced_bad = |r: &AbRow| r.unfenced.is_none() && (r.corrupt > 0 || r.ownership_violations.unwrap_or(0) > 0);
    if rows.iter().any(|r| fenced_bad(r) || r.unexplained > 0) {
        Exit::Corrupt
    } else if rows.iter().any(|r| !r.pass) {
        Exit::NotReproduced
    } else {
        Exit::Clean
    }
}

/// An empty matrix of `cfg` (status "running").
fn start(cfg: &RunConfig) -> AbReport {
    AbReport {
        schema: AB_SCHEMA.to_string(),
        started_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        config: serde_json::to_value(cfg).unwrap_or(serde_json::Value::Null),
        environment: None,
        rows: Vec::new(),
        sections: Vec::new(),
        outcome: Outcome { exit_code: 0, status: "running".into(), error: None },
        peer: None,
    }
}

/// How progress names row `index` (from 0) of `total` called `name`: its position, counted
/// from 1, then its name (`row 3/18 stacked`), so a reader knows how much of the matrix is left.
pub fn row_label(index: usize, total: usize, name: &str) -> String {
    format!("row {}/{total} {name}", index + 1)
}

/// Runs the matrix. `cfg.scenario` carries the load (its scenario and unfenced set are
/// replaced row by row). `progress` is called with the row's label ([`row_label`]: its
/// position and name) and the row's progress. `after_row` is called with the report so far
/// after each row (for checkpoints and the table). `dump`: `--dump DIR` and its cap (bytes) —
/// each row's failing slices go to `DIR/<row name>/` ([`crate::report::dump`]), each row capped
/// at an equal share of it. Never panics on bad input.
pub fn run_ab(
    cfg: &RunConfig,
    progress: &mut dyn FnMut(&str, &Progress),
    after_row: &mut dyn FnMut(&AbReport),
    dump: Option<(&std::path::Path, u64)>,
) -> (AbReport, Exit) {
    let mut ab = start(cfg);
    let mut probe = None;
    let mut result = run_rows(cfg, &mut ab, &mut probe, progress, after_row, dump);
    // A failure prefill sent after its last answer ends the matrix as that failure.
    if let (Ok(()), Some(p)) = (&result, &probe) {
        result = p.prefill.last_word();
    }
    let err = result.err();
    let exit = conclude(&mut ab, err.as_ref());
    if let Some(p) = &probe {
        // The pair ends together: prefill takes the matrix's outcome (its summary: the rows'
        // totals) and sends its side.
        let results = crate::peer::Results {
            summary: serde_json::to_value(totals(&ab.sections)).ok(),
            scenario: None,
            rows: serde_json::to_value(&ab.rows).ok(),
        };
        let side = p.prefill.finish(exit as u8, err.map(|e| e.to_string()), results, crate::drive::run::PEER_BYE_BOUND);
        if cfg.peer.is_some() {
            ab.peer = Some(side);
        }
    }
    drop(probe);
    (ab, exit)
}

/// The rows' totals, as one summary (what a prefill side reports of the matrix): block slices
/// checked and corrupt, corrupt by class, bytes moved over NIXL.
fn totals(sections: &[Report]) -> crate::report::Summary {
    let mut t = crate::report::Summary::new();
    for s in sections.iter().map(|r| &r.summary) {
        t.blocks_checked += s.blocks_checked;
        t.blocks_corrupt += s.blocks_corrupt;
        t.bytes_transferred += s.bytes_transferred;
        t.transfer_seconds += s.transfer_seconds;
        t.verify_seconds += s.verify_seconds;
        for (k, n) in &s.by_class {
            *t.by_class.entry(k.clone()).or_default() += n;
        }
    }
    t.transfer_gbps = if t.transfer_seconds > 0.0 { t.bytes_transferred as f64 / t.transfer_seconds / 1e9 } else { 0.0 };
    t
}

/// Sets the outcome of a matrix that ended with `error` (or none) and returns its exit code:
/// the matrix's own ([`matrix_exit`]) unless an error cut it short (corruption still wins).
fn conclude(ab: &mut AbReport, error: Option<&Error>) -> Exit {
    let exit = match error {
        Some(e) if !matches!(matrix_exit(&ab.rows), Exit::Corrupt) => e.exit(),
        _ => matrix_exit(&ab.rows),
    };
    let status = match exit {
        Exit::Clean => "clean",
        Exit::Corrupt => "corrupt",
        Exit::NotReproduced => "not-reproduced",
        Exit::ReportNotWritten => "report-not-written",
        Exit::Timeout => "timeout",
        Exit::Interrupted => "interrupted",
        _ => "error",
    };
    ab.outcome = Outcome {
        exit_code: exit as u8,
        status: status.into(),
        error: error.map(|e| RunError { kind: e.kind().into(), message: e.to_string() }),
    };
    exit
}

/// The row being run, for the watchdog: its name and case.
type RowName = (String, Case);

/// The matrix so far and the row in progress, as last published, for the watchdog.
static SHADOW: std::sync::Mutex<Option<(AbReport, Option<RowName>)>> = std::sync::Mutex::new(None);

fn publish(ab: &AbReport, row: Option<RowName>) {
    *SHADOW.lock().unwrap_or_else(|p| p.into_inner()) = Some((ab.clone(), row));
}

/// The matrix to write when a call blocked past its deadline (`e`, a timeout; see
/// [`crate::sys::deadline`]): the rows so far, the row in progress cut short with `e` (its
/// section as last published, [`crate::drive::run::expired_report`]), and the outcome.
pub fn expired_report(cfg: &RunConfig, e: &Error) -> (AbReport, Exit) {
    let shadow = SHADOW.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let (mut ab, row) = shadow.unwrap_or_else(|| (start(cfg), None));
    if let Some((name, case)) = row {
        let row_cfg = RunConfig { scenario: cfg.scenario.clone().map(|sc| case_config(case, &sc)), ..cfg.clone() };
        let (mut rep, _) = crate::drive::run::expired_report(&row_cfg, e);
        rep.environment = None; // recorded once, at the top
        push_row(&mut ab, name, case, rep, Some(e));
    }
    let exit = conclude(&mut ab, Some(e));
    (ab, exit)
}

/// The scenario configuration of row `case` from the matrix's `template`.
fn case_config(case: Case, template: &ScenarioConfig) -> ScenarioConfig {
    ScenarioConfig {
        scenario: case.scenario,
        unfenced: case.unfenced.into_iter().collect(),
        push: case.push,
        staging: case.staging,
        matrix: false,
        ..template.clone()
    }
}

/// Appends a finished row (its report `rep`, ended by `error` or not).
fn push_row(ab: &mut AbReport, name: String, case: Case, rep: Report, error: Option<&Error>) {
    let mut row = row_of(name, case, &rep);
    if let Some(e) = error {
        // A row cut short proves nothing either way.
        row.verdict = rep.outcome.status.clone();
        row.why = Some(e.to_string());
        row.pass = false;
    }
    ab.rows.push(row);
    ab.sections.push(rep);
}

fn run_rows(
    cfg: &RunConfig,
    ab: &mut AbReport,
    slot: &mut Option<Probe>,
    progress: &mut dyn FnMut(&str, &Progress),
    after_row: &mut dyn FnMut(&AbReport),
    dump: Option<(&std::path::Path, u64)>,
) -> Result<()> {
    let template = cfg.scenario.clone().ok_or_else(|| Error::Usage("kvprobe ab needs a load (scenario config)".into()))?;
    let mut head = crate::drive::run::empty_report(cfg);
    publish(ab, None);
    crate::drive::run::prepare(cfg, &mut head)?;
    ab.environment = head.environment.clone();
    let timeout = Duration::from_secs_f64(cfg.timeout_secs);
    crate::sys::deadline::set_limit(Some(timeout));
    publish(ab, None);
    let ucx_mark = crate::xfer::ucx::mark();
    let probe = slot.insert(Probe::setup_peer(cfg, ab.environment.clone())?);
    crate::xfer::ucx::adopt();
    let all = cases();
    let total = all.len();
    for (row, case) in all.into_iter().enumerate() {
        let name = row_name(case);
        let label = row_label(row, total, &name);
        let sc = case_config(case, &template);
        let row_cfg = RunConfig { scenario: Some(sc.clone()), ..cfg.clone() };
        let mut rep = crate::drive::run::empty_report(&row_cfg);
        rep.environment = None; // recorded once, at the top
        crate::report::publish(&rep);
        publish(ab, Some((name.clone(), case)));
        let mut p = |x: &Progress| progress(&label, x);
        let mut none = |_: &Report| {};
        let mut dumper = match dump {
            Some((dir, cap)) => {
                let geometry = rep.config.get("geometry").cloned().unwrap_or_default();
                // The cap holds for the whole matrix: each row gets an equal share.
                let share = cap / total as u64;
                let shape = crate::core::fingerprint::RowShape::of(&cfg.geometry);
                Some(crate::report::dump::Dumper::new(
                    &dir.join(&name),
                    share,
                    cfg.seed,
                    geometry,
                    cfg.geometry.slice_bytes()?,
                    shape,
                    serde_json::Value::Null,
                )?)
            }
            None => None,
        };
        let sides = crate::scenario::decode::Sides {
            prefill: &probe.prefill,
            decode: &mut probe.decode,
            arena: probe.tier_arena.clone(),
            lanes: Vec::new(), // ab refuses hybrid models for now (cli::args::refuse_hybrid)
        };
        let r = crate::scenario::decode::run_scenario(
            &sc,
            cfg.seed,
            row as u32,
            sides,
            timeout,
            cfg.max_failures,
            &mut rep,
            &mut p,
            (0.0, &mut none),
            dumper.as_mut(),
        );
        if let Some(d) = dumper.as_mut() {
            rep.dump = Some(d.finish());
        }
        rep.summary.transport_path = Some(crate::drive::run::scenario_path(cfg, probe, ucx_mark, ab.environment.as_ref()));
        let exit = match (&r, rep.summary.blocks_corrupt > 0) {
            (_, true) => Exit::Corrupt,
            (Err(e), false) => e.exit(),
            (Ok(()), false) => Exit::Clean,
        };
        rep.finish(exit, r.as_ref().err());
        push_row(ab, name, case, rep, r.as_ref().err());
        publish(ab, None);
        after_row(ab);
        r?;
    }
    Ok(())
}

/// The matrix of serve's report of an `ab --peer` session (its `matrix`: the rows decode
/// sent at the end), as an ab report with serve's outcome, so it is shown as `ab` printed
/// it; `None` for a report of any other run.
pub fn matrix_of(r: &Report) -> Option<AbReport> {
    let rows: Vec<AbRow> = serde_json::from_value(r.matrix.clone()?).ok()?;
    Some(AbReport {
        schema: AB_SCHEMA.into(),
        started_unix: r.started_unix,
        config: r.config.clone(),
        environment: None,
        rows,
        sections: Vec::new(),
        outcome: r.outcome.clone(),
        peer: None,
    })
}

/// The matrix as a text table.
pub fn render(ab: &AbReport) -> String {
    let mut out = format!(
        "{:<36} {:>8} {:>14} {:>8} {:>9}  {:<28} {}\n",
        "scenario", "requests", "slices checked", "corrupt", "ownership", "classes", "verdict"
    );
    for r in &ab.rows {
        let classes: Vec<String> = r.classes.iter().map(|(k, n)| format!("{k} {n}")).collect();
        let mut verdict = format!("{}{}", r.verdict, if r.pass { "" } else { "  <- FAIL" });
        if r.unexplained > 0 {
            verdict += &format!(" ({} unexplained)", r.unexplained);
        }
        if let Some(w) = &r.why {
            // One line in the table; the report holds the whole text (a master's log, say).
            verdict += &format!(": {}", w.lines().next().unwrap_or(""));
        }
        out += &format!(
            "{:<36} {:>8} {:>14} {:>8} {:>9}  {:<28} {}\n",
            r.name,
            r.requests,
            r.slices_checked,
            r.corrupt,
            r.ownership_violations.map_or("-".to_string(), |n| n.to_string()),
            if classes.is_empty() { "-".into() } else { classes.join(", ") },
            verdict
        );
    }
    out += &format!("result: {} (exit {})\n", ab.outcome.status, ab.outcome.exit_code);
    out
}
