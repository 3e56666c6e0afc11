//! Mooncake Store for `--tier mooncake` (in progress): finding the installation, and the
//! `mooncake_master` process kvprobe starts, health-checks and always stops.
//!
//! The install step (scripts/install-mooncake.sh, run by scripts/install-deps.sh) puts the
//! wheel `mooncake-transfer-engine-cuda13` (CUDA 13 hosts) or `-non-cuda` into a virtual
//! environment at `$KVPROBE_HOME/mooncake/venv`; `$KVPROBE_MOONCAKE_VENV` names another.
//! Mooncake exports no C API, so the store client will be a worker on its Python API.

use crate::error::{Error, Result};
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Environment variable naming a Mooncake virtual environment (overrides the install dir).
pub const VENV_ENV: &str = "KVPROBE_MOONCAKE_VENV";

/// How to install Mooncake, for error messages.
pub const INSTALL_HINT: &str = "install it with `scripts/install-mooncake.sh` (run by scripts/install-deps.sh)";

/// A Mooncake installation.
#[derive(Clone, Debug, serde::Serialize)]
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
        None => crate::nixl::kvprobe_home().join("mooncake/venv"),
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

/// A free TCP port on the loopback interface (bound once, then released for the child).
fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| Error::Environment(format!("no free port on 127.0.0.1: {e}")))?;
    Ok(l.local_addr().map_err(|e| Error::Environment(e.to_string()))?.port())
}

/// A `mooncake_master` kvprobe started on loopback, with its HTTP metadata server. Stopped
/// (killed and reaped) when dropped, on every path out of a run, Ctrl-C included.
pub struct Master {
    child: Child,
    /// RPC address, `127.0.0.1:PORT`.
    pub rpc: SocketAddr,
    /// HTTP metadata server URL, `http://127.0.0.1:PORT/metadata`.
    pub metadata_url: String,
    log: tempfile::NamedTempFile,
}

impl Master {
    /// Starts the master of `install` on free loopback ports and waits until its RPC and
    /// HTTP metadata ports accept connections (up to `timeout`).
    ///
    /// Errors: [`Error::Environment`] when it cannot be started, [`Error::Transport`] (with
    /// the tail of its log) when it exits or does not answer in time.
    pub fn start(install: &Install, timeout: Duration) -> Result<Master> {
        let (rpc_port, http_port, metrics_port) = (free_port()?, free_port()?, free_port()?);
        let log = tempfile::Builder::new()
            .prefix("kvprobe-mooncake-master.")
            .suffix(".log")
            .tempfile()
            .map_err(|e| Error::Environment(format!("master log file: {e}")))?;
        let out = log.reopen().map_err(|e| Error::Environment(e.to_string()))?;
        let err = log.reopen().map_err(|e| Error::Environment(e.to_string()))?;
        let child = Command::new(&install.master)
            .arg(format!("--rpc_port={rpc_port}"))
            .arg("--rpc_address=127.0.0.1")
            .arg("--enable_http_metadata_server=true")
            .arg("--http_metadata_server_host=127.0.0.1")
            .arg(format!("--http_metadata_server_port={http_port}"))
            .arg(format!("--metrics_port={metrics_port}"))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            // Its own process group: a terminal's Ctrl-C reaches kvprobe, which stops it.
            .process_group(0)
            .spawn()
            .map_err(|e| Error::Environment(format!("cannot start {}: {e}", install.master.display())))?;
        let rpc: SocketAddr = ([127, 0, 0, 1], rpc_port).into();
        let mut m = Master { child, rpc, metadata_url: format!("http://127.0.0.1:{http_port}/metadata"), log };
        let http: SocketAddr = ([127, 0, 0, 1], http_port).into();
        let t0 = Instant::now();
        loop {
            m.alive()?;
            let up = |a: &SocketAddr| TcpStream::connect_timeout(a, Duration::from_millis(100)).is_ok();
            if up(&m.rpc) && up(&http) {
                return Ok(m);
            }
            if t0.elapsed() > timeout {
                return Err(Error::Transport(format!(
                    "mooncake_master did not answer on {} and {} within {:.1} s; its log ends:\n{}",
                    m.rpc,
                    http,
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

    /// Path of the master's log.
    pub fn log_path(&self) -> &Path {
        self.log.path()
    }

    /// The last `n` lines of the master's log.
    pub fn log_tail(&self, n: usize) -> String {
        let mut s = String::new();
        if let Ok(mut f) = self.log.reopen() {
            let _ = f.read_to_string(&mut s);
        }
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
