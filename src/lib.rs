//! kvprobe: proves that KV-cache blocks moved between a prefill and a decode engine arrive
//! intact.
//!
//! The modules stand on floors ([`FLOORS`], lowest first); a module imports only modules of
//! its own floor or the floors below it, and no two modules import each other, directly or
//! not (`tests/house.rs` reads every `crate::` path of `src/` and holds both rules):
//!
//! | floor | modules | concern |
//! |---|---|---|
//! | sys | [`error`], [`child`], [`interrupt`], [`tempdir`], [`deadline`], [`hostmem`], [`units`], [`text`], [`parallel`], [`process`], [`progress`], [`test_hooks`], [`sys::trace`], [`sys::net`] | the process: errors and exit codes, children, signals, temporary files, deadlines, host memory, CPU threads, progress phases, test hooks, `KVPROBE_TRACE`, the sockets it listens on |
//! | core | [`geometry`], [`hybrid`], [`model_config`], [`fingerprint`], [`pairing`], [`verify`], [`inject`], [`mechanism`], [`workload`] | what a KV cache is and what every byte must be: vLLM's paged layout, a model's KV cache and a hybrid model's other regions, the fingerprint (shared with the CUDA kernels), two sides that differ, classification, injections, the race vocabulary, the request load |
//! | gpu | [`cuda`] | CUDA devices, memory, kernels |
//! | mem | [`pool`], [`tier`], [`mooncake`] | KV cache pools on VRAM or DRAM, the KV tier, Mooncake Store |
//! | xfer | [`nixl`], [`transport`], [`ucx`], [`rdma`] | NIXL agents and requests, prefill and decode roles, which path UCX chose, RDMA NICs |
//! | env | [`envinfo`] | the environment a run records |
//! | report | [`report`], [`report::render`], [`report::write`], [`junit`], [`dump`] | the versioned JSON report, its summary and atomic writing, JUnit, `--dump` (nothing that drives a run) |
//! | peer | [`peer`] | the protocol between decode and a prefill side (it carries data and knows no engine) |
//! | scenario | [`scenario`] | request-level load: scheduler, connectors, shadow, the two engines |
//! | sweep | [`sweep`] | the whole-pool sweep's configuration and plan |
//! | drive | [`run`], [`serve`], [`ab`], [`bench`](mod@bench) | decode's side, prefill's side, the isolation matrix, the probe's own speed |
//! | evidence | [`bundle`], [`report_check`], [`show`], [`env_capture`], [`redact`] | bundles, `report check`, `report show/diff`, the environment capture, `--redact` |
//!
//! Each floor is a folder of `src/` (a module of the same name); every module is also
//! re-exported here under its own name (`crate::geometry` is [`core::geometry`]). The binary's
//! command line (`src/main.rs`, `src/cli/`) stands on all of them.
//!
//! `unsafe` lives only in the FFI and OS modules [`cuda`], [`hostmem`], [`nixl`], [`child`],
//! [`interrupt`] (the signal handler) and the C bridge inside [`fingerprint`]: the crate
//! denies it everywhere else.
#![deny(missing_docs)]
// Unsafe code only where the compiler is told it may be (the FFI and OS modules below, and the
// C bridge's calls in `fingerprint`), each block with a `// SAFETY:` comment.
#![deny(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod core;
pub mod drive;
pub mod env;
pub mod error;
pub mod evidence;
pub mod gpu;
pub mod mem;
pub mod peer;
pub mod report;
pub mod scenario;
pub mod sweep;
pub mod sys;
pub mod xfer;

// Each module by its own name too (`crate::geometry`, `kvprobe::pool`): the paths the code and
// its users name, whichever folder holds the file.
pub use self::core::{fingerprint, geometry, hybrid, inject, mechanism, model_config, pairing, verify, workload};
pub use drive::{ab, bench, run, serve};
pub use env::envinfo;
pub use error::{Error, Exit, Result};
pub use evidence::{bundle, env_capture, redact, report_check, show};
pub use gpu::cuda;
pub use mem::{mooncake, pool, tier};
pub use report::{dump, junit};
pub use sys::trace::tracing;
pub use sys::{child, deadline, hostmem, interrupt, parallel, progress, tempdir, test_hooks, text, units};
pub use xfer::{nixl, rdma, transport, ucx};

/// The floors of the modules, lowest first: (floor, its modules). A module imports only
/// modules of its own floor or below (the table above; `tests/house.rs`).
pub const FLOORS: &[(&str, &[&str])] = &[
    (
        "sys",
        &[
            "error",
            "child",
            "interrupt",
            "tempdir",
            "deadline",
            "hostmem",
            "units",
            "text",
            "parallel",
            "process",
            "progress",
            "test_hooks",
            "trace",
            "net",
        ],
    ),
    ("core", &["geometry", "hybrid", "model_config", "fingerprint", "pairing", "verify", "inject", "mechanism", "workload"]),
    ("gpu", &["cuda"]),
    ("mem", &["pool", "tier", "mooncake"]),
    ("xfer", &["nixl", "transport", "ucx", "rdma"]),
    ("env", &["envinfo"]),
    ("report", &["report", "render", "write", "junit", "dump"]),
    ("peer", &["peer"]),
    ("scenario", &["scenario"]),
    ("sweep", &["sweep"]),
    ("drive", &["run", "serve", "ab", "bench"]),
    ("evidence", &["bundle", "report_check", "show", "env_capture", "redact"]),
];
