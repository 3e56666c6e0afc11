//! The tier connector (kv_both): vLLM's MooncakeStoreConnector over a KV-tier store. The
//! scheduler asks it for the prompt's leading block hashes (lookup), the engines load hits
//! into prefill or decode blocks (load) and save computed blocks (save).
//!
//! The store is the built-in one ([`Store`], host memory; `--tier embedded`) or a real
//! Mooncake Store (`--tier mooncake`: a master kvprobe starts or an existing deployment, and
//! the Python store client as a worker that maps both pools, [`crate::mooncake`]); with
//! Mooncake, [`Store`] keeps only the index (keys, pins, evictions and each entry's shadow
//! content) and the bytes live in Mooncake.

use crate::error::{Error, Result};
use crate::pool::KvPool;
use crate::scenario::config::ScenarioConfig;
use crate::tier::{EntryId, Store, TierKind};
use rand::Rng;
use std::time::{Duration, Instant};

/// The tier under the connectors: the store's index and, for `--tier mooncake`, the
/// deployment holding the bytes.
pub(crate) struct TierConnector {
    /// Entries by block hash: keys, pins, evictions and what each entry holds.
    pub(crate) store: Store,
    /// `--tier mooncake`: the master and the store worker (dropped with the connector).
    mooncake: Option<MooncakeTier>,
}

/// Which pool a load writes into, as the store worker numbers the pools it maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PoolSide {
    /// Pool 0.
    Prefill,
    /// Pool 1.
    Decode,
}

impl TierConnector {
    /// Starts the tier of `cfg` for the two pools (`cfg.tier_blocks` entries of one block
    /// each). Errors: set-up (exit 2) for a broken Mooncake install, transport (exit 3) when
    /// the deployment cannot be joined, device for the embedded store's pinned buffers.
    pub(crate) fn start(
        cfg: &ScenarioConfig,
        seed: u64,
        prefill: &KvPool,
        decode: &KvPool,
        timeout: Duration,
    ) -> Result<TierConnector> {
        if cfg.tier == TierKind::Mooncake {
            let mooncake = MooncakeTier::start(cfg, seed, prefill, decode, timeout)?;
            Ok(TierConnector { store: Store::metadata_only(cfg.tier_blocks, prefill.block_bytes()), mooncake: Some(mooncake) })
        } else {
            Ok(TierConnector {
                store: Store::new(cfg.tier_blocks, prefill.block_bytes(), prefill.gpu().as_ref())?,
                mooncake: None,
            })
        }
    }

    /// What the report names as the tier: "embedded", or Mooncake's version, protocol and
    /// master address.
    pub(crate) fn detail(&self) -> String {
        self.mooncake.as_ref().map_or_else(|| "embedded".into(), |mc| mc.detail.clone())
    }

    /// Checks that a master kvprobe started is still running. Errors: transport (exit 3), with
    /// its log.
    pub(crate) fn check_master(&mut self) -> Result<()> {
        match self.mooncake.as_mut().map(|mc| &mut mc.master) {
            Some(crate::mooncake::Deployment::Started(m)) => m.alive(),
            _ => Ok(()),
        }
    }

    /// A save: copies prefill block `slot` of `pool` into tier entry `entry`. Errors:
    /// transport (exit 3) when Mooncake refuses the put or its master died.
    pub(crate) fn save(&mut self, pool: &mut KvPool, slot: u32, entry: EntryId) -> Result<()> {
        let store = &mut self.store;
        match self.mooncake.as_mut() {
            None => pool.read_block(slot, store.bytes_mut(entry)),
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

    /// A load: copies tier entry `entry` into block `slot` of `pool`, the `side` pool. Errors:
    /// transport (exit 3) when Mooncake returns another length or its master died.
    pub(crate) fn load(&mut self, pool: &mut KvPool, side: PoolSide, slot: u32, entry: EntryId) -> Result<()> {
        let store = &self.store;
        match self.mooncake.as_mut() {
            None => pool.write_block(slot, store.bytes(entry)),
            Some(mc) => {
                let key = mc.key(store.key_of(entry));
                let want = pool.block_bytes() as i64;
                let index = if side == PoolSide::Prefill { 0 } else { 1 };
                match mc.worker.get(index, std::slice::from_ref(&key), &[pool.block_ranges(slot)]) {
                    Ok(rc) if rc.first() == Some(&want) => Ok(()),
                    Ok(rc) => {
                        Err(mc
                            .explain(Error::Transport(format!("Mooncake get of {key} returned {rc:?} (expected {want} bytes)"))))
                    }
                    Err(e) => Err(mc.explain(e)),
                }
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

/// `--tier mooncake`: the master (started by kvprobe, or an existing deployment) and a store
/// worker mapping both pools (prefill = pool 0, decode = pool 1).
pub(crate) struct MooncakeTier {
    master: crate::mooncake::Deployment,
    worker: crate::mooncake::Worker,
    /// Key prefix: the seed and a run nonce (vLLM's keys lead with a config fingerprint).
    fingerprint: String,
    detail: String,
    /// Keys of evicted entries still to remove from the store.
    doomed: Vec<String>,
}

impl MooncakeTier {
    fn start(cfg: &ScenarioConfig, seed: u64, prefill: &KvPool, decode: &KvPool, timeout: Duration) -> Result<MooncakeTier> {
        use crate::mooncake::{Deployment, Master, Worker};
        let install = crate::mooncake::find()?;
        // The worker first: its hello imports the store client, so a broken install is a
        // set-up error (exit 2) before anything else starts.
        // Set-up calls (hello, setup, mapping the pools) get at least the set-up floor; the
        // run's calls then --timeout (crate::deadline).
        let shared: Vec<&crate::hostmem::HostBuffer> = [prefill, decode].into_iter().filter_map(|p| p.host_buffer()).collect();
        let mut worker = Worker::start(&install, timeout.max(crate::deadline::SETUP_FLOOR), &shared)?;
        let mut master = match &cfg.mooncake {
            Some(ext) => {
                ext.reachable(Duration::from_secs(5))?;
                Deployment::External(ext.clone())
            }
            // Start-up has its own window (the master takes about a second), whatever --timeout says.
            None => Deployment::Started(Master::start(&install, Duration::from_secs(30))?),
        };
        // Room for every entry the engine may hold, twice over, so Mooncake itself never evicts one.
        let segment = (cfg.tier_blocks as u64 * prefill.block_bytes()).saturating_mul(2).max(64 << 20);
        let mut connect = || -> Result<&'static str> {
            worker.setup(&master, "tcp", segment)?;
            let mut sharing = "a shared memory mapping (memfd)";
            for pool in [prefill, decode] {
                match (pool.host_buffer(), pool.ipc_handles()?) {
                    (Some(buf), _) => worker.map_shared(buf)?,
                    (None, Some((device, handles))) => {
                        worker.map_cuda(device, &handles, pool.geometry().region_bytes()?)?;
                        sharing = "CUDA IPC handles (one per layer region)";
                    }
                    (None, None) => unreachable!("a pool is DRAM or VRAM"),
                }
            }
            Ok(sharing)
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
        let fingerprint = format!("{:08x}-{:08x}", crate::fingerprint::seed32(seed), rand::rng().random::<u32>());
        let detail = format!(
            "mooncake {} {}, tcp, master {} ({}), metadata {}, pools shared with the store client by {sharing}",
            install.wheel,
            install.version,
            master.rpc(),
            if master.is_started() { "started by kvprobe" } else { "existing deployment" },
            master.metadata_url()
        );
        Ok(MooncakeTier { master, worker, fingerprint, detail, doomed: Vec::new() })
    }

    /// The error to report for a failed store call `e` (see [`explain`]).
    fn explain(&mut self, e: Error) -> Error {
        explain(&mut self.master, e)
    }

    fn key(&self, (hash, serial): (u32, u64)) -> String {
        crate::mooncake::block_key(&self.fingerprint, hash, serial)
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
fn explain(master: &mut crate::mooncake::Deployment, e: Error) -> Error {
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
