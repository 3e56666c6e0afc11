//! kvprobe's integration tests, one module per area. Tests that need a GPU skip with a
//! named reason where none is present (set KVPROBE_REQUIRE_GPU=1 to make them fail
//! instead); tests of real NIXL need the libraries from scripts/install-deps.sh.

// Tests start kvprobe and helper commands directly (clippy.toml steers src/ to kvprobe::child).
#![allow(clippy::disallowed_methods)]

mod common;

mod bench;
mod capture;
mod cli;
mod docker;
mod dram;
mod dump;
mod fingerprint;
mod geometry;
mod gpu;
mod hetero;
mod house;
mod hybrid;
mod inspect;
mod junit;
mod lanes;
mod limits;
mod model_config;
mod mooncake;
mod pair;
mod peer_auth;
mod rdma;
mod redact;
mod regions;
mod scenario;
mod setup;
mod stray;
mod timeout;
mod units;
mod xfer;
