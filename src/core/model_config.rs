//! Geometry from a Hugging Face `config.json` (`--model-config PATH`, with `--tp` and
//! `--kv-cache-dtype`): the per-rank KV-cache shape a vLLM engine serving that model would
//! allocate.
//!
//! What is read, and the vLLM function each rule follows (`vllm/config/model.py`,
//! `ModelConfig` and its architecture convertor `vllm/transformers_utils/
//! model_arch_config_convertor.py`):
//!
//! | field | rule | vLLM |
//! |---|---|---|
//! | the text model | `text_config` when present (multimodal wrappers nest the language model there), else the top level | `get_hf_text_config` |
//! | layers | `num_hidden_layers` (also `n_layer`, `num_layers`) | `get_num_layers` |
//! | MLA | `kv_lora_rank` present and not null with a DeepSeek-style `model_type` ([`MLA_MODEL_TYPES`]; another is refused): one latent per layer, `head_size = kv_lora_rank + qk_rope_head_dim`, 1 KV head | `is_deepseek_mla`, `get_head_size` |
//! | KV heads | `n_head_kv`, `num_kv_heads`, `num_key_value_heads`, `multi_query_group_num`, the first present; else `num_attention_heads` (or `n_head`); `multi_query: true` → 1 unless Falcon's `new_decoder_architecture` | `get_total_num_kv_heads` |
//! | head size | `head_dim` when not null, else `hidden_size_per_head`, else `hidden_size / num_attention_heads` | `get_head_size` |
//! | dtype | `--kv-cache-dtype auto` (the default): the model's `torch_dtype` (or `dtype`; the top level's before `text_config`'s); float32 or absent → bfloat16 (vLLM's `dtype=auto` downcasts float32 to the platform's first dtype, bfloat16 on CUDA GPUs that have it) | `_resolve_auto_dtype`, `CacheConfig.cache_dtype` |
//! | per TP rank | KV heads per rank `max(1, total / tp)`; when `tp` exceeds the KV heads each is replicated on `tp / total` ranks; `num_attention_heads` must divide by `tp`, and the KV heads by `tp` (or `tp` by them); MLA's latent is whole on every rank | `get_num_kv_heads`, `verify_with_parallel_config`, `QKVParallelLinear` (`num_kv_head_replicas`) |
//! | block size | 16 tokens; MLA 64 | `CacheConfig.block_size`; the CUDA platform sets 64 for FlashMLA (`CudaPlatform.check_and_update_config`) |
//!
//! Fields a published config.json leaves to Transformers' class defaults are filled from
//! them for the model types whose cards rely on it (`defaults_of`: Gemma 3's text model,
//! Gemma 2, Gemma, DeepSeek V2/V3).
//!
//! Layers whose KV cache is not uniform: `layer_types` (one entry per layer), or Transformers'
//! defaults without it (`sliding_window_pattern`: every Nth layer full attention; Llama 4's
//! `attention_chunk_size`; Gemma 2 alternating; Qwen2's `max_window_layers`), or
//! `sliding_window` alone (every layer), split the layers into **layer groups** — full attention, sliding window (with its
//! window in tokens), chunked attention — as vLLM's hybrid KV-cache manager groups them
//! (`vllm/v1/core/kv_cache_utils.py`). Their pages have one shape here, so kvprobe gives
//! every layer the same per-layer region and moves every block of every layer (a superset of
//! what a sliding-window layer's connector moves); the groups are reported. A layer that
//! holds no paged KV cache (Mamba or linear-attention state, convolution: `layer_types`
//! entries `mamba`, `linear_attention`, `conv`, ..., `layers_block_type`,
//! `hybrid_override_pattern`), or sliding-window layers with their own KV shape
//! (`swa_num_key_value_heads`, `swa_head_dim`), or a per-layer list of KV heads, is refused
//! with the reason.

use crate::core::geometry::{Dtype, Geometry, Layout};
use crate::core::hybrid::{HybridKv, LayerRole, Region};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::fmt;
use std::path::Path;

/// A config.json that cannot give a geometry.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ModelConfigError {
    /// The file cannot be read or is not a JSON object.
    #[error("--model-config {path}: {reason}")]
    Unreadable {
        /// The path given.
        path: String,
        /// Why.
        reason: String,
    },
    /// A field is missing, has the wrong type or an impossible value.
    #[error("model config: {0}")]
    Field(String),
    /// The model's KV cache is something kvprobe does not model (see the module docs).
    #[error("model config: {0}")]
    Unsupported(String),
    /// `--tp` does not split the model's heads the way vLLM allows.
    #[error("model config: {0}")]
    Parallel(String),
}

impl From<crate::core::hybrid::HybridError> for ModelConfigError {
    fn from(e: crate::core::hybrid::HybridError) -> Self {
        use crate::core::hybrid::HybridError as H;
        match e {
            H::Field(s) => ModelConfigError::Field(s),
            H::Unsupported(s) => ModelConfigError::Unsupported(s),
            H::Parallel(s) => ModelConfigError::Parallel(s),
        }
    }
}

/// The KV-cache element type asked for (`--kv-cache-dtype`, vLLM's `CacheConfig.cache_dtype`
/// names).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum KvCacheDtype {
    /// The model's dtype (`torch_dtype`; float32 or absent → bfloat16).
    #[default]
    Auto,
    /// bfloat16 (2 bytes).
    Bfloat16,
    /// float16 (2 bytes).
    Float16,
    /// 8-bit float, vLLM's default fp8 format (e4m3 on CUDA), 1 byte.
    Fp8,
    /// 8-bit float e4m3, 1 byte.
    #[value(name = "fp8_e4m3")]
    Fp8E4m3,
    /// 8-bit float e5m2, 1 byte.
    #[value(name = "fp8_e5m2")]
    Fp8E5m2,
}

/// How a group of layers attends (a vLLM KV-cache group's spec).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "attention")]
pub enum Attention {
    /// Every token of the sequence (vLLM `FullAttentionSpec`).
    Full,
    /// The last `window` tokens (vLLM `SlidingWindowSpec`).
    SlidingWindow {
        /// Window in tokens.
        window: u64,
    },
    /// Chunks of `chunk` tokens (vLLM `ChunkedLocalAttentionSpec`).
    ChunkedLocal {
        /// Chunk in tokens.
        chunk: u64,
    },
}

impl fmt::Display for Attention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attention::Full => f.write_str("full attention"),
            Attention::SlidingWindow { window } => write!(f, "sliding window {window} tokens"),
            Attention::ChunkedLocal { chunk } => write!(f, "chunked local attention {chunk} tokens"),
        }
    }
}

/// Layers that attend alike (one vLLM KV-cache group).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerGroup {
    /// How they attend.
    #[serde(flatten)]
    pub attention: Attention,
    /// Their layer indices (ascending).
    pub layers: Vec<u32>,
}

/// What a config.json says about the model's KV cache, before tensor parallelism.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelKv {
    /// `model_type` of the text model (or the top level's), when given.
    pub model_type: Option<String>,
    /// Attention layers (`num_hidden_layers`).
    pub num_layers: u32,
    /// Query heads (`num_attention_heads`; MLA models too).
    pub num_attention_heads: u32,
    /// KV heads of the whole model (1 for MLA).
    pub total_kv_heads: u32,
    /// Elements per head (MLA: `kv_lora_rank + qk_rope_head_dim`).
    pub head_size: u32,
    /// Multi-head latent attention.
    pub mla: bool,
    /// The model's own dtype (`torch_dtype` resolved as `--kv-cache-dtype auto` does).
    pub dtype: Dtype,
    /// The attention layers by how they attend; one group when all attend alike.
    pub layer_groups: Vec<LayerGroup>,
    /// A hybrid model's other regions: recurrent state layers, the sparse-attention indexer
    /// ([`crate::core::hybrid`]); absent for an attention-only model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hybrid: Option<HybridKv>,
}

/// How `--tp` splits the KV heads over the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TpSplit {
    /// Tensor-parallel size.
    pub tp: u32,
    /// KV heads each rank holds (MLA: 1, the whole latent).
    pub kv_heads_per_rank: u32,
    /// Ranks holding a copy of each KV head (1 = no replication; MLA: `tp`, every rank holds
    /// the latent).
    pub replicas: u32,
}

/// What `--model-config` resolved to, written in reports as `config.model`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// The config file as given.
    pub path: String,
    /// `--kv-cache-dtype`.
    pub kv_cache_dtype: KvCacheDtype,
    /// The model, before TP.
    #[serde(flatten)]
    pub kv: ModelKv,
    /// The split over TP ranks; the run's geometry is one rank's.
    pub tp: TpSplit,
    /// A hybrid model's `--block-size` when vLLM's rule raised it (the geometry's block size
    /// is the raised one: [`crate::core::hybrid::hybrid_block_size`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size_asked: Option<u32>,
}

/// Most blocks [`default_blocks`] gives (a tiny model's 1 GiB would be millions of blocks,
/// whose bookkeeping outweighs the pool).
pub const MAX_DEFAULT_BLOCKS: u32 = 1 << 16;

/// Default blocks per pool for a model config: the smallest power of two whose pool holds
/// at least 1 GiB (2^30 bytes), the size of the presets' pools (llama3-8b: 512 blocks of
/// 2 MiB; deepseek-v3: 256 of 4.4 MiB), at most [`MAX_DEFAULT_BLOCKS`]. Computed after
/// `--block-size` and `--layout` apply.
pub fn default_blocks(g: &Geometry) -> u32 {
    let per_block = g.slice_bytes().unwrap_or(1).saturating_mul(g.kv_parts() as u64).saturating_mul(g.num_layers as u64);
    let need = (1u64 << 30).div_ceil(per_block.max(1));
    need.next_power_of_two().clamp(1, MAX_DEFAULT_BLOCKS as u64) as u32
}

/// A path as it may be printed: control characters escaped (a file name reaches terminals and
/// reports).
pub fn show_path(p: &Path) -> String {
    let s = p.to_string_lossy();
    if s.chars().any(char::is_control) { s.chars().flat_map(char::escape_default).collect() } else { s.into_owned() }
}

/// Most bytes of a config.json read (16 MiB).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

use crate::core::hybrid::get;

/// A positive integer field (≤ u32::MAX); `None` when absent or null.
fn uint(m: &Map<String, Value>, key: &str) -> Result<Option<u32>, ModelConfigError> {
    let Some(v) = get(m, key) else { return Ok(None) };
    match v.as_u64() {
        Some(n) if n >= 1 && n <= u32::MAX as u64 => Ok(Some(n as u32)),
        _ => Err(ModelConfigError::Field(format!("{key} must be an integer from 1 to {}, not {v}", u32::MAX))),
    }
}

/// The first of `keys` present: its value (a positive integer); a list is refused (a
/// per-layer value: pages that differ between layers).
fn first_uint(m: &Map<String, Value>, keys: &[&str]) -> Result<Option<u32>, ModelConfigError> {
    for k in keys {
        if let Some(v) = get(m, k) {
            if v.is_array() {
                return Err(ModelConfigError::Unsupported(format!(
                    "{k} is a list (it differs by layer): a KV cache whose pages differ in shape between layers is not modelled"
                )));
            }
            return uint(m, k);
        }
    }
    Ok(None)
}

/// Keys that mark a hybrid model (besides any key starting `mamba` or `ssm_`): Jamba
/// (`layers_block_type`, `attn_layer_period`, `attn_layer_indices`), Nemotron-H
/// (`hybrid_override_pattern`), Qwen3-Next (`full_attention_interval`, `linear_*_heads`,
/// `linear_*_dim`), MiniMax-Text-01 (`attn_type_list`), Kimi Linear (`linear_attn_config`),
/// RecurrentGemma (`block_types`), LFM2 (`full_attn_idxs`, `conv_L_cache`).
const HYBRID_KEYS: &[&str] = &[
    "layers_block_type",
    "hybrid_override_pattern",
    "attn_layer_indices",
    "attn_layer_period",
    "full_attention_interval",
    "attn_type_list",
    "block_types",
    "linear_attn_config",
    "linear_num_value_heads",
    "linear_num_key_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "full_attn_idxs",
    "conv_L_cache",
];

/// Transformers' class defaults of the fields this module reads, for model types whose
/// published config.json relies on them (`Gemma3TextConfig`, `Gemma2Config`, `GemmaConfig`,
/// `DeepseekV2Config`, `DeepseekV3Config`): filled in where the file leaves them out.
fn defaults_of(m: &Map<String, Value>) -> Option<&'static [(&'static str, u64)]> {
    Some(match get(m, "model_type").and_then(Value::as_str)? {
        "gemma3_text" => &[
            ("num_hidden_layers", 26),
            ("num_attention_heads", 8),
            ("num_key_value_heads", 4),
            ("head_dim", 256),
            ("sliding_window", 4096),
            ("sliding_window_pattern", 6),
        ],
        "gemma2" | "gemma" => &[("head_dim", 256)],
        "deepseek_v2" | "deepseek_v3" => &[("kv_lora_rank", 512), ("qk_rope_head_dim", 64)],
        _ => return None,
    })
}

/// Model types whose `kv_lora_rank` means a latent KV cache in vLLM (`is_deepseek_mla`).
pub const MLA_MODEL_TYPES: &[&str] = &[
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "deepseek_mtp",
    "kimi_k2",
    "kimi_linear",
    "kimi_k3",
    "longcat_flash",
    "pangu_ultra_moe",
    "pangu_ultra_moe_mtp",
];

const KV_HEAD_KEYS: &[&str] = &["n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num"];
const LAYER_KEYS: &[&str] = &["num_hidden_layers", "n_layer", "num_layers"];

fn dtype_of(m: &Map<String, Value>, top: &Map<String, Value>) -> Result<Dtype, ModelConfigError> {
    // The top level first, then the text model (vLLM's `_find_dtype`).
    let found = [top, m].iter().flat_map(|c| ["torch_dtype", "dtype"].map(|k| (k, get(c, k)))).find_map(|(k, v)| Some((k, v?)));
    let Some((key, v)) = found else { return Ok(Dtype::Bf16) };
    match v.as_str() {
        Some("bfloat16") => Ok(Dtype::Bf16),
        Some("float16" | "half") => Ok(Dtype::Fp16),
        Some("float32" | "float") => Ok(Dtype::Bf16),
        _ => Err(ModelConfigError::Field(format!("{key} must be bfloat16, float16 or float32, not {v}"))),
    }
}

/// A boolean field (`default` when absent or null); anything but true/false is an error.
fn flag(m: &Map<String, Value>, key: &str, default: bool) -> Result<bool, ModelConfigError> {
    match get(m, key) {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ModelConfigError::Field(format!("{key} must be true or false, not {v}"))),
    }
}

fn window(m: &Map<String, Value>, key: &str, why: &str) -> Result<u64, ModelConfigError> {
    match get(m, key).map(|v| v.as_u64()) {
        Some(Some(w)) if w >= 1 => Ok(w),
        Some(_) => Err(ModelConfigError::Field(format!("{key} must be a positive integer, not {}", m[key]))),
        None => Err(ModelConfigError::Field(format!("{why} but {key} is not given"))),
    }
}

/// The layer groups (module docs): from `layer_types`, `sliding_window_pattern` or
/// `sliding_window`; errors on layers without a paged KV cache.
fn layer_groups(m: &Map<String, Value>, layers: u32, roles: Option<&[LayerRole]>) -> Result<Vec<LayerGroup>, ModelConfigError> {
    // Hybrid models kvprobe does not lay out (crate::core::hybrid reads the others): some
    // layers keep a state (Mamba/SSM, linear attention, RG-LRU, short conv) instead of a paged
    // KV cache. Named by any of these keys, or a key starting `mamba`/`ssm_`.
    let hybrid = m
        .iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, _)| k.as_str())
        .find(|k| HYBRID_KEYS.contains(k) || k.starts_with("mamba") || k.starts_with("ssm_"));
    if let (Some(key), None) = (hybrid, roles) {
        return Err(ModelConfigError::Unsupported(format!(
            "{key} is given: a hybrid model whose layers keep a recurrent state besides or instead of a paged KV cache, of a family kvprobe does not lay out; it lays out Kimi Linear / Kimi-K3 (linear_attn_config), Qwen3-Next (gated DeltaNet), Nemotron-H and Granite 4.0-H (Mamba2), Jamba (Mamba1) and DeepSeek-V3.2's indexer (docs/geometry.md \"Hybrid KV caches\")"
        )));
    }
    if get(m, "block_configs").is_some() {
        return Err(ModelConfigError::Unsupported(
            "block_configs is given: per-layer attention configurations (Nemotron-NAS: KV heads that differ by layer, layers without attention), a KV cache whose pages differ between layers; not modelled".into(),
        ));
    }
    if let Some(v) = get(m, "num_kv_shared_layers")
        && v.as_u64().is_none()
    {
        return Err(ModelConfigError::Field(format!("num_kv_shared_layers must be a non-negative integer, not {v}")));
    }
    if get(m, "num_kv_shared_layers").and_then(Value::as_u64).unwrap_or(0) > 0 {
        return Err(ModelConfigError::Unsupported(
            "num_kv_shared_layers is given: later layers reuse earlier layers' KV cache (Gemma 3n), a KV cache that is not one region per layer; not modelled".into(),
        ));
    }
    for key in ["swa_num_key_value_heads", "swa_head_dim"] {
        if get(m, key).is_some() {
            return Err(ModelConfigError::Unsupported(format!(
                "{key} is given: sliding-window layers with their own KV shape (a KV cache whose pages differ between layer groups) are not modelled"
            )));
        }
    }
    let mut per_layer: Vec<Attention> = Vec::with_capacity(layers as usize);
    if let Some(types) = get(m, "layer_types") {
        let Some(types) = types.as_array() else {
            return Err(ModelConfigError::Field(format!("layer_types must be a list of strings, not {types}")));
        };
        if types.len() != layers as usize {
            return Err(ModelConfigError::Field(format!(
                "layer_types has {} entries for {layers} layers (num_hidden_layers)",
                types.len()
            )));
        }
        for (i, t) in types.iter().enumerate() {
            if roles.is_some_and(|r| r[i] != LayerRole::Attention) {
                continue;
            }
            let a = match t.as_str() {
                Some("full_attention" | "attention" | "global_attention" | "*") => Attention::Full,
                Some("sliding_attention" | "sliding_window_attention" | "local_attention") => {
                    Attention::SlidingWindow { window: window(m, "sliding_window", &format!("layer {i} is {t}"))? }
                }
                Some("chunked_attention") => {
                    Attention::ChunkedLocal { chunk: window(m, "attention_chunk_size", &format!("layer {i} is {t}"))? }
                }
                Some(other) => {
                    return Err(ModelConfigError::Unsupported(format!(
                        "layer {i} is {other:?} in layer_types: not an attention layer type kvprobe knows (full_attention, sliding_attention, chunked_attention); Mamba, linear-attention and convolution layers keep a state that is not a paged KV cache"
                    )));
                }
                None => return Err(ModelConfigError::Field(format!("layer_types[{i}] must be a string, not {t}"))),
            };
            per_layer.push(a);
        }
    } else if let Some(p) = get(m, "sliding_window_pattern") {
        let n = p
            .as_u64()
            .filter(|n| *n >= 1)
            .ok_or_else(|| ModelConfigError::Field(format!("sliding_window_pattern must be a positive integer, not {p}")))?;
        let w = window(m, "sliding_window", "sliding_window_pattern is given")?;
        // Gemma 2/3: layer i is full attention when (i + 1) % pattern == 0.
        per_layer.extend(
            (0..layers as u64).map(|i| if (i + 1) % n == 0 { Attention::Full } else { Attention::SlidingWindow { window: w } }),
        );
    } else if get(m, "attention_chunk_size").is_some() {
        // Llama 4: chunked local attention on the layers that use RoPE; `no_rope_layers` (1 =
        // RoPE) or, by Transformers' default, every layer but each 4th
        // (`no_rope_layer_interval`).
        let chunk = window(m, "attention_chunk_size", "attention_chunk_size is given")?;
        let default_rope = || {
            let n = get(m, "no_rope_layer_interval").and_then(Value::as_u64).filter(|n| *n >= 1).unwrap_or(4);
            (0..layers as u64).map(|i| (i + 1) % n != 0).collect::<Vec<bool>>()
        };
        let rope: Vec<bool> = match get(m, "no_rope_layers") {
            Some(Value::Array(v)) if v.is_empty() => default_rope(),
            Some(Value::Array(v)) if v.len() == layers as usize => v.iter().map(|x| x.as_u64() == Some(1)).collect(),
            Some(v) => {
                return Err(ModelConfigError::Field(format!("no_rope_layers must be a list of {layers} 0/1 entries, not {v}")));
            }
            None => default_rope(),
        };
        per_layer.extend(rope.into_iter().map(|r| if r { Attention::ChunkedLocal { chunk } } else { Attention::Full }));
    } else if get(m, "sliding_window").is_some() && !flag(m, "use_sliding_window", true)? {
        per_layer.extend((0..layers).map(|_| Attention::Full));
    } else if get(m, "sliding_window").is_some() {
        let w = window(m, "sliding_window", "sliding_window is given")?;
        let model_type = get(m, "model_type").and_then(Value::as_str).unwrap_or("");
        if model_type == "gemma2" {
            // Gemma 2 (Transformers' default layer_types): even layers sliding, odd full.
            per_layer
                .extend((0..layers).map(|i| if i % 2 == 0 { Attention::SlidingWindow { window: w } } else { Attention::Full }));
        } else if let Some(first) = get(m, "max_window_layers").and_then(Value::as_u64) {
            // Qwen2 family: layers from max_window_layers on use the window.
            per_layer.extend(
                (0..layers as u64).map(|i| if i >= first { Attention::SlidingWindow { window: w } } else { Attention::Full }),
            );
        } else {
            per_layer.extend((0..layers).map(|_| Attention::SlidingWindow { window: w }));
        }
    } else {
        per_layer.extend((0..layers).map(|_| Attention::Full));
    }
    // A hybrid's layer_types list skipped its state layers; the other rules gave every layer.
    let attention_layers: Vec<usize> = match roles {
        Some(r) => (0..layers as usize).filter(|&i| r[i] == LayerRole::Attention).collect(),
        None => (0..layers as usize).collect(),
    };
    let per_layer: Vec<(usize, Attention)> = if per_layer.len() == attention_layers.len() {
        attention_layers.into_iter().zip(per_layer).collect()
    } else {
        attention_layers.into_iter().map(|i| (i, per_layer[i].clone())).collect()
    };
    let mut groups: Vec<LayerGroup> = Vec::new();
    for (i, a) in per_layer.into_iter() {
        match groups.iter_mut().find(|g| g.attention == a) {
            Some(g) => g.layers.push(i as u32),
            None => groups.push(LayerGroup { attention: a, layers: vec![i as u32] }),
        }
    }
    Ok(groups)
}

impl ModelKv {
    /// Reads a config.json file (see [`ModelKv::parse`]).
    ///
    /// Errors: [`ModelConfigError::Unreadable`] when the file cannot be read or is not
    /// JSON, and those of [`ModelKv::parse`].
    pub fn load(path: &Path) -> Result<ModelKv, ModelConfigError> {
        use std::io::Read;
        let unreadable = |reason: String| ModelConfigError::Unreadable { path: show_path(path), reason };
        let meta = std::fs::metadata(path).map_err(|e| unreadable(e.to_string()))?;
        // A model directory (as vLLM takes one): its config.json.
        let file = if meta.is_dir() { path.join("config.json") } else { path.to_path_buf() };
        // Opened without blocking (a FIFO, /proc/kmsg), then its type checked on the open file,
        // so a file swapped for a FIFO after a check cannot hang the read.
        use std::os::unix::fs::OpenOptionsExt;
        let shown = show_path(&file);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&file)
            .map_err(|e| unreadable(format!("{shown}: {e}")))?;
        let meta = f.metadata().map_err(|e| unreadable(format!("{shown}: {e}")))?;
        if !meta.is_file() {
            return Err(unreadable(format!("{shown} is not a regular file (a directory, device, FIFO or socket is not read)")));
        }
        let mut text = Vec::new();
        f.take(MAX_CONFIG_BYTES + 1).read_to_end(&mut text).map_err(|e| unreadable(format!("{shown}: {e}")))?;
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return Err(unreadable(format!("over {MAX_CONFIG_BYTES} bytes: a config.json is a few KiB")));
        }
        let text = String::from_utf8(text).map_err(|_| unreadable("not UTF-8 text".into()))?;
        Self::parse(&text).map_err(|e| match e {
            ModelConfigError::Unreadable { reason, .. } => unreadable(reason),
            e => e,
        })
    }

    /// Parses the text of a config.json (module docs for the fields and rules).
    ///
    /// Errors: not a JSON object ([`ModelConfigError::Unreadable`]); a missing or malformed
    /// field ([`ModelConfigError::Field`]); a KV cache kvprobe does not model
    /// ([`ModelConfigError::Unsupported`]).
    pub fn parse(text: &str) -> Result<ModelKv, ModelConfigError> {
        let unreadable = |reason: String| ModelConfigError::Unreadable { path: String::new(), reason };
        let top: Value = serde_json::from_str(text).map_err(|e| unreadable(format!("not JSON: {e}")))?;
        let Some(top) = top.as_object() else {
            return Err(unreadable("not a JSON object (a Hugging Face config.json is one)".into()));
        };
        let m = match get(top, "text_config") {
            Some(Value::Object(t)) => t,
            Some(v) => return Err(ModelConfigError::Field(format!("text_config must be an object, not {v}"))),
            None => top,
        };
        // Fields a published config.json leaves to Transformers' class defaults.
        let mut filled;
        let m = match defaults_of(m) {
            None => m,
            Some(d) => {
                filled = m.clone();
                for (k, v) in d {
                    if get(&filled, k).is_none() && !(*k == "sliding_window_pattern" && get(&filled, "layer_types").is_some()) {
                        filled.insert(k.to_string(), Value::from(*v));
                    }
                }
                &filled
            }
        };
        // Printable only (it is echoed to terminals and reports).
        let model_type = get(m, "model_type")
            .or_else(|| get(top, "model_type"))
            .and_then(Value::as_str)
            .map(|t| t.chars().flat_map(char::escape_default).take(64).collect::<String>());
        let num_layers = first_uint(m, LAYER_KEYS)?
            .ok_or_else(|| ModelConfigError::Field("num_hidden_layers is not given (the text model's layers)".into()))?;
        if num_layers > 0xFFFF {
            return Err(ModelConfigError::Field(format!("num_hidden_layers {num_layers} exceeds 65535")));
        }
        // A hybrid model's regions first, then what is not modelled: a refusal says more than
        // a field missing.
        let model_dtype = dtype_of(m, top)?;
        let hybrid = crate::core::hybrid::read(m, model_type.as_deref().unwrap_or(""), num_layers, model_dtype)?;
        let layer_groups = layer_groups(m, num_layers, hybrid.as_ref().map(|(r, _)| r.as_slice()))?;
        let hybrid = hybrid.map(|(_, h)| h).filter(HybridKv::any);
        let heads = first_uint(m, &["num_attention_heads", "n_head"])?
            .ok_or_else(|| ModelConfigError::Field("num_attention_heads is not given".into()))?;
        let mla = get(m, "kv_lora_rank").is_some();
        if mla && !MLA_MODEL_TYPES.contains(&model_type.as_deref().unwrap_or("")) {
            return Err(ModelConfigError::Unsupported(format!(
                "kv_lora_rank with model_type {:?}: vLLM serves a latent KV cache (MLA) only for the DeepSeek-style model types ({}); this model's KV shape is its own",
                model_type.as_deref().unwrap_or("(none)"),
                MLA_MODEL_TYPES.join(", ")
            )));
        }
        let (total_kv_heads, head_size) = if mla {
            let rank = uint(m, "kv_lora_rank")?.expect("present");
            let rope = match get(m, "qk_rope_head_dim").map(Value::as_u64) {
                None => 0,
                Some(Some(r)) if r <= u32::MAX as u64 => r as u32,
                Some(_) => {
                    return Err(ModelConfigError::Field(format!(
                        "qk_rope_head_dim must be an integer from 0 to {}, not {}",
                        u32::MAX,
                        m["qk_rope_head_dim"]
                    )));
                }
            };
            (
                1,
                rank.checked_add(rope)
                    .ok_or_else(|| ModelConfigError::Field("kv_lora_rank + qk_rope_head_dim overflows".into()))?,
            )
        } else {
            // Falcon's new decoder architecture ignores multi_query (vLLM get_total_num_kv_heads).
            let falcon_new = matches!(model_type.as_deref(), Some("falcon" | "RefinedWeb" | "RefinedWebModel"))
                && flag(m, "new_decoder_architecture", false)?;
            let kv =
                if !falcon_new && flag(m, "multi_query", false)? { 1 } else { first_uint(m, KV_HEAD_KEYS)?.unwrap_or(heads) };
            if kv > heads || !heads.is_multiple_of(kv) {
                return Err(ModelConfigError::Field(format!(
                    "{heads} attention heads do not form groups over {kv} KV heads (each KV head serves an equal group of query heads)"
                )));
            }
            let head = match uint(m, "head_dim")? {
                Some(h) => h,
                None => match uint(m, "hidden_size_per_head")? {
                    Some(h) => h,
                    None => {
                        let hidden = uint(m, "hidden_size")?.ok_or_else(|| {
                            ModelConfigError::Field("neither head_dim nor hidden_size is given (head size unknown)".into())
                        })?;
                        if hidden % heads != 0 {
                            return Err(ModelConfigError::Field(format!(
                                "hidden_size {hidden} is not a multiple of num_attention_heads {heads} and head_dim is not given"
                            )));
                        }
                        hidden / heads
                    }
                },
            };
            (kv, head)
        };
        Ok(ModelKv {
            model_type,
            num_layers,
            num_attention_heads: heads,
            total_kv_heads,
            head_size,
            mla,
            dtype: model_dtype,
            layer_groups,
            hybrid,
        })
    }

    /// How `tp` ranks split the KV heads (vLLM `get_num_kv_heads` and `QKVParallelLinear`).
    ///
    /// Errors ([`ModelConfigError::Parallel`]): `tp` 0; `num_attention_heads` not a multiple
    /// of `tp`; KV heads not a multiple of `tp` (when `tp` ≤ KV heads) nor `tp` a multiple
    /// of the KV heads (when `tp` > KV heads).
    pub fn split(&self, tp: u32) -> Result<TpSplit, ModelConfigError> {
        if tp == 0 {
            return Err(ModelConfigError::Parallel("--tp must be at least 1".into()));
        }
        if !self.num_attention_heads.is_multiple_of(tp) {
            return Err(ModelConfigError::Parallel(format!(
                "num_attention_heads {} is not divisible by --tp {tp} (vLLM refuses it)",
                self.num_attention_heads
            )));
        }
        if self.mla {
            return Ok(TpSplit { tp, kv_heads_per_rank: 1, replicas: tp });
        }
        let kv = self.total_kv_heads;
        if tp <= kv {
            if !kv.is_multiple_of(tp) {
                return Err(ModelConfigError::Parallel(format!("{kv} KV heads do not split evenly over --tp {tp}")));
            }
            Ok(TpSplit { tp, kv_heads_per_rank: kv / tp, replicas: 1 })
        } else {
            if !tp.is_multiple_of(kv) {
                return Err(ModelConfigError::Parallel(format!(
                    "--tp {tp} exceeds the {kv} KV heads and is not a multiple of them (each KV head is replicated on tp / heads ranks)"
                )));
            }
            Ok(TpSplit { tp, kv_heads_per_rank: 1, replicas: tp / kv })
        }
    }

    /// The element type of the KV cache for `--kv-cache-dtype`.
    pub fn cache_dtype(&self, want: KvCacheDtype) -> Dtype {
        match want {
            KvCacheDtype::Auto => self.dtype,
            KvCacheDtype::Bfloat16 => Dtype::Bf16,
            KvCacheDtype::Float16 => Dtype::Fp16,
            KvCacheDtype::Fp8 | KvCacheDtype::Fp8E4m3 | KvCacheDtype::Fp8E5m2 => Dtype::Fp8,
        }
    }

    /// Layers with a paged attention KV cache (all of them unless the model is hybrid).
    pub fn attention_layers(&self) -> u32 {
        self.layer_groups.iter().map(|g| g.layers.len() as u32).sum()
    }

    /// One TP rank's geometry: the model's attention layers, the rank's KV heads and head
    /// size, the dtype of `kv_cache_dtype`, NHD, block size 16 (MLA 64) — for a model with
    /// recurrent state, raised as vLLM raises it so an attention page holds a state slot
    /// ([`crate::core::hybrid::hybrid_block_size`]) — and [`default_blocks`] blocks. The
    /// caller's explicit flags then override fields. Errors: those of [`ModelKv::split`] and
    /// of the state's TP split ([`crate::core::hybrid::StateModel::rank_parts`]).
    pub fn rank_geometry(&self, tp: u32, kv_cache_dtype: KvCacheDtype) -> Result<(Geometry, TpSplit), ModelConfigError> {
        let split = self.split(tp)?;
        let mut g = Geometry {
            num_layers: self.attention_layers(),
            num_kv_heads: split.kv_heads_per_rank,
            head_size: self.head_size,
            block_size: if self.mla { 64 } else { 16 },
            num_blocks: 1,
            dtype: self.cache_dtype(kv_cache_dtype),
            layout: Layout::Nhd,
            mla: self.mla,
        };
        if let Some(s) = self.hybrid.as_ref().and_then(|h| h.state.as_ref()) {
            let per_token = g.bytes_per_token();
            let page = s.rank_page_bytes(tp)?;
            g.block_size = crate::core::hybrid::hybrid_block_size(per_token, page, g.mla, g.block_size);
            if g.block_size > crate::core::geometry::MAX_POSITION {
                return Err(ModelConfigError::Unsupported(format!(
                    "a {} slot is {page} bytes per layer on each of {tp} rank(s): an attention page that holds it takes {} tokens a block, more than the fingerprint's {} (a larger --tp splits the state)",
                    s.region_name(),
                    g.block_size,
                    crate::core::geometry::MAX_POSITION
                )));
            }
        }
        g.num_blocks = default_blocks(&g);
        Ok((g, split))
    }

    /// vLLM's block size for a hybrid model with recurrent state whose attention geometry is
    /// `g`, when `--block-size` asked for `asked` tokens: `asked` raised to the smallest
    /// multiple of max(16, MLA 128, `asked`) whose page holds a state slot
    /// ([`crate::core::hybrid::hybrid_block_size`]); `asked` itself for a model without state.
    /// Errors: those of the state's TP split.
    pub fn hybrid_block_size(&self, g: &Geometry, tp: u32, asked: u32) -> Result<u32, ModelConfigError> {
        match self.hybrid.as_ref().and_then(|h| h.state.as_ref()) {
            Some(s) => {
                let per_token = g.bytes_per_token();
                Ok(crate::core::hybrid::hybrid_block_size(per_token, s.rank_page_bytes(tp)?, g.mla, asked))
            }
            None => Ok(asked),
        }
    }

    /// Every region of one TP rank whose attention geometry is `g` (after the flags):
    /// [`crate::core::hybrid::rank_regions`] with this model's attention groups. Errors: those
    /// of `rank_regions`.
    pub fn rank_regions(&self, g: &Geometry, tp: u32) -> Result<Vec<Region>, ModelConfigError> {
        let kind = if self.mla { "MLA" } else { "" };
        let attention: Vec<(String, Vec<u32>)> = self
            .layer_groups
            .iter()
            .map(|grp| {
                let name = match (&grp.attention, kind) {
                    (Attention::Full, "MLA") => "MLA".to_string(),
                    (a, "MLA") => format!("MLA, {a}"),
                    (a, _) => a.to_string(),
                };
                (name, grp.layers.clone())
            })
            .collect();
        Ok(crate::core::hybrid::rank_regions(g, &attention, self.hybrid.as_ref().unwrap_or(&HybridKv::default()), tp)?)
    }
}

/// Human text of a geometry and, when a model config gave it, the model (`kvprobe geometry`):
/// one line per fact, sizes in bytes with binary units in parentheses.
pub fn describe(g: &Geometry, model: Option<&ModelInfo>) -> String {
    use std::fmt::Write;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let mut s = String::new();
    if let Some(m) = model {
        let kind = if m.kv.mla { "MLA".to_string() } else { format!("{} KV heads", m.kv.total_kv_heads) };
        let _ = writeln!(
            s,
            "model:        {} ({}{} layers, {kind}, head size {}, {} attention heads)",
            m.path,
            m.kv.model_type.as_deref().map(|t| format!("{t}, ")).unwrap_or_default(),
            m.kv.num_layers,
            m.kv.head_size,
            m.kv.num_attention_heads
        );
        let rep = match (m.kv.mla, m.tp.replicas) {
            (true, _) => format!("the latent whole on each of {} rank(s)", m.tp.tp),
            (false, 1) => "no replication".to_string(),
            (false, r) => format!("each KV head replicated on {r} ranks"),
        };
        let _ = writeln!(s, "tp:           {} ({} KV head(s) per rank, {rep})", m.tp.tp, m.tp.kv_heads_per_rank);
        if let Some(asked) = m.block_size_asked {
            let _ = writeln!(
                s,
                "block size:   {} tokens: --block-size {asked} raised as vLLM raises it, so that an attention page holds a state slot",
                g.block_size
            );
        }
        let dt = name(&m.kv_cache_dtype);
        let _ = writeln!(s, "kv cache:     --kv-cache-dtype {dt}: {} ({} byte(s) per element)", name(&g.dtype), g.dtype.bytes());
        for grp in &m.kv.layer_groups {
            let _ = writeln!(s, "layer group:  {} — {} layer(s): {}", grp.attention, grp.layers.len(), ranges(&grp.layers));
        }
        if let Some(h) = m.kv.hybrid.as_ref().filter(|h| h.any()) {
            if !h.no_cache_layers.is_empty() {
                let _ =
                    writeln!(s, "no cache:     {} layer(s) (MLP, MoE): {}", h.no_cache_layers.len(), ranges(&h.no_cache_layers));
            }
            match m.kv.rank_regions(g, m.tp.tp) {
                Ok(regions) => {
                    for r in &regions {
                        s += &describe_region(r);
                    }
                }
                Err(e) => {
                    let _ = writeln!(s, "regions:      {e}");
                }
            }
            let _ = writeln!(
                s,
                "transfer:     kvprobe run moves every region (the attention sweep, then each state and indexer region; one process, --decode-process, --peer); under request load (--scenario nixl-only|stacked, READ or WRITE) each request's state slot moves with its blocks; ab, tier-only, --host-staging and an indexer under load refuse this model for now"
            );
        }
    }
    let layout = if g.mla { "MLA".to_string() } else { format!("{:?}", g.layout).to_uppercase() };
    let _ = writeln!(
        s,
        "geometry:     {} layers, {} KV head(s), head size {}, {}, block size {} tokens, {} blocks, {layout}",
        g.num_layers,
        g.num_kv_heads,
        g.head_size,
        name(&g.dtype),
        g.block_size,
        g.num_blocks
    );
    if let (Ok(slice), Ok(pool)) = (g.slice_bytes(), g.pool_bytes()) {
        let _ = writeln!(s, "block slice:  {slice} bytes ({:.1} KiB)", slice as f64 / 1024.0);
        let _ = writeln!(s, "pool:         {pool} bytes ({:.1} MiB) per side", mib(pool));
    }
    s
}

/// Lines of one region (`kvprobe geometry` on a hybrid model): its layers, groups, parts and
/// page stride.
pub fn describe_region(r: &Region) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let unit = match r.unit {
        crate::core::hybrid::RegionUnit::Block => "per layer and block",
        crate::core::hybrid::RegionUnit::Slot => "per layer and request slot",
    };
    let _ = writeln!(s, "region:       {} ({}) — {} layer(s): {}", r.name, r.kind, r.layers.len(), ranges(&r.layers));
    let groups: Vec<String> = r.groups.iter().map(|(i, l)| format!("{i} ({} layer(s): {})", l.len(), ranges(l))).collect();
    if !groups.is_empty() {
        let _ = writeln!(s, "  kv cache groups: {}", groups.join("; "));
    }
    let parts: Vec<String> = r
        .parts
        .iter()
        .map(|p| {
            let shape: Vec<String> = p.shape.iter().map(u64::to_string).collect();
            format!("{} ({}) {} {} bytes", p.name, shape.join(", "), p.dtype, p.bytes)
        })
        .collect();
    if parts.len() == 1 {
        let _ = writeln!(s, "  page {unit}: {}", parts[0]);
    } else {
        let _ = writeln!(s, "  page {unit}: {} = {} bytes", parts.join(" + "), r.page_bytes);
    }
    if r.descriptors.len() > 1 {
        let d: Vec<String> = r.descriptors.iter().map(|d| format!("{} {} at {}", d.name, d.bytes, d.offset)).collect();
        let _ = writeln!(s, "  nixl descriptors {unit}: {} (bytes at page offset)", d.join(", "));
    }
    if r.page_stride_bytes != r.page_bytes {
        let _ = writeln!(s, "  page stride:  {} bytes (padded to the attention page)", r.page_stride_bytes);
    }
    if r.replicated {
        let _ = writeln!(s, "  whole on every TP rank");
    }
    s
}

/// A value's serde name (`bf16`, `fp8_e4m3`, ...).
fn name<T: Serialize>(v: &T) -> String {
    serde_json::to_value(v).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default()
}

/// `0-3,5,7-9` for ascending indices.
fn ranges(v: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        out.push(if i == j { v[i].to_string() } else { format!("{}-{}", v[i], v[j]) });
        i = j + 1;
    }
    out.join(",")
}
