//! RDMA discovery from sysfs, GPU↔NIC PCIe distance, and the flags on UCX's path, against
//! fake sysfs trees built here (the expected values follow from how each tree is built).

use kvprobe::rdma::{GpuPci, PciDistance, RdmaFacts, gather_from};
use kvprobe::ucx::{ProtoRow, Selection, TransportPath, flag_path};
use std::path::{Path, PathBuf};

/// A fake sysfs root: `devices/pciDDDD:BB/...` directories, `bus/pci/devices/<addr>` and
/// `class/infiniband/<dev>` links into them, as the kernel lays them out.
struct FakeSys {
    dir: tempfile::TempDir,
}

fn write(p: &Path, s: &str) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, s).unwrap();
}

impl FakeSys {
    fn new() -> FakeSys {
        FakeSys { dir: tempfile::tempdir().unwrap() }
    }

    fn root(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    /// A PCI function at `chain` ("pci0000:00/0000:00:01.0/.../addr") on NUMA node `numa`,
    /// linked from bus/pci/devices; returns its directory. Bridges on the way get their own
    /// bus/pci/devices link too.
    fn pci(&self, chain: &str, numa: i32) -> PathBuf {
        let parts: Vec<&str> = chain.split('/').collect();
        for i in 2..=parts.len() {
            let rel = parts[..i].join("/");
            let d = self.root().join("devices").join(&rel);
            std::fs::create_dir_all(&d).unwrap();
            write(&d.join("numa_node"), &format!("{numa}\n"));
            let link = self.root().join("bus/pci/devices").join(parts[i - 1]);
            std::fs::create_dir_all(link.parent().unwrap()).unwrap();
            if std::fs::symlink_metadata(&link).is_err() {
                std::os::unix::fs::symlink(format!("../../../devices/{rel}"), &link).unwrap();
            }
            if i < parts.len() {
                write(&d.join("vendor"), "0x8086\n");
                write(&d.join("class"), "0x060400\n"); // PCI bridge
            }
        }
        self.root().join("devices").join(chain)
    }

    /// An NVIDIA GPU (vendor 0x10de, class 3D controller) at `chain`.
    fn gpu(&self, chain: &str, numa: i32) {
        let d = self.pci(chain, numa);
        write(&d.join("vendor"), "0x10de\n");
        write(&d.join("class"), "0x030200\n");
    }

    /// An RDMA device `name` on the PCI function at `chain` with netdev `netdev` and ports
    /// `(number, state, phys_state, link_layer, rate)`.
    fn nic(&self, name: &str, chain: &str, numa: i32, netdev: &str, ports: &[(u32, &str, &str, &str, &str)]) {
        let d = self.pci(chain, numa);
        write(&d.join("vendor"), "0x15b3\n");
        write(&d.join("class"), "0x020700\n");
        std::fs::create_dir_all(d.join("net").join(netdev)).unwrap();
        let ib = d.join("infiniband").join(name);
        std::fs::create_dir_all(&ib).unwrap();
        std::os::unix::fs::symlink("../..", ib.join("device")).unwrap();
        for (n, state, phys, ll, rate) in ports {
            let p = ib.join("ports").join(n.to_string());
            write(&p.join("state"), &format!("{state}\n"));
            write(&p.join("phys_state"), &format!("{phys}\n"));
            write(&p.join("link_layer"), &format!("{ll}\n"));
            write(&p.join("rate"), &format!("{rate}\n"));
        }
        let class = self.root().join("class/infiniband");
        std::fs::create_dir_all(&class).unwrap();
        std::os::unix::fs::symlink(format!("../../devices/{chain}/infiniband/{name}"), class.join(name)).unwrap();
    }

    fn module(&self, name: &str) {
        std::fs::create_dir_all(self.root().join("module").join(name)).unwrap();
    }
}

const IB_UP: (u32, &str, &str, &str, &str) = (1, "4: ACTIVE", "5: LinkUp", "InfiniBand", "400 Gb/sec (4X NDR)");
const IB_DOWN: (u32, &str, &str, &str, &str) = (1, "1: DOWN", "3: Disabled", "InfiniBand", "10 Gb/sec (4X SDR)");

// GPU 0 and mlx5_0 behind one switch (upstream port 01:00.0) under root port 00:01.0;
// GPU 1 and mlx5_1 behind another switch (05:00.0) under root port 00:02.0 of the same root.
const GPU0: &str = "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0";
const NIC0: &str = "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0";
const GPU1: &str = "pci0000:00/0000:00:02.0/0000:05:00.0/0000:06:00.0/0000:07:00.0";
const NIC1: &str = "pci0000:00/0000:00:02.0/0000:05:00.0/0000:06:01.0/0000:08:00.0";

/// Two switches, a GPU and a NIC on each (tree (c)); `nic0_up` says whether mlx5_0's port is ACTIVE.
fn two_switches(nic0_up: bool, peermem: bool) -> FakeSys {
    let f = FakeSys::new();
    f.gpu(GPU0, 0);
    f.gpu(GPU1, 0);
    f.nic("mlx5_0", NIC0, 0, "ibp4s0", &[if nic0_up { IB_UP } else { IB_DOWN }]);
    f.nic("mlx5_1", NIC1, 0, "ibp8s0", &[IB_UP]);
    if peermem {
        f.module("nvidia_peermem");
    }
    f
}

fn two_gpus() -> Vec<GpuPci> {
    vec![
        // CUDA's spelling (8-digit domain, upper case) for one of them.
        GpuPci { ordinal: Some(0), pci_address: "00000000:03:00.0".into(), dma_buf: Some(false) },
        GpuPci { ordinal: Some(1), pci_address: "0000:07:00.0".into(), dma_buf: Some(false) },
    ]
}

fn distance(facts: &RdmaFacts, gpu: usize, nic: &str) -> Option<PciDistance> {
    facts.gpu(gpu).unwrap().nics.iter().find(|n| n.nic == nic).unwrap().distance
}

#[test]
fn rdma_none_when_no_infiniband_class() {
    let f = FakeSys::new();
    f.gpu(GPU0, 0);
    let facts = gather_from(&f.root(), &[GpuPci { ordinal: Some(0), pci_address: "0000:03:00.0".into(), dma_buf: None }]);
    assert!(facts.devices.is_empty());
    assert!(!facts.any_active());
    let g = facts.gpu(0).unwrap();
    assert_eq!((g.nearest.as_deref(), g.ucx_settings.len()), (None, 0));
    assert!(!facts.gpudirect.available && facts.gpudirect.peermem_module.is_none() && facts.gpudirect.dma_buf.is_none());
    assert_eq!(kvprobe::rdma::render(&facts), "RDMA: no RDMA devices: UCX will use TCP between hosts\n");
}

#[test]
fn rdma_one_ib_port_active_is_read_from_sysfs() {
    let f = FakeSys::new();
    f.gpu(GPU0, 0);
    f.nic("mlx5_0", NIC0, 0, "ib0", &[IB_UP]);
    f.module("nvidia_peermem");
    let facts = gather_from(&f.root(), &[GpuPci { ordinal: Some(0), pci_address: "0000:03:00.0".into(), dma_buf: None }]);
    assert_eq!(facts.devices.len(), 1);
    let d = &facts.devices[0];
    assert_eq!(d.name, "mlx5_0");
    assert_eq!(d.pci_address.as_deref(), Some("0000:04:00.0"));
    assert_eq!(d.numa_node, Some(0));
    assert_eq!(d.netdevs, vec!["ib0".to_string()]);
    assert_eq!(d.ports.len(), 1);
    let p = &d.ports[0];
    assert_eq!(
        (p.port, p.state.as_str(), p.phys_state.as_str(), p.link_layer.as_str(), p.rate.as_str(), p.kind()),
        (1, "ACTIVE", "LinkUp", "InfiniBand", "400 Gb/sec (4X NDR)", "InfiniBand")
    );
    assert_eq!(facts.active_ports(), vec!["mlx5_0:1".to_string()]);
    let g = facts.gpu(0).unwrap();
    assert_eq!(g.nearest.as_deref(), Some("mlx5_0"));
    assert_eq!(g.nearest_distance, Some(PciDistance::Pix));
    assert_eq!(g.ucx_settings, vec!["UCX_NET_DEVICES=mlx5_0:1".to_string(), "UCX_TLS=rc,cuda_copy,cuda_ipc".to_string()]);
    assert_eq!(facts.gpudirect.peermem_module.as_deref(), Some("nvidia_peermem"));
    assert!(facts.gpudirect.available);
    let text = kvprobe::rdma::render(&facts);
    assert!(text.contains("mlx5_0  pci 0000:04:00.0  numa 0  netdev ib0"), "{text}");
    assert!(text.contains("port 1: ACTIVE (LinkUp), InfiniBand, 400 Gb/sec (4X NDR)"), "{text}");
    assert!(text.contains("GPU0 (0000:03:00.0): mlx5_0 (PIX): UCX_NET_DEVICES=mlx5_0:1"), "{text}");
    assert!(text.contains("GPUDirect RDMA: yes (nvidia_peermem loaded"), "{text}");
}

#[test]
fn rdma_roce_port_reads_as_roce() {
    let f = FakeSys::new();
    f.nic("mlx5_0", NIC0, 0, "ens1f0np0", &[(1, "4: ACTIVE", "5: LinkUp", "Ethernet", "200 Gb/sec (4X HDR)")]);
    let facts = gather_from(&f.root(), &[]);
    assert_eq!(facts.devices[0].ports[0].kind(), "RoCE");
    assert_eq!(facts.devices[0].netdevs, vec!["ens1f0np0".to_string()]);
    let text = kvprobe::rdma::render(&facts);
    assert!(text.contains("port 1: ACTIVE (LinkUp), RoCE, 200 Gb/sec (4X HDR)"), "{text}");
    assert!(text.contains("GPUDirect RDMA: no (nvidia_peermem not loaded"), "{text}");
}

#[test]
fn rdma_nearest_nic_per_gpu_across_two_switches() {
    let f = two_switches(true, false);
    let facts = gather_from(&f.root(), &two_gpus());
    // Each GPU shares a switch with one NIC and reaches the other through the root.
    assert_eq!(distance(&facts, 0, "mlx5_0"), Some(PciDistance::Pix));
    assert_eq!(distance(&facts, 0, "mlx5_1"), Some(PciDistance::Phb));
    assert_eq!(distance(&facts, 1, "mlx5_0"), Some(PciDistance::Phb));
    assert_eq!(distance(&facts, 1, "mlx5_1"), Some(PciDistance::Pix));
    assert_eq!(facts.gpu(0).unwrap().pci_address, "0000:03:00.0");
    assert_eq!(facts.gpu(0).unwrap().nearest.as_deref(), Some("mlx5_0"));
    assert_eq!(facts.gpu(1).unwrap().nearest.as_deref(), Some("mlx5_1"));
    assert_eq!(facts.gpu(1).unwrap().ucx_settings[0], "UCX_NET_DEVICES=mlx5_1:1");
    // No peermem, GPUs without dma-buf: no GPUDirect RDMA.
    assert_eq!(facts.gpudirect.dma_buf, Some(false));
    assert!(!facts.gpudirect.available);
    let text = kvprobe::rdma::render(&facts);
    assert!(text.contains("  GPU0  PIX     PHB\n"), "{text}");
    assert!(text.contains("  GPU1  PHB     PIX\n"), "{text}");
}

#[test]
fn rdma_nearest_prefers_an_active_port() {
    // mlx5_0, next to GPU 0, has its port down: GPU 0 is pinned to mlx5_1 instead.
    let f = two_switches(false, true);
    let facts = gather_from(&f.root(), &two_gpus());
    let g = facts.gpu(0).unwrap();
    assert_eq!((g.nearest.as_deref(), g.nearest_distance), (Some("mlx5_1"), Some(PciDistance::Phb)));
    assert_eq!(g.ucx_settings[0], "UCX_NET_DEVICES=mlx5_1:1");
}

#[test]
fn rdma_distance_classes_pxb_node_sys() {
    let f = FakeSys::new();
    f.gpu(GPU0, 0);
    // Below a second switch hanging off GPU 0's switch (downstream port 02:02.0).
    f.nic(
        "mlx5_4",
        "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:02.0/0000:09:00.0/0000:0a:00.0/0000:0b:00.0",
        0,
        "p4",
        &[IB_UP],
    );
    // Another PCI root on the same NUMA node, and one on the other node.
    f.nic("mlx5_2", "pci0000:40/0000:40:01.0/0000:41:00.0", 0, "p2", &[IB_UP]);
    f.nic("mlx5_3", "pci0000:80/0000:80:01.0/0000:81:00.0", 1, "p3", &[IB_UP]);
    let facts = gather_from(&f.root(), &[GpuPci { ordinal: Some(0), pci_address: "0000:03:00.0".into(), dma_buf: Some(true) }]);
    assert_eq!(distance(&facts, 0, "mlx5_4"), Some(PciDistance::Pxb));
    assert_eq!(distance(&facts, 0, "mlx5_2"), Some(PciDistance::Node));
    assert_eq!(distance(&facts, 0, "mlx5_3"), Some(PciDistance::Sys));
    assert_eq!(facts.gpu(0).unwrap().nearest.as_deref(), Some("mlx5_4"));
    // dma-buf alone makes GPUDirect RDMA available.
    assert!(facts.gpudirect.available && facts.gpudirect.peermem_module.is_none());
}

#[test]
fn rdma_gpus_found_in_sysfs_without_cuda() {
    let f = two_switches(true, false);
    // Bridges and NICs are not GPUs.
    assert_eq!(kvprobe::rdma::sysfs_gpus(&f.root()), vec!["0000:03:00.0".to_string(), "0000:07:00.0".to_string()]);
}

fn path(operation: &str, config: &str) -> TransportPath {
    TransportPath {
        backend: "UCX".into(),
        selections: vec![Selection {
            operation: operation.into(),
            endpoint: Some("kvprobe-decode inter-node cfg#1".into()),
            rows: vec![ProtoRow { range: "0..inf".into(), description: "zero-copy".into(), config: config.into() }],
        }],
        ..Default::default()
    }
}

const VRAM_READ: &str = "remote memory read by ucp_get*(multi) into cuda/dev[0] from cuda/dev[0]";
const DRAM_WRITE: &str = "remote memory write by ucp_put* from host memory to host";

fn codes(p: &TransportPath) -> Vec<&str> {
    p.flags.iter().map(|f| f.code.as_str()).collect()
}

#[test]
fn rdma_flag_tcp_with_rdma_present() {
    let f = two_switches(true, true);
    let facts = gather_from(&f.root(), &two_gpus());
    let mut p = path(VRAM_READ, "tcp/eth0");
    flag_path(&mut p, &facts, Some(1));
    assert_eq!(codes(&p), vec!["tcp-with-rdma-present"]);
    assert!(p.flags[0].message.contains("mlx5_0:1, mlx5_1:1"), "{:?}", p.flags);
    // The fix pins GPU 1's nearest NIC.
    assert!(
        p.flags[0].fix.as_deref().unwrap().starts_with("UCX_NET_DEVICES=mlx5_1:1 UCX_TLS=rc,cuda_copy,cuda_ipc"),
        "{:?}",
        p.flags
    );
    // DRAM: no GPU, the first ACTIVE port.
    let mut p = path(DRAM_WRITE, "tcp/eth0");
    flag_path(&mut p, &facts, None);
    assert_eq!(codes(&p), vec!["tcp-with-rdma-present"]);
    assert!(p.flags[0].fix.as_deref().unwrap().starts_with("UCX_NET_DEVICES=mlx5_0:1"));
    // Loopback TCP carries transfers within the host only: not flagged.
    let mut p = path(DRAM_WRITE, "tcp/lo");
    flag_path(&mut p, &facts, None);
    assert!(p.flags.is_empty(), "{:?}", p.flags);
    // No RDMA device at all: TCP is all there is, nothing to flag.
    let none = gather_from(&FakeSys::new().root(), &[]);
    let mut p = path(DRAM_WRITE, "tcp/eth0");
    flag_path(&mut p, &none, None);
    assert!(p.flags.is_empty());
}

#[test]
fn rdma_flag_port_down() {
    let f = FakeSys::new();
    f.nic("mlx5_0", NIC0, 0, "ib0", &[IB_DOWN]);
    let facts = gather_from(&f.root(), &[]);
    let mut p = path(DRAM_WRITE, "tcp/eth0");
    flag_path(&mut p, &facts, None);
    assert_eq!(codes(&p), vec!["rdma-port-down"]);
}

#[test]
fn rdma_flag_rc_over_nearest_nic_is_clean() {
    let f = two_switches(true, true);
    let facts = gather_from(&f.root(), &two_gpus());
    let mut p = path(VRAM_READ, "rc_mlx5/mlx5_0:1");
    flag_path(&mut p, &facts, Some(0));
    assert!(p.flags.is_empty(), "{:?}", p.flags);
    // Empty flags are left out of the JSON.
    assert!(serde_json::to_value(&p).unwrap().get("flags").is_none());
}

#[test]
fn rdma_flag_nic_not_nearest() {
    let f = two_switches(true, true);
    let facts = gather_from(&f.root(), &two_gpus());
    let mut p = path(VRAM_READ, "rc_mlx5/mlx5_1:1");
    flag_path(&mut p, &facts, Some(0));
    assert_eq!(codes(&p), vec!["nic-not-nearest"]);
    assert!(p.flags[0].message.contains("mlx5_1 (PHB from it) while mlx5_0 is nearer (PIX)"), "{:?}", p.flags);
    assert_eq!(p.flags[0].fix.as_deref(), Some("UCX_NET_DEVICES=mlx5_0:1"));
    // The same NIC is the nearest for GPU 1.
    flag_path(&mut p, &facts, Some(1));
    assert!(p.flags.is_empty(), "{:?}", p.flags);
    // A DRAM transfer names no GPU: no distance to judge.
    let mut p = path(DRAM_WRITE, "rc_mlx5/mlx5_1:1");
    flag_path(&mut p, &facts, None);
    assert!(p.flags.is_empty());
    // Flags round-trip through JSON.
    let mut p = path(VRAM_READ, "rc_mlx5/mlx5_1:1");
    flag_path(&mut p, &facts, Some(0));
    let back: TransportPath = serde_json::from_value(serde_json::to_value(&p).unwrap()).unwrap();
    assert_eq!(back.flags, p.flags);
}

#[test]
fn rdma_flag_no_gpudirect_and_staging() {
    let f = two_switches(true, false); // no peermem, GPUs without dma-buf
    let facts = gather_from(&f.root(), &two_gpus());
    let mut p = path(VRAM_READ, "rc_mlx5/mlx5_0:1");
    flag_path(&mut p, &facts, Some(0));
    assert_eq!(codes(&p), vec!["no-gpudirect-rdma"]);
    assert!(p.flags[0].fix.as_deref().unwrap().contains("nvidia_peermem"));
    // Host memory over rc needs no GPUDirect.
    let mut p = path(DRAM_WRITE, "rc_mlx5/mlx5_0:1");
    flag_path(&mut p, &facts, None);
    assert!(p.flags.is_empty(), "{:?}", p.flags);
    // A row that stages through host memory with cuda_copy, GPUDirect available.
    let f = two_switches(true, true);
    let facts = gather_from(&f.root(), &two_gpus());
    let mut p = path(VRAM_READ, "cuda_copy/cuda, rc_mlx5/mlx5_0:1");
    flag_path(&mut p, &facts, Some(0));
    assert_eq!(codes(&p), vec!["staged-through-host"]);
    // Old reports (no `flags`) still read.
    let old = serde_json::json!({"backend": "UCX", "selections": [], "unknown_because": null, "emulated": false,
        "copy_gbps": null, "ratio_to_copy": null, "warning": null, "ucx_messages": []});
    assert!(serde_json::from_value::<TransportPath>(old).unwrap().flags.is_empty());
}

#[test]
fn rdma_env_says_no_rdma_plainly() {
    let f = FakeSys::new();
    let root = f.root();
    let (_, out, err) =
        crate::common::kvprobe_env(&["env", "--no-probe"], &[("KVPROBE_TEST_SYSFS_ROOT", root.to_str().unwrap())]);
    assert!(out.contains("RDMA: no RDMA devices: UCX will use TCP between hosts\n"), "{out}\n{err}");
    let (_, out, err) =
        crate::common::kvprobe_env(&["env", "--no-probe", "--json"], &[("KVPROBE_TEST_SYSFS_ROOT", root.to_str().unwrap())]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
    assert_eq!(v["rdma"]["devices"], serde_json::json!([]));
    assert_eq!(v["rdma"]["gpudirect"]["available"], false);
}

#[test]
fn rdma_env_lists_devices_topology_and_settings() {
    let f = two_switches(true, true);
    let root = f.root();
    let env = [("KVPROBE_TEST_SYSFS_ROOT", root.to_str().unwrap())];
    let (_, out, err) = crate::common::kvprobe_env(&["env", "--no-probe"], &env);
    assert!(out.contains("  mlx5_0  pci 0000:04:00.0  numa 0  netdev ibp4s0\n"), "{out}\n{err}");
    assert!(out.contains("    port 1: ACTIVE (LinkUp), InfiniBand, 400 Gb/sec (4X NDR)\n"), "{out}");
    // GPUs from the fake tree, named by address (no CUDA ordinal under the test root).
    assert!(out.contains("  GPU 0000:03:00.0: mlx5_0 (PIX): UCX_NET_DEVICES=mlx5_0:1 UCX_TLS=rc,cuda_copy,cuda_ipc"), "{out}");
    assert!(out.contains("  GPU 0000:07:00.0: mlx5_1 (PIX): UCX_NET_DEVICES=mlx5_1:1"), "{out}");
    assert!(out.contains("GPUDirect RDMA: yes (nvidia_peermem loaded"), "{out}");
    let (_, out, err) = crate::common::kvprobe_env(&["env", "--no-probe", "--json"], &env);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
    let r = &v["rdma"];
    assert_eq!(r["devices"][1]["name"], "mlx5_1");
    assert_eq!(r["devices"][1]["ports"][0]["link_layer"], "InfiniBand");
    assert_eq!(r["gpus"][0]["pci_address"], "0000:03:00.0");
    assert_eq!(r["gpus"][0]["nics"][1]["distance"], "PHB");
    assert_eq!(r["gpus"][1]["nearest"], "mlx5_1");
    assert_eq!(r["gpus"][1]["ucx_settings"][0], "UCX_NET_DEVICES=mlx5_1:1");
    assert_eq!(r["gpudirect"]["peermem_module"], "nvidia_peermem");
}

#[test]
fn rdma_pins_the_active_port_of_a_dual_port_nic() {
    let f = FakeSys::new();
    f.gpu(GPU0, 0);
    f.nic("mlx5_0", NIC0, 0, "ib0", &[IB_DOWN, (2, "4: ACTIVE", "5: LinkUp", "InfiniBand", "200 Gb/sec (4X HDR)")]);
    let facts = gather_from(&f.root(), &[GpuPci { ordinal: Some(0), pci_address: "0000:03:00.0".into(), dma_buf: None }]);
    let ports: Vec<(u32, &str)> = facts.devices[0].ports.iter().map(|p| (p.port, p.state.as_str())).collect();
    assert_eq!(ports, vec![(1, "DOWN"), (2, "ACTIVE")]);
    assert_eq!(facts.active_ports(), vec!["mlx5_0:2".to_string()]);
    assert_eq!(facts.gpu(0).unwrap().ucx_settings[0], "UCX_NET_DEVICES=mlx5_0:2");
}

#[test]
fn rdma_device_without_pci_has_no_distance() {
    // A soft RoCE device (rxe) has no PCI function: listed, but never anyone's nearest.
    let f = FakeSys::new();
    f.gpu(GPU0, 0);
    let p = f.root().join("devices/virtual/infiniband/rxe0/ports/1");
    for (file, v) in
        [("state", "4: ACTIVE"), ("phys_state", "5: LinkUp"), ("link_layer", "Ethernet"), ("rate", "10 Gb/sec (1X QDR)")]
    {
        write(&p.join(file), v);
    }
    std::fs::create_dir_all(f.root().join("class/infiniband")).unwrap();
    std::os::unix::fs::symlink("../../devices/virtual/infiniband/rxe0", f.root().join("class/infiniband/rxe0")).unwrap();
    let facts = gather_from(&f.root(), &[GpuPci { ordinal: Some(0), pci_address: "0000:03:00.0".into(), dma_buf: None }]);
    assert_eq!(facts.devices.len(), 1);
    assert_eq!((facts.devices[0].pci_address.as_deref(), facts.devices[0].numa_node), (None, None));
    let g = facts.gpu(0).unwrap();
    assert_eq!((g.nics[0].distance, g.nearest.as_deref()), (None, None));
    assert!(kvprobe::rdma::render(&facts).contains("GPU0 (0000:03:00.0): unknown (no PCI path to compare)"));
}
