//! Hybrid KV caches: the regions a model keeps besides (or beside) the paged attention KV
//! cache, read from a Hugging Face config.json and laid out per TP rank as vLLM 0.34 lays them
//! out.
//!
//! | region | per | one TP rank's parts (shapes in elements) | vLLM source |
//! |---|---|---|---|
//! | recurrent state, Mamba1 (Jamba) | request (one slot) | conv `(I/tp, k−1)`, ssm `(I/tp, d_state)`; `I = mamba_expand × hidden_size` | `MambaStateShapeCalculator.mamba1_state_shape` |
//! | recurrent state, Mamba2 (Nemotron-H, Granite 4.0-H) | request | conv `((I + 2·g′·d_state)/tp, k−1)`, ssm `(H/tp, head_dim, d_state)`; `g′ = n_groups`, or `tp` when `n_groups` is 1 and does not divide by `tp` | `mamba2_state_shape`, `extra_groups_for_head_shards` |
//! | recurrent state, gated DeltaNet (Qwen3-Next) | request | conv `((2·Hk·Dk + Hv·Dv)/tp, k−1)`, temporal `(Hv/tp, Dv, Dk)` | `gated_delta_net_state_shape` |
//! | recurrent state, KDA (Kimi Linear, Kimi-K3) | request | conv `(3·H·D/tp, k−1)` (q, k, v fused), recurrent `(H/tp, D, D)` | `kda_state_shape` |
//! | sparse-attention indexer K cache (DeepSeek-V3.2) | block of tokens | `index_head_dim` fp8 bytes per token, then one 4-byte scale per 128 of them, every token of the block's values first: `block_size × (D + D/128·4)` bytes, whole on every rank | `DeepseekV32IndexerCache.get_kv_cache_spec` (an `MLAAttentionSpec` of uint8) |
//!
//! (`vllm/model_executor/layers/mamba/mamba_utils.py`; each model's
//! `get_mamba_state_shape_from_config`.) `k` is the conv kernel; speculative tokens would add
//! to `k − 1` and are not modelled. The conv state is shown dim-first, `(dim, k − 1)`: vLLM's
//! NixlConnector requires `VLLM_SSM_CONV_STATE_LAYOUT=DS` whenever a model has Mamba layers
//! (`nixl/base_worker.py`), so that is the layout a transfer sees; its bytes are the same
//! either way.
//!
//! **Dtypes** (`MambaStateDtypeCalculator`): the conv state is the model's dtype
//! (`mamba_cache_dtype` auto; `--kv-cache-dtype` does not apply to state); the ssm/temporal
//! state is the conv's dtype, except KDA's recurrent state (fp32) and Nemotron-H's
//! (`mamba_ssm_cache_dtype` of the config, default float32).
//!
//! **Pages** (`Platform._align_hybrid_block_size`, `unify_kv_cache_spec_page_size`): a slot
//! of one state layer is a *page* holding its parts back to back (conv, then ssm) — vLLM packs
//! them in one tensor, each part C-contiguous. When a model has state, the attention block size
//! is raised to the smallest multiple of the kernel alignment (16 tokens; MLA 128) whose page
//! holds a state page, and the state page is padded to the attention page: one page stride for
//! every layer (`page_stride_bytes`). Layers are then split into **KV cache groups** of equal
//! size (`_get_kv_cache_groups_uniform_page_size`: the smallest bucket's layer count, or the
//! largest when it is under 1.5 × the smallest; bucket layers assigned `layers[i::n]`), each with
//! its own block table per request. NixlConnector moves one state slot per request and state
//! group (the running state, `clip_ssm_state_blocks`).

use crate::core::geometry::{Dtype, Geometry};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// A hybrid config that gives no regions (converted to
/// [`crate::core::model_config::ModelConfigError`]'s variants of the same names).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HybridError {
    /// A field is missing, has the wrong type or an impossible value.
    #[error("model config: {0}")]
    Field(String),
    /// A hybrid family or variant kvprobe does not lay out.
    #[error("model config: {0}")]
    Unsupported(String),
    /// `--tp` splits the state as vLLM does not (or a block size too small for a state page).
    #[error("model config: {0}")]
    Parallel(String),
}

/// The recurrent mixer whose state a layer keeps, with its model-level dimensions (before TP).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mixer", rename_all = "snake_case")]
pub enum StateMixer {
    /// Mamba1 (Jamba): `intermediate = mamba_expand × hidden_size`.
    Mamba1 {
        /// Inner width `I`, elements.
        intermediate: u32,
        /// `mamba_d_state`.
        d_state: u32,
        /// Conv kernel width (`mamba_d_conv`).
        conv_kernel: u32,
    },
    /// Mamba2 (Nemotron-H, Granite 4.0-H): `intermediate = num_heads × head_dim`.
    Mamba2 {
        /// SSM heads (`mamba_num_heads` / `mamba_n_heads`).
        num_heads: u32,
        /// Elements per SSM head (`mamba_head_dim` / `mamba_d_head`).
        head_dim: u32,
        /// `ssm_state_size` / `mamba_d_state`.
        d_state: u32,
        /// B/C groups (`n_groups` / `mamba_n_groups`).
        n_groups: u32,
        /// Conv kernel width (`conv_kernel` / `mamba_d_conv`).
        conv_kernel: u32,
    },
    /// Gated DeltaNet (Qwen3-Next).
    GatedDeltaNet {
        /// `linear_num_key_heads`.
        key_heads: u32,
        /// `linear_key_head_dim`.
        key_head_dim: u32,
        /// `linear_num_value_heads`.
        value_heads: u32,
        /// `linear_value_head_dim`.
        value_head_dim: u32,
        /// `linear_conv_kernel_dim`.
        conv_kernel: u32,
    },
    /// Kimi Delta Attention (Kimi Linear, Kimi-K3): `linear_attn_config`.
    Kda {
        /// `num_heads`.
        heads: u32,
        /// `head_dim`.
        head_dim: u32,
        /// `short_conv_kernel_size`.
        conv_kernel: u32,
    },
}

impl StateMixer {
    /// The mixer's name as vLLM's `mamba_type` reads (`mamba1`, `mamba2`, `gdn`, `kda`).
    pub fn name(&self) -> &'static str {
        match self {
            StateMixer::Mamba1 { .. } => "mamba1",
            StateMixer::Mamba2 { .. } => "mamba2",
            StateMixer::GatedDeltaNet { .. } => "gated_deltanet",
            StateMixer::Kda { .. } => "kda",
        }
    }
}

/// The layers that keep a recurrent state, before TP.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateModel {
    /// The mixer and its dimensions.
    #[serde(flatten)]
    pub mixer: StateMixer,
    /// Model layer indices (0-based, ascending).
    pub layers: Vec<u32>,
    /// Conv state dtype (the model's).
    pub conv_dtype: Dtype,
    /// SSM / temporal / recurrent state dtype.
    pub ssm_dtype: Dtype,
    /// The ssm dtype the model's config sets for `--mamba-ssm-cache-dtype auto` (Nemotron-H's
    /// `mamba_ssm_cache_dtype`, default float32; Qwen3.5's `mamba_ssm_dtype`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssm_config_dtype: Option<Dtype>,
}

/// vLLM's `--mamba-cache-dtype` and `--mamba-ssm-cache-dtype` (`CacheConfig.mamba_cache_dtype`,
/// `mamba_ssm_cache_dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum MambaDtype {
    /// The conv state: the model's dtype; the ssm state: the model's rule (KDA float32,
    /// Nemotron-H its config's, Qwen3.5 its config's), else the conv state's.
    #[default]
    Auto,
    /// float32 (4 bytes).
    Float32,
    /// bfloat16 (2 bytes).
    Bfloat16,
    /// float16 (2 bytes).
    Float16,
}

impl MambaDtype {
    fn dtype(self) -> Option<Dtype> {
        match self {
            MambaDtype::Auto => None,
            MambaDtype::Float32 => Some(Dtype::Fp32),
            MambaDtype::Bfloat16 => Some(Dtype::Bf16),
            MambaDtype::Float16 => Some(Dtype::Fp16),
        }
    }
}

/// The DeepSeek-V3.2 sparse-attention indexer's K cache, before TP (whole on every rank).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexerModel {
    /// `index_head_dim`: fp8 bytes per token (before the scales).
    pub head_dim: u32,
    /// Model layer indices that keep one.
    pub layers: Vec<u32>,
}

/// What a hybrid model keeps besides its attention layers (`config.model.hybrid` in reports).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HybridKv {
    /// Recurrent state layers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<StateModel>,
    /// The indexer K cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub indexer: Option<IndexerModel>,
    /// Layers that keep no cache at all (Nemotron-H's MLP and MoE layers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub no_cache_layers: Vec<u32>,
}

impl HybridKv {
    /// True when the model has a region besides its paged attention KV cache.
    pub fn any(&self) -> bool {
        self.state.is_some() || self.indexer.is_some()
    }
}

/// What one model layer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LayerRole {
    /// A paged attention KV cache (its kind decided by the attention rules).
    Attention,
    /// A recurrent state.
    State,
    /// No cache (an MLP or MoE layer of a hybrid pattern).
    None,
}

/// A config.json field, `None` when absent or null (model_config reads fields with it too).
pub(crate) fn get<'a>(m: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    m.get(key).filter(|v| !v.is_null())
}

fn need(m: &Map<String, Value>, key: &str, why: &str) -> Result<u32, HybridError> {
    opt(m, key)?.ok_or_else(|| HybridError::Field(format!("{why}, but {key} is not given")))
}

/// Most a state dimension may be (heads, head sizes, state sizes, hidden size: 2^20), so that
/// every page size is computed exactly in 64 bits; real models stay far below it.
pub const MAX_STATE_DIM: u32 = 1 << 20;

fn opt(m: &Map<String, Value>, key: &str) -> Result<Option<u32>, HybridError> {
    match get(m, key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 && n <= MAX_STATE_DIM as u64 => Ok(Some(n as u32)),
            _ => Err(HybridError::Field(format!("{key} must be an integer from 1 to {MAX_STATE_DIM}, not {v}"))),
        },
    }
}

fn first(m: &Map<String, Value>, keys: &[&str], why: &str) -> Result<u32, HybridError> {
    for k in keys {
        if let Some(v) = opt(m, k)? {
            return Ok(v);
        }
    }
    Err(HybridError::Field(format!("{why}, but none of {} is given", keys.join(", "))))
}

fn dtype_name(m: &Map<String, Value>, key: &str) -> Result<Option<Dtype>, HybridError> {
    match get(m, key) {
        None => Ok(None),
        Some(v) => match v.as_str() {
            Some("float32" | "float" | "fp32") => Ok(Some(Dtype::Fp32)),
            Some("bfloat16" | "bf16") => Ok(Some(Dtype::Bf16)),
            Some("float16" | "half" | "fp16") => Ok(Some(Dtype::Fp16)),
            Some("auto") => Ok(None),
            _ => Err(HybridError::Field(format!("{key} must be float32, bfloat16, float16 or auto, not {v}"))),
        },
    }
}

/// Layer roles from a per-layer list of type names (`layer_types`, `layers_block_type`).
fn roles_from_names(key: &str, v: &Value, layers: u32) -> Result<Vec<LayerRole>, HybridError> {
    let Some(list) = v.as_array() else {
        return Err(HybridError::Field(format!("{key} must be a list of strings, not {v}")));
    };
    if list.len() != layers as usize {
        return Err(HybridError::Field(format!("{key} has {} entries for {layers} layers (num_hidden_layers)", list.len())));
    }
    list.iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            Some("mamba" | "linear_attention" | "M") => Ok(LayerRole::State),
            Some("mlp" | "moe" | "-" | "E") => Ok(LayerRole::None),
            Some(
                "attention" | "full_attention" | "global_attention" | "*" | "sliding_attention" | "sliding_window_attention"
                | "local_attention" | "chunked_attention",
            ) => Ok(LayerRole::Attention),
            Some(other) => Err(HybridError::Unsupported(format!(
                "{key}[{i}] is {other:?}: not a layer type kvprobe knows (attention kinds: attention, full_attention, sliding_attention, chunked_attention; state: mamba, linear_attention; no cache: mlp, moe)"
            ))),
            None => Err(HybridError::Field(format!("{key}[{i}] must be a string, not {t}"))),
        })
        .collect()
}

/// Reads the hybrid parts of a text model's config (`m`, after `text_config` and class
/// defaults): the role of each layer, and the state and indexer regions. `model_dtype` is the
/// model's dtype as `--kv-cache-dtype auto` resolves it (the conv state's dtype).
///
/// Families, by the key or `model_type` that marks them (others whose keys look alike —
/// Falcon-H1, Zamba2, MiniMax, LFM2 — are left to the caller's refusal): Kimi Linear /
/// Kimi-K3 (`linear_attn_config`, 1-based `kda_layers`, the others MLA), Qwen3-Next and
/// Qwen3.5 (`model_type` `qwen3_next*`/`qwen3_5*`; `layer_types` or `full_attention_interval`,
/// gated DeltaNet `linear_*` keys), Nemotron-H (`nemotron_h` or `hybrid_override_pattern`, or
/// `layers_block_type`: `M` Mamba2, `*` attention, `-`/`E` none), Granite 4.0-H
/// (`granitemoehybrid`; `layer_types` `mamba`/`attention`, Mamba2 `mamba_*` keys; absent: every
/// layer Mamba), Jamba (`jamba`; `layers_block_type`, or `attn_layer_period`/
/// `attn_layer_offset`, Mamba1), DeepSeek-V3.2 (`index_topk`: an indexer on every attention
/// layer). `None` when the config names none of them.
///
/// Errors: [`HybridError::Field`] for a missing or malformed dimension;
/// [`HybridError::Unsupported`] for a hybrid kvprobe does not lay out (the reason named).
pub(crate) fn read(
    m: &Map<String, Value>,
    model_type: &str,
    layers: u32,
    model_dtype: Dtype,
) -> Result<Option<(Vec<LayerRole>, HybridKv)>, HybridError> {
    let mut hy = HybridKv::default();
    let roles: Vec<LayerRole>;
    let mixer: Option<(StateMixer, Option<Dtype>)>;
    if let Some(lac) = get(m, "linear_attn_config") {
        let Some(lac) = lac.as_object() else {
            return Err(HybridError::Field(format!("linear_attn_config must be an object, not {lac}")));
        };
        if get(m, "dsa_config").is_some() {
            return Err(HybridError::Unsupported(
                "dsa_config is given (Kimi-K3.1): its MLA and indexer pages are packed into one block row (vLLM's BLHNC packed groups); not laid out yet".into(),
            ));
        }
        let kda = get(lac, "kda_layers")
            .and_then(Value::as_array)
            .ok_or_else(|| HybridError::Field("linear_attn_config.kda_layers must be a list of 1-based layer numbers".into()))?;
        let mut r = vec![LayerRole::Attention; layers as usize];
        for v in kda {
            match v.as_u64() {
                Some(n) if n >= 1 && n <= layers as u64 => {
                    if r[n as usize - 1] == LayerRole::State {
                        return Err(HybridError::Field(format!("linear_attn_config.kda_layers names layer {n} twice")));
                    }
                    r[n as usize - 1] = LayerRole::State;
                }
                _ => {
                    return Err(HybridError::Field(format!(
                        "linear_attn_config.kda_layers holds {v}: layers are numbered from 1 to {layers} (1-based, as vLLM's KimiLinearConfig.is_kda_layer reads them)"
                    )));
                }
            }
        }
        roles = r;
        let why = "linear_attn_config gives KDA layers";
        mixer = Some((
            StateMixer::Kda {
                heads: need(lac, "num_heads", why)?,
                head_dim: need(lac, "head_dim", why)?,
                conv_kernel: need(lac, "short_conv_kernel_size", why)?,
            },
            None,
        ));
    } else if model_type.starts_with("qwen3_next") || model_type.starts_with("qwen3_5") {
        roles = match get(m, "layer_types") {
            Some(v) => roles_from_names("layer_types", v, layers)?,
            None => {
                let n = opt(m, "full_attention_interval")?.unwrap_or(4);
                (0..layers).map(|i| if (i + 1) % n == 0 { LayerRole::Attention } else { LayerRole::State }).collect()
            }
        };
        let why = "layers use gated DeltaNet linear attention";
        mixer = Some((
            StateMixer::GatedDeltaNet {
                key_heads: need(m, "linear_num_key_heads", why)?,
                key_head_dim: need(m, "linear_key_head_dim", why)?,
                value_heads: need(m, "linear_num_value_heads", why)?,
                value_head_dim: need(m, "linear_value_head_dim", why)?,
                conv_kernel: need(m, "linear_conv_kernel_dim", why)?,
            },
            // Qwen3.5 names its ssm dtype in the config (vLLM's Qwen3_5 config hook reads
            // mamba_ssm_dtype); Qwen3-Next has none.
            if model_type.starts_with("qwen3_5") { dtype_name(m, "mamba_ssm_dtype")? } else { None },
        ));
    } else if model_type == "nemotron_h" || get(m, "hybrid_override_pattern").is_some() {
        roles = match (get(m, "hybrid_override_pattern"), get(m, "layers_block_type")) {
            (Some(Value::String(p)), _) => {
                if p.chars().count() != layers as usize {
                    return Err(HybridError::Field(format!(
                        "hybrid_override_pattern has {} characters for {layers} layers (num_hidden_layers)",
                        p.chars().count()
                    )));
                }
                p.chars()
                    .enumerate()
                    .map(|(i, c)| match c {
                        'M' => Ok(LayerRole::State),
                        '*' => Ok(LayerRole::Attention),
                        '-' | 'E' => Ok(LayerRole::None),
                        _ => Err(HybridError::Field(format!(
                            "hybrid_override_pattern[{i}] is {c:?}: Nemotron-H's pattern holds M (Mamba2), * (attention), - (MLP) and E (MoE)"
                        ))),
                    })
                    .collect::<Result<_, _>>()?
            }
            (Some(v), _) => return Err(HybridError::Field(format!("hybrid_override_pattern must be a string, not {v}"))),
            (None, Some(v)) => roles_from_names("layers_block_type", v, layers)?,
            (None, None) => {
                return Err(HybridError::Field("a Nemotron-H model needs hybrid_override_pattern (or layers_block_type)".into()));
            }
        };
        let why = "layers are Mamba2";
        mixer = Some((
            StateMixer::Mamba2 {
                num_heads: need(m, "mamba_num_heads", why)?,
                head_dim: need(m, "mamba_head_dim", why)?,
                d_state: need(m, "ssm_state_size", why)?,
                n_groups: first(m, &["n_groups", "mamba_n_groups"], why)?,
                conv_kernel: first(m, &["conv_kernel", "mamba_d_conv"], why)?,
            },
            // Nemotron-H keeps its ssm state in float32 unless the config says otherwise.
            Some(dtype_name(m, "mamba_ssm_cache_dtype")?.unwrap_or(Dtype::Fp32)),
        ));
    } else if model_type == "granitemoehybrid" {
        roles = match get(m, "layer_types").or_else(|| get(m, "layers_block_type")) {
            Some(v) => roles_from_names("layer_types", v, layers)?,
            None => vec![LayerRole::State; layers as usize],
        };
        if !roles.contains(&LayerRole::State) {
            // Granite-4.0-Micro: a granitemoehybrid config whose layers are all attention is
            // served as an attention model (vLLM's ModelConfig.is_hybrid); its mamba_* keys
            // describe no layer.
            return Ok(Some((roles, hy)));
        }
        let why = "layers are Mamba2";
        let n_heads = need(m, "mamba_n_heads", why)?;
        let head_dim = match get(m, "mamba_d_head") {
            Some(Value::String(s)) if s == "auto" => None,
            _ => opt(m, "mamba_d_head")?,
        };
        let head_dim = match head_dim {
            Some(h) => h,
            None => {
                // Transformers' "auto": mamba_expand × hidden_size / mamba_n_heads.
                let inner = need(m, "mamba_expand", why)? as u64 * need(m, "hidden_size", why)? as u64;
                if !inner.is_multiple_of(n_heads as u64) {
                    return Err(HybridError::Field(format!(
                        "mamba_expand × hidden_size = {inner} is not a multiple of mamba_n_heads {n_heads} (mamba_d_head auto)"
                    )));
                }
                u32::try_from(inner / n_heads as u64).ok().filter(|&d| d <= MAX_STATE_DIM).ok_or_else(|| {
                    HybridError::Field(format!(
                        "mamba_d_head auto (mamba_expand × hidden_size / mamba_n_heads) exceeds {MAX_STATE_DIM}"
                    ))
                })?
            }
        };
        mixer = Some((
            StateMixer::Mamba2 {
                num_heads: n_heads,
                head_dim,
                d_state: need(m, "mamba_d_state", why)?,
                n_groups: need(m, "mamba_n_groups", why)?,
                conv_kernel: need(m, "mamba_d_conv", why)?,
            },
            // vLLM reads the ssm dtype from --mamba-ssm-cache-dtype, not from this config.
            None,
        ));
    } else if model_type == "jamba" {
        roles = match get(m, "layers_block_type") {
            Some(v) => roles_from_names("layers_block_type", v, layers)?,
            None => {
                let period = opt(m, "attn_layer_period")?.unwrap_or(8);
                let offset = match get(m, "attn_layer_offset") {
                    None => 4,
                    Some(v) => v.as_u64().filter(|&o| o <= u32::MAX as u64).ok_or_else(|| {
                        HybridError::Field(format!("attn_layer_offset must be an integer from 0 to {}, not {v}", u32::MAX))
                    })?,
                };
                (0..layers as u64)
                    .map(|i| if i % period as u64 == offset { LayerRole::Attention } else { LayerRole::State })
                    .collect()
            }
        };
        let why = "layers are Mamba (Jamba)";
        let inner = opt(m, "mamba_expand")?.unwrap_or(2) as u64 * need(m, "hidden_size", why)? as u64;
        mixer = Some((
            StateMixer::Mamba1 {
                intermediate: u32::try_from(inner).ok().filter(|&i| i <= 1 << 24).ok_or_else(|| {
                    HybridError::Field(format!("mamba_expand × hidden_size = {inner} exceeds 2^24 (the Mamba inner width)"))
                })?,
                d_state: opt(m, "mamba_d_state")?.unwrap_or(16),
                conv_kernel: opt(m, "mamba_d_conv")?.unwrap_or(4),
            },
            // vLLM reads the ssm dtype from --mamba-ssm-cache-dtype, not from this config.
            None,
        ));
    } else {
        roles = vec![LayerRole::Attention; layers as usize];
        mixer = None;
    }
    if let Some((mixer, ssm)) = mixer {
        let state_layers: Vec<u32> = (0..layers).filter(|&i| roles[i as usize] == LayerRole::State).collect();
        if !roles.contains(&LayerRole::Attention) {
            return Err(HybridError::Unsupported(format!(
                "every one of the {layers} layers keeps a {} state and none a paged attention KV cache: kvprobe lays out hybrids with at least one attention layer",
                mixer.name()
            )));
        }
        if state_layers.is_empty() {
            return Err(HybridError::Field(format!(
                "the config describes {} layers but names none of its {layers} layers as one",
                mixer.name()
            )));
        }
        if let StateMixer::Mamba1 { conv_kernel, .. }
        | StateMixer::Mamba2 { conv_kernel, .. }
        | StateMixer::GatedDeltaNet { conv_kernel, .. }
        | StateMixer::Kda { conv_kernel, .. } = mixer
            && conv_kernel < 2
        {
            return Err(HybridError::Field(format!(
                "the conv kernel is {conv_kernel}: the conv state keeps kernel − 1 ≥ 1 columns"
            )));
        }
        let mut state =
            StateModel { mixer, layers: state_layers, conv_dtype: model_dtype, ssm_dtype: model_dtype, ssm_config_dtype: ssm };
        state.set_cache_dtypes(MambaDtype::Auto, MambaDtype::Auto, model_dtype)?;
        hy.state = Some(state);
        hy.no_cache_layers = (0..layers).filter(|&i| roles[i as usize] == LayerRole::None).collect();
    }
    if get(m, "index_topk").is_some() || get(m, "index_head_dim").is_some() || get(m, "index_n_heads").is_some() {
        let head_dim = opt(m, "index_head_dim")?.unwrap_or(128);
        if !head_dim.is_multiple_of(128) {
            return Err(HybridError::Field(format!(
                "index_head_dim {head_dim} is not a multiple of 128 (the indexer keeps one scale per 128 fp8 values)"
            )));
        }
        let att: Vec<u32> = (0..layers).filter(|&i| roles[i as usize] == LayerRole::Attention).collect();
        hy.indexer = Some(IndexerModel { head_dim, layers: att });
    }
    Ok((hy.any() || roles.iter().any(|r| *r != LayerRole::Attention)).then_some((roles, hy)))
}

/// One part of a region's page on one TP rank (a state part, an indexer part, or the
/// attention page).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionPart {
    /// `conv`, `ssm`, `temporal`, `recurrent`, `k`, `scale`, `kv` (attention K and V) or
    /// `latent` (MLA).
    pub name: String,
    /// Shape in elements of one slot or block (one TP rank's).
    pub shape: Vec<u64>,
    /// Element type name (`bf16`, `fp16`, `fp32`, `fp8`, `uint8`).
    pub dtype: String,
    /// Bytes (product of the shape × element bytes).
    pub bytes: u64,
}

/// What a region's page is indexed by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RegionUnit {
    /// A block of `block_size` tokens (one block table entry).
    Block,
    /// One request's state slot.
    Slot,
}

/// One region of one TP rank's KV cache: a set of layers whose pages have one shape, and the
/// KV cache groups they fall in (`kvprobe geometry`, its JSON `regions`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    /// `attention`, `state` or `indexer`.
    pub kind: String,
    /// Human name: `MLA`, `full attention`, `KDA state`, `indexer K cache`, ...
    pub name: String,
    /// Model layer indices (ascending).
    pub layers: Vec<u32>,
    /// The region's layers by KV cache group (vLLM group index, its layers); the indexer
    /// shares its attention layers' group.
    pub groups: Vec<(u32, Vec<u32>)>,
    /// Block (per `block_size` tokens) or slot (per request).
    pub unit: RegionUnit,
    /// The page's parts in memory order.
    pub parts: Vec<RegionPart>,
    /// Payload bytes of one page (one layer, one block or slot): the parts' sum.
    pub page_bytes: u64,
    /// Bytes from one page to the next (≥ `page_bytes`; a state page padded to the attention
    /// page).
    pub page_stride_bytes: u64,
    /// Whole on every TP rank (MLA, the indexer) rather than split.
    pub replicated: bool,
    /// The NIXL descriptors of one page (per layer and block or slot), as vLLM 0.34's
    /// NixlConnector builds them: an attention or indexer page whole (`_build_fa_local`); a
    /// state slot as one descriptor per conv sub-projection, then the ssm state, the padding
    /// left out (`_build_mamba_local`).
    pub descriptors: Vec<RegionDescriptor>,
}

/// One NIXL descriptor of a page: `bytes` from byte `offset` of the page.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDescriptor {
    /// What it moves (`page`, `conv x`, `conv B`, `conv q`, ..., `ssm`, `recurrent`).
    pub name: String,
    /// Byte offset in the page.
    pub offset: u64,
    /// Bytes.
    pub bytes: u64,
}

fn part(name: &str, shape: Vec<u64>, dtype: &str, elem: u64) -> RegionPart {
    let bytes = shape.iter().product::<u64>() * elem;
    RegionPart { name: name.into(), shape, dtype: dtype.into(), bytes }
}

fn divide(what: &str, n: u64, tp: u32) -> Result<u64, HybridError> {
    if !n.is_multiple_of(tp as u64) {
        return Err(HybridError::Parallel(format!("{what} {n} is not divisible by --tp {tp} (vLLM's divide() refuses it)")));
    }
    Ok(n / tp as u64)
}

impl StateModel {
    /// Sets the conv and ssm dtypes as vLLM resolves `--mamba-cache-dtype` (`conv`) and
    /// `--mamba-ssm-cache-dtype` (`ssm`) for a model of dtype `model_dtype`
    /// (`MambaStateDtypeCalculator`: conv auto = the model's; ssm auto = KDA float32, else the
    /// config's ([`StateModel::ssm_config_dtype`]), else the conv's). Errors
    /// ([`HybridError::Unsupported`]): a KDA recurrent state other than float32 or bfloat16
    /// (`kda_state_dtype`).
    pub fn set_cache_dtypes(&mut self, conv: MambaDtype, ssm: MambaDtype, model_dtype: Dtype) -> Result<(), HybridError> {
        self.conv_dtype = conv.dtype().unwrap_or(model_dtype);
        let kda = matches!(self.mixer, StateMixer::Kda { .. });
        self.ssm_dtype = match (ssm.dtype(), kda) {
            (None, true) => Dtype::Fp32,
            (Some(d @ (Dtype::Fp32 | Dtype::Bf16)), true) => d,
            (Some(d), true) => {
                return Err(HybridError::Unsupported(format!(
                    "--mamba-ssm-cache-dtype {} for KDA layers: vLLM's kda_state_dtype keeps the recurrent state in float32 or bfloat16 only",
                    d.name()
                )));
            }
            (Some(d), false) => d,
            (None, false) => self.ssm_config_dtype.unwrap_or(self.conv_dtype),
        };
        Ok(())
    }

    /// One TP rank's parts of a state slot (conv dim-first, then the ssm/temporal/recurrent
    /// state). Errors ([`HybridError::Parallel`]): a dimension vLLM splits over TP that
    /// does not divide; Mamba2 `n_groups` that neither divides by `tp` nor is 1.
    pub fn rank_parts(&self, tp: u32) -> Result<Vec<RegionPart>, HybridError> {
        let (c, s) = (self.conv_dtype, self.ssm_dtype);
        let conv = |dim: u64, k: u32| part("conv", vec![dim, k as u64 - 1], c.name(), c.bytes());
        Ok(match self.mixer {
            StateMixer::Mamba1 { intermediate, d_state, conv_kernel } => {
                let i = divide("the Mamba inner width (mamba_expand × hidden_size)", intermediate as u64, tp)?;
                vec![conv(i, conv_kernel), part("ssm", vec![i, d_state as u64], s.name(), s.bytes())]
            }
            StateMixer::Mamba2 { num_heads, head_dim, d_state, n_groups, conv_kernel } => {
                let groups = if n_groups.is_multiple_of(tp) {
                    n_groups
                } else if n_groups == 1 {
                    tp // the one group is replicated on every rank
                } else {
                    return Err(HybridError::Parallel(format!(
                        "n_groups {n_groups} is not divisible by --tp {tp} and is not 1 (vLLM's MambaMixer2 refuses it)"
                    )));
                };
                let heads = divide("mamba_num_heads", num_heads as u64, tp)?;
                let dim = num_heads as u64 * head_dim as u64 + 2 * groups as u64 * d_state as u64;
                vec![
                    conv(divide("the Mamba2 conv dim", dim, tp)?, conv_kernel),
                    part("ssm", vec![heads, head_dim as u64, d_state as u64], s.name(), s.bytes()),
                ]
            }
            StateMixer::GatedDeltaNet { key_heads, key_head_dim, value_heads, value_head_dim, conv_kernel } => {
                divide("linear_num_key_heads", key_heads as u64, tp)?;
                let hv = divide("linear_num_value_heads", value_heads as u64, tp)?;
                let dim = 2 * key_heads as u64 * key_head_dim as u64 + value_heads as u64 * value_head_dim as u64;
                vec![
                    conv(divide("the gated DeltaNet conv dim", dim, tp)?, conv_kernel),
                    part("temporal", vec![hv, value_head_dim as u64, key_head_dim as u64], s.name(), s.bytes()),
                ]
            }
            StateMixer::Kda { heads, head_dim, conv_kernel } => {
                let h = divide("linear_attn_config.num_heads", heads as u64, tp)?;
                vec![
                    conv(3 * h * head_dim as u64, conv_kernel),
                    part("recurrent", vec![h, head_dim as u64, head_dim as u64], s.name(), s.bytes()),
                ]
            }
        })
    }

    /// Bytes of one TP rank's state slot of one layer (the parts' sum, vLLM's
    /// `MambaSpec.page_size_bytes` before padding, state alignment 1).
    pub fn rank_page_bytes(&self, tp: u32) -> Result<u64, HybridError> {
        Ok(self.rank_parts(tp)?.iter().map(|p| p.bytes).sum())
    }

    /// Names of the sections of a slot, in page order ([`StateModel::rank_row_runs`]: one
    /// run each): the conv sub-projections, then the ssm state.
    pub fn section_names(&self) -> Vec<&'static str> {
        match self.mixer {
            StateMixer::Mamba1 { .. } => vec!["conv x", "ssm"],
            StateMixer::Mamba2 { .. } => vec!["conv x", "conv B", "conv C", "ssm"],
            StateMixer::GatedDeltaNet { .. } => vec!["conv q", "conv k", "conv v", "temporal"],
            StateMixer::Kda { .. } => vec!["conv q", "conv k", "conv v", "recurrent"],
        }
    }

    /// Human name of the region (`KDA state`, ...).
    pub fn region_name(&self) -> String {
        match self.mixer {
            StateMixer::Mamba1 { .. } => "Mamba1 state".into(),
            StateMixer::Mamba2 { .. } => "Mamba2 state".into(),
            StateMixer::GatedDeltaNet { .. } => "gated DeltaNet state".into(),
            StateMixer::Kda { .. } => "KDA state".into(),
        }
    }
}

/// vLLM's hybrid block size: the smallest multiple of `align` tokens whose attention page
/// (`attn_bytes_per_token` per token) holds `state_page` bytes, `align` = max(16, MLA: 128,
/// `configured`) (`Platform._align_hybrid_block_size`). Saturates at `u32::MAX`.
pub fn hybrid_block_size(attn_bytes_per_token: u64, state_page: u64, mla: bool, configured: u32) -> u32 {
    let mut align = (configured as u64).max(16);
    if mla {
        align = align.max(128);
    }
    let n = state_page.div_ceil(align * attn_bytes_per_token.max(1)).max(1);
    (align * n).min(u32::MAX as u64) as u32
}

/// vLLM's KV cache groups for buckets of layers with one page size
/// (`_get_kv_cache_groups_uniform_page_size`): the group size is the smallest bucket's layer
/// count, or the largest when that is under 1.5 × the smallest; a bucket of `n` layers makes
/// `ceil(n / size)` groups, group `i` holding `layers[i::groups]`. Returns per bucket its
/// groups, numbered across buckets in the order of their first layers (as vLLM meets them).
pub fn kv_cache_groups(buckets: &[Vec<u32>]) -> Vec<Vec<(u32, Vec<u32>)>> {
    let lens: Vec<usize> = buckets.iter().map(Vec::len).filter(|&n| n > 0).collect();
    let (Some(&min), Some(&max)) = (lens.iter().min(), lens.iter().max()) else { return vec![Vec::new(); buckets.len()] };
    let size = if (max as f64) < min as f64 * 1.5 { max } else { min };
    // vLLM meets the buckets in layer order (the first layer of each), and numbers their
    // groups in that order.
    let mut order: Vec<usize> = (0..buckets.len()).collect();
    order.sort_by_key(|&b| buckets[b].iter().min().copied().unwrap_or(u32::MAX));
    let mut out = vec![Vec::new(); buckets.len()];
    let mut next = 0u32;
    for b in order {
        let layers = &buckets[b];
        let n = layers.len().div_ceil(size);
        out[b] = (0..n)
            .map(|i| {
                let g = (next, layers.iter().skip(i).step_by(n).copied().collect());
                next += 1;
                g
            })
            .collect();
    }
    out
}

/// Every region of one TP rank: the attention layers (as `g`, one region per attention kind
/// in `attention`), the state layers and the indexer, with vLLM's KV cache groups and page
/// strides. `attention` lists each attention group's name and layers.
///
/// Errors: those of [`StateModel::rank_parts`]; [`HybridError::Parallel`] when
/// `g.block_size` gives an attention page smaller than a state page (vLLM raises the block
/// size to [`hybrid_block_size`]; the error names it).
pub fn rank_regions(g: &Geometry, attention: &[(String, Vec<u32>)], hy: &HybridKv, tp: u32) -> Result<Vec<Region>, HybridError> {
    let per_token = g.bytes_per_token();
    let attn_page = per_token * g.block_size as u64;
    let mut buckets: Vec<Vec<u32>> = attention.iter().map(|(_, l)| l.clone()).collect();
    let state = match &hy.state {
        Some(s) => {
            let page = s.rank_page_bytes(tp)?;
            if page > attn_page && !attention.is_empty() {
                let want = hybrid_block_size(per_token, page, g.mla, 16);
                return Err(HybridError::Parallel(format!(
                    "a {} slot is {page} bytes per layer on each rank, more than an attention page of {} tokens ({attn_page} bytes): vLLM raises the block size to {want} tokens so that pages match; give --block-size {want} or more (or leave it out)",
                    s.region_name(),
                    g.block_size
                )));
            }
            buckets.push(s.layers.clone());
            Some((s, page))
        }
        None => None,
    };
    let groups = kv_cache_groups(&buckets);
    let mut out = Vec::new();
    let (kv_name, kv_shape) = if g.mla {
        ("latent", vec![g.block_size as u64, g.head_size as u64])
    } else {
        ("kv", vec![g.num_kv_heads as u64, g.block_size as u64, 2 * g.head_size as u64])
    };
    for (i, (name, layers)) in attention.iter().enumerate() {
        out.push(Region {
            kind: "attention".into(),
            name: name.clone(),
            layers: layers.clone(),
            groups: groups[i].clone(),
            unit: RegionUnit::Block,
            parts: vec![part(kv_name, kv_shape.clone(), g.dtype.name(), g.dtype.bytes())],
            page_bytes: attn_page,
            page_stride_bytes: attn_page,
            replicated: g.mla,
            descriptors: vec![RegionDescriptor { name: "page".into(), offset: 0, bytes: attn_page }],
        });
    }
    if let Some((s, page)) = state {
        out.push(Region {
            kind: "state".into(),
            name: s.region_name(),
            layers: s.layers.clone(),
            groups: groups[attention.len()].clone(),
            unit: RegionUnit::Slot,
            parts: s.rank_parts(tp)?,
            page_bytes: page,
            page_stride_bytes: if attention.is_empty() { page } else { attn_page },
            replicated: false,
            descriptors: s
                .rank_row_runs(tp, 0)?
                .iter()
                .zip(s.section_names())
                .map(|(r, name)| RegionDescriptor {
                    name: name.into(),
                    offset: r.offset,
                    bytes: r.rows as u64 * r.row_bytes as u64,
                })
                .collect(),
        });
    }
    if let Some(ix) = &hy.indexer {
        let b = g.block_size as u64;
        let parts =
            vec![part("k", vec![b, ix.head_dim as u64], "fp8", 1), part("scale", vec![b, ix.head_dim as u64 / 128], "fp32", 4)];
        let page: u64 = parts.iter().map(|p| p.bytes).sum();
        // The indexer's layers are MLA layers: it shares their group (vLLM's
        // UniformTypeKVCacheSpecs puts both in one group, per-layer page sizes).
        let grp = groups.first().cloned().unwrap_or_default();
        out.push(Region {
            kind: "indexer".into(),
            name: "indexer K cache".into(),
            layers: ix.layers.clone(),
            groups: grp,
            unit: RegionUnit::Block,
            parts,
            page_bytes: page,
            page_stride_bytes: page,
            replicated: true,
            descriptors: vec![RegionDescriptor { name: "page".into(), offset: 0, bytes: page }],
        });
    }
    Ok(out)
}

/// One run of region rows in a page (a state slot or an indexer block of one layer, one TP
/// rank): `rows` rows of `row_bytes` from byte `offset`, naming the region's global rows
/// `first_row ..` of part `part`. The fingerprint of region rows (docs/fingerprint.md "Region
/// rows") tags each with `layer | part << 12`, K/V code 3 and its global row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowRun {
    /// The part (state: conv 0, then ssm 1; indexer: values 0, scales 1).
    pub part: u32,
    /// Byte offset in the page.
    pub offset: u64,
    /// Rows in the run.
    pub rows: u32,
    /// Bytes per row (a valid fingerprint row, at most 512).
    pub row_bytes: u32,
    /// Global row of the run's first row: its place in the part of the whole model (before
    /// TP splits it), counted in rows of `row_bytes`.
    pub first_row: u32,
}

/// A contiguous section of a part: its bytes in the whole model, and whether TP splits it
/// (rank `t` holding the `t`-th of `tp` equal chunks) or every rank holds all of it.
struct Section {
    global_bytes: u64,
    split: bool,
}

/// The longest valid region row (a multiple of 16 from 32 to 512) dividing `bytes`.
fn row_bytes_for(bytes: u64) -> Option<u32> {
    (2..=32u32).rev().map(|k| k * 16).find(|r| bytes.is_multiple_of(*r as u64))
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Lays out the runs of `parts` (each a list of sections) on rank `rank` of `tp`, in rows that
/// also divide the chunks of `row_tp` ranks.
fn runs_of(parts: &[(&str, Vec<Section>)], tp: u32, rank: u32, row_tp: u32) -> Result<Vec<RowRun>, HybridError> {
    let mut out = Vec::new();
    let mut offset = 0u64;
    for (p, (name, sections)) in parts.iter().enumerate() {
        let chunk_at = |s: &Section, n: u32| if s.split { s.global_bytes / n as u64 } else { s.global_bytes };
        let chunk = |s: &Section| chunk_at(s, tp);
        let g = sections.iter().fold(0, |g, s| gcd(g, gcd(gcd(chunk(s), chunk_at(s, row_tp.max(1))), s.global_bytes)));
        let r = row_bytes_for(g).ok_or_else(|| {
            HybridError::Unsupported(format!(
                "the {name} state's sections on each of {tp} rank(s) are not multiples of 32 bytes: the fingerprint cannot cut them into rows"
            ))
        })? as u64;
        let mut base = 0u64;
        for s in sections {
            let c = chunk(s);
            let first = base + if s.split { rank as u64 * c / r } else { 0 };
            let rows = c / r;
            if first + rows > 1 << 32 {
                return Err(HybridError::Unsupported(format!(
                    "the {name} state has more than 2^32 rows of {r} bytes (the fingerprint's row number is 32-bit)"
                )));
            }
            out.push(RowRun { part: p as u32, offset, rows: rows as u32, row_bytes: r as u32, first_row: first as u32 });
            offset += c;
            base += s.global_bytes / r;
        }
    }
    Ok(out)
}

impl StateModel {
    /// The row runs of one state slot of rank `rank` of `tp` (parts as
    /// [`StateModel::rank_parts`]; each conv sub-projection — x|B|C, Q|K|V — a section of its
    /// own, dim-first, split over TP or, for Mamba2's one group under `tp` > 1, whole on every
    /// rank; the ssm state one section split over TP). Errors: those of `rank_parts`, and a
    /// section the fingerprint cannot cut into rows of 32 to 512 bytes.
    pub fn rank_row_runs(&self, tp: u32, rank: u32) -> Result<Vec<RowRun>, HybridError> {
        self.rank_row_runs_with(tp, rank, tp)
    }

    /// As [`StateModel::rank_row_runs`], in rows that also divide the chunks of `row_tp`
    /// ranks: prefill and decode at different TP sizes both cut rows for the larger one, so
    /// that global rows name the same bytes on both sides (`row_tp` a multiple of `tp` or a
    /// divisor; its split checked as `rank_parts` checks `tp`'s).
    pub fn rank_row_runs_with(&self, tp: u32, rank: u32, row_tp: u32) -> Result<Vec<RowRun>, HybridError> {
        self.rank_parts(row_tp)?;
        let parts = self.rank_parts(tp)?;
        let (ce, se) = (self.conv_dtype.bytes(), self.ssm_dtype.bytes());
        let conv = |channels: u64, k: u32, split: bool| Section { global_bytes: channels * (k as u64 - 1) * ce, split };
        let whole = |bytes: u64| Section { global_bytes: bytes, split: true };
        let sections: Vec<(&str, Vec<Section>)> = match self.mixer {
            StateMixer::Mamba1 { intermediate: i, d_state, conv_kernel: k } => {
                vec![("conv", vec![conv(i as u64, k, true)]), ("ssm", vec![whole(i as u64 * d_state as u64 * se)])]
            }
            StateMixer::Mamba2 { num_heads, head_dim, d_state, n_groups, conv_kernel: k } => {
                let x = num_heads as u64 * head_dim as u64;
                let split_groups = n_groups.is_multiple_of(tp);
                let bc = n_groups as u64 * d_state as u64;
                vec![
                    ("conv", vec![conv(x, k, true), conv(bc, k, split_groups), conv(bc, k, split_groups)]),
                    ("ssm", vec![whole(x * d_state as u64 * se)]),
                ]
            }
            StateMixer::GatedDeltaNet { key_heads, key_head_dim, value_heads, value_head_dim, conv_kernel: k } => {
                let (kd, vd) = (key_heads as u64 * key_head_dim as u64, value_heads as u64 * value_head_dim as u64);
                vec![
                    ("conv", vec![conv(kd, k, true), conv(kd, k, true), conv(vd, k, true)]),
                    ("temporal", vec![whole(vd * key_head_dim as u64 * se)]),
                ]
            }
            StateMixer::Kda { heads, head_dim, conv_kernel: k } => {
                let d = heads as u64 * head_dim as u64;
                vec![
                    ("conv", vec![conv(d, k, true), conv(d, k, true), conv(d, k, true)]),
                    ("recurrent", vec![whole(d * head_dim as u64 * se)]),
                ]
            }
        };
        let runs = runs_of(&sections, tp, rank, row_tp)?;
        debug_assert_eq!(
            runs.iter().map(|r| r.rows as u64 * r.row_bytes as u64).sum::<u64>(),
            parts.iter().map(|p| p.bytes).sum::<u64>()
        );
        Ok(runs)
    }
}

impl IndexerModel {
    /// The row runs of one indexer block of `block_size` tokens (whole on every rank): the
    /// values (`block_size × head_dim` fp8 bytes, part 0), then the scales (`block_size ×
    /// head_dim / 128` fp32, part 1). Errors: a part the fingerprint cannot cut into rows.
    pub fn block_row_runs(&self, block_size: u32) -> Result<Vec<RowRun>, HybridError> {
        let b = block_size as u64;
        let parts = [
            ("indexer values", vec![Section { global_bytes: b * self.head_dim as u64, split: false }]),
            ("indexer scales", vec![Section { global_bytes: b * (self.head_dim as u64 / 128) * 4, split: false }]),
        ];
        runs_of(&parts, 1, 0, 1)
    }
}

/// The fingerprint rows of one run: what a region row names (`layer`, the run's part, the
/// logical id `id` — a request's state or a logical block — and `generation`).
pub fn run_rows(run: &RowRun, layer: u32, id: u32, generation: u32) -> crate::core::fingerprint::SliceRows {
    use crate::core::fingerprint::{BlockIdentity, RowOrder, RowShape, SliceRows};
    SliceRows {
        slice: BlockIdentity {
            layer: region_layer(layer, run.part),
            kv: crate::core::geometry::KvPart::Region,
            block: id,
            generation,
            token_base: run.first_row,
        },
        shape: RowShape { order: RowOrder::Rows, block_size: run.rows, heads: 1, head_base: 0, row_bytes: run.row_bytes },
    }
}

/// The runs of `page` (one region page of model layer `layer`, laid out as `runs`) that are
/// not the rows of logical id `id` at `generation`: each wrong run's index, the rows it should
/// hold and its byte range in the page — the CPU check of every region pass (the sweep's and
/// a scenario's), one definition. `page` must hold every run (panics otherwise).
pub fn wrong_runs(
    runs: &[RowRun],
    page: &[u8],
    layer: u32,
    id: u32,
    generation: u32,
    seed: u64,
) -> Vec<(usize, crate::core::fingerprint::SliceRows, std::ops::Range<usize>)> {
    let mut out = Vec::new();
    for (k, run) in runs.iter().enumerate() {
        let rows = run_rows(run, layer, id, generation);
        let at = run.offset as usize..run.offset as usize + rows.len() as usize;
        if crate::core::fingerprint::check(&page[at.clone()], seed, &rows).0 != 0 {
            out.push((k, rows, at));
        }
    }
    out
}

/// The layer field of a region row: `layer | part << 12` (layer below 4096, part below 16;
/// `kvp2_region_layer` in csrc/fingerprint.h).
pub fn region_layer(layer: u32, part: u32) -> u32 {
    (layer & 0xFFF) | (part & 0xF) << 12
}
