//! Mooncake Store for `--tier mooncake`: finding the installation, the `mooncake_master`
//! process kvprobe starts, health-checks and always stops (or an existing deployment named by
//! `--mooncake-master` / `--mooncake-metadata`), and the store worker kvprobe drives over a
//! pipe.
//!
//! The install step (scripts/install-mooncake.sh, run by scripts/install-deps.sh) puts the
//! wheel `mooncake-transfer-engine-cuda13` (CUDA 13 hosts) or `-non-cuda` into a virtual
//! environment at `$KVPROBE_HOME/mooncake/venv`; `$KVPROBE_MOONCAKE_VENV` names another.
//! Mooncake exports no C API, so the store client is a worker on its Python API
//! ([`Worker`], pysrc/kvprobe_mooncake_worker.py) that maps kvprobe's pools (DRAM: a memfd it
//! inherits; VRAM: each layer region's CUDA IPC handle) and moves blocks between them and the
//! store.

use crate::error::{Error, Result};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Mooncake Store's `ErrorCode::LEASE_EXPIRED` (mooncake-store/include/types.h): the read
/// lease of a get ran out before its data transfer completed.
pub const LEASE_EXPIRED: i64 = -707;

/// Attempts [`Worker::get_block`] makes when a get fails with [`LEASE_EXPIRED`].
pub const GET_ATTEMPTS: u32 = 8;

/// The metadata setting of the store clients of a master kvprobe starts: Mooncake's
/// peer-to-peer handshake (each client's Transfer Engine answers for its own segments), so no
/// metadata server runs at all.
pub const P2P_METADATA: &str = "P2PHANDSHAKE";

/// Environment variable naming a Mooncake virtual environment (overrides the install dir).
pub const VENV_ENV: &str = "KVPROBE_MOONCAKE_VENV";

/// How to install Mooncake, for error messages.
pub const INSTALL_HINT: &str = "install it with `scripts/install-mooncake.sh` (run by scripts/install-deps.sh)";

/// A Mooncake installation.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Install {
    /// The virtual environment.
    pub venv: PathBuf,
    /// Its Python interpreter.
    pub python: PathBuf,
    /// The `mooncake_master` executable inside the package.
    pub master: PathBuf,
    /// Wheel (distribution) name, e.g. "mooncake_transfer_engine_non_cuda".
    pub wheel: String,
    /// Wheel version, e.g. "0.3.13.post1".
    pub version: String,
}

/// The venv kvprobe uses: `$KVPROBE_MOONCAKE_VENV`, else `$KVPROBE_HOME/mooncake/venv`.
pub fn venv_dir() -> PathBuf {
    match std::env::var_os(VENV_ENV).filter(|v| !v.is_empty()) {
        Some(v) => PathBuf::from(v),
        None => crate::sys::tempdir::kvprobe_home().join("mooncake/venv"),
    }
}

/// Finds the installation: the venv's python, the package's `mooncake_master` binary, and the
/// wheel's name and version from its `.dist-info`. Errors (exit 2): not installed.
pub fn find() -> Result<Install> {
    let venv = venv_dir();
    let python = venv.join("bin/python");
    let missing = |what: String| Error::Environment(format!("Mooncake not usable: {what}; {INSTALL_HINT}"));
    if !python.is_file() {
        return Err(missing(format!("no virtual environment at {}", venv.display())));
    }
    let site = std::fs::read_dir(venv.join("lib"))
        .map_err(|e| missing(format!("{}: {e}", venv.join("lib").display())))?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("site-packages"))
        .find(|p| p.join("mooncake").is_dir())
        .ok_or_else(|| missing(format!("no mooncake package under {}", venv.display())))?;
    let master = site.join("mooncake/mooncake_master");
    if !master.is_file() {
        return Err(missing(format!("{} is missing", master.display())));
    }
    let (wheel, version) = std::fs::read_dir(&site)
        .map_err(|e| missing(e.to_string()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let stem = name.strip_suffix(".dist-info")?;
            let (w, v) = stem.rsplit_once('-')?;
            w.starts_with("mooncake_transfer_engine").then(|| (w.to_string(), v.to_string()))
        })
        .next()
        .ok_or_else(|| missing("no mooncake_transfer_engine*.dist-info".into()))?;
    Ok(Install { venv, python, master, wheel, version })
}

/// `N` distinct free TCP ports on `host`: all bound at once (so none is handed out twice),
/// then released for the child to bind.
fn free_ports<const N: usize>(host: IpAddr) -> Result<[u16; N]> {
    let err = |e: std::io::Error| Error::Environment(format!("no free port on {host}: {e}"));
    let held = (0..N).map(|_| TcpListener::bind((host, 0)).map_err(err)).collect::<Result<Vec<_>>>()?;
    let mut ports = [0u16; N];
    for (p, l) in ports.iter_mut().zip(&held) {
        *p = l.local_addr().map_err(err)?.port();
    }
    Ok(ports)
}

pub use crate::sys::net::{listening, proc_net_addr};

/// Checks that every TCP socket process `pid` (`what`, e.g. "mooncake_master") listens on is
/// bound to `host`, the address kvprobe asked it to listen on (an IPv4-mapped IPv6 form of
/// it counts as the same); an unspecified `host` (0.0.0.0, ::) allows any. Returns the
/// addresses. Errors: environment (exit 2) naming each wider or other address: a server that
/// ignored what it was asked is not run; /proc unreadable.
pub fn check_listening(what: &str, pid: u32, host: IpAddr) -> Result<Vec<SocketAddr>> {
    let addrs = listening(pid).map_err(|e| Error::Environment(format!("cannot read what {what} (pid {pid}) listens on: {e}")))?;
    let same = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4) == Some(host) || ip == host,
        _ => ip == host,
    };
    let wrong: Vec<String> = addrs.iter().filter(|a| !host.is_unspecified() && !same(a.ip())).map(|a| a.to_string()).collect();
    if !wrong.is_empty() {
        return Err(Error::Environment(format!(
            "{what} listens on {}, wider than {host}, the address kvprobe asked for: not running it (docs/scenarios.md, \"Network exposure\")",
            wrong.join(", ")
        )));
    }
    Ok(addrs)
}

/// An existing Mooncake deployment (`--mooncake-master`, `--mooncake-metadata`): kvprobe's
/// worker joins it as one more store client instead of starting a master.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct External {
    /// The master's RPC address, `HOST:PORT` (mooncake_master's `--rpc_port`, default 50051).
    pub master: String,
    /// The metadata service: `http://HOST:PORT/metadata` (the master's HTTP metadata server),
    /// `etcd://HOST:PORT` or `P2PHANDSHAKE`, as Mooncake's `metadata_server` setting takes it
    /// (the released wheels carry no redis plugin).
    pub metadata_url: String,
}

impl External {
    /// Checks both settings' form. Errors (usage, exit 2): not `HOST:PORT`, or a metadata
    /// service Mooncake does not take.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Usage(m));
        match self.master.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0) => {}
            _ => return bad(format!("--mooncake-master {:?}: expected HOST:PORT (e.g. 10.0.0.5:50051)", self.master)),
        }
        let u = &self.metadata_url;
        let hostport = ["http://", "etcd://"].iter().find_map(|p| u.strip_prefix(p));
        let port_ok = |hp: &str| hp.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
        // The HTTP metadata server answers on a path (mooncake_master serves /metadata).
        let path_ok = |rest: &str| !u.starts_with("http://") || rest.split_once('/').is_some_and(|(_, p)| !p.is_empty());
        match hostport {
            Some(rest) if port_ok(rest.split('/').next().unwrap_or("")) && path_ok(rest) => Ok(()),
            None if u == "P2PHANDSHAKE" => Ok(()),
            _ => bad(format!("--mooncake-metadata {u:?}: expected http://HOST:PORT/metadata, etcd://HOST:PORT or P2PHANDSHAKE")),
        }
    }

    /// The master's socket address. Errors: usage (exit 2) when the host does not resolve.
    pub fn master_addr(&self) -> Result<SocketAddr> {
        use std::net::ToSocketAddrs;
        self.master
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| Error::Usage(format!("--mooncake-master {:?}: the host does not resolve", self.master)))
    }

    /// Whether the master accepts a TCP connection within `timeout`. Errors: transport
    /// (exit 3) when it does not.
    pub fn reachable(&self, timeout: Duration) -> Result<()> {
        let a = self.master_addr()?;
        TcpStream::connect_timeout(&a, timeout)
            .map(|_| ())
            .map_err(|e| Error::Transport(format!("the Mooncake master at {} does not answer: {e}", self.master)))
    }
}

/// The master a run uses: one kvprobe started (and stops), or an existing deployment.
pub enum Deployment {
    /// Started by kvprobe on loopback.
    Started(Master),
    /// Given by `--mooncake-master` / `--mooncake-metadata`.
    External(External),
}

impl Deployment {
    /// The master's RPC address as the store client's `master_server_address`.
    pub fn rpc(&self) -> String {
        match self {
            Deployment::Started(m) => m.rpc.to_string(),
            Deployment::External(e) => e.master.clone(),
        }
    }

    /// The metadata service URL.
    pub fn metadata_url(&self) -> &str {
        match self {
            Deployment::Started(m) => &m.metadata_url,
            Deployment::External(e) => &e.metadata_url,
        }
    }

    /// The address this host's store client advertises to the others: the address a master
    /// kvprobe started listens on (this host), else the local address of the route to the
    /// master (no packet is sent).
    pub fn local_hostname(&self) -> String {
        let e = match self {
            Deployment::Started(m) => return m.rpc.ip().to_string(),
            Deployment::External(e) => e,
        };
        let local = e.master_addr().ok().and_then(|a| {
            let any: SocketAddr =
                if a.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { (std::net::Ipv6Addr::UNSPECIFIED, 0).into() };
            let s = std::net::UdpSocket::bind(any).ok()?;
            s.connect(a).ok()?;
            s.local_addr().ok()
        });
        local.map(|a| a.ip().to_string()).unwrap_or_else(|| "127.0.0.1".into())
    }

    /// [`Error::Transport`] when the master is gone: a started one exited (with its log's
    /// tail), an external one refuses connections.
    pub fn alive(&mut self) -> Result<()> {
        match self {
            Deployment::Started(m) => m.alive(),
            Deployment::External(e) => e.reachable(Duration::from_secs(2)),
        }
    }

    /// True for a master kvprobe started.
    pub fn is_started(&self) -> bool {
        matches!(self, Deployment::Started(_))
    }
}

/// A `mooncake_master` kvprobe started, with its HTTP metadata server, listening on one
/// address of this host (loopback for one process; the address decode reached `kvprobe
/// serve` on for a node pair). Stopped (killed and reaped) when dropped, on every path out of
/// a run, Ctrl-C included.
pub struct Master {
    child: Child,
    /// RPC address, `HOST:PORT`.
    pub rpc: SocketAddr,
    /// The store clients' metadata setting: [`P2P_METADATA`] (the master runs no metadata
    /// server).
    pub metadata_url: String,
    /// The master's stdout and stderr: an anonymous file ([`crate::sys::tempdir::anonymous_file`]).
    log: std::fs::File,
}

impl Master {
    /// Starts the master of `install` on free ports of `host` (an address of this host) and
    /// waits until its RPC and HTTP metadata ports accept connections (up to `timeout`).
    ///
    /// Errors: [`Error::Environment`] when it cannot be started, [`Error::Transport`] (with
    /// the tail of its log) when it exits or does not answer in time.
    ///
    /// Another process can take a chosen port between kvprobe releasing it and the master
    /// binding it; a master that exits during start-up is started again on new ports (three
    /// attempts; the last one's error is returned). Not only on "Address already in use" in
    /// its log: a master that lost a port race has been seen to exit with status 1 and an
    /// empty log while many tests started masters at once.
    pub fn start(install: &Install, timeout: Duration, host: IpAddr) -> Result<Master> {
        let mut attempt = 1;
        loop {
            match Master::start_once(install, timeout, host) {
                Err(Error::Transport(m)) if attempt < 3 && m.starts_with("mooncake_master exited") => {
                    crate::sys::trace::trace!("mooncake_master attempt {attempt} failed: {m}");
                    attempt += 1
                }
                r => return r,
            }
        }
    }

    fn start_once(install: &Install, timeout: Duration, host: IpAddr) -> Result<Master> {
        let [rpc_port, metrics_port] = free_ports::<2>(host)?;
        let log = crate::sys::tempdir::anonymous_file().map_err(|e| Error::Environment(format!("master log file: {e}")))?;
        let out = log.try_clone().map_err(|e| Error::Environment(format!("master log file: {e}")))?;
        let err = log.try_clone().map_err(|e| Error::Environment(format!("master log file: {e}")))?;
        let mut cmd = Command::new(&install.master);
        cmd.arg(format!("--rpc_port={rpc_port}"))
            .arg(format!("--rpc_address={host}"))
            // No embedded HTTP metadata server: it binds all interfaces whatever
            // --http_metadata_server_host says (Mooncake 0.3.13: the host is never passed to
            // its HTTP server). The store clients exchange their metadata peer to peer
            // (P2PHANDSHAKE) instead.
            .arg("--enable_http_metadata_server=false")
            .arg(format!("--metrics_host={host}"))
            .arg(format!("--metrics_port={metrics_port}"))
            // A read lease must outlast one get (shorter ones fail it: LEASE_EXPIRED), but the
            // default 10 s keeps kvprobe from removing evicted objects (OBJECT_HAS_LEASE) long
            // enough for the store to fill with dead ones; kvprobe retries refused removals.
            .arg("--default_kv_lease_ttl=500")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            // Its own process group: a terminal's Ctrl-C reaches kvprobe, which stops it.
            .process_group(0);
        let child = crate::sys::child::spawn(cmd)
            .map_err(|e| Error::Environment(format!("cannot start {}: {e}", install.master.display())))?;
        let rpc = SocketAddr::new(host, rpc_port);
        let metrics = SocketAddr::new(host, metrics_port);
        let mut m = Master { child, rpc, metadata_url: P2P_METADATA.to_string(), log };
        let t0 = Instant::now();
        loop {
            m.alive()?;
            if crate::sys::interrupt::requested() {
                return Err(Error::Interrupted("while starting mooncake_master".into()));
            }
            let up = |a: &SocketAddr| TcpStream::connect_timeout(a, Duration::from_millis(100)).is_ok();
            // The admin (metrics) server starts last, about a second after the others.
            if up(&m.rpc) && up(&metrics) {
                // Every port it opened is on `host`, as asked (Drop stops it otherwise).
                check_listening("mooncake_master", m.pid(), host)?;
                return Ok(m);
            }
            if t0.elapsed() > timeout {
                return Err(Error::Transport(format!(
                    "mooncake_master did not answer on {} and {} within {:.1} s; its log ends:\n{}",
                    m.rpc,
                    metrics,
                    timeout.as_secs_f64(),
                    m.log_tail(20)
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The master's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// [`Error::Transport`] (with the tail of its log) when the master has exited.
    pub fn alive(&mut self) -> Result<()> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(st)) => Err(Error::Transport(format!("mooncake_master exited ({st}); its log ends:\n{}", self.log_tail(20)))),
            Err(e) => Err(Error::Transport(format!("mooncake_master: {e}"))),
        }
    }

    /// The last `n` lines of the master's log.
    pub fn log_tail(&self, n: usize) -> String {
        let s = read_all(&self.log);
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Master {
    fn drop(&mut self) {
        // The master keeps no state kvprobe needs: SIGKILL, then reap it.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Source of the store worker (pysrc/kvprobe_mooncake_worker.py), run in the Mooncake venv.
pub const WORKER_SOURCE: &str = include_str!("../../pysrc/kvprobe_mooncake_worker.py");

/// The worker's protocol name.
pub const PROTOCOL: &str = "kvprobe-mooncake/1";

/// The bind() shim the worker runs with (`LD_PRELOAD`; csrc/bind_host.c, built by build.rs):
/// while [`BIND_HOST_VAR`] holds an address literal (the worker sets it to setup's
/// `local_hostname`), a bind to 0.0.0.0 or :: becomes a bind to it (`::ffff:HOST` on a dual-stack
/// IPv6 socket). Mooncake 0.3.13/0.3.14's Transfer Engine binds its handshake port to 0.0.0.0
/// (`findAvailableTcpPort`) and its TCP-transport port to [::] (`TcpContext`) with no setting to
/// narrow them; with the shim both listen on the store client's own address only, which
/// [`Worker::setup`] checks.
pub const BIND_SHIM: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libkvprobe_bind_host.so"));

/// The variable the shim reads (in the worker's environment only).
pub const BIND_HOST_VAR: &str = "KVPROBE_BIND_HOST";

/// One byte range `(offset, length)` of the shared pool.
pub type Range = (u64, u64);

/// The store worker: a child process running [`WORKER_SOURCE`] with the Mooncake Python API,
/// driven over a typed JSON-lines protocol ([`PROTOCOL`]). Its stderr goes to a log whose
/// tail ends up in errors. Killed and reaped when dropped; it also exits when its stdin
/// closes.
pub struct Worker {
    child: Child,
    stdin: std::process::ChildStdin,
    replies: std::sync::mpsc::Receiver<String>,
    next_id: u64,
    timeout: Duration,
    /// The worker's stderr: an anonymous file.
    log: std::fs::File,
    /// The worker's script, in kvprobe's private directory ([`crate::sys::tempdir::dir`]).
    _script: tempfile::NamedTempFile,
    /// The bind() shim it runs with ([`BIND_SHIM`]), beside the script.
    _shim: tempfile::NamedTempFile,
    /// The descriptors it inherited ([`Worker::start`]'s shareable buffers).
    inherited: Vec<i32>,
    /// Set when the run ended elsewhere (the peer of a node pair ended it or went away,
    /// [`crate::peer::Link::ended`]): a call waiting for its reply gives up.
    abort: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

impl Worker {
    /// Starts the worker with `install`'s Python and checks its protocol (`hello`). Each
    /// later call waits at most `timeout` for its reply. The worker inherits the memfds of
    /// `shared` (shareable host buffers it may map later with [`Worker::map_shared`]) and no
    /// other descriptor of kvprobe's.
    ///
    /// Errors: [`Error::Environment`] when it cannot start, [`Error::Transport`] when it
    /// dies, answers out of protocol, or not in time.
    pub fn start(install: &Install, timeout: Duration, shared: &[&crate::sys::hostmem::HostBuffer]) -> Result<Worker> {
        use std::io::{BufRead, Write};
        let env_err = |w: &str, e: std::io::Error| Error::Environment(format!("Mooncake worker: {w}: {e}"));
        let dir = crate::sys::tempdir::dir()?;
        let mut script = tempfile::Builder::new()
            .prefix("kvprobe-mooncake-worker.")
            .suffix(".py")
            .tempfile_in(dir)
            .map_err(|e| env_err("script", e))?;
        script.write_all(WORKER_SOURCE.as_bytes()).map_err(|e| env_err("script", e))?;
        let mut shim = tempfile::Builder::new()
            .prefix("kvprobe-bind-host.")
            .suffix(".so")
            .tempfile_in(dir)
            .map_err(|e| env_err("bind shim", e))?;
        shim.write_all(BIND_SHIM).map_err(|e| env_err("bind shim", e))?;
        let log = crate::sys::tempdir::anonymous_file().map_err(|e| env_err("log", e))?;
        let mut cmd = Command::new(&install.python);
        // The Transfer Engine's listeners bind where setup's local_hostname says ([`BIND_SHIM`]),
        // before any library the user preloads.
        let preload = match std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
            Some(v) => {
                let mut p = shim.path().as_os_str().to_owned();
                p.push(" ");
                p.push(v);
                p
            }
            None => shim.path().as_os_str().to_owned(),
        };
        cmd.env("LD_PRELOAD", preload).env_remove(BIND_HOST_VAR);
        let inherited: Vec<i32> = shared.iter().filter_map(|b| b.shared_fd()).collect();
        cmd.arg("-u")
            .arg(script.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log.try_clone().map_err(|e| env_err("log", e))?)
            .process_group(0);
        let mut child = crate::sys::child::spawn_keeping(cmd, &inherited)
            .map_err(|e| env_err(&format!("cannot start {}", install.python.display()), e))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut w =
            Worker { child, stdin, replies: rx, next_id: 1, timeout, log, _script: script, _shim: shim, inherited, abort: None };
        // hello imports the store client: a broken install fails here, as a set-up problem.
        let hello = w.call("hello", serde_json::json!({})).map_err(|e| match e {
            Error::Transport(m) => Error::Environment(format!("{m}; {INSTALL_HINT}")),
            e => e,
        })?;
        if hello["protocol"] != PROTOCOL {
            return Err(Error::Transport(format!("Mooncake worker speaks {}, not {PROTOCOL}", hello["protocol"])));
        }
        Ok(w)
    }

    fn log_tail(&self, n: usize) -> String {
        let s = read_all(&self.log);
        let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    fn dead(&mut self, what: &str) -> Error {
        let status = match self.child.try_wait() {
            Ok(Some(st)) => format!(" (exited: {st})"),
            _ => String::new(),
        };
        Error::Transport(format!("Mooncake worker {what}{status}; its log ends:\n{}", self.log_tail(20)))
    }

    /// Sends `op` with `args` (a JSON object) and returns the reply's fields. Errors:
    /// transport (exit 3) when the worker fails the op, dies or answers out of protocol;
    /// timeout (exit 4) when it does not answer within the worker's timeout.
    pub fn call(&mut self, op: &str, args: serde_json::Value) -> Result<serde_json::Value> {
        use std::io::Write;
        let id = self.next_id;
        self.next_id += 1;
        let mut req = match args {
            serde_json::Value::Object(m) => m,
            _ => serde_json::Map::new(),
        };
        req.insert("v".into(), 1.into());
        req.insert("id".into(), id.into());
        req.insert("op".into(), op.into());
        let line = serde_json::to_string(&req).map_err(|e| Error::Transport(e.to_string()))?;
        // The deadline starts before the request is written: a worker that stops reading
        // fills the pipe and blocks the write (the watchdog ends that, crate::sys::deadline).
        let deadline = crate::sys::deadline::Deadline::after(self.timeout);
        let w = crate::sys::deadline::watch_until(deadline, || format!("writing `{op}` to the Mooncake worker").into());
        if writeln!(self.stdin, "{line}").and_then(|_| self.stdin.flush()).is_err() {
            return Err(self.dead(&format!("did not take `{op}`")));
        }
        w.check()?;
        // Wait in slices, so Ctrl-C is honoured while the store client is busy (a setup
        // against something that is not a master can take the whole timeout).
        let t0 = deadline.start;
        let reply = loop {
            let left = self.timeout.saturating_sub(t0.elapsed());
            match self.replies.recv_timeout(left.min(Duration::from_millis(100))) {
                Ok(r) => break r,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) if left > Duration::from_millis(100) => {
                    if crate::sys::interrupt::requested() && op != "quit" {
                        return Err(Error::Interrupted(format!("while waiting for the Mooncake worker's `{op}`")));
                    }
                    if self.abort.as_ref().is_some_and(|a| a.load(std::sync::atomic::Ordering::SeqCst)) && op != "quit" {
                        return Err(Error::Transport(format!(
                            "the peer ended the run while the Mooncake worker's `{op}` was awaited"
                        )));
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    return Err(Error::Timeout(format!(
                        "Mooncake worker did not answer `{op}` within {:.3} s",
                        self.timeout.as_secs_f64()
                    )));
                }
                Err(_) => return Err(self.dead(&format!("died during `{op}`"))),
            }
        };
        let v: serde_json::Value =
            serde_json::from_str(&reply).map_err(|e| Error::Transport(format!("Mooncake worker: bad reply {reply:?}: {e}")))?;
        if v["v"] != 1 || v["id"] != id {
            return Err(Error::Transport(format!("Mooncake worker: reply out of protocol: {reply}")));
        }
        if v["ok"] != true {
            return Err(Error::Transport(format!("Mooncake worker: `{op}` failed: {}", v["error"].as_str().unwrap_or("?"))));
        }
        Ok(v)
    }

    /// Connects the store client to the master of `deployment` over `protocol` ("tcp"),
    /// contributing `segment_bytes` of its memory to the store.
    pub fn setup(&mut self, deployment: &Deployment, protocol: &str, segment_bytes: u64) -> Result<()> {
        let host = deployment.local_hostname();
        self.call(
            "setup",
            serde_json::json!({
                "local_hostname": host,
                "metadata_url": deployment.metadata_url(),
                "master": deployment.rpc(),
                "protocol": protocol,
                "global_segment_bytes": segment_bytes,
                "local_buffer_bytes": 16u64 << 20,
            }),
        )?;
        // Its Transfer Engine listens where it was asked to ([`BIND_SHIM`]), or it is not run.
        if let Ok(ip) = host.parse::<IpAddr>() {
            check_listening("the Mooncake store client (kvprobe's worker)", self.pid(), ip)?;
        }
        Ok(())
    }

    /// Maps a shareable host buffer ([`crate::sys::hostmem::HostBuffer::alloc_shareable`]) in the
    /// worker and registers it with the store; later ranges are offsets into it. The buffer
    /// must have been passed to [`Worker::start`] (the worker inherits its memfd then, and
    /// only then). Errors: usage when it was not, or is not shareable; transport when the
    /// worker cannot map it.
    pub fn map_shared(&mut self, buf: &crate::sys::hostmem::HostBuffer) -> Result<()> {
        let fd = buf.shared_fd().ok_or_else(|| Error::Usage("the pool is not shareable with the Mooncake worker".into()))?;
        if !self.inherited.contains(&fd) {
            return Err(Error::Usage(format!(
                "the shared pool (descriptor {fd}) was not passed to the Mooncake worker when it started: pass it to \
                 Worker::start"
            )));
        }
        self.call("map_fd", serde_json::json!({ "fd": fd, "len": buf.len() }))?;
        Ok(())
    }

    /// Opens a VRAM pool in the worker by CUDA IPC: `handles` are its layer regions'
    /// handles ([`crate::mem::pool::KvPool::ipc_handles`]), each region `region_bytes` long, on GPU
    /// `device` (the ordinal under the same CUDA_VISIBLE_DEVICES). Later ranges are offsets
    /// `layer * region_bytes + offset`, the DRAM pool's layout. Errors: transport (exit 3)
    /// when the worker cannot open or register a region.
    pub fn map_cuda(&mut self, device: usize, handles: &[[u8; 64]], region_bytes: u64) -> Result<()> {
        let hex: Vec<String> = handles.iter().map(|h| h.iter().map(|b| format!("{b:02x}")).collect()).collect();
        self.call("map_cuda", serde_json::json!({ "device": device, "handles": hex, "region_bytes": region_bytes }))?;
        Ok(())
    }

    fn batch(&mut self, op: &str, pool: usize, keys: &[String], ranges: &[Vec<Range>]) -> Result<Vec<i64>> {
        let v = self.call(op, serde_json::json!({ "keys": keys, "ranges": ranges, "pool": pool }))?;
        let rc: Vec<i64> = rc_list(&v);
        if rc.len() != keys.len() {
            return Err(Error::Transport(format!(
                "Mooncake worker: `{op}` answered {} results for {} keys",
                rc.len(),
                keys.len()
            )));
        }
        Ok(rc)
    }

    /// Stores each key from its byte ranges of mapped pool `pool` (0 = the first mapped)
    /// (batch_put_from_multi_buffers); one return code per key (0 = stored).
    pub fn put(&mut self, pool: usize, keys: &[String], ranges: &[Vec<Range>]) -> Result<Vec<i64>> {
        self.batch("put", pool, keys, ranges)
    }

    /// Loads each key into its byte ranges of mapped pool `pool`
    /// (batch_get_into_multi_buffers); per key the bytes read, or a negative Mooncake error code.
    pub fn get(&mut self, pool: usize, keys: &[String], ranges: &[Vec<Range>]) -> Result<Vec<i64>> {
        self.batch("get", pool, keys, ranges)
    }

    /// Loads the object `key` into block `slot` of `pool`, the first pool mapped in this
    /// worker (its slices back to back, [`crate::mem::pool::KvPool::block_ranges`]). A get whose
    /// read lease ran out before its transfer completed ([`LEASE_EXPIRED`]: the master kvprobe
    /// starts gives 500 ms leases, which a loaded host can outlast) is tried again, up to
    /// [`GET_ATTEMPTS`] times in all: the object is still there, and a new get takes a new
    /// lease. Errors: transport (exit 3) when the store returns another length than the
    /// block's, or LEASE_EXPIRED at every attempt.
    pub fn get_block(&mut self, key: &str, pool: &mut crate::mem::pool::KvPool, slot: u32) -> Result<()> {
        let want = pool.block_bytes() as i64;
        let mut tries = 0;
        loop {
            tries += 1;
            match self.get(0, &[key.to_string()], &[pool.block_ranges(slot)])? {
                rc if rc.first() == Some(&want) => return Ok(()),
                rc if rc.first() == Some(&LEASE_EXPIRED) && tries < GET_ATTEMPTS => continue,
                rc => {
                    let lease = if rc.first() == Some(&LEASE_EXPIRED) {
                        format!(" (LEASE_EXPIRED at each of {tries} attempts)")
                    } else {
                        String::new()
                    };
                    return Err(Error::Transport(format!(
                        "Mooncake get of {key} returned {rc:?} (expected {want} bytes){lease}"
                    )));
                }
            }
        }
    }

    /// Drops keys from the store (batch_remove); one return code per key.
    pub fn remove(&mut self, keys: &[String]) -> Result<Vec<i64>> {
        let v = self.call("remove", serde_json::json!({ "keys": keys }))?;
        Ok(rc_list(&v))
    }

    /// Which keys the store holds (batch_is_exist): 1 yes, 0 no, negative on error.
    pub fn exists(&mut self, keys: &[String]) -> Result<Vec<i64>> {
        let v = self.call("exists", serde_json::json!({ "keys": keys }))?;
        Ok(rc_list(&v))
    }

    /// Makes every later call give up waiting once `flag` is set (the peer of a node pair
    /// ended the run or went away, [`crate::peer::Link::ended`]).
    pub fn set_abort(&mut self, flag: std::sync::Arc<std::sync::atomic::AtomicBool>) {
        self.abort = Some(flag);
    }

    /// Sets how long each later call waits for its reply (set-up calls run with
    /// [`crate::sys::deadline::SETUP_FLOOR`] at least, the run's calls with `--timeout`).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The worker's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.timeout = self.timeout.min(Duration::from_secs(2));
            let _ = self.call("quit", serde_json::json!({}));
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(2) {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// The whole of a log file a child writes through its own descriptor (read from offset 0,
/// without moving the shared file offset the child appends at).
fn read_all(f: &std::fs::File) -> String {
    use std::os::unix::fs::FileExt;
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 1 << 16];
    while let Ok(n @ 1..) = f.read_at(&mut chunk, buf.len() as u64) {
        buf.extend_from_slice(&chunk[..n]);
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// A reply's per-key return codes (`rc`); a non-integer code reads as `i64::MIN`.
fn rc_list(v: &serde_json::Value) -> Vec<i64> {
    v["rc"].as_array().map(|a| a.iter().map(|x| x.as_i64().unwrap_or(i64::MIN)).collect()).unwrap_or_default()
}

/// The store key of a block, following vLLM's MooncakeStoreConnector scheme (a fingerprint
/// of the configuration, then the block hash): `kvprobe/CONFIG/HASH/SERIAL`. CONFIG is the
/// run's seed and nonce, so keys of different runs never collide and a foreign key is
/// attributable; SERIAL (the tier reservation) tells apart saves of one hash made again after
/// an eviction whose object the store still holds under a read lease.
pub fn block_key(config_fingerprint: &str, block_hash: u32, serial: u64) -> String {
    format!("kvprobe/{config_fingerprint}/{block_hash:08x}/{serial:x}")
}
