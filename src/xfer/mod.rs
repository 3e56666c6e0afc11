//! Floor xfer: NIXL agents and requests, the prefill and decode transport roles, which path
//! UCX chose, and the host's RDMA NICs.

#[allow(unsafe_code)] // the NIXL C API
pub mod nixl;
pub mod rdma;
pub mod transport;
pub mod ucx;
