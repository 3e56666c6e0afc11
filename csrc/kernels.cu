/*
 * kvprobe CUDA kernels: fill, poison, verify and poison-check the block slices of a range of layers, and
 * rearrange the head rows of received slices (decode's conversion on receive, kvp_permute_rows).
 * Compiled at run time by NVRTC with fingerprint.h prepended (src/core/fingerprint.rs,
 * KERNEL_SOURCE), so the kernels and the CPU reference share one definition.
 *
 * Every kernel but kvp_permute_rows runs over the regions of layers layer0 .. layer0 +
 * num_layers - 1 in one launch (`bases[layer]`: the device address of layer `layer`'s region; one launch per pass, not per
 * layer: the gaps between 32 launches of ~33 us cost verify 4 % on an H200), each region read
 * as uint4 (16-byte) chunks; slice q of a region starts at q * slice_bytes and is global slice
 * layer * num_slices + q. Work items are parts of slices: part p of slice q covers chunks
 * [p * KVP_PART_CHUNKS, (p + 1) * KVP_PART_CHUNKS) (32 KiB), so a region of few large slices
 * (2 MiB with block_size 1024) still spreads over every SM. One thread block (KVP_THREADS
 * threads) handles one part at a time (grid-stride over parts); thread t takes chunks
 * c0 + t + k * KVP_THREADS, k = 0..7, so accesses coalesce and each thread has its eight loads
 * in flight at once (verify: streaming loads, __ldcs, the bytes are read once). Measured on an
 * H200 (bench/NOTES.md, v8): 32 KiB parts and streaming loads took verify from 0.96 to 0.98 of
 * the copy ceiling. `table[block]` = {logical block id, generation, token_base, 0} names what a
 * slot must hold. src/gpu/cuda.rs computes the same part count (PART_CHUNKS) for grids and the
 * failure list.
 *
 * Rows (fingerprint.h, "The rows"): chunk c of a slice is chunk w = c % rc of row r = c / rc,
 * rc = row_bytes / 16. A part's rows' keys and positions are computed once per part into
 * shared memory (at most KVP_PART_CHUNKS / 2 + 1 rows: rows are at least 2 chunks); a thread
 * finds its first chunk's row with one division per part and steps to the next with
 * additions (KVP_THREADS = q_step * rc + w_step).
 */
#ifndef KVP_NVRTC
#include "fingerprint.h"
#endif

/* One failing slice, appended by kvp_verify (layout shared with src/gpu/cuda.rs). */
struct kvp_fail {
    unsigned int slice;     /* global slice index */
    unsigned int bad_bytes; /* bytes that differ from the fingerprint */
    unsigned int first_bad; /* byte offset of the first */
    unsigned int pad;
};

#define KVP_PART_CHUNKS 2048u
#define KVP_THREADS 256u
#define KVP_PER_THREAD (KVP_PART_CHUNKS / KVP_THREADS)
#define KVP_PART_ROWS (KVP_PART_CHUNKS / 2u + 1u)

/* Slots of kvp_verify's compared-work counters: thread block b adds to slot b % KVP_CMP_SLOTS
 * (spreads the atomics over addresses); each slot is {slices, bytes} as two u64, the host
 * sums them (src/gpu/cuda.rs CMP_SLOTS). */
#define KVP_CMP_SLOTS 256u

__device__ __forceinline__ unsigned kvp_parts(unsigned chunks) { return (chunks + KVP_PART_CHUNKS - 1u) / KVP_PART_CHUNKS; }

/* Work item `it` of a launch over num_layers layers of num_slices slices of `parts` parts:
 * its layer, slice q in the layer and first chunk c0. */
__device__ __forceinline__ void kvp_item(unsigned long long it, unsigned layer0, unsigned num_slices, unsigned parts,
                                         unsigned *layer, unsigned *q, unsigned *c0) {
    const unsigned long long per_layer = (unsigned long long)num_slices * parts;
    const unsigned li = (unsigned)(it / per_layer);
    const unsigned long long rest = it - (unsigned long long)li * per_layer;
    *layer = layer0 + li;
    *q = (unsigned)(rest / parts);
    *c0 = (unsigned)(rest % parts) * KVP_PART_CHUNKS;
}

/* How a region's slices are cut into rows (kernel parameters, src/gpu/cuda.rs RegionArgs). */
struct kvp_rows {
    unsigned rc;         /* chunks per row: row_bytes / 16, at least 2 */
    unsigned heads;      /* head positions per slice */
    unsigned block_size; /* token positions per slice */
    unsigned head_base;  /* global head of the first head position */
    unsigned order;      /* KVP2_ORDER_*, equal to the region's KVP_LAYOUT_* */
};

/* The part's row keys and positions in shared memory: rows r0 .. r0 + n - 1 of the slice. */
struct kvp_part_rows {
    unsigned key[KVP_PART_ROWS];
    unsigned pos[KVP_PART_ROWS];
};

/* Fills `pr` with the keys and positions of the rows holding chunks [c0, c1) of a slice
 * holding (blk, lkv0, gen, token_base); returns the first row. Ends with __syncthreads. */
__device__ __forceinline__ unsigned kvp_load_rows(kvp_part_rows *pr, const kvp_rows &R, unsigned seed32, unsigned blk,
                                                  unsigned lkv0, unsigned gen, unsigned token_base, unsigned c0,
                                                  unsigned c1) {
    const unsigned r0 = c0 / R.rc, n = (c1 - 1u) / R.rc - r0 + 1u;
    for (unsigned i = threadIdx.x; i < n; i += blockDim.x) {
        const unsigned pos = kvp2_row_pos(R.order, R.block_size, R.heads, token_base, R.head_base, r0 + i);
        pr->pos[i] = pos;
        pr->key[i] = kvp2_row_key(seed32, blk, lkv0, gen, pos);
    }
    __syncthreads();
    return r0;
}

/* Chunk w (group w: elements 4w .. 4w+3) of a row with key `key` and position `pos`, as
 * kvp2_elem computes them: the unit's tag when w is a unit's first chunk, else the group's
 * hash times M (its first element the unit's check word when w is the unit's second chunk).
 * Every lane computes the hash and the tag is a select, so lanes of a warp do not diverge. */
__device__ __forceinline__ uint4 kvp2_chunk(unsigned key, unsigned pos, unsigned blk, unsigned lkv0, unsigned gen,
                                            unsigned w) {
    const unsigned wu = w & 31u, u = w >> 5;
    const unsigned h = kvp2_group(key, w);
    uint4 v;
    v.x = h;
    v.y = h * KVP2_M1;
    v.z = h * KVP2_M2;
    v.w = h * KVP2_M3;
    if (wu == 0u) {
        v.x = blk;
        v.y = lkv0 | ((u & 0x3Fu) << 18);
        v.z = gen;
        v.w = pos;
    }
    return v;
}

extern "C" __global__ void __launch_bounds__(KVP_THREADS)
kvp_fill(const unsigned long long *bases, unsigned layer0, unsigned num_layers, unsigned slice_bytes, unsigned layout,
         unsigned num_blocks, unsigned seed32, const uint4 *table, unsigned num_slices, kvp_rows R) {
    __shared__ kvp_part_rows pr;
    const unsigned chunks = slice_bytes / 16u, parts = kvp_parts(chunks);
    const unsigned q_step = KVP_THREADS / R.rc, w_step = KVP_THREADS - q_step * R.rc;
    const unsigned long long items = (unsigned long long)num_layers * num_slices * parts;
    for (unsigned long long it = blockIdx.x; it < items; it += gridDim.x) {
        unsigned layer, q, c0;
        kvp_item(it, layer0, num_slices, parts, &layer, &q, &c0);
        const unsigned c1 = min(c0 + KVP_PART_CHUNKS, chunks);
        unsigned blk, kv;
        kvp_slice_coords(layout, num_blocks, q, &blk, &kv);
        const uint4 ent = table[blk];
        if (ent.y == KVP_SKIP_GEN) continue; /* uniform across the block */
        const unsigned lkv0 = kvp2_lkvu(layer, kv, 0u);
        __syncthreads(); /* the previous part's rows are no longer read */
        const unsigned r0 = kvp_load_rows(&pr, R, seed32, ent.x, lkv0, ent.y, ent.z, c0, c1);
        uint4 *s = (uint4 *)bases[layer] + (size_t)q * chunks;
        unsigned c = c0 + threadIdx.x, r = c / R.rc, w = c - r * R.rc;
#pragma unroll
        for (unsigned k = 0; k < KVP_PER_THREAD; k++) {
            if (c < c1) s[c] = kvp2_chunk(pr.key[r - r0], pr.pos[r - r0], ent.x, lkv0, ent.y, w);
            c += KVP_THREADS;
            r += q_step;
            w += w_step;
            if (w >= R.rc) { w -= R.rc; r++; }
        }
    }
}

/* Poisons every slice of the layers, or, when `table` is not null, only the slices of blocks
 * whose table entry is not KVP_SKIP_GEN. */
extern "C" __global__ void kvp_poison(const unsigned long long *bases, unsigned layer0, unsigned num_layers,
                                      unsigned slice_bytes, unsigned layout, unsigned num_blocks, unsigned num_slices,
                                      unsigned iteration, const uint4 *table) {
    const unsigned chunks = slice_bytes / 16u, parts = kvp_parts(chunks);
    const unsigned long long items = (unsigned long long)num_layers * num_slices * parts;
    for (unsigned long long it = blockIdx.x; it < items; it += gridDim.x) {
        unsigned layer, q, c0;
        kvp_item(it, layer0, num_slices, parts, &layer, &q, &c0);
        const unsigned c1 = min(c0 + KVP_PART_CHUNKS, chunks);
        if (table) {
            unsigned blk, kv;
            kvp_slice_coords(layout, num_blocks, q, &blk, &kv);
            if (table[blk].y == KVP_SKIP_GEN) continue;
        }
        const unsigned slot = layer * num_slices + q;
        uint4 v;
        v.x = kvp_poison_elem(slot, iteration, 0u);
        v.y = kvp_poison_elem(slot, iteration, 1u);
        v.z = v.x;
        v.w = v.y;
        uint4 *s = (uint4 *)bases[layer] + (size_t)q * chunks;
        for (unsigned c = c0 + threadIdx.x; c < c1; c += blockDim.x) s[c] = v;
    }
}

__device__ __forceinline__ void kvp_cmp(unsigned want, unsigned got, unsigned off, unsigned *bad, unsigned *first) {
    const unsigned x = want ^ got;
    if (x) {
        *bad += kvp_diff_bytes(want, got);
        const unsigned at = off + (unsigned)(__ffs(x) - 1) / 8u;
        if (at < *first) *first = at;
    }
}

/* kvp_cmp over the four elements of chunk `got` at byte offset `off`. */
__device__ __forceinline__ void kvp_cmp4(uint4 want, uint4 got, unsigned off, unsigned *bad, unsigned *first) {
    kvp_cmp(want.x, got.x, off, bad, first);
    kvp_cmp(want.y, got.y, off + 4u, bad, first);
    kvp_cmp(want.z, got.z, off + 8u, bad, first);
    kvp_cmp(want.w, got.w, off + 12u, bad, first);
}

/* Appends one failure record (a failing part of `slice`): counted always, written only below
 * `cap` (the host treats a count above it as an error). Returns the record's index. */
__device__ __forceinline__ unsigned kvp_append_fail(kvp_fail *fails, unsigned *count, unsigned cap, unsigned slice,
                                                    unsigned bad, unsigned first) {
    const unsigned i = atomicAdd(count, 1u);
    kvp_fail f;
    f.slice = slice;
    f.bad_bytes = bad;
    f.first_bad = first;
    f.pad = 0u;
    if (i < cap) fails[i] = f;
    return i;
}

/* Verifies every part; a failing part appends one kvp_fail (its slice, its bad bytes, its
 * first bad byte within the slice) — the host merges the parts of a slice. The fast path
 * only ORs the differences; a part that differs is counted again byte by byte. `fails` holds
 * `fail_cap` records: a record past it is not written, but `fail_count` still counts it, so
 * the host sees the overflow (src/mem/pool.rs treats `*fail_count > fail_cap` as a device error).
 * What was compared is counted as it is compared, not derived from the geometry: each thread
 * block counts the 16-byte chunks of every part its loop compared (the loop's bounds), and a
 * slice once when its part 0 was compared; at the end the block adds its sums (two global
 * atomics) to `compared[2 * (b % KVP_CMP_SLOTS)]` (slices) and `[... + 1]` (bytes).
 * The bytes a failing part was judged on (its loads, not a second read of the slice) are
 * copied to `capture`: record i's part to chunks [i * KVP_PART_CHUNKS, i * KVP_PART_CHUNKS +
 * c1 - c0) when i < `capture_cap` (in parts); past it nothing is captured (the host reads the
 * slice again, and says so). */
extern "C" __global__ void __launch_bounds__(KVP_THREADS)
kvp_verify(const unsigned long long *bases, unsigned layer0, unsigned num_layers, unsigned slice_bytes, unsigned layout,
           unsigned num_blocks, unsigned seed32, const uint4 *table, unsigned num_slices, kvp_fail *fails,
           unsigned *fail_count, unsigned fail_cap, unsigned long long *compared, kvp_rows R, uint4 *capture,
           unsigned capture_cap) {
    __shared__ kvp_part_rows pr;
    __shared__ unsigned s_bad, s_first, s_slot;
    /* Thread 0 only; 32-bit (a block covers far fewer than 2^32 chunks): 64-bit counters cost
     * registers, occupancy and so a tenth of the kernel's bandwidth on the H200. */
    unsigned my_chunks = 0u, my_slices = 0u;
    const unsigned chunks = slice_bytes / 16u, parts = kvp_parts(chunks);
    const unsigned q_step = KVP_THREADS / R.rc, w_step = KVP_THREADS - q_step * R.rc;
    const unsigned long long items = (unsigned long long)num_layers * num_slices * parts;
    for (unsigned long long it = blockIdx.x; it < items; it += gridDim.x) {
        unsigned layer, q, c0;
        kvp_item(it, layer0, num_slices, parts, &layer, &q, &c0);
        const unsigned c1 = min(c0 + KVP_PART_CHUNKS, chunks);
        unsigned blk, kv;
        kvp_slice_coords(layout, num_blocks, q, &blk, &kv);
        const uint4 ent = table[blk];
        if (ent.y == KVP_SKIP_GEN) continue; /* uniform across the block */
        const unsigned lkv0 = kvp2_lkvu(layer, kv, 0u);
        const uint4 *s = (const uint4 *)bases[layer] + (size_t)q * chunks;
        /* The loads first (all four in flight), then the rows' keys, then the compare. */
        uint4 got[KVP_PER_THREAD];
#pragma unroll
        for (unsigned k = 0; k < KVP_PER_THREAD; k++) {
            const unsigned c = c0 + threadIdx.x + k * KVP_THREADS;
            if (c < c1) got[k] = __ldcs(s + c);
        }
        __syncthreads(); /* the previous part's rows are no longer read */
        const unsigned r0 = kvp_load_rows(&pr, R, seed32, ent.x, lkv0, ent.y, ent.z, c0, c1);
        unsigned acc = 0u;
        {
            unsigned c = c0 + threadIdx.x, r = c / R.rc, w = c - r * R.rc;
#pragma unroll
            for (unsigned k = 0; k < KVP_PER_THREAD; k++) {
                if (c < c1) {
                    const uint4 want = kvp2_chunk(pr.key[r - r0], pr.pos[r - r0], ent.x, lkv0, ent.y, w);
                    acc |= (got[k].x ^ want.x) | (got[k].y ^ want.y) | (got[k].z ^ want.z) | (got[k].w ^ want.w);
                }
                c += KVP_THREADS;
                r += q_step;
                w += w_step;
                if (w >= R.rc) { w -= R.rc; r++; }
            }
        }
        /* The block's threads together compared c1 - c0 chunks; thread 0 keeps the block's
         * count. (A counter inside the loop and a per-block reduction cost the kernel a third
         * of its bandwidth on the H200: the grid has about one thread block per part.) */
        if (threadIdx.x == 0) {
            my_chunks += c1 - c0;
            if (c0 == 0u) my_slices++;
        }
        if (!__syncthreads_or(acc != 0u)) continue; /* the part is intact (uniform) */
        if (threadIdx.x == 0) { s_bad = 0u; s_first = 0xFFFFFFFFu; }
        __syncthreads();
        unsigned bad = 0u, first = 0xFFFFFFFFu;
        {
            unsigned c = c0 + threadIdx.x, r = c / R.rc, w = c - r * R.rc;
#pragma unroll
            for (unsigned k = 0; k < KVP_PER_THREAD; k++) {
                if (c < c1) {
                    const uint4 want = kvp2_chunk(pr.key[r - r0], pr.pos[r - r0], ent.x, lkv0, ent.y, w);
                    kvp_cmp4(want, got[k], c * 16u, &bad, &first);
                }
                c += KVP_THREADS;
                r += q_step;
                w += w_step;
                if (w >= R.rc) { w -= R.rc; r++; }
            }
        }
        if (bad) { atomicAdd(&s_bad, bad); atomicMin(&s_first, first); }
        __syncthreads();
        if (threadIdx.x == 0)
            s_slot = s_bad ? kvp_append_fail(fails, fail_count, fail_cap, layer * num_slices + q, s_bad, s_first)
                           : 0xFFFFFFFFu;
        __syncthreads();
        if (s_slot < capture_cap) { /* uniform: s_slot is shared */
            uint4 *dst = capture + (size_t)s_slot * KVP_PART_CHUNKS;
#pragma unroll
            for (unsigned k = 0; k < KVP_PER_THREAD; k++) {
                const unsigned c = c0 + threadIdx.x + k * KVP_THREADS;
                if (c < c1) dst[c - c0] = got[k];
            }
        }
        __syncthreads(); /* s_slot is read before the next part's thread 0 writes it */
    }
    if (threadIdx.x == 0) {
        unsigned long long *slot = compared + 2u * (blockIdx.x % KVP_CMP_SLOTS);
        if (my_slices) atomicAdd(slot, (unsigned long long)my_slices);
        if (my_chunks) atomicAdd(slot + 1, (unsigned long long)my_chunks * 16ull);
    }
}

/* Checks that every slice of the layers still holds the poison of (slot, iteration)
 * (kvp_poison_elem; slot = layer * num_slices + q): the sweep's stray-write check, run on a stage
 * right before it is posted again. Kept apart from kvp_verify so the hot verify kernel's
 * registers and bandwidth are untouched. Failing parts are appended to `fails` exactly as
 * kvp_verify appends them ({slice, bad bytes, first bad byte, 0}; past `fail_cap` counted in
 * `*fail_count` but not written). Each thread block counts the slices whose part 0 it
 * checked and adds the sum to `*checked` (one global atomic per block). */
extern "C" __global__ void kvp_check_poison(const unsigned long long *bases, unsigned layer0, unsigned num_layers,
                                            unsigned slice_bytes, unsigned num_slices, unsigned iteration,
                                            kvp_fail *fails, unsigned *fail_count, unsigned fail_cap,
                                            unsigned long long *checked) {
    __shared__ unsigned s_bad, s_first;
    unsigned my_slices = 0u;
    const unsigned chunks = slice_bytes / 16u, parts = kvp_parts(chunks);
    const unsigned long long items = (unsigned long long)num_layers * num_slices * parts;
    for (unsigned long long w = blockIdx.x; w < items; w += gridDim.x) {
        unsigned layer, q, c0;
        kvp_item(w, layer0, num_slices, parts, &layer, &q, &c0);
        const unsigned c1 = min(c0 + KVP_PART_CHUNKS, chunks);
        const unsigned slot = layer * num_slices + q;
        /* Chunk c holds elements 4c (even) .. 4c + 3: even, odd, even, odd. */
        uint4 want;
        want.x = kvp_poison_elem(slot, iteration, 0u);
        want.y = kvp_poison_elem(slot, iteration, 1u);
        want.z = want.x;
        want.w = want.y;
        const uint4 *s = (const uint4 *)bases[layer] + (size_t)q * chunks;
        unsigned acc = 0u;
        for (unsigned c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
            const uint4 got = s[c];
            acc |= (got.x ^ want.x) | (got.y ^ want.y) | (got.z ^ want.z) | (got.w ^ want.w);
        }
        if (threadIdx.x == 0 && c0 == 0u) my_slices++;
        if (!__syncthreads_or(acc != 0u)) continue; /* the part still holds its poison (uniform) */
        if (threadIdx.x == 0) { s_bad = 0u; s_first = 0xFFFFFFFFu; }
        __syncthreads();
        unsigned bad = 0u, first = 0xFFFFFFFFu;
        for (unsigned c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
            const uint4 got = s[c];
            const unsigned off = c * 16u;
            kvp_cmp4(want, got, off, &bad, &first);
        }
        if (bad) { atomicAdd(&s_bad, bad); atomicMin(&s_first, first); }
        __syncthreads();
        if (threadIdx.x == 0 && s_bad) kvp_append_fail(fails, fail_count, fail_cap, slot, s_bad, s_first);
        __syncthreads();
    }
    if (threadIdx.x == 0 && my_slices) atomicAdd(checked, (unsigned long long)my_slices);
}

/* Decode's conversion on receive (src/drive/run.rs, src/pairing Sides::row_permutation): writes into
 * `dst` the `num_slices` consecutive slices that start at `src` (one layer region's), each with
 * its head rows rearranged: chunk w of row r comes from chunk w of row perm[r] of the same slice
 * (`row_chunks` 16-byte chunks per row, `slice_chunks` per slice). Poison needs no care: a
 * slice's poison is the same in every 16-byte chunk, so rows that hold it still do. */
extern "C" __global__ void kvp_permute_rows(const uint4 *src, uint4 *dst, unsigned num_slices, unsigned slice_chunks,
                                            unsigned row_chunks, const unsigned *perm) {
    const unsigned long long n = (unsigned long long)num_slices * slice_chunks;
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const unsigned long long s = i / slice_chunks;
        const unsigned c = (unsigned)(i - s * slice_chunks);
        const unsigned r = c / row_chunks, w = c - r * row_chunks;
        dst[i] = src[s * slice_chunks + (unsigned long long)perm[r] * row_chunks + w];
    }
}
