//! SIGINT/SIGTERM/SIGHUP handling: the first signal asks the run to stop at the next iteration
//! boundary (a sweep's transfer in flight gets up to [`GRACE`] after the signal to complete,
//! and its iteration is then verified; one still incomplete is abandoned unverified; a
//! scenario stops at its next engine step); the partial report is written and marked
//! `interrupted`. A second signal, a second or more later, ends the run at once with 130: the
//! watchdog thread (`deadline`) writes the report published so far, marked
//! `interrupted`, without waiting for the run; a third signal exits with 130 even if that
//! write is held up. A repeat within a second counts as the same request: `timeout(1)` sends
//! its signal to kvprobe and again to the process group, and two Ctrl-C presses that close are
//! one impatient user.
//!
//! SIGHUP (a closed terminal, an ssh hangup, `kill -HUP`) counts as SIGTERM: the run stops
//! with its report. UCX would take SIGHUP for its debug handler (`UCX_DEBUG_SIGNO` defaults
//! to it) and swallow it; kvprobe sets `UCX_DEBUG_SIGNO=0` where the user has not
//! ([`crate::xfer::nixl::set_process_env`]). A user who sets it to SIGHUP gives SIGHUP to UCX.
//!
//! SIGXFSZ (a write past the file-size limit, `ulimit -f`) is ignored ([`ignore_file_size_signal`]):
//! the write then fails with EFBIG, an error kvprobe handles like a full disk, instead of
//! killing it with no report.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static INSTALLED: OnceLock<()> = OnceLock::new();
static FLAG: AtomicBool = AtomicBool::new(false);
/// Set by a second signal (a second or more after the first).
static SECOND: AtomicBool = AtomicBool::new(false);
/// CLOCK_MONOTONIC milliseconds of the first signal.
static FIRST_MS: AtomicU64 = AtomicU64::new(0);

/// Milliseconds of CLOCK_MONOTONIC (async-signal-safe).
fn now_ms() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the valid `ts`; it is async-signal-safe.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

fn on_signal() {
    if !FLAG.swap(true, Ordering::SeqCst) {
        FIRST_MS.store(now_ms().max(1), Ordering::SeqCst);
        return;
    }
    if now_ms().saturating_sub(FIRST_MS.load(Ordering::SeqCst)) >= 1000 && SECOND.swap(true, Ordering::SeqCst) {
        // SAFETY: _exit is async-signal-safe; the user asked three times to stop now (the
        // second signal's report write, by the watchdog, is held up).
        unsafe { libc::_exit(130) };
    }
}

/// Installs the handlers (idempotent). Errors: the signal handlers cannot be registered.
pub fn install() -> std::io::Result<()> {
    if INSTALLED.get().is_some() {
        return Ok(());
    }
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM, signal_hook::consts::SIGHUP] {
        // SAFETY: `on_signal` only touches atomics, clock_gettime and _exit, all
        // async-signal-safe; it allocates nothing and takes no lock.
        unsafe { signal_hook::low_level::register(sig, on_signal) }?;
    }
    let _ = INSTALLED.set(());
    Ok(())
}

/// How long after the first signal a sweep's transfer in flight may still complete (its
/// iteration is then verified and reported); README "Exit codes" states the same.
pub const GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Time since the first SIGINT/SIGTERM/SIGHUP, or `None` when none arrived.
pub fn since_requested() -> Option<std::time::Duration> {
    if !requested() {
        return None;
    }
    let first = FIRST_MS.load(Ordering::SeqCst);
    Some(std::time::Duration::from_millis(now_ms().saturating_sub(first)))
}

/// True once a second SIGINT/SIGTERM/SIGHUP arrived, a second or more after the first: the run
/// ends at once (the watchdog writes the report so far).
pub fn second_requested() -> bool {
    SECOND.load(Ordering::SeqCst)
}

/// True once SIGINT, SIGTERM or SIGHUP arrived.
pub fn requested() -> bool {
    FLAG.load(Ordering::SeqCst)
}

/// Ignores SIGXFSZ for the life of the process (and of the processes it starts, which inherit
/// the ignored disposition): a write past `RLIMIT_FSIZE` fails with EFBIG instead of killing
/// kvprobe before it can report, and UCX then fails its shared-memory set-up cleanly (removing
/// its segment) instead of dying with one left in /dev/shm. Call first thing in `main`.
pub fn ignore_file_size_signal() {
    // SAFETY: signal(2) with SIG_IGN installs no handler code; called at start-up.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}
