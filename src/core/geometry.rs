//! KV-cache geometry: vLLM's paged layout, block slices and NIXL descriptors.
//!
//! A pool is one memory region per layer, shaped as vLLM's per-layer KV-cache tensor:
//!
//! | layout | per-layer tensor shape (elements)                                | vLLM source |
//! |--------|-------------------------------------------------------------------|-------------|
//! | NHD    | `(2, num_blocks, block_size, num_kv_heads, head_size)`            | `FlashAttentionBackend.get_kv_cache_shape` |
//! | HND    | `(num_blocks, 2, num_kv_heads, block_size, head_size)`            | `FlashInferBackend.get_kv_cache_shape` with the HND stride order `(0, 1, 3, 2, 4)` |
//! | MLA    | `(num_blocks, block_size, head_size)` (head_size = latent width, e.g. 512 + 64 = 576) | `MLACommonBackend.get_kv_cache_shape` |
//!
//! The unit of verification is a **block slice**: the contiguous bytes of one
//! (layer, K/V, block), `block_size * num_kv_heads * head_size * dtype_bytes` long (MLA:
//! `block_size * head_size * dtype_bytes`). NIXL descriptors are built as vLLM's
//! NixlConnector builds them: one descriptor per (layer, K/V, block) at
//! `region_base + slice_offset`.
//!
//! All size arithmetic is overflow-checked and returns [`GeometryError`].

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of the KV cache; only its width matters to the probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// bfloat16, 2 bytes.
    Bf16,
    /// IEEE half, 2 bytes.
    Fp16,
    /// IEEE single, 4 bytes.
    Fp32,
    /// 8-bit float (e4m3 or e5m2), 1 byte.
    Fp8,
}

impl Dtype {
    /// Width of one element in bytes.
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp32 => 4,
            Dtype::Fp8 => 1,
        }
    }

    /// Its name as flags and reports write it (`bf16`, `fp16`, `fp32`, `fp8`).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp32 => "fp32",
            Dtype::Fp8 => "fp8",
        }
    }
}

/// Order of a layer's K/V cache tensor (ignored when the geometry is MLA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// FlashAttention order: all K blocks of a layer, then all V blocks.
    Nhd,
    /// FlashInfer HND order: per block, its K slice then its V slice.
    Hnd,
}

/// Which part of a layer a slice belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvPart {
    /// Keys.
    K,
    /// Values.
    V,
    /// The MLA latent (one per layer instead of K and V).
    #[serde(rename = "latent")]
    Latent,
    /// A row of a hybrid model's other regions (recurrent state, indexer K cache): its layer
    /// field holds `layer | part << 12` ([`crate::core::hybrid`]).
    #[serde(rename = "region")]
    Region,
}

impl KvPart {
    /// Code used by the fingerprint (0 = K, 1 = V, 2 = latent, 3 = region row).
    pub fn code(self) -> u32 {
        match self {
            KvPart::K => 0,
            KvPart::V => 1,
            KvPart::Latent => 2,
            KvPart::Region => 3,
        }
    }

    /// Inverse of [`KvPart::code`].
    pub fn from_code(code: u32) -> Option<KvPart> {
        match code {
            0 => Some(KvPart::K),
            1 => Some(KvPart::V),
            2 => Some(KvPart::Latent),
            3 => Some(KvPart::Region),
            _ => None,
        }
    }
}

impl fmt::Display for KvPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvPart::K => "K",
            KvPart::V => "V",
            KvPart::Latent => "latent",
            KvPart::Region => "region",
        })
    }
}

/// A geometry that cannot be laid out.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum GeometryError {
    /// A parameter is zero or out of range.
    #[error("invalid geometry: {0}")]
    Invalid(String),
    /// A size does not fit in 64 bits (or a fingerprint field).
    #[error("geometry too large: {0} overflows")]
    Overflow(&'static str),
}

/// Block-slice size limit: slice byte offsets are 32-bit in the kernels.
pub const MAX_SLICE_BYTES: u64 = 1 << 31;

/// Bytes of a tagged unit of a head row in the fingerprint ([`crate::core::fingerprint`]); the last
/// unit of a row may be shorter, at least [`MIN_ROW_BYTES`].
pub const UNIT_BYTES: u32 = 512;

/// Shortest head row (and shortest last unit of a row): the fingerprint's 16-byte tag, its
/// check word and 3 body words.
pub const MIN_ROW_BYTES: u32 = 32;

/// Longest head row: the fingerprint tag's unit index has 6 bits (64 units of 512 bytes).
pub const MAX_ROW_BYTES: u32 = 64 * UNIT_BYTES;

/// Tokens and heads are 16-bit fields of the fingerprint's tag: a block's tokens and a
/// model's KV heads are at most this many.
pub const MAX_POSITION: u32 = 1 << 16;

/// Checks a head row's length (`head_size × dtype bytes`) against what the fingerprint
/// encodes: a multiple of 16 from [`MIN_ROW_BYTES`] to [`MAX_ROW_BYTES`] whose last 512-byte
/// unit is not 16 bytes (every unit holds a 16-byte tag and a check word).
pub fn check_row_bytes(row_bytes: u64) -> Result<(), GeometryError> {
    let rb = row_bytes;
    if rb < MIN_ROW_BYTES as u64 || !rb.is_multiple_of(16) || rb > MAX_ROW_BYTES as u64 || rb % UNIT_BYTES as u64 == 16 {
        return Err(GeometryError::Invalid(format!(
            "a head row is {rb} bytes (head_size × dtype bytes; MLA: the latent width × dtype bytes); the fingerprint \
             needs a multiple of 16 from {MIN_ROW_BYTES} to {MAX_ROW_BYTES} that is not 16 more than a multiple of 512 \
             (every 512-byte unit of a row holds a 16-byte tag and a check word)"
        )));
    }
    Ok(())
}

/// Shape of one engine's paged KV cache.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Geometry {
    /// Number of attention layers (one registered region each), 1..=65535.
    pub num_layers: u32,
    /// KV heads per layer (1 for MLA).
    pub num_kv_heads: u32,
    /// Elements per head (MLA: latent width, e.g. 576).
    pub head_size: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks per layer.
    pub num_blocks: u32,
    /// Element type.
    pub dtype: Dtype,
    /// Tensor order (NHD or HND); ignored for MLA.
    pub layout: Layout,
    /// Multi-head latent attention: one latent slice per (layer, block), no K/V split.
    pub mla: bool,
}

/// One block slice's coordinates in a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SliceCoord {
    /// Layer index.
    pub layer: u32,
    /// K, V or latent.
    pub kv: KvPart,
    /// Block id (physical slot) within the layer.
    pub block: u32,
}

impl Geometry {
    /// Checks every parameter and that all sizes fit; call before allocating.
    ///
    /// Errors: zero parameters, more than 65535 layers, MLA with more than one KV head, a
    /// head row the fingerprint cannot tag ([`check_row_bytes`]), more than [`MAX_POSITION`]
    /// tokens per block or KV heads, a slice larger than [`MAX_SLICE_BYTES`], and more than
    /// 2^32 − 1 slices in the pool.
    pub fn validate(&self) -> Result<(), GeometryError> {
        for (name, v) in [
            ("layers", self.num_layers),
            ("kv-heads", self.num_kv_heads),
            ("head-size", self.head_size),
            ("block-size", self.block_size),
            ("blocks", self.num_blocks),
        ] {
            if v == 0 {
                return Err(GeometryError::Invalid(format!("--{name} must be at least 1")));
            }
        }
        if self.num_layers > 0xFFFF {
            return Err(GeometryError::Invalid(format!(
                "--layers {} exceeds 65535 (the fingerprint stores the layer in 16 bits)",
                self.num_layers
            )));
        }
        if self.mla && self.num_kv_heads != 1 {
            return Err(GeometryError::Invalid(format!(
                "MLA stores one latent per layer: --kv-heads must be 1, not {}",
                self.num_kv_heads
            )));
        }
        check_row_bytes(self.head_size as u64 * self.dtype.bytes())?;
        for (name, v) in [("block-size", self.block_size), ("kv-heads", self.num_kv_heads)] {
            if v > MAX_POSITION {
                return Err(GeometryError::Invalid(format!(
                    "--{name} {v} exceeds {MAX_POSITION} (the fingerprint stores tokens and heads in 16 bits)"
                )));
            }
        }
        let s = self.slice_bytes()?;
        if s > MAX_SLICE_BYTES {
            return Err(GeometryError::Invalid(format!("a block slice is {s} bytes; at most {MAX_SLICE_BYTES} are supported")));
        }
        let total = self.total_slices()?;
        if total > u32::MAX as u64 {
            return Err(GeometryError::Overflow("number of block slices (2^32 - 1 at most)"));
        }
        self.pool_bytes()?;
        Ok(())
    }

    /// Bytes of one block slice: `block_size * num_kv_heads * head_size * dtype.bytes()`.
    pub fn slice_bytes(&self) -> Result<u64, GeometryError> {
        // block_size × num_kv_heads rows of row_bytes() (MLA: num_kv_heads is 1).
        (self.block_size as u64)
            .checked_mul(self.num_kv_heads as u64)
            .and_then(|v| v.checked_mul(self.head_size as u64))
            .and_then(|v| v.checked_mul(self.dtype.bytes()))
            .ok_or(GeometryError::Overflow("slice bytes"))
    }

    /// Bytes one token takes in one attention layer: `kv_parts × num_kv_heads × head_size ×
    /// dtype bytes` (vLLM's `AttentionSpec.page_size_bytes` over `block_size`).
    pub fn bytes_per_token(&self) -> u64 {
        self.kv_parts() as u64 * self.num_kv_heads as u64 * self.head_size as u64 * self.dtype.bytes()
    }

    /// Parts per layer: 2 (K and V), or 1 for MLA.
    pub fn kv_parts(&self) -> u32 {
        if self.mla { 1 } else { 2 }
    }

    /// The parts a layer holds, in fingerprint-code order.
    pub fn parts(&self) -> &'static [KvPart] {
        if self.mla { &[KvPart::Latent] } else { &[KvPart::K, KvPart::V] }
    }

    /// Block slices per layer region: `kv_parts * num_blocks`.
    pub fn slices_per_layer(&self) -> u64 {
        self.kv_parts() as u64 * self.num_blocks as u64
    }

    /// Block slices in the pool: `num_layers * slices_per_layer`.
    pub fn total_slices(&self) -> Result<u64, GeometryError> {
        (self.num_layers as u64).checked_mul(self.slices_per_layer()).ok_or(GeometryError::Overflow("slice count"))
    }

    /// Bytes of one layer's region: `slices_per_layer * slice_bytes`.
    pub fn region_bytes(&self) -> Result<u64, GeometryError> {
        self.slice_bytes()?.checked_mul(self.slices_per_layer()).ok_or(GeometryError::Overflow("region bytes"))
    }

    /// Bytes of the whole pool on one side: `num_layers * region_bytes`.
    pub fn pool_bytes(&self) -> Result<u64, GeometryError> {
        self.region_bytes()?.checked_mul(self.num_layers as u64).ok_or(GeometryError::Overflow("pool bytes"))
    }

    /// Layout code used by the kernels (`KVP_LAYOUT_*` in csrc/fingerprint.h).
    pub fn layout_code(&self) -> u32 {
        match (self.mla, self.layout) {
            (true, _) => 2,
            (false, Layout::Nhd) => 0,
            (false, Layout::Hnd) => 1,
        }
    }

    /// Index of a slice within its layer's region (its offset is `q * slice_bytes`).
    pub fn slice_index_in_layer(&self, kv: KvPart, block: u32) -> u64 {
        match (self.mla, self.layout) {
            (true, _) => block as u64,
            (false, Layout::Nhd) => kv.code() as u64 * self.num_blocks as u64 + block as u64,
            (false, Layout::Hnd) => block as u64 * 2 + kv.code() as u64,
        }
    }

    /// Byte offset of a slice within its layer's region. Valid after [`Geometry::validate`].
    pub fn slice_offset(&self, kv: KvPart, block: u32) -> u64 {
        self.slice_index_in_layer(kv, block) * self.slice_bytes().unwrap_or(0)
    }

    /// Global slice index: `layer * slices_per_layer + index_in_layer` (fits u32 after
    /// validation). It names a slot in poison patterns and failure lists.
    pub fn global_slice(&self, c: SliceCoord) -> u32 {
        (c.layer as u64 * self.slices_per_layer() + self.slice_index_in_layer(c.kv, c.block)) as u32
    }

    /// Inverse of [`Geometry::global_slice`].
    pub fn coord_of(&self, global: u32) -> SliceCoord {
        let per = self.slices_per_layer();
        let layer = (global as u64 / per) as u32;
        let q = global as u64 % per;
        let (block, kv) = match (self.mla, self.layout) {
            (true, _) => (q as u32, KvPart::Latent),
            (false, Layout::Nhd) => {
                ((q % self.num_blocks as u64) as u32, if q < self.num_blocks as u64 { KvPart::K } else { KvPart::V })
            }
            (false, Layout::Hnd) => ((q / 2) as u32, if q.is_multiple_of(2) { KvPart::K } else { KvPart::V }),
        };
        SliceCoord { layer, kv, block }
    }

    /// Every slice coordinate in descriptor order: layer, then K/V, then block — the
    /// order in which vLLM's NixlConnector lists per-block descriptors of split K/V regions.
    pub fn coords(&self) -> impl Iterator<Item = SliceCoord> + '_ {
        (0..self.num_layers).flat_map(move |layer| {
            self.parts().iter().flat_map(move |&kv| (0..self.num_blocks).map(move |block| SliceCoord { layer, kv, block }))
        })
    }

    /// The NIXL descriptor `(address, length)` of a slice, given each layer's region base
    /// address (`bases[layer]`).
    pub fn descriptor(&self, bases: &[u64], c: SliceCoord) -> (u64, u64) {
        (bases[c.layer as usize] + self.slice_offset(c.kv, c.block), self.slice_bytes().unwrap_or(0))
    }
}

/// Serialises a geometry with its derived `slice_bytes` added (reports' `config.geometry`,
/// so a reader needs no formula to recompute digests). For `#[serde(serialize_with)]`.
pub fn serialize_with_slice_bytes<S: serde::Serializer>(g: &Geometry, s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::Error;
    let mut v = serde_json::to_value(g).map_err(S::Error::custom)?;
    if let (Some(m), Ok(b)) = (v.as_object_mut(), g.slice_bytes()) {
        m.insert("slice_bytes".into(), b.into());
    }
    v.serialize(s)
}

/// [`serialize_with_slice_bytes`] for an optional geometry (reports' `config.decode_geometry`).
pub fn serialize_opt_with_slice_bytes<S: serde::Serializer>(g: &Option<Geometry>, s: S) -> Result<S::Ok, S::Error> {
    match g {
        Some(g) => serialize_with_slice_bytes(g, s),
        None => s.serialize_none(),
    }
}

/// Named geometries (`--preset`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Preset {
    /// The embedded default: 4 layers, 2 KV heads, head 64, bf16, block 16, 64 blocks
    /// (4 KiB slices, 2 MiB pool per side) — runs in seconds on a 2-core CPU.
    Small,
    /// Llama-3-8B: 32 layers, 8 KV heads, head 128, bf16, block 16 (32 KiB slices);
    /// 512 blocks = 1 GiB pool per side.
    #[value(name = "llama3-8b")]
    #[serde(rename = "llama3-8b")]
    Llama3_8b,
    /// DeepSeek-V3: MLA, 61 layers, latent 576 (512 + 64), bf16, block 64 (72 KiB slices);
    /// 256 blocks ≈ 1.07 GiB pool per side.
    #[value(name = "deepseek-v3")]
    #[serde(rename = "deepseek-v3")]
    DeepseekV3,
}

impl Preset {
    /// The preset's geometry.
    pub fn geometry(self) -> Geometry {
        match self {
            Preset::Small => Geometry {
                num_layers: 4,
                num_kv_heads: 2,
                head_size: 64,
                block_size: 16,
                num_blocks: 64,
                dtype: Dtype::Bf16,
                layout: Layout::Nhd,
                mla: false,
            },
            Preset::Llama3_8b => Geometry {
                num_layers: 32,
                num_kv_heads: 8,
                head_size: 128,
                block_size: 16,
                num_blocks: 512,
                dtype: Dtype::Bf16,
                layout: Layout::Nhd,
                mla: false,
            },
            Preset::DeepseekV3 => Geometry {
                num_layers: 61,
                num_kv_heads: 1,
                head_size: 576,
                block_size: 64,
                num_blocks: 256,
                dtype: Dtype::Bf16,
                layout: Layout::Nhd,
                mla: true,
            },
        }
    }
}

/// A geometry kvprobe cannot lay out is a usage error (exit 2).
impl From<GeometryError> for crate::error::Error {
    fn from(e: GeometryError) -> Self {
        crate::error::Error::Usage(e.to_string())
    }
}
