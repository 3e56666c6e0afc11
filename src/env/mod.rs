//! Floor env: the environment a run records (GPUs, driver, NIXL, Mooncake, RDMA, the path UCX
//! picks).

pub mod envinfo;
