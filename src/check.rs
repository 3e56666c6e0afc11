//! `kvprobe report check BUNDLE`: the receiver's side of a bundle ([`crate::bundle`]), with
//! no GPU and no NIXL.
//!
//! 1. The manifest: every file it lists is in the bundle with its size and SHA-256, and no
//!    other file is (besides `manifest.json`).
//! 2. Every dumped slice (`dump/index.json`; ab: `dump/<row>/index.json`): the expected bytes
//!    are regenerated from the fingerprint definition ([`crate::fingerprint::expected`], or the
//!    poison for a `stray` slice found by the poison check) and their digest compared with
//!    `expected_digest`; the `regenerate` command must be the one kvprobe writes for that
//!    record; from the dumped bytes, the class ([`crate::verify::classify_against`]),
//!    `first_bad_offset` and `bad_bytes` (byte by byte against the expected bytes), the sector
//!    map, `bit_flips`, the observed identity and `actual_digest` are derived again and
//!    compared with the slice's record in `index.json` and in the report; coordinates,
//!    expected identity and slot agree between the two; the dump's per-class counts add up to
//!    the report's.
//!
//! Every disagreement is one line naming the slice (`iteration 2 layer 1 K block 17`, with
//! `row NAME:` before it in an ab bundle) or the file, the field, and both values.

use crate::dump::{DumpEntry, DumpIndex};
use crate::error::{Error, Result};
use crate::fingerprint::{self, BlockIdentity, RowShape};
use crate::geometry::{Geometry, SliceCoord};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// What [`check`] found.
#[derive(Clone, Debug, Default)]
pub struct Checked {
    /// The disagreements, one line each (empty: everything agrees).
    pub problems: Vec<String>,
    /// Files the manifest lists (each checked for size and SHA-256).
    pub files: usize,
    /// Dumped slices whose bytes were re-derived and compared.
    pub slices: usize,
}

/// Checks the bundle at `path`. Returns the disagreements and what was checked.
/// Errors (usage, exit 2): a malformed bundle — unreadable, not gzip or tar, no manifest, a
/// manifest, report or index that is not valid JSON of its schema.
pub fn check(path: &Path) -> Result<Checked> {
    let mut b = crate::bundle::read(path)?;
    let m = crate::bundle::manifest(&b)?;
    let mut problems = Vec::new();
    let mut listed = BTreeSet::new();
    for f in &m.files {
        if !listed.insert(f.path.clone()) {
            problems.push(format!("{}: listed twice in the manifest", f.path));
            continue;
        }
        match b.files.get(&f.path) {
            None => problems.push(format!("{}: in the manifest but not in the bundle", f.path)),
            Some(body) => {
                // Read up to the listed size + 1 byte: "more" means the entry is longer.
                if body.len() as u64 != f.bytes {
                    let more = if body.len() as u64 > f.bytes { "more than " } else { "" };
                    problems.push(format!(
                        "{}: bytes: manifest {}, file {more}{}",
                        f.path,
                        f.bytes,
                        body.len().min(f.bytes as usize)
                    ));
                }
                let d = fingerprint::digest(body);
                if d != f.sha256 {
                    problems.push(format!("{}: sha256: manifest {}, file {d}", f.path, f.sha256));
                }
            }
        }
    }
    // An entry of the wrong size was read only to its listed size + 1: its bytes are not the
    // file's, so nothing else is derived from them (it counts as absent below).
    let wrong_size: Vec<String> = m
        .files
        .iter()
        .filter(|f| b.files.get(&f.path).is_some_and(|body| body.len() as u64 != f.bytes))
        .map(|f| f.path.clone())
        .collect();
    for p in &wrong_size {
        b.files.remove(p);
    }
    for p in &b.unlisted {
        problems.push(format!("{p}: in the bundle but not in the manifest (not read)"));
    }
    if wrong_size.contains(&m.report) {
        // Its size disagrees (said above): nothing more can be compared with it.
        return Ok(Checked { problems, files: m.files.len(), slices: 0 });
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
    } else if schema == crate::ab::AB_SCHEMA {
        let ab: crate::ab::AbReport = serde_json::from_value(report.clone())
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
            problems.extend(crate::ab::row_disagreements(row, sec).into_iter().map(|l| format!("{label}{l}")));
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
    let mut indexed = BTreeSet::new();
    for (label, dir, sec) in sections {
        let index_path = format!("{dir}index.json");
        let Some(ib) = b.files.get(&index_path) else {
            if sec.get("dump").is_some_and(|d| d["slices_written"].as_u64() > Some(0)) {
                problems.push(format!("{index_path}: missing, but the report says slices were dumped"));
            }
            continue;
        };
        let index: DumpIndex = serde_json::from_slice(ib)
            .map_err(|e| Error::Usage(format!("{}: {index_path} is not a dump index: {e}", path.display())))?;
        if index.schema != crate::dump::SCHEMA {
            return Err(Error::Usage(format!(
                "{}: {index_path}: schema {:?} is not {}",
                path.display(),
                index.schema,
                crate::dump::SCHEMA
            )));
        }
        check_section(&label, &dir, &index, sec, &b.files, &mut indexed, &mut problems, path)?;
    }
    for p in b.files.keys() {
        if p.starts_with("dump/") && p.contains("slices/") && !indexed.contains(p) {
            problems.push(format!("{p}: a slice file no index.json lists"));
        }
    }
    Ok(Checked { problems, files: m.files.len(), slices: indexed.len() })
}

/// The report's geometry, validated ([`Geometry::validate`]).
fn geometry_of(v: &Value) -> std::result::Result<Geometry, String> {
    let g: Geometry = serde_json::from_value(v.clone()).map_err(|e| format!("not a geometry: {e}"))?;
    g.validate().map_err(|e| e.to_string())?;
    Ok(g)
}

/// Outcome coherence of one report (or ab section): failures listed (or slices dumped) mean
/// the run was not clean and `summary.blocks_corrupt` counts at least that many; sweep
/// failures carry `iteration` >= 1 (scenario failures, with `request`, count engine steps from 0).
fn coherence(sec: &Value, failures: &[Value], dumped: usize, say: &mut dyn FnMut(String)) {
    let outcome = &sec["outcome"];
    if (!failures.is_empty() || dumped > 0) && !outcome.is_null() {
        let status = outcome["status"].as_str().unwrap_or("");
        if status == "clean" || outcome["exit_code"].as_u64() == Some(0) {
            say(format!(
                "report: outcome: status {status:?} exit {}, but {} failures listed and {dumped} slices dumped",
                show(&outcome["exit_code"]),
                failures.len()
            ));
        }
    }
    let corrupt = sec["summary"]["blocks_corrupt"].as_u64().unwrap_or(0);
    if corrupt < failures.len() as u64 {
        say(format!("report: summary.blocks_corrupt: {corrupt}, but {} failures listed", failures.len()));
    }
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
    if f.class == crate::verify::Class::Stray {
        // The stray-write checks name no class beyond `stray`: what landed is the first tag
        // that decodes from the first bad byte on.
        d.insert("class", json!("stray"));
        d.insert("observed", json!(fingerprint::observed_identity(actual, seed, shape, first)));
        d.insert("bit_flips", Value::Null);
        d.insert("sectors", Value::Null);
        d.insert("displacement", Value::Null);
        d.insert("rows", Value::Null);
    } else {
        let v = crate::verify::classify_against(actual, &want, &shape.slice(f.expected), seed, f.slot, f.poison_iteration);
        d.insert("class", json!(v.class));
        d.insert("observed", json!(v.observed));
        d.insert("bit_flips", json!(v.bit_flips));
        d.insert("sectors", json!(v.sectors));
        d.insert("displacement", json!(v.displacement.map(|x| x.to_string())));
        d.insert("rows", json!(v.rows));
    }
    d
}

/// Fields that must agree between the index's record and the report's.
const RECORD_FIELDS: [&str; 19] = [
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
];

fn show(v: &Value) -> String {
    match v {
        Value::Null => "none".into(),
        Value::String(s) => s.clone(),
        v => v.to_string(),
    }
}

#[allow(clippy::too_many_arguments)]
fn check_section(
    label: &str,
    dir: &str,
    index: &DumpIndex,
    sec: &Value,
    files: &BTreeMap<String, Vec<u8>>,
    indexed: &mut BTreeSet<String>,
    problems: &mut Vec<String>,
    bundle: &Path,
) -> Result<()> {
    let bundle = bundle.display();
    if index.fingerprint != fingerprint::FORMAT {
        return Err(Error::Usage(format!(
            "{bundle}: {label}{dir}index.json: fingerprint {:?}: this kvprobe checks {} (README \"Fingerprint format\"); \
             the dump's own scripts/fingerprint_ref.py regenerates its slices",
            index.fingerprint,
            fingerprint::FORMAT
        )));
    }
    let mut say = |s: String| problems.push(format!("{label}{s}"));
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
    let dumped = crate::dump::dumped_geometry(config);
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
    let geometry = Some(geometry_of(dumped).map_err(|e| Error::Usage(format!("{bundle}: {label}report: config.{field}: {e}")))?);
    if let Some(g) = &geometry
        && let Ok(n) = g.slice_bytes()
    {
        if slice_bytes != Some(n) {
            say(format!("report: config.{field}.slice_bytes: report {}, geometry {n}", show(&dumped["slice_bytes"])));
        }
        if index.slice_bytes != n {
            say(format!("{dir}index.json: slice_bytes: index {}, geometry {n}", index.slice_bytes));
        }
    }
    // TP ranks (`config.tp`): each dumped slice's rows start at its decode rank's first head.
    let tp: Option<crate::pairing::tp::Tp> = match config.get("tp").filter(|t| !t.is_null()) {
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
        if let Some(d) = &geometry
            && let Err(why) = crate::pairing::Sides::check(&p, d, config["permute_local_kv"] == true, tp)
        {
            say(format!("report: config.geometry, config.decode_geometry and config.tp are not one pair: {why}"));
        }
    } else if let (Some(t), Some(g)) = (tp, &geometry)
        && let Err(why) = crate::pairing::Sides::check(g, g, config["permute_local_kv"] == true, Some(t))
    {
        say(format!("report: config.geometry and config.tp are not one pair: {why}"));
    }
    let failures = sec["failures"].as_array().cloned().unwrap_or_default();
    coherence(sec, &failures, index.slices.len(), &mut say);
    let (mut bytes_total, mut per_class) = (0u64, BTreeMap::<String, u64>::new());
    for e in &index.slices {
        let name = slice_name(e);
        let file = format!("{dir}{}", e.file);
        indexed.insert(file.clone());
        // A converting run's received bytes: listed, hashed by the manifest, one slice long.
        if let Some(r) = e.received_file.as_ref().map(|r| format!("{dir}{r}")) {
            match files.get(&r) {
                Some(b) if b.len() as u64 == index.slice_bytes => bytes_total += b.len() as u64,
                Some(b) => say(format!("{name}: {r}: {} bytes, slice_bytes {}", b.len(), index.slice_bytes)),
                None => say(format!("{name}: {r} is not in the bundle")),
            }
            indexed.insert(r);
        }
        let ev = serde_json::to_value(&e.failure).unwrap_or(Value::Null);
        let Some(actual) = files.get(&file) else {
            say(format!("{name}: {file} is not in the bundle"));
            continue;
        };
        bytes_total += actual.len() as u64;
        *per_class.entry(e.failure.class.name().to_string()).or_default() += 1;
        if actual.len() as u64 != index.slice_bytes || e.bytes != index.slice_bytes {
            say(format!("{name}: bytes: index {} (slice_bytes {}), file {}", e.bytes, index.slice_bytes, actual.len()));
            continue;
        }
        let Some(g) = &geometry else { continue };
        if let Some(r) = e.failure.tp_rank
            && tp.is_none_or(|t| r >= t.decode)
        {
            say(format!(
                "{name}: tp_rank {r}: the report's config.tp has {}",
                tp.map_or("no TP ranks".to_string(), |t| format!("{} decode ranks", t.decode))
            ));
            continue;
        }
        let shape = crate::dump::rank_shape(&RowShape::of(g), tp.as_ref(), e.failure.tp_rank);
        if let Err(err) = shape.validate(e.failure.expected.token_base) {
            say(format!("{name}: expected.token_base {}: {err}", e.failure.expected.token_base));
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
        let want_cmd = crate::dump::regenerate_command(&e.failure, index.seed, &shape, e.bytes, fname);
        if e.regenerate != want_cmd {
            say(format!("{name}: regenerate: index {:?}, expected {want_cmd:?}", e.regenerate));
        }
        {
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
        let expected_ok = {
            let x: &BlockIdentity = &e.failure.expected;
            x.layer == e.failure.layer && x.kv == e.failure.kv
        };
        if !expected_ok {
            say(format!(
                "{name}: expected: identity {} {} is not the slot's layer and K/V",
                e.failure.expected.layer, e.failure.expected.kv
            ));
        }
        let derived = derive(e, index.seed, &shape, actual);
        if derived.get("bad_bytes") == Some(&json!(0)) {
            say(format!("{name}: bytes: the slice equals what it had to hold ({file} is intact): a dumped slice is a failure"));
        }
        for (k, v) in &derived {
            let got = ev.get(*k).cloned().unwrap_or(Value::Null);
            if &got != v {
                say(format!("{name}: {k}: index {}, bytes {}", show(&got), show(v)));
            }
        }
        let Some(i) = e.report_index else { continue };
        let Some(rec) = failures.get(i) else {
            say(format!("{name}: report_index {i}: the report lists {} failures", failures.len()));
            continue;
        };
        for k in RECORD_FIELDS {
            let (r, x) = (rec.get(k).cloned().unwrap_or(Value::Null), ev.get(k).cloned().unwrap_or(Value::Null));
            if r != x {
                say(format!("{name}: {k}: report {}, index {}", show(&r), show(&x)));
            }
            if let Some(v) = derived.get(k)
                && &r != v
            {
                say(format!("{name}: {k}: report {}, bytes {}", show(&r), show(v)));
            }
        }
    }
    if bytes_total != index.bytes_written {
        say(format!("{dir}index.json: bytes_written: index {}, slice files {bytes_total}", index.bytes_written));
    }
    let by_class = &sec["summary"]["by_class"];
    for (class, c) in &index.by_class {
        let n = per_class.get(class).copied().unwrap_or(0);
        if c.written != n {
            say(format!("{dir}index.json: by_class.{class}.written: index {}, slices listed {n}", c.written));
        }
        let r = by_class[class].as_u64().unwrap_or(0);
        if c.written + c.omitted != r {
            say(format!("{dir}index.json: by_class.{class}: report {r}, index written {} + omitted {}", c.written, c.omitted));
        }
    }
    Ok(())
}
