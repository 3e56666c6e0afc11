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
use std::sync::mpsc::{Receiver, TryRecvError, channel};
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
/// by every region of the pool imported from it.
struct ChildGuard {
    child: Mutex<Child>,
    stdin: Mutex<Option<BufWriter<ChildStdin>>>,
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(mut s) = self.stdin.lock() {
            if let Some(w) = s.as_mut() {
                let _ = w.write_all(b"Q\n");
                let _ = w.flush();
            }
            *s = None; // end of input
        }
        if let Ok(mut c) = self.child.lock() {
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(10) {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let _ = c.kill();
            let _ = c.wait();
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
    /// Starts `kvprobe agent`, sends `init` and waits (up to 120 s) for the child's pool and
    /// agent. Returns the proxy, the child's [`Ready`] and the keep-alive to hand to the
    /// imported pool. Errors: the child cannot start or reports an error (its exit code's
    /// kind), dies or does not answer (transport, exit 3).
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
        crate::child::die_with_parent(&mut cmd);
        let mut child = cmd.spawn().map_err(|e| Error::Environment(format!("cannot start the decode agent process: {e}")))?;
        let stdin = child.stdin.take().map(BufWriter::new);
        let stdout = child.stdout.take().expect("piped");
        let guard = Arc::new(ChildGuard { child: Mutex::new(child), stdin: Mutex::new(stdin) });
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
                Err(_) if t0.elapsed() > Duration::from_secs(120) => {
                    return Err(Error::Transport("the decode agent process did not answer in 120 s".into()));
                }
                Err(_) => {}
            }
        };
        let remote = RemoteAgent { info: ready.info.clone(), ..remote };
        Ok((remote, ready, guard))
    }

    fn send(&self, head: &[u8], body: &[u8]) -> Result<()> {
        let mut s = self.guard.stdin.lock().unwrap();
        let w = s.as_mut().ok_or_else(|| Error::Transport("the decode agent process is closed".into()))?;
        w.write_all(head)
            .and_then(|_| w.write_all(body))
            .and_then(|_| w.flush())
            .map_err(|e| Error::Transport(format!("the decode agent process is gone: {e}")))
    }

    /// The agent's name and metadata, as the child reported them.
    pub fn info(&self) -> &PeerInfo {
        &self.info
    }

    /// Has the child post one READ of `pairs` from the prefill agent with notification `tag`.
    /// Errors: the child is gone (transport).
    pub fn post_read(&self, pairs: &[Pair], tag: &str) -> Result<()> {
        debug_assert!(!tag.contains(char::is_whitespace));
        let mut body = Vec::with_capacity(pairs.len() * 32);
        for p in pairs {
            for v in [p.src.layer, p.src.kv.code(), p.src.block, p.dst.layer, p.dst.kv.code(), p.dst.block] {
                body.extend_from_slice(&v.to_le_bytes());
            }
            body.extend_from_slice(&p.len.to_le_bytes());
        }
        self.send(format!("X {tag} {}\n", pairs.len()).as_bytes(), &body)
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
        /// When it was sent to the child.
        started: Instant,
    },
}

impl Request {
    /// [`Error::Timeout`] when still incomplete after `timeout` (checked by the caller while
    /// polling).
    pub fn check_timeout(&self, timeout: Duration) -> Result<()> {
        match self {
            Request::Local(p) => p.check_timeout(timeout),
            Request::Remote { tag, bytes, started } if started.elapsed() > timeout => Err(Error::Timeout(format!(
                "READ {tag} of {bytes} bytes by the decode agent process not complete after {:.3} s",
                timeout.as_secs_f64()
            ))),
            Request::Remote { .. } => Ok(()),
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

enum Cmd {
    Xfer(String, Vec<Pair>),
    Path,
    Quit,
}

/// `kvprobe agent`: the child side. Reads [`Init`] from stdin, serves the protocol above,
/// and returns the exit code (0 after `Q` or end of input).
pub fn agent_main() -> Exit {
    crate::child::ignore_interrupts();
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
    let mut line = String::new();
    input.read_line(&mut line).map_err(|e| Error::Io(e.to_string()))?;
    let init: Init = serde_json::from_str(line.trim()).map_err(|e| Error::Usage(format!("kvprobe agent: bad init: {e}")))?;
    crate::trace!("decode agent process: init for GPU {}", init.device);
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
    let mut ep = Endpoint::new(&init.name, &init.backend, pool)?;
    crate::trace!("decode agent process: loads prefill's metadata");
    ep.connect(init.peer.clone())?;
    crate::ucx::adopt();
    let ready = Ready { info: ep.info()?, handles: handles.iter().map(|h| hex(h)).collect() };
    say(format!("R {}\n", serde_json::to_string(&ready).map_err(|e| Error::Io(e.to_string()))?));

    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let mut l = String::new();
        loop {
            l.clear();
            if input.read_line(&mut l).unwrap_or(0) == 0 {
                let _ = tx.send(Cmd::Quit);
                return;
            }
            let f: Vec<&str> = l.split_whitespace().collect();
            let cmd = match f.as_slice() {
                ["X", tag, n] => {
                    let n: usize = n.parse().unwrap_or(0);
                    let mut body = vec![0u8; n * 32];
                    if input.read_exact(&mut body).is_err() {
                        let _ = tx.send(Cmd::Quit);
                        return;
                    }
                    match body.chunks_exact(32).map(decode_pair).collect::<Option<Vec<_>>>() {
                        Some(pairs) => Cmd::Xfer(tag.to_string(), pairs),
                        None => Cmd::Quit,
                    }
                }
                ["P"] => Cmd::Path,
                _ => Cmd::Quit,
            };
            let quit = matches!(cmd, Cmd::Quit);
            if tx.send(cmd).is_err() || quit {
                return;
            }
        }
    });
    let mut inflight: Vec<(String, crate::nixl::Posted)> = Vec::new();
    loop {
        let mut busy = false;
        match rx.try_recv() {
            Ok(Cmd::Xfer(tag, pairs)) => {
                crate::trace!("decode agent process: READ {tag}");
                busy = true;
                inflight.push((tag.clone(), ep.post_as_initiator(Op::Read, &pairs, &tag)?));
            }
            Ok(Cmd::Path) => {
                busy = true;
                let p = crate::ucx::path_since(mark, &init.backend, "READ", vram);
                say(format!("T {}\n", serde_json::to_string(&p).map_err(|e| Error::Io(e.to_string()))?));
            }
            Ok(Cmd::Quit) | Err(TryRecvError::Disconnected) => return Ok(()),
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
