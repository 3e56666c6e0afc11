//! The `kvprobe` command line: a thin layer over the library.
#![deny(unsafe_code)]

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use kvprobe::ab::AbReport;
use kvprobe::geometry::{Dtype, Layout, Preset};
use kvprobe::inject::Spec;
use kvprobe::pool::MemoryKind;
use kvprobe::race::{Mechanism, RaceSpec, Scenario};
use kvprobe::report::Report;
use kvprobe::run::Hooks;
use kvprobe::scenario::config::{Progress, ScenarioConfig};
use kvprobe::sweep::RunConfig;
use kvprobe::tier::TierKind;
use kvprobe::transport::{Op, XferReq};
use kvprobe::workload::WorkloadConfig;
use kvprobe::{Error, Exit};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const EXIT_CODES: &str = "Exit codes:
  0  clean: every block slice verified (ab: fenced rows clean, unfenced races detected)
  1  corruption found, also when planted by --inject or --race (wins over every other outcome;
     ab: a fenced row is corrupt, or corruption no mechanism explains)
  2  usage, configuration or environment error (bad flag, NIXL or GPU missing)
  3  transport or device error during the run
  4  a transfer did not complete within --timeout, or another wait exceeded its bound
  5  transfer rate below --min-gbps (only when given)
  6  an unfenced race mechanism was not detected (ab; run --race MECHANISM: not reproduced)
  7  the run was clean but --report (bench: --json), --junit or --bundle could not be written (disk full,
     ulimit -f): the report is on stderr between -----BEGIN/END KVPROBE REPORT----- lines; other
     outcomes keep their code
  130  interrupted by SIGINT/SIGTERM (partial report written, marked interrupted; a transfer
     in flight gets up to 1 s after the signal to complete)";

/// Proves that KV-cache blocks moved between a prefill and a decode engine over NIXL
/// arrive intact.
#[derive(Parser)]
#[command(name = "kvprobe", version, after_help = EXIT_CODES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Fill fingerprinted KV blocks on prefill, move them with NIXL, verify every block slice on decode (whole-pool sweep, or request-level load with --scenario).
    #[command(after_help = EXIT_CODES, allow_negative_numbers = true)]
    Run(RunArgs),
    /// The isolation matrix: nixl-only, tier-only, stacked, and stacked with each race mechanism unfenced, same seed and load.
    #[command(after_help = EXIT_CODES, allow_negative_numbers = true)]
    Ab(AbArgs),
    /// Measure kvprobe's own speed: fill, poison and verify against a same-run copy ceiling, CPU passes against memcpy, and sweep iterations broken down (table, and JSON with --json). Driven by bench/run.sh.
    Bench(BenchArgs),
    /// Read back what kvprobe wrote (run and ab reports, bench results): no GPU or NIXL needed.
    #[command(subcommand)]
    Report(ReportCommand),
    /// Bundle an existing report (and its dump) into one .tar.gz for a vendor, with a manifest and an environment capture made now (the manifest says so).
    #[command(
        after_help = "Exit codes: 0 written; 2 bad input (unreadable report, not a run or ab report, no such dump directory) or the bundle could not be written."
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
    #[command(after_help = SERVE_EXIT_CODES)]
    Serve(ServeArgs),
    /// Print the geometry the geometry flags give (a preset, a model's config.json with --tp and --kv-cache-dtype, the flags over them): one TP rank's per-layer KV shape, slice and pool bytes, and the model's layer groups; nothing is allocated.
    #[command(
        after_help = "Exit codes: 0 printed; 2 bad flags, a config.json that cannot be read or gives no geometry (the reason on stderr), or a geometry kvprobe cannot lay out."
    )]
    Geometry {
        #[command(flatten)]
        geo: GeometryArgs,
        /// Print JSON (the report's `config.geometry` with `slice_bytes`, and `config.model`) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print what was found: GPUs and their links, driver, CUDA, NVRTC, NIXL library and plugins, RDMA NICs (ports, distance to each GPU, the UCX settings that pin the nearest, GPUDirect RDMA), and the path UCX selects for small probe transfers (exit 2 when NIXL is unusable).
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
enum ReportCommand {
    /// Print the human summary of a run report, an ab report, a bench JSON or a bundle (its report), in the words the command printed.
    #[command(after_help = "Exit codes: 0 shown; 2 unreadable, not JSON, or not a kvprobe document.")]
    Show {
        /// The file (`--report` of run or ab, `--json` of bench, or a bundle `.tar.gz`).
        file: PathBuf,
    },
    /// Verify a bundle as its receiver (no GPU, no NIXL): the manifest (every file's size and SHA-256), then every dumped slice: the expected bytes regenerated from the fingerprint, the class, first bad offset, bad bytes, sector map, observed identity and digests re-derived from the dumped bytes and compared with the report and index.json.
    #[command(
        after_help = "Exit codes: 0 everything agrees; 1 something disagrees (each disagreement on stdout, naming the slice or file and the field); 2 a malformed bundle (not gzip/tar, no manifest, bad JSON)."
    )]
    Check {
        /// The bundle (`--bundle` of run or ab, or `kvprobe bundle -o`).
        bundle: PathBuf,
    },
    /// Set two documents side by side, differences first: configuration, environment (driver, CUDA, NIXL, UCX, GPUs), the UCX path, the outcome and its counts.
    #[command(
        after_help = "Exit codes (as diff(1)): 0 no differences in the compared fields; 1 differences; 2 a file is unreadable or not a kvprobe document."
    )]
    Diff {
        /// The first document (A: e.g. the clean node pair's report).
        a: PathBuf,
        /// The second document (B).
        b: PathBuf,
    },
}

#[derive(Args)]
struct BenchArgs {
    /// vram: GPU kernels and the copy ceiling, DRAM passes, VRAM sweeps; dram: DRAM passes and sweeps. Default: vram when a GPU is present.
    #[arg(long, value_enum)]
    memory: Option<MemoryKind>,
    /// GPU to measure (and of the prefill pool).
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// A second GPU for the decode pool: adds the cross-device copy ceiling and runs the sweeps across the two GPUs.
    #[arg(long)]
    decode_device: Option<usize>,
    /// GPU pool the kernels and the copy ceiling run over (e.g. 4GiB, 512MiB; whole 2 MiB llama3-8b blocks).
    #[arg(long, default_value = "4GiB", value_parser = parse_bytes)]
    gpu_bytes: u64,
    /// DRAM buffers for memcpy and the CPU passes (two of them are allocated).
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    host_bytes: u64,
    /// Each pool of the sweep breakdowns (llama3-8b geometry).
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    sweep_bytes: u64,
    /// Timed passes per figure after one warm-up (the median is reported).
    #[arg(long, default_value_t = 7)]
    repeats: u32,
    /// Iterations of each sweep breakdown.
    #[arg(long, default_value_t = 5)]
    iterations: u32,
    /// Fingerprint seed (decimal or 0x hex).
    #[arg(long, default_value = "1", value_parser = parse_seed)]
    seed: u64,
    /// Sweeps with the two NIXL agents in two kvprobe processes (run --decode-process: prefill's agent and pool in a child).
    #[arg(long)]
    decode_process: bool,
    /// NIXL backend of the sweeps.
    #[arg(long, default_value = "UCX")]
    backend: String,
    /// Set a parameter of the NIXL backend plugin of the sweeps and request rows (repeatable; run --backend-param).
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_backend_param)]
    backend_param: Vec<(String, String)>,
    /// Seconds to wait for each transfer of the sweeps.
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// Write the results as JSON (schema kvprobe.bench/1), atomically; `-` writes it to stdout (the table then goes to stderr).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write JUnit XML here for CI (atomically): one case per goal (met or missed), plus the outcome.
    #[arg(long)]
    junit: Option<PathBuf>,
}

/// Parses a byte count: a plain number, or with a KiB/MiB/GiB/TiB (or KB/MB/GB/TB, powers of 1000) suffix, any case.
fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let units: [(&str, u64); 8] = [
        ("KiB", 1 << 10),
        ("MiB", 1 << 20),
        ("GiB", 1 << 30),
        ("TiB", 1 << 40),
        ("KB", 1_000),
        ("MB", 1_000_000),
        ("GB", 1_000_000_000),
        ("TB", 1_000_000_000_000),
    ];
    let lower = t.to_ascii_lowercase();
    let (num, mul) = units
        .iter()
        .find_map(|(u, m)| lower.strip_suffix(&u.to_ascii_lowercase()).map(|n| (n.trim(), *m)))
        .unwrap_or((lower.as_str(), 1));
    let n: u64 = num.parse().map_err(|_| format!("{s:?}: expected a byte count such as 4GiB, 512MiB or 1000000"))?;
    n.checked_mul(mul).ok_or_else(|| format!("{s:?}: too large"))
}

/// The KV geometry flags (run, ab, serve).
#[derive(Args, Clone)]
struct GeometryArgs {
    /// Named geometry; the geometry flags below override its fields. run, ab: default small; serve: none (it takes the run's geometry unless one of these flags pins it).
    #[arg(long, value_enum, conflicts_with = "model_config")]
    preset: Option<Preset>,
    /// Geometry of one TP rank of the model a Hugging Face config.json describes (layers, KV heads, head size or MLA latent, dtype; block size 16, MLA 64; blocks for a pool of about 1 GiB); --block-size, --blocks and --layout override. docs/geometry.md "Geometry from a model's config.json".
    #[arg(long, value_name = "PATH")]
    model_config: Option<PathBuf>,
    /// With --model-config: tensor-parallel size; the geometry is one rank's (KV heads / tp, each head replicated when tp exceeds them, MLA's latent whole on every rank).
    #[arg(long, value_name = "N", requires = "model_config")]
    tp: Option<u32>,
    /// With --model-config: KV-cache element type, vLLM's names (auto: the model's torch_dtype, float32 served as bfloat16).
    #[arg(long, value_enum, requires = "model_config")]
    kv_cache_dtype: Option<kvprobe::model_config::KvCacheDtype>,
    /// Attention layers (one NIXL-registered region each).
    #[arg(long, conflicts_with = "model_config")]
    layers: Option<u32>,
    /// KV heads per layer.
    #[arg(long, conflicts_with = "model_config")]
    kv_heads: Option<u32>,
    /// Elements per head (MLA: latent width, e.g. 576).
    #[arg(long, conflicts_with = "model_config")]
    head_size: Option<u32>,
    /// Tokens per block.
    #[arg(long)]
    block_size: Option<u32>,
    /// Blocks per layer (per pool).
    #[arg(long)]
    blocks: Option<u32>,
    /// Element type.
    #[arg(long, value_enum, conflicts_with = "model_config")]
    dtype: Option<Dtype>,
    /// Tensor order of each layer's K/V cache.
    #[arg(long, value_enum)]
    layout: Option<Layout>,
    /// MLA: one latent slice per (layer, block) instead of K and V.
    #[arg(long, conflicts_with = "model_config")]
    mla: bool,
}

impl GeometryArgs {
    /// The geometry the flags give (preset or model config, then each flag over its field),
    /// with what the model config resolved to. Errors (usage, exit 2): a model config that
    /// cannot be read or gives no geometry ([`kvprobe::model_config::ModelConfigError`]).
    fn resolve(&self) -> Result<(kvprobe::geometry::Geometry, Option<kvprobe::model_config::ModelInfo>), Error> {
        let (mut g, model) = match &self.model_config {
            Some(path) => {
                let usage = |e: kvprobe::model_config::ModelConfigError| Error::Usage(e.to_string());
                let kv = kvprobe::model_config::ModelKv::load(path).map_err(usage)?;
                let dtype = self.kv_cache_dtype.unwrap_or_default();
                let (g, tp) = kv.rank_geometry(self.tp.unwrap_or(1), dtype).map_err(usage)?;
                (
                    g,
                    Some(kvprobe::model_config::ModelInfo {
                        path: kvprobe::model_config::show_path(path),
                        kv_cache_dtype: dtype,
                        kv,
                        tp,
                    }),
                )
            }
            None => (self.preset.unwrap_or(Preset::Small).geometry(), None),
        };
        if self.mla {
            g.mla = true;
            if self.kv_heads.is_none() {
                g.num_kv_heads = 1;
            }
        }
        let set = |dst: &mut u32, v: Option<u32>| *dst = v.unwrap_or(*dst);
        set(&mut g.num_layers, self.layers);
        set(&mut g.num_kv_heads, self.kv_heads);
        set(&mut g.head_size, self.head_size);
        set(&mut g.block_size, self.block_size);
        set(&mut g.num_blocks, self.blocks);
        g.dtype = self.dtype.unwrap_or(g.dtype);
        g.layout = self.layout.unwrap_or(g.layout);
        if model.is_some() && self.blocks.is_none() {
            // The default pool size follows the block size given.
            g.num_blocks = kvprobe::model_config::default_blocks(&g);
        }
        Ok((g, model))
    }

    /// The preset's geometry with the flags over it, `--model-config` left out: the geometry
    /// of the report that refuses a model config (nothing is read, nothing can fail).
    fn without_model(&self) -> kvprobe::geometry::Geometry {
        GeometryArgs { model_config: None, ..self.clone() }.resolve().expect("no model config to read").0
    }

    /// True when any geometry flag was given.
    fn any(&self) -> bool {
        self.preset.is_some()
            || self.model_config.is_some()
            || self.mla
            || [self.layers, self.kv_heads, self.head_size, self.block_size, self.blocks].iter().any(Option::is_some)
            || self.dtype.is_some()
            || self.layout.is_some()
    }
}

#[derive(Args)]
#[command(next_help_heading = "Pools and transport")]
struct PoolArgs {
    /// Pool memory: vram (GPU) or dram (host). Default: vram when a GPU is present, else dram.
    #[arg(long, value_enum)]
    memory: Option<MemoryKind>,
    /// GPU holding the prefill pool; with --prefill-tp, one GPU per rank as a comma list (rank 0 first; one GPU: every rank shares it).
    #[arg(long, default_value = "0", value_delimiter = ',', num_args = 1)]
    prefill_device: Vec<usize>,
    /// GPU holding the decode pool; with --decode-tp, one GPU per rank as a comma list (rank 0 first; one GPU: every rank shares it).
    #[arg(long, default_value = "0", value_delimiter = ',', num_args = 1)]
    decode_device: Vec<usize>,
    #[command(flatten)]
    geo: GeometryArgs,
    /// Seed of fingerprints, block mapping, load and injections.
    #[arg(long, default_value = "1", value_parser = parse_seed)]
    seed: u64,
    /// Write the JSON report here (atomically; also when the run fails). `-` writes it to stdout at the end (no checkpoints), and the human summary goes to stderr.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Write JUnit XML here for CI (atomically; also when the run fails, as an error case): run: one case per sweep iteration (scenario: per interval and race mechanism) and per injection; ab: one per row; plus the outcome.
    #[arg(long)]
    junit: Option<PathBuf>,
    /// NIXL backend plugin.
    #[arg(long, default_value = "UCX")]
    backend: String,
    /// Set a parameter of the NIXL backend plugin when it is created (repeatable; a key given twice: the last value counts), e.g. num_threads=2 for UCX. A key the plugin does not read is refused (exit 2), listing the valid ones.
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_backend_param)]
    backend_param: Vec<(String, String)>,
    /// How each NIXL request is made: prepared (one descriptor list per side prepared after connecting, each request made from block-slice indices, as vLLM's NixlConnector) or create (a descriptor list built for each request).
    #[arg(long, value_enum, default_value = "prepared", value_name = "MODE")]
    xfer_req: XferReq,
    /// Bound of every wait, in seconds: each transfer from just before it is posted until it completes and its notification arrives, and each other blocking call (set-up calls: at least 60 s); with --scenario, also for any request to progress.
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// At most this many failures listed in the report, up to 1000000 (counts stay complete; scenarios list up to N explained and N unexplained).
    #[arg(long, default_value_t = 1000)]
    max_failures: usize,
    /// Write every failing block slice exactly as it arrived into DIR (new or empty; ab: DIR/<row>/), with index.json (coordinates, expected identity, digests, the command that regenerates the expected bytes), up to --dump-max-bytes.
    #[arg(long, value_name = "DIR")]
    dump: Option<PathBuf>,
    /// Cap of the slice bytes --dump writes (e.g. 64MiB); counts in the report and index.json stay complete, and the first failures of each class are kept before more of one.
    #[arg(long, default_value = "256MiB", value_parser = parse_bytes, value_name = "BYTES")]
    dump_max_bytes: u64,
    /// At the end of the run, write one .tar.gz holding the report, the dump (a scratch one without --dump), a manifest and an environment capture (for a vendor: `kvprobe report check FILE`).
    #[arg(long, value_name = "FILE")]
    bundle: Option<PathBuf>,
    /// With --bundle: replace host names, IP addresses and user names in the bundle's text files by stable tokens.
    #[arg(long, requires = "bundle")]
    redact: bool,
}

#[derive(Args)]
#[command(next_help_heading = "Request load (with --scenario, and for ab)")]
struct LoadArgs {
    /// Requests to admit, then drain [default: 2000]. Not with --duration.
    #[arg(long)]
    requests: Option<u64>,
    /// Admit requests for this long instead (e.g. 90s, 10m, 1h), then drain. Not with --requests (refused: one of them decides when admission stops).
    #[arg(long, value_parser = parse_duration, conflicts_with = "requests")]
    duration: Option<f64>,
    /// Requests in flight at most.
    #[arg(long, default_value_t = 16)]
    concurrency: u32,
    /// Prompt length in blocks, uniform in MIN-MAX (or one number).
    #[arg(long, default_value = "2-8", value_parser = parse_range)]
    prompt_blocks: (u32, u32),
    /// Share of requests (0-1) that extend an earlier prompt, so tier prefix hits happen.
    #[arg(long, default_value_t = 0.5)]
    prefix_share: f64,
    /// Share of requests (0 to below 1) the client aborts right after their prefill is issued.
    #[arg(long, default_value_t = 0.05)]
    abort_rate: f64,
    /// The KV tier under the connectors.
    #[arg(long, value_enum, default_value = "embedded")]
    tier: TierKind,
    /// With --tier mooncake: an existing master's RPC address (HOST:PORT) instead of one kvprobe starts; needs --mooncake-metadata.
    #[arg(long, value_name = "HOST:PORT", requires = "mooncake_metadata")]
    mooncake_master: Option<String>,
    /// With --mooncake-master: its metadata service (http://HOST:PORT/metadata, etcd://HOST:PORT or P2PHANDSHAKE).
    #[arg(long, value_name = "URL", requires = "mooncake_master")]
    mooncake_metadata: Option<String>,
    /// Engine steps prefill keeps a handed request's blocks before its lease (abort timeout) expires; kept alive until the READ's notification unless abort-timeout-free is unfenced.
    #[arg(long, value_name = "STEPS", default_value_t = kvprobe::scenario::config::DEFAULT_LEASE)]
    lease: u32,
    /// Engine steps one request in eight waits at decode before its pull (a busy decode instance).
    #[arg(long, value_name = "STEPS", default_value_t = kvprobe::scenario::config::DEFAULT_DECODE_DELAY)]
    decode_delay: u32,
    /// Share of requests (0 to below 1) the scheduler preempts after their prefill (recomputed later); their blocks wait for queued saves unless preempt-save is unfenced.
    #[arg(long, default_value_t = kvprobe::scenario::config::DEFAULT_PREEMPT_RATE)]
    preempt_rate: f64,
    /// Share of decode's transfers of two or more blocks (0 to below 1: READs, tier-only loads) in which some blocks fail to move; they are read again unless failed-as-complete is unfenced.
    #[arg(long, default_value_t = kvprobe::scenario::config::DEFAULT_FAIL_RATE)]
    fail_rate: f64,
    /// Host-buffer staging (vLLM's kv_buffer_device=cpu): prefill computes into its own KV cache, chunked (two blocks per chunk), and stages each request's blocks into the pool NIXL reads; every chunk unless partial-staging is unfenced.
    #[arg(long)]
    host_staging: bool,
    /// Tier capacity in blocks. Default: 16 x --blocks, at most 4 GiB of host memory, at least 2 x concurrency x max prompt blocks.
    #[arg(long)]
    tier_blocks: Option<u32>,
    /// Length of each error-rate interval in the report (e.g. 10s; at least 100ms).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    interval: f64,
    /// Complete each step's NIXL READs before the step goes on: the run, corrupt counts included, then replays exactly from --seed (default: READs overlap the tier's copies, as in a real engine).
    #[arg(long)]
    lockstep: bool,
    /// Rewrite the report (atomically) this often during a run, when --report is given (e.g. 30s; 0 = never). ab rewrites it after every row.
    #[arg(long, default_value = "30s", value_parser = parse_duration_or_zero)]
    checkpoint: f64,
}

#[derive(Args)]
#[command(next_help_heading = "Node pair")]
struct PeerArgs {
    /// Node pair: prefill is `kvprobe serve` at HOST:PORT (another host, or another process); this side is decode and drives the run (a sweep, a scenario, or ab's matrix). Every flag of the run applies; --memory and --decode-device are decode's (serve's --memory and --device are prefill's).
    #[arg(long, value_name = "HOST:PORT")]
    peer: Option<String>,
    /// With --peer: the token serve printed or was given, at least 16 characters (default: $KVPROBE_TOKEN). Visible to other users in the process list: prefer KVPROBE_TOKEN.
    #[arg(long, value_name = "T", requires = "peer")]
    token: Option<String>,
}

/// Refuses a GPU flag typed with `--memory dram` (even `--prefill-device 0`, which equals the
/// default: the user meant a GPU the pools will not be on). Errors: usage (exit 2).
fn dram_takes_no_device(c: &RunConfig, typed: &[&str]) -> Result<(), Error> {
    match typed.iter().find(|f| **f == "prefill_device" || **f == "decode_device") {
        Some(f) if c.memory == MemoryKind::Dram => {
            Err(Error::Usage(format!("--{} applies to --memory vram only (the pools are in host memory)", f.replace('_', "-"))))
        }
        _ => Ok(()),
    }
}

impl PeerArgs {
    /// Places prefill at `--peer` in `c` (with its token). `typed`: the flags given on the
    /// command line (clap ids). Errors (usage): `--decode-process` or `--prefill-device` with
    /// it, or no token.
    fn apply(&self, c: &mut RunConfig, typed: &[&str]) -> Result<(), Error> {
        let Some(addr) = &self.peer else { return Ok(()) };
        if c.decode_process {
            return Err(Error::Usage("--peer and --decode-process both place prefill elsewhere: give one".into()));
        }
        if typed.contains(&"prefill_device") {
            return Err(Error::Usage("--prefill-device does not apply to --peer: prefill's GPU is serve's --device".into()));
        }
        c.peer = Some(addr.clone());
        let source = if self.token.is_some() { "--token".to_string() } else { kvprobe::peer::TOKEN_VAR.to_string() };
        c.peer_token = self.token.clone().or_else(|| std::env::var(kvprobe::peer::TOKEN_VAR).ok());
        match c.peer_token.as_deref() {
            None | Some("") => {
                Err(Error::Usage(format!("--peer needs the token serve printed: --token T or {}", kvprobe::peer::TOKEN_VAR)))
            }
            Some(t) => kvprobe::peer::check_token(t, &source),
        }
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    pool: PoolArgs,
    /// read: decode pulls from prefill (vLLM's NixlConnector); write: prefill pushes (the sweep; with --scenario nixl-only or stacked, push mode: prefill WRITEs into the blocks decode asks for).
    #[arg(long, value_enum, default_value = "read")]
    op: Op,
    /// Sweep iterations (each: refill, re-poison, transfer, verify everything).
    #[arg(long, default_value_t = 5)]
    iterations: u32,
    /// Sweep: blocks per NIXL descriptor. The block map moves runs of N consecutive blocks together and each run's contiguous slices travel as one descriptor; 1 = vLLM NixlConnector's per-block descriptors. Must divide the number of blocks.
    #[arg(long, default_value_t = 1, value_name = "N")]
    descriptor_blocks: u32,
    /// Sweep: pipeline stages (consecutive layer ranges, one NIXL request each; while one is in flight the finished ones are verified, refilled and re-poisoned). Default: 8 with VRAM pools on two GPUs (the passes use each GPU's memory while the transfer uses the link), else 1 (the transfer measured alone: on one GPU the passes compete with it for memory bandwidth and slow it by more than they hide; bench/NOTES.md); more when a stage would exceed 65536 descriptors; at most the number of layers.
    #[arg(long, value_name = "N")]
    pipeline_stages: Option<u32>,
    /// Sweep: run the two NIXL agents in two kvprobe processes (as vLLM's engines run), so UCX sees two processes (cuda_ipc between them on VRAM). kvprobe stays decode; prefill's agent and pool (on --memory and --prefill-device) live in a child `kvprobe serve`, driven over the same protocol as --peer.
    #[arg(long)]
    decode_process: bool,
    /// Sweep: plant a fault per iteration: bitflip, drop, misroute, stale, torn, stray (a write into another
    /// pipeline stage's slot; needs --pipeline-stages 3 or more), head-offset or token-offset (a slice's rows moved one
    /// head or one token off: class layout), optionally :COUNT. Repeatable.
    #[arg(long, value_name = "CLASS[:N]")]
    inject: Vec<Spec>,
    /// Exit 5 when the transfer rate (GB/s = 1e9 B/s) is below this.
    #[arg(long)]
    min_gbps: Option<f64>,
    /// Sweep: decode's KV-cache layout when it differs from prefill's (--layout). The bytes travel verbatim (vLLM's NixlConnector); without --permute-local-kv an NHD/HND pair holds the right rows at the wrong positions (class layout, exit 1).
    #[arg(long, value_enum, value_name = "LAYOUT")]
    decode_layout: Option<kvprobe::geometry::Layout>,
    /// Sweep: decode's tokens per block when they differ from prefill's (--block-size); one must be a multiple of the other, and decode's pool holds prefill's tokens (--blocks × prefill's / decode's block size). Decode blocks a multiple of prefill's follow vLLM (block_size_ratio); prefill blocks cut into smaller decode blocks are kvprobe's own rule (vLLM refuses them).
    #[arg(long, value_name = "TOKENS")]
    decode_block_size: Option<u32>,
    /// Sweep: decode converts each received slice from prefill's layout into its own, as vLLM's enable_permute_local_kv (kv_postprocess_layout_on_receive).
    #[arg(long)]
    permute_local_kv: bool,
    /// Sweep: prefill's tensor-parallel size: one NIXL agent and pool per TP rank, each holding its KV heads (the geometry's --kv-heads, or the model's, are the model's total; above the KV heads each head is replicated, as vLLM's get_num_kv_heads). Decode's ranks read by vLLM NixlConnector's TP rules.
    #[arg(long, value_name = "N")]
    prefill_tp: Option<u32>,
    /// Sweep: decode's tensor-parallel size (see --prefill-tp).
    #[arg(long, value_name = "N")]
    decode_tp: Option<u32>,
    #[command(flatten)]
    pair: PeerArgs,
    /// Request-level load instead of the sweep: which connectors move the blocks.
    #[arg(long, value_enum)]
    scenario: Option<Scenario>,
    /// Leave a race mechanism unfenced (the bug) or fenced; implies --scenario stacked. Repeatable. See --help.
    #[arg(long, value_name = "MECHANISM[=unfenced|fenced]")]
    race: Vec<RaceSpec>,
    #[command(flatten)]
    load: LoadArgs,
}

const SERVE_EXIT_CODES: &str = "Exit codes: the run's own code (0 clean, 1 corrupt, 3 transport, 4 timeout, 5 below --min-gbps, 6 an unfenced race mechanism not reproduced (run --race, ab), 7 decode's report not written, 130 interrupted: the two sides end with one outcome); 2 a refused configuration (the reason names the fields; a wrong token or protocol version is refused and serve keeps listening) or a bad flag (--listen that cannot be bound); 3 the decode side died or the link broke; 4 the decode side went silent for --timeout (stopped, link dropped); 130 interrupted while waiting (--keep-serving ends only by a signal: 130).";

#[derive(Args)]
struct ServeArgs {
    /// Address and port to listen on (required; e.g. 10.0.0.2:7000, 0.0.0.0:7000; port 0 picks a free one and prints it). Nothing else is opened until a run connects.
    #[arg(long, value_name = "ADDR:PORT", required_unless_present = "fd")]
    listen: Option<String>,
    /// Internal (the prefill process of `run --decode-process`): serve one session on the Unix socket inherited as descriptor N, token from $KVPROBE_TOKEN; nothing on stdout, no report.
    #[arg(long, value_name = "N", hide = true, conflicts_with_all = ["listen", "keep_serving", "report"])]
    fd: Option<i32>,
    /// Shared token the run must prove, at least 16 characters (default: $KVPROBE_TOKEN; with neither, serve makes a random one and prints it).
    #[arg(long, value_name = "T")]
    token: Option<String>,
    /// Prefill's pool memory: vram (GPU) or dram (host). Default: vram when a GPU is present, else dram.
    #[arg(long, value_enum)]
    memory: Option<MemoryKind>,
    /// Prefill's GPU.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Require this NIXL backend of the run (refused otherwise).
    #[arg(long)]
    backend: Option<String>,
    /// Prefill's geometry: when any of these is given, a run with another geometry is refused, naming the field.
    #[command(flatten)]
    geo: GeometryArgs,
    /// Write serve's JSON report here (atomically) after each run: the run's config and outcome, this side's environment and UCX path, decode's environment under `peer`.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Serve another run after each one (default: exit after one run).
    #[arg(long)]
    keep_serving: bool,
    /// Bound of the wait for a connected client's configuration, in seconds (then the run's --timeout bounds everything).
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
}

#[derive(Args)]
struct AbArgs {
    #[command(flatten)]
    pool: PoolArgs,
    #[command(flatten)]
    load: LoadArgs,
    #[command(flatten)]
    pair: PeerArgs,
    /// Not an ab flag (ab leaves each mechanism unfenced in turn): accepted only to say so
    /// instead of clap's "did you mean --backend".
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "", action = clap::ArgAction::Append)]
    race: Vec<String>,
    /// Not an ab flag (ab runs every scenario): accepted only to say so.
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "")]
    scenario: Option<String>,
}

/// `run` flags that shape a request-level load (clap ids).
const LOAD_FLAGS: &[&str] = &[
    "requests",
    "duration",
    "concurrency",
    "prompt_blocks",
    "prefix_share",
    "abort_rate",
    "tier",
    "tier_blocks",
    "mooncake_master",
    "mooncake_metadata",
    "interval",
    "lockstep",
    "checkpoint",
    "lease",
    "decode_delay",
    "preempt_rate",
    "fail_rate",
    "host_staging",
];

/// `run` flags of the whole-pool sweep only.
const SWEEP_FLAGS: &[&str] = &[
    "iterations",
    "descriptor_blocks",
    "pipeline_stages",
    "decode_process",
    "decode_layout",
    "decode_block_size",
    "permute_local_kv",
    "prefill_tp",
    "decode_tp",
];

/// `run` flags whose use `--peer` checks (clap ids).
const PEER_FLAGS: &[&str] = &["prefill_device"];

/// Flags whose presence on the command line matters though they have defaults (a GPU with
/// `--memory dram` is refused even when it is the default one).
const DEVICE_FLAGS: &[&str] = &["prefill_device", "decode_device"];

/// Parses `--backend-param KEY=VALUE` (a non-empty key of letters, digits and `_`; the
/// value may be empty and may hold `=`).
fn parse_backend_param(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once('=').ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))?;
    if k.is_empty() || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!("the key must be letters, digits and _, got {k:?}"));
    }
    if v.contains('\0') {
        return Err("the value must not contain a NUL byte".into());
    }
    Ok((k.to_string(), v.to_string()))
}

/// Parses a seed in decimal or 0x-prefixed hex.
fn parse_seed(s: &str) -> Result<u64, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.map_err(|_| format!("{s:?} is not a 64-bit seed (decimal or 0x hex)"))
}

/// Parses a positive duration such as `90s`, `10m`, `1h 30m` or a plain number of seconds.
fn parse_duration(s: &str) -> Result<f64, String> {
    let d = parse_duration_or_zero(s)?;
    if d <= 0.0 {
        return Err(format!("{s:?}: the duration must be positive"));
    }
    Ok(d)
}

fn parse_duration_or_zero(s: &str) -> Result<f64, String> {
    let d = match s.trim().parse::<f64>() {
        Ok(x) => x,
        Err(_) => humantime::parse_duration(s.trim())
            .map_err(|e| format!("{s:?} is not a duration (e.g. 30s, 10m, 1h): {e}"))?
            .as_secs_f64(),
    };
    if !d.is_finite() || !(0.0..=1e9).contains(&d) {
        return Err(format!("{s:?}: the duration must be between 0 and 1e9 seconds"));
    }
    Ok(d)
}

/// Parses `MIN-MAX` or `N`.
fn parse_range(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("{s:?} is not MIN-MAX or N (blocks, e.g. 2-8)");
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    let a: u32 = a.trim().parse().map_err(|_| bad())?;
    let b: u32 = b.trim().parse().map_err(|_| bad())?;
    Ok((a, b))
}

impl PoolArgs {
    /// The run's configuration from these flags; errors as [`GeometryArgs::resolve`] (the
    /// model config is read once, here).
    fn try_config(&self) -> Result<RunConfig, Error> {
        let (g, model) = self.geo.resolve()?;
        Ok(self.config_of(g, model))
    }

    /// [`PoolArgs::try_config`], or for a model config that gives no geometry the
    /// configuration of the report that refuses it ([`GeometryArgs::without_model`]).
    fn config(&self) -> RunConfig {
        self.try_config().unwrap_or_else(|_| self.config_of(self.geo.without_model(), None))
    }

    fn config_of(&self, g: kvprobe::geometry::Geometry, model: Option<kvprobe::model_config::ModelInfo>) -> RunConfig {
        let memory =
            self.memory.unwrap_or_else(|| if kvprobe::cuda::device_count() > 0 { MemoryKind::Vram } else { MemoryKind::Dram });
        RunConfig {
            memory,
            prefill_device: self.prefill_device.first().copied().unwrap_or(0),
            decode_device: self.decode_device.first().copied().unwrap_or(0),
            prefill_rank_devices: if self.prefill_device.len() > 1 { self.prefill_device.clone() } else { Vec::new() },
            decode_rank_devices: if self.decode_device.len() > 1 { self.decode_device.clone() } else { Vec::new() },
            preset: if self.geo.model_config.is_some() { None } else { Some(self.geo.preset.unwrap_or(Preset::Small)) },
            model,
            geometry: g,
            decode_geometry: None,
            permute_local_kv: false,
            tp: None,
            op: Op::Read,
            iterations: 1,
            fingerprint: Default::default(),
            seed: self.seed,
            inject: Vec::new(),
            backend: self.backend.clone(),
            backend_params: self.backend_param.iter().cloned().collect(),
            xfer_req: self.xfer_req,
            timeout_secs: self.timeout,
            min_gbps: None,
            max_failures: self.max_failures,
            descriptor_blocks: 1,
            stages: None,
            decode_process: false,
            scenario: None,
            peer: None,
            peer_token: None,
        }
    }
}

impl LoadArgs {
    fn config(&self, scenario: Scenario, unfenced: Vec<Mechanism>, g: &kvprobe::geometry::Geometry) -> ScenarioConfig {
        let (min_blocks, max_blocks) = self.prompt_blocks;
        // Default tier: 16 x the pool's blocks, at most 4 GiB of host memory, and never
        // fewer entries than in-flight requests can pin.
        let block = (g.num_layers as u64 * g.kv_parts() as u64 * g.slice_bytes().unwrap_or(1)).max(1);
        let pinned = 2 * self.concurrency as u64 * max_blocks as u64;
        let auto = (16 * g.num_blocks as u64).min((4u64 << 30) / block).max(pinned).min(u32::MAX as u64) as u32;
        ScenarioConfig {
            scenario,
            unfenced,
            requests: self.requests.unwrap_or(2000),
            duration_secs: self.duration,
            concurrency: self.concurrency,
            workload: WorkloadConfig { min_blocks, max_blocks, prefix_share: self.prefix_share, abort_rate: self.abort_rate },
            tier: self.tier,
            mooncake: match (&self.mooncake_master, &self.mooncake_metadata) {
                (Some(m), Some(u)) => Some(kvprobe::mooncake::External { master: m.clone(), metadata_url: u.clone() }),
                _ => None,
            },
            tier_blocks: self.tier_blocks.unwrap_or(auto),
            interval_secs: self.interval,
            lockstep: self.lockstep,
            lease_steps: self.lease,
            decode_delay_steps: self.decode_delay,
            preempt_rate: self.preempt_rate,
            fail_rate: self.fail_rate,
            inject: Vec::new(),
            push: false,
            staging: self.host_staging,
            matrix: false,
        }
    }
}

impl RunArgs {
    /// The run's configuration. `typed`: the flags given on the command line (clap ids).
    fn config(&self, typed: &[&str]) -> Result<RunConfig, Error> {
        let mut c = self.pool.try_config()?;
        c.op = self.op;
        c.iterations = self.iterations;
        c.descriptor_blocks = self.descriptor_blocks;
        c.stages = self.pipeline_stages;
        c.decode_process = self.decode_process;
        dram_takes_no_device(&c, typed)?;
        self.pair.apply(&mut c, typed)?;
        c.inject = self.inject.clone();
        c.min_gbps = self.min_gbps;
        let mut sides =
            kvprobe::pairing::Sides::derive(&c.geometry, self.decode_layout, self.decode_block_size, self.permute_local_kv)
                .map_err(Error::Usage)?;
        // Flags that change nothing here are said, not silently dropped.
        if c.geometry.mla && self.decode_layout.is_some_and(|l| l != c.geometry.layout) {
            eprintln!("note: --decode-layout changes nothing with --mla (one latent row per token: no layout to differ in)");
        }
        if self.permute_local_kv && c.geometry.mla {
            eprintln!("note: --permute-local-kv changes nothing with --mla (one latent row per token: no layout to convert)");
        } else if self.permute_local_kv && sides.prefill.layout == sides.decode.layout {
            eprintln!(
                "note: --permute-local-kv changes nothing here: both sides have one layout (it converts between NHD and HND)"
            );
        }
        if self.prefill_tp.is_some() || self.decode_tp.is_some() {
            if self.pool.geo.tp.is_some() {
                return Err(Error::Usage(
                    "--tp gives one rank's geometry on both sides; with --prefill-tp/--decode-tp the model's whole KV cache is split by each side's TP size: give those alone".into(),
                ));
            }
            let tp = kvprobe::pairing::tp::Tp {
                prefill: self.prefill_tp.unwrap_or(1),
                decode: self.decode_tp.unwrap_or(1),
                total_kv_heads: if c.geometry.mla { 1 } else { c.geometry.num_kv_heads },
                mla: c.geometry.mla,
            };
            sides = sides.with_tp(tp).map_err(Error::Usage)?;
            c.tp = (!tp.is_single()).then_some(tp);
            c.geometry = sides.prefill.clone();
        }
        c.decode_geometry = (sides.decode != sides.prefill).then_some(sides.decode);
        c.permute_local_kv = self.permute_local_kv;
        let flag = |id: &str| format!("--{}", id.replace('_', "-"));
        let scenario = match (self.scenario, self.race.is_empty()) {
            (Some(s), true) => Some(s),
            (None, false) => Some(Scenario::Stacked),
            (Some(s), false) => match self.race.iter().find(|r| !r.mechanism.applies_to(s)) {
                None => Some(s),
                Some(r) => {
                    return Err(Error::Usage(format!(
                        "--race {} needs both connectors on the same blocks (--scenario stacked), not --scenario {}",
                        r.mechanism,
                        s.name()
                    )));
                }
            },
            (None, true) => None,
        };
        match scenario {
            Some(s) => {
                if let Some(f) = typed.iter().find(|f| SWEEP_FLAGS.contains(f)) {
                    return Err(Error::Usage(format!(
                        "{} applies to the whole-pool sweep; a scenario runs --requests or --duration",
                        flag(f)
                    )));
                }
                let races = kvprobe::race::Races::from_specs(&self.race);
                if !s.uses_tier()
                    && (self.load.mooncake_master.is_some() || typed.iter().any(|f| *f == "tier" || *f == "tier_blocks"))
                {
                    return Err(Error::Usage(format!(
                        "--scenario {} moves blocks over NIXL only; --tier, --tier-blocks and --mooncake-* apply to tier-only and stacked",
                        s.name()
                    )));
                }
                c.scenario = Some(ScenarioConfig {
                    inject: c.inject.clone(),
                    push: c.op == Op::Write,
                    ..self.load.config(s, races.list(), &c.geometry)
                });
            }
            None => {
                if let Some(f) = typed.iter().find(|f| LOAD_FLAGS.contains(f)) {
                    return Err(Error::Usage(format!(
                        "{} shapes a request-level load: add --scenario {} (or --race)",
                        flag(f),
                        if *f == "host_staging" { "nixl-only|stacked" } else { "nixl-only|tier-only|stacked" }
                    )));
                }
            }
        }
        Ok(c)
    }
}

/// Set when `--report -` / `--json -` sends the JSON to stdout: the human output then goes to
/// stderr, so stdout holds nothing but the JSON.
static HUMAN_TO_STDERR: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Writes the human output to stdout (stderr when stdout carries the JSON), ignoring
/// failures: a closed pipe (`kvprobe run | head`) must not cost the report or the exit code.
fn out(text: &str) {
    if HUMAN_TO_STDERR.load(std::sync::atomic::Ordering::Relaxed) {
        let _ = std::io::stderr().write_all(text.as_bytes());
    } else {
        let _ = std::io::stdout().write_all(text.as_bytes());
    }
}

/// Where a run's JSON report will be, in the words of the summary's pointer to its full
/// list of failures ([`kvprobe::report::render_with`]): the `--report` file, the JSON on
/// stdout, or the bundle's report.json; `None` when the run writes none.
fn json_named(report: &Option<PathBuf>, bundle: &Option<PathBuf>) -> Option<String> {
    match (report, bundle) {
        (Some(p), _) if is_stdout(p) => Some("on stdout".into()),
        (Some(p), _) => Some(p.display().to_string()),
        (None, Some(b)) => Some(format!("report.json in {}", b.display())),
        (None, None) => None,
    }
}

/// The clap ids among `flags` that were typed on the command line (not defaults).
fn typed_flags<'a>(m: &clap::ArgMatches, flags: impl Iterator<Item = &'a &'static str>) -> Vec<&'static str> {
    flags.copied().filter(|f| m.value_source(f) == Some(clap::parser::ValueSource::CommandLine)).collect()
}

/// True when a `--report`/`--json` path is `-`: the JSON goes to stdout.
fn is_stdout(p: &Path) -> bool {
    p.as_os_str() == "-"
}

/// Sends the human output to stderr when `path` is `-` (the JSON then owns stdout).
fn claim_stdout(path: &Option<PathBuf>) {
    if path.as_deref().is_some_and(is_stdout) {
        HUMAN_TO_STDERR.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Writes a `--report`/`--json` document: pretty JSON on stdout for `-` (once, at the end),
/// else atomically to the file. Errors: [`Error::Io`] (exit 2).
fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<(), Error> {
    if !is_stdout(path) {
        return kvprobe::report::write_atomic(path, value);
    }
    let mut body = serde_json::to_vec_pretty(value).map_err(|e| Error::Io(format!("report: serialise: {e}")))?;
    body.push(b'\n');
    let mut o = std::io::stdout().lock();
    o.write_all(&body).and_then(|_| o.flush()).map_err(|e| Error::Io(format!("report: writing the JSON to stdout: {e}")))
}

/// Checkpoints rewrite a file; stdout takes the JSON only once, at the end.
fn checkpoints_to(path: &Option<PathBuf>) -> Option<PathBuf> {
    path.clone().filter(|p| !is_stdout(p))
}

/// Writes a line to stderr, ignoring failures.
fn err(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The spinner showing the current set-up or bench phase on a terminal (see [`show_phases`]).
static PHASE_BAR: std::sync::Mutex<Option<indicatif::ProgressBar>> = std::sync::Mutex::new(None);

/// Shows each phase the library announces ([`kvprobe::phase`]): on a terminal as one spinner
/// line (cleared by [`end_phases`] before anything else is printed), otherwise as one plain
/// line on stderr per phase. `setup_lines`: whether plain lines include `setup:` phases
/// (bench leaves its sweeps' set-up steps to the spinner).
fn show_phases(setup_lines: bool) {
    if std::io::stderr().is_terminal() {
        kvprobe::phase::set_sink(|msg| {
            let mut g = PHASE_BAR.lock().unwrap_or_else(|e| e.into_inner());
            let bar = g.get_or_insert_with(|| {
                let b = indicatif::ProgressBar::new_spinner();
                if let Ok(st) = indicatif::ProgressStyle::with_template("{spinner} {msg} [{elapsed}]") {
                    b.set_style(st);
                }
                b.enable_steady_tick(Duration::from_millis(100));
                b
            });
            bar.set_message(msg.to_string());
        });
    } else {
        kvprobe::phase::set_sink(move |msg| {
            if setup_lines || !msg.starts_with("setup:") {
                err(msg);
            }
        });
    }
}

/// Clears the phase spinner (before other output on the terminal).
fn end_phases() {
    if let Some(b) = PHASE_BAR.lock().unwrap_or_else(|e| e.into_inner()).take() {
        b.finish_and_clear();
    }
}

/// Live progress on stderr: a spinner line on a terminal, else a plain line every 10 s.
struct Display {
    bar: Option<indicatif::ProgressBar>,
    last_line: Option<Instant>,
}

impl Display {
    fn new() -> Display {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = indicatif::ProgressBar::new_spinner();
            if let Ok(st) = indicatif::ProgressStyle::with_template("{spinner} {msg}") {
                b.set_style(st);
            }
            b
        });
        Display { bar, last_line: None }
    }

    fn update(&mut self, label: &str, p: &Progress) {
        end_phases();
        let rate = if p.elapsed > 0.0 { p.requests as f64 / p.elapsed } else { 0.0 };
        let gbps = if p.elapsed > 0.0 { p.bytes as f64 / p.elapsed / 1e9 } else { 0.0 };
        let done = match (p.target_secs, p.target_requests) {
            _ if p.draining => " (draining)".to_string(),
            (Some(d), _) => format!(" ({:.0}%)", (100.0 * p.elapsed / d).min(100.0)),
            (None, Some(n)) if n > 0 => format!(" of {n}"),
            _ => String::new(),
        };
        let msg = format!(
            "{label}[{:.1} s] {} requests verified{done}, {rate:.1} req/s, {gbps:.3} GB/s over NIXL (over the wall time), {} corrupt slices",
            p.elapsed, p.requests, p.corrupt
        );
        match &self.bar {
            Some(b) => {
                b.set_message(msg);
                b.tick();
            }
            None => {
                if self.last_line.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                    self.last_line = Some(Instant::now());
                    err(&msg);
                }
            }
        }
    }

    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

fn install_signals() -> Result<(), Exit> {
    kvprobe::interrupt::install().map_err(|e| {
        err(&format!("kvprobe: cannot install signal handlers: {e}"));
        Exit::Usage
    })?;
    // The watchdog also ends the run on a second signal (with the report so far).
    kvprobe::deadline::start_watchdog();
    Ok(())
}

fn check_report_path(path: &Option<PathBuf>) -> Result<(), Exit> {
    let checked = match path {
        Some(p) if is_stdout(p) => stdout_takes_json("--report"),
        Some(p) => kvprobe::report::check_writable(p),
        None => Ok(()),
    };
    checked.map_err(|e| {
        err(&format!("kvprobe: {e}"));
        e.exit()
    })
}

/// Where a path leads, for comparing output paths: the file's device and inode when it exists
/// (so a symlink or another spelling of the same file compares equal), else its parent directory
/// resolved (symlinks, `..`) joined with its name.
#[derive(PartialEq, Eq)]
enum Place {
    File(u64, u64),
    Path(PathBuf),
}

fn place(p: &Path) -> Place {
    place_at(p, 0)
}

fn place_at(p: &Path, depth: u32) -> Place {
    use std::os::unix::fs::MetadataExt;
    if let Ok(m) = std::fs::metadata(p) {
        return Place::File(m.dev(), m.ino());
    }
    let parent = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    // A dangling symlink: where it points (the file it would create).
    if depth < 8
        && let Ok(t) = std::fs::read_link(p)
    {
        return place_at(&parent.join(t), depth + 1);
    }
    Place::Path(absolute(parent).join(p.file_name().unwrap_or_default()))
}

/// `p` resolved: its longest existing ancestor canonicalised (symlinks, `..`), the rest joined
/// lexically (`.` dropped, `..` taking off a part).
fn absolute(p: &Path) -> PathBuf {
    use std::path::Component;
    let p = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let parts: Vec<Component> = p.components().collect();
    let mut k = parts.len();
    let mut out = loop {
        let prefix: PathBuf = parts[..k].iter().collect();
        if let Ok(c) = std::fs::canonicalize(&prefix) {
            break c;
        }
        if k == 0 {
            break PathBuf::from("/");
        }
        k -= 1;
    };
    for c in &parts[k..] {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(x) => out.push(x),
            _ => {}
        }
    }
    out
}

/// Refuses (exit 2, before anything runs) output flags that lead to the same file — one output
/// would silently replace another (`--report r.json --junit r.json`, also through a symlink or
/// another spelling) — or an output file inside the `--dump` directory (the dump holds only
/// its own files, and a bundle would carry that file as dump content). `-` (stdout) is not a
/// file and is left out.
fn check_distinct_outputs(files: &[(&str, &Option<PathBuf>)], dump: Option<&Path>) -> Result<(), Exit> {
    let given: Vec<(&str, &Path)> =
        files.iter().filter_map(|(f, p)| p.as_deref().filter(|p| !is_stdout(p)).map(|p| (*f, p))).collect();
    let refuse = |why: String| {
        err(&format!("kvprobe: {why}"));
        Err(Exit::Usage)
    };
    for (i, (fa, a)) in given.iter().enumerate() {
        for (fb, b) in &given[i + 1..] {
            if place(a) == place(b) {
                return refuse(format!(
                    "{fa} {} and {fb} {} are the same file: one would replace the other (give each its own path)",
                    a.display(),
                    b.display()
                ));
            }
        }
        if let Some(d) = dump {
            let (dd, pa) = (absolute(d), absolute(a));
            if pa.starts_with(&dd) {
                return refuse(format!(
                    "{fa} {} is inside --dump {}: the dump directory holds only the dump (put {fa} elsewhere)",
                    a.display(),
                    d.display()
                ));
            }
        }
    }
    Ok(())
}

/// The output checks of `run` and `ab` before anything runs: distinct output files, none inside
/// `--dump` ([`check_distinct_outputs`]), a writable `--report` and `--junit`.
fn check_outputs(pool: &PoolArgs) -> Result<(), Exit> {
    check_distinct_outputs(
        &[("--report", &pool.report), ("--junit", &pool.junit), ("--bundle", &pool.bundle)],
        pool.dump.as_deref(),
    )
    .and_then(|_| check_report_path(&pool.report))
    .and_then(|_| check_junit_path(&pool.junit))
}

/// Checks a `--junit` path before the run: a file (not `-`) that can be written.
fn check_junit_path(path: &Option<PathBuf>) -> Result<(), Exit> {
    let checked = match path {
        Some(p) if is_stdout(p) => Err(Error::Usage("--junit needs a file path (`-` is not supported)".into())),
        Some(p) => kvprobe::report::check_writable_for(p, "--junit"),
        None => Ok(()),
    };
    checked.map_err(|e| {
        err(&format!("kvprobe: {e}"));
        e.exit()
    })
}

/// Which JUnit document a command's JSON gives ([`kvprobe::junit`]).
type JunitOf = fn(&serde_json::Value) -> quick_junit::Report;

/// Writes the JUnit XML of `doc` to `path` (`--junit`), when given, and says where it went.
/// Returns `exit`, or 7 in place of 0 when it could not be written (the error on stderr): a
/// missing file must not pass for a clean run.
fn write_junit<T: serde::Serialize>(path: &Option<PathBuf>, of: JunitOf, doc: &T, exit: Exit) -> Exit {
    let Some(p) = path else { return exit };
    let written =
        serde_json::to_value(doc).map_err(|e| Error::Io(format!("--junit: {e}"))).and_then(|v| kvprobe::junit::write(p, &of(&v)));
    match written {
        Ok(()) => {
            out(&format!(
                "junit:             {}
",
                p.display()
            ));
            exit
        }
        Err(e) => {
            err(&format!("kvprobe: --junit {} was not written: {e}", p.display()));
            if exit == Exit::Clean { Exit::ReportNotWritten } else { exit }
        }
    }
}

/// Refuses `FLAG -` when stdout is /dev/null, as `FLAG /dev/null` is refused: the JSON would
/// be lost. That includes a closed stdout (`>&-`), which the Rust runtime reopens on /dev/null
/// at start-up. Errors: usage (exit 2).
fn stdout_takes_json(flag: &str) -> Result<(), Error> {
    use std::os::unix::fs::MetadataExt;
    let same = |a: &std::fs::Metadata, b: &std::fs::Metadata| a.dev() == b.dev() && a.ino() == b.ino();
    match (std::fs::metadata("/proc/self/fd/1"), std::fs::metadata("/dev/null")) {
        (Ok(out), Ok(null)) if same(&out, &null) => Err(Error::Usage(format!(
            "{flag} - writes the JSON to stdout, but stdout is closed or /dev/null: it would be lost (give a file, or keep stdout open)"
        ))),
        _ if std::env::var("UCX_LOG_FILE").is_ok_and(|v| v == "stdout") => Err(Error::Usage(format!(
            "{flag} - writes the JSON to stdout, and UCX_LOG_FILE=stdout would mix UCX's log into it: unset it or give a file"
        ))),
        _ => Ok(()),
    }
}

/// A call blocked past its deadline: the watchdog ([`kvprobe::deadline`]) ends the run from
/// its own thread (the stuck call is never joined). `finish` builds what to write and show
/// (the document, its exit code, the text for the human output); this clears the status
/// lines, writes `path` as the normal end does ([`write_json`], [`report_lost`]), prints, and
/// exits with the code. Helper processes die with kvprobe.
fn on_stall<T, F>(
    bar: Option<indicatif::ProgressBar>,
    path: Option<PathBuf>,
    junit: (Option<PathBuf>, JunitOf),
    label: &'static str,
    finish: F,
) where
    T: serde::Serialize,
    F: Fn(&Error) -> (T, Exit, String) + Send + Sync + 'static,
{
    kvprobe::deadline::on_expiry(std::sync::Arc::new(move |e: &Error| {
        if let Some(b) = &bar {
            b.finish_and_clear();
        }
        // try_lock: the stuck thread may be the one announcing a phase.
        if let Ok(mut g) = PHASE_BAR.try_lock()
            && let Some(b) = g.take()
        {
            b.finish_and_clear();
        }
        let (doc, exit, text) = finish(e);
        let lost = path.as_ref().and_then(|p| write_json(p, &doc).err());
        out(&text);
        err(&format!("kvprobe: {e}"));
        let exit = match (&path, lost) {
            (Some(p), None) => {
                if !is_stdout(p) {
                    out(&format!("{label}{}\n", p.display()));
                }
                exit
            }
            (Some(p), Some(we)) => report_lost(&format!("--report {}", p.display()), &doc, &we, exit),
            (None, _) => exit,
        };
        let exit = write_junit(&junit.0, junit.1, &doc, exit);
        kvprobe::nixl::exit_now(exit as u8)
    }));
}

/// `kvprobe geometry`: prints what the geometry flags resolve to.
fn geometry_command(geo: &GeometryArgs, json: bool) -> Exit {
    let (g, model) = match geo.resolve() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvprobe: {e}");
            return e.exit();
        }
    };
    if let Err(e) = g.validate() {
        eprintln!("kvprobe: {e}");
        return Exit::Usage;
    }
    if json {
        #[derive(serde::Serialize)]
        struct Out<'a> {
            #[serde(serialize_with = "kvprobe::geometry::serialize_with_slice_bytes")]
            geometry: &'a kvprobe::geometry::Geometry,
            pool_bytes: u64,
            #[serde(skip_serializing_if = "Option::is_none")]
            model: Option<&'a kvprobe::model_config::ModelInfo>,
        }
        let out = Out { geometry: &g, pool_bytes: g.pool_bytes().unwrap_or(0), model: model.as_ref() };
        println!("{}", serde_json::to_string_pretty(&out).expect("serialisable"));
        return Exit::Clean;
    }
    print!("{}", kvprobe::model_config::describe(&g, model.as_ref()));
    Exit::Clean
}

fn run(args: RunArgs, typed: &[&str]) -> Exit {
    claim_stdout(&args.pool.report);
    if let Err(x) = check_outputs(&args.pool).and_then(|_| install_signals()) {
        return x;
    }
    let cfg = match args.config(typed) {
        Ok(c) => c,
        Err(e) => {
            return refused(&args.pool, &kvprobe::run::failed_report(&args.pool.config(), &e), kvprobe::junit::from_run, &e);
        }
    };
    let mut display = Display::new();
    let stall_cfg = cfg.clone();
    let json_at = json_named(&args.pool.report, &args.pool.bundle);
    let json_at_end = json_at.clone();
    on_stall(
        display.bar.clone(),
        args.pool.report.clone(),
        (args.pool.junit.clone(), kvprobe::junit::from_run),
        "report:            ",
        move |e| {
            let (r, exit) = kvprobe::run::expired_report(&stall_cfg, e);
            let text = if r.summary.iterations > 0 || r.scenario.is_some() {
                kvprobe::report::render_with(&r, json_at.as_deref())
            } else {
                String::new()
            };
            (r, exit, text)
        },
    );
    let mut ckpt_failed = false;
    let path = checkpoints_to(&args.pool.report);
    show_phases(true);
    let mut line = |l: &str| {
        end_phases();
        err(l)
    };
    let mut progress = |p: &Progress| display.update("", p);
    let mut checkpoint = |r: &Report| {
        if let Some(path) = &path
            && let Err(e) = kvprobe::report::write_atomic(path, r)
            && !ckpt_failed
        {
            ckpt_failed = true;
            err(&format!("kvprobe: checkpoint: {e}"));
        }
    };
    let mut dumper = match start_dump(&args.pool, &cfg, None) {
        Ok(d) => d,
        Err(e) => return refused(&args.pool, &kvprobe::run::failed_report(&cfg, &e), kvprobe::junit::from_run, &e),
    };
    let mut hooks = Hooks {
        line: &mut line,
        progress: &mut progress,
        checkpoint_secs: if cfg.scenario.is_some() { args.load.checkpoint } else { 0.0 },
        checkpoint: &mut checkpoint,
        dump: dumper.as_mut(),
    };
    let (mut report, exit) = kvprobe::run::run(&cfg, &mut hooks);
    if let Some(d) = dumper.as_mut() {
        report.dump = Some(d.finish());
    }
    end_phases();
    display.finish();
    let lost = args.pool.report.as_ref().and_then(|p| write_json(p, &report).err());
    if report.summary.iterations > 0 || report.outcome.error.is_none() || report.scenario.is_some() {
        out(&kvprobe::report::render_with(&report, json_at_end.as_deref()));
    }
    report_error(&report.outcome);
    let exit = report_outcome(&args.pool.report, lost, &report, exit, "report:            ");
    if let (Some(d), Some(_)) = (&report.dump, &args.pool.dump) {
        out(&format!(
            "dump:              {} ({} slices written, {} left out by --dump-max-bytes or a failed write)\n",
            d.dir, d.slices_written, d.slices_omitted
        ));
    }
    let exit = finish_bundle(&args.pool, &report, "report.json", exit);
    write_junit(&args.pool.junit, kvprobe::junit::from_run, &report, exit)
}

/// A run or ab refused before it started (`e`: bad flags, a dump directory that is not empty,
/// an unwritable bundle path): says why, and still leaves `doc` (a report saying why) at
/// `--report` (or on stderr when it cannot be written) and its `--junit` error case, as every
/// other error does. Returns the error's exit code.
fn refused<T: serde::Serialize>(pool: &PoolArgs, doc: &T, of: JunitOf, e: &Error) -> Exit {
    err(&format!("kvprobe: {e}"));
    if let Some(path) = &pool.report
        && let Err(w) = write_json(path, doc)
    {
        kvprobe::report::print_fallback(&format!("--report {}", path.display()), doc, &w);
    }
    write_junit(&pool.junit, of, doc, e.exit())
}

/// The dump directory of a run (`--dump`, or with `--bundle` alone a scratch one).
fn dump_dir(pool: &PoolArgs) -> Result<Option<PathBuf>, Error> {
    match (&pool.dump, &pool.bundle) {
        (Some(d), _) => Ok(Some(d.clone())),
        (None, Some(_)) => Ok(Some(kvprobe::scratch::dir()?.join("dump"))),
        (None, None) => Ok(None),
    }
}

/// Checks `--dump`/`--bundle` before the run (exit 2: a non-empty dump directory, an
/// unwritable bundle path) and, for `run` (`row` None), starts the dump.
fn start_dump(pool: &PoolArgs, cfg: &RunConfig, row: Option<&str>) -> Result<Option<kvprobe::dump::Dumper>, Error> {
    if let Some(b) = &pool.bundle {
        if is_stdout(b) {
            return Err(Error::Usage("--bundle needs a file path (`-` is not supported)".into()));
        }
        kvprobe::report::check_writable_for(b, "--bundle")?;
    }
    let Some(dir) = dump_dir(pool)? else { return Ok(None) };
    kvprobe::dump::check_dir(&dir)?;
    if row.is_some() {
        return Ok(None);
    }
    let config = serde_json::to_value(cfg).unwrap_or_default();
    let geometry = kvprobe::dump::dumped_geometry(&config).clone();
    let sb = cfg.decode_geom().slice_bytes()?;
    let shape = kvprobe::fingerprint::RowShape::of(cfg.decode_geom());
    kvprobe::dump::Dumper::new(&dir, pool.dump_max_bytes, cfg.seed, geometry, sb, shape, config["tp"].clone()).map(Some)
}

/// `--bundle` at the end of run and ab: the report `doc` (as `name`), the dump, and the
/// environment captured now with the run's UCX log. A bundle that cannot be written is said on
/// stderr and turns a clean exit into 7 (as a report that cannot be written does).
fn finish_bundle<T: serde::Serialize>(pool: &PoolArgs, doc: &T, name: &'static str, exit: Exit) -> Exit {
    let Some(path) = &pool.bundle else { return exit };
    let result = serde_json::to_vec_pretty(doc).map_err(|e| Error::Io(format!("--bundle: {e}"))).and_then(|mut body| {
        body.push(b'\n');
        let dir = dump_dir(pool)?;
        let c = kvprobe::bundle::Contents {
            report: body,
            report_name: name,
            dump: dir.as_deref().filter(|d| d.is_dir()),
            capture_made: "run",
            ucx_log: None, // the capture reads this process's own UCX log
            redact: pool.redact,
        };
        kvprobe::bundle::write(path, &c)
    });
    match result {
        Ok(_) => {
            out(&format!("bundle:            {}\n", path.display()));
            exit
        }
        Err(e) => {
            err(&format!("kvprobe: --bundle {} was not written: {e}", path.display()));
            if exit == Exit::Clean { Exit::ReportNotWritten } else { exit }
        }
    }
}

/// `kvprobe bundle`: an existing report and dump into a bundle, the environment captured now.
fn bundle_command(report: &Path, dump: Option<&Path>, redact: bool, output: &Path) -> Exit {
    let made = (|| -> Result<PathBuf, Error> {
        let body =
            std::fs::read(report).map_err(|e| Error::Usage(format!("--report {}: cannot read it: {e}", report.display())))?;
        let v: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| Error::Usage(format!("--report {}: not a kvprobe report: {e}", report.display())))?;
        let name = match v.get("schema").and_then(|s| s.as_str()) {
            Some(s) if s == kvprobe::report::SCHEMA => "report.json",
            Some(s) if s == kvprobe::ab::AB_SCHEMA => "ab.json",
            other => {
                return Err(Error::Usage(format!(
                    "--report {}: {} is not a run or ab report ({} or {})",
                    report.display(),
                    other.map_or("no \"schema\" string".to_string(), |s| format!("schema {s:?}")),
                    kvprobe::report::SCHEMA,
                    kvprobe::ab::AB_SCHEMA
                )));
            }
        };
        if let Some(d) = dump
            && !d.is_dir()
        {
            return Err(Error::Usage(format!("--dump {}: not a directory", d.display())));
        }
        // Without --dump: the directory the report says it dumped into, when it is still there
        // (ab: the parent of the rows' folders).
        // A relative `dump.dir` was relative to where the run was started: the report's folder is
        // the best guess here, then the current directory.
        let recorded = match name {
            "report.json" => v["dump"]["dir"].as_str().map(PathBuf::from),
            _ => v["sections"][0]["dump"]["dir"].as_str().and_then(|d| Path::new(d).parent().map(Path::to_path_buf)),
        };
        let dumped: u64 = match name {
            "report.json" => v["dump"]["slices_written"].as_u64().unwrap_or(0),
            _ => v["sections"].as_array().into_iter().flatten().filter_map(|s| s["dump"]["slices_written"].as_u64()).sum(),
        };
        let found = |d: &Path| if name == "ab.json" { d.is_dir() } else { d.join("index.json").is_file() };
        let recorded = match recorded.filter(|_| dump.is_none()) {
            Some(d) if d.is_relative() => {
                let beside = report.parent().unwrap_or(Path::new(".")).join(&d);
                if found(&beside) { Some(beside) } else { Some(d).filter(|d| found(d)) }
            }
            Some(d) => Some(d).filter(|d| found(d)),
            None => None,
        };
        if dump.is_none() && recorded.is_none() && dumped > 0 {
            return Err(Error::Usage(format!(
                "--report {}: it says {dumped} slices were dumped into {}, which is not there (looked beside the report and \
                 in the current directory): give --dump DIR",
                report.display(),
                match name {
                    "report.json" => v["dump"]["dir"].as_str().unwrap_or("?").to_string(),
                    _ => v["sections"][0]["dump"]["dir"].as_str().unwrap_or("?").to_string(),
                }
            )));
        }
        let dump_given = dump;
        let dump = dump.or(recorded.as_deref());
        if is_stdout(output) {
            return Err(Error::Usage("-o needs a file path (`-` is not supported)".into()));
        }
        kvprobe::bundle::check_output(output, report, dump)?;
        kvprobe::report::check_writable_for(output, "--bundle")?;
        let c =
            kvprobe::bundle::Contents { report: body, report_name: name, dump, capture_made: "bundle", ucx_log: None, redact };
        kvprobe::bundle::write(output, &c).map_err(|e| match (e, &recorded) {
            // The dump was found from the report's `dump.dir`, not given: say so.
            (Error::Usage(m), Some(_)) if dump_given.is_none() => {
                Error::Usage(format!("{m} (the dump the report names, found without --dump: give --dump DIR)"))
            }
            (e, _) => e,
        })?;
        Ok(output.to_path_buf())
    })();
    match made {
        Ok(p) => {
            out(&format!("bundle: {}\n", p.display()));
            Exit::Clean
        }
        Err(e) => {
            err(&format!("kvprobe: {e}"));
            Exit::Usage
        }
    }
}

/// Prints the error that ended a run, if any, on stderr.
fn report_error(o: &kvprobe::report::Outcome) {
    if let Some(e) = &o.error {
        err(&format!("kvprobe: {}", e.message));
    }
}

/// A final report (`what`: "--report PATH") that could not be written (`why`): says so on
/// stdout, puts the report on stderr ([`kvprobe::report::print_fallback`]), and returns the
/// exit code: the run's own, or 7 (report not written) in place of 0, so neither a clean
/// verdict nor a missing file passes unnoticed.
/// The end of `run` and `ab`: says where the `--report` went (`label` then the path; nothing
/// for stdout), or, when writing it failed (`lost`), hands it to [`report_lost`]. Returns the
/// exit code.
fn report_outcome<T: serde::Serialize>(path: &Option<PathBuf>, lost: Option<Error>, doc: &T, exit: Exit, label: &str) -> Exit {
    match (path, lost) {
        (Some(path), None) => {
            if !is_stdout(path) {
                out(&format!("{label}{}\n", path.display()));
            }
            exit
        }
        (Some(path), Some(e)) => report_lost(&format!("--report {}", path.display()), doc, &e, exit),
        (None, _) => exit,
    }
}

fn report_lost<T: serde::Serialize>(what: &str, value: &T, why: &Error, exit: Exit) -> Exit {
    let exit = if exit == Exit::Clean { Exit::ReportNotWritten } else { exit };
    out(&format!("report:            NOT WRITTEN ({why}): the JSON report is on stderr; exit {}\n", exit as u8));
    kvprobe::report::print_fallback(what, value, why);
    exit
}

fn ab(args: AbArgs, typed: &[&str]) -> Exit {
    if !args.race.is_empty() || args.scenario.is_some() {
        let flag = if args.race.is_empty() { "--scenario" } else { "--race" };
        err(&format!(
            "kvprobe ab: {flag} is not an ab flag: ab runs nixl-only, tier-only and stacked, then stacked with each race \
             mechanism unfenced in turn (rows stacked+MECHANISM). For one scenario or one mechanism use `kvprobe run {flag} ...`"
        ));
        return Exit::Usage;
    }
    if args.load.host_staging {
        err("kvprobe ab: --host-staging is not an ab flag: ab runs its own rows with host staging (stacked-staged, \
             stacked+partial-staging); for a staged run use `kvprobe run --host-staging ...`");
        return Exit::Usage;
    }
    claim_stdout(&args.pool.report);
    if let Err(x) = check_outputs(&args.pool).and_then(|_| install_signals()) {
        return x;
    }
    let mut cfg = match args.pool.try_config() {
        Ok(c) => c,
        Err(e) => {
            return refused(&args.pool, &kvprobe::ab::expired_report(&args.pool.config(), &e).0, kvprobe::junit::from_ab, &e);
        }
    };
    cfg.scenario = Some(ScenarioConfig { matrix: true, ..args.load.config(Scenario::Stacked, Vec::new(), &cfg.geometry) });
    if let Err(e) = dram_takes_no_device(&cfg, typed).and_then(|_| args.pair.apply(&mut cfg, typed)) {
        return refused(&args.pool, &kvprobe::ab::expired_report(&cfg, &e).0, kvprobe::junit::from_ab, &e);
    }
    let dir = match start_dump(&args.pool, &cfg, Some("ab")).and_then(|_| dump_dir(&args.pool)) {
        Ok(d) => d,
        // expired_report makes the matrix's report of an error before any row (no row started).
        Err(e) => return refused(&args.pool, &kvprobe::ab::expired_report(&cfg, &e).0, kvprobe::junit::from_ab, &e),
    };
    let mut display = Display::new();
    let stall_cfg = cfg.clone();
    on_stall(
        display.bar.clone(),
        args.pool.report.clone(),
        (args.pool.junit.clone(), kvprobe::junit::from_ab),
        "report: ",
        move |e| {
            let (ab, exit) = kvprobe::ab::expired_report(&stall_cfg, e);
            let text = if ab.rows.is_empty() { String::new() } else { kvprobe::ab::render(&ab) };
            (ab, exit, text)
        },
    );
    let path = checkpoints_to(&args.pool.report);
    let mut ckpt_failed = false;
    let mut shown = 0;
    let mut progress = |name: &str, p: &Progress| display.update(&format!("{name}: "), p);
    show_phases(true);
    let mut after_row = |ab: &AbReport| {
        end_phases();
        if let Some(r) = ab.rows.get(shown) {
            shown += 1;
            err(&format!("row {}: {} {} ({} requests, {} corrupt)", shown, r.name, r.verdict, r.requests, r.corrupt));
        }
        if let Some(path) = &path
            && let Err(e) = kvprobe::report::write_atomic(path, ab)
            && !ckpt_failed
        {
            ckpt_failed = true;
            err(&format!("kvprobe: checkpoint: {e}"));
        }
    };
    let (ab, exit) =
        kvprobe::ab::run_ab(&cfg, &mut progress, &mut after_row, dir.as_deref().map(|d| (d, args.pool.dump_max_bytes)));
    end_phases();
    display.finish();
    let lost = args.pool.report.as_ref().and_then(|p| write_json(p, &ab).err());
    if !ab.rows.is_empty() {
        out(&kvprobe::ab::render(&ab));
    }
    report_error(&ab.outcome);
    let exit = report_outcome(&args.pool.report, lost, &ab, exit, "report: ");
    let exit = finish_bundle(&args.pool, &ab, "ab.json", exit);
    write_junit(&args.pool.junit, kvprobe::junit::from_ab, &ab, exit)
}

fn bench(a: BenchArgs, typed: &[&str]) -> Exit {
    if !(a.timeout.is_finite() && a.timeout > 0.0) {
        err("kvprobe: --timeout must be a positive number of seconds");
        return Exit::Usage;
    }
    if a.memory == Some(MemoryKind::Dram) && typed.contains(&"device") {
        err("kvprobe: --device and --decode-device apply to --memory vram only");
        return Exit::Usage;
    }
    let cfg = kvprobe::bench::BenchConfig {
        memory: a.memory.unwrap_or_else(|| if kvprobe::cuda::device_count() > 0 { MemoryKind::Vram } else { MemoryKind::Dram }),
        device: a.device,
        decode_device: a.decode_device,
        gpu_bytes: a.gpu_bytes,
        host_bytes: a.host_bytes,
        repeats: a.repeats,
        iterations: a.iterations,
        sweep_bytes: a.sweep_bytes,
        seed: a.seed,
        decode_process: a.decode_process,
        backend: a.backend,
        backend_params: a.backend_param.iter().cloned().collect(),
        timeout_secs: a.timeout,
    };
    claim_stdout(&a.json);
    let checked = match &a.json {
        Some(p) if is_stdout(p) => stdout_takes_json("--json"),
        Some(p) => kvprobe::report::check_writable_for(p, "--json"),
        None => Ok(()),
    };
    if let Err(e) = checked {
        err(&format!("kvprobe: {e}"));
        return e.exit();
    }
    if let Err(code) =
        check_distinct_outputs(&[("--json", &a.json), ("--junit", &a.junit)], None).and_then(|_| check_junit_path(&a.junit))
    {
        return code;
    }
    if let Err(e) = kvprobe::bench::check(&cfg) {
        err(&format!("kvprobe: {e}"));
        return e.exit();
    }
    if let Err(code) = install_signals() {
        return code;
    }
    show_phases(false);
    let mut r = kvprobe::bench::start(&cfg);
    let result = kvprobe::bench::run(&cfg, &mut r);
    end_phases();
    let exit = match &result {
        Ok(()) => Exit::Clean,
        Err(e) => e.exit(),
    };
    r.outcome = kvprobe::report::Outcome::of(exit, result.as_ref().err());
    if !r.figures.is_empty() || !r.breakdowns.is_empty() {
        out(&kvprobe::bench::render(&r));
    }
    if let Err(e) = &result {
        err(&format!("kvprobe: {e}"));
    }
    let exit = match &a.json {
        Some(p) => match write_json(p, &r) {
            Err(e) => report_lost(&format!("--json {}", p.display()), &r, &e, exit),
            Ok(()) => {
                if !is_stdout(p) {
                    out(&format!("results: {}\n", p.display()));
                }
                exit
            }
        },
        None => exit,
    };
    write_junit(&a.junit, kvprobe::junit::from_bench, &r, exit)
}

fn env(json: bool, probe: bool) -> Exit {
    let mut e = kvprobe::envinfo::gather(kvprobe::envinfo::nixl_info());
    if probe && e.nixl.library.is_some() && !e.nixl.plugins.is_empty() {
        if let Err(code) = install_signals() {
            return code;
        }
        e.transport_probes = kvprobe::envinfo::probe_paths(e.gpus.len(), &e.rdma);
    }
    let interrupted = kvprobe::interrupt::requested();
    if json {
        match serde_json::to_string_pretty(&e) {
            Ok(s) => out(&format!("{s}\n")),
            Err(x) => {
                err(&format!("kvprobe: env: {}", Error::Io(x.to_string())));
                return Exit::Usage;
            }
        }
    } else {
        out(&kvprobe::envinfo::render(&e));
    }
    // NIXL (with at least one backend plugin) is what kvprobe cannot run without; a DRAM probe
    // transfer refused by the environment (exit 2) means it is not usable either.
    let dram_refused = e.transport_probes.first().is_some_and(|p| p.what.contains("DRAM") && p.exit_code == 2);
    if interrupted {
        Exit::Interrupted
    } else if e.nixl.library.is_none() || e.nixl.plugins.is_empty() || dram_refused {
        Exit::Usage
    } else {
        Exit::Clean
    }
}

/// `kvprobe report show|diff|check` ([`kvprobe::inspect`], [`kvprobe::check`]). What they
/// print is their result: stdout that cannot take it (a full disk, `> /dev/full`) is said on
/// stderr and exits 7, as a report that cannot be written ([`report_out`]).
fn report_command(c: ReportCommand) -> Exit {
    let load = |p: &Path| {
        kvprobe::inspect::load(p).map_err(|e| {
            err(&format!("kvprobe: {e}"));
            e.exit()
        })
    };
    match c {
        ReportCommand::Show { file } => match kvprobe::inspect::show_file(&file) {
            Ok(text) => report_out(&text, Exit::Clean),
            Err(e) => {
                err(&format!("kvprobe: {e}"));
                e.exit()
            }
        },
        ReportCommand::Check { bundle } => match kvprobe::check::check(&bundle) {
            Ok(c) if c.problems.is_empty() => report_out(
                &format!(
                    "{}: everything agrees ({} files match the manifest; {} dumped slices re-derived, as the report says)\n",
                    bundle.display(),
                    c.files,
                    c.slices
                ),
                Exit::Clean,
            ),
            Ok(c) => {
                let mut text: String =
                    c.problems.iter().map(|p| format!("{}\n", kvprobe::inspect::escape_for_terminal(p))).collect();
                text += &format!("{}: {} disagreement(s)\n", bundle.display(), c.problems.len());
                report_out(&text, Exit::Corrupt)
            }
            Err(e) => {
                err(&format!("kvprobe: {}", kvprobe::inspect::escape_for_terminal(&e.to_string())));
                Exit::Usage
            }
        },
        ReportCommand::Diff { a, b } => {
            let (da, db) = match (load(&a), load(&b)) {
                (Ok(x), Ok(y)) => (x, y),
                (Err(x), _) | (_, Err(x)) => return x,
            };
            let exit = if kvprobe::inspect::diff(&da, &db).0.is_empty() { Exit::Clean } else { Exit::Corrupt };
            report_out(&kvprobe::inspect::render_diff(&a, &da, &b, &db), exit)
        }
    }
}

/// Writes `text` to stdout and flushes it: `exit` when it all went out, else (a full disk,
/// `> /dev/full`, a closed pipe) the failure said on stderr and exit 7 (README "Exit codes").
fn report_out(text: &str, exit: Exit) -> Exit {
    let mut o = std::io::stdout().lock();
    match o.write_all(text.as_bytes()).and_then(|_| o.flush()) {
        Ok(()) => exit,
        Err(e) => {
            err(&format!("kvprobe: stdout: {e}: the output was not written"));
            Exit::ReportNotWritten
        }
    }
}

/// `--race`'s long help: each mechanism with what its unfenced variant does.
fn race_help() -> String {
    let mut h = String::from(
        "Leave a race mechanism unfenced (the bug) or keep it fenced (the correct protocol); implies --scenario stacked (those marked \"also in nixl-only\" run with --scenario nixl-only too). Repeatable; MECHANISM alone means unfenced. Every mechanism not named is fenced.\n",
    );
    for m in Mechanism::ALL {
        h += &format!("\n  {}: {}\n", m.name(), m.explain());
    }
    h
}

fn main() {
    // A write past `ulimit -f` is an error (EFBIG) kvprobe reports, not a signal that kills it.
    kvprobe::interrupt::ignore_file_size_signal();
    // A watchdog that ends the process (an expired deadline) does it without the library
    // destructors that can crash at exit.
    kvprobe::deadline::set_exit(kvprobe::nixl::exit_now);
    let cmd = Cli::command().mut_subcommand("run", |c| c.mut_arg("race", |a| a.long_help(race_help())));
    let matches = cmd.get_matches();
    // Flags typed on the command line (not defaults): load flags make no sense in a sweep,
    // nor sweep flags in a scenario.
    let typed: Vec<&'static str> = match matches.subcommand() {
        Some(("run", m)) => typed_flags(m, LOAD_FLAGS.iter().chain(SWEEP_FLAGS).chain(PEER_FLAGS).chain(DEVICE_FLAGS)),
        // A GPU typed with --memory dram is refused even when it is the default one.
        Some(("bench" | "serve", m)) => typed_flags(m, ["device"].iter()),
        Some(("ab", m)) => typed_flags(m, PEER_FLAGS.iter().chain(DEVICE_FLAGS)),
        _ => Vec::new(),
    };
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    // The environment NIXL and UCX read, set while this process has one thread (the
    // watchdog, the spinner, CUDA and UCX start theirs later).
    if let Some(plan) = env_plan(&cli.command) {
        kvprobe::nixl::set_process_env(plan);
    }
    if !matches!(&cli.command, Command::Serve(a) if a.fd.is_some()) {
        // What killed kvprobes left in their private directories (SIGKILL, a crash); the
        // prefill process of --decode-process leaves that to its parent.
        kvprobe::scratch::sweep_stale();
    }
    let exit = match cli.command {
        Command::Run(a) => run(a, &typed),
        Command::Ab(a) => ab(a, &typed),
        Command::Bench(a) => bench(a, &typed),
        Command::Env { json, no_probe } => env(json, !no_probe),
        Command::Geometry { geo, json } => geometry_command(&geo, json),
        Command::Serve(a) => serve(a, &typed),
        Command::Report(c) => report_command(c),
        Command::Bundle { report, dump, redact, output } => bundle_command(&report, dump.as_deref(), redact, &output),
    };
    // Not a plain return: see `exit_now` (library destructors can crash at exit).
    kvprobe::nixl::exit_now(exit as u8)
}

/// What the NIXL agents of `command` need from the environment ([`kvprobe::nixl::EnvPlan`]),
/// from its flags alone; `None` for the subcommands that load no NIXL.
fn env_plan(command: &Command) -> Option<kvprobe::nixl::EnvPlan> {
    use kvprobe::nixl::EnvPlan;
    // Both pools on one GPU of this process: VRAM, or a default memory that may be VRAM.
    let same_gpu = |p: &PoolArgs, decode_process: bool| {
        p.memory != Some(MemoryKind::Dram) && p.prefill_device.first() == p.decode_device.first() && !decode_process
    };
    match command {
        Command::Run(a) => Some(EnvPlan { same_gpu_in_process: same_gpu(&a.pool, a.decode_process), diagnosis: true }),
        Command::Ab(a) => Some(EnvPlan { same_gpu_in_process: same_gpu(&a.pool, false), diagnosis: true }),
        Command::Bench(a) => Some(EnvPlan { same_gpu_in_process: a.memory != Some(MemoryKind::Dram), diagnosis: true }),
        Command::Serve(_) => Some(EnvPlan { same_gpu_in_process: false, diagnosis: true }),
        Command::Env { .. } => Some(EnvPlan { same_gpu_in_process: false, diagnosis: false }),
        _ => None,
    }
}

/// `kvprobe serve`: the prefill side of a node pair ([`kvprobe::serve`]).
fn serve(a: ServeArgs, typed: &[&str]) -> Exit {
    if a.fd.is_some() {
        // The prefill process of `run --decode-process`: its parent decides when to stop (a
        // Ctrl-C reaches the whole process group), and its test-only stall hooks are
        // KVPROBE_TEST_STALL_AGENT_*.
        kvprobe::child::ignore_interrupts();
        kvprobe::deadline::set_agent_process();
    } else {
        claim_stdout(&a.report); // `--report -`: the JSON alone on stdout, serve's lines on stderr
        if let Err(x) = check_report_path(&a.report).and_then(|_| install_signals()) {
            return x;
        }
    }
    let fail = |e: Error| {
        err(&format!("kvprobe serve: {e}"));
        e.exit()
    };
    if !(a.timeout.is_finite() && a.timeout > 0.0 && a.timeout <= 1e9) {
        return fail(Error::Usage("--timeout must be a positive number of seconds (at most 1e9)".into()));
    }
    let memory = a.memory.unwrap_or_else(|| if kvprobe::cuda::device_count() > 0 { MemoryKind::Vram } else { MemoryKind::Dram });
    if memory == MemoryKind::Dram && (a.device != 0 || typed.contains(&"device")) {
        return fail(Error::Usage("--device applies to --memory vram only (the pool is in host memory)".into()));
    }
    if memory == MemoryKind::Vram && a.device >= kvprobe::cuda::device_count() {
        return fail(Error::Environment(format!(
            "--device {}: this host has {} CUDA GPU(s) (use --memory dram for a host pool)",
            a.device,
            kvprobe::cuda::device_count()
        )));
    }
    let geometry = match a.geo.any().then(|| a.geo.resolve()).transpose() {
        Ok(g) => g.map(|(g, _)| g),
        Err(e) => return fail(e),
    };
    if let Some(g) = &geometry
        && let Err(e) = g.validate()
    {
        return fail(Error::Usage(e.to_string()));
    }
    // Everything a run needs on this side, checked before listening.
    if let Err(e) = kvprobe::nixl::check_ucx_log_file().and_then(|_| kvprobe::nixl::load().map(|_| ())) {
        return fail(e);
    }
    if let Some(fd) = a.fd {
        let stream = match kvprobe::child::inherited_socket(fd) {
            Ok(s) => s,
            Err(e) => return fail(Error::Usage(format!("--fd {fd}: {e}"))),
        };
        let token = match std::env::var(kvprobe::peer::TOKEN_VAR).ok().filter(|t| !t.is_empty()) {
            Some(t) => t,
            None => return fail(Error::Usage(format!("--fd needs the token in {}", kvprobe::peer::TOKEN_VAR))),
        };
        let cfg = kvprobe::serve::ServeConfig {
            listen: format!("fd {fd}"),
            token,
            memory,
            device: a.device,
            backend: a.backend.clone(),
            geometry,
            keep_serving: false,
            idle_timeout: Duration::from_secs_f64(a.timeout),
            mode: kvprobe::serve::SessionMode::Child,
        };
        return kvprobe::serve::serve_child(&cfg, stream);
    }
    let listen = a.listen.clone().unwrap_or_default();
    let listener = match kvprobe::serve::bind(&listen) {
        Ok(l) => l,
        Err(e) => return fail(e),
    };
    let (token, made) = match a.token.clone().or_else(|| std::env::var(kvprobe::peer::TOKEN_VAR).ok()).filter(|t| !t.is_empty()) {
        Some(t) => {
            let source = if a.token.is_some() { "--token" } else { kvprobe::peer::TOKEN_VAR };
            if let Err(e) = kvprobe::peer::check_token(&t, source) {
                return fail(e);
            }
            (t, false)
        }
        None => match kvprobe::peer::random_hex(16) {
            Ok(t) => (t, true),
            Err(e) => return fail(e),
        },
    };
    let cfg = kvprobe::serve::ServeConfig {
        listen: listen.clone(),
        token: token.clone(),
        memory,
        device: a.device,
        backend: a.backend.clone(),
        geometry,
        keep_serving: a.keep_serving,
        idle_timeout: Duration::from_secs_f64(a.timeout),
        mode: kvprobe::serve::SessionMode::Listen,
    };
    let bound = listener.local_addr().map(|x| x.to_string()).unwrap_or_else(|_| listen.clone());
    out(&format!(
        "kvprobe serve: listening on {bound} (peer protocol {}; prefill pool on {}; {})\n",
        kvprobe::peer::PROTOCOL,
        if memory == MemoryKind::Vram { format!("VRAM, GPU {}", a.device) } else { "DRAM".into() },
        if a.keep_serving { "serving runs until stopped" } else { "one run, then exit" }
    ));
    // The address to give `--peer`: what serve listens on, or for an unspecified address
    // (0.0.0.0, ::) any address of this host the decode node reaches.
    let dial = match listener.local_addr() {
        Ok(a) if a.ip().is_unspecified() => format!("<an address of this host>:{}", a.port()),
        _ => bound.clone(),
    };
    if made {
        out(&format!("kvprobe serve: token {token} (run: KVPROBE_TOKEN={token} kvprobe run --peer {dial} ...)\n"));
    }
    let report_path = a.report.clone();
    let mut say = |l: &str| out(&format!("{l}\n"));
    let mut ended = |end: &kvprobe::serve::SessionEnd| -> Exit {
        let r = &end.report;
        match r.matrix.as_ref().and_then(|m| serde_json::from_value::<Vec<kvprobe::ab::AbRow>>(m.clone()).ok()) {
            // `ab --peer`: the matrix's table and outcome, as decode printed them.
            Some(rows) => out(&kvprobe::ab::render(&kvprobe::ab::AbReport {
                schema: kvprobe::ab::AB_SCHEMA.into(),
                started_unix: r.started_unix,
                config: r.config.clone(),
                environment: None,
                rows,
                sections: Vec::new(),
                outcome: r.outcome.clone(),
                peer: None,
            })),
            None if r.summary.iterations > 0 || r.scenario.is_some() => {
                out(&kvprobe::report::render_with(r, json_named(&report_path, &None).as_deref()))
            }
            None => {}
        }
        report_error(&r.outcome);
        let lost = report_path.as_ref().and_then(|p| write_json(p, r).err());
        report_outcome(&report_path, lost, r, end.exit, "report:            ")
    };
    kvprobe::serve::serve(&cfg, listener, &mut say, &mut ended)
}
