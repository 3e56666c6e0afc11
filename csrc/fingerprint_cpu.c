/*
 * CPU reference of the kvprobe fingerprint (fills DRAM pools, verifies them, and
 * computes expected bytes for classification). The definition lives in
 * fingerprint.h, shared with the CUDA kernels.
 */
#include <string.h>
#include "fingerprint.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvprobe's fingerprint is defined on little-endian elements"
#endif

static inline kvp_u32 load32(const uint8_t *p) { kvp_u32 v; memcpy(&v, p, 4); return v; }
static inline void store32(uint8_t *p, kvp_u32 v) { memcpy(p, &v, 4); }

void kvp_cpu_fill(uint8_t *dst, uint64_t len, uint64_t seed, uint32_t block, uint32_t layer,
                  uint32_t kv, uint32_t gen) {
    kvp_u32 lkv = kvp_layer_kv(layer, kv);
    kvp_u32 key = kvp_slice_key(kvp_seed32(seed), block, lkv, gen);
    uint64_t n = len / 4;
    for (uint64_t e = 0; e < n; e++) store32(dst + 4 * e, kvp_elem(key, block, lkv, gen, (kvp_u32)e));
}

void kvp_cpu_poison(uint8_t *dst, uint64_t len, uint32_t slot, uint32_t iteration) {
    uint64_t n = len / 4;
    for (uint64_t e = 0; e < n; e++) store32(dst + 4 * e, kvp_poison_elem(slot, iteration, (kvp_u32)e));
}

/* Returns the number of bytes that differ from the fingerprint; *first_bad gets the
 * offset of the first (len when none). */
uint64_t kvp_cpu_verify(const uint8_t *src, uint64_t len, uint64_t seed, uint32_t block,
                        uint32_t layer, uint32_t kv, uint32_t gen, uint64_t *first_bad) {
    kvp_u32 lkv = kvp_layer_kv(layer, kv);
    kvp_u32 key = kvp_slice_key(kvp_seed32(seed), block, lkv, gen);
    uint64_t n = len / 4, bad = 0, first = len;
    for (uint64_t e = 0; e < n; e++) {
        kvp_u32 want = kvp_elem(key, block, lkv, gen, (kvp_u32)e);
        kvp_u32 got = load32(src + 4 * e);
        if (want != got) {
            if (first == len) {
                kvp_u32 x = want ^ got;
                uint64_t b = 0;
                while (((x >> (8 * b)) & 0xFFu) == 0u) b++;
                first = 4 * e + b;
            }
            bad += kvp_diff_bytes(want, got);
        }
    }
    *first_bad = first;
    return bad;
}

/* Checks the 16-byte tag at the head of `sector` in `src`; on success stores the
 * identity it names and returns 1. */
int kvp_cpu_decode_tag(const uint8_t *src, uint64_t len, uint64_t seed, uint32_t sector,
                       uint32_t *block, uint32_t *layer, uint32_t *kv, uint32_t *gen) {
    uint64_t off = (uint64_t)sector * KVP_SECTOR_BYTES;
    if (off + 16 > len) return 0;
    kvp_u32 b = load32(src + off), lkv = load32(src + off + 4), g = load32(src + off + 8);
    kvp_u32 check = load32(src + off + 12);
    if ((lkv >> 24) != KVP_TAG_MAGIC) return 0;
    kvp_u32 key = kvp_slice_key(kvp_seed32(seed), b, lkv, g);
    if (kvp_tag_check(key, sector) != check) return 0;
    *block = b;
    *layer = lkv & 0xFFFFu;
    *kv = (lkv >> 16) & 0xFFu;
    *gen = g;
    return 1;
}

/* The folded seed the kernels take (kvp_seed32). */
uint32_t kvp_cpu_seed32(uint64_t seed) { return kvp_seed32(seed); }
