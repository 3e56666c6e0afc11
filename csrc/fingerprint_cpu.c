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

/* The hot loops run unit by unit: the 4 tag elements, then the unit's 16-byte groups (a hash
 * and three multiplies each, kvp2_elem's w >= 4 case) in a branch-free loop the compiler
 * vectorises. On
 * x86-64 they are built twice (AVX2 and baseline) and the loader picks one for the CPU
 * (target_clones). Results equal kvp2_elem's element for element. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define KVP_HOT __attribute__((target_clones("avx2", "default")))
#else
#define KVP_HOT
#endif

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

/* Compares `src` with the poison of (slot, iteration) (kvp_poison_elem): returns the number of
 * bytes that differ; *first_bad gets the offset of the first (len when none). As kvp2_cpu_verify:
 * a run of 128 elements (512 bytes) is first checked with an OR of the differences, and only a
 * run that differs is counted byte by byte. Used by the sweep's stray-write check (a stage must still hold its
 * poison right before it is posted again). */
KVP_HOT
uint64_t kvp_cpu_check_poison(const uint8_t *src, uint64_t len, uint32_t slot, uint32_t iteration, uint64_t *first_bad) {
    uint64_t n = len / 4, bad = 0, first = len;
    for (uint64_t s0 = 0; s0 < n; s0 += 128u) {
        uint64_t end = s0 + 128u < n ? s0 + 128u : n;
        kvp_u32 acc = 0;
        for (uint64_t e = s0; e < end; e++) acc |= kvp_poison_elem(slot, iteration, (kvp_u32)e) ^ load32(src + 4 * e);
        if (!acc) continue;
        for (uint64_t e = s0; e < end; e++)
            kvp_cpu_count(kvp_poison_elem(slot, iteration, (kvp_u32)e), load32(src + 4 * e), 4 * e, &bad, &first);
    }
    *first_bad = first;
    return bad;
}

/* ---- A slice of head rows (fingerprint.h, "The rows") ---- */

/* A block slice's rows: what it must hold and in which order (layout shared with
 * src/core/fingerprint.rs, SliceRows and RowShape). The slice is block_size * heads * row_bytes long. */
typedef struct {
    uint32_t block, layer, kv, gen; /* logical block, layer, 0 K / 1 V / 2 latent / 3 region, generation */
    uint32_t token_base, head_base; /* the first row's token in the logical block (region: its global row), global head */
    uint32_t order;                 /* KVP2_ORDER_* */
    uint32_t block_size, heads;     /* tokens and heads in this slice (MLA: heads 1) */
    uint32_t row_bytes;             /* head_size * dtype bytes (fingerprint.h, "The rows") */
} kvp2_slice;

/* Rows are handled in batches: the keys of up to KVP2_BATCH rows at once (a branch-free loop
 * the compiler vectorises: kvp2_row_key with the generation's fmix32 hoisted), then each row's
 * expected elements into a row buffer (groups vectorised, the tags patched in). */
#define KVP2_BATCH 256u
#define KVP2_MAX_ROW_ELEMS 8192u /* 32768-byte rows */
/* Verify prefetches the bytes this far ahead of the row it compares (measured on a 2-core
 * x86-64 VM: 7.0 -> 8.7 GB/s per thread on 256-byte rows; the hardware prefetcher alone lags
 * behind the row-by-row loop). */
#define KVP2_PREFETCH 4096u

/* Positions and keys of rows r0 .. r0 + n - 1 (n <= KVP2_BATCH) of slice `s`. */
static void kvp2_batch(const kvp2_slice *s, kvp_u32 seed32, uint64_t r0, uint64_t n, kvp_u32 *pos, kvp_u32 *keys) {
    kvp_u32 t, h, lkv0 = kvp2_lkvu(s->layer, s->kv, 0u), g = kvp_fmix32(s->gen ^ 0x9E3779B9u);
    kvp2_row_coords(s->order, s->block_size, s->heads, (kvp_u32)r0, &t, &h);
    for (uint64_t k = 0; k < n; k++) {
        pos[k] = s->order == KVP2_ORDER_ROWS ? s->token_base + (kvp_u32)(r0 + k) : kvp2_pos(s->token_base + t, s->head_base + h);
        if (s->order == KVP2_ORDER_NHD) {
            if (++h == s->heads) { h = 0; t++; }
        } else if (s->order == KVP2_ORDER_HND) {
            if (++t == s->block_size) { t = 0; h++; }
        } else {
            t++;
        }
    }
    for (uint64_t k = 0; k < n; k++) keys[k] = kvp_fmix32(seed32 ^ kvp_fmix32(s->block ^ kvp_fmix32(lkv0 ^ kvp_fmix32(pos[k] ^ g))));
}

/* The elements of the row whose key is rkey (row_elems of them) into the row buffer `out`. */
KVP_HOT
static void kvp2_row_elems(kvp_u32 *restrict out, uint64_t row_elems, kvp_u32 rkey, kvp_u32 block, kvp_u32 lkv0,
                           kvp_u32 gen, kvp_u32 pos) {
    for (kvp_u32 g = 0; g < (kvp_u32)(row_elems / 4u); g++) {
        kvp_u32 x = kvp2_group(rkey, g);
        out[4 * g] = x;
        out[4 * g + 1] = x * KVP2_M1;
        out[4 * g + 2] = x * KVP2_M2;
        out[4 * g + 3] = x * KVP2_M3;
    }
    for (uint64_t u0 = 0; u0 < row_elems; u0 += KVP2_UNIT_ELEMS) {
        out[u0] = block;
        out[u0 + 1] = lkv0 | (kvp_u32)((u0 / KVP2_UNIT_ELEMS) << 18);
        out[u0 + 2] = gen;
        out[u0 + 3] = pos;
    }
}

KVP_HOT
void kvp2_cpu_fill(uint8_t *dst, uint64_t len, uint64_t seed, const kvp2_slice *s) {
    kvp_u32 seed32 = kvp_seed32(seed), lkv0 = kvp2_lkvu(s->layer, s->kv, 0u);
    kvp_u32 pos[KVP2_BATCH], keys[KVP2_BATCH], want[KVP2_MAX_ROW_ELEMS];
    uint64_t row_elems = s->row_bytes / 4u, rows = len / s->row_bytes;
    for (uint64_t r0 = 0; r0 < rows; r0 += KVP2_BATCH) {
        uint64_t n = rows - r0 < KVP2_BATCH ? rows - r0 : KVP2_BATCH;
        kvp2_batch(s, seed32, r0, n, pos, keys);
        for (uint64_t k = 0; k < n; k++) {
            /* Through the row buffer: measured faster than storing the groups into the slice
             * directly (8.7 against 7.2 GB/s per thread on 256-byte rows). */
            kvp2_row_elems(want, row_elems, keys[k], s->block, lkv0, s->gen, pos[k]);
            memcpy(dst + (r0 + k) * s->row_bytes, want, s->row_bytes);
        }
    }
}

/* Bytes of `src` that differ from the rows `s` names; *first_bad gets the offset of the first
 * (len when none). A row is first compared with an OR of the differences; only a row that
 * differs is counted byte by byte. */
KVP_HOT
uint64_t kvp2_cpu_verify(const uint8_t *src, uint64_t len, uint64_t seed, const kvp2_slice *s, uint64_t *first_bad) {
    kvp_u32 seed32 = kvp_seed32(seed), lkv0 = kvp2_lkvu(s->layer, s->kv, 0u);
    kvp_u32 pos[KVP2_BATCH], keys[KVP2_BATCH], want[KVP2_MAX_ROW_ELEMS];
    uint64_t row_elems = s->row_bytes / 4u, rows = len / s->row_bytes, bad = 0, first = len;
    for (uint64_t r0 = 0; r0 < rows; r0 += KVP2_BATCH) {
        uint64_t n = rows - r0 < KVP2_BATCH ? rows - r0 : KVP2_BATCH;
        kvp2_batch(s, seed32, r0, n, pos, keys);
        for (uint64_t k = 0; k < n; k++) {
            const uint8_t *row = src + (r0 + k) * s->row_bytes;
            for (uint64_t b = 0; b < s->row_bytes; b += 64) __builtin_prefetch(row + KVP2_PREFETCH + b);
            kvp2_row_elems(want, row_elems, keys[k], s->block, lkv0, s->gen, pos[k]);
            kvp_u32 acc = 0;
            for (uint64_t i = 0; i < row_elems; i++) acc |= want[i] ^ load32(row + 4 * i);
            if (!acc) continue;
            for (uint64_t i = 0; i < row_elems; i++)
                kvp_cpu_count(want[i], load32(row + 4 * i), (r0 + k) * s->row_bytes + 4 * i, &bad, &first);
        }
    }
    *first_bad = first;
    return bad;
}

/* Checks the tag of the unit starting at byte `off` of `src`, in rows of `row_bytes` (off must
 * be a unit's start: a row's start plus a multiple of 512); on success stores the row and unit
 * it names and returns 1. Valid: element 1's top byte is 0x4C, the unit exists in such a row
 * and the check word (element 4) matches (K/V is 0..3: 3 a region row, whose token | head << 16
 * is its global row). */
int kvp2_cpu_decode_tag(const uint8_t *src, uint64_t len, uint64_t seed, uint64_t off, uint32_t row_bytes,
                        uint32_t *block, uint32_t *layer, uint32_t *kv, uint32_t *unit, uint32_t *gen, uint32_t *token,
                        uint32_t *head) {
    if (off + 20 > len || row_bytes < 32 || row_bytes % 16) return 0;
    kvp_u32 b = load32(src + off), lkvu = load32(src + off + 4), g = load32(src + off + 8), pos = load32(src + off + 12);
    kvp_u32 k = (lkvu >> 16) & 3u, u = (lkvu >> 18) & 0x3Fu, row_elems = row_bytes / 4u;
    if ((lkvu >> 24) != KVP2_MAGIC || u * KVP2_UNIT_ELEMS + 4u >= row_elems) return 0;
    kvp_u32 lkv0 = lkvu & ~(0x3Fu << 18);
    kvp_u32 rkey = kvp2_row_key(kvp_seed32(seed), b, lkv0, g, pos);
    if (load32(src + off + 16) != kvp2_elem(rkey, b, lkv0, g, pos, u * KVP2_UNIT_ELEMS + 4u)) return 0;
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
