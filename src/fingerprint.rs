//! The block-slice fingerprint: what every byte of a KV block slice must be.
//!
//! The definition is `csrc/fingerprint.h` (quoted in README.md, "Fingerprint format"),
//! shared by the CUDA kernels ([`KERNEL_SOURCE`]) and the CPU reference
//! (`csrc/fingerprint_cpu.c`, linked here), so VRAM and DRAM pools hold bit-identical
//! bytes. In short: a slice's bytes are a function of (seed, layer, K/V, logical block,
//! generation, byte offset); every 512-byte sector starts with a 16-byte tag naming
//! (logical block, layer, K/V, generation) plus a check word, so the verifier can say
//! which block a slot holds wherever it landed.
//!
//! Digests for reports are SHA-256 of the slice bytes, hex (`sha256sum` recomputes them).

pub mod v2;

use crate::geometry::KvPart;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Bytes per sector: each sector starts with a tag.
pub const SECTOR_BYTES: usize = 512;

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
    concat!("#define KVP_NVRTC 1\n", include_str!("../csrc/fingerprint.h"), "\n", include_str!("../csrc/kernels.cu"));

/// What a block slice holds: the identity encoded in its fingerprint.
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
}

mod ffi {
    unsafe extern "C" {
        pub fn kvp_cpu_fill(dst: *mut u8, len: u64, seed: u64, block: u32, layer: u32, kv: u32, gen_: u32);
        pub fn kvp_cpu_poison(dst: *mut u8, len: u64, slot: u32, iteration: u32);
        pub fn kvp_cpu_verify(
            src: *const u8,
            len: u64,
            seed: u64,
            block: u32,
            layer: u32,
            kv: u32,
            gen_: u32,
            first_bad: *mut u64,
        ) -> u64;
        pub fn kvp_cpu_decode_tag(
            src: *const u8,
            len: u64,
            seed: u64,
            sector: u32,
            block: *mut u32,
            layer: *mut u32,
            kv: *mut u32,
            gen_: *mut u32,
        ) -> i32;
        pub fn kvp_cpu_check_poison(src: *const u8, len: u64, slot: u32, iteration: u32, first_bad: *mut u64) -> u64;
        pub fn kvp_cpu_seed32(seed: u64) -> u32;
    }
}

/// The 32-bit folded seed the kernels take (`kvp_seed32` in fingerprint.h).
pub fn seed32(seed: u64) -> u32 {
    // SAFETY: a pure function of its argument.
    unsafe { ffi::kvp_cpu_seed32(seed) }
}

/// Writes the fingerprint of `id` into `dst` (a whole slice, length a multiple of 16).
pub fn fill(dst: &mut [u8], seed: u64, id: BlockIdentity) {
    // SAFETY: the C function writes exactly `len` bytes (len/4 whole elements) of `dst`,
    // which is a valid, exclusively borrowed buffer of that length.
    unsafe { ffi::kvp_cpu_fill(dst.as_mut_ptr(), dst.len() as u64, seed, id.block, id.layer, id.kv.code(), id.generation) }
}

/// Writes the poison pattern of (slot, iteration) into `dst`: little-endian u32 elements,
/// `slot` at even indices and `0x5A000000 | (iteration & 0xFFFFFF)` at odd ones; `slot` is
/// the global slice index ([`crate::geometry::Geometry::global_slice`]).
pub fn poison(dst: &mut [u8], slot: u32, iteration: u32) {
    // SAFETY: writes exactly `dst.len()` bytes of the exclusively borrowed buffer.
    unsafe { ffi::kvp_cpu_poison(dst.as_mut_ptr(), dst.len() as u64, slot, iteration) }
}

/// Compares `src` with the fingerprint of `id`: returns `(bad_bytes, first_bad_offset)`;
/// `first_bad_offset == src.len()` when the slice is intact.
pub fn check(src: &[u8], seed: u64, id: BlockIdentity) -> (u64, u64) {
    let mut first = 0u64;
    // SAFETY: reads exactly `src.len()` bytes of the borrowed buffer; `first` is a valid
    // out-pointer for the duration of the call.
    let bad = unsafe {
        ffi::kvp_cpu_verify(src.as_ptr(), src.len() as u64, seed, id.block, id.layer, id.kv.code(), id.generation, &mut first)
    };
    (bad, first)
}

/// [`fill`] into a range of a DRAM pool (see [`crate::hostmem`]: no transfer may be in
/// flight into it).
pub fn fill_span(dst: &mut crate::hostmem::SpanMut<'_>, seed: u64, id: BlockIdentity) {
    let len = dst.len() as u64;
    // SAFETY: the C function writes exactly `len` bytes at the pointer; the span is valid
    // for them and held exclusively (SpanMut), and no transfer touches them (its contract).
    unsafe { ffi::kvp_cpu_fill(dst.as_mut_ptr(), len, seed, id.block, id.layer, id.kv.code(), id.generation) }
}

/// [`poison`] into a range of a DRAM pool (no transfer may be in flight into it).
pub fn poison_span(dst: &mut crate::hostmem::SpanMut<'_>, slot: u32, iteration: u32) {
    let len = dst.len() as u64;
    // SAFETY: writes exactly `len` bytes of the exclusively held span (as fill_span).
    unsafe { ffi::kvp_cpu_poison(dst.as_mut_ptr(), len, slot, iteration) }
}

/// [`check`] of a range of a DRAM pool (no transfer may be writing it).
pub fn check_span(src: crate::hostmem::Span<'_>, seed: u64, id: BlockIdentity) -> (u64, u64) {
    let mut first = 0u64;
    // SAFETY: reads exactly `src.len()` bytes, valid for the span's borrow; no writer touches
    // them (the span's contract); `first` is a valid out-pointer.
    let bad = unsafe {
        ffi::kvp_cpu_verify(src.as_ptr(), src.len() as u64, seed, id.block, id.layer, id.kv.code(), id.generation, &mut first)
    };
    (bad, first)
}

/// Compares `src` with the poison of (`slot`, `iteration`) ([`poison`]): returns
/// `(bad_bytes, first_bad_offset)`, bytes counted one by one (a byte differs when it is not
/// the poison's byte at that offset); `first_bad_offset == src.len()` when `src` still holds
/// its poison. The sweep's stray-write check.
pub fn check_poison(src: &[u8], slot: u32, iteration: u32) -> (u64, u64) {
    let mut first = 0u64;
    // SAFETY: reads exactly `src.len()` bytes of the borrowed buffer; `first` is a valid
    // out-pointer for the duration of the call.
    let bad = unsafe { ffi::kvp_cpu_check_poison(src.as_ptr(), src.len() as u64, slot, iteration, &mut first) };
    (bad, first)
}

/// [`check_poison`] of a range of a DRAM pool (no transfer may be writing it).
pub fn check_poison_span(src: crate::hostmem::Span<'_>, slot: u32, iteration: u32) -> (u64, u64) {
    let mut first = 0u64;
    // SAFETY: reads exactly `src.len()` bytes, valid for the span's borrow; no writer touches
    // them (the span's contract); `first` is a valid out-pointer.
    let bad = unsafe { ffi::kvp_cpu_check_poison(src.as_ptr(), src.len() as u64, slot, iteration, &mut first) };
    (bad, first)
}

/// The identity a (possibly damaged) slice names in the first sector whose tag decodes
/// ([`decode_tag`]), searching from the sector holding byte `from` onwards, then from the
/// start; `None` when no sector's tag decodes.
pub fn observed_identity(src: &[u8], seed: u64, from: u64) -> Option<BlockIdentity> {
    let sectors = src.len().div_ceil(SECTOR_BYTES) as u32;
    let start = ((from as usize) / SECTOR_BYTES).min(sectors as usize) as u32;
    (start..sectors).chain(0..start).find_map(|s| decode_tag(src, seed, s))
}

/// Decodes the tag at the head of `sector` of a slice; `None` when the tag is not a valid
/// fingerprint tag for this seed and sector index.
pub fn decode_tag(src: &[u8], seed: u64, sector: u32) -> Option<BlockIdentity> {
    let (mut block, mut layer, mut kv, mut generation) = (0u32, 0u32, 0u32, 0u32);
    // SAFETY: the C function reads at most 16 bytes at sector*512 after checking that they
    // lie within `src.len()`; the out-pointers are valid locals.
    let ok = unsafe {
        ffi::kvp_cpu_decode_tag(src.as_ptr(), src.len() as u64, seed, sector, &mut block, &mut layer, &mut kv, &mut generation)
    };
    if ok == 0 {
        return None;
    }
    Some(BlockIdentity { layer, kv: KvPart::from_code(kv)?, block, generation })
}

/// The expected bytes of a slice (allocates `len` bytes).
pub fn expected(len: usize, seed: u64, id: BlockIdentity) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(&mut v, seed, id);
    v
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
