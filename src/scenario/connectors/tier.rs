//! The tier connector (kv_both): vLLM's MooncakeStoreConnector over a KV-tier store. On
//! prefill (`TierConnector`) the scheduler asks it for the prompt's leading block hashes
//! (lookup), and the engine loads hits into prefill blocks (load) and saves computed blocks
//! (save); on decode (`TierReader`, tier-only) it loads saved entries into decode blocks.
//!
//! The store is the built-in one ([`Store`] over a [`TierArena`] in prefill's host memory;
//! `--tier embedded`) or a real Mooncake Store (`--tier mooncake`: a master kvprobe starts on
//! prefill's host, or an existing deployment, and the Python store client as a worker per
//! engine, each mapping its own engine's pool, [`crate::mem::mooncake`]); with Mooncake, [`Store`]
//! keeps only the index (keys, pins, evictions and each entry's shadow content) and the bytes
//! live in Mooncake. Decode reaches the embedded store directly in one process and over NIXL
//! from another process or host ([`TierAccess`]).

use crate::core::geometry::SliceCoord;
use crate::error::{Error, Result};
use crate::mem::pool::KvPool;
use crate::mem::tier::{EntryId, Store, TierArena, TierKind};
use crate::peer::steps::{TierAccess, TierRef};
use crate::scenario::config::ScenarioConfig;
use crate::xfer::transport::Endpoint;
use rand::Rng;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The tier under prefill's connectors: the store's index and, for `--tier mooncake`, the
/// deployment holding the bytes.
pub(crate) struct TierConnector {
    /// Entries by block hash: keys, pins, evictions and what each entry holds.
    pub(crate) store: Store,
    /// `--tier mooncake`: the master and prefill's store client (dropped with the connector).
    mooncake: Option<MooncakeTier>,
    /// The embedded store in words.
    detail: String,
}

/// Where a prefill engine's tier lives and how decode reaches it.
pub struct TierPlace {
    /// The embedded store's arena, made once per session ([`TierArena`]).
    pub arena: Option<Arc<TierArena>>,
    /// How decode reaches that arena: [`TierAccess::InProcess`] (prefill on a thread of
    /// decode's process) or [`TierAccess::Nixl`] (registered with prefill's agent).
    pub embedded: TierAccess,
    /// The address a master kvprobe starts listens on, and prefill's store client
    /// advertises: loopback in one process, else the address decode reached serve on.
    pub host: IpAddr,
    /// Set once decode ended the run or went away ([`crate::peer::Link::ended`]): a tier call
    /// waiting for the store gives up.
    pub ended: Arc<std::sync::atomic::AtomicBool>,
}

impl TierConnector {
    /// Starts the tier of `cfg` under prefill's pool `prefill` (`cfg.tier_blocks` entries of
    /// one block each) at `place`. Returns it with how decode reaches it. Errors: set-up
    /// (exit 2) for a broken Mooncake install or a missing arena, transport (exit 3) when the
    /// deployment cannot be joined.
    pub(crate) fn start(
        cfg: &ScenarioConfig,
        seed: u64,
        prefill: &KvPool,
        timeout: Duration,
        place: &TierPlace,
    ) -> Result<(TierConnector, TierAccess)> {
        if cfg.tier == TierKind::Mooncake {
            // Who started a master: decode's kvprobe (prefill on its thread), or serve.
            let by = if place.embedded == TierAccess::InProcess { "kvprobe" } else { "serve" };
            let mut mooncake = MooncakeTier::start(cfg, seed, prefill, timeout, place.host, by)?;
            mooncake.worker.set_abort(place.ended.clone());
            let access = TierAccess::Mooncake {
                master: mooncake.master.rpc(),
                metadata_url: mooncake.master.metadata_url().to_string(),
                key_prefix: mooncake.fingerprint.clone(),
            };
            Ok((
                TierConnector { store: Store::metadata_only(cfg.tier_blocks), mooncake: Some(mooncake), detail: String::new() },
                access,
            ))
        } else {
            let arena = place
                .arena
                .clone()
                .ok_or_else(|| Error::Environment("the embedded tier has no arena (the session did not make one)".into()))?;
            let detail = match place.embedded {
                TierAccess::Nixl => "embedded, in prefill's host memory; decode's tier-only loads READ it over NIXL".into(),
                _ => "embedded".into(),
            };
            Ok((TierConnector { store: Store::on(arena), mooncake: None, detail }, place.embedded.clone()))
        }
    }

    /// What the report names as the tier: "embedded" (in one process; across processes how
    /// decode reaches it), or Mooncake's version, protocol and master address.
    pub(crate) fn detail(&self) -> String {
        self.mooncake.as_ref().map_or_else(|| self.detail.clone(), |mc| mc.detail.clone())
    }

    /// Checks that a master kvprobe started is still running. Errors: transport (exit 3), with
    /// its log.
    pub(crate) fn check_master(&mut self) -> Result<()> {
        match self.mooncake.as_mut().map(|mc| &mut mc.master) {
            Some(crate::mem::mooncake::Deployment::Started(m)) => m.alive(),
            _ => Ok(()),
        }
    }

    /// A save: copies prefill block `slot` of `pool` into tier entry `entry`. Errors:
    /// transport (exit 3) when Mooncake refuses the put or its master died.
    pub(crate) fn save(&mut self, pool: &mut KvPool, slot: u32, entry: EntryId) -> Result<()> {
        let store = &mut self.store;
        match self.mooncake.as_mut() {
            None => store.save_block(entry, pool, slot),
            Some(mc) => {
                let key = mc.key(store.key_of(entry));
                let rc = mc.worker.put(0, std::slice::from_ref(&key), &[pool.block_ranges(slot)]);
                match rc {
                    Ok(rc) if rc.first() == Some(&0) => Ok(()),
                    Ok(rc) => Err(mc.explain(Error::Transport(format!("Mooncake put of {key} returned {rc:?}")))),
                    Err(e) => Err(mc.explain(e)),
                }
            }
        }
    }

    /// A load (a prefix hit): copies tier entry `entry` into prefill block `slot` of `pool`.
    /// Errors: transport (exit 3) when Mooncake returns another length or its master died.
    pub(crate) fn load(&mut self, pool: &mut KvPool, slot: u32, entry: EntryId) -> Result<()> {
        let store = &self.store;
        match self.mooncake.as_mut() {
            None => store.load_block(entry, pool, slot),
            Some(mc) => {
                let key = mc.key(store.key_of(entry));
                mc.worker.get_block(&key, pool, slot).map_err(|e| mc.explain(e))
            }
        }
    }

    /// Drops the objects of evicted tier entries from Mooncake at engine step `now`, in
    /// batches (best effort: a leftover object is never read, its key is unique to the
    /// evicted reservation). Errors: transport (exit 3) when the master died.
    pub(crate) fn drop_evicted(&mut self, now: u64) -> Result<()> {
        if let Some(mc) = self.mooncake.as_mut() {
            let evicted: Vec<String> = self.store.take_evicted().into_iter().map(|k| mc.key(k)).collect();
            mc.doomed.extend(evicted);
            if !mc.doomed.is_empty() && (mc.doomed.len() >= 64 || now.is_multiple_of(64)) {
                let keys = std::mem::take(&mut mc.doomed);
                let rc = mc.worker.remove(&keys).map_err(|e| mc.explain(e))?;
                // Objects still under a read lease are retried later.
                mc.doomed = keys.into_iter().zip(rc).filter(|(_, rc)| *rc != 0).map(|(k, _)| k).collect();
            }
        }
        Ok(())
    }

    /// At the end of a run: removes this run's objects from a Mooncake deployment kvprobe did
    /// not start (see `MooncakeTier::clean_up`).
    pub(crate) fn clean_up(&mut self) {
        if let Some(mc) = self.mooncake.as_mut() {
            mc.clean_up(&self.store);
        }
    }
}

/// Decode's side of the tier (tier-only): loads an entry prefill saved into one of decode's
/// blocks, the way [`TierAccess`] says decode reaches the store.
pub(crate) enum TierReader {
    /// The embedded store of this process: a copy from its arena.
    Direct(Arc<TierArena>),
    /// The embedded store on prefill's host: a NIXL READ of the entry's slices from the arena
    /// prefill registered ([`Endpoint::post_read_tier`]).
    Nixl,
    /// Mooncake: decode's own store client (it maps decode's pool), getting the entry's object.
    Mooncake {
        /// The store client.
        worker: crate::mem::mooncake::Worker,
        /// The run's key prefix.
        key_prefix: String,
    },
}

impl TierReader {
    /// Decode's reader for `access`; `arena` is the in-process arena ([`TierAccess::InProcess`]).
    /// Errors: set-up (exit 2) for a broken Mooncake install or a missing arena, transport
    /// (exit 3) when decode's store client cannot join the deployment.
    pub(crate) fn start(
        access: &TierAccess,
        arena: Option<Arc<TierArena>>,
        decode: &KvPool,
        timeout: Duration,
        ended: Arc<std::sync::atomic::AtomicBool>,
    ) -> Result<TierReader> {
        Ok(match access {
            // Prefill names a tier in this process only when it is a thread of it.
            TierAccess::InProcess => TierReader::Direct(arena.ok_or_else(|| {
                Error::Transport("prefill named a tier in this process, but it is not in this process (a protocol error)".into())
            })?),
            TierAccess::Nixl => TierReader::Nixl,
            TierAccess::Mooncake { master, metadata_url, key_prefix } => {
                let install = crate::mem::mooncake::find()?;
                let shared: Vec<&crate::sys::hostmem::HostBuffer> = decode.host_buffer().into_iter().collect();
                let mut worker = Worker::start(&install, timeout.max(crate::sys::deadline::SETUP_FLOOR), &shared)?;
                let ext = crate::mem::mooncake::External { master: master.clone(), metadata_url: metadata_url.clone() };
                let deployment = crate::mem::mooncake::Deployment::External(ext);
                // A pure client: decode contributes no memory to the store (the tier is prefill's).
                worker.setup(&deployment, "tcp", 0).map_err(|e| match e {
                    Error::Timeout(m) | Error::Transport(m) => Error::Transport(format!(
                        "decode's Mooncake store client could not join the master at {master} (metadata {metadata_url}): {m}"
                    )),
                    e => e,
                })?;
                map_pool(&mut worker, decode)?;
                worker.set_timeout(timeout);
                worker.set_abort(ended);
                TierReader::Mooncake { worker, key_prefix: key_prefix.clone() }
            }
        })
    }

    /// Loads each `(decode block, entry)` of `loads` into `ep`'s pool, and returns the bytes
    /// that crossed NIXL (the embedded tier on prefill's host: one READ of every slice of
    /// every entry; 0 otherwise). Errors: transport (exit 3) when the store fails a load,
    /// timeout (exit 4) past `timeout`.
    pub(crate) fn load(&mut self, ep: &mut Endpoint, loads: &[(u32, TierRef)], timeout: Duration) -> Result<u64> {
        match self {
            TierReader::Direct(arena) => {
                for (slot, entry) in loads {
                    arena.read_entry(entry.entry, |b| ep.pool.write_block_from(*slot, b))??;
                }
                Ok(0)
            }
            TierReader::Nixl => {
                let g = ep.pool.geometry().clone();
                let sb = g.slice_bytes()?;
                let block = ep.pool.block_bytes();
                let mut pairs = Vec::with_capacity(loads.len() * g.num_layers as usize * g.kv_parts() as usize);
                for (slot, entry) in loads {
                    // An entry is the block's slices back to back, in (layer, K/V) order
                    // (`KvPool::read_block`), at its slot of the arena.
                    let mut off = entry.entry as u64 * block;
                    for layer in 0..g.num_layers {
                        for &kv in g.parts() {
                            pairs.push((off, SliceCoord { layer, kv, block: *slot }, sb));
                            off += sb;
                        }
                    }
                }
                if pairs.is_empty() {
                    return Ok(0);
                }
                let mut x = ep.post_read_tier(&pairs, timeout)?;
                loop {
                    if let Some(done) = ep.poll(&mut x)? {
                        return Ok(done.bytes);
                    }
                    std::thread::yield_now();
                }
            }
            TierReader::Mooncake { worker, key_prefix } => {
                for (slot, entry) in loads {
                    let key = crate::mem::mooncake::block_key(key_prefix, entry.hash, entry.serial);
                    worker.get_block(&key, &mut ep.pool, *slot)?;
                }
                Ok(0)
            }
        }
    }
}

use crate::mem::mooncake::Worker;

/// Maps `pool` in `worker` (DRAM: its memfd; VRAM: its layer regions' CUDA IPC handles) and
/// returns how it was shared, in words.
fn map_pool(worker: &mut Worker, pool: &KvPool) -> Result<&'static str> {
    match (pool.host_buffer(), pool.ipc_handles()?) {
        (Some(buf), _) => {
            worker.map_shared(buf)?;
            Ok("a shared memory mapping (memfd)")
        }
        (None, Some((device, handles))) => {
            worker.map_cuda(device, &handles, pool.geometry().region_bytes()?)?;
            Ok("CUDA IPC handles (one per layer region)")
        }
        (None, None) => unreachable!("a pool is DRAM or VRAM"),
    }
}

/// `--tier mooncake`: the master (started by kvprobe, or an existing deployment) and
/// prefill's store client (a worker mapping prefill's pool).
pub(crate) struct MooncakeTier {
    master: crate::mem::mooncake::Deployment,
    worker: Worker,
    /// Key prefix: the seed and a run nonce (vLLM's keys lead with a config fingerprint).
    fingerprint: String,
    detail: String,
    /// Keys of evicted entries still to remove from the store.
    doomed: Vec<String>,
}

impl MooncakeTier {
    fn start(
        cfg: &ScenarioConfig,
        seed: u64,
        prefill: &KvPool,
        timeout: Duration,
        host: IpAddr,
        by: &str,
    ) -> Result<MooncakeTier> {
        use crate::mem::mooncake::{Deployment, Master};
        let install = crate::mem::mooncake::find()?;
        // The worker first: its hello imports the store client, so a broken install is a
        // set-up error (exit 2) before anything else starts.
        // Set-up calls (hello, setup, mapping the pool) get at least the set-up floor; the
        // run's calls then --timeout (crate::sys::deadline).
        let shared: Vec<&crate::sys::hostmem::HostBuffer> = prefill.host_buffer().into_iter().collect();
        let mut worker = Worker::start(&install, timeout.max(crate::sys::deadline::SETUP_FLOOR), &shared)?;
        let mut master = match &cfg.mooncake {
            Some(ext) => {
                ext.reachable(Duration::from_secs(5))?;
                Deployment::External(ext.clone())
            }
            // Start-up has its own window (the master takes about a second), whatever --timeout says.
            None => Deployment::Started(Master::start(&install, Duration::from_secs(30), host)?),
        };
        // Room for every entry the engine may hold, twice over, so Mooncake itself never evicts one.
        let segment = (cfg.tier_blocks as u64 * prefill.block_bytes()).saturating_mul(2).max(64 << 20);
        let mut connect = || -> Result<&'static str> {
            worker.setup(&master, "tcp", segment)?;
            map_pool(&mut worker, prefill)
        };
        // A master that dies while the worker connects explains the failure best; with an
        // existing deployment, name the two addresses to check. Not answering in time here is
        // a transport failure (exit 3), not a transfer timeout.
        let sharing = connect().map_err(|e| {
            let e = match e {
                Error::Timeout(m) => Error::Transport(m),
                e => e,
            };
            match explain(&mut master, e) {
                Error::Transport(m) if !master.is_started() => Error::Transport(format!(
                    "joining the Mooncake deployment failed ({m}): check that --mooncake-master {} is a mooncake_master's RPC \
                     address and --mooncake-metadata {} its metadata service",
                    master.rpc(),
                    master.metadata_url()
                )),
                e => e,
            }
        })?;
        worker.set_timeout(timeout);
        let fingerprint = format!("{:08x}-{:08x}", crate::core::fingerprint::seed32(seed), rand::rng().random::<u32>());
        // Where the store client's Transfer Engine listens (its own address only, checked by
        // Worker::setup: mooncake::BIND_SHIM), said as docs/scenarios.md "Network exposure" does.
        let exposed = crate::mem::mooncake::listening(worker.pid())
            .map(|a| a.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(", "))
            .unwrap_or_default();
        let detail = format!(
            "mooncake {} {}, tcp, master {} ({}), metadata {}, prefill's pool shared with its store client by {sharing}{}",
            install.wheel,
            install.version,
            master.rpc(),
            if master.is_started() { format!("started by {by}") } else { "existing deployment".into() },
            master.metadata_url(),
            if exposed.is_empty() { String::new() } else { format!("; its store client listens on {exposed}") }
        );
        Ok(MooncakeTier { master, worker, fingerprint, detail, doomed: Vec::new() })
    }

    /// The error to report for a failed store call `e` (see [`explain`]).
    fn explain(&mut self, e: Error) -> Error {
        explain(&mut self.master, e)
    }

    fn key(&self, (hash, serial): (u32, u64)) -> String {
        crate::mem::mooncake::block_key(&self.fingerprint, hash, serial)
    }

    /// Removes this run's objects from a store kvprobe did not start (best effort: objects
    /// still under a read lease stay until the store evicts them; their keys are unique to
    /// this run).
    fn clean_up(&mut self, store: &Store) {
        if self.master.is_started() {
            return; // the master and everything in it go with the run
        }
        let mut keys = std::mem::take(&mut self.doomed);
        keys.extend(store.live_keys().into_iter().map(|k| self.key(k)));
        for chunk in keys.chunks(1024) {
            if self.worker.remove(chunk).is_err() {
                break;
            }
        }
    }
}

/// The error to report for a failed store call `e`: the master's death (with its log) when
/// that is the cause, else `e`. A killed master is reaped a moment after its client sees the
/// connection drop, so a started master is watched for 300 ms.
fn explain(master: &mut crate::mem::mooncake::Deployment, e: Error) -> Error {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) {
        if let Err(gone) = master.alive() {
            return gone;
        }
        if !master.is_started() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    e
}
