//! Request-level load on the two pools (`kvprobe run --scenario`, `kvprobe ab`): a prefill
//! engine with a KV tier, a decode engine pulling over NIXL, and the race mechanisms between
//! them, in the parts a vLLM reader expects to find:
//!
//! - [`config`]: the scenario's parameters and the live progress counters (types only);
//! - [`scheduler`]: requests and their states on each engine, prefill's block manager (free
//!   list, owners, pending writes and READs, the early list) and decode's free list (vLLM's
//!   `Scheduler` and `KVCacheManager`);
//! - [`connectors`]: the NIXL connector (kv_producer / kv_consumer), the tier connector
//!   (kv_both: the embedded store or Mooncake; decode's reader for tier-only loads) and the
//!   multi-connector that counts a request's completions and decides when its blocks are
//!   freed;
//! - [`shadow`]: what every prefill block holds, the READ windows, and the attribution of
//!   each corrupt slice decode finds; it learns all of it from the engines' events, each
//!   stamped with the engine, its step and its sequence number;
//! - [`prefill`]: the prefill engine (scheduler, connectors, its pool), hosted by `kvprobe
//!   serve` — on another host, in a child, or on a thread of decode's process;
//! - [`decode`]: the decode engine (READs, tier-only loads, verification against the shadow)
//!   and the loop that couples it to the prefill engine one step at a time over the peer
//!   protocol ([`crate::peer::steps`]): the two engines talk only by messages;
//! - [`state`]: a hybrid model's recurrent state, one slot per request on each engine, moved
//!   with the request's blocks;
//! - [`fault`]: test-only damage that no race can produce.
//!
//! Types flow one way inside: config → scheduler → connectors → shadow → prefill, decode.

pub mod config;
pub mod connectors;
pub mod decode;
pub mod fault;
pub mod prefill;
pub mod scheduler;
pub mod shadow;
pub mod state;
