//! The `kvprobe` command line (binary only): clap's structures, each subcommand's flags, where
//! output goes, and one function per subcommand.

pub(crate) use clap::{Args, Parser, Subcommand};
pub(crate) use kvprobe::ab::AbReport;
pub(crate) use kvprobe::geometry::{Dtype, Layout, Preset};
pub(crate) use kvprobe::mechanism::{Mechanism, RaceSpec, Scenario};
pub(crate) use kvprobe::pool::MemoryKind;
pub(crate) use kvprobe::report::Report;
pub(crate) use kvprobe::run::Hooks;
pub(crate) use kvprobe::scenario::config::{Progress, ScenarioConfig};
pub(crate) use kvprobe::sweep::RunConfig;
pub(crate) use kvprobe::tier::TierKind;
pub(crate) use kvprobe::transport::{Op, XferReq};
pub(crate) use kvprobe::workload::WorkloadConfig;
pub(crate) use kvprobe::{Error, Exit};
pub(crate) use std::io::{IsTerminal, Write};
pub(crate) use std::path::{Path, PathBuf};
pub(crate) use std::time::{Duration, Instant};

mod args;
mod commands;
mod output;

pub(crate) use args::*;
pub(crate) use commands::*;
pub(crate) use output::*;

/// The exit codes of run and ab, as one string literal (so `concat!` can add a reference).
macro_rules! exit_codes {
    () => {
        "Exit codes:
  0  clean: every block slice verified (ab: fenced rows clean, unfenced races detected;
     run --self-test: every planted fault detected as predicted, nothing else corrupt)
  1  corruption found, also when planted by --inject or --race (wins over every other outcome;
     ab: a fenced row is corrupt, or corruption no mechanism explains; run --self-test: a
     planted fault missed or not as predicted, or corruption nothing planted predicts)
  2  usage, configuration or environment error (bad flag, NIXL or GPU missing)
  3  transport or device error during the run
  4  a transfer did not complete within --timeout, or another wait exceeded its bound
  5  transfer rate below --min-gbps (only when given)
  6  an unfenced race mechanism was not detected (ab; run --race MECHANISM: not reproduced)
  7  the run was clean but --report (bench: --json), --junit or --bundle could not be written (disk full,
     ulimit -f): the report is on stderr between -----BEGIN/END KVPROBE REPORT----- lines; other
     outcomes keep their code
  130  interrupted by SIGINT/SIGTERM (partial report written, marked interrupted; a transfer
     in flight gets up to 1 s after the signal to complete)"
    };
}

pub(crate) const EXIT_CODES: &str = exit_codes!();

/// Proves that KV-cache blocks moved between a prefill and a decode engine over NIXL
/// arrive intact.
#[derive(Parser)]
#[command(name = "kvprobe", version, after_help = EXIT_CODES)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Fill fingerprinted KV blocks on prefill, move them with NIXL, verify every block slice on decode (whole-pool sweep, or request-level load with --scenario).
    #[command(
        after_help = concat!(exit_codes!(), "\n\nReference: docs/guide.md (flags, the sweep, --timeout), docs/scenarios.md (--scenario, --race), docs/geometry.md (--model-config, unequal sides, TP), docs/two-hosts.md (--peer), docs/report.md (--report, --dump, --bundle, --junit)."),
        allow_negative_numbers = true
    )]
    Run(RunArgs),
    /// The isolation matrix: nixl-only, tier-only, stacked, and stacked with each race mechanism unfenced, same seed and load.
    ///
    /// 18 rows, one after the other (progress names each: `row 3/18 NAME`); at the default 2000 requests a row the matrix takes minutes. The short form for CI, `--lockstep --requests 500`, still detects every mechanism. How long each form takes: docs/scenarios.md (kvprobe ab).
    #[command(
        after_help = concat!(exit_codes!(), "\n\nReference: docs/scenarios.md (kvprobe ab: the isolation matrix; --lockstep in CI), docs/report.md (the ab report)."),
        allow_negative_numbers = true
    )]
    Ab(AbArgs),
    /// Measure kvprobe's own speed: fill, poison and verify against a same-run copy ceiling, CPU passes against memcpy, and sweep iterations broken down (table, and JSON with --json). Driven by bench/run.sh.
    #[command(after_help = "Reference: docs/gpu-hosts.md (Benchmark: bench/run.sh, what each figure measures).")]
    Bench(BenchArgs),
    /// Read back what kvprobe wrote (run and ab reports, bench results): no GPU or NIXL needed.
    #[command(subcommand)]
    Report(ReportCommand),
    /// Bundle an existing report (and its dump) into one .tar.gz for a vendor, with a manifest and an environment capture made now (the manifest says so).
    #[command(
        after_help = "Exit codes: 0 written; 2 bad input (unreadable report, not a run or ab report, no such dump directory) or the bundle could not be written.\n\nReference: docs/report.md (Bundles, Environment capture and --redact)."
    )]
    Bundle {
        /// The report (`--report` of run or ab).
        #[arg(long)]
        report: PathBuf,
        /// Its dump directory (`--dump`). Default: the directory the report names (`dump.dir`), when it is still there.
        #[arg(long)]
        dump: Option<PathBuf>,
        /// Replace host names, IP addresses and user names in the bundle's text files by stable tokens.
        #[arg(long)]
        redact: bool,
        /// The bundle to write (.tar.gz).
        #[arg(short = 'o', long = "output", value_name = "FILE")]
        output: PathBuf,
    },
    /// Node pair: the prefill side. Listens on ADDR:PORT for one `kvprobe run --peer` at a time (token-checked), fills its pool as the run asks, and serves NIXL READs/WRITEs; exits after one run unless --keep-serving.
    #[command(after_help = concat!(serve_exit_codes!(), "\n\nReference: docs/two-hosts.md (a node pair: serve, run --peer, the token, what crosses the link)."))]
    Serve(ServeArgs),
    /// Print the geometry the geometry flags give (a preset, a model's config.json with --tp and --kv-cache-dtype, the flags over them): one TP rank's per-layer KV shape, slice and pool bytes, and the model's layer groups; nothing is allocated.
    #[command(
        after_help = "Exit codes: 0 printed; 2 bad flags, a config.json that cannot be read or gives no geometry (the reason on stderr), or a geometry kvprobe cannot lay out.\n\nReference: docs/geometry.md (vLLM's KV cache layout, presets, a model's config.json, TP)."
    )]
    Geometry {
        #[command(flatten)]
        geo: GeometryArgs,
        /// Print JSON (the report's `config.geometry` with `slice_bytes`, and `config.model`) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print what was found: GPUs and their links, driver, CUDA, NVRTC, NIXL library and plugins, RDMA NICs (ports, distance to each GPU, the UCX settings that pin the nearest, GPUDirect RDMA), and the path UCX selects for small probe transfers (exit 2 when NIXL is unusable; a failed probe transfer exits with its run's code).
    #[command(
        after_help = "Exit codes: 0 NIXL usable and every probe transfer clean; 2 NIXL unusable (no library, no backend plugin) or a probe transfer refused by the environment; 1 a probe transfer found corruption; 3 a probe transfer failed in transport or on the device; 4 a probe transfer timed out; 130 interrupted. Each failed probe is named with its error in the output.\n\nReference: docs/gpu-hosts.md (UCX paths, RDMA NICs), docs/setup.md (what install-deps.sh installs and how each dependency is found)."
    )]
    Env {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Skip the probe transfers (DRAM READ; on a GPU, VRAM READ and WRITE; with two GPUs, READ across them), each a short `kvprobe run` in a child process.
        #[arg(long)]
        no_probe: bool,
    },
}

#[derive(Subcommand)]
pub(crate) enum ReportCommand {
    /// Print the human summary of a run report, an ab report, a bench JSON or a bundle (its report), in the words the command printed.
    #[command(
        after_help = "Exit codes: 0 shown; 2 unreadable, not JSON, or not a kvprobe document.\n\nReference: docs/report.md."
    )]
    Show {
        /// The file (`--report` of run or ab, `--json` of bench, or a bundle `.tar.gz`).
        file: PathBuf,
    },
    /// Verify a bundle as its receiver (no GPU, no NIXL): the manifest (every file's size and SHA-256), then every dumped slice: the expected bytes regenerated from the fingerprint, the class, first bad offset, bad bytes, sector map, observed identity and digests re-derived from the dumped bytes and compared with the report and index.json.
    #[command(
        after_help = "Exit codes: 0 the bundle is consistent (its corruption, if any, is exactly as its report says); 1 something disagrees (each disagreement on stdout, naming the slice or file and the field); 2 a malformed bundle (not gzip/tar, no manifest, bad JSON).\n\nReference: docs/report.md (what report check re-derives), docs/fingerprint.md (the fingerprint and the failure classes)."
    )]
    Check {
        /// The bundle (`--bundle` of run or ab, or `kvprobe bundle -o`).
        bundle: PathBuf,
    },
    /// Set two documents side by side, differences first: configuration, environment (driver, CUDA, NIXL, UCX, GPUs), the UCX path, the outcome and its counts.
    #[command(
        after_help = "Exit codes (as diff(1)): 0 no differences in the compared fields; 1 differences; 2 a file is unreadable or not a kvprobe document.\n\nReference: docs/report.md."
    )]
    Diff {
        /// The first document (A: e.g. the clean node pair's report).
        a: PathBuf,
        /// The second document (B).
        b: PathBuf,
    },
}
