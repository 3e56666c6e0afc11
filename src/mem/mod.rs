//! Floor mem: the KV cache pools on VRAM or DRAM, the KV tier, and Mooncake Store.

pub mod mooncake;
pub mod pool;
pub mod tier;
