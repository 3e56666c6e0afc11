//! kvprobe's private temporary directories: nothing kvprobe makes outlives it, even on SIGKILL.
//!
//! Every file kvprobe (or a helper it starts) needs by name while it runs — UCX's log, the
//! Mooncake worker's script — lives in one directory per process, `$TMPDIR/kvprobe-PID.RANDOM/`
//! ([`dir`]); UCX's shared-memory segments (its `posix` transport) go to a second one,
//! `/dev/shm/kvprobe-PID.RANDOM/` ([`shm_dir`], given to UCX as `UCX_POSIX_DIR`). Logs that only
//! kvprobe reads back are anonymous files, never named at all ([`anonymous_file`]).
//!
//! Each directory holds a file `lock` that its process keeps locked (`flock`, exclusive) for
//! its whole life; the directory is created under a temporary name and renamed to its final
//! one only once the lock is held. kvprobe removes its directories at exit ([`remove_own`]);
//! when it cannot (SIGKILL, a crash, a second Ctrl-C), the next kvprobe started by the same
//! user removes them at its start ([`sweep_stale`]): a directory whose `lock` it can lock has
//! no living owner. The kernel drops a lock when its holder dies, whatever the PID namespace,
//! so a live run's directory is never taken and a recycled PID never keeps a dead one.

use crate::error::{Error, Result};
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, SystemTime};

/// Prefix of the directories' names (`kvprobe-PID.RANDOM`).
pub const PREFIX: &str = "kvprobe-";

/// Prefix of a directory still being set up (renamed to `kvprobe-PID.RANDOM` once locked).
const NEW_PREFIX: &str = ".kvprobe-new.";

/// A directory being set up that is older than this has lost its creator: it is removed.
const NEW_MAX_AGE: Duration = Duration::from_secs(600);

/// Where UCX's posix transport puts its segments by default (shm_open).
pub const SHM_ROOT: &str = "/dev/shm";

/// One private directory and the open, locked `lock` file that marks it alive.
struct Private {
    path: PathBuf,
    /// Closed just before the directory is removed at exit (removal needs a descriptor, and
    /// under a tight `ulimit -n` that one may be the last).
    lock: Mutex<Option<File>>,
}

static TMP: OnceLock<std::result::Result<Private, String>> = OnceLock::new();
static SHM: OnceLock<std::result::Result<Private, String>> = OnceLock::new();
/// Serialises the creation of both directories and their removal at exit.
static GUARD: Mutex<()> = Mutex::new(());

/// True for `kvprobe-PID.RANDOM` (decimal PID, a random suffix of at least 6 characters).
fn is_private_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix(PREFIX) else { return false };
    let Some((pid, rand)) = rest.split_once('.') else { return false };
    !pid.is_empty()
        && pid.bytes().all(|b| b.is_ascii_digit())
        && rand.len() >= 6
        && rand.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// Creates `root/kvprobe-PID.RANDOM/` (mode 0700) holding a locked `lock` file.
fn create(root: &Path) -> std::result::Result<Private, String> {
    let fail = |what: &str, e: std::io::Error| format!("{what} in {}: {e}", root.display());
    let new = tempfile::Builder::new()
        .prefix(NEW_PREFIX)
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700))
        .tempdir_in(root)
        .map_err(|e| fail("cannot create a directory", e))?;
    let suffix =
        new.path().file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix(NEW_PREFIX)).unwrap_or("").to_string();
    let lock = File::create_new(new.path().join("lock")).map_err(|e| fail("cannot create a lock file", e))?;
    lock.try_lock().map_err(|e| format!("cannot lock {}: {e}", new.path().join("lock").display()))?;
    let path = root.join(format!("{PREFIX}{}.{suffix}", std::process::id()));
    std::fs::rename(new.path(), &path).map_err(|e| fail("cannot rename a directory", e))?;
    let _ = new.keep();
    Ok(Private { path, lock: Mutex::new(Some(lock)) })
}

fn get(cell: &'static OnceLock<std::result::Result<Private, String>>, root: &Path) -> Result<&'static Path> {
    let _g = GUARD.lock().unwrap_or_else(|p| p.into_inner());
    cell.get_or_init(|| create(root)).as_ref().map(|p| p.path.as_path()).map_err(|e| Error::Environment(e.clone()))
}

/// kvprobe's private directory in the temporary directory (`$TMPDIR`, else /tmp), created on
/// first use. Errors: [`Error::Environment`] (exit 2) when it cannot be created there.
pub fn dir() -> Result<&'static Path> {
    get(&TMP, &std::env::temp_dir())
}

/// kvprobe's private directory in /dev/shm, created on first use (for UCX's shared-memory
/// segments). Errors: [`Error::Environment`] when /dev/shm is missing or refuses it.
pub fn shm_dir() -> Result<&'static Path> {
    get(&SHM, Path::new(SHM_ROOT))
}

/// A file with no name (O_TMPFILE, or created and unlinked at once) in [`dir`], or in the
/// temporary directory when [`dir`] cannot be made: gone as soon as its last descriptor closes.
/// Errors: the file system refuses it.
pub fn anonymous_file() -> std::io::Result<File> {
    match dir() {
        Ok(d) => tempfile::tempfile_in(d),
        Err(_) => tempfile::tempfile(),
    }
}

/// Removes this process's private directories (at exit; later calls to [`dir`] do not
/// recreate them).
pub fn remove_own() {
    let _g = GUARD.lock().unwrap_or_else(|p| p.into_inner());
    for cell in [&TMP, &SHM] {
        let _ = cell.set(Err("kvprobe is exiting".into()));
        if let Some(Ok(p)) = cell.get() {
            drop(p.lock.lock().unwrap_or_else(|e| e.into_inner()).take());
            let _ = std::fs::remove_dir_all(&p.path);
        }
    }
}

/// This process's effective uid (the owner of its /proc entry); `None` without /proc.
pub(crate) fn own_uid() -> Option<u32> {
    std::fs::metadata("/proc/self").map(|m| m.uid()).ok()
}

/// Removes the private directories of kvprobe processes that are gone (see the module
/// documentation) from `$TMPDIR` and /dev/shm. Only directories owned by this user and named
/// as kvprobe names them are considered; errors are ignored (best effort).
pub fn sweep_stale() {
    sweep_in(&std::env::temp_dir());
    sweep_in(Path::new(SHM_ROOT));
}

/// [`sweep_stale`] in one directory; returns the directories removed.
pub fn sweep_in(root: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(root) else { return removed };
    let Some(me) = own_uid() else { return removed };
    let own = |p: &Path| TMP.get().into_iter().chain(SHM.get()).any(|c| c.as_ref().is_ok_and(|x| x.path == p));
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let path = e.path();
        let Ok(m) = std::fs::symlink_metadata(&path) else { continue };
        if !m.is_dir() || m.uid() != me || own(&path) {
            continue;
        }
        let stale = if is_private_name(name) {
            // A directory whose lock nobody holds (or without one: never completed) is dead.
            match File::open(path.join("lock")) {
                Ok(f) => f.try_lock().is_ok(),
                Err(_) => true,
            }
        } else if name.starts_with(NEW_PREFIX) {
            m.modified().ok().and_then(|t| SystemTime::now().duration_since(t).ok()).is_some_and(|age| age > NEW_MAX_AGE)
        } else {
            false
        };
        if stale && std::fs::remove_dir_all(&path).is_ok() {
            removed.push(path);
        }
    }
    removed
}

/// kvprobe's data directory: `$KVPROBE_HOME`, else `$XDG_DATA_HOME/kvprobe`, else
/// `~/.local/share/kvprobe`.
/// Empty or relative values are ignored (a relative path would make kvprobe load a
/// library from the current directory).
pub fn kvprobe_home() -> std::path::PathBuf {
    let abs = |k: &str| std::env::var_os(k).map(std::path::PathBuf::from).filter(|p| p.is_absolute());
    if let Some(h) = abs("KVPROBE_HOME") {
        return h;
    }
    if let Some(x) = abs("XDG_DATA_HOME") {
        return x.join("kvprobe");
    }
    let home = std::env::home_dir().unwrap_or_else(|| std::path::PathBuf::from("/nonexistent"));
    home.join(".local/share/kvprobe")
}
