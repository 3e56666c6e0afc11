#!/usr/bin/env python3
"""Independent reference of the kvprobe fingerprint (README "Fingerprint format"), for
vendors who receive a report: recompute the expected bytes of any block slice and compare
them with a dump, without kvprobe.

usage: scripts/fingerprint_ref.py SEED LAYER KV BLOCK GENERATION SLICE_BYTES [OUT]
  KV: K, V or latent (or 0, 1, 2). BLOCK and GENERATION are the *logical* block id and
  generation — a failure's `expected.block` / `expected.generation` (or `observed.*`),
  not the slot `block`. Prints the slice's SHA-256 (as in the report's expected_digest);
  writes the bytes to OUT when given. Numbers may be decimal or 0x hex.
"""
import hashlib, struct, sys

M = 0xFFFFFFFF

def fmix32(h):
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M
    h ^= h >> 16
    return h

def seed32(seed):
    return fmix32((seed & M) ^ fmix32(((seed >> 32) & M) ^ 0x6B767062))

def slice_bytes(seed, layer, kv, block, gen, length):
    lkv = (layer & 0xFFFF) | ((kv & 0xFF) << 16) | (0x4B << 24)
    key = fmix32(seed32(seed) ^ fmix32(block ^ fmix32(lkv ^ fmix32(gen ^ 0x9E3779B9))))
    out = []
    for e in range(length // 4):
        w = e % 128
        if w == 0: v = block
        elif w == 1: v = lkv
        elif w == 2: v = gen
        elif w == 3: v = fmix32(key ^ (((e // 128) * 0x85EBCA77) & M))
        else: v = fmix32(key ^ ((e * 0x9E3779B9) & M))
        out.append(v)
    return struct.pack("<%dI" % len(out), *out)

if __name__ == "__main__":
    a = sys.argv[1:]
    if len(a) < 6:
        sys.exit(__doc__)
    kv_names = {"K": "0", "V": "1", "latent": "2"}
    a[2] = kv_names.get(a[2], a[2])
    seed, layer, kv, block, gen, n = (int(x, 0) for x in a[:6])
    b = slice_bytes(seed, layer, kv, block, gen, n)
    if len(a) > 6:
        open(a[6], "wb").write(b)
    print(hashlib.sha256(b).hexdigest())
