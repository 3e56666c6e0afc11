//! Fingerprint version 2 (by position): vectors of the Python reference, an independent
//! re-implementation of csrc/fingerprint.h's comment, tags that name every row, and the
//! property issue 18 needs: a verbatim copy between NHD and HND no longer verifies.

use kvprobe::fingerprint::v2::{self, RowIdentity, RowOrder, SliceRows};
use kvprobe::fingerprint::{self, BlockIdentity};
use kvprobe::geometry::{Dtype, Geometry, KvPart, Layout};

fn id(layer: u32, kv: KvPart, block: u32, generation: u32) -> BlockIdentity {
    BlockIdentity { layer, kv, block, generation }
}

#[allow(clippy::too_many_arguments)]
fn rows(
    slice: BlockIdentity,
    order: RowOrder,
    block_size: u32,
    heads: u32,
    row_bytes: u32,
    token_base: u32,
    head_base: u32,
) -> SliceRows {
    SliceRows { slice, token_base, head_base, order, block_size, heads, row_bytes }
}

/// The header comment of csrc/fingerprint.h ("Fingerprint version 2"), re-implemented from
/// the text alone.
mod spec {
    use crate::fingerprint::spec::fmix32;

    #[allow(clippy::too_many_arguments)]
    pub fn slice(
        seed: u64,
        layer: u32,
        kv: u32,
        block: u32,
        gen_: u32,
        order: &str,
        bs: u32,
        heads: u32,
        row_bytes: u32,
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
            let pos = (tb + t) | (hb + h) << 16;
            let lkv = |u: u32| layer | kv << 16 | u << 18 | 0x4C << 24;
            let rkey = fmix32(seed32 ^ fmix32(block ^ fmix32(lkv(0) ^ fmix32(pos ^ fmix32(gen_ ^ 0x9E37_79B9)))));
            for i in 0..row_bytes / 4 {
                let (u, w) = (i / 128, i % 128);
                let v = match w {
                    0 => block,
                    1 => lkv(u),
                    2 => gen_,
                    3 => pos,
                    4 => fmix32(rkey ^ (u + 1).wrapping_mul(0x85EB_CA77)),
                    _ => fmix32(rkey ^ i.wrapping_mul(0x9E37_79B9)),
                };
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        out
    }
}

#[test]
fn vectors_match_the_python_reference() {
    // scripts/fingerprint_ref.py v2 SEED LAYER KV BLOCK GENERATION ORDER BLOCK_SIZE HEADS ROW_BYTES TOKEN_BASE HEAD_BASE
    let hex = "955dcd9a160bc3581a296b5f1301e61a97596d0e841eb397192a2246a6b86e89";
    let big = id(60, KvPart::Latent, 4_000_000_000, 4_294_967_294);
    let cases: Vec<(u64, SliceRows, &str)> = vec![
        (
            1,
            rows(id(3, KvPart::V, 17, 5), RowOrder::Nhd, 16, 2, 128, 0, 0),
            "e8c0dea88ba9ce7fa27f7197e71178965ac56fc2c5b67d71f4a6f7eecf949491",
        ),
        (
            1,
            rows(id(3, KvPart::V, 17, 5), RowOrder::Hnd, 16, 2, 128, 0, 0),
            "fffd2accf754095064c3470468c20b6a9c692497884600825b3b72a16a7802ea",
        ),
        (0xdead_beef_cafe_f00d, rows(big, RowOrder::Mla, 64, 1, 1152, 0, 0), hex),
        (
            9,
            rows(id(0, KvPart::K, 5, 1), RowOrder::Nhd, 8, 4, 16, 24, 12),
            "ec2429dbce325dd96a409d81fc9d0517cabc49a9169dfea5839b3f721f390d4c",
        ),
        (
            9,
            rows(id(0, KvPart::K, 5, 1), RowOrder::Hnd, 4, 3, 2064, 32, 4),
            "8d69434d1248dcb2f8da0bc41d3727efaaf0732bf0b4621afbdd81ad8a343d7e",
        ),
    ];
    for (seed, r, digest) in cases {
        assert_eq!(fingerprint::digest(&v2::expected(seed, &r)), digest, "{r:?}");
    }
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
        // Rows of one unit, of several (512-byte units, the last shorter) and of 16 bytes.
        let row_bytes = [16, 32, 48, 128, 256, 512, 528, 1152, 2064][next(9) as usize];
        let (tb, hb) = (next(1000) as u32, if order == RowOrder::Mla { 0 } else { next(100) as u32 });
        let seed = next(u64::MAX);
        let r = rows(slice, order, bs, heads, row_bytes, tb, hb);
        r.validate().unwrap();
        let got = v2::expected(seed, &r);
        let name = match order {
            RowOrder::Nhd => "nhd",
            RowOrder::Hnd => "hnd",
            RowOrder::Mla => "mla",
        };
        let want = spec::slice(seed, slice.layer, kv.code(), slice.block, slice.generation, name, bs, heads, row_bytes, tb, hb);
        assert_eq!(got, want, "case {case}: {r:?} seed {seed}");
        assert_eq!(v2::check(&got, seed, &r), (0, got.len() as u64));
        if case % 12 == 0 {
            let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/fingerprint_ref.py");
            let args: Vec<String> = [
                "v2".to_string(),
                seed.to_string(),
                slice.layer.to_string(),
                kv.to_string(),
                slice.block.to_string(),
                slice.generation.to_string(),
                name.into(),
                bs.to_string(),
                heads.to_string(),
                row_bytes.to_string(),
                tb.to_string(),
                hb.to_string(),
            ]
            .into();
            let o = std::process::Command::new("python3").arg(script).args(&args).output().expect("python3 runs");
            assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
            assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), fingerprint::digest(&got), "{args:?}");
        }
    }
}

#[test]
fn every_unit_names_its_row_and_unit() {
    for (order, bs, heads, row_bytes) in
        [(RowOrder::Nhd, 16, 4, 256), (RowOrder::Hnd, 16, 4, 256), (RowOrder::Mla, 8, 1, 1152), (RowOrder::Nhd, 2, 3, 16)]
    {
        let r = rows(
            id(7, if order == RowOrder::Mla { KvPart::Latent } else { KvPart::V }, 99, 4),
            order,
            bs,
            heads,
            row_bytes,
            32,
            if order == RowOrder::Mla { 0 } else { 8 },
        );
        let bytes = v2::expected(42, &r);
        for row in 0..bs * heads {
            for unit in 0..row_bytes.div_ceil(v2::UNIT_BYTES) {
                let off = row as u64 * row_bytes as u64 + (unit * v2::UNIT_BYTES) as u64;
                assert_eq!(
                    v2::decode_tag(&bytes, 42, off, row_bytes),
                    Some((r.row(row), unit)),
                    "{order:?} row {row} unit {unit}"
                );
            }
        }
        assert_eq!(v2::observed_rows(&bytes, 42, row_bytes), (0..bs * heads).map(|i| Some(r.row(i))).collect::<Vec<_>>());
    }
    // The positions: NHD row t·heads+h, HND row h·block_size+t, both offset by the bases.
    let nhd = rows(id(0, KvPart::K, 1, 1), RowOrder::Nhd, 16, 4, 128, 32, 8);
    assert_eq!((nhd.row(4 * 3 + 2).token, nhd.row(4 * 3 + 2).head), (32 + 3, 8 + 2));
    let hnd = SliceRows { order: RowOrder::Hnd, ..nhd };
    assert_eq!((hnd.row(16 * 2 + 3).token, hnd.row(16 * 2 + 3).head), (32 + 3, 8 + 2));
}

#[test]
fn a_verbatim_copy_between_nhd_and_hnd_fails_and_names_the_rows_it_holds() {
    let g = Geometry {
        num_layers: 2,
        num_kv_heads: 4,
        head_size: 64,
        block_size: 16,
        num_blocks: 8,
        dtype: Dtype::Bf16,
        layout: Layout::Nhd,
        mla: false,
    };
    let slice = id(1, KvPart::K, 12345, 7);
    let prefill = SliceRows::of(&g, slice);
    let decode = SliceRows::of(&Geometry { layout: Layout::Hnd, ..g.clone() }, slice);
    assert_eq!((prefill.len(), decode.len()), (16 * 4 * 128, 16 * 4 * 128));
    let copied = v2::expected(3, &prefill);
    let (bad, first) = v2::check(&copied, 3, &decode);
    assert!(bad > 0, "a verbatim NHD → HND copy must not verify");
    // Row 0 (token 0, head 0) is the same in both orders; row 1 is not, and its tag's first
    // three words (block, layer/K/V/unit, generation) agree: the position word (bytes 12..16)
    // is the first to differ.
    assert_eq!(first, 128 + 12);
    let seen = v2::observed_rows(&copied, 3, 128);
    let mut misplaced = 0;
    for (r, got) in seen.iter().enumerate() {
        let got = got.expect("every row of a verbatim copy carries a valid tag");
        assert_eq!(got, prefill.row(r as u32), "the bytes hold prefill's row {r}");
        assert_eq!(got.slice, slice, "right block, layer, K/V and generation");
        if got != decode.row(r as u32) {
            misplaced += 1;
        }
    }
    // Of 64 rows only those with t·4 + h = h·16 + t (t = 5h) stay in place: (t, h) = (0, 0),
    // (5, 1), (10, 2), (15, 3).
    assert_eq!(misplaced, 64 - 4);
    // With one head (or one token) NHD and HND are the same bytes.
    let one = Geometry { num_kv_heads: 1, ..g.clone() };
    let a = v2::expected(3, &SliceRows::of(&one, slice));
    assert_eq!(v2::check(&a, 3, &SliceRows::of(&Geometry { layout: Layout::Hnd, ..one }, slice)).0, 0);
    // Version 1 could not see it: its bytes depend on the offset alone.
    let v1 = fingerprint::expected(prefill.len() as usize, 3, slice);
    assert_eq!(fingerprint::check(&v1, 3, slice).0, 0);
}

#[test]
fn a_decode_block_half_the_prefill_block_and_a_tp_rank_name_their_rows() {
    // Prefill block 32 tokens, 8 heads (TP 1); decode block 16 tokens, TP 2 (4 heads per rank).
    let slice = id(0, KvPart::V, 77, 3);
    let prefill = rows(slice, RowOrder::Nhd, 32, 8, 256, 0, 0);
    let bytes = v2::expected(11, &prefill);
    // Decode rank 1's second block: tokens 16..32, heads 4..8 of prefill's block, NHD. Cut
    // from prefill's rows as a heterogeneous-TP READ would (row by row).
    let decode = rows(slice, RowOrder::Nhd, 16, 4, 256, 16, 4);
    let mut gathered = Vec::new();
    for t in 16..32u32 {
        for h in 4..8u32 {
            let r = (t * 8 + h) as usize * 256;
            gathered.extend_from_slice(&bytes[r..r + 256]);
        }
    }
    assert_eq!(v2::check(&gathered, 11, &decode), (0, gathered.len() as u64));
    // The wrong head offset (heads 0..4: rank 0's) is caught and named.
    let mut wrong = Vec::new();
    for t in 16..32u32 {
        for h in 0..4u32 {
            let r = (t * 8 + h) as usize * 256;
            wrong.extend_from_slice(&bytes[r..r + 256]);
        }
    }
    assert!(v2::check(&wrong, 11, &decode).0 > 0);
    let first = v2::observed_rows(&wrong, 11, 256)[0].unwrap();
    assert_eq!((first.token, first.head), (16, 0));
    assert_eq!((decode.row(0).token, decode.row(0).head), (16, 4));
}

#[test]
fn tags_are_not_confused_with_poison_version_1_or_flipped_bits() {
    let r = rows(id(5, KvPart::K, 1000, 9), RowOrder::Nhd, 4, 2, 256, 0, 0);
    let bytes = v2::expected(77, &r);
    // Poison, whatever the slot and iteration, is never a version-2 tag.
    for (slot, it) in [(0u32, 0u32), (1, 1), (0x4C00_0000, 3), (u32::MAX - 1, 0xFF_FFFF)] {
        let mut p = vec![0u8; bytes.len()];
        fingerprint::poison(&mut p, slot, it);
        assert!(v2::observed_rows(&p, 77, 256).iter().all(Option::is_none), "poison {slot} {it}");
    }
    // Version-1 bytes carry version-1 tags (0x4B), never a version-2 one, and the reverse.
    let v1 = fingerprint::expected(bytes.len(), 77, r.slice);
    assert!(v2::observed_rows(&v1, 77, 256).iter().all(Option::is_none));
    assert_eq!(fingerprint::observed_identity(&bytes, 77, 0), None);
    // Another seed's row is no valid tag (the check word binds the seed).
    assert!(v2::observed_rows(&bytes, 78, 256).iter().all(Option::is_none));
    // A single flipped bit in a tag or its check word never names another row.
    for row in 0..8u64 {
        for bit in 0..160 {
            let mut b = bytes.clone();
            b[(row * 256) as usize + bit / 8] ^= 1 << (bit % 8);
            assert_eq!(v2::decode_tag(&b, 77, row * 256, 256), None, "row {row} bit {bit}");
        }
    }
}

#[test]
fn what_version_2_cannot_encode_is_refused() {
    let ok = rows(id(0, KvPart::K, 0, 0), RowOrder::Nhd, 16, 8, 256, 0, 0);
    ok.validate().unwrap();
    for (bad, why) in [
        (SliceRows { row_bytes: 8, ..ok }, "multiple of 16"),
        (SliceRows { row_bytes: 40, ..ok }, "multiple of 16"),
        (SliceRows { row_bytes: v2::MAX_ROW_BYTES + 16, ..ok }, "multiple of 16 from 16 to 32768"),
        (SliceRows { token_base: 65530, ..ok }, "16-bit token"),
        (SliceRows { head_base: 65530, ..ok }, "16-bit head"),
        (SliceRows { heads: 0, ..ok }, "at least one"),
        (SliceRows { order: RowOrder::Mla, ..ok }, "one latent row per token"),
        (SliceRows { order: RowOrder::Mla, heads: 1, head_base: 3, ..ok }, "head 0"),
    ] {
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains(why), "{bad:?}: {e}");
    }
    let r: RowIdentity = ok.row(0);
    assert_eq!((r.token, r.head), (0, 0));
}

mod rows_classified {
    use super::*;
    use kvprobe::verify::rows::{Displacement, RowClass, RowSource, classify_rows};

    const SEED: u64 = 5;

    fn hnd_and_nhd() -> (SliceRows, SliceRows) {
        let slice = id(2, KvPart::V, 4242, 9);
        let nhd = rows(slice, RowOrder::Nhd, 16, 4, 128, 0, 0);
        (nhd, SliceRows { order: RowOrder::Hnd, ..nhd })
    }

    #[test]
    fn nhd_bytes_read_as_hnd_are_layout_transposed_with_row_identities() {
        let (nhd, hnd) = hnd_and_nhd();
        let v = classify_rows(&v2::expected(SEED, &nhd), &hnd, SEED, 7, 1);
        assert_eq!(v.class, RowClass::Layout);
        assert_eq!(v.displacement, Some(Displacement::Transposed));
        let wrong: Vec<_> = v.wrong_rows(&hnd).collect();
        assert_eq!(wrong.len(), 60, "all rows but the 4 fixed points");
        // Slot 1 of the HND slice is due (token 1, head 0) and holds NHD's row 1 (token 0, head 1).
        let (r, due, got) = wrong[0];
        assert_eq!((r, due.token, due.head), (1, 1, 0));
        match got {
            RowSource::Row(id) => assert_eq!((id.token, id.head), (0, 1)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_wrong_head_or_token_offset_is_named() {
        let slice = id(0, KvPart::K, 77, 3);
        // TP: rank 1 of 2 is due heads 4..8 and got rank 0's heads 0..4.
        let due = rows(slice, RowOrder::Hnd, 16, 4, 256, 0, 4);
        let got = v2::expected(SEED, &SliceRows { head_base: 0, ..due });
        let v = classify_rows(&got, &due, SEED, 0, 1);
        assert_eq!((v.class, v.displacement), (RowClass::Layout, Some(Displacement::HeadOffset(-4))));
        // Block sizes: the second half (tokens 16..32) of a 32-token prefill block was due, the
        // first half came.
        let due = rows(slice, RowOrder::Nhd, 16, 4, 256, 16, 0);
        let got = v2::expected(SEED, &SliceRows { token_base: 0, ..due });
        let v = classify_rows(&got, &due, SEED, 0, 1);
        assert_eq!((v.class, v.displacement), (RowClass::Layout, Some(Displacement::TokenOffset(-16))));
        // MLA rows shifted by one token.
        let mla = rows(id(5, KvPart::Latent, 1, 1), RowOrder::Mla, 8, 1, 1152, 1, 0);
        let v = classify_rows(&v2::expected(SEED, &SliceRows { token_base: 0, ..mla }), &mla, SEED, 0, 1);
        assert_eq!((v.class, v.displacement), (RowClass::Layout, Some(Displacement::TokenOffset(-1))));
    }

    #[test]
    fn the_other_classes_row_by_row() {
        let (nhd, _) = hnd_and_nhd();
        let good = v2::expected(SEED, &nhd);
        let check = |bytes: &[u8], want: RowClass| {
            let v = classify_rows(bytes, &nhd, SEED, 11, 3);
            assert_eq!(v.class, want, "{:?}", &v.rows[..4]);
            v
        };
        let mut p = vec![0u8; good.len()];
        fingerprint::poison(&mut p, 11, 3);
        check(&p, RowClass::Unwritten);
        let mut flip = good.clone();
        flip[300] ^= 0x10;
        let v = check(&flip, RowClass::Bitflip);
        assert_eq!(v.rows[2], RowSource::Flipped(1));
        let other = v2::expected(SEED, &SliceRows { slice: id(2, KvPart::V, 1, 9), ..nhd });
        check(&other, RowClass::Misplaced);
        let old = v2::expected(SEED, &SliceRows { slice: id(2, KvPart::V, 4242, 8), ..nhd });
        check(&old, RowClass::Stale);
        let mut torn = good.clone();
        torn[..good.len() / 2].copy_from_slice(&p[..good.len() / 2]);
        check(&torn, RowClass::Torn);
        let garbage: Vec<u8> = (0..good.len()).map(|i| (i * 7 + 3) as u8).collect();
        check(&garbage, RowClass::Garbage);
        // Rows of another seed are not recognised as rows.
        check(&v2::expected(SEED + 1, &nhd), RowClass::Garbage);
    }
}
