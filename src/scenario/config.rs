//! A scenario's parameters (`kvprobe run --scenario`, `kvprobe ab`): which connectors, the
//! request load, the tier and the mechanisms left unfenced, with their checks, and the live
//! counters a run reports its progress with. Types only, so the sweep's configuration
//! (`sweep::RunConfig`) and the report can carry them without the engine.

use crate::core::mechanism::{Fencing, Mechanism, Races, Scenario};
use crate::core::workload::WorkloadConfig;
use crate::error::{Error, Result};
use crate::mem::tier::TierKind;

/// Parameters of a scenario run.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct ScenarioConfig {
    /// Which connectors move the blocks.
    pub scenario: Scenario,
    /// Mechanisms left unfenced (all others fenced).
    pub unfenced: Vec<Mechanism>,
    /// Stop admitting after this many requests (when no duration is given).
    pub requests: u64,
    /// Stop admitting after this many seconds; `requests` is then unused (the command line
    /// refuses `--duration` with `--requests`).
    pub duration_secs: Option<f64>,
    /// Requests in flight at most.
    pub concurrency: u32,
    /// Prompt lengths, prefix sharing and aborts.
    pub workload: WorkloadConfig,
    /// The tier.
    pub tier: TierKind,
    /// `--tier mooncake` with an existing master and metadata service instead of one kvprobe
    /// starts.
    pub mooncake: Option<crate::mem::mooncake::External>,
    /// Tier entries (blocks).
    pub tier_blocks: u32,
    /// Seconds per error-rate interval in the report.
    pub interval_secs: f64,
    /// Complete each step's READs (and their notifications) within the step: no copy
    /// overlaps a transfer, and the whole run, counts included, follows from the seed.
    pub lockstep: bool,
    /// Engine steps prefill keeps a handed request's blocks before its lease (the abort
    /// timeout, vLLM's `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`) expires; fenced, the lease is kept
    /// alive until decode's READ is notified (`abort-timeout-free`).
    #[serde(default = "default_lease")]
    pub lease_steps: u32,
    /// Engine steps one request in eight waits at decode before its pull (a decode instance
    /// busy with others): with a lease shorter than this, `abort-timeout-free` opens.
    #[serde(default = "default_decode_delay")]
    pub decode_delay_steps: u32,
    /// Share of requests the scheduler preempts after their prefill writes (block pressure;
    /// recomputed later): fenced, their blocks are freed once their queued saves ran
    /// (`preempt-save`).
    #[serde(default = "default_preempt_rate")]
    pub preempt_rate: f64,
    /// Share of decode's transfers of two or more blocks (a request's NIXL READ, its
    /// tier-only loads) in which some blocks fail to move (a seeded 1 to all-but-one of
    /// them, as a backend reporting per-descriptor errors would): fenced, the failed blocks
    /// are read again before the request is used (`failed-as-complete`). Runs before this
    /// field had none (0).
    #[serde(default)]
    pub fail_rate: f64,
    /// Push mode (`run --op write --scenario`): prefill WRITEs each request's blocks into
    /// the decode blocks decode asked for (vLLM's push flow, SGLang's), instead of decode
    /// READing them; nixl-only and stacked. Written only when set.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub push: bool,
    /// Host-buffer staging (`--host-staging`, vLLM's `kv_buffer_device=cpu`): prefill
    /// computes into its KV cache, a pool of its own, and stages each request's blocks into
    /// the pool registered with NIXL, which decode READs; its prefill is chunked (two computed
    /// blocks per chunk, one chunk per step). nixl-only and stacked. Written only when set.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub staging: bool,
    /// `--inject` under request load: faults planted on decode's READ descriptors (drop,
    /// misroute, torn: decode plants them) and in prefill's source blocks (bitflip, stale:
    /// prefill plants them and names them at the hand-over). Written only when set.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inject: Vec<crate::core::inject::Spec>,
    /// `kvprobe ab`'s load: the template of the matrix, whose rows each pick their scenario
    /// and unfenced mechanism (a prefill side then runs every row it is asked for, one after
    /// the other). Written only when set.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub matrix: bool,
}

/// `--requests` when neither it nor `--duration` is given (requests).
pub const DEFAULT_REQUESTS: u64 = 2000;
/// Most host memory the default tier takes (bytes): 4 GiB.
pub const DEFAULT_TIER_MAX_BYTES: u64 = 4 << 30;
/// `--lease` when not given (steps).
pub const DEFAULT_LEASE: u32 = 8;
/// `--decode-delay` when not given (steps).
pub const DEFAULT_DECODE_DELAY: u32 = 16;
/// `--preempt-rate` when not given.
pub const DEFAULT_PREEMPT_RATE: f64 = 0.05;
/// `--fail-rate` when not given.
pub const DEFAULT_FAIL_RATE: f64 = 0.05;

fn default_lease() -> u32 {
    DEFAULT_LEASE
}
fn default_decode_delay() -> u32 {
    DEFAULT_DECODE_DELAY
}
fn default_preempt_rate() -> f64 {
    DEFAULT_PREEMPT_RATE
}

impl ScenarioConfig {
    /// `--tier-blocks` when not given (blocks): 16 x the pool's blocks, within
    /// [`DEFAULT_TIER_MAX_BYTES`] of host memory (a tier block holds every layer's K/V
    /// slices: `num_layers x kv_parts x slice_bytes`), and never fewer entries than in-flight
    /// requests can pin (2 x `concurrency` x `max_prompt_blocks`); at most `u32::MAX`.
    pub fn default_tier_blocks(g: &crate::core::geometry::Geometry, concurrency: u32, max_prompt_blocks: u32) -> u32 {
        let block = (g.num_layers as u64 * g.kv_parts() as u64 * g.slice_bytes().unwrap_or(1)).max(1);
        let pinned = 2 * concurrency as u64 * max_prompt_blocks as u64;
        (16 * g.num_blocks as u64).min(DEFAULT_TIER_MAX_BYTES / block).max(pinned).min(u32::MAX as u64) as u32
    }

    /// The unfenced set.
    pub fn races(&self) -> Races {
        Races::from_specs(
            &self
                .unfenced
                .iter()
                .map(|&m| crate::core::mechanism::RaceSpec { mechanism: m, fencing: Fencing::Unfenced })
                .collect::<Vec<_>>(),
        )
    }
}

/// Live counters handed to the progress callback.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    /// Seconds since the start.
    pub elapsed: f64,
    /// Requests verified.
    pub requests: u64,
    /// Admission target (requests), when not running for a duration.
    pub target_requests: Option<u64>,
    /// Duration target (seconds), when given.
    pub target_secs: Option<f64>,
    /// NIXL bytes moved so far.
    pub bytes: u64,
    /// Corrupt slices so far.
    pub corrupt: u64,
    /// True once admission stopped and in-flight requests drain.
    pub draining: bool,
}

/// Whether a geometry and load fit: every prompt must fit in each pool.
pub fn check(cfg: &ScenarioConfig, num_blocks: u32) -> Result<()> {
    let w = &cfg.workload;
    if w.min_blocks == 0 || w.min_blocks > w.max_blocks {
        return Err(Error::Usage(format!("--prompt-blocks {}-{}: need 1 <= MIN <= MAX", w.min_blocks, w.max_blocks)));
    }
    if w.max_blocks > num_blocks / 2 {
        return Err(Error::Usage(format!(
            "--prompt-blocks up to {} needs at least {} blocks per pool (--blocks is {num_blocks})",
            w.max_blocks,
            w.max_blocks * 2
        )));
    }
    if !(0.0..=1.0).contains(&w.prefix_share) {
        return Err(Error::Usage(format!("--prefix-share must be between 0 and 1, got {}", shown(w.prefix_share))));
    }
    if !(0.0..1.0).contains(&w.abort_rate) {
        return Err(Error::Usage(format!(
            "--abort-rate must be at least 0 and below 1 (some requests must reach decode), got {}",
            shown(w.abort_rate)
        )));
    }
    if cfg.concurrency == 0 || cfg.concurrency > 4096 {
        return Err(Error::Usage("--concurrency must be between 1 and 4096".into()));
    }
    if let Some(d) = cfg.duration_secs
        && !(d.is_finite() && d > 0.0)
    {
        return Err(Error::Usage("--duration must be positive".into()));
    }
    if cfg.duration_secs.is_none() && cfg.requests == 0 {
        return Err(Error::Usage("--requests must be at least 1".into()));
    }
    if cfg.lease_steps == 0 || cfg.lease_steps > 1_000_000 {
        return Err(Error::Usage("--lease must be between 1 and 1000000 engine steps".into()));
    }
    if cfg.decode_delay_steps > 1_000_000 {
        return Err(Error::Usage("--decode-delay must be at most 1000000 engine steps".into()));
    }
    if !(0.0..1.0).contains(&cfg.preempt_rate) {
        return Err(Error::Usage(format!(
            "--preempt-rate must be at least 0 and below 1 (some requests must reach decode), got {}",
            shown(cfg.preempt_rate)
        )));
    }
    if cfg.push && !cfg.scenario.uses_nixl() {
        return Err(Error::Usage(
            "push mode (--op write) WRITEs blocks over NIXL: tier-only moves none (use nixl-only or stacked)".into(),
        ));
    }
    if let Some(m) = cfg.unfenced.iter().find(|m| m.needs_push())
        && !cfg.push
    {
        return Err(Error::Usage(format!(
            "--race {m} needs push mode, where prefill WRITEs into decode's blocks: add --op write"
        )));
    }
    if cfg.staging && (cfg.push || !cfg.scenario.uses_nixl()) {
        return Err(Error::Usage(
            "--host-staging stages the blocks decode READs: it needs nixl-only or stacked, without push mode (--op write)".into(),
        ));
    }
    if let Some(m) = cfg.unfenced.iter().find(|m| m.needs_staging())
        && !cfg.staging
    {
        return Err(Error::Usage(format!("--race {m} needs host-buffer staging: add --host-staging")));
    }
    if let Some(m) = cfg.unfenced.iter().find(|m| matches!(m, Mechanism::FailedAsComplete | Mechanism::DuplicateCompletion))
        && cfg.push
    {
        return Err(Error::Usage(format!(
            "--race {m} acts on decode's READs and their notifications (failed-as-complete also on tier-only loads); \
             push mode (--op write) has neither"
        )));
    }
    if cfg.push && !cfg.inject.is_empty() {
        return Err(Error::Usage(
            "--inject plants faults on decode's READ descriptors; in push mode (--op write) prefill builds the WRITEs".into(),
        ));
    }
    for s in &cfg.inject {
        use crate::core::inject::Kind;
        // Prefill's faults stay in its block after the request: a mechanism that frees or
        // reuses blocks early, or leaves them unstaged, would carry them to another request
        // (or write over them) where the shadow cannot know them.
        if matches!(s.kind, Kind::Bitflip | Kind::Stale)
            && let Some(m) = cfg.unfenced.iter().find(|m| m.breaks_ownership() || m.needs_staging())
        {
            return Err(Error::Usage(format!(
                "--inject {} plants in prefill's blocks, which unfenced {m} reuses or leaves unstaged: run them apart \
                 (drop, misroute and torn combine with every mechanism)",
                s.kind.name()
            )));
        }
        if s.kind == Kind::Stray {
            return Err(Error::Usage(
                "--inject stray under request load is not supported: stray needs the sweep's pipeline stages".into(),
            ));
        }
        if matches!(s.kind, Kind::HeadOffset | Kind::TokenOffset) {
            return Err(Error::Usage(format!(
                "--inject {} under request load is not supported: the sweep plants it (run without --scenario)",
                s.kind.name()
            )));
        }
        if !cfg.scenario.uses_nixl() {
            return Err(Error::Usage(format!(
                "--inject {} plants faults on decode's NIXL READs and their source blocks; tier-only has none (use nixl-only or stacked)",
                s.kind.name()
            )));
        }
        if s.kind == Kind::Misroute && w.max_blocks < 2 {
            return Err(Error::Usage(
                "--inject misroute pairs two blocks of one request: it needs prompts of two or more blocks (--prompt-blocks)"
                    .into(),
            ));
        }
    }
    let planted: u64 = cfg.inject.iter().map(|s| s.count as u64).sum();
    if cfg.duration_secs.is_none() && planted > cfg.requests {
        return Err(Error::Usage(format!(
            "--inject plants one fault per request's READ: {planted} faults need more than --requests {}",
            cfg.requests
        )));
    }
    if !(0.0..1.0).contains(&cfg.fail_rate) {
        return Err(Error::Usage(format!(
            "--fail-rate must be at least 0 and below 1 (some transfers must succeed), got {}",
            shown(cfg.fail_rate)
        )));
    }
    if !(cfg.interval_secs.is_finite() && cfg.interval_secs >= 0.1) {
        return Err(Error::Usage("--interval must be at least 100ms".into()));
    }
    let need = 2 * cfg.concurrency as u64 * w.max_blocks as u64;
    // A matrix's rows use the tier whatever its template says.
    if (cfg.matrix || cfg.scenario.uses_tier()) && (cfg.tier_blocks as u64) < need {
        return Err(Error::Usage(format!(
            "--tier-blocks {} is too small: in-flight requests may pin up to {need} entries (2 x concurrency x max prompt blocks)",
            cfg.tier_blocks
        )));
    }
    Ok(())
}

/// A flag's number as typed back in an error: plain, or in exponent form when huge or tiny
/// (`1e308`, not 309 digits).
fn shown(x: f64) -> String {
    if x != 0.0 && !(1e-6..1e9).contains(&x.abs()) { format!("{x:e}") } else { format!("{x}") }
}
