/*
 * kvprobe CUDA kernels: fill, poison, verify and poison-check block slices of one layer's region.
 * Compiled at run time by NVRTC with fingerprint.h prepended (src/fingerprint.rs,
 * KERNEL_SOURCE), so the kernels and the CPU reference share one definition.
 *
 * Every kernel takes one layer's region as uint4 (16-byte) chunks; slice q of the region
 * starts at q * slice_bytes. Work items are parts of slices: part p of slice q covers chunks
 * [p * KVP_PART_CHUNKS, (p + 1) * KVP_PART_CHUNKS) (16 KiB), so a region of few large slices
 * (2 MiB with block_size 1024) still spreads over every SM. One thread block handles one
 * part at a time (grid-stride over parts); threads stride over its chunks, so accesses
 * coalesce. `table[block]` = {logical block id, generation} names what a slot must hold.
 * src/cuda.rs computes the same part count (PART_CHUNKS) for grids and the failure list.
 */
#ifndef KVP_NVRTC
#include "fingerprint.h"
#endif

/* One failing slice, appended by kvp_verify (layout shared with src/cuda.rs). */
struct kvp_fail {
    unsigned int slice;     /* global slice index */
    unsigned int bad_bytes; /* bytes that differ from the fingerprint */
    unsigned int first_bad; /* byte offset of the first */
    unsigned int pad;
};

#define KVP_PART_CHUNKS 1024u

/* Slots of kvp_verify's compared-work counters: thread block b adds to slot b % KVP_CMP_SLOTS
 * (spreads the atomics over addresses); each slot is {slices, bytes} as two u64, the host
 * sums them (src/cuda.rs CMP_SLOTS). */
#define KVP_CMP_SLOTS 256u

__device__ __forceinline__ unsigned kvp_parts(unsigned chunks) { return (chunks + KVP_PART_CHUNKS - 1u) / KVP_PART_CHUNKS; }

/* Chunk c (elements 4c .. 4c+3) of a slice: the sector's tag when c is a sector's first
 * chunk, else four body elements (kvp_elem, without its per-element branch). */
__device__ __forceinline__ uint4 kvp_chunk(unsigned key, unsigned blk, unsigned lkv, unsigned gen, unsigned c) {
    const unsigned e = c * 4u;
    uint4 v;
    if ((e & (KVP_SECTOR_ELEMS - 1u)) == 0u) {
        v.x = blk;
        v.y = lkv;
        v.z = gen;
        v.w = kvp_tag_check(key, e / KVP_SECTOR_ELEMS);
    } else {
        v.x = kvp_body(key, e);
        v.y = kvp_body(key, e + 1u);
        v.z = kvp_body(key, e + 2u);
        v.w = kvp_body(key, e + 3u);
    }
    return v;
}

extern "C" __global__ void kvp_fill(uint4 *region, unsigned slice_bytes, unsigned layout,
                                    unsigned num_blocks, unsigned layer, unsigned seed32,
                                    const uint2 *table, unsigned num_slices) {
    const unsigned chunks = slice_bytes / 16u, parts = kvp_parts(chunks);
    const unsigned long long items = (unsigned long long)num_slices * parts;
    for (unsigned long long w = blockIdx.x; w < items; w += gridDim.x) {
        const unsigned q = (unsigned)(w / parts), c0 = (unsigned)(w % parts) * KVP_PART_CHUNKS;
        const unsigned c1 = min(c0 + KVP_PART_CHUNKS, chunks);
        unsigned blk, kv;
        kvp_slice_coords(layout, num_blocks, q, &blk, &kv);
        const uint2 ent = table[blk];
        if (ent.y == KVP_SKIP_GEN) continue;
        const unsigned lkv = kvp_layer_kv(layer, kv);
        const unsigned key = kvp_slice_key(seed32, ent.x, lkv, ent.y);
        uint4 *s = region + (size_t)q * chunks;
        for (unsigned c = c0 + threadIdx.x; c < c1; c += blockDim.x) s[c] = kvp_chunk(key, ent.x, lkv, ent.y, c);
    }
}

/* Poisons every slice of a region, or, when `table` is not null, only the slices of blocks
 * whose table entry is not KVP_SKIP_GEN. */
extern "C" __global__ void kvp_poison(uint4 *region, unsigned slice_bytes, unsigned layout,
                                      unsigned num_blocks, unsigned num_slices,
                                      unsigned slice_base, unsigned iteration, const uint2 *table) {
    const unsigned chunks = slice_bytes / 16u, parts = kvp_parts(chunks);
    const unsigned long long items = (unsigned long long)num_slices * parts;
    for (unsigned long long w = blockIdx.x; w < items; w += gridDim.x) {
        const unsigned q = (unsigned)(w / parts), c0 = (unsigned)(w % parts) * KVP_PART_CHUNKS;
        const unsigned c1 = min(c0 + KVP_PART_CHUNKS, chunks);
        if (table) {
            unsigned blk, kv;
            kvp_slice_coords(layout, num_blocks, q, &blk, &kv);
            if (table[blk].y == KVP_SKIP_GEN) continue;
        }
        const unsigned slot = slice_base + q;
        uint4 v;
        v.x = kvp_poison_elem(slot, iteration, 0u);
        v.y = kvp_poison_elem(slot, iteration, 1u);
        v.z = v.x;
        v.w = v.y;
        uint4 *s = region + (size_t)q * chunks;
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
 * `cap` (the host treats a count above it as an error). */
__device__ __forceinline__ void kvp_append_fail(kvp_fail *fails, unsigned *count, unsigned cap, unsigned slice,
                                                unsigned bad, unsigned first) {
    const unsigned i = atomicAdd(count, 1u);
    kvp_fail f;
    f.slice = slice;
    f.bad_bytes = bad;
    f.first_bad = first;
    f.pad = 0u;
    if (i < cap) fails[i] = f;
}

/* Verifies every part; a failing part appends one kvp_fail (its slice, its bad bytes, its
 * first bad byte within the slice) — the host merges the parts of a slice. The fast path
 * only ORs the differences; a part that differs is counted again byte by byte. `fails` holds
 * `fail_cap` records: a record past it is not written, but `fail_count` still counts it, so
 * the host sees the overflow (src/pool.rs treats `*fail_count > fail_cap` as a device error). *
 * What was compared is counted as it is compared, not derived from the geometry: each thread
 * block counts the 16-byte chunks of every part its loop compared (the loop's bounds), and a
 * slice once when its part 0 was compared; at the end the block adds its sums (two global
 * atomics) to `compared[2 * (b % KVP_CMP_SLOTS)]` (slices) and `[... + 1]` (bytes). */
extern "C" __global__ void kvp_verify(const uint4 *region, unsigned slice_bytes, unsigned layout,
                                      unsigned num_blocks, unsigned layer, unsigned seed32,
                                      const uint2 *table, unsigned num_slices, unsigned slice_base,
                                      kvp_fail *fails, unsigned *fail_count, unsigned fail_cap,
                                      unsigned long long *compared) {
    __shared__ unsigned s_bad, s_first;
    /* Thread 0 only; 32-bit (a block covers far fewer than 2^32 chunks): 64-bit counters cost
     * registers, occupancy and so a tenth of the kernel's bandwidth on the H200. */
    unsigned my_chunks = 0u, my_slices = 0u;
    const unsigned chunks = slice_bytes / 16u, parts = kvp_parts(chunks);
    const unsigned long long items = (unsigned long long)num_slices * parts;
    for (unsigned long long w = blockIdx.x; w < items; w += gridDim.x) {
        const unsigned q = (unsigned)(w / parts), c0 = (unsigned)(w % parts) * KVP_PART_CHUNKS;
        const unsigned c1 = min(c0 + KVP_PART_CHUNKS, chunks);
        unsigned blk, kv;
        kvp_slice_coords(layout, num_blocks, q, &blk, &kv);
        const uint2 ent = table[blk];
        if (ent.y == KVP_SKIP_GEN) continue; /* uniform across the block */
        const unsigned lkv = kvp_layer_kv(layer, kv);
        const unsigned key = kvp_slice_key(seed32, ent.x, lkv, ent.y);
        const uint4 *s = region + (size_t)q * chunks;
        unsigned acc = 0u;
        const unsigned c_start = c0 + threadIdx.x;
        for (unsigned c = c_start; c < c1; c += blockDim.x) {
            const uint4 got = s[c];
            const uint4 want = kvp_chunk(key, ent.x, lkv, ent.y, c);
            acc |= (got.x ^ want.x) | (got.y ^ want.y) | (got.z ^ want.z) | (got.w ^ want.w);
        }
        /* The block's threads together made c1 - c0 iterations of the loop above (thread t:
         * those from c0 + t in steps of blockDim.x); thread 0 keeps the block's count. (A
         * counter inside the loop and a per-block reduction cost the kernel a third of its
         * bandwidth on the H200: the grid has about one thread block per part.) */
        if (threadIdx.x == 0) {
            my_chunks += c1 - c0;
            if (c0 == 0u) my_slices++;
        }
        if (!__syncthreads_or(acc != 0u)) continue; /* the part is intact (uniform) */
        if (threadIdx.x == 0) { s_bad = 0u; s_first = 0xFFFFFFFFu; }
        __syncthreads();
        unsigned bad = 0u, first = 0xFFFFFFFFu;
        for (unsigned c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
            const uint4 got = s[c];
            const uint4 want = kvp_chunk(key, ent.x, lkv, ent.y, c);
            const unsigned off = c * 16u;
            kvp_cmp4(want, got, off, &bad, &first);
        }
        if (bad) { atomicAdd(&s_bad, bad); atomicMin(&s_first, first); }
        __syncthreads();
        if (threadIdx.x == 0 && s_bad) kvp_append_fail(fails, fail_count, fail_cap, slice_base + q, s_bad, s_first);
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        unsigned long long *slot = compared + 2u * (blockIdx.x % KVP_CMP_SLOTS);
        if (my_slices) atomicAdd(slot, (unsigned long long)my_slices);
        if (my_chunks) atomicAdd(slot + 1, (unsigned long long)my_chunks * 16ull);
    }
}

/* Checks that every slice of a region still holds the poison of (slot, iteration)
 * (kvp_poison_elem; slot = slice_base + q): the sweep's stray-write check, run on a stage
 * right before it is posted again. Kept apart from kvp_verify so the hot verify kernel's
 * registers and bandwidth are untouched. Failing parts are appended to `fails` exactly as
 * kvp_verify appends them ({slice, bad bytes, first bad byte, 0}; past `fail_cap` counted in
 * `*fail_count` but not written). Each thread block counts the slices whose part 0 it
 * checked and adds the sum to `*checked` (one global atomic per block). */
extern "C" __global__ void kvp_check_poison(const uint4 *region, unsigned slice_bytes, unsigned num_slices,
                                            unsigned slice_base, unsigned iteration, kvp_fail *fails,
                                            unsigned *fail_count, unsigned fail_cap,
                                            unsigned long long *checked) {
    __shared__ unsigned s_bad, s_first;
    unsigned my_slices = 0u;
    const unsigned chunks = slice_bytes / 16u, parts = kvp_parts(chunks);
    const unsigned long long items = (unsigned long long)num_slices * parts;
    for (unsigned long long w = blockIdx.x; w < items; w += gridDim.x) {
        const unsigned q = (unsigned)(w / parts), c0 = (unsigned)(w % parts) * KVP_PART_CHUNKS;
        const unsigned c1 = min(c0 + KVP_PART_CHUNKS, chunks);
        const unsigned slot = slice_base + q;
        /* Chunk c holds elements 4c (even) .. 4c + 3: even, odd, even, odd. */
        uint4 want;
        want.x = kvp_poison_elem(slot, iteration, 0u);
        want.y = kvp_poison_elem(slot, iteration, 1u);
        want.z = want.x;
        want.w = want.y;
        const uint4 *s = region + (size_t)q * chunks;
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
