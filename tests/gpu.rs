//! GPU tests: the CUDA kernels equal the CPU reference bit for bit, the verify kernel finds
//! exactly what the CPU finds, and VRAM runs are clean / classify every injection. They
//! skip with a named reason where no GPU is present (KVPROBE_REQUIRE_GPU=1 fails instead).

use crate::common::{assert_exact_injection, gpu_or_skip, kvprobe, read_report, tmpdir, two_gpus_or_skip};
use kvprobe::cuda::{Device, Kernels};
use kvprobe::fingerprint;
use kvprobe::geometry::{Dtype, Geometry, Layout};
use kvprobe::pool::{KvPool, TableEntry};
use std::sync::Arc;

fn geometries() -> Vec<Geometry> {
    let g = |layers, heads, head, bs, blocks, dtype, layout, mla| Geometry {
        num_layers: layers,
        num_kv_heads: heads,
        head_size: head,
        block_size: bs,
        num_blocks: blocks,
        dtype,
        layout,
        mla,
    };
    vec![
        g(2, 8, 128, 16, 33, Dtype::Bf16, Layout::Nhd, false),
        g(3, 5, 72, 3, 7, Dtype::Fp16, Layout::Hnd, false),
        g(2, 1, 576, 64, 5, Dtype::Bf16, Layout::Nhd, true),
        g(1, 1, 16, 1, 1, Dtype::Fp8, Layout::Nhd, false),
    ]
}

fn table(g: &Geometry, generation: u32) -> Vec<TableEntry> {
    (0..g.num_blocks).map(|i| TableEntry { block: i * 7 + 3, generation: generation + i % 3 }).collect()
}

#[test]
fn kernels_match_the_cpu_reference_bit_for_bit() {
    if !gpu_or_skip("kernels_match_the_cpu_reference_bit_for_bit") {
        return;
    }
    let dev = Device::open(0).unwrap();
    let k = Arc::new(Kernels::compile(&dev).unwrap());
    for g in geometries() {
        let seed = 0x1234_5678_9abc_def0;
        let mut pool = KvPool::device(&dev, k.clone(), &g, seed).unwrap();
        let t = table(&g, 5);
        pool.fill(&t).unwrap();
        let sb = g.slice_bytes().unwrap() as usize;
        let mut buf = vec![0u8; sb];
        for c in g.coords() {
            pool.read_slice(c, &mut buf).unwrap();
            let want = fingerprint::expected(sb, seed, t[c.block as usize].identity(c));
            assert!(buf == want, "{g:?}: fill kernel differs from the CPU reference at {c:?}");
        }
        assert!(pool.verify(&t).unwrap().is_empty(), "{g:?}: verify kernel flags a correct pool");
        pool.poison(4).unwrap();
        for c in g.coords() {
            pool.read_slice(c, &mut buf).unwrap();
            let mut want = vec![0u8; sb];
            fingerprint::poison(&mut want, g.global_slice(c), 4);
            assert!(buf == want, "{g:?}: poison kernel differs from the CPU reference at {c:?}");
        }
    }
}

#[test]
fn verify_kernel_reports_what_the_cpu_reports() {
    if !gpu_or_skip("verify_kernel_reports_what_the_cpu_reports") {
        return;
    }
    let dev = Device::open(0).unwrap();
    let k = Arc::new(Kernels::compile(&dev).unwrap());
    let g = geometries().remove(0);
    let seed = 9;
    let mut pool = KvPool::device(&dev, k, &g, seed).unwrap();
    let t = table(&g, 1);
    pool.fill(&t).unwrap();
    let sb = g.slice_bytes().unwrap() as usize;
    let mut damaged = Vec::new();
    for (n, c) in g.coords().enumerate().filter(|(n, _)| n % 17 == 3) {
        let mut buf = vec![0u8; sb];
        pool.read_slice(c, &mut buf).unwrap();
        for j in 0..=(n % 5) {
            buf[(n * 131 + j * 977) % sb] ^= 0x41;
        }
        pool.write_slice(c, &buf).unwrap();
        let (bad, first) = fingerprint::check(&buf, seed, t[c.block as usize].identity(c));
        damaged.push((g.global_slice(c), bad, first));
    }
    damaged.sort();
    let got: Vec<(u32, u64, u64)> = pool.verify(&t).unwrap().into_iter().map(|f| (f.slice, f.bad_bytes, f.first_bad)).collect();
    assert_eq!(got, damaged);
}

fn vram_report(name: &str, args: &[&str]) -> (i32, serde_json::Value, String) {
    let d = tmpdir(name);
    let p = d.join("report.json");
    let mut a = vec!["run", "--memory", "vram", "--report", p.to_str().unwrap()];
    a.extend_from_slice(args);
    let (code, out, err) = kvprobe(&a);
    (code, read_report(&p), format!("{out}{err}"))
}

#[test]
fn vram_run_is_clean() {
    if !gpu_or_skip("vram_run_is_clean") {
        return;
    }
    for op in ["read", "write"] {
        let (code, r, log) = vram_report("vram-clean", &["--iterations", "3", "--op", op, "--blocks", "256"]);
        assert_eq!(code, 0, "{op}: {log}");
        assert_eq!(r["summary"]["blocks_corrupt"], 0);
        assert!(!r["environment"]["gpus"].as_array().unwrap().is_empty());
        assert!(r["environment"]["gpus"][0]["uuid"].as_str().unwrap().starts_with("GPU-"));
    }
}

#[test]
fn vram_injections_are_classified_exactly() {
    if !gpu_or_skip("vram_injections_are_classified_exactly") {
        return;
    }
    for (kind, class) in
        [("bitflip", "bitflip"), ("drop", "unwritten"), ("misroute", "misplaced"), ("stale", "stale"), ("torn", "torn")]
    {
        let spec = format!("{kind}:2");
        let (code, r, log) = vram_report(kind, &["--iterations", "2", "--inject", &spec]);
        assert_eq!(code, 1, "{kind}: {log}");
        assert_exact_injection(&r, class);
    }
}

#[test]
fn cross_device_runs_are_clean_and_classify_injections() {
    if !two_gpus_or_skip("cross_device_runs_are_clean_and_classify_injections") {
        return;
    }
    let devs = ["--prefill-device", "0", "--decode-device", "1", "--blocks", "128"];
    for op in ["read", "write"] {
        let mut a = vec!["--iterations", "3", "--op", op];
        a.extend_from_slice(&devs);
        let (code, r, log) = vram_report("x2-clean", &a);
        assert_eq!(code, 0, "{op}: {log}");
        assert_eq!(r["summary"]["blocks_corrupt"], 0);
        assert_eq!(r["config"]["decode_device"], 1);
    }
    for (kind, class) in
        [("bitflip", "bitflip"), ("drop", "unwritten"), ("misroute", "misplaced"), ("stale", "stale"), ("torn", "torn")]
    {
        let spec = format!("{kind}:2");
        let mut a = vec!["--iterations", "2", "--inject", spec.as_str()];
        a.extend_from_slice(&devs);
        let (code, r, log) = vram_report(kind, &a);
        assert_eq!(code, 1, "{kind}: {log}");
        assert_exact_injection(&r, class);
    }
}

#[test]
fn env_describes_the_link_between_two_gpus() {
    if !two_gpus_or_skip("env_describes_the_link_between_two_gpus") {
        return;
    }
    let (code, out, err) = kvprobe(&["env", "--json"]);
    assert_eq!(code, 0, "{err}");
    let e: serde_json::Value = serde_json::from_str(&out).unwrap();
    let links = e["gpu_links"].as_array().unwrap();
    assert!(links.iter().any(|l| l["from"] == 0 && l["to"] == 1), "{links:?}");
    assert!(e["gpus"][1]["uuid"].as_str().unwrap().starts_with("GPU-"));
}
