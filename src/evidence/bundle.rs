//! Bundles: one `.tar.gz` a vendor can receive (`--bundle FILE` on run and ab, `kvprobe
//! bundle`), read back by `kvprobe report check` (`check`) and `kvprobe report show`.
//!
//! Layout (docs/report.md "Dumps, bundles and `report check`"), all under the top folder [`TOP`]:
//! `manifest.json` ([`Manifest`], schema [`MANIFEST_SCHEMA`]: every other file with its size
//! and SHA-256), `report.json` (a run report) or `ab.json` (an ab report), `dump/…` (the
//! dump's own files only, checked against the report ([`dump_files`]): `index.json`, the
//! slice files it lists and `scripts/fingerprint_ref.py`; ab: the same in one folder per row),
//! and `env/…` (the environment capture). Written with the tar and flate2 crates, to a
//! temporary file beside the target renamed over it ([`crate::report::write_atomic_with`]).

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// Documents larger than this are refused (`report show|diff` and a bundle's held entries; a
/// regular file unread): kvprobe's reports are kilobytes to tens of megabytes (an ab report
/// with 8 full sections); a file of gigabytes (or `/dev/zero`) would only exhaust memory.
pub const MAX_DOCUMENT_BYTES: u64 = 256 << 20;

/// Schema of `manifest.json`.
pub const MANIFEST_SCHEMA: &str = "kvprobe.manifest/1";

/// The folder every bundle entry lies in.
pub const TOP: &str = "kvprobe-bundle";

/// One file of the bundle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestFile {
    /// Path under [`TOP`] (e.g. `dump/slices/1-0-K-3.bin`).
    pub path: String,
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256 of the file, lowercase hex.
    pub sha256: String,
}

/// `manifest.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`MANIFEST_SCHEMA`].
    pub schema: String,
    /// Version of the kvprobe that wrote the bundle.
    pub kvprobe_version: String,
    /// When the bundle was written (Unix seconds).
    pub created_unix: u64,
    /// True when host names, IP addresses and user names were replaced (`--redact`).
    pub redacted: bool,
    /// When the environment capture (`env/`) was made: `run` (at the end of the run that
    /// wrote the report, `--bundle`) or `bundle` (later, by `kvprobe bundle`: it describes the
    /// machine then, not necessarily the run's).
    pub capture_made: String,
    /// The report's path in the bundle: `report.json` or `ab.json`.
    pub report: String,
    /// Every other file of the bundle.
    pub files: Vec<ManifestFile>,
}

/// What goes into a bundle.
pub struct Contents<'a> {
    /// The report's JSON exactly as written.
    pub report: Vec<u8>,
    /// `report.json` or `ab.json`.
    pub report_name: &'static str,
    /// The dump directory, if any.
    pub dump: Option<&'a Path>,
    /// `run` or `bundle` ([`Manifest::capture_made`]).
    pub capture_made: &'static str,
    /// The run's UCX log for the capture ([`crate::evidence::env_capture::capture`]); `None`: this
    /// process's own (a run-time bundle), recorded missing when there is none (`kvprobe
    /// bundle`).
    pub ucx_log: Option<&'a Path>,
    /// Replace host names, IP addresses and user names in text files.
    pub redact: bool,
}

/// SHA-256 of `bytes`, lowercase hex.
fn sha_hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// A file to archive: in memory or on disk.
enum Source {
    Bytes(Vec<u8>),
    File(PathBuf),
}

/// Every regular file under `dir`, sorted, as (path relative to `dir` with `/`, full path).
fn walk(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let rd = std::fs::read_dir(&d).map_err(|e| Error::Io(format!("bundle: read {}: {e}", d.display())))?;
        for e in rd.flatten() {
            let p = e.path();
            let Ok(t) = e.file_type() else { continue };
            if t.is_dir() {
                stack.push(p);
            } else if t.is_file() {
                let rel = p.strip_prefix(dir).unwrap_or(&p).to_string_lossy().replace('\\', "/");
                out.push((rel, p));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Report fields whose string values `--redact` never changes: fixed vocabularies (the
/// values of enums in `src/report/mod.rs`, `src/drive/ab.rs`, `src/core/verify.rs`, `src/core/mechanism.rs`,
/// `src/core/geometry.rs`, `src/sweep/mod.rs`, `src/mem/tier.rs`, `src/core/inject.rs`) and hashes. A user or
/// host name equal to one of their values (`USER=torn`) must not rename them: the redacted
/// report would no longer be a report. Any key ending in `_digest` is kept too.
pub const KEPT_FIELDS: &[&str] = &[
    "schema",
    "class",
    "kv",
    "status",
    "verdict",
    "expect",
    "mechanism",
    "fencing",
    "scenario",
    "unfenced",
    "attributed_to",
    "cause",
    "kind",
    "op",
    "memory",
    "layout",
    "dtype",
    "preset",
    "stray_check",
    "tier",
    "backend",
    "source",
    "fingerprint",
    "seed_hex",
    "sha256",
];

/// Whether `--redact` keeps the string value(s) of the field `key` ([`KEPT_FIELDS`]).
fn kept(key: &str) -> bool {
    KEPT_FIELDS.contains(&key) || key.ends_with("_digest")
}

/// Redacts a report in place: every string value (in arrays too) passes through `r`
/// ([`crate::evidence::redact::Redactor::text`]), except those of [`KEPT_FIELDS`]; object keys are
/// never changed.
pub fn redact_json(r: &mut crate::evidence::redact::Redactor, v: &mut serde_json::Value) {
    redact_json_keeping(r, v, kept)
}

/// Redacts JSON in place: every string value (in arrays too) passes through `r`, except the
/// values of fields for which `keep(key)` is true; object keys are never changed.
fn redact_json_keeping(r: &mut crate::evidence::redact::Redactor, v: &mut serde_json::Value, keep: fn(&str) -> bool) {
    fn walk(r: &mut crate::evidence::redact::Redactor, v: &mut serde_json::Value, kept: bool, keep: fn(&str) -> bool) {
        match v {
            serde_json::Value::String(s) if !kept => *s = r.text(s),
            serde_json::Value::Array(a) => a.iter_mut().for_each(|x| walk(r, x, kept, keep)),
            serde_json::Value::Object(o) => o.iter_mut().for_each(|(k, x)| walk(r, x, keep(k), keep)),
            _ => {}
        }
    }
    walk(r, v, false, keep)
}

/// The files of the dump `dir` that belong in a bundle of `report` (a run or ab report, as
/// JSON), as (path below `dump/`, path on disk): `index.json`, the slice files it lists (and
/// their `received_file`s) and
/// `scripts/fingerprint_ref.py`; ab: the same under each row's folder (`rows[i].name`, for
/// `sections[i]`). Nothing else found in the directory is ever packed.
///
/// Errors ([`Error::Usage`], exit 2), each naming what differs: `dir` is not a kvprobe dump
/// (no `index.json` of schema [`crate::report::dump::SCHEMA`]; ab: no row folder holding one), or a
/// dump of the other kind (a run's dump for an ab report, or the reverse); the index's seed or
/// geometry is not the report's `config`; a listed slice file is absolute, has `..`, leaves
/// `dir` through a symbolic link, or is not a regular file; the report records no dump or
/// another number of dumped slices than the index lists; an indexed slice's record
/// (iteration, layer, kv, block, actual_digest) is not the report's `failures[report_index]`.
pub fn dump_files(dir: &Path, report: &serde_json::Value) -> Result<Vec<(String, PathBuf)>> {
    let usage = |why: String| Error::Usage(format!("--dump {}: {why}", dir.display()));
    let has_index = |d: &Path| std::fs::symlink_metadata(d.join("index.json")).is_ok_and(|m| m.is_file());
    let schema = report.get("schema").and_then(|s| s.as_str()).unwrap_or("");
    if !dir.is_dir() {
        return Err(usage("not a directory".into()));
    }
    // An empty directory (a run refused before it dumped: `--dump` was created, nothing
    // written) gives no files, unless the report says slices were dumped.
    let empty = std::fs::read_dir(dir).is_ok_and(|mut it| it.next().is_none());
    let said = |sec: &serde_json::Value| sec["dump"]["slices_written"].as_u64().unwrap_or(0);
    let dumped = if schema == crate::drive::ab::AB_SCHEMA {
        report["sections"].as_array().into_iter().flatten().map(said).sum()
    } else {
        said(report)
    };
    if empty && dumped == 0 {
        return Ok(Vec::new());
    }
    if schema == crate::drive::ab::AB_SCHEMA {
        if has_index(dir) {
            return Err(usage("a run's dump (index.json at its top), but the report is an ab report".into()));
        }
        let rows = report["rows"].as_array().cloned().unwrap_or_default();
        let mut out = Vec::new();
        let mut found = 0;
        for (i, row) in rows.iter().enumerate() {
            let Some(name) = row["name"].as_str() else { continue };
            if name.is_empty() || name == "." || name == ".." || name.contains('/') {
                return Err(usage(format!("row name {name:?} is not a folder name")));
            }
            let sec = &report["sections"][i];
            let folder = dir.join(name);
            if !has_index(&folder) {
                let n = sec["dump"]["slices_written"].as_u64().unwrap_or(0);
                if n > 0 {
                    return Err(usage(format!(
                        "row {name}: the report says {n} slices were dumped, but {name}/index.json is missing"
                    )));
                }
                continue;
            }
            found += 1;
            for (rel, p) in section_files(&folder, sec, &format!("row {name}: {name}/"))? {
                out.push((format!("{name}/{rel}"), p));
            }
        }
        if found == 0 {
            return Err(usage("not a kvprobe ab dump: no row folder of the report holds an index.json".into()));
        }
        Ok(out)
    } else if schema == crate::report::SCHEMA {
        if !has_index(dir) {
            let ab = std::fs::read_dir(dir).into_iter().flatten().flatten().any(|e| has_index(&e.path()));
            return Err(usage(if ab {
                "an ab dump (row folders), but the report is a run report".into()
            } else {
                format!("not a kvprobe dump: no index.json (schema {})", crate::report::dump::SCHEMA)
            }));
        }
        section_files(dir, report, "")
    } else {
        Err(usage(format!("schema {schema:?} is not a run or ab report")))
    }
}

/// One dump folder (`dir`, holding `index.json`) checked against its report section `sec`
/// (`label`: where it is, for messages); its files as in [`dump_files`].
fn section_files(dir: &Path, sec: &serde_json::Value, label: &str) -> Result<Vec<(String, PathBuf)>> {
    let usage = |why: String| Error::Usage(format!("--dump {}: {label}{why}", dir.display()));
    let body = std::fs::read(dir.join("index.json")).map_err(|e| usage(format!("index.json: cannot read it: {e}")))?;
    let v: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| usage(format!("index.json is not JSON, not a kvprobe dump: {e}")))?;
    if v["schema"].as_str() != Some(crate::report::dump::SCHEMA) {
        return Err(usage(format!(
            "index.json has schema {}, not {}: not a kvprobe dump",
            v["schema"],
            crate::report::dump::SCHEMA
        )));
    }
    let index: crate::report::dump::DumpIndex =
        serde_json::from_value(v).map_err(|e| usage(format!("index.json is not a dump index: {e}")))?;
    let config = &sec["config"];
    if config["seed"].as_u64() != Some(index.seed) {
        return Err(usage(format!(
            "another run's dump: seed: report {}, dump {} (give the dump this report's run wrote)",
            config["seed"], index.seed
        )));
    }
    let dumped = crate::report::dump::dumped_geometry(config);
    if *dumped != index.geometry {
        return Err(usage(format!("another run's dump: geometry: report {dumped}, dump {}", index.geometry)));
    }
    match sec["dump"]["slices_written"].as_u64() {
        None => return Err(usage("another run's dump: the report records no dump".into())),
        Some(n) if n != index.slices.len() as u64 => {
            return Err(usage(format!(
                "another run's dump: slices: the report says {n} were dumped, index.json lists {}",
                index.slices.len()
            )));
        }
        Some(_) => {}
    }
    let canon = dir.canonicalize().map_err(|e| usage(format!("cannot resolve it: {e}")))?;
    let failures = sec["failures"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let mut out = vec![("index.json".to_string(), dir.join("index.json"))];
    let listed = |file: &str| -> Result<PathBuf> {
        let rel = Path::new(file);
        if rel.as_os_str().is_empty() || !rel.components().all(|c| matches!(c, std::path::Component::Normal(_))) {
            return Err(usage(format!("index.json lists {file:?}: not a plain path inside the dump")));
        }
        let p = dir.join(rel);
        match p.canonicalize() {
            Ok(c) if c.starts_with(&canon) && c.is_file() => Ok(p),
            Ok(c) if !c.starts_with(&canon) => {
                Err(usage(format!("index.json lists {file}: it leads outside the dump (to {})", c.display())))
            }
            Ok(_) => Err(usage(format!("index.json lists {file}: not a regular file"))),
            Err(err) => Err(usage(format!("index.json lists {file}: {err}"))),
        }
    };
    for e in &index.slices {
        let p = listed(&e.file)?;
        // A converting run's received bytes travel with the slice (listed and hashed).
        let received = e.received_file.as_ref().map(|r| listed(r).map(|rp| (r.clone(), rp))).transpose()?;
        let f = &e.failure;
        if let Some(i) = e.report_index {
            let ours = serde_json::to_value(f).unwrap_or_default();
            let Some(rec) = failures.get(i) else {
                return Err(usage(format!(
                    "another run's dump: {} has report_index {i}, the report lists {} failures",
                    e.file,
                    failures.len()
                )));
            };
            for k in ["iteration", "layer", "kv", "block", "actual_digest"] {
                if rec[k] != ours[k] {
                    return Err(usage(format!(
                        "another run's dump: {}: {k}: report failures[{i}] {}, dump {}",
                        e.file, rec[k], ours[k]
                    )));
                }
            }
        }
        for (r, p) in std::iter::once((e.file.clone(), p)).chain(received) {
            if !out.iter().any(|(x, _)| *x == r) {
                out.push((r, p));
            }
        }
    }
    let script = dir.join("scripts/fingerprint_ref.py");
    let inside = script.canonicalize().is_ok_and(|c| c.starts_with(&canon));
    if inside && std::fs::symlink_metadata(&script).is_ok_and(|m| m.is_file()) {
        out.push(("scripts/fingerprint_ref.py".into(), script));
    }
    Ok(out)
}

/// Refuses ([`Error::Usage`], exit 2) a bundle path `out` that would overwrite its own
/// input: the report `report` (the same file: the same device and inode when `out` exists, or
/// the same resolved path), or a path inside the dump directory `dump`. Paths are compared
/// resolved: an existing `out` canonicalized, else its parent canonicalized with its name.
pub fn check_output(out: &Path, report: &Path, dump: Option<&Path>) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let resolved = out.canonicalize().ok().or_else(|| {
        let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        Some(parent.canonicalize().ok()?.join(out.file_name()?))
    });
    let same_file = match (std::fs::metadata(out), std::fs::metadata(report)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    };
    if same_file || (resolved.is_some() && resolved == report.canonicalize().ok()) {
        return Err(Error::Usage(format!(
            "-o {}: that is the report being bundled (--report {}): give another path",
            out.display(),
            report.display()
        )));
    }
    if let (Some(r), Some(d)) = (&resolved, dump.and_then(|d| d.canonicalize().ok()))
        && r.starts_with(&d)
    {
        return Err(Error::Usage(format!(
            "-o {}: it is inside the dump directory being bundled ({}): give a path outside it",
            out.display(),
            d.display()
        )));
    }
    Ok(())
}

/// Writes the bundle `out` (atomically) holding `c`, with the environment captured now
/// ([`crate::evidence::env_capture::capture`]) into a scratch directory; with `c.redact`, the report and the
/// capture pass through one [`crate::evidence::redact::Redactor`]. Returns its manifest. Errors: [`Error::Io`] (the dump or capture
/// cannot be read, the bundle cannot be written).
pub fn write(out: &Path, c: &Contents<'_>) -> Result<Manifest> {
    // One redactor for the whole bundle: the same name gets the same token in every file.
    let mut redactor = c.redact.then(crate::evidence::redact::Redactor::new);
    let report: Option<serde_json::Value> = serde_json::from_slice(&c.report).ok();
    // The dump is checked against the report before anything is written, and only its own
    // files are packed (never anything else found in the directory).
    let dump_files = match (c.dump, &report) {
        (Some(d), Some(r)) => dump_files(d, r)?,
        (Some(d), None) => return Err(Error::Usage(format!("--dump {}: the report is not JSON", d.display()))),
        (None, _) => Vec::new(),
    };
    let report_body = match (redactor.as_mut(), report) {
        // A JSON report is redacted value by value ([`redact_json`]): never its keys or its
        // fixed vocabularies, so the redacted report still reads as a report.
        (Some(r), Some(mut v)) => {
            redact_json(r, &mut v);
            let mut b = serde_json::to_vec_pretty(&v).map_err(|e| Error::Io(format!("bundle: report: {e}")))?;
            b.push(b'\n');
            b
        }
        _ => c.report.clone(),
    };
    let mut entries: Vec<(String, Source)> = vec![(c.report_name.to_string(), Source::Bytes(report_body))];
    // The dump's bytes stay exact (slices, index, script): nothing in them names the host.
    for (rel, p) in dump_files {
        entries.push((format!("dump/{rel}"), Source::File(p)));
    }
    let scratch = tempfile::Builder::new()
        .prefix("bundle-env.")
        .tempdir_in(crate::sys::tempdir::dir()?)
        .map_err(|e| Error::Io(format!("bundle: scratch directory: {e}")))?;
    crate::evidence::env_capture::capture(scratch.path(), c.ucx_log)?;
    for (rel, p) in walk(scratch.path())? {
        let body = std::fs::read(&p).map_err(|e| Error::Io(format!("bundle: read {}: {e}", p.display())))?;
        // JSON files (`capture.json`) are redacted value by value, never their keys; only
        // `schema` and `status` (ok, timed-out, ...) are kept (its `source` names paths).
        let json = rel.ends_with(".json").then(|| serde_json::from_slice::<serde_json::Value>(&body).ok()).flatten();
        let body = match (json, redactor.as_mut()) {
            (_, None) => body,
            (Some(mut v), Some(r)) => {
                redact_json_keeping(r, &mut v, |k| k == "schema" || k == "status");
                let mut b = serde_json::to_vec_pretty(&v).map_err(|e| Error::Io(format!("bundle: {rel}: {e}")))?;
                b.push(b'\n');
                b
            }
            (None, Some(r)) => match String::from_utf8(body) {
                Ok(s) => r.text(&s).into_bytes(),
                Err(e) => e.into_bytes(), // binary: kept as is
            },
        };
        entries.push((format!("env/{rel}"), Source::Bytes(body)));
    }
    let mut files = Vec::new();
    for (path, src) in &entries {
        let (bytes, sha256) = match src {
            Source::Bytes(b) => (b.len() as u64, sha_hex(&Sha256::digest(b))),
            Source::File(p) => {
                let mut f = std::fs::File::open(p).map_err(|e| Error::Io(format!("bundle: read {}: {e}", p.display())))?;
                let mut h = Sha256::new();
                let mut buf = vec![0u8; 1 << 16];
                let mut n = 0u64;
                loop {
                    let k = f.read(&mut buf).map_err(|e| Error::Io(format!("bundle: read {}: {e}", p.display())))?;
                    if k == 0 {
                        break;
                    }
                    h.update(&buf[..k]);
                    n += k as u64;
                }
                (n, sha_hex(&h.finalize()))
            }
        };
        files.push(ManifestFile { path: path.clone(), bytes, sha256 });
    }
    let created_unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let manifest = Manifest {
        schema: MANIFEST_SCHEMA.into(),
        kvprobe_version: env!("CARGO_PKG_VERSION").into(),
        created_unix,
        redacted: c.redact,
        capture_made: c.capture_made.into(),
        report: c.report_name.into(),
        files,
    };
    let mut mbody = serde_json::to_vec_pretty(&manifest).map_err(|e| Error::Io(format!("bundle: manifest: {e}")))?;
    mbody.push(b'\n');
    crate::report::write_atomic_with(out, "--bundle", |f| {
        let gz = flate2::write::GzEncoder::new(f, flate2::Compression::default());
        let mut tar = tar::Builder::new(gz);
        let mut add = |path: &str, size: u64, r: &mut dyn Read| -> std::io::Result<()> {
            let mut h = tar::Header::new_gnu();
            h.set_size(size);
            // The fingerprint reference is a script a vendor runs; the rest is data.
            h.set_mode(if path.ends_with(".py") { 0o755 } else { 0o644 });
            h.set_mtime(created_unix);
            h.set_entry_type(tar::EntryType::Regular);
            tar.append_data(&mut h, format!("{TOP}/{path}"), r)
        };
        add("manifest.json", mbody.len() as u64, &mut mbody.as_slice())?;
        for ((path, src), m) in entries.iter().zip(&manifest.files) {
            match src {
                Source::Bytes(b) => add(path, b.len() as u64, &mut b.as_slice())?,
                // The size the manifest gives: a file that changed since would fail the check.
                Source::File(p) => add(path, m.bytes, &mut std::fs::File::open(p)?.take(m.bytes))?,
            }
        }
        let gz = tar.into_inner()?;
        gz.finish()?.flush()
    })?;
    Ok(manifest)
}

/// Largest total of the sizes a manifest may list (16 GiB): a bundle listing more is refused
/// as too large (exit 2) before any body is read.
pub const MAX_TOTAL_BYTES: u64 = 16 << 30;

/// Largest `manifest.json` read (64 MiB): the manifest lists paths, sizes and digests only.
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// Most entries a bundle may hold that its manifest does not list (each is named, unread);
/// one more is malformed (exit 2), so a stream of tiny entries cannot grow the list unbounded.
pub const MAX_UNLISTED: usize = 1000;

/// Most entries a bundle may hold before its `manifest.json` (a bundle re-packed with `tar
/// czf`, whose order is the directory's): their names are kept until the manifest says which
/// are listed, so a stream of tiny entries ahead of it cannot grow that list unbounded.
pub const MAX_BEFORE_MANIFEST: usize = 100_000;

/// Size and SHA-256 of one listed entry, hashed as it streamed past ([`read`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryDigest {
    /// Bytes read: the entry's size, or its listed size + 1 when it is longer (never more).
    pub bytes: u64,
    /// SHA-256 of those bytes, lowercase hex.
    pub sha256: String,
}

/// Where a bundle's entries are read from.
#[derive(Clone, Debug)]
enum Origin {
    /// A `.tar.gz` file (written by kvprobe, or re-packed with `tar czf`).
    Archive(PathBuf),
    /// An unpacked bundle: the folder holding `manifest.json` (the folder given, or its
    /// [`TOP`] folder).
    Dir(PathBuf),
}

/// A bundle read back, boundedly: the manifest, the bodies of the entries that are held (see
/// [`read`], [`read_entry`]), the size and SHA-256 of every listed entry (hashed as it
/// streamed past, each read up to its listed size + 1 byte, so a longer entry shows as a size
/// disagreement without being read whole), and the names of the entries the manifest does not
/// list (their bodies are skipped, never held).
pub struct Bundle {
    /// Listed files held, by path below [`TOP`] (`manifest.json` included).
    pub files: BTreeMap<String, Vec<u8>>,
    /// Size and SHA-256 of every listed entry found ([`read`] only), by path below [`TOP`].
    pub digests: BTreeMap<String, EntryDigest>,
    /// The manifest ([`manifest`]).
    pub manifest: Manifest,
    /// Entries the manifest does not list (paths below [`TOP`]), in archive order; not read.
    pub unlisted: Vec<String>,
    /// Where it was read from (for [`Bundle::for_each_listed`]).
    origin: Origin,
    /// The path given, for messages.
    path: PathBuf,
}

/// Which listed entries [`read_bounded`] reads besides the manifest.
#[derive(Clone, Copy)]
enum Only<'a> {
    /// Every listed entry is hashed; the report and the dump indexes (`dump/…index.json`)
    /// are held ([`held`]), the rest (slices, the capture) never.
    All,
    Entry(&'a str),
    Report,
}

/// Whether [`read`] holds the body of the listed entry `rel` (the report `report` and the
/// dump indexes, which are JSON the check parses; at most
/// [`MAX_DOCUMENT_BYTES`] each).
fn held(rel: &str, report: &str) -> bool {
    rel == report || (rel.starts_with("dump/") && (rel == "dump/index.json" || rel.ends_with("/index.json")))
}

/// Opens `path` for reading without blocking (a FIFO with no writer, a device) and refuses
/// anything but a regular file, its type checked on the open file (as `--model-config` does):
/// a file swapped for a FIFO after a check cannot hang the read. `what` names it in messages.
pub fn open_regular(path: &Path, what: &str) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| Error::Usage(format!("{}: cannot read it: {e}", path.display())))?;
    let m = f.metadata().map_err(|e| Error::Usage(format!("{}: cannot read it: {e}", path.display())))?;
    if !m.is_file() {
        return Err(Error::Usage(format!("{}: not a regular file{what} (a FIFO, device or socket is not read)", path.display())));
    }
    Ok(f)
}

/// Where the bundle `path` is: a regular file (a `.tar.gz`) or a directory holding
/// `manifest.json` or `kvprobe-bundle/manifest.json` (an unpacked bundle).
fn origin(path: &Path) -> Result<Origin> {
    let m = std::fs::metadata(path).map_err(|e| Error::Usage(format!("{}: cannot read it: {e}", path.display())))?;
    if m.is_dir() {
        for top in [path.to_path_buf(), path.join(TOP)] {
            if std::fs::symlink_metadata(top.join("manifest.json")).is_ok_and(|m| m.is_file()) {
                return Ok(Origin::Dir(top));
            }
        }
        return Err(Error::Usage(format!(
            "{}: not a kvprobe bundle: a directory holding no manifest.json (nor {TOP}/manifest.json)",
            path.display()
        )));
    }
    open_regular(path, " or a directory")?;
    Ok(Origin::Archive(path.to_path_buf()))
}

/// `name` with any leading `./` removed (`tar czf B -C DIR .` writes `./kvprobe-bundle/…`).
fn plain_name(name: &str) -> &str {
    let mut n = name;
    while let Some(r) = n.strip_prefix("./") {
        n = r;
    }
    n
}

/// Calls `f(rel, body)` for every regular file of the bundle at `path`, `rel` being its path
/// below [`TOP`]: an archive's entries in archive order (directory entries of `.`, [`TOP`]
/// and folders below it skipped, leading `./` removed), an unpacked bundle's files sorted by
/// path with `manifest.json` first. `f` returns false to stop. Errors (usage, exit 2, naming
/// `path`): not gzip or tar, an entry that is not a regular file or a directory (a symbolic
/// link), or one outside [`TOP`] or with `..` or empty components.
fn each_entry(path: &Path, o: &Origin, f: &mut dyn FnMut(&str, &mut dyn Read) -> Result<bool>) -> Result<()> {
    let bad = |why: String| Error::Usage(format!("{}: not a kvprobe bundle: {why}", path.display()));
    let plain = |rel: &str| !rel.split('/').any(|c| c == ".." || c == "." || c.is_empty());
    match o {
        Origin::Archive(p) => {
            let file = open_regular(p, " or a directory")?;
            let mut magic = [0u8; 2];
            let _ = (&file).read(&mut magic);
            if magic != [0x1f, 0x8b] {
                return Err(bad("not a gzip file".into()));
            }
            let file = open_regular(p, " or a directory")?;
            let mut ar = tar::Archive::new(flate2::read::MultiGzDecoder::new(std::io::BufReader::new(file)));
            let entries = ar.entries().map_err(|e| bad(format!("not a gzip-compressed tar archive: {e}")))?;
            for e in entries {
                let mut e = e.map_err(|e| bad(format!("not a gzip-compressed tar archive: {e}")))?;
                let raw = e.path().map_err(|e| bad(format!("an entry's name: {e}")))?.to_string_lossy().into_owned();
                let name = plain_name(&raw);
                let t = e.header().entry_type();
                if t.is_dir() {
                    // `tar czf` writes the folders too: `./`, `kvprobe-bundle/`, `kvprobe-bundle/dump/`.
                    let d = name.trim_end_matches('/');
                    if d.is_empty() || d == "." || d == TOP || d.strip_prefix(&format!("{TOP}/")).is_some_and(plain) {
                        continue;
                    }
                    return Err(bad(format!("{raw} is a directory outside {TOP}/")));
                }
                if !t.is_file() {
                    return Err(bad(format!("{raw} is not a regular file")));
                }
                let Some(rel) = name.strip_prefix(&format!("{TOP}/")) else {
                    return Err(bad(format!("{raw} is outside {TOP}/")));
                };
                if !plain(rel) {
                    return Err(bad(format!("{raw}: not a plain relative path")));
                }
                if !f(rel, &mut e)? {
                    break;
                }
            }
        }
        Origin::Dir(top) => {
            let mut found = Vec::new();
            let mut stack = vec![top.clone()];
            while let Some(d) = stack.pop() {
                let rd = std::fs::read_dir(&d).map_err(|e| bad(format!("cannot read {}: {e}", d.display())))?;
                for e in rd {
                    let e = e.map_err(|e| bad(format!("cannot read {}: {e}", d.display())))?;
                    let p = e.path();
                    let rel = p.strip_prefix(top).unwrap_or(&p).to_string_lossy().into_owned();
                    let t = e.file_type().map_err(|e| bad(format!("{rel}: {e}")))?;
                    if t.is_dir() {
                        stack.push(p);
                    } else if t.is_file() {
                        found.push(rel);
                    } else {
                        return Err(bad(format!("{rel} is not a regular file (a symbolic link, FIFO or device)")));
                    }
                }
            }
            found.sort_by(|a, b| (a != "manifest.json", a).cmp(&(b != "manifest.json", b)));
            for rel in found {
                let mut file = open_regular(&top.join(&rel), "")?;
                if !f(&rel, &mut file)? {
                    break;
                }
            }
        }
    }
    Ok(())
}

/// Reads the bundle at `path`, reading only what the manifest lists (all of it, or only the
/// entry `only` and the manifest). The manifest may come anywhere (a bundle re-packed with
/// `tar czf`): the entries before it are read in a second pass. Errors (usage, exit 2: a
/// malformed bundle, each naming `path`): unreadable, not a regular file or a directory, not
/// gzip or not tar, no `manifest.json`, a manifest that is not one of [`MANIFEST_SCHEMA`] or
/// larger than [`MAX_MANIFEST_BYTES`], listed sizes totalling over [`MAX_TOTAL_BYTES`] ("too
/// large"), a held entry listed over [`MAX_DOCUMENT_BYTES`], more than
/// [`MAX_UNLISTED`] unlisted entries or [`MAX_BEFORE_MANIFEST`] entries before the manifest,
/// an entry that is not a regular file or a directory or lies outside [`TOP`], a path given
/// twice, or memory running out while reading ("out of memory").
fn read_bounded(path: &Path, only: Only<'_>) -> Result<Bundle> {
    let bad = |why: String| Error::Usage(format!("{}: not a kvprobe bundle: {why}", path.display()));
    let oom = |name: &str, n: u64| Error::Usage(format!("{}: out of memory reading {TOP}/{name} ({n} bytes)", path.display()));
    let o = origin(path)?;
    let mut files = BTreeMap::new();
    let mut digests = BTreeMap::new();
    let mut unlisted = Vec::new();
    // Every name seen, for "appears twice": at most the listed ones, MAX_UNLISTED and
    // MAX_BEFORE_MANIFEST more.
    let mut seen = std::collections::BTreeSet::new();
    let mut before = Vec::new();
    let mut manifest: Option<Manifest> = None;
    let mut listed = BTreeMap::<String, u64>::new();
    // One listed or unlisted entry, once the manifest is known.
    let mut take = |rel: &str,
                    r: &mut dyn Read,
                    m: &Manifest,
                    listed: &BTreeMap<String, u64>,
                    files: &mut BTreeMap<String, Vec<u8>>,
                    unlisted: &mut Vec<String>|
     -> Result<()> {
        let Some(&n) = listed.get(rel) else {
            if unlisted.len() >= MAX_UNLISTED {
                return Err(bad(format!("more than {MAX_UNLISTED} entries the manifest does not list")));
            }
            unlisted.push(rel.to_string());
            return Ok(());
        };
        let hold = match only {
            Only::All => held(rel, &m.report),
            Only::Entry(o) => o == rel,
            Only::Report => m.report == rel,
        };
        if hold {
            if matches!(only, Only::All) && n > MAX_DOCUMENT_BYTES {
                return Err(Error::Usage(format!(
                    "{}: too large: the manifest lists {TOP}/{rel} at {n} bytes, over the {} MiB a report or dump index is read to",
                    path.display(),
                    MAX_DOCUMENT_BYTES >> 20
                )));
            }
            let body = read_capped(r, n.saturating_add(1)).map_err(|n| oom(rel, n))?;
            let body = body.map_err(|e| bad(format!("reading {TOP}/{rel}: {e}")))?;
            if matches!(only, Only::All) {
                digests
                    .insert(rel.to_string(), EntryDigest { bytes: body.len() as u64, sha256: sha_hex(&Sha256::digest(&body)) });
            }
            files.insert(rel.to_string(), body);
        } else if matches!(only, Only::All) {
            let d = hash_capped(r, n.saturating_add(1)).map_err(|e| bad(format!("reading {TOP}/{rel}: {e}")))?;
            digests.insert(rel.to_string(), d);
        }
        Ok(())
    };
    each_entry(path, &o, &mut |rel, r| {
        if !seen.insert(rel.to_string()) {
            return Err(bad(format!("{TOP}/{rel} appears twice")));
        }
        let Some(m) = &manifest else {
            if rel != "manifest.json" {
                if before.len() >= MAX_BEFORE_MANIFEST {
                    return Err(bad(format!("more than {MAX_BEFORE_MANIFEST} entries before {TOP}/manifest.json")));
                }
                before.push(rel.to_string());
                return Ok(true);
            }
            let body = read_capped(r, MAX_MANIFEST_BYTES + 1).map_err(|n| oom(rel, n))?;
            let body = body.map_err(|e| bad(format!("reading {TOP}/{rel}: {e}")))?;
            if body.len() as u64 > MAX_MANIFEST_BYTES {
                return Err(bad(format!("{TOP}/{rel} is larger than {MAX_MANIFEST_BYTES} bytes")));
            }
            let m: Manifest = serde_json::from_slice(&body)
                .map_err(|e| Error::Usage(format!("{}: {TOP}/manifest.json is not a manifest: {e}", path.display())))?;
            if m.schema != MANIFEST_SCHEMA {
                return Err(Error::Usage(format!("{}: manifest schema {:?} is not {MANIFEST_SCHEMA}", path.display(), m.schema)));
            }
            let total = m.files.iter().fold(0u64, |a, f| a.saturating_add(f.bytes));
            if total > MAX_TOTAL_BYTES {
                return Err(Error::Usage(format!(
                    "{}: too large: the manifest lists {total} bytes, over the {MAX_TOTAL_BYTES} bytes (16 GiB) report check reads",
                    path.display()
                )));
            }
            for f in &m.files {
                listed.entry(f.path.clone()).or_insert(f.bytes);
            }
            files.insert(rel.to_string(), body);
            manifest = Some(m);
            return Ok(true);
        };
        take(rel, r, m, &listed, &mut files, &mut unlisted)?;
        Ok(true)
    })?;
    let Some(manifest) = manifest else {
        return Err(Error::Usage(format!("{}: no {TOP}/manifest.json", path.display())));
    };
    if !before.is_empty() {
        // The entries ahead of the manifest, now that it says which are listed.
        let before: std::collections::BTreeSet<String> = before.into_iter().collect();
        each_entry(path, &o, &mut |rel, r| {
            if rel == "manifest.json" {
                return Ok(false);
            }
            if before.contains(rel) {
                take(rel, r, &manifest, &listed, &mut files, &mut unlisted)?;
            }
            Ok(true)
        })?;
    }
    Ok(Bundle { files, digests, manifest, unlisted, origin: o, path: path.to_path_buf() })
}

/// Size and SHA-256 of up to `cap` bytes of `r`, streamed (nothing held).
fn hash_capped(r: &mut dyn Read, cap: u64) -> std::io::Result<EntryDigest> {
    let mut h = Sha256::new();
    let mut r = r.take(cap);
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0u64;
    loop {
        match r.read(&mut buf) {
            Ok(0) => return Ok(EntryDigest { bytes: n, sha256: sha_hex(&h.finalize()) }),
            Ok(k) => {
                h.update(&buf[..k]);
                n += k as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Up to `cap` bytes of `r`, the room reserved first: `Err(bytes)` when memory for them
/// cannot be had (reported as "out of memory", not as a malformed bundle).
fn read_capped(r: &mut dyn Read, cap: u64) -> std::result::Result<std::io::Result<Vec<u8>>, u64> {
    let mut body = Vec::new();
    // Reserve at most 1 MiB ahead; the rest grows as the bytes arrive (a listed size is a
    // claim, not a promise), each growth checked the same way.
    let mut r = r.take(cap);
    let mut buf = [0u8; 1 << 16];
    loop {
        let k = match r.read(&mut buf) {
            Ok(0) => return Ok(Ok(body)),
            Ok(k) => k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Ok(Err(e)),
        };
        if body.capacity() - body.len() < k {
            let want = (body.len() as u64).max(k as u64).min(cap - body.len() as u64).max(k as u64);
            body.try_reserve(want as usize).map_err(|_| body.len() as u64 + want)?;
        }
        body.extend_from_slice(&buf[..k]);
    }
}

impl Bundle {
    /// Reads the bundle again and calls `f(rel, body)` for each listed entry in `wanted`
    /// whose size is the one the manifest lists (its digest from [`read`]), one at a time,
    /// in archive order: only one such body is held at once (the slices of `report check`).
    /// Errors: as [`read`], or memory running out ("out of memory").
    pub fn for_each_listed(&self, wanted: &std::collections::BTreeSet<String>, f: &mut dyn FnMut(&str, &[u8])) -> Result<()> {
        let path = &self.path;
        let sizes: BTreeMap<&str, u64> = self.manifest.files.iter().map(|m| (m.path.as_str(), m.bytes)).collect();
        let mut left = wanted.len();
        each_entry(path, &self.origin, &mut |rel, r| {
            let Some(&n) = sizes.get(rel) else { return Ok(true) };
            if !wanted.contains(rel) || self.digests.get(rel).is_none_or(|d| d.bytes != n) {
                return Ok(true);
            }
            let body = read_capped(r, n)
                .map_err(|k| Error::Usage(format!("{}: out of memory reading {TOP}/{rel} ({k} bytes)", path.display())))?
                .map_err(|e| Error::Usage(format!("{}: not a kvprobe bundle: reading {TOP}/{rel}: {e}", path.display())))?;
            f(rel, &body);
            left -= 1;
            Ok(left > 0)
        })
    }
}

/// Reads the bundle at `path` (a `.tar.gz`, or a directory holding an unpacked bundle): the
/// manifest, the size and SHA-256 of every entry it lists (streamed), and the bodies of the
/// report and the dump indexes (see [`Bundle`]). Errors: as [`read_bounded`] describes
/// (usage, exit 2, naming `path`).
pub fn read(path: &Path) -> Result<Bundle> {
    read_bounded(path, Only::All)
}

/// Reads one listed entry of the bundle at `path` (e.g. its report for `kvprobe report
/// show`), and the manifest, nothing else. Errors (usage, exit 2, naming `path`): as [`read`],
/// or `name` not listed or not in the bundle.
pub fn read_entry(path: &Path, name: &str) -> Result<Vec<u8>> {
    let mut b = read_bounded(path, Only::Entry(name))?;
    b.files
        .remove(name)
        .ok_or_else(|| Error::Usage(format!("{}: {TOP}/{name} is not in the bundle or not in its manifest", path.display())))
}

/// The report a bundle at `path` holds (the manifest's `report`: `report.json` or
/// `ab.json`), reading only the manifest and that entry, for `kvprobe report show`.
pub fn read_report(path: &Path) -> Result<Vec<u8>> {
    read_report_of(path).map(|(body, _)| body)
}

/// [`read_report`], and whether the bundle was redacted (the manifest's `redacted`).
pub fn read_report_of(path: &Path) -> Result<(Vec<u8>, bool)> {
    let mut b = read_bounded(path, Only::Report)?;
    let name = b.manifest.report.clone();
    let redacted = b.manifest.redacted;
    let body = b
        .files
        .remove(&name)
        .ok_or_else(|| Error::Usage(format!("{}: the manifest's report {TOP}/{name} is not in the bundle", path.display())))?;
    Ok((body, redacted))
}

/// The manifest of a bundle read by [`read`].
pub fn manifest(b: &Bundle) -> Result<Manifest> {
    Ok(b.manifest.clone())
}
