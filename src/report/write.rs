//! Writing reports: atomically (to a temporary file in the target's directory, flushed to
//! disk, then renamed over the target — a reader never sees a partial report, and a failed
//! run still leaves one), the last published report kept for a watchdog or a signal, and
//! when the report cannot be written (disk full, `ulimit -f`, an I/O error) the temporary
//! file removed and the report sent to stderr instead ([`print_fallback`]).

use super::Report;
use crate::error::{Error, Result};
use serde::Serialize;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Longest file name most Linux filesystems accept (NAME_MAX).
const NAME_MAX: usize = 255;

/// Resolves where a report at `path` goes: a symlink is followed to its target; an
/// existing target must be a regular file (never a device, FIFO or directory — as root,
/// renaming over /dev/null would replace it). Returns (target, its directory).
fn resolve_target(path: &Path, flag: &str) -> Result<(PathBuf, PathBuf)> {
    let bad = |why: String| Error::Io(format!("{flag} {}: {why}", path.display()));
    if path.as_os_str().as_encoded_bytes().ends_with(b"/") {
        return Err(bad("names a directory (trailing /)".into()));
    }
    let target = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            std::fs::canonicalize(path).map_err(|e| bad(format!("cannot resolve the symlink: {e}")))?
        }
        _ => path.to_path_buf(),
    };
    match std::fs::metadata(&target) {
        Ok(m) if m.is_dir() => return Err(bad("is a directory".into())),
        Ok(m) if !m.is_file() => {
            return Err(bad("is not a regular file (device, FIFO or socket)".into()));
        }
        _ => {}
    }
    let name = target.file_name().ok_or_else(|| bad("is not a file path".into()))?;
    if name.len() > NAME_MAX {
        return Err(bad(format!("the file name is longer than {NAME_MAX} bytes")));
    }
    let dir = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((target, dir))
}

/// Checks, before a run, that a report can be written at `path`: not a directory or
/// special file, an existing report can be opened for writing (not immutable), and its
/// directory accepts a new file (an anonymous temporary file is created there).
/// Errors: [`Error::Io`] (exit 2).
pub fn check_writable(path: &Path) -> Result<()> {
    check_writable_for(path, "--report")
}

/// [`check_writable`] for a file named by `flag` (e.g. "--json"), which errors name.
pub fn check_writable_for(path: &Path, flag: &str) -> Result<()> {
    let (target, dir) = resolve_target(path, flag)?;
    if target.exists() {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&target)
            .map_err(|e| Error::Io(format!("{flag} {}: cannot replace it: {e}", path.display())))?;
    }
    tempfile::tempfile_in(&dir)
        .map_err(|e| Error::Io(format!("{flag} {}: cannot create files in {}: {e}", path.display(), dir.display())))?;
    Ok(())
}

/// Name prefix of a report being written (beside its target).
const TMP_PREFIX: &str = ".kvprobe-report.";
/// Name suffix of a report being written.
const TMP_SUFFIX: &str = ".tmp";
/// A temporary report is removed by a later write into its directory once it is older than
/// this and nobody holds its lock: its writer locks it right after creating it and holds the
/// lock until the rename, so only a writer killed mid-write (SIGKILL) leaves one; the age
/// covers the instant between creating and locking.
pub const STALE_TMP_AGE: std::time::Duration = std::time::Duration::from_secs(60);

/// Removes the temporary reports (`.kvprobe-report.*.tmp`) in `dir` that killed writers left
/// (see [`STALE_TMP_AGE`]); only this user's regular files. Best effort.
fn sweep_stale_temps(dir: &Path) {
    use std::os::unix::fs::MetadataExt;
    let (Ok(entries), Some(me)) = (std::fs::read_dir(dir), crate::sys::tempdir::own_uid()) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !(name.starts_with(TMP_PREFIX) && name.ends_with(TMP_SUFFIX)) {
            continue;
        }
        let path = e.path();
        let Ok(m) = std::fs::symlink_metadata(&path) else { continue };
        let old = m.modified().ok().and_then(|t| t.elapsed().ok()).is_some_and(|age| age > STALE_TMP_AGE);
        if m.is_file() && m.uid() == me && old && std::fs::File::open(&path).is_ok_and(|f| f.try_lock().is_ok()) {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// The report of the run in progress as last published ([`publish`]), for the watchdog.
static SHADOW: std::sync::Mutex<Option<Report>> = std::sync::Mutex::new(None);

/// Publishes the report so far, so that a call that blocks past its deadline still ends the
/// run with it (`run::expired_report`, the watchdog of `deadline`). Called after set-up steps, after
/// each sweep iteration and with each scenario progress update. Cheap: listed failures and
/// injections are appended, not copied again (a run only ever appends to them).
pub fn publish(r: &Report) {
    let mut s = SHADOW.lock().unwrap_or_else(|p| p.into_inner());
    match s.as_mut() {
        Some(sh)
            if sh.started_unix == r.started_unix
                && sh.config == r.config
                && sh.failures.len() <= r.failures.len()
                && sh.injections.len() <= r.injections.len() =>
        {
            sh.failures.extend_from_slice(&r.failures[sh.failures.len()..]);
            sh.injections.extend_from_slice(&r.injections[sh.injections.len()..]);
            sh.summary = r.summary.clone();
            sh.scenario = r.scenario.clone();
            if sh.environment.is_none() {
                sh.environment = r.environment.clone();
            }
        }
        _ => *s = Some(r.clone()),
    }
}

/// The report last [`publish`]ed in this process, if any.
pub fn last_published() -> Option<Report> {
    SHADOW.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Writes `value` as pretty JSON to `path` atomically: a new temporary file with a random
/// name in the target's directory (created exclusively, never through a symlink), given the
/// replaced report's mode and owner, synced, then renamed over the target; removed again when
/// any step fails. Temporary reports that killed writers left in that directory are removed
/// first ([`STALE_TMP_AGE`]). Symlinks at `path` are followed to their target; special files
/// are refused. Errors: [`Error::Io`] (exit 2).
pub fn write_atomic<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let mut body = serde_json::to_vec_pretty(value).map_err(|e| Error::Io(format!("report: serialise: {e}")))?;
    body.push(b'\n');
    write_bytes_atomic(path, &body, "--report")
}

/// Writes `body` to `path` atomically, exactly as [`write_atomic`] writes a report; `flag`
/// names the option in errors ("--junit"). Errors: [`Error::Io`] (exit 2).
pub fn write_bytes_atomic(path: &Path, body: &[u8], flag: &str) -> Result<()> {
    write_atomic_with(path, flag, |f| f.write_all(body))
}

/// [`write_bytes_atomic`] streaming: `fill` writes the body into the temporary file (a
/// bundle's archive), which is then synced and renamed over `path`; removed when any step
/// fails. Errors: [`Error::Io`] (exit 2).
pub fn write_atomic_with(path: &Path, flag: &str, fill: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let label = flag.trim_start_matches('-');
    let io = |what: &str, e: std::io::Error| Error::Io(format!("{label}: {what} {}: {e}", path.display()));
    let (target, dir) = resolve_target(path, flag)?;
    sweep_stale_temps(&dir);
    let mut tmp = tempfile::Builder::new()
        .prefix(TMP_PREFIX)
        .suffix(TMP_SUFFIX)
        .tempfile_in(&dir)
        .map_err(|e| io("create temp file for", e))?;
    // Marks the file as being written, for [`sweep_stale_temps`] (released when it closes).
    let _ = tmp.as_file().try_lock();
    let f = tmp.as_file_mut();
    match std::fs::metadata(&target) {
        Ok(m) => {
            // Keep the replaced report's owner and mode (without set-id bits).
            let _ = std::os::unix::fs::fchown(&*f, Some(m.uid()), Some(m.gid()));
            let _ = f.set_permissions(std::fs::Permissions::from_mode(m.mode() & 0o777));
        }
        Err(_) => {
            let _ = f.set_permissions(std::fs::Permissions::from_mode(0o644));
        }
    }
    fill(f).map_err(|e| io("write", e))?;
    f.sync_all().map_err(|e| io("sync", e))?;
    tmp.persist(&target).map_err(|e| io("rename into", e.error))?;
    if let Ok(d) = std::fs::File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The line before a report printed on stderr because it could not be written ([`print_fallback`]).
pub const FALLBACK_BEGIN: &str = "-----BEGIN KVPROBE REPORT-----";
/// The line after it.
pub const FALLBACK_END: &str = "-----END KVPROBE REPORT-----";

/// Puts a report that could not be written (`why`: [`write_atomic`]'s error) on stderr
/// instead, so a finished run's result is never lost: a message naming the error and where
/// the report went, then the JSON exactly as the file would have held it, alone on the lines
/// between [`FALLBACK_BEGIN`] and [`FALLBACK_END`]. `what` names the file for the message
/// ("--report r.json"). Returns false when stderr did not take it either (then nothing more
/// can be done: the human summary on stdout is all that is left).
pub fn print_fallback<T: Serialize>(what: &str, value: &T, why: &Error) -> bool {
    let Ok(body) = serde_json::to_string_pretty(value) else { return false };
    let text = format!(
        "kvprobe: {what} was not written ({why}); the report follows on stderr, between the lines {FALLBACK_BEGIN} and {FALLBACK_END}\n{FALLBACK_BEGIN}\n{body}\n{FALLBACK_END}\n"
    );
    let mut e = std::io::stderr().lock();
    e.write_all(text.as_bytes()).and_then(|_| e.flush()).is_ok()
}
