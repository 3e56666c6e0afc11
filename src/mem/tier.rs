//! The built-in KV tier (`--tier embedded`): a block store keyed by block hash, modelled
//! on vLLM's MooncakeStoreConnector (one store object per full block, key = block hash).
//!
//! Entries live in one host arena of `capacity` block-sized slots (page-locked for VRAM
//! pools); an entry is the block's slices back to back in (layer, K/V) order
//! ([`crate::mem::pool::KvPool::read_block`]). A put first reserves an entry (invisible to
//! lookups) and fills it when the save executes; lookups see only complete entries.
//! Entries in use by a pending load or save are pinned; a reservation evicts the least
//! recently used unpinned entry when the arena is full.
//!
//! Besides the bytes, each entry records what the engine believes it holds
//! ([`Content`]): the identity its key promises and the identity actually copied in, so a
//! save that copied the wrong block is attributable when a later load delivers it.

use crate::core::mechanism::Mechanism;
use crate::error::{Error, Result};
use crate::mem::pool::TableEntry;
use crate::sys::hostmem::{HostBuffer, Span, SpanMut};
use std::collections::HashMap;

/// The KV tier under the connectors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TierKind {
    /// The built-in store (src/mem/tier.rs): block-hash keyed entries in host memory.
    Embedded,
    /// A real Mooncake Store (master started by kvprobe, or `--mooncake-master`; Python store
    /// client as a worker) on DRAM or VRAM pools.
    Mooncake,
}

/// What a block (pool slot or tier entry) holds, as far as the engine's own operations go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Content {
    /// Logical block and generation of the fingerprint written there.
    pub id: TableEntry,
    /// The unfenced mechanism whose operation put it there, if one did.
    pub cause: Option<Mechanism>,
}

/// One stored block.
#[derive(Clone, Copy, Debug)]
struct Entry {
    /// Unique per reservation: names the object in an external store.
    serial: u64,
    /// The identity the key promises (what the saving request computed).
    promised: TableEntry,
    /// What was actually copied in (None while the put is pending).
    content: Option<Content>,
    pins: u32,
    last_use: u64,
}

/// The embedded tier's bytes: `capacity` entries of `block_bytes` each, back to back, in host
/// memory (page-locked for VRAM pools, so copies to and from the GPU run at full rate).
/// Shared (`Arc`) by the store that fills it and, in one process, by decode's tier reader
/// (`kvprobe run --scenario tier-only` with prefill on a thread); across processes prefill
/// registers it with its NIXL agent and decode READs entries from it
/// ([`crate::xfer::transport::Endpoint::register_tier`]), so UCX's progress thread may read any
/// entry while kvprobe copies into another. The memory is therefore a [`HostBuffer`], which
/// hands out no Rust reference (a `&mut [u8]` over the arena would assert that nothing else
/// touches any of its bytes): callers get one entry at a time as a [`Span`] or [`SpanMut`]
/// ([`TierArena::read_entry`], [`TierArena::write_entry`]), under the arena's lock. The entry
/// a remote READ is reading is pinned by its pending load (the store evicts and refills only
/// unpinned entries), so no copy writes bytes a transfer is reading.
pub struct TierArena {
    mem: std::sync::Mutex<ArenaMem>,
    addr: u64,
    block_bytes: usize,
    capacity: u32,
}

enum ArenaMem {
    Host(HostBuffer),
    Pinned(crate::gpu::cuda::PinnedHost),
}

impl ArenaMem {
    fn buffer(&self) -> &HostBuffer {
        match self {
            ArenaMem::Host(b) => b,
            ArenaMem::Pinned(p) => p.buffer(),
        }
    }

    fn buffer_mut(&mut self) -> &mut HostBuffer {
        match self {
            ArenaMem::Host(b) => b,
            ArenaMem::Pinned(p) => p.buffer_mut(),
        }
    }
}

impl TierArena {
    /// An arena of `capacity` entries of `block_bytes` each (`block_bytes` = a block's
    /// slices back to back, [`crate::mem::pool::KvPool::block_bytes`]), page-locked for `device`
    /// when given. Errors: usage (exit 2) when it does not fit in the host memory available;
    /// device when it cannot be page-locked.
    pub fn new(capacity: u32, block_bytes: u64, device: Option<&std::sync::Arc<crate::gpu::cuda::Device>>) -> Result<TierArena> {
        let bytes = (capacity as u64).checked_mul(block_bytes).ok_or_else(|| Error::Usage("tier size overflows".into()))?;
        if let Some(avail) = crate::sys::hostmem::available_bytes()
            && bytes > avail
        {
            return Err(Error::Usage(format!(
                "the tier of {capacity} blocks needs {} of host memory; {} are available (lower --tier-blocks)",
                crate::sys::units::bytes_exact(bytes),
                crate::sys::units::bytes_exact(avail)
            )));
        }
        let buf = HostBuffer::alloc(bytes as usize)?;
        let addr = buf.addr();
        let mem = match device {
            Some(d) => ArenaMem::Pinned(crate::gpu::cuda::PinnedHost::new(d, buf)?),
            None => ArenaMem::Host(buf),
        };
        Ok(TierArena { mem: std::sync::Mutex::new(mem), addr, block_bytes: block_bytes as usize, capacity })
    }

    /// Entries it holds.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Bytes of one entry.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes as u64
    }

    /// Its memory: (start address, bytes), for NIXL registration.
    pub fn region(&self) -> (u64, u64) {
        (self.addr, self.capacity as u64 * self.block_bytes as u64)
    }

    /// Byte offset of entry `id` from the arena's start.
    pub fn entry_offset(&self, id: EntryId) -> u64 {
        id as u64 * self.block_bytes as u64
    }

    /// Calls `f` with entry `id`'s bytes for reading, the arena locked. Errors (usage): `id`
    /// is past the capacity (a caller's bug: entry ids come from the store).
    pub fn read_entry<R>(&self, id: EntryId, f: impl FnOnce(Span<'_>) -> R) -> Result<R> {
        let off = self.offset_of(id)?;
        let m = self.mem.lock().unwrap_or_else(|p| p.into_inner());
        Ok(f(m.buffer().span(off, self.block_bytes)?))
    }

    /// Calls `f` with entry `id`'s bytes for writing (entry `id` only: no other entry is
    /// covered), the arena locked. Errors (usage): `id` is past the capacity.
    pub fn write_entry<R>(&self, id: EntryId, f: impl FnOnce(SpanMut<'_>) -> R) -> Result<R> {
        let off = self.offset_of(id)?;
        let mut m = self.mem.lock().unwrap_or_else(|p| p.into_inner());
        Ok(f(m.buffer_mut().span_mut(off, self.block_bytes)?))
    }

    fn offset_of(&self, id: EntryId) -> Result<usize> {
        (id as usize)
            .checked_mul(self.block_bytes)
            .ok_or_else(|| Error::Usage(format!("tier entry {id} is past the arena's {} entries", self.capacity)))
    }
}

/// The embedded store.
pub struct Store {
    /// The bytes: `None` when they live elsewhere (Mooncake Store) and this store keeps only
    /// the metadata.
    arena: Option<std::sync::Arc<TierArena>>,
    capacity: u32,
    entries: Vec<Option<(u32, Entry)>>,
    by_hash: HashMap<u32, u32>,
    free: Vec<u32>,
    tick: u64,
    /// Saves skipped because every entry was pinned.
    pub full_skips: u64,
    /// Entries evicted.
    pub evictions: u64,
    serials: u64,
    evicted: Vec<(u32, u64)>,
}

/// Index of an entry in the store.
pub type EntryId = u32;

impl Store {
    /// A store of `capacity` entries of `block_bytes` each in a new arena, page-locked for
    /// `device` when given. Errors: as [`TierArena::new`].
    pub fn new(capacity: u32, block_bytes: u64, device: Option<&std::sync::Arc<crate::gpu::cuda::Device>>) -> Result<Store> {
        Ok(Store::on(std::sync::Arc::new(TierArena::new(capacity, block_bytes, device)?)))
    }

    /// An empty store over `arena`'s entries (whatever they hold is never read before a save
    /// fills it: only complete entries are looked up).
    pub fn on(arena: std::sync::Arc<TierArena>) -> Store {
        let capacity = arena.capacity();
        Store::with_arena(Some(arena), capacity)
    }

    fn with_arena(arena: Option<std::sync::Arc<TierArena>>, capacity: u32) -> Store {
        Store {
            arena,
            capacity,
            entries: vec![None; capacity as usize],
            by_hash: HashMap::new(),
            free: (0..capacity).rev().collect(),
            tick: 0,
            full_skips: 0,
            evictions: 0,
            serials: 0,
            evicted: Vec::new(),
        }
    }

    /// A store that keeps only the metadata of `capacity` entries; the bytes live in an
    /// external store (Mooncake), named by [`Store::key_of`].
    pub fn metadata_only(capacity: u32) -> Store {
        Store::with_arena(None, capacity)
    }

    /// The arena holding the entries' bytes (`None` for a metadata-only store).
    pub fn arena(&self) -> Option<&std::sync::Arc<TierArena>> {
        self.arena.as_ref()
    }

    /// The block hash and reservation serial of entry `id` (the pair is unique for the life
    /// of the store: a hash saved again after eviction gets a new serial).
    pub fn key_of(&self, id: EntryId) -> (u32, u64) {
        let (hash, e) = self.entries[id as usize].as_ref().expect("live entry");
        (*hash, e.serial)
    }

    /// `(block hash, serial)` of every entry held (complete or pending).
    pub fn live_keys(&self) -> Vec<(u32, u64)> {
        self.entries.iter().flatten().map(|(h, e)| (*h, e.serial)).collect()
    }

    /// `(block hash, serial)` of the entries evicted since the last call (to drop from an
    /// external store).
    pub fn take_evicted(&mut self) -> Vec<(u32, u64)> {
        std::mem::take(&mut self.evicted)
    }

    /// Entries the store holds at most.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    fn entry(&self, id: EntryId) -> &Entry {
        &self.entries[id as usize].as_ref().expect("live entry").1
    }

    fn entry_mut(&mut self, id: EntryId) -> &mut Entry {
        &mut self.entries[id as usize].as_mut().expect("live entry").1
    }

    /// True when `hash` has an entry (complete or pending).
    pub fn contains(&self, hash: u32) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// The entry of `hash`, complete or pending.
    pub fn find(&self, hash: u32) -> Option<EntryId> {
        self.by_hash.get(&hash).copied()
    }

    /// The longest run of leading `hashes` with complete entries; pins and returns them
    /// (batch_is_exist, then the loads).
    pub fn lookup_prefix(&mut self, hashes: &[u32]) -> Vec<EntryId> {
        let mut out = Vec::new();
        for h in hashes {
            match self.by_hash.get(h) {
                Some(&id) if self.entry(id).content.is_some() => out.push(id),
                _ => break,
            }
        }
        for &id in &out {
            self.pin(id);
        }
        out
    }

    /// Pins an entry (not evicted until unpinned).
    pub fn pin(&mut self, id: EntryId) {
        self.tick += 1;
        let t = self.tick;
        let e = self.entry_mut(id);
        e.pins += 1;
        e.last_use = t;
    }

    /// Releases one pin.
    pub fn unpin(&mut self, id: EntryId) {
        let e = self.entry_mut(id);
        e.pins = e.pins.saturating_sub(1);
    }

    /// Reserves a pinned, pending entry for `hash` (promising `promised`); `None` when
    /// `hash` is already stored or pending, or every entry is pinned (counted in
    /// [`Store::full_skips`]).
    pub fn reserve(&mut self, hash: u32, promised: TableEntry) -> Option<EntryId> {
        if self.contains(hash) {
            return None;
        }
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let victim = self
                    .entries
                    .iter()
                    .enumerate()
                    .filter_map(|(i, e)| {
                        e.as_ref().filter(|(_, e)| e.pins == 0 && e.content.is_some()).map(|(_, e)| (e.last_use, i))
                    })
                    .min()
                    .map(|(_, i)| i as u32);
                let Some(v) = victim else {
                    self.full_skips += 1;
                    return None;
                };
                let (h, old) = self.entries[v as usize].take().expect("victim is live");
                self.by_hash.remove(&h);
                self.evicted.push((h, old.serial));
                self.evictions += 1;
                v
            }
        };
        self.tick += 1;
        self.serials += 1;
        self.entries[id as usize] =
            Some((hash, Entry { serial: self.serials, promised, content: None, pins: 1, last_use: self.tick }));
        self.by_hash.insert(hash, id);
        Some(id)
    }

    /// The identity entry `id`'s key promises.
    pub fn promised(&self, id: EntryId) -> TableEntry {
        self.entry(id).promised
    }

    /// What entry `id` holds (None while its put is pending).
    pub fn content(&self, id: EntryId) -> Option<Content> {
        self.entry(id).content
    }

    /// Marks a reserved entry's put done: it holds `content` (bytes already copied with
    /// [`Store::save_block`]) and becomes visible to lookups.
    pub fn complete(&mut self, id: EntryId, content: Content) {
        self.entry_mut(id).content = Some(content);
    }

    /// A save into the embedded arena: copies block `slot` of `pool` into entry `id`. Errors:
    /// usage for a metadata-only store (its bytes live in Mooncake) or an entry past the
    /// capacity; the pool's copy errors.
    pub fn save_block(&self, id: EntryId, pool: &crate::mem::pool::KvPool, slot: u32) -> Result<()> {
        match &self.arena {
            Some(a) => a.write_entry(id, |e| pool.read_block_into(slot, e))?,
            None => Err(Error::Usage("a metadata-only store holds no bytes".into())),
        }
    }

    /// A load from the embedded arena: copies entry `id` into block `slot` of `pool`. Errors:
    /// as [`Store::save_block`].
    pub fn load_block(&self, id: EntryId, pool: &mut crate::mem::pool::KvPool, slot: u32) -> Result<()> {
        match &self.arena {
            Some(a) => a.read_entry(id, |e| pool.write_block_from(slot, e))?,
            None => Err(Error::Usage("a metadata-only store holds no bytes".into())),
        }
    }

    /// Complete entries.
    pub fn len(&self) -> usize {
        self.entries.iter().flatten().filter(|(_, e)| e.content.is_some()).count()
    }

    /// True when no entry is complete.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
