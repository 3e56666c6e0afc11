//! Classifying a corrupt block slice: what it holds instead of the expected block.
//!
//! The pool's verify pass ([`crate::pool::KvPool::verify`]) finds slices whose bytes differ
//! from the fingerprint; this module looks at one such slice on the host and attributes
//! each 512-byte sector to a source:
//!
//! - `expected` — the expected fingerprint, exactly or with at most
//!   [`BITFLIP_MAX_BITS_PER_SECTOR`] bits flipped;
//! - `poison` — this iteration's poison for this slot (nothing arrived);
//! - another block's intact fingerprint, named by the sector's tag;
//! - `expected+poison within the sector` — a tear inside the sector;
//! - `unknown` — none of these.
//!
//! The slice's [`Class`] follows: all expected with flips → `bitflip`; all poison →
//! `unwritten`; all one other identity → `stale` (same layer, K/V and logical block, other
//! generation) or `misplaced` (another block); several sources → `torn` (with the sector
//! map); nothing recognisable → `garbage`.

use crate::fingerprint::{self, BlockIdentity, SECTOR_BYTES};
use serde::{Deserialize, Serialize};
use std::fmt;

/// At most this many differing bits in a sector still count as the expected block.
pub const BITFLIP_MAX_BITS_PER_SECTOR: u32 = 8;

/// What went wrong with a block slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Class {
    /// This iteration's poison is still there: nothing was written.
    Unwritten,
    /// The right block from an older generation.
    Stale,
    /// Another block's intact fingerprint.
    Misplaced,
    /// A mix of sources by sector.
    Torn,
    /// The expected block with a few bits flipped.
    Bitflip,
    /// None of the above.
    Garbage,
}

impl Class {
    /// All classes, in report order.
    pub const ALL: [Class; 6] = [Class::Unwritten, Class::Stale, Class::Misplaced, Class::Torn, Class::Bitflip, Class::Garbage];

    /// The class's name as used in reports and `--inject`.
    pub fn name(self) -> &'static str {
        match self {
            Class::Unwritten => "unwritten",
            Class::Stale => "stale",
            Class::Misplaced => "misplaced",
            Class::Torn => "torn",
            Class::Bitflip => "bitflip",
            Class::Garbage => "garbage",
        }
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The source of one sector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The expected fingerprint with this many bits flipped (0 = intact).
    Expected(u32),
    /// This iteration's poison for this slot.
    Poison,
    /// Another identity's intact fingerprint.
    Other(BlockIdentity),
    /// Part expected, part poison, split inside the sector (4-byte elements; at most one
    /// element mixes both at the byte level).
    Mixed,
    /// Unrecognised bytes.
    Unknown,
}

impl Source {
    fn label(&self) -> String {
        match self {
            Source::Expected(0) => "expected".into(),
            Source::Expected(n) => format!("expected({n} bits flipped)"),
            Source::Poison => "poison".into(),
            Source::Other(i) => format!("layer {} {} block {} gen {}", i.layer, i.kv, i.block, i.generation),
            Source::Mixed => "expected+poison within the sector".into(),
            Source::Unknown => "unknown".into(),
        }
    }
}

/// A run of consecutive sectors with one source (sector s covers bytes
/// `[512 s, 512 (s + 1))` of the slice).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SectorRun {
    /// First sector of the run.
    pub first: u32,
    /// Last sector of the run (inclusive).
    pub last: u32,
    /// Where these sectors came from.
    pub source: String,
}

/// The verdict on one corrupt slice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// The class.
    pub class: Class,
    /// The identity the slice (or its first foreign sector) actually holds, when decodable.
    pub observed: Option<BlockIdentity>,
    /// Flipped bits (bitflip only).
    pub bit_flips: Option<u64>,
    /// Per-sector sources (torn only).
    pub sectors: Option<Vec<SectorRun>>,
}

fn hamming(a: &[u8], b: &[u8]) -> u32 {
    a.iter().zip(b).map(|(x, y)| (x ^ y).count_ones()).sum()
}

/// Classifies `actual`, the bytes of destination slot `slot` (global slice index) in
/// iteration `iteration`, which should hold `expected`.
pub fn classify(actual: &[u8], expected: BlockIdentity, seed: u64, slot: u32, iteration: u32) -> Verdict {
    classify_against(actual, &fingerprint::expected(actual.len(), seed, expected), expected, seed, slot, iteration)
}

/// [`classify`] with the expected bytes `want` (the fingerprint of `expected`) already at hand.
pub fn classify_against(actual: &[u8], want: &[u8], expected: BlockIdentity, seed: u64, slot: u32, iteration: u32) -> Verdict {
    let mut poison = vec![0u8; actual.len()];
    fingerprint::poison(&mut poison, slot, iteration);
    let mut others: Vec<(BlockIdentity, Vec<u8>)> = Vec::new();
    let mut sources = Vec::new();
    for (s, (got, exp)) in actual.chunks(SECTOR_BYTES).zip(want.chunks(SECTOR_BYTES)).enumerate() {
        let range = s * SECTOR_BYTES..s * SECTOR_BYTES + got.len();
        let h = hamming(got, exp);
        let src = if h <= BITFLIP_MAX_BITS_PER_SECTOR {
            Source::Expected(h)
        } else if got == &poison[range.clone()] {
            Source::Poison
        } else if split_within(got, exp, &poison[range.clone()]) {
            Source::Mixed
        } else if let Some(id) = fingerprint::decode_tag(actual, seed, s as u32) {
            if !others.iter().any(|(i, _)| *i == id) {
                others.push((id, fingerprint::expected(actual.len(), seed, id)));
            }
            let bytes = &others.iter().find(|(i, _)| *i == id).unwrap().1;
            if got == &bytes[range] { Source::Other(id) } else { Source::Unknown }
        } else {
            Source::Unknown
        };
        sources.push(src);
    }
    verdict(&sources, expected)
}

/// True when `got` is `exp` in some 4-byte elements and `poison` in the others (both
/// present), with at most one element matching neither (a tear inside an element).
fn split_within(got: &[u8], exp: &[u8], poison: &[u8]) -> bool {
    let (mut e, mut p, mut x) = (0, 0, 0);
    for ((g, a), b) in got.chunks(4).zip(exp.chunks(4)).zip(poison.chunks(4)) {
        if g == a {
            e += 1;
        } else if g == b {
            p += 1;
        } else {
            x += 1;
        }
    }
    e > 0 && p > 0 && x <= 1
}

fn same_source(a: &Source, b: &Source) -> bool {
    match (a, b) {
        (Source::Expected(_), Source::Expected(_)) => true,
        _ => a == b,
    }
}

/// Turns per-sector sources into a verdict (see the module docs for the rules).
pub fn verdict(sources: &[Source], expected: BlockIdentity) -> Verdict {
    let mut known: Vec<Source> = Vec::new();
    let mut unknown = false;
    for s in sources {
        match s {
            Source::Unknown => unknown = true,
            s if !known.iter().any(|k| same_source(k, s)) => known.push(*s),
            _ => {}
        }
    }
    let first_other = sources.iter().find_map(|s| if let Source::Other(i) = s { Some(*i) } else { None });
    let plain = |class, observed| Verdict { class, observed, bit_flips: None, sectors: None };
    match (known.as_slice(), unknown) {
        ([], _) => plain(Class::Garbage, None),
        ([Source::Expected(_)], false) => {
            let bits: u64 = sources.iter().map(|s| if let Source::Expected(n) = s { *n as u64 } else { 0 }).sum();
            Verdict { class: Class::Bitflip, observed: Some(expected), bit_flips: Some(bits), sectors: None }
        }
        ([Source::Poison], false) => plain(Class::Unwritten, None),
        ([Source::Other(i)], false) => {
            let same_block = i.layer == expected.layer && i.kv == expected.kv && i.block == expected.block;
            plain(if same_block { Class::Stale } else { Class::Misplaced }, Some(*i))
        }
        _ => {
            let mut runs: Vec<SectorRun> = Vec::new();
            for (n, s) in sources.iter().enumerate() {
                let label = s.label();
                match runs.last_mut() {
                    Some(r) if r.source == label && r.last + 1 == n as u32 => r.last = n as u32,
                    _ => runs.push(SectorRun { first: n as u32, last: n as u32, source: label }),
                }
            }
            Verdict { class: Class::Torn, observed: first_other, bit_flips: None, sectors: Some(runs) }
        }
    }
}
