//! kvprobe's peer protocol: how the decode side (`kvprobe run --peer`) drives the prefill
//! side (`kvprobe serve`) of a sweep on another host — and, over a Unix socket pair, how
//! `kvprobe run --decode-process` drives its child `kvprobe serve --fd N` on the same host
//! ([`client::start_child`]): one protocol and one code path for both.
//!
//! Length-prefixed frames (a 4-byte big-endian length, then a JSON [`Msg`]; framing by
//! `tokio_util`'s `LengthDelimitedCodec`, used synchronously) over one TCP connection, or over
//! any byte stream ([`Stream`]). The protocol is versioned ([`PROTOCOL`]); the conversation:
//!
//! | step | decode (`run --peer`, client) | prefill (`serve`) |
//! |---|---|---|
//! | 1 | | [`Msg::Challenge`]: kvprobe and protocol version, a fresh nonce |
//! | 2 | [`Msg::Hello`]: versions, run id, its own fresh nonce, decode's proof ([`proof`]) | checks version and proof ([`check_hello`]) before anything else |
//! | 3 | checks prefill's proof before it sends anything about itself | [`Msg::Welcome`] with prefill's proof, or [`Msg::Refused`] (reason; both sides exit 2; a refusal for now — busy, crowded, a source refused for some seconds — exit 3) |
//! | 4 | [`Msg::Config`]: the run's configuration, its hash ([`config_hash`]), decode's side (geometry, memory, GPU) and environment | re-hashes it, checks it against its own flags |
//! | 5 | | [`Msg::Accept`] (prefill's side and environment) or [`Msg::Refused`] naming the field |
//! | 6 | [`Msg::Connect`]: decode's NIXL agent metadata and region bases | loads them (`load_remote_md`) |
//! | 7 | | [`Msg::Connected`]: prefill's; decode loads them, then `check_remote_metadata` |
//! | 8 | per iteration: [`Msg::Fill`] (prefill refills a stage), [`Msg::Write`] (WRITE: prefill posts a stage), then [`Msg::Verified`] with the iteration's results | [`Msg::Filled`], [`Msg::Written`]; NIXL notifications prefill receives come back as [`Msg::Notified`] |
//! | 8b | a hybrid model's state and indexer regions, one (region, TP rank) plan at a time: [`Msg::RegionOpen`] (the plan's index in `sweep::regions::plans` of the configuration, decode's NIXL agent for it), then its READs, or [`Msg::RegionWrite`], then [`Msg::RegionClose`] | [`Msg::RegionOpened`]: a pool and NIXL agent per prefill rank the plan reads, filled with region rows; [`Msg::Written`], [`Msg::Notified`] as above; [`Msg::RegionClosed`] once its agents are gone |
//! | 8c | scenarios (`run --scenario`, `ab`): per run, [`Msg::Begin`] (with a hybrid model's state lanes: decode's NIXL agent of each, in the order of `sweep::regions::scenario_lanes`), then [`Msg::Step`] per engine step, then [`Msg::End`] | [`Msg::Begun`] (the tier; prefill's agent of each state lane, loaded with decode's), [`Msg::Stepped`], [`Msg::Ended`] |
//! | 9 | [`Msg::Done`] with the run's outcome | [`Msg::Bye`] with prefill's side of the report; both close |
//!
//! Either side sends [`Msg::Heartbeat`] every [`heartbeat_interval`] from its own thread, so
//! a side that is alive but busy is never silent; a side that hears nothing for the run's
//! `--timeout` treats its peer as stopped (exit 4). A closed connection is a dead peer (exit
//! 3). [`Msg::Interrupt`] carries Ctrl-C to the other side (both exit 130), [`Msg::Failed`] an
//! error with its exit code. NIXL notifications stay the completion signal of transfers, as in
//! vLLM's NixlConnector: the protocol carries only control.
//!
//! Authentication is mutual and bound to the session: each side proves the shared token with
//! HMAC-SHA256 (RFC 2104) over both nonces, the run id, the protocol number and its own role
//! ([`proof`]), so a proof is good for one session and one direction only (a side cannot be
//! answered with its own proof, nor a proof replayed into another session). Decode proves
//! first but says nothing about itself (configuration, environment, NIXL agent, host name)
//! until prefill has proven the token too. Every frame after the welcome carries an
//! HMAC-SHA256 tag under a key derived from the token and the session ([`session_key`]) over
//! its direction, its sequence number and its bytes: a relay between the two sides can pass
//! frames on unchanged, and nothing else (an altered, dropped, reordered or injected frame
//! ends the session as a protocol error, exit 3). Frames are not encrypted.
//!
//! Bounds: a frame before the token check is at most [`MAX_HELLO_FRAME`] bytes, a set-up frame
//! (configuration, NIXL metadata) at most [`MAX_FRAME`], a frame once the agents are connected
//! at most [`MAX_RUN_FRAME`] ([`Link::running`]); the handshake must finish within
//! [`HANDSHAKE_BOUND`]; frames wait in a queue of at most [`MAX_QUEUED`] (the reader stops
//! reading beyond it), so what a peer can make this side hold is bounded.

use crate::error::{Error, Result};
use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::codec::{Decoder, Encoder, LengthDelimitedCodec};

/// Environment variable holding the shared token when `--token` is not given (`serve`,
/// `run --peer`); a child `kvprobe serve --fd N` gets its token here, never on its command line.
pub const TOKEN_VAR: &str = "KVPROBE_TOKEN";

pub mod client;
pub mod gate;
pub mod steps;

/// The protocol version both sides must speak (in [`Msg::Challenge`] and [`Msg::Hello`]).
/// 2: the slices follow fingerprint version 2 (`kvprobe.fingerprint/2`), by head row.
/// 3: mutual authentication (HMAC-SHA256 proofs of both sides over both nonces) and a MAC on
/// every frame after the welcome.
pub const PROTOCOL: u32 = 3;

/// Shortest token `serve` and `run`/`ab --peer` take (characters): a shorter one falls to
/// guessing (the random default has 32 hex digits, 128 bits).
pub const MIN_TOKEN_CHARS: usize = 16;

/// Bytes of a nonce ([`Msg::Challenge`], [`Msg::Hello`]) and of a proof or frame tag
/// (HMAC-SHA256's output).
pub const NONCE_BYTES: usize = 32;

/// Bytes of the tag at the end of every frame after the welcome (HMAC-SHA256).
pub const TAG_BYTES: usize = 32;

/// Fewest distinct characters a token may have: a long token of one or a few repeated
/// characters (`aaaaaaaaaaaaaaaa`, `abababab…`) is among the first an offline guesser tries
/// against a proof it saw (a proof is an HMAC of the token over values it knows).
pub const MIN_TOKEN_DISTINCT: usize = 5;

/// Checks a shared token given by `source` (`--token`, or [`TOKEN_VAR`]): at least
/// [`MIN_TOKEN_CHARS`] characters, of at least [`MIN_TOKEN_DISTINCT`] distinct ones.
/// Errors: usage (exit 2) saying the rule.
pub fn check_token(token: &str, source: &str) -> Result<()> {
    let n = token.chars().count();
    let hint = format!("give a longer one, or let serve make a random one: give serve neither --token nor {TOKEN_VAR}");
    if n < MIN_TOKEN_CHARS {
        return Err(Error::Usage(format!(
            "{source}: the token has {n} characters; at least {MIN_TOKEN_CHARS} are needed, so that it cannot be guessed ({hint})"
        )));
    }
    let distinct = token.chars().collect::<std::collections::BTreeSet<char>>().len();
    if distinct < MIN_TOKEN_DISTINCT {
        return Err(Error::Usage(format!(
            "{source}: the token's {n} characters are only {distinct} distinct one(s); at least {MIN_TOKEN_DISTINCT} are needed, so that it cannot be guessed ({hint})"
        )));
    }
    Ok(())
}

/// Largest frame before the token check (bytes): a HELLO is a few hundred bytes.
pub const MAX_HELLO_FRAME: usize = 4096;

/// Largest frame after the token check (bytes): NIXL metadata is a few hundred KiB, a
/// report section a few MiB at most.
pub const MAX_FRAME: usize = 64 << 20;

/// How long the handshake (challenge to welcome) may take before the connection is dropped.
pub const HANDSHAKE_BOUND: Duration = Duration::from_secs(10);

/// Frames the reader thread holds before it stops reading (backpressure on the peer).
pub const MAX_QUEUED: usize = 256;

/// Largest frame once both NIXL agents are connected (bytes): per-iteration control is a few
/// hundred bytes, the goodbye (a side's report section) well under this.
pub const MAX_RUN_FRAME: usize = 4 << 20;

/// Most error-rate intervals a scenario's `done` carries to serve's report (about 100 bytes
/// each: well inside [`MAX_RUN_FRAME`]); a longer run's first ones are only in decode's report.
pub const MAX_DONE_INTERVALS: usize = 10_000;

/// One side of a node pair as it announces itself: the geometry of its pool (carried per side
/// so that unequal geometries can be allowed later), its memory and GPU.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Side {
    /// KV geometry of this side's pool.
    pub geometry: crate::core::geometry::Geometry,
    /// VRAM or DRAM.
    pub memory: crate::mem::pool::MemoryKind,
    /// GPU ordinal of the pool (VRAM; 0 for DRAM).
    pub device: usize,
    /// Host name of the side (as `gethostname` says).
    pub host: String,
}

/// A frame's message (JSON, tagged by `type`). See the module's table for the order.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Msg {
    /// serve → run, first: versions and the nonce the token proof covers (hex, 32 bytes).
    Challenge {
        /// kvprobe version.
        kvprobe: String,
        /// [`PROTOCOL`].
        protocol: u32,
        /// 32 random bytes, hex.
        nonce: String,
    },
    /// run → serve: versions, the run id, decode's nonce and decode's proof of the token.
    Hello {
        /// kvprobe version.
        kvprobe: String,
        /// [`PROTOCOL`].
        protocol: u32,
        /// The run's id (16 hex digits), in both sides' reports.
        run_id: String,
        /// Decode's nonce: [`NONCE_BYTES`] random bytes, hex (absent from a hello of protocol
        /// 2 and older, which is then refused by its version).
        #[serde(default)]
        nonce: String,
        /// [`proof`] with role [`Role::Decode`], hex.
        proof: String,
    },
    /// serve → run: decode's proof verified; prefill's own proof, which decode checks before
    /// it sends anything about itself.
    Welcome {
        /// The run id, echoed.
        run_id: String,
        /// [`proof`] with role [`Role::Prefill`], hex.
        #[serde(default)]
        proof: String,
    },
    /// Either way: the session is refused (version, token, configuration, busy); both sides
    /// exit with `exit` (2).
    Refused {
        /// Why, in words.
        reason: String,
        /// The configuration field that differs, when that is the reason (e.g.
        /// `geometry.block_size`).
        field: Option<String>,
        /// Exit code both sides use.
        exit: u8,
    },
    /// run → serve: the run's configuration (`RunConfig` as JSON) and its hash.
    Config {
        /// The configuration as the run resolved it.
        config: serde_json::Value,
        /// [`config_hash`] of `config`.
        hash: String,
        /// Decode's side.
        decode: Side,
        /// Decode's environment (GPUs, driver, NIXL, UCX).
        environment: Option<crate::env::envinfo::Environment>,
    },
    /// serve → run: configuration accepted; prefill's side.
    Accept {
        /// Prefill's side.
        prefill: Side,
        /// Prefill's environment.
        environment: Option<crate::env::envinfo::Environment>,
    },
    /// run → serve: decode's NIXL agent (TP rank 0's).
    Connect {
        /// Agent name, metadata and region bases.
        decode: crate::xfer::transport::PeerInfo,
        /// With `--decode-tp` > 1: the agents of decode's ranks 1.. (one per TP rank).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        decode_ranks: Vec<crate::xfer::transport::PeerInfo>,
    },
    /// serve → run: prefill's NIXL agent (TP rank 0's; it has loaded decode's metadata).
    Connected {
        /// Agent name, metadata and region bases.
        prefill: crate::xfer::transport::PeerInfo,
        /// With `--prefill-tp` > 1: the agents of prefill's ranks 1.. .
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        prefill_ranks: Vec<crate::xfer::transport::PeerInfo>,
    },
    /// run → serve: fill `stage` (all layers when `None`) with generation `it` and plant
    /// prefill's injected faults of iteration `it` there; answered by [`Msg::Filled`] once the
    /// fill has completed.
    Fill {
        /// Iteration (= generation), 1-based.
        it: u32,
        /// Pipeline stage, or every layer.
        stage: Option<u32>,
    },
    /// serve → run: the fill is complete.
    Filled {
        /// Iteration.
        it: u32,
        /// Stage.
        stage: Option<u32>,
        /// Seconds the fill took on prefill (host clock).
        seconds: f64,
        /// Seconds its fill kernels ran on the GPU (CUDA events; 0 on DRAM). Absent from an
        /// older kvprobe of the same protocol: 0.
        #[serde(default)]
        kernel_seconds: f64,
    },
    /// run → serve (WRITE sweeps): post stage `stage` of iteration `it` with notification `tag`.
    Write {
        /// Iteration.
        it: u32,
        /// Stage.
        stage: u32,
        /// Notification tag.
        tag: String,
    },
    /// serve → run: the WRITE `tag` completed at prefill (its initiator).
    Written {
        /// Notification tag.
        tag: String,
        /// Bytes moved.
        bytes: u64,
        /// Post to completion, nanoseconds.
        nanos: u64,
    },
    /// run → serve (test-only early-notification fault): send `tag` as a bare notification.
    Notify {
        /// Notification tag.
        tag: String,
    },
    /// serve → run: NIXL notifications prefill's agent received from decode (READ).
    Notified {
        /// Their messages.
        tags: Vec<String>,
        /// Nanoseconds the NIXL notification query that returned them took (prefill's clock):
        /// decode counts a request as late whose deadline passed while that query was in
        /// progress, as it does for its own queries. Absent from an older kvprobe of the same
        /// protocol: 0.
        #[serde(default)]
        query_ns: u64,
    },
    /// run → serve: decode verified iteration `it` (every stage): its results.
    Verified {
        /// Iteration.
        it: u32,
        /// Block slices verified.
        slices: u64,
        /// Block slices found corrupt (every class).
        corrupt: u64,
        /// Transfer rate of the iteration (GB/s = 1e9 B/s).
        gbps: f64,
    },
    /// run → serve (hybrid models, after the sweep): set up region plan `plan` (its index in
    /// `sweep::regions::plans` of the run's configuration, which both sides derive): a pool per
    /// prefill rank it reads, filled with region rows and the planted region faults, each with
    /// a NIXL agent that has loaded `decode`; answered by [`Msg::RegionOpened`]. One plan is
    /// open at a time.
    RegionOpen {
        /// The plan's index.
        plan: u32,
        /// Decode's NIXL agent of this plan's pool.
        decode: crate::xfer::transport::PeerInfo,
    },
    /// serve → run: plan `plan`'s prefill agents, in the plan's source order.
    RegionOpened {
        /// The plan's index.
        plan: u32,
        /// One agent per source (prefill TP rank read).
        sources: Vec<crate::xfer::transport::PeerInfo>,
    },
    /// run → serve (WRITE): post the region pages of each listed source (its index in the
    /// plan's sources, its notification tag) into decode's pool; each answered by
    /// [`Msg::Written`] with its tag. A source not listed is not written (a region left out).
    RegionWrite {
        /// The open plan's index.
        plan: u32,
        /// (source index, notification tag).
        sources: Vec<(u32, String)>,
    },
    /// run → serve: plan `plan` is over (its requests complete): prefill gives its pools and
    /// agents up and answers [`Msg::RegionClosed`].
    RegionClose {
        /// The plan's index.
        plan: u32,
    },
    /// serve → run: plan `plan`'s prefill agents and pools are gone.
    RegionClosed {
        /// The plan's index.
        plan: u32,
    },
    /// Either way: still alive.
    Heartbeat,
    /// Either way: SIGINT/SIGTERM on the sender; the receiver ends its run as interrupted.
    Interrupt {
        /// What the sender was doing.
        why: String,
    },
    /// Either way: the sender failed with `exit` (its error's code).
    Failed {
        /// Exit code.
        exit: u8,
        /// The error.
        message: String,
    },
    /// run → serve: the run ended with `exit` (and `error`); serve takes the same outcome.
    Done {
        /// Exit code of the run.
        exit: u8,
        /// The run's error, if any.
        error: Option<String>,
        /// Decode's report summary (iterations, corrupt slices, rate), for serve's summary.
        summary: Option<serde_json::Value>,
        /// `run --scenario`: decode's scenario section (requests, tier, races), for serve's
        /// report. Absent from a sweep, `ab`, or an older kvprobe of the same protocol.
        #[serde(default)]
        scenario: Option<serde_json::Value>,
        /// `ab`: the matrix's rows (`kvprobe.ab/1` `rows`), for serve's report and table.
        /// Absent otherwise, or from an older kvprobe of the same protocol.
        #[serde(default)]
        rows: Option<serde_json::Value>,
    },
    /// serve → run: prefill's side of the report.
    Bye {
        /// Prefill's environment, transport paths and timings.
        side: Box<crate::report::PeerSide>,
    },
    /// run → serve (scenarios): start scenario run `begin.row` (its prefill engine, its tier,
    /// the genesis fill of prefill's pool); answered by [`Msg::Begun`].
    Begin {
        /// What to start.
        begin: steps::Begin,
        /// A hybrid model's state lanes (`crate::scenario::state`, in the order of
        /// `sweep::regions::scenario_lanes` of the run's configuration, which both sides
        /// derive): decode's NIXL agent of each; empty for an attention-only model.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        lanes: Vec<crate::xfer::transport::PeerInfo>,
    },
    /// serve → run: the prefill engine of row `row` is ready.
    Begun {
        /// Row.
        row: u32,
        /// How decode reaches the tier (tier-only loads); `None` without a tier.
        tier: Option<steps::TierAccess>,
        /// The tier in words, for the report ("embedded", Mooncake's version and master).
        tier_detail: String,
        /// Prefill's NIXL agent of each state lane decode named in [`Msg::Begin`], in its
        /// order, each having loaded decode's.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        lanes: Vec<crate::xfer::transport::PeerInfo>,
    },
    /// run → serve: what decode did in its last step; prefill runs step `step` of row `row`
    /// and answers [`Msg::Stepped`].
    Step {
        /// Row.
        row: u32,
        /// The step prefill runs now (1, 2, ...).
        step: u64,
        /// What decode did.
        input: steps::StepIn,
    },
    /// serve → run: what prefill did in step `step` of row `row`.
    Stepped {
        /// Row.
        row: u32,
        /// Step.
        step: u64,
        /// What prefill did.
        output: Box<steps::StepOut>,
    },
    /// run → serve: row `row` is over (drained, or ended by decode's error): prefill tears its
    /// engine down (tier, master) and answers [`Msg::Ended`].
    End {
        /// Row.
        row: u32,
        /// Decode's one-line verdict of the row, for serve's output.
        line: String,
    },
    /// serve → run: row `row`'s prefill engine is gone; its final counts.
    Ended {
        /// Row.
        row: u32,
        /// Prefill's counts.
        counters: steps::PrefillCounters,
    },
}

impl Msg {
    /// The message's `type`, for errors.
    pub fn name(&self) -> &'static str {
        match self {
            Msg::Challenge { .. } => "challenge",
            Msg::Hello { .. } => "hello",
            Msg::Welcome { .. } => "welcome",
            Msg::Refused { .. } => "refused",
            Msg::Config { .. } => "config",
            Msg::Accept { .. } => "accept",
            Msg::Connect { .. } => "connect",
            Msg::Connected { .. } => "connected",
            Msg::Fill { .. } => "fill",
            Msg::Filled { .. } => "filled",
            Msg::Write { .. } => "write",
            Msg::Written { .. } => "written",
            Msg::Notify { .. } => "notify",
            Msg::Notified { .. } => "notified",
            Msg::Verified { .. } => "verified",
            Msg::RegionOpen { .. } => "region_open",
            Msg::RegionOpened { .. } => "region_opened",
            Msg::RegionWrite { .. } => "region_write",
            Msg::RegionClose { .. } => "region_close",
            Msg::RegionClosed { .. } => "region_closed",
            Msg::Heartbeat => "heartbeat",
            Msg::Interrupt { .. } => "interrupt",
            Msg::Failed { .. } => "failed",
            Msg::Done { .. } => "done",
            Msg::Bye { .. } => "bye",
            Msg::Begin { .. } => "begin",
            Msg::Begun { .. } => "begun",
            Msg::Step { .. } => "step",
            Msg::Stepped { .. } => "stepped",
            Msg::End { .. } => "end",
            Msg::Ended { .. } => "ended",
        }
    }
}

/// Shares of NIXL registrations handed between the two roles when both live in one process
/// (prefill on a thread): what a [`crate::xfer::transport::PeerInfo`] loses when it is
/// serialized. A request takes shares of the peer's registrations from it, so that neither
/// side frees a pool under a request of the other (the region pass's pools; the sweep's go by
/// `serve::Handoff`).
#[derive(Default)]
pub struct LeaseSlots {
    /// Decode's registrations, for prefill's agents.
    pub to_prefill: Mutex<Option<crate::xfer::nixl::WeakLease>>,
    /// Prefill's registrations, for decode's agents.
    pub to_decode: Mutex<Option<crate::xfer::nixl::WeakLease>>,
}

/// What decode tells prefill of its results as the run ends ([`Msg::Done`]), for serve's
/// summary and report: decode's summary, a scenario's section, `ab`'s rows (JSON of the
/// report's types).
#[derive(Clone, Debug, Default)]
pub struct Results {
    /// The report's `summary` (`ab`: the rows' totals).
    pub summary: Option<serde_json::Value>,
    /// `run --scenario`: the report's `scenario`.
    pub scenario: Option<serde_json::Value>,
    /// `ab`: the matrix's `rows`.
    pub rows: Option<serde_json::Value>,
}

/// The byte stream under a [`Link`]: a TCP connection (two hosts) or a Unix socket (a child
/// on a socket pair, an in-process peer).
pub enum Stream {
    /// TCP.
    Tcp(TcpStream),
    /// Unix domain socket.
    Unix(UnixStream),
}

impl Stream {
    fn try_clone(&self) -> std::io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }
    fn set_read_timeout(&self, d: Option<Duration>) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(d),
            Stream::Unix(s) => s.set_read_timeout(d),
        }
    }
    fn set_write_timeout(&self, d: Option<Duration>) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(d),
            Stream::Unix(s) => s.set_write_timeout(d),
        }
    }
    fn shutdown(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }
    /// This side's address of a TCP connection (the address the peer reached it on); `None`
    /// for a Unix socket.
    pub fn local_ip(&self) -> Option<std::net::IpAddr> {
        match self {
            Stream::Tcp(s) => s.local_addr().ok().map(|a| a.ip()),
            Stream::Unix(_) => None,
        }
    }

    /// The peer's address, in words.
    pub fn peer_label(&self) -> String {
        match self {
            Stream::Tcp(s) => s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into()),
            Stream::Unix(_) => "a local socket".into(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(b),
            Stream::Unix(s) => s.read(b),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(b),
            Stream::Unix(s) => s.write(b),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Unix(s) => s.flush(),
        }
    }
}

/// Reads frames off a stream (the codec's buffer kept between calls).
struct FrameReader {
    stream: Stream,
    codec: LengthDelimitedCodec,
    buf: BytesMut,
    /// The handshake's end: every read of a frame must be done by then (a peer that sends a
    /// byte at a time cannot stretch it); `None` once the link runs.
    until: Option<Instant>,
    /// Once authenticated: the peer's frame tags, checked on every frame.
    tags: Option<FrameTags>,
}

/// Why reading a frame stopped.
enum ReadEnd {
    /// The peer closed the connection (or it broke).
    Closed(String),
    /// The read timed out (no complete frame within the socket's timeout).
    TimedOut,
    /// The peer sent something that is not a frame of this protocol.
    Bad(String),
}

impl FrameReader {
    fn new(stream: Stream, max: usize) -> FrameReader {
        let codec = LengthDelimitedCodec::builder().length_field_length(4).max_frame_length(max).new_codec();
        FrameReader { stream, codec, buf: BytesMut::with_capacity(64 << 10), until: None, tags: None }
    }

    fn next(&mut self) -> std::result::Result<Msg, ReadEnd> {
        loop {
            match self.codec.decode(&mut self.buf) {
                Ok(Some(frame)) => {
                    let body: &[u8] = match &mut self.tags {
                        None => &frame,
                        Some(t) => {
                            let Some(cut) = frame.len().checked_sub(TAG_BYTES) else {
                                return Err(ReadEnd::Bad("a frame without its tag (not a frame of this session)".into()));
                            };
                            let (body, tag) = frame.split_at(cut);
                            if !t.open(body, tag) {
                                return Err(ReadEnd::Bad(
                                    "a frame whose tag does not verify (altered, replayed or injected on the way, or not from the authenticated peer)"
                                        .into(),
                                ));
                            }
                            body
                        }
                    };
                    // serde's error quotes the peer's bytes: escaped before it reaches a terminal.
                    return serde_json::from_slice::<Msg>(body).map_err(|e| {
                        ReadEnd::Bad(
                            crate::sys::text::escape_control(&format!(
                                "a frame that is not a message of protocol {PROTOCOL}: {e}"
                            ))
                            .into_owned(),
                        )
                    });
                }
                Ok(None) => {}
                Err(e) => return Err(ReadEnd::Bad(format!("a frame over the size bound: {e}"))),
            }
            if let Some(until) = self.until {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() || self.stream.set_read_timeout(Some(left)).is_err() {
                    return Err(ReadEnd::TimedOut);
                }
            }
            let mut chunk = [0u8; 64 << 10];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(ReadEnd::Closed("the peer closed the connection".into())),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    return Err(ReadEnd::TimedOut);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ReadEnd::Closed(format!("the connection broke: {e}"))),
            }
        }
    }
}

/// Writes one frame (serialized here). Errors: transport when the connection is gone, timeout
/// when the peer took nothing for the stream's write timeout.
fn write_frame(stream: &mut Stream, msg: &Msg) -> Result<()> {
    write_tagged(stream, msg, None)
}

/// [`write_frame`], the frame's tag appended when `tags` is given (after the welcome).
fn write_tagged(stream: &mut Stream, msg: &Msg, tags: Option<&mut FrameTags>) -> Result<()> {
    let mut body = serde_json::to_vec(msg).map_err(|e| Error::Io(format!("peer protocol: {e}")))?;
    if let Some(t) = tags {
        let tag = t.seal(&body);
        body.extend_from_slice(&tag);
    }
    let mut codec = LengthDelimitedCodec::builder().length_field_length(4).max_frame_length(MAX_FRAME + TAG_BYTES).new_codec();
    let mut out = BytesMut::with_capacity(body.len() + 4);
    codec
        .encode(Bytes::from(body), &mut out)
        .map_err(|e| Error::Usage(format!("peer protocol: a {} message over {MAX_FRAME} bytes: {e}", msg.name())))?;
    stream.write_all(&out).and_then(|_| stream.flush()).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            Error::Timeout(format!("the peer took no frame within the write bound: {e}"))
        }
        _ => Error::Transport(format!("the peer connection broke: {e}")),
    })
}

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// Who proves the token (in [`proof`]'s message, so one side's proof is never the other's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The client (`run --peer`, `ab --peer`, a `--decode-process` parent).
    Decode,
    /// The server (`serve`).
    Prefill,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Decode => b"decode",
            Role::Prefill => b"prefill",
        }
    }
}

/// One session's handshake values, which every proof and the session key cover.
#[derive(Clone, Debug)]
pub struct Session<'a> {
    /// Prefill's nonce ([`Msg::Challenge`]), [`NONCE_BYTES`] bytes.
    pub prefill_nonce: &'a [u8],
    /// Decode's nonce ([`Msg::Hello`]), [`NONCE_BYTES`] bytes.
    pub decode_nonce: &'a [u8],
    /// The run id ([`Msg::Hello`]).
    pub run_id: &'a str,
}

/// HMAC-SHA256 keyed by `key` over kvprobe's label, [`PROTOCOL`] and `parts`, each part
/// preceded by its length (4 bytes big-endian), so that no two different inputs share bytes.
fn mac(key: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    use hmac::{KeyInit, Mac};
    // HMAC takes a key of any length (RFC 2104 §2): this cannot fail.
    let mut m = <HmacSha256 as KeyInit>::new_from_slice(key).expect("HMAC takes keys of any length");
    for p in [b"kvprobe peer".as_slice(), &PROTOCOL.to_be_bytes()].into_iter().chain(parts.iter().copied()) {
        m.update(&(p.len() as u32).to_be_bytes());
        m.update(p);
    }
    m
}

fn session_parts<'a>(what: &'a [u8], s: &Session<'a>) -> [&'a [u8]; 4] {
    [what, s.prefill_nonce, s.decode_nonce, s.run_id.as_bytes()]
}

/// `role`'s proof that it knows `token` in session `s`: HMAC-SHA256 (RFC 2104) keyed by the
/// token over "kvprobe peer", [`PROTOCOL`], the role ("decode" or "prefill"), prefill's
/// nonce, decode's nonce and the run id (each length-prefixed), hex (64 digits).
pub fn proof(token: &str, role: Role, s: &Session) -> String {
    use hmac::Mac;
    hex(&mac(token.as_bytes(), &session_parts(role.label(), s)).finalize().into_bytes())
}

/// Whether `got` (hex) is `role`'s proof of `token` in session `s`, compared in constant time
/// (the MAC's `verify_slice`).
pub fn proof_holds(got: &str, token: &str, role: Role, s: &Session) -> bool {
    use hmac::Mac;
    let Some(got) = hex_decode(got) else { return false };
    mac(token.as_bytes(), &session_parts(role.label(), s)).verify_slice(&got).is_ok()
}

/// The key of session `s`'s frame tags: HMAC-SHA256 keyed by `token` over "kvprobe peer",
/// [`PROTOCOL`], "session key", both nonces and the run id (as in [`proof`]).
pub fn session_key(token: &str, s: &Session) -> [u8; 32] {
    use hmac::Mac;
    mac(token.as_bytes(), &session_parts(b"session key", s)).finalize().into_bytes().into()
}

/// The tags of one direction of a session's frames: HMAC-SHA256 keyed by the session key
/// ([`session_key`]) over "kvprobe peer", [`PROTOCOL`], the direction (who sends), the
/// frame's sequence number in that direction (from 0, 8 bytes big-endian) and its JSON
/// bytes; the tag ([`TAG_BYTES`]) follows the JSON in the frame.
#[derive(Clone)]
pub struct FrameTags {
    key: [u8; 32],
    from: Role,
    seq: u64,
}

impl FrameTags {
    /// Tags of frames sent by `from` under session key `key`, from sequence number 0.
    pub fn new(key: [u8; 32], from: Role) -> FrameTags {
        FrameTags { key, from, seq: 0 }
    }

    fn mac(&self, body: &[u8]) -> HmacSha256 {
        mac(&self.key, &[b"frame from", self.from.label(), &self.seq.to_be_bytes(), body])
    }

    /// The next frame's tag over `body` (and the sequence number moves on).
    pub fn seal(&mut self, body: &[u8]) -> [u8; TAG_BYTES] {
        use hmac::Mac;
        let t = self.mac(body).finalize().into_bytes().into();
        self.seq += 1;
        t
    }

    /// Whether `tag` is the next frame's tag over `body` (constant-time compare); the sequence
    /// number moves on only when it is.
    pub fn open(&mut self, body: &[u8], tag: &[u8]) -> bool {
        use hmac::Mac;
        let ok = self.mac(body).verify_slice(tag).is_ok();
        if ok {
            self.seq += 1;
        }
        ok
    }
}

/// Lowercase hex of `b`.
fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn hex_decode(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

/// `n` random bytes from the OS, hex (nonces, tokens, run ids). Errors: environment when
/// `/dev/urandom` cannot be read.
pub fn random_hex(n: usize) -> Result<String> {
    let mut b = vec![0u8; n];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| Error::Environment(format!("cannot read /dev/urandom: {e}")))?;
    Ok(hex(&b))
}

/// The configuration hash both sides compare: SHA-256 of `config`'s JSON (serde_json writes
/// a struct's fields in declaration order, so equal configurations give equal bytes), hex.
pub fn config_hash(config: &serde_json::Value) -> String {
    crate::core::fingerprint::digest(&serde_json::to_vec(config).unwrap_or_default())
}

/// Every field (dotted path) where `a` and `b` differ, with both values, in key order.
pub fn differences(a: &serde_json::Value, b: &serde_json::Value) -> Vec<(String, String, String)> {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter()
                .flat_map(|k| {
                    let (va, vb) = (x.get(k).unwrap_or(&Value::Null), y.get(k).unwrap_or(&Value::Null));
                    differences(va, vb)
                        .into_iter()
                        .map(move |(f, p, q)| (if f.is_empty() { k.clone() } else { format!("{k}.{f}") }, p, q))
                })
                .collect()
        }
        _ if a == b => Vec::new(),
        // -1 and -1.0 are one number (JSON does not say which it is).
        (Value::Number(x), Value::Number(y)) if x.as_f64() == y.as_f64() => Vec::new(),
        _ => vec![(String::new(), a.to_string(), b.to_string())],
    }
}

/// The first field (dotted path) where `a` and `b` differ, with both values; `None` if equal.
pub fn first_difference(a: &serde_json::Value, b: &serde_json::Value) -> Option<(String, String, String)> {
    differences(a, b).into_iter().next()
}

/// Checks a [`Msg::Hello`] against this side's version, the challenge's `nonce` (hex) and
/// `token` (decode's [`proof`], compared in constant time). Returns the run id and decode's
/// nonce (bytes). Errors: the reason to send back in [`Msg::Refused`] (peer text in it
/// escaped: [`crate::sys::text::escape_control`]).
pub fn check_hello(msg: &Msg, nonce: &str, token: &str) -> std::result::Result<(String, Vec<u8>), String> {
    let Msg::Hello { kvprobe, protocol, run_id, nonce: decode_nonce, proof: got } = msg else {
        return Err(format!("expected hello, got {}", msg.name()));
    };
    if *protocol != PROTOCOL {
        return Err(format!(
            "protocol version mismatch: this kvprobe {} speaks peer protocol {PROTOCOL}, the peer (kvprobe {}) speaks {protocol}: run the same kvprobe version on both hosts",
            env!("CARGO_PKG_VERSION"),
            crate::sys::text::escape_control(kvprobe)
        ));
    }
    let (Some(prefill_nonce), Some(decode_nonce)) = (nonce_bytes(nonce), nonce_bytes(decode_nonce)) else {
        return Err(format!("not a hello of protocol {PROTOCOL}: its nonce is not {NONCE_BYTES} bytes in hex"));
    };
    let s = Session { prefill_nonce: &prefill_nonce, decode_nonce: &decode_nonce, run_id };
    if !proof_holds(got, token, Role::Decode, &s) {
        return Err("wrong token (the token given to run --peer is not serve's)".into());
    }
    if run_id.is_empty() || run_id.len() > 64 || !run_id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
        return Err("a run id must be 1 to 64 letters, digits or dashes".into());
    }
    Ok((run_id.clone(), decode_nonce))
}

/// A nonce's bytes from its hex: `None` unless exactly [`NONCE_BYTES`] bytes.
fn nonce_bytes(hex: &str) -> Option<Vec<u8>> {
    hex_decode(hex).filter(|b| b.len() == NONCE_BYTES)
}

/// Escapes every string in `v` ([`crate::sys::text::escape_control`]): JSON a peer sent, before
/// any of it can reach a terminal (keys are left as they are: the types that read them know
/// their names).
pub fn escape_strings(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::String(s) => {
            if let std::borrow::Cow::Owned(e) = crate::sys::text::escape_control(s) {
                *s = e;
            }
        }
        Value::Array(a) => a.iter_mut().for_each(escape_strings),
        Value::Object(o) => o.values_mut().for_each(escape_strings),
        _ => {}
    }
}

/// `t` (something a peer sent: its side, environment, report section) with every string in
/// it escaped ([`escape_strings`]); `t` unchanged if it does not survive the trip through
/// JSON (it then holds no string that could).
pub fn escaped<T: Serialize + serde::de::DeserializeOwned>(t: T) -> T {
    let Ok(mut v) = serde_json::to_value(&t) else { return t };
    escape_strings(&mut v);
    serde_json::from_value(v).unwrap_or(t)
}

/// The error that stands for the run's end as the peer said it ([`Msg::Done`]): its exit
/// code's kind (130 interrupted, 4 timeout, 2 usage, 1 corrupt, else transport), with `who`
/// and its message; a clean or other normal end while this side failed is a transport error
/// naming it. The peer's message is escaped ([`crate::sys::text::escape_control`]).
pub fn ended_with(who: &str, exit: u8, error: Option<String>) -> Error {
    let m = crate::sys::text::escape_control(&error.unwrap_or_default()).into_owned();
    match exit {
        130 => Error::Interrupted(format!("{who} was interrupted: {m}")),
        4 => Error::Timeout(format!("{who}: {m}")),
        2 => Error::Usage(format!("{who}: {m}")),
        1 => Error::Corrupt(format!("{who} found corruption: {m}")),
        3 => Error::Transport(format!("{who} ended the run: {m}")),
        x => Error::Transport(format!("{who} ended the run (exit {x}) while this side still had a call in progress")),
    }
}

/// What the reader thread passes on.
enum Incoming {
    Msg(Box<Msg>),
    Gone(String),
    Bad(String),
}

/// An established connection to the peer: frames in through a reader thread, out under a
/// lock, heartbeats from their own thread. Dropping it stops the heartbeat and closes the
/// connection.
pub struct Link {
    out: Arc<Mutex<Out>>,
    rx: Mutex<Receiver<Incoming>>,
    /// Milliseconds since `epoch` when the peer was last heard (any frame).
    heard: Arc<AtomicU64>,
    epoch: Instant,
    stop: Arc<AtomicBool>,
    /// The silence bound in milliseconds ([`silence_bound`]), shared with the heartbeat thread.
    silence_ms: Arc<AtomicU64>,
    /// The largest frame the reader takes now (bytes), shared with the reader thread.
    max_frame: Arc<AtomicU64>,
    /// What the peer is called in errors ("the prefill peer at 10.0.0.2:7000").
    who: String,
    /// A failure seen already: every later call returns it again.
    failed: Mutex<Option<Error>>,
    /// A bound on [`Link::expect`]'s waits, whatever the heartbeats say ([`Link::set_deadline`]):
    /// when it passes, the error (a timeout) to return.
    deadline: Mutex<Option<(Instant, String)>>,
    /// Set by the reader thread once the peer ended the run or went away ([`Link::ended`]).
    ended: Arc<AtomicBool>,
}

/// The sending half of a [`Link`]: the stream and this side's frame tags.
struct Out {
    stream: Stream,
    tags: FrameTags,
}

impl Out {
    fn send(&mut self, msg: &Msg) -> Result<()> {
        write_tagged(&mut self.stream, msg, Some(&mut self.tags))
    }
}

/// How long a failed [`Link::send`] reads what the peer sent before it closed, for the reason
/// it gave.
pub const SEND_CAUSE_WAIT: Duration = Duration::from_millis(300);

/// Heartbeat interval for a silence bound of `silence`: a quarter of it, between 10 ms and
/// 1 s, so several beats fit in the bound.
pub fn heartbeat_interval(silence: Duration) -> Duration {
    (silence / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// Shortest silence bound: a run's `--timeout`, but at least this (a busy host can delay a
/// heartbeat thread by some milliseconds; a sub-second `--timeout` bounds transfers, not the
/// peer's liveness).
pub const MIN_SILENCE: Duration = Duration::from_secs(1);

/// How long a peer may say nothing before it counts as stopped, for a run whose `--timeout`
/// is `timeout`: `timeout`, at least [`MIN_SILENCE`].
pub fn silence_bound(timeout: Duration) -> Duration {
    timeout.max(MIN_SILENCE)
}

impl Link {
    /// Starts the reader and heartbeat threads on an authenticated `stream`. `reader` is the
    /// handshake's reader (its buffered bytes are kept); `silence` is how long the peer may say
    /// nothing (`--timeout`); `who` names the peer in errors; `me` is this side's role and
    /// `key` the session's key ([`session_key`]): every frame from here on is tagged.
    fn start(reader: FrameReader, silence: Duration, who: String, me: Role, key: [u8; 32]) -> Result<Link> {
        let silence = silence_bound(silence);
        let mut reader = reader;
        reader.until = None;
        let them = if me == Role::Decode { Role::Prefill } else { Role::Decode };
        reader.tags = Some(FrameTags::new(key, them));
        reader.codec.set_max_frame_length(MAX_FRAME + TAG_BYTES);
        let io = |e: std::io::Error| Error::Transport(format!("{who}: {e}"));
        reader.stream.set_read_timeout(None).map_err(io)?;
        let out = reader.stream.try_clone().map_err(io)?;
        // A peer that stops reading (SIGSTOP) must not block this side's writes for ever.
        out.set_write_timeout(Some(silence.max(Duration::from_millis(100)))).map_err(io)?;
        let out = Arc::new(Mutex::new(Out { stream: out, tags: FrameTags::new(key, me) }));
        let (tx, rx): (SyncSender<Incoming>, _) = sync_channel(MAX_QUEUED);
        let epoch = Instant::now();
        let heard = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let silence_ms = Arc::new(AtomicU64::new(silence.as_millis() as u64));
        let max_frame = Arc::new(AtomicU64::new(MAX_FRAME as u64));
        let ended = Arc::new(AtomicBool::new(false));
        {
            let max_frame = max_frame.clone();
            let heard = heard.clone();
            let ended = ended.clone();
            std::thread::spawn(move || {
                loop {
                    reader.codec.set_max_frame_length(max_frame.load(Ordering::Relaxed) as usize + TAG_BYTES);
                    let m = reader.next();
                    heard.store(epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
                    let (msg, end) = match m {
                        Ok(Msg::Heartbeat) => continue,
                        Ok(m) => {
                            if matches!(m, Msg::Done { .. } | Msg::Interrupt { .. } | Msg::Failed { .. }) {
                                ended.store(true, Ordering::SeqCst);
                            }
                            (Incoming::Msg(Box::new(m)), false)
                        }
                        Err(ReadEnd::TimedOut) => continue,
                        Err(ReadEnd::Closed(w)) => (Incoming::Gone(w), true),
                        Err(ReadEnd::Bad(w)) => (Incoming::Bad(w), true),
                    };
                    if end {
                        ended.store(true, Ordering::SeqCst);
                    }
                    if tx.send(msg).is_err() || end {
                        return;
                    }
                }
            });
        }
        {
            let (out, stop, ms) = (out.clone(), stop.clone(), silence_ms.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(heartbeat_interval(Duration::from_millis(ms.load(Ordering::Relaxed))));
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let Ok(mut s) = out.lock() else { return };
                    if s.send(&Msg::Heartbeat).is_err() {
                        return;
                    }
                }
            });
        }
        Ok(Link {
            out,
            rx: Mutex::new(rx),
            heard,
            epoch,
            stop,
            silence_ms,
            max_frame,
            who,
            failed: Mutex::new(None),
            deadline: Mutex::new(None),
            ended,
        })
    }

    /// Sets the silence bound to [`silence_bound`]`(timeout)` (serve, once the run's
    /// `--timeout` is known); heartbeats follow it.
    pub fn set_silence(&self, timeout: Duration) {
        self.silence_ms.store(silence_bound(timeout).as_millis() as u64, Ordering::Relaxed);
        let _ = self.out.lock().map(|s| s.stream.set_write_timeout(Some(silence_bound(timeout))));
    }

    /// Set-up is over (both agents connected): later frames are bounded by [`MAX_RUN_FRAME`].
    pub fn running(&self) {
        self.max_frame.store(MAX_RUN_FRAME as u64, Ordering::Relaxed);
    }

    /// The heartbeat interval now ([`heartbeat_interval`] of the silence bound).
    pub fn heartbeat(&self) -> Duration {
        heartbeat_interval(self.silence())
    }

    /// The silence bound now.
    pub fn silence(&self) -> Duration {
        Duration::from_millis(self.silence_ms.load(Ordering::Relaxed))
    }

    /// Bounds every later [`Link::expect`] by `at` (a live peer's heartbeats do not extend
    /// it): past it, `expect` fails with a timeout (exit 4) saying `why`. `None` lifts the
    /// bound. The parent of a `--decode-process` child bounds the child's start this way.
    pub fn set_deadline(&self, bound: Option<(Instant, String)>) {
        *self.deadline.lock().unwrap_or_else(|p| p.into_inner()) = bound;
    }

    /// Bounds the set-up waits that follow (acceptance, the other side's agent) by `timeout`,
    /// at least the set-up floor ([`crate::sys::deadline::SETUP_FLOOR`]), whatever the heartbeats
    /// say ([`Link::set_deadline`]).
    pub fn bound_setup(&self, timeout: Duration) {
        let bound = timeout.max(crate::sys::deadline::SETUP_FLOOR);
        self.set_deadline(Some((
            Instant::now() + bound,
            format!(
                "{} did not set up its side within {:.0} s (--timeout, at least 60 s for set-up)",
                self.who(),
                bound.as_secs_f64()
            ),
        )));
    }

    /// A flag the reader thread sets once the peer ended the run or went away (it sent `done`,
    /// `interrupt` or `failed`, or the connection closed): a long call of this side that
    /// waits on something else (a Mooncake worker, NIXL notifications) checks it and stops
    /// waiting, so that the pair ends together with the peer's outcome.
    pub fn ended(&self) -> Arc<AtomicBool> {
        self.ended.clone()
    }

    /// This side's address of the connection (what the peer reached it on): `None` for a
    /// Unix socket (a child or a thread of the same host).
    pub fn local_ip(&self) -> Option<std::net::IpAddr> {
        self.out.lock().unwrap_or_else(|p| p.into_inner()).stream.local_ip()
    }

    /// What the peer is called in errors.
    pub fn who(&self) -> &str {
        &self.who
    }

    /// Sends `msg`. Errors: transport when the connection is gone (or the peer stopped
    /// reading for longer than the silence bound) — unless the peer said why before it closed
    /// ([`Msg::Failed`], [`Msg::Interrupt`], [`Msg::Refused`], read within [`SEND_CAUSE_WAIT`]):
    /// then that error, so that a peer that failed on a timeout ends this side with exit 4
    /// too, whichever side wrote next.
    pub fn send(&self, msg: &Msg) -> Result<()> {
        let sent = {
            let mut s = self.out.lock().unwrap_or_else(|p| p.into_inner());
            s.send(msg)
        };
        let Err(e) = sent else { return Ok(()) };
        let broke = match e {
            // The write timed out: the peer stopped reading for the silence bound.
            Error::Timeout(_) => Error::Timeout(format!(
                "{} stopped reading: a frame could not be written within {:.1} s (stopped, or the link dropped)",
                self.who,
                self.silence().as_secs_f64()
            )),
            Error::Transport(m) => Error::Transport(format!("{} is gone: {m}", self.who)),
            e => return Err(e), // this side's own (a frame over the bound)
        };
        if let Some(pe) = self.failed.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Err(pe);
        }
        let until = Instant::now() + SEND_CAUSE_WAIT;
        let rx = self.rx.lock().unwrap_or_else(|p| p.into_inner());
        // Frames arrive in order: the peer's last word comes before its connection's end.
        while let Ok(Incoming::Msg(m)) = rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
            if let Some(pe) = self.error_of(&m) {
                return Err(self.fail(pe));
            }
            if let Msg::Done { exit, error, .. } = *m {
                return Err(self.fail(ended_with(&self.who, exit, error)));
            }
        }
        Err(self.fail(broke))
    }

    fn fail(&self, e: Error) -> Error {
        *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.clone());
        e
    }

    /// The error a message from the peer means, if it is one ([`Msg::Failed`],
    /// [`Msg::Interrupt`], [`Msg::Refused`]), the peer's words escaped
    /// ([`crate::sys::text::escape_control`]).
    fn error_of(&self, m: &Msg) -> Option<Error> {
        use crate::sys::text::escape_control as esc;
        match m {
            Msg::Failed { exit, message } => Some({
                let message = esc(message);
                match exit {
                    2 => Error::Environment(format!("{}: {message}", self.who)),
                    4 => Error::Timeout(format!("{}: {message}", self.who)),
                    130 => Error::Interrupted(format!("{} was interrupted: {message}", self.who)),
                    _ => Error::Transport(format!("{} failed: {message}", self.who)),
                }
            }),
            Msg::Interrupt { why } => Some(Error::Interrupted(format!("{} was interrupted ({})", self.who, esc(why)))),
            Msg::Refused { reason, .. } => Some(Error::Usage(format!("{} refused: {}", self.who, esc(reason)))),
            _ => None,
        }
    }

    /// The next message within `wait` (`Ok(None)` if none came). Errors: the peer closed the
    /// connection or sent garbage (transport, exit 3), said nothing for the silence bound
    /// (timeout, exit 4), failed, refused or was interrupted (its error's kind).
    pub fn recv(&self, wait: Duration) -> Result<Option<Msg>> {
        if let Some(e) = self.failed.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Err(e);
        }
        let got = {
            let rx = self.rx.lock().unwrap_or_else(|p| p.into_inner());
            if wait.is_zero() {
                match rx.try_recv() {
                    Ok(m) => Some(m),
                    Err(TryRecvError::Empty) => None,
                    Err(TryRecvError::Disconnected) => Some(Incoming::Gone("the connection's reader ended".into())),
                }
            } else {
                match rx.recv_timeout(wait) {
                    Ok(m) => Some(m),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => Some(Incoming::Gone("the connection's reader ended".into())),
                }
            }
        };
        match got {
            Some(Incoming::Msg(m)) => match self.error_of(&m) {
                Some(e) => Err(self.fail(e)),
                None => Ok(Some(*m)),
            },
            Some(Incoming::Gone(w)) => Err(self.fail(Error::Transport(format!("{} is gone: {w}", self.who)))),
            Some(Incoming::Bad(w)) => Err(self.fail(Error::Transport(format!("{} sent {w}", self.who)))),
            None => {
                let quiet = self.quiet_for();
                let silence = self.silence();
                if quiet > silence {
                    return Err(self.fail(Error::Timeout(format!(
                        "{} has been silent for {:.1} s (no heartbeat within --timeout {:.3} s: stopped, or the link dropped)",
                        self.who,
                        quiet.as_secs_f64(),
                        silence.as_secs_f64()
                    ))));
                }
                Ok(None)
            }
        }
    }

    /// How long since the peer was last heard.
    pub fn quiet_for(&self) -> Duration {
        self.epoch.elapsed().saturating_sub(Duration::from_millis(self.heard.load(Ordering::Relaxed)))
    }

    /// Waits for the next message and hands it to `pick`, which returns what it wants of it
    /// or the message's name (a protocol error), up to the silence bound between messages; `what` names the wait in errors. A local SIGINT/SIGTERM ends
    /// the wait as interrupted.
    pub fn expect<T>(&self, what: &str, mut pick: impl FnMut(Msg) -> std::result::Result<T, &'static str>) -> Result<T> {
        loop {
            if crate::sys::interrupt::requested() {
                return Err(Error::Interrupted(format!("while waiting for {what} from {}", self.who)));
            }
            let bound = self.deadline.lock().unwrap_or_else(|p| p.into_inner()).clone();
            if let Some((at, why)) = bound
                && Instant::now() >= at
            {
                return Err(self.fail(Error::Timeout(format!("{why} (while waiting for {what})"))));
            }
            if let Some(m) = self.recv(Duration::from_millis(20))? {
                match pick(m) {
                    Ok(v) => return Ok(v),
                    Err(name) => {
                        return Err(self.fail(Error::Transport(format!(
                            "{} sent {name} while {what} was awaited (a protocol error)",
                            self.who
                        ))));
                    }
                }
            }
        }
    }

    /// Stops heartbeats and closes the connection (the peer sees it closed).
    pub fn close(&self) {
        self.stop.store(true, Ordering::Relaxed);
        self.out.lock().unwrap_or_else(|p| p.into_inner()).stream.shutdown();
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // A link given up because this side was interrupted (set-up included) tells the
        // peer, so that both sides end as interrupted (best effort: after a goodbye the
        // connection is already closed and this goes nowhere).
        if crate::sys::interrupt::requested() {
            let _ = self.send(&Msg::Interrupt { why: "interrupted by a signal".into() });
        }
        self.close();
    }
}

/// The client side of the handshake (`run --peer`): reads the challenge, sends the hello
/// (decode's proof over both nonces), waits for the welcome and checks prefill's proof in it
/// before anything about this side is sent. `silence` is the run's `--timeout`. Errors:
/// transport (the peer is not a kvprobe serve, closed, or could not prove the token: exit 3),
/// usage (refused: version or token, exit 2), timeout (no answer within [`HANDSHAKE_BOUND`]).
pub fn client(stream: Stream, token: &str, run_id: &str, silence: Duration, who: String) -> Result<Link> {
    client_within(stream, token, run_id, silence, who, HANDSHAKE_BOUND)
}

/// [`client`] with each handshake read bounded by `bound` instead of [`HANDSHAKE_BOUND`]
/// (`run --decode-process`: the child's challenge comes once it has started and loaded NIXL,
/// within the child's start bound).
pub fn client_within(stream: Stream, token: &str, run_id: &str, silence: Duration, who: String, bound: Duration) -> Result<Link> {
    use crate::sys::text::escape_control as esc;
    let io = |e: std::io::Error| Error::Transport(format!("{who}: {e}"));
    stream.set_read_timeout(Some(bound)).map_err(io)?;
    stream.set_write_timeout(Some(bound)).map_err(io)?;
    let mut w = stream.try_clone().map_err(io)?;
    let mut r = FrameReader::new(stream, MAX_HELLO_FRAME);
    r.until = Some(Instant::now() + bound); // the whole handshake, not each read
    let next = |r: &mut FrameReader| -> Result<Msg> {
        r.next().map_err(|e| match e {
            ReadEnd::Closed(w2) => Error::Transport(format!("{who}: {w2} during the handshake")),
            ReadEnd::TimedOut => Error::Timeout(format!("{who}: no answer within {} s", bound.as_secs_f64())),
            ReadEnd::Bad(w2) => Error::Transport(format!("{who} is not a kvprobe serve of protocol {PROTOCOL}: it sent {w2}")),
        })
    };
    let prefill_nonce = match next(&mut r)? {
        Msg::Challenge { nonce, protocol, kvprobe } => {
            if protocol != PROTOCOL {
                let reason = format!(
                    "protocol version mismatch: this kvprobe {} speaks peer protocol {PROTOCOL}, {who} (kvprobe {}) speaks {protocol}: run the same kvprobe version on both hosts",
                    env!("CARGO_PKG_VERSION"),
                    esc(&kvprobe)
                );
                let _ = write_frame(&mut w, &Msg::Refused { reason: reason.clone(), field: None, exit: 2 });
                return Err(Error::Usage(reason));
            }
            nonce_bytes(&nonce).ok_or_else(|| {
                Error::Transport(format!(
                    "{who} is not a kvprobe serve of protocol {PROTOCOL}: its challenge's nonce is not {NONCE_BYTES} bytes in hex"
                ))
            })?
        }
        // A refusal for now (busy, crowded, a source refused for some seconds) is exit 3 and
        // says so; any other (version) is exit 2.
        Msg::Refused { reason, exit, .. } if exit == TRANSIENT_REFUSAL_EXIT => {
            return Err(Error::Transport(format!("{who} refused for now: {} (try again later)", esc(&reason))));
        }
        Msg::Refused { reason, .. } => return Err(Error::Usage(format!("{who} refused: {}", esc(&reason)))),
        m => return Err(Error::Transport(format!("{who} sent {} instead of a challenge", m.name()))),
    };
    let decode_nonce = hex_decode(&random_hex(NONCE_BYTES)?).unwrap_or_default();
    let session = Session { prefill_nonce: &prefill_nonce, decode_nonce: &decode_nonce, run_id };
    write_frame(
        &mut w,
        &Msg::Hello {
            kvprobe: env!("CARGO_PKG_VERSION").into(),
            protocol: PROTOCOL,
            run_id: run_id.into(),
            nonce: hex(&decode_nonce),
            proof: proof(token, Role::Decode, &session),
        },
    )?;
    match next(&mut r)? {
        Msg::Welcome { run_id: echoed, proof: got } => {
            if echoed != run_id || !proof_holds(&got, token, Role::Prefill, &session) {
                let reason = "serve did not prove the token".to_string();
                let _ = write_frame(&mut w, &Msg::Refused { reason, field: None, exit: 3 });
                r.stream.shutdown();
                return Err(Error::Transport(format!(
                    "{who} did not prove that it knows the token (its welcome carries no valid proof): it is not the kvprobe serve that was given this token (another process at that address, or a relay); nothing about this run was sent to it"
                )));
            }
            Link::start(r, silence, who, Role::Decode, session_key(token, &session))
        }
        Msg::Refused { reason, .. } => Err(Error::Usage(format!("{who} refused the run: {}", esc(&reason)))),
        m => Err(Error::Transport(format!("{who} sent {} instead of a welcome", m.name()))),
    }
}

/// What the server side's handshake ended with.
pub enum Accepted {
    /// Authenticated: the link and the run id.
    Link(Link, String),
    /// Refused (reason sent to the client): version, token, a malformed hello, or the gate's
    /// reason ([`server_gated`]).
    Refused(String),
}

/// The server side of the handshake (`serve`): sends the challenge, checks the hello
/// ([`check_hello`]) — the token before anything else — and answers welcome (with prefill's
/// own proof) or refused. `silence` is the heartbeat bound for the session once
/// authenticated. Errors: transport when the client vanished or sent no hello within
/// [`HANDSHAKE_BOUND`].
pub fn server(stream: Stream, token: &str, silence: Duration) -> Result<Accepted> {
    server_gated(stream, token, silence, &|_| Ok(()))
}

/// [`server`] with a gate: `gate(false)` is called when the hello fails (not a hello, wrong
/// version or token) before the refusal is sent, `gate(true)` once decode's proof holds and
/// before the welcome; an `Err(reason)` from it refuses the session with that reason (serve:
/// busy with another client).
pub fn server_gated(
    stream: Stream,
    token: &str,
    silence: Duration,
    gate: &dyn Fn(bool) -> std::result::Result<(), String>,
) -> Result<Accepted> {
    let who = format!("the decode peer at {}", stream.peer_label());
    let io = |e: std::io::Error| Error::Transport(format!("{who}: {e}"));
    stream.set_read_timeout(Some(HANDSHAKE_BOUND)).map_err(io)?;
    stream.set_write_timeout(Some(HANDSHAKE_BOUND)).map_err(io)?;
    let mut w = stream.try_clone().map_err(io)?;
    let nonce = random_hex(NONCE_BYTES)?;
    write_frame(&mut w, &Msg::Challenge { kvprobe: env!("CARGO_PKG_VERSION").into(), protocol: PROTOCOL, nonce: nonce.clone() })?;
    let mut r = FrameReader::new(stream, MAX_HELLO_FRAME);
    r.until = Some(Instant::now() + HANDSHAKE_BOUND); // the whole hello, not each read
    let refuse = |w: &mut Stream, reason: String| {
        let _ = gate(false);
        let _ = write_frame(w, &Msg::Refused { reason: reason.clone(), field: None, exit: 2 });
        Ok(Accepted::Refused(reason))
    };
    let hello = match r.next() {
        Ok(m) => m,
        Err(ReadEnd::Closed(w2)) => return Err(Error::Transport(format!("{who}: {w2} during the handshake"))),
        Err(ReadEnd::TimedOut) => {
            return Err(Error::Timeout(format!("{who} sent no hello within {} s", HANDSHAKE_BOUND.as_secs())));
        }
        Err(ReadEnd::Bad(w2)) => return refuse(&mut w, format!("not a kvprobe hello: {w2}")),
    };
    if let Msg::Refused { reason, .. } = &hello {
        return Ok(Accepted::Refused(format!("the client refused: {}", crate::sys::text::escape_control(reason))));
    }
    match check_hello(&hello, &nonce, token) {
        Ok((run_id, decode_nonce)) => {
            if let Err(reason) = gate(true) {
                let _ = write_frame(&mut w, &Msg::Refused { reason: reason.clone(), field: None, exit: 2 });
                return Ok(Accepted::Refused(reason));
            }
            let prefill_nonce = nonce_bytes(&nonce).unwrap_or_default();
            let session = Session { prefill_nonce: &prefill_nonce, decode_nonce: &decode_nonce, run_id: &run_id };
            write_frame(&mut w, &Msg::Welcome { run_id: run_id.clone(), proof: proof(token, Role::Prefill, &session) })?;
            let key = session_key(token, &session);
            Ok(Accepted::Link(Link::start(r, silence, who, Role::Prefill, key)?, run_id))
        }
        Err(reason) => refuse(&mut w, reason),
    }
}

/// The exit code of a refusal that holds only for now (serve busy with another client, too
/// many handshakes in progress, a source refused for some seconds): a transport error (3),
/// not a configuration error (2) — the same run can succeed when tried again.
pub const TRANSIENT_REFUSAL_EXIT: u8 = 3;

/// Refuses a connection without a session, for now (serve is busy with another client, has
/// too many handshakes in progress, or refuses the source for some seconds): sends
/// [`Msg::Refused`] with [`TRANSIENT_REFUSAL_EXIT`] and closes.
pub fn refuse_busy(stream: Stream, reason: &str) {
    let mut s = stream;
    let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
    let _ = write_frame(&mut s, &Msg::Refused { reason: reason.into(), field: None, exit: TRANSIENT_REFUSAL_EXIT });
    s.shutdown();
}

/// This host's name ([`crate::env::envinfo::hostname`]), or "?".
pub fn host_name() -> String {
    Some(crate::env::envinfo::hostname()).filter(|h| !h.is_empty()).unwrap_or_else(|| "?".into())
}
