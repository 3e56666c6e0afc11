//! NIXL: finding the real library, and a small agent wrapper over `nixl-sys`.
//!
//! `nixl-sys` is built with `stub-api`: its stubs `dlopen("libnixl_capi.so")` on first use
//! and abort the process when it is missing. kvprobe therefore finds the library itself
//! ([`load`]) and preloads it by full path before any NIXL call, so the stubs bind to it by
//! its soname — or kvprobe exits 2 with install instructions. It never runs on the stub.
//!
//! Search order: `$KVPROBE_NIXL_DIR` (a directory holding `libnixl_capi.so`; when set, the
//! only place looked at), else the directory the install step writes (`$KVPROBE_HOME/nixl/lib`, default
//! `~/.local/share/kvprobe/nixl/lib`, see scripts/install-deps.sh).

use crate::error::{Error, Result};
use crate::sys::deadline::Deadline;
use nixl_sys::{MemType, MemoryRegion, NixlDescriptor, XferDescList, XferOp};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Environment variable naming the directory that holds `libnixl_capi.so`.
pub const NIXL_DIR_ENV: &str = "KVPROBE_NIXL_DIR";

/// How to install NIXL, for error messages.
pub const INSTALL_HINT: &str = "install it with `scripts/install-deps.sh` (PyPI wheel nixl-cu13 1.5.1), or set KVPROBE_NIXL_DIR to the directory holding libnixl_capi.so";

/// Where the install step puts the NIXL libraries.
pub fn default_lib_dir() -> PathBuf {
    crate::sys::tempdir::kvprobe_home().join("nixl/lib")
}

/// The NIXL library kvprobe loaded.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct NixlLibrary {
    /// Full path of the loaded `libnixl_capi.so`.
    pub library: PathBuf,
    /// Plugin directory (`NIXL_PLUGIN_DIR`).
    pub plugin_dir: PathBuf,
    /// How it was found: "KVPROBE_NIXL_DIR" or "install dir".
    pub found_via: String,
    /// Whether nixl-sys runs on its stub (always false once loaded).
    pub stub: bool,
}

/// Candidate directories in search order, with how each was named.
/// When `KVPROBE_NIXL_DIR` is set (non-empty) it is the only candidate: an operator who pins a library
/// gets that library or an error, never a silent fallback.
pub fn candidates() -> Vec<(PathBuf, &'static str)> {
    match std::env::var_os(NIXL_DIR_ENV) {
        Some(d) if !d.is_empty() => vec![(PathBuf::from(d), NIXL_DIR_ENV)],
        _ => vec![(default_lib_dir(), "install dir")],
    }
}

/// Finds `libnixl_capi.so` without loading it.
pub fn find() -> Option<(PathBuf, &'static str)> {
    candidates().into_iter().find(|(d, _)| d.join("libnixl_capi.so").is_file())
}

static LOADED: OnceLock<std::result::Result<NixlLibrary, String>> = OnceLock::new();

/// Finds and loads the real NIXL C API library (once per process). `NIXL_PLUGIN_DIR` is set
/// before, by [`set_process_env`].
///
/// Errors (exit 2): not found, fails to load, or nixl-sys still reports its stub.
pub fn load() -> Result<NixlLibrary> {
    LOADED.get_or_init(load_once).clone().map_err(Error::Environment)
}

/// The NIXL library this process already loaded, if [`load`] succeeded; never loads it.
pub fn loaded() -> Option<NixlLibrary> {
    LOADED.get().and_then(|r| r.as_ref().ok()).cloned()
}

/// What kvprobe's NIXL agents need from the process environment, decided from the command
/// line alone ([`set_process_env`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EnvPlan {
    /// Both pools of the run may be on one GPU in this process (VRAM or a default memory that
    /// may be VRAM, the same `--prefill-device` and `--decode-device`, no `--decode-process`):
    /// `UCX_CUDA_IPC_ENABLE_SAME_PROCESS=y`, without which UCX will not use CUDA IPC within one
    /// process. Across GPUs it stays unset: with it UCX opens the peer GPU's IPC handle in this
    /// process and fails ("cuIpcOpenMemHandle() failed: invalid device context", seen on two
    /// H200s).
    pub same_gpu_in_process: bool,
    /// Turn on the transport diagnosis ([`crate::xfer::ucx`]): UCX's protocol tables
    /// (`UCX_PROTO_INFO=y`) written to a log file in kvprobe's private temporary directory
    /// ([`crate::sys::tempdir::dir`], `UCX_LOG_FILE`), unless the user set either or
    /// `KVPROBE_UCX_DIAG=0`. Not for `kvprobe env`, which makes no transfer itself.
    pub diagnosis: bool,
    /// Both engines of the run are on this host (no `--peer`; `--decode-process` is one host
    /// too): `UCX_NET_DEVICES` = the loopback interface ([`crate::sys::net::loopback_interface`]),
    /// so that UCX's TCP transport listens on loopback only instead of on every network
    /// interface of the host (it opens a listening socket per interface and agent); see
    /// [`check_new_listeners`]. Not for `serve` nor `run --peer`, whose agents must be
    /// reachable from the other host, nor `kvprobe env`, which lists the host's devices.
    pub one_host: bool,
}

pub use crate::xfer::ucx::{DEBUG_SIGNO_ENV, GET_ZCOPY_ENV, kvprobe_defaults};

/// True when an NVIDIA driver is present (its device node or /proc entry): UCX's CUDA
/// transports can load. Looks at files only (no CUDA call, which could start threads).
fn nvidia_driver_present() -> bool {
    ["/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/dxg"].iter().any(|p| Path::new(p).exists())
}

/// Sets, where the user has not, the environment kvprobe's NIXL agents read (UCX and NIXL
/// read it with `getenv` from their own threads): call first thing in `main`, while the
/// process has one thread, since changing the environment while another thread may read it
/// is undefined behaviour (`std::env::set_var`). Sets nothing (and says so in a trace line)
/// when the process already has other threads.
///
/// - `NIXL_PLUGIN_DIR`: the `plugins/` beside the NIXL library found ([`find`]);
/// - `UCX_DEBUG_SIGNO=0` ([`DEBUG_SIGNO_ENV`]): UCX installs no handler for SIGHUP, which then
///   stops a run as SIGTERM does ([`crate::sys::interrupt`]);
/// - `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y` ([`GET_ZCOPY_ENV`]), and
///   `UCX_CUDA_IPC_ENABLE_SAME_PROCESS=y` when `plan.same_gpu_in_process`: on hosts with an
///   NVIDIA driver, and on others when kvprobe captures UCX's log (it drops UCX's warning that
///   they went unused there, [`crate::xfer::ucx::messages`]);
/// - with `plan.diagnosis` (and an open-file limit NIXL can run with, [`ensure_open_files`],
///   which raises a low soft limit): `UCX_PROTO_INFO=y` and `UCX_LOG_FILE` (see [`EnvPlan::diagnosis`]);
///   and UCX's shared-memory segments (`UCX_POSIX_DIR`) in kvprobe's private directory in
///   /dev/shm ([`crate::sys::tempdir::shm_dir`]): UCX unlinks each right after creating it, and one
///   a kill catches in between is removed with the directory (at exit, or at the next
///   kvprobe's start).
///
/// - `UCX_NET_DEVICES` = the loopback interface with `plan.one_host` ([`EnvPlan::one_host`]).
///
/// The names set are [`kvprobe_defaults`].
pub fn set_process_env(plan: EnvPlan) {
    if crate::xfer::ucx::defaults_recorded() {
        return;
    }
    let Some(mut env) = crate::sys::process::SingleThreadedEnv::take() else {
        crate::sys::trace::trace!("the environment was not set: the process already has other threads");
        crate::xfer::ucx::record_defaults(Vec::new());
        return;
    };
    let mut set = Vec::new();
    let mut default = |key: &str, value: &std::ffi::OsStr| {
        if env.set_default(key, value) {
            set.push(key.to_string());
        }
    };
    if let Some((dir, _)) = find() {
        default("NIXL_PLUGIN_DIR", dir.join("plugins").as_os_str());
    }
    default(DEBUG_SIGNO_ENV, "0".as_ref());
    if plan.one_host
        && let Some(lo) = crate::sys::net::loopback_interface()
    {
        default(NET_DEVICES_ENV, lo.as_ref());
    }
    let mut captured = false;
    // The capture's private directories hold a descriptor each (their lock): under an
    // open-file limit NIXL cannot run with (which `load` then reports), none is made.
    if plan.diagnosis && ensure_open_files().is_ok() {
        let off = std::env::var(crate::xfer::ucx::DIAG_ENV).is_ok_and(|v| v == "0")
            || ["UCX_PROTO_INFO", "UCX_LOG_FILE"].iter().any(|k| std::env::var_os(k).is_some_and(|v| !v.is_empty()));
        let log = if off {
            None
        } else {
            match crate::sys::tempdir::dir() {
                Ok(d) => Some(d.join("ucx.log")),
                Err(e) => {
                    crate::xfer::ucx::set_off_because(format!(
                        "capture off: no temporary directory for UCX's log ({e}; TMPDIR={})",
                        std::env::var("TMPDIR").unwrap_or_default()
                    ));
                    None
                }
            }
        };
        if let Some(l) = &log {
            default("UCX_PROTO_INFO", "y".as_ref());
            default("UCX_LOG_FILE", l.as_os_str());
            captured = true;
        }
        crate::xfer::ucx::set_log_path(log);
        if std::env::var_os("UCX_POSIX_DIR").is_none_or(|v| v.is_empty())
            && let Ok(d) = crate::sys::tempdir::shm_dir()
        {
            default("UCX_POSIX_DIR", d.as_os_str());
        }
    }
    // UCX's CUDA transport reads these; where it does not load (no NVIDIA driver) UCX warns
    // that they went unused, which kvprobe drops from the log it captures.
    if captured || nvidia_driver_present() {
        if plan.same_gpu_in_process {
            default("UCX_CUDA_IPC_ENABLE_SAME_PROCESS", "y".as_ref());
        }
        default(GET_ZCOPY_ENV, "y".as_ref());
    }
    crate::xfer::ucx::record_defaults(set);
}

/// `UCX_NET_DEVICES`: the network devices UCX may use (its TCP transport listens on each).
pub const NET_DEVICES_ENV: &str = "UCX_NET_DEVICES";

/// Checks the TCP sockets this process started listening on since `before` (what `what`, a
/// NIXL agent's backend, opened: UCX's TCP transport listens on every network interface it
/// may use, one socket per interface and agent): none may be a wildcard (0.0.0.0, ::), which
/// no UCX transport asks for; and when `UCX_NET_DEVICES` names only loopback interfaces
/// (kvprobe's default on one host, [`EnvPlan::one_host`], or the user's), each must be a
/// loopback address. Errors: environment (exit 2) naming each wider address: an agent that
/// listens wider than asked is not run.
pub fn check_new_listeners(what: &str, before: &[std::net::SocketAddr]) -> Result<()> {
    let Ok(now) = crate::sys::net::listening(std::process::id()) else { return Ok(()) };
    let loopback_only = std::env::var(NET_DEVICES_ENV).ok().is_some_and(|v| {
        let lo = crate::sys::net::loopback_interface();
        let names: Vec<&str> = v.split(',').map(|d| d.split(':').next().unwrap_or(d).trim()).collect();
        !names.is_empty() && names.iter().all(|d| Some(*d) == lo.as_deref())
    });
    let wide: Vec<String> = now
        .iter()
        .filter(|a| !before.contains(a))
        .filter(|a| a.ip().is_unspecified() || (loopback_only && !crate::sys::net::is_loopback(a.ip())))
        .map(|a| a.to_string())
        .collect();
    if wide.is_empty() {
        return Ok(());
    }
    let asked = match std::env::var(NET_DEVICES_ENV) {
        Ok(v) if loopback_only => format!("{NET_DEVICES_ENV}={v} asks for loopback only"),
        _ => "no UCX transport asks for a wildcard address".to_string(),
    };
    Err(Error::Environment(format!(
        "{what} listens on {}, wider than asked ({asked}): not running it (docs/two-hosts.md, \"Network exposure\")",
        wide.join(", ")
    )))
}

/// Refuses a user-set `UCX_LOG_FILE` that UCX could not open (a directory, a missing or
/// read-only directory): UCX aborts the whole process on it (SIGABRT, no report). Errors:
/// environment (exit 2).
pub fn check_ucx_log_file() -> Result<()> {
    let Some(v) = std::env::var_os("UCX_LOG_FILE").filter(|v| !v.is_empty()) else { return Ok(()) };
    if crate::xfer::ucx::log_path().is_some_and(|p| p.as_os_str() == v) {
        return Ok(()); // kvprobe's own
    }
    let p = PathBuf::from(&v);
    let bad = |why: String| Err(Error::Environment(format!("UCX_LOG_FILE {}: {why} (UCX would abort)", p.display())));
    if p.is_dir() {
        return bad("is a directory".into());
    }
    let dir = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !dir.is_dir() {
        return bad(format!("{} is not a directory", dir.display()));
    }
    // UCX expands %p, %h and the like in the name: check the directory takes new files.
    if let Err(e) = tempfile::tempfile_in(dir) {
        return bad(format!("cannot create files in {}: {e}", dir.display()));
    }
    Ok(())
}

/// The fewest open file descriptors kvprobe starts NIXL with (`ulimit -n`): the UCX backend
/// failed to start below 48 on a DRAM sweep, and aborted the process (SIGABRT, no report)
/// below 12; the rest is headroom for the peer link's sockets and the Mooncake worker.
pub const MIN_OPEN_FILES: u64 = 128;

/// Raises the soft open-file limit to the hard one when it is below [`MIN_OPEN_FILES`] (as
/// a server would; it changes nothing else), and refuses a hard limit below it before UCX can
/// abort on it. Errors: the message for [`load`] (environment, exit 2).
pub fn ensure_open_files() -> std::result::Result<(), String> {
    use crate::sys::process::{Resource, raise_soft_limit};
    // Raised to 4096 at most (a server's usual soft limit), never above the hard one.
    let Some(r) = raise_soft_limit(Resource::OpenFiles, MIN_OPEN_FILES, MIN_OPEN_FILES.max(4096)) else {
        return Ok(()); // unknown: let UCX try
    };
    if r.soft < MIN_OPEN_FILES {
        return Err(format!(
            "the open-file limit (ulimit -n) is {} and cannot be raised (hard limit {}); NIXL's UCX backend needs more descriptors (it fails below 48, aborts below 12): kvprobe needs at least {MIN_OPEN_FILES}",
            r.soft, r.hard
        ));
    }
    Ok(())
}

/// The least address space (`ulimit -v`, RLIMIT_AS) kvprobe starts NIXL with, in bytes: UCX
/// reserves address space well beyond the pools (memory pools, registration caches, thread
/// stacks) and under a tighter limit it failed to connect (exit 4 after --timeout) or crashed
/// in registration (SIGSEGV, no report): seen between 200 and 500 MB, fine from 600 MB, on the
/// smallest DRAM run.
pub const MIN_ADDRESS_SPACE: u64 = 2 << 30;

/// Raises a soft address-space limit below [`MIN_ADDRESS_SPACE`] to the hard one, and refuses
/// a hard limit below it before UCX can crash on it. Errors: the message for [`load`]
/// (environment, exit 2).
pub fn ensure_address_space() -> std::result::Result<(), String> {
    use crate::sys::process::{Resource, raise_soft_limit};
    // Raised as far as the hard limit allows (unlimited: u64::MAX).
    let Some(r) = raise_soft_limit(Resource::AddressSpace, MIN_ADDRESS_SPACE, u64::MAX) else { return Ok(()) };
    if r.soft < MIN_ADDRESS_SPACE {
        return Err(format!(
            "the address-space limit (ulimit -v) is {} KiB and cannot be raised; NIXL's UCX backend reserves address space beyond the pools and fails or crashes under tight limits: kvprobe needs at least {} KiB (ulimit -v {}) plus its DRAM pools, or no limit",
            r.soft >> 10,
            MIN_ADDRESS_SPACE >> 10,
            MIN_ADDRESS_SPACE >> 10
        ));
    }
    Ok(())
}

fn load_once() -> std::result::Result<NixlLibrary, String> {
    ensure_open_files()?;
    ensure_address_space()?;
    if let Some(d) = std::env::var_os(NIXL_DIR_ENV).filter(|d| !d.is_empty())
        && !Path::new(&d).is_absolute()
    {
        return Err(format!("{NIXL_DIR_ENV} must be an absolute path (got {:?})", Path::new(&d)));
    }
    let (dir, via) = find().ok_or_else(|| {
        let looked: Vec<String> = candidates().iter().map(|(d, w)| format!("{} ({w})", d.display())).collect();
        format!("NIXL library libnixl_capi.so not found (looked in: {}); {INSTALL_HINT}", looked.join(", "))
    })?;
    let lib = dir.join("libnixl_capi.so");
    // NIXL_PLUGIN_DIR is set by `set_process_env` (kvprobe's main), not here: this process
    // may have threads by now. Where it is unset (a library caller), NIXL looks in the
    // `plugins/` beside its own library (found with dladdr), the same directory here.
    let plugin_dir =
        std::env::var_os("NIXL_PLUGIN_DIR").filter(|v| !v.is_empty()).map(PathBuf::from).unwrap_or_else(|| dir.join("plugins"));
    // Loaded for the life of the process, its symbols global, as nixl-sys's stubs expect.
    crate::sys::process::load_library_global(&lib)
        .map_err(|err| format!("cannot load {}: {err}; {INSTALL_HINT}", lib.display()))?;
    let stub = nixl_sys::is_stub();
    if stub {
        return Err(format!("loaded {} but nixl-sys still reports its stub; {INSTALL_HINT}", lib.display()));
    }
    Ok(NixlLibrary { library: lib, plugin_dir, found_via: via.to_string(), stub })
}

/// The NIXL wheel and version installed in `lib_dir`'s parent, from the stamp install-deps.sh
/// leaves there (`.installed-<wheel>-<version>`, e.g. "nixl-cu13 1.5.1"); `None` when there is
/// no stamp (a NIXL installed by other means, e.g. `KVPROBE_NIXL_DIR`).
pub fn installed_version(lib_dir: &Path) -> Option<String> {
    let root = lib_dir.parent()?;
    std::fs::read_dir(root).ok()?.flatten().find_map(|e| {
        let name = e.file_name().into_string().ok()?;
        let rest = name.strip_prefix(".installed-")?;
        let (wheel, version) = rest.rsplit_once('-')?;
        Some(format!("{wheel} {version}"))
    })
}

/// The version of the UCX library NIXL's UCX plugin loaded into this process
/// (`ucp_get_version_string()` of the libucp mapped here, e.g. "1.20.0"); `None` when no
/// libucp is loaded (NIXL not started, or another backend) or it lacks the symbol. Loads
/// nothing: the library is looked up with `RTLD_NOLOAD`.
pub fn loaded_ucx_version() -> Option<String> {
    let path = crate::sys::process::loaded_library("libucp")?;
    // SAFETY: `ucp_get_version_string` is `const char *ucp_get_version_string(void)` (UCX's
    // ucp.h): no arguments, returns a static NUL-terminated string owned by libucp.
    unsafe { crate::sys::process::call_static_string(&path, c"ucp_get_version_string") }
}

/// Ends the process with `code` without running library destructors, after flushing stdout
/// and stderr. With NIXL loaded, the normal exit path can crash: the wheel's UCX bundles its
/// own libnl-route, and when a second libnl comes in with the system's libibverbs (installed
/// for Mooncake) its destructor `rtnl_tc_unregister` segfaults during `exit` (seen on Debian
/// 12: exit code 139 after a clean run). kvprobe writes and syncs its report before this.
pub fn exit_now(code: u8) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // UCX's diagnostics (UCX_PROTO_INFO, UCX_LOG_LEVEL) go through a buffered C stdout that
    // _exit would drop.
    crate::sys::child::flush_c_stdio();
    let ucx = crate::xfer::ucx::messages();
    if !ucx.is_empty() {
        let mut e = std::io::stderr().lock();
        for m in ucx {
            let _ = writeln!(e, "{m}");
        }
        let _ = e.flush();
    }
    crate::xfer::ucx::remove_log();
    crate::sys::tempdir::remove_own();
    // And what killed kvprobes left (a `--decode-process` child or a run killed hard): each start
    // sweeps too, but the last run on a host should not leave them until the next one.
    crate::sys::tempdir::sweep_stale();
    // Every file kvprobe wrote was synced or closed before (reports are synced in
    // `write_atomic`), and stdout/stderr were just flushed: nothing needs the atexit handlers
    // that are skipped.
    crate::sys::process::exit_immediately(code)
}

/// Why a backend may not start under a file-size limit: UCX's shared-memory transport (posix)
/// sizes its segments as files, which the limit caps. Empty without a limit.
fn file_size_limit_hint() -> String {
    match crate::sys::process::file_size_limit() {
        Some(b) => format!(
            "; the file-size limit (ulimit -f) is {b} bytes, and UCX's shared-memory segments count as files: \
             raise the limit, or leave UCX's posix transport out (UCX_TLS=^posix)"
        ),
        None => String::new(),
    }
}

/// Keys NIXL's UCX plugin reads from its parameters beyond those of its defaults
/// (`getPluginParams` of nixl-cu13 1.5.1 lists `ucx_devices`, `num_workers` and
/// `ucx_error_handling_mode`): from NIXL's src/plugins/ucx/ucx_backend.cpp (v1.4.0 and
/// later): `nixlUcxEngine::create` reads `num_threads` (> 0 selects the thread-pool engine,
/// which reads `split_batch_size`), the engine's constructor `device_list`,
/// `ucx_num_device_channels` and `engine_config` (UCX configuration, `KEY=VALUE;...`). The
/// installed plugin (libplugin_UCX.so) holds each of these names except the short
/// `num_threads`, which the compiler stores inline.
pub const UCX_EXTRA_PARAMS: &[&str] =
    &["num_threads", "split_batch_size", "device_list", "ucx_num_device_channels", "engine_config"];

/// Refuses a `--backend-param` key plugin `backend` does not read: valid are the keys of
/// its default parameters (`known`, from `getPluginParams`) and, for UCX, those of
/// [`UCX_EXTRA_PARAMS`]. NIXL itself would pass an unknown key on and the plugin ignore
/// it, so a typo would change nothing and say nothing. Errors: usage (exit 2) naming the
/// key and listing the valid ones.
pub fn check_backend_params(backend: &str, known: &[String], params: &BTreeMap<String, String>) -> Result<()> {
    let mut valid: Vec<String> = known.to_vec();
    if backend == "UCX" {
        valid.extend(UCX_EXTRA_PARAMS.iter().map(|k| k.to_string()));
    }
    valid.sort();
    valid.dedup();
    for k in params.keys() {
        if !valid.contains(k) {
            return Err(Error::Usage(format!(
                "--backend-param {k}: NIXL backend {backend} has no parameter {k:?} (valid: {})",
                if valid.is_empty() { "none".to_string() } else { valid.join(", ") }
            )));
        }
    }
    Ok(())
}

/// Names of the backend plugins NIXL can load (e.g. "UCX", "POSIX").
pub fn available_plugins() -> Result<Vec<String>> {
    load()?;
    let a = nixl_sys::Agent::new("kvprobe-env").map_err(|e| Error::Transport(format!("create NIXL agent: {e}")))?;
    let list = a.get_available_plugins().map_err(|e| Error::Transport(format!("list NIXL plugins: {e}")))?;
    Ok(list.iter().filter_map(|s| s.ok().map(str::to_string)).collect())
}

/// A contiguous memory range to register with NIXL.
#[derive(Clone, Copy, Debug)]
pub struct Region {
    /// Start address (host virtual address, or CUDA device address for VRAM).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// DRAM or VRAM.
    pub mem: MemType,
    /// GPU ordinal for VRAM, 0 for DRAM.
    pub dev_id: u64,
}

impl MemoryRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }
    fn size(&self) -> usize {
        self.len as usize
    }
}

impl NixlDescriptor for Region {
    fn mem_type(&self) -> MemType {
        self.mem
    }
    fn device_id(&self) -> u64 {
        self.dev_id
    }
}

/// A NIXL call's failure (transport, exit 3), with what UCX's log says about connections it
/// could not open ([`crate::xfer::ucx::connect_hint`]).
fn terr(what: &str, e: nixl_sys::NixlError) -> Error {
    Error::Transport(format!("{what}: {e}{}", crate::xfer::ucx::connect_hint()))
}

/// Memory registered with one NIXL agent by one [`Agent::register`] call: NIXL deregisters it
/// when the last share ([`Lease`]) drops. The agent holds one share, every request that may
/// touch the memory ([`Posted`]) holds one, and so does the
/// [`Registered`] guard that owns the memory: memory is never deregistered, nor freed, under
/// a request.
pub struct Registration {
    _handles: Vec<nixl_sys::RegistrationHandle>,
}

/// Shares of registrations ([`Registration`]): what a request holds of the memory it moves
/// (both sides when both agents live in this process).
#[derive(Clone, Default)]
pub struct Lease(Vec<Arc<Registration>>);

impl Lease {
    /// Adds `other`'s shares.
    pub fn join(&mut self, other: &Lease) {
        self.0.extend(other.0.iter().cloned());
    }

    /// A reference that keeps nothing alive, for a peer's `transport::PeerInfo`.
    pub fn downgrade(&self) -> WeakLease {
        WeakLease(self.0.iter().map(Arc::downgrade).collect())
    }

    /// True when this is the only share of each of its registrations left.
    fn sole(&self) -> bool {
        self.0.iter().all(|r| Arc::strong_count(r) == 1)
    }
}

/// A [`Lease`] that keeps nothing alive: what a role knows of the peer's registrations.
#[derive(Clone, Default)]
pub struct WeakLease(Vec<Weak<Registration>>);

impl WeakLease {
    /// Adds `other`'s references (the registrations of several TP ranks held as one).
    pub fn join(&mut self, other: &WeakLease) {
        self.0.extend(other.0.iter().cloned());
    }

    /// The shares, if every registration still exists. Errors: transport (exit 3) when the
    /// peer's memory was deregistered.
    pub fn upgrade(&self) -> Result<Lease> {
        self.0
            .iter()
            .map(Weak::upgrade)
            .collect::<Option<Vec<_>>>()
            .map(Lease)
            .ok_or_else(|| Error::Transport("the peer's memory is no longer registered with NIXL".into()))
    }
}

impl std::fmt::Debug for WeakLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeakLease({} registrations)", self.0.len())
    }
}

/// How long a request dropped before it completed (a run that ends on a timeout, an interrupt
/// or an error with requests in flight) is polled for NIXL to say it is no longer in
/// progress before the memory it moves is given up for good ([`Posted`]'s drop).
pub const DRAIN_BOUND: Duration = Duration::from_secs(2);

/// [`DRAIN_BOUND`] after SIGINT/SIGTERM: the request already had
/// [`crate::sys::interrupt::GRACE`] to complete, and a drain must end before the watchdog would
/// take it for a call blocked past [`crate::sys::deadline::INTERRUPT_GRACE`].
pub const DRAIN_BOUND_INTERRUPTED: Duration = Duration::from_secs(1);
const _: () = assert!(DRAIN_BOUND_INTERRUPTED.as_secs() < crate::sys::deadline::INTERRUPT_GRACE.as_secs());

/// The drain bound in force now ([`DRAIN_BOUND`], or [`DRAIN_BOUND_INTERRUPTED`] after a signal).
fn drain_bound() -> Duration {
    if crate::sys::interrupt::requested() { DRAIN_BOUND_INTERRUPTED } else { DRAIN_BOUND }
}

/// Requests dropped in flight that NIXL confirmed finished within [`DRAIN_BOUND`].
static DRAINED: AtomicUsize = AtomicUsize::new(0);
/// Requests dropped in flight that could not be confirmed finished: they, their registrations
/// and the memory they move are kept until the process exits.
static UNCONFIRMED: AtomicUsize = AtomicUsize::new(0);
/// Requests of this process dropped in flight that could not be confirmed finished (kept,
/// with the memory they move, until exit).
pub fn unconfirmed() -> usize {
    UNCONFIRMED.load(Ordering::SeqCst)
}

static KEPT_SAID: AtomicBool = AtomicBool::new(false);
static DRAINED_SAID: AtomicBool = AtomicBool::new(false);

/// Test-only: `KVPROBE_TEST_UNRECALLABLE=1` makes every request dropped in flight count as
/// one NIXL cannot confirm finished (as a cuda_ipc copy already on a stream, or a backend
/// whose cancel does not complete), so tests can show what kvprobe then keeps. Never set in
/// normal use.
fn test_unrecallable() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| crate::sys::test_hooks::on(crate::sys::test_hooks::UNRECALLABLE))
}

/// Memory `T` (a KV pool) registered with NIXL: the guard owns it, with a share of its
/// registrations ([`Lease`]). Dropped, it frees the memory only when it holds the last share
/// (the agent dropped, no request left): otherwise a request that could not be confirmed
/// finished still holds one, and the memory is kept, registered, until the process exits
/// (one stderr line says so). Derefs to `T`.
pub struct Registered<T> {
    memory: std::mem::ManuallyDrop<T>,
    lease: Lease,
}

impl<T> Registered<T> {
    /// Registers `regions` (which must lie in `memory`) with `agent`, and takes ownership of
    /// `memory` so that it outlives every use NIXL makes of them. Errors: transport (exit 3),
    /// timeout (exit 4).
    pub fn new(agent: &mut Agent, memory: T, regions: &[Region]) -> Result<Registered<T>> {
        // SAFETY: the regions lie in `memory`, which the returned guard owns and frees only
        // after its registration (every share: the agent's, each request's, its own) is gone
        // (`Drop for Registered`); on an error here `memory` is dropped after the handles
        // registered so far, which `register` dropped (deregistered) before returning.
        let lease = unsafe { agent.register(regions)? };
        Ok(Registered { memory: std::mem::ManuallyDrop::new(memory), lease })
    }

    /// `memory` with one registration of no regions (nothing is registered with NIXL): for
    /// tests of the sharing rule without NIXL (`tests/units.rs`).
    #[doc(hidden)]
    pub fn with_empty_registration(memory: T) -> Registered<T> {
        let lease = Lease(vec![Arc::new(Registration { _handles: Vec::new() })]);
        Registered { memory: std::mem::ManuallyDrop::new(memory), lease }
    }

    /// The shares of its registrations (for the requests that move it).
    pub fn lease(&self) -> &Lease {
        &self.lease
    }
}

impl<T> std::ops::Deref for Registered<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.memory
    }
}

impl<T> std::ops::DerefMut for Registered<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.memory
    }
}

impl<T> Drop for Registered<T> {
    fn drop(&mut self) {
        if self.lease.sole() {
            let drained = DRAINED.load(Ordering::SeqCst);
            if drained > 0 && !self.lease.0.is_empty() && !DRAINED_SAID.swap(true, Ordering::SeqCst) {
                eprintln!(
                    "kvprobe: {drained} NIXL request(s) in flight when the run stopped were drained (confirmed finished) before the pools were freed"
                );
            }
            drop(std::mem::take(&mut self.lease)); // deregisters (the last share)
            // SAFETY: `memory` is dropped once, here, and never used after; NIXL no longer
            // has it registered and no request holds a share of it (`sole` above: shares are
            // only cloned from a live one, and this was the last).
            unsafe { std::mem::ManuallyDrop::drop(&mut self.memory) };
            return;
        }
        // A request that could not be confirmed finished still holds the registration: the
        // memory stays mapped and registered until the process exits (`memory` and the lease
        // are never dropped).
        std::mem::forget(std::mem::take(&mut self.lease));
        if !KEPT_SAID.swap(true, Ordering::SeqCst) {
            eprintln!(
                "kvprobe: {} NIXL request(s) in flight when the run stopped could not be confirmed finished within {} s; the pools they move stay allocated and registered with NIXL until kvprobe exits",
                UNCONFIRMED.load(Ordering::SeqCst).max(1),
                drain_bound().as_secs()
            );
        }
    }
}

/// A NIXL agent with one backend and its registered regions.
pub struct Agent {
    agent: nixl_sys::Agent,
    backend: nixl_sys::Backend,
    backend_name: String,
    regs: Lease,
}

/// Outcome of one posted transfer.
#[derive(Clone, Copy, Debug)]
pub struct XferResult {
    /// Bytes moved (sum of descriptor lengths).
    pub bytes: u64,
    /// Wall time from post to completion.
    pub elapsed: Duration,
}

impl Agent {
    /// Creates agent `name` with backend plugin `backend` (e.g. "UCX") and the plugin's
    /// default parameters. Errors (exit 2): NIXL missing, or the plugin is not installed /
    /// fails to start.
    pub fn new(name: &str, backend: &str) -> Result<Agent> {
        Self::with_params(name, backend, &BTreeMap::new())
    }

    /// [`Agent::new`] with `params` (`--backend-param KEY=VALUE`) set over the plugin's
    /// default parameters (`getPluginParams`) before the backend is created
    /// (`createBackend`), as `nixl_agent_config` passes backend parameters in NIXL's Python
    /// API. NIXL hands every key to the plugin, which reads the keys it knows and ignores
    /// the rest (NIXL's UCX plugin, src/plugins/ucx/ucx_backend.cpp, looks keys up with
    /// `getBackendParamDefaulted`): so a key the plugin does not know is refused here
    /// ([`check_backend_params`]) instead of being silently ignored. Errors (exit 2): as
    /// [`Agent::new`]; usage for an unknown key, naming the valid ones.
    pub fn with_params(name: &str, backend: &str, params: &BTreeMap<String, String>) -> Result<Agent> {
        load()?;
        if backend == "UCX" {
            // Before NIXL's agent and UCX start: without it they hang rather than fail.
            crate::xfer::ucx::check_loopback()?;
        }
        let w = crate::sys::deadline::watch_setup(|| format!("creating NIXL agent {name} with backend {backend}").into());
        let agent = nixl_sys::Agent::new(name).map_err(|e| terr("create NIXL agent", e))?;
        let plugins: Vec<String> = agent
            .get_available_plugins()
            .map(|l| l.iter().filter_map(|s| s.ok().map(str::to_string)).collect())
            .unwrap_or_default();
        if !plugins.iter().any(|p| p == backend) {
            return Err(Error::Environment(format!(
                "NIXL backend plugin {backend:?} is not installed (available: {})",
                plugins.join(", ")
            )));
        }
        let (_mems, mut defaults) =
            agent.get_plugin_params(backend).map_err(|e| Error::Environment(format!("NIXL plugin {backend}: {e}")))?;
        if !params.is_empty() {
            let known: Vec<String> =
                defaults.iter().map(|it| it.filter_map(|p| p.ok().map(|(k, _)| k.to_string())).collect()).unwrap_or_default();
            check_backend_params(backend, &known, params)?;
            for (k, v) in params {
                defaults.set(k, v).map_err(|e| Error::Usage(format!("--backend-param {k}={v}: NIXL refused it: {e}")))?;
            }
        }
        // What this process listened on before the backend started: what it adds is UCX's.
        let before = crate::sys::net::listening(std::process::id()).unwrap_or_default();
        let b = agent.create_backend(backend, &defaults).map_err(|e| {
            let given: Vec<String> = params.iter().map(|(k, v)| format!("{k}={v}")).collect();
            Error::Environment(format!(
                "NIXL backend {backend} failed to start{}: {e}{}",
                if given.is_empty() { String::new() } else { format!(" with --backend-param {}", given.join(" ")) },
                file_size_limit_hint()
            ))
        })?;
        w.check()?;
        if std::env::var_os(crate::sys::test_hooks::WIDE_LISTENER).is_some() {
            // A listener as a library could open it, kept open until exit.
            if let Ok(l) = std::net::TcpListener::bind((std::net::Ipv4Addr::UNSPECIFIED, 0)) {
                std::mem::forget(l);
            }
        }
        check_new_listeners(&format!("NIXL agent {name} ({backend} backend)"), &before)?;
        Ok(Agent { agent, backend: b, backend_name: backend.to_string(), regs: Lease::default() })
    }

    /// The agent's name.
    pub fn name(&self) -> String {
        self.agent.name()
    }

    /// The backend plugin in use.
    pub fn backend_name(&self) -> &str {
        &self.backend_name
    }

    /// Registers `regions` with this agent's backend; returns a share of the registration
    /// ([`Lease`]; the agent keeps another). NIXL deregisters them when the last share drops.
    /// Prefer [`Registered::new`], which owns the memory and upholds the contract below.
    ///
    /// # Safety
    /// Every region must stay mapped (and, for VRAM, allocated) until the registration is
    /// gone — until the agent, the returned lease and every request holding a share of it
    /// ([`Posted`]) have dropped — and must not be freed before then even when that is never
    /// (a request that could not be confirmed finished keeps its share until exit).
    /// Errors: transport (exit 3), timeout (exit 4).
    pub unsafe fn register(&mut self, regions: &[Region]) -> Result<Lease> {
        let w = crate::sys::deadline::watch_setup(|| format!("registering {} regions with NIXL", regions.len()).into());
        let mut opt = nixl_sys::OptArgs::new().map_err(|e| terr("opt args", e))?;
        opt.add_backend(&self.backend).map_err(|e| terr("opt args", e))?;
        let mut handles = Vec::with_capacity(regions.len());
        for r in regions {
            handles.push(self.agent.register_memory(r, Some(&opt)).map_err(|e| terr("register memory", e))?);
        }
        let lease = Lease(vec![Arc::new(Registration { _handles: handles })]);
        w.check()?; // on a timeout the lease drops here, the only share: deregistered
        self.regs.join(&lease);
        Ok(lease)
    }

    /// This agent's metadata blob, for the peer's [`Agent::load_remote`].
    pub fn metadata(&self) -> Result<Vec<u8>> {
        let w = crate::sys::deadline::watch_setup(|| "NIXL getLocalMD".into());
        let md = self.agent.get_local_md().map_err(|e| terr("get local metadata", e))?;
        w.check()?;
        Ok(md)
    }

    /// Loads a peer's metadata; returns the peer's agent name.
    pub fn load_remote(&self, md: &[u8]) -> Result<String> {
        let w = crate::sys::deadline::watch_setup(|| "NIXL loadRemoteMD".into());
        let name = self.agent.load_remote_md(md).map_err(|e| terr("load remote metadata", e))?;
        w.check()?;
        Ok(name)
    }

    fn dlist(mem: MemType, descs: &[(u64, u64)], dev: u64) -> Result<XferDescList<'static>> {
        let mut l = XferDescList::new(mem).map_err(|e| terr("descriptor list", e))?;
        for &(a, n) in descs {
            l.add_desc(a as usize, n as usize, dev);
        }
        Ok(l)
    }

    fn backend_opt(&self) -> Result<nixl_sys::OptArgs> {
        let mut opt = nixl_sys::OptArgs::new().map_err(|e| terr("opt args", e))?;
        opt.add_backend(&self.backend).map_err(|e| terr("opt args", e))?;
        Ok(opt)
    }

    /// Whether the metadata this agent loaded from `peer` covers every descriptor of
    /// `descs` (`checkRemoteMD` with the real list: each descriptor must lie in memory the
    /// peer registered with a backend this agent shares). vLLM's NixlConnector relies on
    /// `add_remote_agent` having loaded it; kvprobe checks it once after loading, before the
    /// first transfer. Errors: transport (exit 3) when the list cannot be built.
    pub fn check_remote(&self, peer: &str, descs: (&[(u64, u64)], MemType, u64)) -> Result<bool> {
        let _w =
            crate::sys::deadline::watch_setup(|| format!("NIXL checkRemoteMD of {} descriptors of {peer}", descs.0.len()).into());
        let l = Self::dlist(descs.1, descs.0, descs.2)?;
        Ok(self.agent.check_remote_metadata(peer, Some(&l)))
    }

    /// Prepares `descs` once (`prepXferDlist`) for requests made from indices into it
    /// ([`Descs::Prepared`], `makeXferReq`): this agent's own memory when `peer` is `None`
    /// (NIXL's `NIXL_INIT_AGENT`, the empty name), else memory `peer` registered (its
    /// metadata loaded). As vLLM's NixlConnector `register_local_xfer_handler` and
    /// `add_remote_agent` prepare one list per side (vllm/distributed/kv_transfer/
    /// kv_connector/v1/nixl_connector.py). Errors: transport (exit 3) when NIXL refuses a
    /// descriptor (outside registered memory).
    pub fn prepare(&self, peer: Option<&str>, descs: (&[(u64, u64)], MemType, u64)) -> Result<PreparedList> {
        let who = peer.unwrap_or("this agent");
        let _w =
            crate::sys::deadline::watch_setup(|| format!("NIXL prepXferDlist of {} descriptors of {who}", descs.0.len()).into());
        let l = Self::dlist(descs.1, descs.0, descs.2)?;
        let opt = self.backend_opt()?;
        let handle = self
            .agent
            .prepare_xfer_dlist(peer.unwrap_or(""), &l, Some(&opt))
            .map_err(|e| terr(&format!("prepare the descriptor list of {who}"), e))?;
        Ok(PreparedList { handle, len: descs.0.len(), _agent: self.agent.clone() })
    }

    /// Builds one request (not posted) with notification `notif` to `peer`.
    fn request(&self, op: XferOp, descs: &Descs<'_>, peer: &str, opt: &nixl_sys::OptArgs) -> Result<nixl_sys::XferRequest> {
        match descs {
            Descs::Fresh { local, remote } => {
                let l = Self::dlist(local.1, local.0, local.2)?;
                let r = Self::dlist(remote.1, remote.0, remote.2)?;
                self.agent.create_xfer_req(op, &l, &r, peer, Some(opt)).map_err(|e| terr("create transfer request", e))
            }
            Descs::Prepared { local, local_idx, remote, remote_idx, .. } => self
                .agent
                .make_xfer_req(op, &local.handle, local_idx, &remote.handle, remote_idx, Some(opt))
                .map_err(|e| terr("make transfer request from prepared descriptors", e)),
        }
    }

    fn notif_opt(&self, notif: &[u8]) -> Result<nixl_sys::OptArgs> {
        let mut opt = self.backend_opt()?;
        opt.set_notification_message(notif).map_err(|e| terr("notification", e))?;
        opt.set_has_notification(true).map_err(|e| terr("notification", e))?;
        Ok(opt)
    }

    /// Builds one request of `descs` to `peer` as [`Agent::post`] would, releases it without
    /// posting it, and returns the seconds the build took (`kvprobe bench`'s request rows).
    /// Errors: transport (exit 3) when NIXL refuses it.
    pub fn time_request(&self, op: XferOp, descs: &Descs<'_>, peer: &str) -> Result<f64> {
        let opt = self.notif_opt(b"kvprobe-bench")?;
        let t = Instant::now();
        let req = self.request(op, descs, peer, &opt)?;
        let secs = t.elapsed().as_secs_f64();
        drop(req);
        Ok(secs)
    }

    /// Posts one transfer of `descs` (READ pulls remote into local; WRITE pushes local to
    /// remote) without waiting; the peer gets `notif` as a NIXL notification when it
    /// completes. Poll it with [`Agent::poll`].
    ///
    /// `deadline` started just before the caller built the request: a post call that returns
    /// after it is a timeout, whether or not the request completed inside the call (the
    /// request is released). `keep` is the shares of the memory the request moves ([`Lease`]:
    /// the local pool's and, when the peer lives in this process, the peer's); the request
    /// holds them until it is confirmed finished. Errors: [`Error::Transport`] when NIXL
    /// refuses the request, [`Error::Timeout`] (exit 4) past the deadline.
    pub fn post(
        &self,
        op: XferOp,
        descs: Descs<'_>,
        peer: &str,
        notif: &[u8],
        deadline: Deadline,
        keep: Lease,
    ) -> Result<Posted> {
        let bytes = descs.bytes();
        let what = || format!("posting a NIXL {op:?} of {bytes} bytes ({} descriptors) with {peer}", descs.count()).into();
        let _w = crate::sys::deadline::watch_until(deadline, what);
        let opt = self.notif_opt(notif)?;
        let req = self.request(op, &descs, peer, &opt)?;
        let mut pending = self.agent.post_xfer_req(&req, Some(&opt)).map_err(|e| terr("post transfer", e))?;
        if let Some(stall) = crate::sys::deadline::Stall::Post.secs() {
            // Test-only: a post call that completes its request inside it, then blocks.
            while pending {
                pending = matches!(
                    self.agent.get_xfer_status(&req).map_err(|e| terr("transfer failed", e))?,
                    nixl_sys::XferStatus::InProgress
                );
            }
            std::thread::sleep(stall);
        }
        let returned = Instant::now();
        let p = Posted {
            req: Some(req),
            lease: keep,
            agent: self.agent.clone(),
            op,
            bytes,
            peer: peer.to_string(),
            deadline,
            // Test-only: with the status stall set, a request that completed inside the post
            // call is still queried (so the stall happens whatever the machine's speed).
            done: (!pending && crate::sys::deadline::Stall::Status.secs().is_none()).then(|| deadline.start.elapsed()),
            late_misses: 0,
        };
        if deadline.passed_at(returned) {
            return Err(p.timeout(&format!(
                "posting it took {:.3} s{}",
                (returned - deadline.start).as_secs_f64(),
                if pending { "" } else { " (it completed inside the post call)" }
            )));
        }
        Ok(p)
    }

    /// Checks a posted transfer once: `Some(result)` when it has completed. A request still in
    /// progress at two checks that began after its deadline has timed out (the first check
    /// after kvprobe was busy elsewhere drives NIXL's progress; a request found complete is
    /// never late by this rule: when it completed is not known); so has one whose status
    /// query began before its deadline and returned after it ([`crate::sys::deadline::crossed`]).
    /// Errors: [`Error::Transport`] when NIXL reports it failed, [`Error::Timeout`] (exit 4).
    pub fn poll(&self, p: &mut Posted) -> Result<Option<XferResult>> {
        if p.done.is_none() {
            let asked = Instant::now();
            let status = {
                // A static name: this runs in the wait's spin loop.
                let _w = crate::sys::deadline::watch_until(p.deadline, || "a NIXL transfer status query".into());
                crate::sys::deadline::Stall::Status.here();
                let Some(req) = &p.req else { return Ok(None) };
                self.agent.get_xfer_status(req).map_err(|e| terr("transfer failed", e))?
            };
            // A query that was still blocked when the deadline passed: the wait exceeded
            // --timeout, whatever the query found.
            let returned = Instant::now();
            if crate::sys::deadline::crossed(&p.deadline, asked, returned) {
                return Err(p.timeout(&format!(
                    "a status query begun {:.3} s after it was posted returned {:.3} s after it was posted",
                    (asked - p.deadline.start).as_secs_f64(),
                    (returned - p.deadline.start).as_secs_f64()
                )));
            }
            match status {
                nixl_sys::XferStatus::Success => p.done = Some(p.deadline.start.elapsed()),
                nixl_sys::XferStatus::InProgress => {
                    if p.deadline.passed_at(asked) {
                        p.late_misses += 1;
                        if p.late_misses >= 2 {
                            return Err(p.timeout("still in progress"));
                        }
                    }
                    return Ok(None);
                }
            }
        }
        Ok(p.done.map(|elapsed| XferResult { bytes: p.bytes, elapsed }))
    }

    /// Sends `msg` to agent `peer` as a NIXL notification without any transfer (genNotif);
    /// test-only faults use it to deliver a transfer's notification before its data.
    /// Errors: [`Error::Transport`] when NIXL refuses it.
    pub fn notify(&self, peer: &str, msg: &[u8]) -> Result<()> {
        let _w = crate::sys::deadline::watch(|| "sending a NIXL notification".into());
        self.agent.send_notification(peer, msg, Some(&self.backend)).map_err(|e| terr("send notification", e))
    }

    /// Takes every notification that has arrived, as `(peer agent, message)` pairs. The
    /// callers check the query against the deadlines of the requests they wait for
    /// ([`crate::sys::deadline::crossed`]).
    pub fn take_notifications(&self) -> Result<Vec<(String, String)>> {
        // A poll for requests that carry their own deadlines (checked by the callers): only a
        // query that never returns needs the watchdog.
        let _w = crate::sys::deadline::watch(|| "a NIXL notification query".into());
        crate::sys::deadline::Stall::Notifications.here();
        let mut map = nixl_sys::NotificationMap::new().map_err(|e| terr("notification map", e))?;
        self.agent.get_notifications(&mut map, None).map_err(|e| terr("get notifications", e))?;
        let got = map.take_notifs().map_err(|e| terr("read notifications", e))?;
        Ok(got.into_iter().flat_map(|(peer, msgs)| msgs.into_iter().map(move |m| (peer.clone(), m))).collect())
    }
}

/// The descriptors of one request: built for it, or indices into lists prepared once.
pub enum Descs<'a> {
    /// Lists built for this request (`createXferReq`): `(descriptors as (address, bytes),
    /// memory type, device)` of the local and the remote side, `local[i] <-> remote[i]`.
    Fresh {
        /// This agent's side.
        local: (&'a [(u64, u64)], MemType, u64),
        /// The peer's side.
        remote: (&'a [(u64, u64)], MemType, u64),
    },
    /// Indices into lists prepared once ([`Agent::prepare`], `makeXferReq`):
    /// `local[local_idx[i]] <-> remote[remote_idx[i]]`. NIXL merges runs of consecutive
    /// indices whose memory is contiguous on both sides into one descriptor
    /// (src/core/nixl_agent.cpp, `makeXferReq`).
    Prepared {
        /// This agent's prepared list.
        local: &'a PreparedList,
        /// Indices into it.
        local_idx: &'a [i32],
        /// The peer's prepared list.
        remote: &'a PreparedList,
        /// Indices into it (as many as `local_idx`).
        remote_idx: &'a [i32],
        /// Bytes the request moves (the sum of the indexed descriptors' lengths).
        bytes: u64,
    },
}

impl Descs<'_> {
    /// Bytes the request moves.
    pub fn bytes(&self) -> u64 {
        match self {
            Descs::Fresh { local, .. } => local.0.iter().map(|d| d.1).sum(),
            Descs::Prepared { bytes, .. } => *bytes,
        }
    }

    /// Descriptors (fresh) or index pairs (prepared) of the request.
    pub fn count(&self) -> usize {
        match self {
            Descs::Fresh { local, .. } => local.0.len(),
            Descs::Prepared { local_idx, .. } => local_idx.len(),
        }
    }
}

/// A descriptor list NIXL prepared once for one side (`prepXferDlist`, [`Agent::prepare`]);
/// requests index into it ([`Descs::Prepared`]). Released (`releasedDlistH`) on drop.
pub struct PreparedList {
    // Field order is drop order: the handle is released while the agent it names (kept
    // alive by the clone below) still exists.
    handle: nixl_sys::XferDlistHandle,
    len: usize,
    _agent: nixl_sys::Agent,
}

// SAFETY: the handle is a pointer to NIXL's prepared list (nixlDlistH) and to the agent that
// made it, which `_agent` keeps alive. NIXL never changes a prepared list after
// prepXferDlist returns: makeXferReq only reads it, under the agent's shared lock
// (src/core/nixl_agent.cpp), so shared use from several threads is sound; it is released
// once, in Drop, which needs exclusive access.
unsafe impl Send for PreparedList {}
// SAFETY: as for Send: shared references only reach makeXferReq, which reads the list.
unsafe impl Sync for PreparedList {}

impl PreparedList {
    /// Descriptors in the list (valid indices are `0..len`).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the list holds no descriptor.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A posted NIXL transfer request (see [`Agent::post`]). It holds the agent and a share of
/// the registration of the memory it moves ([`Lease`]), so neither can be deregistered or
/// freed under it. Dropped before it was seen complete (a run that stops on a timeout, an
/// interrupt or an error), it is polled for up to [`DRAIN_BOUND`] (1 s after a signal) until NIXL says it is no
/// longer in progress, then released; one that cannot be confirmed finished (still in
/// progress, or a cuda_ipc copy already on a stream) is never released and keeps its shares,
/// and so the memory, until the process exits.
pub struct Posted {
    // Field order is drop order: the request is released before its shares drop.
    req: Option<nixl_sys::XferRequest>,
    lease: Lease,
    agent: nixl_sys::Agent,
    op: XferOp,
    bytes: u64,
    peer: String,
    deadline: Deadline,
    done: Option<Duration>,
    /// Checks begun after the deadline that found it still in progress.
    late_misses: u8,
}

impl Posted {
    /// Bytes the request moves.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Time since its deadline started (just before it was posted).
    pub fn age(&self) -> Duration {
        self.deadline.start.elapsed()
    }

    /// Its deadline (`--timeout` from just before it was posted).
    pub fn deadline(&self) -> Deadline {
        self.deadline
    }

    /// Polls the request, without the test stall hooks, until NIXL says it is no longer in
    /// progress (complete or failed: either way it no longer touches the memory), for up to
    /// [`drain_bound`] — or only once when an earlier request could not be confirmed (then
    /// NIXL is stuck, and a run with many requests in flight would otherwise wait for each).
    /// False when it could not be confirmed.
    fn settle(&self) -> bool {
        let Some(req) = &self.req else { return true };
        if test_unrecallable() {
            return false;
        }
        let bound = Deadline::after(drain_bound());
        let _w = crate::sys::deadline::watch_until(bound, || "a NIXL status query draining a request left in flight".into());
        loop {
            match self.agent.get_xfer_status(req) {
                Ok(nixl_sys::XferStatus::InProgress)
                    if UNCONFIRMED.load(Ordering::SeqCst) == 0 && !bound.passed_at(Instant::now()) =>
                {
                    std::thread::sleep(Duration::from_micros(50))
                }
                Ok(nixl_sys::XferStatus::InProgress) => return false,
                Ok(nixl_sys::XferStatus::Success) | Err(_) => return true,
            }
        }
    }

    fn timeout(&self, why: &str) -> Error {
        Error::Timeout(format!(
            "{:?} of {} bytes {} {}: {why}, over --timeout {:.6} s ({:.3} s since it was posted)",
            self.op,
            self.bytes,
            if matches!(self.op, XferOp::Read) { "from" } else { "to" },
            self.peer,
            self.deadline.limit_secs(),
            self.deadline.elapsed_secs()
        ))
    }
}

impl Drop for Posted {
    fn drop(&mut self) {
        if self.done.is_some() {
            return; // complete: released, then its shares dropped
        }
        if self.settle() {
            DRAINED.fetch_add(1, Ordering::SeqCst);
            return;
        }
        // Not confirmed finished: releasing it would only cancel it best-effort. Never release
        // it, and keep its shares of the registrations until exit: the memory it moves cannot
        // be deregistered or freed ([`Registered`]).
        std::mem::forget(self.req.take());
        std::mem::forget(std::mem::take(&mut self.lease));
        UNCONFIRMED.fetch_add(1, Ordering::SeqCst);
    }
}
