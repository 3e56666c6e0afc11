//! Deadlines for every wait of a run (`--timeout`), and the watchdog that ends a run whose
//! call blocks past its deadline.
//!
//! What `--timeout` bounds (docs/guide.md, "What `--timeout` bounds"):
//! - each NIXL request: from just before it is created (descriptor lists, `createXferReq`,
//!   `postXferReq`) until the initiator sees it complete and the other role has its
//!   notification ([`Deadline`], checked by `nixl::Agent::post` and
//!   `nixl::Agent::poll`, `transport::await_notifications`, the scenario
//!   engine);
//! - each other blocking call of the run ([`watch`], [`Watch::check`]): a CUDA
//!   synchronisation, event wait or synchronous copy, a write to the Mooncake worker's pipe —
//!   from just before the call, with the run's limit ([`set_limit`]); NIXL status and
//!   notification queries are polls for requests with their own deadlines: one still in
//!   progress when such a deadline passed is a timeout ([`crossed`], checked by the callers),
//!   one that never returns is found by the watchdog;
//! - set-up calls (NIXL agent and backend creation, memory registration, metadata) get at
//!   least [`SETUP_FLOOR`] ([`setup_limit`]).
//!
//! A call that returns after its deadline is a timeout (exit 4) found by its caller, which then
//! ends the run normally (report written, helpers stopped). A call that does not return at all
//! is found by the watchdog thread: [`GRACE`] after the deadline it hands the error to the
//! handler the command installed ([`on_expiry`]; `kvprobe run` and `ab` write the report of
//! the run so far, outcome `timeout`) and ends the process with exit 4 without joining the
//! stuck call. Helper processes die with kvprobe (`PR_SET_PDEATHSIG`, [`crate::sys::child`]).
//! The same thread keeps SIGINT/SIGTERM from being held up by a blocked call
//! ([`INTERRUPT_GRACE`]: the report is then marked interrupted, exit 130), and ends the run at
//! once on a second signal ([`crate::sys::interrupt::second_requested`]) through the same handler,
//! so the report so far is still written.
//!
//! Test-only fault hooks: `KVPROBE_TEST_STALL_<POINT>=SECS` makes the call at `<POINT>` block
//! for SECS seconds inside its watched region ([`Stall`]). They exist to prove the above in
//! tests and are never set in normal use.

use crate::error::Error;
use std::borrow::Cow;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a call may stay blocked after its deadline before the watchdog ends the run
/// (a call that returns within it is handled by its caller, with the full report).
pub const GRACE: Duration = Duration::from_secs(5);

/// How long after SIGINT/SIGTERM (or after it began, if later) a watched call may stay blocked
/// and keep the run from stopping before the watchdog ends it with the report marked
/// interrupted (exit 130): a second more than a transfer in flight is given
/// ([`crate::sys::interrupt::GRACE`]).
pub const INTERRUPT_GRACE: Duration = Duration::from_secs(crate::sys::interrupt::GRACE.as_secs() + 1);

/// The least bound of a set-up call (NIXL agent and backend start, registration, metadata
/// exchange, the Mooncake worker's set-up): UCX, its transports and the store client take
/// seconds to start on a loaded host, whatever a short `--timeout` says. The default
/// `--timeout`, so with it every wait has the same bound.
pub const SETUP_FLOOR: Duration = Duration::from_secs(60);

/// A deadline started just before a wait began: `start + limit`.
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    /// When the wait began (just before the first call of it).
    pub start: Instant,
    /// The bound (`--timeout`).
    pub limit: Duration,
}

impl Deadline {
    /// A deadline `limit` from now.
    pub fn after(limit: Duration) -> Deadline {
        Deadline { start: Instant::now(), limit }
    }

    /// The instant it passes (far in the future when `start + limit` overflows).
    pub fn at(&self) -> Instant {
        let far = || self.start.checked_add(Duration::from_secs(1 << 32));
        self.start.checked_add(self.limit).or_else(far).unwrap_or(self.start)
    }

    /// True when `t` is past the deadline.
    pub fn passed_at(&self, t: Instant) -> bool {
        t > self.at()
    }

    /// Seconds since the wait began.
    pub fn elapsed_secs(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// The limit in seconds.
    pub fn limit_secs(&self) -> f64 {
        self.limit.as_secs_f64()
    }
}

/// True when a poll call (a NIXL status or notification query) for a request with deadline
/// `d`, begun at `asked` and returned at `returned`, was in progress when `d` passed: the wait
/// exceeded `--timeout` inside the call, whatever it found (a call begun after the deadline
/// is the first check after kvprobe was busy elsewhere: docs/guide.md "What `--timeout` bounds").
pub fn crossed(d: &Deadline, asked: Instant, returned: Instant) -> bool {
    !d.passed_at(asked) && d.passed_at(returned)
}

/// Called by the watchdog with the timeout error of a call that stayed blocked past its
/// deadline; it should write what it can and end the process (if it returns, the watchdog
/// prints the error and exits 4).
pub type Handler = Arc<dyn Fn(&Error) + Send + Sync>;

struct Armed {
    id: u64,
    armed_at: Instant,
    deadline: Instant,
    limit: Duration,
    what: Cow<'static, str>,
}

#[derive(Default)]
struct State {
    armed: Vec<Armed>,
    next_id: u64,
    limit: Option<Duration>,
    handler: Option<Handler>,
    started: bool,
}

fn state() -> &'static (Mutex<State>, Condvar) {
    static S: OnceLock<(Mutex<State>, Condvar)> = OnceLock::new();
    S.get_or_init(|| (Mutex::new(State::default()), Condvar::new()))
}

fn lock() -> std::sync::MutexGuard<'static, State> {
    state().0.lock().unwrap_or_else(|p| p.into_inner())
}

/// Sets the bound of the run's blocking calls ([`watch`]; `None`: unbounded, as outside a
/// run). Called at the start of `run` and `ab` with `--timeout`.
pub fn set_limit(limit: Option<Duration>) {
    lock().limit = limit;
}

/// The bound of the run's blocking calls, if one is set.
pub fn limit() -> Option<Duration> {
    lock().limit
}

/// The bound of a set-up call: the run's limit, but at least [`SETUP_FLOOR`].
pub fn setup_limit() -> Option<Duration> {
    limit().map(|l| l.max(SETUP_FLOOR))
}

/// Installs what the watchdog calls when a call stays blocked past its deadline (replaces any
/// earlier handler).
pub fn on_expiry(handler: Handler) {
    lock().handler = Some(handler);
}

/// A watched call: disarmed when dropped.
#[must_use = "the call is watched while this guard lives"]
pub struct Watch {
    id: Option<u64>,
    deadline: Option<Deadline>,
}

impl Watch {
    /// Ends the watch after the call returned: [`Error::Timeout`] (exit 4) when it returned
    /// after its deadline — a call that took longer than its bound is a timeout even though
    /// it returned.
    pub fn check(self) -> crate::error::Result<()> {
        let (Some(id), Some(d)) = (self.id, self.deadline) else { return Ok(()) };
        let returned = Instant::now();
        if !d.passed_at(returned) {
            return Ok(());
        }
        let what = lock().armed.iter().find(|a| a.id == id).map(|a| a.what.to_string()).unwrap_or_default();
        Err(Error::Timeout(format!(
            "{what} took {:.3} s, over its bound of {:.6} s",
            (returned - d.start).as_secs_f64(),
            d.limit_secs()
        )))
    }
}

/// Set once the watchdog ends the run: a watched call that returns after that never goes on
/// (its thread waits for the process to end), so the run is not ended twice.
static FIRED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl Drop for Watch {
    fn drop(&mut self) {
        while FIRED.load(std::sync::atomic::Ordering::SeqCst) {
            std::thread::sleep(Duration::from_secs(1));
        }
        if let Some(id) = self.id {
            let mut s = lock();
            if let Some(i) = s.armed.iter().position(|a| a.id == id) {
                s.armed.swap_remove(i);
            }
        }
    }
}

/// Watches a blocking call that starts now, with the run's limit ([`set_limit`]); no-op
/// when none is set. `what` names the call in the error (called only when the call is
/// watched; hot paths pass a static name).
pub fn watch(what: impl FnOnce() -> Cow<'static, str>) -> Watch {
    match limit() {
        Some(l) => watch_until(Deadline::after(l), what),
        None => Watch { id: None, deadline: None },
    }
}

/// Watches a set-up call that starts now ([`setup_limit`]); no-op outside a run.
pub fn watch_setup(what: impl FnOnce() -> Cow<'static, str>) -> Watch {
    match setup_limit() {
        Some(l) => watch_until(Deadline::after(l), what),
        None => Watch { id: None, deadline: None },
    }
}

/// Watches a blocking call bounded by `deadline` (a transfer's): if it has not returned
/// [`GRACE`] after the deadline, the watchdog ends the run.
pub fn watch_until(deadline: Deadline, what: impl FnOnce() -> Cow<'static, str>) -> Watch {
    let mut s = lock();
    let id = s.next_id;
    s.next_id += 1;
    s.armed.push(Armed { id, armed_at: Instant::now(), deadline: deadline.at(), limit: deadline.limit, what: what() });
    start_locked(&mut s);
    Watch { id: Some(id), deadline: Some(deadline) }
}

fn start_locked(s: &mut State) {
    if !s.started {
        s.started = true;
        std::thread::Builder::new().name("kvprobe-watchdog".into()).spawn(watchdog).ok();
    }
}

/// Starts the watchdog thread now (idempotent; otherwise it starts with the first watched
/// call). The binary calls it right after installing the signal handlers: the watchdog also
/// ends the run on a second SIGINT/SIGTERM, writing the report so far through the [`on_expiry`] handler (exit 130).
pub fn start_watchdog() {
    start_locked(&mut lock());
}

fn watchdog() {
    let (m, cv) = state();
    let mut s = m.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let now = Instant::now();
        // A call blocked for INTERRUPT_GRACE since the signal (or since it began, if later)
        // keeps the run from stopping: end it here with the report marked interrupted (130).
        let stuck = crate::sys::interrupt::since_requested()
            .filter(|d| *d >= INTERRUPT_GRACE)
            .and_then(|_| s.armed.iter().find(|a| now.duration_since(a.armed_at) >= INTERRUPT_GRACE).map(|a| a.what.clone()));
        let due = s
            .armed
            .iter()
            .min_by_key(|a| a.deadline)
            .map(|a| (a.deadline.checked_add(GRACE).unwrap_or(a.deadline), a.limit, a.what.clone()));
        let fire = match (stuck, due) {
            // A second signal: the user wants out now, with the report so far.
            _ if crate::sys::interrupt::second_requested() => Some(Error::Interrupted(
                "a second signal: kvprobe ended the run at once, without waiting for the call or iteration in progress".into(),
            )),
            (Some(what), _) => Some(Error::Interrupted(format!(
                "{what} was still blocked {} s after the signal; kvprobe ended the run without waiting for it",
                INTERRUPT_GRACE.as_secs()
            ))),
            (None, Some((at, limit, what))) if at <= now => Some(Error::Timeout(format!(
                "{what} did not return within {:.3} s (still blocked {} s after its deadline; kvprobe ended the run \
                 without waiting for it)",
                limit.as_secs_f64(),
                GRACE.as_secs()
            ))),
            (None, due) => {
                // Checks at least every 100 ms (arming does not wake it: a watched status
                // query runs in a spin loop, and a wake-up per call would cost a system call).
                let wait = due.map_or(Duration::from_millis(100), |(at, _, _)| (at - now).min(Duration::from_millis(100)));
                s = cv.wait_timeout(s, wait).unwrap_or_else(|p| p.into_inner()).0;
                None
            }
        };
        if let Some(e) = fire {
            FIRED.store(true, std::sync::atomic::Ordering::SeqCst);
            let handler = s.handler.clone();
            drop(s);
            if let Some(h) = handler {
                h(&e);
            }
            eprintln!("kvprobe: {e}");
            end_process(e.exit() as u8);
        }
    }
}

static EXIT: OnceLock<fn(u8) -> !> = OnceLock::new();

/// Sets how the watchdog ends the process when a deadline expires (the binary passes
/// `nixl::exit_now`, which skips library destructors that can crash at exit). The first call
/// wins; unset, the watchdog flushes stdout and stderr and calls `std::process::exit`.
pub fn set_exit(exit: fn(u8) -> !) {
    let _ = EXIT.set(exit);
}

fn end_process(code: u8) -> ! {
    if let Some(exit) = EXIT.get() {
        exit(code)
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    std::process::exit(code as i32)
}

static AGENT_PROCESS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Marks this process as the second process of `run --decode-process` (its child `kvprobe
/// serve --fd N`, prefill's side): its stall points read `KVPROBE_TEST_STALL_AGENT_<NAME>`
/// instead, so a test can stall one process of the two.
pub fn set_agent_process() {
    AGENT_PROCESS.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Where this process's sweep is: `(iteration << 16) | stage` (0 before the first iteration),
/// what [`STALL_FROM_VAR`] compares with.
static POSITION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Says that this process's sweep has begun stage `stage` (0-based: waiting for its request)
/// of iteration `it` (1-based), for [`STALL_FROM_VAR`].
pub fn set_position(it: u32, stage: u32) {
    POSITION.store((u64::from(it) << 16) | u64::from(stage.min(0xffff)), std::sync::atomic::Ordering::SeqCst);
}

/// Test-only: `KVPROBE_TEST_STALL_FROM_ITERATION=N[:K]` arms the stall points of this process
/// only once its sweep has begun iteration N (stage K of it, default 0): set-up and what comes
/// before run unstalled, so that a stall can come after a verified iteration, or after a
/// verified stage while the next is in flight, whichever thread makes the call. Unset: armed
/// from the start.
pub const STALL_FROM_VAR: &str = crate::sys::test_hooks::STALL_FROM_ITERATION;

/// Points where a test can make a call block (`KVPROBE_TEST_STALL_<NAME>=SECS` in kvprobe,
/// `KVPROBE_TEST_STALL_AGENT_<NAME>=SECS` in the prefill process of `run --decode-process`;
/// [`STALL_FROM_VAR`] delays them; test-only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stall {
    /// Inside `nixl::Agent::post`, after `postXferReq` returned: the call waits
    /// until the request has completed, then blocks SECS more — a post call that completes
    /// its request inside it (SECS = 0) and takes long: `KVPROBE_TEST_STALL_POST`.
    Post,
    /// Inside a NIXL transfer status query: `KVPROBE_TEST_STALL_STATUS`.
    Status,
    /// Inside a NIXL notification query: `KVPROBE_TEST_STALL_NOTIFICATIONS`.
    Notifications,
    /// Inside a CUDA synchronisation or event wait (VRAM): `KVPROBE_TEST_STALL_SYNC`.
    Sync,
    /// `serve`'s start-up, just before it says it is ready (its NIXL agent connected): in the
    /// prefill process of `run --decode-process`, `KVPROBE_TEST_STALL_AGENT_START`.
    Start,
}

impl Stall {
    const ALL: [Stall; 5] = [Stall::Post, Stall::Status, Stall::Notifications, Stall::Sync, Stall::Start];

    /// The environment variable that sets it in this process.
    pub fn var(self) -> String {
        let name = match self {
            Stall::Post => "POST",
            Stall::Status => "STATUS",
            Stall::Notifications => "NOTIFICATIONS",
            Stall::Sync => "SYNC",
            Stall::Start => "START",
        };
        let agent = if AGENT_PROCESS.load(std::sync::atomic::Ordering::SeqCst) { "AGENT_" } else { "" };
        format!("{}{agent}{name}", crate::sys::test_hooks::STALL_PREFIX)
    }

    /// The seconds its variable names (read once per process), if set and armed
    /// ([`STALL_FROM_VAR`]).
    pub fn secs(self) -> Option<Duration> {
        static FROM: OnceLock<u64> = OnceLock::new();
        let from = *FROM.get_or_init(|| {
            let v = std::env::var(STALL_FROM_VAR).unwrap_or_default();
            let (it, stage) = v.trim().split_once(':').unwrap_or((v.trim(), "0"));
            match (it.parse::<u64>(), stage.parse::<u64>()) {
                (Ok(i), Ok(k)) => (i << 16) | k.min(0xffff),
                _ => 0,
            }
        });
        if POSITION.load(std::sync::atomic::Ordering::SeqCst) < from {
            return None;
        }
        static SECS: OnceLock<[Option<Duration>; 5]> = OnceLock::new();
        let all = SECS.get_or_init(|| {
            Stall::ALL.map(|p| {
                std::env::var(p.var())
                    .ok()
                    .and_then(|v| v.trim().parse::<f64>().ok())
                    .and_then(|s| Duration::try_from_secs_f64(s).ok())
            })
        });
        all[Stall::ALL.iter().position(|&p| p == self).unwrap_or(0)]
    }

    /// Blocks for the seconds its variable names; nothing when unset.
    pub fn here(self) {
        if let Some(d) = self.secs() {
            std::thread::sleep(d);
        }
    }
}
