//! The shadow: what every prefill block and tier entry holds as far as the engines' own
//! writes say, and the attribution of each corrupt slice decode finds (docs/scenarios.md
//! "Attribution").
//!
//! Every write into a prefill block (a computed fill, a tier load) is recorded here as a
//! [`Content`]: the identity written and, when an unfenced mechanism allowed the write, that
//! mechanism. While a NIXL READ of a block is in flight its window collects every content
//! written into the block, so that a corrupt slice at decode is *explained* only when every
//! 4-byte element of it is what one of those contents put there ([`attribute`]); anything
//! else (poison, a flipped bit, garbage, an identity never written in the window) is a defect
//! of the stack under test. The shadow also counts how often each unfenced mechanism's window
//! opened and what was attributed to it, and turns the counts into each mechanism's verdict
//! (`Shadow::outcomes`).
//!
//! The engines tell the shadow what they do as [`Event`]s, each stamped with the engine, its
//! step and the engine's own sequence number ([`Shadow::observe`]): the shadow holds no
//! reference into either engine, so the same stream can reach it from another thread, process
//! or host, and a lost or reordered event is an error, never a silent misattribution.

use crate::core::fingerprint::{self, BlockIdentity};
use crate::core::geometry::SliceCoord;
use crate::core::mechanism::{Fencing, Mechanism, Races};
use crate::core::verify::{self, Class};
use crate::error::{Error, Result};
use crate::mem::pool::TableEntry;
use crate::report::RaceOutcome;
use std::collections::BTreeMap;

pub use crate::mem::tier::Content;

/// Classes an unfenced mechanism may produce at decode: another block's data (misplaced),
/// the same block's older data (stale) or newer data (overwritten: its source rewritten before
/// the READ read it), or a mix when the write lands during a READ (torn).
pub const RACE_CLASSES: [Class; 4] = [Class::Misplaced, Class::Stale, Class::Overwritten, Class::Torn];

/// The classes unfenced mechanism `m` may produce at decode: [`RACE_CLASSES`] for an ordering
/// that lets another write reach a block; `unwritten` (this pull's poison) for
/// failed-as-complete, whose failed blocks were never written; for decode-abort-free also
/// `stray`: an aborted request's late WRITE into a freed block after the block's next
/// request verified, found by the re-verify before the block's re-poison.
pub fn predicted_classes(m: Mechanism) -> &'static [Class] {
    match m {
        Mechanism::FailedAsComplete => &[Class::Unwritten],
        Mechanism::DecodeAbortFree => &[Class::Misplaced, Class::Stale, Class::Overwritten, Class::Torn, Class::Stray],
        _ => &RACE_CLASSES,
    }
}

/// The shadow of one prefill block.
#[derive(Clone, Debug, Default)]
struct BlockShadow {
    /// What the block holds now.
    content: Content,
    /// One window per NIXL READ of this block still in flight: (request, every content
    /// written into the block since the READ was posted, in order). A window lives only
    /// while its READ does (bounded by `--timeout`), so nothing written during a READ is
    /// ever forgotten and no bound on rewrites is needed.
    reads: Vec<(u64, Vec<Content>)>,
}

pub use crate::peer::steps::{EngineId, Event, What};

/// What the shadow answers an [`Event`] with.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// Nothing (a write, a window).
    Noted,
    /// [`What::ReadPosted`]: what each block held when the READ was posted.
    AtPost(Vec<Content>),
    /// [`What::ReadDone`]: what was written into each block while the READ was in flight,
    /// in order.
    During(Vec<Vec<Content>>),
}

/// The shadow of the prefill pool, and the per-mechanism counts of a run.
pub struct Shadow {
    /// By prefill block id.
    blocks: Vec<BlockShadow>,
    /// Times each unfenced mechanism let a conflicting copy happen.
    windows: BTreeMap<Mechanism, u64>,
    /// Corrupt slices explained by each mechanism, by class.
    attributed: BTreeMap<Mechanism, BTreeMap<Class, u64>>,
    /// Corrupt slices nothing explains (defects of the stack under test).
    pub(crate) unexplained: u64,
    /// The last sequence number seen from prefill and from decode.
    seen: [u64; 2],
    /// The run's fencing: a prefill write may be stamped only with a mechanism unfenced
    /// here ([`Shadow::observe`]).
    races: Races,
}

impl Shadow {
    /// A shadow of blocks holding `genesis` (by prefill block id), written by no mechanism,
    /// for a run whose fencing is `races` (the causes a prefill write may carry).
    pub fn new(genesis: &[TableEntry], races: Races) -> Shadow {
        Shadow {
            blocks: genesis.iter().map(|&id| BlockShadow { content: Content { id, cause: None }, reads: Vec::new() }).collect(),
            windows: BTreeMap::new(),
            attributed: BTreeMap::new(),
            unexplained: 0,
            seen: [0, 0],
            races,
        }
    }

    /// Applies event `e`, the next of its engine. Errors: transport (exit 3) when it is not
    /// the one after the last seen from that engine (an event lost or reordered on its way:
    /// attributing past it could excuse what nothing wrote), names a block the shadow does
    /// not have, or is a prefill write stamped with a cause that cannot exist in this run
    /// ([`prefill_may_stamp`]): a fenced mechanism would turn real corruption into
    /// "explained", and a serve across hosts sends these events, so they are hostile input.
    pub fn observe(&mut self, e: Event) -> Result<Answer> {
        let k = e.engine as usize;
        if e.seq != self.seen[k] + 1 {
            return Err(Error::Transport(format!(
                "shadow: event {} of {:?} (step {}) arrived after event {}: an event was lost or reordered",
                e.seq, e.engine, e.step, self.seen[k]
            )));
        }
        let n = self.blocks.len() as u32;
        let bad = |b: u32| Error::Transport(format!("shadow: event {} of {:?} names block {b} of {n}", e.seq, e.engine));
        let blocks = match &e.what {
            What::Write { block, .. } => std::slice::from_ref(block),
            What::Window { .. } => &[],
            What::ReadPosted { blocks, .. } | What::ReadDone { blocks, .. } | What::Pushed { blocks, .. } => blocks.as_slice(),
        };
        // A window may open on either side (decode's own: failed-as-complete).
        let from_decode = matches!(e.what, What::ReadPosted { .. } | What::ReadDone { .. });
        let from_prefill = matches!(e.what, What::Write { .. } | What::Pushed { .. });
        if from_decode && e.engine != EngineId::Decode || from_prefill && e.engine != EngineId::Prefill {
            return Err(Error::Transport(format!(
                "shadow: event {} of {:?} (step {}) is not one that engine makes",
                e.seq, e.engine, e.step
            )));
        }
        if let Some(&b) = blocks.iter().find(|&&b| b >= n) {
            return Err(bad(b));
        }
        if let What::Write { block, content: Content { cause: Some(m), .. } } = &e.what
            && !prefill_may_stamp(*m, self.races)
        {
            let why = if self.races.unfenced(*m) { "a mechanism of decode's own" } else { "fenced in this run" };
            return Err(Error::Transport(format!(
                "shadow: event {} of {:?} (step {}) is a write into block {block} caused by {m}, which is {why} (a protocol error)",
                e.seq, e.engine, e.step
            )));
        }
        self.seen[k] = e.seq;
        Ok(match e.what {
            What::Write { block, content } => {
                self.record(block, content);
                Answer::Noted
            }
            What::Window { mechanism } => {
                self.window(mechanism);
                Answer::Noted
            }
            What::ReadPosted { req, blocks } => {
                let at_post = blocks.iter().map(|&b| self.content(b)).collect();
                for &b in &blocks {
                    self.open_read(b, req);
                }
                Answer::AtPost(at_post)
            }
            What::ReadDone { req, blocks } => Answer::During(blocks.iter().map(|&b| self.close_read(b, req)).collect()),
            // Prefill writes nothing while its WRITE is in flight: what landed is what the
            // blocks hold now.
            What::Pushed { blocks, .. } => Answer::AtPost(blocks.iter().map(|&b| self.content(b)).collect()),
        })
    }

    /// What prefill block `block` holds now.
    pub fn content(&self, block: u32) -> Content {
        self.blocks[block as usize].content
    }

    /// A write of `c` into prefill block `block`: it holds `c` now, and every READ window open
    /// on it sees `c`.
    fn record(&mut self, block: u32, c: Content) {
        let b = &mut self.blocks[block as usize];
        b.content = c;
        for (_, w) in b.reads.iter_mut() {
            w.push(c);
        }
    }

    /// Request `req`'s NIXL READ of prefill block `block` was posted: opens its window.
    fn open_read(&mut self, block: u32, req: u64) {
        self.blocks[block as usize].reads.push((req, Vec::new()));
    }

    /// Request `req`'s READ of prefill block `block` completed: closes its window and returns
    /// what was written into the block while it was open, in order (empty when none was open).
    fn close_read(&mut self, block: u32, req: u64) -> Vec<Content> {
        let reads = &mut self.blocks[block as usize].reads;
        match reads.iter().position(|(q, _)| *q == req) {
            Some(k) => reads.swap_remove(k).1,
            None => Vec::new(),
        }
    }

    /// Unfenced mechanism `m` let a conflicting copy happen once more.
    fn window(&mut self, m: Mechanism) {
        *self.windows.entry(m).or_default() += 1;
    }

    /// Counts a corrupt slice of `class`, attributed to `cause` (`None`: unexplained).
    pub(crate) fn count(&mut self, cause: Option<Mechanism>, class: Class) {
        match cause {
            Some(m) => *self.attributed.entry(m).or_default().entry(class).or_default() += 1,
            None => self.unexplained += 1,
        }
    }

    /// Each mechanism's outcome under `races`: an unfenced one is "detected" when corruption
    /// of its predicted classes ([`predicted_classes`]) was attributed to it, else "not reproduced"
    /// with why; a fenced one is "clean", or "corrupt" if anything was attributed to it.
    pub(crate) fn outcomes(&self, races: &Races) -> Vec<RaceOutcome> {
        Mechanism::ALL
            .iter()
            .map(|&m| {
                let unf = races.unfenced(m);
                let classes: BTreeMap<String, u64> = self
                    .attributed
                    .get(&m)
                    .map(|c| c.iter().map(|(k, v)| (k.name().to_string(), *v)).collect())
                    .unwrap_or_default();
                let n: u64 = classes.values().sum();
                let w = self.windows.get(&m).copied().unwrap_or(0);
                let in_class = self.attributed.get(&m).is_none_or(|c| c.keys().all(|k| predicted_classes(m).contains(k)));
                let (verdict, why) = match (unf, n > 0 && in_class) {
                    (false, _) => (if n == 0 { "clean" } else { "corrupt" }.to_string(), None),
                    (true, true) => ("detected".to_string(), None),
                    (true, false) if n > 0 => (
                        "not reproduced".to_string(),
                        Some("corruption was attributed but with classes it does not predict".to_string()),
                    ),
                    (true, false) if w == 0 => ("not reproduced".to_string(), Some(window_never(m))),
                    (true, false) => (
                        "not reproduced".to_string(),
                        Some(format!("the window opened {w} times but no affected block reached a verified decode read")),
                    ),
                };
                RaceOutcome {
                    mechanism: m,
                    fencing: if unf { Fencing::Unfenced } else { Fencing::Fenced },
                    windows_opened: w,
                    corrupt_attributed: n,
                    classes,
                    predicted_classes: predicted_classes(m).to_vec(),
                    verdict,
                    why,
                }
            })
            .collect()
    }
}

/// Whether a prefill write (a [`What::Write`] event) may carry cause `m` in a run fenced as
/// `races`: only a mechanism this run leaves unfenced, and never one that acts on decode's
/// side alone (failed-as-complete: decode counts a failed transfer delivered;
/// decode-abort-free: decode frees its own blocks), which no prefill write can be caused by.
pub fn prefill_may_stamp(m: Mechanism, races: Races) -> bool {
    races.unfenced(m) && !matches!(m, Mechanism::FailedAsComplete | Mechanism::DecodeAbortFree)
}

pub(crate) fn ident(t: TableEntry, c: SliceCoord) -> BlockIdentity {
    t.identity(c)
}

/// The attribution of a corrupt slice (docs/scenarios.md "Attribution"): `actual` is the slice at
/// coordinate `c` as decode holds it, `want` its expected bytes, and `written` what the
/// engine's shadow says its source held during the READ window, in order (first: the
/// content when the READ was posted; then each write made before it completed; for a tier
/// load, the entry loaded).
///
/// Returns the mechanism it is attributed to (`None`: unexplained) and the content the
/// shadow predicts there. The slice is explained only when every 4-byte element of it is
/// what one of `written` put at that offset ([`verify::explained_by`]); this iteration's
/// poison, a flipped bit, garbage or an identity never written in the window make the whole
/// slice unexplained, however often the block was rewritten. It is then attributed to the
/// mechanism stamped on the content that supplies most of the wrong elements (the latest on
/// a tie; when it carries none, the latest other supplier's), and that content is the
/// prediction. A content that supplies none of the wrong elements (the content at post
/// included) never lends its cause: when no supplier carries one, the slice is unexplained
/// (wrong data that only unstamped writes put there is no unfenced mechanism's doing).
pub fn attribute(
    actual: &[u8],
    want: &[u8],
    seed: u64,
    shape: &crate::core::fingerprint::RowShape,
    c: SliceCoord,
    written: &[Content],
) -> (Option<Mechanism>, TableEntry) {
    let pre = written.first().copied().unwrap_or_default();
    // One fingerprint per distinct identity (a window may hold the same one several times).
    let mut ids: Vec<TableEntry> = Vec::new();
    for w in written {
        if !ids.contains(&w.id) {
            ids.push(w.id);
        }
    }
    let prints: Vec<Vec<u8>> = ids.iter().map(|&t| fingerprint::expected(seed, &shape.slice(ident(t, c)))).collect();
    let Some(used) = verify::explained_by(actual, want, &prints) else {
        return (None, pre.id);
    };
    let supplied = |w: &Content| ids.iter().position(|t| *t == w.id).map_or(0, |k| used[k]);
    // The prediction: the content supplying most of the wrong data (`max_by_key` keeps the
    // last of equals: the latest on a tie).
    let Some(best) = written.iter().filter(|w| supplied(w) > 0).max_by_key(|w| supplied(w)) else {
        return (None, pre.id);
    };
    let cause = best.cause.or_else(|| written.iter().rev().filter(|w| supplied(w) > 0).find_map(|w| w.cause));
    (cause, best.id)
}

fn window_never(m: Mechanism) -> String {
    match m {
        Mechanism::LoadIntoReading => "the window never opened: no tier load landed in a block whose READ was pending (needs prefix hits: --prefix-share > 0)".into(),
        Mechanism::SaveAfterFree => "the window never opened: no block was reused before its save ran (more load: --concurrency, --requests)".into(),
        Mechanism::SaveBeforeWrite => "the window never opened: every save found its block already written".into(),
        Mechanism::FreeOnFirstCompletion => "the window never opened: no block was reused while the other connector still used it (more load: --concurrency, --requests)".into(),
        Mechanism::UnfencedLoad => "the window never opened: no load targeted a block with a write still in flight (needs aborts, --abort-rate > 0, and prefix hits)".into(),
        Mechanism::AbortTimeoutFree => "the window never opened: no freed block was reused before its READ (every READ done within --lease steps: raise --decode-delay or lower --lease)".into(),
        Mechanism::DuplicateCompletion => "the window never opened: no duplicate completion freed a block another request was still reading (more load: --concurrency, --requests)".into(),
        Mechanism::PhantomCompletion => "the window never opened: no block freed by a phantom completion was reused before its READ (more load: --concurrency, --requests)".into(),
        Mechanism::LoadAfterAbort => "the window never opened: no aborted request had a load still in flight when its blocks were reused (needs aborts, --abort-rate > 0, and prefix hits)".into(),
        Mechanism::PreemptSave => "the window never opened: no preempted request's save copied a reused block (needs --preempt-rate > 0 and saves)".into(),
        Mechanism::DecodeAbortFree => "the window never opened: no aborted request's WRITE landed in a decode block another request had taken (needs push mode, --op write, and WRITEs later than --lease: --decode-delay above --lease)".into(),
        Mechanism::PartialStaging => "the window never opened: no request had a block past its first chunk (needs --host-staging and prompts longer than two computed blocks: --prompt-blocks)".into(),
        Mechanism::FailedAsComplete => "the window never opened: no transfer of a request of two or more blocks failed (needs --fail-rate > 0 and more load: --requests)".into(),
    }
}
