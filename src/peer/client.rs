//! The decode side's handle on a prefill side in another process or host (`run --peer`, and
//! the child `kvprobe serve` of `run --decode-process`, [`start_child`]): what the sweep asks
//! of prefill (fill a stage, post a WRITE, which notifications arrived) as messages of the
//! peer protocol ([`super::Msg`]).

use super::{Link, Msg, Side};
use crate::error::{Error, Result};
use crate::report::PeerSide;
use crate::sys::deadline::Deadline;
use crate::xfer::nixl::XferResult;
use crate::xfer::transport::PeerInfo;
use std::collections::{HashMap, HashSet};
use std::os::fd::AsRawFd;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long decode waits for prefill to start a scenario run ([`PrefillPeer::begin`]) with a
/// silence bound of `silence` (the run's `--timeout`, at least 1 s): twice the set-up floor's
/// share of it (`--timeout`, at least [`crate::sys::deadline::SETUP_FLOOR`]: prefill's Mooncake
/// store client starting, then joining), plus the 30 s a master it starts may take, plus
/// [`crate::sys::deadline::GRACE`].
pub fn begin_bound(silence: Duration) -> Duration {
    2 * silence.max(crate::sys::deadline::SETUP_FLOOR) + Duration::from_secs(30) + crate::sys::deadline::GRACE
}

/// How long connecting to `serve` may take (TCP connect, a refused connection tried again
/// every 0.2 s within it: a serve started beside the run may not listen yet), before the
/// handshake's own bound.
pub const CONNECT_BOUND: Duration = Duration::from_secs(10);

/// Most notifications from prefill decode keeps unclaimed ([`Msg::Notified`]): a sweep has at
/// most two requests per stage in flight, and at most as many stages as layers.
pub const MAX_NOTIFIED: usize = 65_536;

/// Longest notification tag accepted from prefill (bytes); kvprobe's are under 64.
pub const MAX_TAG: usize = 256;

/// How long a failed transfer waits for the link to show whether prefill is gone
/// ([`PrefillPeer::cause_of`]).
pub const CAUSE_WAIT: Duration = Duration::from_millis(300);

#[derive(Default)]
struct State {
    /// Fills acknowledged: (iteration, stage).
    filled: HashSet<(u32, Option<u32>)>,
    /// Fills sent and not yet acknowledged.
    pending_fills: usize,
    /// When each unacknowledged fill was sent.
    fill_sent: HashMap<(u32, Option<u32>), Instant>,
    /// Prefill's WRITEs seen complete, by tag.
    written: HashMap<String, XferResult>,
    /// Notifications prefill's agent received, by tag.
    /// Notification tags prefill forwarded and nobody claimed yet, each with the window (this
    /// side's clock) in which prefill's query that returned it was in progress: from the
    /// query's length before it arrived here, to its arrival.
    notified: HashMap<String, (Instant, Instant)>,
    /// Seconds prefill spent filling (its clock).
    fill_seconds: f64,
    /// Seconds prefill's fill kernels ran since [`PrefillPeer::take_fill_kernel_seconds`].
    fill_kernel_seconds: f64,
    /// Prefill's report section, once it said goodbye.
    bye: Option<PeerSide>,
    /// The region plan prefill opened, with its agents ([`Msg::RegionOpened`]).
    region_opened: Option<(u32, Vec<PeerInfo>)>,
    /// The region plan prefill closed ([`Msg::RegionClosed`]).
    region_closed: Option<u32>,
    /// The region answer decode waits for: one, once.
    region_asked: Option<RegionAsk>,
}

/// Which region answer decode waits for ([`PrefillPeer::region_open`], [`PrefillPeer::region_close`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RegionAsk {
    Open,
    Close,
}

/// The prefill side of a node pair, reached over the peer protocol.
pub struct PrefillPeer {
    link: Link,
    /// Prefill's NIXL agent (TP rank 0's).
    pub info: PeerInfo,
    /// With `--prefill-tp` > 1: the agents of prefill's ranks 1.. .
    pub ranks_info: Vec<PeerInfo>,
    /// What prefill announced (geometry, memory, GPU, host).
    pub side: Side,
    /// What the report says of prefill until its goodbye replaces it.
    pub section: PeerSide,
    state: Mutex<State>,
    /// Where prefill lives when this process started it (after `link`: dropped once the link
    /// is closed, which ends its session).
    holder: Option<Holder>,
    /// Prefill on a thread of this process: the slots its region agents' registrations come
    /// by ([`super::LeaseSlots`]).
    pub region_leases: Option<std::sync::Arc<super::LeaseSlots>>,
}

/// A prefill side this process started.
pub enum Holder {
    /// `--decode-process`: a child process.
    Child(PrefillChild),
    /// The plain sweep: a thread of this process.
    Thread(PrefillThread),
}

/// The plain sweep's prefill side: a thread of this process serving one session over a Unix
/// socket pair ([`start_thread`]). Dropped (after its link is closed), it is joined within
/// [`EXIT_GRACE`] ([`EXIT_GRACE_INTERRUPTED`] after a signal); one that has not ended by then
/// (stuck in a NIXL or CUDA call) is left to the process's exit, with a line on stderr. Its
/// pool is never freed under a request of this process: each request holds a share of its
/// registrations (`serve::Handoff::lease`).
pub struct PrefillThread {
    handle: Option<std::thread::JoinHandle<crate::error::Exit>>,
}

impl Drop for PrefillThread {
    fn drop(&mut self) {
        let Some(h) = self.handle.take() else { return };
        let t0 = Instant::now();
        let grace = if crate::sys::interrupt::requested() { EXIT_GRACE_INTERRUPTED } else { EXIT_GRACE };
        while t0.elapsed() < grace {
            if h.is_finished() {
                let _ = h.join();
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        eprintln!("kvprobe: the prefill thread did not end within {} s of its session's end; left to the exit", grace.as_secs());
    }
}

/// The plain sweep: starts prefill's side on a thread of this process — `session` (the
/// caller's: `serve::serve_in_process`) on one end of a Unix socket pair, with a fresh
/// random token — and authenticates with it as [`start_child`] does with a child. Returns the
/// link and the thread. Errors: environment (no socket pair, no thread), transport (the
/// session ended before its welcome), timeout (no welcome within [`super::HANDSHAKE_BOUND`]).
pub fn start_thread(
    silence: Duration,
    run_id: &str,
    session: impl FnOnce(std::os::unix::net::UnixStream, String) -> crate::error::Exit + Send + 'static,
) -> Result<(Link, PrefillThread)> {
    let token = super::random_hex(16)?;
    let (mine, theirs) = std::os::unix::net::UnixStream::pair()
        .map_err(|e| Error::Environment(format!("cannot make a socket pair for the prefill thread: {e}")))?;
    let t = token.clone();
    let handle = std::thread::Builder::new()
        .name("kvprobe-prefill".into())
        .spawn(move || session(theirs, t))
        .map_err(|e| Error::Environment(format!("cannot start the prefill thread: {e}")))?;
    let thread = PrefillThread { handle: Some(handle) };
    let link = super::client(super::Stream::Unix(mine), &token, run_id, silence, "the prefill thread".into())?;
    Ok((link, thread))
}

/// How long kvprobe waits for the prefill process of `--decode-process` to exit once their
/// link is closed (it deregisters its memory and closes its NIXL agent) before killing it.
pub const EXIT_GRACE: Duration = Duration::from_secs(5);

/// [`EXIT_GRACE`] after SIGINT/SIGTERM: a child that is stuck or stopped is killed after this,
/// so an interrupted run exits within [`crate::sys::deadline::INTERRUPT_GRACE`] of the signal plus
/// `run::PEER_BYE_BOUND` and this (docs/guide.md "What `--timeout` bounds").
pub const EXIT_GRACE_INTERRUPTED: Duration = Duration::from_secs(1);

/// How long the prefill process of `--decode-process` has to become ready — from its start to
/// its NIXL agent connected to decode's (fixed; not `--timeout`).
pub const START_BOUND: Duration = Duration::from_secs(120);

/// Test-only: `KVPROBE_TEST_AGENT_START_SECS=SECS` replaces [`START_BOUND`], so a test of a
/// child that never becomes ready does not take two minutes. Never set in normal use.
fn start_bound() -> Duration {
    crate::sys::test_hooks::value(crate::sys::test_hooks::AGENT_START_SECS)
        .and_then(|v| v.trim().parse::<f64>().ok())
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .unwrap_or(START_BOUND)
}

/// The prefill process of `run --decode-process` (a child `kvprobe serve --fd N`). It dies
/// with kvprobe however kvprobe exits ([`crate::sys::child::spawn`]); dropped, it is waited for
/// ([`EXIT_GRACE`]) and killed if it has not exited — at once when a request of this process
/// may still be moving its memory ([`crate::xfer::nixl::unconfirmed`]): told to end, the child would
/// free that memory under it; killed, its memory is released only once nothing holds it.
pub struct PrefillChild {
    child: Child,
}

impl PrefillChild {
    /// The child's process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for PrefillChild {
    fn drop(&mut self) {
        let c = &mut self.child;
        if crate::xfer::nixl::unconfirmed() > 0 {
            let _ = c.kill();
            let _ = c.wait();
            eprintln!(
                "kvprobe: the prefill process was not told to exit (a request of kvprobe may still move its memory); kvprobe killed it"
            );
            return;
        }
        let t0 = Instant::now();
        // After SIGINT/SIGTERM a stuck (or stopped) child must not hold up the exit.
        let grace = if crate::sys::interrupt::requested() { EXIT_GRACE_INTERRUPTED } else { EXIT_GRACE };
        while t0.elapsed() < grace {
            if let Ok(Some(_)) = c.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = c.kill();
        let _ = c.wait();
        eprintln!(
            "kvprobe: the prefill process did not exit within {} s of being told to; kvprobe killed it",
            t0.elapsed().as_secs()
        );
    }
}

/// What the prefill child of `run --decode-process` is started with: the run's `--memory`,
/// `--prefill-device`, `--backend` and `--timeout` (seconds). The peer protocol knows no run
/// configuration beyond these.
#[derive(Clone, Copy, Debug)]
pub struct ChildSpec<'a> {
    /// Prefill's pool memory.
    pub memory: crate::mem::pool::MemoryKind,
    /// Prefill's GPU (VRAM).
    pub device: usize,
    /// The NIXL backend plugin.
    pub backend: &'a str,
    /// `--timeout`, seconds.
    pub timeout_secs: f64,
}

/// `run --decode-process`: starts prefill's side as a child `kvprobe serve --fd N` on one end
/// of a Unix socket pair (its pool on the run's `--memory` and `--prefill-device`, the run's
/// `--backend`) and authenticates with a fresh random token, handed to the child in its
/// environment ([`crate::peer::TOKEN_VAR`], never its command line). The child's stderr is
/// kvprobe's; its stdout is discarded. Returns the link, bounded until the child is ready by
/// [`START_BOUND`] (120 s, [`super::Link::set_deadline`]; lifted by
/// [`PrefillPeer::adopt`]), and the child. Errors: environment (the child cannot be
/// started), transport (it died or closed the socket), timeout (exit 4: not ready in time).
pub fn start_child(cfg: &ChildSpec<'_>, silence: Duration, run_id: &str) -> Result<(Link, PrefillChild)> {
    let token = super::random_hex(16)?;
    let (mine, theirs) = std::os::unix::net::UnixStream::pair()
        .map_err(|e| Error::Environment(format!("cannot make a socket pair for the prefill process: {e}")))?;
    let exe = std::env::current_exe().map_err(|e| Error::Environment(format!("cannot find kvprobe's executable: {e}")))?;
    let fd = theirs.as_raw_fd();
    let vram = cfg.memory == crate::mem::pool::MemoryKind::Vram;
    let mut cmd = Command::new(exe);
    cmd.args(["serve", "--fd", &fd.to_string(), "--memory", if vram { "vram" } else { "dram" }]).args([
        "--backend",
        cfg.backend,
        "--timeout",
        &cfg.timeout_secs.to_string(),
    ]);
    if vram {
        cmd.args(["--device", &cfg.device.to_string()]);
    }
    cmd.env(crate::peer::TOKEN_VAR, &token).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::inherit());
    // The child sets kvprobe's defaults itself (as its own, so its report and its UCX
    // messages tell them from the user's): this process's UCX capture file and shared-memory
    // directory are private to it (the file already unlinked), and the rest it recomputes.
    for k in crate::xfer::nixl::kvprobe_defaults() {
        cmd.env_remove(k);
    }
    // The child's end of the pair (close-on-exec here) is inherited by this child alone.
    let t0 = Instant::now();
    let child = crate::sys::child::spawn_keeping(cmd, &[fd])
        .map_err(|e| Error::Environment(format!("cannot start the prefill process: {e}")))?;
    drop(theirs);
    let mut child = PrefillChild { child };
    let who = format!("the prefill process (pid {})", child.id());
    let bound = start_bound();
    let not_ready = format!("{who} was not ready within {} s of its start (a fixed bound)", bound.as_secs_f64());
    let link = match super::client_within(super::Stream::Unix(mine), &token, run_id, silence, who.clone(), bound) {
        Ok(l) => l,
        Err(Error::Timeout(m)) => return Err(Error::Timeout(format!("{not_ready}: {m}"))),
        Err(Error::Transport(m)) => {
            // A child that exited 2 before its handshake refused what it was asked to hold (a
            // GPU this host does not have, ...; its reason is on stderr above): exit 2 here too.
            let t = Instant::now();
            let mut code = None;
            while t.elapsed() < Duration::from_secs(2) {
                if let Ok(Some(st)) = child.child.try_wait() {
                    code = st.code();
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            return Err(match code {
                Some(2) => Error::Environment(format!("{who} refused to start (exit 2; its reason is above): {m}")),
                _ => Error::Transport(m),
            });
        }
        Err(e) => return Err(e),
    };
    link.set_deadline(Some((t0 + bound, not_ready)));
    Ok((link, child))
}

/// Connects to `serve` at `addr` (HOST:PORT) and authenticates with `token`; `silence` is
/// the run's `--timeout` (heartbeat bound). Errors: environment (the address does not resolve
/// or nothing listens there: exit 2), transport (the connection broke, not a kvprobe serve, or
/// a serve that cannot prove the token, or a refusal for now — busy, crowded, a source
/// refused for some seconds: exit 3), usage (refused: version or token, exit 2), timeout
/// (exit 4).
pub fn connect(addr: &str, token: &str, run_id: &str, silence: Duration) -> Result<Link> {
    use std::net::ToSocketAddrs;
    let who = format!("the prefill peer at {addr}");
    let addrs: Vec<_> =
        addr.to_socket_addrs().map_err(|e| Error::Usage(format!("--peer {addr}: not a HOST:PORT that resolves: {e}")))?.collect();
    let mut last = None;
    // A refused connection is tried again within the bound: serve started beside this run
    // (`kvprobe serve ... &` then `kvprobe run --peer ...`) may not listen yet.
    let until = std::time::Instant::now() + CONNECT_BOUND;
    'retry: loop {
        let mut refused = false;
        for a in &addrs {
            let left = until.saturating_duration_since(std::time::Instant::now()).max(Duration::from_millis(100));
            match std::net::TcpStream::connect_timeout(a, left) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    return super::client(super::Stream::Tcp(s), token, run_id, silence, who);
                }
                Err(e) => {
                    refused |= e.kind() == std::io::ErrorKind::ConnectionRefused;
                    last = Some(format!("{a}: {e}"));
                }
            }
        }
        if !refused || std::time::Instant::now() + Duration::from_millis(200) >= until {
            break 'retry;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(Error::Environment(format!(
        "--peer {addr}: cannot connect ({}); is `kvprobe serve --listen` running there, and the port open?",
        last.unwrap_or_else(|| "no address".into())
    )))
}

impl PrefillPeer {
    /// Sends the configuration and decode's side, waits for prefill's acceptance. Errors:
    /// refused (usage, exit 2, the reason names the field), or the link's errors.
    pub fn configure(
        link: Link,
        config: serde_json::Value,
        decode: Side,
        environment: Option<crate::env::envinfo::Environment>,
        address: &str,
        run_id: &str,
    ) -> Result<(Link, Side, PeerSide)> {
        let hash = super::config_hash(&config);
        link.send(&Msg::Config { config, hash, decode, environment })?;
        let (side, env) = link.expect("the configuration's acceptance", |m| match m {
            Msg::Accept { prefill, environment } => Ok((prefill, environment)),
            m => Err(m.name()),
        })?;
        // Prefill's words (host name, environment) reach this side's output: escaped.
        let (side, env) = (super::escaped(side), super::escaped(env));
        let section = PeerSide {
            role: "prefill".into(),
            address: address.into(),
            host: side.host.clone(),
            run_id: run_id.into(),
            memory: Some(side.memory),
            device: side.device,
            environment: env,
            ..Default::default()
        };
        Ok((link, side, section))
    }

    /// Exchanges NIXL agents: sends decode's, returns the peer with prefill's.
    pub fn connect_agents(link: Link, decode: PeerInfo, side: Side, section: PeerSide) -> Result<PrefillPeer> {
        Self::connect_ranks(link, decode, Vec::new(), side, section)
    }

    /// [`PrefillPeer::connect_agents`] with the agents of decode's TP ranks 1.. (`decode_ranks`);
    /// prefill's ranks 1.. come back in [`PrefillPeer::ranks_info`].
    pub fn connect_ranks(
        link: Link,
        decode: PeerInfo,
        decode_ranks: Vec<PeerInfo>,
        side: Side,
        section: PeerSide,
    ) -> Result<PrefillPeer> {
        link.send(&Msg::Connect { decode, decode_ranks })?;
        let (info, ranks_info) = link.expect("prefill's NIXL agent", |m| match m {
            Msg::Connected { prefill, prefill_ranks } => Ok((prefill, prefill_ranks)),
            m => Err(m.name()),
        })?;
        link.running();
        Ok(PrefillPeer {
            link,
            info,
            ranks_info,
            side,
            section,
            state: Mutex::new(State::default()),
            holder: None,
            region_leases: None,
        })
    }

    /// `--decode-process` and the plain sweep: takes charge of the child or thread prefill
    /// lives in, now that it is ready (a child's start bound is lifted: `--timeout` and the
    /// heartbeats bound the run from here).
    pub fn adopt(&mut self, holder: Holder) {
        self.link.set_deadline(None);
        self.holder = Some(holder);
    }

    /// Seconds prefill's fill kernels ran since the last call (0 on DRAM).
    pub fn take_fill_kernel_seconds(&self) -> f64 {
        std::mem::take(&mut self.state.lock().unwrap_or_else(|p| p.into_inner()).fill_kernel_seconds)
    }

    /// `--peer`: set-up is over; the set-up bound is lifted (`--timeout`, the heartbeats and
    /// the fills' own bounds bound the run from here).
    pub fn set_up(&mut self) {
        self.link.set_deadline(None);
    }

    /// What prefill is called in errors ("the prefill peer at HOST:PORT", "the prefill
    /// process (pid N)").
    pub fn who(&self) -> &str {
        self.link.who()
    }

    /// Reads what has arrived (waiting up to `wait` for the first message). Errors: the
    /// link's (dead peer: transport; silent peer: timeout; its failure or interrupt).
    pub fn pump(&self, wait: Duration) -> Result<()> {
        let mut wait = wait;
        while let Some(m) = self.link.recv(wait)? {
            wait = Duration::ZERO;
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            match m {
                Msg::Filled { it, stage, seconds, kernel_seconds } => {
                    let ok = |x: f64| x.is_finite() && x >= 0.0;
                    if s.fill_sent.remove(&(it, stage)).is_none() || !ok(seconds) || !ok(kernel_seconds) {
                        return Err(self.protocol_error(format!(
                            "a fill of iteration {it} stage {stage:?} it was not asked for, or {seconds} s"
                        )));
                    }
                    s.filled.insert((it, stage));
                    s.pending_fills = s.pending_fills.saturating_sub(1);
                    s.fill_seconds += seconds;
                    s.fill_kernel_seconds += kernel_seconds;
                }
                Msg::Written { tag, bytes, nanos } => {
                    s.written.insert(tag, XferResult { bytes, elapsed: Duration::from_nanos(nanos) });
                }
                Msg::Notified { tags, query_ns } => {
                    // Prefill forwards one notification per request decode posted: a frame or a
                    // backlog beyond what any run posts at once is not a kvprobe serve's.
                    if tags.len() + s.notified.len() > MAX_NOTIFIED || tags.iter().any(|t| t.len() > MAX_TAG) {
                        return Err(self.protocol_error(format!(
                            "{} notifications (more than {MAX_NOTIFIED} unclaimed, or a tag over {MAX_TAG} bytes)",
                            tags.len() + s.notified.len()
                        )));
                    }
                    let now = Instant::now();
                    let began = now.checked_sub(Duration::from_nanos(query_ns)).unwrap_or(now);
                    s.notified.extend(tags.into_iter().map(|t| (t, (began, now))))
                }
                Msg::Bye { side } => s.bye = Some(super::escaped(*side)),
                // One answer per region request, and only to one decode sent.
                Msg::RegionOpened { plan, sources } if s.region_asked == Some(RegionAsk::Open) => {
                    s.region_asked = None;
                    s.region_opened = Some((plan, sources));
                }
                Msg::RegionClosed { plan } if s.region_asked == Some(RegionAsk::Close) => {
                    s.region_asked = None;
                    s.region_closed = Some(plan);
                }
                m => {
                    return Err(Error::Transport(format!(
                        "{} sent {} during the run (a protocol error)",
                        self.link.who(),
                        m.name()
                    )));
                }
            }
        }
        Ok(())
    }

    /// Asks prefill to fill `stage` (every layer: `None`) with generation `it` and plant its
    /// faults; does not wait ([`PrefillPeer::await_filled`]).
    pub fn fill(&self, it: u32, stage: Option<u32>) -> Result<()> {
        {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            s.pending_fills += 1;
            s.fill_sent.insert((it, stage), Instant::now());
        }
        self.link.send(&Msg::Fill { it, stage })
    }

    /// How long prefill may take to answer a fill: twice the silence bound (`--timeout`, at
    /// least 1 s) plus [`crate::sys::deadline::GRACE`] for a stage — a fill waits behind prefill's
    /// other calls, and a call of prefill's blocked past its own `--timeout` is ended by
    /// prefill's watchdog within GRACE, which names it — at least
    /// [`crate::sys::deadline::SETUP_FLOOR`] for a whole pool (set-up).
    fn fill_bound(&self, stage: Option<u32>) -> Duration {
        let b = 2 * super::silence_bound(self.link.silence()) + crate::sys::deadline::GRACE;
        if stage.is_none() { b.max(crate::sys::deadline::SETUP_FLOOR) } else { b }
    }

    /// Errors (timeout, exit 4) when a fill sent has not been answered within its bound: a
    /// prefill that heartbeats but does not work is not waited for for ever.
    fn check_fills(&self) -> Result<()> {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(((it, stage), at)) = s.fill_sent.iter().find(|((_, st), at)| at.elapsed() > self.fill_bound(*st)) {
            return Err(Error::Timeout(format!(
                "{} did not report its fill of iteration {it}{} within {:.3} s",
                self.link.who(),
                stage.map_or(String::new(), |k| format!(" stage {k}")),
                at.elapsed().as_secs_f64()
            )));
        }
        Ok(())
    }

    fn protocol_error(&self, what: String) -> Error {
        Error::Transport(format!("{} sent {what} (a protocol error)", self.link.who()))
    }

    /// Waits until prefill has filled `stage` of generation `it` (or every layer of it).
    pub fn await_filled(&self, it: u32, stage: Option<u32>) -> Result<()> {
        loop {
            {
                let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
                if s.filled.contains(&(it, stage)) || s.filled.contains(&(it, None)) {
                    return Ok(());
                }
            }
            self.check_interrupt(&format!("prefill's fill of iteration {it}"))?;
            self.check_fills()?;
            self.pump(Duration::from_millis(1))?;
        }
    }

    /// Waits until every fill sent has been acknowledged.
    pub fn await_all_filled(&self) -> Result<()> {
        loop {
            if self.state.lock().unwrap_or_else(|p| p.into_inner()).pending_fills == 0 {
                return Ok(());
            }
            self.check_interrupt("prefill's fills")?;
            self.check_fills()?;
            self.pump(Duration::from_millis(1))?;
        }
    }

    fn check_interrupt(&self, what: &str) -> Result<()> {
        if crate::sys::interrupt::since_requested().is_some_and(|d| d > crate::sys::interrupt::GRACE) {
            return Err(Error::Interrupted(format!("while waiting for {what}")));
        }
        Ok(())
    }

    /// Has prefill set up region plan `plan` (its index in `sweep::regions::plans` of the
    /// run's configuration) against decode's agent `decode`, and returns prefill's agents, one
    /// per source of the plan (in process, each with shares of prefill's registrations). Waits
    /// at most the set-up bound of a fill. Errors: timeout (exit 4), transport (exit 3: an
    /// answer for another plan), the link's.
    pub fn region_open(&self, plan: u32, decode: PeerInfo) -> Result<Vec<PeerInfo>> {
        if let Some(slots) = &self.region_leases {
            *slots.to_prefill.lock().unwrap_or_else(|p| p.into_inner()) = Some(decode.lease.clone());
        }
        self.state.lock().unwrap_or_else(|p| p.into_inner()).region_asked = Some(RegionAsk::Open);
        self.link.send(&Msg::RegionOpen { plan, decode })?;
        let (got, mut sources) = self.await_region(&format!("set up region plan {plan}"), |s| s.region_opened.take())?;
        if got != plan {
            return Err(self.protocol_error(format!("region plan {got}'s agents when plan {plan} was asked for")));
        }
        if let Some(l) = self.region_leases.as_ref().and_then(|s| s.to_decode.lock().unwrap_or_else(|p| p.into_inner()).take()) {
            sources.iter_mut().for_each(|i| i.lease = l.clone());
        }
        Ok(sources)
    }

    /// Has prefill WRITE the region pages of each of `sources` (index in the open plan's
    /// sources, notification tag) into decode's pool; [`PrefillPeer::take_written`] says when
    /// each is complete.
    pub fn region_write(&self, plan: u32, sources: Vec<(u32, String)>) -> Result<()> {
        self.link.send(&Msg::RegionWrite { plan, sources })
    }

    /// Has prefill give region plan `plan`'s pools and agents up, and waits until it has.
    /// Errors: as [`PrefillPeer::region_open`].
    pub fn region_close(&self, plan: u32) -> Result<()> {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).region_asked = Some(RegionAsk::Close);
        self.link.send(&Msg::RegionClose { plan })?;
        let got = self.await_region(&format!("give region plan {plan} up"), |s| s.region_closed.take())?;
        if got != plan {
            return Err(self.protocol_error(format!("region plan {got} closed when plan {plan} was")));
        }
        Ok(())
    }

    /// Waits for prefill's answer about a region plan (`take` finds it in what arrived), at
    /// most the set-up bound of a fill. Errors: timeout (exit 4) saying prefill did not `what`;
    /// interrupted; the link's.
    fn await_region<T>(&self, what: &str, mut take: impl FnMut(&mut State) -> Option<T>) -> Result<T> {
        let bound = self.fill_bound(None);
        let t = Instant::now();
        loop {
            if let Some(x) = take(&mut self.state.lock().unwrap_or_else(|p| p.into_inner())) {
                return Ok(x);
            }
            self.check_interrupt("prefill's region pools")?;
            if t.elapsed() > bound {
                return Err(Error::Timeout(format!(
                    "{} did not {what} within {:.3} s",
                    self.link.who(),
                    t.elapsed().as_secs_f64()
                )));
            }
            self.pump(Duration::from_millis(1))?;
        }
    }

    /// Has prefill post stage `stage` of iteration `it` as a WRITE with notification `tag`.
    pub fn post_write(&self, it: u32, stage: u32, tag: &str) -> Result<()> {
        self.link.send(&Msg::Write { it, stage, tag: tag.into() })
    }

    /// Tells prefill iteration `it`'s results (`slices` verified, `corrupt`, `gbps`).
    pub fn verified(&self, it: u32, slices: u64, corrupt: u64, gbps: f64) -> Result<()> {
        self.link.send(&Msg::Verified { it, slices, corrupt, gbps })
    }

    /// Has prefill send `tag` as a bare notification (the test-only early-notification fault).
    pub fn notify(&self, tag: &str) -> Result<()> {
        self.link.send(&Msg::Notify { tag: tag.into() })
    }

    /// `Some` once prefill's WRITE `tag` has completed there.
    pub fn take_written(&self, tag: &str) -> Result<Option<XferResult>> {
        self.pump(Duration::ZERO)?;
        Ok(self.state.lock().unwrap_or_else(|p| p.into_inner()).written.remove(tag))
    }

    /// What prefill said last, read before the run decides its outcome (a short wait, 20 ms):
    /// a failure prefill sent after its last answer (serve refusing a frame after it closed
    /// the last region plan, say) ends the run as that failure instead of decode's clean.
    /// Errors: the failure prefill sent, or the link's (named with [`PrefillPeer::cause_of`]).
    pub fn last_word(&self) -> Result<()> {
        self.pump(Duration::from_millis(20)).map_err(|e| self.cause_of(e))
    }

    /// One check whether prefill's WRITE `tag` (posted under `deadline`) is complete: `Some`
    /// with prefill's result once it said `written`. The rule of decode's own requests: a
    /// WRITE still missing at two checks that began after its deadline has timed out, and so
    /// has one prefill says took longer than the deadline from post to completion (`misses`:
    /// the caller's count of checks after the deadline, one per request). Errors: timeout
    /// (exit 4) naming `tag`, where prefill is and the bound; the link's errors.
    pub fn poll_written(&self, tag: &str, deadline: Deadline, misses: &mut u8) -> Result<Option<XferResult>> {
        let asked = Instant::now();
        let timeout = |why: String| {
            Error::Timeout(format!(
                "WRITE {tag} by {}: {why}, over --timeout {:.6} s ({:.3} s since it was sent)",
                self.who(),
                deadline.limit_secs(),
                deadline.elapsed_secs()
            ))
        };
        match self.take_written(tag)? {
            Some(done) if done.elapsed > deadline.limit => {
                Err(timeout(format!("it took {:.3} s from post to completion", done.elapsed.as_secs_f64())))
            }
            Some(done) => Ok(Some(done)),
            None if deadline.passed_at(asked) => {
                *misses += 1;
                if *misses >= 2 { Err(timeout("still not complete".into())) } else { Ok(None) }
            }
            None => Ok(None),
        }
    }

    /// Waits until prefill has received the notification of every tag in `tags` (removed as
    /// they arrive). A tag still missing at two checks that began after its deadline has timed
    /// out; so has one whose deadline passed while prefill's query that returned it was in
    /// progress (the rule for decode's own queries, `transport::poll_notification_from`).
    /// Errors: timeout (exit 4), the link's errors.
    pub fn await_notifications(&self, tags: &mut HashMap<String, Deadline>) -> Result<()> {
        let mut late_misses = 0u32;
        while !tags.is_empty() {
            let asked = Instant::now();
            self.pump(Duration::from_micros(200))?;
            {
                let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
                let mut late = None;
                tags.retain(|t, d| match s.notified.remove(t) {
                    Some((began, arrived)) => {
                        if late.is_none() && !d.passed_at(began) && d.passed_at(arrived) {
                            late = Some((t.clone(), *d, arrived.saturating_duration_since(began)));
                        }
                        false
                    }
                    None => true,
                });
                if let Some((tag, d, took)) = late {
                    return Err(Error::Timeout(format!(
                        "prefill's ({}) NIXL notification query that returned {tag} took {:.3} s and was in progress when \
                         its request's --timeout {:.6} s passed ({:.3} s since the request was posted)",
                        self.link.who(),
                        took.as_secs_f64(),
                        d.limit_secs(),
                        d.elapsed_secs()
                    )));
                }
            }
            if tags.is_empty() {
                break;
            }
            self.check_interrupt("prefill's notifications")?;
            if let Some((tag, d)) = tags.iter().filter(|(_, d)| d.passed_at(asked)).min_by_key(|(_, d)| d.at()) {
                late_misses += 1;
                if late_misses >= 2 {
                    return Err(Error::Timeout(format!(
                        "prefill ({}) had no notification {tag} from decode within --timeout {:.6} s ({:.3} s since its request was posted)",
                        self.link.who(),
                        d.limit_secs(),
                        d.elapsed_secs()
                    )));
                }
            }
        }
        Ok(())
    }

    /// Seconds prefill reported filling so far.
    pub fn fill_seconds(&self) -> f64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).fill_seconds
    }

    /// Ends the session: tells prefill the run's outcome and decode's `results` ([`Msg::Done`])
    /// and waits (up to `wait`) for its side of the report. Returns prefill's section (what it
    /// sent, or what was known of it, with `bye_missing` set when it did not answer).
    pub fn finish(&self, exit: u8, error: Option<String>, results: super::Results, wait: Duration) -> PeerSide {
        let super::Results { summary, scenario, rows } = results;
        // A child is not told to end while a request of this process may still move its
        // memory: it is killed instead ([`PrefillChild`]).
        let sent = if matches!(self.holder, Some(Holder::Child(_))) && crate::xfer::nixl::unconfirmed() > 0 {
            Err(Error::Transport("requests in flight".into()))
        } else {
            self.link.send(&Msg::Done { exit, error, summary, scenario, rows })
        };
        let t0 = Instant::now();
        if sent.is_ok() {
            while t0.elapsed() < wait {
                if self.state.lock().unwrap_or_else(|p| p.into_inner()).bye.is_some() {
                    break;
                }
                if self.pump(Duration::from_millis(10)).is_err() {
                    break;
                }
            }
        }
        self.link.close();
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match s.bye.take() {
            Some(mut b) => {
                b.address = self.section.address.clone(); // the address this side dialled
                b
            }
            None => {
                let mut sec = self.section.clone();
                sec.bye_missing = true;
                sec
            }
        }
    }

    /// The error to report for a NIXL failure `e` of a transfer with prefill: when the link
    /// shows prefill gone or silent within [`CAUSE_WAIT`], that (a dead peer explains the failed
    /// transfer), else `e`.
    pub fn cause_of(&self, e: Error) -> Error {
        if let Error::Timeout(m) = &e {
            // A transfer that timed out while prefill missed its heartbeats: say so (the
            // silence bound is the same --timeout, so either may fire first).
            let quiet = self.link.quiet_for();
            if quiet > 2 * self.link.heartbeat() + Duration::from_millis(100) {
                return Error::Timeout(format!(
                    "{m}; {} has been silent for {:.1} s (no heartbeat: stopped, or the link dropped)",
                    self.link.who(),
                    quiet.as_secs_f64()
                ));
            }
            return e;
        }
        if !matches!(e, Error::Transport(_)) {
            return e;
        }
        let t0 = Instant::now();
        while t0.elapsed() < CAUSE_WAIT {
            if let Err(link) = self.pump(Duration::from_millis(10)) {
                return link; // its kind: gone (3), silent (4), interrupted (130)
            }
        }
        e
    }

    /// Scenarios: asks prefill to start scenario run `begin.row` ([`Msg::Begin`]) and waits
    /// for it ([`Msg::Begun`]: how decode reaches the tier, and the tier in words), within
    /// [`begin_bound`]: longer than prefill's own bounds on its set-up (its Mooncake store
    /// client's start and join, each `--timeout` at least 60 s, and a master's start), so that
    /// prefill's own error, naming what failed, arrives first. Errors: the link's (prefill's
    /// own failure included), timeout (exit 4), transport (a protocol error).
    ///
    /// `lanes`: decode's NIXL agent of each state lane of a hybrid model
    /// ([`crate::scenario::state`]); the answer's third part is prefill's agent of each, in
    /// that order (a count other than decode's is a protocol error).
    pub fn begin(
        &self,
        begin: super::steps::Begin,
        lanes: Vec<PeerInfo>,
    ) -> Result<(Option<super::steps::TierAccess>, String, Vec<PeerInfo>)> {
        let row = begin.row;
        let asked = lanes.len();
        if let Some(slots) = self.region_leases.as_ref().filter(|_| asked > 0) {
            let mut lease = crate::xfer::nixl::WeakLease::default();
            lanes.iter().for_each(|i| lease.join(&i.lease));
            *slots.to_prefill.lock().unwrap_or_else(|p| p.into_inner()) = Some(lease);
        }
        self.link.send(&Msg::Begin { begin, lanes })?;
        let bound = begin_bound(self.link.silence());
        self.link.set_deadline(Some((
            Instant::now() + bound,
            format!(
                "{} did not start its scenario run (tier, genesis fill) within {:.0} s",
                self.link.who(),
                bound.as_secs_f64()
            ),
        )));
        let got = self.link.expect("prefill's start of the scenario", |m| match m {
            Msg::Begun { row: r, tier, tier_detail, lanes } if r == row => {
                Ok((tier, crate::sys::text::escape_control(&tier_detail).into_owned(), lanes))
            }
            m => Err(m.name()),
        });
        self.link.set_deadline(None);
        let (tier, detail, mut lanes) = got?;
        if lanes.len() != asked {
            return Err(self.protocol_error(format!("{} NIXL agent(s) for the scenario's {asked} state lane(s)", lanes.len())));
        }
        if let Some(l) = self
            .region_leases
            .as_ref()
            .filter(|_| asked > 0)
            .and_then(|s| s.to_decode.lock().unwrap_or_else(|p| p.into_inner()).take())
        {
            lanes.iter_mut().for_each(|i| i.lease = l.clone());
        }
        Ok((tier, detail, lanes))
    }

    /// How long prefill may take to answer a step: twice the silence bound plus
    /// [`crate::sys::deadline::GRACE`] (each call of prefill's is bounded by `--timeout`, and one
    /// blocked past it is ended by prefill's watchdog within GRACE, which names it), at least
    /// [`crate::sys::deadline::SETUP_FLOOR`] (a step may run many tier calls).
    fn step_bound(&self) -> Duration {
        (2 * super::silence_bound(self.link.silence()) + crate::sys::deadline::GRACE).max(crate::sys::deadline::SETUP_FLOOR)
    }

    /// Scenarios: sends what decode did ([`Msg::Step`]) and waits for prefill's step `step` of
    /// row `row` ([`Msg::Stepped`], within twice the silence bound + 5 s, at least 60 s). Errors: the link's,
    /// timeout (exit 4), transport (an answer out of protocol).
    pub fn step(&self, row: u32, step: u64, input: super::steps::StepIn) -> Result<super::steps::StepOut> {
        self.link.send(&Msg::Step { row, step, input })?;
        let bound = self.step_bound();
        self.link.set_deadline(Some((
            Instant::now() + bound,
            format!("{} did not answer step {step} within {:.0} s", self.link.who(), bound.as_secs_f64()),
        )));
        let got = self.link.expect("prefill's step", |m| match m {
            Msg::Stepped { row: r, step: k, output } if r == row && k == step => Ok(*output),
            m => Err(m.name()),
        });
        self.link.set_deadline(None);
        got
    }

    /// Scenarios: row `row` is over ([`Msg::End`], with decode's one-line verdict); waits for
    /// prefill to tear its engine down ([`Msg::Ended`], bounded as a step) and returns its
    /// final counts. Errors: the link's, timeout (exit 4).
    pub fn end(&self, row: u32, line: &str) -> Result<super::steps::PrefillCounters> {
        self.link.send(&Msg::End { row, line: line.to_string() })?;
        let bound = self.step_bound();
        self.link.set_deadline(Some((
            Instant::now() + bound,
            format!("{} did not end row {row} within {:.0} s", self.link.who(), bound.as_secs_f64()),
        )));
        let got = self.link.expect("prefill's end of the scenario", |m| match m {
            Msg::Ended { row: r, counters } if r == row => Ok(counters),
            m => Err(m.name()),
        });
        self.link.set_deadline(None);
        got
    }

    /// The flag set once prefill ended the run or went away ([`super::Link::ended`]).
    pub fn ended(&self) -> std::sync::Arc<std::sync::atomic::AtomicBool> {
        self.link.ended()
    }

    /// Tells prefill this side was interrupted (best effort).
    pub fn interrupt(&self, why: &str) {
        let _ = self.link.send(&Msg::Interrupt { why: why.into() });
    }
}
