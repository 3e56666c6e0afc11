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
use crate::nixl::{Agent, Region, XferResult};
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
    /// The role's KV pool.
    pub pool: KvPool,
    agent: Agent,
    peer: Option<PeerInfo>,
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
        Ok(Endpoint { pool, agent, peer: None })
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
pub fn transfer(op: Op, prefill: &Endpoint, decode: &Endpoint, pairs: &[Pair], tag: &str, timeout: Duration) -> Result<XferResult> {
    if pairs.is_empty() {
        return Ok(XferResult { bytes: 0, elapsed: Duration::ZERO });
    }
    let src = |e: &Endpoint, bases: &[u64]| e.descs(bases, pairs.iter().map(|p| (p.src, p.len)));
    let dst = |e: &Endpoint, bases: &[u64]| e.descs(bases, pairs.iter().map(|p| (p.dst, p.len)));
    match op {
        Op::Read => {
            let peer = decode.peer();
            let local = dst(decode, &decode.pool.region_addrs());
            let remote = src(decode, &peer.region_bases);
            let r = decode.agent.transfer(
                XferOp::Read,
                (&local, mem_type(decode.pool.memory()), decode.pool.device_id()),
                (&remote, mem_type(peer.memory), peer.device_id),
                &peer.agent,
                tag.as_bytes(),
                timeout,
            )?;
            prefill.agent.wait_notification(&decode.agent.name(), tag, timeout)?;
            Ok(r)
        }
        Op::Write => {
            let peer = prefill.peer();
            let local = src(prefill, &prefill.pool.region_addrs());
            let remote = dst(prefill, &peer.region_bases);
            let r = prefill.agent.transfer(
                XferOp::Write,
                (&local, mem_type(prefill.pool.memory()), prefill.pool.device_id()),
                (&remote, mem_type(peer.memory), peer.device_id),
                &peer.agent,
                tag.as_bytes(),
                timeout,
            )?;
            decode.agent.wait_notification(&prefill.agent.name(), tag, timeout)?;
            Ok(r)
        }
    }
}
