//! The environment capture of a bundle (`--bundle`, `kvprobe bundle`): what the machine was when the run ran,
//! one plain-text file per source, written into a directory, plus `capture.json`.
//!
//! | file | source |
//! |---|---|
//! | `nvidia-smi-q.txt` | `nvidia-smi -q` (stdout as printed) |
//! | `nvidia-smi-topo.txt` | `nvidia-smi topo -m` |
//! | `uname.txt` | `uname -a` |
//! | `ucx-info-v.txt` | `ucx_info -v` (UCX's own tool; the NIXL wheel bundles UCX without it, so often missing: `versions.txt` then names the UCX libraries) |
//! | `env-vars.txt` | every `UCX_*` / `NIXL_*` variable of this process, `NAME=value`, sorted |
//! | `ucx-protocols.txt` | the run's UCX log (protocol tables, UCX's messages): the file given, verbatim, else this process's own log ([`crate::xfer::ucx::log_text`]) |
//! | `infiniband.txt` | `/sys/class/infiniband/*/ports/*/{state,phys_state,rate,link_layer}` |
//! | `ibv_devinfo.txt` | `ibv_devinfo` |
//! | `gpudirect.txt` | `/proc/modules` (nvidia_peermem, nv_peer_mem, nvidia, ib_core), kernel release, `/sys/module/nvidia/parameters/*` |
//! | `pcie.txt` | `/sys/bus/pci/devices/*/{class,vendor,device,numa_node}` of GPUs and NICs, then `lspci -tv` |
//! | `kernel-gpu.txt` | lines of the kernel log with `NVRM` or `Xid`: `dmesg`, else `/dev/kmsg` |
//! | `versions.txt` | [`crate::env::envinfo`]'s driver, CUDA, NVRTC, NIXL library and plugins, and the UCX libraries |
//! | `capture.json` | schema `kvprobe.capture/1`: per file, its source, status, reason, seconds |
//!
//! A missing tool or an unreadable file is a status in `capture.json` (`missing`,
//! `unreadable`, `timed-out`, `failed`, with the reason), never an error: every file of the
//! table is written (empty when its source gave nothing). Every command runs with a bound
//! ([`DEFAULT_BOUND`], `KVPROBE_CAPTURE_TIMEOUT` seconds overrides it), is killed when it
//! exceeds it, and dies with kvprobe ([`crate::sys::child`]); the commands run side by side, so a
//! capture takes about one bound at worst.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `capture.json`'s schema name.
pub const SCHEMA: &str = "kvprobe.capture/1";

/// The bound of each external command when `KVPROBE_CAPTURE_TIMEOUT` is unset: 10 s.
pub const DEFAULT_BOUND: Duration = Duration::from_secs(10);

/// Environment variable overriding [`DEFAULT_BOUND`]: seconds (decimal, > 0; e.g. `0.5`).
/// Tests use it to time out a fake tool quickly; an invalid value is ignored.
pub const BOUND_ENV: &str = "KVPROBE_CAPTURE_TIMEOUT";

/// After a command's bound, how long kvprobe waits for it to exit once killed (a process in
/// uninterruptible sleep, e.g. `nvidia-smi` on a GPU that fell off the bus, ignores SIGKILL:
/// it is then left behind, and the reason says so).
const KILL_GRACE: Duration = Duration::from_secs(2);

/// At most this many bytes of a command's stderr go into a reason.
const REASON_MAX: usize = 400;

/// What became of one source.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Status {
    /// Read or ran, and its output is in the file.
    Ok,
    /// The tool is not on `PATH`, or the file or directory does not exist.
    Missing,
    /// It exists but could not be read or run (permissions, e.g. `dmesg` as a plain user).
    Unreadable,
    /// The command did not finish within the bound and was killed (what it printed so far is in the file).
    TimedOut,
    /// The command exited non-zero or by a signal (its stdout is in the file).
    Failed,
}

/// One entry of `capture.json`: one file and where it came from.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Source {
    /// The file's name in the capture directory, e.g. `nvidia-smi-q.txt`.
    pub file: String,
    /// The command run (`nvidia-smi -q`) or the path(s) read.
    pub source: String,
    /// What became of it.
    pub status: Status,
    /// Why, when the status is not `ok` (or what was found when a status alone says too little).
    pub reason: Option<String>,
    /// Wall time spent on it, in seconds.
    pub seconds: f64,
    /// Secondary sources folded into the same file (e.g. `pcie.txt`'s `lspci -tv`), each
    /// `"<source>: <status>[: reason]"`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<String>,
}

/// `capture.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// [`SCHEMA`].
    pub schema: String,
    /// kvprobe's version.
    pub kvprobe_version: String,
    /// The bound of each command, in seconds.
    pub command_bound_seconds: f64,
    /// One entry per file, in the order of the module's table.
    pub sources: Vec<Source>,
}

/// Writes the capture into directory `out` (created with its parents when missing) and
/// returns the paths of the files written, **relative to `out`** (bare file names, the
/// module's table, `capture.json` last). `ucx_log`: the run's UCX log (a file kvprobe's UCX
/// wrote with `UCX_PROTO_INFO=y`), copied verbatim into `ucx-protocols.txt`; `None`: this
/// process's own UCX log when kvprobe's capture is on ([`crate::xfer::ucx`]), else that file is
/// recorded `missing`.
///
/// Errors: only [`Error::Io`], when `out` cannot be created or a file in it written. Every
/// source that is absent, unreadable, slow or failing is a status in `capture.json`.
pub fn capture(out: &Path, ucx_log: Option<&Path>) -> Result<Vec<PathBuf>> {
    let bound = bound();
    std::fs::create_dir_all(out).map_err(|e| io_err(out, e))?;
    let t0 = Instant::now();
    // The commands, side by side; the file sources meanwhile on this thread.
    let cmds: [(&str, &[&str]); 7] = [
        ("nvidia-smi", &["-q"]),
        ("nvidia-smi", &["topo", "-m"]),
        ("uname", &["-a"]),
        ("ucx_info", &["-v"]),
        ("ibv_devinfo", &[]),
        ("lspci", &["-tv"]),
        ("dmesg", &[]),
    ];
    let (ran, files) = std::thread::scope(|s| {
        let handles: Vec<_> = cmds.iter().map(|(p, a)| s.spawn(move || run_bounded(p, a, bound))).collect();
        let files = FileSources {
            env: env_vars(),
            ucx: ucx_protocols(ucx_log),
            ib: infiniband(),
            gd: gpudirect(),
            pci: pci_sysfs(),
            versions: versions(),
        };
        let ran: Vec<Ran> = handles
            .into_iter()
            .zip(cmds.iter())
            .map(|(h, (p, a))| {
                h.join().unwrap_or_else(|_| Ran::failed(&command_line(p, a), "the capture thread panicked".into()))
            })
            .collect();
        (ran, files)
    });
    let [smi_q, smi_topo, uname, ucx_info, ibv, lspci, dmesg]: [Ran; 7] =
        ran.try_into().unwrap_or_else(|_| unreachable!("seven commands"));
    let mut sources = Vec::new();
    let mut written = Vec::new();
    let mut put = |file: &str, text: &[u8], src: Source| -> Result<()> {
        let p = out.join(file);
        std::fs::write(&p, text).map_err(|e| io_err(&p, e))?;
        written.push(PathBuf::from(file));
        sources.push(src);
        Ok(())
    };
    for (file, r) in [("nvidia-smi-q.txt", &smi_q), ("nvidia-smi-topo.txt", &smi_topo), ("uname.txt", &uname)] {
        put(file, &r.stdout, r.source(file))?;
    }
    if ucx_info.status == Status::Ok {
        put("ucx-info-v.txt", &ucx_info.stdout, ucx_info.source("ucx-info-v.txt"))?;
    } else {
        let mut s = ucx_info.source("ucx-info-v.txt");
        s.reason = Some(format!("{}; versions.txt names the UCX libraries found", s.reason.unwrap_or_default()));
        put("ucx-info-v.txt", &ucx_info.stdout, s)?;
    }
    let FileSources { env, ucx, ib, gd, pci, versions } = files;
    for (file, (text, src)) in [("env-vars.txt", env), ("ucx-protocols.txt", ucx), ("infiniband.txt", ib)] {
        put(file, text.as_bytes(), src.named(file))?;
    }
    put("ibv_devinfo.txt", &ibv.stdout, ibv.source("ibv_devinfo.txt"))?;
    let (text, src) = gd;
    put("gpudirect.txt", text.as_bytes(), src.named("gpudirect.txt"))?;
    // pcie.txt: sysfs first, then lspci -tv.
    let (mut text, mut src) = pci;
    text += &format!("\n# {}\n", lspci.cmd);
    text += &String::from_utf8_lossy(&lspci.stdout);
    src.parts.push(lspci.part());
    src.source += &format!(", {}", lspci.cmd);
    text += &format!("\n# {}: in nvidia-smi-topo.txt ({})\n", smi_topo.cmd, smi_topo.part());
    put("pcie.txt", text.as_bytes(), src.named("pcie.txt"))?;
    let (text, src) = kernel_gpu(&dmesg);
    put("kernel-gpu.txt", text.as_bytes(), src.named("kernel-gpu.txt"))?;
    let (text, src) = versions;
    put("versions.txt", text.as_bytes(), src.named("versions.txt"))?;
    let manifest = Manifest {
        schema: SCHEMA.into(),
        kvprobe_version: env!("CARGO_PKG_VERSION").into(),
        command_bound_seconds: bound.as_secs_f64(),
        sources,
    };
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| Error::Io(format!("capture.json: {e}")))?;
    let p = out.join("capture.json");
    std::fs::write(&p, json).map_err(|e| io_err(&p, e))?;
    written.push(PathBuf::from("capture.json"));
    crate::sys::trace::trace!("environment capture: {} files in {:.1} s", written.len(), t0.elapsed().as_secs_f64());
    Ok(written)
}

struct FileSources {
    env: (String, Source),
    ucx: (String, Source),
    ib: (String, Source),
    gd: (String, Source),
    pci: (String, Source),
    versions: (String, Source),
}

fn io_err(p: &Path, e: std::io::Error) -> Error {
    Error::Io(format!("environment capture: cannot write {}: {e}", p.display()))
}

/// The bound of each command: [`BOUND_ENV`] when valid, else [`DEFAULT_BOUND`].
pub fn bound() -> Duration {
    std::env::var(BOUND_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0 && *s < 86_400.0)
        .map(Duration::from_secs_f64)
        .unwrap_or(DEFAULT_BOUND)
}

fn source(src: impl Into<String>, status: Status, reason: Option<String>, t0: Instant) -> Source {
    Source { file: String::new(), source: src.into(), status, reason, seconds: t0.elapsed().as_secs_f64(), parts: Vec::new() }
}

impl Source {
    fn named(mut self, file: &str) -> Source {
        self.file = file.into();
        self
    }
}

/// The outcome of one bounded command.
struct Ran {
    cmd: String,
    status: Status,
    reason: Option<String>,
    stdout: Vec<u8>,
    seconds: f64,
}

impl Ran {
    fn failed(cmd: &str, reason: String) -> Ran {
        Ran { cmd: cmd.into(), status: Status::Failed, reason: Some(reason), stdout: Vec::new(), seconds: 0.0 }
    }

    fn source(&self, file: &str) -> Source {
        Source {
            file: file.into(),
            source: self.cmd.clone(),
            status: self.status,
            reason: self.reason.clone(),
            seconds: self.seconds,
            parts: Vec::new(),
        }
    }

    fn part(&self) -> String {
        let st = serde_json::to_value(self.status).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
        match &self.reason {
            Some(r) => format!("{}: {st}: {r}", self.cmd),
            None => format!("{}: {st}", self.cmd),
        }
    }
}

fn command_line(prog: &str, args: &[&str]) -> String {
    std::iter::once(prog).chain(args.iter().copied()).collect::<Vec<_>>().join(" ")
}

/// Starts `cmd` through kvprobe's spawner thread ([`crate::sys::child::spawn`]: it dies with kvprobe). Its
/// stdout and stderr are anonymous files opened close-on-exec, stdin is /dev/null.
fn spawn(cmd: Command) -> std::io::Result<std::process::Child> {
    crate::sys::child::spawn(cmd)
}

/// Runs `prog args` (found on `PATH`) with `LC_ALL=C`, killed after `bound`.
fn run_bounded(prog: &str, args: &[&str], bound: Duration) -> Ran {
    let cmd_line = command_line(prog, args);
    let t0 = Instant::now();
    let done = |status, reason: Option<String>, stdout: Vec<u8>| Ran {
        cmd: cmd_line.clone(),
        status,
        reason,
        stdout,
        seconds: t0.elapsed().as_secs_f64(),
    };
    // Output goes to anonymous files, not pipes: a grandchild the tool leaves behind cannot
    // hold kvprobe up by keeping a pipe open.
    let files = (|| -> std::io::Result<_> {
        let o = tempfile::tempfile()?;
        let e = tempfile::tempfile()?;
        Ok((o.try_clone()?, o, e.try_clone()?, e))
    })();
    let (o_child, mut o, e_child, mut e) = match files {
        Ok(f) => f,
        Err(err) => return done(Status::Failed, Some(format!("no temporary file for its output: {err}")), Vec::new()),
    };
    let mut cmd = Command::new(prog);
    cmd.args(args).env("LC_ALL", "C").stdin(Stdio::null()).stdout(Stdio::from(o_child)).stderr(Stdio::from(e_child));
    // Its own process group, so that a timeout kills what it started too (a wrapper
    // script's children would otherwise outlive it).
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = match spawn(cmd) {
        Ok(c) => c,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            return done(Status::Missing, Some(format!("{prog} not found on PATH")), Vec::new());
        }
        Err(err) if err.kind() == std::io::ErrorKind::PermissionDenied => {
            return done(Status::Unreadable, Some(format!("{prog} cannot be run: {err}")), Vec::new());
        }
        Err(err) => return done(Status::Failed, Some(format!("{prog} cannot be started: {err}")), Vec::new()),
    };
    let outcome: std::result::Result<std::process::ExitStatus, String> = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Ok(st),
            Ok(None) => {}
            Err(err) => break Err(format!("waiting for it failed: {err}")),
        }
        let interrupted = crate::sys::interrupt::requested();
        if t0.elapsed() >= bound || interrupted {
            kill_group(child.id());
            let _ = child.kill();
            let t1 = Instant::now();
            let mut exited = false;
            while t1.elapsed() < KILL_GRACE {
                if let Ok(Some(_)) = child.try_wait() {
                    exited = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let why = if interrupted {
                "interrupted by a signal; killed".to_string()
            } else {
                format!("no answer within {:.1} s; killed", bound.as_secs_f64())
            };
            let why = if exited { why } else { format!("{why}, and it did not exit (uninterruptible sleep?): left behind") };
            let stdout = read_all(&mut o);
            let status = if interrupted { Status::Failed } else { Status::TimedOut };
            return done(status, Some(why), stdout);
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let stdout = read_all(&mut o);
    let stderr = read_all(&mut e);
    let err_text = tail_text(&stderr);
    match outcome {
        Ok(st) if st.success() => done(Status::Ok, None, stdout),
        Ok(st) => {
            let how = match st.code() {
                Some(c) => format!("exit {c}"),
                None => format!("killed by signal {}", std::os::unix::process::ExitStatusExt::signal(&st).unwrap_or(0)),
            };
            let reason = if err_text.is_empty() { how } else { format!("{how}: {err_text}") };
            done(Status::Failed, Some(reason), stdout)
        }
        Err(why) => done(Status::Failed, Some(why), stdout),
    }
}

/// Sends SIGKILL to process group `pgid` (a timed-out command and whatever it started)
/// with `kill(1)`, itself bounded; best effort (the command itself is killed directly too).
fn kill_group(pgid: u32) {
    for k in ["kill", "/bin/kill", "/usr/bin/kill"] {
        let mut cmd = Command::new(k);
        cmd.args(["-KILL", "--", &format!("-{pgid}")]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        if let Ok(mut c) = spawn(cmd) {
            let t0 = Instant::now();
            while t0.elapsed() < KILL_GRACE {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.try_wait();
            return;
        }
    }
}

fn read_all(f: &mut std::fs::File) -> Vec<u8> {
    let mut v = Vec::new();
    if f.seek(SeekFrom::Start(0)).is_ok() {
        let _ = f.read_to_end(&mut v);
    }
    v
}

/// The last [`REASON_MAX`] bytes of `b` as one trimmed line.
fn tail_text(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(b);
    let s = s.trim();
    let mut start = s.len().saturating_sub(REASON_MAX);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    s[start..].split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Every `UCX_*` / `NIXL_*` variable of this process, `NAME=value` lines sorted by name.
fn env_vars() -> (String, Source) {
    let t0 = Instant::now();
    let mut vars: Vec<(String, String)> = std::env::vars_os()
        .map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned()))
        .filter(|(k, _)| k.starts_with("UCX_") || k.starts_with("NIXL_"))
        .collect();
    vars.sort();
    let text: String = vars.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
    let reason = vars.is_empty().then(|| "no UCX_* or NIXL_* variable is set".to_string());
    (text, source("the environment of kvprobe's process (UCX_*, NIXL_*)", Status::Ok, reason, t0))
}

/// The run's UCX log, verbatim.
fn ucx_protocols(ucx_log: Option<&Path>) -> (String, Source) {
    let t0 = Instant::now();
    match ucx_log {
        Some(p) => match std::fs::read(p) {
            // Verbatim: the bytes as UCX wrote them (lossless for the UTF-8/ASCII UCX prints).
            Ok(b) => (String::from_utf8_lossy(&b).into_owned(), source(p.display().to_string(), Status::Ok, None, t0)),
            Err(e) => {
                let st = if e.kind() == std::io::ErrorKind::NotFound { Status::Missing } else { Status::Unreadable };
                (String::new(), source(p.display().to_string(), st, Some(e.to_string()), t0))
            }
        },
        None => match crate::xfer::ucx::log_text() {
            Some(t) => (t, source("kvprobe's own UCX log (UCX_PROTO_INFO=y, UCX_LOG_FILE)", Status::Ok, None, t0)),
            None => (
                String::new(),
                source(
                    "kvprobe's own UCX log",
                    Status::Missing,
                    Some(
                        "no UCX log given, and this process has none (no NIXL agent yet, or the capture is off: \
                         UCX_PROTO_INFO / UCX_LOG_FILE set by the user, or KVPROBE_UCX_DIAG=0)"
                            .into(),
                    ),
                    t0,
                ),
            ),
        },
    }
}

/// Sorted entries of a directory (names), or the error.
fn list_dir(p: &Path) -> std::io::Result<Vec<String>> {
    let mut v: Vec<String> = std::fs::read_dir(p)?.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    Ok(v)
}

fn read_trim(p: &Path) -> std::result::Result<String, String> {
    std::fs::read_to_string(p).map(|s| s.trim().to_string()).map_err(|e| e.to_string())
}

fn dir_status(e: &std::io::Error) -> Status {
    if e.kind() == std::io::ErrorKind::NotFound { Status::Missing } else { Status::Unreadable }
}

/// `/sys/class/infiniband/DEV/ports/N/{state,phys_state,rate,link_layer}`.
fn infiniband() -> (String, Source) {
    infiniband_at(Path::new("/sys/class/infiniband"))
}

fn infiniband_at(root: &Path) -> (String, Source) {
    let t0 = Instant::now();
    let devs = match list_dir(root) {
        Ok(d) => d,
        Err(e) => {
            let why = if e.kind() == std::io::ErrorKind::NotFound {
                format!("{} does not exist: no RDMA device, or its driver is not loaded", root.display())
            } else {
                e.to_string()
            };
            return (String::new(), source(root.display().to_string(), dir_status(&e), Some(why), t0));
        }
    };
    let mut s = String::new();
    for d in &devs {
        let _ = writeln!(s, "device {d}");
        for f in ["node_type", "node_guid", "fw_ver", "hca_type", "board_id"] {
            if let Ok(v) = read_trim(&root.join(d).join(f)) {
                let _ = writeln!(s, "  {f}: {v}");
            }
        }
        let ports = root.join(d).join("ports");
        match list_dir(&ports) {
            Ok(ps) => {
                for p in ps {
                    for f in ["state", "phys_state", "rate", "link_layer"] {
                        let v = read_trim(&ports.join(&p).join(f)).unwrap_or_else(|e| format!("unreadable ({e})"));
                        let _ = writeln!(s, "  port {p} {f}: {v}");
                    }
                }
            }
            Err(e) => {
                let _ = writeln!(s, "  ports: unreadable ({e})");
            }
        }
    }
    let reason = devs.is_empty().then(|| format!("{} is empty: no RDMA device", root.display()));
    (s, source(format!("{}/*/ports/*/{{state,phys_state,rate,link_layer}}", root.display()), Status::Ok, reason, t0))
}

/// Whether GPUDirect RDMA can work: peer-memory modules, kernel release (dma-buf needs Linux
/// ≥ 5.12 and the open kernel module), the nvidia module's parameters.
fn gpudirect() -> (String, Source) {
    let t0 = Instant::now();
    let mut s = String::new();
    let modules = std::fs::read_to_string("/proc/modules");
    let (status, reason) = match &modules {
        Ok(m) => {
            let loaded = |name: &str| m.lines().any(|l| l.split_whitespace().next() == Some(name));
            let _ = writeln!(s, "# /proc/modules");
            for name in ["nvidia_peermem", "nv_peer_mem", "nvidia", "nvidia_uvm", "ib_core", "ib_uverbs", "mlx5_core"] {
                let _ = writeln!(s, "{name}: {}", if loaded(name) { "loaded" } else { "not loaded" });
            }
            let peer = loaded("nvidia_peermem") || loaded("nv_peer_mem");
            let _ = writeln!(
                s,
                "peer-memory module (GPUDirect RDMA through ib_core): {}",
                if peer { "yes" } else { "no (GPUDirect RDMA needs nvidia_peermem or dma-buf)" }
            );
            (Status::Ok, None)
        }
        Err(e) => {
            let _ = writeln!(s, "# /proc/modules: unreadable ({e})");
            (dir_status(e), Some(format!("/proc/modules: {e}")))
        }
    };
    let _ = writeln!(s, "\n# kernel");
    let rel = read_trim(Path::new("/proc/sys/kernel/osrelease"));
    let _ = writeln!(s, "release: {}", rel.clone().unwrap_or_else(|e| format!("unreadable ({e})")));
    if let Ok(r) = &rel {
        let mut it = r.split(|c: char| !c.is_ascii_digit()).filter_map(|x| x.parse::<u32>().ok());
        if let (Some(a), Some(b)) = (it.next(), it.next()) {
            let ok = (a, b) >= (5, 12);
            let _ = writeln!(s, "dma-buf for RDMA (Linux >= 5.12): {}", if ok { "kernel new enough" } else { "kernel too old" });
        }
    }
    match read_trim(Path::new("/proc/driver/nvidia/version")) {
        Ok(v) => {
            let open = v.contains("Open Kernel Module");
            let _ = writeln!(s, "\n# /proc/driver/nvidia/version\n{v}");
            let _ = writeln!(
                s,
                "open kernel module (needed for dma-buf GPUDirect RDMA): {}",
                if open { "yes" } else { "no (proprietary module: nvidia_peermem only)" }
            );
        }
        Err(e) => {
            let _ = writeln!(s, "\n# /proc/driver/nvidia/version: {e}");
        }
    }
    let params = Path::new("/sys/module/nvidia/parameters");
    let _ = writeln!(s, "\n# {}", params.display());
    match list_dir(params) {
        Ok(names) => {
            for n in names {
                let v = read_trim(&params.join(&n)).unwrap_or_else(|e| format!("unreadable ({e})"));
                let _ = writeln!(s, "{n}: {v}");
            }
        }
        Err(e) => {
            let _ = writeln!(s, "unreadable ({e})");
        }
    }
    let src = "/proc/modules, /proc/sys/kernel/osrelease, /proc/driver/nvidia/version, /sys/module/nvidia/parameters";
    (s, source(src, status, reason, t0))
}

/// GPUs (display/3D controllers of vendor 0x10de) and NICs (network controllers, class 0x02)
/// from `/sys/bus/pci/devices`: address, class, vendor, device, NUMA node, driver.
fn pci_sysfs() -> (String, Source) {
    let t0 = Instant::now();
    let root = Path::new("/sys/bus/pci/devices");
    let addrs = match list_dir(root) {
        Ok(a) => a,
        Err(e) => {
            let st = dir_status(&e);
            return (format!("# {}: {e}\n", root.display()), source(root.display().to_string(), st, Some(e.to_string()), t0));
        }
    };
    let mut s = format!("# {}: GPUs (NVIDIA display/3D controllers) and NICs (class 0x02xxxx)\n", root.display());
    s += "# address class vendor device numa_node driver kind\n";
    let mut n = 0;
    for a in addrs {
        let d = root.join(&a);
        let class = read_trim(&d.join("class")).unwrap_or_default();
        let vendor = read_trim(&d.join("vendor")).unwrap_or_default();
        let kind = if class.starts_with("0x02") {
            "nic"
        } else if vendor == "0x10de" && (class.starts_with("0x0300") || class.starts_with("0x0302")) {
            "gpu"
        } else {
            continue;
        };
        let device = read_trim(&d.join("device")).unwrap_or_default();
        let numa = read_trim(&d.join("numa_node")).unwrap_or_else(|_| "?".into());
        let driver = std::fs::read_link(d.join("driver"))
            .ok()
            .and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "-".into());
        let _ = writeln!(s, "{a} {class} {vendor} {device} {numa} {driver} {kind}");
        n += 1;
    }
    let reason = (n == 0).then(|| "no GPU or NIC among the PCI devices".to_string());
    (s, source(format!("{}/*/{{class,vendor,device,numa_node}}", root.display()), Status::Ok, reason, t0))
}

/// True for a kernel log line about the GPU: NVIDIA's driver (`NVRM`) or an Xid error.
fn is_gpu_line(l: &str) -> bool {
    l.contains("NVRM") || l.contains("Xid")
}

/// `kernel-gpu.txt`: the NVRM / Xid lines of `dmesg`, else of `/dev/kmsg` (read without
/// blocking), else unreadable with both reasons.
fn kernel_gpu(dmesg: &Ran) -> (String, Source) {
    let t0 = Instant::now();
    if dmesg.status == Status::Ok {
        let text = String::from_utf8_lossy(&dmesg.stdout);
        let total = text.lines().count();
        let lines: String = text.lines().filter(|l| is_gpu_line(l)).map(|l| format!("{l}\n")).collect();
        let mut src = dmesg.source("kernel-gpu.txt");
        src.reason = Some(format!("{} NVRM/Xid line(s) among {total} kernel log line(s)", lines.lines().count()));
        return (lines, src);
    }
    match read_kmsg() {
        Ok(records) => {
            let total = records.len();
            let lines: String = records.iter().filter(|l| is_gpu_line(l)).map(|l| format!("{l}\n")).collect();
            let mut src = source("/dev/kmsg", Status::Ok, None, t0);
            src.reason = Some(format!("{} NVRM/Xid line(s) among {total} kernel log record(s)", lines.lines().count()));
            src.parts.push(dmesg.part());
            (lines, src)
        }
        Err(e) => {
            let mut src = source(format!("{}, /dev/kmsg", dmesg.cmd), Status::Unreadable, None, t0);
            src.reason = Some(format!("{}; /dev/kmsg: {e}", dmesg.part()));
            if dmesg.status == Status::TimedOut {
                src.status = Status::TimedOut;
            }
            (String::new(), src)
        }
    }
}

/// The kernel log records in /dev/kmsg (`pri,seq,usec,flags;message`), as `[seconds] message`.
fn read_kmsg() -> std::io::Result<Vec<String>> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open("/dev/kmsg")?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let rec = String::from_utf8_lossy(&buf[..n]);
                let (head, msg) = rec.split_once(';').unwrap_or(("", &rec));
                let usec = head.split(',').nth(2).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0);
                let msg = msg.lines().next().unwrap_or("");
                out.push(format!("[{:>5}.{:06}] {msg}", usec / 1_000_000, usec % 1_000_000));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            // A record overwritten while reading: skip on.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// `versions.txt`: [`crate::env::envinfo`]'s view (driver, CUDA, NVRTC, NIXL library and plugins,
/// Mooncake), and the UCX libraries: those mapped into this process, and those beside the
/// NIXL library found. NIXL is not loaded here: when this process loaded it, its agent lists
/// the plugins ([`crate::env::envinfo::nixl_info`]); otherwise the plugin files are listed.
fn versions() -> (String, Source) {
    let t0 = Instant::now();
    let nixl = match crate::xfer::nixl::loaded() {
        Some(_) => crate::env::envinfo::nixl_info(),
        None => nixl_unloaded(),
    };
    let env = crate::env::envinfo::gather(nixl);
    let mut s = crate::env::envinfo::render(&env);
    if let Err(e) = crate::gpu::cuda::try_device_count() {
        let _ = writeln!(s, "CUDA device count: {e}");
    }
    let _ = writeln!(s, "\n# UCX libraries mapped into kvprobe's process (/proc/self/maps)");
    let mapped = mapped_ucx();
    if mapped.is_empty() {
        let _ = writeln!(s, "none (NIXL's UCX backend not started in this process)");
    }
    for m in mapped {
        let _ = writeln!(s, "{m}");
    }
    if let Some(lib) = env.nixl.library.as_ref().or(crate::xfer::nixl::find().map(|(d, _)| d.join("libnixl_capi.so")).as_ref()) {
        let _ = writeln!(s, "\n# UCX libraries installed with NIXL");
        for l in ucx_beside(lib) {
            let _ = writeln!(s, "{}", l.display());
        }
    }
    (s, source("kvprobe's environment (envinfo), /proc/self/maps", Status::Ok, None, t0))
}

fn nixl_unloaded() -> crate::env::envinfo::NixlInfo {
    match crate::xfer::nixl::find() {
        Some((dir, via)) => {
            let plugin_dir = std::env::var_os("NIXL_PLUGIN_DIR")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
                .unwrap_or_else(|| dir.join("plugins"));
            let plugins = list_dir(&plugin_dir)
                .unwrap_or_default()
                .into_iter()
                .filter_map(|f| f.strip_prefix("libplugin_").and_then(|r| r.strip_suffix(".so")).map(str::to_string))
                .collect();
            crate::env::envinfo::NixlInfo {
                library: Some(dir.join("libnixl_capi.so")),
                found_via: Some(via.to_string()),
                plugin_dir: Some(plugin_dir),
                plugins,
                stub: None,
                error: Some("not loaded by this process: the plugins are the files in the plugin directory".into()),
                version: crate::xfer::nixl::installed_version(&dir),
                ucx_version: crate::xfer::nixl::loaded_ucx_version(),
            }
        }
        None => crate::env::envinfo::NixlInfo {
            library: None,
            found_via: None,
            plugin_dir: None,
            plugins: Vec::new(),
            stub: None,
            error: Some(format!("libnixl_capi.so not found; {}", crate::xfer::nixl::INSTALL_HINT)),
            version: None,
            ucx_version: None,
        },
    }
}

/// Paths of UCX's libraries (`libucp`, `libuct`, `libucs`, `libucm`) mapped into this process.
fn mapped_ucx() -> Vec<String> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return Vec::new() };
    let mut v: Vec<String> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|p| {
            let name = p.rsplit('/').next().unwrap_or("");
            ["libucp", "libuct", "libucs", "libucm"].iter().any(|x| name.starts_with(x))
        })
        .map(str::to_string)
        .collect();
    v.sort();
    v.dedup();
    v
}

/// UCX libraries installed with the NIXL library `lib`: in its directory and in a sibling
/// `*.libs` directory (as the PyPI wheel lays them out).
fn ucx_beside(lib: &Path) -> Vec<PathBuf> {
    let Some(dir) = lib.parent() else { return Vec::new() };
    let mut dirs = vec![dir.to_path_buf()];
    if let Some(up) = dir.parent()
        && let Ok(rd) = std::fs::read_dir(up)
    {
        dirs.extend(rd.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "libs")));
    }
    let mut v = Vec::new();
    for d in dirs {
        for f in list_dir(&d).unwrap_or_default() {
            if ["libucp", "libuct", "libucs", "libucm"].iter().any(|x| f.starts_with(x)) {
                v.push(d.join(f));
            }
        }
    }
    v.sort();
    v
}
