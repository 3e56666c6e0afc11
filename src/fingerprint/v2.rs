//! Fingerprint version 2 (`fingerprint/2`): the bytes of a block slice by **position**.
//!
//! Version 1 ([`crate::fingerprint`]) is a function of the byte offset inside a slice, so a
//! verbatim copy between two layouts (prefill NHD, decode HND) verifies clean. Version 2's unit
//! is the **head row**: one token's one KV head, `head_size × dtype bytes` long (MLA: one
//! token's latent row). A row's bytes are a function of (seed, layer, K/V, logical block, token
//! in that block, global KV head, generation, element), and every 512-byte unit of a row starts
//! with a 16-byte tag naming them in plain words, so a verifier can say "this slot holds token
//! t, head h of block b; token t′, head h′ was due". The definition is `csrc/fingerprint.h`
//! ("Fingerprint version 2"), shared with the CPU reference linked here (and, with the pools'
//! switch to version 2, the CUDA kernels); `scripts/fingerprint_ref.py v2` re-implements it.
//!
//! A slice holds `block_size × heads` rows in its layout's order, after the per-layer vLLM
//! tensor shapes of [`crate::geometry`]: NHD `[token][head]` (FlashAttention's
//! `(2, num_blocks, block_size, num_kv_heads, head_size)`), HND `[head][token]` (FlashInfer's
//! HND stride order), MLA `[token]`. A slice's rows name tokens `token_base + t` and heads
//! `head_base + h`, so a decode block holding part of a larger prefill block (heterogeneous
//! block sizes), or a TP rank holding the heads from `head_base` on, names exactly the rows it
//! must hold.
//!
//! Not yet used by the pools: fills, verifies and reports are version 1 until the kernels move
//! to version 2 (issue 18). [`crate::verify::rows`] classifies a version-2 slice row by row.

use super::BlockIdentity;
use crate::geometry::{Geometry, GeometryError, KvPart, Layout};

/// The version string reports and bundles will carry.
pub const FORMAT: &str = "fingerprint/2";

/// Bytes of a tagged unit of a row (the last unit of a row may be shorter, ≥ 16 bytes).
pub const UNIT_BYTES: u32 = 512;

/// Longest row: the tag's unit index has 6 bits (64 units of 512 bytes).
pub const MAX_ROW_BYTES: u32 = 64 * UNIT_BYTES;

/// Tokens and heads are 16-bit fields of the tag: a slice's `token_base + block_size` and
/// `head_base + heads` are at most this.
pub const MAX_POSITION: u32 = 1 << 16;

/// Order of the rows inside a block slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowOrder {
    /// `[token][head]`: row `t × heads + h`.
    Nhd,
    /// `[head][token]`: row `h × block_size + t`.
    Hnd,
    /// `[token]`: row `t` (one latent row per token).
    Mla,
}

impl RowOrder {
    /// The order of a geometry's slices.
    pub fn of(g: &Geometry) -> RowOrder {
        match (g.mla, g.layout) {
            (true, _) => RowOrder::Mla,
            (false, Layout::Nhd) => RowOrder::Nhd,
            (false, Layout::Hnd) => RowOrder::Hnd,
        }
    }

    fn code(self) -> u32 {
        match self {
            RowOrder::Nhd => 0,
            RowOrder::Hnd => 1,
            RowOrder::Mla => 2,
        }
    }
}

/// What one head row holds: the row's identity in the fingerprint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowIdentity {
    /// The slice the row belongs to (layer, K/V, logical block, generation).
    pub slice: BlockIdentity,
    /// Token within the logical block that computed it (prefill's block).
    pub token: u32,
    /// Global KV head index (0 for MLA).
    pub head: u32,
}

/// The rows a block slice must hold, and their order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SliceRows {
    /// Layer, K/V, logical block and generation of every row.
    pub slice: BlockIdentity,
    /// Token of the slice's first token position.
    pub token_base: u32,
    /// Global head of the slice's first head position.
    pub head_base: u32,
    /// Row order.
    pub order: RowOrder,
    /// Token positions in the slice.
    pub block_size: u32,
    /// Head positions in the slice (MLA: 1).
    pub heads: u32,
    /// Bytes per row: `head_size × dtype bytes`.
    pub row_bytes: u32,
}

#[repr(C)]
struct CSlice {
    block: u32,
    layer: u32,
    kv: u32,
    gen_: u32,
    token_base: u32,
    head_base: u32,
    order: u32,
    block_size: u32,
    heads: u32,
    row_bytes: u32,
}

mod ffi {
    unsafe extern "C" {
        pub fn kvp2_cpu_fill(dst: *mut u8, len: u64, seed: u64, s: *const super::CSlice);
        pub fn kvp2_cpu_verify(src: *const u8, len: u64, seed: u64, s: *const super::CSlice, first_bad: *mut u64) -> u64;
        pub fn kvp2_cpu_decode_tag(
            src: *const u8,
            len: u64,
            seed: u64,
            off: u64,
            row_bytes: u32,
            block: *mut u32,
            layer: *mut u32,
            kv: *mut u32,
            unit: *mut u32,
            gen_: *mut u32,
            token: *mut u32,
            head: *mut u32,
        ) -> i32;
    }
}

impl SliceRows {
    /// The rows of a whole slice of `g` holding `slice`: tokens `0..block_size`, heads
    /// `0..num_kv_heads` (MLA: head 0), `row_bytes = head_size × dtype bytes`.
    pub fn of(g: &Geometry, slice: BlockIdentity) -> SliceRows {
        SliceRows {
            slice,
            token_base: 0,
            head_base: 0,
            order: RowOrder::of(g),
            block_size: g.block_size,
            heads: if g.mla { 1 } else { g.num_kv_heads },
            row_bytes: (g.head_size as u64 * g.dtype.bytes()).min(u32::MAX as u64) as u32,
        }
    }

    /// Bytes of the slice: `block_size × heads × row_bytes`.
    pub fn len(&self) -> u64 {
        self.block_size as u64 * self.heads as u64 * self.row_bytes as u64
    }

    /// True when the slice has no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks what version 2 can encode. Errors: a row that is not a multiple of 16 bytes
    /// (the tag) or is longer than [`MAX_ROW_BYTES`]; tokens or heads past [`MAX_POSITION`];
    /// zero tokens or heads; MLA with more than one head; more than 2^31 bytes.
    pub fn validate(&self) -> Result<(), GeometryError> {
        let bad = |m: String| Err(GeometryError::Invalid(m));
        if self.row_bytes == 0 || !self.row_bytes.is_multiple_of(16) || self.row_bytes > MAX_ROW_BYTES {
            return bad(format!(
                "a head row is {} bytes (head_size × dtype bytes); fingerprint/2 needs a multiple of 16 from 16 to {MAX_ROW_BYTES}",
                self.row_bytes
            ));
        }
        if self.block_size == 0 || self.heads == 0 {
            return bad("a slice needs at least one token and one head".into());
        }
        if self.order == RowOrder::Mla && (self.heads != 1 || self.head_base != 0) {
            return bad(format!(
                "an MLA slice has one latent row per token, head 0 (every TP rank holds the whole latent), not {} heads from head {}",
                self.heads, self.head_base
            ));
        }
        if self.token_base as u64 + self.block_size as u64 > MAX_POSITION as u64 {
            return bad(format!(
                "tokens {}..{} exceed the fingerprint's 16-bit token ({MAX_POSITION} per block at most)",
                self.token_base,
                self.token_base as u64 + self.block_size as u64
            ));
        }
        if self.head_base as u64 + self.heads as u64 > MAX_POSITION as u64 {
            return bad(format!("heads {}.. exceed the fingerprint's 16-bit head index", self.head_base));
        }
        if self.len() > crate::geometry::MAX_SLICE_BYTES {
            return bad(format!(
                "a block slice is {} bytes; at most {} are supported",
                self.len(),
                crate::geometry::MAX_SLICE_BYTES
            ));
        }
        Ok(())
    }

    /// The identity row `r` (0-based, in the slice's order) must hold.
    pub fn row(&self, r: u32) -> RowIdentity {
        let (t, h) = match self.order {
            RowOrder::Nhd => (r / self.heads, r % self.heads),
            RowOrder::Hnd => (r % self.block_size, r / self.block_size),
            RowOrder::Mla => (r, 0),
        };
        RowIdentity { slice: self.slice, token: self.token_base + t, head: self.head_base + h }
    }

    fn c(&self) -> CSlice {
        CSlice {
            block: self.slice.block,
            layer: self.slice.layer,
            kv: self.slice.kv.code(),
            gen_: self.slice.generation,
            token_base: self.token_base,
            head_base: self.head_base,
            order: self.order.code(),
            block_size: self.block_size,
            heads: self.heads,
            row_bytes: self.row_bytes,
        }
    }
}

/// Writes the version-2 fingerprint of `rows` into `dst`.
///
/// Panics when `rows` does not validate or `dst` is not exactly `rows.len()` bytes (callers
/// size the buffer from the same `SliceRows`).
pub fn fill(dst: &mut [u8], seed: u64, rows: &SliceRows) {
    rows.validate().expect("SliceRows validated by the caller");
    assert_eq!(dst.len() as u64, rows.len(), "buffer of the slice's length");
    let c = rows.c();
    // SAFETY: the C function writes exactly `len` bytes (whole rows of `row_bytes`, a multiple
    // of 16) into the exclusively borrowed buffer of that length; `c` outlives the call.
    unsafe { ffi::kvp2_cpu_fill(dst.as_mut_ptr(), dst.len() as u64, seed, &c) }
}

/// The expected bytes of `rows` (allocates [`SliceRows::len`] bytes).
pub fn expected(seed: u64, rows: &SliceRows) -> Vec<u8> {
    let mut v = vec![0u8; rows.len() as usize];
    fill(&mut v, seed, rows);
    v
}

/// Compares `src` with the fingerprint of `rows`: `(bad_bytes, first_bad_offset)`,
/// `first_bad_offset == src.len()` when intact. Panics as [`fill`].
pub fn check(src: &[u8], seed: u64, rows: &SliceRows) -> (u64, u64) {
    rows.validate().expect("SliceRows validated by the caller");
    assert_eq!(src.len() as u64, rows.len(), "buffer of the slice's length");
    let c = rows.c();
    let mut first = 0u64;
    // SAFETY: reads exactly `src.len()` bytes of the borrowed buffer; `c` and `first` are valid
    // for the duration of the call.
    let bad = unsafe { ffi::kvp2_cpu_verify(src.as_ptr(), src.len() as u64, seed, &c, &mut first) };
    (bad, first)
}

/// Decodes the tag of the unit starting at byte `off` of `src` (a row's start plus a multiple
/// of [`UNIT_BYTES`]), in rows of `row_bytes`: the row it names and the unit index; `None`
/// when it is not a valid version-2 tag for this seed (csrc/fingerprint_cpu.c,
/// `kvp2_cpu_decode_tag`, says what is checked).
pub fn decode_tag(src: &[u8], seed: u64, off: u64, row_bytes: u32) -> Option<(RowIdentity, u32)> {
    let (mut block, mut layer, mut kv, mut unit, mut generation, mut token, mut head) =
        (0u32, 0u32, 0u32, 0u32, 0u32, 0u32, 0u32);
    // SAFETY: the C function reads at most 20 bytes at `off` after checking they lie within
    // `src.len()`; every out-pointer is a valid local.
    let ok = unsafe {
        ffi::kvp2_cpu_decode_tag(
            src.as_ptr(),
            src.len() as u64,
            seed,
            off,
            row_bytes,
            &mut block,
            &mut layer,
            &mut kv,
            &mut unit,
            &mut generation,
            &mut token,
            &mut head,
        )
    };
    if ok == 0 {
        return None;
    }
    let slice = BlockIdentity { layer, kv: KvPart::from_code(kv)?, block, generation };
    Some((RowIdentity { slice, token, head }, unit))
}

/// What each row of a slice of `row_bytes` rows holds, by its first unit's tag (`None`: no
/// valid tag there).
pub fn observed_rows(src: &[u8], seed: u64, row_bytes: u32) -> Vec<Option<RowIdentity>> {
    if row_bytes == 0 {
        return Vec::new();
    }
    (0..src.len() as u64 / row_bytes as u64)
        .map(|r| decode_tag(src, seed, r * row_bytes as u64, row_bytes).filter(|(_, u)| *u == 0).map(|(id, _)| id))
        .collect()
}
