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

use crate::deadline::Deadline;
use crate::error::Result;
use crate::geometry::SliceCoord;
use crate::nixl::{Agent, Lease, Posted, Region, Registered, WeakLease, XferResult};
use crate::pool::{KvPool, MemoryKind};
use nixl_sys::{MemType, XferOp};
use serde::{Deserialize, Serialize};
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
    /// The role's registrations when it lives in this process (empty once serialized): a
    /// request takes shares of them ([`Lease`]) so the peer's pool outlives it too.
    #[serde(skip)]
    pub lease: WeakLease,
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

/// A role's NIXL agent (in this process).
enum Role {
    /// In this process.
    Local(Agent),
}

/// A role: a NIXL agent with its pool registered.
pub struct Endpoint {
    // Field order is drop order: the agent gives up its share of the registration before the
    // pool's guard decides whether it holds the last one.
    agent: Role,
    backend: String,
    peer: Option<PeerInfo>,
    /// The role's KV pool, owned by its NIXL registration ([`Registered`]): freed only when no
    /// request may still move it (else kept until exit).
    pub pool: Registered<KvPool>,
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
        let pool = Registered::new(&mut agent, pool, &regions)?;
        Ok(Endpoint { agent: Role::Local(agent), backend: backend.to_string(), peer: None, pool })
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
                memory: self.pool.memory(),
                device_id: self.pool.device_id(),
                lease: self.pool.lease().downgrade(),
            }),
        }
    }

    /// NIXL agent name.
    pub fn name(&self) -> String {
        match &self.agent {
            Role::Local(a) => a.name(),
        }
    }

    /// Loads the peer's metadata so transfers and notifications can reach it.
    pub fn connect(&mut self, peer: PeerInfo) -> Result<()> {
        self.local()?.load_remote(&peer.metadata)?;
        self.peer = Some(peer);
        Ok(())
    }

    /// NIXL backend in use.
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// Posts `op` as the initiator (READ: this role is decode and `dst` slices are local;
    /// WRITE: this role is prefill and `src` slices are local) with notification `tag`; does
    /// not wait. `deadline` started just before the request was built ([`Agent::post`]).
    /// Errors: transport (exit 3); timeout (exit 4).
    pub fn post_as_initiator(&self, op: Op, pairs: &[Pair], tag: &str, deadline: Deadline) -> Result<Posted> {
        let agent = self.local()?;
        let keep = self.keep()?;
        let side = |p: &Pair| {
            if op == Op::Write { (p.src, p.dst) } else { (p.dst, p.src) }
        };
        let peer = self.peer();
        let local = self.descs(&self.pool.region_addrs(), pairs.iter().map(|p| (side(p).0, p.len)));
        let remote = self.descs(&peer.region_bases, pairs.iter().map(|p| (side(p).1, p.len)));
        self.pool.bind()?;
        agent.post(
            if op == Op::Write { XferOp::Write } else { XferOp::Read },
            (&local, mem_type(self.pool.memory()), self.pool.device_id()),
            (&remote, mem_type(peer.memory), peer.device_id),
            &peer.agent,
            tag.as_bytes(),
            deadline,
            keep,
        )
    }

    /// Sends `tag` to the peer as a bare NIXL notification (no transfer): the test-only
    /// early-notification fault of the sweep ([`crate::run`]). Errors: transport (exit 3).
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
    pub fn transport_path(&self, mark: u64, op: Op, vram: bool) -> crate::ucx::TransportPath {
        let name = if op == Op::Write { "WRITE" } else { "READ" };
        crate::ucx::path_since(mark, &self.backend, name, vram)
    }

    /// Posts one NIXL READ of `pairs` from the peer (this role is decode: `dst` slices are
    /// local, `src` slices the peer's), with notification `tag` to the peer; does not wait.
    /// Its deadline is `timeout` from now (before the descriptors are built).
    /// Errors: transport (exit 3), timeout (exit 4: [`Agent::post`]).
    pub fn post_read(&self, pairs: &[Pair], tag: &str, timeout: Duration) -> Result<Posted> {
        let deadline = Deadline::after(timeout);
        let peer = self.peer();
        let local = self.descs(&self.pool.region_addrs(), pairs.iter().map(|p| (p.dst, p.len)));
        let remote = self.descs(&peer.region_bases, pairs.iter().map(|p| (p.src, p.len)));
        self.pool.bind()?;
        let keep = self.keep()?;
        self.local()?.post(
            XferOp::Read,
            (&local, mem_type(self.pool.memory()), self.pool.device_id()),
            (&remote, mem_type(peer.memory), peer.device_id),
            &peer.agent,
            tag.as_bytes(),
            deadline,
            keep,
        )
    }

    /// The shares a request from this role holds: of its own pool's registration and, when
    /// the peer lives in this process, of the peer's. Errors: transport (exit 3) when the
    /// peer's pool was already given up.
    fn keep(&self) -> Result<Lease> {
        let mut keep = self.pool.lease().clone();
        if let Some(p) = &self.peer {
            keep.join(&p.lease.upgrade()?);
        }
        Ok(keep)
    }

    /// Checks a posted transfer once: `Some` when complete. Errors: transport (exit 3),
    /// timeout (exit 4, [`Agent::poll`]).
    pub fn poll(&self, p: &mut Posted) -> Result<Option<XferResult>> {
        self.pool.bind()?;
        self.local()?.poll(p)
    }

    /// Notification messages that arrived from the peer since the last call.
    pub fn notifications(&self) -> Result<Vec<String>> {
        let peer = self.peer().agent.clone();
        Ok(self.raw_notifications()?.into_iter().filter(|(p, _)| *p == peer).map(|(_, m)| m).collect())
    }

    fn peer(&self) -> &PeerInfo {
        self.peer.as_ref().expect("connect() before transfers")
    }

    fn descs(&self, bases: &[u64], coords: impl Iterator<Item = (SliceCoord, u64)>) -> Vec<(u64, u64)> {
        let g = self.pool.geometry();
        coords.map(|(c, len)| (g.descriptor(bases, c).0, len)).collect()
    }
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
/// in progress ([`crate::deadline::crossed`]). Errors: timeout (exit 4), transport (exit 3).
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
            && crate::deadline::crossed(&d, asked, returned)
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
/// and returned after it ([`crate::deadline::crossed`]). Returns true (and forgets the tag)
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
    poll_notification_from(other, &init.name(), inbox, tag, deadline)
}

/// [`poll_notification`] for a receiving role `receiver` whose initiator is the agent named
/// `from` (it may live in another process or host: `run --peer`).
pub fn poll_notification_from(receiver: &Endpoint, from: &str, inbox: &mut Inbox, tag: &str, deadline: Deadline) -> Result<bool> {
    let other = receiver;
    if inbox.got.remove(tag) {
        inbox.late_misses = 0;
        return Ok(true);
    }
    let asked = Instant::now();
    let got = other.raw_notifications()?;
    let returned = Instant::now();
    if crate::deadline::crossed(&deadline, asked, returned) {
        return Err(query_crossed(tag, from, &deadline, asked, returned));
    }
    inbox.got.extend(got.into_iter().filter(|(peer, _)| *peer == from).map(|(_, m)| m));
    if inbox.got.remove(tag) {
        inbox.late_misses = 0;
        return Ok(true);
    }
    if deadline.passed_at(asked) {
        inbox.late_misses += 1;
        if inbox.late_misses >= 2 {
            return Err(crate::error::Error::Timeout(format!(
                "no notification {tag} from {from} within --timeout {:.6} s ({:.3} s since its request was posted)",
                deadline.limit_secs(),
                deadline.elapsed_secs()
            )));
        }
    }
    Ok(false)
}
