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

/// Bytes of host memory this process may still allocate: the smaller of `MemAvailable`
/// (/proc/meminfo) and the headroom of its memory cgroup (v2 `memory.max - memory.current`,
/// v1 `memory.limit_in_bytes - memory.usage_in_bytes`), when known.
pub fn available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok()?.checked_mul(1024)
    });
    match (meminfo, cgroup_headroom()) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn read_u64(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn cgroup_headroom() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut best: Option<u64> = None;
    for line in own.lines() {
        let mut f = line.splitn(3, ':');
        let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
        let (limit, usage) = if ctrl.is_empty() {
            (format!("/sys/fs/cgroup{path}/memory.max"), format!("/sys/fs/cgroup{path}/memory.current"))
        } else if ctrl.split(',').any(|c| c == "memory") {
            (
                format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"),
                format!("/sys/fs/cgroup/memory{path}/memory.usage_in_bytes"),
            )
        } else {
            continue;
        };
        // "max" (v2) or a huge number (v1) means no limit: read_u64 fails or the min ignores it.
        if let Some(l) = read_u64(&limit) {
            let room = l.saturating_sub(read_u64(&usage).unwrap_or(0));
            best = Some(best.map_or(room, |b| b.min(room)));
        }
    }
    best
}
