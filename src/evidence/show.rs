//! `kvprobe report show|diff`: reading back what kvprobe wrote — a run report
//! (`kvprobe.report/1`), an ab report (`kvprobe.ab/1`) or a bench result (`kvprobe.bench/1`) —
//! without a GPU or NIXL.
//!
//! `show` prints the same human summary the command printed at the end of its run (the same
//! render functions: [`crate::report::render`], [`crate::drive::ab::render`], [`crate::drive::bench::render`]).
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
    /// `kvprobe ab` ([`crate::drive::ab::AB_SCHEMA`]).
    Ab,
    /// `kvprobe bench` ([`crate::drive::bench::SCHEMA`]).
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
    /// True for the report of a bundle made with `--redact` (host names, addresses and user
    /// names replaced by tokens: [`crate::evidence::redact`]).
    pub redacted: bool,
}

/// Reads `path` and tells what it is by its `schema`. Every string of the document comes
/// back escaped for a terminal ([`escape_json_strings`]). Errors (usage, exit 2): unreadable,
/// not a regular file, device or pipe with content, not JSON (the parser's line and column),
/// or a schema this version does not know (named).
pub fn load(path: &Path) -> Result<Document> {
    let (bytes, named, kind, redacted) = read_document(path)?;
    let json: Value = serde_json::from_slice(&bytes)
        .map_err(|e| Error::Usage(format!("{}: not a kvprobe JSON document: {e}", path.display())))?;
    Ok(Document { kind, json, path: named, redacted })
}

/// The document at `path` (a bundle's report for a bundle) with every string escaped
/// ([`escape_json_strings`]), the name it is shown under, and its kind (from its `schema`
/// alone: nothing else is parsed here), and whether it comes from a redacted bundle.
fn read_document(path: &Path) -> Result<(Vec<u8>, String, Kind, bool)> {
    let bad = |why: String| Error::Usage(format!("{}: {why}", path.display()));
    let mut bytes = read_bounded(path).map_err(bad)?;
    let mut named = path.display().to_string();
    let mut redacted = false;
    if bytes.starts_with(&[0x1f, 0x8b]) {
        // A bundle (`--bundle`, `kvprobe bundle`): its report.
        // Only the manifest and the report entry are read (bounded; see [`crate::evidence::bundle`]).
        (bytes, redacted) = crate::evidence::bundle::read_report_of(path)?;
        named = format!("report.json in {named}");
    }
    let bytes = escape_json_strings(&bytes);
    /// The `schema` field alone (the rest skipped unparsed).
    #[derive(serde::Deserialize)]
    struct Head {
        schema: Option<Value>,
    }
    let head: Head = serde_json::from_slice(&bytes).map_err(|e| bad(format!("not a kvprobe JSON document: {e}")))?;
    let schema = match &head.schema {
        None => "",
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return Err(bad(format!("its \"schema\" is {other}, not a string: not a kvprobe document"))),
    };
    let kind = match schema {
        s if s == crate::report::SCHEMA => Kind::Run,
        s if s == crate::drive::ab::AB_SCHEMA => Kind::Ab,
        s if s == crate::drive::bench::SCHEMA => Kind::Bench,
        "" => return Err(bad("no \"schema\" field: not a kvprobe report, ab report or bench result".into())),
        other => {
            return Err(bad(format!(
                "schema {other:?} is not one this version reads ({}, {}, {})",
                crate::report::SCHEMA,
                crate::drive::ab::AB_SCHEMA,
                crate::drive::bench::SCHEMA
            )));
        }
    };
    Ok((bytes, named, kind, redacted))
}

/// The human summary of the document at `path` ([`show`]), parsed straight into its type
/// (no [`Value`] tree in between: a report of 244 MB held as a tree took 4.4 GB). Errors:
/// as [`load`] and [`show`].
pub fn show_file(path: &Path) -> Result<String> {
    let (bytes, named, kind, _) = read_document(path)?;
    let bad = |e: serde_json::Error| Error::Usage(format!("{}: the document does not fit its schema: {e}", path.display()));
    Ok(match kind {
        Kind::Run => render_run(&serde_json::from_slice(&bytes).map_err(bad)?, &named),
        Kind::Ab => crate::drive::ab::render(&serde_json::from_slice(&bytes).map_err(bad)?),
        Kind::Bench => render_bench(&serde_json::from_slice(&bytes).map_err(bad)?),
    })
}

fn render_run(r: &crate::report::Report, named: &str) -> String {
    // Serve's report of an `ab --peer` session: the matrix, as serve printed it.
    let mut s = match crate::drive::ab::matrix_of(r) {
        Some(ab) => crate::drive::ab::render(&ab),
        None => crate::report::render_with(r, Some(named)),
    };
    if let Some(e) = &r.outcome.error {
        s += &format!("error:             {}\n", escape_for_terminal(&e.message));
    }
    s
}

fn render_bench(b: &crate::drive::bench::BenchReport) -> String {
    format!(
        "{}result: {} (exit {})\n",
        crate::drive::bench::render(b),
        escape_for_terminal(&b.outcome.status),
        b.outcome.exit_code
    )
}

/// `s` with every character that must not reach a terminal raw written as a visible escape
/// (`\n`, `\r`, `\t`, `\u{1b}`, `\u{202e}`): [`crate::sys::text::escape_control`], the one rule
/// for every string that came from outside kvprobe (a report read back, a bundle, a peer).
/// Nothing in the result can move the cursor, clear the screen, set a window title or forge a
/// line of output.
pub fn escape_for_terminal(s: &str) -> String {
    crate::sys::text::escape_control(s).into_owned()
}

/// True for the characters [`escape_for_terminal`] replaces.
fn unsafe_for_terminal(c: char) -> bool {
    crate::sys::text::needs_escape(c)
}

/// The JSON text `b` with every string (keys too) escaped for a terminal: a character of a
/// string that [`escape_for_terminal`] would escape — written as a JSON escape (`\n`,
/// `\u001b`) or raw (DEL, C1 and bidirectional controls in UTF-8) — is replaced by the JSON
/// text of its escaped form, so the parsed string holds `\u{1b}` as six visible characters.
/// Everything else is copied byte for byte (invalid JSON stays invalid, for the parser to
/// name).
pub fn escape_json_strings(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.len());
    let put = |out: &mut Vec<u8>, c: char| {
        // The escaped text, as JSON string content: its backslash doubled.
        out.extend_from_slice(escape_for_terminal(&c.to_string()).replace('\\', "\\\\").as_bytes())
    };
    let (mut i, mut in_string) = (0, false);
    while i < b.len() {
        let c = b[i];
        if !in_string {
            in_string = c == b'"';
            out.push(c);
            i += 1;
            continue;
        }
        match c {
            b'"' => {
                in_string = false;
                out.push(c);
                i += 1;
            }
            b'\\' if i + 1 < b.len() => {
                let (ch, len) = match b[i + 1] {
                    b'n' => (Some('\n'), 2),
                    b'r' => (Some('\r'), 2),
                    b't' => (Some('\t'), 2),
                    b'b' => (Some('\u{8}'), 2),
                    b'f' => (Some('\u{c}'), 2),
                    b'u' if i + 6 <= b.len() => (
                        std::str::from_utf8(&b[i + 2..i + 6])
                            .ok()
                            .and_then(|h| u32::from_str_radix(h, 16).ok())
                            .and_then(char::from_u32),
                        6,
                    ),
                    _ => (None, 2),
                };
                match ch {
                    Some(ch) if unsafe_for_terminal(ch) => put(&mut out, ch),
                    _ => out.extend_from_slice(&b[i..i + len]),
                }
                i += len;
            }
            0x7f.. => {
                let len = match c {
                    0xf0.. => 4,
                    0xe0.. => 3,
                    0xc0.. => 2,
                    _ => 1,
                };
                match b.get(i..i + len).and_then(|x| std::str::from_utf8(x).ok()).and_then(|x| x.chars().next()) {
                    Some(ch) if unsafe_for_terminal(ch) => put(&mut out, ch),
                    Some(_) => out.extend_from_slice(&b[i..i + len]),
                    None => {
                        out.push(c);
                        i += 1;
                        continue;
                    }
                }
                i += len;
            }
            _ => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

pub use crate::evidence::bundle::MAX_DOCUMENT_BYTES;

/// The file at `path`, at most [`MAX_DOCUMENT_BYTES`] (read through a bound, so a device or a
/// file that grows is never read whole). Errors: unreadable, or larger than the bound.
fn read_bounded(path: &Path) -> std::result::Result<Vec<u8>, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    // Opened without blocking: a FIFO with no writer would hang open(2) (as `--model-config`
    // opens its file).
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("cannot read it: {e}"))?;
    let too_large = || format!("larger than {} MiB: not a kvprobe report, ab report or bench result", MAX_DOCUMENT_BYTES >> 20);
    // A regular file says its size: refused unread. Anything else (a device, a pipe) is read up
    // to the bound.
    let regular = f.metadata().is_ok_and(|m| m.is_file());
    if regular && f.metadata().is_ok_and(|m| m.len() > MAX_DOCUMENT_BYTES) {
        return Err(too_large());
    }
    let mut bytes = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match f.read(&mut buf) {
            // End of file; for a FIFO or pipe, no writer (left, or never there).
            Ok(0) => break,
            Ok(k) => {
                bytes.extend_from_slice(&buf[..k]);
                if bytes.len() as u64 > MAX_DOCUMENT_BYTES {
                    return Err(too_large());
                }
            }
            // A pipe whose writer has sent nothing yet: its writer decides when it ends.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(std::time::Duration::from_millis(5)),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("cannot read it: {e}")),
        }
    }
    if bytes.is_empty() && !regular {
        return Err("nothing to read: not a regular file, and no writer sent anything (a FIFO with no writer?)".into());
    }
    Ok(bytes)
}

/// The human summary of `doc`, in the words its command printed. Errors (usage, exit 2): a
/// document of a known schema whose fields do not fit (the field named by the parser).
pub fn show(doc: &Document) -> Result<String> {
    let bad = |e: serde_json::Error| Error::Usage(format!("the document does not fit its schema: {e}"));
    Ok(match doc.kind {
        Kind::Run => render_run(&serde_json::from_value(doc.json.clone()).map_err(bad)?, &doc.path),
        Kind::Ab => crate::drive::ab::render(&serde_json::from_value(doc.json.clone()).map_err(bad)?),
        Kind::Bench => render_bench(&serde_json::from_value(doc.json.clone()).map_err(bad)?),
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
/// [`crate::sys::tempdir`]) replaced by `kvprobe-*`: they differ on every run (e.g. the UCX_LOG_FILE
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
///
/// A path met more than once in one document (an ab report whose rows repeat, a bench
/// figure given twice) is numbered from its second occurrence on (`rows.NAME.verdict#2`), so
/// repeated or extra rows are differences, never folded into one.
pub fn diff(a: &Document, b: &Document) -> (Vec<Row>, Vec<Row>) {
    let fa = numbered(fields(a));
    let fb = numbered(fields(b));
    let mb: std::collections::HashMap<&str, &str> = fb.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let ma: std::collections::HashMap<&str, &str> = fa.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let (mut differ, mut same) = (Vec::new(), Vec::new());
    // One side redacted, the other not: a value that differs only where the redacted side
    // holds tokens (`host-1`, `ip-2`, ...) is the same value, redacted.
    let redacted_as = |x: &str, y: &str| match (a.redacted, b.redacted) {
        (true, false) => crate::evidence::redact::could_be_redaction_of(x, y),
        (false, true) => crate::evidence::redact::could_be_redaction_of(y, x),
        _ => false,
    };
    for (k, v) in &fa {
        let row = Row { path: k.clone(), a: Some(v.clone()), b: mb.get(k.as_str()).map(|s| s.to_string()) };
        let same_value = match (&row.a, &row.b) {
            (Some(x), Some(y)) => x == y || redacted_as(x, y),
            _ => false,
        };
        if same_value { same.push(row) } else { differ.push(row) }
    }
    for (k, v) in &fb {
        if !ma.contains_key(k.as_str()) {
            differ.push(Row { path: k.clone(), a: None, b: Some(v.clone()) });
        }
    }
    (differ, same)
}

/// `fields` with the n-th occurrence (n >= 2) of a path renamed `PATH#n`
/// (`rows.NAME.verdict#2`).
fn numbered(fields: Vec<(String, String)>) -> Vec<(String, String)> {
    let mut seen = std::collections::HashMap::<String, usize>::new();
    fields
        .into_iter()
        .map(|(k, v)| {
            let n = seen.entry(k.clone()).or_default();
            *n += 1;
            if *n == 1 { (k, v) } else { (format!("{k}#{n}"), v) }
        })
        .collect()
}

/// The text of [`diff`]: a header per file, the differences as a three-column table (field,
/// A, B; "(absent)" where a side lacks the field; long values cut at 60 characters with "…"),
/// then the fields that are the same (field, value).
pub fn render_diff(pa: &Path, a: &Document, pb: &Path, b: &Document) -> String {
    let (differ, same) = diff(a, b);
    let cut = |s: &Option<String>| -> String {
        match s {
            None => "(absent)".into(),
            Some(s) if s.chars().count() > 60 => format!("{}…", escape_for_terminal(&s.chars().take(59).collect::<String>())),
            Some(s) => escape_for_terminal(s),
        }
    };
    let head = |p: &Path, d: &Document| {
        escape_for_terminal(&format!(
            "{} ({}, {} exit {})",
            p.display(),
            d.json["schema"].as_str().unwrap_or("?"),
            d.json["outcome"]["status"].as_str().unwrap_or("?"),
            d.json["outcome"]["exit_code"]
        ))
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
            s += &format!("  {:<w$}  {:<wa$}  {}\n", escape_for_terminal(&r.path), cut(&r.a), cut(&r.b));
        }
    }
    let (ra, rb) = (rates(a), rates(b));
    if !ra.is_empty() || !rb.is_empty() {
        let mb: std::collections::HashMap<&str, &str> = rb.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        s += "\nrates (shown, not compared: they differ on every run):\n";
        for (k, v) in &ra {
            let vb = mb.get(k.as_str()).unwrap_or(&"(absent)");
            s += &format!("  {:<w$}  {:<12}  {}\n", escape_for_terminal(k), escape_for_terminal(v), escape_for_terminal(vb));
        }
    }
    s += &format!("\nsame ({}):\n", same.len());
    for r in &same {
        // The same up to redaction: both values, so the reader sees what the token stands for.
        let redacted =
            if r.a != r.b { format!("  (redacted: {})", cut(if a.redacted { &r.a } else { &r.b })) } else { String::new() };
        let shown = if a.redacted && r.a != r.b { &r.b } else { &r.a };
        s += &format!("  {:<w$}  {}{redacted}\n", escape_for_terminal(&r.path), cut(shown));
    }
    s
}
