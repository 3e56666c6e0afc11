//! Page-aligned host memory for DRAM pools: the only module with host-memory `unsafe`.
//!
//! Regions are anonymous shared mappings (`mmap`), page-aligned so NIXL/UCX can register
//! them, and zero-filled by the kernel on first touch.

use crate::error::{Error, Result};

/// An anonymous shared mapping of `len` bytes, unmapped on drop.
#[derive(Debug)]
pub struct HostBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; access goes through &/&mut.
unsafe impl Send for HostBuffer {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Maps `len` bytes. Errors: the kernel refused the mapping (out of memory).
    pub fn alloc(len: usize) -> Result<HostBuffer> {
        let n = len.max(1);
        // SAFETY: a fresh anonymous mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), n, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(Error::Environment(format!(
                "cannot map {len} bytes of host memory: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(HostBuffer { ptr: p as *mut u8, len })
    }

    /// Start address (for NIXL descriptors).
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when zero-length.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` readable bytes for the lifetime of self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` maps `len` writable bytes; &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping created in `alloc`, once.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len.max(1)) };
    }
}

/// Bytes of host memory available to allocate (`MemAvailable` in /proc/meminfo), if known.
pub fn available_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}
