//! A hybrid model's state and indexer regions moved and verified by `kvprobe run` (issue 36,
//! items 3–5, one process, DRAM): each family clean with the bytes and pages its layout says,
//! a region left out of the transfer failing by name, equal TP sizes rank by rank, and the
//! forms that do not move regions yet refusing. Expected sizes are worked out here by hand
//! from vLLM 0.34's formulas (mamba_utils.py, the hybrid block size), not by the code under test.

use crate::common::{kvprobe, kvprobe_env, read_report, tmpdir};
use serde_json::Value;
use std::path::PathBuf;

/// Kimi-Linear-shaped, small: 8 layers (1-based in the config), MLA at 4 and 8, KDA at the rest;
/// 16 KDA heads of 128, conv kernel 4.
const TINY_KIMI: &str = r#"{"model_type": "kimi_linear", "num_hidden_layers": 8, "hidden_size": 2048,
    "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "torch_dtype": "bfloat16",
    "linear_attn_config": {"full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7], "num_heads": 16,
    "head_dim": 128, "short_conv_kernel_size": 4}}"#;

/// DeepSeek-V3.2-shaped, small: 4 MLA layers, each with the indexer K cache.
const TINY_V32: &str = r#"{"model_type": "deepseek_v32", "num_hidden_layers": 4, "num_attention_heads": 16,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64}"#;

const NEMOTRON: &str = r#"{"model_type": "nemotron_h", "num_hidden_layers": 8, "hybrid_override_pattern": "M-M*ME-*",
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096,
    "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
    "torch_dtype": "bfloat16"}"#;

const JAMBA: &str = r#"{"model_type": "jamba", "num_hidden_layers": 16, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16,
    "mamba_d_conv": 4, "mamba_expand": 2}"#;

const GRANITE: &str = r#"{"model_type": "granitemoehybrid", "num_hidden_layers": 6,
    "layer_types": ["mamba", "mamba", "mamba", "attention", "mamba", "mamba"], "hidden_size": 1536,
    "num_attention_heads": 12, "num_key_value_heads": 4, "mamba_n_heads": 48, "mamba_d_head": "auto",
    "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2}"#;

fn shipped(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs").join(name).to_str().unwrap().to_string()
}

fn write_config(dir: &std::path::Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

/// `kvprobe run --memory dram --blocks 2 --iterations 1 --report R ARGS` with `env`: (exit code,
/// report, stdout + stderr).
fn run(name: &str, args: &[&str], env: &[(&str, &str)]) -> (i32, Value, String) {
    let d = tmpdir(name);
    let p = d.join("report.json");
    let mut a = vec!["run", "--memory", "dram", "--blocks", "2", "--iterations", "1", "--report", p.to_str().unwrap()];
    a.extend_from_slice(args);
    let (code, out, err) = kvprobe_env(&a, env);
    assert!(!err.contains("panicked"), "{err}");
    (code, read_report(&p), format!("{out}{err}"))
}

/// `kvprobe run --memory dram --report R ARGS` (a scenario: no sweep flags) with `env`: (exit
/// code, report, stdout + stderr).
fn run_load(name: &str, args: &[&str], env: &[(&str, &str)]) -> (i32, Value, String) {
    let d = tmpdir(name);
    let p = d.join("report.json");
    let mut a = vec!["run", "--memory", "dram", "--report", p.to_str().unwrap()];
    a.extend_from_slice(args);
    let (code, out, err) = kvprobe_env(&a, env);
    assert!(!err.contains("panicked"), "{err}");
    (code, read_report(&p), format!("{out}{err}"))
}

/// Units of a region's pool: as many as fit 64 MiB a side, 2 to 16 (docs/geometry.md).
fn units(layers: u64, stride: u64) -> u64 {
    ((64u64 << 20) / (layers * stride)).clamp(2, 16)
}

/// Checks one region entry of a clean run: its layout as worked out by hand, every page
/// compared and clean, the bytes moved those of every page's payload.
fn assert_region(r: &Value, want: (&str, &str, u64, u64, u64, u64, u64), ctx: &str) {
    let (kind, name, layers, page, stride, descriptors, runs_per_page) = want;
    let n = units(layers, stride);
    assert_eq!(r["kind"], kind, "{ctx}: {r}");
    assert_eq!(r["name"], name, "{ctx}: {r}");
    assert_eq!(r["layers"].as_u64(), Some(layers), "{ctx}: {r}");
    assert_eq!(r["page_bytes"].as_u64(), Some(page), "{ctx}: {r}");
    assert_eq!(r["page_stride_bytes"].as_u64(), Some(stride), "{ctx}: {r}");
    assert_eq!(r["descriptors_per_page"].as_u64(), Some(descriptors), "{ctx}: {r}");
    assert_eq!(r["units"].as_u64(), Some(n), "{ctx}: {r}");
    assert_eq!(r["bytes_moved"].as_u64(), Some(layers * n * page), "{ctx}: {r}");
    assert_eq!(r["pages_compared"].as_u64(), Some(layers * n), "{ctx}: {r}");
    assert_eq!(r["runs_compared"].as_u64(), Some(layers * n * runs_per_page), "{ctx}: {r}");
    assert_eq!(r["pages_corrupt"].as_u64(), Some(0), "{ctx}: {r}");
    assert_eq!(r["failures"].as_array().map(Vec::len), Some(0), "{ctx}: {r}");
}

#[test]
fn each_hybrid_family_moves_every_region_clean() {
    let d = tmpdir("regions-families");
    // Kimi-K3 at TP 8 (configs/kimi-k3.json): 69 KDA layers; a rank's slot is conv 3 × (12 heads
    // × 128) channels × 3 taps × 2 bytes = 27 648, recurrent 12 × 128 × 128 × 4 = 786 432: 814 080
    // bytes, padded to the MLA page of 768 tokens × 576 × 2 = 884 736.
    let k3 = shipped("kimi-k3.json");
    let (code, r, out) = run("regions-k3", &["--model-config", &k3, "--tp", "8"], &[]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(r["regions"].as_array().map(Vec::len), Some(1), "{out}");
    assert_region(&r["regions"][0], ("state", "KDA state", 69, 814_080, 884_736, 4, 4), "kimi-k3");
    assert!(out.contains("region:            KDA state (state, TP rank 0): 69 layer(s) x 2 slots"), "{out}");
    // Qwen3-Next at TP 4, WRITE: 36 gated DeltaNet layers; a rank's slot is conv (2 × 16 × 128 +
    // 32 × 128) / 4 = 2048 channels × 3 × 2 = 12 288, temporal 8 × 128 × 128 × 2 = 262 144:
    // 274 432 bytes; attention 1 KV head a rank × 256 × 2 (K, V) × 2 = 1024 bytes a token, so
    // 272 tokens (the multiple of 16 holding it): 278 528.
    let q = shipped("qwen3-next-80b.json");
    let (code, r, out) = run("regions-qwen", &["--model-config", &q, "--tp", "4", "--op", "write"], &[]);
    assert_eq!(code, 0, "{out}");
    assert_region(&r["regions"][0], ("state", "gated DeltaNet state", 36, 274_432, 278_528, 4, 4), "qwen3-next");
    // DeepSeek-V3.2: the indexer K cache, 64 tokens × (128 fp8 + one fp32 scale) = 8448 bytes a
    // block, whole on every rank, one descriptor a block, two row runs (values, scales).
    let v32 = write_config(&d, "v32.json", TINY_V32);
    let (code, r, out) = run("regions-v32", &["--model-config", &v32, "--tp", "8"], &[]);
    assert_eq!(code, 0, "{out}");
    assert_region(&r["regions"][0], ("indexer", "indexer K cache", 4, 8448, 8448, 1, 2), "deepseek-v3.2");
    // Mamba families: Nemotron-H at TP 2 (Mamba2, 8 groups split), Jamba at TP 2 (Mamba1),
    // Granite 4 at TP 1 (Mamba2, one group, head dim from hidden × expand / heads).
    // Nemotron-H: conv (128 × 64 + 2 × 8 × 128) / 2 = 5120 channels × 3 × 2 = 30 720, ssm 64 heads ×
    // 64 × 128 × 4 (fp32) = 2 097 152: 2 127 872; attention 4 heads × 128 × 2 × 2 = 2048 a token:
    // 1040 tokens (multiple of 16): 2 129 920.
    let nem = write_config(&d, "nemotron.json", NEMOTRON);
    let (code, r, out) = run("regions-nemotron", &["--model-config", &nem, "--tp", "2"], &[]);
    assert_eq!(code, 0, "{out}");
    assert_region(&r["regions"][0], ("state", "Mamba2 state", 3, 2_127_872, 2_129_920, 4, 4), "nemotron-h");
    // Jamba: I = 8192, a rank 4096: conv 4096 × 3 × 2 = 24 576, ssm 4096 × 16 × 2 = 131 072:
    // 155 648; attention 4 heads × 128 × 2 × 2 = 2048 a token: 80 tokens: 163 840.
    let jamba = write_config(&d, "jamba.json", JAMBA);
    let (code, r, out) = run("regions-jamba", &["--model-config", &jamba, "--tp", "2"], &[]);
    assert_eq!(code, 0, "{out}");
    assert_region(&r["regions"][0], ("state", "Mamba1 state", 14, 155_648, 163_840, 2, 2), "jamba");
    // Granite 4: I = 3072, 48 heads of 64; conv (3072 + 2 × 128) × 3 × 2 = 19 968, ssm 48 × 64 ×
    // 128 × 2 = 786 432: 806 400; attention 4 heads × 128 × 2 × 2 = 2048 a token: 400 tokens:
    // 819 200.
    let granite = write_config(&d, "granite.json", GRANITE);
    let (code, r, out) = run("regions-granite", &["--model-config", &granite], &[]);
    assert_eq!(code, 0, "{out}");
    assert_region(&r["regions"][0], ("state", "Mamba2 state", 5, 806_400, 819_200, 4, 4), "granite-4");
}

#[test]
fn a_region_left_out_of_the_transfer_fails_by_name() {
    let d = tmpdir("regions-left-out");
    let v32 = write_config(&d, "v32.json", TINY_V32);
    let hook = "KVPROBE_TEST_LEAVE_OUT_REGION";
    let (code, r, out) = run("regions-left-out-ix", &["--model-config", &v32, "--max-failures", "1000"], &[(hook, "indexer")]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("region indexer K cache (indexer, TP rank 0) was not moved: none of its ")
            && out.contains("decode would compute its 4 layer(s) from zeros"),
        "{out}"
    );
    let g = &r["regions"][0];
    // 4 layers × 16 blocks, each with two runs still holding decode's poison.
    assert_eq!(
        (g["bytes_moved"].as_u64(), g["pages_compared"].as_u64(), g["pages_corrupt"].as_u64()),
        (Some(0), Some(64), Some(64))
    );
    let f = g["failures"].as_array().unwrap();
    assert_eq!(f.len(), 128, "{g}");
    assert!(f.iter().all(|f| f["class"] == "unwritten"), "{g}");
    // The attention pages moved: the failure is the region's alone.
    assert_eq!(r["summary"]["blocks_corrupt"].as_u64(), Some(0), "{out}");
    assert_eq!(r["outcome"]["exit_code"].as_u64(), Some(1), "{out}");
    // By name, on a state region.
    let kimi = write_config(&d, "kimi.json", TINY_KIMI);
    let (code, _, out) = run("regions-left-out-kda", &["--model-config", &kimi], &[(hook, "KDA state")]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("region KDA state (state, TP rank 0) was not moved"), "{out}");
}

#[test]
fn equal_tp_sizes_move_each_ranks_state() {
    // Tiny Kimi at --prefill-tp 8 --decode-tp 8: each engine raises its block size from its
    // rank's slot: 2 KDA heads a rank, conv 3 × 256 × 3 × 2 = 4608, recurrent 2 × 128 × 128 × 4
    // = 131 072: 135 680 bytes; MLA 1152 bytes a token, aligned to 128 tokens: 147 456.
    let d = tmpdir("regions-tp");
    let kimi = write_config(&d, "kimi.json", TINY_KIMI);
    let (code, r, out) = run("regions-tp8", &["--model-config", &kimi, "--prefill-tp", "8", "--decode-tp", "8"], &[]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(r["config"]["geometry"]["block_size"].as_u64(), Some(128), "{out}");
    let regions = r["regions"].as_array().unwrap();
    assert_eq!(regions.iter().map(|g| g["rank"].as_u64().unwrap()).collect::<Vec<_>>(), (0..8).collect::<Vec<_>>());
    for g in regions {
        assert_region(g, ("state", "KDA state", 6, 135_680, 147_456, 4, 4), "tiny kimi tp 8");
    }
    // Faults on every rank of equal TP sizes: each rank's region plants its own and finds them.
    let (code, r, out) = run(
        "regions-tp2-inject",
        &["--model-config", &kimi, "--prefill-tp", "2", "--decode-tp", "2", "--inject", "torn:2@state", "--self-test"],
        &[],
    );
    assert_eq!(code, 0, "{out}");
    for g in r["regions"].as_array().unwrap() {
        assert_eq!((g["injections_planted"].as_u64(), g["injections_detected"].as_u64()), (Some(2), Some(2)), "{g}");
    }
}

/// The region pass crosses the peer protocol as the attention sweep does: prefill's region
/// pages live with prefill — the child of `--decode-process`, or `kvprobe serve` on loopback —
/// and decode asks for them plan by plan (READ and WRITE, equal and unequal TP, planted faults,
/// a region left out), with the same bytes and pages as in one process.
#[test]
fn regions_cross_the_peer_protocol_to_a_child_and_to_serve() {
    let d = tmpdir("regions-peer");
    let kimi = write_config(&d, "kimi.json", TINY_KIMI);
    // --decode-process, 8 → 4 READ: the sizes of the one-process test above.
    let (code, r, out) =
        run("regions-dp-8-4", &["--model-config", &kimi, "--prefill-tp", "8", "--decode-tp", "4", "--decode-process"], &[]);
    assert_eq!(code, 0, "{out}");
    let regions = r["regions"].as_array().unwrap();
    assert_eq!(regions.len(), 4, "{out}");
    for (rank, g) in regions.iter().enumerate() {
        assert_eq!(g["prefill_ranks"], serde_json::json!([2 * rank, 2 * rank + 1]), "{g}");
        assert_region(g, ("state", "KDA state", 6, 271_360, 294_912, 8, 4), "--decode-process 8 -> 4");
    }
    // --decode-process, TP 2 WRITE (prefill's child posts), every class planted: each detected
    // as predicted, nothing else corrupt.
    let (code, r, out) = run(
        "regions-dp-write-inject",
        &[
            "--model-config",
            &kimi,
            "--prefill-tp",
            "2",
            "--decode-tp",
            "2",
            "--op",
            "write",
            "--decode-process",
            "--self-test",
            "--inject",
            "bitflip@state",
            "--inject",
            "drop@state",
            "--inject",
            "misroute@state",
            "--inject",
            "stale@state",
            "--inject",
            "torn@state",
        ],
        &[],
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(r["outcome"]["status"], "self-test-passed", "{out}");
    for g in r["regions"].as_array().unwrap() {
        assert_eq!(
            (g["injections_planted"].as_u64(), g["injections_detected"].as_u64(), g["unexpected_failures"].as_u64()),
            (Some(5), Some(5), Some(0)),
            "{g}"
        );
    }
    // A region left out (the hook in decode's process; the child inherits it and ignores it).
    for op in ["read", "write"] {
        let (code, r, out) = run(
            &format!("regions-dp-left-out-{op}"),
            &["--model-config", &kimi, "--decode-process", "--op", op],
            &[("KVPROBE_TEST_LEAVE_OUT_REGION", "state")],
        );
        assert_eq!(code, 1, "{op}: {out}");
        assert!(out.contains("region KDA state (state, TP rank 0) was not moved"), "{op}: {out}");
        assert_eq!(r["regions"][0]["bytes_moved"].as_u64(), Some(0), "{op}: {out}");
    }
    // A node pair on loopback: serve pinned to the same hybrid model (its block size follows the
    // run's TP, its default block count the run's), TP 8 → 8 WRITE; serve names every plan it
    // served.
    let serve = crate::pair::Serve::start(&["--model-config", &kimi]);
    let (code, r, out) = crate::pair::run_peer(
        &serve.addr.clone(),
        &[
            "--model-config",
            &kimi,
            "--blocks",
            "2",
            "--iterations",
            "1",
            "--prefill-tp",
            "8",
            "--decode-tp",
            "8",
            "--op",
            "write",
        ],
    );
    let (scode, sout, _) = serve.wait();
    assert_eq!((code, scode), (0, 0), "{out}\n{sout}");
    let regions = r["regions"].as_array().unwrap();
    assert_eq!(regions.len(), 8, "{out}");
    for g in regions {
        assert_region(g, ("state", "KDA state", 6, 135_680, 147_456, 4, 4), "--peer tp 8");
    }
    for rank in 0..8 {
        let want = format!(
            "region KDA state (state, TP rank {rank}): 6 layer(s) x {} page(s) served from 1 prefill rank(s)",
            units(6, 147_456)
        );
        assert!(sout.contains(&want), "{want}: {sout}");
    }
}

/// Under request load (`run --scenario`, issue 36 item 6) every request owns one state slot
/// on each engine and decode READs it with the request's blocks. Worked out by hand for the
/// small Kimi-Linear shape at TP 8 (a rank's slot: conv 3 × 2 heads × 128 × 3 taps × 2 bytes =
/// 4608, recurrent 2 × 128 × 128 × 4 = 131 072; 135 680 bytes, padded to 128 tokens × 576 × 2
/// = 147 456): slots = --concurrency 16 (6 × 16 pages fit 256 MiB), every verified request's 6
/// pages compared (4 runs each: conv q, k, v, recurrent), 6 × 135 680 bytes moved a request.
#[test]
fn scenarios_move_each_requests_state_slot_with_its_blocks() {
    let d = tmpdir("regions-scenario");
    let kimi = write_config(&d, "kimi.json", TINY_KIMI);
    let check_lane = |r: &Value, out: &str, ctx: &str| {
        let verified = r["scenario"]["requests_verified"].as_u64().unwrap();
        assert!(verified > 0, "{ctx}: {out}");
        let g = &r["regions"][0];
        assert_eq!(r["regions"].as_array().map(Vec::len), Some(1), "{ctx}: {out}");
        assert_eq!(
            (g["kind"].as_str(), g["name"].as_str(), g["unit"].as_str()),
            (Some("state"), Some("KDA state"), Some("slot")),
            "{ctx}: {g}"
        );
        assert_eq!(
            (g["units"].as_u64(), g["page_bytes"].as_u64(), g["page_stride_bytes"].as_u64(), g["descriptors_per_page"].as_u64()),
            (Some(16), Some(135_680), Some(147_456), Some(4)),
            "{ctx}: {g}"
        );
        assert_eq!(g["pages_compared"].as_u64(), Some(verified * 6), "{ctx}: {g}");
        assert_eq!(g["runs_compared"].as_u64(), Some(verified * 6 * 4), "{ctx}: {g}");
        assert_eq!(g["bytes_moved"].as_u64(), Some(verified * 6 * 135_680), "{ctx}: {g}");
        g.clone()
    };
    // nixl-only and stacked (the tier saves and loads attention blocks), in one process.
    for (sc, extra) in [("nixl-only", &[][..]), ("stacked", &["--race", "save-after-free=fenced"][..])] {
        let mut a = vec!["--model-config", kimi.as_str(), "--tp", "8", "--scenario", sc, "--requests", "24", "--seed", "5"];
        a.extend_from_slice(extra);
        let bundle = d.join(format!("{sc}.tar.gz"));
        a.extend_from_slice(&["--bundle", bundle.to_str().unwrap()]);
        let (code, r, out) = run_load(&format!("regions-scenario-{sc}"), &a, &[]);
        assert_eq!(code, 0, "{sc}: {out}");
        let g = check_lane(&r, &out, sc);
        assert_eq!((g["pages_corrupt"].as_u64(), g["unexpected_failures"].as_u64()), (Some(0), Some(0)), "{sc}: {g}");
        let (c, o, e) = kvprobe(&["report", "check", bundle.to_str().unwrap()]);
        assert_eq!(c, 0, "{sc}: {o}{e}");
    }
    // Push mode (--op write): prefill WRITEs each request's state into the slot decode names;
    // with decode-abort-free unfenced (decode frees an aborted request's blocks while its WRITE
    // is pending) the late WRITEs corrupt attention blocks, attributed, while the aborted
    // requests' state slots are held until their WRITE landed: no state page is wrong.
    let (code, r, out) = run_load(
        "regions-scenario-push",
        &["--model-config", &kimi, "--tp", "8", "--scenario", "nixl-only", "--op", "write", "--requests", "24"],
        &[],
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(check_lane(&r, &out, "push")["pages_corrupt"].as_u64(), Some(0), "{out}");
    let (code, r, out) = run_load(
        "regions-scenario-push-abort",
        &[
            "--model-config",
            &kimi,
            "--tp",
            "8",
            "--scenario",
            "nixl-only",
            "--op",
            "write",
            "--race",
            "decode-abort-free",
            "--requests",
            "200",
            "--seed",
            "3",
        ],
        &[],
    );
    assert_eq!(code, 1, "{out}");
    let race = r["scenario"]["races"].as_array().unwrap().iter().find(|o| o["mechanism"] == "decode-abort-free").unwrap();
    assert_eq!(race["verdict"], "detected", "{out}");
    assert_eq!(r["scenario"]["unexplained_corrupt"].as_u64(), Some(0), "{out}");
    let g = check_lane(&r, &out, "push, decode-abort-free");
    assert_eq!((g["pages_corrupt"].as_u64(), g["unexpected_failures"].as_u64()), (Some(0), Some(0)), "{g}");
    // Decode READs the next prefill slot for two requests (under --lockstep, the READ completes
    // within decode's step): every run of their 6 pages holds another request's state or a
    // slot's genesis: misplaced, unexplained, exit 1, each failure naming its request.
    let bundle = d.join("misroute.tar.gz");
    let (code, r, out) = run_load(
        "regions-scenario-misroute",
        &[
            "--model-config",
            &kimi,
            "--tp",
            "8",
            "--scenario",
            "nixl-only",
            "--lockstep",
            "--requests",
            "12",
            "--seed",
            "5",
            "--bundle",
            bundle.to_str().unwrap(),
        ],
        &[("KVPROBE_TEST_FAULT", "state-misroute:2")],
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("region KDA state (state, TP rank 0): 12 of"), "{out}");
    let g = check_lane(&r, &out, "misroute");
    assert_eq!((g["pages_corrupt"].as_u64(), g["unexpected_failures"].as_u64()), (Some(12), Some(48)), "{g}");
    let failures = g["failures"].as_array().unwrap();
    assert_eq!(failures.len(), 48, "{g}");
    let requests: std::collections::BTreeSet<u64> = failures.iter().map(|f| f["request"].as_u64().unwrap()).collect();
    assert_eq!(requests.len(), 2, "{g}");
    for f in failures {
        assert_eq!(f["class"], "misplaced", "{f}");
        assert_ne!(f["observed"]["block"], f["id"], "{f}");
        // docs/fingerprint.md "Region rows": a request's state id, worked out here.
        let req = f["request"].as_u64().unwrap() as u32;
        let id = req.wrapping_mul(0x9E37_79B1) ^ ((5u64 ^ 0x5354_4154_4500_0000) as u32).rotate_left(7);
        assert_eq!(f["id"].as_u64(), Some(id as u64), "{f}");
    }
    let (c, o, e) = kvprobe(&["report", "check", bundle.to_str().unwrap()]);
    assert_eq!(c, 0, "{o}{e}");
    // Each count of the lane edited (the manifest made to agree) is a disagreement naming it.
    {
        use crate::dump::{check, edit_json, retar, untar};
        let files = untar(&bundle);
        type Edit = Box<dyn Fn(&mut Value)>;
        let cases: Vec<(&str, Edit, &str)> = vec![
            ("units", Box::new(|v| v["regions"][0]["units"] = 3.into()), "units is 3, but the run's configuration gives 16"),
            (
                "unexpected",
                Box::new(|v| v["regions"][0]["unexpected_failures"] = 1_000_000_000_000u64.into()),
                "48 failure(s) listed on 12 page(s), unexpected_failures 1000000000000, pages_corrupt 12",
            ),
            (
                "pages-corrupt",
                Box::new(|v| v["regions"][0]["pages_corrupt"] = 1.into()),
                "48 failure(s) listed on 12 page(s), unexpected_failures 48, pages_corrupt 1",
            ),
            ("id", Box::new(|v| v["regions"][0]["failures"][0]["id"] = 7.into()), "failures[0]: id 7, but request"),
            ("pages", Box::new(|v| v["regions"][0]["pages_compared"] = 6.into()), "pages_compared is 6, but"),
            ("moved", Box::new(|v| v["regions"][0]["bytes_moved"] = 5.into()), "bytes_moved is 5, but"),
            (
                "injected",
                Box::new(|v| v["regions"][0]["failures"][3]["injected"] = true.into()),
                "failures[3]: marked injected, but nothing is planted",
            ),
        ];
        for (case, edit, line) in cases {
            let e = d.join(format!("tampered-{case}.tgz"));
            retar(&e, &edit_json(&files, "report.json", &*edit));
            let (code, out, err) = check(&e);
            assert_eq!(code, 1, "{case}: {out}{err}");
            assert!(out.contains(line), "{case}: {out}");
        }
    }
    // The state lane left out of the transfer: every page of every request poison, exit 1
    // naming the region.
    let (code, r, out) = run_load(
        "regions-scenario-left-out",
        &["--model-config", &kimi, "--tp", "8", "--scenario", "stacked", "--requests", "8"],
        &[("KVPROBE_TEST_LEAVE_OUT_REGION", "state")],
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("region KDA state (state, TP rank 0) was not moved: none of its bytes arrived"), "{out}");
    let g = &r["regions"][0];
    assert_eq!(g["bytes_moved"].as_u64(), Some(0), "{g}");
    assert_eq!(g["pages_corrupt"], g["pages_compared"], "{g}");
    assert!(g["failures"].as_array().unwrap().iter().all(|f| f["class"] == "unwritten"), "{g}");
    // Across a node pair on loopback: serve builds prefill's lanes from the same configuration.
    let serve = crate::pair::Serve::start(&["--model-config", &kimi, "--tp", "8"]);
    let (code, r, out) = crate::pair::run_peer(
        &serve.addr.clone(),
        &["--model-config", &kimi, "--tp", "8", "--scenario", "nixl-only", "--requests", "12"],
    );
    let (scode, sout, _) = serve.wait();
    assert_eq!((code, scode), (0, 0), "{out}\n{sout}");
    let g = check_lane(&r, &out, "--peer");
    assert_eq!(g["pages_corrupt"].as_u64(), Some(0), "{g}");
    // Serve pinned to another state layout (KDA heads of 64, a conv kernel of 2: the same
    // attention pages) or another --tp refuses the run by name, as for the attention geometry.
    let other = write_config(
        &d,
        "kimi-b.json",
        &TINY_KIMI.replace("\"head_dim\": 128, \"short_conv_kernel_size\": 4", "\"head_dim\": 64, \"short_conv_kernel_size\": 2"),
    );
    assert!(std::fs::read_to_string(&other).unwrap().contains("\"head_dim\": 64, \"short_conv_kernel_size\": 2"));
    for (serve_args, want) in [
        (vec!["--model-config", other.as_str(), "--tp", "8"], "model.kv.hybrid."),
        (vec!["--model-config", kimi.as_str(), "--tp", "4"], "tp: serve --tp 4, run --tp 8"),
    ] {
        let serve = crate::pair::Serve::start(&serve_args);
        let (code, _, out) = crate::pair::run_peer(
            &serve.addr.clone(),
            &["--model-config", &kimi, "--tp", "8", "--scenario", "nixl-only", "--requests", "4"],
        );
        let (scode, sout, _) = serve.wait();
        assert_eq!((code, scode), (2, 2), "{serve_args:?}: {out}\n{sout}");
        assert!(out.contains(want), "{serve_args:?}: {out}");
    }
}

/// Prefill TP above decode TP with replicated KV heads: vLLM refuses it for attention-only
/// models and accepts it for models with state layers (PR #37635), a decode rank reading each
/// of its heads from the first of its target ranks that holds it. Worked out by hand for 2 KV
/// heads: at TP 8 ranks 0–3 hold head 0 and 4–7 head 1.
#[test]
fn prefill_tp_above_decode_tp_with_replicated_heads_runs_for_state_models() {
    use kvprobe::pairing::tp::{Source, Tp};
    let tp = |decode, state| Tp { prefill: 8, decode, total_kv_heads: 2, mla: false, state };
    // 8 → 1: head 0 from rank 0, head 1 from rank 4 (the first holder of each among 0..8).
    assert!(tp(1, true).check().is_ok());
    assert_eq!(
        tp(1, true).sources(0),
        vec![
            Source { prefill_rank: 0, heads: 0..1, src_head: 0, dst_head: 0 },
            Source { prefill_rank: 4, heads: 1..2, src_head: 0, dst_head: 1 },
        ]
    );
    // 8 → 4: decode rank d holds head d / 2 and reads it from rank 2d alone (2d + 1 holds the same).
    for d in 0..4 {
        assert_eq!(
            tp(4, true).sources(d),
            vec![Source { prefill_rank: 2 * d, heads: d / 2..d / 2 + 1, src_head: 0, dst_head: 0 }]
        );
    }
    let e = tp(4, false).check().unwrap_err();
    assert!(e.contains("_validate_remote_agent_handshake refuses it for a model without state layers"), "{e}");
    // Qwen3-Next (2 KV heads, 12 attention layers of 48), both engines at block size 544, HND
    // (heads split differently on the two sides): clean, and planted faults found as predicted.
    let q = shipped("qwen3-next-80b.json");
    let args = ["--model-config", &q, "--prefill-tp", "8", "--decode-tp", "1", "--block-size", "544", "--layout", "hnd"];
    let (code, r, out) = run("regions-replicated-8-1", &args, &[]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(r["config"]["tp"]["state"], true, "{out}");
    // 12 layers × K, V × 2 blocks, each 544 tokens × 2 heads × 256 × 2 bytes.
    assert_eq!(r["summary"]["slices_compared"].as_u64(), Some(12 * 2 * 2), "{out}");
    assert_eq!(r["summary"]["bytes_compared"].as_u64(), Some(48 * 544 * 2 * 256 * 2), "{out}");
    let mut a = args.to_vec();
    a.extend(["--inject", "bitflip", "--inject", "misroute", "--self-test"]);
    let (code, r, out) = run("regions-replicated-8-1-inject", &a, &[]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(r["outcome"]["status"], "self-test-passed", "{out}");
    // An attention-only model of the same heads is refused.
    let (code, _, err) = kvprobe(&["run", "--memory", "dram", "--preset", "llama3-8b", "--prefill-tp", "16", "--decode-tp", "8"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("for a model without state layers"), "{err}");
}

/// Unequal TP sizes: each engine raises its block size from its own rank's slot, and each
/// decode rank reads the rows of its chunk from every prefill rank holding part of them (a
/// section every rank holds whole, from the first).
#[test]
fn unequal_tp_sizes_read_each_chunk_from_the_ranks_that_hold_it() {
    let d = tmpdir("regions-unequal");
    let kimi = write_config(&d, "kimi.json", TINY_KIMI);
    // 8 → 4: decode's slot at TP 4 is conv 3 × (4 heads × 128) × 3 × 2 = 9216 + recurrent 4 × 128
    // × 128 × 4 = 262 144: 271 360 bytes, 256 tokens of MLA (2 × 128 ≥ 271 360 / 1152): 294 912.
    // Each decode rank's four sections come half from prefill rank 2d, half from 2d + 1.
    let (code, r, out) = run("regions-8-4", &["--model-config", &kimi, "--prefill-tp", "8", "--decode-tp", "4"], &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("decode at --decode-tp 4 raises its block size to 256 tokens"), "{out}");
    assert_eq!(r["config"]["geometry"]["block_size"].as_u64(), Some(128), "{out}");
    assert_eq!(r["config"]["decode_geometry"]["block_size"].as_u64(), Some(256), "{out}");
    let regions = r["regions"].as_array().unwrap();
    assert_eq!(regions.len(), 4);
    for (rank, g) in regions.iter().enumerate() {
        let rank = rank as u64;
        assert_eq!(g["rank"].as_u64(), Some(rank));
        assert_eq!(g["prefill_ranks"], serde_json::json!([2 * rank, 2 * rank + 1]), "{g}");
        assert_region(g, ("state", "KDA state", 6, 271_360, 294_912, 8, 4), "8 -> 4");
    }
    // 4 → 8: decode rank d's quarter-chunks all lie in prefill rank d / 2's half.
    let (code, r, out) = run("regions-4-8", &["--model-config", &kimi, "--prefill-tp", "4", "--decode-tp", "8"], &[]);
    assert_eq!(code, 0, "{out}");
    for (rank, g) in r["regions"].as_array().unwrap().iter().enumerate() {
        assert_eq!(g["prefill_ranks"], serde_json::json!([rank / 2]), "{g}");
        assert_region(g, ("state", "KDA state", 6, 135_680, 147_456, 4, 4), "4 -> 8");
    }
    // Granite 4 (Mamba2, one group: B and C whole on every rank) 4 → 2: decode rank 1 reads its
    // half of x and of the ssm state from prefill ranks 2 and 3, and B and C from rank 0.
    let granite = write_config(&d, "granite.json", GRANITE);
    let (code, r, out) = run(
        "regions-granite-4-2",
        &["--model-config", &granite, "--layout", "hnd", "--prefill-tp", "4", "--decode-tp", "2"],
        &[],
    );
    assert_eq!(code, 0, "{out}");
    let g = &r["regions"][1];
    assert_eq!(g["prefill_ranks"], serde_json::json!([0, 2, 3]), "{g}");
    assert_eq!((g["descriptors_per_page"].as_u64(), g["pages_corrupt"].as_u64()), (Some(6), Some(0)), "{g}");
}

/// Faults planted in regions read between unequal TP sizes: each hits one prefill rank's page
/// and descriptors, and decode finds exactly the bytes predicted for it. 2 → 1 (two sources
/// for the decode rank; each of its 4 runs half from each): a page of one source dropped,
/// stale or misrouted changes all 4 runs of a decode unit (misroute: of two units); 1 → 2 (one
/// source whose page holds twice decode's rows): as between equal sizes, the whole unit's runs
/// are unwritten, stale or misplaced. (8 → 4 and 4 → 8 are the same cuts, four times.) A bundle of each is consistent under `report check`.
#[test]
fn region_faults_between_unequal_tp_sizes_are_detected_as_predicted() {
    let d = tmpdir("regions-unequal-inject");
    let kimi = write_config(&d, "kimi.json", TINY_KIMI);
    for (p, dtp) in [("2", "1"), ("1", "2")] {
        for class in ["bitflip", "drop", "misroute", "stale", "torn"] {
            let ctx = format!("{p} -> {dtp} {class}");
            let dump = d.join(format!("dump-{p}-{dtp}-{class}"));
            let inj = format!("{class}:2@state");
            let (code, r, out) = run(
                &format!("regions-unequal-{class}"),
                &[
                    "--model-config",
                    &kimi,
                    "--prefill-tp",
                    p,
                    "--decode-tp",
                    dtp,
                    "--inject",
                    &inj,
                    "--self-test",
                    "--dump",
                    dump.to_str().unwrap(),
                ],
                &[],
            );
            assert_eq!(code, 0, "{ctx}: {out}");
            let ranks = dtp.parse::<usize>().unwrap();
            let state: Vec<&Value> = r["regions"].as_array().unwrap().iter().filter(|g| g["kind"] == "state").collect();
            assert_eq!(state.len(), ranks, "{ctx}");
            for g in state {
                assert_eq!(
                    (g["injections_planted"].as_u64(), g["injections_detected"].as_u64()),
                    (Some(2), Some(2)),
                    "{ctx}: {g}"
                );
                assert_eq!(g["unexpected_failures"].as_u64(), Some(0), "{ctx}: {g}");
                for j in g["injections"].as_array().unwrap() {
                    let classes: Vec<&str> =
                        j["predicted"].as_array().unwrap().iter().map(|p| p["class"].as_str().unwrap()).collect();
                    let count = |c: &str| classes.iter().filter(|x| **x == c).count();
                    let two = p == "2";
                    match class {
                        "bitflip" => assert_eq!(classes, ["bitflip"], "{ctx}: {j}"),
                        "torn" => assert_eq!(classes, ["torn"], "{ctx}: {j}"),
                        // Half of each run from the page left out: the other half arrived.
                        "drop" if two => assert_eq!(classes.len(), 4, "{ctx}: {j}"),
                        "drop" => assert_eq!(count("unwritten"), 4, "{ctx}: {j}"),
                        "stale" if two => assert_eq!(classes.len(), 4, "{ctx}: {j}"),
                        "stale" => assert_eq!(count("stale"), 4, "{ctx}: {j}"),
                        "misroute" if two => assert_eq!(classes.len(), 8, "{ctx}: {j}"),
                        _ => assert_eq!((count("misplaced"), count("unwritten")), (4, 4), "{ctx}: {j}"),
                    }
                }
                if class == "bitflip" {
                    assert!(g["failures"].as_array().unwrap().iter().all(|f| f["bit_flips"] == 1), "{ctx}: {g}");
                }
            }
            let bundle = d.join(format!("b-{p}-{dtp}-{class}.tgz"));
            let rp = d.join("regions-report.json");
            std::fs::write(&rp, serde_json::to_vec(&r).unwrap()).unwrap();
            let (bc, bo, be) = kvprobe(&[
                "bundle",
                "--report",
                rp.to_str().unwrap(),
                "--dump",
                dump.to_str().unwrap(),
                "-o",
                bundle.to_str().unwrap(),
            ]);
            assert_eq!(bc, 0, "{ctx}: {bo}{be}");
            let (cc, co, ce) = kvprobe(&["report", "check", bundle.to_str().unwrap()]);
            assert_eq!(cc, 0, "{ctx}: {co}{ce}");
            assert!(co.contains("corrupt region page(s), as reported"), "{ctx}: {co}");
        }
    }
}

#[test]
fn forms_that_do_not_move_regions_yet_refuse_hybrid_models() {
    let d = tmpdir("regions-refused");
    let kimi = write_config(&d, "kimi.json", TINY_KIMI);
    let base = ["--memory", "dram", "--model-config", kimi.as_str()];
    for (extra, how) in [
        (&["run", "--scenario", "tier-only"][..], "in a tier-only scenario"),
        (&["run", "--scenario", "stacked", "--host-staging"][..], "with --host-staging"),
        (&["ab"][..], "in this command"),
    ] {
        let mut a = vec![extra[0]];
        a.extend_from_slice(&base);
        a.extend_from_slice(&extra[1..]);
        let (code, out, err) = kvprobe(&a);
        assert_eq!(code, 2, "{a:?}: {out}{err}");
        assert!(err.contains("KDA state (6 layers)") && err.contains(&format!("does not move it {how}")), "{a:?}: {err}");
    }
    // Under request load: an indexer region is not moved yet, and region faults are the sweep's.
    let v32 = write_config(&d, "v32.json", TINY_V32);
    for (a, want) in [
        (
            vec!["run", "--memory", "dram", "--model-config", v32.as_str(), "--scenario", "nixl-only"],
            "region indexer K cache (indexer, 4 layers) is not moved under request load",
        ),
        (
            vec![
                "run",
                "--memory",
                "dram",
                "--model-config",
                kimi.as_str(),
                "--scenario",
                "nixl-only",
                "--inject",
                "bitflip@state",
            ],
            "--inject bitflip@state: faults in a hybrid model's regions are planted by the sweep",
        ),
    ] {
        let (code, out, err) = kvprobe(&a);
        assert_eq!(code, 2, "{a:?}: {out}{err}");
        assert!(err.contains(want), "{a:?}: {err}");
    }
    // A state layer a region row's 12-bit layer field cannot name (Jamba of 4104 layers: state
    // at 4097..4103 would tag as 1..7), a --block-size of 0, and a test hook naming no region.
    let jamba = write_config(
        &d,
        "jamba-4104.json",
        r#"{"model_type":"jamba","num_hidden_layers":4104,"hidden_size":64,"num_attention_heads":1,"num_key_value_heads":1,
            "attn_layer_period":8,"attn_layer_offset":4,"mamba_d_state":16,"mamba_d_conv":4,"mamba_expand":1}"#,
    );
    for (args, env, want) in [
        (vec![jamba.as_str()], vec![], "layer 4103 is beyond the 4095"),
        (vec![kimi.as_str(), "--block-size", "0"], vec![], "--block-size must be at least 1"),
        (
            vec![kimi.as_str()],
            vec![("KVPROBE_TEST_LEAVE_OUT_REGION", "KDA")],
            "names no region of this run (its regions: KDA state (state))",
        ),
    ] {
        let mut a = vec!["run", "--memory", "dram", "--blocks", "2", "--model-config"];
        a.extend(args);
        let (code, out, err) = kvprobe_env(&a, &env);
        assert_eq!(code, 2, "{a:?}: {out}{err}");
        assert!(err.contains(want), "{a:?}: {err}");
    }
}

/// `report check` re-derives a bundle's regions from its configuration: the bundle of a run
/// that left a region out is consistent as written, and each claim edited (the manifest made to
/// agree) is a disagreement naming it.
#[test]
fn report_check_re_derives_each_regions_layout_and_failures() {
    use crate::dump::{check, edit_json, retar, untar};
    let d = tmpdir("regions-check");
    let v32 = write_config(&d, "v32.json", TINY_V32);
    let b = d.join("b.tgz");
    let (code, out, err) = kvprobe_env(
        &[
            "run",
            "--memory",
            "dram",
            "--model-config",
            &v32,
            "--blocks",
            "2",
            "--iterations",
            "1",
            "--bundle",
            b.to_str().unwrap(),
        ],
        &[("KVPROBE_TEST_LEAVE_OUT_REGION", "indexer")],
    );
    assert_eq!(code, 1, "{out}{err}");
    let (code, out, _) = check(&b);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("no corrupt slice, as reported; 64 corrupt region page(s), as reported"), "{out}");
    let files = untar(&b);
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "units",
            Box::new(|v| v["regions"][0]["units"] = 3.into()),
            "regions[0] (indexer K cache): units is 3, but the run's configuration gives 16",
        ),
        (
            "stride",
            Box::new(|v| v["regions"][0]["page_stride_bytes"] = 9000.into()),
            "page_stride_bytes is 9000, but the run's configuration gives 8448",
        ),
        ("id", Box::new(|v| v["regions"][0]["failures"][0]["id"] = 7.into()), "failures[0]: id 7, but the plan puts logical id"),
        (
            "layer",
            Box::new(|v| v["regions"][0]["failures"][1]["layer"] = 9.into()),
            "failures[1]: layer 9 is not one of the region's",
        ),
        ("unit", Box::new(|v| v["regions"][0]["failures"][2]["unit"] = 16.into()), "failures[2]: unit 16 is not one of its 16"),
        (
            "clean",
            Box::new(|v| {
                v["outcome"]["status"] = "clean".into();
                v["outcome"]["exit_code"] = 0.into();
            }),
            "but 64 region page(s) are corrupt",
        ),
        // Corrupt with every attention page clean: the corruption is the regions', which the
        // report must then list.
        (
            "missing",
            Box::new(|v| v["regions"] = serde_json::json!([])),
            "0 region(s) listed, but the run's configuration plans 1 and its attention pages were clean",
        ),
        ("moved", Box::new(|v| v["regions"][0]["bytes_moved"] = 5.into()), "bytes_moved is 5, but its descriptors move 540672"),
        // A region that moved nothing cannot be clean, whatever else the report is made to say.
        (
            "left-out-called-clean",
            Box::new(|v| {
                v["regions"][0]["pages_corrupt"] = 0.into();
                v["regions"][0]["failures"] = serde_json::json!([]);
                v["outcome"] = serde_json::json!({"exit_code": 0, "status": "clean", "error": null});
            }),
            "bytes_moved is 0, but its descriptors move 540672",
        ),
        (
            "runs",
            Box::new(|v| v["regions"][0]["runs_compared"] = 1.into()),
            "runs_compared is 1, but its pages hold 128 row runs",
        ),
        (
            "unit-kind",
            Box::new(|v| v["regions"][0]["unit"] = "slot".into()),
            "unit is slot, but the run's configuration gives \"block\"",
        ),
        ("seconds", Box::new(|v| v["regions"][0]["seconds"] = (-1).into()), "seconds is -1, not a duration"),
        (
            "planted",
            Box::new(|v| v["regions"][0]["injections_planted"] = 3.into()),
            "injections_planted is 3, but the run's configuration plants 0",
        ),
    ];
    for (case, edit, line) in cases {
        let e = d.join(format!("{case}.tgz"));
        retar(&e, &edit_json(&files, "report.json", &*edit));
        let (code, out, err) = check(&e);
        assert_eq!(code, 1, "{case}: {out}{err}");
        assert!(out.contains(line), "{case}: {out}");
    }
    // `report show` of a report whose region name carries a terminal escape prints it escaped.
    let mut v: Value = serde_json::from_slice(&files.iter().find(|f| f.0 == "kvprobe-bundle/report.json").unwrap().1).unwrap();
    v["regions"][0]["name"] = "X\u{1b}[2JY".into();
    let shown = d.join("escaped.json");
    std::fs::write(&shown, serde_json::to_vec(&v).unwrap()).unwrap();
    let (_, out, _) = kvprobe(&["report", "show", shown.to_str().unwrap()]);
    assert!(out.contains("region:            X\\u{1b}[2JY (indexer") && !out.contains('\u{1b}'), "{out}");
    // A self-test's bundle with faults planted in a region is consistent as written: its bytes
    // moved are those of the faulted descriptors, its corrupt pages the faults'.
    for class in ["misroute:2", "torn:2", "drop"] {
        let b = d.join(format!("inj-{class}.tgz"));
        let inj = format!("{class}@indexer");
        let (code, out, err) = kvprobe(&[
            "run",
            "--memory",
            "dram",
            "--model-config",
            &v32,
            "--blocks",
            "2",
            "--iterations",
            "1",
            "--inject",
            &inj,
            "--self-test",
            "--bundle",
            b.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{inj}: {out}{err}");
        let (code, out, err) = check(&b);
        assert_eq!(code, 0, "{inj}: {out}{err}");
        assert!(out.contains("corrupt region page(s), as reported"), "{inj}: {out}");
    }
    // The injections and failures of a region are re-derived and re-counted: two misroutes on
    // the indexer predict 2 runs misplaced and 2 unwritten each (values and scales of the two
    // decode units), 8 failures on 4 pages, all injected.
    let files = untar(&d.join("inj-misroute:2.tgz"));
    let g = |v: &Value| v["regions"][0].clone();
    let base: Value = serde_json::from_slice(&files.iter().find(|f| f.0 == "kvprobe-bundle/report.json").unwrap().1).unwrap();
    assert_eq!(
        (g(&base)["failures"].as_array().unwrap().len(), g(&base)["pages_corrupt"].as_u64()),
        (8, Some(4)),
        "{}",
        g(&base)
    );
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "detected-count",
            Box::new(|v| v["regions"][0]["injections_detected"] = 1.into()),
            "injections_detected is 1, but 2 injection(s) are marked detected",
        ),
        (
            "detected-flag",
            Box::new(|v| v["regions"][0]["injections"][0]["detected"] = false.into()),
            "injections[0].detected is false, but all of its predicted runs are failures marked injected",
        ),
        (
            "class",
            Box::new(|v| {
                let f =
                    v["regions"][0]["failures"].as_array_mut().unwrap().iter_mut().find(|f| f["class"] == "misplaced").unwrap();
                f["class"] = "stale".into();
            }),
            "is marked injected as stale, but its fault predicts \"misplaced\" there",
        ),
        (
            "injected-flag",
            Box::new(|v| v["regions"][0]["failures"][0]["injected"] = false.into()),
            "unexpected_failures is 0, but 1 failure(s) are not marked injected",
        ),
        (
            "pages",
            Box::new(|v| v["regions"][0]["pages_corrupt"] = 3.into()),
            "pages_corrupt is 3, but the failures name 4 page(s)",
        ),
        (
            "dropped-failure",
            Box::new(|v| {
                v["regions"][0]["failures"].as_array_mut().unwrap().pop();
            }),
            "but not all of its predicted runs are failures marked injected",
        ),
        (
            "predicted-unit",
            Box::new(|v| {
                let u = v["regions"][0]["injections"][0]["predicted"][0]["unit"].as_u64().unwrap();
                v["regions"][0]["injections"][0]["predicted"][0]["unit"] = (u + 1).into();
            }),
            "injections[0].predicted is",
        ),
        ("unplanted", Box::new(|v| v["regions"][0]["injections"][0]["unit"] = 99.into()), "injections[0].unit is 99"),
    ];
    for (case, edit, line) in cases {
        let e = d.join(format!("inj-{case}.tgz"));
        retar(&e, &edit_json(&files, "report.json", &*edit));
        let (code, out, err) = check(&e);
        assert_eq!(code, 1, "{case}: {out}{err}");
        assert!(out.contains(line), "{case}: {out}");
    }
}

/// `--inject CLASS:2@REGION --self-test` on a state region (tiny Kimi, KDA: four row runs a
/// slot, one descriptor each) and an indexer region (tiny DeepSeek-V3.2: two runs a block, one
/// descriptor): every class is planted twice and detected as predicted, each with the runs the
/// class must leave wrong, as worked out here from what each fault does to the descriptors.
#[test]
fn every_class_planted_in_a_state_and_an_indexer_region_is_detected_as_predicted() {
    let d = tmpdir("regions-inject");
    let kimi = write_config(&d, "kimi.json", TINY_KIMI);
    let v32 = write_config(&d, "v32.json", TINY_V32);
    for (config, region, runs) in [(&kimi, "state", 4usize), (&v32, "indexer", 2)] {
        for class in ["bitflip", "drop", "misroute", "stale", "torn"] {
            let inj = format!("{class}:2@{region}");
            let ctx = format!("{inj} on {region}");
            let (code, r, out) = run(
                &format!("regions-inject-{region}-{class}"),
                &["--model-config", config, "--inject", &inj, "--self-test"],
                &[],
            );
            assert_eq!(code, 0, "{ctx}: {out}");
            assert_eq!(r["outcome"]["status"], "self-test-passed", "{ctx}");
            assert!(
                out.contains("self-test:         passed: 2 planted faults (2 in regions) detected as predicted"),
                "{ctx}: {out}"
            );
            let g = &r["regions"][0];
            assert_eq!((g["injections_planted"].as_u64(), g["injections_detected"].as_u64()), (Some(2), Some(2)), "{ctx}: {g}");
            assert_eq!(g["unexpected_failures"].as_u64(), Some(0), "{ctx}: {g}");
            let injections = g["injections"].as_array().unwrap();
            assert_eq!(injections.len(), 2, "{ctx}");
            for j in injections {
                let classes: Vec<&str> =
                    j["predicted"].as_array().unwrap().iter().map(|p| p["class"].as_str().unwrap()).collect();
                let count = |c: &str| classes.iter().filter(|x| **x == c).count();
                match class {
                    // One run's bit: that run alone.
                    "bitflip" => assert_eq!(classes, ["bitflip"], "{ctx}: {j}"),
                    // A page's descriptors left out: every run of its decode unit is poison.
                    "drop" => assert_eq!((count("unwritten"), classes.len()), (runs, runs), "{ctx}: {j}"),
                    // Page a into b's decode unit: b's runs hold a's rows, a's unit keeps poison.
                    "misroute" => assert_eq!((count("misplaced"), count("unwritten")), (runs, runs), "{ctx}: {j}"),
                    "stale" => assert_eq!((count("stale"), classes.len()), (runs, runs), "{ctx}: {j}"),
                    // A state descriptor covers one run: that run is torn. The indexer's one
                    // descriptor covers both: a cut in the values tears them and leaves the
                    // scales unwritten; a cut in the scales tears them alone.
                    _ if region == "state" => assert_eq!(classes, ["torn"], "{ctx}: {j}"),
                    _ => assert!(classes == ["torn"] || (count("torn"), count("unwritten")) == (1, 1), "{ctx}: {j}"),
                }
                assert_eq!(j["detected"], true, "{ctx}: {j}");
            }
            let failures = g["failures"].as_array().unwrap();
            let predicted: usize = injections.iter().map(|j| j["predicted"].as_array().unwrap().len()).sum();
            assert_eq!(failures.len(), predicted, "{ctx}: {g}");
            assert!(failures.iter().all(|f| f["injected"] == true && f["class"] != "late"), "{ctx}: {g}");
            if class == "bitflip" {
                assert!(failures.iter().all(|f| f["bit_flips"] == 1), "{ctx}: {g}");
            }
            if class == "misroute" {
                // The rows found are another request's (or block's): a region row of another id.
                for f in failures.iter().filter(|f| f["class"] == "misplaced") {
                    assert_eq!(f["observed"]["kv"], "region", "{ctx}: {f}");
                    assert_ne!(f["observed"]["block"], f["id"], "{ctx}: {f}");
                }
            }
        }
    }
    // Without --self-test the planted faults fail the run by region (exit 1): 6 layers × 9
    // slots (64 MiB / (6 × 1024 tokens × 1152 bytes)).
    let (code, _, out) = run("regions-inject-plain", &["--model-config", &kimi, "--inject", "stale@state"], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("region KDA state (state, TP rank 0): 1 of 54 page(s) corrupt"), "{out}");
    // A self-test fails when a region holds damage no planted fault predicts.
    let (code, _, out) = run(
        "regions-inject-unexpected",
        &["--model-config", &kimi, "--inject", "bitflip@state", "--self-test"],
        &[("KVPROBE_TEST_LEAVE_OUT_REGION", "state")],
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("corrupt region row runs that no planted fault predicts"), "{out}");
    // As many faults as the region has pages are all planted (54 pages: 6 layers × 9 slots).
    let (code, r, out) =
        run("regions-inject-all-pages", &["--model-config", &kimi, "--inject", "bitflip:54@state", "--self-test"], &[]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(r["regions"][0]["injections_detected"].as_u64(), Some(54), "{out}");
    // Region classes that do not apply, regions the run does not move.
    for (args, want) in [
        (vec!["--model-config", kimi.as_str(), "--inject", "stray@state"], "stray does not apply to a region's pages"),
        (vec!["--model-config", kimi.as_str(), "--inject", "torn@kv"], "REGION in \"torn@kv\" must be state or indexer"),
        (vec!["--model-config", kimi.as_str(), "--inject", "torn@indexer"], "this run moves no indexer region"),
        (vec!["--inject", "torn@state"], "this run moves no state region"),
        // 54 pages (6 layers x 9 slots): 55 faults do not fit, refused before anything moves.
        (
            vec!["--model-config", kimi.as_str(), "--inject", "bitflip:50@state", "--inject", "drop:5@state"],
            "region KDA state (TP rank 0) has 6 layer(s) × 9 page(s), room for 54 of the 55 fault(s) asked for",
        ),
    ] {
        let mut a = vec!["run", "--memory", "dram"];
        a.extend(args.iter().copied());
        let (code, out, err) = kvprobe(&a);
        assert_eq!(code, 2, "{a:?}: {out}{err}");
        assert!(err.contains(want), "{a:?}: {err}");
    }
}

/// On a GPU (VRAM pools, one GPU: both sides' region pools on it): Kimi-K3 at TP 8 moves its
/// KDA state clean with READ and WRITE, every region class planted is detected as predicted,
/// and a region left out fails by name. Skips without a GPU.
#[test]
fn regions_move_and_verify_on_vram() {
    if !crate::common::gpu_or_skip("regions_move_and_verify_on_vram") {
        return;
    }
    let k3 = shipped("kimi-k3.json");
    for op in ["read", "write"] {
        let d = tmpdir("regions-vram");
        let p = d.join("r.json");
        let (code, out, err) = kvprobe(&[
            "run",
            "--memory",
            "vram",
            "--model-config",
            &k3,
            "--tp",
            "8",
            "--iterations",
            "1",
            "--op",
            op,
            "--report",
            p.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{op}: {out}{err}");
        let r = read_report(&p);
        assert_region(&r["regions"][0], ("state", "KDA state", 69, 814_080, 884_736, 4, 4), op);
    }
    let mut args =
        vec!["run", "--memory", "vram", "--model-config", k3.as_str(), "--tp", "8", "--iterations", "1", "--self-test"];
    for c in ["bitflip:2@state", "drop@state", "misroute@state", "stale@state", "torn:2@state"] {
        args.extend(["--inject", c]);
    }
    let (code, out, err) = kvprobe(&args);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("injections: 7 planted, 7 detected as predicted, 0 unexpected failures"), "{out}");
    let (code, out, err) = kvprobe_env(
        &["run", "--memory", "vram", "--model-config", &k3, "--tp", "8", "--iterations", "1"],
        &[("KVPROBE_TEST_LEAVE_OUT_REGION", "state")],
    );
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("region KDA state (state, TP rank 0) was not moved"), "{err}");
    // Under request load on VRAM: each request's state slot moves with its blocks (4 slots:
    // 256 MiB / (69 × 884 736)), nixl-only and stacked clean; two misrouted state READs
    // misplaced, exit 1.
    for (sc, env) in [("nixl-only", None), ("stacked", None), ("nixl-only", Some("state-misroute:2"))] {
        let d = tmpdir("regions-vram-scenario");
        let p = d.join("r.json");
        let a = [
            "run",
            "--memory",
            "vram",
            "--model-config",
            &k3,
            "--tp",
            "8",
            "--scenario",
            sc,
            "--lockstep",
            "--requests",
            "30",
            "--report",
            p.to_str().unwrap(),
        ];
        let env: Vec<(&str, &str)> = env.map(|f| ("KVPROBE_TEST_FAULT", f)).into_iter().collect();
        let (code, out, err) = kvprobe_env(&a, &env);
        assert_eq!(code, if env.is_empty() { 0 } else { 1 }, "{sc} {env:?}: {out}{err}");
        let r = read_report(&p);
        let g = &r["regions"][0];
        let verified = r["scenario"]["requests_verified"].as_u64().unwrap();
        assert_eq!((g["units"].as_u64(), g["pages_compared"].as_u64()), (Some(4), Some(verified * 69)), "{g}");
        assert_eq!(g["bytes_moved"].as_u64(), Some(verified * 69 * 814_080), "{g}");
        let want_corrupt = if env.is_empty() { 0 } else { 2 * 69 };
        assert_eq!(g["pages_corrupt"].as_u64(), Some(want_corrupt), "{sc} {env:?}: {g}");
        assert!(g["failures"].as_array().unwrap().iter().all(|f| f["class"] == "misplaced"), "{g}");
    }
}
