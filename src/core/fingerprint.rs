//! The block-slice fingerprint (`kvprobe.fingerprint/2`): what every byte of a KV block slice
//! must be, by **position**.
//!
//! The unit is the **head row**: one token's one KV head, `head_size × dtype bytes` long
//! (MLA: one token's latent row). A row's bytes are a function of (seed, layer, K/V, logical
//! block, token in that block, global KV head, generation, element), and every 512-byte unit
//! of a row starts with a 16-byte tag naming them in plain words, bound by a check word, so a
//! verifier can say "this slot holds token t, head h of block b; token t′, head h′ was due" —
//! and a verbatim copy between two layouts (prefill NHD, decode HND) does not verify.
//!
//! The definition is `csrc/fingerprint.h` (quoted in docs/fingerprint.md, "Fingerprint format"), shared
//! by the CUDA kernels ([`KERNEL_SOURCE`]) and the CPU reference (`csrc/fingerprint_cpu.c`,
//! linked here), so VRAM and DRAM pools hold bit-identical bytes; `pysrc/fingerprint_ref.py`
//! re-implements it.
//!
//! A slice holds `block_size × heads` rows in its layout's order, after the per-layer vLLM
//! tensor shapes of [`crate::core::geometry`]: NHD `[token][head]` (FlashAttention's
//! `(2, num_blocks, block_size, num_kv_heads, head_size)`), HND `[head][token]` (FlashInfer's
//! HND stride order), MLA `[token]`. A slice's rows name tokens `token_base + t` and heads
//! `head_base + h`, so a decode block holding part of a larger prefill block (heterogeneous
//! block sizes), or a TP rank holding the heads from `head_base` on, names exactly the rows it
//! must hold. [`crate::core::verify`] classifies a corrupt slice unit by unit and row by row.
//!
//! Digests for reports are SHA-256 of the slice bytes, hex (`sha256sum` recomputes them).

use crate::core::geometry::{Geometry, GeometryError, KvPart, Layout};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::ops::Range;

/// The version string reports (`config.fingerprint`), dumps and bundles carry.
pub const FORMAT: &str = "kvprobe.fingerprint/2";

pub use crate::core::geometry::{MAX_POSITION, MAX_ROW_BYTES, MIN_ROW_BYTES, UNIT_BYTES};

/// Generation value that marks a table entry "neither fill nor verify".
pub const SKIP_GEN: u32 = u32::MAX;

/// The generation computed after `g`: `g + 1`, wrapping from `SKIP_GEN - 1` (and from
/// anything above it) back to 1, so a computed generation is never 0 (the initial fill's)
/// nor [`SKIP_GEN`] (the kernels' "neither fill nor verify" marker), however many blocks a
/// run computes. Scenario runs number every computed block this way.
pub fn next_generation(g: u32) -> u32 {
    if g >= SKIP_GEN - 1 { 1 } else { g + 1 }
}

/// `seed` as `"0x"` followed by 16 lowercase hex digits (the report's `seed_hex`).
pub fn seed_hex(seed: u64) -> String {
    format!("{seed:#018x}")
}

/// CUDA source of the fill, poison and verify kernels: `fingerprint.h` followed by
/// `kernels.cu`, compiled by NVRTC at run time.
pub const KERNEL_SOURCE: &str =
    concat!("#define KVP_NVRTC 1\n", include_str!("../../csrc/fingerprint.h"), "\n", include_str!("../../csrc/kernels.cu"));

/// A report's `config.fingerprint`: the definition its digests and dumps follow. Written as
/// [`FORMAT`] by this kvprobe; a report without it is read as `kvprobe.fingerprint/1` (the
/// byte-offset fingerprint of kvprobes before version 2).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Format(pub String);

impl Default for Format {
    fn default() -> Format {
        Format(FORMAT.into())
    }
}

impl Format {
    /// What a report without `config.fingerprint` follows.
    pub fn before_version_2() -> Format {
        Format("kvprobe.fingerprint/1".into())
    }
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// What a block slice holds: the identity encoded in its rows' tags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockIdentity {
    /// Layer index.
    pub layer: u32,
    /// K, V or MLA latent.
    pub kv: KvPart,
    /// Logical block id (independent of the physical slot).
    pub block: u32,
    /// Generation (iteration that wrote it; 0 = the initial fill).
    pub generation: u32,
    /// Token of the logical block at the slice's first token position: 0 unless a slot holds
    /// part of a larger logical block (unequal block sizes on the two sides). Written only
    /// when not 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub token_base: u32,
}

impl BlockIdentity {
    /// The identity of a whole logical block's slice (`token_base` 0).
    pub fn new(layer: u32, kv: KvPart, block: u32, generation: u32) -> BlockIdentity {
        BlockIdentity { layer, kv, block, generation, token_base: 0 }
    }
}

/// Order of the rows inside a block slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowOrder {
    /// `[token][head]`: row `t × heads + h`.
    Nhd,
    /// `[head][token]`: row `h × block_size + t`.
    Hnd,
    /// `[token]`: row `t` (one latent row per token).
    Mla,
    /// Region rows (a hybrid model's state and indexer): row `r` is the region's global row
    /// `token_base + r`, its position word that 32-bit number.
    Rows,
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

    /// The code of `KVP2_ORDER_*` in fingerprint.h (equal to `KVP_LAYOUT_*`).
    pub fn code(self) -> u32 {
        match self {
            RowOrder::Nhd => 0,
            RowOrder::Hnd => 1,
            RowOrder::Mla => 2,
            RowOrder::Rows => 3,
        }
    }
}

/// What one head row holds: the row's identity in the fingerprint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowIdentity {
    /// The slice the row belongs to (layer, K/V, logical block, generation; `token_base` 0).
    pub slice: BlockIdentity,
    /// Token within the logical block that computed it (prefill's block).
    pub token: u32,
    /// Global KV head index (0 for MLA).
    pub head: u32,
}

/// How one side cuts its block slices into head rows: the same for every slice of a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowShape {
    /// Row order.
    pub order: RowOrder,
    /// Token positions in a slice (the side's `block_size`).
    pub block_size: u32,
    /// Head positions in a slice (the side's KV heads per TP rank; MLA: 1).
    pub heads: u32,
    /// Global head of a slice's first head position (a TP rank's first head; MLA: 0).
    pub head_base: u32,
    /// Bytes per row: `head_size × dtype bytes`.
    pub row_bytes: u32,
}

/// The rows a block slice must hold: a slice identity cut by a side's [`RowShape`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SliceRows {
    /// Layer, K/V, logical block, generation and first token of every row.
    pub slice: BlockIdentity,
    /// The side's rows.
    pub shape: RowShape,
}

impl RowShape {
    /// The rows of a whole slice of `g`: heads `0..num_kv_heads` (MLA: head 0),
    /// `row_bytes = head_size × dtype bytes` (saturating; [`RowShape::validate`] refuses what
    /// does not fit).
    pub fn of(g: &Geometry) -> RowShape {
        RowShape {
            order: RowOrder::of(g),
            block_size: g.block_size,
            heads: if g.mla { 1 } else { g.num_kv_heads },
            head_base: 0,
            row_bytes: (g.head_size as u64 * g.dtype.bytes()).min(u32::MAX as u64) as u32,
        }
    }

    /// Bytes of a slice: `block_size × heads × row_bytes`.
    pub fn slice_bytes(&self) -> u64 {
        self.block_size as u64 * self.heads as u64 * self.row_bytes as u64
    }

    /// Rows in a slice: `block_size × heads`.
    pub fn rows(&self) -> u64 {
        self.block_size as u64 * self.heads as u64
    }

    /// Checks what the fingerprint can encode. Errors: a row that is not a multiple of 16
    /// bytes from [`MIN_ROW_BYTES`] to [`MAX_ROW_BYTES`], or whose last 512-byte unit is 16
    /// bytes (every unit needs its tag and check word); heads or tokens past
    /// [`MAX_POSITION`] (with `token_base`, the largest the slices will name); zero tokens or
    /// heads; MLA with more than one head or a head other than 0; more than 2^31 bytes.
    pub fn validate(&self, max_token_base: u32) -> Result<(), GeometryError> {
        let bad = |m: String| Err(GeometryError::Invalid(m));
        crate::core::geometry::check_row_bytes(self.row_bytes as u64)?;
        if self.block_size == 0 || self.heads == 0 {
            return bad("a slice needs at least one token and one head".into());
        }
        if self.order == RowOrder::Rows {
            if self.heads != 1 || self.head_base != 0 {
                return bad(format!(
                    "region rows have one position per row, not {} heads from head {}",
                    self.heads, self.head_base
                ));
            }
            if max_token_base as u64 + self.block_size as u64 > 1u64 << 32 {
                return bad(format!("region rows {max_token_base}.. of {} exceed the 32-bit row number", self.block_size));
            }
        } else if self.order == RowOrder::Mla && (self.heads != 1 || self.head_base != 0) {
            return bad(format!(
                "an MLA slice has one latent row per token, head 0 (every TP rank holds the whole latent), not {} heads from head {}",
                self.heads, self.head_base
            ));
        }
        if self.order != RowOrder::Rows && max_token_base as u64 + self.block_size as u64 > MAX_POSITION as u64 {
            return bad(format!(
                "tokens {}..{} exceed the fingerprint's 16-bit token ({MAX_POSITION} per block at most)",
                max_token_base,
                max_token_base as u64 + self.block_size as u64
            ));
        }
        if self.head_base as u64 + self.heads as u64 > MAX_POSITION as u64 {
            return bad(format!(
                "heads {}..{} exceed the fingerprint's 16-bit head index ({MAX_POSITION} at most)",
                self.head_base,
                self.head_base as u64 + self.heads as u64
            ));
        }
        if self.slice_bytes() > crate::core::geometry::MAX_SLICE_BYTES {
            return bad(format!(
                "a block slice is {} bytes; at most {} are supported",
                self.slice_bytes(),
                crate::core::geometry::MAX_SLICE_BYTES
            ));
        }
        Ok(())
    }

    /// The slice of `id` in this shape.
    pub fn slice(&self, id: BlockIdentity) -> SliceRows {
        SliceRows { slice: id, shape: *self }
    }

    /// `(t, h)` of row `r` (0-based, in the slice's order): its token and head positions.
    pub fn coords(&self, r: u32) -> (u32, u32) {
        match self.order {
            RowOrder::Nhd => (r / self.heads, r % self.heads),
            RowOrder::Hnd => (r % self.block_size, r / self.block_size),
            RowOrder::Mla | RowOrder::Rows => (r, 0),
        }
    }

    /// The tagged units of a slice in byte order: `(row, unit, byte range in the slice)`; a
    /// unit is 512 bytes of a row, the row's last unit the remainder.
    pub fn units(&self) -> impl Iterator<Item = (u32, u32, Range<usize>)> + '_ {
        let rb = self.row_bytes as usize;
        let per_row = rb.div_ceil(UNIT_BYTES as usize).max(1);
        (0..self.rows() as usize).flat_map(move |r| {
            (0..per_row).map(move |u| {
                let start = r * rb + u * UNIT_BYTES as usize;
                (r as u32, u as u32, start..(start + UNIT_BYTES as usize).min((r + 1) * rb))
            })
        })
    }
}

impl SliceRows {
    /// Bytes of the slice: `block_size × heads × row_bytes`.
    pub fn len(&self) -> u64 {
        self.shape.slice_bytes()
    }

    /// True when the slice has no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks the shape with this slice's `token_base` ([`RowShape::validate`]).
    pub fn validate(&self) -> Result<(), GeometryError> {
        self.shape.validate(self.slice.token_base)
    }

    /// The identity row `r` (0-based, in the slice's order) must hold.
    pub fn row(&self, r: u32) -> RowIdentity {
        let (t, h) = self.shape.coords(r);
        RowIdentity {
            slice: BlockIdentity { token_base: 0, ..self.slice },
            token: self.slice.token_base + t,
            head: self.shape.head_base + h,
        }
    }

    fn c(&self) -> CSlice {
        CSlice {
            block: self.slice.block,
            layer: self.slice.layer,
            kv: self.slice.kv.code(),
            gen_: self.slice.generation,
            token_base: self.slice.token_base,
            head_base: self.shape.head_base,
            order: self.shape.order.code(),
            block_size: self.shape.block_size,
            heads: self.shape.heads,
            row_bytes: self.shape.row_bytes,
        }
    }
}

/// `kvp2_slice` of csrc/fingerprint_cpu.c.
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

#[allow(unsafe_code)] // the C bridge to csrc/fingerprint.h
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
        pub fn kvp_cpu_poison(dst: *mut u8, len: u64, slot: u32, iteration: u32);
        pub fn kvp_cpu_check_poison(src: *const u8, len: u64, slot: u32, iteration: u32, first_bad: *mut u64) -> u64;
        pub fn kvp_cpu_seed32(seed: u64) -> u32;
    }
}

/// The 32-bit folded seed the kernels take (`kvp_seed32` in fingerprint.h).
#[allow(unsafe_code)] // the C bridge to csrc/fingerprint.h
pub fn seed32(seed: u64) -> u32 {
    // SAFETY: a pure function of its argument.
    unsafe { ffi::kvp_cpu_seed32(seed) }
}

fn checked(rows: &SliceRows, len: usize) {
    rows.validate().expect("SliceRows validated by the caller (the pool's geometry)");
    assert_eq!(len as u64, rows.len(), "a buffer of the slice's length");
}

/// Writes the fingerprint of `rows` into `dst`.
///
/// Panics when `rows` does not validate or `dst` is not exactly `rows.len()` bytes (callers
/// size the buffer from the same validated geometry).
#[allow(unsafe_code)] // the C bridge to csrc/fingerprint.h
pub fn fill(dst: &mut [u8], seed: u64, rows: &SliceRows) {
    checked(rows, dst.len());
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
#[allow(unsafe_code)] // the C bridge to csrc/fingerprint.h
pub fn check(src: &[u8], seed: u64, rows: &SliceRows) -> (u64, u64) {
    checked(rows, src.len());
    let c = rows.c();
    let mut first = 0u64;
    // SAFETY: reads exactly `src.len()` bytes of the borrowed buffer; `c` and `first` are valid
    // for the duration of the call.
    let bad = unsafe { ffi::kvp2_cpu_verify(src.as_ptr(), src.len() as u64, seed, &c, &mut first) };
    (bad, first)
}

/// [`fill`] into a range of a DRAM pool (see [`crate::sys::hostmem`]: no transfer may be in
/// flight into it). Panics as [`fill`].
#[allow(unsafe_code)] // the C bridge to csrc/fingerprint.h
pub fn fill_span(dst: &mut crate::sys::hostmem::SpanMut<'_>, seed: u64, rows: &SliceRows) {
    checked(rows, dst.len());
    let c = rows.c();
    // SAFETY: the C function writes exactly `len` bytes at the pointer; the span is valid for
    // them and held exclusively (SpanMut), and no transfer touches them (its contract).
    unsafe { ffi::kvp2_cpu_fill(dst.as_mut_ptr(), dst.len() as u64, seed, &c) }
}

/// [`check`] of a range of a DRAM pool (no transfer may be writing it). Panics as [`fill`].
#[allow(unsafe_code)] // the C bridge to csrc/fingerprint.h
pub fn check_span(src: crate::sys::hostmem::Span<'_>, seed: u64, rows: &SliceRows) -> (u64, u64) {
    checked(rows, src.len());
    let c = rows.c();
    let mut first = 0u64;
    // SAFETY: reads exactly `src.len()` bytes, valid for the span's borrow; no writer touches
    // them (the span's contract); `c` and `first` are valid for the call.
    let bad = unsafe { ffi::kvp2_cpu_verify(src.as_ptr(), src.len() as u64, seed, &c, &mut first) };
    (bad, first)
}

/// Writes the poison of (slot, iteration) into `dst`: little-endian u32 elements, `slot` at
/// even indices and `0x5A000000 | (iteration & 0xFFFFFF)` at odd ones; `slot` is the global
/// slice index ([`crate::core::geometry::Geometry::global_slice`]).
#[allow(unsafe_code)] // the C bridge to csrc/fingerprint.h
pub fn poison(dst: &mut [u8], slot: u32, iteration: u32) {
    // SAFETY: writes exactly `dst.len()` bytes of the exclusively borrowed buffer.
    unsafe { ffi::kvp_cpu_poison(dst.as_mut_ptr(), dst.len() as u64, slot, iteration) }
}

/// [`poison`] into a range of a DRAM pool (no transfer may be in flight into it).
#[allow(unsafe_code)] // the C bridge to csrc/fingerprint.h
pub fn poison_span(dst: &mut crate::sys::hostmem::SpanMut<'_>, slot: u32, iteration: u32) {
    let len = dst.len() as u64;
    // SAFETY: writes exactly `len` bytes of the exclusively held span (as fill_span).
    unsafe { ffi::kvp_cpu_poison(dst.as_mut_ptr(), len, slot, iteration) }
}

/// Compares `src` with the poison of (`slot`, `iteration`) ([`poison`]): returns
/// `(bad_bytes, first_bad_offset)`, bytes counted one by one; `first_bad_offset == src.len()`
/// when `src` still holds its poison. The sweep's stray-write check.
#[allow(unsafe_code)] // the C bridge to csrc/fingerprint.h
pub fn check_poison(src: &[u8], slot: u32, iteration: u32) -> (u64, u64) {
    let mut first = 0u64;
    // SAFETY: reads exactly `src.len()` bytes of the borrowed buffer; `first` is a valid
    // out-pointer for the duration of the call.
    let bad = unsafe { ffi::kvp_cpu_check_poison(src.as_ptr(), src.len() as u64, slot, iteration, &mut first) };
    (bad, first)
}

/// [`check_poison`] of a range of a DRAM pool (no transfer may be writing it).
#[allow(unsafe_code)] // the C bridge to csrc/fingerprint.h
pub fn check_poison_span(src: crate::sys::hostmem::Span<'_>, slot: u32, iteration: u32) -> (u64, u64) {
    let mut first = 0u64;
    // SAFETY: reads exactly `src.len()` bytes, valid for the span's borrow; no writer touches
    // them (the span's contract); `first` is a valid out-pointer.
    let bad = unsafe { ffi::kvp_cpu_check_poison(src.as_ptr(), src.len() as u64, slot, iteration, &mut first) };
    (bad, first)
}

/// Decodes the tag of the unit starting at byte `off` of `src` (a row's start plus a multiple
/// of [`UNIT_BYTES`]), in rows of `row_bytes`: the row it names and the unit index; `None`
/// when it is not a valid tag for this seed (magic, K/V, a unit such a row has, check word).
#[allow(unsafe_code)] // the C bridge to csrc/fingerprint.h
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
    let kv = KvPart::from_code(kv)?;
    let slice = BlockIdentity::new(layer, kv, block, generation);
    if kv == KvPart::Region {
        // A region row's position word is its global row.
        return Some((RowIdentity { slice, token: token | head << 16, head: 0 }, unit));
    }
    Some((RowIdentity { slice, token, head }, unit))
}

/// The bytes of one row (`row_bytes` long) of the fingerprint.
pub fn row_fingerprint(seed: u64, id: RowIdentity, row_bytes: u32) -> Option<Vec<u8>> {
    let one = SliceRows {
        slice: BlockIdentity { token_base: id.token, ..id.slice },
        shape: RowShape {
            order: if id.slice.kv == KvPart::Latent { RowOrder::Mla } else { RowOrder::Nhd },
            block_size: 1,
            heads: 1,
            head_base: id.head,
            row_bytes,
        },
    };
    one.validate().ok()?;
    Some(expected(seed, &one))
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

/// The slice identity a (possibly damaged) slice of `shape` names in the first unit whose tag
/// decodes, searching from the unit holding byte `from` onwards, then from the start; its
/// `token_base` is the decoded token less the row's token position (0 when that is
/// negative). `None` when no unit's tag decodes.
pub fn observed_identity(src: &[u8], seed: u64, shape: &RowShape, from: u64) -> Option<BlockIdentity> {
    let rb = shape.row_bytes as u64;
    if rb == 0 {
        return None;
    }
    let rows = (src.len() as u64 / rb).min(shape.rows());
    let per_row = rb.div_ceil(UNIT_BYTES as u64);
    let units = rows * per_row;
    // Unit k is unit k % per_row of row k / per_row; the search starts at the unit holding `from`.
    let start = (from / rb).saturating_mul(per_row).saturating_add((from % rb) / UNIT_BYTES as u64).min(units);
    (start..units).chain(0..start).find_map(|k| {
        let (r, u) = (k / per_row, k % per_row);
        let (id, _) = decode_tag(src, seed, r * rb + u * UNIT_BYTES as u64, shape.row_bytes)?;
        let (t, _) = shape.coords(r as u32);
        Some(BlockIdentity { token_base: id.token.saturating_sub(t), ..id.slice })
    })
}

/// SHA-256 of `bytes` as lowercase hex (64 characters).
pub fn digest(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    let mut s = String::with_capacity(64);
    for b in d.iter() {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Logical block id of prefill slot `i`: a seeded bijection of u32 (so logical ≠ physical).
pub fn logical_block(seed: u64, i: u32) -> u32 {
    i.wrapping_mul(0x9E37_79B1) ^ (seed as u32).rotate_left(7)
}
