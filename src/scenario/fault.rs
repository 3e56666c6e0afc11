//! Test-only damage a scenario plants at decode (`KVPROBE_TEST_FAULT`), which no race of the
//! engine can produce: tests/scenario.rs proves each such slice is reported unexplained.

use crate::error::{Error, Result};

/// A test-only fault hook: `KVPROBE_TEST_FAULT=KIND:N` corrupts one decode slice in each of
/// N verified requests of a scenario, after the READ (or tier load) delivered it and before
/// decode verifies it — damage no race of the engine can produce, so each such slice must be
/// reported unexplained (tests/scenario.rs proves it). Never set in normal use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestFault {
    /// `bitflip`: flips one bit of the slice's first check word.
    Bitflip,
    /// `poison`: overwrites the second half of a slice whose prefill block was rewritten
    /// while its READ was in flight with this iteration's poison (a partial delivery).
    Poison,
    /// `early-free`: prefill frees the blocks of each of the next requests as it hands them
    /// over, before decode's READ, with no mechanism to blame: a block-ownership violation
    /// of a fenced run (it corrupts only when the blocks are reused before the READ).
    EarlyFree,
    /// `torn-tail`: writes 16 bytes of garbage over the poison tail of a slice an
    /// `--inject torn` tore (in the next requests verified that carry one): still `torn`,
    /// but not the predicted bytes, so it must be reported unexplained.
    TornTail,
    /// `late-write`: after the verify of each of the next requests, writes another block's
    /// fingerprint into the first slice of its first decode block (which verified clean): a
    /// write after the verdict, found by the re-verify before the block's re-poison.
    LateWrite,
    /// `late-data`: right after a verify pass judged, before its failing slices are
    /// classified, writes the expected fingerprint into each of the next N failing slices
    /// (data that landed after the verdict): each must be `late`, with the class of the bytes
    /// judged (`judged_class`) and their digest, never a bitflip of 0 bits.
    LateData,
    /// `state-misroute`: a hybrid model's state READ of each of the next N requests reads
    /// prefill's next state slot instead of the request's own (another request's state, or a
    /// slot's genesis): every run of its state pages must be `misplaced` and unexplained.
    StateMisroute,
}

impl TestFault {
    /// The environment variable.
    pub const VAR: &'static str = crate::sys::test_hooks::FAULT;

    /// The name in `KVPROBE_TEST_FAULT`.
    pub fn name(self) -> &'static str {
        match self {
            TestFault::Bitflip => "bitflip",
            TestFault::Poison => "poison",
            TestFault::EarlyFree => "early-free",
            TestFault::TornTail => "torn-tail",
            TestFault::LateWrite => "late-write",
            TestFault::LateData => "late-data",
            TestFault::StateMisroute => "state-misroute",
        }
    }

    /// Reads `KVPROBE_TEST_FAULT` (`bitflip:N`, `poison:N`, `early-free:N`,
    /// `torn-tail:N`, `late-write:N`, `late-data:N` or `state-misroute:N`); errors (exit 2)
    /// on another value.
    pub fn from_env() -> Result<Option<(TestFault, u64)>> {
        let Ok(v) = std::env::var(Self::VAR) else { return Ok(None) };
        let bad = || {
            Error::Usage(format!(
                "{}={v:?}: expected bitflip:N, poison:N, early-free:N, torn-tail:N, late-write:N, late-data:N or state-misroute:N (test-only)",
                Self::VAR
            ))
        };
        let (kind, n) = v.split_once(':').ok_or_else(bad)?;
        let kind = match kind {
            "bitflip" => TestFault::Bitflip,
            "poison" => TestFault::Poison,
            "early-free" => TestFault::EarlyFree,
            "torn-tail" => TestFault::TornTail,
            "late-write" => TestFault::LateWrite,
            "late-data" => TestFault::LateData,
            "state-misroute" => TestFault::StateMisroute,
            _ => return Err(bad()),
        };
        Ok(Some((kind, n.trim().parse().map_err(|_| bad())?)))
    }
}
