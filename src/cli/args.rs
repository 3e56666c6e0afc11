//! The flags of each subcommand (clap) and what they resolve to: a run's configuration.

use super::*;

#[derive(Args)]
pub(crate) struct BenchArgs {
    /// vram: GPU kernels and the copy ceiling, DRAM passes, VRAM sweeps; dram: DRAM passes and sweeps. Default: vram when a GPU is present.
    #[arg(long, value_enum)]
    pub(crate) memory: Option<MemoryKind>,
    /// GPU to measure (and of the prefill pool).
    #[arg(long, default_value_t = 0)]
    pub(crate) device: usize,
    /// A second GPU for the decode pool: adds the cross-device copy ceiling and runs the sweeps across the two GPUs.
    #[arg(long)]
    pub(crate) decode_device: Option<usize>,
    /// GPU pool the kernels and the copy ceiling run over (e.g. 4GiB, 512MiB; whole 2 MiB llama3-8b blocks).
    #[arg(long, default_value = "4GiB", value_parser = parse_bytes)]
    pub(crate) gpu_bytes: u64,
    /// DRAM buffers for memcpy and the CPU passes (two of them are allocated).
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    pub(crate) host_bytes: u64,
    /// Each pool of the sweep breakdowns (llama3-8b geometry).
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    pub(crate) sweep_bytes: u64,
    /// Timed passes per figure after one warm-up (the median is reported).
    #[arg(long, default_value_t = 7)]
    pub(crate) repeats: u32,
    /// Iterations of each sweep breakdown.
    #[arg(long, default_value_t = 5)]
    pub(crate) iterations: u32,
    /// Fingerprint seed (decimal or 0x hex).
    #[arg(long, default_value_t = kvprobe::sweep::DEFAULT_SEED, value_parser = parse_seed)]
    pub(crate) seed: u64,
    /// Sweeps with the two NIXL agents in two kvprobe processes (run --decode-process: prefill's agent and pool in a child).
    #[arg(long)]
    pub(crate) decode_process: bool,
    /// NIXL backend of the sweeps.
    #[arg(long, default_value = kvprobe::sweep::DEFAULT_BACKEND)]
    pub(crate) backend: String,
    /// Set a parameter of the NIXL backend plugin of the sweeps and request rows (repeatable; run --backend-param).
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_backend_param)]
    pub(crate) backend_param: Vec<(String, String)>,
    /// Seconds to wait for each transfer of the sweeps.
    #[arg(long, default_value_t = kvprobe::sweep::DEFAULT_TIMEOUT_SECS)]
    pub(crate) timeout: f64,
    /// Write the results as JSON (schema kvprobe.bench/1), atomically; `-` writes it to stdout (the table then goes to stderr).
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// Write JUnit XML here for CI (atomically): one case per goal (met or missed), plus the outcome.
    #[arg(long)]
    pub(crate) junit: Option<PathBuf>,
}

/// Parses a byte count: a plain number, or with a KiB/MiB/GiB/TiB (or KB/MB/GB/TB, powers of 1000) suffix, any case.
pub(crate) fn parse_bytes(s: &str) -> Result<u64, String> {
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
pub(crate) struct GeometryArgs {
    /// Named geometry; the geometry flags below override its fields. run, ab: default small; serve: none (it takes the run's geometry unless one of these flags pins it).
    #[arg(long, value_enum, conflicts_with = "model_config")]
    pub(crate) preset: Option<Preset>,
    /// Geometry of one TP rank of the model a Hugging Face config.json describes (layers, KV heads, head size or MLA latent, dtype; block size 16, MLA 64; blocks for a pool of about 1 GiB); --block-size, --blocks and --layout override. docs/geometry.md "Geometry from a model's config.json".
    #[arg(long, value_name = "PATH")]
    pub(crate) model_config: Option<PathBuf>,
    /// With --model-config: tensor-parallel size; the geometry is one rank's (KV heads / tp, each head replicated when tp exceeds them, MLA's latent whole on every rank).
    #[arg(long, value_name = "N", requires = "model_config")]
    pub(crate) tp: Option<u32>,
    /// With --model-config: KV-cache element type, vLLM's names (auto: the model's torch_dtype, float32 served as bfloat16).
    #[arg(long, value_enum, requires = "model_config")]
    pub(crate) kv_cache_dtype: Option<kvprobe::model_config::KvCacheDtype>,
    /// With --model-config of a hybrid model: the conv state's element type, as vLLM's --mamba-cache-dtype (auto: the model's dtype).
    #[arg(long, value_enum, requires = "model_config", value_name = "DTYPE")]
    pub(crate) mamba_cache_dtype: Option<kvprobe::hybrid::MambaDtype>,
    /// With --model-config of a hybrid model: the ssm / recurrent state's element type, as vLLM's --mamba-ssm-cache-dtype (auto: KDA float32, Nemotron-H its config's, else the conv state's).
    #[arg(long, value_enum, requires = "model_config", value_name = "DTYPE")]
    pub(crate) mamba_ssm_cache_dtype: Option<kvprobe::hybrid::MambaDtype>,
    /// Attention layers (one NIXL-registered region each).
    #[arg(long, conflicts_with = "model_config")]
    pub(crate) layers: Option<u32>,
    /// KV heads per layer.
    #[arg(long, conflicts_with = "model_config")]
    pub(crate) kv_heads: Option<u32>,
    /// Elements per head (MLA: latent width, e.g. 576).
    #[arg(long, conflicts_with = "model_config")]
    pub(crate) head_size: Option<u32>,
    /// Tokens per block.
    #[arg(long)]
    pub(crate) block_size: Option<u32>,
    /// Blocks per layer (per pool).
    #[arg(long)]
    pub(crate) blocks: Option<u32>,
    /// Element type.
    #[arg(long, value_enum, conflicts_with = "model_config")]
    pub(crate) dtype: Option<Dtype>,
    /// Tensor order of each layer's K/V cache.
    #[arg(long, value_enum)]
    pub(crate) layout: Option<Layout>,
    /// MLA: one latent slice per (layer, block) instead of K and V.
    #[arg(long, conflicts_with = "model_config")]
    pub(crate) mla: bool,
}

impl GeometryArgs {
    /// The geometry the flags give (preset or model config, then each flag over its field),
    /// with what the model config resolved to. Errors (usage, exit 2): a model config that
    /// cannot be read or gives no geometry ([`kvprobe::model_config::ModelConfigError`]).
    pub(crate) fn resolve(&self) -> Result<(kvprobe::geometry::Geometry, Option<kvprobe::model_config::ModelInfo>), Error> {
        let (g, model) = self.resolve_any()?;
        refuse_hybrid(model.as_ref(), "in this command")?;
        Ok((g, model))
    }

    /// As [`GeometryArgs::resolve`], a hybrid model's config accepted (`kvprobe geometry`
    /// prints its regions).
    pub(crate) fn resolve_any(&self) -> Result<(kvprobe::geometry::Geometry, Option<kvprobe::model_config::ModelInfo>), Error> {
        self.resolve_any_at(None)
    }

    /// [`GeometryArgs::resolve_any`] with a hybrid model's block size raised for its state split
    /// over `state_tp` ranks (`run --prefill-tp P --decode-tp P`: each engine raises its block
    /// size from its own rank's state page, vLLM's `HybridAttentionMambaModelConfig`); `None`:
    /// over `--tp`'s ranks.
    pub(crate) fn resolve_any_at(
        &self,
        state_tp: Option<u32>,
    ) -> Result<(kvprobe::geometry::Geometry, Option<kvprobe::model_config::ModelInfo>), Error> {
        let mut block_geometry = None;
        let (mut g, model) = match &self.model_config {
            Some(path) => {
                let usage = |e: kvprobe::model_config::ModelConfigError| Error::Usage(e.to_string());
                let mut kv = kvprobe::model_config::ModelKv::load(path).map_err(usage)?;
                let model_dtype = kv.dtype;
                if let Some(state) = kv.hybrid.as_mut().and_then(|h| h.state.as_mut()) {
                    let (c, s) = (self.mamba_cache_dtype.unwrap_or_default(), self.mamba_ssm_cache_dtype.unwrap_or_default());
                    state.set_cache_dtypes(c, s, model_dtype).map_err(|e| usage(e.into()))?;
                }
                let dtype = self.kv_cache_dtype.unwrap_or_default();
                let (mut g, tp) = kv.rank_geometry(self.tp.unwrap_or(1), dtype).map_err(usage)?;
                if let Some(p) = state_tp.filter(|p| *p != tp.tp && kv.hybrid.as_ref().is_some_and(|h| h.state.is_some())) {
                    // The block size of an engine at TP p, from its rank's state page.
                    let (rank_g, _) = kv.rank_geometry(p, dtype).map_err(usage)?;
                    g.block_size = rank_g.block_size;
                    block_geometry = Some((rank_g, p));
                }
                (
                    g,
                    Some(kvprobe::model_config::ModelInfo {
                        path: kvprobe::model_config::show_path(path),
                        kv_cache_dtype: dtype,
                        kv,
                        tp,
                        block_size_asked: None,
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
        let mut model = model;
        if model.is_some() && self.block_size == Some(0) {
            return Err(Error::Usage("--block-size must be at least 1".into()));
        }
        if let (Some(m), Some(asked)) = (model.as_mut(), self.block_size) {
            // A hybrid model's block size follows vLLM's rule from the size asked for.
            let (bg, btp) = block_geometry.unwrap_or((g.clone(), m.tp.tp));
            let b = m.kv.hybrid_block_size(&bg, btp, asked).map_err(|e| Error::Usage(e.to_string()))?;
            if b != asked {
                g.block_size = b;
                m.block_size_asked = Some(asked);
            }
        }
        if model.is_some() && self.blocks.is_none() {
            // The default pool size follows the block size given.
            g.num_blocks = kvprobe::model_config::default_blocks(&g);
        }
        Ok((g, model))
    }

    /// The preset's geometry with the flags over it, `--model-config` left out: the geometry
    /// of the report that refuses a model config (nothing is read, nothing can fail).
    pub(crate) fn without_model(&self) -> kvprobe::geometry::Geometry {
        GeometryArgs { model_config: None, ..self.clone() }.resolve().expect("no model config to read").0
    }

    /// True when any geometry flag was given.
    pub(crate) fn any(&self) -> bool {
        self.preset.is_some()
            || self.model_config.is_some()
            || self.mla
            || [self.layers, self.kv_heads, self.head_size, self.block_size, self.blocks].iter().any(Option::is_some)
            || self.dtype.is_some()
            || self.mamba_cache_dtype.is_some()
            || self.mamba_ssm_cache_dtype.is_some()
            || self.layout.is_some()
    }
}

#[derive(Args)]
#[command(next_help_heading = "Pools and transport")]
#[command(group(clap::ArgGroup::new("device").multiple(true)))]
pub(crate) struct PoolArgs {
    /// Pool memory: vram (GPU) or dram (host). Default: vram when a GPU is present, else dram.
    #[arg(long, value_enum)]
    pub(crate) memory: Option<MemoryKind>,
    /// GPU holding the prefill pool; with --prefill-tp, one GPU per rank as a comma list (rank 0 first; one GPU: every rank shares it).
    #[arg(group = "device", long, default_value = "0", value_delimiter = ',', num_args = 1)]
    pub(crate) prefill_device: Vec<usize>,
    /// GPU holding the decode pool; with --decode-tp, one GPU per rank as a comma list (rank 0 first; one GPU: every rank shares it).
    #[arg(group = "device", long, default_value = "0", value_delimiter = ',', num_args = 1)]
    pub(crate) decode_device: Vec<usize>,
    #[command(flatten)]
    pub(crate) geo: GeometryArgs,
    /// Seed of fingerprints, block mapping, load and injections.
    #[arg(long, default_value_t = kvprobe::sweep::DEFAULT_SEED, value_parser = parse_seed)]
    pub(crate) seed: u64,
    /// Write the JSON report here (atomically; also when the run fails). `-` writes it to stdout at the end (no checkpoints), and the human summary goes to stderr.
    #[arg(long)]
    pub(crate) report: Option<PathBuf>,
    /// Write JUnit XML here for CI (atomically; also when the run fails, as an error case): run: one case per sweep iteration (scenario: per interval and race mechanism) and per injection; ab: one per row; plus the outcome.
    #[arg(long)]
    pub(crate) junit: Option<PathBuf>,
    /// NIXL backend plugin.
    #[arg(long, default_value = kvprobe::sweep::DEFAULT_BACKEND)]
    pub(crate) backend: String,
    /// Set a parameter of the NIXL backend plugin when it is created (repeatable; a key given twice: the last value counts), e.g. num_threads=2 for UCX. A key the plugin does not read is refused (exit 2), listing the valid ones.
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_backend_param)]
    pub(crate) backend_param: Vec<(String, String)>,
    /// How each NIXL request is made: prepared (one descriptor list per side prepared after connecting, each request made from block-slice indices, as vLLM's NixlConnector) or create (a descriptor list built for each request).
    #[arg(long, value_enum, default_value = "prepared", value_name = "MODE")]
    pub(crate) xfer_req: XferReq,
    /// Bound of every wait, in seconds: each transfer from just before it is posted until it completes and its notification arrives, and each other blocking call (set-up calls: at least 60 s); with --scenario, also for any request to progress.
    #[arg(long, default_value_t = kvprobe::sweep::DEFAULT_TIMEOUT_SECS)]
    pub(crate) timeout: f64,
    /// At most this many failures listed in the report, up to 1000000 (counts stay complete; scenarios list up to N explained and N unexplained).
    #[arg(long, default_value_t = kvprobe::sweep::DEFAULT_MAX_FAILURES)]
    pub(crate) max_failures: usize,
    /// Write every failing block slice exactly as it arrived into DIR (new or empty; ab: DIR/<row>/), with index.json (coordinates, expected identity, digests, the command that regenerates the expected bytes), up to --dump-max-bytes.
    #[arg(long, value_name = "DIR")]
    pub(crate) dump: Option<PathBuf>,
    /// Cap of the slice bytes --dump writes (e.g. 64MiB); counts in the report and index.json stay complete, and the first failures of each class are kept before more of one.
    #[arg(long, default_value = "256MiB", value_parser = parse_bytes, value_name = "BYTES")]
    pub(crate) dump_max_bytes: u64,
    /// At the end of the run, write one .tar.gz holding the report, the dump (a scratch one without --dump), a manifest and an environment capture (for a vendor: `kvprobe report check FILE`).
    #[arg(long, value_name = "FILE")]
    pub(crate) bundle: Option<PathBuf>,
    /// With --bundle: replace host names, IP addresses and user names in the bundle's text files by stable tokens.
    #[arg(long, requires = "bundle")]
    pub(crate) redact: bool,
}

#[derive(Args)]
#[command(next_help_heading = "Request load (with --scenario, and for ab)")]
pub(crate) struct LoadArgs {
    /// Requests to admit, then drain [default: 2000]. Not with --duration.
    #[arg(long)]
    pub(crate) requests: Option<u64>,
    /// Admit requests for this long instead (e.g. 90s, 10m, 1h), then drain. Not with --requests (refused: one of them decides when admission stops).
    #[arg(long, value_parser = parse_duration, conflicts_with = "requests")]
    pub(crate) duration: Option<f64>,
    /// Requests in flight at most.
    #[arg(long, default_value_t = 16)]
    pub(crate) concurrency: u32,
    /// Prompt length in blocks, uniform in MIN-MAX (or one number).
    #[arg(long, default_value = "2-8", value_parser = parse_range)]
    pub(crate) prompt_blocks: (u32, u32),
    /// Share of requests (0-1) that extend an earlier prompt, so tier prefix hits happen.
    #[arg(long, default_value_t = 0.5)]
    pub(crate) prefix_share: f64,
    /// Share of requests (0 to below 1) the client aborts right after their prefill is issued.
    #[arg(long, default_value_t = 0.05)]
    pub(crate) abort_rate: f64,
    /// The KV tier under the connectors.
    #[arg(long, value_enum, default_value = "embedded")]
    pub(crate) tier: TierKind,
    /// With --tier mooncake: an existing master's RPC address (HOST:PORT) instead of one kvprobe starts; needs --mooncake-metadata.
    #[arg(long, value_name = "HOST:PORT", requires = "mooncake_metadata")]
    pub(crate) mooncake_master: Option<String>,
    /// With --mooncake-master: its metadata service (http://HOST:PORT/metadata, etcd://HOST:PORT or P2PHANDSHAKE).
    #[arg(long, value_name = "URL", requires = "mooncake_master")]
    pub(crate) mooncake_metadata: Option<String>,
    /// Engine steps prefill keeps a handed request's blocks before its lease (abort timeout) expires; kept alive until the READ's notification unless abort-timeout-free is unfenced.
    #[arg(long, value_name = "STEPS", default_value_t = kvprobe::scenario::config::DEFAULT_LEASE)]
    pub(crate) lease: u32,
    /// Engine steps one request in eight waits at decode before its pull (a busy decode instance).
    #[arg(long, value_name = "STEPS", default_value_t = kvprobe::scenario::config::DEFAULT_DECODE_DELAY)]
    pub(crate) decode_delay: u32,
    /// Share of requests (0 to below 1) the scheduler preempts after their prefill (recomputed later); their blocks wait for queued saves unless preempt-save is unfenced.
    #[arg(long, default_value_t = kvprobe::scenario::config::DEFAULT_PREEMPT_RATE)]
    pub(crate) preempt_rate: f64,
    /// Share of decode's transfers of two or more blocks (0 to below 1: READs, tier-only loads) in which some blocks fail to move; they are read again unless failed-as-complete is unfenced.
    #[arg(long, default_value_t = kvprobe::scenario::config::DEFAULT_FAIL_RATE)]
    pub(crate) fail_rate: f64,
    /// Host-buffer staging (vLLM's kv_buffer_device=cpu): prefill computes into its own KV cache, chunked (two blocks per chunk), and stages each request's blocks into the pool NIXL reads; every chunk unless partial-staging is unfenced.
    #[arg(long)]
    pub(crate) host_staging: bool,
    /// Tier capacity in blocks. Default: 16 x --blocks, at most 4 GiB of host memory, at least 2 x concurrency x max prompt blocks.
    #[arg(long)]
    pub(crate) tier_blocks: Option<u32>,
    /// Length of each error-rate interval in the report (e.g. 10s; at least 100ms).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) interval: f64,
    /// Complete each step's NIXL READs before the step goes on: the run, corrupt counts included, then replays exactly from --seed (default: READs overlap the tier's copies, as in a real engine).
    #[arg(long)]
    pub(crate) lockstep: bool,
    /// Rewrite the report (atomically) this often during a run, when --report is given (e.g. 30s; 0 = never). ab rewrites it after every row.
    #[arg(long, default_value = "30s", value_parser = parse_duration_or_zero)]
    pub(crate) checkpoint: f64,
}

#[derive(Args)]
#[command(next_help_heading = "Node pair")]
pub(crate) struct PeerArgs {
    /// Node pair: prefill is `kvprobe serve` at HOST:PORT (another host, or another process); this side is decode and drives the run (a sweep, a scenario, or ab's matrix). Every flag of the run applies; --memory and --decode-device are decode's (serve's --memory and --device are prefill's).
    #[arg(long, value_name = "HOST:PORT")]
    pub(crate) peer: Option<String>,
    /// With --peer: the token serve printed or was given, at least 16 characters of at least 5 distinct ones (default: $KVPROBE_TOKEN). Visible to other users in the process list: prefer KVPROBE_TOKEN.
    #[arg(long, value_name = "T", requires = "peer")]
    pub(crate) token: Option<String>,
}

/// Refuses a GPU flag typed with `--memory dram` (even `--prefill-device 0`, which equals the
/// default: the user meant a GPU the pools will not be on). Errors: usage (exit 2).
pub(crate) fn dram_takes_no_device(c: &RunConfig, typed: &[&str]) -> Result<(), Error> {
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
    pub(crate) fn apply(&self, c: &mut RunConfig, typed: &[&str]) -> Result<(), Error> {
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
#[command(group(clap::ArgGroup::new("sweep").multiple(true)))]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub(crate) pool: PoolArgs,
    /// read: decode pulls from prefill (vLLM's NixlConnector); write: prefill pushes (the sweep; with --scenario nixl-only or stacked, push mode: prefill WRITEs into the blocks decode asks for).
    #[arg(long, value_enum, default_value = "read")]
    pub(crate) op: Op,
    /// Sweep iterations (each: refill, re-poison, transfer, verify everything).
    #[arg(long, group = "sweep", default_value_t = 5)]
    pub(crate) iterations: u32,
    /// Sweep: blocks per NIXL descriptor. The block map moves runs of N consecutive blocks together and each run's contiguous slices travel as one descriptor; 1 = vLLM NixlConnector's per-block descriptors. Must divide the number of blocks.
    #[arg(long, group = "sweep", default_value_t = 1, value_name = "N")]
    pub(crate) descriptor_blocks: u32,
    /// Sweep: pipeline stages (consecutive layer ranges, one NIXL request each; while one is in flight the finished ones are verified, refilled and re-poisoned). Default: 8 with VRAM pools on two GPUs (the passes use each GPU's memory while the transfer uses the link), else 1 (the transfer measured alone: on one GPU the passes compete with it for memory bandwidth and slow it by more than they hide; bench/NOTES.md); more when a stage would exceed 65536 descriptors; at most the number of layers.
    #[arg(long, group = "sweep", value_name = "N")]
    pub(crate) pipeline_stages: Option<u32>,
    /// Sweep: run the two NIXL agents in two kvprobe processes (as vLLM's engines run), so UCX sees two processes (cuda_ipc between them on VRAM). kvprobe stays decode; prefill's agent and pool (on --memory and --prefill-device) live in a child `kvprobe serve`, driven over the same protocol as --peer.
    #[arg(long, group = "sweep")]
    pub(crate) decode_process: bool,
    /// Sweep: plant a fault per iteration: bitflip, drop, misroute, stale, torn, stray (a write into another
    /// pipeline stage's slot; needs --pipeline-stages 3 or more), head-offset or token-offset (a slice's rows moved one
    /// head or one token off: class layout), optionally :COUNT. Repeatable. A hybrid model's state or indexer region:
    /// CLASS[:N]@state or @indexer (bitflip, drop, misroute, stale or torn; N in each such region per TP rank).
    #[arg(long, value_name = "CLASS[:N][@REGION]")]
    pub(crate) inject: Vec<kvprobe::inject::InjectArg>,
    /// Judge kvprobe itself rather than the stack (CI's self-test): exit 0 when every fault planted by --inject (and every unfenced --race mechanism) is detected as predicted and nothing else is corrupt, exit 1 with the reasons otherwise; the JUnit cases pass on the same terms. Needs --inject or an unfenced --race.
    #[arg(long)]
    pub(crate) self_test: bool,
    /// Exit 5 when the transfer rate (GB/s = 1e9 B/s) is below this.
    #[arg(long)]
    pub(crate) min_gbps: Option<f64>,
    /// Sweep: decode's KV-cache layout when it differs from prefill's (--layout). The bytes travel verbatim (vLLM's NixlConnector); without --permute-local-kv an NHD/HND pair holds the right rows at the wrong positions (class layout, exit 1).
    #[arg(long, group = "sweep", value_enum, value_name = "LAYOUT")]
    pub(crate) decode_layout: Option<kvprobe::geometry::Layout>,
    /// Sweep: decode's tokens per block when they differ from prefill's (--block-size); one must be a multiple of the other, and decode's pool holds prefill's tokens (--blocks × prefill's / decode's block size). Decode blocks a multiple of prefill's follow vLLM (block_size_ratio); prefill blocks cut into smaller decode blocks are kvprobe's own rule (vLLM refuses them).
    #[arg(long, group = "sweep", value_name = "TOKENS")]
    pub(crate) decode_block_size: Option<u32>,
    /// Sweep: decode converts each received slice from prefill's layout into its own, as vLLM's enable_permute_local_kv (kv_postprocess_layout_on_receive).
    #[arg(long, group = "sweep")]
    pub(crate) permute_local_kv: bool,
    /// Sweep: prefill's tensor-parallel size: one NIXL agent and pool per TP rank, each holding its KV heads (the geometry's --kv-heads, or the model's, are the model's total; above the KV heads each head is replicated, as vLLM's get_num_kv_heads). Decode's ranks read by vLLM NixlConnector's TP rules.
    #[arg(long, group = "sweep", value_name = "N")]
    pub(crate) prefill_tp: Option<u32>,
    /// Sweep: decode's tensor-parallel size (see --prefill-tp).
    #[arg(long, group = "sweep", value_name = "N")]
    pub(crate) decode_tp: Option<u32>,
    #[command(flatten)]
    pub(crate) pair: PeerArgs,
    /// Request-level load instead of the sweep: which connectors move the blocks.
    #[arg(long, value_enum)]
    pub(crate) scenario: Option<Scenario>,
    /// Leave a race mechanism unfenced (the bug) or fenced; implies --scenario stacked. Repeatable. See --help.
    #[arg(long, value_name = "MECHANISM[=unfenced|fenced]")]
    pub(crate) race: Vec<RaceSpec>,
    #[command(flatten)]
    pub(crate) load: LoadArgs,
}

/// serve's exit codes, as one string literal (so `concat!` can add a reference).
macro_rules! serve_exit_codes {
    () => {
        "Exit codes: the run's own code (0 clean, 1 corrupt, 3 transport, 4 timeout, 5 below --min-gbps, 6 an unfenced race mechanism not reproduced (run --race, ab), 7 decode's report not written, 130 interrupted: the two sides end with one outcome); 2 a refused configuration (the reason names the fields; a wrong token or protocol version is refused and serve keeps listening) or a bad flag (--listen that cannot be bound); 3 the decode side died or the link broke; 4 the decode side went silent for --timeout (stopped, link dropped); 130 interrupted while waiting (--keep-serving ends only by a signal: 130)."
    };
}
pub(crate) use serve_exit_codes;

#[derive(Args)]
pub(crate) struct ServeArgs {
    /// Address and port to listen on (required; e.g. 10.0.0.2:7000, 0.0.0.0:7000; port 0 picks a free one and prints it). Nothing else is opened until a run connects.
    #[arg(long, value_name = "ADDR:PORT", required_unless_present = "fd")]
    pub(crate) listen: Option<String>,
    /// Internal (the prefill process of `run --decode-process`): serve one session on the Unix socket inherited as descriptor N, token from $KVPROBE_TOKEN; nothing on stdout, no report.
    #[arg(long, value_name = "N", hide = true, conflicts_with_all = ["listen", "keep_serving", "report"])]
    pub(crate) fd: Option<i32>,
    /// Shared token the run must prove, at least 16 characters of at least 5 distinct ones (default: $KVPROBE_TOKEN; with neither, serve makes a random one and prints it on stdout, where its other status lines go too).
    #[arg(long, value_name = "T")]
    pub(crate) token: Option<String>,
    /// Write the token (given or made) to FILE for scripts: the token alone on one line, mode 0600, written atomically before serve listens.
    #[arg(long, value_name = "FILE", conflicts_with = "fd")]
    pub(crate) token_file: Option<PathBuf>,
    /// Prefill's pool memory: vram (GPU) or dram (host). Default: vram when a GPU is present, else dram.
    #[arg(long, value_enum)]
    pub(crate) memory: Option<MemoryKind>,
    /// Prefill's GPU.
    #[arg(long, default_value_t = 0)]
    pub(crate) device: usize,
    /// Require this NIXL backend of the run (refused otherwise).
    #[arg(long)]
    pub(crate) backend: Option<String>,
    /// Prefill's geometry: when any of these is given, a run with another geometry is refused, naming the field.
    #[command(flatten)]
    pub(crate) geo: GeometryArgs,
    /// Write serve's JSON report here (atomically) after each run: the run's config and outcome, this side's environment and UCX path, decode's environment under `peer`.
    #[arg(long)]
    pub(crate) report: Option<PathBuf>,
    /// Serve another run after each one (default: exit after one run).
    #[arg(long)]
    pub(crate) keep_serving: bool,
    /// Bound of the wait for a connected client's configuration, in seconds (then the run's --timeout bounds everything).
    #[arg(long, default_value_t = kvprobe::sweep::DEFAULT_TIMEOUT_SECS)]
    pub(crate) timeout: f64,
}

#[derive(Args)]
pub(crate) struct AbArgs {
    #[command(flatten)]
    pub(crate) pool: PoolArgs,
    #[command(flatten)]
    pub(crate) load: LoadArgs,
    #[command(flatten)]
    pub(crate) pair: PeerArgs,
    /// Not an ab flag (ab leaves each mechanism unfenced in turn): accepted only to say so
    /// instead of clap's "did you mean --backend".
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "", action = clap::ArgAction::Append)]
    pub(crate) race: Vec<String>,
    /// Not an ab flag (ab runs every scenario): accepted only to say so.
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "")]
    pub(crate) scenario: Option<String>,
}

/// The clap ids of the flags in `group` of subcommand `sub`, as the flags' own attributes
/// define them: `LoadArgs` (every request-load flag: clap's group of that struct), `sweep`
/// (flags of the whole-pool sweep only, `group = "sweep"` on `RunArgs`), `device` (the GPUs
/// of the two pools, `group = "device"` on `PoolArgs`).
pub(crate) fn group_ids(sub: &str, group: &str) -> Vec<String> {
    // Built, so that each flag's `group = ...` is listed in its group.
    let mut cmd = <Cli as clap::CommandFactory>::command();
    cmd.build();
    let Some(c) = cmd.find_subcommand(sub) else { return Vec::new() };
    c.get_groups().filter(|g| g.get_id() == group).flat_map(|g| g.get_args().map(|a| a.to_string())).collect()
}

/// Parses `--backend-param KEY=VALUE` (a non-empty key of letters, digits and `_`; the
/// value may be empty and may hold `=`).
pub(crate) fn parse_backend_param(s: &str) -> Result<(String, String), String> {
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
pub(crate) fn parse_seed(s: &str) -> Result<u64, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.map_err(|_| format!("{s:?} is not a 64-bit seed (decimal or 0x hex)"))
}

/// Parses a positive duration such as `90s`, `10m`, `1h 30m` or a plain number of seconds.
pub(crate) fn parse_duration(s: &str) -> Result<f64, String> {
    let d = parse_duration_or_zero(s)?;
    if d <= 0.0 {
        return Err(format!("{s:?}: the duration must be positive"));
    }
    Ok(d)
}

pub(crate) fn parse_duration_or_zero(s: &str) -> Result<f64, String> {
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
pub(crate) fn parse_range(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("{s:?} is not MIN-MAX or N (blocks, e.g. 2-8)");
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    let a: u32 = a.trim().parse().map_err(|_| bad())?;
    let b: u32 = b.trim().parse().map_err(|_| bad())?;
    Ok((a, b))
}

/// Refuses a hybrid model's config where kvprobe does not move its state and indexer regions
/// (`how`: where, e.g. `in this command`): they move in `kvprobe run`'s sweeps
/// ([`kvprobe::sweep::regions`]) and, the state, in its nixl-only and stacked scenarios
/// ([`kvprobe::scenario::state`]), and a run that moved the attention pages alone would pass
/// while decode computed from zeros. Errors: usage (exit 2) naming the regions.
pub(crate) fn refuse_hybrid(model: Option<&kvprobe::model_config::ModelInfo>, how: &str) -> Result<(), Error> {
    let Some(h) = model.and_then(|m| m.kv.hybrid.as_ref()).filter(|h| h.any()) else { return Ok(()) };
    let mut what = Vec::new();
    if let Some(s) = &h.state {
        what.push(format!("its {} ({} layers)", s.region_name(), s.layers.len()));
    }
    if let Some(i) = &h.indexer {
        what.push(format!("its sparse-attention indexer K cache ({} layers)", i.layers.len()));
    }
    Err(Error::Usage(format!(
        "model config: a hybrid model: kvprobe moves {} in `kvprobe run` (sweeps; nixl-only and stacked scenarios) and does not move {} {how} yet, and a run that moved the attention pages alone would pass while decode computed from zeros; refused (kvprobe geometry --model-config shows every region per TP rank)",
        what.join(" and "),
        if what.len() == 1 { "it" } else { "them" }
    )))
}

impl PoolArgs {
    /// The run's configuration from these flags; errors as [`GeometryArgs::resolve`] (the
    /// model config is read once, here).
    pub(crate) fn try_config(&self) -> Result<RunConfig, Error> {
        let (g, model) = self.geo.resolve()?;
        Ok(self.config_of(g, model))
    }

    /// [`PoolArgs::try_config`] with a hybrid model's config accepted (`kvprobe run`, which
    /// refuses the forms that do not move its regions yet).
    pub(crate) fn try_config_any(&self, state_tp: Option<u32>) -> Result<RunConfig, Error> {
        let (g, model) = self.geo.resolve_any_at(state_tp)?;
        Ok(self.config_of(g, model))
    }

    /// [`PoolArgs::try_config`], or for a model config that gives no geometry the
    /// configuration of the report that refuses it ([`GeometryArgs::without_model`]).
    pub(crate) fn config(&self) -> RunConfig {
        self.try_config().unwrap_or_else(|_| self.config_of(self.geo.without_model(), None))
    }

    pub(crate) fn config_of(&self, g: kvprobe::geometry::Geometry, model: Option<kvprobe::model_config::ModelInfo>) -> RunConfig {
        let memory = self.memory.unwrap_or_else(MemoryKind::default_here);
        RunConfig {
            prefill_device: self.prefill_device.first().copied().unwrap_or(0),
            decode_device: self.decode_device.first().copied().unwrap_or(0),
            prefill_rank_devices: if self.prefill_device.len() > 1 { self.prefill_device.clone() } else { Vec::new() },
            decode_rank_devices: if self.decode_device.len() > 1 { self.decode_device.clone() } else { Vec::new() },
            preset: if self.geo.model_config.is_some() { None } else { Some(self.geo.preset.unwrap_or(Preset::Small)) },
            model,
            seed: self.seed,
            backend: self.backend.clone(),
            backend_params: self.backend_param.iter().cloned().collect(),
            xfer_req: self.xfer_req,
            timeout_secs: self.timeout,
            max_failures: self.max_failures,
            ..RunConfig::new(memory, g)
        }
    }
}

impl LoadArgs {
    pub(crate) fn config(&self, scenario: Scenario, unfenced: Vec<Mechanism>, g: &kvprobe::geometry::Geometry) -> ScenarioConfig {
        let (min_blocks, max_blocks) = self.prompt_blocks;
        ScenarioConfig {
            scenario,
            unfenced,
            requests: self.requests.unwrap_or(kvprobe::scenario::config::DEFAULT_REQUESTS),
            duration_secs: self.duration,
            concurrency: self.concurrency,
            workload: WorkloadConfig { min_blocks, max_blocks, prefix_share: self.prefix_share, abort_rate: self.abort_rate },
            tier: self.tier,
            mooncake: match (&self.mooncake_master, &self.mooncake_metadata) {
                (Some(m), Some(u)) => Some(kvprobe::mooncake::External { master: m.clone(), metadata_url: u.clone() }),
                _ => None,
            },
            tier_blocks: self.tier_blocks.unwrap_or_else(|| ScenarioConfig::default_tier_blocks(g, self.concurrency, max_blocks)),
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
    pub(crate) fn config(&self, typed: &[&str]) -> Result<RunConfig, Error> {
        let mut c = self.pool.try_config_any(self.prefill_tp)?;
        c.op = self.op;
        c.iterations = self.iterations;
        c.descriptor_blocks = self.descriptor_blocks;
        c.stages = self.pipeline_stages;
        c.decode_process = self.decode_process;
        dram_takes_no_device(&c, typed)?;
        self.pair.apply(&mut c, typed)?;
        for a in &self.inject {
            match a {
                kvprobe::inject::InjectArg::Sweep(spec) => c.inject.push(*spec),
                kvprobe::inject::InjectArg::Region(r) => c.region_inject.push(r.clone()),
            }
        }
        c.self_test = self.self_test;
        c.min_gbps = self.min_gbps;
        if (self.prefill_tp.is_some() || self.decode_tp.is_some()) && self.pool.geo.tp.is_some() {
            return Err(Error::Usage(
                "--tp gives one rank's geometry on both sides; with --prefill-tp/--decode-tp the model's whole KV cache is split by each side's TP size: give those alone".into(),
            ));
        }
        // A hybrid model's decode engine at another TP size raises its block size from its own
        // rank's state slot (vLLM's rule, per engine): decode's block size, unless given.
        let mut decode_block_size = self.decode_block_size;
        if let (None, Some(p), Some(d), Some(m)) = (decode_block_size, self.prefill_tp, self.decode_tp, c.model.as_ref())
            && p != d
            && m.kv.hybrid.as_ref().is_some_and(|h| h.state.is_some())
        {
            let usage = |e: kvprobe::model_config::ModelConfigError| Error::Usage(e.to_string());
            let (rank_g, _) = m.kv.rank_geometry(d, m.kv_cache_dtype).map_err(usage)?;
            let b = match m.block_size_asked.or(self.pool.geo.block_size) {
                Some(asked) => m.kv.hybrid_block_size(&rank_g, d, asked).map_err(usage)?,
                None => rank_g.block_size,
            };
            if b != c.geometry.block_size {
                decode_block_size = Some(b);
                eprintln!(
                    "note: decode at --decode-tp {d} raises its block size to {b} tokens for its rank's state slot (prefill at --prefill-tp {p}: {})",
                    c.geometry.block_size
                );
            }
        }
        let side = kvprobe::sweep::DecodeSide {
            layout: self.decode_layout,
            block_size: decode_block_size,
            permute_local_kv: self.permute_local_kv,
            prefill_tp: self.prefill_tp,
            decode_tp: self.decode_tp,
        };
        // Flags that change nothing here are said, not silently dropped.
        for note in c.set_decode_side(side)? {
            eprintln!("note: {note}");
        }
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
                let sweep = group_ids("run", "sweep");
                if let Some(f) = typed.iter().find(|f| sweep.iter().any(|s| s == *f)) {
                    return Err(Error::Usage(format!(
                        "{} applies to the whole-pool sweep; a scenario runs --requests or --duration",
                        flag(f)
                    )));
                }
                let races = kvprobe::mechanism::Races::from_specs(&self.race);
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
                let load = group_ids("run", "LoadArgs");
                if let Some(f) = typed.iter().find(|f| load.iter().any(|s| s == *f)) {
                    return Err(Error::Usage(format!(
                        "{} shapes a request-level load: add --scenario {} (or --race)",
                        flag(f),
                        if *f == "host_staging" { "nixl-only|stacked" } else { "nixl-only|tier-only|stacked" }
                    )));
                }
            }
        }
        // A hybrid model's state moves per request in nixl-only and stacked scenarios
        // (kvprobe::scenario::state), READ or WRITE, without host staging; the other forms
        // refuse it.
        if let Some(sc) = &c.scenario {
            let how = if !sc.scenario.uses_nixl() {
                Some("in a tier-only scenario (kvprobe's tier saves no state)")
            } else if sc.staging {
                Some("with --host-staging")
            } else {
                None
            };
            if let Some(how) = how {
                refuse_hybrid(c.model.as_ref(), how)?;
            }
            if let Some(r) = c.region_inject.first() {
                return Err(Error::Usage(format!(
                    "--inject {}@{}: faults in a hybrid model's regions are planted by the sweep (`kvprobe run` without --scenario); under request load the state is verified per request",
                    r.kind.name(),
                    r.region
                )));
            }
            kvprobe::sweep::regions::scenario_lanes(&c)?;
        }
        // A hybrid model's regions: planned here (sizes, layers, injections), so that what
        // cannot run is refused before anything moves.
        let plans = kvprobe::sweep::regions::plans(&c)?;
        for p in &plans {
            p.pool_geometry()?;
            for src in &p.sources {
                p.pool_geometry_of(src.page_stride_bytes)?;
            }
        }
        kvprobe::sweep::regions::check_hooks(&plans)?;
        if let Some(r) = c.region_inject.iter().find(|r| !plans.iter().any(|p| p.region.kind == r.region)) {
            return Err(Error::Usage(format!(
                "--inject {}:{}@{}: this run moves no {} region (a hybrid model's --model-config has it: kvprobe geometry lists its regions)",
                r.kind.name(),
                r.count,
                r.region,
                r.region
            )));
        }
        kvprobe::sweep::regions::check_room(&c, &plans)?;
        if c.self_test
            && c.inject.is_empty()
            && c.region_inject.is_empty()
            && c.scenario.as_ref().is_none_or(|s| s.unfenced.is_empty())
        {
            return Err(Error::Usage(
                "--self-test judges planted faults: give --inject CLASS[:N] (or an unfenced --race with --scenario stacked)"
                    .into(),
            ));
        }
        Ok(c)
    }
}

/// Set when `--report -` / `--json -` sends the JSON to stdout: the human output then goes to
/// stderr, so stdout holds nothing but the JSON.
pub(crate) static HUMAN_TO_STDERR: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
