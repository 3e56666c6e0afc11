/*
 * kvprobe fingerprint (kvprobe.fingerprint/2): the one definition of the bytes of a KV-cache
 * block slice, by position.
 *
 * Included by the CUDA kernels (csrc/kernels.cu, compiled by NVRTC at run time) and by the
 * CPU reference (csrc/fingerprint_cpu.c, compiled by build.rs with cc), so VRAM and DRAM
 * pools hold bit-identical bytes for the same inputs. scripts/fingerprint_ref.py
 * re-implements it; docs/fingerprint.md "Fingerprint format" quotes it.
 *
 * A block slice is the contiguous bytes of one (layer, K/V, block) of the paged KV cache. Its
 * unit is the head row: one token's one KV head, row_bytes = head_size * dtype bytes (MLA:
 * one token's latent row). The slice holds block_size * heads rows in its layout's order
 * (below). A row's bytes are a function of (seed, layer, K/V, logical block, token, head,
 * generation, element), and every 512-byte unit of a row starts with a 16-byte tag naming
 * them, so a verifier can say "this slot holds token t, head h of block b; token t', head h'
 * was due". The physical slot is not an input: a row verifies wherever it lands.
 *
 * Poison (written into destination slices before each transfer) is unique to
 * (iteration, slot): element e of the slice (little-endian uint32, byte offset 4 * e) is
 * `slot` (the global slice index) for even e and 0x5A000000 | (iteration & 0xFFFFFF) for odd
 * e. The global slice index of (layer, kv, block) in the decode pool is
 * layer * slices_per_layer + q, with q the slice's index in its layer region (KVP_LAYOUT_*
 * below) and slices_per_layer = 2 * num_blocks (NHD, HND) or num_blocks (MLA). Poison
 * differs from every tag in at least 3 bits (element 1's top byte: 0x5A against 0x4C), so a
 * 1-bit flip never looks like poison.
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

#define KVP_POISON_MARK 0x5A000000u
/* A table entry whose generation is KVP_SKIP_GEN is neither filled nor verified. */
#define KVP_SKIP_GEN 0xFFFFFFFFu

/* Layouts of a layer's region (see src/core/geometry.rs for the vLLM shapes). */
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
 * ---- The rows ----
 *
 * row_bytes is a multiple of 16 from 32 to 32768, and row_bytes % 512 is not 16: every unit
 * (below) is at least 32 bytes, so every unit has a check word. A row is read as
 * little-endian uint32 elements i = 0 .. row_bytes/4 - 1, in units of 128 elements (512
 * bytes; the last may be shorter, at least 8 elements). Element w = i % 128 of unit
 * u = i / 128 is:
 *   w == 0 : logical block id
 *   w == 1 : layer | kv << 16 | u << 18 | 0x4C << 24   (kvp2_lkvu; kv: 0 K, 1 V, 2 MLA latent,
 *            3 region row: a state or indexer row, whose layer field is layer | part << 12)
 *   w == 2 : generation
 *   w == 3 : token | head << 16                         (kvp2_pos; a region row: its global row)
 *   w >= 4 : fmix32(rkey ^ ((i / 4) * 0x9E3779B9)) * M[i % 4]      (kvp2_group, kvp2_mult)
 *            with M = {1, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F}; element 4 of a unit (w == 4,
 *            the first after the tag) is its check word
 * with rkey = kvp2_row_key(seed32, block, kvp2_lkvu(layer, kv, 0), gen, pos) and seed32 =
 * kvp_seed32(seed). fmix32 is MurmurHash3's 32-bit finaliser; all arithmetic is modulo 2^32.
 * So every unit starts with a 16-byte tag naming (block, layer, K/V, unit, generation, token,
 * head) in plain words, bound to the seed and to each other by the check word: one changed
 * tag word (a flipped bit) never reads as another row's valid tag. Each 16-byte group of four
 * elements costs one fmix32 (and three multiplies): the kernels run at memory speed. token is the position in
 * the logical block that computed the row (prefill's block) and head the global KV head index
 * (before tensor parallelism splits the heads; MLA: 0).
 *
 * A block slice holds block_size * heads rows in the order of its layout (the vLLM tensor
 * shapes in src/core/geometry.rs): NHD [token][head] (row r = t * heads + h), HND [head][token]
 * (r = h * block_size + t), MLA [token] (r = t, head 0). A slice's rows name tokens
 * token_base + t and heads head_base + h: a decode block that holds part of a larger prefill
 * block, or a TP rank holding heads head_base.., names the rows it must hold.
 */

#define KVP2_MAGIC 0x4Cu
#define KVP2_UNIT_ELEMS 128u
#define KVP2_ORDER_NHD 0u
#define KVP2_ORDER_HND 1u
#define KVP2_ORDER_MLA 2u
/* Region rows (a hybrid model's state and indexer, src/core/hybrid.rs): row r of a slice is the
 * region's global row token_base + r, its 32-bit position word that number (no token/head). */
#define KVP2_ORDER_ROWS 3u
/* The K/V code of a region row; its layer field is kvp2_region_layer(layer, part). */
#define KVP2_KV_REGION 3u

KVP_FN kvp_u32 kvp2_lkvu(kvp_u32 layer, kvp_u32 kv, kvp_u32 unit) {
    return (layer & 0xFFFFu) | ((kv & 3u) << 16) | ((unit & 0x3Fu) << 18) | (KVP2_MAGIC << 24);
}

KVP_FN kvp_u32 kvp2_pos(kvp_u32 token, kvp_u32 head) { return (token & 0xFFFFu) | ((head & 0xFFFFu) << 16); }

/* The layer field of a region row: the model layer (12 bits) and the region part (4 bits:
 * state parts in page order, conv 0 then ssm 1; indexer values 0, scales 1). */
KVP_FN kvp_u32 kvp2_region_layer(kvp_u32 layer, kvp_u32 part) { return (layer & 0xFFFu) | ((part & 0xFu) << 12); }

KVP_FN kvp_u32 kvp2_row_key(kvp_u32 seed32, kvp_u32 block, kvp_u32 lkv0, kvp_u32 gen, kvp_u32 pos) {
    return kvp_fmix32(seed32 ^ kvp_fmix32(block ^ kvp_fmix32(lkv0 ^ kvp_fmix32(pos ^ kvp_fmix32(gen ^ 0x9E3779B9u)))));
}

/* The hash of the 16-byte group g (elements 4g .. 4g+3) of the row whose key is rkey. */
KVP_FN kvp_u32 kvp2_group(kvp_u32 rkey, kvp_u32 g) { return kvp_fmix32(rkey ^ (g * 0x9E3779B9u)); }

#define KVP2_M1 0x85EBCA6Bu
#define KVP2_M2 0xC2B2AE35u
#define KVP2_M3 0x27D4EB2Fu

/* M[j]: element 4g + j of a group is its hash times M[j]. */
KVP_FN kvp_u32 kvp2_mult(kvp_u32 j) { return j == 0u ? 1u : j == 1u ? KVP2_M1 : j == 2u ? KVP2_M2 : KVP2_M3; }

/* Element i of the row whose key is rkey, identified by (block, lkv0 = kvp2_lkvu(layer, kv, 0),
 * gen, pos). */
KVP_FN kvp_u32 kvp2_elem(kvp_u32 rkey, kvp_u32 block, kvp_u32 lkv0, kvp_u32 gen, kvp_u32 pos, kvp_u32 i) {
    kvp_u32 w = i & (KVP2_UNIT_ELEMS - 1u), u = i / KVP2_UNIT_ELEMS;
    if (w >= 4u) return kvp2_group(rkey, i >> 2) * kvp2_mult(i & 3u);
    if (w == 0u) return block;
    if (w == 1u) return lkv0 | ((u & 0x3Fu) << 18);
    if (w == 2u) return gen;
    return pos;
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

/* The position word of row r of a slice in `order` whose first token is token_base and first
 * head head_base: kvp2_pos of the row's (token, head), or for region rows the global row
 * token_base + r (all 32 bits). */
KVP_FN kvp_u32 kvp2_row_pos(kvp_u32 order, kvp_u32 block_size, kvp_u32 heads, kvp_u32 token_base, kvp_u32 head_base,
                            kvp_u32 r) {
    if (order == KVP2_ORDER_ROWS) return token_base + r;
    kvp_u32 t, h;
    kvp2_row_coords(order, block_size, heads, r, &t, &h);
    return kvp2_pos(token_base + t, head_base + h);
}

#endif /* KVPROBE_FINGERPRINT_H */
