//! What the machine offers: GPUs, driver, CUDA, NVRTC, NIXL library and plugins.
//!
//! Printed by `kvprobe env` and embedded in every report's `environment`.

use crate::cuda::{self, GpuInfo};
use serde::Serialize;
use std::path::PathBuf;

/// NIXL as found on this machine.
#[derive(Clone, Debug, Serialize)]
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
}

/// How one GPU reaches another.
#[derive(Clone, Debug, Serialize)]
pub struct GpuLink {
    /// CUDA peer-to-peer attributes.
    #[serde(flatten)]
    pub p2p: cuda::PeerLink,
    /// The link as `nvidia-smi topo -m` names it (e.g. "NV18" = 18 NVLinks, "PIX", "SYS"),
    /// when nvidia-smi is available.
    pub topology: Option<String>,
}

/// The report's `environment` section.
#[derive(Clone, Debug, Serialize)]
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
    /// Mooncake Store (`--tier mooncake`): the installation found, or why none is usable.
    pub mooncake: MooncakeInfo,
}

/// Mooncake availability.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MooncakeInfo {
    /// The installation, when found.
    pub install: Option<crate::mooncake::Install>,
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
    let out = std::process::Command::new("nvidia-smi").args(["topo", "-m"]).output().ok()?;
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
    match crate::nixl::load() {
        Ok(lib) => {
            let (plugins, error) = match crate::nixl::available_plugins() {
                Ok(p) if p.is_empty() => (p, Some(format!("no NIXL backend plugin loads from {}", lib.plugin_dir.display()))),
                Ok(p) => (p, None),
                Err(e) => (Vec::new(), Some(e.to_string())),
            };
            NixlInfo {
                library: Some(lib.library),
                found_via: Some(lib.found_via),
                plugin_dir: Some(lib.plugin_dir),
                plugins,
                stub: Some(lib.stub),
                error,
            }
        }
        Err(e) => NixlInfo {
            library: None,
            found_via: None,
            plugin_dir: None,
            plugins: Vec::new(),
            stub: None,
            error: Some(e.to_string()),
        },
    }
}

/// Gathers the environment. `nixl` is passed in so a caller that already probed it (or
/// must not load it) decides.
pub fn gather(nixl: NixlInfo) -> Environment {
    let n = cuda::device_count();
    let gpus = (0..n).filter_map(|i| cuda::gpu_info(i).ok()).collect();
    let transport_env = std::env::vars_os()
        .map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned()))
        .filter(|(k, _)| k.starts_with("UCX_") || k.starts_with("NIXL_"))
        .collect();
    Environment {
        kvprobe_version: env!("CARGO_PKG_VERSION").to_string(),
        hostname: std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_default(),
        gpus,
        gpu_links: gpu_links(n),
        driver: kernel_driver(),
        cuda: if n > 0 { cuda::driver_version().ok() } else { None },
        nvrtc: cuda::nvrtc_version(),
        nixl,
        transport_env,
        mooncake: match crate::mooncake::find() {
            Ok(i) => MooncakeInfo { install: Some(i), error: None },
            Err(e) => MooncakeInfo { install: None, error: Some(e.to_string()) },
        },
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
                e.nixl.stub.unwrap_or(true)
            );
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
        s += &format!("{k}={v}\n");
    }
    s
}
