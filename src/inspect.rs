//! `kvprobe report show|diff`: reading back what kvprobe wrote — a run report
//! (`kvprobe.report/1`), an ab report (`kvprobe.ab/1`) or a bench result (`kvprobe.bench/1`) —
//! without a GPU or NIXL.
//!
//! `show` prints the same human summary the command printed at the end of its run (the same
//! render functions: [`crate::report::render`], [`crate::ab::render`], [`crate::bench::render`]).
//! `diff` sets two documents side by side, field by field, differences first: the fields that
//! say what changed between a clean and a corrupt node pair — the configuration (geometry,
//! settings), the environment (driver, CUDA, NIXL, UCX, GPUs), the UCX path of the transfers,
//! and the outcome with its counts.

use crate::error::{Error, Result};
use serde_json::Value;
use std::path::Path;

/// What a file holds, by its `schema`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `kvprobe run` ([`crate::report::SCHEMA`]).
    Run,
    /// `kvprobe ab` ([`crate::ab::AB_SCHEMA`]).
    Ab,
    /// `kvprobe bench` ([`crate::bench::SCHEMA`]).
    Bench,
}

/// A document read back: its kind and its JSON.
#[derive(Clone, Debug)]
pub struct Document {
    /// What it is.
    pub kind: Kind,
    /// Its JSON, as written.
    pub json: Value,
    /// Where it was read from, as given (a run's summary names its `--report` file so):
    /// the path, or `report.json in BUNDLE` for a bundle's report.
    pub path: String,
}

/// Reads `path` and tells what it is by its `schema`. Errors (usage, exit 2): unreadable, not
/// JSON (the parser's line and column), or a schema this version does not know (named).
pub fn load(path: &Path) -> Result<Document> {
    let bad = |why: String| Error::Usage(format!("{}: {why}", path.display()));
    let mut bytes = read_bounded(path).map_err(bad)?;
    let mut named = path.display().to_string();
    if bytes.starts_with(&[0x1f, 0x8b]) {
        // A bundle (`--bundle`, `kvprobe bundle`): its report.
        // Only the manifest and the report entry are read (bounded; see [`crate::bundle`]).
        bytes = crate::bundle::read_report(path)?;
        named = format!("report.json in {named}");
    }
    let json: Value = serde_json::from_slice(&bytes).map_err(|e| bad(format!("not a kvprobe JSON document: {e}")))?;
    let schema = match json.get("schema") {
        None => "",
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return Err(bad(format!("its \"schema\" is {other}, not a string: not a kvprobe document"))),
    };
    let kind = match schema {
        s if s == crate::report::SCHEMA => Kind::Run,
        s if s == crate::ab::AB_SCHEMA => Kind::Ab,
        s if s == crate::bench::SCHEMA => Kind::Bench,
        "" => return Err(bad("no \"schema\" field: not a kvprobe report, ab report or bench result".into())),
        other => {
            return Err(bad(format!(
                "schema {other:?} is not one this version reads ({}, {}, {})",
                crate::report::SCHEMA,
                crate::ab::AB_SCHEMA,
                crate::bench::SCHEMA
            )));
        }
    };
    Ok(Document { kind, json, path: named })
}

/// Documents larger than this are refused ([`load`]; a regular file unread): kvprobe's reports are kilobytes
/// to tens of megabytes (an ab report with 8 full sections); a file of gigabytes (or
/// `/dev/zero`) would only exhaust memory.
pub const MAX_DOCUMENT_BYTES: u64 = 256 << 20;

/// The file at `path`, at most [`MAX_DOCUMENT_BYTES`] (read through a bound, so a device or a
/// file that grows is never read whole). Errors: unreadable, or larger than the bound.
fn read_bounded(path: &Path) -> std::result::Result<Vec<u8>, String> {
    use std::io::Read;
    let f = std::fs::File::open(path).map_err(|e| format!("cannot read it: {e}"))?;
    let too_large = || format!("larger than {} MiB: not a kvprobe report, ab report or bench result", MAX_DOCUMENT_BYTES >> 20);
    // A regular file says its size: refused unread. Anything else (a device, a pipe) is read up
    // to the bound.
    if f.metadata().is_ok_and(|m| m.is_file() && m.len() > MAX_DOCUMENT_BYTES) {
        return Err(too_large());
    }
    let mut bytes = Vec::new();
    f.take(MAX_DOCUMENT_BYTES + 1).read_to_end(&mut bytes).map_err(|e| format!("cannot read it: {e}"))?;
    if bytes.len() as u64 > MAX_DOCUMENT_BYTES {
        return Err(too_large());
    }
    Ok(bytes)
}

/// The human summary of `doc`, in the words its command printed. Errors (usage, exit 2): a
/// document of a known schema whose fields do not fit (the field named by the parser).
pub fn show(doc: &Document) -> Result<String> {
    let bad = |e: serde_json::Error| Error::Usage(format!("the document does not fit its schema: {e}"));
    Ok(match doc.kind {
        Kind::Run => {
            let r: crate::report::Report = serde_json::from_value(doc.json.clone()).map_err(bad)?;
            let mut s = crate::report::render_with(&r, Some(&doc.path));
            if let Some(e) = &r.outcome.error {
                s += &format!("error:             {}\n", e.message);
            }
            s
        }
        Kind::Ab => crate::ab::render(&serde_json::from_value(doc.json.clone()).map_err(bad)?),
        Kind::Bench => {
            let b: crate::bench::BenchReport = serde_json::from_value(doc.json.clone()).map_err(bad)?;
            format!("{}result: {} (exit {})\n", crate::bench::render(&b), b.outcome.status, b.outcome.exit_code)
        }
    })
}

/// The fields [`diff`] compares, as (dotted path, value), in the order a reader wants them:
/// `outcome`; by kind — run: the summary's counts and `summary.transport_path` (the UCX path),
/// scenario verdicts; ab: each row's verdict and counts; bench: each figure's ratio and goal —
/// then `environment`, `config` and `schema`. Rates and timings, which differ on every run,
/// are left out (see [`rates`]).
pub fn fields(doc: &Document) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let j = &doc.json;
    flatten("outcome", &j["outcome"], &mut out);
    match doc.kind {
        Kind::Run => {
            let s = &j["summary"];
            for k in [
                "iterations",
                "blocks_checked",
                "blocks_corrupt",
                "slices_compared",
                "by_class",
                "unexpected_failures",
                "injections_planted",
                "injections_detected",
                "pipeline_stages",
                "transport_path",
            ] {
                flatten(&format!("summary.{k}"), &s[k], &mut out);
            }
            if let Some(sc) = j["scenario"].as_object() {
                for k in ["scenario", "tier_detail", "requests_verified", "unexplained_corrupt"] {
                    flatten(&format!("scenario.{k}"), sc.get(k).unwrap_or(&Value::Null), &mut out);
                }
                for r in sc.get("races").and_then(Value::as_array).into_iter().flatten() {
                    let m = r["mechanism"].as_str().unwrap_or("?");
                    for k in ["fencing", "verdict", "corrupt_attributed"] {
                        flatten(&format!("scenario.races.{m}.{k}"), &r[k], &mut out);
                    }
                }
            }
        }
        Kind::Ab => {
            for r in j["rows"].as_array().into_iter().flatten() {
                let n = r["name"].as_str().unwrap_or("?");
                for k in ["verdict", "pass", "corrupt", "unexplained", "classes"] {
                    flatten(&format!("rows.{n}.{k}"), &r[k], &mut out);
                }
            }
        }
        Kind::Bench => {
            for f in j["figures"].as_array().into_iter().flatten() {
                let n = f["name"].as_str().unwrap_or("?");
                for k in ["goal", "meets"] {
                    flatten(&format!("figures.{n}.{k}"), &f[k], &mut out);
                }
            }
            for b in j["breakdowns"].as_array().into_iter().flatten() {
                let n = b["label"].as_str().unwrap_or("?");
                for k in ["meets", "exit_code"] {
                    flatten(&format!("breakdowns.{n}.{k}"), &b[k], &mut out);
                }
            }
        }
    }
    flatten("environment", &j["environment"], &mut out);
    flatten("config", &j["config"], &mut out);
    flatten("schema", &j["schema"], &mut out);
    out
}

/// The rates of `doc` that [`render_diff`] shows beside each other but does not compare (they
/// differ on every run): run: `summary.transfer_gbps`; bench: each figure's GB/s and ratio and
/// each breakdown's transfer rate and probe share. (path, value rounded to 3 decimals).
pub fn rates(doc: &Document) -> Vec<(String, String)> {
    let j = &doc.json;
    let r = |v: &Value| v.as_f64().map_or("-".to_string(), |x| format!("{x:.3}"));
    let mut out = Vec::new();
    match doc.kind {
        Kind::Run => out.push(("summary.transfer_gbps".to_string(), r(&j["summary"]["transfer_gbps"]))),
        Kind::Ab => {}
        Kind::Bench => {
            for f in j["figures"].as_array().into_iter().flatten() {
                let n = f["name"].as_str().unwrap_or("?");
                out.push((format!("figures.{n}.gbps"), r(&f["gbps"])));
                out.push((format!("figures.{n}.ratio"), r(&f["ratio"])));
            }
            for b in j["breakdowns"].as_array().into_iter().flatten() {
                let n = b["label"].as_str().unwrap_or("?");
                out.push((format!("breakdowns.{n}.transfer_gbps"), r(&b["transfer_gbps"])));
                out.push((format!("breakdowns.{n}.probe_share"), r(&b["probe_share"])));
            }
        }
    }
    out
}

/// Time-varying environment fields that would make every pair of runs differ (free memory,
/// clocks, probe timings): left out of [`fields`].
fn volatile(path: &str) -> bool {
    const ENDINGS: [&str; 6] = ["free_bytes", "memory_free", "seconds", "elapsed_s", "started_unix", "host_peak_bytes"];
    ENDINGS.iter().any(|e| path.ends_with(e))
}

/// `s` with the names of kvprobe's private scratch directories (`kvprobe-PID.RANDOM`, see
/// [`crate::scratch`]) replaced by `kvprobe-*`: they differ on every run (e.g. the UCX_LOG_FILE
/// and UCX_POSIX_DIR kvprobe sets) and say nothing about the node pair.
fn unscratch(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find("kvprobe-") {
        out.push_str(&rest[..i + 8]);
        rest = &rest[i + 8..];
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits > 0 && rest[digits..].starts_with('.') {
            let tail = rest[digits + 1..].bytes().take_while(u8::is_ascii_alphanumeric).count();
            out.push('*');
            rest = &rest[digits + 1 + tail..];
        }
    }
    out.push_str(rest);
    out
}

fn flatten(path: &str, v: &Value, out: &mut Vec<(String, String)>) {
    if volatile(path) {
        return;
    }
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, x) in m {
                flatten(&format!("{path}.{k}"), x, out);
            }
        }
        // A short array, or one of numbers alone (`config.model.layer_groups[0].layers`), is
        // one value (`config.inject`: `[{"count":2,"kind":"torn"}]` against `[]`); a long one
        // of anything else (the GPUs), and the model's layer groups whatever their length (so
        // two models line up group by group), are compared element by element.
        Value::Array(a)
            if !a.is_empty()
                && (path.ends_with(".layer_groups") || v.to_string().len() > 120)
                && !a.iter().all(Value::is_number) =>
        {
            for (i, x) in a.iter().enumerate() {
                flatten(&format!("{path}[{i}]"), x, out);
            }
        }
        Value::Array(_) => out.push((path.to_string(), unscratch(&v.to_string()))),
        Value::String(s) => out.push((path.to_string(), unscratch(s))),
        Value::Null => out.push((path.to_string(), "-".into())),
        other => out.push((path.to_string(), other.to_string())),
    }
}

/// One compared field: its path and its value in A and in B (`None`: absent there).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    /// Dotted path ("environment.driver_version", "summary.by_class.torn").
    pub path: String,
    /// Value in A.
    pub a: Option<String>,
    /// Value in B.
    pub b: Option<String>,
}

/// The fields of `a` and `b` ([`fields`]), differences first (in A's order, then B's extra
/// fields), then the fields they share. Returns (differences, same).
pub fn diff(a: &Document, b: &Document) -> (Vec<Row>, Vec<Row>) {
    let fa = fields(a);
    let fb = fields(b);
    let mb: std::collections::HashMap<&str, &str> = fb.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let ma: std::collections::HashMap<&str, &str> = fa.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let (mut differ, mut same) = (Vec::new(), Vec::new());
    for (k, v) in &fa {
        let row = Row { path: k.clone(), a: Some(v.clone()), b: mb.get(k.as_str()).map(|s| s.to_string()) };
        if row.a == row.b { same.push(row) } else { differ.push(row) }
    }
    for (k, v) in &fb {
        if !ma.contains_key(k.as_str()) {
            differ.push(Row { path: k.clone(), a: None, b: Some(v.clone()) });
        }
    }
    (differ, same)
}

/// The text of [`diff`]: a header per file, the differences as a three-column table (field,
/// A, B; "(absent)" where a side lacks the field; long values cut at 60 characters with "…"),
/// then the fields that are the same (field, value).
pub fn render_diff(pa: &Path, a: &Document, pb: &Path, b: &Document) -> String {
    let (differ, same) = diff(a, b);
    let cut = |s: &Option<String>| -> String {
        match s {
            None => "(absent)".into(),
            Some(s) if s.chars().count() > 60 => format!("{}…", s.chars().take(59).collect::<String>()),
            Some(s) => s.clone(),
        }
    };
    let head = |p: &Path, d: &Document| {
        format!(
            "{} ({}, {} exit {})",
            p.display(),
            d.json["schema"].as_str().unwrap_or("?"),
            d.json["outcome"]["status"].as_str().unwrap_or("?"),
            d.json["outcome"]["exit_code"]
        )
    };
    let mut s = format!("A: {}\nB: {}\n", head(pa, a), head(pb, b));
    if a.kind != b.kind {
        s += "note: A and B are different kinds of document; only their shared fields line up\n";
    }
    let w = differ.iter().chain(&same).map(|r| r.path.len()).max().unwrap_or(5).clamp(5, 70);
    s += &format!("\ndifferences ({}):\n", differ.len());
    if !differ.is_empty() {
        let wa = differ.iter().map(|r| cut(&r.a).chars().count()).max().unwrap_or(1).max(1);
        s += &format!("  {:<w$}  {:<wa$}  {}\n", "field", "A", "B");
        for r in &differ {
            s += &format!("  {:<w$}  {:<wa$}  {}\n", r.path, cut(&r.a), cut(&r.b));
        }
    }
    let (ra, rb) = (rates(a), rates(b));
    if !ra.is_empty() || !rb.is_empty() {
        let mb: std::collections::HashMap<&str, &str> = rb.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        s += "\nrates (shown, not compared: they differ on every run):\n";
        for (k, v) in &ra {
            s += &format!("  {:<w$}  {:<12}  {}\n", k, v, mb.get(k.as_str()).unwrap_or(&"(absent)"));
        }
    }
    s += &format!("\nsame ({}):\n", same.len());
    for r in &same {
        s += &format!("  {:<w$}  {}\n", r.path, cut(&r.a));
    }
    s
}
