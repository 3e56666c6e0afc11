#!/usr/bin/env python3
"""Independent reference of the kvprobe fingerprint (kvprobe.fingerprint/2) and poison (docs/fingerprint.md
"Fingerprint format"), for vendors who receive a report: recompute the expected bytes of any
block slice, or the poison of any slot, and compare them with a dump, without kvprobe.

usage: scripts/fingerprint_ref.py SEED LAYER KV BLOCK GENERATION ORDER BLOCK_SIZE HEADS ROW_BYTES TOKEN_BASE HEAD_BASE [OUT]
       scripts/fingerprint_ref.py poison SLOT ITERATION SLICE_BYTES [OUT]
       scripts/fingerprint_ref.py slot LAYOUT NUM_LAYERS NUM_BLOCKS LAYER KV BLOCK

  The first form prints the SHA-256 of a slice's fingerprint (a failure's expected_digest):
  BLOCK_SIZE x HEADS head rows of ROW_BYTES (head_size x dtype bytes) in ORDER nhd
  ([token][head]), hnd ([head][token]) or mla ([token], HEADS 1), naming tokens TOKEN_BASE..
  and global heads HEAD_BASE.. . ORDER rows (KV region, HEADS 1, HEAD_BASE 0) is a run of
  BLOCK_SIZE region rows of a hybrid model's state or indexer (docs/fingerprint.md "Region
  rows"), naming global rows TOKEN_BASE.. (32-bit), LAYER being layer | part << 12. BLOCK, GENERATION and TOKEN_BASE are the *logical* block's
  (a failure's `expected.block`, `expected.generation`, `expected.token_base` or 0, or
  `observed.*`), not the slot `block`; ORDER, BLOCK_SIZE, HEADS and ROW_BYTES follow the
  decode side's geometry, the report's config.decode_geometry when present, else
  config.geometry (mla when mla is true, else layout; block_size; num_kv_heads, or 1 with
  mla; head_size x dtype bytes: bf16 and fp16 2, fp32 4, fp8 1), and HEAD_BASE is the first
  KV head of the failure's decode TP rank (0 without one; docs/fingerprint.md "Fingerprint format" gives
  the recipe). A dump's `regenerate` commands spell them out.
  `poison` prints the SHA-256 of the poison of global slice index SLOT in ITERATION (an
  `unwritten` slice's actual_digest). `slot` prints the global slice index of a decode slot
  (a failure's layer, kv and block) in a pool of LAYOUT nhd, hnd or mla.
  OUT, when given, receives the bytes ("-": standard output, and the digest goes to
  standard error).

  SEED: 0 to 2^64-1.  LAYER: 0 to 65535.  KV: K, V, latent or region (or 0, 1, 2, 3; latent
  only with mla, region only with rows, K and V only with nhd and hnd).  BLOCK, GENERATION, ITERATION: 0 to 2^32-1.  SLOT: 0 to 2^32-2.
  SLICE_BYTES: a multiple of 16 from 16 to 2^31 (the decode geometry's slice_bytes).
  ROW_BYTES: a multiple of 16 from 32 to 32768, not 16 more than a multiple of 512.
  BLOCK_SIZE, HEADS: from 1; TOKEN_BASE + BLOCK_SIZE and HEAD_BASE + HEADS at most 65536 (rows:
  TOKEN_BASE + BLOCK_SIZE at most 2^32); the
  slice at most 2^31 bytes. ORDER mla goes with KV latent, HEADS 1 and HEAD_BASE 0 (one
  latent row per token, head 0).
  NUM_LAYERS: 1 to 65535.  NUM_BLOCKS: 1 to 2^32-1.  Numbers are decimal (leading zeros
  allowed) or 0x hex, at most 40 digits.
  Bad arguments: this text and exit status 2. OUT (or standard output) that cannot be
  written, or too little memory for the slice: a one-line error and exit status 1.
"""
import array, hashlib, re, sys

M = 0xFFFFFFFF
MULT = (1, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F)
MAX_SLICE_BYTES = 1 << 31


def fmix32(h):
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M
    h ^= h >> 16
    return h


def seed32(seed):
    return fmix32((seed & M) ^ fmix32(((seed >> 32) & M) ^ 0x6B767062))


def le_bytes(a):
    """The little-endian bytes of an array of uint32 (4 bytes per element, not a list of ints)."""
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def slice_rows(seed, layer, kv, block, gen, order, block_size, heads, row_bytes, token_base, head_base):
    s32 = seed32(seed)
    lkv0 = (layer & 0xFFFF) | ((kv & 3) << 16) | (0x4C << 24)
    row_elems = row_bytes // 4
    out = array.array("I")
    for r in range(block_size * heads):
        if order == "nhd": t, h = r // heads, r % heads
        elif order == "hnd": t, h = r % block_size, r // block_size
        else: t, h = r, 0
        if order == "rows": pos = (token_base + r) & M  # a region row: its global row
        else: pos = ((token_base + t) & 0xFFFF) | (((head_base + h) & 0xFFFF) << 16)
        rkey = fmix32(s32 ^ fmix32(block ^ fmix32(lkv0 ^ fmix32(pos ^ fmix32(gen ^ 0x9E3779B9)))))
        for i in range(row_elems):
            u, w = i // 128, i % 128
            if w == 0: v = block
            elif w == 1: v = lkv0 | ((u & 0x3F) << 18)
            elif w == 2: v = gen
            elif w == 3: v = pos
            else: v = (fmix32(rkey ^ (((i // 4) * 0x9E3779B9) & M)) * MULT[i % 4]) & M
            out.append(v)
    return le_bytes(out)


def poison_bytes(slot, iteration, length):
    even, odd = slot & M, 0x5A000000 | (iteration & 0xFFFFFF)
    return le_bytes(array.array("I", [even, odd]) * (length // 8) + array.array("I", [even] * ((length // 4) % 2)))


def global_slot(layout, num_layers, num_blocks, layer, kv, block):
    parts = 1 if layout == "mla" else 2
    if layout == "nhd": q = kv * num_blocks + block
    elif layout == "hnd": q = block * 2 + kv
    else: q = block
    return layer * parts * num_blocks + q


class Usage(Exception):
    pass


def number(name, text, lo, hi):
    if not re.fullmatch(r"[0-9]{1,40}|0[xX][0-9a-fA-F]{1,40}", text):
        raise Usage("%s must be a non-negative decimal or 0x hex integer (at most 40 digits), not %r" % (name, text))
    v = int(text, 16) if text[:2] in ("0x", "0X") else int(text, 10)
    if not lo <= v <= hi:
        raise Usage("%s must be from %d to %d, not %d" % (name, lo, hi, v))
    return v


def length(text):
    n = number("SLICE_BYTES", text, 16, MAX_SLICE_BYTES)
    if n % 16:
        raise Usage("SLICE_BYTES must be a multiple of 16 (a block slice always is), not %d" % n)
    return n


def kv_code(text, allowed=(0, 1, 2)):
    names = {"K": 0, "V": 1, "latent": 2, "region": 3, "0": 0, "1": 1, "2": 2, "3": 3}
    if text not in names or names[text] not in allowed:
        ok = ", ".join(n for n, c in names.items() if c in allowed and not n.isdigit())
        raise Usage("KV must be one of %s (or its code), not %r" % (ok, text))
    return names[text]


def main(a):
    if a and a[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if not a:
        raise Usage("no arguments")
    if a[0] == "poison":
        if len(a) not in (4, 5):
            raise Usage("poison takes SLOT ITERATION SLICE_BYTES [OUT]")
        slot = number("SLOT", a[1], 0, M - 1)
        it = number("ITERATION", a[2], 0, M)
        b, out = poison_bytes(slot, it, length(a[3])), a[4:]
    elif a[0] == "slot":
        if len(a) != 7:
            raise Usage("slot takes LAYOUT NUM_LAYERS NUM_BLOCKS LAYER KV BLOCK")
        layout = a[1].lower()
        if layout not in ("nhd", "hnd", "mla"):
            raise Usage("LAYOUT must be nhd, hnd or mla, not %r" % a[1])
        layers = number("NUM_LAYERS", a[2], 1, 0xFFFF)
        blocks = number("NUM_BLOCKS", a[3], 1, M)
        layer = number("LAYER", a[4], 0, layers - 1)
        kv = kv_code(a[5], (2,) if layout == "mla" else (0, 1))
        block = number("BLOCK", a[6], 0, blocks - 1)
        s = global_slot(layout, layers, blocks, layer, kv, block)
        if layers * (1 if layout == "mla" else 2) * blocks > M:
            raise Usage("the pool has more than 2^32-1 slices (kvprobe refuses that geometry)")
        write_all(stdout_bytes(), ("%d\n" % s).encode())
        return 0
    else:
        if len(a) not in (11, 12):
            raise Usage("expected SEED LAYER KV BLOCK GENERATION ORDER BLOCK_SIZE HEADS ROW_BYTES TOKEN_BASE HEAD_BASE [OUT]")
        seed = number("SEED", a[0], 0, (1 << 64) - 1)
        layer = number("LAYER", a[1], 0, 0xFFFF)
        order = a[5].lower()
        if order not in ("nhd", "hnd", "mla", "rows"):
            raise Usage("ORDER must be nhd, hnd, mla or rows, not %r" % a[5])
        kv = kv_code(a[2], (2,) if order == "mla" else (3,) if order == "rows" else (0, 1))
        block = number("BLOCK", a[3], 0, M)
        gen = number("GENERATION", a[4], 0, M)
        block_size = number("BLOCK_SIZE", a[6], 1, M if order == "rows" else 1 << 16)
        heads = number("HEADS", a[7], 1, 1 if order in ("mla", "rows") else 1 << 16)
        row_bytes = number("ROW_BYTES", a[8], 32, 32768)
        if row_bytes % 16 or row_bytes % 512 == 16:
            raise Usage("ROW_BYTES must be a multiple of 16 that is not 16 more than a multiple of 512, not %d" % row_bytes)
        token_base = number("TOKEN_BASE", a[9], 0, (1 << (32 if order == "rows" else 16)) - block_size)
        head_base = number("HEAD_BASE", a[10], 0, 0 if order in ("mla", "rows") else (1 << 16) - heads)
        if block_size * heads * row_bytes > MAX_SLICE_BYTES:
            raise Usage("the slice would be more than 2^31 bytes")
        b = slice_rows(seed, layer, kv, block, gen, order, block_size, heads, row_bytes, token_base, head_base)
        out = a[11:]
    digest = hashlib.sha256(b).hexdigest()
    if out and out[0] == "-":
        write_all(stdout_bytes(), b)
        sys.stderr.write(digest + "\n")
        return 0
    if out:
        with open(out[0], "wb") as f:
            write_all(f, b)
    write_all(stdout_bytes(), (digest + "\n").encode())
    return 0


def stdout_bytes():
    """Standard output as a byte stream; OSError when it is closed."""
    if sys.stdout is None or not hasattr(sys.stdout, "buffer"):
        raise OSError(9, "standard output is closed")
    return sys.stdout.buffer


def write_all(f, b):
    """Writes every byte of b (an unbuffered stream may take part of it), then flushes."""
    view = memoryview(b)
    while view:
        n = f.write(view)
        if n is None or n <= 0:
            raise OSError(5, "short write")
        view = view[n:]
    f.flush()


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Usage as e:
        sys.stderr.write(__doc__ + "\nerror: %s\n" % e)
        sys.exit(2)
    except MemoryError:
        sys.stderr.write("fingerprint_ref.py: not enough memory for a slice of that size (about twice its bytes are needed)\n")
        sys.exit(1)
    except OSError as e:
        sys.stderr.write("fingerprint_ref.py: cannot write %s: %s\n" % (e.filename or "the output", e.strerror or e))
        try:
            sys.stdout = None  # no second error from flushing a broken stdout at exit
        finally:
            sys.exit(1)
