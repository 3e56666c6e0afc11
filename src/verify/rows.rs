//! Classifying a corrupt block slice row by row (fingerprint version 2,
//! [`crate::fingerprint::v2`]): which head row each slot of the slice holds.
//!
//! Version 2 names every head row (token, head) of every block, so a slice that holds the
//! right block's rows at the wrong places — NHD bytes read as HND, a TP rank's wrong head
//! offset, a token offset from unequal block sizes — is told apart from another block's rows
//! (`misplaced`), an older generation (`stale`), nothing written (`unwritten`) or a mix
//! (`torn`). Each row is attributed to the first source that fits, exact matches first:
//!
//! 1. `Expected` — the row due there, exactly;
//! 2. `Poison` — exactly this iteration's poison for this slot (nothing arrived);
//! 3. `Row(id)` — another row's intact bytes, named by the row's first tag (any slice, any
//!    position);
//! 4. `Flipped(n)` — the row due there with 1 to [`super::BITFLIP_MAX_BITS_PER_SECTOR`] bits
//!    flipped in each of its units;
//! 5. `Unknown` — none of these (a tear inside a row, garbage).
//!
//! The verdict ([`RowClass`]): all `Expected`/`Flipped` → `Bitflip`; all `Poison` →
//! `Unwritten`; every row that is not `Expected` a row of the same slice (layer, K/V, logical
//! block, generation) at another position → `Layout`, with the [`Displacement`] they share
//! when they share one; every wrong row from one other slice → `Stale` (same block, other
//! generation) or `Misplaced`; several sources → `Torn`; nothing recognised → `Garbage`.

use crate::fingerprint::v2::{self, RowIdentity, RowOrder, SliceRows};
use crate::fingerprint::{self, BlockIdentity};

/// What one row slot of a slice holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowSource {
    /// The row due there.
    Expected,
    /// The row due there with this many bits flipped (1 to 8 per 512-byte unit).
    Flipped(u32),
    /// This iteration's poison for this slot.
    Poison,
    /// Another row's intact bytes.
    Row(RowIdentity),
    /// Unrecognised bytes.
    Unknown,
}

/// The verdict class of a slice classified by rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RowClass {
    /// Nothing was written.
    Unwritten,
    /// The right rows of an older generation.
    Stale,
    /// Another block's rows.
    Misplaced,
    /// The right block's rows at the wrong positions (layout, head or token offset).
    Layout,
    /// A mix of sources.
    Torn,
    /// The expected rows with a few bits flipped.
    Bitflip,
    /// Nothing recognisable.
    Garbage,
}

impl RowClass {
    /// The class's name (as reports name classes).
    pub fn name(self) -> &'static str {
        match self {
            RowClass::Unwritten => "unwritten",
            RowClass::Stale => "stale",
            RowClass::Misplaced => "misplaced",
            RowClass::Layout => "layout",
            RowClass::Torn => "torn",
            RowClass::Bitflip => "bitflip",
            RowClass::Garbage => "garbage",
        }
    }
}

/// How the rows of a `Layout` slice are displaced, when every wrong row shares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Displacement {
    /// The rows are those of the other row order (NHD bytes read as HND, or the reverse):
    /// slot `r` holds the row the other order puts at `r`.
    Transposed,
    /// Every row holds the row `heads` global heads away (a TP rank's wrong head offset).
    HeadOffset(i64),
    /// Every row holds the row `tokens` tokens away (unequal block sizes cut wrongly).
    TokenOffset(i64),
}

/// The verdict on one slice classified by rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowVerdict {
    /// The class.
    pub class: RowClass,
    /// What each row slot holds, in the slice's row order.
    pub rows: Vec<RowSource>,
    /// The displacement every wrong row shares (`Layout` only).
    pub displacement: Option<Displacement>,
}

impl RowVerdict {
    /// The slots that do not hold their row: (row index, the row due, what is there).
    pub fn wrong_rows<'a>(&'a self, due: &'a SliceRows) -> impl Iterator<Item = (u32, RowIdentity, RowSource)> + 'a {
        self.rows.iter().enumerate().filter(|(_, s)| **s != RowSource::Expected).map(|(r, s)| (r as u32, due.row(r as u32), *s))
    }
}

fn hamming(a: &[u8], b: &[u8]) -> u32 {
    a.iter().zip(b).map(|(x, y)| (x ^ y).count_ones()).sum()
}

/// Classifies `actual`, the bytes of decode slot `slot` (global slice index) in iteration
/// `iteration`, which should hold the rows `due` names (fingerprint version 2). `actual` must
/// be `due.len()` bytes (panics otherwise, as [`v2::fill`]).
pub fn classify_rows(actual: &[u8], due: &SliceRows, seed: u64, slot: u32, iteration: u32) -> RowVerdict {
    let want = v2::expected(seed, due);
    let mut poison = vec![0u8; actual.len()];
    fingerprint::poison(&mut poison, slot, iteration);
    let rb = due.row_bytes as usize;
    let mut rows = Vec::with_capacity(actual.len() / rb.max(1));
    for (r, (got, exp)) in actual.chunks(rb).zip(want.chunks(rb)).enumerate() {
        let range = r * rb..(r + 1) * rb;
        let src = if got == exp {
            RowSource::Expected
        } else if got == &poison[range.clone()] {
            RowSource::Poison
        } else if let Some(other) = intact_other_row(got, seed, due) {
            RowSource::Row(other)
        } else {
            let per_unit =
                got.chunks(v2::UNIT_BYTES as usize).zip(exp.chunks(v2::UNIT_BYTES as usize)).map(|(g, e)| hamming(g, e));
            let (mut total, mut ok) = (0u32, true);
            for h in per_unit {
                ok &= h <= super::BITFLIP_MAX_BITS_PER_SECTOR;
                total += h;
            }
            if ok { RowSource::Flipped(total) } else { RowSource::Unknown }
        };
        rows.push(src);
    }
    verdict(rows, due)
}

/// The row `got` holds intact, when its first tag names a row (of any slice) whose bytes it is.
fn intact_other_row(got: &[u8], seed: u64, due: &SliceRows) -> Option<RowIdentity> {
    let (id, unit) = v2::decode_tag(got, seed, 0, due.row_bytes)?;
    if unit != 0 {
        return None;
    }
    let one = SliceRows {
        slice: id.slice,
        token_base: id.token,
        head_base: id.head,
        order: if id.slice.kv == crate::geometry::KvPart::Latent { RowOrder::Mla } else { RowOrder::Nhd },
        block_size: 1,
        heads: 1,
        row_bytes: due.row_bytes,
    };
    one.validate().ok()?;
    (v2::expected(seed, &one) == got).then_some(id)
}

fn verdict(rows: Vec<RowSource>, due: &SliceRows) -> RowVerdict {
    let plain = |class, rows| RowVerdict { class, rows, displacement: None };
    if rows.iter().all(|s| matches!(s, RowSource::Expected | RowSource::Flipped(_))) {
        return plain(RowClass::Bitflip, rows);
    }
    if rows.iter().all(|s| *s == RowSource::Poison) {
        return plain(RowClass::Unwritten, rows);
    }
    if rows.iter().all(|s| *s == RowSource::Unknown) {
        return plain(RowClass::Garbage, rows);
    }
    let wrong: Vec<(u32, RowIdentity)> = rows
        .iter()
        .enumerate()
        .filter_map(|(r, s)| match s {
            RowSource::Row(id) => Some((r as u32, *id)),
            _ => None,
        })
        .collect();
    let only_rows = rows.iter().all(|s| matches!(s, RowSource::Expected | RowSource::Row(_)));
    if only_rows && !wrong.is_empty() {
        let slices: Vec<BlockIdentity> = wrong.iter().map(|(_, id)| id.slice).collect();
        if slices.iter().all(|s| *s == due.slice) {
            let displacement = displacement(&wrong, due);
            return RowVerdict { class: RowClass::Layout, rows, displacement };
        }
        let first = slices[0];
        if rows.iter().all(|s| matches!(s, RowSource::Row(_))) && slices.iter().all(|s| *s == first) {
            let same_block = first.layer == due.slice.layer && first.kv == due.slice.kv && first.block == due.slice.block;
            return plain(if same_block { RowClass::Stale } else { RowClass::Misplaced }, rows);
        }
    }
    plain(RowClass::Torn, rows)
}

/// The displacement all wrong rows share, if one does.
fn displacement(wrong: &[(u32, RowIdentity)], due: &SliceRows) -> Option<Displacement> {
    let other = SliceRows {
        order: match due.order {
            RowOrder::Nhd => RowOrder::Hnd,
            RowOrder::Hnd => RowOrder::Nhd,
            RowOrder::Mla => RowOrder::Mla,
        },
        ..*due
    };
    if due.order != RowOrder::Mla && wrong.iter().all(|(r, id)| other.row(*r) == *id) {
        return Some(Displacement::Transposed);
    }
    let d = |(r, id): &(u32, RowIdentity)| {
        let want = due.row(*r);
        (id.head as i64 - want.head as i64, id.token as i64 - want.token as i64)
    };
    let (h0, t0) = d(&wrong[0]);
    if !wrong.iter().all(|w| d(w) == (h0, t0)) {
        return None;
    }
    match (h0, t0) {
        (h, 0) if h != 0 => Some(Displacement::HeadOffset(h)),
        (0, t) if t != 0 => Some(Displacement::TokenOffset(t)),
        _ => None,
    }
}
