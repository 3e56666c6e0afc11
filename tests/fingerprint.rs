//! The fingerprint (kvprobe.fingerprint/2, by head row): vectors of the independent reference
//! pysrc/fingerprint_ref.py, a re-implementation of csrc/fingerprint.h's comment, tags that
//! name every row, checking, and classification on the CPU — unit by unit and row by row.

use kvprobe::fingerprint::{self, BlockIdentity, RowOrder, RowShape, SliceRows};
use kvprobe::geometry::{Dtype, Geometry, KvPart, Layout};
use kvprobe::verify::{Class, Displacement, classify};

fn id(layer: u32, kv: KvPart, block: u32, generation: u32) -> BlockIdentity {
    BlockIdentity::new(layer, kv, block, generation)
}

/// The rows of `slice` (tokens from `tb`, heads from `hb`) in a slice of `bs` tokens × `heads`
/// heads of `rb`-byte rows in `order`.
#[allow(clippy::too_many_arguments)]
fn rows(slice: BlockIdentity, order: RowOrder, bs: u32, heads: u32, rb: u32, tb: u32, hb: u32) -> SliceRows {
    SliceRows {
        slice: BlockIdentity { token_base: tb, ..slice },
        shape: RowShape { order, block_size: bs, heads, head_base: hb, row_bytes: rb },
    }
}

/// Issue 13.7: generations computed in a scenario run wrap from SKIP_GEN − 1 to 1, never
/// reaching SKIP_GEN (the kernels' "neither fill nor verify") nor 0 (the initial fill).
#[test]
fn generations_wrap_past_the_skip_marker_to_one() {
    use kvprobe::fingerprint::{SKIP_GEN, next_generation};
    assert_eq!(SKIP_GEN, u32::MAX);
    assert_eq!(next_generation(0), 1);
    assert_eq!(next_generation(1), 2);
    assert_eq!(next_generation(u32::MAX - 2), u32::MAX - 1);
    assert_eq!(next_generation(u32::MAX - 1), 1, "SKIP_GEN - 1 wraps to 1");
    assert_eq!(next_generation(u32::MAX), 1, "even from SKIP_GEN itself");
    let mut g = u32::MAX - 5;
    for _ in 0..10 {
        g = next_generation(g);
        assert!(g != 0 && g != SKIP_GEN, "{g}");
    }
    assert_eq!(g, 6);
}

#[test]
fn vectors_match_the_python_reference() {
    // pysrc/fingerprint_ref.py SEED LAYER KV BLOCK GENERATION ORDER BLOCK_SIZE HEADS ROW_BYTES TOKEN_BASE HEAD_BASE
    let big = id(60, KvPart::Latent, 4_000_000_000, 4_294_967_294);
    let cases: Vec<(u64, SliceRows, &str)> = vec![
        (
            1,
            rows(id(3, KvPart::V, 17, 5), RowOrder::Nhd, 16, 2, 128, 0, 0),
            "12ddf30d7560af11af2f2ca82326db74424c0b1ea120dd83f5f207adfe733d13",
        ),
        (
            1,
            rows(id(3, KvPart::V, 17, 5), RowOrder::Hnd, 16, 2, 128, 0, 0),
            "f5e485aadb0c937c68443a025d26798cb3d6b3bc5bf4deac8c7ae037b4f19811",
        ),
        (
            0xdead_beef_cafe_f00d,
            rows(big, RowOrder::Mla, 64, 1, 1152, 0, 0),
            "3ed27f5ed7ab782d09c6242610487f9982a47522482445880bddc750cf39740d",
        ),
        (
            9,
            rows(id(0, KvPart::K, 5, 1), RowOrder::Nhd, 8, 4, 32, 24, 12),
            "eb42ce255f44836cd42ee919e9fd913e49bd5c07954f2ac502cf5062a2927cc7",
        ),
        (
            9,
            rows(id(0, KvPart::K, 5, 1), RowOrder::Hnd, 4, 3, 2080, 32, 4),
            "e052d71658a1f3d0a9f08fc4bcd904e9f7273ba29475f58bb188fa779d225c57",
        ),
    ];
    for (seed, r, digest) in cases {
        assert_eq!(fingerprint::digest(&fingerprint::expected(seed, &r)), digest, "{r:?}");
    }
    // pysrc/fingerprint_ref.py 1 3 V 17 5 nhd 1 1 32 2 1 - | xxd -i: the tag (block 17;
    // layer 3, V, unit 0, 0x4C; generation 5; token 2, head 1), then group 1: its hash h (the
    // check word), h × 0x85EBCA6B, h × 0xC2B2AE35, h × 0x27D4EB2F.
    assert_eq!(
        fingerprint::expected(1, &rows(id(3, KvPart::V, 17, 5), RowOrder::Nhd, 1, 1, 32, 2, 1)),
        [
            0x11, 0, 0, 0, 0x03, 0x00, 0x01, 0x4c, 0x05, 0, 0, 0, 0x02, 0x00, 0x01, 0x00, 0xd5, 0x9d, 0x04, 0x57, 0x07, 0x0a,
            0xff, 0x8e, 0x19, 0x73, 0x55, 0x4f, 0x1b, 0x81, 0x1f, 0x5e
        ]
    );
}

#[test]
fn the_cpu_reference_equals_the_spec_and_the_python_script_on_random_shapes() {
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for case in 0..60 {
        let order = [RowOrder::Nhd, RowOrder::Hnd, RowOrder::Mla][case % 3];
        let kv = if order == RowOrder::Mla { KvPart::Latent } else { [KvPart::K, KvPart::V][next(2) as usize] };
        let slice = id(next(65536) as u32, kv, next(1 << 32) as u32, next(1 << 32) as u32);
        let bs = 1 + next(40) as u32;
        let heads = if order == RowOrder::Mla { 1 } else { 1 + next(9) as u32 };
        // Rows of one unit, of several (512-byte units, the last shorter) and the shortest.
        let rb = [32, 48, 128, 256, 512, 544, 1152, 2080][next(8) as usize];
        let (tb, hb) = (next(1000) as u32, if order == RowOrder::Mla { 0 } else { next(100) as u32 });
        let seed = next(u64::MAX);
        let r = rows(slice, order, bs, heads, rb, tb, hb);
        r.validate().unwrap();
        let got = fingerprint::expected(seed, &r);
        let name = order_name(order);
        let want = spec::rows(seed, slice.layer, kv.code(), slice.block, slice.generation, name, bs, heads, rb, tb, hb);
        assert_eq!(got, want, "case {case}: {r:?} seed {seed}");
        assert_eq!(fingerprint::check(&got, seed, &r), (0, got.len() as u64));
        if case % 12 == 0 {
            let args: Vec<String> = [
                seed.to_string(),
                slice.layer.to_string(),
                kv.to_string(),
                slice.block.to_string(),
                slice.generation.to_string(),
                name.into(),
                bs.to_string(),
                heads.to_string(),
                rb.to_string(),
                tb.to_string(),
                hb.to_string(),
            ]
            .into();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let (code, out, err) = fingerprint_ref(&args);
            assert_eq!((code, out.trim()), (0, fingerprint::digest(&got).as_str()), "{args:?}: {err}");
        }
    }
}

fn order_name(o: RowOrder) -> &'static str {
    match o {
        RowOrder::Nhd => "nhd",
        RowOrder::Hnd => "hnd",
        RowOrder::Mla => "mla",
        RowOrder::Rows => "rows",
    }
}

#[test]
fn every_input_changes_the_bytes_but_not_the_slot() {
    let at = |s: BlockIdentity| rows(s, RowOrder::Nhd, 4, 2, 128, 0, 0);
    let base = id(1, KvPart::K, 9, 2);
    let a = fingerprint::expected(7, &at(base));
    for other in [id(2, KvPart::K, 9, 2), id(1, KvPart::V, 9, 2), id(1, KvPart::K, 10, 2), id(1, KvPart::K, 9, 3)] {
        assert_ne!(a, fingerprint::expected(7, &at(other)), "{other:?}");
    }
    assert_ne!(a, fingerprint::expected(8, &at(base)), "seed");
    assert_ne!(a, fingerprint::expected(7, &rows(base, RowOrder::Nhd, 4, 2, 128, 4, 0)), "token base");
    assert_ne!(a, fingerprint::expected(7, &rows(base, RowOrder::Nhd, 4, 2, 128, 0, 2)), "head base");
    // The same inputs give the same bytes (no hidden slot or address input).
    assert_eq!(a, fingerprint::expected(7, &at(base)));
}

#[test]
fn every_unit_names_its_row_and_unit() {
    for (order, bs, heads, rb) in [
        (RowOrder::Nhd, 16, 4, 256),
        (RowOrder::Hnd, 16, 4, 256),
        (RowOrder::Mla, 8, 1, 1152),
        (RowOrder::Nhd, 2, 3, 32),
        (RowOrder::Hnd, 3, 2, 2080),
    ] {
        let kv = if order == RowOrder::Mla { KvPart::Latent } else { KvPart::V };
        let r = rows(id(7, kv, 99, 4), order, bs, heads, rb, 32, if order == RowOrder::Mla { 0 } else { 8 });
        let bytes = fingerprint::expected(42, &r);
        let units: Vec<_> = r.shape.units().collect();
        assert_eq!(units.len() as u32, bs * heads * rb.div_ceil(512));
        for (row, unit, range) in units {
            assert_eq!(
                fingerprint::decode_tag(&bytes, 42, range.start as u64, rb),
                Some((r.row(row), unit)),
                "{order:?} row {row} unit {unit}"
            );
            assert_eq!(fingerprint::decode_tag(&bytes, 41, range.start as u64, rb), None, "another seed");
        }
        let seen = fingerprint::observed_rows(&bytes, 42, rb);
        assert_eq!(seen, (0..bs * heads).map(|i| Some(r.row(i))).collect::<Vec<_>>());
        assert_eq!(fingerprint::observed_identity(&bytes, 42, &r.shape, 0), Some(r.slice));
    }
    // The positions: NHD row t·heads+h, HND row h·block_size+t, both offset by the bases.
    let nhd = rows(id(0, KvPart::K, 1, 1), RowOrder::Nhd, 16, 4, 128, 32, 8);
    assert_eq!((nhd.row(4 * 3 + 2).token, nhd.row(4 * 3 + 2).head), (32 + 3, 8 + 2));
    let hnd = rows(id(0, KvPart::K, 1, 1), RowOrder::Hnd, 16, 4, 128, 32, 8);
    assert_eq!((hnd.row(16 * 2 + 3).token, hnd.row(16 * 2 + 3).head), (32 + 3, 8 + 2));
}

/// The stray-write checks name what landed by the first tag from the first bad byte on, then
/// from the start: a slice half poison, half another block's rows (token_base derived from the
/// row's position).
#[test]
fn observed_identity_searches_from_the_first_bad_byte_and_wraps() {
    let shape = RowShape { order: RowOrder::Hnd, block_size: 8, heads: 2, head_base: 0, row_bytes: 544 };
    let other = id(1, KvPart::V, 77, 4);
    let mut bytes = fingerprint::expected(3, &shape.slice(BlockIdentity { token_base: 8, ..other }));
    let half = bytes.len() / 2;
    let mut p = vec![0u8; half];
    fingerprint::poison(&mut p, 5, 1);
    bytes[..half].copy_from_slice(&p);
    let want = Some(BlockIdentity { token_base: 8, ..other });
    for from in [0, 1, half as u64 - 1, half as u64, bytes.len() as u64 - 1, bytes.len() as u64, u64::MAX] {
        assert_eq!(fingerprint::observed_identity(&bytes, 3, &shape, from), want, "from {from}");
    }
    bytes[half..].copy_from_slice(&p);
    assert_eq!(fingerprint::observed_identity(&bytes, 3, &shape, 0), None);
}

#[test]
fn check_counts_bad_bytes_and_the_first_offset() {
    let want = rows(id(0, KvPart::K, 1, 1), RowOrder::Nhd, 4, 2, 256, 0, 0);
    let mut s = fingerprint::expected(1, &want);
    assert_eq!(fingerprint::check(&s, 1, &want), (0, 2048));
    s[700] ^= 0x10;
    s[1500] ^= 0xff;
    assert_eq!(fingerprint::check(&s, 1, &want), (2, 700));
}

#[test]
fn check_agrees_with_a_byte_by_byte_comparison() {
    // Tags, check words, bodies and short last units: the row-wise check must count exactly.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for (bs, heads, rb) in [(1, 1, 32), (3, 1, 48), (1, 1, 512), (2, 2, 544), (1, 3, 4096 + 32)] {
        let want = rows(id(4, KvPart::V, 99, 3), RowOrder::Hnd, bs, heads, rb, 0, 0);
        let good = fingerprint::expected(5, &want);
        let len = good.len();
        for hits in 1..=6 {
            let mut s = good.clone();
            for _ in 0..hits {
                let at = (next() % len as u64) as usize;
                s[at] ^= 1 << (next() % 8);
            }
            let bad = good.iter().zip(&s).filter(|(a, b)| a != b).count() as u64;
            let first = good.iter().zip(&s).position(|(a, b)| a != b).map_or(len as u64, |p| p as u64);
            assert_eq!(fingerprint::check(&s, 5, &want), (bad, first), "rows of {rb}, {hits} flips");
        }
    }
}

#[test]
fn poison_is_unique_to_iteration_and_slot() {
    let mut a = vec![0u8; 64];
    let mut b = vec![0u8; 64];
    let mut c = vec![0u8; 64];
    fingerprint::poison(&mut a, 5, 1);
    fingerprint::poison(&mut b, 6, 1);
    fingerprint::poison(&mut c, 5, 2);
    assert_ne!(a, b);
    assert_ne!(a, c);
    assert_eq!(&a[0..8], &[5, 0, 0, 0, 1, 0, 0, 0x5a]);
}

#[test]
fn tags_are_not_confused_with_poison_other_seeds_or_flipped_bits() {
    for rb in [32u32, 256, 544] {
        let r = rows(id(5, KvPart::K, 1000, 9), RowOrder::Nhd, 4, 2, rb, 0, 0);
        let bytes = fingerprint::expected(77, &r);
        // Poison, whatever the slot and iteration, is never a tag.
        for (slot, it) in [(0u32, 0u32), (1, 1), (0x4C00_0000, 3), (u32::MAX - 1, 0xFF_FFFF)] {
            let mut p = vec![0u8; bytes.len()];
            fingerprint::poison(&mut p, slot, it);
            assert!(fingerprint::observed_rows(&p, 77, rb).iter().all(Option::is_none), "poison {slot} {it}");
        }
        // Another seed's row is no valid tag (the check word binds the seed).
        assert!(fingerprint::observed_rows(&bytes, 78, rb).iter().all(Option::is_none));
        // A single flipped bit in a tag or its check word never names another row, in every
        // unit (rows of 544 bytes: a 32-byte last unit).
        for (row, _, range) in r.shape.units() {
            for bit in 0..160 {
                let mut b = bytes.clone();
                b[range.start + bit / 8] ^= 1 << (bit % 8);
                assert_eq!(fingerprint::decode_tag(&b, 77, range.start as u64, rb), None, "rows of {rb}: row {row} bit {bit}");
            }
        }
    }
}

#[test]
fn what_the_fingerprint_cannot_encode_is_refused() {
    let ok = rows(id(0, KvPart::K, 0, 0), RowOrder::Nhd, 16, 8, 256, 0, 0);
    ok.validate().unwrap();
    let with = |f: &dyn Fn(&mut SliceRows)| {
        let mut r = ok;
        f(&mut r);
        r
    };
    for (bad, why) in [
        (with(&|r| r.shape.row_bytes = 16), "from 32 to 32768"),
        (with(&|r| r.shape.row_bytes = 40), "multiple of 16"),
        (with(&|r| r.shape.row_bytes = 528), "not 16 more than a multiple of 512"),
        (with(&|r| r.shape.row_bytes = fingerprint::MAX_ROW_BYTES + 32), "from 32 to 32768"),
        (with(&|r| r.slice.token_base = 65530), "16-bit token"),
        (with(&|r| r.shape.head_base = 65530), "16-bit head"),
        (with(&|r| r.shape.heads = 0), "at least one"),
        (with(&|r| r.shape.order = RowOrder::Mla), "one latent row per token"),
        (
            with(&|r| {
                r.shape.order = RowOrder::Mla;
                r.shape.heads = 1;
                r.shape.head_base = 3
            }),
            "head 0",
        ),
    ] {
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains(why), "{bad:?}: {e}");
    }
    // The geometry refuses the same rows, with its flags' names.
    let g = Geometry {
        num_layers: 1,
        num_kv_heads: 1,
        head_size: 8,
        block_size: 1,
        num_blocks: 4,
        dtype: Dtype::Bf16,
        layout: Layout::Nhd,
        mla: false,
    };
    assert!(g.validate().unwrap_err().to_string().contains("a head row is 16 bytes"));
    assert!(Geometry { head_size: 264, ..g.clone() }.validate().unwrap_err().to_string().contains("528"));
    assert!(
        Geometry { block_size: 65537, head_size: 16, ..g.clone() }
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--block-size 65537")
    );
    Geometry { head_size: 16, ..g }.validate().unwrap();
}

const SEED: u64 = 42;

fn want() -> SliceRows {
    rows(id(2, KvPart::K, 1000, 9), RowOrder::Nhd, 4, 4, 256, 0, 0)
}

fn with_slice(s: BlockIdentity) -> SliceRows {
    SliceRows { slice: s, ..want() }
}

#[test]
fn classify_bitflip_counts_bits() {
    let mut s = fingerprint::expected(SEED, &want());
    s[100] ^= 0b101;
    s[3000] ^= 0x80;
    let v = classify(&s, &want(), SEED, 7, 9);
    assert_eq!(v.class, Class::Bitflip);
    assert_eq!(v.bit_flips, Some(3));
    assert_eq!(v.observed, Some(want().slice));
}

#[test]
fn classify_unwritten_is_this_iterations_poison() {
    let mut s = vec![0u8; 4096];
    fingerprint::poison(&mut s, 7, 9);
    assert_eq!(classify(&s, &want(), SEED, 7, 9).class, Class::Unwritten);
    // Another slot's poison is not this slot's: nothing recognisable.
    fingerprint::poison(&mut s, 8, 9);
    assert_eq!(classify(&s, &want(), SEED, 7, 9).class, Class::Garbage);
}

#[test]
fn classify_stale_and_misplaced_name_what_arrived() {
    let old = BlockIdentity { generation: 8, ..want().slice };
    let v = classify(&fingerprint::expected(SEED, &with_slice(old)), &want(), SEED, 7, 9);
    assert_eq!((v.class, v.observed), (Class::Stale, Some(old)));
    let other = BlockIdentity { block: 1001, ..want().slice };
    let v = classify(&fingerprint::expected(SEED, &with_slice(other)), &want(), SEED, 7, 9);
    assert_eq!((v.class, v.observed), (Class::Misplaced, Some(other)));
    let other_layer = BlockIdentity { layer: 3, ..want().slice };
    assert_eq!(classify(&fingerprint::expected(SEED, &with_slice(other_layer)), &want(), SEED, 7, 9).class, Class::Misplaced);
}

/// Issue 33 item 8: `stale` is an older generation of the right block; a newer one (its
/// source rewritten before the transfer read it) is an overwrite race, `overwritten`.
#[test]
fn a_newer_generation_of_the_right_block_is_overwritten_not_stale() {
    for (generation, class) in [(8, Class::Stale), (1, Class::Stale), (10, Class::Overwritten), (1000, Class::Overwritten)] {
        let g = BlockIdentity { generation, ..want().slice };
        let v = classify(&fingerprint::expected(SEED, &with_slice(g)), &want(), SEED, 7, 9);
        assert_eq!((v.class, v.observed), (class, Some(g)), "generation {generation} where 9 is due");
    }
}

/// Issue 33 item 1: the expected bytes themselves (a slice that failed the verify but holds
/// the right rows when classified: it changed after the verdict) are `late`, never `bitflip`
/// with 0 bits — on every shape, order and seed tried here.
#[test]
fn the_expected_bytes_are_late_never_a_bitflip_of_zero_bits() {
    for seed in [1u64, 42, 0xFFFF_FFFF_FFFF_FFFF] {
        for order in [RowOrder::Nhd, RowOrder::Hnd, RowOrder::Mla] {
            for (bs, heads, rb) in [(1, 1, 32), (4, 4, 256), (2, 3, 1056), (16, 8, 128)] {
                let heads = if order == RowOrder::Mla { 1 } else { heads };
                let kv = if order == RowOrder::Mla { KvPart::Latent } else { KvPart::V };
                let due = rows(id(1, kv, 77, 3), order, bs, heads, rb, 0, 0);
                let v = classify(&fingerprint::expected(seed, &due), &due, seed, 5, 3);
                assert_eq!(v.class, Class::Late, "seed {seed} {order:?} {bs}x{heads}x{rb}");
                assert_eq!(v.bit_flips, None, "seed {seed} {order:?} {bs}x{heads}x{rb}");
            }
        }
    }
}

#[test]
fn classify_torn_gives_the_unit_map() {
    let mut s = fingerprint::expected(SEED, &want());
    let mut p = vec![0u8; 4096];
    fingerprint::poison(&mut p, 7, 9);
    s[1024..].copy_from_slice(&p[1024..]);
    let v = classify(&s, &want(), SEED, 7, 9);
    assert_eq!(v.class, Class::Torn);
    // 256-byte rows: units 0..=3 arrived, 4..=15 are poison.
    let map: Vec<(u32, u32, String)> = v.sectors.unwrap().into_iter().map(|r| (r.first, r.last, r.source)).collect();
    assert_eq!(map, vec![(0, 3, "expected".to_string()), (4, 15, "poison".to_string())]);
    // A mix of two blocks names the foreign one.
    let other = BlockIdentity { block: 5, ..want().slice };
    let o = fingerprint::expected(SEED, &with_slice(other));
    let mut s = fingerprint::expected(SEED, &want());
    s[2048..].copy_from_slice(&o[2048..]);
    let v = classify(&s, &want(), SEED, 7, 9);
    assert_eq!((v.class, v.observed), (Class::Torn, Some(other)));
    let map: Vec<String> = v.sectors.unwrap().into_iter().map(|r| r.source).collect();
    assert_eq!(map, ["expected", "layer 2 K block 5 gen 9"]);
}

#[test]
fn classify_garbage_when_nothing_matches() {
    let s: Vec<u8> = (0..4096).map(|i| (i * 7 + 3) as u8).collect();
    let v = classify(&s, &want(), SEED, 7, 9);
    assert_eq!((v.class, v.observed), (Class::Garbage, None));
    // Rows of another seed are not recognised as rows.
    let v = classify(&fingerprint::expected(SEED + 1, &want()), &want(), SEED, 7, 9);
    assert_eq!(v.class, Class::Garbage);
}

#[test]
fn classify_torn_inside_one_unit() {
    // A tear inside a row (or inside a 512-byte unit of a longer row) is still torn.
    for (rb, cut) in [(512u32, 272usize), (64, 32), (1152, 1030), (32, 16)] {
        let r = rows(id(1, KvPart::V, 3, 2), RowOrder::Nhd, 1, 1, rb, 0, 0);
        let mut s = fingerprint::expected(SEED, &r);
        let mut p = vec![0u8; s.len()];
        fingerprint::poison(&mut p, 7, 9);
        s[cut..].copy_from_slice(&p[cut..]);
        let v = classify(&s, &r, SEED, 7, 9);
        assert_eq!(v.class, Class::Torn, "rows of {rb} cut {cut}");
    }
}

/// Issue 18: NHD rows read as HND are `layout`, transposed, with the rows' identities.
#[test]
fn nhd_bytes_read_as_hnd_are_layout_transposed_with_row_identities() {
    let slice = id(2, KvPart::V, 4242, 9);
    let nhd = rows(slice, RowOrder::Nhd, 16, 4, 128, 0, 0);
    let hnd = rows(slice, RowOrder::Hnd, 16, 4, 128, 0, 0);
    let copied = fingerprint::expected(SEED, &nhd);
    let (bad, first) = fingerprint::check(&copied, SEED, &hnd);
    assert!(bad > 0, "a verbatim NHD → HND copy must not verify");
    // Row 0 (token 0, head 0) is the same in both orders; row 1 is not, and its tag's first
    // three words (block, layer/K/V/unit, generation) agree: the position word (bytes 12..16)
    // is the first to differ.
    assert_eq!(first, 128 + 12);
    let v = classify(&copied, &hnd, SEED, 7, 1);
    assert_eq!((v.class, v.displacement, v.observed), (Class::Layout, Some(Displacement::Transposed), Some(slice)));
    let listed = v.rows.unwrap();
    assert_eq!(listed.len(), kvprobe::verify::MAX_LISTED_ROWS);
    // Slot 1 of the HND slice is due (token 1, head 0) and holds NHD's row 1 (token 0, head 1).
    let w = listed[0];
    assert_eq!((w.row, w.due_token, w.due_head, w.token, w.head), (1, 1, 0, 0, 1));
    // Of 64 rows only those with t·4 + h = h·16 + t (t = 5h) stay in place.
    let held = fingerprint::observed_rows(&copied, SEED, 128);
    let moved = (0..64).filter(|&r| held[r as usize] != Some(hnd.row(r))).count();
    assert_eq!(moved, 64 - 4);
    // With one head NHD and HND are the same bytes.
    let one = |o| rows(slice, o, 16, 1, 128, 0, 0);
    assert_eq!(fingerprint::check(&fingerprint::expected(SEED, &one(RowOrder::Nhd)), SEED, &one(RowOrder::Hnd)).0, 0);
}

#[test]
fn a_wrong_head_or_token_offset_is_named() {
    let slice = id(0, KvPart::K, 77, 3);
    // TP: rank 1 of 2 is due heads 4..8 and got rank 0's heads 0..4.
    let due = rows(slice, RowOrder::Hnd, 16, 4, 256, 0, 4);
    let got = fingerprint::expected(SEED, &rows(slice, RowOrder::Hnd, 16, 4, 256, 0, 0));
    let v = classify(&got, &due, SEED, 0, 1);
    assert_eq!((v.class, v.displacement), (Class::Layout, Some(Displacement::HeadOffset(-4))));
    // Block sizes: the second half (tokens 16..32) of a 32-token prefill block was due, the
    // first half came.
    let due = rows(slice, RowOrder::Nhd, 16, 4, 256, 16, 0);
    let got = fingerprint::expected(SEED, &rows(slice, RowOrder::Nhd, 16, 4, 256, 0, 0));
    let v = classify(&got, &due, SEED, 0, 1);
    assert_eq!((v.class, v.displacement), (Class::Layout, Some(Displacement::TokenOffset(-16))));
    assert_eq!(v.displacement.unwrap().to_string(), "token offset -16");
    // MLA rows shifted by one token.
    let mla = rows(id(5, KvPart::Latent, 1, 1), RowOrder::Mla, 8, 1, 1152, 1, 0);
    let got = fingerprint::expected(SEED, &rows(id(5, KvPart::Latent, 1, 1), RowOrder::Mla, 8, 1, 1152, 0, 0));
    let v = classify(&got, &mla, SEED, 0, 1);
    assert_eq!((v.class, v.displacement), (Class::Layout, Some(Displacement::TokenOffset(-1))));
    // A decode block holding tokens 16..32 of a 32-token prefill block: cut from prefill's
    // rows as a heterogeneous block-size READ would, it verifies.
    let prefill = rows(slice, RowOrder::Nhd, 32, 8, 256, 0, 0);
    let bytes = fingerprint::expected(11, &prefill);
    let decode = rows(slice, RowOrder::Nhd, 16, 4, 256, 16, 4);
    let mut gathered = Vec::new();
    for t in 16..32u32 {
        for h in 4..8u32 {
            let r = (t * 8 + h) as usize * 256;
            gathered.extend_from_slice(&bytes[r..r + 256]);
        }
    }
    assert_eq!(fingerprint::check(&gathered, 11, &decode), (0, gathered.len() as u64));
}

/// Every row length the geometry accepts up to two units and a bit (32, 48, …, 1056 bytes, not
/// 528: one partial unit, one full unit, a full unit plus a 32-byte tail, …) in slices of one
/// row and of 2 tokens × 2 heads, every injection class, seeds 1..=30, and poison slots chosen
/// to coincide with the small integers of the tag (block id, generation, token, head): each
/// simulated fault is classified as its injection predicts. (Issue 12.3: a stale 16-byte
/// slice whose old generation equalled the slot number was read as torn; rows of 16 bytes,
/// whose tag would have no check word, are refused since fingerprint version 2.)
#[test]
fn every_class_is_classified_as_predicted_on_the_smallest_slices() {
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut failures = Vec::new();
    for rb in (32..=1056u32).step_by(16).filter(|rb| rb % 512 != 16) {
        for seed in 1..=30u64 {
            let kv = if seed % 2 == 0 { KvPart::K } else { KvPart::V };
            let (bs, heads) = if seed % 4 == 0 { (2, 2) } else { (1, 1) };
            // Small logical ids collide with slot numbers; large ones are the usual case.
            let block = if seed % 3 == 0 { kvprobe::run::logical_block(seed, seed as u32) } else { (seed % 5) as u32 };
            for it in 1..=4u32 {
                let shape = |s: BlockIdentity| rows(s, RowOrder::Nhd, bs, heads, rb, 0, 0);
                let want = id(0, kv, block, it);
                let stale = BlockIdentity { generation: it - 1, ..want };
                let other = BlockIdentity { block: block.wrapping_add(1), ..want };
                for slot in [it - 1, it, it + 1, block, block.wrapping_add(1), 1000] {
                    let good = fingerprint::expected(seed, &shape(want));
                    let len = good.len();
                    let mut poison = vec![0u8; len];
                    fingerprint::poison(&mut poison, slot, it);
                    let mut cases: Vec<(&str, Vec<u8>, Class, Option<BlockIdentity>)> = Vec::new();
                    let mut flipped = good.clone();
                    flipped[(next() % len as u64) as usize] ^= 1 << (next() % 8);
                    cases.push(("bitflip", flipped, Class::Bitflip, Some(want)));
                    cases.push(("drop", poison.clone(), Class::Unwritten, None));
                    cases.push(("misroute", fingerprint::expected(seed, &shape(other)), Class::Misplaced, Some(other)));
                    cases.push(("stale", fingerprint::expected(seed, &shape(stale)), Class::Stale, Some(stale)));
                    let newer = BlockIdentity { generation: it + 1, ..want };
                    cases.push(("overwritten", fingerprint::expected(seed, &shape(newer)), Class::Overwritten, Some(newer)));
                    cases.push(("late", good.clone(), Class::Late, Some(want)));
                    // As inject::plan: a prefix of 16 * [1, len / 16) bytes arrived.
                    let cut = 16 * (1 + (next() % (len as u64 / 16 - 1)) as usize);
                    let mut torn = good.clone();
                    torn[cut..].copy_from_slice(&poison[cut..]);
                    cases.push(("torn", torn, Class::Torn, None));
                    for (kind, bytes, class, observed) in cases {
                        let v = classify(&bytes, &shape(want), seed, slot, it);
                        let observed_ok = observed.is_none() || v.observed == observed;
                        if v.class != class || !observed_ok {
                            failures.push(format!(
                                "rows {rb} seed {seed} iteration {it} slot {slot} {kind}: {} (observed {:?}, units {:?})",
                                v.class, v.observed, v.sectors
                            ));
                        }
                    }
                }
            }
        }
    }
    let mut by: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    for f in &failures {
        let w: Vec<&str> = f.split(' ').collect();
        *by.entry(format!("rows {} {}", w[1], w[8].trim_end_matches(':'))).or_default() += 1;
    }
    assert!(
        failures.is_empty(),
        "{} misclassified ({by:?}), e.g.:\n{}",
        failures.len(),
        failures[..failures.len().min(12)].join("\n")
    );
}

// ---- Issue 12.6: docs/fingerprint.md's spec, re-implemented here from it alone ----

/// docs/fingerprint.md "Fingerprint format", independently of csrc/fingerprint.h.
pub(crate) mod spec {
    pub fn fmix32(mut h: u32) -> u32 {
        h ^= h >> 16;
        h = h.wrapping_mul(0x85EB_CA6B);
        h ^= h >> 13;
        h = h.wrapping_mul(0xC2B2_AE35);
        h ^ (h >> 16)
    }

    /// The fingerprint of the slice of (seed, layer, kv code, logical block, generation) cut
    /// into `bs × heads` rows of `rb` bytes in `order`, naming tokens `tb..` and heads `hb..`.
    #[allow(clippy::too_many_arguments)]
    pub fn rows(
        seed: u64,
        layer: u32,
        kv: u32,
        block: u32,
        gen_: u32,
        order: &str,
        bs: u32,
        heads: u32,
        rb: u32,
        tb: u32,
        hb: u32,
    ) -> Vec<u8> {
        let seed32 = fmix32(seed as u32 ^ fmix32((seed >> 32) as u32 ^ 0x6B76_7062));
        let mut out = Vec::new();
        for r in 0..bs * heads {
            let (t, h) = match order {
                "nhd" => (r / heads, r % heads),
                "hnd" => (r % bs, r / bs),
                _ => (r, 0),
            };
            // docs/fingerprint.md "Region rows": a region row's position word is its global row.
            let pos = if order == "rows" { tb.wrapping_add(r) } else { (tb + t) | (hb + h) << 16 };
            let lkv = |u: u32| layer | kv << 16 | u << 18 | 0x4C << 24;
            let rkey = fmix32(seed32 ^ fmix32(block ^ fmix32(lkv(0) ^ fmix32(pos ^ fmix32(gen_ ^ 0x9E37_79B9)))));
            for i in 0..rb / 4 {
                let (u, w) = (i / 128, i % 128);
                let v = match w {
                    0 => block,
                    1 => lkv(u),
                    2 => gen_,
                    3 => pos,
                    _ => fmix32(rkey ^ (i / 4).wrapping_mul(0x9E37_79B9))
                        .wrapping_mul([1, 0x85EB_CA6B, 0xC2B2_AE35, 0x27D4_EB2F][i as usize % 4]),
                };
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        out
    }

    /// The poison of `slot` in `iteration`, `len` bytes.
    pub fn poison(slot: u32, iteration: u32, len: usize) -> Vec<u8> {
        (0..len / 4).flat_map(|e| if e % 2 == 0 { slot } else { 0x5A00_0000 | (iteration & 0xFF_FFFF) }.to_le_bytes()).collect()
    }

    /// The global slice index of decode slot (layer, kv, block) in docs/fingerprint.md's table.
    pub fn slot(layout: &str, mla: bool, num_blocks: u32, layer: u32, kv: u32, block: u32) -> u32 {
        let (per_layer, q) = match (mla, layout) {
            (true, _) => (num_blocks, block),
            (false, "nhd") => (2 * num_blocks, kv * num_blocks + block),
            (false, "hnd") => (2 * num_blocks, 2 * block + kv),
            other => panic!("layout {other:?}"),
        };
        layer * per_layer + q
    }

    pub fn kv_code(kv: &str) -> u32 {
        match kv {
            "K" => 0,
            "V" => 1,
            "latent" => 2,
            other => panic!("kv {other:?}"),
        }
    }

    pub fn sha256(b: &[u8]) -> String {
        use sha2::Digest;
        sha2::Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
    }
}

/// Checks every failure of `r` against docs/fingerprint.md's spec: the slot formula, both digests
/// (the actual one where the class says what arrived), `first_bad_offset` and `bad_bytes`.
/// Returns how many failures of each class were checked in full.
fn check_report_against_the_spec(r: &serde_json::Value, ctx: &str) -> std::collections::BTreeMap<String, usize> {
    let c = &r["config"];
    let g = &c["geometry"];
    let seed_hex = c["seed_hex"].as_str().unwrap_or_else(|| panic!("{ctx}: no config.seed_hex"));
    let seed = u64::from_str_radix(seed_hex.strip_prefix("0x").unwrap(), 16).unwrap();
    assert_eq!(seed_hex.len(), 18, "{ctx}: {seed_hex}");
    // The integer stays (exact in serde_json), and agrees.
    assert_eq!(c["seed"].as_u64(), Some(seed), "{ctx}");
    let field = |k: &str| g[k].as_u64().unwrap_or_else(|| panic!("{ctx}: geometry.{k}: {g}"));
    let mla = g["mla"].as_bool().unwrap();
    let dtype = match g["dtype"].as_str().unwrap() {
        "fp8" => 1,
        "bf16" | "fp16" => 2,
        _ => 4,
    };
    let len = field("slice_bytes") as usize;
    let heads = if mla { 1 } else { field("num_kv_heads") };
    assert_eq!(len as u64, field("block_size") * heads * field("head_size") * dtype, "{ctx}: slice_bytes");
    assert_eq!(c["fingerprint"], "kvprobe.fingerprint/2", "{ctx}");
    let order = if mla { "mla" } else { g["layout"].as_str().unwrap() };
    let (bs, rb) = (field("block_size") as u32, (field("head_size") * dtype) as u32);
    let scenario = !r["scenario"].is_null();
    let mut checked = std::collections::BTreeMap::new();
    for f in r["failures"].as_array().unwrap() {
        let n = |k: &str| f[k].as_u64().unwrap_or_else(|| panic!("{ctx}: {k} in {f}")) as u32;
        let (layer, kv, block) = (n("layer"), spec::kv_code(f["kv"].as_str().unwrap()), n("block"));
        let slot = spec::slot(g["layout"].as_str().unwrap(), mla, field("num_blocks") as u32, layer, kv, block);
        assert_eq!(n("slot"), slot, "{ctx}: {f}");
        if !scenario {
            assert!(n("iteration") >= 1, "{ctx}: sweep iterations count from 1: {f}");
            assert_eq!(n("poison_iteration"), n("iteration"), "{ctx}: {f}");
            assert_eq!(f["expected"]["generation"].as_u64(), Some(n("iteration") as u64), "{ctx}: {f}");
        }
        let ident = |i: &serde_json::Value| {
            let m = |k: &str| i[k].as_u64().unwrap_or(0) as u32;
            let kv = spec::kv_code(i["kv"].as_str().unwrap());
            let tb = m("token_base");
            spec::rows(seed, m("layer"), kv, m("block"), m("generation"), order, bs, heads as u32, rb, tb, 0)
        };
        let want = ident(&f["expected"]);
        assert_eq!(spec::sha256(&want), f["expected_digest"], "{ctx}: {f}");
        let class = f["class"].as_str().unwrap();
        let got = match class {
            "unwritten" => spec::poison(slot, n("poison_iteration"), len),
            "stale" | "misplaced" => ident(&f["observed"]),
            _ => continue,
        };
        assert_eq!(spec::sha256(&got), f["actual_digest"], "{ctx}: {f}");
        let bad: Vec<usize> = (0..len).filter(|&i| want[i] != got[i]).collect();
        assert_eq!(f["bad_bytes"].as_u64(), Some(bad.len() as u64), "{ctx}: {f}");
        assert_eq!(f["first_bad_offset"].as_u64(), Some(bad[0] as u64), "{ctx}: {f}");
        *checked.entry(class.to_string()).or_default() += 1;
    }
    checked
}

/// Issue 12.6: a re-implementation written from docs/fingerprint.md alone reproduces the bytes
/// kvprobe writes — fingerprints, poison (global slice index in NHD, HND and MLA decode
/// pools), `first_bad_offset` and `bad_bytes` — from the report's fields (`seed_hex`,
/// `geometry.slice_bytes`, a failure's identities, `slot`, `poison_iteration`), for a seed
/// that JSON doubles would round.
#[test]
fn the_readmes_spec_reproduces_the_reports_bytes() {
    for (layout, extra) in [("nhd", &[][..]), ("hnd", &["--layout", "hnd"][..]), ("mla", &["--mla"][..])] {
        let mut args = vec!["--iterations", "3", "--seed", "0xfffffffffffffff1", "--layers", "3", "--blocks", "8"];
        args.extend(["--inject", "drop:2", "--inject", "stale", "--inject", "misroute", "--inject", "torn"]);
        args.extend_from_slice(extra);
        let (code, r, log) = crate::common::run_with_report(&format!("spec-{layout}"), "dram", &args);
        assert_eq!(code, 1, "{layout}: {log}");
        assert_eq!(r["config"]["seed_hex"], "0xfffffffffffffff1");
        let checked = check_report_against_the_spec(&r, layout);
        // drop:2 and misroute's source: 3 unwritten per iteration; one stale, one misplaced.
        let want: std::collections::BTreeMap<String, usize> =
            [("misplaced", 3), ("stale", 3), ("unwritten", 9)].into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        assert_eq!(checked, want, "{layout}: {log}");
        // Torn failures: their unit map in the documented format (rows of at most 512 bytes
        // here: one unit per row).
        for f in r["failures"].as_array().unwrap().iter().filter(|f| f["class"] == "torn") {
            let runs = f["sectors"].as_array().unwrap();
            let g = &r["config"]["geometry"];
            let row_bytes = g["head_size"].as_u64().unwrap() * 2;
            assert!(row_bytes <= 512, "{g}");
            let sectors = g["slice_bytes"].as_u64().unwrap() / row_bytes;
            assert_eq!(runs[0]["first"], 0, "{f}");
            assert_eq!(runs.last().unwrap()["last"], sectors - 1, "{f}");
            for w in runs.windows(2) {
                assert_eq!(w[1]["first"].as_u64().unwrap(), w[0]["last"].as_u64().unwrap() + 1, "{f}");
            }
            for run in runs {
                let s = run["source"].as_str().unwrap();
                assert!(["expected", "poison", "expected+poison within the sector"].contains(&s), "{f}");
            }
        }
    }
}

/// The same spec holds in scenario runs, where a failure's `iteration` is the engine step and
/// the poison's iteration is the step decode poisoned in (`poison_iteration`).
#[test]
fn the_readmes_spec_reproduces_scenario_failures() {
    let (code, r, log) = crate::common::run_with_report(
        "spec-scenario",
        "dram",
        &["--race", "save-after-free", "--requests", "600", "--seed", "0x8000000000000003", "--lockstep"],
    );
    assert_eq!(code, 1, "{log}");
    assert!(!r["failures"].as_array().unwrap().is_empty(), "{log}");
    let checked = check_report_against_the_spec(&r, "scenario");
    assert!(checked.values().sum::<usize>() > 0, "{checked:?}: {log}");
}

pub(crate) fn fingerprint_ref(args: &[&str]) -> (i32, String, String) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/pysrc/fingerprint_ref.py");
    let o = std::process::Command::new("python3").arg(script).args(args).output().expect("python3 runs");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Issue 12.6: scripts/fingerprint_ref.py refuses what is not a block slice, seed or slot
/// (usage, exit 2), and computes what it accepts as kvprobe does.
#[test]
fn fingerprint_ref_refuses_bad_arguments_and_agrees_with_kvprobe() {
    for (args, needle) in [
        (&[][..], "no arguments"),
        (&["1", "3", "V", "17", "5", "nhd", "16", "2", "16", "0", "0"][..], "ROW_BYTES must be from 32"),
        (&["1", "3", "V", "17", "5", "nhd", "16", "2", "40", "0", "0"][..], "multiple of 16"),
        (&["1", "3", "V", "17", "5", "nhd", "16", "2", "528", "0", "0"][..], "not 16 more than a multiple of 512"),
        (&["1", "3", "V", "17", "5", "nhd", "16", "2", "32784", "0", "0"][..], "ROW_BYTES must be from 32"),
        (&["1", "3", "V", "17", "5", "xyz", "16", "2", "32", "0", "0"][..], "ORDER must be"),
        (&["1", "3", "V", "17", "5", "nhd", "0", "2", "32", "0", "0"][..], "BLOCK_SIZE must be from 1"),
        (&["1", "3", "V", "17", "5", "nhd", "16", "2", "32", "65530", "0"][..], "TOKEN_BASE must be from 0 to 65520"),
        (&["1", "3", "V", "17", "5", "nhd", "16", "2", "32", "0", "65535"][..], "HEAD_BASE must be from 0 to 65534"),
        (&["1", "3", "latent", "17", "5", "mla", "16", "2", "32", "0", "0"][..], "HEADS must be from 1 to 1"),
        (&["1", "3", "K", "17", "5", "mla", "16", "1", "32", "0", "0"][..], "KV must be one of latent"),
        (&["1", "3", "latent", "17", "5", "hnd", "16", "1", "32", "0", "0"][..], "KV must be one of K, V"),
        (&["1", "3", "V", "17", "5", "nhd", "65536", "2", "32768", "0", "0"][..], "more than 2^31 bytes"),
        (
            &["18446744073709551616", "3", "V", "17", "5", "nhd", "1", "1", "32", "0", "0"][..],
            "SEED must be from 0 to 18446744073709551615",
        ),
        (&["0x10000000000000000", "3", "V", "17", "5", "nhd", "1", "1", "32", "0", "0"][..], "SEED must be from 0"),
        (&["-1", "3", "V", "17", "5", "nhd", "1", "1", "32", "0", "0"][..], "SEED must be a non-negative"),
        (&["1.5", "3", "V", "17", "5", "nhd", "1", "1", "32", "0", "0"][..], "SEED must be a non-negative"),
        (&["1", "65536", "V", "17", "5", "nhd", "1", "1", "32", "0", "0"][..], "LAYER must be from 0 to 65535"),
        (&["1", "-3", "V", "17", "5", "nhd", "1", "1", "32", "0", "0"][..], "LAYER must be a non-negative"),
        (&["1", "3", "3", "17", "5", "nhd", "1", "1", "32", "0", "0"][..], "KV must be one of"),
        (&["1", "3", "V", "4294967296", "5", "nhd", "1", "1", "32", "0", "0"][..], "BLOCK must be from 0 to 4294967295"),
        (&["1", "3", "V", "17", "4294967296", "nhd", "1", "1", "32", "0", "0"][..], "GENERATION must be from 0 to 4294967295"),
        (&["1", "3", "V", "17", "5", "nhd", "1", "1", "32", "0"][..], "expected SEED"),
        (&["1", "3", "V", "17", "5", "nhd", "1", "1", "32", "0", "0", "out", "extra"][..], "expected SEED"),
        (&["poison", "1", "1", "0"][..], "SLICE_BYTES must be from 16"),
        (&["poison", "1", "1", "4294967296"][..], "SLICE_BYTES must be from 16"),
        (&["poison", "4294967295", "1", "32"][..], "SLOT must be from 0 to 4294967294"),
        (&["poison", "1", "-1", "32"][..], "ITERATION must be a non-negative"),
        (&["poison", "1", "1", "20"][..], "multiple of 16"),
        (&["slot", "xyz", "1", "8", "0", "K", "0"][..], "LAYOUT must be"),
        (&["slot", "nhd", "2", "8", "2", "K", "0"][..], "LAYER must be from 0 to 1"),
        (&["slot", "nhd", "2", "8", "1", "K", "8"][..], "BLOCK must be from 0 to 7"),
        (&["slot", "mla", "2", "8", "1", "K", "0"][..], "KV must be one of latent"),
        (&["slot", "hnd", "2", "8", "1", "latent", "0"][..], "KV must be one of K, V"),
    ] {
        let (code, out, err) = fingerprint_ref(args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(err.contains("usage: scripts/fingerprint_ref.py") && err.contains(needle), "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}: {out}");
    }
    // Accepted arguments: the same bytes as kvprobe's own fingerprint and poison.
    let seed = u64::MAX - 14;
    let want = fingerprint::expected(seed, &rows(id(65535, KvPart::Latent, u32::MAX, 3), RowOrder::Mla, 3, 1, 544, 65533, 0));
    let args = ["0xfffffffffffffff1", "65535", "latent", "0xffffffff", "3", "mla", "3", "1", "544", "65533", "0"];
    let (code, out, err) = fingerprint_ref(&args);
    assert_eq!((code, out.trim()), (0, fingerprint::digest(&want).as_str()), "{err}");
    let mut p = vec![0u8; 48];
    fingerprint::poison(&mut p, 4_294_967_294, 0x0123_4567);
    let (code, out, err) = fingerprint_ref(&["poison", "4294967294", "0x01234567", "48"]);
    assert_eq!((code, out.trim()), (0, fingerprint::digest(&p).as_str()), "{err}");
    let g = kvprobe::geometry::Geometry {
        num_layers: 3,
        num_kv_heads: 1,
        head_size: 16,
        block_size: 1,
        num_blocks: 3,
        dtype: kvprobe::geometry::Dtype::Fp8,
        layout: kvprobe::geometry::Layout::Hnd,
        mla: false,
    };
    for (layout, mla) in
        [(kvprobe::geometry::Layout::Nhd, false), (kvprobe::geometry::Layout::Hnd, false), (kvprobe::geometry::Layout::Nhd, true)]
    {
        let g = kvprobe::geometry::Geometry { layout, mla, ..g.clone() };
        // Layer 1's slots (the layer term and every in-layer index of a 3-block pool).
        for c in g.coords().filter(|c| c.layer == 1) {
            let name = if mla { "mla".to_string() } else { format!("{layout:?}").to_lowercase() };
            let (layer, block) = (c.layer.to_string(), c.block.to_string());
            let (code, out, err) = fingerprint_ref(&["slot", &name, "3", "3", &layer, &c.kv.to_string(), &block]);
            assert_eq!((code, out.trim().to_string()), (0, g.global_slice(c).to_string()), "{c:?} {name}: {err}");
        }
    }
}

/// docs/fingerprint.md's digest recipe as a program: the first ```python block after "To recompute a
/// failure's `expected_digest`" in "Fingerprint format".
fn readme_recipe() -> String {
    let readme = include_str!("../docs/fingerprint.md");
    let at =
        readme.find("To recompute a failure's `expected_digest`").expect("docs/fingerprint.md has the expected_digest recipe");
    let rest = &readme[at..];
    let start = rest.find("```python\n").expect("the recipe has a ```python block") + "```python\n".len();
    let end = rest[start..].find("```").expect("the block ends");
    rest[start..start + end].to_string()
}

/// Issue 33 (spec-2026-12 ambiguity 1 and 2): docs/fingerprint.md's expected-digest recipe, run as
/// written, gives every failure's `expected_digest` through scripts/fingerprint_ref.py for runs
/// whose sides differ in block size and TP (a decode block larger and smaller than prefill's,
/// GQA replication, MLA with its `layout` left at nhd). The runs must tell a right recipe from
/// the one that took `config.geometry` and head 0 (some failure's digest differs under it), and
/// each failure's logical id follows docs/fingerprint.md's rule from `prefill_block`.
#[test]
fn the_readmes_digest_recipe_holds_between_unequal_sides_and_tp() {
    let d = crate::common::tmpdir("recipe");
    let recipe = d.join("recipe.py");
    std::fs::write(&recipe, readme_recipe()).unwrap();
    let inject = ["--inject", "drop", "--inject", "stale", "--inject", "misroute", "--inject", "bitflip", "--inject", "torn"];
    let runs: [(&str, &[&str]); 3] = [
        (
            "bd>bp tp1>2",
            &[
                "--layout",
                "hnd",
                "--block-size",
                "16",
                "--decode-block-size",
                "32",
                "--prefill-tp",
                "1",
                "--decode-tp",
                "2",
                "--kv-heads",
                "4",
            ],
        ),
        (
            "bp>bd tp2>4 gqa",
            &[
                "--layout",
                "hnd",
                "--block-size",
                "32",
                "--decode-block-size",
                "16",
                "--prefill-tp",
                "2",
                "--decode-tp",
                "4",
                "--kv-heads",
                "2",
                "--seed",
                "0xfffffffffffffff1",
            ],
        ),
        (
            "mla tp2>2",
            &["--mla", "--block-size", "16", "--decode-block-size", "8", "--prefill-tp", "2", "--decode-tp", "2", "--seed", "0"],
        ),
    ];
    for (name, extra) in runs {
        let mut args = vec!["--blocks", "16", "--layers", "2", "--iterations", "2"];
        args.extend_from_slice(&inject);
        args.extend_from_slice(extra);
        let (code, r, log) = crate::common::run_with_report(&format!("recipe-{}", name.replace([' ', '>'], "-")), "dram", &args);
        assert_eq!(code, 1, "{name}: {log}");
        let report = d.join(format!("{}.json", name.replace([' ', '>'], "-")));
        std::fs::write(&report, serde_json::to_vec(&r).unwrap()).unwrap();
        let o = std::process::Command::new("python3").arg(&recipe).arg(&report).output().expect("python3 runs");
        assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
        let lines: Vec<String> = String::from_utf8(o.stdout).unwrap().lines().map(String::from).collect();
        let failures = r["failures"].as_array().unwrap();
        assert_eq!(lines.len(), failures.len(), "{name}: one line per failure");
        let c = &r["config"];
        let g = &c["geometry"];
        let dg = &c["decode_geometry"];
        assert!(dg.is_object() || c["tp"].is_object(), "{name}: {c}");
        let mut naive_wrong = 0;
        for (f, line) in failures.iter().zip(&lines) {
            let a: Vec<&str> = line.split_whitespace().collect();
            let (code, out, err) = fingerprint_ref(&a);
            assert_eq!((code, out.trim()), (0, f["expected_digest"].as_str().unwrap()), "{name}: {line} for {f}: {err}");
            // The recipe read as "config.geometry, head 0": another digest somewhere.
            let mla = g["mla"] == true;
            let dtype = if g["dtype"] == "fp32" {
                4
            } else if g["dtype"] == "fp8" {
                1
            } else {
                2
            };
            let e = &f["expected"];
            let naive = [
                c["seed_hex"].as_str().unwrap().to_string(),
                e["layer"].to_string(),
                e["kv"].as_str().unwrap().to_string(),
                e["block"].to_string(),
                e["generation"].to_string(),
                if mla { "mla".to_string() } else { g["layout"].as_str().unwrap().to_string() },
                g["block_size"].to_string(),
                if mla { "1".to_string() } else { g["num_kv_heads"].to_string() },
                (g["head_size"].as_u64().unwrap() * dtype).to_string(),
                e["token_base"].as_u64().unwrap_or(0).to_string(),
                "0".to_string(),
            ];
            let naive: Vec<&str> = naive.iter().map(String::as_str).collect();
            let (_, out, _) = fingerprint_ref(&naive);
            naive_wrong += (out.trim() != f["expected_digest"].as_str().unwrap()) as usize;
            // docs/fingerprint.md "Logical block ids": prefill slot i holds f(i div (G/Bp)).
            let (bp, bd) = (
                g["block_size"].as_u64().unwrap(),
                if dg.is_object() { dg["block_size"].as_u64().unwrap() } else { g["block_size"].as_u64().unwrap() },
            );
            let i = (f["prefill_block"].as_u64().unwrap() / (bp.max(bd) / bp)) as u32;
            let seed = c["seed"].as_u64().unwrap();
            let id = i.wrapping_mul(0x9E37_79B1) ^ (seed as u32).rotate_left(7);
            assert_eq!(e["block"].as_u64(), Some(id as u64), "{name}: {f}");
        }
        assert!(naive_wrong > 0, "{name}: the run does not tell the decode geometry and head base from prefill's");
    }
}
