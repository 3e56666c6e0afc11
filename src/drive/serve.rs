//! `kvprobe serve`: the prefill side of a node pair. It listens where told, authenticates
//! its clients (`kvprobe run --peer`) with a shared token, both ways, behind a gate that slows
//! token guessing ([`peer::gate`]), serves one run at a time, takes the run's
//! configuration from it, and then does what the decode side asks over the peer protocol
//! ([`crate::peer`]): fill stages of its pool with fingerprinted generations (planting the
//! prefill-side faults of `--inject`), post WRITEs, forward the NIXL notifications its
//! agent receives. NIXL moves the bytes between the two hosts; the protocol carries control.
//!
//! The same session serves `kvprobe run --decode-process`: kvprobe starts a child
//! `kvprobe serve --fd N` (hidden) on one end of a Unix socket pair ([`serve_child`]) and
//! drives it exactly as `run --peer` drives a serve on another host; and the plain sweep,
//! whose prefill side is this session on a thread of the same process, on a Unix socket pair
//! too ([`serve_in_process`]). One protocol and one code path for a remote, a child and an
//! in-process peer.
//!
//! Both sides plan each iteration from the configuration alone (`sweep::plan`: block
//! map, injections), so the protocol never carries block lists.

use crate::core::mechanism::Scenario;
use crate::error::{Error, Exit, Result};
use crate::mem::pool::MemoryKind;
use crate::mem::tier::TierKind;
use crate::peer::steps::TierAccess;
use crate::peer::{self, Accepted, Link, Msg, Side, Stream};
use crate::report::{PeerSide, Report};
use crate::scenario::config::ScenarioConfig;
use crate::scenario::connectors::tier::TierPlace;
use crate::scenario::prefill::PrefillEngine;
use crate::sweep::{self, RunConfig};
use crate::xfer::transport::{Endpoint, Op};
use std::collections::BTreeMap;
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::mpsc::{RecvTimeoutError, channel};
use std::time::{Duration, Instant};

/// Least time serve waits for decode's next request once the run is set up (the bound is
/// 2 × the run's `--timeout`, at least this).
pub const IDLE_REQUESTS: Duration = Duration::from_secs(120);

/// What `kvprobe serve` was told.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Where to listen (`--listen ADDR:PORT`; port 0 picks a free one).
    pub listen: String,
    /// The shared token (`--token`, [`peer::TOKEN_VAR`], or one made at start and printed).
    pub token: String,
    /// Prefill's pool memory (`--memory`; default VRAM when a GPU exists).
    pub memory: MemoryKind,
    /// Prefill's GPU (`--device`).
    pub device: usize,
    /// The NIXL backend the run must use (`--backend`), when given.
    pub backend: Option<String>,
    /// Prefill's geometry when pinned by flags (`--preset`, `--layers`, …): the run's must
    /// equal it field by field.
    pub geometry: Option<crate::core::geometry::Geometry>,
    /// `geometry` came from a hybrid model's config without `--block-size`: its block size
    /// follows the run's TP (each engine raises it from its own rank's state slot, vLLM's
    /// hybrid block size), so the run's is taken.
    pub block_size_follows_tp: bool,
    /// `geometry` came from a model config without `--blocks`: its block count is a default
    /// that follows the block size and TP (1 GiB a rank), so the run's is taken.
    pub num_blocks_follow_run: bool,
    /// Serve's own `--model-config`: its hybrid regions' layout (`ModelKv::hybrid` as JSON,
    /// `null` for an attention-only model), which the run's must equal; `None` without a model
    /// config (the run's is taken).
    pub hybrid: Option<serde_json::Value>,
    /// Serve's `--tp` when given: the run's model TP (`--tp`) must be the same.
    pub tp: Option<u32>,
    /// Serve another run after each one (`--keep-serving`).
    pub keep_serving: bool,
    /// How long a client may stay silent before its configuration arrives (then the run's
    /// `--timeout` takes over).
    pub idle_timeout: Duration,
    /// Where the decode side of its sessions is.
    pub mode: SessionMode,
}

/// Where a serve session's decode side is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionMode {
    /// `kvprobe serve --listen`: on another host (or process), `kvprobe run --peer`.
    Listen,
    /// The prefill process of `run --decode-process` (`serve --fd N`, [`serve_child`]): one
    /// session on an inherited socket, a configuration with `decode_process` accepted.
    Child,
    /// The plain sweep's prefill side on a thread of the decode process ([`serve_in_process`]):
    /// one session, its pool handed over by decode ([`Handoff`]).
    InProcess,
}

/// What an in-process session ([`serve_in_process`]) shares with the decode side of its
/// process, besides the protocol.
#[derive(Default)]
pub struct Handoff {
    /// Prefill's pool, allocated by the decode side (which timed the copy ceiling on it); the
    /// session takes it instead of allocating one (it must be on the session's `--memory` and
    /// GPU).
    pub pool: std::sync::Mutex<Option<crate::mem::pool::KvPool>>,
    /// Prefill's registrations, set before the session says its agent is connected: decode's
    /// requests take shares of them, as requests between two agents of one process always do
    /// ([`crate::xfer::transport::PeerInfo::lease`]), so that prefill's pool outlives every request
    /// that may still move it, whenever the session ends.
    pub prefill_lease: std::sync::Mutex<Option<crate::xfer::nixl::WeakLease>>,
    /// Decode's registrations, set before decode sends its agent: prefill's requests (WRITE)
    /// take shares of them.
    pub decode_lease: std::sync::Mutex<Option<crate::xfer::nixl::WeakLease>>,
    /// Scenarios with the embedded tier: its arena, set before the session says its agent is
    /// connected, so that decode's tier-only loads copy from it directly.
    pub tier_arena: std::sync::Mutex<Option<Arc<crate::mem::tier::TierArena>>>,
    /// A hybrid model's region pass: the registrations of each plan's pools, both ways.
    pub regions: Arc<peer::LeaseSlots>,
}

/// Where prefill's region pools of a hybrid model go ([`Msg::RegionOpen`]): serve's memory,
/// the GPU of each prefill TP rank, and in process the slots their registrations are handed
/// by.
struct RegionSide<'a> {
    memory: MemoryKind,
    device_of: &'a dyn Fn(u32) -> usize,
    leases: Option<&'a peer::LeaseSlots>,
}

/// The region plan prefill holds open: its index, its pools' agents, decode's agent of it.
struct OpenRegion {
    index: u32,
    sources: Vec<Endpoint>,
    decode_agent: String,
}

/// One session's end: the report serve writes and its exit code.
pub struct SessionEnd {
    /// Serve's report of the run (config, its environment, decode's as `peer`, outcome).
    pub report: Report,
    /// Exit code.
    pub exit: Exit,
}

/// Binds `--listen`. Errors: usage (exit 2) when the address does not parse or resolve, or
/// cannot be bound (in use, not this host's, no permission).
pub fn bind(listen: &str) -> Result<TcpListener> {
    TcpListener::bind(listen).map_err(|e| Error::Usage(format!("--listen {listen}: cannot listen there: {e}")))
}

/// What the accept side tells the session loop of [`serve`].
enum Event {
    /// A client proved the token and took the session: its link, run id and address.
    Session(Link, String, String),
    /// A client was refused (its address, why).
    Refused(String, String),
    /// A connection ended before its hello (its address, the error).
    Dropped(String, Error),
    /// A source failed its handshake too often: (source, failures, refused for).
    Blocked(std::net::IpAddr, u32, Duration),
}

/// Serves sessions on `listener` until one run has ended (every run with `keep_serving`),
/// calling `ended` with each session's end (to print and write its report) and `say` with
/// status lines (peer text in them escaped). Returns the last session's exit code; 130 when
/// interrupted while waiting.
///
/// Connections are let in by a [`peer::gate::Gate`]: handshakes run on their own threads,
/// side by side, so that a client that stalls or fails its handshake does not keep the real
/// client out; a source that keeps failing is refused at once for a growing while (token
/// guessing); one session runs at a time, on this thread, and connections that come during it
/// are told serve is busy.
pub fn serve(
    cfg: &ServeConfig,
    listener: TcpListener,
    say: &mut dyn FnMut(&str),
    ended: &mut dyn FnMut(&SessionEnd) -> Exit,
) -> Exit {
    let gate = Arc::new(std::sync::Mutex::new(peer::gate::Gate::new()));
    let (tx, rx) = channel::<Event>();
    {
        let gate = gate.clone();
        let (token, idle) = (cfg.token.clone(), cfg.idle_timeout);
        std::thread::spawn(move || {
            for s in listener.incoming() {
                let Ok(s) = s else { continue };
                let _ = s.set_nodelay(true);
                let Ok(addr) = s.peer_addr() else { continue };
                let ip = addr.ip();
                let door = gate.lock().unwrap_or_else(|p| p.into_inner()).arrive(ip, Instant::now());
                let refusal = match door {
                    peer::gate::Door::Open => None,
                    // One client at a time: the others are told so at once.
                    peer::gate::Door::Busy => Some("this kvprobe serve is busy with another client".to_string()),
                    peer::gate::Door::Blocked(left) => Some(format!(
                        "too many failed handshakes from {}: its connections are refused for {:.0} s more",
                        peer::gate::source(ip),
                        left.as_secs_f64().ceil()
                    )),
                    peer::gate::Door::Crowded => {
                        Some("this kvprobe serve has too many handshakes in progress; try again".to_string())
                    }
                };
                if let Some(reason) = refusal {
                    peer::refuse_busy(Stream::Tcp(s), &reason);
                    continue;
                }
                let (gate, tx, token) = (gate.clone(), tx.clone(), token.clone());
                std::thread::spawn(move || {
                    let from = addr.to_string();
                    let failed = |gate: &std::sync::Mutex<peer::gate::Gate>| {
                        let mut g = gate.lock().unwrap_or_else(|p| p.into_inner());
                        if let Some(block) = g.failed(ip, Instant::now()) {
                            let _ = tx.send(Event::Blocked(peer::gate::source(ip), g.failures(ip), block));
                        }
                    };
                    // Whether this handshake's slot was given back (at most once).
                    let left = std::sync::atomic::AtomicBool::new(false);
                    let leave = || {
                        if !left.swap(true, std::sync::atomic::Ordering::SeqCst) {
                            gate.lock().unwrap_or_else(|p| p.into_inner()).leave(ip);
                        }
                    };
                    // The failure is counted, and the handshake's slot given back, before the
                    // refusal is sent (`gate(false)`): the source's next connection meets its
                    // count (and any block), never this handshake still in progress.
                    let check = |proven: bool| match proven {
                        true => gate.lock().unwrap_or_else(|p| p.into_inner()).claim(ip),
                        false => {
                            failed(&gate);
                            leave();
                            Ok(())
                        }
                    };
                    let event = match peer::server_gated(Stream::Tcp(s), &token, idle, &check) {
                        Ok(Accepted::Link(link, run_id)) => Event::Session(link, run_id, from),
                        Ok(Accepted::Refused(why)) => Event::Refused(from, why),
                        Err(e) => {
                            // A client that held its handshake for the whole bound counts as
                            // a failure; one that just closed (a port scan) does not.
                            if matches!(e, Error::Timeout(_)) {
                                failed(&gate);
                            }
                            Event::Dropped(from, e)
                        }
                    };
                    leave();
                    let _ = tx.send(event);
                });
            }
        });
    }
    let mut say = |l: &str| say(&crate::sys::text::escape_control(l));
    loop {
        let event = match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(e) => e,
            Err(RecvTimeoutError::Timeout) if crate::sys::interrupt::requested() => return Exit::Interrupted,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return Exit::Transport,
        };
        let (link, run_id, from) = match event {
            Event::Session(link, run_id, from) => (link, run_id, from),
            Event::Refused(from, why) => {
                // Not a run (no token proven, or busy): serve keeps listening, so a client
                // with a wrong token or another protocol version cannot end it.
                say(&format!("kvprobe serve: refused the client at {from}: {why}"));
                continue;
            }
            Event::Dropped(from, e) => {
                // A connection that never completed its hello (a port scan, a health check):
                // not a run; keep listening.
                say(&format!("kvprobe serve: dropped the connection from {from}: {e}"));
                continue;
            }
            Event::Blocked(src, n, block) => {
                say(&format!(
                    "kvprobe serve: {n} failed handshakes from {src}: its connections are refused for {:.0} s (other addresses are served)",
                    block.as_secs_f64()
                ));
                continue;
            }
        };
        say(&format!("kvprobe serve: run {run_id} from {from}"));
        let end = session(cfg, link, &run_id, &from, &mut say, None);
        let exit = ended(&end);
        if !cfg.keep_serving {
            return exit;
        }
        gate.lock().unwrap_or_else(|p| p.into_inner()).session_over();
        if crate::sys::interrupt::requested() {
            return Exit::Interrupted; // --keep-serving ends only by a signal: say so
        }
    }
}

/// `kvprobe serve --fd N` (hidden): the prefill process of `run --decode-process`. Serves one
/// session on `stream`, the socket it inherited from its parent (the decode side, which holds
/// the other end), then returns the session's exit code (what the parent's run ended with, or
/// this side's failure). Says nothing on stdout and writes no report: the parent's report
/// carries this side's part (its `bye`). The token is the one the parent put in
/// [`peer::TOKEN_VAR`].
pub fn serve_child(cfg: &ServeConfig, stream: std::os::unix::net::UnixStream) -> Exit {
    match peer::server(Stream::Unix(stream), &cfg.token, cfg.idle_timeout) {
        Ok(Accepted::Link(link, run_id)) => session(cfg, link, &run_id, "the parent kvprobe", &mut |_| {}, None).exit,
        Ok(Accepted::Refused(why)) => {
            eprintln!("kvprobe serve: refused the parent kvprobe: {why}");
            Exit::Usage
        }
        Err(e) => {
            eprintln!("kvprobe serve: {e}");
            e.exit()
        }
    }
}

/// The plain sweep's prefill side: serves one session on `stream` (one end of a Unix socket
/// pair whose other end the decode side of this process holds), on the calling thread, with
/// the pool and lease slots of `handoff`. Says nothing and writes no report (the run's report
/// is the decode side's); returns the session's exit code. `cfg.mode` must be
/// [`SessionMode::InProcess`].
pub fn serve_in_process(cfg: &ServeConfig, stream: std::os::unix::net::UnixStream, handoff: &Handoff) -> Exit {
    match peer::server(Stream::Unix(stream), &cfg.token, cfg.idle_timeout) {
        Ok(Accepted::Link(link, run_id)) => {
            session(cfg, link, &run_id, "this process's decode side", &mut |_| {}, Some(handoff)).exit
        }
        Ok(Accepted::Refused(_)) => Exit::Usage,
        Err(e) => e.exit(),
    }
}

/// A report for a session refused before its configuration was known.
fn refused_report(e: &Error) -> Report {
    let mut r = Report::start(serde_json::Value::Null);
    r.finish(e.exit(), Some(e));
    r
}

/// What a session knows as it goes (for its report, whatever the end).
struct Acc {
    report: Report,
    side: PeerSide,
}

/// Checks a received configuration: it reads back to the same JSON (same kvprobe schema),
/// its hash matches, it is a sweep kvprobe can run, and it agrees with serve's own flags.
/// Errors: (field, reason) to refuse with.
fn check_config(
    cfg: &ServeConfig,
    value: &serde_json::Value,
    hash: &str,
    decode: &Side,
) -> std::result::Result<RunConfig, (Option<String>, String)> {
    let rc: RunConfig =
        serde_json::from_value(value.clone()).map_err(|e| (None, format!("not a configuration this kvprobe reads: {e}")))?;
    let back = serde_json::to_value(&rc).map_err(|e| (None, e.to_string()))?;
    if let Some((f, a, b)) = peer::first_difference(value, &back) {
        return Err((
            Some(f.clone()),
            format!("configuration field {f}: sent {a}, read back as {b} (the two kvprobe versions differ)"),
        ));
    }
    if peer::config_hash(value) != hash {
        return Err((None, "configuration hash mismatch (the configuration changed in transit)".into()));
    }
    if let Some(b) = &cfg.backend
        && *b != rc.backend
    {
        return Err((Some("backend".into()), format!("backend: prefill (serve --backend) {b}, decode {}", rc.backend)));
    }
    let geo = |g: &crate::core::geometry::Geometry| serde_json::to_value(g).unwrap_or_default();
    if let Some(g) = &cfg.geometry {
        // With --prefill-tp the run's geometry is one rank's: serve's flags give the model's.
        let mut model = rc.geometry.clone();
        if let Some(t) = rc.tp {
            model.num_kv_heads = t.total_kv_heads;
        }
        // With `--tp N` (a model config's TP) the run's geometry is one rank's too: its heads
        // are serve's model's split as vLLM's get_num_kv_heads splits them.
        if let Some(m) = rc.model.as_ref().filter(|m| rc.tp.is_none() && m.tp.tp > 1 && !g.mla)
            && (g.num_kv_heads / m.tp.tp).max(1) == rc.geometry.num_kv_heads
        {
            model.num_kv_heads = g.num_kv_heads;
        }
        if cfg.block_size_follows_tp {
            model.block_size = g.block_size;
        }
        if cfg.num_blocks_follow_run {
            model.num_blocks = g.num_blocks;
        }
        let diff = peer::differences(&geo(g), &geo(&model));
        if let Some((f, _, _)) = diff.first() {
            let all: Vec<String> = diff.iter().map(|(f, a, b)| format!("geometry.{f}: serve {a}, run {b}")).collect();
            return Err((
                Some(format!("geometry.{f}")),
                format!(
                    "{} (serve's geometry flags pin prefill's geometry: give the run the same flags; decode's may differ only by --decode-layout and --decode-block-size)",
                    all.join("; ")
                ),
            ));
        }
    }
    // A hybrid model's state and indexer regions: serve's model config pins their layout as its
    // geometry flags pin the attention pages' (a run of another state layout would be
    // verified against pages prefill does not hold).
    if let Some(h) = &cfg.hybrid {
        let run = serde_json::to_value(rc.model.as_ref().and_then(|m| m.kv.hybrid.as_ref())).unwrap_or_default();
        let diff = peer::differences(h, &run);
        if let Some((f, _, _)) = diff.first() {
            let all: Vec<String> =
                diff.iter().take(4).map(|(f, a, b)| format!("model.kv.hybrid.{f}: serve {a}, run {b}")).collect();
            return Err((
                Some(format!("model.kv.hybrid.{f}")),
                format!(
                    "{} (serve's --model-config pins the model's state and indexer regions: give the run the same config and --mamba-* flags)",
                    all.join("; ")
                ),
            ));
        }
    }
    if let (Some(t), None) = (cfg.tp, rc.tp) {
        let run = rc.model.as_ref().map_or(1, |m| m.tp.tp);
        if run != t {
            return Err((Some("model.tp".into()), format!("tp: serve --tp {t}, run --tp {run} (give both the same --tp)")));
        }
    }
    if let Some((f, a, b)) = peer::first_difference(&geo(&decode.geometry), &geo(rc.decode_geom())) {
        return Err((Some(format!("geometry.{f}")), format!("decode announced geometry.{f} {a} but configured {b}")));
    }
    if rc.decode_process != (cfg.mode == SessionMode::Child) {
        return Err((
            Some("decode_process".into()),
            match cfg.mode {
                SessionMode::Child => {
                    "the prefill process of --decode-process serves only its parent's --decode-process run".into()
                }
                SessionMode::Listen => "--decode-process does not apply to --peer".into(),
                SessionMode::InProcess => "an in-process prefill does not serve --decode-process runs".into(),
            },
        ));
    }
    sweep::check_config(&rc).map_err(|e| (None, e.detail().to_string()))?;
    // Prefill's pool on this host: DRAM pool bytes plus the per-slice bookkeeping.
    let g = &rc.geometry;
    let ranks = rc.tp.map_or(1, |t| t.prefill as u64);
    let pool = if cfg.memory == MemoryKind::Dram { g.pool_bytes().unwrap_or(u64::MAX).saturating_mul(ranks) } else { 0 };
    let need = pool.saturating_add(g.total_slices().unwrap_or(u64::MAX).saturating_mul(sweep::HOST_BYTES_PER_SLICE));
    if let Some(avail) = crate::sys::hostmem::available_bytes()
        && need > avail
    {
        return Err((
            None,
            format!(
                "prefill's side needs about {} of host memory on this host; {} are available",
                crate::sys::units::bytes_exact(need),
                crate::sys::units::bytes_exact(avail)
            ),
        ));
    }
    Ok(rc)
}

/// Runs one authenticated session to its end (`handoff`: the in-process session's shared slots).
fn session(
    cfg: &ServeConfig,
    link: Link,
    run_id: &str,
    from: &str,
    say: &mut dyn FnMut(&str),
    handoff: Option<&Handoff>,
) -> SessionEnd {
    let mut acc = Acc {
        report: refused_report(&Error::Usage(String::new())),
        side: PeerSide { role: "decode".into(), address: from.into(), run_id: run_id.into(), ..Default::default() },
    };
    acc.report.outcome = crate::report::Outcome { exit_code: 0, status: "running".into(), error: None };
    let result = session_inner(cfg, &link, run_id, &mut acc, say, handoff);
    let (exit, err) = match result {
        Ok((exit, err)) => (exit, err),
        Err(e) => {
            // Tell the run (best effort; a dead or silent peer does not hear it).
            let m = match &e {
                Error::Interrupted(w) => Msg::Interrupt { why: w.clone() },
                e => Msg::Failed { exit: e.exit() as u8, message: e.detail().to_string() },
            };
            let _ = link.send(&m);
            (e.exit(), Some(e))
        }
    };
    link.close();
    let mut report = acc.report;
    report.peer = Some(acc.side);
    report.summary.host_peak_bytes = crate::sys::hostmem::peak_resident_bytes();
    report.finish(exit, err.as_ref());
    SessionEnd { report, exit }
}

/// The error to report for a failure `e` of prefill's side during the run (NIXL, the tier, a
/// wait): when the link shows within [`crate::peer::client::CAUSE_WAIT`] that decode is gone,
/// silent, interrupted or ended the run, that — the pair has one outcome, and decode's end
/// explains why prefill's call failed or was given up ([`peer::ended_with`]) — else `e`.
fn attribute(link: &Link, e: Error) -> Error {
    let t0 = Instant::now();
    while t0.elapsed() < crate::peer::client::CAUSE_WAIT {
        match link.recv(Duration::from_millis(10)) {
            Err(le) => return le,
            Ok(Some(Msg::Done { exit, error, .. })) => return peer::ended_with("the decode side", exit, error),
            Ok(_) => {}
        }
    }
    e
}

/// Makes sure `plans` holds iteration `it`'s plan (a function of the configuration:
/// [`sweep::plan`]), keeping the two newest.
fn plan_for(rc: &RunConfig, plans: &mut BTreeMap<u32, sweep::Plan>, it: u32) -> Result<()> {
    if let std::collections::btree_map::Entry::Vacant(v) = plans.entry(it) {
        v.insert(sweep::plan(rc, it)?);
    }
    while plans.len() > 2 && plans.first_key_value().is_some_and(|(k, _)| *k != it) {
        plans.pop_first();
    }
    Ok(())
}

fn session_inner(
    cfg: &ServeConfig,
    link: &Link,
    run_id: &str,
    acc: &mut Acc,
    say: &mut dyn FnMut(&str),
    handoff: Option<&Handoff>,
) -> Result<(Exit, Option<Error>)> {
    let started = Instant::now();
    // serve --timeout (at least the handshake's bound) bounds the wait for the configuration,
    // heartbeats or not.
    let config_bound = cfg.idle_timeout.max(peer::HANDSHAKE_BOUND);
    link.set_deadline(Some((
        started + config_bound,
        format!(
            "{} sent no configuration within {:.0} s (serve's --timeout, at least 10 s)",
            link.who(),
            config_bound.as_secs_f64()
        ),
    )));
    let (value, hash, decode, decode_env) = link.expect("the run's configuration", |m| match m {
        Msg::Config { config, hash, decode, environment } => Ok((config, hash, decode, environment)),
        m => Err(m.name()),
    })?;
    // Decode's words reach serve's output and report: escaped.
    let (decode, decode_env) = (peer::escaped(decode), peer::escaped(decode_env));
    acc.side.host = decode.host.clone();
    acc.side.memory = Some(decode.memory);
    acc.side.device = decode.device;
    acc.side.environment = decode_env;
    acc.report.config = value.clone();
    let rc = match check_config(cfg, &value, &hash, &decode) {
        Ok(rc) => rc,
        Err((field, reason)) => {
            // The reason quotes decode's configuration: escaped for serve's output.
            let reason = crate::sys::text::escape_control(&reason).into_owned();
            let _ = link.send(&Msg::Refused { reason: reason.clone(), field, exit: 2 });
            say(&format!("kvprobe serve: refused run {run_id}: {reason}"));
            return Ok((Exit::Usage, Some(Error::Usage(format!("refused the run's configuration: {reason}")))));
        }
    };
    let timeout = Duration::from_secs_f64(rc.timeout_secs);
    link.set_silence(timeout);
    link.bound_setup(timeout);
    crate::sys::deadline::set_limit(Some(timeout));
    // In process: the decode side's environment is this one (and its report the only one).
    let env = (cfg.mode != SessionMode::InProcess).then(|| crate::env::envinfo::gather(crate::env::envinfo::nixl_info()));
    acc.report.environment = env.clone();
    let vram = cfg.memory == MemoryKind::Vram;
    let prefill = Side {
        geometry: rc.geometry.clone(),
        memory: cfg.memory,
        device: if vram { cfg.device } else { 0 },
        host: peer::host_name(),
    };
    link.send(&Msg::Accept { prefill, environment: env })?;
    let mark = crate::xfer::ucx::mark();
    say(&format!(
        "kvprobe serve: prefill pool {} {}, backend {}",
        rc.geometry.pool_bytes().map(crate::sys::units::bytes_binary).unwrap_or_default(),
        if vram { format!("VRAM on GPU {}", cfg.device) } else { "DRAM".into() },
        rc.backend
    ));
    let handed = handoff.and_then(|h| h.pool.lock().unwrap_or_else(|p| p.into_inner()).take());
    let pool = match handed {
        Some(p) => p,
        None => sweep::build_prefill_pool(&rc, cfg.memory, cfg.device)?,
    };
    // The run's --xfer-req and --backend-param apply to both sides.
    let opts = crate::xfer::transport::TransportOptions { xfer_req: rc.xfer_req, backend_params: rc.backend_params.clone() };
    let refusal = |e| sweep::backend_refusal(&rc.backend, cfg.memory, e);
    crate::sys::trace::trace!("prefill NIXL agent");
    let mut ep = Endpoint::with_options("kvprobe-prefill", &rc.backend, pool, &opts).map_err(refusal)?;
    let (mut decode_info, mut decode_ranks) = link.expect("decode's NIXL agent", |m| match m {
        Msg::Connect { decode, decode_ranks } => Ok((decode, decode_ranks)),
        m => Err(m.name()),
    })?;
    let sides = rc.sides()?;
    let tp = sides.tp;
    if decode_ranks.len() + 1 != tp.decode as usize {
        return Err(Error::Transport(format!(
            "decode sent {} NIXL agents for decode TP {} (a protocol error)",
            decode_ranks.len() + 1,
            tp.decode
        )));
    }
    if let Some(l) = handoff.and_then(|h| h.decode_lease.lock().unwrap_or_else(|p| p.into_inner()).take()) {
        decode_ranks.iter_mut().for_each(|d| d.lease = l.clone());
        decode_info.lease = l;
    }
    let decode_agents: Vec<String> =
        std::iter::once(decode_info.agent.clone()).chain(decode_ranks.iter().map(|d| d.agent.clone())).collect();
    // Prefill's TP ranks 1.. (`--prefill-tp`): a pool and a NIXL agent each, on this side's
    // memory and GPU, holding their heads.
    let mut ranks = Vec::new();
    for p in 1..tp.prefill {
        // Rank p's GPU: the run's list (in process, --decode-process), else serve's --device.
        let dev = rc.prefill_rank_devices.get(p as usize).copied().unwrap_or(cfg.device);
        let mut pool = match cfg.memory {
            MemoryKind::Vram if dev != cfg.device => sweep::vram_pool_on(dev, &rc.geometry, rc.seed)?,
            _ => ep.pool.sibling()?,
        };
        pool.set_head_base(tp.heads_of(tp.prefill, p).start);
        ranks.push(Endpoint::with_options(&format!("kvprobe-prefill-tp{p}"), &rc.backend, pool, &opts).map_err(refusal)?);
    }
    // Scenarios with the embedded tier: its arena lives with prefill for the whole session;
    // decode copies from it in this process, else READs it over NIXL.
    let arena = match rc.scenario.as_ref().filter(|sc| sc.tier == TierKind::Embedded && (sc.matrix || sc.scenario.uses_tier())) {
        Some(sc) => {
            let a = Arc::new(crate::mem::tier::TierArena::new(sc.tier_blocks, ep.pool.block_bytes(), ep.pool.gpu().as_ref())?);
            match handoff {
                Some(h) => *h.tier_arena.lock().unwrap_or_else(|p| p.into_inner()) = Some(a.clone()),
                None => ep.register_tier(a.clone()).map_err(refusal)?,
            }
            Some(a)
        }
        None => None,
    };
    crate::sys::trace::trace!("prefill loads decode's metadata");
    // Each prefill rank loads the agents of the decode ranks that read it (vLLM's
    // get_target_remote_ranks, from decode's side). Bad metadata is decode's fault: transport,
    // exit 3.
    let all_decode: Vec<crate::xfer::transport::PeerInfo> = std::iter::once(decode_info).chain(decode_ranks).collect();
    for (p, e) in std::iter::once(&mut ep).chain(ranks.iter_mut()).enumerate() {
        for (d, info) in all_decode.iter().enumerate() {
            if tp.targets(d as u32).contains(&(p as u32)) {
                e.connect_link(info.clone(), crate::xfer::transport::Cuts::of_link(&sides, p as u32, d as u32))?;
            }
        }
    }
    // Test-only (`KVPROBE_TEST_STALL_AGENT_START` in the prefill process of --decode-process):
    // a side that never says it is ready.
    crate::sys::deadline::Stall::Start.here();
    let info = ep.info().map_err(refusal)?;
    let rank_infos = ranks.iter().map(|e| e.info()).collect::<Result<Vec<_>>>().map_err(refusal)?;
    if let Some(h) = handoff {
        let mut lease = info.lease.clone();
        rank_infos.iter().for_each(|r| lease.join(&r.lease));
        *h.prefill_lease.lock().unwrap_or_else(|p| p.into_inner()) = Some(lease);
    }
    link.send(&Msg::Connected { prefill: info, prefill_ranks: rank_infos })?;
    crate::xfer::ucx::adopt();
    if let Some(e) = acc.report.environment.as_mut() {
        e.nixl.ucx_version = crate::xfer::nixl::loaded_ucx_version();
    }
    let mut me = PeerSide { setup_seconds: started.elapsed().as_secs_f64(), ..Default::default() };

    link.set_deadline(None);
    link.running();
    // Decode's next request comes within its own bounded waits and passes (a transfer within
    // --timeout, a verify pass): one that heartbeats but sends nothing for IDLE_REQUESTS is
    // not waited for for ever.
    let idle_bound = (2 * timeout).max(IDLE_REQUESTS);
    let (exit, error, results) = match &rc.scenario {
        None => {
            let mut sides: Vec<Endpoint> = std::iter::once(ep).chain(ranks).collect();
            let device_of = |p: u32| rc.prefill_rank_devices.get(p as usize).copied().unwrap_or(cfg.device);
            let region_side =
                RegionSide { memory: cfg.memory, device_of: &device_of, leases: handoff.map(|h| h.regions.as_ref()) };
            sweep_requests(&rc, link, &mut sides, &decode_agents, &region_side, &mut me, idle_bound, say)?
        }
        Some(template) => {
            let place = TierPlace {
                arena,
                embedded: if handoff.is_some() { TierAccess::InProcess } else { TierAccess::Nixl },
                host: link.local_ip().unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)),
                ended: link.ended(),
            };
            let lane_side =
                RegionSide { memory: cfg.memory, device_of: &|_| cfg.device, leases: handoff.map(|h| h.regions.as_ref()) };
            scenario_requests(&rc, template, link, &mut ep, &place, &lane_side, &mut me, idle_bound, say)?
        }
    };
    // Decode's totals become serve's summary (one outcome for the pair), with serve's own path.
    if let Some(s) = results.summary.and_then(|v| serde_json::from_value::<crate::report::Summary>(v).ok()) {
        acc.side.transport_path = s.transport_path.clone(); // decode's UCX tables
        acc.report.summary = s;
    }
    acc.report.scenario = results.scenario.and_then(|v| serde_json::from_value(v).ok());
    acc.report.matrix = results.rows;
    acc.side.exit_code = Some(exit as u8); // one outcome for the pair: decode's is the run's
    let op = if rc.op == Op::Write { "WRITE" } else { "READ" };
    let mut path = crate::xfer::ucx::path_since(mark, &rc.backend, op, vram);
    if path.selections.is_empty() && rc.op == Op::Read {
        // The target of a READ logs no table of it: the initiator, decode, does.
        path.unknown_because =
            Some("decode initiates the READs: their UCX tables are decode's (summary.transport_path of decode's report, peer.transport_path of serve's)".into());
    }
    if let Some(env) = acc.report.environment.as_ref() {
        crate::xfer::ucx::flag_path(&mut path, &env.rdma, vram.then_some(cfg.device));
    }
    acc.report.summary.transport_path = Some(path.clone());
    me.role = "prefill".into();
    me.host = peer::host_name();
    me.run_id = run_id.into();
    me.memory = Some(cfg.memory);
    me.device = if vram { cfg.device } else { 0 };
    me.environment = acc.report.environment.clone();
    me.transport_path = Some(path);
    me.exit_code = Some(exit as u8);
    let _ = link.send(&Msg::Bye { side: Box::new(me) });
    let err = error.map(|m| match exit {
        Exit::Interrupted => Error::Interrupted(format!("the decode side was interrupted: {m}")),
        Exit::Timeout => Error::Timeout(format!("the decode side: {m}")),
        Exit::Usage => Error::Usage(format!("the decode side: {m}")),
        Exit::Corrupt => Error::Corrupt(m),
        _ => Error::Transport(format!("the decode side: {m}")),
    });
    Ok((exit, err))
}

/// How decode ended the run ([`Msg::Done`]): its exit code, error and results.
type Ending = (Exit, Option<String>, crate::peer::Results);

/// The run's end as decode said it ([`Msg::Done`]). Errors: transport (exit 3) for an exit
/// code kvprobe never uses (a protocol error).
fn done(link: &Link, m: Msg) -> Result<Ending> {
    let Msg::Done { exit, error, mut summary, mut scenario, mut rows } = m else {
        return Err(Error::Transport(format!("{} sent {} to end the run (a protocol error)", link.who(), m.name())));
    };
    match Exit::from_code(exit) {
        Some(x) => {
            let error = if x == Exit::Clean { None } else { error }; // a clean run has no error
            // Decode's words reach serve's output: escaped.
            let error = error.map(|e| crate::sys::text::escape_control(&e).into_owned());
            for v in [&mut summary, &mut scenario, &mut rows].into_iter().flatten() {
                peer::escape_strings(v);
            }
            Ok((x, error, crate::peer::Results { summary, scenario, rows }))
        }
        None => Err(Error::Transport(format!(
            "{} ended the run with exit code {exit}, which kvprobe never uses (a protocol error)",
            link.who()
        ))),
    }
}

/// The sweep's requests, served until decode's [`Msg::Done`]: fills of stages, WRITEs, and
/// the NIXL notifications prefill's agent receives, forwarded. `idle_bound`: how long decode
/// may send nothing while alive.
#[allow(clippy::too_many_arguments)]
fn sweep_requests(
    rc: &RunConfig,
    link: &Link,
    ranks: &mut [Endpoint],
    decode_agents: &[String],
    region_side: &RegionSide<'_>,
    me: &mut PeerSide,
    idle_bound: Duration,
    say: &mut dyn FnMut(&str),
) -> Result<Ending> {
    let stages = sweep::sweep_stages(rc);
    let mut plans: BTreeMap<u32, sweep::Plan> = BTreeMap::new();
    // WRITEs in flight: (stage tag, prefill rank, request); per stage tag, the requests
    // still in flight, their bytes and the longest post-to-completion time (ns).
    let mut inflight: Vec<(String, usize, crate::xfer::nixl::Posted)> = Vec::new();
    let mut writes: std::collections::HashMap<String, (u32, u64, u64)> = std::collections::HashMap::new();
    let lie_written = std::env::var_os(crate::sys::test_hooks::LIE_WRITTEN).is_some();
    let tp = rc.tp.unwrap_or(crate::core::pairing::tp::Tp::single(rc.geometry.num_kv_heads, rc.geometry.mla));
    let check_it = |it: u32| {
        if it == 0 || it > rc.iterations.saturating_add(1) {
            return Err(Error::Transport(format!("decode asked for iteration {it} of {} (a protocol error)", rc.iterations)));
        }
        Ok(())
    };
    let mut last_request = Instant::now();
    let timeout = Duration::from_secs_f64(rc.timeout_secs);
    // A hybrid model's region plans (derived from the configuration as decode derives them),
    // the one open, and its WRITEs in flight: (tag, source, request).
    let mut region_plans: Option<Vec<sweep::regions::RegionPlan>> = None;
    let mut region: Option<OpenRegion> = None;
    let mut region_inflight: Vec<(String, usize, crate::xfer::nixl::Posted)> = Vec::new();
    let out = loop {
        if crate::sys::interrupt::requested() {
            return Err(Error::Interrupted("serve was interrupted".into()));
        }
        let busy = !inflight.is_empty() || !region_inflight.is_empty();
        let m = link.recv(if busy { Duration::ZERO } else { Duration::from_millis(1) })?;
        if m.is_some() {
            last_request = Instant::now();
        } else if !busy && last_request.elapsed() > idle_bound {
            return Err(Error::Timeout(format!(
                "{} sent no request for {:.0} s (2 x --timeout, at least {} s) while alive: it stopped driving the run",
                link.who(),
                last_request.elapsed().as_secs_f64(),
                IDLE_REQUESTS.as_secs()
            )));
        }
        match m {
            None => {}
            Some(Msg::Fill { it, stage }) => {
                check_it(it)?;
                if stage.is_some_and(|k| k as usize >= stages.len()) {
                    return Err(Error::Transport(format!(
                        "decode asked for stage {stage:?} of {} (a protocol error)",
                        stages.len()
                    )));
                }
                let t = Instant::now();
                plan_for(rc, &mut plans, it)?;
                // Filled means in memory: decode READs it next. Every TP rank's pool.
                let mut kernel_seconds = 0.0;
                for (p, ep) in ranks.iter_mut().enumerate() {
                    sweep::fill_stage(rc, &mut ep.pool, p as u32, &plans[&it], &stages, stage.map(|k| k as usize), true)?;
                    kernel_seconds += ep.pool.take_kernel_seconds().fill;
                }
                let seconds = t.elapsed().as_secs_f64();
                me.fill_seconds += seconds;
                me.fills += 1;
                link.send(&Msg::Filled { it, stage, seconds, kernel_seconds })?;
            }
            Some(Msg::Write { it, stage, tag }) => {
                check_it(it)?;
                if rc.op != Op::Write || stage as usize >= stages.len() || tag.len() > 256 {
                    return Err(Error::Transport(format!("decode asked for a WRITE of stage {stage} (a protocol error)")));
                }
                plan_for(rc, &mut plans, it)?;
                let plan = &plans[&it];
                let per_link = sweep::stage_requests(rc, plan, &stages, stage as usize)?;
                if per_link.iter().all(|p| p.is_empty()) {
                    link.send(&Msg::Written { tag, bytes: 0, nanos: 0 })?;
                } else {
                    // One WRITE per link (prefill rank → decode rank), notified with the
                    // link's tag; decode hears of the stage once all are complete.
                    let d = crate::sys::deadline::Deadline::after(timeout);
                    let mut n = 0;
                    for (l, pairs) in per_link.iter().enumerate().filter(|(_, p)| !p.is_empty()) {
                        let (pr, dr) = plan.links[l];
                        // Prefill rank pr connected the decode ranks that read it, in rank order.
                        let peer = (0..dr).filter(|&x| tp.targets(x).contains(&pr)).count();
                        let t = sweep::link_tag(&tag, plan, l);
                        let posted = ranks[pr as usize].post_to(peer, Op::Write, pairs, &t, d).map_err(|e| attribute(link, e))?;
                        inflight.push((tag.clone(), pr as usize, posted));
                        n += 1;
                    }
                    writes.insert(tag.clone(), (n, 0u64, 0u64));
                    me.writes += 1;
                }
            }
            Some(Msg::Notify { tag }) => ranks[0].notify_peer(&tag)?,
            Some(Msg::Verified { it, gbps, .. }) if it == 0 || it > rc.iterations || !(gbps.is_finite() && gbps >= 0.0) => {
                return Err(Error::Transport(format!(
                    "{} reported iteration {it} of {} at {gbps} GB/s (a protocol error)",
                    link.who(),
                    rc.iterations
                )));
            }
            Some(Msg::Verified { it, slices, corrupt, gbps }) => {
                say(&format!(
                    "iteration {it}/{}: {slices} block slices verified on decode, {corrupt} corrupt, {gbps:.2} GB/s",
                    rc.iterations
                ));
            }
            Some(Msg::RegionOpen { plan, mut decode }) => {
                if region.is_some() {
                    return Err(Error::Transport(format!(
                        "{} opened region plan {plan} while another was open (a protocol error)",
                        link.who()
                    )));
                }
                let plans = match &region_plans {
                    Some(p) => p,
                    None => region_plans.insert(sweep::regions::plans(rc)?),
                };
                let Some(p) = plans.get(plan as usize) else {
                    return Err(Error::Transport(format!(
                        "{} asked for region plan {plan} of {} (a protocol error)",
                        link.who(),
                        plans.len()
                    )));
                };
                if let Some(l) = region_side.leases.and_then(|s| s.to_prefill.lock().unwrap_or_else(|p| p.into_inner()).take()) {
                    decode.lease = l;
                }
                let decode_agent = decode.agent.clone();
                // Each source on its rank's GPU.
                let sources = sweep::regions::prefill_sources(rc, p, region_side.memory, region_side.device_of, &decode)
                    .map_err(|e| attribute(link, e))?;
                let infos = sources.iter().map(|e| e.info()).collect::<Result<Vec<_>>>()?;
                if let Some(slots) = region_side.leases {
                    let mut lease = crate::xfer::nixl::WeakLease::default();
                    infos.iter().for_each(|i| lease.join(&i.lease));
                    *slots.to_decode.lock().unwrap_or_else(|p| p.into_inner()) = Some(lease);
                }
                region = Some(OpenRegion { index: plan, sources, decode_agent });
                link.send(&Msg::RegionOpened { plan, sources: infos })?;
            }
            Some(Msg::RegionWrite { plan, sources }) => {
                let open = region.as_ref().filter(|r| r.index == plan);
                let p = region_plans.as_ref().and_then(|ps| ps.get(plan as usize));
                let (Some(open), Some(p)) = (open, p) else {
                    return Err(Error::Transport(format!(
                        "{} asked for a WRITE of region plan {plan}, which is not open (a protocol error)",
                        link.who()
                    )));
                };
                let mut seen = std::collections::HashSet::new();
                if rc.op != Op::Write
                    || sources.iter().any(|(k, t)| *k as usize >= open.sources.len() || t.len() > 256 || !seen.insert(*k))
                {
                    return Err(Error::Transport(format!(
                        "{} asked for a WRITE of region plan {plan}'s sources {:?} (a protocol error)",
                        link.who(),
                        sources.iter().map(|(k, _)| *k).collect::<Vec<_>>()
                    )));
                }
                let faults = sweep::regions::plan_faults(rc, p);
                let d = crate::sys::deadline::Deadline::after(timeout);
                for (k, tag) in sources {
                    let pairs = sweep::regions::source_pairs(p, &faults, k as usize);
                    if pairs.is_empty() {
                        link.send(&Msg::Written { tag, bytes: 0, nanos: 0 })?;
                        continue;
                    }
                    let posted =
                        open.sources[k as usize].post_as_initiator(Op::Write, &pairs, &tag, d).map_err(|e| attribute(link, e))?;
                    region_inflight.push((tag, k as usize, posted));
                    me.writes += 1;
                }
            }
            Some(Msg::RegionClose { plan }) => {
                if region.as_ref().is_none_or(|r| r.index != plan) || !region_inflight.is_empty() {
                    return Err(Error::Transport(format!(
                        "{} closed region plan {plan}, which is not open or has WRITEs in flight (a protocol error)",
                        link.who()
                    )));
                }
                if let Some(p) = region_plans.as_ref().and_then(|ps| ps.get(plan as usize)) {
                    say(&format!(
                        "region {} ({}, TP rank {}): {} layer(s) x {} page(s) served from {} prefill rank(s)",
                        p.region.name,
                        p.region.kind,
                        p.rank,
                        p.region.layers.len(),
                        p.units,
                        p.sources.len()
                    ));
                }
                region = None;
                link.send(&Msg::RegionClosed { plan })?;
            }
            Some(m @ Msg::Done { .. }) => break done(link, m)?,
            Some(m) => {
                return Err(Error::Transport(format!("decode sent {} during the run (a protocol error)", m.name())));
            }
        }
        let mut i = 0;
        while i < region_inflight.len() {
            let (_, k, posted) = &mut region_inflight[i];
            let open = region.as_ref().expect("a region WRITE in flight keeps its plan open");
            if let Some(r) = open.sources[*k].poll(posted).map_err(|e| attribute(link, e))? {
                let (tag, _, _) = region_inflight.swap_remove(i);
                me.bytes_written += r.bytes;
                link.send(&Msg::Written { tag, bytes: r.bytes, nanos: r.elapsed.as_nanos() as u64 })?;
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < inflight.len() {
            let (_, pr, posted) = &mut inflight[i];
            if let Some(r) = ranks[*pr].poll(posted).map_err(|e| attribute(link, e))? {
                let (tag, _, _) = inflight.swap_remove(i);
                me.bytes_written += r.bytes;
                let w = writes.get_mut(&tag).expect("a posted stage is counted");
                *w = (w.0 - 1, w.1 + r.bytes, w.2.max(r.elapsed.as_nanos() as u64));
                if w.0 == 0 {
                    let (_, mut bytes, mut nanos) = writes.remove(&tag).expect("present");
                    if lie_written {
                        // Test-only: a prefill that claims a thousand times the bytes in 1 ns.
                        (bytes, nanos) = (bytes.saturating_mul(1000), 1);
                    }
                    link.send(&Msg::Written { tag, bytes, nanos })?;
                }
            } else {
                i += 1;
            }
        }
        // Only READs notify prefill (WRITE notifications go to decode): a WRITE sweep makes
        // no notification query, which would contend with its WRITEs' progress.
        if rc.op != Op::Read {
            continue;
        }
        // Decode cannot see when a notification reached this agent, only when it was
        // forwarded: the query's duration goes with it, so that decode judges a request whose
        // deadline passed while the query was in progress late, as it would its own query.
        let asked = Instant::now();
        let mut got = Vec::new();
        for ep in ranks.iter() {
            got.extend(ep.raw_notifications()?);
        }
        if let Some(open) = &region {
            for ep in &open.sources {
                got.extend(ep.raw_notifications()?.into_iter().filter(|(p, _)| *p == open.decode_agent));
            }
        }
        let query_ns = asked.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        let region_agent = region.as_ref().map(|r| r.decode_agent.as_str());
        let tags: Vec<String> = got
            .into_iter()
            .filter(|(p, _)| decode_agents.contains(p) || region_agent == Some(p.as_str()))
            .map(|(_, m)| m)
            .collect();
        if !tags.is_empty() {
            link.send(&Msg::Notified { tags, query_ns })?;
        }
    };
    Ok(out)
}

/// Most rows one session runs (`kvprobe ab` runs 8).
pub const MAX_ROWS: u32 = 64;

/// A scenario's requests, served until decode's [`Msg::Done`]: each row decode begins
/// ([`Msg::Begin`]) runs a prefill engine ([`PrefillEngine`]) step by step as decode asks
/// ([`Msg::Step`] → [`Msg::Stepped`]) until decode ends it ([`Msg::End`] → [`Msg::Ended`]).
/// `template`: the run's load (for `kvprobe ab`, the matrix's, whose rows pick their
/// scenario and unfenced mechanism); `place`: where the tier lives; `lane_side`: where a
/// hybrid model's state lanes go (`sweep::regions::scenario_lanes`: a pool and NIXL agent
/// each per row, connected to decode's agents of [`Msg::Begin`]); `idle_bound`: how long
/// decode may send nothing while alive.
#[allow(clippy::too_many_arguments)]
fn scenario_requests(
    rc: &RunConfig,
    template: &ScenarioConfig,
    link: &Link,
    ep: &mut Endpoint,
    place: &TierPlace,
    lane_side: &RegionSide<'_>,
    me: &mut PeerSide,
    idle_bound: Duration,
    say: &mut dyn FnMut(&str),
) -> Result<Ending> {
    let timeout = Duration::from_secs_f64(rc.timeout_secs);
    let next = |what: &str| {
        link.set_deadline(Some((
            Instant::now() + idle_bound,
            format!(
                "{} sent no request for {:.0} s (2 x --timeout, at least {} s) while alive: it stopped driving the run",
                link.who(),
                idle_bound.as_secs_f64(),
                IDLE_REQUESTS.as_secs()
            ),
        )));
        let m = link.expect(what, Ok::<Msg, &'static str>);
        link.set_deadline(None);
        m
    };
    let mut rows = 0u32;
    // A hybrid model's state lanes, as decode derives them from the same configuration.
    let lanes = sweep::regions::scenario_lanes(rc)?;
    loop {
        let (begin, decode_lanes) = match next("decode's next scenario run")? {
            Msg::Begin { begin, lanes } => (begin, lanes),
            m @ Msg::Done { .. } => return done(link, m),
            m => return Err(Error::Transport(format!("decode sent {} between scenario runs (a protocol error)", m.name()))),
        };
        let cfg = row_config(template, &begin, rows)?;
        rows += 1;
        let row = begin.row;
        // Rows as decode's table counts them (from 1); a single run is just its scenario.
        let what = match template.matrix {
            true => format!("row {}", row + 1),
            false => "scenario".to_string(),
        };
        say(&format!(
            "kvprobe serve: {what}: {}{}",
            cfg.scenario.name(),
            cfg.unfenced.iter().map(|m| format!(" with {m} unfenced")).collect::<String>()
        ));
        // Each state lane: prefill's pool and agent, loaded with decode's.
        if decode_lanes.len() != lanes.len() {
            return Err(Error::Transport(format!(
                "{} named {} NIXL agent(s) for the {} state lane(s) of this model (a protocol error)",
                link.who(),
                decode_lanes.len(),
                lanes.len()
            )));
        }
        let shared = lane_side.leases.filter(|_| !lanes.is_empty());
        let decode_lease = shared.and_then(|s| s.to_prefill.lock().unwrap_or_else(|p| p.into_inner()).take());
        let mut lane_eps = Vec::new();
        for (k, (lane, mut info)) in lanes.iter().zip(decode_lanes).enumerate() {
            if info.geometry.as_ref().is_some_and(|g| *g != lane.geometry) {
                return Err(Error::Transport(format!(
                    "{}'s NIXL agent {} announced a pool other than state lane {k}'s ({}) (a protocol error)",
                    link.who(),
                    crate::sys::text::escape_control(&info.agent),
                    lane.name
                )));
            }
            if let Some(l) = &decode_lease {
                info.lease = l.clone();
            }
            let run: String = begin.tag.chars().filter(char::is_ascii_alphanumeric).take(40).collect();
            let agent = format!("kvprobe-state{k}-prefill-{run}");
            let mut e = sweep::regions::lane_endpoint(rc, lane, lane_side.memory, (lane_side.device_of)(0), &agent, true)
                .map_err(|e| attribute(link, e))?;
            e.connect(info).map_err(|e| attribute(link, e))?;
            lane_eps.push(e);
        }
        let lane_infos = lane_eps.iter().map(|e| e.info()).collect::<Result<Vec<_>>>()?;
        if let Some(slots) = shared {
            let mut lease = crate::xfer::nixl::WeakLease::default();
            lane_infos.iter().for_each(|i| lease.join(&i.lease));
            *slots.to_decode.lock().unwrap_or_else(|p| p.into_inner()) = Some(lease);
        }
        let state = lanes.iter().cloned().zip(lane_eps).collect();
        let (mut engine, tier, tier_detail) =
            PrefillEngine::start(&cfg, rc.seed, ep, &begin.tag, timeout, place, state).map_err(|e| attribute(link, e))?;
        link.send(&Msg::Begun { row, tier, tier_detail, lanes: lane_infos })?;
        let mut step = 0u64;
        loop {
            match next("decode's next step")? {
                Msg::Step { row: r, step: k, input } if r == row && k == step + 1 => {
                    step = k;
                    let output = engine.step(input).map_err(|e| attribute(link, e))?;
                    link.send(&Msg::Stepped { row, step, output: Box::new(output) })?;
                }
                Msg::End { row: r, line } if r == row => {
                    let counters = engine.finish();
                    me.fill_seconds += counters.fill_seconds;
                    say(&format!("kvprobe serve: {what} ended: {line}"));
                    link.send(&Msg::Ended { row, counters })?;
                    break;
                }
                m @ Msg::Done { .. } => return done(link, m),
                m => {
                    return Err(Error::Transport(format!(
                        "decode sent {} during step {step} of row {row} (a protocol error)",
                        m.name()
                    )));
                }
            }
        }
    }
}

/// The configuration of scenario run `begin` (the `index`-th of the session): `template`'s
/// load with the row's scenario and unfenced mechanisms. A matrix (`kvprobe ab`) may run any
/// scenario with at most one mechanism unfenced (stacked only), up to [`MAX_ROWS`] rows in
/// order; a single run exactly its own, once. Errors: transport (exit 3) for any other
/// request (a protocol error).
fn row_config(template: &ScenarioConfig, begin: &crate::peer::steps::Begin, index: u32) -> Result<ScenarioConfig> {
    let bad = |why: &str| Err(Error::Transport(format!("decode asked for scenario run {} ({why}; a protocol error)", begin.row)));
    if begin.row != index {
        return bad(&format!("run {index} was next"));
    }
    if begin.tag.is_empty() || begin.tag.len() > 256 {
        return bad("a notification prefix of 1 to 256 bytes is required");
    }
    if template.matrix {
        if index >= MAX_ROWS {
            return bad(&format!("a matrix has at most {MAX_ROWS} rows"));
        }
        if begin.unfenced.len() > 1 || (!begin.unfenced.is_empty() && begin.scenario != Scenario::Stacked) {
            return bad("a matrix row leaves at most one mechanism of the stacked scenario unfenced");
        }
    } else if index > 0
        || begin.scenario != template.scenario
        || begin.unfenced != template.unfenced
        || begin.push != template.push
        || begin.staging != template.staging
    {
        return bad("not the configured scenario");
    }
    if (begin.push || begin.staging) && !begin.scenario.uses_nixl() || begin.push && begin.staging {
        return bad("push mode and host staging need a scenario that moves blocks over NIXL, and not both");
    }
    Ok(ScenarioConfig {
        scenario: begin.scenario,
        unfenced: begin.unfenced.clone(),
        push: begin.push,
        staging: begin.staging,
        matrix: false,
        ..template.clone()
    })
}
