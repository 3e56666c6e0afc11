//! kvprobe's integration tests, one module per area. Tests that need a GPU skip with a
//! named reason where none is present (set KVPROBE_REQUIRE_GPU=1 to make them fail
//! instead); tests of real NIXL need the libraries from scripts/install-deps.sh.

mod common;

mod bench;
mod cli;
mod dram;
mod dump;
mod fingerprint;
mod geometry;
mod gpu;
mod inspect;
mod junit;
mod lanes;
mod limits;
mod mooncake;
mod scenario;
mod setup;
mod stray;
mod timeout;
mod units;
