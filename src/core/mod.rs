//! Floor core: what a KV cache is and what every byte of it must be — vLLM's paged layout
//! (geometry), a model's KV cache (model_config), the fingerprint (shared with the CUDA
//! kernels), two sides that differ (pairing), classification (verify), injections, the race
//! vocabulary and the request load. Nothing here moves or allocates a pool.

pub mod fingerprint;
pub mod geometry;
pub mod hybrid;
pub mod inject;
pub mod mechanism;
pub mod model_config;
pub mod pairing;
pub mod verify;
pub mod workload;
