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

/* The hot loops run sector by sector: the 4 tag elements, then the sector's body, where every
 * element is kvp_body (kvp_elem's w >= 4 case) in a branch-free loop
 * the compiler vectorises. On x86-64 they are built twice (AVX2 and baseline) and the loader
 * picks one for the CPU (target_clones). Results equal kvp_elem's element for element. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define KVP_HOT __attribute__((target_clones("avx2", "default")))
#else
#define KVP_HOT
#endif

KVP_HOT
void kvp_cpu_fill(uint8_t *dst, uint64_t len, uint64_t seed, uint32_t block, uint32_t layer,
                  uint32_t kv, uint32_t gen) {
    kvp_u32 lkv = kvp_layer_kv(layer, kv);
    kvp_u32 key = kvp_slice_key(kvp_seed32(seed), block, lkv, gen);
    uint64_t n = len / 4;
    for (uint64_t s0 = 0; s0 < n; s0 += KVP_SECTOR_ELEMS) {
        uint64_t end = s0 + KVP_SECTOR_ELEMS < n ? s0 + KVP_SECTOR_ELEMS : n;
        uint64_t tag_end = s0 + KVP_TAG_ELEMS < end ? s0 + KVP_TAG_ELEMS : end;
        for (uint64_t e = s0; e < tag_end; e++) store32(dst + 4 * e, kvp_elem(key, block, lkv, gen, (kvp_u32)e));
        for (uint64_t e = tag_end; e < end; e++) store32(dst + 4 * e, kvp_body(key, (kvp_u32)e));
    }
}

KVP_HOT
void kvp_cpu_poison(uint8_t *dst, uint64_t len, uint32_t slot, uint32_t iteration) {
    uint64_t n = len / 4;
    kvp_u32 even = kvp_poison_elem(slot, iteration, 0u), odd = kvp_poison_elem(slot, iteration, 1u);
    for (uint64_t e = 0; e + 1 < n; e += 2) {
        store32(dst + 4 * e, even);
        store32(dst + 4 * e + 4, odd);
    }
    if (n & 1u) store32(dst + 4 * (n - 1), even);
}

/* Exact count of differing bytes in elements [from, to), and the first differing byte. */
static uint64_t kvp_cpu_diff(const uint8_t *src, uint64_t from, uint64_t to, kvp_u32 key, kvp_u32 block, kvp_u32 lkv,
                             kvp_u32 gen, uint64_t *first) {
    uint64_t bad = 0;
    for (uint64_t e = from; e < to; e++) {
        kvp_u32 want = kvp_elem(key, block, lkv, gen, (kvp_u32)e);
        kvp_u32 got = load32(src + 4 * e);
        if (want != got) {
            kvp_u32 x = want ^ got;
            uint64_t b = 0;
            while (((x >> (8 * b)) & 0xFFu) == 0u) b++;
            if (4 * e + b < *first) *first = 4 * e + b;
            bad += kvp_diff_bytes(want, got);
        }
    }
    return bad;
}

/* Returns the number of bytes that differ from the fingerprint; *first_bad gets the
 * offset of the first (len when none). A sector is first checked with an OR of the
 * differences (vectorised); only a sector that differs is counted byte by byte. */
KVP_HOT
uint64_t kvp_cpu_verify(const uint8_t *src, uint64_t len, uint64_t seed, uint32_t block,
                        uint32_t layer, uint32_t kv, uint32_t gen, uint64_t *first_bad) {
    kvp_u32 lkv = kvp_layer_kv(layer, kv);
    kvp_u32 key = kvp_slice_key(kvp_seed32(seed), block, lkv, gen);
    uint64_t n = len / 4, bad = 0, first = len;
    for (uint64_t s0 = 0; s0 < n; s0 += KVP_SECTOR_ELEMS) {
        uint64_t end = s0 + KVP_SECTOR_ELEMS < n ? s0 + KVP_SECTOR_ELEMS : n;
        uint64_t tag_end = s0 + KVP_TAG_ELEMS < end ? s0 + KVP_TAG_ELEMS : end;
        kvp_u32 acc = 0;
        for (uint64_t e = s0; e < tag_end; e++) acc |= kvp_elem(key, block, lkv, gen, (kvp_u32)e) ^ load32(src + 4 * e);
        for (uint64_t e = tag_end; e < end; e++) acc |= kvp_body(key, (kvp_u32)e) ^ load32(src + 4 * e);
        if (acc) bad += kvp_cpu_diff(src, s0, end, key, block, lkv, gen, &first);
    }
    *first_bad = first;
    return bad;
}

/* Compares `src` with the poison of (slot, iteration) (kvp_poison_elem): returns the number of
 * bytes that differ; *first_bad gets the offset of the first (len when none). As kvp_cpu_verify:
 * a sector is first checked with an OR of the differences, and only a sector that differs is
 * counted byte by byte. Used by the sweep's stray-write check (a stage must still hold its
 * poison right before it is posted again). */
KVP_HOT
uint64_t kvp_cpu_check_poison(const uint8_t *src, uint64_t len, uint32_t slot, uint32_t iteration, uint64_t *first_bad) {
    uint64_t n = len / 4, bad = 0, first = len;
    for (uint64_t s0 = 0; s0 < n; s0 += KVP_SECTOR_ELEMS) {
        uint64_t end = s0 + KVP_SECTOR_ELEMS < n ? s0 + KVP_SECTOR_ELEMS : n;
        kvp_u32 acc = 0;
        for (uint64_t e = s0; e < end; e++) acc |= kvp_poison_elem(slot, iteration, (kvp_u32)e) ^ load32(src + 4 * e);
        if (!acc) continue;
        for (uint64_t e = s0; e < end; e++) {
            kvp_u32 want = kvp_poison_elem(slot, iteration, (kvp_u32)e), got = load32(src + 4 * e);
            if (want != got) {
                kvp_u32 x = want ^ got;
                uint64_t b = 0;
                while (((x >> (8 * b)) & 0xFFu) == 0u) b++;
                if (4 * e + b < first) first = 4 * e + b;
                bad += kvp_diff_bytes(want, got);
            }
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
