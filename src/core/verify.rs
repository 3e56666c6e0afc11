//! Classifying a corrupt block slice: what it holds instead of the expected rows.
//!
//! The pool's verify pass ([`crate::mem::pool::KvPool::verify`]) finds slices whose bytes differ
//! from the fingerprint; this module looks at one such slice on the host and attributes each
//! tagged **unit** — a head row, or 512 bytes of a longer row (the last unit of a row may be
//! as short as 32 bytes) — to the first of these sources that fits, exact matches before
//! approximate ones:
//!
//! 1. `expected` — the expected fingerprint, exactly;
//! 2. `poison` — exactly this iteration's poison for this slot (nothing arrived);
//! 3. another row's intact fingerprint (any slice, any token and head), named by the unit's
//!    tag, exactly;
//! 4. `expected(N bits flipped)` — the expected fingerprint with 1 to
//!    [`BITFLIP_MAX_BITS_PER_SECTOR`] bits flipped in this unit;
//! 5. `expected+poison within the sector` — every 4-byte element either expected or poison
//!    (both present), at most one element neither: a tear inside the unit;
//! 6. `unknown` — none of these.
//!
//! Every unit has a check word binding its tag's words to each other and to the seed, so a
//! flipped bit never turns a unit into another row's valid tag, and poison differs from every
//! tag in at least three bits (element 1's top byte: 0x5A, not 0x4C): an injected fault is
//! classified as predicted on every slice size.
//!
//! The slice's [`Class`] follows: all expected with flips → `bitflip`; all poison →
//! `unwritten`; every unit that is not expected a row of the expected slice (layer, K/V,
//! logical block, generation) at another position → `layout`, with the rows' displacement
//! when they share one (transposed NHD/HND, a head offset, a token offset) and the first wrong
//! rows; every unit one other slice's rows → `stale` (same layer, K/V and logical block, an
//! older generation), `overwritten` (the same block's newer generation: the source was
//! rewritten before the transfer read it) or `misplaced` (another block); several sources →
//! `torn` (with the unit map); nothing recognisable → `garbage`. Bytes that equal the expected
//! fingerprint in every unit are never `bitflip` (0 bits): they are `late` — the slice failed
//! the verify pass but the bytes classified are intact, so they changed after the verdict.

use crate::core::fingerprint::{self, BlockIdentity, RowIdentity, RowOrder, SliceRows};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;

/// At most this many differing bits in a unit still count as the expected rows.
pub const BITFLIP_MAX_BITS_PER_SECTOR: u32 = 8;

/// At most this many wrong rows are listed in a `layout` verdict ([`Verdict::rows`]).
pub const MAX_LISTED_ROWS: usize = 8;

/// What went wrong with a block slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Class {
    /// This iteration's poison is still there: nothing was written.
    Unwritten,
    /// The right block from an older generation.
    Stale,
    /// The right block from a newer generation than the one due: its source was overwritten
    /// (with the next generation) before the transfer read it — an overwrite race, not old
    /// data.
    Overwritten,
    /// Another block's intact fingerprint.
    Misplaced,
    /// The right block's rows at the wrong positions: the two sides disagree on the layout
    /// (NHD/HND), the TP rank's head offset or the block size's token offset.
    Layout,
    /// A mix of sources by unit.
    Torn,
    /// The expected block with a few bits flipped.
    Bitflip,
    /// None of the above.
    Garbage,
    /// A write into a decode slot outside its own transfer, found by the stray-write checks
    /// (never by the classification below): the slot no longer held its poison right before
    /// its sweep stage was posted again, or no longer held the fingerprint it had verified
    /// clean when judged again before its re-poison or at the end (sweeps and scenarios).
    Stray,
    /// The slice's bytes changed after the verify pass judged them: data that landed after
    /// its completion or notification, or a write after the verdict. The run classifies the
    /// bytes the verify pass judged (its snapshot); when the slice read again right after
    /// differs from them, the slice is `late` and the failure's `judged_class` keeps the class
    /// of the judged bytes. [`classify`] also returns it for bytes equal to the expected
    /// fingerprint (a slice that failed the verify but is intact when classified), never
    /// `bitflip` with 0 bits.
    Late,
}

impl Class {
    /// All classes, in report order.
    pub const ALL: [Class; 10] = [
        Class::Unwritten,
        Class::Stale,
        Class::Overwritten,
        Class::Misplaced,
        Class::Layout,
        Class::Torn,
        Class::Bitflip,
        Class::Garbage,
        Class::Stray,
        Class::Late,
    ];

    /// The class's name as used in reports and `--inject`.
    pub fn name(self) -> &'static str {
        match self {
            Class::Unwritten => "unwritten",
            Class::Stale => "stale",
            Class::Overwritten => "overwritten",
            Class::Misplaced => "misplaced",
            Class::Layout => "layout",
            Class::Torn => "torn",
            Class::Bitflip => "bitflip",
            Class::Garbage => "garbage",
            Class::Stray => "stray",
            Class::Late => "late",
        }
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The source of one unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The expected fingerprint with this many bits flipped (0 = intact).
    Expected(u32),
    /// This iteration's poison for this slot.
    Poison,
    /// Another row's intact fingerprint (the same unit of that row).
    Other(RowIdentity),
    /// Part expected, part poison, split inside the unit (4-byte elements; at most one
    /// element mixes both at the byte level).
    Mixed,
    /// Unrecognised bytes.
    Unknown,
}

impl Source {
    /// The label of the unit map: another row is named by its slice (runs of one slice's
    /// rows merge), `layer L K|V|latent block B gen G`.
    fn label(&self) -> String {
        match self {
            Source::Expected(0) => "expected".into(),
            Source::Expected(n) => format!("expected({n} bits flipped)"),
            Source::Poison => "poison".into(),
            Source::Other(r) => {
                let i = r.slice;
                format!("layer {} {} block {} gen {}", i.layer, i.kv, i.block, i.generation)
            }
            Source::Mixed => "expected+poison within the sector".into(),
            Source::Unknown => "unknown".into(),
        }
    }
}

/// A run of consecutive tagged units with one source (units counted from 0 in slice order:
/// row by row, a row's 512-byte units in order; with rows of at most 512 bytes, unit = row).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SectorRun {
    /// First unit of the run.
    pub first: u32,
    /// Last unit of the run (inclusive).
    pub last: u32,
    /// Where these units came from.
    pub source: String,
}

/// A row slot that holds another row of the right slice (`layout` verdicts).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WrongRow {
    /// Row index in the slice (its order: NHD `t × heads + h`, HND `h × block_size + t`).
    pub row: u32,
    /// Token due there (in the logical block).
    pub due_token: u32,
    /// Global KV head due there.
    pub due_head: u32,
    /// Token the slot holds.
    pub token: u32,
    /// Global KV head the slot holds.
    pub head: u32,
}

/// How the rows of a `layout` slice are displaced, when every wrong row shares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Displacement {
    /// The rows are those of the other row order (NHD bytes read as HND, or the reverse):
    /// slot `r` holds the row the other order puts at `r`.
    Transposed,
    /// Every wrong row holds the row `heads` global heads away (a TP rank's wrong head offset).
    HeadOffset(i64),
    /// Every wrong row holds the row `tokens` tokens away (unequal block sizes cut wrongly).
    TokenOffset(i64),
}

impl fmt::Display for Displacement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Displacement::Transposed => f.write_str("transposed (NHD rows read as HND, or HND as NHD)"),
            Displacement::HeadOffset(h) => write!(f, "head offset {h:+}"),
            Displacement::TokenOffset(t) => write!(f, "token offset {t:+}"),
        }
    }
}

/// The verdict on one corrupt slice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// The class.
    pub class: Class,
    /// The identity the slice (or its first foreign unit) actually holds, when decodable.
    pub observed: Option<BlockIdentity>,
    /// Flipped bits (bitflip only).
    pub bit_flips: Option<u64>,
    /// Per-unit sources (torn only).
    pub sectors: Option<Vec<SectorRun>>,
    /// The displacement every wrong row shares (layout only, when one does).
    pub displacement: Option<Displacement>,
    /// The first [`MAX_LISTED_ROWS`] wrong rows (layout only).
    pub rows: Option<Vec<WrongRow>>,
}

fn hamming(a: &[u8], b: &[u8]) -> u32 {
    a.iter().zip(b).map(|(x, y)| (x ^ y).count_ones()).sum()
}

/// Classifies `actual`, the bytes of destination slot `slot` (global slice index) in
/// iteration `iteration`, which should hold the rows `due` names. `actual` must be
/// `due.len()` bytes (panics otherwise, as [`fingerprint::fill`]).
pub fn classify(actual: &[u8], due: &SliceRows, seed: u64, slot: u32, iteration: u32) -> Verdict {
    classify_against(actual, &fingerprint::expected(seed, due), due, seed, slot, iteration)
}

/// [`classify`] with the expected bytes `want` (the fingerprint of `due`) already at hand.
pub fn classify_against(actual: &[u8], want: &[u8], due: &SliceRows, seed: u64, slot: u32, iteration: u32) -> Verdict {
    let mut poison = vec![0u8; actual.len()];
    fingerprint::poison(&mut poison, slot, iteration);
    let rb = due.shape.row_bytes;
    let mut rows_seen: HashMap<RowIdentity, Option<Vec<u8>>> = HashMap::new();
    let mut sources = Vec::new();
    let mut unit_rows = Vec::new();
    for (r, u, range) in due.shape.units() {
        if range.end > actual.len() || range.end > want.len() {
            break;
        }
        let (got, exp) = (&actual[range.clone()], &want[range.clone()]);
        let h = hamming(got, exp);
        // Exact matches first (the expected bytes, this slot's poison, another row named by
        // the unit's tag), then the approximate ones (a few flipped bits, a tear inside the
        // unit).
        let mut other = || {
            let (id, unit) = fingerprint::decode_tag(actual, seed, range.start as u64, rb)?;
            if unit != u || id == due.row(r) {
                return None;
            }
            let bytes = rows_seen.entry(id).or_insert_with(|| fingerprint::row_fingerprint(seed, id, rb)).as_ref()?;
            let at = (u * fingerprint::UNIT_BYTES) as usize;
            (bytes.get(at..at + got.len()) == Some(got)).then_some(id)
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
        unit_rows.push(r);
    }
    verdict(&sources, &unit_rows, due)
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

/// Same kind of source for the verdict: flips of any count, another row of one slice.
fn same_source(a: &Source, b: &Source) -> bool {
    match (a, b) {
        (Source::Expected(_), Source::Expected(_)) => true,
        (Source::Other(x), Source::Other(y)) => x.slice == y.slice,
        _ => a == b,
    }
}

/// Turns per-unit sources (`unit_rows[i]`: the row of unit `i`) into a verdict (see the
/// module docs for the rules).
pub fn verdict(sources: &[Source], unit_rows: &[u32], due: &SliceRows) -> Verdict {
    let expected = due.slice;
    let mut known: Vec<Source> = Vec::new();
    let mut unknown = false;
    for s in sources {
        match s {
            Source::Unknown => unknown = true,
            s if !known.iter().any(|k| same_source(k, s)) => known.push(*s),
            _ => {}
        }
    }
    let own = BlockIdentity { token_base: 0, ..expected };
    let observed_of = |r: &RowIdentity, row: u32| {
        let (t, _) = due.shape.coords(row);
        BlockIdentity { token_base: r.token.saturating_sub(t), ..r.slice }
    };
    let first_other = sources.iter().zip(unit_rows).find_map(|(s, row)| match s {
        Source::Other(r) => Some(observed_of(r, *row)),
        _ => None,
    });
    let plain = |class, observed| Verdict { class, observed, bit_flips: None, sectors: None, displacement: None, rows: None };
    match (known.as_slice(), unknown) {
        ([], _) => return plain(Class::Garbage, None),
        ([Source::Expected(_)], false) => {
            let bits: u64 = sources.iter().map(|s| if let Source::Expected(n) = s { *n as u64 } else { 0 }).sum();
            if bits == 0 {
                // Intact bytes in a slice the verify pass failed: they changed after the verdict.
                return plain(Class::Late, Some(expected));
            }
            return Verdict { bit_flips: Some(bits), ..plain(Class::Bitflip, Some(expected)) };
        }
        ([Source::Poison], false) => return plain(Class::Unwritten, None),
        ([Source::Other(r)], false) => {
            let i = r.slice;
            if i == own {
                return layout(sources, unit_rows, due);
            }
            let same_block = i.layer == expected.layer && i.kv == expected.kv && i.block == expected.block;
            // Generations only grow within a run (they wrap after 2^32 - 2, far beyond any run):
            // an older one is stale data, a newer one an overwrite of the source.
            let class = match (same_block, i.generation > expected.generation) {
                (false, _) => Class::Misplaced,
                (true, false) => Class::Stale,
                (true, true) => Class::Overwritten,
            };
            return plain(class, first_other);
        }
        _ => {}
    }
    // The right slice's rows, some in place: a layout error that left some rows where they
    // belong (a transposition keeps its diagonal).
    if !unknown
        && sources.iter().all(|s| match s {
            Source::Expected(0) => true,
            Source::Other(r) => r.slice == own,
            _ => false,
        })
    {
        return layout(sources, unit_rows, due);
    }
    let mut runs: Vec<SectorRun> = Vec::new();
    for (n, s) in sources.iter().enumerate() {
        let label = s.label();
        match runs.last_mut() {
            Some(r) if r.source == label && r.last + 1 == n as u32 => r.last = n as u32,
            _ => runs.push(SectorRun { first: n as u32, last: n as u32, source: label }),
        }
    }
    Verdict { sectors: Some(runs), ..plain(Class::Torn, first_other) }
}

/// The `layout` verdict: the wrong rows (by their first unit) and their shared displacement.
fn layout(sources: &[Source], unit_rows: &[u32], due: &SliceRows) -> Verdict {
    let mut wrong: Vec<(u32, RowIdentity)> = Vec::new();
    for (s, &row) in sources.iter().zip(unit_rows) {
        if let Source::Other(id) = s
            && wrong.last().is_none_or(|(r, _)| *r != row)
        {
            wrong.push((row, *id));
        }
    }
    let listed = wrong
        .iter()
        .take(MAX_LISTED_ROWS)
        .map(|(r, id)| {
            let d = due.row(*r);
            WrongRow { row: *r, due_token: d.token, due_head: d.head, token: id.token, head: id.head }
        })
        .collect();
    Verdict {
        class: Class::Layout,
        observed: Some(due.slice),
        bit_flips: None,
        sectors: None,
        displacement: displacement(&wrong, due),
        rows: Some(listed),
    }
}

/// The displacement all wrong rows share, if one does.
fn displacement(wrong: &[(u32, RowIdentity)], due: &SliceRows) -> Option<Displacement> {
    let first = wrong.first()?;
    let other = SliceRows {
        shape: fingerprint::RowShape {
            order: match due.shape.order {
                RowOrder::Nhd => RowOrder::Hnd,
                RowOrder::Hnd => RowOrder::Nhd,
                o @ (RowOrder::Mla | RowOrder::Rows) => o,
            },
            ..due.shape
        },
        ..*due
    };
    if !matches!(due.shape.order, RowOrder::Mla | RowOrder::Rows) && wrong.iter().all(|(r, id)| other.row(*r) == *id) {
        return Some(Displacement::Transposed);
    }
    let d = |(r, id): &(u32, RowIdentity)| {
        let want = due.row(*r);
        (id.head as i64 - want.head as i64, id.token as i64 - want.token as i64)
    };
    let (h0, t0) = d(first);
    if !wrong.iter().all(|w| d(w) == (h0, t0)) {
        return None;
    }
    match (h0, t0) {
        (h, 0) if h != 0 => Some(Displacement::HeadOffset(h)),
        (0, t) if t != 0 => Some(Displacement::TokenOffset(t)),
        _ => None,
    }
}

/// Which written contents explain a corrupt slice (scenario attribution, docs/scenarios.md
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
