//! The decode role's NIXL agent in a second kvprobe process (`run --decode-process`), as
//! vLLM runs prefill and decode engines: UCX then treats the two agents as two processes
//! (CUDA IPC between them, no same-process special cases).
//!
//! VRAM: the child (`kvprobe agent`, hidden) allocates the decode pool on its GPU, registers
//! it with its own NIXL agent, loads the prefill agent's metadata, and hands back its
//! [`PeerInfo`] and the CUDA IPC handle of each layer region. kvprobe opens those regions
//! ([`crate::pool::KvPool::imported`]) and runs the probe's kernels on them as on any pool.
//! DRAM: kvprobe allocates the decode pool (memfd-backed) and the child maps it through the
//! descriptor it inherits. Either way only the NIXL requests the decode role initiates (READ)
//! and the notifications it receives (WRITE) cross the process boundary.
//!
//! Wire format over the child's stdin/stdout, one line per message (tags have no spaces):
//!
//! | direction | line | payload |
//! |---|---|---|
//! | → child | [`Init`] as JSON | — |
//! | ← child | `R <Ready as JSON>` or `E <exit code> <message>` | — |
//! | → child | `X <tag> <n>` | `n` pairs of 32 bytes (src layer, K/V code, block, dst layer, K/V code, block: u32 LE; length: u64 LE) |
//! | ← child | `D <tag> <bytes> <nanoseconds>` | the READ `tag` completed (post to completion) |
//! | ← child | `N <peer hex> <message hex>` | a notification the child's agent received |
//! | → child / ← child | `P` / `T <TransportPath as JSON>` | UCX's protocol selection seen by the child |
//! | → child | `Q` (or end of input) | the child releases everything and exits 0 |
//!
//! The child checks what it reads: lines are bounded (64 MiB for [`Init`], 4 KiB for a
//! command), a pair count is 1 to the pool's slice count, and each pair must lie inside the
//! pool; anything else is `E 2 <why>` and exit 2, never a quit with 0.
//!
//! A child that fails sends `E` and exits with the code kvprobe would have used; a child
//! that dies is reported as a transport error (exit 3). The child ignores Ctrl-C (kvprobe
//! stops it by closing its input) and dies with kvprobe (`PR_SET_PDEATHSIG`).

use crate::error::{Error, Exit, Result};
use crate::geometry::{Geometry, KvPart, SliceCoord};
use crate::nixl::XferResult;
use crate::transport::{Endpoint, Op, Pair, PeerInfo};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the child needs to set up the decode role.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Init {
    /// NIXL agent name.
    pub name: String,
    /// NIXL backend plugin.
    pub backend: String,
    /// VRAM or DRAM.
    pub memory: crate::pool::MemoryKind,
    /// GPU of the decode pool (VRAM).
    pub device: usize,
    /// DRAM: the inherited descriptor of kvprobe's decode pool (memfd).
    pub dram_fd: Option<i32>,
    /// KV geometry of the pool.
    pub geometry: Geometry,
    /// Fingerprint seed (the pool's kernels are not run in the child; kept for symmetry).
    pub seed: u64,
    /// The prefill role's metadata and region bases.
    pub peer: PeerInfo,
    /// How the child's agent is created and makes its READs (`--backend-param`,
    /// `--xfer-req`).
    #[serde(default)]
    pub transport: crate::transport::TransportOptions,
}

/// The child's answer to [`Init`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Ready {
    /// The decode role's metadata and region bases (addresses in the child).
    pub info: PeerInfo,
    /// VRAM: CUDA IPC handle of each layer region, hex (128 digits each); empty for DRAM.
    pub handles: Vec<String>,
}

/// The child process; closing its input ends it. Kept alive by the decode agent's proxy and
/// by every region of the pool imported from it. Messages to the child go through a writer
/// thread, so a child that stops reading never blocks kvprobe (its requests then time out).
struct ChildGuard {
    child: Mutex<Child>,
    to_child: Mutex<Option<Sender<Vec<u8>>>>,
    /// Shares of this process's registrations ([`crate::nixl::Lease`]) held by READs the
    /// child may still be running (dropped before they were seen complete): released once the
    /// child has exited, when nothing of it can touch them any more.
    held: Mutex<Vec<crate::nixl::Lease>>,
}

/// Writes what it receives to the child's stdin until the channel closes (then ends the
/// child's input with `Q` and EOF) or the child's input is gone.
fn writer(stdin: ChildStdin, rx: Receiver<Vec<u8>>) {
    let mut w = BufWriter::new(stdin);
    for msg in rx {
        if w.write_all(&msg).and_then(|_| w.flush()).is_err() {
            return;
        }
    }
    let _ = w.write_all(b"Q\n").and_then(|_| w.flush());
}

/// How long kvprobe waits for the decode agent process to exit after closing its input (it
/// deregisters its memory and closes its NIXL agent) before killing it.
pub const EXIT_GRACE: Duration = Duration::from_secs(5);

/// [`EXIT_GRACE`] after SIGINT/SIGTERM: a child that is stuck or stopped is killed after this,
/// so an interrupted run exits within [`crate::deadline::INTERRUPT_GRACE`] of the signal plus
/// this (README "What `--timeout` bounds").
pub const EXIT_GRACE_INTERRUPTED: Duration = Duration::from_secs(1);

/// How long the decode agent process has to become ready (fixed; not `--timeout`).
pub const START_BOUND: Duration = Duration::from_secs(120);

/// Test-only: `KVPROBE_TEST_AGENT_START_SECS=SECS` replaces [`START_BOUND`], so a test of a
/// child that never becomes ready does not take two minutes. Never set in normal use.
fn start_bound() -> Duration {
    std::env::var("KVPROBE_TEST_AGENT_START_SECS")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .unwrap_or(START_BOUND)
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if crate::nixl::unconfirmed() > 0 {
            // A WRITE of this process into the child's pool may still be in progress: told to
            // quit, the child would free that pool under it. Killed, its memory is released
            // only once nothing holds its pages.
            if let Ok(mut c) = self.child.lock() {
                let _ = c.kill();
                let _ = c.wait();
            } else if let Ok(mut h) = self.held.lock() {
                std::mem::forget(std::mem::take(&mut *h)); // not known to have exited
            }
            return; // else `held` drops with the guard: the child has exited
        }
        if let Ok(mut s) = self.to_child.lock() {
            *s = None; // the writer sends Q and closes the child's input
        }
        let Ok(mut c) = self.child.lock() else {
            // Not known to have exited: the READs it may run keep their shares until exit.
            if let Ok(mut h) = self.held.lock() {
                std::mem::forget(std::mem::take(&mut *h));
            }
            return;
        };
        let t0 = Instant::now();
        // After SIGINT/SIGTERM a stuck (or stopped) child must not hold up the exit.
        while t0.elapsed() < if crate::interrupt::requested() { EXIT_GRACE_INTERRUPTED } else { EXIT_GRACE } {
            if let Ok(Some(_)) = c.try_wait() {
                return; // exited: `held` drops with the guard
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = c.kill();
        let _ = c.wait();
        eprintln!(
            "kvprobe: the decode agent process did not exit within {} s of being told to; kvprobe killed it",
            t0.elapsed().as_secs()
        );
    }
}

/// What a READ of the decode agent process holds of this process's memory: shares of the
/// prefill pool's registration ([`crate::nixl::Lease`]). Dropped before the READ was seen
/// complete, they pass to the child's guard until the child has exited.
pub struct RemoteHold {
    lease: crate::nixl::Lease,
    guard: std::sync::Weak<ChildGuard>,
    done: bool,
}

impl RemoteHold {
    /// Marks the READ complete (its shares may drop with it).
    pub fn complete(&mut self) {
        self.done = true;
    }
}

impl Drop for RemoteHold {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Some(g) = self.guard.upgrade()
            && let Ok(mut h) = g.held.lock()
        {
            h.push(std::mem::take(&mut self.lease));
        }
    }
}

enum Event {
    Ready(Box<Ready>),
    Done { tag: String, bytes: u64, nanos: u64 },
    Notif(String, String),
    Path(Box<crate::ucx::TransportPath>),
    Failed(u8, String),
    Gone(String),
}

/// The decode role's NIXL agent, living in the child process.
pub struct RemoteAgent {
    guard: Arc<ChildGuard>,
    info: PeerInfo,
    events: Mutex<Receiver<Event>>,
    done: Mutex<HashMap<String, XferResult>>,
    notifs: Mutex<Vec<(String, String)>>,
    path: Mutex<Option<crate::ucx::TransportPath>>,
    failure: Mutex<Option<Error>>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

fn error_of(code: u8, msg: String) -> Error {
    match code {
        2 => Error::Environment(msg),
        4 => Error::Timeout(msg),
        _ => Error::Transport(msg),
    }
}

impl RemoteAgent {
    /// Starts `kvprobe agent`, sends `init` and waits (up to [`START_BOUND`], 120 s) for the
    /// child's pool and agent. Returns the proxy, the child's [`Ready`] and the keep-alive to
    /// hand to the imported pool. Errors: the child cannot start or reports an error (its exit
    /// code's kind), dies (transport, exit 3) or is not ready within the bound (timeout, exit 4).
    pub fn spawn(init: &Init) -> Result<(RemoteAgent, Ready, Arc<dyn std::any::Any + Send + Sync>)> {
        let exe = std::env::current_exe().map_err(|e| Error::Environment(format!("cannot find kvprobe's executable: {e}")))?;
        let mut cmd = Command::new(exe);
        cmd.arg("agent").stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        // kvprobe's own UCX capture file is private to this process (and already unlinked):
        // the child makes its own.
        if let Some(own) = crate::ucx::log_path()
            && std::env::var_os("UCX_LOG_FILE").is_some_and(|v| v == own.as_os_str())
        {
            cmd.env_remove("UCX_LOG_FILE").env_remove("UCX_PROTO_INFO");
        }
        // The DRAM pool's memfd (close-on-exec in kvprobe) is inherited by this child alone.
        if let Some(fd) = init.dram_fd {
            crate::child::keep_fd(&mut cmd, fd);
        }
        let mut child =
            crate::child::spawn(cmd).map_err(|e| Error::Environment(format!("cannot start the decode agent process: {e}")))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (wtx, wrx) = channel::<Vec<u8>>();
        std::thread::spawn(move || writer(stdin, wrx));
        let guard =
            Arc::new(ChildGuard { child: Mutex::new(child), to_child: Mutex::new(Some(wtx)), held: Mutex::new(Vec::new()) });
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(stdout);
            let mut line = String::new();
            loop {
                line.clear();
                match r.read_line(&mut line) {
                    Ok(0) | Err(_) => {
                        let _ = tx.send(Event::Gone("the decode agent process exited".into()));
                        return;
                    }
                    Ok(_) => {}
                }
                let l = line.trim_end();
                let (kind, rest) = l.split_once(' ').unwrap_or((l, ""));
                let ev = match kind {
                    "R" => serde_json::from_str(rest).map(|r| Event::Ready(Box::new(r))).ok(),
                    "T" => serde_json::from_str(rest).map(|p| Event::Path(Box::new(p))).ok(),
                    "D" => {
                        let f: Vec<&str> = rest.split(' ').collect();
                        match (f.first(), f.get(1).and_then(|x| x.parse().ok()), f.get(2).and_then(|x| x.parse().ok())) {
                            (Some(tag), Some(bytes), Some(nanos)) => Some(Event::Done { tag: tag.to_string(), bytes, nanos }),
                            _ => None,
                        }
                    }
                    "N" => rest.split_once(' ').and_then(|(p, m)| {
                        let s = |x: &str| unhex(x).map(|b| String::from_utf8_lossy(&b).into_owned());
                        Some(Event::Notif(s(p)?, s(m)?))
                    }),
                    "E" => {
                        let (c, m) = rest.split_once(' ').unwrap_or((rest, ""));
                        Some(Event::Failed(c.parse().unwrap_or(3), m.to_string()))
                    }
                    _ => None,
                };
                let ev = ev.unwrap_or_else(|| Event::Gone(format!("the decode agent process sent an unreadable line: {l:?}")));
                if tx.send(ev).is_err() {
                    return;
                }
            }
        });
        let remote = RemoteAgent {
            guard: guard.clone(),
            info: init.peer.clone(),
            events: Mutex::new(rx),
            done: Mutex::new(HashMap::new()),
            notifs: Mutex::new(Vec::new()),
            path: Mutex::new(None),
            failure: Mutex::new(None),
        };
        remote.send(format!("{}\n", serde_json::to_string(init).map_err(|e| Error::Io(e.to_string()))?).as_bytes(), &[])?;
        let t0 = Instant::now();
        let bound = start_bound();
        let ready = loop {
            let ev = remote.events.lock().unwrap().recv_timeout(Duration::from_millis(100));
            match ev {
                Ok(Event::Ready(r)) => break *r,
                Ok(Event::Failed(c, m)) => return Err(error_of(c, format!("decode agent process: {m}"))),
                Ok(Event::Gone(m)) => return Err(Error::Transport(m)),
                Ok(_) => {}
                Err(_) if crate::interrupt::requested() => {
                    return Err(Error::Interrupted("while the decode agent process started".into()));
                }
                Err(_) if t0.elapsed() > bound => {
                    // It reads kvprobe's input only once ready: waiting for it to exit is no use.
                    if let Ok(mut c) = guard.child.lock() {
                        let _ = c.kill();
                    }
                    return Err(Error::Timeout(format!(
                        "the decode agent process was not ready within {} s of its start (a fixed bound)",
                        bound.as_secs_f64()
                    )));
                }
                Err(_) => {}
            }
        };
        let remote = RemoteAgent { info: ready.info.clone(), ..remote };
        Ok((remote, ready, guard))
    }

    /// Queues a message for the child (never blocks: the writer thread delivers it).
    fn send(&self, head: &[u8], body: &[u8]) -> Result<()> {
        let s = self.guard.to_child.lock().unwrap();
        let tx = s.as_ref().ok_or_else(|| Error::Transport("the decode agent process is closed".into()))?;
        let mut msg = Vec::with_capacity(head.len() + body.len());
        msg.extend_from_slice(head);
        msg.extend_from_slice(body);
        tx.send(msg).map_err(|_| Error::Transport("the decode agent process is gone (its input is closed)".into()))
    }

    /// The agent's name and metadata, as the child reported them.
    pub fn info(&self) -> &PeerInfo {
        &self.info
    }

    /// Has the child post one READ of `pairs` from the prefill agent with notification `tag`;
    /// `keep` is the shares of this process's memory it reads, held by the returned
    /// [`RemoteHold`] until the READ is seen complete or the child has exited.
    /// Errors: the child is gone (transport).
    pub fn post_read(&self, pairs: &[Pair], tag: &str, keep: crate::nixl::Lease) -> Result<RemoteHold> {
        debug_assert!(!tag.contains(char::is_whitespace));
        let mut body = Vec::with_capacity(pairs.len() * 32);
        for p in pairs {
            for v in [p.src.layer, p.src.kv.code(), p.src.block, p.dst.layer, p.dst.kv.code(), p.dst.block] {
                body.extend_from_slice(&v.to_le_bytes());
            }
            body.extend_from_slice(&p.len.to_le_bytes());
        }
        let hold = RemoteHold { lease: keep, guard: Arc::downgrade(&self.guard), done: false };
        self.send(format!("X {tag} {}\n", pairs.len()).as_bytes(), &body)?;
        Ok(hold)
    }

    fn pump(&self) -> Result<()> {
        if let Some(e) = self.failure.lock().unwrap().as_ref() {
            return Err(e.clone());
        }
        let rx = self.events.lock().unwrap();
        loop {
            match rx.try_recv() {
                Ok(Event::Done { tag, bytes, nanos }) => {
                    self.done.lock().unwrap().insert(tag, XferResult { bytes, elapsed: Duration::from_nanos(nanos) });
                }
                Ok(Event::Notif(p, m)) => self.notifs.lock().unwrap().push((p, m)),
                Ok(Event::Path(p)) => *self.path.lock().unwrap() = Some(*p),
                Ok(Event::Ready(_)) => {}
                Ok(Event::Failed(c, m)) => {
                    let e = error_of(c, format!("decode agent process: {m}"));
                    *self.failure.lock().unwrap() = Some(e.clone());
                    return Err(e);
                }
                Ok(Event::Gone(m)) => {
                    let e = Error::Transport(m);
                    *self.failure.lock().unwrap() = Some(e.clone());
                    return Err(e);
                }
                Err(TryRecvError::Empty) => return Ok(()),
                Err(TryRecvError::Disconnected) => {
                    return Err(Error::Transport("the decode agent process exited".into()));
                }
            }
        }
    }

    /// `Some` once the READ `tag` has completed (its post-to-completion time as the child
    /// measured it). Errors: the child failed or died.
    pub fn poll(&self, tag: &str) -> Result<Option<XferResult>> {
        self.pump()?;
        Ok(self.done.lock().unwrap().remove(tag))
    }

    /// Notifications the child's agent received since the last call: (peer, message).
    pub fn take_notifications(&self) -> Result<Vec<(String, String)>> {
        self.pump()?;
        Ok(std::mem::take(&mut *self.notifs.lock().unwrap()))
    }

    /// UCX's protocol selection as the child saw it (its READs), within `timeout`.
    pub fn transport_path(&self, timeout: Duration) -> Result<crate::ucx::TransportPath> {
        self.send(b"P\n", &[])?;
        let t0 = Instant::now();
        loop {
            self.pump()?;
            if let Some(p) = self.path.lock().unwrap().take() {
                return Ok(p);
            }
            if t0.elapsed() > timeout {
                return Err(Error::Timeout("the decode agent process did not report its transport path".into()));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// A request [`crate::transport::post`] made: a local NIXL request, or a READ the decode
/// agent process posted.
pub enum Request {
    /// Posted by a NIXL agent of this process.
    Local(crate::nixl::Posted),
    /// Posted by the decode agent process under `tag`.
    Remote {
        /// Notification tag (names the request).
        tag: String,
        /// Bytes it moves.
        bytes: u64,
        /// `--timeout` from just before it was sent to the child.
        deadline: crate::deadline::Deadline,
        /// Checks begun after the deadline that found it incomplete.
        late_misses: u8,
        /// The shares of this process's memory the READ holds.
        hold: RemoteHold,
    },
}

impl Request {
    /// Its deadline (`--timeout` from just before it was posted).
    pub fn deadline(&self) -> crate::deadline::Deadline {
        match self {
            Request::Local(p) => p.deadline(),
            Request::Remote { deadline, .. } => *deadline,
        }
    }
}

fn decode_pair(b: &[u8]) -> Option<Pair> {
    let w = |i: usize| u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
    let kv = |c: u32| KvPart::from_code(c);
    Some(Pair {
        src: SliceCoord { layer: w(0), kv: kv(w(1))?, block: w(2) },
        dst: SliceCoord { layer: w(3), kv: kv(w(4))?, block: w(5) },
        len: u64::from_le_bytes(b[24..32].try_into().unwrap()),
    })
}

/// A command the decode agent process read (see the module's table).
#[derive(Debug)]
pub enum AgentCommand {
    /// `X`: post a READ of these pairs under this tag.
    Xfer(String, Vec<Pair>),
    /// `P`: report UCX's protocol selection.
    Path,
    /// `Q` or end of input: release everything and exit 0.
    Quit,
    /// A malformed command: the child fails with this message (exit 2).
    Bad(String),
}

/// Longest [`Init`] line the child accepts (its NIXL metadata is a few hundred KiB at most).
const MAX_INIT_BYTES: u64 = 64 << 20;
/// Longest command line the child accepts (`X <tag> <n>`).
const MAX_COMMAND_BYTES: u64 = 4096;

/// Reads one line of at most `max` bytes; `Ok(None)` at end of input. Errors: a longer line
/// or invalid UTF-8 (usage).
fn read_line_limited(r: &mut impl BufRead, max: u64) -> Result<Option<String>> {
    let mut buf = Vec::new();
    let n = r.take(max + 1).read_until(b'\n', &mut buf).map_err(|e| Error::Io(format!("kvprobe agent: input: {e}")))?;
    if n == 0 {
        return Ok(None);
    }
    if n as u64 > max {
        return Err(Error::Usage(format!("kvprobe agent: an input line is longer than {max} bytes")));
    }
    String::from_utf8(buf).map(Some).map_err(|_| Error::Usage("kvprobe agent: input is not UTF-8".into()))
}

/// Reads and checks the next command of the decode agent process (see the module's table):
/// lines of at most 4 KiB, a pair count of 1 to `max_pairs`, every pair inside a pool of
/// `geometry` ([`check_pair`]); end of input is `Quit`, anything else malformed `Bad`.
pub fn read_command(input: &mut impl BufRead, geometry: &Geometry, max_pairs: u64) -> AgentCommand {
    let l = match read_line_limited(input, MAX_COMMAND_BYTES) {
        Ok(Some(l)) => l,
        Ok(None) => return AgentCommand::Quit,
        Err(e) => return AgentCommand::Bad(e.detail().to_string()),
    };
    let f: Vec<&str> = l.split_whitespace().collect();
    match f.as_slice() {
        ["X", tag, n] => match n.parse::<u64>() {
            Ok(n) if n >= 1 && n <= max_pairs => {
                let mut body = vec![0u8; n as usize * 32];
                if input.read_exact(&mut body).is_err() {
                    return AgentCommand::Bad(format!("kvprobe agent: input ended inside the {n} pairs of {tag}"));
                }
                match body.chunks_exact(32).map(decode_pair).collect::<Option<Vec<_>>>() {
                    Some(pairs) => match pairs.iter().try_for_each(|p| check_pair(geometry, p)) {
                        Ok(()) => AgentCommand::Xfer(tag.to_string(), pairs),
                        Err(e) => AgentCommand::Bad(e.detail().to_string()),
                    },
                    None => AgentCommand::Bad(format!("kvprobe agent: a pair of {tag} has an unknown K/V code")),
                }
            }
            _ => AgentCommand::Bad(format!("kvprobe agent: X {tag} {n}: the pair count must be 1 to {max_pairs}")),
        },
        ["P"] => AgentCommand::Path,
        ["Q"] => AgentCommand::Quit,
        _ => AgentCommand::Bad(format!("kvprobe agent: unknown command {:?}", l.trim_end())),
    }
}

/// Checks a pair against the pool's geometry: both slices exist and `len` bytes from each
/// stay inside its layer region (a length over one slice must be whole slices). Errors: usage.
pub fn check_pair(g: &Geometry, p: &Pair) -> Result<()> {
    let sb = g.slice_bytes()?;
    let region = g.region_bytes()?;
    for c in [p.src, p.dst] {
        if c.layer >= g.num_layers || c.block >= g.num_blocks || !g.parts().contains(&c.kv) {
            return Err(Error::Usage(format!("kvprobe agent: pair names a slice outside the pool: {c:?}")));
        }
        if p.len == 0 || g.slice_offset(c.kv, c.block) + p.len > region || (p.len > sb && !p.len.is_multiple_of(sb)) {
            return Err(Error::Usage(format!("kvprobe agent: pair of {} bytes at {c:?} leaves its layer region", p.len)));
        }
    }
    Ok(())
}

/// `kvprobe agent`: the child side. Reads [`Init`] from stdin, serves the protocol above,
/// and returns the exit code (0 after `Q` or end of input).
pub fn agent_main() -> Exit {
    crate::child::ignore_interrupts();
    crate::deadline::set_agent_process();
    let out = Arc::new(Mutex::new(std::io::stdout()));
    let say = |s: String| {
        let mut o = out.lock().unwrap();
        let _ = o.write_all(s.as_bytes()).and_then(|_| o.flush());
    };
    match serve(&say) {
        Ok(()) => Exit::Clean,
        Err(e) => {
            say(format!("E {} {}\n", e.exit() as u8, e.detail().replace('\n', " ")));
            e.exit()
        }
    }
}

fn serve(say: &dyn Fn(String)) -> Result<()> {
    let mut input = BufReader::new(std::io::stdin());
    let line = read_line_limited(&mut input, MAX_INIT_BYTES)?
        .ok_or_else(|| Error::Usage("kvprobe agent: no init line on stdin".into()))?;
    let init: Init = serde_json::from_str(line.trim()).map_err(|e| Error::Usage(format!("kvprobe agent: bad init: {e}")))?;
    if init.memory == crate::pool::MemoryKind::Dram && init.dram_fd.is_none() {
        return Err(Error::Usage("kvprobe agent: a DRAM init needs the pool's descriptor (dram_fd)".into()));
    }
    init.geometry.validate()?;
    let max_pairs = init.geometry.total_slices()?;
    crate::trace!(
        "decode agent process: init ({})",
        if init.memory == crate::pool::MemoryKind::Vram { format!("VRAM on GPU {}", init.device) } else { "DRAM".into() }
    );
    crate::nixl::prepare_ucx_env(false);
    crate::nixl::check_ucx_log_file()?;
    crate::nixl::load()?;
    let mark = crate::ucx::mark();
    let vram = init.memory == crate::pool::MemoryKind::Vram;
    let pool = match init.dram_fd {
        Some(fd) if !vram => {
            let buf = crate::hostmem::HostBuffer::map_inherited(fd, init.geometry.pool_bytes()? as usize)?;
            crate::pool::KvPool::host_over(&init.geometry, init.seed, buf)?
        }
        _ => {
            let dev = crate::cuda::Device::open(init.device)?;
            let kernels = Arc::new(crate::cuda::Kernels::compile(&dev)?);
            crate::pool::KvPool::device(&dev, kernels, &init.geometry, init.seed)?
        }
    };
    let handles = pool.ipc_handles()?.map(|(_, h)| h).unwrap_or_default();
    crate::trace!("decode agent process: NIXL agent");
    let mut ep = Endpoint::with_options(&init.name, &init.backend, pool, &init.transport)?;
    crate::trace!("decode agent process: loads prefill's metadata");
    ep.connect(init.peer.clone())?;
    crate::ucx::adopt();
    crate::deadline::Stall::Start.here();
    let ready = Ready { info: ep.info()?, handles: handles.iter().map(|h| hex(h)).collect() };
    say(format!("R {}\n", serde_json::to_string(&ready).map_err(|e| Error::Io(e.to_string()))?));

    let (tx, rx) = channel();
    let geometry = init.geometry.clone();
    std::thread::spawn(move || {
        loop {
            let cmd = read_command(&mut input, &geometry, max_pairs);
            let stop = matches!(cmd, AgentCommand::Quit | AgentCommand::Bad(_));
            if tx.send(cmd).is_err() || stop {
                return;
            }
        }
    });
    let mut inflight: Vec<(String, crate::nixl::Posted)> = Vec::new();
    loop {
        let mut busy = false;
        match rx.try_recv() {
            Ok(AgentCommand::Xfer(tag, pairs)) => {
                crate::trace!("decode agent process: READ {tag}");
                busy = true;
                // kvprobe bounds the request (--timeout); here it is only measured.
                let unbounded = crate::deadline::Deadline::after(Duration::from_secs(u32::MAX as u64));
                inflight.push((tag.clone(), ep.post_as_initiator(Op::Read, &pairs, &tag, unbounded)?));
            }
            Ok(AgentCommand::Path) => {
                busy = true;
                let p = crate::ucx::path_since(mark, &init.backend, "READ", vram);
                say(format!("T {}\n", serde_json::to_string(&p).map_err(|e| Error::Io(e.to_string()))?));
            }
            Ok(AgentCommand::Bad(m)) => return Err(Error::Usage(m)),
            Ok(AgentCommand::Quit) | Err(TryRecvError::Disconnected) => return Ok(()),
            Err(TryRecvError::Empty) => {}
        }
        let mut i = 0;
        while i < inflight.len() {
            if let Some(r) = ep.poll(&mut inflight[i].1)? {
                let (tag, _) = inflight.swap_remove(i);
                say(format!("D {tag} {} {}\n", r.bytes, r.elapsed.as_nanos()));
                busy = true;
            } else {
                i += 1;
            }
        }
        for (p, m) in ep.raw_notifications()? {
            say(format!("N {} {}\n", hex(p.as_bytes()), hex(m.as_bytes())));
            busy = true;
        }
        if !busy {
            if inflight.is_empty() {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::hint::spin_loop();
            }
        }
    }
}
