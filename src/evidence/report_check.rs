//! `kvprobe report check BUNDLE`: the receiver's side of a bundle ([`crate::evidence::bundle`]), with
//! no GPU and no NIXL.
//!
//! 1. The manifest: every file it lists is in the bundle with its size and SHA-256, and no
//!    other file is (besides `manifest.json`).
//! 2. Every dumped slice (`dump/index.json`; ab: `dump/<row>/index.json`): the expected bytes
//!    are regenerated from the fingerprint definition ([`crate::core::fingerprint::expected`], or the
//!    poison for a `stray` slice found by the poison check) and their digest compared with
//!    `expected_digest`; the `regenerate` command must be the one kvprobe writes for that
//!    record; `observed_regenerate`, when given (and in a dump that gives it for any slice,
//!    wherever it applies), must be the command kvprobe writes for that record and bytes
//!    ([`crate::report::dump::observed_regenerate_command`]: the bytes are exactly the
//!    fingerprint of `observed` or the poison, recomputed here); from the dumped bytes, the
//!    class ([`crate::core::verify::classify_against`]),
//!    `first_bad_offset` and `bad_bytes` (byte by byte against the expected bytes), the sector
//!    map, `bit_flips`, the observed identity and `actual_digest` are derived again and
//!    compared with the slice's record in `index.json` and in the report; coordinates,
//!    expected identity and slot agree between the two; the dump's per-class counts add up to
//!    the report's.
//!
//! Every disagreement is one line naming the slice (`iteration 2 layer 1 K block 17`, with
//! `row NAME:` before it in an ab bundle) or the file, the field, and both values.

use crate::core::fingerprint::{self, BlockIdentity, RowShape};
use crate::core::geometry::{Geometry, SliceCoord};
use crate::error::{Error, Result};
use crate::report::dump::{DumpEntry, DumpIndex};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// What [`check`] found.
#[derive(Clone, Debug, Default)]
pub struct Checked {
    /// The disagreements, one line each (empty: the bundle is consistent).
    pub problems: Vec<String>,
    /// Files the manifest lists (each checked for size and SHA-256).
    pub files: usize,
    /// Dumped slices whose bytes were re-derived and compared.
    pub slices: usize,
    /// The corrupt block slices the report counts (`summary.blocks_corrupt`; an ab report:
    /// over its rows' sections); 0 when the report could not be read.
    pub corrupt: u64,
    /// The corrupt pages of a hybrid model's state and indexer regions the report counts
    /// (`regions[].pages_corrupt`; their pages are not dumped, their failures are re-derived
    /// from the configuration).
    pub region_pages_corrupt: u64,
}

/// Checks the bundle at `path` (a `.tar.gz`, or a directory holding an unpacked bundle).
/// Returns the disagreements and what was checked. Errors (usage, exit 2): a malformed
/// bundle — unreadable, not gzip or tar, no manifest, a manifest, report or index that is not
/// valid JSON of its schema.
///
/// Reading is bounded ([`crate::evidence::bundle::read`]): the entries are hashed as they stream past;
/// only the report and the dump indexes are held, and each dumped slice is read again, one at
/// a time, for its re-derivation.
pub fn check(path: &Path) -> Result<Checked> {
    let mut b = crate::evidence::bundle::read(path)?;
    let m = crate::evidence::bundle::manifest(&b)?;
    let mut problems = Vec::new();
    let mut listed = BTreeSet::new();
    for f in &m.files {
        if !listed.insert(f.path.clone()) {
            problems.push(format!("{}: listed twice in the manifest", f.path));
            continue;
        }
        match b.digests.get(&f.path) {
            None => problems.push(format!("{}: in the manifest but not in the bundle", f.path)),
            Some(d) => {
                // Read up to the listed size + 1 byte: "more" means the entry is longer.
                if d.bytes != f.bytes {
                    let more = if d.bytes > f.bytes { "more than " } else { "" };
                    problems.push(format!("{}: bytes: manifest {}, file {more}{}", f.path, f.bytes, d.bytes.min(f.bytes)));
                }
                if d.sha256 != f.sha256 {
                    problems.push(format!("{}: sha256: manifest {}, file {}", f.path, f.sha256, d.sha256));
                }
            }
        }
    }
    // An entry of the wrong size was read only to its listed size + 1: its bytes are not the
    // file's, so nothing else is derived from them (it counts as absent below).
    let wrong_size: Vec<String> =
        m.files.iter().filter(|f| b.digests.get(&f.path).is_some_and(|d| d.bytes != f.bytes)).map(|f| f.path.clone()).collect();
    for p in &wrong_size {
        b.files.remove(p);
        b.digests.remove(p);
    }
    for p in &b.unlisted {
        problems.push(format!("{p}: in the bundle but not in the manifest (not read)"));
    }
    if wrong_size.contains(&m.report) {
        // Its size disagrees (said above): nothing more can be compared with it.
        return Ok(Checked { problems, files: m.files.len(), slices: 0, corrupt: 0, region_pages_corrupt: 0 });
    }
    let body = b
        .files
        .get(&m.report)
        .ok_or_else(|| Error::Usage(format!("{}: the manifest's report {} is not in the bundle", path.display(), m.report)))?;
    let report: Value =
        serde_json::from_slice(body).map_err(|e| Error::Usage(format!("{}: {} is not JSON: {e}", path.display(), m.report)))?;
    let schema = report.get("schema").and_then(Value::as_str).unwrap_or("");
    // (label prefix, dump folder in the bundle, report section)
    let sections: Vec<(String, String, &Value)> = if schema == crate::report::SCHEMA {
        vec![(String::new(), "dump/".into(), &report)]
    } else if schema == crate::drive::ab::AB_SCHEMA {
        let ab: crate::drive::ab::AbReport = serde_json::from_value(report.clone())
            .map_err(|e| Error::Usage(format!("{}: {} is not an ab report: {e}", path.display(), m.report)))?;
        let secs = report["sections"].as_array().map(Vec::as_slice).unwrap_or_default();
        if ab.sections.len() != ab.rows.len() {
            problems.push(format!("{}: {} rows, {} sections", m.report, ab.rows.len(), ab.sections.len()));
        }
        let mut names = BTreeSet::new();
        let mut v = Vec::new();
        // rows[i] is re-derived from sections[i]; dump folders are paired with rows by name.
        for (i, row) in ab.rows.iter().enumerate() {
            let label = format!("row {}: ", row.name);
            if !names.insert(row.name.clone()) {
                problems.push(format!("{label}the name is given to two rows"));
                continue;
            }
            let (Some(sec), Some(sv)) = (ab.sections.get(i), secs.get(i)) else { continue };
            problems.extend(crate::drive::ab::row_disagreements(row, sec).into_iter().map(|l| format!("{label}{l}")));
            v.push((label, format!("dump/{}/", row.name), sv));
        }
        for p in b.files.keys() {
            if let Some(dir) = p.strip_prefix("dump/").and_then(|q| q.strip_suffix("/index.json"))
                && !names.contains(dir)
            {
                problems.push(format!("{p}: a dump folder no row is named ({dir})"));
            }
        }
        v
    } else {
        return Err(Error::Usage(format!("{}: {} has schema {schema:?}, not a run or ab report", path.display(), m.report)));
    };
    // Each section's checks that need no slice bytes, then one more pass over the bundle
    // for the slices (one held at a time), then what the slices add up to.
    let corrupt = sections.iter().map(|(_, _, sec)| sec["summary"]["blocks_corrupt"].as_u64().unwrap_or(0)).sum();
    let region_pages_corrupt = sections
        .iter()
        .flat_map(|(_, _, sec)| sec["regions"].as_array().cloned().unwrap_or_default())
        .map(|r| r["pages_corrupt"].as_u64().unwrap_or(0))
        .fold(0u64, u64::saturating_add);
    let mut secs = Vec::new();
    for (label, dir, sec) in sections {
        let mut head = Vec::new();
        report_checks(sec, &mut |s| head.push(format!("{label}{s}")));
        let index_path = format!("{dir}index.json");
        let Some(ib) = b.files.get(&index_path) else {
            if sec.get("dump").is_some_and(|d| d["slices_written"].as_u64() > Some(0)) {
                head.push(format!("{label}{index_path}: missing, but the report says slices were dumped"));
            }
            problems.append(&mut head);
            continue;
        };
        let index: DumpIndex = serde_json::from_slice(ib)
            .map_err(|e| Error::Usage(format!("{}: {index_path} is not a dump index: {e}", path.display())))?;
        if index.schema != crate::report::dump::SCHEMA {
            return Err(Error::Usage(format!(
                "{}: {index_path}: schema {:?} is not {}",
                path.display(),
                index.schema,
                crate::report::dump::SCHEMA
            )));
        }
        let s = section_head(label, dir, index, sec, path, &mut head)?;
        secs.push((s, head));
    }
    // Every slice file an index names, once, with the (section, entry) that name it.
    let mut wanted = BTreeMap::<String, Vec<(usize, usize)>>::new();
    for (k, (s, _)) in secs.iter().enumerate() {
        for (i, e) in s.index.slices.iter().enumerate() {
            if s.shapes[i].is_some() {
                wanted.entry(format!("{}{}", s.dir, e.file)).or_default().push((k, i));
            }
        }
    }
    let mut said: Vec<Vec<Vec<String>>> = secs.iter().map(|(s, _)| vec![Vec::new(); s.index.slices.len()]).collect();
    let mut met = BTreeSet::new();
    let names: BTreeSet<String> = wanted.keys().cloned().collect();
    if !names.is_empty() {
        b.for_each_listed(&names, &mut |rel, actual| {
            met.insert(rel.to_string());
            for &(k, i) in wanted.get(rel).into_iter().flatten() {
                let s = &secs[k].0;
                said[k][i] = check_slice(s, i, actual);
            }
        })?;
    }
    let mut indexed = BTreeSet::new();
    for (k, (s, head)) in secs.iter_mut().enumerate() {
        problems.append(head);
        for (i, e) in s.index.slices.iter().enumerate() {
            let file = format!("{}{}", s.dir, e.file);
            indexed.insert(file.clone());
            // A converting run's received bytes: listed, and hashed by the manifest.
            if let Some(r) = e.received_file.as_ref().map(|r| format!("{}{r}", s.dir)) {
                if !b.digests.contains_key(&r) {
                    problems.push(format!("{}{}: {r} is not in the bundle", s.label, slice_name(e)));
                }
                indexed.insert(r);
            }
            if s.shapes[i].is_some() && !met.contains(&file) {
                // Absent, or of another size than listed (said with the manifest).
                problems.push(format!("{}{}: {file} is not in the bundle", s.label, slice_name(e)));
                continue;
            }
            problems.append(&mut said[k][i]);
        }
        let size_of = |f: &str| b.digests.get(f).map(|d| d.bytes);
        section_tail(s, &size_of, &mut problems);
    }
    for p in b.digests.keys() {
        if p.starts_with("dump/") && p.contains("slices/") && !indexed.contains(p) {
            problems.push(format!("{p}: a slice file no index.json lists"));
        }
    }
    Ok(Checked { problems, files: m.files.len(), slices: met.len(), corrupt, region_pages_corrupt })
}

/// The report's geometry, validated ([`Geometry::validate`]).
fn geometry_of(v: &Value) -> std::result::Result<Geometry, String> {
    let g: Geometry = serde_json::from_value(v.clone()).map_err(|e| format!("not a geometry: {e}"))?;
    g.validate().map_err(|e| e.to_string())?;
    Ok(g)
}

/// A `--self-test` that says it passed (status `self-test-passed`): the run was a self-test
/// (`config.self_test`), exit 0, every listed failure `injected`, no unexpected failure (nor,
/// in a scenario, an unexplained one), every planted fault detected, something planted, and
/// every checked slice compared.
fn self_test_checks(sec: &Value, say: &mut dyn FnMut(String)) {
    let (s, status) = (&sec["summary"], crate::report::SELF_TEST_PASSED);
    if sec["config"]["self_test"] != true {
        say(format!("report: outcome: status {status:?}, but config.self_test is not true"));
    }
    if sec["outcome"]["exit_code"].as_u64() != Some(0) {
        say(format!("report: outcome: status {status:?}, but exit code {}", show(&sec["outcome"]["exit_code"])));
    }
    let failures = sec["failures"].as_array().map(Vec::as_slice).unwrap_or_default();
    if let Some(i) = failures.iter().position(|f| f["injected"] != true) {
        say(format!(
            "report: outcome: status {status:?}, but failures[{i}] is not a planted fault found as predicted (injected)"
        ));
    }
    if s["unexpected_failures"].as_u64() != Some(0) {
        say(format!(
            "report: outcome: status {status:?}, but summary.unexpected_failures is {}",
            show(&s["unexpected_failures"])
        ));
    }
    if let Some(n) = sec["scenario"]["unexplained_corrupt"].as_u64().filter(|&n| n > 0) {
        say(format!("report: outcome: status {status:?}, but scenario.unexplained_corrupt is {n}"));
    }
    let (planted, detected) = (s["injections_planted"].as_u64(), s["injections_detected"].as_u64());
    let races = sec["scenario"]["races"].as_array().into_iter().flatten().filter(|r| r["fencing"] == "unfenced").count();
    let regions = sec["regions"].as_array().map(Vec::as_slice).unwrap_or_default();
    let region_planted: u64 = regions.iter().map(|r| r["injections_planted"].as_u64().unwrap_or(0)).sum();
    for (k, r) in regions.iter().enumerate() {
        if r["injections_planted"] != r["injections_detected"] || r["unexpected_failures"].as_u64() != Some(0) {
            say(format!(
                "report: outcome: status {status:?}, but regions[{k}] detected {} of {} planted faults with {} unexpected failures",
                show(&r["injections_detected"]),
                show(&r["injections_planted"]),
                show(&r["unexpected_failures"])
            ));
        }
        if let Some(i) = r["failures"].as_array().into_iter().flatten().position(|f| f["injected"] != true) {
            say(format!(
                "report: outcome: status {status:?}, but regions[{k}].failures[{i}] is not a planted fault found as predicted (injected)"
            ));
        }
    }
    if planted != detected || (planted.unwrap_or(0) == 0 && races == 0 && region_planted == 0) {
        say(format!(
            "report: outcome: status {status:?}, but summary.injections_detected is {} of {} planted",
            show(&s["injections_detected"]),
            show(&s["injections_planted"])
        ));
    }
    if let Some(i) = sec["injections"].as_array().into_iter().flatten().position(|j| j["detected"] != true) {
        say(format!("report: outcome: status {status:?}, but injections[{i}] was not detected"));
    }
    let compared = &s["slices_compared"];
    if !compared.is_null() && (compared != &s["blocks_checked"] || compared.as_u64() == Some(0)) {
        say(format!(
            "report: outcome: status {status:?}, but summary.slices_compared is {} of {} slices checked",
            show(compared),
            show(&s["blocks_checked"])
        ));
    }
}

/// A scenario's state lanes (`regions` of `run --scenario` on a hybrid model,
/// [`crate::scenario::state`]) re-derived from the report's configuration: each lane's layout
/// and slots as `sweep::regions::scenario_lanes` gives them (all present, in order, in a run
/// that ended clean or corrupt); pages compared = requests verified × layers, runs compared =
/// pages × the page's runs, bytes moved = requests verified × a request's state READ (0 only
/// for a lane left out, which a clean run cannot have); every listed failure in the lane's
/// layers and slots, with the state id of the request it names; no planted fault; a clean run
/// with no corrupt page. Which slot a request had is not re-derived (it follows the scheduler's
/// timing-dependent order).
fn scenario_region_checks(sec: &Value, cfg: &crate::sweep::RunConfig, regions: &[Value], say: &mut dyn FnMut(String)) {
    use crate::scenario::state::StateLane;
    let lanes = match crate::sweep::regions::scenario_lanes(cfg) {
        Ok(l) => l,
        Err(e) => {
            if !regions.is_empty() {
                say(format!("report: regions listed, but its config plans no state lanes: {e}"));
            }
            return;
        }
    };
    let status = sec["outcome"]["status"].as_str().unwrap_or("");
    let clean = status == "clean" || sec["outcome"]["exit_code"].as_u64() == Some(0);
    let ran = status != "running" && sec["outcome"]["exit_code"].as_u64().is_some_and(|c| c <= 1 || c == 6);
    if (ran && regions.len() != lanes.len()) || regions.len() > lanes.len() {
        say(format!(
            "report: {} region(s) listed, but the run's configuration moves {} state lane(s)",
            regions.len(),
            lanes.len()
        ));
    }
    let verified = sec["scenario"]["requests_verified"].as_u64().unwrap_or(0);
    for (k, (r, lane)) in regions.iter().zip(&lanes).enumerate() {
        let at = format!("report: regions[{k}] ({})", show(&r["name"]));
        let layers = lane.layers.len() as u64;
        let want = [
            ("kind", Value::from("state")),
            ("name", Value::from(lane.name.clone())),
            ("rank", Value::from(lane.rank)),
            ("layers", Value::from(layers)),
            ("units", Value::from(lane.slots)),
            ("page_bytes", Value::from(lane.page_bytes)),
            ("page_stride_bytes", Value::from(lane.page_stride_bytes)),
            ("unit", Value::from("slot")),
            ("descriptors_per_page", Value::from(lane.descriptors.len() as u64)),
            ("prefill_ranks", Value::from(vec![lane.rank])),
            ("injections_planted", Value::from(0u64)),
        ];
        for (field, v) in want {
            if r[field] != v {
                say(format!("{at}: {field} is {}, but the run's configuration gives {v}", show(&r[field])));
            }
        }
        let pages = verified * layers;
        if ran && r["pages_compared"].as_u64() != Some(pages) {
            say(format!(
                "{at}: pages_compared is {}, but {verified} request(s) verified × {layers} layer(s) is {pages}",
                show(&r["pages_compared"])
            ));
        }
        let runs = r["pages_compared"].as_u64().unwrap_or(0) * lane.runs.len() as u64;
        if r["runs_compared"].as_u64() != Some(runs) {
            say(format!("{at}: runs_compared is {}, but its pages hold {runs} row runs", show(&r["runs_compared"])));
        }
        let bytes = verified * lane.bytes_per_request();
        let moved = r["bytes_moved"].as_u64();
        if ran && moved != Some(bytes) && (moved != Some(0) || clean) {
            say(format!(
                "{at}: bytes_moved is {}, but {verified} request(s)' state READs move {bytes}{}",
                show(&r["bytes_moved"]),
                if clean { "" } else { " (or 0, left out)" }
            ));
        }
        let corrupt = r["pages_corrupt"].as_u64().unwrap_or(u64::MAX);
        if corrupt > r["pages_compared"].as_u64().unwrap_or(0) {
            say(format!("{at}: pages_corrupt is {corrupt}, more than the pages compared"));
        }
        if clean && corrupt != 0 {
            say(format!("{at}: pages_corrupt is {corrupt} in a clean run"));
        }
        let failures = r["failures"].as_array().map(Vec::as_slice).unwrap_or_default();
        let unexpected = r["unexpected_failures"].as_u64().unwrap_or(u64::MAX);
        // Each corrupt page has from one to all of its runs wrong; the listed failures are
        // some of those runs, and when all are listed their pages are exactly the corrupt ones.
        let per_page = lane.runs.len() as u64;
        let pages: std::collections::BTreeSet<(u64, u64)> = failures
            .iter()
            .map(|f| (f["request"].as_u64().unwrap_or(u64::MAX), f["layer"].as_u64().unwrap_or(u64::MAX)))
            .collect();
        let all_listed = failures.len() as u64 == unexpected;
        if (failures.len() as u64) > unexpected
            || unexpected < corrupt
            || unexpected > corrupt.saturating_mul(per_page)
            || (pages.len() as u64) > corrupt
            || (all_listed && pages.len() as u64 != corrupt)
        {
            say(format!(
                "{at}: {} failure(s) listed on {} page(s), unexpected_failures {}, pages_corrupt {corrupt} ({per_page} runs a page)",
                failures.len(),
                pages.len(),
                show(&r["unexpected_failures"])
            ));
        }
        for (j, f) in failures.iter().enumerate() {
            if !f["layer"].as_u64().is_some_and(|l| lane.layers.contains(&(l as u32))) {
                say(format!("{at}: failures[{j}]: layer {} is not one of the region's", show(&f["layer"])));
            }
            if f["unit"].as_u64().is_none_or(|u| u >= lane.slots as u64) {
                say(format!("{at}: failures[{j}]: slot {} is not one of its {}", show(&f["unit"]), lane.slots));
            }
            match f["request"].as_u64() {
                Some(q) if f["id"].as_u64() == Some(StateLane::state_id(cfg.seed, q) as u64) => {}
                Some(q) => say(format!(
                    "{at}: failures[{j}]: id {}, but request {q}'s state id is {}",
                    show(&f["id"]),
                    StateLane::state_id(cfg.seed, q)
                )),
                None => say(format!("{at}: failures[{j}]: names no request")),
            }
            if f["injected"].as_bool() == Some(true) {
                say(format!("{at}: failures[{j}]: marked injected, but nothing is planted in a scenario's state"));
            }
            if serde_json::from_value::<crate::core::verify::Class>(f["class"].clone()).is_err() {
                say(format!("{at}: failures[{j}]: class {} is no class", show(&f["class"])));
            }
        }
    }
}

/// A hybrid model's `regions` ([`crate::sweep::regions`]) re-derived from the report's
/// configuration: each region's layout, units and bytes moved as the run's plan gives them
/// (all of the plan's regions present, in its order); pages corrupt at most pages compared,
/// every listed failure's layer one of the region's, its unit one of the pool's and its `id`
/// the logical id the plan puts there; a clean run with no corrupt region page, and a run
/// with one not clean.
fn region_checks(sec: &Value, say: &mut dyn FnMut(String)) {
    let regions = sec["regions"].as_array().map(Vec::as_slice).unwrap_or_default();
    let Ok(cfg) = serde_json::from_value::<crate::sweep::RunConfig>(sec["config"].clone()) else {
        if !regions.is_empty() {
            say("report: regions listed, but config is not a run's configuration".into());
        }
        return;
    };
    if cfg.scenario.is_some() {
        return scenario_region_checks(sec, &cfg, regions, say);
    }
    let plans = match crate::sweep::regions::plans(&cfg) {
        Ok(p) => p,
        Err(e) => {
            if !regions.is_empty() {
                say(format!("report: regions listed, but its config plans none: {e}"));
            }
            return;
        }
    };
    let status = sec["outcome"]["status"].as_str().unwrap_or("");
    // A self-test that passed has corrupt pages: its planted faults (self_test_checks).
    let clean =
        status == "clean" || (sec["outcome"]["exit_code"].as_u64() == Some(0) && status != crate::report::SELF_TEST_PASSED);
    let ran = status != "running" && sec["outcome"]["exit_code"].as_u64().is_some_and(|c| c <= 1);
    // A run that ended clean or corrupt moved every planned region (a transport error may stop
    // it before the regions).
    if (clean && regions.len() != plans.len()) || regions.len() > plans.len() {
        say(format!("report: {} region(s) listed, but the run's configuration plans {}", regions.len(), plans.len()));
    }
    let mut corrupt_pages = 0;
    for (k, (r, p)) in regions.iter().zip(&plans).enumerate() {
        let at = format!("report: regions[{k}] ({})", show(&r["name"]));
        let units = p.units as u64;
        let layers = p.region.layers.len() as u64;
        let want = [
            ("kind", Value::from(p.region.kind.clone())),
            ("name", Value::from(p.region.name.clone())),
            ("rank", Value::from(p.rank)),
            ("layers", Value::from(layers)),
            ("units", Value::from(units)),
            ("page_bytes", Value::from(p.region.page_bytes)),
            ("page_stride_bytes", Value::from(p.region.page_stride_bytes)),
            ("unit", Value::from(crate::sweep::regions::unit_name(p.region.unit))),
            ("descriptors_per_page", Value::from(p.descriptors_per_page())),
            ("prefill_ranks", Value::from(p.sources.iter().map(|s| s.rank).collect::<Vec<_>>())),
        ];
        for (field, v) in want {
            if r[field] != v {
                say(format!("{at}: {field} is {}, but the run's configuration gives {v}", show(&r[field])));
            }
        }
        // What the descriptors move, the planted faults applied; 0 only for a region left out
        // of the transfer, which a clean run cannot have.
        let faults = crate::sweep::regions::plan_faults(&cfg, p);
        let all: u64 = if faults.is_empty() { p.bytes() } else { p.faulted_pairs(&faults).iter().map(|x| x.len).sum() };
        let moved = r["bytes_moved"].as_u64();
        if moved != Some(all) && (moved != Some(0) || clean) {
            say(format!(
                "{at}: bytes_moved is {}, but its descriptors move {all}{}",
                show(&r["bytes_moved"]),
                if clean { "" } else { " (or 0, left out)" }
            ));
        }
        if r["injections_planted"].as_u64().unwrap_or(0) != faults.len() as u64 {
            say(format!(
                "{at}: injections_planted is {}, but the run's configuration plants {}",
                show(&r["injections_planted"]),
                faults.len()
            ));
        }
        if r["injections_detected"].as_u64().unwrap_or(0) > faults.len() as u64 {
            say(format!(
                "{at}: injections_detected is {}, more than the {} planted",
                show(&r["injections_detected"]),
                faults.len()
            ));
        }
        if clean && r["unexpected_failures"].as_u64().unwrap_or(0) != 0 {
            say(format!("{at}: unexpected_failures is {} in a clean run", show(&r["unexpected_failures"])));
        }
        if !r["seconds"].as_f64().is_some_and(|x| x.is_finite() && x >= 0.0) {
            say(format!("{at}: seconds is {}, not a duration", show(&r["seconds"])));
        }
        if !r["failures"].is_array() {
            say(format!("{at}: failures is {}, not a list", show(&r["failures"])));
        }
        let want_runs = layers * units * p.runs.len() as u64;
        if ran && r["runs_compared"].as_u64() != Some(want_runs) {
            say(format!("{at}: runs_compared is {}, but its pages hold {want_runs} row runs", show(&r["runs_compared"])));
        }
        let (compared, corrupt) = (r["pages_compared"].as_u64(), r["pages_corrupt"].as_u64().unwrap_or(u64::MAX));
        if ran && compared != Some(layers * units) {
            say(format!("{at}: pages_compared is {}, but it has {} pages", show(&r["pages_compared"]), layers * units));
        }
        if corrupt > compared.unwrap_or(0) {
            say(format!("{at}: pages_corrupt is {corrupt}, more than the pages compared"));
        }
        corrupt_pages += corrupt.min(u32::MAX as u64);
        let failures = r["failures"].as_array().map(Vec::as_slice).unwrap_or_default();
        if corrupt == 0 && !failures.is_empty() {
            say(format!("{at}: {} failure(s) listed, but pages_corrupt is 0", failures.len()));
        }
        for (j, f) in failures.iter().enumerate() {
            let layer = f["layer"].as_u64();
            let unit = f["unit"].as_u64().filter(|u| *u < units);
            if !layer.is_some_and(|l| p.region.layers.contains(&(l as u32))) {
                say(format!("{at}: failures[{j}]: layer {} is not one of the region's", show(&f["layer"])));
            }
            match unit {
                None => say(format!("{at}: failures[{j}]: unit {} is not one of its {units}", show(&f["unit"]))),
                Some(u) => {
                    let due = p.id_of(cfg.seed, p.decode_unit(u as u32));
                    if f["id"].as_u64() != Some(due as u64) {
                        say(format!(
                            "{at}: failures[{j}]: id {}, but the plan puts logical id {due} in unit {u}",
                            show(&f["id"])
                        ));
                    }
                }
            }
            if serde_json::from_value::<crate::core::verify::Class>(f["class"].clone()).is_err() {
                say(format!("{at}: failures[{j}]: class {} is no class", show(&f["class"])));
            }
        }
        region_injection_checks(&cfg, p, r, &at, ran, say);
    }
    // A run that ended clean or corrupt with no corrupt attention slice went on to move every
    // planned region.
    let attention_clean = sec["summary"]["blocks_corrupt"].as_u64() == Some(0);
    if ran && attention_clean && !clean && regions.len() != plans.len() {
        say(format!(
            "report: {} region(s) listed, but the run's configuration plans {} and its attention pages were clean",
            regions.len(),
            plans.len()
        ));
    }
    if clean && corrupt_pages > 0 {
        say(format!("report: outcome: status {status:?}, but {corrupt_pages} region page(s) are corrupt"));
    }
}

/// A region's planted faults and failures against each other and against what its
/// configuration predicts ([`crate::sweep::regions::predicted_runs`]): each listed injection's
/// class, layer, unit and predicted runs; `injections_detected` = the injections marked
/// detected; and, when no failure was left out (fewer than `max_failures`): `pages_corrupt` =
/// the pages the failures name, `unexpected_failures` = the failures not marked injected, a
/// failure marked injected lies at a run its fault predicts with the predicted class, and an
/// injection is marked detected exactly when each of its predicted runs is a failure marked
/// injected.
fn region_injection_checks(
    cfg: &crate::sweep::RunConfig,
    p: &crate::sweep::regions::RegionPlan,
    r: &Value,
    at: &str,
    ran: bool,
    say: &mut dyn FnMut(String),
) {
    use crate::core::verify::Class;
    let faults = crate::sweep::regions::plan_faults(cfg, p);
    let predicted = crate::sweep::regions::predicted_runs(cfg, p);
    let listed = r["injections"].as_array().map(Vec::as_slice).unwrap_or_default();
    if ran && listed.len() != faults.len() {
        say(format!("{at}: {} injection(s) listed, but the run's configuration plants {}", listed.len(), faults.len()));
    }
    let marked = listed.iter().filter(|j| j["detected"] == true).count() as u64;
    if r["injections_detected"].as_u64() != Some(marked) {
        say(format!(
            "{at}: injections_detected is {}, but {marked} injection(s) are marked detected",
            show(&r["injections_detected"])
        ));
    }
    for (n, (j, (f, runs))) in listed.iter().zip(faults.iter().zip(&predicted)).enumerate() {
        let want = serde_json::json!({
            "kind": f.kind.name(),
            "layer": p.region.layers[f.li as usize],
            "unit": f.unit,
            "predicted": runs.iter().map(|(layer, unit, part, class)| serde_json::json!({
                "layer": layer, "unit": unit, "part": part, "class": class
            })).collect::<Vec<_>>(),
        });
        for field in ["kind", "layer", "unit", "predicted"] {
            if j[field] != want[field] {
                say(format!(
                    "{at}: injections[{n}].{field} is {}, but the configuration plants {}",
                    show(&j[field]),
                    want[field]
                ));
            }
        }
    }
    let failures = r["failures"].as_array().map(Vec::as_slice).unwrap_or_default();
    if failures.len() >= cfg.max_failures {
        return; // some were left out: the counts cannot be re-counted
    }
    let pages: BTreeSet<(u64, u64)> = failures.iter().filter_map(|f| Some((f["layer"].as_u64()?, f["unit"].as_u64()?))).collect();
    if ran && r["pages_corrupt"].as_u64() != Some(pages.len() as u64) {
        say(format!("{at}: pages_corrupt is {}, but the failures name {} page(s)", show(&r["pages_corrupt"]), pages.len()));
    }
    let unexpected = failures.iter().filter(|f| f["injected"] != true).count() as u64;
    if r["unexpected_failures"].as_u64() != Some(unexpected) {
        say(format!(
            "{at}: unexpected_failures is {}, but {unexpected} failure(s) are not marked injected",
            show(&r["unexpected_failures"])
        ));
    }
    let key = |layer: u32, unit: u32, part: &str| (layer as u64, unit as u64, part.to_string());
    let due: BTreeMap<(u64, u64, String), Class> =
        predicted.iter().flatten().map(|(l, u, part, c)| (key(*l, *u, part), *c)).collect();
    let mut found: BTreeSet<(u64, u64, String)> = BTreeSet::new();
    for (k, f) in failures.iter().enumerate().filter(|(_, f)| f["injected"] == true) {
        let here = (
            f["layer"].as_u64().unwrap_or(u64::MAX),
            f["unit"].as_u64().unwrap_or(u64::MAX),
            f["part"].as_str().unwrap_or("").to_string(),
        );
        let class = serde_json::from_value::<Class>(f["class"].clone()).ok();
        match due.get(&here) {
            Some(c) if Some(*c) == class => {
                found.insert(here);
            }
            Some(c) => say(format!(
                "{at}: failures[{k}] is marked injected as {}, but its fault predicts {} there",
                show(&f["class"]),
                json!(c)
            )),
            None => say(format!(
                "{at}: failures[{k}] is marked injected, but no planted fault predicts a run at layer {} unit {} {}",
                here.0, here.1, here.2
            )),
        }
    }
    for (n, (j, runs)) in listed.iter().zip(&predicted).enumerate() {
        let all = !runs.is_empty() && runs.iter().all(|(l, u, part, _)| found.contains(&key(*l, *u, part)));
        if ran && (j["detected"] == true) != all {
            say(format!(
                "{at}: injections[{n}].detected is {}, but {} of its predicted runs are failures marked injected",
                show(&j["detected"]),
                if all { "all" } else { "not all" }
            ));
        }
    }
}

/// The report's own claims, checked against each other and re-derived from its
/// configuration (one report, or one ab section), before any dump is looked at:
///
/// - failures listed (or slices dumped) mean the run was not clean and
///   `summary.blocks_corrupt` counts at least that many; each class's listed failures are at
///   most its `summary.by_class` count (over every class either names);
/// - a run that says clean (status `clean` or exit 0) has no corrupt slice (`blocks_corrupt`
///   0, every `by_class` count 0) and compared every slice it checked, at least one
///   (`slices_compared` = `blocks_checked` > 0, when the report has `slices_compared`);
/// - sweep failures carry `iteration` >= 1 (scenario failures, with `request`, count engine
///   steps from 0) and `poison_iteration` = `iteration`;
/// - sweeps: each failure's `expected` identity and `prefill_block` are what the sweep plan of
///   its iteration says for its slot ([`crate::sweep::plan`] of the report's `config`: the
///   logical block id and token base of the slot's group, generation = iteration), its
///   iteration one the run had; each injection reported `detected` has, at every predicted
///   slice, a listed failure of the predicted class (when no failure was left out);
/// - scenarios: each failure's request is one the run admitted and its `expected` identity
///   one of that request's logical blocks, at its own layer and K/V, of a computed generation
///   ([`scenario_identities`]).
fn report_checks(sec: &Value, say: &mut dyn FnMut(String)) {
    region_checks(sec, say);
    let failures = sec["failures"].as_array().map(Vec::as_slice).unwrap_or_default();
    let dumped = sec["dump"]["slices_written"].as_u64().unwrap_or(0) as usize;
    let outcome = &sec["outcome"];
    let summary = &sec["summary"];
    let self_test = outcome["status"] == crate::report::SELF_TEST_PASSED;
    if self_test {
        self_test_checks(sec, say);
    }
    let clean = !outcome.is_null() && !self_test && (outcome["status"] == "clean" || outcome["exit_code"].as_u64() == Some(0));
    if clean {
        let status = outcome["status"].as_str().unwrap_or("");
        let exit = show(&outcome["exit_code"]);
        if !failures.is_empty() || dumped > 0 {
            say(format!(
                "report: outcome: status {status:?} exit {exit}, but {} failures listed and {dumped} slices dumped",
                failures.len()
            ));
        }
        if let Some(n) = summary["blocks_corrupt"].as_u64().filter(|&n| n > 0) {
            say(format!("report: outcome: status {status:?} exit {exit}, but summary.blocks_corrupt is {n}"));
        }
        for (class, n) in summary["by_class"].as_object().into_iter().flatten() {
            if n.as_u64() != Some(0) {
                say(format!("report: outcome: status {status:?} exit {exit}, but summary.by_class.{class} is {}", show(n)));
            }
        }
        if let Some(compared) = summary.get("slices_compared").filter(|v| !v.is_null()) {
            let checked = &summary["blocks_checked"];
            if compared != checked || compared.as_u64() == Some(0) {
                say(format!(
                    "report: outcome: status {status:?} exit {exit}, but summary.slices_compared is {} of {} slices checked: \
                     a clean run compared every slice it checked, at least one",
                    show(compared),
                    show(checked)
                ));
            }
        }
    }
    let corrupt = summary["blocks_corrupt"].as_u64().unwrap_or(0);
    if corrupt < failures.len() as u64 {
        say(format!("report: summary.blocks_corrupt: {corrupt}, but {} failures listed", failures.len()));
    }
    // Each class's listed failures against its count, over the classes either names.
    let mut listed = BTreeMap::<String, u64>::new();
    for f in failures {
        *listed.entry(show(&f["class"])).or_default() += 1;
    }
    let by_class = summary["by_class"].as_object();
    let classes: BTreeSet<String> = listed.keys().cloned().chain(by_class.into_iter().flat_map(|m| m.keys().cloned())).collect();
    for class in classes {
        let n = listed.get(&class).copied().unwrap_or(0);
        let counted = by_class.and_then(|m| m.get(&class)).and_then(Value::as_u64);
        if counted.unwrap_or(0) < n {
            say(format!(
                "report: summary.by_class.{class}: {}, but {n} {class} failures listed",
                counted.map_or("absent".to_string(), |c| c.to_string())
            ));
        }
    }
    let mut sweep_failures = Vec::new();
    for (i, f) in failures.iter().enumerate() {
        let sweep = f.get("request").is_none_or(Value::is_null);
        if sweep && f["iteration"].as_u64().is_some_and(|n| n < 1) {
            say(format!("report: failures[{i}].iteration: {}, sweeps count from 1", show(&f["iteration"])));
        }
        // A sweep poisons iteration n's slots with n; a scenario with its step mod 2^24.
        let (it, pi) = (f["iteration"].as_u64(), f["poison_iteration"].as_u64());
        if (sweep && pi != it) || pi.is_some_and(|p| p >= 1 << 24) {
            say(format!(
                "report: failures[{i}].poison_iteration: {}, {}",
                show(&f["poison_iteration"]),
                if sweep { format!("a sweep's is its iteration ({})", show(&f["iteration"])) } else { "below 2^24".into() }
            ));
        }
        if sweep {
            sweep_failures.push((format!("report: failures[{i}]"), f));
        }
    }
    let config = &sec["config"];
    if config.get("scenario").is_none_or(Value::is_null) {
        let mut plans = Plans::new(config);
        for (name, f) in &sweep_failures {
            plans.check_identity(name, f, say);
        }
        injections(sec, failures, say);
    } else {
        scenario_identities(sec, failures, say);
    }
}

/// Scenario failures against the seeded request load: each names a `request` the run
/// admitted, and its `expected` identity is one of that request's logical blocks — the
/// chained block hashes [`crate::core::workload::Workload`] draws from the report's `config.seed`
/// and `config.scenario.workload` (prefill promises every block of a request under its
/// hash, computed or loaded from the tier) — of the failure's own layer and K/V, with a
/// generation prefill computed in this run: prefill numbers each block it computes 1, 2, …
/// (`scenario::prefill`, [`fingerprint::next_generation`]), so a generation is at least 1 and
/// at most the blocks of every request the run admitted. Which block got which generation
/// follows prefill's scheduler over the run's steps, whose order depends on when transfers
/// and tier loads completed (timing no report records), so it is bounded, not re-derived. Said once when the
/// configuration has no seeded load kvprobe can replay.
fn scenario_identities(sec: &Value, failures: &[Value], say: &mut dyn FnMut(String)) {
    let config = &sec["config"];
    let asked: Vec<(usize, u64)> =
        failures.iter().enumerate().filter_map(|(i, f)| f["request"].as_u64().map(|r| (i, r))).collect();
    if asked.is_empty() {
        return;
    }
    let workload = serde_json::from_value::<crate::core::workload::WorkloadConfig>(config["scenario"]["workload"].clone());
    let (Ok(workload), Some(seed)) = (workload, config["seed"].as_u64()) else {
        say("report: config: no seeded request load (config.seed, config.scenario.workload), so no expected identity of a \
             scenario failure is re-derived"
            .into());
        return;
    };
    let share = |x: f64| x.is_finite() && (0.0..=1.0).contains(&x);
    let ok = workload.min_blocks >= 1
        && workload.min_blocks <= workload.max_blocks
        && workload.max_blocks <= 1 << 16
        && share(workload.prefix_share)
        && share(workload.abort_rate);
    if !ok {
        say(format!("report: config.scenario.workload: {workload:?} is not a load kvprobe runs, so no identity is re-derived"));
        return;
    }
    let admitted = sec["scenario"]["requests_admitted"].as_u64();
    let wanted: BTreeSet<u64> = asked.iter().map(|&(_, r)| r).filter(|&r| admitted.is_none_or(|a| r < a)).collect();
    // The load is replayed up to the last request named (bounded by what the run admitted,
    // and by REPLAY_BLOCKS drawn blocks so that a forged report cannot make the check spin).
    const REPLAY_BLOCKS: u64 = 1 << 28;
    let mut load = crate::core::workload::Workload::new(workload, seed);
    let mut hashes: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    // The most blocks prefill can have computed: every block of every admitted request (when
    // the load replays that far within the bound).
    let mut computable: Option<u64> = None;
    if let Some(&last) = wanted.last() {
        if (last + 1).saturating_mul(workload.max_blocks as u64) > REPLAY_BLOCKS {
            say(format!(
                "report: failures name request {last}: replaying the seeded load that far (up to {} blocks) is more than \
                 report check does ({REPLAY_BLOCKS} blocks), so no expected identity of a scenario failure is re-derived",
                (last + 1).saturating_mul(workload.max_blocks as u64)
            ));
            return;
        }
        let upto = match admitted {
            Some(a) if a.saturating_mul(workload.max_blocks as u64) <= REPLAY_BLOCKS => a.max(last + 1),
            _ => last + 1,
        };
        let mut blocks = 0u64;
        for id in 0..upto {
            let spec = load.next_request();
            if admitted.is_some_and(|a| id < a) {
                blocks += spec.hashes.len() as u64;
            }
            if wanted.contains(&id) {
                hashes.insert(id, spec.hashes);
            }
        }
        computable = admitted.filter(|&a| upto >= a).map(|_| blocks);
    }
    for (i, r) in asked {
        let f = &failures[i];
        let name = format!("report: failures[{i}]");
        let Some(h) = hashes.get(&r) else {
            say(format!("{name}: request {r}: the run admitted {}", admitted.map_or("fewer".into(), |a| a.to_string())));
            continue;
        };
        let e = &f["expected"];
        if e["layer"] != f["layer"] || e["kv"] != f["kv"] {
            say(format!(
                "{name}: expected: {}, but the failure is at layer {} {}: a slice holds its own layer and K/V",
                show(e),
                show(&f["layer"]),
                show(&f["kv"])
            ));
        }
        match e["block"].as_u64() {
            Some(b) if h.iter().any(|&x| x as u64 == b) => {}
            _ => say(format!(
                "{name}: expected: {}, but request {r} of the seeded load (seed, config.scenario.workload) has logical blocks {h:?}",
                show(e)
            )),
        }
        match (e["generation"].as_u64(), computable) {
            (Some(g), Some(n)) if g > n && n < fingerprint::SKIP_GEN as u64 - 1 => say(format!(
                "{name}: expected: {}: prefill numbers the blocks it computes 1, 2, ..., and the {} admitted request(s) of the \
                 seeded load have {n} block(s) in all: generation {g} was never computed in this run",
                show(e),
                admitted.unwrap_or(0)
            )),
            (Some(g), _) if g >= 1 && g < fingerprint::SKIP_GEN as u64 => {}
            _ => say(format!("{name}: expected: {}: a generation prefill computes is 1 up to 2^32 - 1 (exclusive)", show(e))),
        }
    }
}

/// The sweep plans of a report's iterations ([`crate::sweep::plan`] of its `config`), made
/// as failures ask for them (the last one kept: failures are listed in iteration order, and a
/// plan holds tables of the pool's size); said once when the config is not one kvprobe runs.
struct Plans {
    cfg: std::result::Result<crate::sweep::RunConfig, String>,
    made: Option<(u32, std::result::Result<crate::sweep::Plan, String>)>,
    said: bool,
}

impl Plans {
    fn new(config: &Value) -> Plans {
        let cfg = serde_json::from_value::<crate::sweep::RunConfig>(config.clone()).map_err(|e| e.to_string());
        Plans { cfg, made: None, said: false }
    }

    /// Says where the failure record `f` (named `name`) has another expected identity or
    /// prefill block than the plan of its iteration gives its decode slot, or an iteration
    /// the run never had.
    fn check_identity(&mut self, name: &str, f: &Value, say: &mut dyn FnMut(String)) {
        let cfg = match &self.cfg {
            Ok(c) => c,
            Err(e) => {
                if !std::mem::replace(&mut self.said, true) {
                    say(format!("report: config: not a run configuration, so no expected identity is re-derived: {e}"));
                }
                return;
            }
        };
        let (Some(it), Some(block)) = (f["iteration"].as_u64(), f["block"].as_u64()) else { return };
        if it < 1 || it > cfg.iterations as u64 {
            say(format!("{name}: iteration {it}: the run has iterations 1..={}", cfg.iterations));
            return;
        }
        let it = it as u32;
        if self.made.as_ref().is_none_or(|(n, _)| *n != it) {
            self.made = Some((it, crate::sweep::plan(cfg, it).map_err(|e| e.to_string())));
        }
        let Some((_, plan)) = &self.made else { return };
        let plan = match plan {
            Ok(p) => p,
            Err(e) => {
                if !std::mem::replace(&mut self.said, true) {
                    say(format!("report: config: the sweep plan cannot be made, so no expected identity is re-derived: {e}"));
                }
                return;
            }
        };
        let Some(entry) = plan.dst_table.get(block as usize) else {
            say(format!("{name}: block {block}: decode has {} blocks", plan.dst_table.len()));
            return;
        };
        let (Ok(layer), Ok(kv)) = (
            serde_json::from_value::<u32>(f["layer"].clone()),
            serde_json::from_value::<crate::core::geometry::KvPart>(f["kv"].clone()),
        ) else {
            return;
        };
        let c = SliceCoord { layer, kv, block: block as u32 };
        let want = json!(entry.identity(c));
        if f["expected"] != want {
            say(format!(
                "{name}: expected: {}, but the sweep plan of iteration {it} (seed, config) puts {want} in that slot",
                show(&f["expected"])
            ));
        }
        let src = plan.src_of[block as usize];
        if f["prefill_block"].as_u64() != Some(src as u64) {
            say(format!(
                "{name}: prefill_block: {}, but the sweep plan of iteration {it} moves prefill block {src} there",
                show(&f["prefill_block"])
            ));
        }
    }
}

/// The report's `injections` against its failures: an injection reported `detected` has, at
/// each slice it predicts, a listed failure of its iteration of the predicted class; checked
/// only when no failure was left out of the list (`--max-failures`).
fn injections(sec: &Value, failures: &[Value], say: &mut dyn FnMut(String)) {
    let omitted = sec["summary"]["failures_omitted"].as_u64().unwrap_or(0);
    if omitted > 0 {
        return;
    }
    let at = |v: &Value| ["layer", "kv", "block", "tp_rank"].map(|k| v.get(k).cloned().unwrap_or(Value::Null));
    for (k, inj) in sec["injections"].as_array().into_iter().flatten().enumerate() {
        if inj["detected"] != true {
            continue;
        }
        for h in inj["predicted"].as_array().into_iter().flatten() {
            let here: Vec<&Value> = failures
                .iter()
                .filter(|f| f["iteration"] == inj["iteration"] && at(f) == at(h) && f["stray_check"].is_null())
                .collect();
            let slice = format!(
                "iteration {} layer {} {} block {}",
                show(&inj["iteration"]),
                show(&h["layer"]),
                show(&h["kv"]),
                show(&h["block"])
            );
            if here.is_empty() {
                say(format!(
                    "report: injections[{k}] ({}): detected, but no failure is listed at {slice}, where it predicts {}",
                    show(&inj["kind"]),
                    show(&h["class"])
                ));
            } else if !here.iter().any(|f| f["class"] == h["class"]) {
                say(format!(
                    "report: injections[{k}] ({}): detected, but the failure at {slice} is {}, not the predicted {}",
                    show(&inj["kind"]),
                    show(&here[0]["class"]),
                    show(&h["class"])
                ));
            }
        }
    }
}

/// The slice's name in messages: `iteration 2 layer 1 K block 17`.
fn slice_name(e: &DumpEntry) -> String {
    let f = &e.failure;
    format!("iteration {} layer {} {} block {}", f.iteration, f.layer, f.kv, f.block)
}

/// What the dumped bytes say, field by field (as the report writes them).
fn derive(e: &DumpEntry, seed: u64, shape: &RowShape, actual: &[u8]) -> BTreeMap<&'static str, Value> {
    let f = &e.failure;
    let len = actual.len();
    let poison_check = f.stray_check == Some(crate::report::StrayCheck::Poison);
    let want = if poison_check {
        let mut p = vec![0u8; len];
        fingerprint::poison(&mut p, f.slot, f.poison_iteration);
        p
    } else {
        fingerprint::expected(seed, &shape.slice(f.expected))
    };
    let bad = actual.iter().zip(&want).filter(|(a, b)| a != b).count() as u64;
    let first = actual.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(len) as u64;
    let mut d = BTreeMap::new();
    d.insert("expected_digest", json!(fingerprint::digest(&want)));
    d.insert("actual_digest", json!(fingerprint::digest(actual)));
    d.insert("first_bad_offset", json!(first));
    d.insert("bad_bytes", json!(bad));
    if f.class == crate::core::verify::Class::Stray {
        // The stray-write checks name no class beyond `stray`: what landed is the first tag
        // that decodes from the first bad byte on.
        d.insert("class", json!("stray"));
        d.insert("observed", json!(fingerprint::observed_identity(actual, seed, shape, first)));
        d.insert("bit_flips", Value::Null);
        d.insert("sectors", Value::Null);
        d.insert("displacement", Value::Null);
        d.insert("rows", Value::Null);
    } else {
        let v = crate::core::verify::classify_against(actual, &want, &shape.slice(f.expected), seed, f.slot, f.poison_iteration);
        // A `late` slice's dump holds the bytes the verify judged: they derive its
        // `judged_class` (the slice changed only after the verdict).
        let late = crate::core::verify::Class::Late;
        let class = if f.class == late && f.judged_class == Some(v.class) { late } else { v.class };
        d.insert("class", json!(class));
        d.insert("observed", json!(v.observed));
        d.insert("bit_flips", json!(v.bit_flips));
        d.insert("sectors", json!(v.sectors));
        d.insert("displacement", json!(v.displacement.map(|x| x.to_string())));
        d.insert("rows", json!(v.rows));
    }
    d
}

/// Fields that must agree between the index's record and the report's.
const RECORD_FIELDS: [&str; 20] = [
    "iteration",
    "layer",
    "kv",
    "block",
    "class",
    "slot",
    "poison_iteration",
    "first_bad_offset",
    "bad_bytes",
    "expected_digest",
    "actual_digest",
    "observed",
    "expected",
    "bit_flips",
    "sectors",
    "displacement",
    "rows",
    "stray_check",
    "tp_rank",
    "judged_class",
];

fn show(v: &Value) -> String {
    match v {
        Value::Null => "none".into(),
        Value::String(s) => s.clone(),
        v => v.to_string(),
    }
}

/// One dump folder and its report section, as [`section_head`] found them.
struct Section {
    /// `row NAME: ` in an ab bundle, else empty.
    label: String,
    /// The dump folder in the bundle (`dump/`, `dump/NAME/`).
    dir: String,
    index: DumpIndex,
    /// The report's failures.
    failures: Vec<Value>,
    /// Per index entry: its rows ([`crate::report::dump::rank_shape`]), or `None` when its bytes
    /// are not re-derived (why was said: a rank or token base the geometry cannot name, a
    /// file outside `slices/` or named twice, a size not the slices').
    shapes: Vec<Option<RowShape>>,
    /// Per index entry: its record in the report's failures (`report_index`, or the failure
    /// with its coordinates when it has none).
    rec_of: Vec<Option<usize>>,
    /// The report's `summary.by_class`.
    by_class: BTreeMap<String, u64>,
    /// Some entry of the index has `observed_regenerate`: the dump was made by a kvprobe that
    /// writes it wherever it applies, so an entry without one where it applies is a
    /// disagreement. (A dump of an older kvprobe has none anywhere, and its absence is not one.)
    writes_observed_regenerate: bool,
}

/// A failure record's coordinates, as the report and the index write them: two records with
/// the same are the same failing slice.
fn coordinates(v: &Value) -> [Value; 7] {
    ["iteration", "layer", "kv", "block", "tp_rank", "stray_check", "request"].map(|k| v.get(k).cloned().unwrap_or(Value::Null))
}

/// Checks a dump folder's `index.json` against its report section `sec` without the slice
/// bytes: seed, geometry, fingerprint, the `dump` block, TP sizes; each entry's file (in
/// `slices/`, named by one entry only), size, slot, rank, `regenerate` command, expected
/// coordinates, the report's record (`report_index` unique; an entry without one is in no
/// listed failure, and the list was full) field by field, and the entry's record re-derived
/// from the sweep plan. Disagreements go to `said`.
fn section_head(
    label: String,
    dir: String,
    index: DumpIndex,
    sec: &Value,
    bundle: &Path,
    said: &mut Vec<String>,
) -> Result<Section> {
    let bundle = bundle.display();
    if index.fingerprint != fingerprint::FORMAT {
        return Err(Error::Usage(format!(
            "{bundle}: {label}{dir}index.json: fingerprint {:?}: this kvprobe checks {} (docs/fingerprint.md \"Fingerprint format\"); \
             the dump's own scripts/fingerprint_ref.py regenerates its slices",
            index.fingerprint,
            fingerprint::FORMAT
        )));
    }
    let mut say = |s: String| said.push(format!("{label}{s}"));
    let config = &sec["config"];
    if config["fingerprint"] != json!(index.fingerprint) {
        say(format!(
            "report: config.fingerprint: report {}, {dir}index.json {}",
            show(&config["fingerprint"]),
            index.fingerprint
        ));
    }
    if config["seed"].as_u64() != Some(index.seed) {
        say(format!("{dir}index.json: seed: report {}, index {}", show(&config["seed"]), index.seed));
    }
    // seed_hex is the seed again, "0x" + 16 hex digits, in the report and in the index.
    if let Some(seed) = config["seed"].as_u64() {
        let want = fingerprint::seed_hex(seed);
        if config["seed_hex"].as_str() != Some(want.as_str()) {
            say(format!("report: config.seed_hex: report {}, seed {seed} is {want}", show(&config["seed_hex"])));
        }
    }
    let want = fingerprint::seed_hex(index.seed);
    if index.seed_hex != want {
        say(format!("{dir}index.json: seed_hex: index {}, seed {} is {want}", index.seed_hex, index.seed));
    }
    let dumped = crate::report::dump::dumped_geometry(config);
    if index.geometry != *dumped {
        say(format!("{dir}index.json: geometry: report {}, index {}", show(dumped), show(&index.geometry)));
    }
    // The report's dump block and the index say the same.
    match sec.get("dump").filter(|d| !d.is_null()) {
        None if !index.slices.is_empty() => {
            say(format!("report: dump: none, but {dir}index.json lists {} slices", index.slices.len()))
        }
        None => {}
        Some(d) => {
            let sum: u64 = index.slices.iter().map(|e| e.bytes * (1 + e.received_file.is_some() as u64)).sum();
            let truncated = index.dump_truncated.as_ref().map_or(Value::Null, |t| json!(t));
            for (k, want) in [
                ("slices_written", json!(index.slices.len() as u64)),
                ("bytes_written", json!(sum)),
                ("max_bytes", json!(index.max_bytes)),
                ("dump_truncated", truncated),
            ] {
                let got = d.get(k).cloned().unwrap_or(Value::Null);
                if got != want {
                    say(format!("report: dump.{k}: report {}, {dir}index.json {}", show(&got), show(&want)));
                }
            }
        }
    }
    let slice_bytes = dumped["slice_bytes"].as_u64();
    if slice_bytes != Some(index.slice_bytes) {
        say(format!("{dir}index.json: slice_bytes: report {}, index {}", show(&dumped["slice_bytes"]), index.slice_bytes));
    }
    let field = if dumped == &config["geometry"] { "geometry" } else { "decode_geometry" };
    let geometry = geometry_of(dumped).map_err(|e| Error::Usage(format!("{bundle}: {label}report: config.{field}: {e}")))?;
    if let Ok(n) = geometry.slice_bytes() {
        if slice_bytes != Some(n) {
            say(format!("report: config.{field}.slice_bytes: report {}, geometry {n}", show(&dumped["slice_bytes"])));
        }
        if index.slice_bytes != n {
            say(format!("{dir}index.json: slice_bytes: index {}, geometry {n}", index.slice_bytes));
        }
    }
    // TP ranks (`config.tp`): each dumped slice's rows start at its decode rank's first head.
    let tp: Option<crate::core::pairing::tp::Tp> = match config.get("tp").filter(|t| !t.is_null()) {
        None => None,
        Some(t) => Some(
            serde_json::from_value(t.clone())
                .map_err(|e| Error::Usage(format!("{bundle}: {label}report: config.tp: not TP sizes: {e}")))?,
        ),
    };
    if let Some(t) = tp {
        t.check().map_err(|e| Error::Usage(format!("{bundle}: {label}report: config.tp: not TP sizes kvprobe runs: {e}")))?;
    }
    // Prefill's geometry is the report's too when decode's is what was dumped; the two sides
    // and the TP sizes must be one pair kvprobe would run (pairing::Sides::check).
    if field == "decode_geometry" {
        let p = geometry_of(&config["geometry"])
            .map_err(|e| Error::Usage(format!("{bundle}: {label}report: config.geometry: {e}")))?;
        if let Err(why) = crate::core::pairing::Sides::check(&p, &geometry, config["permute_local_kv"] == true, tp) {
            say(format!("report: config.geometry, config.decode_geometry and config.tp are not one pair: {why}"));
        }
    } else if let Some(t) = tp
        && let Err(why) = crate::core::pairing::Sides::check(&geometry, &geometry, config["permute_local_kv"] == true, Some(t))
    {
        say(format!("report: config.geometry and config.tp are not one pair: {why}"));
    }
    let failures = sec["failures"].as_array().cloned().unwrap_or_default();
    let max_failures = config["max_failures"].as_u64();
    let sweep = config.get("scenario").is_none_or(Value::is_null);
    let mut plans = Plans::new(config);
    let (mut shapes, mut rec_of) = (Vec::new(), Vec::new());
    // report_index -> the entry that gave it; file -> the entry that named it.
    let (mut pointed, mut files) = (BTreeMap::<usize, String>::new(), BTreeMap::<&str, String>::new());
    for e in &index.slices {
        let name = slice_name(e);
        let ev = serde_json::to_value(&e.failure).unwrap_or(Value::Null);
        let mut readable = true;
        // Slice files lie in `slices/`, one file per entry.
        let in_slices =
            e.file.strip_prefix("slices/").is_some_and(|f| !f.is_empty() && !f.contains('/') && f != "." && f != "..");
        if !in_slices {
            say(format!("{name}: file {:?}: not a file in {dir}slices/", e.file));
            readable = false;
        }
        if let Some(other) = files.insert(&e.file, name.clone()) {
            say(format!("{name}: file {}: also named by {other}", e.file));
            readable = false;
        }
        // Its record in the report: report_index, given to one entry only; without one, no
        // listed failure is this slice, and the list was full when it was found.
        let found = failures.iter().position(|r| coordinates(r) == coordinates(&ev));
        let rec = match (e.report_index, found) {
            (Some(i), _) => {
                if let Some(other) = pointed.insert(i, name.clone()) {
                    say(format!("{name}: report_index {i}: also given to {other}"));
                }
                if i >= failures.len() {
                    say(format!("{name}: report_index {i}: the report lists {} failures", failures.len()));
                    None
                } else {
                    Some(i)
                }
            }
            (None, Some(j)) => {
                say(format!("{name}: report_index: none, but the report's failures[{j}] is this slice"));
                Some(j)
            }
            (None, None) => {
                if max_failures.is_some_and(|m| (failures.len() as u64) < m) {
                    say(format!(
                        "{name}: report_index: none, but the report lists {} failures of --max-failures {}: \
                         a slice found while the list had room is listed",
                        failures.len(),
                        show(&config["max_failures"])
                    ));
                }
                None
            }
        };
        if let Some(i) = rec {
            for k in RECORD_FIELDS {
                let (r, x) = (failures[i].get(k).cloned().unwrap_or(Value::Null), ev.get(k).cloned().unwrap_or(Value::Null));
                if r != x {
                    say(format!("{name}: {k}: report {}, index {}", show(&r), show(&x)));
                }
            }
        } else if sweep {
            // Not in the report: its own record against the plan.
            plans.check_identity(&format!("{dir}index.json: {name}"), &ev, &mut say);
        }
        rec_of.push(rec);
        if e.bytes != index.slice_bytes {
            say(format!("{name}: bytes: index {} (slice_bytes {})", e.bytes, index.slice_bytes));
            readable = false;
        }
        if let Some(r) = e.failure.tp_rank
            && tp.is_none_or(|t| r >= t.decode)
        {
            say(format!(
                "{name}: tp_rank {r}: the report's config.tp has {}",
                tp.map_or("no TP ranks".to_string(), |t| format!("{} decode ranks", t.decode))
            ));
            shapes.push(None);
            continue;
        }
        let shape = crate::report::dump::rank_shape(&RowShape::of(&geometry), tp.as_ref(), e.failure.tp_rank);
        if let Err(err) = shape.validate(e.failure.expected.token_base) {
            say(format!("{name}: expected.token_base {}: {err}", e.failure.expected.token_base));
            shapes.push(None);
            continue;
        }
        let fname = e.file.rsplit('/').next().unwrap_or(&e.file);
        // A TP slice's file name ends with its rank (`-tpR.bin`).
        let named_rank = fname.split_once("-tp").map(|(_, r)| r.chars().take_while(char::is_ascii_digit).collect::<String>());
        if let Some(r) = &named_rank
            && Some(r.as_str()) != e.failure.tp_rank.map(|x| x.to_string()).as_deref()
        {
            say(format!("{name}: tp_rank: index {}, file name {fname}", show(&json!(e.failure.tp_rank))));
        }
        let want_cmd = crate::report::dump::regenerate_command(&e.failure, index.seed, &shape, e.bytes, fname);
        if e.regenerate != want_cmd {
            say(format!("{name}: regenerate: index {:?}, expected {want_cmd:?}", e.regenerate));
        }
        {
            let g = &geometry;
            let c = SliceCoord { layer: e.failure.layer, kv: e.failure.kv, block: e.failure.block };
            let in_pool = c.layer < g.num_layers && c.block < g.num_blocks && g.parts().contains(&c.kv);
            // u64: a pool of 2^31 blocks has global slices past u32.
            let slot = c.layer as u64 * g.slices_per_layer() + g.slice_index_in_layer(c.kv, c.block);
            if !in_pool || slot != e.failure.slot as u64 {
                say(format!(
                    "{name}: slot: index {}, geometry {}",
                    e.failure.slot,
                    if in_pool { slot.to_string() } else { "no such slice".into() }
                ));
            }
        }
        let x: &BlockIdentity = &e.failure.expected;
        if x.layer != e.failure.layer || x.kv != e.failure.kv {
            say(format!("{name}: expected: identity {} {} is not the slot's layer and K/V", x.layer, x.kv));
        }
        shapes.push(readable.then_some(shape));
    }
    let by_class =
        sec["summary"]["by_class"].as_object().into_iter().flatten().map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0))).collect();
    let writes_observed_regenerate = index.slices.iter().any(|e| e.observed_regenerate.is_some());
    Ok(Section { label, dir, index, failures, shapes, rec_of, by_class, writes_observed_regenerate })
}

/// Re-derives one dumped slice from its bytes `actual` (the slice file, of the listed size)
/// and compares the result with its record in the index and in the report.
fn check_slice(s: &Section, i: usize, actual: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    let e = &s.index.slices[i];
    let Some(shape) = &s.shapes[i] else { return out };
    let name = format!("{}{}", s.label, slice_name(e));
    if actual.len() as u64 != s.index.slice_bytes {
        out.push(format!("{name}: bytes: index {} (slice_bytes {}), file {}", e.bytes, s.index.slice_bytes, actual.len()));
        return out;
    }
    let ev = serde_json::to_value(&e.failure).unwrap_or(Value::Null);
    let derived = derive(e, s.index.seed, shape, actual);
    // A `late` slice whose judged bytes were not kept was read again, intact.
    if derived.get("bad_bytes") == Some(&json!(0)) && e.failure.class != crate::core::verify::Class::Late {
        out.push(format!(
            "{name}: bytes: the slice equals what it had to hold ({}{} is intact): a dumped slice is a failure",
            s.dir, e.file
        ));
    }
    for (k, v) in &derived {
        let got = ev.get(*k).cloned().unwrap_or(Value::Null);
        if &got != v {
            out.push(format!("{name}: {k}: index {}, bytes {}", show(&got), show(v)));
        }
    }
    // observed_regenerate: the command kvprobe writes for this record and these bytes, which
    // it writes only when the bytes are exactly the fingerprint of `observed` or the poison
    // (recomputed here); absent is a disagreement only in a dump that writes it.
    let fname = e.file.rsplit('/').next().unwrap_or(&e.file);
    let want = crate::report::dump::observed_regenerate_command(&e.failure, s.index.seed, shape, actual, fname);
    if e.observed_regenerate != want && (e.observed_regenerate.is_some() || s.writes_observed_regenerate) {
        let q = |c: &Option<String>| c.as_ref().map_or("none".to_string(), |c| format!("{c:?}"));
        out.push(format!("{name}: observed_regenerate: index {}, expected {}", q(&e.observed_regenerate), q(&want)));
    }
    if let Some(rec) = s.rec_of[i].and_then(|r| s.failures.get(r)) {
        for k in RECORD_FIELDS {
            let r = rec.get(k).cloned().unwrap_or(Value::Null);
            if let Some(v) = derived.get(k)
                && &r != v
            {
                out.push(format!("{name}: {k}: report {}, bytes {}", show(&r), show(v)));
            }
        }
    }
    out
}

/// What a dump folder's slices add up to: `bytes_written` (the sizes of the slice files
/// present, `size_of`), each class's written count against the slices listed and written +
/// omitted against the report's `summary.by_class` (over every class the index, the slices or
/// the report names: a class missing on one side counts 0 there), and the report's failures
/// no entry is: at most the class's omitted count.
fn section_tail(s: &Section, size_of: &dyn Fn(&str) -> Option<u64>, problems: &mut Vec<String>) {
    let (label, dir, index) = (&s.label, &s.dir, &s.index);
    let mut say = |m: String| problems.push(format!("{label}{m}"));
    let (mut bytes_total, mut per_class) = (0u64, BTreeMap::<String, u64>::new());
    for e in &index.slices {
        if let Some(n) = size_of(&format!("{dir}{}", e.file)) {
            bytes_total += n;
            *per_class.entry(e.failure.class.name().to_string()).or_default() += 1;
        }
        // A converting run's received bytes: one slice long, counted in bytes_written.
        if let Some(r) = e.received_file.as_ref().map(|r| format!("{dir}{r}"))
            && let Some(n) = size_of(&r)
        {
            bytes_total += n;
            if n != index.slice_bytes {
                say(format!("{}: {r}: {n} bytes, slice_bytes {}", slice_name(e), index.slice_bytes));
            }
        }
    }
    if bytes_total != index.bytes_written {
        say(format!("{dir}index.json: bytes_written: index {}, slice files {bytes_total}", index.bytes_written));
    }
    let by_class = &s.by_class;
    let mut in_report = BTreeMap::<String, u64>::new();
    let dumped: BTreeSet<usize> = s.rec_of.iter().flatten().copied().collect();
    for (j, f) in s.failures.iter().enumerate() {
        if !dumped.contains(&j) {
            *in_report.entry(show(&f["class"])).or_default() += 1;
        }
    }
    let classes: BTreeSet<String> =
        index.by_class.keys().chain(per_class.keys()).chain(by_class.keys()).chain(in_report.keys()).cloned().collect();
    let absent = |c: Option<u64>| c.map_or("absent".to_string(), |n| n.to_string());
    for class in classes {
        let c = index.by_class.get(&class);
        let n = per_class.get(&class).copied().unwrap_or(0);
        let (written, omitted) = (c.map_or(0, |c| c.written), c.map_or(0, |c| c.omitted));
        if written != n || (c.is_none() && n > 0) {
            say(format!("{dir}index.json: by_class.{class}.written: index {}, slices listed {n}", absent(c.map(|c| c.written))));
        }
        let r = by_class.get(&class).copied();
        if written + omitted != r.unwrap_or(0) || (c.is_none() != r.is_none() && written + omitted + r.unwrap_or(0) > 0) {
            say(format!(
                "{dir}index.json: by_class.{class}: report {}, index written {} + omitted {}",
                absent(r),
                absent(c.map(|c| c.written)),
                absent(c.map(|c| c.omitted))
            ));
        }
        let undumped = in_report.get(&class).copied().unwrap_or(0);
        if undumped > omitted {
            say(format!(
                "report: {undumped} listed {class} failures are in no {dir}index.json entry, but the index omitted {omitted} {class} slices"
            ));
        }
    }
}
