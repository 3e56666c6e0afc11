//! Fingerprint vectors (from the independent reference scripts/fingerprint_ref.py),
//! tag decoding, checking and classification on the CPU.

use kvprobe::fingerprint::{self, BlockIdentity};
use kvprobe::geometry::KvPart;
use kvprobe::verify::{Class, classify};

fn id(layer: u32, kv: KvPart, block: u32, generation: u32) -> BlockIdentity {
    BlockIdentity { layer, kv, block, generation }
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
    // Walk across the boundary: every value produced is in 1..SKIP_GEN.
    let mut g = u32::MAX - 5;
    for _ in 0..10 {
        g = next_generation(g);
        assert!(g != 0 && g != SKIP_GEN, "{g}");
    }
    assert_eq!(g, 6);
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

// ---- Issue 12.6: the README's spec, re-implemented here from the README alone ----

/// README "Fingerprint format", independently of csrc/fingerprint.h.
pub(crate) mod spec {
    pub fn fmix32(mut h: u32) -> u32 {
        h ^= h >> 16;
        h = h.wrapping_mul(0x85EB_CA6B);
        h ^= h >> 13;
        h = h.wrapping_mul(0xC2B2_AE35);
        h ^ (h >> 16)
    }

    /// The fingerprint of (seed, layer, kv code, logical block, generation), `len` bytes.
    pub fn fingerprint(seed: u64, layer: u32, kv: u32, block: u32, generation: u32, len: usize) -> Vec<u8> {
        let seed32 = fmix32(seed as u32 ^ fmix32((seed >> 32) as u32 ^ 0x6B76_7062));
        let lkv = layer | kv << 16 | 0x4B << 24;
        let key = fmix32(seed32 ^ fmix32(block ^ fmix32(lkv ^ fmix32(generation ^ 0x9E37_79B9))));
        let elem = |e: u32| match e % 128 {
            0 => block,
            1 => lkv,
            2 => generation,
            3 => fmix32(key ^ (e / 128).wrapping_mul(0x85EB_CA77)),
            _ => fmix32(key ^ e.wrapping_mul(0x9E37_79B9)),
        };
        (0..len as u32 / 4).flat_map(|e| elem(e).to_le_bytes()).collect()
    }

    /// The poison of `slot` in `iteration`, `len` bytes.
    pub fn poison(slot: u32, iteration: u32, len: usize) -> Vec<u8> {
        (0..len / 4).flat_map(|e| if e % 2 == 0 { slot } else { 0x5A00_0000 | (iteration & 0xFF_FFFF) }.to_le_bytes()).collect()
    }

    /// The global slice index of decode slot (layer, kv, block) in the README's table.
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

/// Checks every failure of `r` against the README's spec: the slot formula, both digests
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
            let m = |k: &str| i[k].as_u64().unwrap() as u32;
            spec::fingerprint(seed, m("layer"), spec::kv_code(i["kv"].as_str().unwrap()), m("block"), m("generation"), len)
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

/// Issue 12.6: a re-implementation written from the README alone reproduces the bytes
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
        // Torn failures: their sector map in the documented format.
        for f in r["failures"].as_array().unwrap().iter().filter(|f| f["class"] == "torn") {
            let runs = f["sectors"].as_array().unwrap();
            let sectors = (r["config"]["geometry"]["slice_bytes"].as_u64().unwrap()).div_ceil(512);
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

fn fingerprint_ref(args: &[&str]) -> (i32, String, String) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/fingerprint_ref.py");
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
        (&["1", "3", "1", "17", "5", "0"][..], "SLICE_BYTES must be from 16"),
        (&["1", "3", "1", "17", "5", "4095"][..], "multiple of 16"),
        (&["1", "3", "1", "17", "5", "8"][..], "SLICE_BYTES must be from 16"),
        (&["1", "3", "1", "17", "5", "4294967296"][..], "SLICE_BYTES must be from 16"),
        (&["18446744073709551616", "3", "1", "17", "5", "32"][..], "SEED must be from 0 to 18446744073709551615"),
        (&["0x10000000000000000", "3", "1", "17", "5", "32"][..], "SEED must be from 0"),
        (&["-1", "3", "1", "17", "5", "32"][..], "SEED must be a non-negative"),
        (&["1.5", "3", "1", "17", "5", "32"][..], "SEED must be a non-negative"),
        (&["1", "65536", "1", "17", "5", "32"][..], "LAYER must be from 0 to 65535"),
        (&["1", "-3", "1", "17", "5", "32"][..], "LAYER must be a non-negative"),
        (&["1", "3", "3", "17", "5", "32"][..], "KV must be one of"),
        (&["1", "3", "1", "4294967296", "5", "32"][..], "BLOCK must be from 0 to 4294967295"),
        (&["1", "3", "1", "17", "4294967296", "32"][..], "GENERATION must be from 0 to 4294967295"),
        (&["1", "3", "1", "17", "5"][..], "expected SEED"),
        (&["1", "3", "1", "17", "5", "32", "out", "extra"][..], "expected SEED"),
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
    let want = fingerprint::expected(528, seed, id(65535, KvPart::Latent, u32::MAX, 3));
    let (code, out, err) = fingerprint_ref(&["0xfffffffffffffff1", "65535", "latent", "0xffffffff", "3", "528"]);
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
