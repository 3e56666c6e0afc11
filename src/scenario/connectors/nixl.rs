//! The NIXL connector (vLLM's NixlConnector): decode, the kv_consumer, posts one NIXL READ of
//! every block slice of a request from prefill's blocks into its own, and the READ carries a
//! notification that tells prefill, the kv_producer, that its blocks may be freed.
//!
//! Descriptors follow the NixlConnector's per-block layout: one descriptor per (layer, K/V
//! part, block), the block's slice `[num_layers][2][num_blocks][block_size, num_kv_heads,
//! head_size]` in each layer's region (`geometry`). Notifications are tagged with a prefix
//! unique to the engine and the request id, so a late notification of an earlier run in the
//! same process is never taken for this one's.

use crate::core::geometry::{Geometry, SliceCoord};
use crate::error::Result;
use crate::xfer::nixl::Posted;
use crate::xfer::transport::{Endpoint, Pair};
use rand::Rng;
use std::time::Duration;

/// The NIXL connector of one scenario run (one on each engine, sharing the prefix).
pub(crate) struct NixlConnector {
    /// Prefix of this run's notification messages.
    tag: String,
}

impl NixlConnector {
    /// Decode's connector, with a fresh notification prefix (prefill learns it from
    /// [`crate::peer::steps::Begin::tag`]).
    pub(crate) fn new() -> NixlConnector {
        NixlConnector { tag: format!("kvprobe:{:016x}:req=", rand::rng().random::<u64>()) }
    }

    /// Prefill's connector for decode's prefix `tag`.
    pub(crate) fn with_tag(tag: &str) -> NixlConnector {
        NixlConnector { tag: tag.to_string() }
    }

    /// The prefix of this run's notification messages.
    pub(crate) fn tag(&self) -> &str {
        &self.tag
    }

    /// The descriptor pairs of one request's READ: for each layer and K/V part, prefill block
    /// `src[i]` into decode block `dst[i]`, a whole block slice each. Errors: a geometry whose
    /// slice size does not fit (usage).
    pub(crate) fn read_pairs(g: &Geometry, src: &[u32], dst: &[u32]) -> Result<Vec<Pair>> {
        let len = g.slice_bytes()?;
        let mut pairs = Vec::with_capacity(src.len() * g.num_layers as usize * g.kv_parts() as usize);
        for layer in 0..g.num_layers {
            for &kv in g.parts() {
                for (&s, &d) in src.iter().zip(dst) {
                    pairs.push(Pair::slice(SliceCoord { layer, kv, block: s }, SliceCoord { layer, kv, block: d }, len));
                }
            }
        }
        Ok(pairs)
    }

    /// Posts request `id`'s READ of `pairs` on decode's endpoint; `timeout` bounds it from
    /// now. With `notify` it carries the request's notification (prefill frees its blocks on
    /// it); without, a message prefill takes for no request's (`<prefix><id>:failed`): the
    /// READ stands for a transfer whose failure a fenced connector reports, which notifies
    /// no one. Errors: transport (exit 3), timeout (exit 4).
    pub(crate) fn post_read(
        &self,
        decode: &mut Endpoint,
        pairs: &[Pair],
        id: u64,
        notify: bool,
        timeout: Duration,
    ) -> Result<Posted> {
        let msg = if notify { format!("{}{id}", self.tag) } else { format!("{}{id}:failed", self.tag) };
        decode.post_read(pairs, &msg, timeout)
    }

    /// The request a notification message on prefill is for, when it is this run's.
    pub(crate) fn request_of(&self, msg: &str) -> Option<u64> {
        msg.strip_prefix(self.tag.as_str()).and_then(|s| s.parse::<u64>().ok())
    }
}
