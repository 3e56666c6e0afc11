//! Fingerprint vectors (from the independent reference scripts/fingerprint_ref.py),
//! tag decoding, checking and classification on the CPU.

use kvprobe::fingerprint::{self, BlockIdentity};
use kvprobe::geometry::KvPart;
use kvprobe::verify::{Class, classify};

fn id(layer: u32, kv: KvPart, block: u32, generation: u32) -> BlockIdentity {
    BlockIdentity { layer, kv, block, generation }
}

#[test]
fn vectors_match_the_python_reference() {
    // scripts/fingerprint_ref.py 1 3 1 17 5 4096
    let a = fingerprint::expected(4096, 1, id(3, KvPart::V, 17, 5));
    assert_eq!(fingerprint::digest(&a), "8e1b8e3c987ede63422b233ffc953101351c3e697cf59615548653a307a068a9");
    // scripts/fingerprint_ref.py 0xdeadbeefcafef00d 60 2 4000000000 4294967294 73728
    let b = fingerprint::expected(73728, 0xdead_beef_cafe_f00d, id(60, KvPart::Latent, 4_000_000_000, 4_294_967_294));
    assert_eq!(fingerprint::digest(&b), "d7326cd89fbe8e2a85cdab76230a0d5d9c214660fd08371c87423368cd5be992");
    // scripts/fingerprint_ref.py 1 3 1 17 5 32 (bytes shown by xxd)
    let c = fingerprint::expected(32, 1, id(3, KvPart::V, 17, 5));
    assert_eq!(
        c,
        [
            0x11, 0, 0, 0, 0x03, 0x00, 0x01, 0x4b, 0x05, 0, 0, 0, 0xf1, 0x54, 0x36, 0x23, 0xc6, 0xee, 0x0e, 0x26, 0xa4, 0xe8,
            0x75, 0xbd, 0x99, 0x1d, 0xd1, 0x14, 0xad, 0x7f, 0x05, 0xf8
        ]
    );
}

#[test]
fn every_input_changes_the_bytes_but_not_the_slot() {
    let base = id(1, KvPart::K, 9, 2);
    let a = fingerprint::expected(1024, 7, base);
    for other in [id(2, KvPart::K, 9, 2), id(1, KvPart::V, 9, 2), id(1, KvPart::K, 10, 2), id(1, KvPart::K, 9, 3)] {
        assert_ne!(a, fingerprint::expected(1024, 7, other), "{other:?}");
    }
    assert_ne!(a, fingerprint::expected(1024, 8, base), "seed");
    // The same inputs give the same bytes (no hidden slot or address input).
    assert_eq!(a, fingerprint::expected(1024, 7, base));
}

#[test]
fn tags_decode_in_every_sector_and_only_with_the_right_seed() {
    let want = id(12, KvPart::V, 123_456, 77);
    let s = fingerprint::expected(512 * 5 + 48, 99, want);
    for sector in 0..6 {
        assert_eq!(fingerprint::decode_tag(&s, 99, sector), Some(want), "sector {sector}");
        assert_eq!(fingerprint::decode_tag(&s, 98, sector), None, "wrong seed, sector {sector}");
    }
    assert_eq!(fingerprint::decode_tag(&s, 99, 6), None, "past the end");
    let mut p = vec![0u8; 1024];
    fingerprint::poison(&mut p, 5, 3);
    assert_eq!(fingerprint::decode_tag(&p, 99, 0), None);
}

#[test]
fn check_counts_bad_bytes_and_the_first_offset() {
    let want = id(0, KvPart::K, 1, 1);
    let mut s = fingerprint::expected(2048, 1, want);
    assert_eq!(fingerprint::check(&s, 1, want), (0, 2048));
    s[700] ^= 0x10;
    s[1500] ^= 0xff;
    assert_eq!(fingerprint::check(&s, 1, want), (2, 700));
}

#[test]
fn check_agrees_with_a_byte_by_byte_comparison() {
    // Tags, bodies and short last sectors: the sector-wise check must count exactly.
    let want = id(4, KvPart::V, 99, 3);
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for len in [16usize, 48, 512, 528, 4096 + 16] {
        let good = fingerprint::expected(len, 5, want);
        for hits in 1..=6 {
            let mut s = good.clone();
            for _ in 0..hits {
                let at = (next() % len as u64) as usize;
                s[at] ^= 1 << (next() % 8);
            }
            let bad = good.iter().zip(&s).filter(|(a, b)| a != b).count() as u64;
            let first = good.iter().zip(&s).position(|(a, b)| a != b).map_or(len as u64, |p| p as u64);
            assert_eq!(fingerprint::check(&s, 5, want), (bad, first), "len {len}, {hits} flips");
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

const SEED: u64 = 42;
const LEN: usize = 4096;

fn want() -> BlockIdentity {
    id(2, KvPart::K, 1000, 9)
}

#[test]
fn classify_bitflip_counts_bits() {
    let mut s = fingerprint::expected(LEN, SEED, want());
    s[100] ^= 0b101;
    s[3000] ^= 0x80;
    let v = classify(&s, want(), SEED, 7, 9);
    assert_eq!(v.class, Class::Bitflip);
    assert_eq!(v.bit_flips, Some(3));
    assert_eq!(v.observed, Some(want()));
}

#[test]
fn classify_unwritten_is_this_iterations_poison() {
    let mut s = vec![0u8; LEN];
    fingerprint::poison(&mut s, 7, 9);
    assert_eq!(classify(&s, want(), SEED, 7, 9).class, Class::Unwritten);
    // Another slot's poison is not this slot's: nothing recognisable.
    fingerprint::poison(&mut s, 8, 9);
    assert_eq!(classify(&s, want(), SEED, 7, 9).class, Class::Garbage);
}

#[test]
fn classify_stale_and_misplaced_name_what_arrived() {
    let old = BlockIdentity { generation: 8, ..want() };
    let v = classify(&fingerprint::expected(LEN, SEED, old), want(), SEED, 7, 9);
    assert_eq!((v.class, v.observed), (Class::Stale, Some(old)));
    let other = BlockIdentity { block: 1001, ..want() };
    let v = classify(&fingerprint::expected(LEN, SEED, other), want(), SEED, 7, 9);
    assert_eq!((v.class, v.observed), (Class::Misplaced, Some(other)));
    let other_layer = BlockIdentity { layer: 3, ..want() };
    assert_eq!(classify(&fingerprint::expected(LEN, SEED, other_layer), want(), SEED, 7, 9).class, Class::Misplaced);
}

#[test]
fn classify_torn_gives_the_sector_map() {
    let mut s = fingerprint::expected(LEN, SEED, want());
    let mut p = vec![0u8; LEN];
    fingerprint::poison(&mut p, 7, 9);
    s[1024..].copy_from_slice(&p[1024..]);
    let v = classify(&s, want(), SEED, 7, 9);
    assert_eq!(v.class, Class::Torn);
    let map: Vec<(u32, u32, String)> = v.sectors.unwrap().into_iter().map(|r| (r.first, r.last, r.source)).collect();
    assert_eq!(map, vec![(0, 1, "expected".to_string()), (2, 7, "poison".to_string())]);
    // A mix of two blocks names the foreign one.
    let other = BlockIdentity { block: 5, ..want() };
    let o = fingerprint::expected(LEN, SEED, other);
    let mut s = fingerprint::expected(LEN, SEED, want());
    s[2048..].copy_from_slice(&o[2048..]);
    let v = classify(&s, want(), SEED, 7, 9);
    assert_eq!((v.class, v.observed), (Class::Torn, Some(other)));
}

#[test]
fn classify_garbage_when_nothing_matches() {
    let s: Vec<u8> = (0..LEN).map(|i| (i * 7 + 3) as u8).collect();
    let v = classify(&s, want(), SEED, 7, 9);
    assert_eq!((v.class, v.observed), (Class::Garbage, None));
}

#[test]
fn classify_torn_inside_one_sector() {
    // Slices of 512 bytes or less are one sector: a tear inside it is still torn.
    for (len, cut) in [(512usize, 272usize), (64, 32), (4096, 1030)] {
        let mut s = fingerprint::expected(len, SEED, want());
        let mut p = vec![0u8; len];
        fingerprint::poison(&mut p, 7, 9);
        s[cut..].copy_from_slice(&p[cut..]);
        let v = classify(&s, want(), SEED, 7, 9);
        assert_eq!(v.class, Class::Torn, "len {len} cut {cut}");
    }
}

/// Every slice size the geometry accepts up to two sectors and a bit (16, 32, …, 1056 bytes:
/// one partial sector, one full sector, a full sector plus a 16-byte tail, …), every
/// injection class, seeds 1..=30, and poison slots chosen to coincide with the small
/// integers of the tag (block id, generation): each simulated fault is classified as its
/// injection predicts. (Issue 12.3: a stale 16-byte slice whose old generation equalled
/// the slot number was read as "expected+poison within the sector", i.e. torn.)
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
    for len in (16..=1056usize).step_by(16) {
        for seed in 1..=30u64 {
            let kv = if seed % 2 == 0 { KvPart::K } else { KvPart::V };
            // Small logical ids collide with slot numbers; large ones are the usual case.
            let block = if seed % 3 == 0 { kvprobe::run::logical_block(seed, seed as u32) } else { (seed % 5) as u32 };
            for it in 1..=4u32 {
                let want = id(0, kv, block, it);
                let stale = BlockIdentity { generation: it - 1, ..want };
                let other = BlockIdentity { block: block.wrapping_add(1), ..want };
                for slot in [it - 1, it, it + 1, block, block.wrapping_add(1), 1000] {
                    let good = fingerprint::expected(len, seed, want);
                    let mut poison = vec![0u8; len];
                    fingerprint::poison(&mut poison, slot, it);
                    let mut cases: Vec<(&str, Vec<u8>, Class, Option<BlockIdentity>)> = Vec::new();
                    let mut flipped = good.clone();
                    flipped[(next() % len as u64) as usize] ^= 1 << (next() % 8);
                    cases.push(("bitflip", flipped, Class::Bitflip, Some(want)));
                    cases.push(("drop", poison.clone(), Class::Unwritten, None));
                    cases.push(("misroute", fingerprint::expected(len, seed, other), Class::Misplaced, Some(other)));
                    cases.push(("stale", fingerprint::expected(len, seed, stale), Class::Stale, Some(stale)));
                    if len >= 32 {
                        // As inject::plan: a prefix of 16 * [1, len / 16) bytes arrived.
                        let cut = 16 * (1 + (next() % (len as u64 / 16 - 1)) as usize);
                        let mut torn = good.clone();
                        torn[cut..].copy_from_slice(&poison[cut..]);
                        cases.push(("torn", torn, Class::Torn, None));
                    }
                    for (kind, bytes, class, observed) in cases {
                        let v = classify(&bytes, want, seed, slot, it);
                        let observed_ok = observed.is_none() || v.observed == observed;
                        if v.class != class || !observed_ok {
                            failures.push(format!(
                                "len {len} seed {seed} iteration {it} slot {slot} {kind}: {} (observed {:?}, sectors {:?})",
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
        *by.entry(format!("len {} {}", w[1], w[8].trim_end_matches(':'))).or_default() += 1;
    }
    assert!(
        failures.is_empty(),
        "{} misclassified ({by:?}), e.g.:\n{}",
        failures.len(),
        failures[..failures.len().min(12)].join("\n")
    );
}
