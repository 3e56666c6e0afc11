//! kvprobe: proves that KV-cache blocks moved between a prefill and a decode engine arrive
//! intact.
//!
//! The modules stand on floors ([`FLOORS`], lowest first); a module imports only modules of
//! its own floor or the floors below it, and no two modules import each other, directly or
//! not (`tests/house.rs` reads every `crate::` path of `src/` and holds both rules):
//!
//! | floor | modules | concern |
//! |---|---|---|
//! | sys | [`error`], [`child`], [`interrupt`], [`scratch`], [`deadline`], [`hostmem`], [`units`], [`text`], [`par`], [`phase`], [`test_hooks`] | the process: errors and exit codes, children, signals, temporary files, deadlines, host memory, CPU threads, progress phases, test hooks |
//! | core | [`geometry`], [`model_config`], [`fingerprint`], [`pairing`], [`verify`], [`inject`], [`race`], [`workload`] | what a KV cache is and what every byte must be: vLLM's paged layout, a model's KV cache, the fingerprint (shared with the CUDA kernels), two sides that differ, classification, injections, the race vocabulary, the request load |
//! | gpu | [`cuda`] | CUDA devices, memory, kernels |
//! | mem | [`pool`], [`tier`], [`mooncake`] | KV cache pools on VRAM or DRAM, the KV tier, Mooncake Store |
//! | xfer | [`nixl`], [`transport`], [`ucx`], [`rdma`] | NIXL agents and requests, prefill and decode roles, which path UCX chose, RDMA NICs |
//! | env | [`envinfo`] | the environment a run records |
//! | report | [`report`], [`junit`], [`dump`] | the versioned JSON report, JUnit, `--dump` (nothing that drives a run) |
//! | peer | [`peer`] | the protocol between decode and a prefill side (it carries data and knows no engine) |
//! | scenario | [`scenario`] | request-level load: scheduler, connectors, shadow, the two engines |
//! | sweep | [`sweep`] | the whole-pool sweep's configuration and plan |
//! | drive | [`run`], [`serve`], [`ab`], [`bench`](mod@bench) | decode's side, prefill's side, the isolation matrix, the probe's own speed |
//! | evidence | [`bundle`], [`check`], [`inspect`], [`capture`], [`redact`] | bundles, `report check`, `report show/diff`, the environment capture, `--redact` |
//!
//! The binary's command line (`src/main.rs`, `src/cli/`) stands on all of them.
//!
//! `unsafe` lives only in the FFI and OS modules [`cuda`], [`hostmem`], [`nixl`], [`child`],
//! [`interrupt`] (the signal handler) and the C bridge inside [`fingerprint`]: the crate
//! denies it everywhere else.
#![deny(missing_docs)]
// Unsafe code only where the compiler is told it may be (the FFI and OS modules below, and the
// C bridge's calls in `fingerprint`), each block with a `// SAFETY:` comment.
#![deny(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod ab;
pub mod bench;
pub mod bundle;
pub mod capture;
pub mod check;
#[allow(unsafe_code)] // FFI / OS calls
pub mod child;
#[allow(unsafe_code)] // FFI / OS calls
pub mod cuda;
pub mod deadline;
pub mod dump;
pub mod envinfo;
pub mod error;
pub mod fingerprint;
pub mod geometry;
#[allow(unsafe_code)] // FFI / OS calls
pub mod hostmem;
pub mod inject;
pub mod inspect;
#[allow(unsafe_code)] // FFI / OS calls
pub mod interrupt;
pub mod junit;
pub mod model_config;
pub mod mooncake;
#[allow(unsafe_code)] // FFI / OS calls
pub mod nixl;
pub mod pairing;
pub mod par;
pub mod peer;
pub mod phase;
pub mod pool;
pub mod race;
pub mod rdma;
pub mod redact;
pub mod report;
pub mod run;
pub mod scenario;
pub mod scratch;
pub mod serve;
pub mod sweep;
pub mod test_hooks;
pub mod text;
pub mod tier;
pub mod transport;
pub mod ucx;
pub mod units;
pub mod verify;
pub mod workload;

pub use error::{Error, Exit, Result};

/// True when `KVPROBE_TRACE=1`: kvprobe then prints each setup step to stderr, so a crash
/// inside NIXL, UCX or the CUDA driver (which leaves no report) is located by the last line.
pub fn tracing() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KVPROBE_TRACE").is_ok_and(|v| v == "1"))
}

/// Prints `kvprobe trace [pid]: <message>` to stderr when [`tracing`] is on.
#[macro_export]
macro_rules! trace {
    ($($t:tt)*) => {
        if $crate::tracing() {
            eprintln!("kvprobe trace [{}]: {}", std::process::id(), format!($($t)*));
        }
    };
}

/// The floors of the modules, lowest first: (floor, its modules). A module imports only
/// modules of its own floor or below (the table above; `tests/house.rs`).
pub const FLOORS: &[(&str, &[&str])] = &[
    ("sys", &["error", "child", "interrupt", "scratch", "deadline", "hostmem", "units", "text", "par", "phase", "test_hooks"]),
    ("core", &["geometry", "model_config", "fingerprint", "pairing", "verify", "inject", "race", "workload"]),
    ("gpu", &["cuda"]),
    ("mem", &["pool", "tier", "mooncake"]),
    ("xfer", &["nixl", "transport", "ucx", "rdma"]),
    ("env", &["envinfo"]),
    ("report", &["report", "junit", "dump"]),
    ("peer", &["peer"]),
    ("scenario", &["scenario"]),
    ("sweep", &["sweep"]),
    ("drive", &["run", "serve", "ab", "bench"]),
    ("evidence", &["bundle", "check", "inspect", "capture", "redact"]),
];
