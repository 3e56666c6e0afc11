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

/*
 * ---- Fingerprint version 2: by position (fingerprint/2) ----
 *
 * The unit is the head row: one token's one KV head, row_bytes = head_size * dtype bytes
 * (MLA: one token's latent row), a multiple of 16 from 16 to 32768. A row's bytes are a
 * function of (seed, layer, K/V, logical block, token, head, generation, element), where
 * token is the position in the logical block that computed it (prefill's block) and head the
 * global KV head index (before tensor parallelism splits the heads). A row is read as
 * little-endian uint32 elements i = 0 .. row_bytes/4 - 1, in units of 128 elements (512
 * bytes; the last may be shorter, at least 4 elements). Element w = i % 128 of unit
 * u = i / 128 is:
 *   w == 0 : logical block id
 *   w == 1 : layer | kv << 16 | u << 18 | 0x4C << 24   (kvp2_lkvu)
 *   w == 2 : generation
 *   w == 3 : token | head << 16                         (kvp2_pos)
 *   w == 4 : check = fmix32(rkey ^ ((u + 1) * 0x85EBCA77))
 *   w >= 5 : fmix32(rkey ^ (i * 0x9E3779B9))
 * with rkey = kvp2_row_key(seed32, block, kvp2_lkvu(layer, kv, 0), gen, pos). So every unit
 * starts with a 16-byte tag naming (block, layer, K/V, unit, generation, token, head) in
 * plain words, bound to the seed by the check word (units of at least 5 elements) and the
 * body. Element 1's top byte 0x4C tells a version-2 tag from a version-1 one (0x4B) and from
 * poison (0x5A in every odd element).
 *
 * A block slice holds block_size * heads rows in the order of its layout (the vLLM tensor
 * shapes in src/geometry.rs): NHD [token][head] (row r = t * heads + h), HND [head][token]
 * (r = h * block_size + t), MLA [token] (r = t, head 0). A slice's rows name tokens
 * token_base + t and heads head_base + h: a decode block that holds part of a larger prefill
 * block, or a TP rank holding heads head_base.., names the rows it must hold.
 */
#define KVP2_MAGIC 0x4Cu
#define KVP2_UNIT_ELEMS 128u
#define KVP2_ORDER_NHD 0u
#define KVP2_ORDER_HND 1u
#define KVP2_ORDER_MLA 2u

KVP_FN kvp_u32 kvp2_lkvu(kvp_u32 layer, kvp_u32 kv, kvp_u32 unit) {
    return (layer & 0xFFFFu) | ((kv & 3u) << 16) | ((unit & 0x3Fu) << 18) | (KVP2_MAGIC << 24);
}

KVP_FN kvp_u32 kvp2_pos(kvp_u32 token, kvp_u32 head) { return (token & 0xFFFFu) | ((head & 0xFFFFu) << 16); }

KVP_FN kvp_u32 kvp2_row_key(kvp_u32 seed32, kvp_u32 block, kvp_u32 lkv0, kvp_u32 gen, kvp_u32 pos) {
    return kvp_fmix32(seed32 ^ kvp_fmix32(block ^ kvp_fmix32(lkv0 ^ kvp_fmix32(pos ^ kvp_fmix32(gen ^ 0x9E3779B9u)))));
}

/* Element i of the row whose key is rkey, identified by (block, lkv0 = kvp2_lkvu(layer, kv, 0),
 * gen, pos). */
KVP_FN kvp_u32 kvp2_elem(kvp_u32 rkey, kvp_u32 block, kvp_u32 lkv0, kvp_u32 gen, kvp_u32 pos, kvp_u32 i) {
    kvp_u32 w = i & (KVP2_UNIT_ELEMS - 1u), u = i / KVP2_UNIT_ELEMS;
    if (w >= 5u) return kvp_fmix32(rkey ^ (i * 0x9E3779B9u));
    if (w == 0u) return block;
    if (w == 1u) return lkv0 | ((u & 0x3Fu) << 18);
    if (w == 2u) return gen;
    if (w == 3u) return pos;
    return kvp_fmix32(rkey ^ ((u + 1u) * 0x85EBCA77u));
}

/* Row r of a slice in `order` with `block_size` tokens and `heads` heads: its (t, h). */
KVP_FN void kvp2_row_coords(kvp_u32 order, kvp_u32 block_size, kvp_u32 heads, kvp_u32 r, kvp_u32 *t, kvp_u32 *h) {
    if (order == KVP2_ORDER_NHD) {
        *t = r / heads;
        *h = r - *t * heads;
    } else if (order == KVP2_ORDER_HND) {
        *h = r / block_size;
        *t = r - *h * block_size;
    } else {
        *t = r;
        *h = 0u;
    }
}

#endif /* KVPROBE_FINGERPRINT_H */
