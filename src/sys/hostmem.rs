//! Page-aligned host memory for DRAM pools: the only module with host-memory `unsafe`.
//!
//! Regions are anonymous shared mappings (`mmap`), page-aligned so NIXL/UCX can register
//! them, and zero-filled by the kernel on first touch.
//!
//! Two types, by who else may write the memory:
//!
//! - [`HostBuffer`]: memory a transfer engine may read or write while kvprobe runs — a DRAM
//!   pool, whose address NIXL registers (UCX's progress thread writes it) and whose memfd the
//!   Mooncake worker maps; the embedded tier's arena ([`crate::mem::tier::TierArena`]), which
//!   prefill registers with NIXL for decode's remote READs. It hands out **no Rust reference**
//!   (`&[u8]` / `&mut [u8]`) into the mapping: a reference asserts that nothing else writes
//!   any of its bytes while it lives, which a transfer into a neighbouring block would break
//!   (undefined behaviour even when the bytes touched differ). Access goes through
//!   range-checked copies ([`HostBuffer::read_at`], [`HostBuffer::write_at`]) and through
//!   [`Span`] / [`SpanMut`], a raw pointer and a length that the CPU passes (the fingerprint
//!   reference in C, memcpy) access only for the duration of one call.
//! - [`PrivateBuffer`]: memory nothing but its owner touches (the bench's copy buffers):
//!   plain slices. Its address is never given to a transfer engine.
//!
//! The contract of every [`HostBuffer`] access: **no transfer is in flight into the range
//! accessed** (the sweep and the scenario engine fill, poison and verify only slices whose
//! transfers completed or have not been posted). Rust-side accesses cannot race each other:
//! writes need `&mut HostBuffer` (or a [`SpanMut`], which borrows it exclusively and is only
//! ever split into disjoint pieces).

use crate::error::{Error, Result};
use std::marker::PhantomData;

/// A page-aligned shared mapping of `len` bytes, unmapped on drop, that a transfer engine
/// may write (see the module documentation: no references into it). A buffer from
/// [`HostBuffer::alloc_shareable`] is backed by a close-on-exec memfd that a chosen child
/// process (the Mooncake worker) maps through
/// [`crate::sys::child::spawn_keeping`].
#[derive(Debug)]
pub struct HostBuffer {
    ptr: *mut u8,
    len: usize,
    fd: Option<std::os::fd::OwnedFd>,
}

// SAFETY: the mapping is plain memory owned by this value (no thread affinity).
unsafe impl Send for HostBuffer {}
// SAFETY: no method hands out a reference into the mapping. Through `&HostBuffer` the bytes
// are only read (by `read_at` and `Span`s, through raw pointers, for the duration of a call);
// every write needs `&mut HostBuffer`, so Rust threads never race on it. Writers outside
// Rust (NIXL/UCX, the Mooncake worker) are governed by the module's
// contract: no access to a range a transfer is writing.
unsafe impl Sync for HostBuffer {}

fn mmap_err(what: &str, len: usize) -> Error {
    Error::Environment(format!("{what} ({}): {}", crate::sys::units::bytes_exact(len as u64), std::io::Error::last_os_error()))
}

/// Maps `len` (at least 1) bytes of anonymous shared memory.
fn map_anonymous(len: usize) -> Result<*mut u8> {
    // SAFETY: a fresh anonymous mapping; no existing memory is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len.max(1),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(mmap_err("cannot map host memory", len));
    }
    Ok(p as *mut u8)
}

/// Checks that `off..off + n` lies within `len` bytes.
fn check_range(what: &str, off: usize, n: usize, len: usize) -> Result<()> {
    match off.checked_add(n) {
        Some(end) if end <= len => Ok(()),
        _ => Err(Error::Usage(format!("{what}: bytes {off}..{} outside a {len}-byte buffer", off as u128 + n as u128))),
    }
}

impl HostBuffer {
    /// Maps `len` bytes. Errors: the kernel refused the mapping (out of memory).
    pub fn alloc(len: usize) -> Result<HostBuffer> {
        Ok(HostBuffer { ptr: map_anonymous(len)?, len, fd: None })
    }

    /// Maps `len` bytes backed by a memfd (`memfd:kvprobe-pool`, close-on-exec: no child
    /// inherits it unless its spawn names it with [`crate::sys::child::spawn_keeping`]); that child maps
    /// the same pages through `/proc/self/fd/N` ([`HostBuffer::shared_fd`]). Errors:
    /// memfd_create, ftruncate or mmap failed.
    pub fn alloc_shareable(len: usize) -> Result<HostBuffer> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let n = len.max(1);
        let err = |what: &str| Error::Environment(format!("{what} ({len} bytes): {}", std::io::Error::last_os_error()));
        // SAFETY: the name is a valid NUL-terminated string. MFD_CLOEXEC: children started
        // with exec do not inherit the descriptor (crate::sys::child::spawn_keeping opts one in).
        let raw = unsafe { libc::memfd_create(c"kvprobe-pool".as_ptr(), libc::MFD_CLOEXEC) };
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

    /// The descriptor number of a shareable buffer's memfd (None otherwise): the child that
    /// was given it ([`crate::sys::child::spawn_keeping`]) maps the buffer from `/proc/self/fd/N`.
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

    /// Copies bytes `off..off + dst.len()` into `dst` (no transfer may be writing them: see
    /// the module documentation). Errors (usage): the range is outside the buffer.
    pub fn read_at(&self, off: usize, dst: &mut [u8]) -> Result<()> {
        self.span(off, dst.len())?.read_at(0, dst)
    }

    /// Overwrites bytes `off..off + src.len()` with `src` (no transfer may be touching them).
    /// Errors (usage): the range is outside the buffer.
    pub fn write_at(&mut self, off: usize, src: &[u8]) -> Result<()> {
        self.span_mut(off, src.len())?.write_at(0, src)
    }

    /// Bytes `off..off + len`, for reading (no transfer may be writing them while the span
    /// is read). Errors (usage): the range is outside the buffer.
    pub fn span(&self, off: usize, len: usize) -> Result<Span<'_>> {
        check_range("host buffer", off, len, self.len)?;
        // SAFETY: off + len <= self.len, so the pointer stays within the mapping.
        Ok(Span { ptr: unsafe { self.ptr.add(off) }, len, _buf: PhantomData })
    }

    /// Bytes `off..off + len`, for writing; borrows the buffer exclusively. Errors (usage):
    /// the range is outside the buffer.
    pub fn span_mut(&mut self, off: usize, len: usize) -> Result<SpanMut<'_>> {
        check_range("host buffer", off, len, self.len)?;
        // SAFETY: off + len <= self.len, so the pointer stays within the mapping.
        Ok(SpanMut { ptr: unsafe { self.ptr.add(off) }, len, _buf: PhantomData })
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping created in `alloc*`, once; no
        // Span outlives the borrow of self it came from.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len.max(1)) };
    }
}

/// A readable range of a [`HostBuffer`]: a raw pointer and a length, never a reference, so
/// holding one asserts nothing about bytes it is not reading at the moment. Valid while the
/// buffer is borrowed; copies and sub-ranges are free.
#[derive(Clone, Copy, Debug)]
pub struct Span<'a> {
    ptr: *const u8,
    len: usize,
    _buf: PhantomData<&'a HostBuffer>,
}

// SAFETY: a Span only reads (through raw pointers, inside its methods and the fingerprint
// FFI); writers on the Rust side need the HostBuffer exclusively, which the borrow `'a`
// rules out while a Span lives.
unsafe impl Send for Span<'_> {}
// SAFETY: as for Send.
unsafe impl Sync for Span<'_> {}

impl<'a> Span<'a> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when zero-length.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the range, for FFI that reads at most [`Span::len`] bytes from it.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Bytes `off..off + len` of this span. Errors (usage): outside the span.
    pub fn sub(&self, off: usize, len: usize) -> Result<Span<'a>> {
        check_range("span", off, len, self.len)?;
        // SAFETY: within this span, hence within the mapping.
        Ok(Span { ptr: unsafe { self.ptr.add(off) }, len, _buf: PhantomData })
    }

    /// Consecutive pieces of `n` bytes (the last may be shorter; `n` 0 counts as 1).
    pub fn chunks(self, n: usize) -> impl Iterator<Item = Span<'a>> {
        let n = n.max(1);
        (0..self.len).step_by(n).map(move |off| Span {
            // SAFETY: off < len, so within this span.
            ptr: unsafe { self.ptr.add(off) },
            len: n.min(self.len - off),
            _buf: PhantomData,
        })
    }

    /// Copies bytes `off..off + dst.len()` of this span into `dst`. Errors (usage): outside
    /// the span.
    pub fn read_at(&self, off: usize, dst: &mut [u8]) -> Result<()> {
        check_range("span read", off, dst.len(), self.len)?;
        // SAFETY: the source range lies within this span (checked), `dst` is a distinct Rust
        // buffer (it cannot alias the mapping: HostBuffer hands out no references), and no
        // writer touches the range (the module's contract).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}

/// A writable range of a [`HostBuffer`] (exclusively borrowed): a raw pointer and a length,
/// split only into disjoint pieces ([`SpanMut::into_chunks`]), which may go to different
/// threads.
#[derive(Debug)]
pub struct SpanMut<'a> {
    ptr: *mut u8,
    len: usize,
    _buf: PhantomData<&'a mut HostBuffer>,
}

// SAFETY: a SpanMut is the only Rust handle on its bytes (it borrows the buffer exclusively
// and pieces are disjoint), so moving it to another thread cannot create a race.
unsafe impl Send for SpanMut<'_> {}

impl<'a> SpanMut<'a> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when zero-length.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the range, for FFI that writes at most [`SpanMut::len`] bytes to it.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    /// The same bytes, for reading, while this span is borrowed.
    pub fn as_span(&self) -> Span<'_> {
        Span { ptr: self.ptr, len: self.len, _buf: PhantomData }
    }

    /// Bytes `off..off + len` of this span, borrowing it. Errors (usage): outside the span.
    pub fn sub_mut(&mut self, off: usize, len: usize) -> Result<SpanMut<'_>> {
        check_range("span", off, len, self.len)?;
        // SAFETY: within this span, hence within the mapping; `self` is borrowed meanwhile.
        Ok(SpanMut { ptr: unsafe { self.ptr.add(off) }, len, _buf: PhantomData })
    }

    /// Splits into consecutive disjoint pieces of `n` bytes (the last may be shorter; `n` 0
    /// counts as 1).
    pub fn into_chunks(self, n: usize) -> impl Iterator<Item = SpanMut<'a>> {
        let n = n.max(1);
        let (ptr, len) = (self.ptr, self.len);
        (0..len).step_by(n).map(move |off| SpanMut {
            // SAFETY: off < len, so within this span; the pieces do not overlap.
            ptr: unsafe { ptr.add(off) },
            len: n.min(len - off),
            _buf: PhantomData,
        })
    }

    /// Overwrites bytes `off..off + src.len()` of this span with `src`. Errors (usage):
    /// outside the span.
    pub fn write_at(&mut self, off: usize, src: &[u8]) -> Result<()> {
        check_range("span write", off, src.len(), self.len)?;
        // SAFETY: the destination lies within this exclusively held span (checked); `src` is
        // a Rust buffer, which cannot alias the mapping (HostBuffer hands out no references).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(off), src.len()) };
        Ok(())
    }

    /// Copies all of `src` (same length; another buffer's span) into this span. Errors
    /// (usage): the lengths differ.
    pub fn copy_from(&mut self, src: Span<'_>) -> Result<()> {
        if src.len != self.len {
            return Err(Error::Usage(format!("copy of {} bytes into a {}-byte span", src.len, self.len)));
        }
        // SAFETY: both ranges are valid for `len` bytes; `src` reads another buffer (or a
        // disjoint part: a Span of this buffer cannot exist while `self` borrows it mutably),
        // so they do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.ptr, self.ptr, self.len) };
        Ok(())
    }
}

/// Page-aligned host memory that nothing but its owner touches (the bench's copy buffers):
/// plain slices. Never give its address to a transfer engine — use [`HostBuffer`] for that
/// (the tier arena, page-locked or not, is one).
#[derive(Debug)]
pub struct PrivateBuffer(HostBuffer);

impl PrivateBuffer {
    /// Maps `len` bytes. Errors: the kernel refused the mapping (out of memory).
    pub fn alloc(len: usize) -> Result<PrivateBuffer> {
        HostBuffer::alloc(len).map(PrivateBuffer)
    }

    /// Start address (for page-locking only).
    pub fn addr(&self) -> u64 {
        self.0.addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len
    }

    /// True when zero-length.
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` readable bytes for the lifetime of self, and nothing
        // outside this value writes them (the type's rule).
        unsafe { std::slice::from_raw_parts(self.0.ptr, self.0.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`; &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.0.ptr, self.0.len) }
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
