//! Fault injection through the real transfer path (`--inject CLASS[:COUNT]`).
//!
//! Each injection damages COUNT block slices (default 1) in every iteration, at seeded
//! random coordinates, by changing what the prefill side writes or what the NIXL request
//! carries — never by touching the decode side directly:
//!
//! | injection | what is done | predicted class at the decode slot |
//! |-----------|--------------|------------------------------------|
//! | `bitflip`  | flip one bit of a source slice after the fill | `bitflip` |
//! | `drop`     | leave the slice's descriptor out of the request | `unwritten` |
//! | `misroute` | pair source slice a with b's destination slot (a's and b's own descriptors dropped) | `misplaced` at b's slot, `unwritten` at a's |
//! | `stale`    | leave the source slice at the previous generation | `stale` |
//! | `torn`     | transfer only a prefix of the slice (a multiple of 16 bytes) | `torn` |

use crate::error::{Error, Result};
use crate::geometry::{Geometry, SliceCoord};
use crate::verify::Class;
use rand::Rng;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};

/// An injection kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Flip a bit in a source slice after the fill.
    Bitflip,
    /// Leave descriptors out of the request.
    Drop,
    /// Pair a source block with another destination slot.
    Misroute,
    /// Skip refilling a source slice this generation.
    Stale,
    /// Transfer part of a slice.
    Torn,
}

impl Kind {
    /// Name as written on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Bitflip => "bitflip",
            Kind::Drop => "drop",
            Kind::Misroute => "misroute",
            Kind::Stale => "stale",
            Kind::Torn => "torn",
        }
    }
}

/// One `--inject CLASS[:COUNT]` flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spec {
    /// What to inject.
    pub kind: Kind,
    /// How many per iteration (≥ 1).
    pub count: u32,
}

impl std::str::FromStr for Spec {
    type Err = String;
    /// Parses `CLASS` or `CLASS:COUNT`, CLASS one of bitflip, drop, misroute, stale, torn.
    fn from_str(s: &str) -> std::result::Result<Spec, String> {
        let (name, count) = match s.split_once(':') {
            Some((n, c)) => {
                let c: u32 = c.parse().map_err(|_| format!("COUNT in {s:?} must be an integer from 1 to {}", u32::MAX))?;
                (n, c)
            }
            None => (s, 1),
        };
        if count == 0 {
            return Err(format!("COUNT in {s:?} must be at least 1"));
        }
        let kind = match name {
            "bitflip" => Kind::Bitflip,
            "drop" => Kind::Drop,
            "misroute" => Kind::Misroute,
            "stale" => Kind::Stale,
            "torn" => Kind::Torn,
            _ => {
                return Err(format!("unknown injection {name:?} (expected bitflip, drop, misroute, stale or torn)"));
            }
        };
        Ok(Spec { kind, count })
    }
}

/// One planned injection in one iteration, by source-side coordinates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Flip `bit` (0..8) of byte `offset` in source slice `at`.
    Bitflip {
        /// Source slice.
        at: SliceCoord,
        /// Byte offset.
        offset: u64,
        /// Bit index.
        bit: u8,
    },
    /// Omit source slice `at` from the request.
    Drop {
        /// Source slice.
        at: SliceCoord,
    },
    /// Send source slice `from` to the destination slot of source slice `to`; neither
    /// slice's own descriptor is sent.
    Misroute {
        /// Source slice whose bytes travel.
        from: SliceCoord,
        /// Source slice whose destination slot receives them.
        to: SliceCoord,
    },
    /// Leave source slice `at` at the previous generation.
    Stale {
        /// Source slice.
        at: SliceCoord,
    },
    /// Send only the first `len` bytes of source slice `at`.
    Torn {
        /// Source slice.
        at: SliceCoord,
        /// Bytes sent.
        len: u64,
    },
}

/// Checks that the injections fit the geometry. Errors (exit 2): torn needs slices of at
/// least 32 bytes; misroute pairs two slices of one (layer, K/V), so each needs a group
/// with two free blocks; all injections need distinct slices.
pub fn check(specs: &[Spec], g: &Geometry) -> Result<()> {
    let sb = g.slice_bytes()?;
    let (mut pairs, mut singles): (u64, u64) = (0, 0);
    for s in specs {
        if s.kind == Kind::Torn && sb < 32 {
            return Err(Error::Usage(format!("--inject torn needs block slices of at least 32 bytes (they are {sb})")));
        }
        match s.kind {
            Kind::Misroute => pairs += s.count as u64,
            _ => singles += s.count as u64,
        }
    }
    if pairs > 0 && g.num_blocks < 2 {
        return Err(Error::Usage("--inject misroute needs at least 2 blocks".into()));
    }
    let groups = g.num_layers as u64 * g.kv_parts() as u64;
    let max_pairs = groups * (g.num_blocks as u64 / 2);
    if pairs > max_pairs {
        return Err(Error::Usage(format!(
            "--inject misroute needs {pairs} pairs of blocks in one layer and K/V per iteration; the pool has room for {max_pairs}"
        )));
    }
    let have = g.total_slices()?;
    if 2 * pairs + singles > have {
        return Err(Error::Usage(format!(
            "the injections need {} distinct block slices per iteration; the pool has {have}",
            2 * pairs + singles
        )));
    }
    Ok(())
}

/// Distinct random slices, drawn group by group (a group is one layer's K, V or latent).
struct Picker<'a> {
    g: &'a Geometry,
    used: HashSet<SliceCoord>,
    used_in: HashMap<u64, u32>,
}

impl Picker<'_> {
    fn groups(&self) -> u64 {
        self.g.num_layers as u64 * self.g.kv_parts() as u64
    }

    fn free_in(&self, gi: u64) -> u32 {
        self.g.num_blocks - self.used_in.get(&gi).copied().unwrap_or(0)
    }

    /// The first group, from a random start, with at least `n` free blocks.
    fn group_with(&self, n: u32, rng: &mut impl Rng) -> u64 {
        let groups = self.groups();
        let start = rng.random_range(0..groups);
        (0..groups).map(|k| (start + k) % groups).find(|&gi| self.free_in(gi) >= n).expect("check() bounds the injections")
    }

    /// A random unused block of group `gi` (which has a free one).
    fn take(&mut self, gi: u64, rng: &mut impl Rng) -> SliceCoord {
        let parts = self.g.parts();
        let (layer, kv) = ((gi / parts.len() as u64) as u32, parts[(gi % parts.len() as u64) as usize]);
        loop {
            let c = SliceCoord { layer, kv, block: rng.random_range(0..self.g.num_blocks) };
            if self.used.insert(c) {
                *self.used_in.entry(gi).or_default() += 1;
                return c;
            }
        }
    }
}

/// Plans one iteration's injections at distinct random source slices (misroute pairs first,
/// so [`check`]'s capacity bound holds). Call [`check`] first.
pub fn plan(specs: &[Spec], g: &Geometry, rng: &mut impl Rng) -> Vec<Action> {
    let sb = g.slice_bytes().unwrap_or(0);
    let mut p = Picker { g, used: HashSet::new(), used_in: HashMap::new() };
    let mut out = Vec::new();
    let (pairs, singles): (Vec<&Spec>, Vec<&Spec>) = specs.iter().partition(|s| s.kind == Kind::Misroute);
    for s in pairs {
        for _ in 0..s.count {
            let gi = p.group_with(2, rng);
            let from = p.take(gi, rng);
            let to = p.take(gi, rng);
            out.push(Action::Misroute { from, to });
        }
    }
    for s in singles {
        for _ in 0..s.count {
            let gi = p.group_with(1, rng);
            let a = p.take(gi, rng);
            out.push(match s.kind {
                Kind::Bitflip => Action::Bitflip { at: a, offset: rng.random_range(0..sb), bit: rng.random_range(0..8) },
                Kind::Drop => Action::Drop { at: a },
                Kind::Stale => Action::Stale { at: a },
                Kind::Torn => Action::Torn { at: a, len: 16 * rng.random_range(1..sb / 16) },
                Kind::Misroute => unreachable!("partitioned above"),
            });
        }
    }
    out
}

impl Action {
    /// The injection kind.
    pub fn kind(&self) -> Kind {
        match self {
            Action::Bitflip { .. } => Kind::Bitflip,
            Action::Drop { .. } => Kind::Drop,
            Action::Misroute { .. } => Kind::Misroute,
            Action::Stale { .. } => Kind::Stale,
            Action::Torn { .. } => Kind::Torn,
        }
    }

    /// Predicted damage as `(source slice whose destination slot is hit, class)`.
    pub fn predicted(&self) -> Vec<(SliceCoord, Class)> {
        match *self {
            Action::Bitflip { at, .. } => vec![(at, Class::Bitflip)],
            Action::Drop { at } => vec![(at, Class::Unwritten)],
            Action::Misroute { from, to } => vec![(to, Class::Misplaced), (from, Class::Unwritten)],
            Action::Stale { at } => vec![(at, Class::Stale)],
            Action::Torn { at, .. } => vec![(at, Class::Torn)],
        }
    }
}
