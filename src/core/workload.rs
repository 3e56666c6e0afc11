//! Seeded request load: prompts as chains of block hashes, with shared prefixes.
//!
//! Each request's prompt is `n` full blocks (`n` uniform in `[min_blocks, max_blocks]`).
//! Block `i`'s logical id is a chained hash of the previous block's id and block `i`'s
//! tokens, as vLLM's prefix cache hashes full blocks (`hash(parent_hash, token_ids)`), so
//! a request that extends an earlier prompt shares that prompt's leading block ids and can
//! hit them in a KV tier. Tokens are not materialised: a fresh block's tokens are a
//! random 64-bit draw. Everything follows from the seed.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::collections::VecDeque;

/// Shape of the load.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct WorkloadConfig {
    /// Fewest blocks in a prompt (≥ 1).
    pub min_blocks: u32,
    /// Most blocks in a prompt (≥ `min_blocks`).
    pub max_blocks: u32,
    /// Share of requests, 0..=1, that extend an earlier request's prompt.
    pub prefix_share: f64,
    /// Share of requests, 0..=1, aborted right after their prefill was issued.
    pub abort_rate: f64,
}

/// One request as the client sends it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestSpec {
    /// Sequence number from 0.
    pub id: u64,
    /// Logical block id of each prompt block (chained hashes).
    pub hashes: Vec<u32>,
    /// Leading blocks shared with an earlier request's prompt.
    pub shared: usize,
    /// The client aborts this request right after its prefill is issued.
    pub abort: bool,
}

/// How many recent prompts a new request may extend.
const RECENT: usize = 64;

/// The next block's id: SplitMix64's finaliser over (parent id, tokens), folded to 32 bits.
pub fn chain_hash(parent: u32, tokens: u64) -> u32 {
    let mut z = tokens ^ ((parent as u64) << 32 | parent as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z ^ (z >> 32)) as u32
}

/// A seeded stream of requests.
pub struct Workload {
    cfg: WorkloadConfig,
    rng: ChaCha8Rng,
    recent: VecDeque<Vec<u32>>,
    next_id: u64,
}

impl Workload {
    /// A stream for `cfg`, reproducible from `seed`.
    pub fn new(cfg: WorkloadConfig, seed: u64) -> Workload {
        Workload { cfg, rng: ChaCha8Rng::seed_from_u64(seed ^ 0x6B76_7072_6F62_6521), recent: VecDeque::new(), next_id: 0 }
    }

    /// The next request.
    pub fn next_request(&mut self) -> RequestSpec {
        let n = self.rng.random_range(self.cfg.min_blocks..=self.cfg.max_blocks) as usize;
        let mut hashes: Vec<u32> = Vec::with_capacity(n);
        let mut shared = 0;
        if !self.recent.is_empty() && self.rng.random_bool(self.cfg.prefix_share.clamp(0.0, 1.0)) {
            let base = &self.recent[self.rng.random_range(0..self.recent.len())];
            shared = self.rng.random_range(1..=base.len().min(n));
            hashes.extend_from_slice(&base[..shared]);
        }
        while hashes.len() < n {
            let parent = hashes.last().copied().unwrap_or(0x6B76_7000);
            hashes.push(chain_hash(parent, self.rng.random()));
        }
        let abort = self.rng.random_bool(self.cfg.abort_rate.clamp(0.0, 1.0));
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(hashes.clone());
        let id = self.next_id;
        self.next_id += 1;
        RequestSpec { id, hashes, shared, abort }
    }
}
