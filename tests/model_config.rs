//! `--model-config`: geometry from Hugging Face config.json files (the shipped configs/ and
//! hostile ones), TP splits, KV-cache dtypes, layer groups, refusals; `kvprobe geometry` and a
//! run's report.

use crate::common::{kvprobe, run_with_report};
use kvprobe::geometry::{Dtype, Layout, Preset};
use kvprobe::model_config::{Attention, KvCacheDtype, ModelConfigError, ModelKv, TpSplit};
use std::path::PathBuf;

fn shipped(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs").join(name)
}

fn load(name: &str) -> ModelKv {
    ModelKv::load(&shipped(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn the_llama_style_config_gives_preset_llama3_8b() {
    let m = load("llama-3-8b.json");
    assert_eq!((m.num_layers, m.total_kv_heads, m.head_size, m.mla, m.dtype), (32, 8, 128, false, Dtype::Bf16));
    let (g, tp) = m.rank_geometry(1, KvCacheDtype::Auto).unwrap();
    assert_eq!(g, Preset::Llama3_8b.geometry());
    assert_eq!(tp, TpSplit { tp: 1, kv_heads_per_rank: 8, replicas: 1 });
    assert_eq!(m.layer_groups.len(), 1);
    assert_eq!(m.layer_groups[0].attention, Attention::Full);
    assert_eq!(m.layer_groups[0].layers, (0..32).collect::<Vec<_>>());
}

#[test]
fn the_mla_config_gives_preset_deepseek_v3() {
    let m = load("deepseek-v3.json");
    assert!(m.mla);
    assert_eq!((m.num_layers, m.total_kv_heads, m.head_size), (61, 1, 512 + 64));
    let (g, _) = m.rank_geometry(1, KvCacheDtype::Auto).unwrap();
    assert_eq!(g, Preset::DeepseekV3.geometry());
    // MLA under TP: the latent is whole on every rank (vLLM replicates it).
    let (g8, tp8) = m.rank_geometry(8, KvCacheDtype::Auto).unwrap();
    assert_eq!(tp8, TpSplit { tp: 8, kv_heads_per_rank: 1, replicas: 8 });
    assert_eq!((g8.num_kv_heads, g8.head_size, g8.block_size), (1, 576, 64));
}

#[test]
fn the_sliding_window_mix_is_two_layer_groups_of_one_page_shape() {
    let m = load("gpt-oss-20b.json");
    assert_eq!((m.num_layers, m.total_kv_heads, m.head_size), (24, 8, 64));
    assert_eq!(m.layer_groups.len(), 2);
    let sliding = m.layer_groups.iter().find(|g| g.attention == Attention::SlidingWindow { window: 128 }).unwrap();
    let full = m.layer_groups.iter().find(|g| g.attention == Attention::Full).unwrap();
    assert_eq!(sliding.layers, (0..24).step_by(2).collect::<Vec<_>>());
    assert_eq!(full.layers, (1..24).step_by(2).collect::<Vec<_>>());
    let (g, _) = m.rank_geometry(2, KvCacheDtype::Auto).unwrap();
    assert_eq!((g.num_layers, g.num_kv_heads, g.head_size, g.dtype, g.layout), (24, 4, 64, Dtype::Bf16, Layout::Nhd));
}

#[test]
fn a_nested_text_config_and_a_sliding_window_pattern_are_read() {
    let m = load("gemma-3-27b.json");
    assert_eq!(m.model_type.as_deref(), Some("gemma3_text"));
    // The text model's 62 layers, not the vision tower's 27.
    assert_eq!((m.num_layers, m.num_attention_heads, m.total_kv_heads, m.head_size), (62, 32, 16, 128));
    let full = m.layer_groups.iter().find(|g| g.attention == Attention::Full).unwrap();
    assert_eq!(full.layers, vec![5, 11, 17, 23, 29, 35, 41, 47, 53, 59]);
    let sliding = m.layer_groups.iter().find(|g| g.attention == Attention::SlidingWindow { window: 1024 }).unwrap();
    assert_eq!(sliding.layers.len(), 52);
}

#[test]
fn tp_splits_kv_heads_as_vllm_does() {
    let m = load("llama-3-8b.json");
    let split = |tp| m.split(tp).map(|s| (s.kv_heads_per_rank, s.replicas));
    assert_eq!(split(1), Ok((8, 1)));
    assert_eq!(split(2), Ok((4, 1)));
    assert_eq!(split(8), Ok((1, 1)));
    assert_eq!(split(16), Ok((1, 2)));
    assert_eq!(split(32), Ok((1, 4)));
    for bad in [0, 3, 6, 64] {
        assert!(matches!(m.split(bad), Err(ModelConfigError::Parallel(_))), "tp {bad}: {:?}", m.split(bad));
    }
    // 12 KV heads over tp 8: neither divides the other.
    let odd =
        ModelKv::parse(r#"{"num_hidden_layers": 2, "num_attention_heads": 24, "num_key_value_heads": 12, "hidden_size": 3072}"#)
            .unwrap();
    let e = odd.split(8).unwrap_err().to_string();
    assert!(e.contains("12 KV heads") && e.contains("--tp 8"), "{e}");
    assert_eq!(odd.split(24).map(|s| (s.kv_heads_per_rank, s.replicas)), Ok((1, 2)));
}

#[test]
fn kv_cache_dtypes_and_model_dtypes() {
    let m = load("llama-3-8b.json");
    for (want, dtype) in [
        (KvCacheDtype::Auto, Dtype::Bf16),
        (KvCacheDtype::Bfloat16, Dtype::Bf16),
        (KvCacheDtype::Float16, Dtype::Fp16),
        (KvCacheDtype::Fp8, Dtype::Fp8),
        (KvCacheDtype::Fp8E4m3, Dtype::Fp8),
        (KvCacheDtype::Fp8E5m2, Dtype::Fp8),
    ] {
        let (g, _) = m.rank_geometry(1, want).unwrap();
        assert_eq!(g.dtype, dtype, "{want:?}");
        // The default pool stays about 1 GiB: fp8 halves the slice and doubles the blocks.
        assert_eq!(g.pool_bytes().unwrap(), 1 << 30, "{want:?}");
    }
    let base = r#""num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256"#;
    for (dtype, want) in [
        (r#", "torch_dtype": "float16""#, Dtype::Fp16),
        (r#", "dtype": "float16""#, Dtype::Fp16),
        (r#", "torch_dtype": "float32""#, Dtype::Bf16),
        ("", Dtype::Bf16),
    ] {
        let m = ModelKv::parse(&format!("{{{base}{dtype}}}")).unwrap();
        assert_eq!(m.dtype, want, "{dtype}");
        // No num_key_value_heads: multi-head attention, as many KV heads as query heads.
        assert_eq!((m.total_kv_heads, m.head_size), (4, 64));
    }
    let e = ModelKv::parse(&format!(r#"{{{base}, "torch_dtype": "int8"}}"#)).unwrap_err().to_string();
    assert!(e.contains("torch_dtype"), "{e}");
}

#[test]
fn head_size_comes_from_head_dim_then_hidden_size() {
    let p = |extra: &str| ModelKv::parse(&format!(r#"{{"num_hidden_layers": 4, "num_attention_heads": 8{extra}}}"#));
    assert_eq!(p(r#", "hidden_size": 1024, "head_dim": 96"#).unwrap().head_size, 96);
    assert_eq!(p(r#", "hidden_size": 1024, "head_dim": null"#).unwrap().head_size, 128);
    assert_eq!(p(r#", "hidden_size_per_head": 80"#).unwrap().head_size, 80);
    assert_eq!(p(r#", "hidden_size": 1024, "multi_query": true"#).unwrap().total_kv_heads, 1);
    assert_eq!(p(r#", "hidden_size": 1024, "multi_query_group_num": 2"#).unwrap().total_kv_heads, 2);
    let e = p(r#", "hidden_size": 1001"#).unwrap_err().to_string();
    assert!(e.contains("hidden_size 1001") && e.contains("num_attention_heads 8"), "{e}");
    let e = p("").unwrap_err().to_string();
    assert!(e.contains("head_dim") && e.contains("hidden_size"), "{e}");
}

#[test]
fn what_kvprobe_does_not_model_is_refused_with_the_reason() {
    let base = r#""num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 1024"#;
    let cases: &[(&str, &str)] = &[
        (r#", "layers_block_type": ["mamba", "attention", "mamba", "mamba"]"#, "Mamba"),
        (r#", "layer_types": ["full_attention", "linear_attention", "full_attention", "linear_attention"]"#, "linear_attention"),
        (r#", "layer_types": ["full_attention", "mamba", "full_attention", "mamba"]"#, "not a paged KV cache"),
        (r#", "sliding_window": 512, "swa_num_key_value_heads": 4"#, "own KV shape"),
        // Qwen3-Next, MiniMax-Text-01, Kimi Linear, Falcon-H1 / Mamba fields, RecurrentGemma.
        (r#", "full_attention_interval": 4"#, "recurrent state"),
        (r#", "attn_type_list": [0, 1, 0, 1]"#, "recurrent state"),
        (r#", "mamba_d_state": 16"#, "recurrent state"),
        (r#", "ssm_cfg": {}"#, "recurrent state"),
        (r#", "block_types": ["recurrent", "attention"]"#, "recurrent state"),
        (r#", "full_attn_idxs": [1, 3], "conv_L_cache": 3"#, "recurrent state"),
        (r#", "block_configs": [{"attention": {"n_heads_in_group": 8}}]"#, "per-layer attention configurations"),
        (r#", "num_kv_shared_layers": 2"#, "reuse earlier layers"),
        (r#", "model_type": "minicpm3", "kv_lora_rank": 256"#, "DeepSeek-style model types"),
    ];
    for (extra, why) in cases {
        let e = ModelKv::parse(&format!("{{{base}{extra}}}")).unwrap_err();
        assert!(matches!(e, ModelConfigError::Unsupported(_)), "{extra}: {e:?}");
        assert!(e.to_string().contains(why), "{extra}: {e}");
    }
    let e = ModelKv::parse(r#"{"num_hidden_layers": 2, "num_attention_heads": 8, "num_kv_heads": [2, 4], "hidden_size": 1024}"#)
        .unwrap_err();
    assert!(matches!(e, ModelConfigError::Unsupported(_)) && e.to_string().contains("differs by layer"), "{e}");
}

#[test]
fn malformed_configs_are_errors_naming_the_field() {
    let cases: &[(&str, &str)] = &[
        ("[1, 2]", "not a JSON object"),
        ("{", "not JSON"),
        (r#"{"num_attention_heads": 8, "hidden_size": 1024}"#, "num_hidden_layers is not given"),
        (r#"{"num_hidden_layers": 0, "num_attention_heads": 8, "hidden_size": 1024}"#, "num_hidden_layers must be"),
        (r#"{"num_hidden_layers": -3, "num_attention_heads": 8, "hidden_size": 1024}"#, "num_hidden_layers must be"),
        (r#"{"num_hidden_layers": 2.5, "num_attention_heads": 8, "hidden_size": 1024}"#, "num_hidden_layers must be"),
        (r#"{"num_hidden_layers": "32", "num_attention_heads": 8, "hidden_size": 1024}"#, "num_hidden_layers must be"),
        (r#"{"num_hidden_layers": 70000, "num_attention_heads": 8, "hidden_size": 1024}"#, "exceeds 65535"),
        (r#"{"num_hidden_layers": 2, "hidden_size": 1024}"#, "num_attention_heads is not given"),
        (r#"{"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 1024, "text_config": 3}"#, "text_config must be"),
        (
            r#"{"num_hidden_layers": 3, "num_attention_heads": 8, "hidden_size": 1024, "layer_types": ["full_attention"]}"#,
            "1 entries for 3 layers",
        ),
        (
            r#"{"num_hidden_layers": 1, "num_attention_heads": 8, "hidden_size": 1024, "layer_types": ["sliding_attention"]}"#,
            "sliding_window is not given",
        ),
        (
            r#"{"num_hidden_layers": 1, "num_attention_heads": 8, "hidden_size": 1024, "sliding_window_pattern": 0, "sliding_window": 4}"#,
            "sliding_window_pattern must be",
        ),
        (
            r#"{"model_type": "deepseek_v3", "num_hidden_layers": 2, "num_attention_heads": 8, "kv_lora_rank": 0, "hidden_size": 1024}"#,
            "kv_lora_rank must be",
        ),
        (
            r#"{"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 16, "hidden_size": 1024}"#,
            "8 attention heads do not form groups over 16 KV heads",
        ),
        (
            r#"{"num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 5, "hidden_size": 4096}"#,
            "over 5 KV heads",
        ),
        (
            r#"{"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 1024, "multi_query": 1}"#,
            "multi_query must be true or false",
        ),
        (
            r#"{"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 1024, "sliding_window": 8, "use_sliding_window": "false"}"#,
            "use_sliding_window must be true or false",
        ),
        (
            r#"{"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 1024, "num_kv_shared_layers": "5"}"#,
            "num_kv_shared_layers must be",
        ),
        (r#"{"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 1024, "dtype": "int4"}"#, "dtype must be"),
    ];
    for (text, why) in cases {
        let e = ModelKv::parse(text).expect_err(text).to_string();
        assert!(e.contains(why), "{text}: {e}");
    }
}

#[test]
fn kvprobe_geometry_prints_the_resolved_geometry() {
    let llama = shipped("llama-3-8b.json");
    let (code, out, err) = kvprobe(&["geometry", "--model-config", llama.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let want = serde_json::to_value(Preset::Llama3_8b.geometry()).unwrap();
    for (k, x) in want.as_object().unwrap() {
        assert_eq!(&v["geometry"][k], x, "{k}");
    }
    assert_eq!(v["geometry"]["slice_bytes"], 32768);
    assert_eq!(v["pool_bytes"], 1u64 << 30);
    assert_eq!(v["model"]["tp"]["kv_heads_per_rank"], 8);
    // Flags over the model: --tp, --kv-cache-dtype, --block-size, --blocks, --layout.
    let (code, out, err) = kvprobe(&[
        "geometry",
        "--model-config",
        llama.to_str().unwrap(),
        "--tp",
        "16",
        "--kv-cache-dtype",
        "fp8",
        "--block-size",
        "32",
        "--blocks",
        "10",
        "--layout",
        "hnd",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("tp:           16 (1 KV head(s) per rank, each KV head replicated on 2 ranks)"), "{out}");
    assert!(out.contains("32 layers, 1 KV head(s), head size 128, fp8, block size 32 tokens, 10 blocks, HND"), "{out}");
    assert!(out.contains("block slice:  4096 bytes"), "{out}");
    // Without a model config: the preset.
    let (code, out, _) = kvprobe(&["geometry", "--preset", "deepseek-v3"]);
    assert_eq!(code, 0);
    assert!(out.contains("61 layers, 1 KV head(s), head size 576, bf16, block size 64 tokens, 256 blocks, MLA"), "{out}");
}

#[test]
fn model_config_usage_errors_exit_2() {
    let llama = shipped("llama-3-8b.json");
    let l = llama.to_str().unwrap();
    let d = crate::common::tmpdir("model-config-bad");
    let bad = d.join("config.json");
    std::fs::write(&bad, r#"{"num_hidden_layers": 4, "num_attention_heads": 8, "layers_block_type": ["mamba"]}"#).unwrap();
    let missing = d.join("missing.json");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["geometry", "--model-config", l, "--kv-heads", "4"], "cannot be used with"),
        (vec!["geometry", "--model-config", l, "--preset", "small"], "cannot be used with"),
        (vec!["geometry", "--tp", "2"], "--model-config"),
        (vec!["geometry", "--model-config", l, "--tp", "3"], "not divisible by --tp 3"),
        (vec!["geometry", "--model-config", missing.to_str().unwrap()], "missing.json"),
        (vec!["geometry", "--model-config", bad.to_str().unwrap()], "Mamba"),
        // A directory is read as a model directory: its config.json (here the Mamba one).
        (vec!["geometry", "--model-config", d.to_str().unwrap()], "Mamba"),
        (vec!["run", "--memory", "dram", "--model-config", bad.to_str().unwrap()], "Mamba"),
        (vec!["ab", "--memory", "dram", "--model-config", l, "--tp", "5"], "--tp 5"),
    ];
    for (args, why) in cases {
        let (code, out, err) = kvprobe(&args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(err.contains(why), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn a_run_from_a_model_config_is_clean_and_reports_the_model() {
    let cfg = shipped("gpt-oss-20b.json");
    let (code, r, out) =
        run_with_report("model-config-run", "dram", &["--model-config", cfg.to_str().unwrap(), "--tp", "2", "--blocks", "8"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(r["config"]["geometry"]["num_layers"], 24);
    assert_eq!(r["config"]["geometry"]["num_kv_heads"], 4);
    assert_eq!(r["config"]["geometry"]["head_size"], 64);
    assert_eq!(r["config"]["geometry"]["num_blocks"], 8);
    assert_eq!(r["config"]["model"]["tp"]["tp"], 2);
    assert_eq!(r["config"]["model"]["layer_groups"].as_array().unwrap().len(), 2);
    assert!(r["config"]["preset"].is_null());
    assert!(out.contains("2 layer groups (every layer moved)"), "{out}");
    // 24 layers x K/V x 8 blocks x 5 iterations, every one verified.
    assert_eq!(r["summary"]["slices_compared"], 24 * 2 * 8 * 5, "{}", r["summary"]);
}

#[test]
fn model_specific_rules_follow_vllm_and_transformers() {
    let p = |extra: &str| {
        ModelKv::parse(&format!(r#"{{"num_hidden_layers": 8, "num_attention_heads": 16, "hidden_size": 2048{extra}}}"#)).unwrap()
    };
    // Falcon's new decoder architecture ignores multi_query (vLLM get_total_num_kv_heads).
    let falcon = p(r#", "model_type": "falcon", "new_decoder_architecture": true, "multi_query": true, "num_kv_heads": 8"#);
    assert_eq!(falcon.total_kv_heads, 8);
    assert_eq!(p(r#", "model_type": "falcon", "multi_query": true, "num_kv_heads": 8"#).total_kv_heads, 1);
    // An explicit qk_rope_head_dim 0 is the latent alone.
    let mla = p(r#", "model_type": "deepseek_v2", "kv_lora_rank": 512, "qk_rope_head_dim": 0"#);
    assert_eq!((mla.mla, mla.head_size), (true, 512));
    // Gemma 2 without layer_types: even layers sliding, odd full.
    let gemma2 = p(r#", "model_type": "gemma2", "sliding_window": 4096"#);
    assert_eq!(gemma2.layer_groups[0].attention, Attention::SlidingWindow { window: 4096 });
    assert_eq!(gemma2.layer_groups[0].layers, vec![0, 2, 4, 6]);
    assert_eq!(gemma2.layer_groups[1].layers, vec![1, 3, 5, 7]);
    // Llama 4: chunked local attention except every 4th layer (no_rope_layers empty: the default).
    let llama4 = p(r#", "attention_chunk_size": 8192, "no_rope_layers": []"#);
    let full = llama4.layer_groups.iter().find(|g| g.attention == Attention::Full).unwrap();
    assert_eq!(full.layers, vec![3, 7]);
    // Qwen2: sliding from max_window_layers on, and nothing when use_sliding_window is false.
    let qwen2 = p(r#", "sliding_window": 32768, "use_sliding_window": true, "max_window_layers": 6"#);
    let sliding = qwen2.layer_groups.iter().find(|g| g.attention != Attention::Full).unwrap();
    assert_eq!(sliding.layers, vec![6, 7]);
    let off = p(r#", "sliding_window": 32768, "use_sliding_window": false, "max_window_layers": 6"#);
    assert_eq!(off.layer_groups.len(), 1);
    // The top level's dtype wins over text_config's (vLLM reads the top level first).
    let nested = ModelKv::parse(
        r#"{"torch_dtype": "float16", "text_config": {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "torch_dtype": "bfloat16"}}"#,
    )
    .unwrap();
    assert_eq!(nested.dtype, Dtype::Fp16);
    // A model_type with control characters is kept printable.
    let esc = p(r#", "model_type": "x\u001b[2Jy""#);
    assert_eq!(esc.model_type.as_deref(), Some("x\\u{1b}[2Jy"));
}

#[test]
fn files_directories_and_devices() {
    let d = crate::common::tmpdir("model-config-files");
    std::fs::copy(shipped("llama-3-8b.json"), d.join("config.json")).unwrap();
    // A model directory: its config.json, as vLLM takes one.
    assert_eq!(ModelKv::load(&d).unwrap(), load("llama-3-8b.json"));
    let empty = crate::common::tmpdir("model-config-empty-dir");
    let e = ModelKv::load(&empty).unwrap_err().to_string();
    assert!(e.contains("config.json"), "{e}");
    // Devices are not read (a size check alone let /dev/zero through).
    let e = ModelKv::load(std::path::Path::new("/dev/zero")).unwrap_err().to_string();
    assert!(e.contains("not a regular file"), "{e}");
    let big = d.join("big.json");
    std::fs::write(&big, vec![b' '; (kvprobe::model_config::MAX_CONFIG_BYTES + 1) as usize]).unwrap();
    let e = ModelKv::load(&big).unwrap_err().to_string();
    assert!(e.contains("a config.json is a few KiB"), "{e}");
}

#[test]
fn default_blocks_follow_the_block_size_and_stay_bounded() {
    let llama = shipped("llama-3-8b.json");
    let l = llama.to_str().unwrap();
    for (bs, blocks) in [("16", 512), ("32", 256), ("1", 8192)] {
        let (code, out, err) = kvprobe(&["geometry", "--model-config", l, "--block-size", bs, "--json"]);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["geometry"]["num_blocks"], blocks, "--block-size {bs}");
        assert_eq!(v["pool_bytes"], 1u64 << 30, "--block-size {bs}");
    }
    // A tiny model: the default stops at MAX_DEFAULT_BLOCKS.
    let tiny = ModelKv::parse(r#"{"num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": 8}"#).unwrap();
    let (g, _) = tiny.rank_geometry(1, KvCacheDtype::Fp8).unwrap();
    assert_eq!(g.num_blocks, kvprobe::model_config::MAX_DEFAULT_BLOCKS);
}

#[test]
fn report_diff_lines_up_two_models_group_by_group() {
    let gpt = shipped("gpt-oss-20b.json");
    let llama = shipped("llama-3-8b.json");
    let run = |name: &str, cfg: &PathBuf| {
        let d = crate::common::tmpdir(name);
        let p = d.join("r.json");
        let (code, out, err) = kvprobe(&[
            "run",
            "--memory",
            "dram",
            "--model-config",
            cfg.to_str().unwrap(),
            "--blocks",
            "4",
            "--iterations",
            "1",
            "--report",
            p.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{out}{err}");
        p
    };
    let (a, b) = (run("diff-model-a", &gpt), run("diff-model-b", &llama));
    let (code, out, err) = kvprobe(&["report", "diff", a.to_str().unwrap(), b.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    let line = |path: &str| {
        out.lines().find(|l| l.trim_start().starts_with(path)).unwrap_or_else(|| panic!("{path}: {out}")).to_string()
    };
    let first = line("config.model.layer_groups[0].attention");
    assert!(first.contains("sliding_window") && first.contains("full"), "{first}");
    assert!(line("config.model.layer_groups[1].attention").contains("(absent)"));
    assert!(line("config.model.model_type ").contains("gpt_oss"));
}

#[test]
fn transformers_defaults_fill_what_published_configs_leave_out() {
    // google/gemma-3-4b-it's text_config names neither heads nor head_dim nor the pattern:
    // Gemma3TextConfig's defaults (8 heads, 4 KV heads, head_dim 256, pattern 6) apply.
    let m = ModelKv::parse(
        r#"{"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 34, "sliding_window": 1024}}"#,
    )
    .unwrap();
    assert_eq!((m.num_layers, m.num_attention_heads, m.total_kv_heads, m.head_size), (34, 8, 4, 256));
    let full = m.layer_groups.iter().find(|g| g.attention == Attention::Full).unwrap();
    assert_eq!(full.layers, vec![5, 11, 17, 23, 29]);
    // Gemma 3 12B: head_dim 256 by default, not hidden_size / heads = 240.
    let m = ModelKv::parse(
        r#"{"text_config": {"model_type": "gemma3_text", "hidden_size": 3840, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8, "sliding_window": 1024}}"#,
    )
    .unwrap();
    assert_eq!(m.head_size, 256);
    // DeepSeek-V3 without qk_rope_head_dim: DeepseekV3Config's 64.
    let m =
        ModelKv::parse(r#"{"model_type": "deepseek_v3", "num_hidden_layers": 3, "num_attention_heads": 8, "kv_lora_rank": 512}"#)
            .unwrap();
    assert_eq!((m.mla, m.head_size), (true, 576));
    // The shipped 27B config, like the published one, leaves the pattern to the default.
    let text = std::fs::read_to_string(shipped("gemma-3-27b.json")).unwrap();
    assert!(!text.contains("\"sliding_window_pattern\""));
}
