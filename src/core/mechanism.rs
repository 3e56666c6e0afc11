//! Scenarios and race mechanisms: which connectors touch the KV blocks, and which
//! protocol fence is left out.
//!
//! The stack under test is vLLM's MultiConnector on the prefill engine: NixlConnector as
//! kv_producer (decode READs the blocks, prefill frees them on the NIXL notification) and
//! MooncakeStoreConnector as kv_both (async saves of computed blocks, async loads of
//! prefix hits, lookup_async). Each [`Mechanism`] names one ordering rule of that stack;
//! [`Fencing::Unfenced`] removes it, which is the suspected class of bug behind the field
//! report (garbled tokens, no error). Fenced runs must be clean; an unfenced mechanism
//! must show up as corruption of the class it predicts, attributed to it.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Which connectors move the KV blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// Decode READs every block of a request over NIXL; no tier.
    NixlOnly,
    /// No NIXL: prefill saves blocks to the tier, decode loads them from it.
    TierOnly,
    /// Both on the same prefill blocks: NIXL READs to decode while the tier saves and
    /// loads prefix hits (vLLM MultiConnector: NixlConnector + MooncakeStoreConnector).
    Stacked,
}

impl Scenario {
    /// Name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::NixlOnly => "nixl-only",
            Scenario::TierOnly => "tier-only",
            Scenario::Stacked => "stacked",
        }
    }
    /// Whether decode pulls the blocks over NIXL.
    pub fn uses_nixl(self) -> bool {
        self != Scenario::TierOnly
    }
    /// Whether the tier saves and loads blocks.
    pub fn uses_tier(self) -> bool {
        self != Scenario::NixlOnly
    }
}

/// One ordering rule of the stacked connectors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mechanism {
    /// Prefill blocks whose NIXL READ has not completed are not given to tier loads.
    LoadIntoReading,
    /// A block is not freed while its async save still has to copy it.
    SaveAfterFree,
    /// A save copies a block only after the prefill write of it completed (event fence).
    SaveBeforeWrite,
    /// Blocks touched by two connectors are freed when both have reported done.
    FreeOnFirstCompletion,
    /// A tier load into a reused block waits for the previous owner's write.
    UnfencedLoad,
    /// A handed request's lease (its abort timeout) is kept alive until decode's READ is
    /// notified (vLLM's NixlConnector extends it); unfenced, blocks are freed at its expiry.
    AbortTimeoutFree,
    /// Push mode: decode keeps an aborted request's destination blocks until the WRITE into
    /// them is done (its notification); unfenced, it frees them at once and the late WRITE
    /// lands in their next owner.
    DecodeAbortFree,
    /// A request's completion is counted once: a duplicate (a second `finished_sending`) is
    /// dropped; unfenced, it frees the request's old blocks again.
    DuplicateCompletion,
    /// Only the real completion of a transfer frees its blocks; unfenced, a completion is
    /// reported for a READ still to come and the blocks are freed and reused.
    PhantomCompletion,
    /// An aborted request's blocks are freed once its tier loads have landed; unfenced, at
    /// once, and a load still writing lands in the next owner's block.
    LoadAfterAbort,
    /// A preempted request's blocks are freed once its queued saves have run; unfenced, at
    /// once, and the saves copy the next owner's data under the preempted request's keys.
    PreemptSave,
    /// Host-buffer staging (`--host-staging`, vLLM's `kv_buffer_device=cpu`) copies every
    /// chunk of a chunked prefill into the buffer NIXL reads; unfenced, only the first
    /// chunk's blocks are staged before the transfer.
    PartialStaging,
    /// A transfer (a NIXL READ, a tier-only load) in which some descriptors failed is not
    /// counted as delivered: the failed blocks are reported and read again (vLLM's
    /// `get_block_ids_with_load_errors`); unfenced, it is counted delivered and decode runs
    /// on blocks that were never written.
    FailedAsComplete,
}

impl Mechanism {
    /// Every mechanism, in `kvprobe ab` order.
    pub const ALL: [Mechanism; 13] = [
        Mechanism::LoadIntoReading,
        Mechanism::SaveAfterFree,
        Mechanism::SaveBeforeWrite,
        Mechanism::FreeOnFirstCompletion,
        Mechanism::UnfencedLoad,
        Mechanism::AbortTimeoutFree,
        Mechanism::DecodeAbortFree,
        Mechanism::DuplicateCompletion,
        Mechanism::PhantomCompletion,
        Mechanism::LoadAfterAbort,
        Mechanism::PreemptSave,
        Mechanism::PartialStaging,
        Mechanism::FailedAsComplete,
    ];

    /// Name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Mechanism::LoadIntoReading => "load-into-reading",
            Mechanism::SaveAfterFree => "save-after-free",
            Mechanism::SaveBeforeWrite => "save-before-write",
            Mechanism::FreeOnFirstCompletion => "free-on-first-completion",
            Mechanism::UnfencedLoad => "unfenced-load",
            Mechanism::AbortTimeoutFree => "abort-timeout-free",
            Mechanism::DecodeAbortFree => "decode-abort-free",
            Mechanism::DuplicateCompletion => "duplicate-completion",
            Mechanism::PhantomCompletion => "phantom-completion",
            Mechanism::LoadAfterAbort => "load-after-abort",
            Mechanism::PreemptSave => "preempt-save",
            Mechanism::PartialStaging => "partial-staging",
            Mechanism::FailedAsComplete => "failed-as-complete",
        }
    }

    /// Whether the mechanism can act in `scenario`: the NIXL connector's own orderings in
    /// nixl-only and stacked (decode-abort-free in push mode, [`Mechanism::needs_push`]), the tier's in stacked (where decode READs what the tier saved
    /// and loaded), a failed transfer's handling wherever decode pulls (a READ, a tier-only
    /// load).
    pub fn applies_to(self, scenario: Scenario) -> bool {
        match self {
            Mechanism::FailedAsComplete => true,
            Mechanism::AbortTimeoutFree
            | Mechanism::DecodeAbortFree
            | Mechanism::PartialStaging
            | Mechanism::DuplicateCompletion
            | Mechanism::PhantomCompletion => scenario.uses_nixl(),
            _ => scenario == Scenario::Stacked,
        }
    }

    /// Whether the mechanism acts only in push mode (`--op write` with a scenario: prefill
    /// WRITEs into decode's blocks), and only there.
    pub fn needs_push(self) -> bool {
        self == Mechanism::DecodeAbortFree
    }

    /// Whether the mechanism acts only with host-buffer staging (`--host-staging`).
    pub fn needs_staging(self) -> bool {
        self == Mechanism::PartialStaging
    }

    /// Whether the block-ownership checker sees the mechanism's ordering itself (a free while
    /// a transfer, save or load touches the block, a double free, a write into a block another
    /// request owns or reads): then an unfenced run reports violations even where the bytes
    /// survive. save-before-write only reorders a request's own save and write;
    /// failed-as-complete frees nothing early (what it breaks is the delivery count), nor
    /// does partial-staging (it leaves a request's own staging copies out).
    pub fn breaks_ownership(self) -> bool {
        !matches!(self, Mechanism::SaveBeforeWrite | Mechanism::FailedAsComplete | Mechanism::PartialStaging)
    }

    /// What the unfenced variant does and how it shows up.
    pub fn explain(self) -> &'static str {
        match self {
            Mechanism::LoadIntoReading => {
                "unfenced: a request's prefill blocks are handed to tier loads as soon as prefill has written them, before decode's NIXL READ of them completed; the load's bytes reach decode instead (misplaced, stale, or torn when the READ is in flight)"
            }
            Mechanism::SaveAfterFree => {
                "unfenced: blocks are freed on the NIXL notification while their async save is still queued; the save copies the next owner's data under the old block hash, and a later prefix hit loads it (misplaced/stale at decode)"
            }
            Mechanism::SaveBeforeWrite => {
                "unfenced: a save is not ordered after the prefill write (no event wait) and copies the block's previous contents under the new hash; a later prefix hit loads them (misplaced/stale at decode)"
            }
            Mechanism::FreeOnFirstCompletion => {
                "unfenced: MultiConnector counts one completion for two connectors and frees blocks when the first of NIXL and the save reports done; the other still reads a reused block (misplaced/stale at decode)"
            }
            Mechanism::UnfencedLoad => {
                "unfenced: a tier load into a reused block does not wait for the previous owner's write (an aborted request's prefill still in flight), which lands over the loaded data (misplaced/stale at decode)"
            }
            Mechanism::AbortTimeoutFree => {
                "unfenced: prefill frees a handed request's blocks when its lease (--lease steps, the abort timeout) expires while decode's READ is not done or not yet posted (a slow pull: --decode-delay); the READ gets the next owner's data (misplaced at decode: HTTP 200 with garbage under load). Fenced: the lease is kept alive until the notification. Also in nixl-only"
            }
            Mechanism::DecodeAbortFree => {
                "unfenced: in push mode (--op write: prefill WRITEs each request into the decode blocks decode asked for, as vLLM's push flow and SGLang do) decode aborts a request whose data has not arrived --lease steps after it asked (the client gave up) and frees its destination blocks at once; prefill's WRITE, late (one in eight waits --decode-delay steps), lands in the blocks' next owner while it decodes (misplaced at decode: garbage after client aborts). Fenced: decode keeps the blocks until the WRITE's notification. Also in nixl-only"
            }
            Mechanism::DuplicateCompletion => {
                "unfenced: one request in eight has its completion (the READ's notification) delivered twice, the duplicate 1-32 steps later; it frees the request's old blocks again although they now belong to other requests, whose READs then get yet another owner's data (misplaced). Also in nixl-only"
            }
            Mechanism::PhantomCompletion => {
                "unfenced: one request in four is reported complete by the NIXL connector when it is handed to decode, before decode's READ; its blocks are freed and reused, and the READ gets the next owner's data (misplaced). Also in nixl-only"
            }
            Mechanism::LoadAfterAbort => {
                "unfenced: a request the client aborts has its blocks freed at once while its tier loads (prefix hits) are still queued; a load lands later in the block's next owner and decode reads it there (misplaced)"
            }
            Mechanism::PreemptSave => {
                "unfenced: the scheduler preempts a request after its prefill (--preempt-rate) and frees its blocks while their saves are queued; the saves copy the next owner's data under the preempted request's keys, and a later prefix hit loads wrong KV under a valid key (misplaced)"
            }
            Mechanism::PartialStaging => {
                "unfenced: with host-buffer staging (--host-staging, vLLM's kv_buffer_device=cpu: prefill computes into its KV cache and copies each request's blocks into the buffer registered with NIXL, which decode READs) and chunked prefill (two blocks per chunk, a chunk per step), only the blocks of a request's first chunk are staged; its later blocks are READ from the buffer as an earlier request staged them (misplaced or stale at decode). Fenced: every chunk is staged as it lands, before the hand-over. Also in nixl-only"
            }
            Mechanism::FailedAsComplete => {
                "unfenced: a transfer of decode's (a NIXL READ, a request's tier-only loads) that moved only some of its blocks, the others failing (--fail-rate of them), is counted delivered without the failed block ids; decode runs on blocks that were never written (unwritten at decode: this pull's poison). Fenced: the failed blocks are reported and read again before decode uses the request. Also in nixl-only and tier-only"
            }
        }
    }
}

impl fmt::Display for Mechanism {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Mechanism {
    type Err = String;
    fn from_str(s: &str) -> Result<Mechanism, String> {
        Mechanism::ALL.into_iter().find(|m| m.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Mechanism::ALL.iter().map(|m| m.name()).collect();
            format!("unknown race mechanism {s:?} (expected one of: {})", names.join(", "))
        })
    }
}

/// Whether a mechanism's ordering rule is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fencing {
    /// The rule is kept (the correct protocol).
    Fenced,
    /// The rule is left out (the bug).
    Unfenced,
}

/// One `--race MECHANISM[=fenced|unfenced]` flag (default unfenced: naming a mechanism
/// asks for its bug).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RaceSpec {
    /// The mechanism.
    pub mechanism: Mechanism,
    /// Kept or left out.
    pub fencing: Fencing,
}

impl std::str::FromStr for RaceSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<RaceSpec, String> {
        let (m, f) = s.split_once('=').unwrap_or((s, "unfenced"));
        let fencing = match f {
            "fenced" => Fencing::Fenced,
            "unfenced" => Fencing::Unfenced,
            _ => return Err(format!("{s:?}: the fencing must be `fenced` or `unfenced`")),
        };
        Ok(RaceSpec { mechanism: m.parse()?, fencing })
    }
}

/// The set of mechanisms left unfenced in a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Races(u32);

impl Races {
    /// Resolves `--race` flags (later flags win). All fenced when empty.
    pub fn from_specs(specs: &[RaceSpec]) -> Races {
        let mut r = Races(0);
        for s in specs {
            r.set(s.mechanism, s.fencing == Fencing::Unfenced);
        }
        r
    }
    /// Only `m` unfenced.
    pub fn only(m: Mechanism) -> Races {
        let mut r = Races(0);
        r.set(m, true);
        r
    }
    fn bit(m: Mechanism) -> u32 {
        1 << Mechanism::ALL.iter().position(|x| *x == m).unwrap_or(0)
    }
    fn set(&mut self, m: Mechanism, unfenced: bool) {
        if unfenced { self.0 |= Self::bit(m) } else { self.0 &= !Self::bit(m) }
    }
    /// True when `m` is left unfenced.
    pub fn unfenced(self, m: Mechanism) -> bool {
        self.0 & Self::bit(m) != 0
    }
    /// True when every mechanism is fenced.
    pub fn all_fenced(self) -> bool {
        self.0 == 0
    }
    /// The unfenced mechanisms.
    pub fn list(self) -> Vec<Mechanism> {
        Mechanism::ALL.into_iter().filter(|m| self.unfenced(*m)).collect()
    }
}
