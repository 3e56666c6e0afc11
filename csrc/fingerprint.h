/*
 * kvprobe fingerprint: the one definition of the bytes of a KV-cache block slice.
 *
 * Included by the CUDA kernels (csrc/kernels.cu, compiled by NVRTC at run time)
 * and by the CPU reference (csrc/fingerprint_cpu.c, compiled by build.rs with cc),
 * so VRAM and DRAM pools hold bit-identical bytes for the same inputs.
 *
 * A block slice is the contiguous bytes of one (layer, K/V, block) of the paged KV
 * cache; its length is a multiple of 16 bytes. It is read as little-endian uint32
 * elements e = 0, 1, 2, ... (byte offset = 4 * e) grouped in sectors of 512 bytes
 * (128 elements; the last sector may be shorter). Element w = e % 128 of sector
 * s = e / 128 is:
 *   w == 0 : logical block id
 *   w == 1 : layer | kv << 16 | 0x4B << 24      (kv: 0 = K, 1 = V, 2 = MLA latent)
 *   w == 2 : generation
 *   w == 3 : check = fmix32(key ^ (s * 0x85EBCA77))
 *   w >= 4 : fmix32(key ^ (e * 0x9E3779B9))
 * where key = kvp_slice_key(seed32, block, layer_kv, generation) and seed32 folds the
 * 64-bit seed (kvp_seed32). fmix32 is MurmurHash3's 32-bit finaliser. All arithmetic
 * is modulo 2^32. The physical slot is not an input: a slice verifies wherever it
 * lands, and the 16-byte tag at the head of every sector names the block it holds.
 *
 * Poison (written into destination slices before each transfer) is unique to
 * (iteration, slot): element e is `slot` (the global slice index) for even e and
 * 0x5A000000 | (iteration & 0xFFFFFF) for odd e. The global slice index of (layer, kv,
 * block) in the decode pool is layer * slices_per_layer + q, with q the slice's index in
 * its layer region (KVP_LAYOUT_* below) and slices_per_layer = 2 * num_blocks (NHD, HND)
 * or num_blocks (MLA). Poison differs from every fingerprint sector in at least 2 bits
 * (element 1's top byte: 0x5A against 0x4B), so a 1-bit flip never looks like poison.
 */
#ifndef KVPROBE_FINGERPRINT_H
#define KVPROBE_FINGERPRINT_H

#ifdef __CUDACC__
#define KVP_FN static __host__ __device__ __forceinline__
typedef unsigned int kvp_u32;
typedef unsigned long long kvp_u64;
#else
#include <stdint.h>
#define KVP_FN static inline
typedef uint32_t kvp_u32;
typedef uint64_t kvp_u64;
#endif

#define KVP_SECTOR_BYTES 512u
#define KVP_SECTOR_ELEMS 128u
#define KVP_TAG_ELEMS 4u
#define KVP_TAG_MAGIC 0x4Bu
#define KVP_POISON_MARK 0x5A000000u
/* A table entry whose generation is KVP_SKIP_GEN is neither filled nor verified. */
#define KVP_SKIP_GEN 0xFFFFFFFFu

/* Layouts of a layer's region (see src/geometry.rs for the vLLM shapes). */
#define KVP_LAYOUT_NHD 0u /* (2, num_blocks, ...): slice q = kv * num_blocks + block */
#define KVP_LAYOUT_HND 1u /* (num_blocks, 2, ...): slice q = block * 2 + kv        */
#define KVP_LAYOUT_MLA 2u /* (num_blocks, ...):    slice q = block, kv = 2         */

KVP_FN kvp_u32 kvp_fmix32(kvp_u32 h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

KVP_FN kvp_u32 kvp_seed32(kvp_u64 seed) {
    return kvp_fmix32((kvp_u32)seed ^ kvp_fmix32((kvp_u32)(seed >> 32) ^ 0x6B767062u));
}

KVP_FN kvp_u32 kvp_layer_kv(kvp_u32 layer, kvp_u32 kv) {
    return (layer & 0xFFFFu) | ((kv & 0xFFu) << 16) | (KVP_TAG_MAGIC << 24);
}

KVP_FN kvp_u32 kvp_slice_key(kvp_u32 seed32, kvp_u32 block, kvp_u32 layer_kv, kvp_u32 gen) {
    return kvp_fmix32(seed32 ^ kvp_fmix32(block ^ kvp_fmix32(layer_kv ^ kvp_fmix32(gen ^ 0x9E3779B9u))));
}

KVP_FN kvp_u32 kvp_tag_check(kvp_u32 key, kvp_u32 sector) {
    return kvp_fmix32(key ^ (sector * 0x85EBCA77u));
}

/* Element e of a sector's body (w = e % 128 >= 4): the fast paths of the kernels and the
 * CPU reference compute bodies with this alone. */
KVP_FN kvp_u32 kvp_body(kvp_u32 key, kvp_u32 e) { return kvp_fmix32(key ^ (e * 0x9E3779B9u)); }

/* Element e of the slice identified by (block, layer_kv, gen) whose key is `key`. */
KVP_FN kvp_u32 kvp_elem(kvp_u32 key, kvp_u32 block, kvp_u32 layer_kv, kvp_u32 gen, kvp_u32 e) {
    kvp_u32 w = e & (KVP_SECTOR_ELEMS - 1u);
    if (w >= KVP_TAG_ELEMS) return kvp_body(key, e);
    if (w == 0u) return block;
    if (w == 1u) return layer_kv;
    if (w == 2u) return gen;
    return kvp_tag_check(key, e / KVP_SECTOR_ELEMS);
}

KVP_FN kvp_u32 kvp_poison_elem(kvp_u32 slot, kvp_u32 iteration, kvp_u32 e) {
    return (e & 1u) ? (KVP_POISON_MARK | (iteration & 0xFFFFFFu)) : slot;
}

/* Number of differing bytes between two elements. */
KVP_FN kvp_u32 kvp_diff_bytes(kvp_u32 a, kvp_u32 b) {
    kvp_u32 x = a ^ b;
    return (kvp_u32)((x & 0xFFu) != 0u) + (kvp_u32)((x & 0xFF00u) != 0u) +
           (kvp_u32)((x & 0xFF0000u) != 0u) + (kvp_u32)((x & 0xFF000000u) != 0u);
}

/* Maps slice q of a layer's region to (block, kv). */
KVP_FN void kvp_slice_coords(kvp_u32 layout, kvp_u32 num_blocks, kvp_u32 q, kvp_u32 *block, kvp_u32 *kv) {
    if (layout == KVP_LAYOUT_NHD) {
        *kv = q / num_blocks;
        *block = q - *kv * num_blocks;
    } else if (layout == KVP_LAYOUT_HND) {
        *block = q >> 1;
        *kv = q & 1u;
    } else {
        *block = q;
        *kv = 2u;
    }
}

#endif /* KVPROBE_FINGERPRINT_H */
