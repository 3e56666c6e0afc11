//! Floor gpu: CUDA devices, memory and the fingerprint kernels (NVRTC at run time).

#[allow(unsafe_code)] // the CUDA driver API
pub mod cuda;
