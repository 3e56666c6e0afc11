//! Transport diagnosis: which transport and protocol UCX chose for kvprobe's transfers.
//!
//! UCX prints its protocol selection tables when `UCX_PROTO_INFO=y` (one table per operation
//! and memory-type pair, the first time a worker uses it: "remote memory read by
//! ucp_get*(multi) into cuda/dev[0] from cuda/dev[0]", with rows of message-size range,
//! description such as "zero-copy" or "software emulation", and config such as
//! "cuda_ipc/cuda" or "tcp/lo"). kvprobe turns that on for its own process (unless the user
//! set `UCX_PROTO_INFO` or `UCX_LOG_FILE`, or `KVPROBE_UCX_DIAG=0`) with the log going to a
//! file (`nixl::set_process_env`), reads back the tables of each run, and reports
//! the selection for the memory types of the run, flagging software emulation.
//!
//! UCX's own messages go to that file too while it is on; a sweep's are handed back in
//! [`TransportPath::ucx_messages`], and kvprobe prints all of them to stderr when it exits
//! ([`messages`]), so a failure UCX explains (a bad `UCX_TLS`, say) is still explained.

use serde::Serialize;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::OnceLock;

/// `UCX_CUDA_IPC_ENABLE_GET_ZCOPY`: without it UCX serves a READ of CUDA memory from another
/// agent on the same GPU by software emulation over tcp (0.33-0.45 GB/s on an H100, against
/// 3.9 GB/s with it); kvprobe turns it on for its own agents unless the user set it
/// ([`crate::xfer::nixl::set_process_env`]).
pub const GET_ZCOPY_ENV: &str = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY";

/// Checks that this network namespace's loopback carries packets, which UCX needs to create
/// a worker: a UDP datagram from 127.0.0.1 to itself. A new network namespace (`ip netns
/// add`) starts with `lo` down, and then UCX spins inside NIXL agent creation until kvprobe's
/// bound ends it (exit 4, naming agent creation, not the cause). Read from a socket rather
/// than `/sys/class/net/lo/flags`, which shows the namespace that mounted sysfs (`nsenter
/// --net` keeps the old one). Errors: environment (exit 2) when 127.0.0.1 cannot be bound
/// (address not available: `lo` down while another interface is up) or the datagram cannot
/// be sent (network unreachable: `lo` down), saying what to do; anything else (no socket
/// could be made at all) tells nothing and passes.
pub fn check_loopback() -> crate::error::Result<()> {
    use std::io::ErrorKind;
    let down = |e: std::io::Error, doing: &str| {
        Err(crate::error::Error::Environment(format!(
            "the loopback interface (lo) is down in this network namespace ({doing}: {e}): UCX cannot create its \
             worker without it and would hang. Bring it up: `ip link set lo up` inside the namespace, or \
             `ip -n NAMESPACE link set lo up` from outside"
        )))
    };
    let s = match std::net::UdpSocket::bind((std::net::Ipv4Addr::LOCALHOST, 0)) {
        Ok(s) => s,
        Err(e) if e.kind() == ErrorKind::AddrNotAvailable => return down(e, "binding 127.0.0.1"),
        Err(_) => return Ok(()),
    };
    let Ok(me) = s.local_addr() else { return Ok(()) };
    match s.send_to(b"kvprobe", me) {
        Err(e) if e.kind() == ErrorKind::NetworkUnreachable => down(e, &format!("sending to {me}")),
        _ => Ok(()),
    }
}

/// `UCX_DEBUG_SIGNO`: the signal UCX's debug handler takes (SIGHUP by default, which would
/// swallow a closed terminal's hangup); kvprobe sets 0 (no debug signal) unless the user set it.
pub const DEBUG_SIGNO_ENV: &str = "UCX_DEBUG_SIGNO";

/// The variables [`crate::xfer::nixl::set_process_env`] set (the user had not): kvprobe's defaults.
static DEFAULTS: OnceLock<Vec<String>> = OnceLock::new();

/// The names of the UCX_*/NIXL_* variables whose values are kvprobe's defaults, set by
/// [`crate::xfer::nixl::set_process_env`] because the user had not set them (the report's
/// `environment.transport_env_defaults`). Empty before it ran.
pub fn kvprobe_defaults() -> &'static [String] {
    DEFAULTS.get().map(|v| v.as_slice()).unwrap_or(&[])
}

/// Records the names [`crate::xfer::nixl::set_process_env`] set (once; later calls change nothing).
pub fn record_defaults(names: Vec<String>) {
    let _ = DEFAULTS.set(names);
}

/// True once [`record_defaults`] ran.
pub fn defaults_recorded() -> bool {
    DEFAULTS.get().is_some()
}

/// Environment variable that turns the capture off (`KVPROBE_UCX_DIAG=0`).
pub const DIAG_ENV: &str = "KVPROBE_UCX_DIAG";

static LOG: OnceLock<Option<PathBuf>> = OnceLock::new();

/// The UCX log file kvprobe asked for, if the capture is on (set once, by
/// `nixl::set_process_env`).
pub fn log_path() -> Option<&'static PathBuf> {
    LOG.get().and_then(|p| p.as_ref())
}

pub(crate) fn set_log_path(p: Option<PathBuf>) {
    let _ = LOG.set(p);
}

static OFF_BECAUSE: OnceLock<String> = OnceLock::new();

/// Records why the capture is off when it is not the user's choice (e.g. no temporary
/// directory could be made); reports give it as the path's `unknown_because`.
pub(crate) fn set_off_because(why: String) {
    let _ = OFF_BECAUSE.set(why);
}

/// One row of a UCX protocol table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ProtoRow {
    /// Message sizes in bytes, e.g. "0..inf" or "8185..65528".
    pub range: String,
    /// UCX's protocol, e.g. "zero-copy", "multi-frag copy-in", "software emulation".
    pub description: String,
    /// Transport/device, e.g. "cuda_ipc/cuda", "cma/memory", "tcp/lo".
    pub config: String,
}

/// One UCX protocol selection: the operation and memory types, and its rows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Selection {
    /// UCX's heading, e.g. "remote memory read by ucp_get*(multi) into cuda/dev[0] from cuda/dev[0]".
    pub operation: String,
    /// The endpoint the table belongs to, as UCX names it above the heading: the worker's
    /// name and the endpoint's reach (`self`, `intra-node`, `inter-node`) and configuration,
    /// e.g. "kvprobe-prefill inter-node cfg#1". `None` when UCX printed no such line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// The rows, smallest messages first.
    pub rows: Vec<ProtoRow>,
}

/// What carried a run's transfers.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct TransportPath {
    /// NIXL backend.
    pub backend: String,
    /// UCX's selections for this run's operation (READ: remote memory read; WRITE: remote
    /// memory write) between the run's memory types (VRAM: cuda; DRAM: host).
    pub selections: Vec<Selection>,
    /// Why `selections` is empty, when it is (capture off, another backend, nothing seen).
    pub unknown_because: Option<String>,
    /// True when a selection is UCX's "software emulation" (the slow fallback).
    pub emulated: bool,
    /// Rate of one copy of the pool, prefill to decode, measured in the same run (GB/s, bytes
    /// moved once: cuMemcpyDtoD for VRAM, memcpy on all threads for DRAM); the ceiling the
    /// transfer rate is compared to. `None` for pools under [`crate::mem::pool::MIN_CEILING_BYTES`]
    /// (too small to time a copy).
    pub copy_gbps: Option<f64>,
    /// Transfer rate / `copy_gbps`.
    pub ratio_to_copy: Option<f64>,
    /// Advice when the path is slow for a known reason.
    pub warning: Option<String>,
    /// UCX's warnings and errors from this run (they go to kvprobe's UCX log while the capture is on).
    pub ucx_messages: Vec<String>,
    /// What is wrong with the path given the host's RDMA facts ([`flag_path`]): TCP while an
    /// RDMA port is up, VRAM over RDMA without GPUDirect RDMA, a NIC farther from the GPU than
    /// another. Absent when empty (and in reports written before it existed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub flags: Vec<PathFlag>,
    /// VRAM runs: `UCX_CUDA_IPC_ENABLE_GET_ZCOPY` as the agents of this process had it, and who
    /// set it ([`GET_ZCOPY_ENV`]: with it off UCX serves a READ of CUDA memory on
    /// one GPU by software emulation over tcp). Absent for DRAM runs and in reports written
    /// before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub get_zcopy: Option<EnvSetting>,
}

/// An environment variable as this process had it, and who set it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct EnvSetting {
    /// The variable, e.g. "UCX_CUDA_IPC_ENABLE_GET_ZCOPY".
    pub name: String,
    /// Its value; `None` when unset (UCX's own default applies).
    pub value: Option<String>,
    /// "kvprobe" (kvprobe's default: the user had not set it, [`kvprobe_defaults`]),
    /// "user" (set before kvprobe started), or "unset".
    pub set_by: String,
}

impl EnvSetting {
    /// Variable `name` as this process has it now.
    pub fn of(name: &str) -> EnvSetting {
        let value = std::env::var_os(name).filter(|v| !v.is_empty()).map(|v| v.to_string_lossy().into_owned());
        let set_by = match &value {
            None => "unset",
            Some(_) if kvprobe_defaults().iter().any(|d| d == name) => "kvprobe",
            Some(_) => "user",
        };
        EnvSetting { name: name.to_string(), value, set_by: set_by.to_string() }
    }
}

impl std::fmt::Display for EnvSetting {
    /// `NAME=VALUE, kvprobe's default` / `NAME=VALUE, set by the user` / `NAME unset`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.value, self.set_by.as_str()) {
            (Some(v), "kvprobe") => write!(f, "{}={v}, kvprobe's default", self.name),
            (Some(v), _) => write!(f, "{}={v}, set by the user", self.name),
            (None, _) => write!(f, "{} unset", self.name),
        }
    }
}

/// One problem with the path UCX selected, judged against the host's RDMA facts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct PathFlag {
    /// Stable short code: `tcp-with-rdma-present`, `rdma-port-down`, `no-gpudirect-rdma`,
    /// `staged-through-host`, `nic-not-nearest` (docs/gpu-hosts.md, "Which NIC carried the
    /// bytes"); `same-host` for a node pair whose bytes never left one host ([`same_host_flag`]).
    pub code: String,
    /// One sentence saying what UCX did and why it matters.
    pub message: String,
    /// The setting (or command) that fixes it, when there is one.
    pub fix: Option<String>,
}

impl std::fmt::Display for PathFlag {
    /// `CODE: MESSAGE (fix: FIX)`, as the summaries print a flag.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)?;
        if let Some(x) = &self.fix {
            write!(f, " (fix: {x})")?;
        }
        Ok(())
    }
}

static ADOPTED: OnceLock<std::sync::Mutex<std::fs::File>> = OnceLock::new();

/// Once UCX has opened its log (after the first NIXL agent with the UCX backend), keeps a
/// handle on it through `/proc/self/fd` and removes the file (a kill before then leaves it in
/// kvprobe's private directory, which the next kvprobe removes: [`crate::sys::tempdir`]). Later reads go through the handle.
pub fn adopt() {
    if ADOPTED.get().is_some() {
        return;
    }
    let Some(path) = log_path() else { return };
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else { return };
    for fd in fds.flatten() {
        if std::fs::read_link(fd.path()).is_ok_and(|t| &t == path)
            && let Ok(f) = std::fs::File::open(fd.path())
        {
            let _ = ADOPTED.set(std::sync::Mutex::new(f));
            remove_log();
            return;
        }
    }
}

/// Size of the UCX log now: a run reads what was written after it.
pub fn mark() -> u64 {
    crate::sys::child::flush_c_stdio();
    match ADOPTED.get() {
        Some(f) => f.lock().ok().and_then(|f| f.metadata().ok()).map_or(0, |m| m.len()),
        None => log_path().and_then(|p| std::fs::metadata(p).ok()).map_or(0, |m| m.len()),
    }
}

/// Reads the UCX log from `from` (see [`mark`]).
fn read_since(from: u64) -> Option<String> {
    crate::sys::child::flush_c_stdio();
    let read = |f: &mut std::fs::File| {
        let mut s = String::new();
        f.seek(SeekFrom::Start(from)).ok()?;
        f.read_to_string(&mut s).ok()?;
        Some(s)
    };
    match ADOPTED.get() {
        Some(f) => read(&mut *f.lock().ok()?),
        None => read(&mut std::fs::File::open(log_path()?).ok()?),
    }
}

/// The connections UCX could not open, from UCX's messages in `text` (a UCX log): its
/// `connect(fd=N, dest_addr=ADDRESS) failed: REASON` errors, as (ADDRESS, REASON), each
/// address once, in order.
pub fn connect_failures(text: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for l in text.lines().filter(|l| l.contains("UCX  ERROR")) {
        let Some((_, rest)) = l.split_once("dest_addr=") else { continue };
        let Some((addr, rest)) = rest.split_once(')') else { continue };
        let Some((_, reason)) = rest.split_once("failed: ") else { continue };
        if !out.iter().any(|(a, _)| a == addr) {
            out.push((addr.trim().to_string(), reason.trim().to_string()));
        }
    }
    out
}

/// What UCX's log of this process says about connections it could not open, as a clause for
/// a NIXL error (empty when it says nothing, or the capture is off): "; UCX on host H could
/// not open a connection to ADDRESS (REASON): ..." with what to do. UCX connects in both
/// directions between two agents, so a firewall that lets only one direction through fails
/// here on the side that was refused, which may not be the side whose operation failed:
/// serve passes this clause to decode inside its error.
pub fn connect_hint() -> String {
    let Some(text) = read_since(0) else { return String::new() };
    let failed = connect_failures(&text);
    if failed.is_empty() {
        return String::new();
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
    let to: Vec<String> = failed.iter().map(|(a, r)| format!("{a} ({r})")).collect();
    format!(
        "; UCX on host {} could not open a connection to {}: UCX connects in both directions between the hosts, so \
         each host's UCX ports must be reachable from the other (pin them with UCX_TCP_PORT_RANGE on both sides and \
         open that range both ways: docs/two-hosts.md, firewalled pairs)",
        if host.is_empty() { "?" } else { &host },
        to.join(", ")
    )
}

/// The whole UCX log of this process (protocol tables and UCX's messages) when the capture
/// is on ([`log_path`]), read through the descriptor kvprobe keeps once the file is unlinked;
/// `None` when it is off or unreadable. Used by the bundle's environment capture
/// (`capture`).
pub fn log_text() -> Option<String> {
    read_since(0)
}

/// The cell text of a table line `[time] [host:pid:thread]   | a | b | c |`.
fn cells(line: &str) -> Option<Vec<String>> {
    let body = &line[line.find('|')?..];
    let body = body.trim().strip_prefix('|')?.strip_suffix('|')?;
    Some(body.split('|').map(|c| c.trim().to_string()).collect())
}

/// True for UCX's endpoint line above a table heading: "WORKER self|intra-node|inter-node cfg#N".
fn is_endpoint_line(c: &str) -> bool {
    let f: Vec<&str> = c.split_whitespace().collect();
    matches!(f.as_slice(), [_, reach, cfg] if ["self", "intra-node", "inter-node"].contains(reach) && cfg.starts_with("cfg#"))
}

/// Parses UCX_PROTO_INFO tables out of log text.
pub fn parse(text: &str) -> Vec<Selection> {
    let mut out: Vec<Selection> = Vec::new();
    let mut current: Option<Selection> = None;
    let mut endpoint: Option<String> = None;
    for line in text.lines() {
        let Some(c) = cells(line) else {
            if line.contains("+-") {
                continue; // a table rule
            }
            if let Some(s) = current.take() {
                out.push(s);
            }
            continue;
        };
        match c.len() {
            1 if c[0].starts_with("remote memory") || c[0].contains(" by ucp_") => {
                if let Some(s) = current.take() {
                    out.push(s);
                }
                current = Some(Selection { operation: c[0].clone(), endpoint: endpoint.take(), rows: Vec::new() });
            }
            1 if is_endpoint_line(&c[0]) => endpoint = Some(c[0].clone()),
            3 if c[0] == "Range" => {}
            3 => {
                if let Some(s) = current.as_mut() {
                    s.rows.push(ProtoRow { range: c[0].clone(), description: c[1].clone(), config: c[2].clone() });
                }
            }
            _ => {}
        }
    }
    out.extend(current);
    out.retain(|s| !s.rows.is_empty());
    out.dedup();
    out
}

/// The selections of a run with `op` ("READ"/"WRITE") between pools of `vram` memory, from the
/// UCX log written since `from`.
pub fn path_since(from: u64, backend: &str, op: &str, vram: bool) -> TransportPath {
    let mut p = TransportPath { backend: backend.to_string(), ..Default::default() };
    if backend != "UCX" {
        p.unknown_because = Some(format!("backend {backend}: only UCX's choice is read"));
        return p;
    }
    if vram {
        p.get_zcopy = Some(EnvSetting::of(GET_ZCOPY_ENV));
    }
    let Some(text) = read_since(from) else {
        p.unknown_because = Some(match log_path() {
            None => OFF_BECAUSE
                .get()
                .cloned()
                .unwrap_or_else(|| format!("capture off (UCX_PROTO_INFO or UCX_LOG_FILE set by the user, or {DIAG_ENV}=0)")),
            Some(l) => format!("UCX log {} unreadable", l.display()),
        });
        return p;
    };
    classify(&drop_unused_defaults(&text, kvprobe_defaults()), p, op, vram)
}

/// Fills `p` from UCX log `text`: the selections of `op` ("READ"/"WRITE") between two
/// memories of the run's kind (`vram`: cuda; else host), emulation, advice, UCX's warnings.
pub fn classify(text: &str, mut p: TransportPath, op: &str, vram: bool) -> TransportPath {
    p.ucx_messages =
        text.lines().filter(|l| l.contains("UCX  WARN") || l.contains("UCX  ERROR")).map(|l| l.trim().to_string()).collect();
    let want_op = if op == "WRITE" { "remote memory write" } else { "remote memory read" };
    let mem = if vram { "cuda" } else { "host" };
    // UCX prints a table per endpoint configuration; identical ones (e.g. one per worker
    // connection of a WRITE) are listed once.
    p.selections = Vec::new();
    // An agent's endpoint to itself (`self`, NIXL's loopback connection) never carries a
    // transfer between the two roles.
    let to_peer = |s: &Selection| s.endpoint.as_deref().is_none_or(|e| e.split_whitespace().nth(1) != Some("self"));
    for s in parse(text)
        .into_iter()
        .filter(|s| s.operation.starts_with(want_op) && s.operation.matches(mem).count() >= 2 && to_peer(s))
    {
        if !p.selections.contains(&s) {
            p.selections.push(s);
        }
    }
    if p.selections.is_empty() {
        p.unknown_because = Some(format!("UCX printed no {want_op} table between {mem} memory"));
    }
    p.emulated = p.selections.iter().any(|s| s.rows.iter().any(|r| r.description.contains("emulation")));
    if p.emulated && vram && op != "WRITE" {
        let now = match &p.get_zcopy {
            Some(g @ EnvSetting { value: Some(_), .. }) => format!(" ({g})"),
            _ => String::new(),
        };
        p.warning = Some(format!(
            "UCX moves this VRAM READ by software emulation (cuda_ipc get zero-copy is off{now}): \
             set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (docs/gpu-hosts.md, \"Running on a GPU host\")"
        ));
    } else if p.emulated {
        p.warning = Some("UCX moves these transfers by software emulation (slow fallback); see UCX_PROTO_INFO".into());
    }
    p
}

/// One line for the human summary: the transports and protocols of the selections.
pub fn describe(p: &TransportPath) -> String {
    if p.selections.is_empty() {
        let zcopy = p.get_zcopy.as_ref().map(|g| format!("; {g}")).unwrap_or_default();
        return format!("{} (protocol unknown: {}{zcopy})", p.backend, p.unknown_because.as_deref().unwrap_or("not seen"));
    }
    let mut seen: Vec<String> = Vec::new();
    for s in &p.selections {
        for r in &s.rows {
            let x = format!("{} {} via {}", r.range, r.description, r.config);
            if !seen.contains(&x) {
                seen.push(x);
            }
        }
    }
    let zcopy = p.get_zcopy.as_ref().map(|g| format!(" ({g})")).unwrap_or_default();
    format!("{} {}{zcopy}", p.backend, seen.join("; "))
}

/// UCX's messages in kvprobe's log other than the protocol tables (warnings, errors, and what
/// `UCX_LOG_LEVEL` asked for), in order of first appearance: printed at exit so the capture
/// hides nothing. Messages that differ only in their time stamp, thread and addresses (UCX
/// warns once per object, e.g. thousands of "object 0x… was not returned to mpool" after an
/// interrupted transfer) are given once, with how many more there were.
///
/// UCX's warning that a variable went unused is kept only for the user's variables: one
/// kvprobe set itself ([`kvprobe_defaults`], e.g. `UCX_CUDA_IPC_ENABLE_GET_ZCOPY`
/// on a host where UCX's CUDA transport does not load) is dropped from it.
pub fn messages() -> Vec<String> {
    read_since(0).map(|t| collapse_messages(&drop_unused_defaults(&t, kvprobe_defaults()))).unwrap_or_default()
}

/// `text` (a UCX log) with the variables named in `defaults` taken out of UCX's "unused
/// environment variable(s): A B" warnings (a trailing `;` on a name ignored); a warning left naming none goes, with the
/// "(set UCX_WARN_UNUSED_ENV_VARS=n ...)" line that follows it.
pub fn drop_unused_defaults(text: &str, defaults: &[String]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut dropped = false;
    for l in text.lines() {
        let unused = ["unused environment variables: ", "unused environment variable: "].iter().find_map(|p| l.split_once(p));
        if let Some((head, names)) = unused {
            // UCX 1.19 ends the list with ';' ("variable: UCX_CUDA_IPC_ENABLE_SAME_PROCESS;").
            let kept: Vec<&str> = names
                .split_whitespace()
                .map(|n| n.trim_end_matches(';'))
                .filter(|n| !n.is_empty() && !defaults.iter().any(|d| d == n))
                .collect();
            dropped = kept.is_empty();
            if !dropped {
                let s = if kept.len() > 1 { "s" } else { "" };
                out += &format!("{head}unused environment variable{s}: {}\n", kept.join(" "));
            }
            continue;
        }
        if dropped && l.contains("UCX_WARN_UNUSED_ENV_VARS") {
            dropped = false;
            continue;
        }
        dropped = false;
        out += l;
        out.push('\n');
    }
    out
}

/// [`messages`] of a UCX log `text`: its message lines (not the protocol tables), each kind once
/// (time stamp, thread and `0x…` addresses aside) with " (and N more like it)" when repeated.
pub fn collapse_messages(text: &str) -> Vec<String> {
    let body = |l: &str| l.split_once("] ").and_then(|(_, r)| r.split_once("] ")).map_or(l, |(_, r)| r).trim_start().to_string();
    let hex = regex::Regex::new(r"0x[0-9a-fA-F]+").expect("a valid pattern");
    let mut out: Vec<(String, String, u64)> = Vec::new(); // (normalised body, first line, count)
    for l in text.lines() {
        let b = body(l);
        if b.is_empty() || b.starts_with('|') || b.starts_with('+') {
            continue;
        }
        let key = hex.replace_all(&b, "0x…").into_owned();
        match out.iter_mut().find(|(k, _, _)| *k == key) {
            Some(e) => e.2 += 1,
            None => out.push((key, l.to_string(), 1)),
        }
    }
    out.into_iter().map(|(_, line, n)| if n > 1 { format!("{line} (and {} more like it)", n - 1) } else { line }).collect()
}

/// Removes kvprobe's UCX log (once UCX has it open, and at exit); its directory, kvprobe's
/// private one, goes at exit ([`crate::sys::tempdir::remove_own`]).
pub fn remove_log() {
    if let Some(p) = log_path() {
        let _ = std::fs::remove_file(p);
    }
}

/// One transport lane of a selection row: `(transport, device)` from a config cell such as
/// "rc_mlx5/mlx5_0:1", "cuda_copy/cuda" or "50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_3:1".
fn lanes(config: &str) -> Vec<(String, String)> {
    config
        .split(|c: char| c.is_whitespace() || c == ',' || c == ';')
        .filter_map(|t| {
            let (tl, dev) = t.split_once('/')?;
            let ok = !tl.is_empty() && tl.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            (ok && !dev.is_empty()).then(|| (tl.to_string(), dev.to_string()))
        })
        .collect()
}

/// True for UCX's RDMA transports (rc_mlx5, rc_verbs, dc_mlx5, ud_mlx5, ud_verbs).
fn is_rdma_transport(tl: &str) -> bool {
    ["rc", "dc", "ud"].iter().any(|p| tl == *p || tl.starts_with(&format!("{p}_")))
}

/// The device name of an RDMA lane's device ("mlx5_0:1" → "mlx5_0").
fn device_name(dev: &str) -> &str {
    dev.split_once(':').map_or(dev, |(d, _)| d)
}

const CONTAINER_HINT: &str = "in a container also --device /dev/infiniband --cap-add IPC_LOCK --ulimit memlock=-1";

/// The flags of path `p` given the host's RDMA facts, for transfers of GPU `gpu` (CUDA
/// ordinal; `None` for DRAM or unknown, which skips `nic-not-nearest`). Pure: reads only its
/// arguments.
///
/// - `tcp-with-rdma-present`: a row goes over tcp (not the loopback `lo`, which only carries
///   transfers within the host) while some RDMA port is ACTIVE;
/// - `rdma-port-down`: tcp (not `lo`) while RDMA devices exist but none has an ACTIVE port;
/// - `no-gpudirect-rdma`: a selection between cuda memory goes over rc/dc/ud while neither
///   nvidia_peermem nor dma-buf is available, so UCX stages VRAM through host memory;
/// - `staged-through-host`: a row of a cuda selection uses cuda_copy together with a network
///   transport (rc/dc/ud/tcp): the bytes are copied to host memory and sent from there;
/// - `nic-not-nearest`: rc/dc/ud over a device farther (PCIe distance) from `gpu` than its
///   nearest device with an ACTIVE port.
pub fn path_flags(p: &TransportPath, facts: &crate::xfer::rdma::RdmaFacts, gpu: Option<usize>) -> Vec<PathFlag> {
    let mut flags: Vec<PathFlag> = Vec::new();
    let mut add = |f: PathFlag| {
        if !flags.iter().any(|x| x.code == f.code && x.message == f.message) {
            flags.push(f);
        }
    };
    let gpu_entry = gpu.and_then(|g| facts.gpu(g));
    // The device to pin: the GPU's nearest, else the first ACTIVE port.
    let pin = gpu_entry
        .and_then(|g| g.nearest.as_deref())
        .and_then(|n| facts.net_device(n))
        .or_else(|| facts.active_ports().into_iter().next());
    let pin_fix =
        |extra: &str| pin.as_ref().map(|d| format!("UCX_NET_DEVICES={d} UCX_TLS={}{extra}", crate::xfer::rdma::UCX_TLS_HINT));
    for s in &p.selections {
        let cuda = s.operation.contains("cuda");
        for r in &s.rows {
            let l = lanes(&r.config);
            let net = |tl: &str| tl == "tcp" || is_rdma_transport(tl);
            for (tl, dev) in &l {
                if tl == "tcp" && dev != "lo" {
                    if facts.any_active() {
                        add(PathFlag {
                            code: "tcp-with-rdma-present".into(),
                            message: format!(
                                "UCX moved these transfers over TCP ({dev}) although RDMA port(s) {} are ACTIVE",
                                facts.active_ports().join(", ")
                            ),
                            fix: pin_fix(&format!("; {CONTAINER_HINT}")),
                        });
                    } else if !facts.devices.is_empty() {
                        let names: Vec<&str> = facts.devices.iter().map(|d| d.name.as_str()).collect();
                        add(PathFlag {
                            code: "rdma-port-down".into(),
                            message: format!(
                                "UCX moved these transfers over TCP ({dev}): RDMA device(s) {} have no ACTIVE port",
                                names.join(", ")
                            ),
                            fix: Some("bring the port up (ibstat; for RoCE, the netdev's link: ip link)".into()),
                        });
                    }
                }
                if is_rdma_transport(tl) && cuda && !facts.gpudirect.available {
                    add(PathFlag {
                        code: "no-gpudirect-rdma".into(),
                        message: format!(
                            "VRAM goes over {tl}/{dev} without GPUDirect RDMA (nvidia_peermem not loaded, no dma-buf): \
                             UCX stages it through host memory"
                        ),
                        fix: Some("modprobe nvidia_peermem (or a kernel 5.12+ and driver with dma-buf support)".into()),
                    });
                }
                if is_rdma_transport(tl)
                    && let Some(g) = gpu_entry
                    && let (Some(near), Some(near_d)) = (g.nearest.as_deref(), g.nearest_distance)
                    && device_name(dev) != near
                    && let Some(used_d) = g.nics.iter().find(|n| n.nic == device_name(dev)).and_then(|n| n.distance)
                    && used_d > near_d
                {
                    add(PathFlag {
                        code: "nic-not-nearest".into(),
                        message: format!(
                            "GPU {} sends over {} ({used_d} from it) while {near} is nearer ({near_d})",
                            gpu.unwrap_or_default(),
                            device_name(dev)
                        ),
                        fix: facts.net_device(near).map(|d| format!("UCX_NET_DEVICES={d}")),
                    });
                }
            }
            if cuda && l.iter().any(|(tl, _)| tl == "cuda_copy") && l.iter().any(|(tl, _)| net(tl)) {
                add(PathFlag {
                    code: "staged-through-host".into(),
                    message: format!("VRAM is copied to host memory and sent from there ({})", r.config),
                    fix: if facts.gpudirect.available {
                        pin_fix("")
                    } else {
                        Some("load nvidia_peermem (GPUDirect RDMA), then UCX can send VRAM directly".into())
                    },
                });
            }
        }
    }
    flags
}

/// The flag of a node pair (`run --peer`) whose bytes never crossed a network: `same-host`
/// when UCX's rows name transports and none of them is a network one (tcp over an interface
/// other than the loopback `lo`, or rc/dc/ud) — shared memory (posix, sysv), CMA, xpmem,
/// knem, cuda_ipc or cuda_copy, the loopback: the two sides ran on one host and nothing the
/// pair's link would carry was tested. `None` when a network transport carried a row, or when
/// the rows are unknown (capture off).
pub fn same_host_flag(p: &TransportPath) -> Option<PathFlag> {
    let mut local: Vec<String> = Vec::new();
    for r in p.selections.iter().flat_map(|s| &s.rows) {
        for (tl, dev) in lanes(&r.config) {
            if (tl == "tcp" && dev != "lo") || is_rdma_transport(&tl) {
                return None;
            }
            let l = if tl == "tcp" { "tcp/lo".to_string() } else { tl };
            if !local.contains(&l) {
                local.push(l);
            }
        }
    }
    (!local.is_empty()).then(|| PathFlag {
        code: "same-host".into(),
        message: format!(
            "the bytes did not cross a network: UCX moved them within one host ({}), so this pair run tested no link between hosts",
            local.join(", ")
        ),
        fix: Some(
            "run serve and run on two hosts (or in two network namespaces with their own PID and IPC namespaces: docs/two-hosts.md)".into(),
        ),
    })
}

/// Sets `p.flags` from the host's RDMA facts for transfers of GPU `gpu` (CUDA ordinal, `None`
/// for DRAM): see [`path_flags`]. Replaces earlier flags, so calling it twice is harmless.
pub fn flag_path(p: &mut TransportPath, facts: &crate::xfer::rdma::RdmaFacts, gpu: Option<usize>) {
    p.flags = path_flags(p, facts, gpu);
}

#[cfg(test)]
mod flag_tests {
    use super::*;

    #[test]
    fn lanes_split_configs() {
        assert_eq!(lanes("rc_mlx5/mlx5_0:1"), vec![("rc_mlx5".to_string(), "mlx5_0:1".to_string())]);
        assert_eq!(lanes("cuda_ipc/cuda"), vec![("cuda_ipc".to_string(), "cuda".to_string())]);
        assert_eq!(
            lanes("50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_3:1"),
            vec![("rc_mlx5".to_string(), "mlx5_0:1".to_string()), ("rc_mlx5".to_string(), "mlx5_3:1".to_string())]
        );
        assert!(lanes("zero-copy").is_empty());
        assert!(is_rdma_transport("rc_mlx5") && is_rdma_transport("dc_mlx5") && is_rdma_transport("ud_verbs"));
        assert!(!is_rdma_transport("cuda_copy") && !is_rdma_transport("tcp") && !is_rdma_transport("rcx"));
    }
}
