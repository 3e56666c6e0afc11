//! Hybrid KV caches from config.json (issue 36's first part): the families' layer roles, each
//! region's per-rank parts, page sizes, vLLM's hybrid block size and KV cache groups, the TP
//! refusals, `kvprobe geometry` on them, and ab refusing to move what it does not move yet (run moves them: tests/regions.rs).
//! Expected numbers are worked out here from vLLM 0.34's formulas (mamba_utils.py), written
//! out by hand per family, not by calling the code under test.

use crate::common::kvprobe;
use kvprobe::geometry::Dtype;
use kvprobe::hybrid::{HybridKv, Region, StateMixer, hybrid_block_size, kv_cache_groups};
use kvprobe::model_config::{KvCacheDtype, ModelConfigError, ModelKv};
use std::path::PathBuf;

fn shipped(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs").join(name)
}

fn hybrid(m: &ModelKv) -> &HybridKv {
    m.hybrid.as_ref().expect("a hybrid model")
}

/// (name, shape, dtype, bytes) of each part of a region.
fn parts(r: &Region) -> Vec<(&str, Vec<u64>, &str, u64)> {
    r.parts.iter().map(|p| (p.name.as_str(), p.shape.clone(), p.dtype.as_str(), p.bytes)).collect()
}

fn regions(m: &ModelKv, tp: u32) -> Vec<Region> {
    let (g, _) = m.rank_geometry(tp, KvCacheDtype::Auto).unwrap_or_else(|e| panic!("tp {tp}: {e}"));
    m.rank_regions(&g, tp).unwrap_or_else(|e| panic!("tp {tp}: {e}"))
}

#[test]
fn kimi_k3_is_mla_plus_kda_state_laid_out_per_tp_rank() {
    let m = ModelKv::load(&shipped("kimi-k3.json")).unwrap();
    assert!(m.mla);
    assert_eq!((m.num_layers, m.head_size), (93, 512 + 64));
    // full_attn_layers [4, 8, ..., 92, 93] (1-based) are MLA: 0-based 3, 7, ..., 91 and 92.
    let mut mla: Vec<u32> = (4..=92).step_by(4).map(|l| l - 1).collect();
    mla.push(92);
    assert_eq!(m.layer_groups.len(), 1);
    assert_eq!(m.layer_groups[0].layers, mla);
    let s = hybrid(&m).state.as_ref().unwrap();
    assert_eq!(s.mixer, StateMixer::Kda { heads: 96, head_dim: 128, conv_kernel: 4 });
    assert_eq!(s.layers.len(), 69);
    assert!(s.layers.iter().all(|l| !mla.contains(l)));
    assert_eq!((s.conv_dtype, s.ssm_dtype), (Dtype::Bf16, Dtype::Fp32), "KDA's recurrent state is fp32 under auto");
    for tp in [1u32, 2, 4, 8, 16] {
        let r = regions(&m, tp);
        assert_eq!(r.len(), 2, "tp {tp}");
        let (att, st) = (&r[0], &r[1]);
        // KDA: conv (3·H·D/tp, k−1) bf16, recurrent (H/tp, D, D) fp32.
        let h = 96 / tp as u64;
        let conv = 3 * 96 * 128 / tp as u64;
        assert_eq!(
            parts(st),
            vec![("conv", vec![conv, 3], "bf16", conv * 3 * 2), ("recurrent", vec![h, 128, 128], "fp32", h * 128 * 128 * 4)],
            "tp {tp}"
        );
        let state_page = conv * 3 * 2 + h * 128 * 128 * 4;
        assert_eq!(st.page_bytes, state_page);
        // MLA: 576 bf16 per token, whole on every rank; the block size is the smallest multiple
        // of 128 tokens whose page holds a state slot.
        let per_token = 576 * 2;
        let mut block = 128;
        while block * per_token < state_page {
            block += 128;
        }
        assert_eq!(att.page_bytes, block * per_token, "tp {tp}");
        assert_eq!(st.page_stride_bytes, att.page_bytes, "the state page is padded to the attention page");
        assert!(att.replicated && !st.replicated);
        assert_eq!(att.layers, mla);
        // vLLM's groups: 24 MLA layers make the group size; 69 KDA layers make 3 groups.
        // Numbered as vLLM meets them in layer order: layer 0 is KDA, so the KDA groups are
        // 0-2 and the MLA group 3.
        assert_eq!(att.groups, vec![(3, mla.clone())]);
        assert_eq!(st.groups.len(), 3);
        for (i, (id, layers)) in st.groups.iter().enumerate() {
            assert_eq!(*id, i as u32);
            let want: Vec<u32> = s.layers.iter().skip(i).step_by(3).copied().collect();
            assert_eq!(layers, &want);
        }
    }
    // TP 8 worked out in full (docs/geometry.md quotes it): conv (4608, 3) = 27 648 bytes,
    // recurrent (12, 128, 128) fp32 = 786 432 bytes; 814 080 bytes < 6 × 128 tokens × 1152.
    let r = regions(&m, 8);
    assert_eq!((r[1].page_bytes, r[0].page_bytes), (814_080, 884_736));
    let (g, _) = m.rank_geometry(8, KvCacheDtype::Auto).unwrap();
    assert_eq!((g.num_layers, g.block_size, g.head_size, g.num_kv_heads), (24, 768, 576, 1));
    // vLLM's divide(): 96 heads over 5 or 64 ranks.
    for bad in [5, 64] {
        assert!(matches!(m.rank_geometry(bad, KvCacheDtype::Auto), Err(ModelConfigError::Parallel(_))), "tp {bad}");
    }
}

#[test]
fn qwen3_next_gated_deltanet_and_its_attention_interval() {
    let m = ModelKv::load(&shipped("qwen3-next-80b.json")).unwrap();
    let full: Vec<u32> = (0..48).filter(|i| (i + 1) % 4 == 0).collect();
    assert_eq!(m.layer_groups[0].layers, full);
    let s = hybrid(&m).state.as_ref().unwrap();
    assert_eq!(s.layers.len(), 36);
    assert_eq!((s.conv_dtype, s.ssm_dtype), (Dtype::Bf16, Dtype::Bf16));
    for tp in [1u32, 2] {
        let r = regions(&m, tp);
        // conv ((2·16·128 + 32·128)/tp, 3), temporal (32/tp, Dv 128, Dk 128), both bf16.
        let conv = (2 * 16 * 128 + 32 * 128) / tp as u64;
        let hv = 32 / tp as u64;
        assert_eq!(
            parts(&r[1]),
            vec![("conv", vec![conv, 3], "bf16", conv * 6), ("temporal", vec![hv, 128, 128], "bf16", hv * 128 * 128 * 2)]
        );
        // Full attention: 2 KV heads (1 per rank from tp 2), K and V packed per head, bf16.
        let heads = (2 / tp).max(1) as u64;
        let per_token = heads * 2 * 256 * 2;
        let state_page = conv * 6 + hv * 128 * 128 * 2;
        let block = 16 * state_page.div_ceil(16 * per_token);
        assert_eq!(r[0].page_bytes, block * per_token, "tp {tp}");
        assert_eq!(parts(&r[0]), vec![("kv", vec![heads, block, 512], "bf16", block * per_token)]);
    }
    // layer_types spelled out says the same as the interval.
    let types: Vec<&str> = (0..8).map(|i| if (i + 1) % 4 == 0 { "\"full_attention\"" } else { "\"linear_attention\"" }).collect();
    let text = format!(
        r#"{{"model_type": "qwen3_next", "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "layer_types": [{}]}}"#,
        types.join(",")
    );
    let m = ModelKv::parse(&text).unwrap();
    assert_eq!(m.layer_groups[0].layers, vec![3, 7]);
    assert_eq!(hybrid(&m).state.as_ref().unwrap().layers, vec![0, 1, 2, 4, 5, 6]);
}

const NEMOTRON: &str = r#"{"model_type": "nemotron_h", "num_hidden_layers": 8, "hybrid_override_pattern": "M-M*ME-*",
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096,
    "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
    "torch_dtype": "bfloat16"}"#;

#[test]
fn nemotron_h_mamba2_with_its_pattern_groups_and_fp32_ssm() {
    let m = ModelKv::parse(NEMOTRON).unwrap();
    assert_eq!(m.layer_groups[0].layers, vec![3, 7]);
    let h = hybrid(&m);
    assert_eq!(h.state.as_ref().unwrap().layers, vec![0, 2, 4]);
    assert_eq!(h.no_cache_layers, vec![1, 5, 6]);
    assert_eq!(h.state.as_ref().unwrap().ssm_dtype, Dtype::Fp32, "Nemotron-H's ssm state defaults to float32");
    for tp in [1u32, 2, 8] {
        let r = regions(&m, tp);
        // conv ((128·64 + 2·8·128)/tp, 3) bf16; ssm (128/tp, 64, 128) fp32.
        let conv = (128 * 64 + 2 * 8 * 128) / tp as u64;
        let heads = 128 / tp as u64;
        assert_eq!(
            parts(&r[1]),
            vec![("conv", vec![conv, 3], "bf16", conv * 6), ("ssm", vec![heads, 64, 128], "fp32", heads * 64 * 128 * 4)]
        );
    }
    // n_groups 8 over 16 ranks: neither divides nor is 1 (MambaMixer2 refuses it).
    let e = m.rank_geometry(16, KvCacheDtype::Auto).unwrap_err().to_string();
    assert!(e.contains("n_groups 8") && e.contains("--tp 16"), "{e}");
    // n_groups 1 over 4 ranks: the group is replicated, each rank keeps 2·d_state B/C columns.
    let one = ModelKv::parse(&NEMOTRON.replace(r#""n_groups": 8"#, r#""n_groups": 1"#)).unwrap();
    let r = regions(&one, 4);
    assert_eq!(r[1].parts[0].shape, vec![(128 * 64 + 2 * 4 * 128) / 4, 3]);
    // The config's own ssm dtype wins.
    let bf =
        ModelKv::parse(&NEMOTRON.replace("\"conv_kernel\": 4", "\"conv_kernel\": 4, \"mamba_ssm_cache_dtype\": \"bfloat16\""))
            .unwrap();
    assert_eq!(hybrid(&bf).state.as_ref().unwrap().ssm_dtype, Dtype::Bf16);
}

#[test]
fn granite_4_h_mamba2_with_auto_head_dim_and_legacy_layer_names() {
    // Granite-4.0-H-Tiny's shape (hidden 1536, 48 heads, d_state 128, 1 group, expand 2).
    let types = ["mamba", "mamba", "mamba", "attention", "mamba", "mamba"].map(|t| format!("\"{t}\"")).join(",");
    let text = format!(
        r#"{{"model_type": "granitemoehybrid", "num_hidden_layers": 6, "layer_types": [{types}], "hidden_size": 1536,
        "num_attention_heads": 12, "num_key_value_heads": 4, "mamba_n_heads": 48, "mamba_d_head": "auto",
        "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2}}"#
    );
    let m = ModelKv::parse(&text).unwrap();
    assert_eq!(m.layer_groups[0].layers, vec![3]);
    let s = hybrid(&m).state.as_ref().unwrap();
    // mamba_d_head auto = 2 × 1536 / 48 = 64.
    assert_eq!(s.mixer, StateMixer::Mamba2 { num_heads: 48, head_dim: 64, d_state: 128, n_groups: 1, conv_kernel: 4 });
    assert_eq!(regions(&m, 1)[1].parts[0].shape, vec![3072 + 2 * 128, 3]);
    // TP 2: the one group replicated to 2, (3072 + 2·2·128) / 2 = 1792.
    assert_eq!(regions(&m, 2)[1].parts[0].shape, vec![1792, 3]);
    assert_eq!(regions(&m, 2)[1].parts[1].shape, vec![24, 64, 128]);
    // The renamed spelling reads the same.
    let renamed = text.replace("\"mamba\"", "\"linear_attention\"").replace("\"attention\"", "\"full_attention\"");
    assert_eq!(ModelKv::parse(&renamed).unwrap().hybrid, m.hybrid);
}

#[test]
fn jamba_mamba1_from_the_attention_period() {
    let text = r#"{"model_type": "jamba", "num_hidden_layers": 16, "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 8, "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16,
        "mamba_d_conv": 4, "mamba_expand": 2}"#;
    let m = ModelKv::parse(text).unwrap();
    assert_eq!(m.layer_groups[0].layers, vec![4, 12]);
    let r = regions(&m, 2);
    // conv (I/tp, 3), ssm (I/tp, d_state), I = 2 × 4096.
    assert_eq!(parts(&r[1]), vec![("conv", vec![4096, 3], "bf16", 4096 * 6), ("ssm", vec![4096, 16], "bf16", 4096 * 32)]);
}

#[test]
fn deepseek_v32_indexer_is_its_own_region_in_the_mla_group() {
    let text = r#"{"model_type": "deepseek_v32", "num_hidden_layers": 61, "num_attention_heads": 128,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64}"#;
    let m = ModelKv::parse(text).unwrap();
    let ix = hybrid(&m).indexer.as_ref().unwrap();
    assert_eq!(ix.layers, (0..61).collect::<Vec<_>>());
    let (g, _) = m.rank_geometry(8, KvCacheDtype::Auto).unwrap();
    assert_eq!(g.block_size, 64);
    let r = m.rank_regions(&g, 8).unwrap();
    assert_eq!(r.len(), 2);
    // 64 tokens × 128 fp8 bytes, then 64 × one fp32 scale: 8448 bytes a block, whole on every rank.
    assert_eq!(parts(&r[1]), vec![("k", vec![64, 128], "fp8", 8192), ("scale", vec![64, 1], "fp32", 256)]);
    assert_eq!(r[1].page_bytes, 8448);
    assert!(r[1].replicated);
    assert_eq!(r[1].groups, r[0].groups, "the indexer shares the MLA layers' group and block table");
}

#[test]
fn hybrid_block_size_and_groups_follow_vllms_rules() {
    // The smallest multiple of the alignment whose page holds the state page.
    assert_eq!(hybrid_block_size(1024, 137_216, false, 16), 144);
    assert_eq!(hybrid_block_size(1024, 16 * 1024, false, 16), 16);
    assert_eq!(hybrid_block_size(1024, 16 * 1024 + 1, false, 16), 32);
    assert_eq!(hybrid_block_size(1152, 1, true, 64), 128, "MLA hybrids align to 128 tokens");
    // Nemotron-H-8B at TP 1: a 4 255 744-byte state page, 4096 bytes a token; --block-size 32
    // aligns to 32 (33 × 32), 1024 to 1024 (2 × 1024).
    assert_eq!(hybrid_block_size(4096, 4_255_744, false, 32), 1056);
    assert_eq!(hybrid_block_size(4096, 4_255_744, false, 1024), 2048);
    // 10 full + 20 sliding: groups of 10, the sliding ones strided.
    let full: Vec<u32> = (0..30).step_by(3).collect();
    let sw: Vec<u32> = (0..30).filter(|i| i % 3 != 0).collect();
    let g = kv_cache_groups(&[full.clone(), sw.clone()]);
    assert_eq!(g[0], vec![(0, full)]);
    assert_eq!(g[1].len(), 2);
    assert_eq!(g[1][0].1, sw.iter().step_by(2).copied().collect::<Vec<_>>());
    // 12 and 13 layers: under 1.5×, the larger count is the group size (one group each).
    let g = kv_cache_groups(&[(0..12).collect(), (12..25).collect()]);
    assert_eq!((g[0].len(), g[1].len()), (1, 1));
}

#[test]
fn look_alike_hybrids_kvprobe_does_not_lay_out_are_refused() {
    // Falcon-H1 (attention and Mamba2 in every layer), Zamba2 (shared attention blocks),
    // MiniMax (lightning attention), LFM2 (short conv): Mamba-style keys, other layouts.
    let base = r#""num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 1024"#;
    for extra in [
        r#", "model_type": "falcon_h1", "mamba_n_heads": 16, "mamba_d_head": 64, "mamba_d_state": 128"#,
        r#", "model_type": "zamba2", "mamba_d_state": 64, "layers_block_type": ["mamba", "hybrid", "mamba", "mamba"]"#,
        r#", "model_type": "minimax", "attn_type_list": [0, 1, 0, 1]"#,
        r#", "model_type": "lfm2", "full_attn_idxs": [1, 3], "conv_L_cache": 3"#,
        r#", "linear_num_value_heads": 8, "linear_num_key_heads": 4"#,
    ] {
        let e = ModelKv::parse(&format!("{{{base}{extra}}}")).unwrap_err();
        assert!(matches!(e, ModelConfigError::Unsupported(_)), "{extra}: {e:?}");
        assert!(e.to_string().contains("Kimi Linear / Kimi-K3"), "the refusal lists what is laid out: {e}");
    }
    // Qwen3.5's ssm dtype key.
    let q35 = r#"{"model_type": "qwen3_5_text", "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32"}"#;
    let m = ModelKv::parse(q35).unwrap();
    assert_eq!(hybrid(&m).state.as_ref().unwrap().ssm_dtype, Dtype::Fp32);
    assert_eq!(m.layer_groups[0].layers, vec![3]);
}

#[test]
fn malformed_hybrid_configs_name_the_field() {
    let kimi = |lac: &str| {
        format!(
            r#"{{"model_type": "kimi_linear", "num_hidden_layers": 4, "num_attention_heads": 8, "kv_lora_rank": 512,
            "qk_rope_head_dim": 64, "linear_attn_config": {lac}}}"#
        )
    };
    let cases: Vec<(String, &str)> = vec![
        (kimi(r#"{"kda_layers": [0, 1], "num_heads": 8, "head_dim": 128, "short_conv_kernel_size": 4}"#), "1-based"),
        (kimi(r#"{"kda_layers": [1, 5], "num_heads": 8, "head_dim": 128, "short_conv_kernel_size": 4}"#), "from 1 to 4"),
        (kimi(r#"{"kda_layers": [1, 1], "num_heads": 8, "head_dim": 128, "short_conv_kernel_size": 4}"#), "twice"),
        (kimi(r#"{"kda_layers": [1, 2], "head_dim": 128, "short_conv_kernel_size": 4}"#), "num_heads is not given"),
        (kimi(r#"{"kda_layers": [1], "num_heads": 8, "head_dim": 128, "short_conv_kernel_size": 1}"#), "kernel − 1"),
        (kimi(r#"{"kda_layers": [], "num_heads": 8, "head_dim": 128, "short_conv_kernel_size": 4}"#), "names none"),
        (kimi("3"), "linear_attn_config must be an object"),
        (
            kimi(r#"{"kda_layers": [1], "num_heads": 4294967295, "head_dim": 4294967295, "short_conv_kernel_size": 4}"#),
            "from 1 to 1048576",
        ),
        (NEMOTRON.replace("M-M*ME-*", "M-M*ME-"), "7 characters for 8 layers"),
        (NEMOTRON.replace("M-M*ME-*", "M-M*MX-*"), "'X'"),
        (NEMOTRON.replace(r#""ssm_state_size": 128,"#, ""), "ssm_state_size is not given"),
        (NEMOTRON.replace("\"torch_dtype\"", "\"mamba_ssm_cache_dtype\": \"int8\", \"torch_dtype\""), "mamba_ssm_cache_dtype must be"),
        (
            r#"{"model_type": "deepseek_v32", "num_hidden_layers": 2, "num_attention_heads": 8, "kv_lora_rank": 512, "index_topk": 4, "index_head_dim": 100}"#.into(),
            "multiple of 128",
        ),
    ];
    for (text, why) in cases {
        let e = ModelKv::parse(&text).expect_err(&text).to_string();
        assert!(e.contains(why), "{text}: {e}");
    }
    let e = ModelKv::parse(
        &kimi(r#"{"kda_layers": [1], "num_heads": 8, "head_dim": 128, "short_conv_kernel_size": 4}"#)
            .replace("\"linear_attn_config\"", "\"dsa_config\": {}, \"linear_attn_config\""),
    )
    .unwrap_err();
    assert!(matches!(e, ModelConfigError::Unsupported(_)) && e.to_string().contains("Kimi-K3.1"), "{e}");
    // A layer type no family names, a malformed attention offset, a model without attention.
    let jamba = r#"{"model_type": "jamba", "num_hidden_layers": 4, "hidden_size": 1024, "num_attention_heads": 8"#;
    for (extra, why) in [
        (r#", "layers_block_type": ["mamba", "hybrid", "mamba", "attention"]}"#, "\"hybrid\""),
        (r#", "attn_layer_offset": -1}"#, "attn_layer_offset must be"),
        (r#", "attn_layer_offset": "3"}"#, "attn_layer_offset must be"),
        (r#", "layers_block_type": ["mamba", "mamba", "mamba", "mamba"]}"#, "none a paged attention KV cache"),
    ] {
        let e = ModelKv::parse(&format!("{jamba}{extra}")).unwrap_err().to_string();
        assert!(e.contains(why), "{extra}: {e}");
    }
}

#[test]
fn state_dtypes_follow_vllms_flags_and_only_the_configs_vllm_reads() {
    let kimi = ModelKv::load(&shipped("kimi-k3.json")).unwrap();
    let mut s = hybrid(&kimi).state.clone().unwrap();
    use kvprobe::hybrid::MambaDtype as M;
    // KDA: float32 or bfloat16 only (vLLM's kda_state_dtype).
    assert!(matches!(s.set_cache_dtypes(M::Auto, M::Float16, Dtype::Bf16), Err(kvprobe::hybrid::HybridError::Unsupported(_))));
    s.set_cache_dtypes(M::Auto, M::Bfloat16, Dtype::Bf16).unwrap();
    assert_eq!((s.conv_dtype, s.ssm_dtype), (Dtype::Bf16, Dtype::Bf16));
    s.set_cache_dtypes(M::Float32, M::Auto, Dtype::Bf16).unwrap();
    assert_eq!((s.conv_dtype, s.ssm_dtype), (Dtype::Fp32, Dtype::Fp32));
    // Jamba: vLLM takes the ssm dtype from its flag, not from a config key.
    let jamba = r#"{"model_type": "jamba", "num_hidden_layers": 8, "hidden_size": 1024, "num_attention_heads": 8,
        "mamba_ssm_cache_dtype": "float32"}"#;
    let m = ModelKv::parse(jamba).unwrap();
    let mut s = hybrid(&m).state.clone().unwrap();
    assert_eq!(s.ssm_dtype, Dtype::Bf16, "a config key vLLM does not read changes nothing");
    s.set_cache_dtypes(M::Auto, M::Float32, Dtype::Bf16).unwrap();
    assert_eq!(s.ssm_dtype, Dtype::Fp32);
    // From the command line: the page grows with the dtype (recurrent fp32 → bf16 halves it).
    let k3 = shipped("kimi-k3.json");
    let (code, out, err) =
        kvprobe(&["geometry", "--model-config", k3.to_str().unwrap(), "--tp", "8", "--mamba-ssm-cache-dtype", "bfloat16"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("recurrent (12, 128, 128) bf16 393216 bytes"), "{out}");
    let (code, _, err) = kvprobe(&["geometry", "--model-config", k3.to_str().unwrap(), "--mamba-ssm-cache-dtype", "float16"]);
    assert_eq!(code, 2);
    assert!(err.contains("kda_state_dtype"), "{err}");
    // Granite-4.0-Micro: granitemoehybrid with every layer attention is an attention model.
    let micro = r#"{"model_type": "granitemoehybrid", "num_hidden_layers": 2, "layer_types": ["attention", "attention"],
        "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2, "mamba_n_heads": 16, "mamba_d_state": 64}"#;
    let m = ModelKv::parse(micro).unwrap();
    assert!(m.hybrid.is_none());
    assert_eq!(m.attention_layers(), 2);
}

#[test]
fn a_state_slot_larger_than_any_attention_block_is_refused_not_wrapped() {
    // 65 536 heads of 1024 × 1024 fp32: a 2^38-byte slot; an MLA page of 1152 bytes a token
    // would need 2^38 / 1152 tokens, past the fingerprint's 65 536 a block.
    let text = r#"{"model_type": "kimi_linear", "num_hidden_layers": 2, "num_attention_heads": 8, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "linear_attn_config": {"kda_layers": [1], "num_heads": 65536, "head_dim": 1024,
        "short_conv_kernel_size": 4}}"#;
    let m = ModelKv::parse(text).unwrap();
    let e = m.rank_geometry(1, KvCacheDtype::Auto).unwrap_err().to_string();
    assert!(e.contains("more than the fingerprint's 65536"), "{e}");
}

#[test]
fn kvprobe_geometry_prints_every_region_and_ab_refuses_to_move_them() {
    let k3 = shipped("kimi-k3.json");
    let k3 = k3.to_str().unwrap();
    let (code, out, err) = kvprobe(&["geometry", "--model-config", k3, "--tp", "8"]);
    assert_eq!(code, 0, "{err}");
    for want in [
        "region:       MLA (attention) — 24 layer(s)",
        "region:       KDA state (state) — 69 layer(s)",
        "conv (4608, 3) bf16 27648 bytes + recurrent (12, 128, 128) fp32 786432 bytes = 814080 bytes",
        "page stride:  884736 bytes (padded to the attention page)",
        "block size 768 tokens",
        // NixlConnector's descriptors of a slot: each conv sub-projection, then the recurrent state.
        "nixl descriptors per layer and request slot: conv q 9216 at 0, conv k 9216 at 9216, conv v 9216 at 18432, recurrent 786432 at 27648",
    ] {
        assert!(out.contains(want), "{want}\n{out}");
    }
    let (code, out, err) = kvprobe(&["geometry", "--model-config", k3, "--tp", "8", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["regions"][1]["kind"], "state");
    assert_eq!(v["regions"][1]["page_bytes"], 814_080);
    assert_eq!(v["regions"][1]["parts"][1]["shape"], serde_json::json!([12, 128, 128]));
    assert_eq!(v["model"]["hybrid"]["state"]["mixer"], "kda");
    // A block size whose page cannot hold a state slot is raised as vLLM raises it: the
    // smallest multiple of max(asked, 16, MLA 128) that holds 814 080 bytes at 1152 a token.
    let (code, out, err) = kvprobe(&["geometry", "--model-config", k3, "--tp", "8", "--block-size", "64"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("block size:   768 tokens: --block-size 64 raised"), "{out}");
    let (code, out, err) = kvprobe(&["geometry", "--model-config", k3, "--tp", "8", "--block-size", "500", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    // 500 · ceil(814080 / (500 · 1152)) = 1000.
    assert_eq!((v["geometry"]["block_size"].as_u64(), v["model"]["block_size_asked"].as_u64()), (Some(1000), Some(500)));
    // ab does not move a hybrid model's state yet, and refuses to move its KV cache partly
    // (exit 2, saying what; `run` moves it: tests/regions.rs).
    let (code, out, err) = kvprobe(&["ab", "--memory", "dram", "--model-config", k3, "--tp", "8"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("KDA state (69 layers)") && err.contains("does not move it in this command yet"), "{err}");
}

/// Region rows (docs/fingerprint.md "Region rows"): a Kimi-K3 KDA state slot on rank 3 of 8,
/// laid out by hand from the page's parts: the conv's Q, K and V sections (12 288 channels × 3
/// bf16 each in the whole model, 9216 bytes a rank: 18 rows of 512) and the recurrent state
/// (96 × 128 × 128 fp32, 786 432 bytes a rank: 1536 rows of 512).
#[test]
fn a_state_slot_is_tagged_row_by_row_with_layer_part_and_global_row() {
    use kvprobe::fingerprint;
    use kvprobe::geometry::KvPart;
    use kvprobe::hybrid::{RowRun, region_layer, run_rows};
    let m = ModelKv::load(&shipped("kimi-k3.json")).unwrap();
    let s = hybrid(&m).state.clone().unwrap();
    let runs = s.rank_row_runs(8, 3).unwrap();
    let run = |part, offset, rows, first_row| RowRun { part, offset, rows, row_bytes: 512, first_row };
    assert_eq!(
        runs,
        vec![
            run(0, 0, 18, 3 * 18),
            run(0, 9216, 18, 144 + 3 * 18),
            run(0, 2 * 9216, 18, 2 * 144 + 3 * 18),
            run(1, 27_648, 1536, 3 * 1536),
        ]
    );
    // Every rank's runs tile its page exactly, and the ranks' global rows tile the model's.
    let page = s.rank_page_bytes(8).unwrap();
    let mut global: Vec<(u32, u32)> = Vec::new();
    for rank in 0..8 {
        let runs = s.rank_row_runs(8, rank).unwrap();
        let mut at = 0;
        for r in &runs {
            assert_eq!(r.offset, at);
            at += r.rows as u64 * r.row_bytes as u64;
            global.extend((r.first_row..r.first_row + r.rows).map(|g| (r.part, g)));
        }
        assert_eq!(at, page);
    }
    global.sort();
    let conv_rows = 3 * 144;
    let want: Vec<(u32, u32)> = (0..conv_rows).map(|g| (0, g)).chain((0..8 * 1536).map(|g| (1, g))).collect();
    assert_eq!(global, want, "each global row once across the 8 ranks");
    // Fill the page; every row's tag names layer 40, its part, request 77, generation 5 and
    // its global row; the whole page verifies.
    let (seed, layer, request, generation) = (0xFEED_F00D_u64, 40, 77, 5);
    let mut bytes = vec![0u8; page as usize];
    for r in &runs {
        let rows = run_rows(r, layer, request, generation);
        rows.validate().unwrap();
        let span = r.offset as usize..(r.offset + r.rows as u64 * 512) as usize;
        fingerprint::fill(&mut bytes[span.clone()], seed, &rows);
        assert_eq!(fingerprint::check(&bytes[span], seed, &rows).0, 0);
        for i in 0..r.rows {
            let off = r.offset + i as u64 * 512;
            let (id, unit) = fingerprint::decode_tag(&bytes, seed, off, 512).expect("a tag");
            assert_eq!(unit, 0);
            assert_eq!(
                (id.slice.layer, id.slice.kv, id.slice.block, id.slice.generation),
                (region_layer(40, r.part), KvPart::Region, 77, 5)
            );
            assert_eq!((id.token, id.head), (r.first_row + i, 0));
        }
    }
    assert_eq!(region_layer(40, 1), 40 | 1 << 12);
    // The same bytes from the spec re-implemented from the docs, and from the Python reference.
    let r = runs[1];
    let spec = crate::fingerprint::spec::rows(seed, region_layer(40, 0), 3, 77, 5, "rows", r.rows, 1, 512, r.first_row, 0);
    assert_eq!(&bytes[9216..2 * 9216], &spec[..]);
    let args =
        ["0xFEEDF00D", "40", "region", "77", "5", "rows", "18", "1", "512", &r.first_row.to_string(), "0"].map(String::from);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out, err) = crate::fingerprint::fingerprint_ref(&args);
    assert_eq!((code, out.trim()), (0, fingerprint::digest(&bytes[9216..2 * 9216]).as_str()), "{err}");
}

#[test]
fn state_sections_follow_each_mixer_and_replicated_groups() {
    // Mamba2 with one group over 4 ranks: x is split, B and C are whole on every rank (their
    // global rows the same on every rank); ssm split.
    let m = ModelKv::parse(&NEMOTRON.replace(r#""n_groups": 8"#, r#""n_groups": 1"#)).unwrap();
    let s = hybrid(&m).state.clone().unwrap();
    let a = s.rank_row_runs(4, 1).unwrap();
    let b = s.rank_row_runs(4, 2).unwrap();
    assert_eq!(a.len(), 4);
    // x: 8192 channels × 3 × 2 bytes = 49 152 bytes, 12 288 a rank; B, C: 128 × 3 × 2 = 768 each.
    assert_eq!(a[0].rows as u64 * a[0].row_bytes as u64, 12_288);
    assert_eq!(a[1].rows as u64 * a[1].row_bytes as u64, 768);
    assert_ne!(a[0].first_row, b[0].first_row, "x is split");
    assert_eq!((a[1].first_row, a[2].first_row), (b[1].first_row, b[2].first_row), "B and C are replicated");
    assert_eq!(a[3].part, 1);
    // vLLM's _build_mamba_local: x, B, C, then the ssm state right after the conv bytes.
    let r = regions(&m, 4);
    let d: Vec<(&str, u64, u64)> = r[1].descriptors.iter().map(|d| (d.name.as_str(), d.offset, d.bytes)).collect();
    let ssm = 128 / 4 * 64 * 128 * 4;
    assert_eq!(d, vec![("conv x", 0, 12_288), ("conv B", 12_288, 768), ("conv C", 13_056, 768), ("ssm", 13_824, ssm)]);
    assert_eq!(r[0].descriptors.len(), 1, "an attention page moves whole");
    // Indexer: 64 tokens × 128 fp8 bytes (16 rows of 512), then 64 fp32 scales (one row of 256).
    let v32 = ModelKv::parse(
        r#"{"model_type": "deepseek_v32", "num_hidden_layers": 2, "num_attention_heads": 8, "kv_lora_rank": 512, "index_topk": 4}"#,
    )
    .unwrap();
    let runs = hybrid(&v32).indexer.as_ref().unwrap().block_row_runs(64).unwrap();
    let got: Vec<(u32, u64, u32, u32, u32)> = runs.iter().map(|r| (r.part, r.offset, r.rows, r.row_bytes, r.first_row)).collect();
    assert_eq!(got, vec![(0, 0, 16, 512, 0), (1, 8192, 1, 256, 0)]);
}

/// Issue 36 item 4 (the classes, on region rows): another request's state is `misplaced`, an
/// older generation `stale`, a slot nothing reached `unwritten`, another rank's chunk of the
/// right state `layout` (its rows at the wrong global place), a flipped bit `bitflip`.
#[test]
fn region_rows_classify_like_block_rows() {
    use kvprobe::fingerprint;
    use kvprobe::hybrid::run_rows;
    use kvprobe::verify::{Class, classify};
    let m = ModelKv::load(&shipped("kimi-k3.json")).unwrap();
    let s = hybrid(&m).state.clone().unwrap();
    let (seed, slot, iteration) = (9u64, 123u32, 4u32);
    let mine = s.rank_row_runs(8, 3).unwrap()[3]; // rank 3's recurrent rows
    let due = run_rows(&mine, 40, 77, 5);
    let arrived = |r: &kvprobe::fingerprint::SliceRows| fingerprint::expected(seed, r);
    let v = classify(&arrived(&run_rows(&mine, 40, 78, 5)), &due, seed, slot, iteration);
    assert_eq!((v.class, v.observed.map(|o| o.block)), (Class::Misplaced, Some(78)));
    let v = classify(&arrived(&run_rows(&mine, 40, 77, 4)), &due, seed, slot, iteration);
    assert_eq!((v.class, v.observed.map(|o| o.generation)), (Class::Stale, Some(4)));
    let v = classify(&arrived(&run_rows(&mine, 41, 77, 5)), &due, seed, slot, iteration);
    assert_eq!(v.class, Class::Misplaced, "another layer's state");
    let mut poison = vec![0u8; due.len() as usize];
    fingerprint::poison(&mut poison, slot, iteration);
    assert_eq!(classify(&poison, &due, seed, slot, iteration).class, Class::Unwritten);
    let theirs = s.rank_row_runs(8, 2).unwrap()[3];
    let v = classify(&arrived(&run_rows(&theirs, 40, 77, 5)), &due, seed, slot, iteration);
    assert_eq!(v.class, Class::Layout, "rank 2's chunk where rank 3's is due: {v:?}");
    let mut flipped = arrived(&due);
    flipped[1000] ^= 0x10;
    assert_eq!(classify(&flipped, &due, seed, slot, iteration).class, Class::Bitflip);
}

/// Unequal TP: prefill at TP 2 and decode at TP 8 cut rows for TP 8, and decode ranks 4..7
/// hold exactly prefill rank 1's global rows (the same (part, row) names the same bytes).
#[test]
fn region_rows_agree_between_unequal_tp_sizes() {
    let m = ModelKv::parse(NEMOTRON).unwrap(); // n_groups 8: B and C split too
    let s = hybrid(&m).state.clone().unwrap();
    let rows = |tp: u32, rank: u32| -> Vec<(u32, u32, u32)> {
        let mut v: Vec<(u32, u32, u32)> = s
            .rank_row_runs_with(tp, rank, 8)
            .unwrap()
            .iter()
            .flat_map(|r| (r.first_row..r.first_row + r.rows).map(move |g| (r.part, g, r.row_bytes)))
            .collect();
        v.sort();
        v
    };
    let mut decode: Vec<(u32, u32, u32)> = (4..8).flat_map(|d| rows(8, d)).collect();
    decode.sort();
    assert_eq!(decode, rows(2, 1));
    assert!(s.rank_row_runs_with(2, 0, 16).is_err(), "n_groups 8 over 16 ranks is refused");
}
