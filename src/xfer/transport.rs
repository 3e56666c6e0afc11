//! The prefill and decode roles and the NIXL transfer between them.
//!
//! Each role ([`Endpoint`]) owns one NIXL agent and one [`KvPool`], registers the pool's
//! per-layer regions, and learns about its peer only through a [`PeerInfo`] — the NIXL
//! metadata blob plus the region base addresses, as vLLM's NixlConnector exchanges
//! `NixlAgentMetadata` — and through NIXL notifications. Nothing else passes between them:
//! `run` holds both in one process, or one here and the other in `kvprobe serve` (a child of
//! `run --decode-process`, or another host with `run --peer`).
//!
//! Descriptors follow vLLM's NixlConnector: one per (layer, K/V, block) block slice.
//! `--op read` (default): decode pulls from prefill and notifies it (vLLM's flow);
//! `--op write`: prefill pushes and notifies decode.
//!
//! Requests are made as vLLM's NixlConnector makes them (`--xfer-req prepared`, the
//! default; vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py): once after
//! [`Endpoint::connect`], each role prepares one NIXL descriptor list over every block slice
//! of its own pool (`register_local_xfer_handler`: `prep_xfer_dlist("NIXL_INIT_AGENT", ...)`)
//! and one over every slice of the peer's (`add_remote_agent`:
//! `prep_xfer_dlist(remote_agent, ...)`); a request is then `makeXferReq` from slice indices
//! on both sides (`_read_blocks` with `_get_block_descs_ids`, `make_prepped_xfer`). A
//! slice's index is its global slice index, [`crate::core::geometry::Geometry::global_slice`]
//! (layer-major, then the slice's place in its layer region): for NHD and MLA the same index
//! as vLLM's `region * num_blocks + block`; for HND memory order, where vLLM splits each
//! layer into virtual K and V regions for heterogeneous tensor parallelism (kvprobe has
//! none), so that a merged run's slices keep consecutive indices. `--xfer-req create`
//! builds a fresh descriptor list per request and calls `createXferReq`, as kvprobe did
//! before.
//!
//! Pairs that are not exactly one slice:
//! - a run of `--descriptor-blocks` slices (longer than one slice, contiguous on both
//!   sides) is expanded to its slices' consecutive indices. NIXL's `makeXferReq` merges
//!   consecutive indices of contiguous memory back into one descriptor
//!   (src/core/nixl_agent.cpp), so the request moves the run as one descriptor, as
//!   `createXferReq` does, from the same two prepared lists;
//! - between unequal sides (block sizes, TP head splits) a link's descriptors move pieces
//!   of slices ([`Cuts`], [`crate::core::pairing::Sides::cuts`]): that link's lists are prepared
//!   in those pieces, as vLLM prepares a decode rank's part of each remote block
//!   (`add_remote_agent`: `rank_offset`, its own `block_len`) and a decode block of
//!   `block_size_ratio` remote blocks in pieces (`src_xfer_handles_by_block_size`); a
//!   pair is then the indices of the pieces it covers on each side ([`indices`]);
//! - a torn pair (an injected fault moving less than its descriptor) or a planted offset
//!   cannot be named by any index: that request is built with `createXferReq` instead,
//!   and a trace line (`KVPROBE_TRACE=1`) says so.

use crate::core::geometry::{Geometry, SliceCoord};
use crate::error::Result;
use crate::mem::pool::{KvPool, MemoryKind};
use crate::sys::deadline::Deadline;
use crate::xfer::nixl::{Agent, Descs, Lease, Posted, PreparedList, Region, Registered, WeakLease, XferResult};
use nixl_sys::{MemType, XferOp};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Direction of the NIXL transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// Decode READs from prefill (vLLM NixlConnector's flow).
    Read,
    /// Prefill WRITEs into decode.
    Write,
}

/// How a NIXL request is made (`--xfer-req`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum XferReq {
    /// From indices into descriptor lists prepared once per side (`prepXferDlist` +
    /// `makeXferReq`), as vLLM's NixlConnector.
    #[default]
    Prepared,
    /// From a descriptor list built for each request (`createXferReq`).
    Create,
}

impl XferReq {
    /// The flag's value: "prepared" or "create".
    pub fn name(self) -> &'static str {
        match self {
            XferReq::Prepared => "prepared",
            XferReq::Create => "create",
        }
    }

    /// What a report written before `--xfer-req` existed did: [`XferReq::Create`] (every
    /// request from a descriptor list built for it). For `#[serde(default = ...)]`.
    pub fn before_the_flag() -> XferReq {
        XferReq::Create
    }
}

/// How a role's NIXL agent is set up and makes its requests.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportOptions {
    /// How requests are made (`--xfer-req`).
    #[serde(default)]
    pub xfer_req: XferReq,
    /// Parameters set over the backend plugin's defaults when it is created
    /// (`--backend-param KEY=VALUE`).
    #[serde(default)]
    pub backend_params: BTreeMap<String, String>,
}

/// The most block slices a pool may have for `--xfer-req prepared`: NIXL's `makeXferReq`
/// takes 32-bit (`int`) indices.
pub const MAX_PREPARED_SLICES: u64 = i32::MAX as u64;

/// What one role tells the other: its agent, NIXL metadata and region bases.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerInfo {
    /// NIXL agent name.
    pub agent: String,
    /// NIXL metadata blob (`getLocalMD`).
    pub metadata: Vec<u8>,
    /// Base address of each layer's registered region.
    pub region_bases: Vec<u64>,
    /// Bytes of each layer's region (`Geometry::region_bytes`); 0 from a sender that did not
    /// say (then it is not checked).
    #[serde(default)]
    pub region_len: u64,
    /// VRAM or DRAM.
    pub memory: MemoryKind,
    /// GPU ordinal (0 for DRAM).
    pub device_id: u64,
    /// The geometry of the role's pool, as vLLM's `NixlAgentMetadata` carries `block_lens`,
    /// `block_size` and `kv_cache_layout`: the peer builds its descriptors of this pool from
    /// it. Absent from a sender that did not say (then the receiver's own).
    #[serde(default)]
    pub geometry: Option<Geometry>,
    /// The role's registrations when it lives in this process (empty once serialized): a
    /// request takes shares of them ([`Lease`]) so the peer's pool outlives it too.
    #[serde(skip)]
    pub lease: WeakLease,
    /// Prefill: the embedded KV tier's arena, registered with its agent as DRAM (start
    /// address, bytes), when a scenario's tier-only loads READ it over NIXL
    /// ([`Endpoint::register_tier`]). Absent from a sender that has none.
    #[serde(default)]
    pub tier_region: Option<(u64, u64)>,
}

/// One descriptor to move: `len` bytes from `src_off` of prefill slice `src` to `dst_off`
/// of decode slice `dst` (offsets are 0 between equal sides; a run of
/// `--descriptor-blocks` slices may span the next contiguous slices of one layer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pair {
    /// Prefill-side slice.
    pub src: SliceCoord,
    /// Decode-side slice.
    pub dst: SliceCoord,
    /// Bytes to move (the slice size, or less for an injected tear or a chunk of a slice
    /// between unequal sides, [`crate::core::pairing`]).
    pub len: u64,
    /// Byte offset in the prefill slice.
    pub src_off: u64,
    /// Byte offset in the decode slice.
    pub dst_off: u64,
}

impl Pair {
    /// `len` bytes from the start of `src` to the start of `dst`.
    pub fn slice(src: SliceCoord, dst: SliceCoord, len: u64) -> Pair {
        Pair { src, dst, len, src_off: 0, dst_off: 0 }
    }
}

/// How one link's descriptors cut every block slice of each side: (byte offset in the slice,
/// bytes) ranges, sorted and disjoint, the same for every slice of the pool; empty = the
/// whole slice. Between equal sides both are whole. Between unequal sides (block sizes, TP
/// head splits: [`crate::core::pairing::Sides::cuts`]) they are the pieces a descriptor of that
/// link moves, as vLLM's NixlConnector prepares them: a decode TP rank reading part of a
/// prefill rank's heads prepares the remote blocks at its `rank_offset` with its own
/// `block_len` (`add_remote_agent`), a decode block of `block_size_ratio` prefill blocks is
/// prepared in that many pieces (`src_xfer_handles_by_block_size`), a decode rank reading
/// several prefill ranks prepares each one's part of its blocks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cuts {
    /// This role's slices.
    pub own: Vec<(u64, u64)>,
    /// The peer's slices.
    pub peer: Vec<(u64, u64)>,
}

impl Cuts {
    /// Whole slices on both sides (equal sides).
    pub fn whole() -> Cuts {
        Cuts::default()
    }

    /// How link (prefill rank `p`, decode rank `d`)'s descriptors cut block slices, seen from
    /// prefill (own = prefill's, peer = decode's; [`crate::core::pairing::Sides::cuts`]); whole
    /// slices when the sides cannot be prepared in pieces (requests are then created per
    /// request).
    pub fn of_link(sides: &crate::core::pairing::Sides, p: u32, d: u32) -> Cuts {
        match sides.cuts(p, d) {
            Some((own, peer)) => Cuts { own, peer },
            None => Cuts::whole(),
        }
    }

    /// The cuts seen from the other role (own and peer swapped).
    pub fn swapped(&self) -> Cuts {
        Cuts { own: self.peer.clone(), peer: self.own.clone() }
    }
}

/// `cuts` of a slice of `sb` bytes, with empty meaning the whole slice.
fn cuts_of(cuts: &[(u64, u64)], sb: u64) -> Vec<(u64, u64)> {
    if cuts.is_empty() { vec![(0, sb)] } else { cuts.to_vec() }
}

fn mem_type(m: MemoryKind) -> MemType {
    match m {
        MemoryKind::Vram => MemType::Vram,
        MemoryKind::Dram => MemType::Dram,
    }
}

/// A role's NIXL agent (in this process).
enum Role {
    /// In this process.
    Local(Agent),
}

/// A role: a NIXL agent with its pool registered.
pub struct Endpoint {
    // Field order is drop order: the prepared lists are released, then the agent gives up
    // its share of the registration before the pool's guard decides whether it holds the
    // last one.
    /// The peers connected ([`Endpoint::connect`]), in order: peer 0 is the one
    /// [`Endpoint::post_as_initiator`] and [`Endpoint::notify_peer`] address; a TP rank
    /// reading from several ranks of the other side has one per rank ([`Endpoint::post_to`]).
    /// Each holds its prepared remote list (`--xfer-req prepared`).
    peers: Vec<Peer>,
    /// This role's own prepared list (`--xfer-req prepared`), made at the first connect.
    prepared_local: Option<PreparedList>,
    xfer_req: XferReq,
    agent: Role,
    backend: String,
    /// The role's KV pool, owned by its NIXL registration ([`Registered`]): freed only when no
    /// request may still move it (else kept until exit).
    pub pool: Registered<KvPool>,
    /// Prefill: the embedded tier's arena, registered ([`Endpoint::register_tier`]).
    tier: Option<Registered<std::sync::Arc<crate::mem::tier::TierArena>>>,
}

impl Endpoint {
    /// Creates agent `name` on `backend` and registers every layer region of `pool`, with
    /// the default [`TransportOptions`] (prepared requests, the plugin's default parameters).
    pub fn new(name: &str, backend: &str, pool: KvPool) -> Result<Endpoint> {
        Self::with_options(name, backend, pool, &TransportOptions::default())
    }

    /// [`Endpoint::new`] with `opts`: the backend is created with `opts.backend_params`
    /// ([`Agent::with_params`]) and requests are made as `opts.xfer_req` says. Errors: as
    /// [`Agent::with_params`] (exit 2), registration (exit 3/4).
    pub fn with_options(name: &str, backend: &str, pool: KvPool, opts: &TransportOptions) -> Result<Endpoint> {
        let mut agent = Agent::with_params(name, backend, &opts.backend_params)?;
        let len = pool.geometry().region_bytes()?;
        let regions: Vec<Region> = pool
            .region_addrs()
            .into_iter()
            .map(|addr| Region { addr, len, mem: mem_type(pool.memory()), dev_id: pool.device_id() })
            .collect();
        let pool = Registered::new(&mut agent, pool, &regions)?;
        Ok(Endpoint {
            peers: Vec::new(),
            prepared_local: None,
            xfer_req: opts.xfer_req,
            agent: Role::Local(agent),
            backend: backend.to_string(),
            pool,
            tier: None,
        })
    }

    /// Prefill: registers the embedded KV tier's arena with this role's agent (DRAM), so that
    /// decode in another process or host can READ tier entries from it
    /// ([`Endpoint::post_read_tier`]); [`Endpoint::info`] then announces it. Call before the
    /// info goes to the peer. Errors: as [`Registered::new`].
    pub fn register_tier(&mut self, arena: std::sync::Arc<crate::mem::tier::TierArena>) -> Result<()> {
        let (addr, len) = arena.region();
        let region = Region { addr, len, mem: MemType::Dram, dev_id: 0 };
        let Role::Local(agent) = &mut self.agent;
        self.tier = Some(Registered::new(agent, arena, &[region])?);
        Ok(())
    }

    /// Decode: posts one NIXL READ from the peer's tier arena (announced in its
    /// [`PeerInfo::tier_region`]) into this role's pool: each `(byte offset in the arena, local
    /// slice, bytes)`, descriptors built for the request (`createXferReq`); does not wait
    /// ([`Endpoint::poll`]). Its deadline is `timeout` from now. Errors: transport (exit 3)
    /// when the peer announced no arena or a range leaves it; timeout (exit 4).
    pub fn post_read_tier(&self, pairs: &[(u64, SliceCoord, u64)], timeout: Duration) -> Result<Posted> {
        let deadline = Deadline::after(timeout);
        let agent = self.local()?;
        let peer = self.peer();
        let Some((base, len)) = peer.tier_region else {
            return Err(crate::error::Error::Transport(format!("agent {} announced no tier arena to READ from", peer.agent)));
        };
        if let Some(&(off, _, n)) = pairs.iter().find(|p| p.0.checked_add(p.2).is_none_or(|end| end > len)) {
            return Err(crate::error::Error::Transport(format!(
                "a tier load of {n} bytes at offset {off} leaves agent {}'s arena of {len} bytes",
                peer.agent
            )));
        }
        let g = self.pool.geometry();
        let local: Vec<(u64, u64)> = pairs.iter().map(|p| (g.descriptor(&self.pool.region_addrs(), p.1).0, p.2)).collect();
        let remote: Vec<(u64, u64)> = pairs.iter().map(|p| (base + p.0, p.2)).collect();
        self.pool.bind()?;
        let descs = Descs::Fresh {
            local: (&local, mem_type(self.pool.memory()), self.pool.device_id()),
            remote: (&remote, MemType::Dram, 0),
        };
        agent.post(XferOp::Read, descs, &peer.agent, b"kvprobe:tier-load", deadline, self.keep()?)
    }

    fn local(&self) -> Result<&Agent> {
        match &self.agent {
            Role::Local(a) => Ok(a),
        }
    }

    /// This role's [`PeerInfo`], to hand to the other role.
    pub fn info(&self) -> Result<PeerInfo> {
        match &self.agent {
            Role::Local(a) => Ok(PeerInfo {
                agent: a.name(),
                metadata: a.metadata()?,
                region_bases: self.pool.region_addrs(),
                region_len: self.pool.geometry().region_bytes().unwrap_or(0),
                memory: self.pool.memory(),
                device_id: self.pool.device_id(),
                geometry: Some(self.pool.geometry().clone()),
                lease: self.pool.lease().downgrade(),
                tier_region: self.tier.as_ref().map(|t| t.region()),
            }),
        }
    }

    /// NIXL agent name.
    pub fn name(&self) -> String {
        match &self.agent {
            Role::Local(a) => a.name(),
        }
    }

    /// Checks the peer's regions match this pool's geometry (one per layer, each as long as
    /// this side's), loads the peer's metadata so transfers and notifications can reach it,
    /// checks that the metadata covers every block slice of the peer's pool (`checkRemoteMD`
    /// with that descriptor list), and with `--xfer-req prepared` prepares this role's two
    /// descriptor lists (its own pool's slices and the peer's, [`Prepared`]). Errors:
    /// transport (exit 3) when the regions do not match (a descriptor would leave the peer's
    /// registration), NIXL refuses the metadata, the check fails (naming both agents) or a
    /// list cannot be prepared; usage (exit 2) for a pool of more than
    /// [`MAX_PREPARED_SLICES`] slices with prepared requests.
    pub fn connect(&mut self, peer: PeerInfo) -> Result<()> {
        self.connect_link(peer, Cuts::whole())
    }

    /// [`Endpoint::connect`] for a link whose descriptors cut block slices as `cuts` says
    /// (unequal sides, [`Cuts`]): the prepared lists hold those pieces. Errors: as
    /// [`Endpoint::connect`], counting pieces against [`MAX_PREPARED_SLICES`].
    pub fn connect_link(&mut self, peer: PeerInfo, cuts: Cuts) -> Result<()> {
        let own = self.pool.geometry();
        let g = peer.geometry.as_ref().unwrap_or(own);
        g.validate().map_err(|e| {
            crate::error::Error::Transport(format!("agent {} announced a geometry that is not valid: {e}", peer.agent))
        })?;
        for (c, geo, whose) in [(&cuts.own, own, "this side's"), (&cuts.peer, g, "the peer's")] {
            let sb = geo.slice_bytes()?;
            let mut end = 0;
            for &(off, len) in c.iter() {
                if len == 0 || off < end || off.checked_add(len).is_none_or(|e| e > sb) {
                    return Err(crate::error::Error::Usage(format!(
                        "pieces {c:?} of {whose} block slices of {sb} bytes are not sorted, disjoint and inside the slice"
                    )));
                }
                end = off + len;
            }
        }
        let len = g.region_bytes()?;
        if peer.region_bases.len() != g.num_layers as usize
            || (peer.region_len != 0 && peer.region_len != len)
            || g.num_layers != own.num_layers
        {
            return Err(crate::error::Error::Transport(format!(
                "agent {} announced {} regions of {} bytes; its geometry has {} layers of {len} bytes and this side {} layers",
                peer.agent,
                peer.region_bases.len(),
                peer.region_len,
                g.num_layers,
                own.num_layers
            )));
        }
        let agent = self.local()?;
        agent.load_remote(&peer.metadata)?;
        let mut bases = peer.region_bases.clone();
        if test_wrong_peer_bases() {
            // Test-only: the peer's descriptors as a wrong exchange would name them, one
            // region further than the memory it registered.
            bases.iter_mut().for_each(|b| *b += len);
        }
        let remote = all_slices(g, &bases);
        let remote_side = (remote.as_slice(), mem_type(peer.memory), peer.device_id);
        if !agent.check_remote(&peer.agent, remote_side)? {
            return Err(crate::error::Error::Transport(format!(
                "NIXL agent {}: the metadata loaded from agent {} does not cover its pool's {} block slices \
                 (checkRemoteMD with their descriptors refused it): the peer's region addresses and its registered memory disagree",
                agent.name(),
                peer.agent,
                remote.len()
            )));
        }
        if let Some(arena) = peer.tier_region
            && !agent.check_remote(&peer.agent, (&[arena], MemType::Dram, 0))?
        {
            return Err(crate::error::Error::Transport(format!(
                "NIXL agent {}: the metadata loaded from agent {} does not cover the tier arena it announced \
                 ({} bytes at {:#x}; checkRemoteMD refused it)",
                agent.name(),
                peer.agent,
                arena.1,
                arena.0
            )));
        }
        let (mut prepared, mut own_prepared) = (None, None);
        if self.xfer_req == XferReq::Prepared {
            let pieces = |g: &Geometry, c: &[(u64, u64)]| -> Result<u64> { Ok(g.total_slices()? * c.len().max(1) as u64) };
            let total = pieces(g, &cuts.peer)?.max(pieces(own, &cuts.own)?);
            if total > MAX_PREPARED_SLICES {
                return Err(crate::error::Error::Usage(format!(
                    "--xfer-req prepared: the pool has {total} block slices (or pieces of them that one descriptor moves), and NIXL's makeXferReq indexes at most {MAX_PREPARED_SLICES}; use --xfer-req create"
                )));
            }
            let own_list = |cuts: &[(u64, u64)]| {
                let local = all_cuts(own, &self.pool.region_addrs(), cuts);
                agent.prepare(None, (&local, mem_type(self.pool.memory()), self.pool.device_id()))
            };
            let local = match (cuts.own.is_empty(), self.prepared_local.is_none()) {
                (true, true) => Some(own_list(&[])?),
                (false, _) => {
                    own_prepared = Some(own_list(&cuts.own)?);
                    None
                }
                (true, false) => None,
            };
            let remote = if cuts.peer.is_empty() {
                agent.prepare(Some(&peer.agent), remote_side)?
            } else {
                let pieces = all_cuts(g, &bases, &cuts.peer);
                agent.prepare(Some(&peer.agent), (pieces.as_slice(), mem_type(peer.memory), peer.device_id))?
            };
            crate::sys::trace::trace!(
                "{}: prepared {} local and {} remote descriptors (of {}; {} and {} per block slice)",
                agent.name(),
                pieces(own, &cuts.own)?,
                remote.len(),
                peer.agent,
                cuts.own.len().max(1),
                cuts.peer.len().max(1)
            );
            prepared = Some(remote);
            if local.is_some() {
                self.prepared_local = local;
            }
        }
        self.peers.push(Peer { prepared, own_prepared, cuts, info: peer });
        Ok(())
    }

    /// How many peers are connected.
    pub fn peer_count(&self) -> usize {
        self.peers.len()
    }

    /// NIXL backend in use.
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// Posts `op` as the initiator (READ: this role is decode and `dst` slices are local;
    /// WRITE: this role is prefill and `src` slices are local) with notification `tag`; does
    /// not wait. `deadline` started just before the request was built ([`Agent::post`]).
    /// With prepared lists the request is made from slice indices, unless a pair is not a
    /// whole number of slices (a torn pair): then, and with `--xfer-req create`, from
    /// descriptors built for it (module docs).
    /// Errors: transport (exit 3); timeout (exit 4).
    pub fn post_as_initiator(&self, op: Op, pairs: &[Pair], tag: &str, deadline: Deadline) -> Result<Posted> {
        self.post_to(0, op, pairs, tag, deadline)
    }

    /// [`Endpoint::post_as_initiator`] to connected peer `k` (in [`Endpoint::connect`] order):
    /// the remote slices of `pairs` are that peer's. Errors: as
    /// [`Endpoint::post_as_initiator`]; transport when no peer `k` is connected.
    pub fn post_to(&self, k: usize, op: Op, pairs: &[Pair], tag: &str, deadline: Deadline) -> Result<Posted> {
        let agent = self.local()?;
        let Some(target) = self.peers.get(k) else {
            return Err(crate::error::Error::Transport(format!("{}: no peer {k} connected", agent.name())));
        };
        let keep = self.keep()?;
        // (local slice and offset, remote slice and offset, bytes)
        let side = |p: &Pair| {
            if op == Op::Write {
                ((p.src, p.src_off), (p.dst, p.dst_off), p.len)
            } else {
                ((p.dst, p.dst_off), (p.src, p.src_off), p.len)
            }
        };
        let peer = &target.info;
        let xop = if op == Op::Write { XferOp::Write } else { XferOp::Read };
        let local = target.own_prepared.as_ref().or(self.prepared_local.as_ref());
        if let (Some(local), Some(remote)) = (local, &target.prepared) {
            match indices((self.pool.geometry(), self.geometry_of(peer)), &target.cuts, pairs.iter().map(&side)) {
                Ok((li, ri, bytes)) => {
                    self.pool.bind()?;
                    let descs = Descs::Prepared { local, local_idx: &li, remote, remote_idx: &ri, bytes };
                    return agent.post(xop, descs, &peer.agent, tag.as_bytes(), deadline, keep);
                }
                Err(why) => crate::sys::trace::trace!(
                    "request {tag}: {why}: no prepared index names it, so it is built with createXferReq"
                ),
            }
        }
        let local = descs(self.pool.geometry(), &self.pool.region_addrs(), pairs.iter().map(|p| (side(p).0, side(p).2)));
        let remote = descs(self.geometry_of(peer), &peer.region_bases, pairs.iter().map(|p| (side(p).1, side(p).2)));
        self.pool.bind()?;
        let descs = Descs::Fresh {
            local: (&local, mem_type(self.pool.memory()), self.pool.device_id()),
            remote: (&remote, mem_type(peer.memory), peer.device_id),
        };
        agent.post(xop, descs, &peer.agent, tag.as_bytes(), deadline, keep)
    }

    /// Builds (and releases, unposted) one request of `pairs` as [`Endpoint::post_as_initiator`]
    /// would with `mode` — prepared lists must exist for [`XferReq::Prepared`] — and returns
    /// the seconds the build took, descriptor lists included (`kvprobe bench`). Errors:
    /// transport (exit 3); usage when `mode` is prepared and nothing was prepared or a pair is
    /// not whole slices.
    pub fn time_request(&self, op: Op, pairs: &[Pair], mode: XferReq) -> Result<f64> {
        let agent = self.local()?;
        // (local slice and offset, remote slice and offset, bytes)
        let side = |p: &Pair| {
            if op == Op::Write {
                ((p.src, p.src_off), (p.dst, p.dst_off), p.len)
            } else {
                ((p.dst, p.dst_off), (p.src, p.src_off), p.len)
            }
        };
        let peer = self.peer();
        let xop = if op == Op::Write { XferOp::Write } else { XferOp::Read };
        let first = self.peers.first();
        let own = first.and_then(|p| p.own_prepared.as_ref()).or(self.prepared_local.as_ref());
        let prepared = own.zip(first.and_then(|p| p.prepared.as_ref()));
        let whole = Cuts::whole();
        let cuts = first.map_or(&whole, |p| &p.cuts);
        match (mode, prepared) {
            (XferReq::Prepared, Some((local, remote))) => {
                let t = Instant::now();
                let (li, ri, bytes) = indices((self.pool.geometry(), self.geometry_of(peer)), cuts, pairs.iter().map(&side))
                    .map_err(|w| crate::error::Error::Usage(format!("bench: {w}")))?;
                let descs = Descs::Prepared { local, local_idx: &li, remote, remote_idx: &ri, bytes };
                let built = agent.time_request(xop, &descs, &peer.agent)?;
                Ok(t.elapsed().as_secs_f64().max(built))
            }
            (XferReq::Prepared, None) => Err(crate::error::Error::Usage(
                "bench: prepared requests need an endpoint connected with --xfer-req prepared".into(),
            )),
            (XferReq::Create, _) => {
                let t = Instant::now();
                let local = descs(self.pool.geometry(), &self.pool.region_addrs(), pairs.iter().map(|p| (side(p).0, side(p).2)));
                let remote = descs(self.geometry_of(peer), &peer.region_bases, pairs.iter().map(|p| (side(p).1, side(p).2)));
                let descs = Descs::Fresh {
                    local: (&local, mem_type(self.pool.memory()), self.pool.device_id()),
                    remote: (&remote, mem_type(peer.memory), peer.device_id),
                };
                let built = agent.time_request(xop, &descs, &peer.agent)?;
                Ok(t.elapsed().as_secs_f64().max(built))
            }
        }
    }

    /// Sends `tag` to the peer as a bare NIXL notification (no transfer): the test-only
    /// early-notification fault of the sweep (`run`). Errors: transport (exit 3).
    pub fn notify_peer(&self, tag: &str) -> Result<()> {
        let peer = self.peer().agent.clone();
        self.local()?.notify(&peer, tag.as_bytes())
    }

    /// Notifications from any peer since the last call: (peer agent, message).
    pub fn raw_notifications(&self) -> Result<Vec<(String, String)>> {
        match &self.agent {
            Role::Local(a) => a.take_notifications(),
        }
    }

    /// UCX's protocol selection for `op` as seen by the agent that initiates it from this
    /// role (this process's UCX log since `mark`).
    pub fn transport_path(&self, mark: u64, op: Op, vram: bool) -> crate::xfer::ucx::TransportPath {
        let name = if op == Op::Write { "WRITE" } else { "READ" };
        crate::xfer::ucx::path_since(mark, &self.backend, name, vram)
    }

    /// Posts one NIXL READ of `pairs` from the peer (this role is decode: `dst` slices are
    /// local, `src` slices the peer's), with notification `tag` to the peer; does not wait.
    /// Its deadline is `timeout` from now (before the request is built); made as
    /// [`Endpoint::post_as_initiator`] makes it.
    /// Errors: transport (exit 3), timeout (exit 4: [`Agent::post`]).
    pub fn post_read(&self, pairs: &[Pair], tag: &str, timeout: Duration) -> Result<Posted> {
        self.post_as_initiator(Op::Read, pairs, tag, Deadline::after(timeout))
    }

    /// The shares a request from this role holds: of its own pool's registration and, when
    /// the peer lives in this process, of the peer's. Errors: transport (exit 3) when the
    /// peer's pool was already given up.
    fn keep(&self) -> Result<Lease> {
        let mut keep = self.pool.lease().clone();
        for p in &self.peers {
            keep.join(&p.info.lease.upgrade()?);
        }
        Ok(keep)
    }

    /// Checks a posted transfer once: `Some` when complete. Errors: transport (exit 3),
    /// timeout (exit 4, [`Agent::poll`]).
    pub fn poll(&self, p: &mut Posted) -> Result<Option<XferResult>> {
        self.pool.bind()?;
        self.local()?.poll(p)
    }

    /// Notification messages that arrived from the connected peers since the last call.
    pub fn notifications(&self) -> Result<Vec<String>> {
        Ok(self
            .raw_notifications()?
            .into_iter()
            .filter(|(p, _)| self.peers.iter().any(|x| x.info.agent == *p))
            .map(|(_, m)| m)
            .collect())
    }

    fn peer(&self) -> &PeerInfo {
        &self.peers.first().expect("connect() before transfers").info
    }

    /// A peer pool's geometry: as it announced it, else this side's.
    fn geometry_of<'a>(&'a self, peer: &'a PeerInfo) -> &'a Geometry {
        peer.geometry.as_ref().unwrap_or(self.pool.geometry())
    }
}

/// The NIXL descriptors `(address, length)` of `(slice, byte offset in it)` and lengths in a
/// pool of geometry `g` whose layer regions start at `bases`.
fn descs(g: &Geometry, bases: &[u64], coords: impl Iterator<Item = ((SliceCoord, u64), u64)>) -> Vec<(u64, u64)> {
    coords.map(|((c, off), len)| (g.descriptor(bases, c).0 + off, len)).collect()
}

/// A connected peer: what it announced, how the link cuts slices ([`Cuts`]) and its
/// prepared descriptor lists (`--xfer-req prepared`): the peer's pool (every cut of every
/// block slice at `global slice × cuts + cut`), and this role's own when the link cuts its
/// slices (else the endpoint's list of whole slices serves).
struct Peer {
    // Field order is drop order: the lists are released before the info's lease share.
    prepared: Option<PreparedList>,
    own_prepared: Option<PreparedList>,
    cuts: Cuts,
    info: PeerInfo,
}

/// The descriptor of every block slice of a pool of geometry `g` whose layer regions start
/// at `bases`, at its global slice index ([`Geometry::global_slice`]: layer, then the
/// slice's place in its region): vLLM's per-block descriptors
/// (`register_local_xfer_handler`, `add_remote_agent`).
pub fn all_slices(g: &Geometry, bases: &[u64]) -> Vec<(u64, u64)> {
    all_cuts(g, bases, &[])
}

/// [`all_slices`] with every slice cut into `cuts` ([`Cuts`]; empty: whole slices): cut `i`
/// of the slice at global index `q` is descriptor `q × cuts.len() + i`.
pub fn all_cuts(g: &Geometry, bases: &[u64], cuts: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let sb = g.slice_bytes().unwrap_or(0);
    let per = g.slices_per_layer();
    let cuts = cuts_of(cuts, sb);
    let mut out = Vec::with_capacity(bases.len() * per as usize * cuts.len());
    for &b in bases {
        for q in 0..per {
            out.extend(cuts.iter().map(|&(off, len)| (b + q * sb + off, len)));
        }
    }
    out
}

/// The prepared-list indices of `pairs` given as ((local slice, byte offset), (remote slice,
/// byte offset), bytes), the local pool of geometry `geoms.0` cut by `cuts.own` and the
/// remote of `geoms.1` cut by `cuts.peer` ([`Cuts`], [`all_cuts`]). A pair is walked on
/// both sides at once, one cut at a time: each piece must start at a cut and be that cut's
/// length on both sides (cut `i` of the slice at global index `q`, [`Geometry::global_slice`],
/// is index `q × cuts + i`). With whole slices, a whole slice is its global slice index and a
/// run of k slices (`--descriptor-blocks`) the k consecutive indices from its first, as
/// long as it stays within its layer region on both sides. Returns the local and remote
/// indices and the bytes they move. Errors: why a pair has no indices (a torn pair, a planted
/// offset, a run past its region's end): the caller then builds the request from
/// descriptors.
pub fn indices(
    geoms: (&Geometry, &Geometry),
    cuts: &Cuts,
    pairs: impl Iterator<Item = ((SliceCoord, u64), (SliceCoord, u64), u64)>,
) -> std::result::Result<(Vec<i32>, Vec<i32>, u64), String> {
    struct Side {
        sb: u64,
        per: u64,
        cuts: Vec<(u64, u64)>,
    }
    let side = |g: &Geometry, c: &[(u64, u64)]| -> std::result::Result<Side, String> {
        let sb = g.slice_bytes().map_err(|e| e.to_string())?.max(1);
        Ok(Side { sb, per: g.slices_per_layer(), cuts: cuts_of(c, sb) })
    };
    let sides = [side(geoms.0, &cuts.own)?, side(geoms.1, &cuts.peer)?];
    let (mut li, mut ri, mut bytes) = (Vec::new(), Vec::new(), 0u64);
    for ((l, lo), (r, ro), len) in pairs {
        if len == 0 {
            return Err("a pair moves 0 bytes".into());
        }
        let firsts = [geoms.0.global_slice(l) as u64, geoms.1.global_slice(r) as u64];
        // (slice at its global index, byte offset in it) on each side
        let mut at = [(firsts[0], lo), (firsts[1], ro)];
        let mut left = len;
        while left > 0 {
            let mut piece = [(0u64, 0u64); 2]; // (index, bytes)
            for k in 0..2 {
                let s = &sides[k];
                let (q, off) = (at[k].0 + at[k].1 / s.sb, at[k].1 % s.sb);
                at[k] = (q, off);
                if q / s.per != firsts[k] / s.per {
                    return Err(format!("a pair of {len} bytes from slice {} runs past its layer region", firsts[k] % s.per));
                }
                let Ok(i) = s.cuts.binary_search_by_key(&off, |c| c.0) else {
                    return Err(format!(
                        "a pair of {len} bytes at offsets {lo} and {ro} has a piece at byte {off} of a slice of {} bytes where no descriptor of the link starts",
                        s.sb
                    ));
                };
                piece[k] = (q * s.cuts.len() as u64 + i as u64, s.cuts[i].1);
            }
            let n = piece[0].1;
            if piece[1].1 != n || n > left {
                return Err(format!(
                    "a pair moves {len} bytes at offsets {lo} and {ro}, not whole descriptors of the link ({} and {} bytes)",
                    piece[0].1, piece[1].1
                ));
            }
            li.push(piece[0].0 as i32);
            ri.push(piece[1].0 as i32);
            at[0].1 += n;
            at[1].1 += n;
            left -= n;
        }
        bytes += len;
    }
    Ok((li, ri, bytes))
}

/// Test-only: `KVPROBE_TEST_WRONG_PEER_BASES=1` makes [`Endpoint::connect`] check the peer's
/// descriptors one region further than the addresses it sent (as a wrong exchange would
/// name them), so tests can show `checkRemoteMD` refuses them. Never set in normal use.
fn test_wrong_peer_bases() -> bool {
    crate::sys::test_hooks::on(crate::sys::test_hooks::WRONG_PEER_BASES)
}

/// The role that posts requests for `op` (decode for READ, prefill for WRITE) and the other.
fn roles<'a>(op: Op, prefill: &'a Endpoint, decode: &'a Endpoint) -> (&'a Endpoint, &'a Endpoint) {
    match op {
        Op::Read => (decode, prefill),
        Op::Write => (prefill, decode),
    }
}

/// Posts one NIXL request moving `pairs` (each `len` bytes from its slice start, possibly
/// spanning the next contiguous slices of one layer) from `prefill` to `decode`, with
/// notification `tag` to the other role; does not wait. The request's deadline is `timeout`
/// from now, before its descriptors are built: it bounds the post call, the completion
/// ([`poll`]) and the notification ([`await_notifications`]). Errors: transport (exit 3),
/// timeout (exit 4).
pub fn post(op: Op, prefill: &Endpoint, decode: &Endpoint, pairs: &[Pair], tag: &str, timeout: Duration) -> Result<Posted> {
    let deadline = Deadline::after(timeout);
    let (init, _) = roles(op, prefill, decode);
    init.post_as_initiator(op, pairs, tag, deadline)
}

/// Checks a request [`post`]ed for `op` once: `Some` when complete ([`Agent::poll`]: a
/// request still incomplete at two checks that began after its deadline has timed out).
/// Errors: transport (exit 3), timeout (exit 4).
pub fn poll(op: Op, prefill: &Endpoint, decode: &Endpoint, p: &mut Posted) -> Result<Option<XferResult>> {
    let (init, _) = roles(op, prefill, decode);
    init.poll(p)
}

/// The timeout of a notification query for `tag` (from agent `from`) that began at `asked`,
/// before the deadline `d` of its request, and returned at `returned`, after it.
fn query_crossed(tag: &str, from: &str, d: &Deadline, asked: Instant, returned: Instant) -> crate::error::Error {
    crate::error::Error::Timeout(format!(
        "notification {tag} from {from}: a notification query begun {:.3} s after its request was posted returned \
         {:.3} s after it, over --timeout {:.6} s",
        (asked - d.start).as_secs_f64(),
        (returned - d.start).as_secs_f64(),
        d.limit_secs()
    ))
}

/// Waits until the role that did not post `op`'s requests has received the notification of
/// every tag in `tags` (removed as they arrive; others are dropped). Each tag carries its
/// request's deadline ([`post`]): a tag still missing at two checks that began after its
/// deadline has timed out (the first check after kvprobe was busy elsewhere collects what
/// arrived meanwhile), and so has one whose deadline passed while a notification query was
/// in progress ([`crate::sys::deadline::crossed`]). Errors: timeout (exit 4), transport (exit 3).
pub fn await_notifications(
    op: Op,
    prefill: &Endpoint,
    decode: &Endpoint,
    tags: &mut std::collections::HashMap<String, Deadline>,
) -> Result<()> {
    let (init, other) = roles(op, prefill, decode);
    let from = init.name();
    let mut late_misses = 0u32;
    while !tags.is_empty() {
        let asked = Instant::now();
        // The pending tag whose deadline comes first and has not passed yet: a query still
        // blocked when it passes is a timeout, even if it brings the notification.
        let next = tags.iter().filter(|(_, d)| !d.passed_at(asked)).min_by_key(|(_, d)| d.at()).map(|(t, d)| (t.clone(), *d));
        let got = other.raw_notifications()?;
        let returned = Instant::now();
        if let Some((tag, d)) = next
            && crate::sys::deadline::crossed(&d, asked, returned)
        {
            return Err(query_crossed(&tag, &from, &d, asked, returned));
        }
        for (peer, msg) in got {
            if peer == from {
                tags.remove(&msg);
            }
        }
        if tags.is_empty() {
            break;
        }
        if let Some((tag, d)) = tags.iter().filter(|(_, d)| d.passed_at(asked)).min_by_key(|(_, d)| d.at()) {
            late_misses += 1;
            if late_misses >= 2 {
                let mut missing: Vec<&String> = tags.keys().collect();
                missing.sort();
                return Err(crate::error::Error::Timeout(format!(
                    "no notification {tag} from {from} within --timeout {:.6} s ({:.3} s since its request was posted; missing: {missing:?})",
                    d.limit_secs(),
                    d.elapsed_secs()
                )));
            }
        }
        std::thread::sleep(Duration::from_micros(20));
    }
    Ok(())
}

/// The notifications the role that did not post `op`'s requests has received (decode for
/// WRITE), kept until the sweep asks for them one tag at a time ([`poll_notification`]):
/// a notification that arrives before its stage is waited for is not lost.
#[derive(Debug, Default)]
pub struct Inbox {
    got: std::collections::HashSet<String>,
    late_misses: u32,
}

/// Checks once whether the receiving role of `op` (decode for WRITE, prefill for READ) has
/// the notification `tag` from the initiator; notifications of other tags are kept in
/// `inbox`. `deadline` is the tag's request's ([`post`]): a tag still missing at two checks
/// that began after it has timed out, and so has one whose notification query began before it
/// and returned after it ([`crate::sys::deadline::crossed`]). Returns true (and forgets the tag)
/// once it has arrived. Errors: timeout (exit 4), transport (exit 3).
pub fn poll_notification(
    op: Op,
    prefill: &Endpoint,
    decode: &Endpoint,
    inbox: &mut Inbox,
    tag: &str,
    deadline: Deadline,
) -> Result<bool> {
    let (init, other) = roles(op, prefill, decode);
    poll_notification_from(other, &[init.name()], inbox, tag, deadline)
}

/// [`poll_notification`] for a receiving role `receiver` whose initiators are the agents
/// named in `from` (they may live in another process or host: `run --peer`; several with
/// prefill TP ranks; notifications of other agents are dropped).
pub fn poll_notification_from(
    receiver: &Endpoint,
    from: &[String],
    inbox: &mut Inbox,
    tag: &str,
    deadline: Deadline,
) -> Result<bool> {
    let other = receiver;
    if inbox.got.remove(tag) {
        inbox.late_misses = 0;
        return Ok(true);
    }
    let asked = Instant::now();
    let got = other.raw_notifications()?;
    let returned = Instant::now();
    if crate::sys::deadline::crossed(&deadline, asked, returned) {
        return Err(query_crossed(tag, &from.join(" or "), &deadline, asked, returned));
    }
    inbox.got.extend(got.into_iter().filter(|(peer, _)| from.contains(peer)).map(|(_, m)| m));
    if inbox.got.remove(tag) {
        inbox.late_misses = 0;
        return Ok(true);
    }
    if deadline.passed_at(asked) {
        inbox.late_misses += 1;
        if inbox.late_misses >= 2 {
            return Err(crate::error::Error::Timeout(format!(
                "no notification {tag} from {} within --timeout {:.6} s ({:.3} s since its request was posted)",
                from.join(" or "),
                deadline.limit_secs(),
                deadline.elapsed_secs()
            )));
        }
    }
    Ok(false)
}
