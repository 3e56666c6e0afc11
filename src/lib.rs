//! kvprobe: proves that KV-cache blocks moved between a prefill and a decode engine arrive
//! intact.
//!
//! The pipeline, one module per stage, each depending only on the ones before it (no import
//! cycles):
//! [`geometry`] (vLLM paged layout, block slices, descriptors) →
//! [`fingerprint`] (what every byte must be; shared with the CUDA kernels) →
//! [`pairing`] (how two sides that differ in layout or block size line up) →
//! [`pool`] (fill / poison / verify on VRAM or DRAM) →
//! [`transport`] (prefill and decode NIXL roles; [`ucx`] reads which path UCX chose) and
//! [`peer`] (the protocol between a decode and a prefill side: in-process, child or remote;
//! a sweep's requests, or a scenario's steps between its two engines) →
//! [`tier`] / [`race`] (a KV tier on the same blocks, and the orderings between them) →
//! [`scenario`] (request load: scheduler, connectors, shadow, the prefill engine and the
//! decode engine, which talk only by messages) over a [`workload`] →
//! [`inject`] (faults planted through the real path) →
//! [`verify`] (classifying corrupt slices) →
//! [`report`] (versioned JSON and the human summary; it depends on nothing that drives a run).
//! The drivers sit on top: [`sweep`] (the whole-pool sweep's plan, shared by both roles),
//! [`serve`] (the prefill side: a sweep's fills, or a scenario's prefill engine), [`run`] (the
//! decode side: one scenario or the sweep),
//! [`ab`] (the isolation matrix) and [`bench`](mod@bench) (the probe's own speed against same-run
//! ceilings). [`deadline`] bounds every wait of a run (`--timeout`) and ends a run whose call
//! never returns. [`scratch`] keeps the files kvprobe needs while it runs in private
//! directories that never outlive it. [`capture`] writes a bundle's environment capture and
//! [`redact`] its `--redact` replacements; [`units`] words byte counts; [`text`] escapes text
//! that came from outside (a peer, a foreign report) before it reaches a terminal.
//!
//! `unsafe` lives only in the fenced FFI modules [`cuda`], [`hostmem`], [`nixl`], [`child`],
//! [`interrupt`] (the signal handler) and the C bridge inside [`fingerprint`].
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
