//! The registry of test-only hooks: environment variables that make kvprobe misbehave on
//! purpose so that tests can show what it then reports. Never set in normal use; every
//! `KVPROBE_TEST_*` name kvprobe reads is defined here (a test of `tests/house.rs` holds
//! `src/` to it), and the module that acts on it documents what it does.
//!
//! | variable | read by | effect |
//! |---|---|---|
//! | `KVPROBE_TEST_AGENT_START_SECS=SECS` | `peer::client` | replaces the 120 s bound on the prefill child's start |
//! | `KVPROBE_TEST_CONVERT_FAIL=1` | `pool` | DRAM conversion on receive: one slice's write back fails |
//! | `KVPROBE_TEST_DAMAGE_TORN=KIND` | `run` | damages a slice `--inject torn` tore beyond its tear |
//! | `KVPROBE_TEST_DUMP_FULL_AFTER=N` | `dump` | slice writes after the first N fail with ENOSPC |
//! | `KVPROBE_TEST_EARLY_NOTIFY=N` | `run` | WRITE sweeps: iteration N's notifications come before the data |
//! | `KVPROBE_TEST_FAULT=KIND:N` | `scenario::fault` | scenarios: plants N faults of KIND |
//! | `KVPROBE_TEST_LATE_WRITE=WHEN:N` | `run` | a write into decode's pool after the verify judged it |
//! | `KVPROBE_TEST_LEAVE_OUT_REGION=KIND\|NAME` | `sweep::regions` | a hybrid model's region left out of the transfer |
//! | `KVPROBE_TEST_LIE_WRITTEN=1` | `serve` | WRITE sweeps: `written` claims 1000 times the bytes in 1 ns |
//! | `KVPROBE_TEST_STALL_FROM_ITERATION=N[:K]` | `deadline` | arms the stall points from iteration N (stage K) |
//! | `KVPROBE_TEST_STALL_[AGENT_]NAME=SECS` | `deadline` | blocks a call (POST, STATUS, NOTIFICATIONS, SYNC, START) |
//! | `KVPROBE_TEST_SYSFS_ROOT=DIR` | `rdma` | reads a constructed sysfs tree instead of `/sys` |
//! | `KVPROBE_TEST_UNRECALLABLE=1` | `nixl` | requests dropped in flight count as unconfirmed |
//! | `KVPROBE_TEST_VERIFY_SKIP=N` | `pool` | DRAM verify passes skip global slice N |
//! | `KVPROBE_TEST_WIDE_LISTENER=1` | `nixl` | a wildcard listener opens while an agent's backend starts |
//! | `KVPROBE_TEST_WRONG_PEER_BASES=1` | `transport` | checks the peer's descriptors one region off |

/// Replaces [`crate::peer::client::START_BOUND`] (seconds).
pub const AGENT_START_SECS: &str = "KVPROBE_TEST_AGENT_START_SECS";
/// One slice's write back in a DRAM conversion on receive fails ([`crate::mem::pool`]).
pub const CONVERT_FAIL: &str = "KVPROBE_TEST_CONVERT_FAIL";
/// Damage to a torn slice beyond its tear (`tail`, `prefix`, `foreign`; [`crate::drive::run`]).
pub const DAMAGE_TORN: &str = "KVPROBE_TEST_DAMAGE_TORN";
/// A full disk for `--dump` after N slices ([`crate::report::dump`]).
pub const DUMP_FULL_AFTER: &str = "KVPROBE_TEST_DUMP_FULL_AFTER";
/// Notifications before the data in WRITE sweep iteration N ([`crate::drive::run`]).
pub const EARLY_NOTIFY: &str = "KVPROBE_TEST_EARLY_NOTIFY";
/// Faults planted in scenarios ([`crate::scenario::fault::TestFault`]).
pub const FAULT: &str = "KVPROBE_TEST_FAULT";
/// Writes after the verdict in sweeps ([`crate::drive::run`]).
pub const LATE_WRITE: &str = "KVPROBE_TEST_LATE_WRITE";
/// A hybrid model's region (`state`, `indexer` or its name) left out of the transfer
/// ([`crate::sweep::regions`]).
pub const LEAVE_OUT_REGION: &str = "KVPROBE_TEST_LEAVE_OUT_REGION";
/// serve's `written` claims 1000 times the bytes in 1 ns ([`crate::drive::serve`]).
pub const LIE_WRITTEN: &str = "KVPROBE_TEST_LIE_WRITTEN";
/// Arms the stall points from an iteration ([`crate::sys::deadline`]).
pub const STALL_FROM_ITERATION: &str = "KVPROBE_TEST_STALL_FROM_ITERATION";
/// Prefix of the stall points' variables (`KVPROBE_TEST_STALL_POST`, ...;
/// [`crate::sys::deadline::Stall`]).
pub const STALL_PREFIX: &str = "KVPROBE_TEST_STALL_";
/// A constructed sysfs root ([`crate::xfer::rdma`]).
pub const SYSFS_ROOT: &str = "KVPROBE_TEST_SYSFS_ROOT";
/// Requests dropped in flight counted as unconfirmed ([`crate::xfer::nixl`]).
pub const UNRECALLABLE: &str = "KVPROBE_TEST_UNRECALLABLE";
/// A slice the DRAM verify passes skip ([`crate::mem::pool`]).
pub const VERIFY_SKIP: &str = "KVPROBE_TEST_VERIFY_SKIP";
/// A wildcard TCP listener opened while a NIXL agent's backend starts
/// ([`crate::xfer::nixl::check_new_listeners`]).
pub const WIDE_LISTENER: &str = "KVPROBE_TEST_WIDE_LISTENER";
/// The peer's descriptors checked one region off ([`crate::xfer::transport`]).
pub const WRONG_PEER_BASES: &str = "KVPROBE_TEST_WRONG_PEER_BASES";

/// Every hook above (the stall points by their prefix).
pub const ALL: &[&str] = &[
    AGENT_START_SECS,
    CONVERT_FAIL,
    DAMAGE_TORN,
    DUMP_FULL_AFTER,
    EARLY_NOTIFY,
    FAULT,
    LATE_WRITE,
    LEAVE_OUT_REGION,
    LIE_WRITTEN,
    STALL_FROM_ITERATION,
    STALL_PREFIX,
    SYSFS_ROOT,
    UNRECALLABLE,
    VERIFY_SKIP,
    WIDE_LISTENER,
    WRONG_PEER_BASES,
];

/// The value of hook `name`, when set (not necessarily valid: its module parses it).
pub fn value(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// True when hook `name` is set to `1`.
pub fn on(name: &str) -> bool {
    value(name).is_some_and(|v| v == "1")
}
