//! The connectors that move a scenario's KV blocks, one module each, as vLLM's v1 KV
//! connectors are (vllm/distributed/kv_transfer/kv_connector/v1/):
//!
//! - [`nixl`]: the NIXL connector — kv_producer on prefill (its blocks are read, it is told
//!   by a NIXL notification when a READ is done), kv_consumer on decode (posts one READ of
//!   every block slice of a request);
//! - [`tier`]: the tier connector (kv_both, vLLM's MooncakeStoreConnector) — lookup of the
//!   prompt's leading block hashes, loads of hits, saves of computed blocks, on the embedded
//!   store or a real Mooncake Store;
//! - [`multi`]: the multi-connector (vLLM's MultiConnector) over the two in the stacked
//!   scenario: it counts each request's completions and decides when prefill may free its
//!   blocks — where free-on-first-completion lives.
//!
//! Each connector is a role the engines call; none of them owns requests or blocks (the
//! scheduler does).

pub mod multi;
pub mod nixl;
pub mod tier;
