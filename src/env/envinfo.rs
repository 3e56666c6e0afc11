//! What the machine offers: GPUs, driver, CUDA, NVRTC, NIXL library and plugins, RDMA NICs
//! and their distance to the GPUs ([`crate::xfer::rdma`]).
//!
//! Printed by `kvprobe env` and embedded in every report's `environment`.

use crate::gpu::cuda::{self, GpuInfo};
use serde::Serialize;
use std::path::PathBuf;

/// NIXL as found on this machine.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct NixlInfo {
    /// Full path of the loaded libnixl_capi.so (absent when not found).
    pub library: Option<PathBuf>,
    /// How it was found ("KVPROBE_NIXL_DIR" or "install dir").
    pub found_via: Option<String>,
    /// Plugin directory.
    pub plugin_dir: Option<PathBuf>,
    /// Backend plugins NIXL can load.
    pub plugins: Vec<String>,
    /// Whether nixl-sys runs on its stub once the library is loaded (always false: kvprobe
    /// refuses to run on the stub); null when no library was loaded.
    pub stub: Option<bool>,
    /// Why NIXL is unusable, when it is.
    pub error: Option<String>,
    /// The NIXL wheel and version installed (`nixl-cu13 1.5.1`; [`crate::xfer::nixl::installed_version`]),
    /// when known.
    #[serde(default)]
    pub version: Option<String>,
    /// The version of the UCX library loaded with NIXL's UCX plugin
    /// ([`crate::xfer::nixl::loaded_ucx_version`]); null when UCX was not loaded in this process
    /// (e.g. `kvprobe env --no-probe` before any agent starts).
    #[serde(default)]
    pub ucx_version: Option<String>,
}

/// How one GPU reaches another.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct GpuLink {
    /// CUDA peer-to-peer attributes.
    #[serde(flatten)]
    pub p2p: cuda::PeerLink,
    /// The link as `nvidia-smi topo -m` names it (e.g. "NV18" = 18 NVLinks, "PIX", "SYS"),
    /// when nvidia-smi is available.
    pub topology: Option<String>,
}

/// The report's `environment` section.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct Environment {
    /// kvprobe version.
    pub kvprobe_version: String,
    /// Host name.
    pub hostname: String,
    /// GPUs visible to CUDA, with names and UUIDs.
    pub gpus: Vec<GpuInfo>,
    /// Links between each ordered pair of GPUs (empty with fewer than two).
    pub gpu_links: Vec<GpuLink>,
    /// NVIDIA kernel driver version (from /proc/driver/nvidia/version), when present.
    pub driver: Option<String>,
    /// CUDA driver API version, e.g. "13.0".
    pub cuda: Option<String>,
    /// NVRTC version, e.g. "13.0".
    pub nvrtc: Option<String>,
    /// NIXL library and plugins.
    pub nixl: NixlInfo,
    /// UCX_* and NIXL_* variables in effect (they steer transport selection).
    pub transport_env: std::collections::BTreeMap<String, String>,
    /// The names in `transport_env` whose values are kvprobe's defaults, set because the user
    /// had not set them ([`crate::xfer::nixl::set_process_env`]: e.g. `UCX_CUDA_IPC_ENABLE_GET_ZCOPY`,
    /// `UCX_DEBUG_SIGNO`); the others are the user's. Empty in reports written before it.
    #[serde(default)]
    pub transport_env_defaults: Vec<String>,
    /// Mooncake Store (`--tier mooncake`): the installation found, or why none is usable.
    pub mooncake: MooncakeInfo,
    /// `kvprobe env` only: the paths UCX selected for small probe transfers
    /// ([`probe_paths`]); empty in run reports (they carry their own `transport_path`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub transport_probes: Vec<PathProbe>,
    /// RDMA devices and ports, each GPU's PCIe distance to each device and its nearest one
    /// with the UCX settings that pin it, GPUDirect RDMA status ([`crate::xfer::rdma`]).
    #[serde(default)]
    pub rdma: crate::xfer::rdma::RdmaFacts,
}

/// One probe transfer of `kvprobe env`: a short sweep in a child `kvprobe run` (llama3-8b
/// geometry, 16 blocks = 32 MiB per side, 32 KiB slices, 2 iterations), so each probe gets
/// its own process, UCX configuration and defaults.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct PathProbe {
    /// What moved, e.g. "READ VRAM GPU 0 -> GPU 1".
    pub what: String,
    /// The child run's exit code (0 clean; see `kvprobe run --help`).
    pub exit_code: i32,
    /// The path its report names (backend, UCX protocol rows, emulation flag, warning).
    pub path: Option<crate::xfer::ucx::TransportPath>,
    /// Its transfer rate (GB/s = 1e9 B/s) — tiny transfers: an indication, not a measurement.
    pub transfer_gbps: Option<f64>,
    /// Why it failed, when it did.
    pub error: Option<String>,
}

/// Seconds a probe transfer may take before it is stopped.
const PROBE_SECS: u64 = 90;

/// Runs the probe transfers for `gpus` visible GPUs: DRAM READ; with a GPU, VRAM READ and
/// WRITE on GPU 0; with two, READ from GPU 0 to GPU 1 in one process and with prefill's agent
/// in a second process (`run --decode-process`). Each is `kvprobe run` in a child
/// process (killed after 90 s or when kvprobe dies); failures are recorded, not raised.
/// Each path is flagged against `rdma` ([`crate::xfer::ucx::flag_path`]; VRAM probes for the
/// prefill GPU).
pub fn probe_paths(gpus: usize, rdma: &crate::xfer::rdma::RdmaFacts) -> Vec<PathProbe> {
    let mut plan = vec![("dram", "read", 0, 0, false)];
    if gpus > 0 {
        plan.push(("vram", "read", 0, 0, false));
        plan.push(("vram", "write", 0, 0, false));
    }
    if gpus > 1 {
        plan.push(("vram", "read", 0, 1, false));
        plan.push(("vram", "read", 0, 1, true));
    }
    plan.into_iter()
        .map(|(mem, op, a, b, two)| {
            let mut what = if mem == "vram" {
                format!("{} VRAM GPU {a} -> GPU {b}", op.to_uppercase())
            } else {
                format!("{} DRAM -> DRAM", op.to_uppercase())
            };
            if two {
                what += ", prefill in a second process";
            }
            probe_one(mem, op, a, b, two)
                .unwrap_or_else(|e| PathProbe {
                    what: what.clone(),
                    exit_code: e.exit() as i32,
                    path: None,
                    transfer_gbps: None,
                    error: Some(e.to_string()),
                })
                .named(what)
                .flagged(rdma, (mem == "vram").then_some(a))
        })
        .collect()
}

/// The exit code of `kvprobe env` for its probe transfers: 0 when every one was clean (or
/// none ran), else as a run's: 1 when one found corruption (it wins, as in a run), else the
/// first failed probe's own code — 2 refused by the environment, 3 a transport or device
/// error, 4 a timeout, 130 interrupted; a code no run gives is read as 3.
pub fn probes_exit(probes: &[PathProbe]) -> crate::error::Exit {
    use crate::error::Exit;
    let of = |c: i32| match c {
        0 => Exit::Clean,
        1 => Exit::Corrupt,
        2 => Exit::Usage,
        4 => Exit::Timeout,
        130 => Exit::Interrupted,
        _ => Exit::Transport,
    };
    if probes.iter().any(|p| p.exit_code == 1) {
        return Exit::Corrupt;
    }
    probes.iter().map(|p| of(p.exit_code)).find(|x| *x != Exit::Clean).unwrap_or(Exit::Clean)
}

impl PathProbe {
    fn named(mut self, what: String) -> PathProbe {
        self.what = what;
        self
    }

    fn flagged(mut self, rdma: &crate::xfer::rdma::RdmaFacts, gpu: Option<usize>) -> PathProbe {
        if let Some(p) = self.path.as_mut() {
            crate::xfer::ucx::flag_path(p, rdma, gpu);
        }
        self
    }
}

fn probe_one(mem: &str, op: &str, a: usize, b: usize, two: bool) -> crate::error::Result<PathProbe> {
    use crate::error::Error;
    let exe = std::env::current_exe().map_err(|e| Error::Environment(format!("cannot find kvprobe's own executable: {e}")))?;
    let dir = tempfile::tempdir_in(crate::sys::tempdir::dir()?).map_err(|e| Error::Io(format!("temporary directory: {e}")))?;
    let report = dir.path().join("probe.json");
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["run", "--memory", mem, "--preset", "llama3-8b", "--blocks", "16", "--iterations", "2", "--op", op]);
    if mem == "vram" {
        cmd.args(["--prefill-device", &a.to_string(), "--decode-device", &b.to_string()]);
    }
    if two {
        cmd.arg("--decode-process");
    }
    cmd.arg("--report").arg(&report);
    cmd.stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped());
    // The probe run sets kvprobe's defaults itself, as its own: its path line and report then
    // tell them from the user's as `kvprobe env`'s own lines do.
    for k in crate::xfer::nixl::kvprobe_defaults() {
        cmd.env_remove(k);
    }
    let mut child = crate::sys::child::spawn(cmd).map_err(|e| Error::Environment(format!("cannot start a probe run: {e}")))?;
    let mut stderr = child.stderr.take();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(e) = stderr.as_mut() {
            let _ = std::io::Read::read_to_string(e, &mut s);
        }
        s
    });
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().map_err(|e| Error::Environment(format!("probe run: {e}")))? {
            break Some(st);
        }
        if t0.elapsed().as_secs() > PROBE_SECS || crate::sys::interrupt::requested() {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let err_text = reader.join().unwrap_or_default();
    let Some(status) = status else {
        return Err(if crate::sys::interrupt::requested() {
            Error::Interrupted("during the probe transfers".into())
        } else {
            Error::Timeout(format!("the probe run did not finish in {PROBE_SECS} s"))
        });
    };
    let code = status.code().unwrap_or(128 + std::os::unix::process::ExitStatusExt::signal(&status).unwrap_or(0));
    let last_line = || err_text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").to_string();
    let v: serde_json::Value = match std::fs::read(&report).ok().and_then(|b| serde_json::from_slice(&b).ok()) {
        Some(v) => v,
        None => {
            return Ok(PathProbe {
                what: String::new(),
                exit_code: code,
                path: None,
                transfer_gbps: None,
                error: Some(last_line()),
            });
        }
    };
    let s = &v["summary"];
    Ok(PathProbe {
        what: String::new(),
        exit_code: code,
        path: serde_json::from_value(s["transport_path"].clone()).ok(),
        transfer_gbps: s["transfer_gbps"].as_f64().filter(|_| code == 0),
        error: v["outcome"]["error"]["message"].as_str().map(str::to_string).or_else(|| {
            // Corruption is no error of the run's: say what it found.
            (code == 1).then(|| {
                let classes: Vec<String> = s["by_class"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .filter(|(_, n)| n.as_u64() > Some(0))
                    .map(|(k, n)| format!("{k} {n}"))
                    .collect();
                format!("corruption: {} corrupt block slices ({})", s["blocks_corrupt"], classes.join(", "))
            })
        }),
    })
}

/// Mooncake availability.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct MooncakeInfo {
    /// The installation, when found.
    pub install: Option<crate::mem::mooncake::Install>,
    /// Why it is not usable, otherwise.
    pub error: Option<String>,
}

fn kernel_driver() -> Option<String> {
    // e.g. "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build ..."
    let s = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    let line = s.lines().next()?;
    line.split_whitespace()
        .find(|t| {
            t.starts_with(|c: char| c.is_ascii_digit()) && t.contains('.') && t.chars().all(|c| c.is_ascii_digit() || c == '.')
        })
        .map(str::to_string)
}

/// `nvidia-smi topo -m`'s matrix as rows of cells, keyed by GPU ordinal.
fn topology_matrix() -> Option<Vec<Vec<String>>> {
    let mut cmd = std::process::Command::new("nvidia-smi");
    cmd.args(["topo", "-m"]);
    let out = crate::sys::child::output(cmd).ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // Rows look like "GPU0\t X \tNV18\t..." (ANSI colour codes stripped).
    let rows: Vec<Vec<String>> = text
        .lines()
        .map(|l| l.replace("\u{1b}[4m", "").replace("\u{1b}[0m", ""))
        .filter(|l| l.starts_with("GPU"))
        .map(|l| l.split_whitespace().skip(1).map(str::to_string).collect())
        .collect();
    Some(rows)
}

fn gpu_links(n: usize) -> Vec<GpuLink> {
    if n < 2 {
        return Vec::new();
    }
    let topo = topology_matrix();
    let mut v = Vec::new();
    for a in 0..n {
        for b in 0..n {
            if a == b {
                continue;
            }
            if let Ok(p2p) = cuda::peer_link(a, b) {
                let topology = topo.as_ref().and_then(|m| m.get(a)).and_then(|r| r.get(b)).cloned();
                v.push(GpuLink { p2p, topology });
            }
        }
    }
    v
}

/// Probes NIXL: loads the library (which also sets its default environment) and lists plugins.
pub fn nixl_info() -> NixlInfo {
    match crate::xfer::nixl::load() {
        Ok(lib) => {
            let (plugins, error) = match crate::xfer::nixl::available_plugins() {
                Ok(p) if p.is_empty() => (p, Some(format!("no NIXL backend plugin loads from {}", lib.plugin_dir.display()))),
                Ok(p) => (p, None),
                Err(e) => (Vec::new(), Some(e.to_string())),
            };
            let version = lib.library.parent().and_then(crate::xfer::nixl::installed_version);
            NixlInfo {
                library: Some(lib.library),
                found_via: Some(lib.found_via),
                plugin_dir: Some(lib.plugin_dir),
                plugins,
                stub: Some(lib.stub),
                error,
                version,
                ucx_version: crate::xfer::nixl::loaded_ucx_version(),
            }
        }
        Err(e) => NixlInfo {
            library: None,
            found_via: None,
            plugin_dir: None,
            plugins: Vec::new(),
            stub: None,
            error: Some(e.to_string()),
            version: None,
            ucx_version: None,
        },
    }
}

/// This host's name (`/proc/sys/kernel/hostname`), empty when unreadable.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// Gathers the environment. `nixl` is passed in so a caller that already probed it (or
/// must not load it) decides.
pub fn gather(nixl: NixlInfo) -> Environment {
    let n = cuda::device_count();
    let gpus: Vec<GpuInfo> = (0..n).filter_map(|i| cuda::gpu_info(i).ok()).collect();
    let rdma = crate::xfer::rdma::gather(&gpus);
    let transport_env: std::collections::BTreeMap<String, String> = std::env::vars_os()
        .map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned()))
        .filter(|(k, _)| k.starts_with("UCX_") || k.starts_with("NIXL_"))
        .collect();
    Environment {
        kvprobe_version: env!("CARGO_PKG_VERSION").to_string(),
        hostname: hostname(),
        gpus,
        gpu_links: gpu_links(n),
        driver: kernel_driver(),
        cuda: if n > 0 { cuda::driver_version().ok() } else { None },
        nvrtc: cuda::nvrtc_version(),
        nixl,
        transport_env_defaults: crate::xfer::nixl::kvprobe_defaults()
            .iter()
            .filter(|k| transport_env.contains_key(*k))
            .cloned()
            .collect(),
        transport_env,
        mooncake: match crate::mem::mooncake::find() {
            Ok(i) => MooncakeInfo { install: Some(i), error: None },
            Err(e) => MooncakeInfo { install: None, error: Some(e.to_string()) },
        },
        transport_probes: Vec::new(),
        rdma,
    }
}

/// Human-readable rendering for `kvprobe env`.
pub fn render(e: &Environment) -> String {
    let mut s = String::new();
    s += &format!("kvprobe {}\n", e.kvprobe_version);
    s += &format!("GPUs: {}\n", e.gpus.len());
    for g in &e.gpus {
        s += &format!(
            "  [{}] {}  {}  pci {}  {:.1} GiB  sm_{}{}\n",
            g.ordinal,
            g.name,
            g.uuid,
            g.pci_bus_id,
            g.total_bytes as f64 / (1u64 << 30) as f64,
            g.compute_capability.0,
            g.compute_capability.1
        );
    }
    for l in &e.gpu_links {
        s += &format!(
            "  link GPU{} -> GPU{}: peer access {}, native atomics {}, rank {}, topology {}\n",
            l.p2p.from,
            l.p2p.to,
            if l.p2p.access_supported { "yes" } else { "no" },
            if l.p2p.native_atomics { "yes" } else { "no" },
            l.p2p.performance_rank,
            l.topology.as_deref().unwrap_or("unknown (no nvidia-smi)")
        );
    }
    let opt = |o: &Option<String>| o.clone().unwrap_or_else(|| "not found".into());
    s += &format!("driver: {}\n", opt(&e.driver));
    s += &format!("CUDA driver API: {}\n", opt(&e.cuda));
    s += &format!("NVRTC: {}\n", opt(&e.nvrtc));
    match &e.nixl.library {
        Some(p) => {
            s += &format!(
                "NIXL: {} (via {}, stub: {})\n",
                p.display(),
                e.nixl.found_via.as_deref().unwrap_or("?"),
                e.nixl.stub.map_or("unknown (not loaded)".to_string(), |b| b.to_string())
            );
            if let Some(v) = &e.nixl.version {
                s += &format!("NIXL version: {v}\n");
            }
            if let Some(v) = &e.nixl.ucx_version {
                s += &format!("UCX version: {v} (loaded by NIXL's UCX plugin)\n");
            }
            s += &format!(
                "NIXL plugins ({}): {}\n",
                e.nixl.plugin_dir.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
                e.nixl.plugins.join(", ")
            );
        }
        None => s += "NIXL: unusable (see the error below)\n",
    }
    if let Some(err) = &e.nixl.error {
        s += &format!("NIXL error: {err}\n");
    }
    match (&e.mooncake.install, &e.mooncake.error) {
        (Some(i), _) => s += &format!("Mooncake: {} {} ({})\n", i.wheel, i.version, i.venv.display()),
        (None, Some(err)) => s += &format!("Mooncake: {err}\n"),
        (None, None) => {}
    }
    for (k, v) in &e.transport_env {
        let own = if e.transport_env_defaults.contains(k) { " (kvprobe's default)" } else { "" };
        s += &format!("{k}={v}{own}\n");
    }
    s += &crate::xfer::rdma::render(&e.rdma);
    if !e.transport_probes.is_empty() {
        s += "transport (probe transfers, 32 MiB per side, 32 KiB descriptors):\n";
    }
    for p in &e.transport_probes {
        match (&p.path, p.exit_code) {
            (Some(path), 0) => {
                s +=
                    &format!("  {}: {} ({:.2} GB/s)\n", p.what, crate::xfer::ucx::describe(path), p.transfer_gbps.unwrap_or(0.0));
                if let Some(w) = &path.warning {
                    s += &format!("    warning: {w}\n");
                }
                for f in &path.flags {
                    s += &format!("    flag {f}\n");
                }
            }
            _ => {
                s += &format!("  {}: failed (exit {}): {}\n", p.what, p.exit_code, p.error.as_deref().unwrap_or("no report"));
            }
        }
    }
    s
}
