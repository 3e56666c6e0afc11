//! RDMA NICs, where they sit on PCIe relative to the GPUs, and whether GPUDirect RDMA is
//! possible: the facts that decide which path UCX takes between hosts (rc/dc/ud over an
//! RDMA NIC, GPUDirect RDMA or staging through host memory with cuda_copy, or TCP).
//!
//! Everything is read from sysfs under a root passed in (`/sys` in production), so tests
//! build a fake tree in a temporary directory:
//!
//! - `class/infiniband/<dev>/ports/<n>/{state,phys_state,link_layer,rate}`: the ports
//!   (`state` "4: ACTIVE", `phys_state` "5: LinkUp", `link_layer` "InfiniBand" or "Ethernet"
//!   (= RoCE), `rate` "400 Gb/sec (4X NDR)");
//! - `class/infiniband/<dev>/device`: link to the NIC's PCI function (its address is the link
//!   target's name; `device/net/<ifname>` its netdevs, `device/numa_node` its NUMA node);
//! - `bus/pci/devices/<addr>`: link into `devices/pciDDDD:BB/<bridge>/.../<addr>`, the chain
//!   of bridges from the PCI root to the function, from which [`classify`] derives the
//!   distance between two functions the way `nvidia-smi topo -m` names it;
//! - `bus/pci/devices/*/{vendor,class}`: NVIDIA GPUs (vendor 0x10de, class 0x03xxxx) when
//!   CUDA cannot list them;
//! - `module/nvidia_peermem` (or the older `module/nv_peer_mem`): the kernel module that lets
//!   an RDMA NIC read and write GPU memory (GPUDirect RDMA).

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Test-only: a fake sysfs root that `kvprobe env` (and every report's environment) reads
/// instead of `/sys`, so the CLI can be tested against a constructed tree. Under it, GPUs
/// come from that tree (vendor/class), not from CUDA, whose addresses belong to the real
/// machine. Not for production use.
pub const TEST_SYSFS_ENV: &str = crate::sys::test_hooks::SYSFS_ROOT;

/// The `UCX_TLS` kvprobe suggests with a pinned RDMA device: rc over the NIC, cuda_copy
/// (staging and small copies), cuda_ipc (GPUs of the same host).
pub const UCX_TLS_HINT: &str = "rc,cuda_copy,cuda_ipc";

/// PCIe distance between two PCI functions, nearest first, in `nvidia-smi topo -m`'s terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum PciDistance {
    /// At most one PCIe switch (or bridge) between them.
    #[serde(rename = "PIX")]
    Pix,
    /// Several PCIe switches/bridges, without crossing the PCIe host bridge.
    #[serde(rename = "PXB")]
    Pxb,
    /// Through the PCIe host bridge (the CPU): same PCI root, different root ports.
    #[serde(rename = "PHB")]
    Phb,
    /// Between PCIe host bridges (different PCI roots) of one NUMA node.
    #[serde(rename = "NODE")]
    Node,
    /// Across the interconnect between NUMA nodes (e.g. UPI, xGMI), or NUMA nodes unknown.
    #[serde(rename = "SYS")]
    Sys,
}

impl PciDistance {
    /// The name `nvidia-smi topo -m` prints ("PIX", "PXB", "PHB", "NODE", "SYS").
    pub fn as_str(self) -> &'static str {
        match self {
            PciDistance::Pix => "PIX",
            PciDistance::Pxb => "PXB",
            PciDistance::Phb => "PHB",
            PciDistance::Node => "NODE",
            PciDistance::Sys => "SYS",
        }
    }
}

impl std::fmt::Display for PciDistance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One port of an RDMA device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RdmaPort {
    /// Port number (1-based, as in `UCX_NET_DEVICES=mlx5_0:1`).
    pub port: u32,
    /// Logical state without its number: "ACTIVE", "DOWN", "INIT", "ARMED" (`state`).
    pub state: String,
    /// Physical state without its number: "LinkUp", "Disabled", "Polling" (`phys_state`).
    pub phys_state: String,
    /// "InfiniBand", or "Ethernet" for RoCE (`link_layer`).
    pub link_layer: String,
    /// The kernel's rate text, e.g. "400 Gb/sec (4X NDR)" (`rate`; Gb/s = 1e9 bit/s).
    pub rate: String,
}

impl RdmaPort {
    /// True when the port can carry traffic (logical state ACTIVE).
    pub fn is_active(&self) -> bool {
        self.state == "ACTIVE"
    }

    /// "InfiniBand" or "RoCE" (the Ethernet link layer), else the link layer as read.
    pub fn kind(&self) -> &str {
        if self.link_layer == "Ethernet" { "RoCE" } else { &self.link_layer }
    }
}

/// One RDMA device (`/sys/class/infiniband/<name>`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RdmaDevice {
    /// Device name, e.g. "mlx5_0" (what `UCX_NET_DEVICES` names).
    pub name: String,
    /// PCI address of its function, e.g. "0000:04:00.0"; null for a device not on PCI
    /// (e.g. soft RoCE, rxe0).
    pub pci_address: Option<String>,
    /// NUMA node of the function; null when the kernel says -1 or nothing.
    pub numa_node: Option<i32>,
    /// Network interfaces of the function (e.g. "ib0", "ens1f0np0").
    pub netdevs: Vec<String>,
    /// Its ports, by number.
    pub ports: Vec<RdmaPort>,
}

impl RdmaDevice {
    /// The port UCX should be pinned to: the first ACTIVE one, else the first.
    pub fn best_port(&self) -> Option<&RdmaPort> {
        self.ports.iter().find(|p| p.is_active()).or(self.ports.first())
    }
}

/// Distance from one GPU to one RDMA device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NicDistance {
    /// RDMA device name.
    pub nic: String,
    /// PCIe distance; null when either PCI path is unknown.
    pub distance: Option<PciDistance>,
}

/// One GPU, where it sits, and the NIC UCX should use for it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuNic {
    /// CUDA ordinal; null when the GPU was found in sysfs only (no CUDA).
    pub gpu: Option<usize>,
    /// PCI address, e.g. "0000:03:00.0" (lower case, 4-digit domain).
    pub pci_address: String,
    /// NUMA node of the GPU; null when unknown.
    pub numa_node: Option<i32>,
    /// CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED; null without CUDA.
    pub dma_buf: Option<bool>,
    /// Distance to every RDMA device, in device order.
    pub nics: Vec<NicDistance>,
    /// The nearest RDMA device with an ACTIVE port (the nearest of all when none is active);
    /// null when no distance is known.
    pub nearest: Option<String>,
    /// Its distance.
    pub nearest_distance: Option<PciDistance>,
    /// The UCX settings that pin this GPU's transfers to that device, e.g.
    /// `["UCX_NET_DEVICES=mlx5_0:1", "UCX_TLS=rc,cuda_copy,cuda_ipc"]`.
    pub ucx_settings: Vec<String>,
}

/// GPUDirect RDMA: can the NIC read and write GPU memory directly?
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuDirect {
    /// The peer-memory kernel module loaded ("nvidia_peermem", or the older "nv_peer_mem"),
    /// if any.
    pub peermem_module: Option<String>,
    /// Some GPU can export its memory as a dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED),
    /// which ib_core registers without a peer-memory module; null without CUDA.
    pub dma_buf: Option<bool>,
    /// Either of the two: UCX can move VRAM over RDMA without staging it in host memory.
    pub available: bool,
}

/// Everything kvprobe knows about this host's RDMA path (`environment.rdma`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RdmaFacts {
    /// The sysfs root read ("/sys" outside tests).
    pub sysfs: PathBuf,
    /// RDMA devices, by name.
    pub devices: Vec<RdmaDevice>,
    /// GPUs with their distance to each device and their nearest device.
    pub gpus: Vec<GpuNic>,
    /// GPUDirect RDMA status.
    pub gpudirect: GpuDirect,
}

impl RdmaFacts {
    /// True when some RDMA port is ACTIVE (UCX can use rc/dc/ud between hosts).
    pub fn any_active(&self) -> bool {
        self.devices.iter().any(|d| d.ports.iter().any(RdmaPort::is_active))
    }

    /// The ACTIVE ports as UCX names them ("mlx5_0:1").
    pub fn active_ports(&self) -> Vec<String> {
        self.devices
            .iter()
            .flat_map(|d| d.ports.iter().filter(|p| p.is_active()).map(move |p| format!("{}:{}", d.name, p.port)))
            .collect()
    }

    /// The entry of the GPU with CUDA ordinal `ordinal`.
    pub fn gpu(&self, ordinal: usize) -> Option<&GpuNic> {
        self.gpus.iter().find(|g| g.gpu == Some(ordinal))
    }

    /// `UCX_NET_DEVICES` value for device `name` ("mlx5_0:1"), with its best port.
    pub fn net_device(&self, name: &str) -> Option<String> {
        let d = self.devices.iter().find(|d| d.name == name)?;
        Some(format!("{}:{}", d.name, d.best_port().map_or(1, |p| p.port)))
    }
}

/// A GPU to place: CUDA ordinal (when known), PCI address, dma-buf support (when known).
#[derive(Clone, Debug, PartialEq)]
pub struct GpuPci {
    /// CUDA ordinal.
    pub ordinal: Option<usize>,
    /// PCI address in any case and domain width ("0000:19:00.0", "00000000:19:00.0").
    pub pci_address: String,
    /// CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED.
    pub dma_buf: Option<bool>,
}

/// A PCI address as sysfs spells it: lower case, 4-digit domain ("00000000:3B:00.0" →
/// "0000:3b:00.0"; CUDA and nvidia-smi print 8 digits or upper case).
pub fn normalize_pci(addr: &str) -> String {
    let a = addr.trim().to_ascii_lowercase();
    match a.split_once(':') {
        Some((dom, rest)) if dom.len() > 4 && dom[..dom.len() - 4].chars().all(|c| c == '0') => {
            format!("{}:{rest}", &dom[dom.len() - 4..])
        }
        _ => a,
    }
}

fn is_hex(s: &str, n: usize) -> bool {
    s.len() == n && s.chars().all(|c| c.is_ascii_hexdigit())
}

/// True for "DDDD:BB:DD.F".
fn is_pci_address(s: &str) -> bool {
    let parts: Vec<&str> = s.split(':').collect();
    parts.len() == 3
        && is_hex(parts[0], 4)
        && is_hex(parts[1], 2)
        && parts[2].split_once('.').is_some_and(|(d, f)| is_hex(d, 2) && f.len() == 1 && f.chars().all(|c| c.is_ascii_digit()))
}

/// True for a PCI root's directory name, "pciDDDD:BB".
fn is_pci_root(s: &str) -> bool {
    s.strip_prefix("pci").and_then(|r| r.split_once(':')).is_some_and(|(d, b)| is_hex(d, 4) && is_hex(b, 2))
}

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

/// "4: ACTIVE" → "ACTIVE" (sysfs prefixes the numeric value).
fn after_colon(s: &str) -> String {
    s.split_once(':').map_or(s, |(_, r)| r).trim().to_string()
}

fn numa(dir: &Path) -> Option<i32> {
    read_trim(&dir.join("numa_node")).and_then(|s| s.parse::<i32>().ok()).filter(|n| *n >= 0)
}

/// The chain of a PCI device's sysfs directory from its PCI root: `["pci0000:00",
/// "0000:00:01.0", "0000:01:00.0", ..., addr]`, from the resolved (symlink-free) path.
/// `None` when the path cannot be resolved or has no PCI root in it.
pub fn pci_chain(device_dir: &Path) -> Option<Vec<String>> {
    let real = std::fs::canonicalize(device_dir).ok()?;
    let names: Vec<String> = real.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    let start = names.iter().position(|n| is_pci_root(n))?;
    let chain: Vec<String> = names[start..].to_vec();
    (chain.len() >= 2 && chain[1..].iter().all(|n| is_pci_address(n))).then_some(chain)
}

/// The distance between two PCI functions from their chains ([`pci_chain`]) and NUMA nodes,
/// as `nvidia-smi topo -m` classifies it:
/// - different PCI roots: NODE when both are on the same NUMA node (or both unknown), else SYS;
/// - same root, sharing only the root (different root ports): PHB;
/// - below their deepest common bridge, each at most two levels down (one switch: its
///   downstream port, then the device): PIX;
/// - otherwise (a chain of switches): PXB.
///
/// Limits: platforms that put all root ports under one PCI root while they sit on different
/// host bridges of the CPU read as PHB where nvidia-smi may say NODE.
pub fn classify(a: &[String], numa_a: Option<i32>, b: &[String], numa_b: Option<i32>) -> PciDistance {
    if a.first() != b.first() || a.is_empty() {
        return if numa_a == numa_b { PciDistance::Node } else { PciDistance::Sys };
    }
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    if common <= 1 {
        return PciDistance::Phb;
    }
    let c = common - 1; // index of the deepest common bridge
    let up_a = a.len() - 1 - c;
    let up_b = b.len() - 1 - c;
    if up_a <= 2 && up_b <= 2 { PciDistance::Pix } else { PciDistance::Pxb }
}

/// The RDMA devices under `sys` (`<sys>/class/infiniband`), by name; empty when there are
/// none (or no such directory).
pub fn read_devices(sys: &Path) -> Vec<RdmaDevice> {
    let Ok(rd) = std::fs::read_dir(sys.join("class/infiniband")) else { return Vec::new() };
    let mut out: Vec<RdmaDevice> = rd
        .flatten()
        .map(|e| {
            let dir = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            let device = dir.join("device");
            let pci_address = std::fs::canonicalize(&device)
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .filter(|n| is_pci_address(n));
            let mut netdevs: Vec<String> = std::fs::read_dir(device.join("net"))
                .map(|r| r.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
                .unwrap_or_default();
            netdevs.sort();
            let mut ports: Vec<RdmaPort> = std::fs::read_dir(dir.join("ports"))
                .map(|r| {
                    r.flatten()
                        .filter_map(|p| {
                            let port = p.file_name().to_string_lossy().parse::<u32>().ok()?;
                            let d = p.path();
                            let get = |f: &str| read_trim(&d.join(f)).unwrap_or_default();
                            Some(RdmaPort {
                                port,
                                state: after_colon(&get("state")),
                                phys_state: after_colon(&get("phys_state")),
                                link_layer: get("link_layer"),
                                rate: get("rate"),
                            })
                        })
                        .collect()
                })
                .unwrap_or_default();
            ports.sort_by_key(|p| p.port);
            RdmaDevice { name, numa_node: pci_address.as_ref().and_then(|_| numa(&device)), pci_address, netdevs, ports }
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// NVIDIA GPUs on the PCI bus under `sys` (vendor 0x10de, class 0x03xxxx), by address; for
/// hosts where CUDA cannot list them.
pub fn sysfs_gpus(sys: &Path) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(sys.join("bus/pci/devices")) else { return Vec::new() };
    let mut v: Vec<String> = rd
        .flatten()
        .filter(|e| {
            let p = e.path();
            read_trim(&p.join("vendor")).is_some_and(|v| v == "0x10de")
                && read_trim(&p.join("class")).is_some_and(|c| c.starts_with("0x03"))
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| is_pci_address(n))
        .collect();
    v.sort();
    v
}

/// The peer-memory module loaded under `sys` (`module/nvidia_peermem` or `module/nv_peer_mem`).
pub fn peermem_module(sys: &Path) -> Option<String> {
    ["nvidia_peermem", "nv_peer_mem"].into_iter().find(|m| sys.join("module").join(m).is_dir()).map(str::to_string)
}

/// Reads the RDMA facts under sysfs root `sys` for `gpus`: devices, each GPU's distance to
/// each device and its nearest one (preferring devices with an ACTIVE port), and GPUDirect
/// RDMA status.
pub fn gather_from(sys: &Path, gpus: &[GpuPci]) -> RdmaFacts {
    let devices = read_devices(sys);
    let nic_pos: Vec<(Option<Vec<String>>, Option<i32>)> = devices
        .iter()
        .map(|d| {
            let chain =
                d.pci_address.as_ref().and_then(|_| pci_chain(&sys.join("class/infiniband").join(&d.name).join("device")));
            (chain, d.numa_node)
        })
        .collect();
    let gpu_entries = gpus
        .iter()
        .map(|g| {
            let addr = normalize_pci(&g.pci_address);
            let dir = sys.join("bus/pci/devices").join(&addr);
            let chain = pci_chain(&dir);
            let numa_node = numa(&dir);
            let nics: Vec<NicDistance> = devices
                .iter()
                .zip(&nic_pos)
                .map(|(d, (nc, nn))| NicDistance {
                    nic: d.name.clone(),
                    distance: match (&chain, nc) {
                        (Some(a), Some(b)) => Some(classify(a, numa_node, b, *nn)),
                        _ => None,
                    },
                })
                .collect();
            let nearest = devices
                .iter()
                .zip(&nics)
                .filter_map(|(d, n)| n.distance.map(|dist| (!d.ports.iter().any(RdmaPort::is_active), dist, &d.name)))
                .min();
            let mut e = GpuNic {
                gpu: g.ordinal,
                pci_address: addr,
                numa_node,
                dma_buf: g.dma_buf,
                nics,
                nearest: nearest.map(|n| n.2.clone()),
                nearest_distance: nearest.map(|n| n.1),
                ucx_settings: Vec::new(),
            };
            if let Some(n) = &e.nearest {
                let dev = devices.iter().find(|d| &d.name == n);
                let port = dev.and_then(RdmaDevice::best_port).map_or(1, |p| p.port);
                e.ucx_settings = vec![format!("UCX_NET_DEVICES={n}:{port}"), format!("UCX_TLS={UCX_TLS_HINT}")];
            }
            e
        })
        .collect();
    let peermem = peermem_module(sys);
    let dma_buf =
        if gpus.iter().any(|g| g.dma_buf.is_some()) { Some(gpus.iter().any(|g| g.dma_buf == Some(true))) } else { None };
    RdmaFacts {
        sysfs: sys.to_path_buf(),
        devices,
        gpus: gpu_entries,
        gpudirect: GpuDirect { available: peermem.is_some() || dma_buf == Some(true), peermem_module: peermem, dma_buf },
    }
}

/// Reads this host's RDMA facts: sysfs at `/sys` (or the test-only [`TEST_SYSFS_ENV`]), the
/// GPUs CUDA lists (`cuda_gpus`, with their dma-buf attribute), or, without CUDA (or under
/// the test root), the NVIDIA GPUs on the PCI bus.
pub fn gather(cuda_gpus: &[crate::gpu::cuda::GpuInfo]) -> RdmaFacts {
    let test_root = std::env::var_os(TEST_SYSFS_ENV).filter(|v| !v.is_empty()).map(PathBuf::from);
    let sys = test_root.clone().unwrap_or_else(|| PathBuf::from("/sys"));
    let gpus: Vec<GpuPci> = if !cuda_gpus.is_empty() && test_root.is_none() {
        cuda_gpus
            .iter()
            .map(|g| GpuPci {
                ordinal: Some(g.ordinal),
                pci_address: g.pci_bus_id.clone(),
                dma_buf: crate::gpu::cuda::gpudirect_attrs(g.ordinal).ok().map(|(_, d)| d),
            })
            .collect()
    } else {
        sysfs_gpus(&sys).into_iter().map(|a| GpuPci { ordinal: None, pci_address: a, dma_buf: None }).collect()
    };
    gather_from(&sys, &gpus)
}

fn gpu_label(g: &GpuNic) -> String {
    match g.gpu {
        Some(o) => format!("GPU{o}"),
        None => format!("GPU {}", g.pci_address),
    }
}

/// "GPU0 (0000:03:00.0)", or "GPU 0000:03:00.0" for a GPU known only by its address.
fn gpu_full_label(g: &GpuNic) -> String {
    match g.gpu {
        Some(o) => format!("GPU{o} ({})", g.pci_address),
        None => format!("GPU {}", g.pci_address),
    }
}

/// The RDMA part of `kvprobe env`'s text: devices and ports, the GPU↔NIC distance table,
/// the nearest NIC and UCX settings per GPU, GPUDirect RDMA.
pub fn render(f: &RdmaFacts) -> String {
    let mut s = String::new();
    if f.devices.is_empty() {
        s += "RDMA: no RDMA devices: UCX will use TCP between hosts\n";
        return s;
    }
    s += "RDMA devices:\n";
    for d in &f.devices {
        s += &format!(
            "  {}  pci {}  numa {}  netdev {}\n",
            d.name,
            d.pci_address.as_deref().unwrap_or("none"),
            d.numa_node.map_or("unknown".to_string(), |n| n.to_string()),
            if d.netdevs.is_empty() { "none".to_string() } else { d.netdevs.join(",") }
        );
        for p in &d.ports {
            s += &format!("    port {}: {} ({}), {}, {}\n", p.port, p.state, p.phys_state, p.kind(), p.rate);
        }
    }
    if !f.any_active() {
        s += "  no RDMA port is ACTIVE: UCX will use TCP between hosts\n";
    }
    if !f.gpus.is_empty() {
        s += "GPU <-> NIC (PCIe distance, nearest first: PIX, PXB, PHB, NODE, SYS):\n";
        let w = f.devices.iter().map(|d| d.name.len()).max().unwrap_or(4).max(4) + 2;
        let lw = f.gpus.iter().map(|g| gpu_label(g).len()).max().unwrap_or(4) + 2;
        s += &format!("  {:lw$}", "");
        for d in &f.devices {
            s += &format!("{:w$}", d.name);
        }
        s = s.trim_end().to_string() + "\n";
        for g in &f.gpus {
            s += &format!("  {:lw$}", gpu_label(g));
            for n in &g.nics {
                s += &format!("{:w$}", n.distance.map_or("?", PciDistance::as_str));
            }
            s = s.trim_end().to_string() + "\n";
        }
        s += "nearest NIC per GPU, and the UCX settings that pin it:\n";
        for g in &f.gpus {
            match (&g.nearest, g.nearest_distance) {
                (Some(n), Some(d)) => s += &format!("  {}: {n} ({d}): {}\n", gpu_full_label(g), g.ucx_settings.join(" ")),
                _ => s += &format!("  {}: unknown (no PCI path to compare)\n", gpu_full_label(g)),
            }
        }
    }
    let gd = &f.gpudirect;
    let dma = match gd.dma_buf {
        Some(true) => "dma-buf supported",
        Some(false) => "dma-buf not supported",
        None => "dma-buf unknown (no CUDA)",
    };
    if gd.available {
        s += &format!(
            "GPUDirect RDMA: yes ({}; {dma})\n",
            gd.peermem_module.as_deref().map_or("no peer-memory module".to_string(), |m| format!("{m} loaded"))
        );
    } else {
        s += &format!(
            "GPUDirect RDMA: no (nvidia_peermem not loaded; {dma}): UCX stages VRAM through host memory (cuda_copy); \
             modprobe nvidia_peermem\n"
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(s: &str) -> Vec<String> {
        s.split('/').map(str::to_string).collect()
    }

    #[test]
    fn pci_addresses_normalise_to_sysfs_form() {
        assert_eq!(normalize_pci("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_pci("0000:19:00.0"), "0000:19:00.0");
        assert_eq!(normalize_pci("0001:19:00.0\n"), "0001:19:00.0");
        assert!(is_pci_address("0000:3b:00.0"));
        assert!(!is_pci_address("pci0000:00"));
        assert!(is_pci_root("pci0000:00"));
        assert!(!is_pci_root("0000:00:01.0"));
    }

    #[test]
    fn distances_follow_the_common_ancestor() {
        // GPU behind a switch: root port 00:01.0, switch upstream 01:00.0, downstream 02:00.0.
        let gpu = chain("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0");
        // Same switch, another downstream port: one switch between them.
        let same_switch = chain("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0");
        // Below a second switch hanging off the first: two switches.
        let two_switches = chain("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:02.0/0000:08:00.0/0000:09:00.0/0000:0a:00.0");
        // Another root port of the same root.
        let other_port = chain("pci0000:00/0000:00:02.0/0000:05:00.0/0000:06:00.0/0000:07:00.0");
        let other_root = chain("pci0000:40/0000:40:01.0/0000:41:00.0");
        assert_eq!(classify(&gpu, Some(0), &same_switch, Some(0)), PciDistance::Pix);
        assert_eq!(classify(&gpu, Some(0), &two_switches, Some(0)), PciDistance::Pxb);
        assert_eq!(classify(&gpu, Some(0), &other_port, Some(0)), PciDistance::Phb);
        assert_eq!(classify(&gpu, Some(0), &other_root, Some(0)), PciDistance::Node);
        assert_eq!(classify(&gpu, Some(0), &other_root, Some(1)), PciDistance::Sys);
        assert_eq!(classify(&gpu, None, &other_root, Some(1)), PciDistance::Sys);
        // Two functions of one device (mlx5 ports as PFs): the same parent.
        let f0 = chain("pci0000:00/0000:00:01.0/0000:01:00.0");
        let f1 = chain("pci0000:00/0000:00:01.0/0000:01:00.1");
        assert_eq!(classify(&f0, None, &f1, None), PciDistance::Pix);
        assert!(PciDistance::Pix < PciDistance::Pxb && PciDistance::Node < PciDistance::Sys);
    }

    #[test]
    fn port_state_drops_the_number() {
        assert_eq!(after_colon("4: ACTIVE"), "ACTIVE");
        assert_eq!(after_colon("5: LinkUp"), "LinkUp");
        assert_eq!(after_colon("DOWN"), "DOWN");
    }
}
