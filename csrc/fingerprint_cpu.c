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

/* Counts the bytes in which element `got` at byte offset `at` differs from `want` into *bad,
 * and lowers *first to the first of them (the verify passes' byte-by-byte recount). */
static inline void kvp_cpu_count(kvp_u32 want, kvp_u32 got, uint64_t at, uint64_t *bad, uint64_t *first) {
    kvp_u32 x = want ^ got;
    if (!x) return;
    uint64_t b = 0;
    while (((x >> (8 * b)) & 0xFFu) == 0u) b++;
    if (at + b < *first) *first = at + b;
    *bad += kvp_diff_bytes(want, got);
}

/* Exact count of differing bytes in elements [from, to), and the first differing byte. */
static uint64_t kvp_cpu_diff(const uint8_t *src, uint64_t from, uint64_t to, kvp_u32 key, kvp_u32 block, kvp_u32 lkv,
                             kvp_u32 gen, uint64_t *first) {
    uint64_t bad = 0;
    for (uint64_t e = from; e < to; e++) {
        kvp_cpu_count(kvp_elem(key, block, lkv, gen, (kvp_u32)e), load32(src + 4 * e), 4 * e, &bad, first);
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
        for (uint64_t e = s0; e < end; e++)
            kvp_cpu_count(kvp_poison_elem(slot, iteration, (kvp_u32)e), load32(src + 4 * e), 4 * e, &bad, &first);
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

/* ---- Version 2 (fingerprint.h, "Fingerprint version 2"): a slice of head rows ---- */

/* A block slice's rows: what it must hold and in which order (layout shared with
 * src/fingerprint/v2.rs, SliceRows). The slice is block_size * heads * row_bytes long. */
typedef struct {
    uint32_t block, layer, kv, gen; /* logical block, layer, 0 K / 1 V / 2 latent, generation */
    uint32_t token_base, head_base; /* the first row's token in the logical block, global head */
    uint32_t order;                 /* KVP2_ORDER_* */
    uint32_t block_size, heads;     /* tokens and heads in this slice (MLA: heads 1) */
    uint32_t row_bytes;             /* head_size * dtype bytes: a multiple of 16, 16 .. 32768 */
} kvp2_slice;

/* Row r's key and position. */
static inline void kvp2_row(const kvp2_slice *s, kvp_u32 seed32, kvp_u32 r, kvp_u32 *rkey, kvp_u32 *pos) {
    kvp_u32 t, h;
    kvp2_row_coords(s->order, s->block_size, s->heads, r, &t, &h);
    *pos = kvp2_pos(s->token_base + t, s->head_base + h);
    *rkey = kvp2_row_key(seed32, s->block, kvp2_lkvu(s->layer, s->kv, 0u), s->gen, *pos);
}

/* Writes row after row: each unit's 5 tag-and-check elements, then its body in a
 * branch-free loop (kvp2_elem's w >= 5 case). */
KVP_HOT
void kvp2_cpu_fill(uint8_t *dst, uint64_t len, uint64_t seed, const kvp2_slice *s) {
    kvp_u32 seed32 = kvp_seed32(seed), lkv0 = kvp2_lkvu(s->layer, s->kv, 0u);
    uint64_t row_elems = s->row_bytes / 4u, rows = len / s->row_bytes;
    for (uint64_t r = 0; r < rows; r++) {
        kvp_u32 rkey, pos;
        kvp2_row(s, seed32, (kvp_u32)r, &rkey, &pos);
        uint8_t *row = dst + r * s->row_bytes;
        for (uint64_t u0 = 0; u0 < row_elems; u0 += KVP2_UNIT_ELEMS) {
            uint64_t end = u0 + KVP2_UNIT_ELEMS < row_elems ? u0 + KVP2_UNIT_ELEMS : row_elems;
            uint64_t tag_end = u0 + 5u < end ? u0 + 5u : end;
            for (uint64_t i = u0; i < tag_end; i++) store32(row + 4 * i, kvp2_elem(rkey, s->block, lkv0, s->gen, pos, (kvp_u32)i));
            for (uint64_t i = tag_end; i < end; i++) store32(row + 4 * i, kvp_fmix32(rkey ^ ((kvp_u32)i * 0x9E3779B9u)));
        }
    }
}

/* Bytes of `src` that differ from the rows `s` names; *first_bad gets the offset of the first
 * (len when none). A row is first compared with an OR of the differences; only a row that
 * differs is counted byte by byte. */
KVP_HOT
uint64_t kvp2_cpu_verify(const uint8_t *src, uint64_t len, uint64_t seed, const kvp2_slice *s, uint64_t *first_bad) {
    kvp_u32 seed32 = kvp_seed32(seed), lkv0 = kvp2_lkvu(s->layer, s->kv, 0u);
    uint64_t row_elems = s->row_bytes / 4u, rows = len / s->row_bytes, bad = 0, first = len;
    for (uint64_t r = 0; r < rows; r++) {
        kvp_u32 rkey, pos, acc = 0;
        kvp2_row(s, seed32, (kvp_u32)r, &rkey, &pos);
        const uint8_t *row = src + r * s->row_bytes;
        for (uint64_t u0 = 0; u0 < row_elems; u0 += KVP2_UNIT_ELEMS) {
            uint64_t end = u0 + KVP2_UNIT_ELEMS < row_elems ? u0 + KVP2_UNIT_ELEMS : row_elems;
            uint64_t tag_end = u0 + 5u < end ? u0 + 5u : end;
            for (uint64_t i = u0; i < tag_end; i++) acc |= kvp2_elem(rkey, s->block, lkv0, s->gen, pos, (kvp_u32)i) ^ load32(row + 4 * i);
            for (uint64_t i = tag_end; i < end; i++) acc |= kvp_fmix32(rkey ^ ((kvp_u32)i * 0x9E3779B9u)) ^ load32(row + 4 * i);
        }
        if (!acc) continue;
        for (uint64_t i = 0; i < row_elems; i++)
            kvp_cpu_count(kvp2_elem(rkey, s->block, lkv0, s->gen, pos, (kvp_u32)i), load32(row + 4 * i),
                          r * s->row_bytes + 4 * i, &bad, &first);
    }
    *first_bad = first;
    return bad;
}

/* Checks the version-2 tag of the unit starting at byte `off` of `src`, in rows of
 * `row_bytes` (off must be a unit's start: a row's start plus a multiple of 512); on success
 * stores the row and unit it names and returns 1. Valid: element 1's top byte is 0x4C, K/V is
 * 0..2, the unit exists in such a row and, when the unit has a check word (5 or more
 * elements), the check word matches; a 16-byte row is its plain tag alone. */
int kvp2_cpu_decode_tag(const uint8_t *src, uint64_t len, uint64_t seed, uint64_t off, uint32_t row_bytes,
                        uint32_t *block, uint32_t *layer, uint32_t *kv, uint32_t *unit, uint32_t *gen, uint32_t *token,
                        uint32_t *head) {
    if (off + 16 > len || row_bytes < 16 || row_bytes % 16) return 0;
    kvp_u32 b = load32(src + off), lkvu = load32(src + off + 4), g = load32(src + off + 8), pos = load32(src + off + 12);
    kvp_u32 k = (lkvu >> 16) & 3u, u = (lkvu >> 18) & 0x3Fu, row_elems = row_bytes / 4u;
    if ((lkvu >> 24) != KVP2_MAGIC || k > 2u || u * KVP2_UNIT_ELEMS >= row_elems) return 0;
    kvp_u32 unit_elems = row_elems - u * KVP2_UNIT_ELEMS;
    if (unit_elems > KVP2_UNIT_ELEMS) unit_elems = KVP2_UNIT_ELEMS;
    if (unit_elems >= 5u) {
        if (off + 20 > len) return 0;
        kvp_u32 lkv0 = lkvu & ~(0x3Fu << 18);
        kvp_u32 rkey = kvp2_row_key(kvp_seed32(seed), b, lkv0, g, pos);
        if (load32(src + off + 16) != kvp2_elem(rkey, b, lkv0, g, pos, u * KVP2_UNIT_ELEMS + 4u)) return 0;
    }
    *block = b;
    *layer = lkvu & 0xFFFFu;
    *kv = k;
    *unit = u;
    *gen = g;
    *token = pos & 0xFFFFu;
    *head = pos >> 16;
    return 1;
}

/* The folded seed the kernels take (kvp_seed32). */
uint32_t kvp_cpu_seed32(uint64_t seed) { return kvp_seed32(seed); }
