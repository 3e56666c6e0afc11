//! The `kvprobe` command line: a thin layer over the library.

use clap::{Args, Parser, Subcommand};
use kvprobe::geometry::{Dtype, Layout, Preset};
use kvprobe::inject::Spec;
use kvprobe::pool::MemoryKind;
use kvprobe::run::RunConfig;
use kvprobe::transport::Op;
use kvprobe::{Error, Exit};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

const EXIT_CODES: &str = "Exit codes:
  0  clean: every block slice verified
  1  corruption found (wins over every other outcome)
  2  usage, configuration or environment error (bad flag, NIXL or GPU missing)
  3  transport or device error during the run
  4  a transfer did not complete within --timeout
  5  transfer rate below --min-gbps (only when given)
  130  interrupted by SIGINT/SIGTERM (partial report written, marked interrupted)";

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
    /// Fill fingerprinted KV blocks on prefill, move them with NIXL, verify every block slice on decode.
    #[command(after_help = EXIT_CODES, allow_negative_numbers = true)]
    Run(RunArgs),
    /// Print what was found: GPUs and their links, driver, CUDA, NVRTC, NIXL library and plugins (exit 2 when NIXL is unusable).
    Env {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
struct RunArgs {
    /// Pool memory: vram (GPU) or dram (host). Default: vram when a GPU is present, else dram.
    #[arg(long, value_enum)]
    memory: Option<MemoryKind>,
    /// GPU holding the prefill pool.
    #[arg(long, default_value_t = 0)]
    prefill_device: usize,
    /// GPU holding the decode pool.
    #[arg(long, default_value_t = 0)]
    decode_device: usize,
    /// Named geometry; the geometry flags below override its fields. Default: small.
    #[arg(long, value_enum)]
    preset: Option<Preset>,
    /// Attention layers (one NIXL-registered region each).
    #[arg(long)]
    layers: Option<u32>,
    /// KV heads per layer.
    #[arg(long)]
    kv_heads: Option<u32>,
    /// Elements per head (MLA: latent width, e.g. 576).
    #[arg(long)]
    head_size: Option<u32>,
    /// Tokens per block.
    #[arg(long)]
    block_size: Option<u32>,
    /// Blocks per layer.
    #[arg(long)]
    blocks: Option<u32>,
    /// Element type.
    #[arg(long, value_enum)]
    dtype: Option<Dtype>,
    /// Tensor order of each layer's K/V cache.
    #[arg(long, value_enum)]
    layout: Option<Layout>,
    /// MLA: one latent slice per (layer, block) instead of K and V.
    #[arg(long)]
    mla: bool,
    /// read: decode pulls from prefill (vLLM's NixlConnector); write: prefill pushes.
    #[arg(long, value_enum, default_value = "read")]
    op: Op,
    /// Iterations (each: refill, re-poison, transfer, verify everything).
    #[arg(long, default_value_t = 5)]
    iterations: u32,
    /// Seed of fingerprints, block mapping and injections.
    #[arg(long, default_value = "1", value_parser = parse_seed)]
    seed: u64,
    /// Plant a fault per iteration: bitflip, drop, misroute, stale or torn, optionally :COUNT. Repeatable.
    #[arg(long, value_name = "CLASS[:N]")]
    inject: Vec<Spec>,
    /// Write the JSON report here (atomically; also when the run fails).
    #[arg(long)]
    report: Option<PathBuf>,
    /// NIXL backend plugin.
    #[arg(long, default_value = "UCX")]
    backend: String,
    /// Seconds to wait for each transfer and its notification.
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// Exit 5 when the transfer rate (GB/s = 1e9 B/s) is below this.
    #[arg(long)]
    min_gbps: Option<f64>,
    /// At most this many failures listed in the report (counts stay complete).
    #[arg(long, default_value_t = 1000)]
    max_failures: usize,
}

/// Parses a seed in decimal or 0x-prefixed hex.
fn parse_seed(s: &str) -> Result<u64, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.map_err(|_| format!("{s:?} is not a 64-bit seed (decimal or 0x hex)"))
}

impl RunArgs {
    fn config(&self) -> RunConfig {
        let mut g = self.preset.unwrap_or(Preset::Small).geometry();
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
        let memory = self.memory.unwrap_or_else(|| {
            if kvprobe::cuda::device_count() > 0 { MemoryKind::Vram } else { MemoryKind::Dram }
        });
        RunConfig {
            memory,
            prefill_device: self.prefill_device,
            decode_device: self.decode_device,
            preset: Some(self.preset.unwrap_or(Preset::Small)),
            geometry: g,
            op: self.op,
            iterations: self.iterations,
            seed: self.seed,
            inject: self.inject.clone(),
            backend: self.backend.clone(),
            timeout_secs: self.timeout,
            min_gbps: self.min_gbps,
            max_failures: self.max_failures,
        }
    }
}

/// Writes to stdout, ignoring failures: a closed pipe (`kvprobe run | head`) must not cost
/// the report or the exit code.
fn out(text: &str) {
    let _ = std::io::stdout().write_all(text.as_bytes());
}

/// Writes a line to stderr, ignoring failures.
fn err(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

fn run(args: RunArgs) -> Exit {
    if let Some(path) = &args.report
        && let Err(e) = kvprobe::report::check_writable(path)
    {
        err(&format!("kvprobe: {e}"));
        return e.exit();
    }
    if let Err(e) = kvprobe::interrupt::install() {
        err(&format!("kvprobe: cannot install signal handlers: {e}"));
        return Exit::Usage;
    }
    let cfg = args.config();
    let (mut report, mut exit) = kvprobe::run::run(&cfg, &mut |line| err(line));
    // The report first, so a failure to write it is reflected in the summary and exit code.
    let mut written = None;
    if let Some(path) = &args.report {
        match kvprobe::report::write_atomic(path, &report) {
            Ok(()) => written = Some(path),
            Err(e) => {
                if exit == Exit::Corrupt {
                    // Corruption keeps exit 1 and its outcome; say why the report is missing.
                    err(&format!("kvprobe: {e}"));
                } else {
                    // Printed below as the outcome's error.
                    exit = e.exit();
                    report.finish(exit, Some(&e));
                }
            }
        }
    }
    if report.summary.iterations > 0 || report.outcome.error.is_none() {
        out(&kvprobe::report::render(&report));
    }
    if let Some(path) = written {
        out(&format!("report:            {}\n", path.display()));
    }
    if let Some(e) = &report.outcome.error {
        err(&format!("kvprobe: {}", e.message));
    }
    exit
}

fn env(json: bool) -> Exit {
    let e = kvprobe::envinfo::gather(kvprobe::envinfo::nixl_info());
    if json {
        match serde_json::to_string_pretty(&e) {
            Ok(s) => out(&format!("{s}\n")),
            Err(x) => {
                err(&format!("kvprobe: {}", Error::Io(x.to_string())));
                return Exit::Usage;
            }
        }
    } else {
        out(&kvprobe::envinfo::render(&e));
    }
    // NIXL (with at least one backend plugin) is what kvprobe cannot run without.
    if e.nixl.library.is_none() || e.nixl.plugins.is_empty() { Exit::Usage } else { Exit::Clean }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let exit = match cli.command {
        Command::Run(a) => run(a),
        Command::Env { json } => env(json),
    };
    ExitCode::from(exit as u8)
}
