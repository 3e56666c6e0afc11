//! This process and the OS: its thread count, its environment while it has one thread, its
//! resource limits, libraries loaded by path, and an exit that skips library destructors.
//!
//! The OS calls the NIXL module needs before and around loading NIXL live here, so the FFI
//! module holds FFI only; the policy (which variables, which limits, why) stays with the
//! callers ([`crate::xfer::nixl::set_process_env`], [`crate::xfer::nixl::ensure_open_files`],
//! [`crate::xfer::nixl::exit_now`]).

use std::ffi::{CStr, OsStr};
use std::marker::PhantomData;
use std::path::Path;

/// Threads of this process (`Threads:` in /proc/self/status); `None` without /proc.
pub fn thread_count() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines().find_map(|l| l.strip_prefix("Threads:"))?.trim().parse().ok()
}

/// Leave to change this process's environment: only while it has one thread, since changing
/// the environment while another thread may read it (`getenv` in UCX's and NIXL's threads) is
/// undefined behaviour (`std::env::set_var`). Not `Send`: it stays on the thread that took it.
pub struct SingleThreadedEnv {
    _one_thread: PhantomData<*const ()>,
}

impl SingleThreadedEnv {
    /// The leave, when this process has one thread (or /proc cannot tell, as in a sandbox
    /// without it: callers take it first thing in `main`); `None` when it has others.
    pub fn take() -> Option<SingleThreadedEnv> {
        if thread_count().is_some_and(|n| n != 1) {
            return None;
        }
        Some(SingleThreadedEnv { _one_thread: PhantomData })
    }

    /// Sets `key` to `value` unless the user set it (to anything but the empty string).
    /// Returns whether it set it.
    pub fn set_default(&mut self, key: &str, value: &OsStr) -> bool {
        if std::env::var_os(key).is_some_and(|v| !v.is_empty()) {
            return false;
        }
        // SAFETY: this process had one thread when the leave was taken (`take`), the leave
        // cannot leave this thread, and its callers start none while they hold it (kvprobe's
        // main takes it before it starts any, and before NIXL or CUDA is loaded, which start
        // theirs), so nothing reads the environment concurrently.
        unsafe { std::env::set_var(key, value) };
        true
    }
}

/// A resource limit of this process (getrlimit(2)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resource {
    /// Open file descriptors (`ulimit -n`, RLIMIT_NOFILE).
    OpenFiles,
    /// Address space in bytes (`ulimit -v` is in KiB; RLIMIT_AS).
    AddressSpace,
}

/// A soft and a hard limit; `u64::MAX` is unlimited (RLIM_INFINITY).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    /// The soft limit, the one enforced.
    pub soft: u64,
    /// The hard limit, the most the soft one can be raised to.
    pub hard: u64,
}

/// The limit on `resource` after raising a soft limit below `min` to `target` (at most the
/// hard limit; a raise the OS refuses leaves it as it was). `None` when the limit cannot be
/// read. Changes nothing when the soft limit is at least `min`.
pub fn raise_soft_limit(resource: Resource, min: u64, target: u64) -> Option<Limit> {
    let res = match resource {
        Resource::OpenFiles => libc::RLIMIT_NOFILE,
        Resource::AddressSpace => libc::RLIMIT_AS,
    };
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit(2) of this process into a fully initialised struct.
    if unsafe { libc::getrlimit(res, &mut r) } != 0 {
        return None;
    }
    if r.rlim_cur < min && r.rlim_max > r.rlim_cur {
        let raised = libc::rlimit { rlim_cur: r.rlim_max.min(target.max(min) as libc::rlim_t), rlim_max: r.rlim_max };
        // SAFETY: setrlimit(2) of this process with a fully initialised struct whose soft
        // limit is at most its hard one.
        if unsafe { libc::setrlimit(res, &raised) } == 0 {
            r = raised;
        }
    }
    Some(Limit { soft: r.rlim_cur, hard: r.rlim_max })
}

/// The file-size limit of this process (`ulimit -f`, RLIMIT_FSIZE) in bytes, from
/// /proc/self/limits; `None` when unlimited or unknown.
pub fn file_size_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max file size"))?;
    line["Max file size".len()..].split_whitespace().next()?.parse().ok()
}

/// Loads the shared library at `path` (absolute) for the life of the process, its symbols
/// global (`RTLD_NOW | RTLD_GLOBAL`, as nixl-sys's stubs expect of `libnixl_capi.so`). Errors:
/// `dlerror`'s message.
pub fn load_library_global(path: &Path) -> Result<(), String> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: dlopen of a file by path; the handle is intentionally never closed (the library
    // stays loaded for the life of the process).
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        // SAFETY: dlerror returns a thread-local NUL-terminated string or null.
        let err = unsafe {
            let e = libc::dlerror();
            if e.is_null() { "unknown error".to_string() } else { CStr::from_ptr(e).to_string_lossy().into_owned() }
        };
        return Err(err);
    }
    Ok(())
}

/// The path of the first library mapped into this process whose file name starts with
/// `prefix` and holds `.so` (from /proc/self/maps); `None` when none is.
pub fn loaded_library(prefix: &str) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| Path::new(p).file_name().and_then(|f| f.to_str()).is_some_and(|f| f.starts_with(prefix) && f.contains(".so")))
        .map(str::to_string)
}

/// Calls `symbol` of the library at `path`, already loaded (nothing is loaded or initialised:
/// `RTLD_NOLOAD`), and returns the string it returns; `None` when the library is not loaded,
/// lacks the symbol or returns null.
///
/// # Safety
/// `symbol` must be `const char *symbol(void)` returning a NUL-terminated string that lives
/// as long as the library (a version string, say).
pub unsafe fn call_static_string(path: &str, symbol: &CStr) -> Option<String> {
    let c = std::ffi::CString::new(path).ok()?;
    // SAFETY: RTLD_NOLOAD only returns a handle to a library already loaded (it loads and
    // initialises nothing); the handle's reference is intentionally kept.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if h.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated symbol name on a valid handle.
    let sym = unsafe { libc::dlsym(h, symbol.as_ptr()) };
    if sym.is_null() {
        return None;
    }
    // SAFETY: the caller guarantees the symbol is `const char *f(void)`.
    let f: extern "C" fn() -> *const libc::c_char = unsafe { std::mem::transmute(sym) };
    let s = f();
    if s.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated string owned by the library, which stays loaded (the caller's
    // guarantee).
    Some(unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned())
}

/// Ends the process at once with `code` (`_exit(2)`): no atexit handlers, no library
/// destructors, no flush of Rust's or C's buffered output. Callers flush and sync what they
/// wrote first ([`crate::xfer::nixl::exit_now`]).
pub fn exit_immediately(code: u8) -> ! {
    // SAFETY: _exit(2) terminates the process; it touches no memory of this process.
    unsafe { libc::_exit(code as libc::c_int) }
}
