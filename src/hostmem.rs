//! Page-aligned host memory for DRAM pools: the only module with host-memory `unsafe`.
//!
//! Regions are anonymous shared mappings (`mmap`), page-aligned so NIXL/UCX can register
//! them, and zero-filled by the kernel on first touch.

use crate::error::{Error, Result};

/// An anonymous shared mapping of `len` bytes, unmapped on drop. A buffer from
/// [`HostBuffer::alloc_shareable`] is backed by a memfd that child processes inherit, so a
/// helper process (the Mooncake worker) can map the same pages.
#[derive(Debug)]
pub struct HostBuffer {
    ptr: *mut u8,
    len: usize,
    fd: Option<std::os::fd::OwnedFd>,
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
                "cannot map {} of host memory: {}",
                crate::report::bytes_exact(len as u64),
                std::io::Error::last_os_error()
            )));
        }
        Ok(HostBuffer { ptr: p as *mut u8, len, fd: None })
    }

    /// Maps `len` bytes backed by a memfd that is inherited by child processes (no
    /// close-on-exec): a child maps the same pages through `/proc/self/fd/N`
    /// ([`HostBuffer::shared_fd`]). Errors: memfd_create, ftruncate or mmap failed.
    pub fn alloc_shareable(len: usize) -> Result<HostBuffer> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let n = len.max(1);
        let err = |what: &str| Error::Environment(format!("{what} ({len} bytes): {}", std::io::Error::last_os_error()));
        // SAFETY: the name is a valid NUL-terminated string; flags 0 (no MFD_CLOEXEC) so
        // that children inherit the descriptor.
        let raw = unsafe { libc::memfd_create(c"kvprobe-pool".as_ptr(), 0) };
        if raw < 0 {
            return Err(err("memfd_create"));
        }
        // SAFETY: `raw` is a fresh descriptor owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on our own memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), n as libc::off_t) } != 0 {
            return Err(err("ftruncate"));
        }
        // SAFETY: maps the memfd we just sized; no existing memory is affected.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), n, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0)
        };
        if p == libc::MAP_FAILED {
            return Err(err("mmap of the memfd"));
        }
        Ok(HostBuffer { ptr: p as *mut u8, len, fd: Some(fd) })
    }

    /// Maps `len` bytes of a shareable buffer another kvprobe process created, through the
    /// descriptor `fd` this process inherited (the decode agent process of
    /// `run --decode-process` on DRAM). The descriptor stays open and is not owned. Errors:
    /// the mapping failed (environment).
    pub fn map_inherited(fd: i32, len: usize) -> Result<HostBuffer> {
        // SAFETY: maps an existing shared memory object read-write; no existing memory of
        // this process is affected. A bad descriptor makes mmap fail, which is reported.
        let p =
            unsafe { libc::mmap(std::ptr::null_mut(), len.max(1), libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(Error::Environment(format!(
                "cannot map the shared pool (descriptor {fd}, {len} bytes): {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(HostBuffer { ptr: p as *mut u8, len, fd: None })
    }

    /// The inherited descriptor number of a shareable buffer (None otherwise): a child
    /// process maps the buffer from `/proc/self/fd/N`.
    pub fn shared_fd(&self) -> Option<i32> {
        use std::os::fd::AsRawFd;
        self.fd.as_ref().map(|f| f.as_raw_fd())
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

/// Peak resident memory of this process so far (bytes; `VmHWM` in /proc/self/status):
/// what a run's host memory footprint reaches, pools included for DRAM. `None` where
/// /proc is unavailable.
pub fn peak_resident_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok()?.checked_mul(1024)
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
