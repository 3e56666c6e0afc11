//! Classifying a corrupt block slice: what it holds instead of the expected block.
//!
//! The pool's verify pass ([`crate::pool::KvPool::verify`]) finds slices whose bytes differ
//! from the fingerprint; this module looks at one such slice on the host and attributes
//! each 512-byte sector (the last one may be as short as 16 bytes: its tag alone) to the
//! first of these sources that fits, exact matches before approximate ones:
//!
//! 1. `expected` — the expected fingerprint, exactly;
//! 2. `poison` — exactly this iteration's poison for this slot (nothing arrived);
//! 3. another identity's intact fingerprint, named by the sector's tag, exactly;
//! 4. `expected(N bits flipped)` — the expected fingerprint with 1 to
//!    [`BITFLIP_MAX_BITS_PER_SECTOR`] bits flipped in this sector;
//! 5. `expected+poison within the sector` — every 4-byte element either expected or poison
//!    (both present), at most one element neither: a tear inside the sector;
//! 6. `unknown` — none of these.
//!
//! The order matters in short sectors: a 16-byte sector has one hashed word (the check), and
//! the poison's even elements are the slot number, a small integer like the tag's block id
//! and generation, so an old generation's or another block's exact tag can also be within a
//! few bits of the expected one, or look like expected and poison split inside the sector.
//! An injected fault is classified as predicted on every slice size: a one-bit flip never
//! turns a sector into poison (poison differs from every fingerprint sector in at least two
//! bits: the top byte of element 1 is 0x5A, not 0x4B) nor into another identity's valid tag
//! (the tag key is a bijection of each of block, layer/K/V and generation, and the check
//! word is a bijection of the key), and a tear at a 16-byte boundary leaves every tag whole.
//!
//! The slice's [`Class`] follows: all expected with flips → `bitflip`; all poison →
//! `unwritten`; all one other identity → `stale` (same layer, K/V and logical block, other
//! generation) or `misplaced` (another block); several sources → `torn` (with the sector
//! map); nothing recognisable → `garbage`.

pub mod rows;

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
    /// A write into a decode slot outside its own transfer, found by the pipelined sweep's
    /// stray-write checks (never by the classification below): the slot no longer held its
    /// poison right before its stage was posted again, or no longer held the fingerprint it
    /// had verified clean while later stages were still in flight.
    Stray,
}

impl Class {
    /// All classes, in report order.
    pub const ALL: [Class; 7] =
        [Class::Unwritten, Class::Stale, Class::Misplaced, Class::Torn, Class::Bitflip, Class::Garbage, Class::Stray];

    /// The class's name as used in reports and `--inject`.
    pub fn name(self) -> &'static str {
        match self {
            Class::Unwritten => "unwritten",
            Class::Stale => "stale",
            Class::Misplaced => "misplaced",
            Class::Torn => "torn",
            Class::Bitflip => "bitflip",
            Class::Garbage => "garbage",
            Class::Stray => "stray",
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
        // Exact matches first (the expected bytes, this slot's poison, another identity's
        // fingerprint named by the sector's tag), then the approximate ones (a few flipped
        // bits, a tear inside the sector). In a short sector (a 16-byte one is its tag alone)
        // the approximate tests alone are ambiguous: the poison's even elements are the slot
        // number, a small integer like the tag's block id and generation, so a stale or
        // misplaced tag could pass for "expected and poison split inside the sector", and
        // its one random word (the check) for a few flipped bits of the expected one.
        let mut other = || {
            let id = fingerprint::decode_tag(actual, seed, s as u32).filter(|id| *id != expected)?;
            if !others.iter().any(|(i, _)| *i == id) {
                others.push((id, fingerprint::expected(actual.len(), seed, id)));
            }
            let bytes = &others.iter().find(|(i, _)| *i == id).expect("just added").1;
            (got == &bytes[range.clone()]).then_some(id)
        };
        let src = if h == 0 {
            Source::Expected(0)
        } else if got == &poison[range.clone()] {
            Source::Poison
        } else if let Some(id) = other() {
            Source::Other(id)
        } else if h <= BITFLIP_MAX_BITS_PER_SECTOR {
            Source::Expected(h)
        } else if split_within(got, exp, &poison[range.clone()]) {
            Source::Mixed
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

/// Which written contents explain a corrupt slice (scenario attribution, README
/// "Attribution"). `actual` is the slice as decode holds it, `want` its expected bytes and
/// `written` the fingerprints of every content its source block held during the READ window
/// (the content when the READ was posted, then each write made before it completed; for a
/// tier load, the entry's content), all slice-sized.
///
/// Returns `None` when some 4-byte element of `actual` is not the element at that offset of
/// any `written` content: this iteration's poison (a partial delivery), a flipped bit,
/// garbage, or an identity never written in the window — nothing a race can produce. Else,
/// per `written` content, how many of the elements that differ from `want` (the wrong data)
/// it matches. Elements, not sectors, so that a tear inside a sector (a copy racing a write
/// lands whole aligned elements of each) is still explained; a whole sector of one content
/// is the common case. A tag element (block id, generation) is a small integer that two
/// contents can share, so a fault confined to one such element that turns it into the same
/// element of another content written in the window cannot be told from a tear; every
/// other element is a 32-bit hash of the identity.
pub fn explained_by(actual: &[u8], want: &[u8], written: &[Vec<u8>]) -> Option<Vec<usize>> {
    let mut used = vec![0; written.len()];
    for (e, got) in actual.chunks(4).enumerate() {
        let at = e * 4..e * 4 + got.len();
        let wrong = want.get(at.clone()) != Some(got);
        let mut any = false;
        for (j, w) in written.iter().enumerate() {
            if w.get(at.clone()) == Some(got) {
                any = true;
                used[j] += wrong as usize;
            }
        }
        if !any {
            return None;
        }
    }
    Some(used)
}
