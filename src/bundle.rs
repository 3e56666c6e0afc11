//! Bundles: one `.tar.gz` a vendor can receive (`--bundle FILE` on run and ab, `kvprobe
//! bundle`), read back by `kvprobe report check` ([`crate::check`]) and `kvprobe report show`.
//!
//! Layout (README "Dumps, bundles and `report check`"), all under the top folder [`TOP`]:
//! `manifest.json` ([`Manifest`], schema [`MANIFEST_SCHEMA`]: every other file with its size
//! and SHA-256), `report.json` (a run report) or `ab.json` (an ab report), `dump/…` (the
//! `--dump` directory as written: `index.json`, `slices/`, `scripts/`; ab: one folder per
//! row), and `env/…` (the environment capture). Written with the tar and flate2 crates, to a
//! temporary file beside the target renamed over it ([`crate::report::write_atomic_with`]).

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

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
    /// The run's UCX log for the capture ([`crate::capture::capture`]); `None`: this
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

/// Writes the bundle `out` (atomically) holding `c`, with the environment captured now
/// ([`crate::capture::capture`]) into a scratch directory; with `c.redact`, the report and the
/// capture pass through one [`crate::redact::Redactor`]. Returns its manifest. Errors: [`Error::Io`] (the dump or capture
/// cannot be read, the bundle cannot be written).
pub fn write(out: &Path, c: &Contents<'_>) -> Result<Manifest> {
    // One redactor for the whole bundle: the same name gets the same token in every file.
    let mut redactor = c.redact.then(crate::redact::Redactor::new);
    let mut red = |b: Vec<u8>| -> Vec<u8> {
        let Some(r) = redactor.as_mut() else { return b };
        match String::from_utf8(b) {
            Ok(s) => r.text(&s).into_bytes(),
            Err(e) => e.into_bytes(), // binary: kept as is
        }
    };
    let mut entries: Vec<(String, Source)> = vec![(c.report_name.to_string(), Source::Bytes(red(c.report.clone())))];
    if let Some(d) = c.dump {
        // The dump's bytes stay exact (slices, index, script): nothing in them names the host.
        for (rel, p) in walk(d)? {
            entries.push((format!("dump/{rel}"), Source::File(p)));
        }
    }
    let scratch = tempfile::Builder::new()
        .prefix("bundle-env.")
        .tempdir_in(crate::scratch::dir()?)
        .map_err(|e| Error::Io(format!("bundle: scratch directory: {e}")))?;
    crate::capture::capture(scratch.path(), c.ucx_log)?;
    for (rel, p) in walk(scratch.path())? {
        let body = std::fs::read(&p).map_err(|e| Error::Io(format!("bundle: read {}: {e}", p.display())))?;
        entries.push((format!("env/{rel}"), Source::Bytes(red(body))));
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

/// A bundle read back, boundedly: the manifest (the first entry), the bodies of the entries it
/// lists (each read up to its listed size + 1 byte, so a longer entry shows as a size
/// disagreement without being read whole), and the names of the entries it does not list
/// (their bodies are skipped, never held).
pub struct Bundle {
    /// Listed files read, by path below [`TOP`] (`manifest.json` included).
    pub files: BTreeMap<String, Vec<u8>>,
    /// The manifest ([`manifest`]).
    pub manifest: Manifest,
    /// Entries the manifest does not list (paths below [`TOP`]), in archive order; not read.
    pub unlisted: Vec<String>,
}

/// Which listed entries [`read_bounded`] reads besides the manifest.
#[derive(Clone, Copy)]
enum Only<'a> {
    All,
    Entry(&'a str),
    Report,
}

/// Reads the bundle at `path`, reading only what the manifest lists (all of it, or only the
/// entry `only` and the manifest). Errors (usage, exit 2: a malformed bundle, each naming
/// `path`): unreadable, not gzip or not tar, the first entry not `manifest.json` (or no
/// entry), a manifest that is not one of [`MANIFEST_SCHEMA`] or larger than
/// [`MAX_MANIFEST_BYTES`], listed sizes totalling over [`MAX_TOTAL_BYTES`] ("too large"), more
/// than [`MAX_UNLISTED`] unlisted entries, an
/// entry that is not a regular file (a directory included) or lies outside [`TOP`], a path
/// given twice, or memory running out while reading ("out of memory").
fn read_bounded(path: &Path, only: Only<'_>) -> Result<Bundle> {
    let bad = |why: String| Error::Usage(format!("{}: not a kvprobe bundle: {why}", path.display()));
    let oom = |name: &str, n: u64| Error::Usage(format!("{}: out of memory reading {name} ({n} bytes)", path.display()));
    let f = std::fs::File::open(path).map_err(|e| Error::Usage(format!("{}: cannot read it: {e}", path.display())))?;
    let mut magic = [0u8; 2];
    let _ = (&f).read(&mut magic);
    if magic != [0x1f, 0x8b] {
        return Err(bad("not a gzip file".into()));
    }
    let f = std::fs::File::open(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
    let mut ar = tar::Archive::new(flate2::read::MultiGzDecoder::new(std::io::BufReader::new(f)));
    let mut files = BTreeMap::new();
    let mut unlisted = Vec::new();
    // Every name seen, for "appears twice": at most the listed ones and MAX_UNLISTED more.
    let mut seen = std::collections::BTreeSet::new();
    let mut manifest: Option<Manifest> = None;
    let mut listed = BTreeMap::<String, u64>::new();
    let entries = ar.entries().map_err(|e| bad(format!("not a gzip-compressed tar archive: {e}")))?;
    for e in entries {
        let mut e = e.map_err(|e| bad(format!("not a gzip-compressed tar archive: {e}")))?;
        let name = e.path().map_err(|e| bad(format!("an entry's name: {e}")))?.to_string_lossy().into_owned();
        let t = e.header().entry_type();
        if !t.is_file() {
            let what = if t.is_dir() { "a directory" } else { "not a regular file" };
            return Err(bad(format!("{name} is {what}")));
        }
        let Some(rel) = name.strip_prefix(&format!("{TOP}/")) else {
            return Err(bad(format!("{name} is outside {TOP}/")));
        };
        if rel.split('/').any(|c| c == ".." || c.is_empty()) {
            return Err(bad(format!("{name}: not a plain relative path")));
        }
        let rel = rel.to_string();
        if files.contains_key(&rel) || !seen.insert(rel.clone()) {
            return Err(bad(format!("{name} appears twice")));
        }
        if manifest.is_none() {
            if rel != "manifest.json" {
                return Err(bad(format!("the first entry is {name}, not {TOP}/manifest.json")));
            }
            let body = read_capped(&mut e, MAX_MANIFEST_BYTES + 1).map_err(|n| oom(&name, n))?;
            let body = body.map_err(|e| bad(format!("reading {name}: {e}")))?;
            if body.len() as u64 > MAX_MANIFEST_BYTES {
                return Err(bad(format!("{name} is larger than {MAX_MANIFEST_BYTES} bytes")));
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
            files.insert(rel, body);
            manifest = Some(m);
            continue;
        }
        let Some(&n) = listed.get(&rel) else {
            if unlisted.len() >= MAX_UNLISTED {
                return Err(bad(format!("more than {MAX_UNLISTED} entries the manifest does not list")));
            }
            unlisted.push(rel);
            continue;
        };
        let wanted = match only {
            Only::All => true,
            Only::Entry(o) => o == rel,
            Only::Report => manifest.as_ref().is_some_and(|m| m.report == rel),
        };
        if !wanted {
            continue;
        }
        let body = read_capped(&mut e, n.saturating_add(1)).map_err(|n| oom(&name, n))?;
        files.insert(rel, body.map_err(|e| bad(format!("reading {name}: {e}")))?);
    }
    let Some(manifest) = manifest else {
        return Err(Error::Usage(format!("{}: no {TOP}/manifest.json", path.display())));
    };
    Ok(Bundle { files, manifest, unlisted })
}

/// Up to `cap` bytes of `r`, the room reserved first: `Err(bytes)` when memory for them
/// cannot be had (reported as "out of memory", not as a malformed bundle).
fn read_capped(r: &mut impl Read, cap: u64) -> std::result::Result<std::io::Result<Vec<u8>>, u64> {
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

/// Reads the bundle at `path`: the manifest and every entry it lists (see [`Bundle`]).
/// Errors: as [`read_bounded`] describes (usage, exit 2, naming `path`).
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
    let mut b = read_bounded(path, Only::Report)?;
    let name = b.manifest.report.clone();
    b.files
        .remove(&name)
        .ok_or_else(|| Error::Usage(format!("{}: the manifest's report {TOP}/{name} is not in the bundle", path.display())))
}

/// The manifest of a bundle read by [`read`].
pub fn manifest(b: &Bundle) -> Result<Manifest> {
    Ok(b.manifest.clone())
}

/// The report a bundle holds (`report.json` or `ab.json`), for `kvprobe report show`.
pub fn report_bytes(b: &Bundle) -> Result<(&'static str, &[u8])> {
    for name in ["report.json", "ab.json"] {
        if let Some(body) = b.files.get(name) {
            return Ok((name, body));
        }
    }
    Err(Error::Usage(format!("no {TOP}/report.json or {TOP}/ab.json")))
}
