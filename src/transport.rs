//! The prefill and decode roles and the NIXL transfer between them.
//!
//! Each role ([`Endpoint`]) owns one NIXL agent and one [`KvPool`], registers the pool's
//! per-layer regions, and learns about its peer only through a [`PeerInfo`] — the NIXL
//! metadata blob plus the region base addresses, as vLLM's NixlConnector exchanges
//! `NixlAgentMetadata` — and through NIXL notifications. Both roles live in one process
//! for now; nothing else passes between them, so they can move to two processes or nodes.
//!
//! Descriptors follow vLLM's NixlConnector: one per (layer, K/V, block) block slice.
//! `--op read` (default): decode pulls from prefill and notifies it (vLLM's flow);
//! `--op write`: prefill pushes and notifies decode.

use crate::error::Result;
use crate::geometry::SliceCoord;
use crate::nixl::{Agent, Posted, Region, XferResult};
use crate::pool::{KvPool, MemoryKind};
use nixl_sys::{MemType, XferOp};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Direction of the NIXL transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// Decode READs from prefill (vLLM NixlConnector's flow).
    Read,
    /// Prefill WRITEs into decode.
    Write,
}

/// What one role tells the other: its agent, NIXL metadata and region bases.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerInfo {
    /// NIXL agent name.
    pub agent: String,
    /// NIXL metadata blob (`getLocalMD`).
    pub metadata: Vec<u8>,
    /// Base address of each layer's registered region.
    pub region_bases: Vec<u64>,
    /// VRAM or DRAM.
    pub memory: MemoryKind,
    /// GPU ordinal (0 for DRAM).
    pub device_id: u64,
}

/// One block slice to move: prefill `src` to decode `dst`, `len` bytes from the slice start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pair {
    /// Prefill-side slice.
    pub src: SliceCoord,
    /// Decode-side slice.
    pub dst: SliceCoord,
    /// Bytes to move (the slice size, or less for an injected tear).
    pub len: u64,
}

fn mem_type(m: MemoryKind) -> MemType {
    match m {
        MemoryKind::Vram => MemType::Vram,
        MemoryKind::Dram => MemType::Dram,
    }
}

/// A role: a NIXL agent with its pool registered.
pub struct Endpoint {
    // Field order is drop order: the agent deregisters its regions before the pool frees them.
    agent: Agent,
    peer: Option<PeerInfo>,
    /// The role's KV pool.
    pub pool: KvPool,
}

impl Endpoint {
    /// Creates agent `name` on `backend` and registers every layer region of `pool`.
    pub fn new(name: &str, backend: &str, pool: KvPool) -> Result<Endpoint> {
        let mut agent = Agent::new(name, backend)?;
        let len = pool.geometry().region_bytes()?;
        let regions: Vec<Region> = pool
            .region_addrs()
            .into_iter()
            .map(|addr| Region { addr, len, mem: mem_type(pool.memory()), dev_id: pool.device_id() })
            .collect();
        agent.register(&regions)?;
        Ok(Endpoint { agent, peer: None, pool })
    }

    /// This role's [`PeerInfo`], to hand to the other role.
    pub fn info(&self) -> Result<PeerInfo> {
        Ok(PeerInfo {
            agent: self.agent.name(),
            metadata: self.agent.metadata()?,
            region_bases: self.pool.region_addrs(),
            memory: self.pool.memory(),
            device_id: self.pool.device_id(),
        })
    }

    /// Loads the peer's metadata so transfers and notifications can reach it.
    pub fn connect(&mut self, peer: PeerInfo) -> Result<()> {
        self.agent.load_remote(&peer.metadata)?;
        self.peer = Some(peer);
        Ok(())
    }

    /// NIXL backend in use.
    pub fn backend(&self) -> &str {
        self.agent.backend_name()
    }

    /// Posts one NIXL READ of `pairs` from the peer (this role is decode: `dst` slices are
    /// local, `src` slices the peer's), with notification `tag` to the peer; does not wait.
    /// Errors: transport (exit 3).
    pub fn post_read(&self, pairs: &[Pair], tag: &str) -> Result<Posted> {
        let peer = self.peer();
        let local = self.descs(&self.pool.region_addrs(), pairs.iter().map(|p| (p.dst, p.len)));
        let remote = self.descs(&peer.region_bases, pairs.iter().map(|p| (p.src, p.len)));
        self.pool.bind()?;
        self.agent.post(
            XferOp::Read,
            (&local, mem_type(self.pool.memory()), self.pool.device_id()),
            (&remote, mem_type(peer.memory), peer.device_id),
            &peer.agent,
            tag.as_bytes(),
        )
    }

    /// Checks a posted transfer once: `Some` when complete. Errors: transport (exit 3).
    pub fn poll(&self, p: &mut Posted) -> Result<Option<XferResult>> {
        self.pool.bind()?;
        self.agent.poll(p)
    }

    /// Notification messages that arrived from the peer since the last call.
    pub fn notifications(&self) -> Result<Vec<String>> {
        let peer = self.peer().agent.clone();
        Ok(self.agent.take_notifications()?.into_iter().filter(|(p, _)| *p == peer).map(|(_, m)| m).collect())
    }

    fn peer(&self) -> &PeerInfo {
        self.peer.as_ref().expect("connect() before transfers")
    }

    fn descs(&self, bases: &[u64], coords: impl Iterator<Item = (SliceCoord, u64)>) -> Vec<(u64, u64)> {
        let g = self.pool.geometry();
        coords.map(|(c, len)| (g.descriptor(bases, c).0, len)).collect()
    }
}

/// Moves `pairs` from `prefill` to `decode` with one NIXL request and waits for both the
/// request's completion (initiator) and its notification `tag` (the other role), each
/// within `timeout`. Errors: transport (exit 3) or timeout (exit 4).
pub fn transfer(
    op: Op,
    prefill: &Endpoint,
    decode: &Endpoint,
    pairs: &[Pair],
    tag: &str,
    timeout: Duration,
) -> Result<XferResult> {
    if pairs.is_empty() {
        return Ok(XferResult { bytes: 0, elapsed: Duration::ZERO });
    }
    // The initiator posts the request; the other role waits for its notification.
    let (init, other, xop) = match op {
        Op::Read => (decode, prefill, XferOp::Read),
        Op::Write => (prefill, decode, XferOp::Write),
    };
    let side = |p: &Pair| {
        if op == Op::Write { (p.src, p.dst) } else { (p.dst, p.src) }
    };
    let peer = init.peer();
    let local = init.descs(&init.pool.region_addrs(), pairs.iter().map(|p| (side(p).0, p.len)));
    let remote = init.descs(&peer.region_bases, pairs.iter().map(|p| (side(p).1, p.len)));
    init.pool.bind()?;
    let r = init.agent.transfer(
        xop,
        (&local, mem_type(init.pool.memory()), init.pool.device_id()),
        (&remote, mem_type(peer.memory), peer.device_id),
        &peer.agent,
        tag.as_bytes(),
        timeout,
    )?;
    other.agent.wait_notification(&init.agent.name(), tag, timeout)?;
    Ok(r)
}
