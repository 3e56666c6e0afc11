//! Helpers shared by the test modules.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// Path of the built `kvprobe` binary (`KVPROBE_BIN` overrides it, for test binaries
/// carried to a GPU host without cargo).
pub fn bin() -> PathBuf {
    std::env::var_os("KVPROBE_BIN").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_kvprobe")))
}

/// Runs kvprobe with `args`; returns (exit code, stdout, stderr).
pub fn kvprobe(args: &[&str]) -> (i32, String, String) {
    kvprobe_env(args, &[])
}

/// Runs kvprobe with `args` and extra environment variables.
pub fn kvprobe_env(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut c = Command::new(bin());
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let o: Output = c.output().expect("spawn kvprobe");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// A fresh temporary directory under the target dir (`KVPROBE_TEST_TMP` overrides it),
/// unique to this call: tests run in parallel threads of one process, and several test
/// processes (another checkout's, CI's) may share the root, so the name carries the process
/// id and a per-process serial.
pub fn tmpdir(name: &str) -> PathBuf {
    static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let root =
        std::env::var_os("KVPROBE_TEST_TMP").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    let n = SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = root.join(format!("{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `kvprobe run --memory MEMORY --report <tmp>/report.json ARGS`: (exit code, the report,
/// stdout + stderr). Fails the test if kvprobe panicked.
pub fn run_with_report(name: &str, memory: &str, args: &[&str]) -> (i32, serde_json::Value, String) {
    let d = tmpdir(name);
    let p = d.join("report.json");
    let mut a = vec!["run", "--memory", memory, "--report", p.to_str().unwrap()];
    a.extend_from_slice(args);
    let (code, out, err) = kvprobe(&a);
    assert!(!err.contains("panicked"), "{err}");
    (code, read_report(&p), format!("{out}{err}"))
}

/// Reads a JSON report.
pub fn read_report(p: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).expect("report written")).expect("valid JSON")
}

/// What a GPU test does given the CUDA device count (`Err`: why there is no answer, e.g.
/// libcuda.so.1 missing or `cuInit` failed), the GPUs it needs and the GPUs the lane requires
/// ([`required_gpus`]): `Ok(None)` run it, `Ok(Some(line))` do not run it and print `line`,
/// `Err(message)` fail. A lane that requires the GPUs never skips: a `cuInit` failure there is
/// an error naming it, not "0 GPUs". Where nothing is required the line starts `SKIP `; in a
/// lane that requires fewer GPUs than the test needs (a two-GPU test on a one-GPU host kind,
/// KVPROBE_REQUIRE_GPUS=1) it starts `NOT RUN ` — the lane scripts fail on any `SKIP` line.
pub fn gpu_decision(test: &str, count: Result<usize, String>, needed: usize, required: usize) -> Result<Option<String>, String> {
    let why = match count {
        Ok(n) if n >= needed => return Ok(None),
        Ok(n) => format!("needs {needed} CUDA GPU(s), {n} present"),
        Err(e) => format!("needs {needed} CUDA GPU(s) but CUDA gave no device count: {e}"),
    };
    if required >= needed {
        Err(format!("{test}: the lane requires {required} GPU(s) (KVPROBE_REQUIRE_GPU/KVPROBE_REQUIRE_GPUS) but it {why}"))
    } else if required == 0 {
        Ok(Some(format!("SKIP {test}: {why} (set KVPROBE_REQUIRE_GPUS={needed} to fail instead)")))
    } else {
        Ok(Some(format!("NOT RUN {test}: {why}; the lane requires {required} (KVPROBE_REQUIRE_GPUS={required})")))
    }
}

/// GPUs the lane requires: KVPROBE_REQUIRE_GPUS=N, else 1 when KVPROBE_REQUIRE_GPU=1, else 0
/// (the larger when both are set). A value that is not a number fails the test: a typo must
/// not turn a lane's GPU tests into skips.
pub fn required_gpus() -> usize {
    let n = match std::env::var("KVPROBE_REQUIRE_GPUS") {
        Ok(v) => v.parse::<usize>().unwrap_or_else(|_| panic!("KVPROBE_REQUIRE_GPUS={v:?} is not a number")),
        Err(_) => 0,
    };
    let one = match std::env::var("KVPROBE_REQUIRE_GPU").as_deref() {
        Ok("1") => 1,
        Ok("0") | Ok("") | Err(_) => 0,
        Ok(v) => panic!("KVPROBE_REQUIRE_GPU={v:?} must be 1 or 0"),
    };
    n.max(one)
}

fn gpus_or_skip(test: &str, needed: usize) -> bool {
    let count = kvprobe::cuda::try_device_count().map_err(|e| e.to_string());
    match gpu_decision(test, count, needed, required_gpus()) {
        Ok(None) => true,
        Ok(Some(line)) => {
            // Written to the real stderr (not the captured test output) so CI logs show the skip.
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "{line}");
            false
        }
        Err(m) => panic!("{m}"),
    }
}

/// True when a CUDA GPU is present; otherwise prints why the test is skipped — or fails
/// when the lane requires GPUs (KVPROBE_REQUIRE_GPU=1 or KVPROBE_REQUIRE_GPUS ≥ 1), naming
/// the CUDA error when `cuInit` failed.
pub fn gpu_or_skip(test: &str) -> bool {
    gpus_or_skip(test, 1)
}

/// True when at least two CUDA GPUs are present; otherwise prints why the test is skipped —
/// or fails when KVPROBE_REQUIRE_GPUS ≥ 2 (the two-GPU host's lane).
pub fn two_gpus_or_skip(test: &str) -> bool {
    gpus_or_skip(test, 2)
}

/// The (iteration, layer, kv, block, class, decode TP rank) tuples of a report's failures.
pub fn failure_set(r: &serde_json::Value) -> std::collections::BTreeSet<(u64, u64, String, u64, String, Option<u64>)> {
    r["failures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["iteration"].as_u64().unwrap(),
                f["layer"].as_u64().unwrap(),
                f["kv"].as_str().unwrap().to_string(),
                f["block"].as_u64().unwrap(),
                f["class"].as_str().unwrap().to_string(),
                f["tp_rank"].as_u64(),
            )
        })
        .collect()
}

/// The outcomes the report's injections predicted, in the same form as [`failure_set`].
pub fn predicted_set(r: &serde_json::Value) -> std::collections::BTreeSet<(u64, u64, String, u64, String, Option<u64>)> {
    let mut s = std::collections::BTreeSet::new();
    for inj in r["injections"].as_array().unwrap() {
        for p in inj["predicted"].as_array().unwrap() {
            s.insert((
                inj["iteration"].as_u64().unwrap(),
                p["layer"].as_u64().unwrap(),
                p["kv"].as_str().unwrap().to_string(),
                p["block"].as_u64().unwrap(),
                p["class"].as_str().unwrap().to_string(),
                p["tp_rank"].as_u64(),
            ));
        }
    }
    s
}

/// The tests' own table of what ONE planted fault of each `--inject` kind must cause at the
/// decode side, by failure class (docs/guide.md "--inject"), written here independently of
/// `src/core/inject.rs` so that a wrong prediction there cannot pass by agreeing with itself.
pub const CLASSES_PER_FAULT: [(&str, &[(&str, u64)]); 6] = [
    ("bitflip", &[("bitflip", 1)]),
    ("drop", &[("unwritten", 1)]),
    ("misroute", &[("misplaced", 1), ("unwritten", 1)]),
    ("stale", &[("stale", 1)]),
    ("torn", &[("torn", 1)]),
    // A write into another stage's decode slot outside its transfer (docs/guide.md "--inject").
    ("stray", &[("stray", 1)]),
];

/// Every failure class a report's `summary.by_class` carries.
pub const ALL_CLASSES: [&str; 10] =
    ["bitflip", "garbage", "late", "layout", "misplaced", "overwritten", "stale", "stray", "torn", "unwritten"];

/// The table's classes for one fault of `kind` (panics on a kind the table does not know).
pub fn classes_of(kind: &str) -> &'static [(&'static str, u64)] {
    CLASSES_PER_FAULT.iter().find(|(k, _)| *k == kind).unwrap_or_else(|| panic!("unknown injection kind {kind:?}")).1
}

/// The failures by class that `planted` = [(kind, number of faults)] must cause, from
/// [`CLASSES_PER_FAULT`]; every class of [`ALL_CLASSES`] present (zero when none).
pub fn expected_by_class(planted: &[(&str, u64)]) -> std::collections::BTreeMap<String, u64> {
    let mut m: std::collections::BTreeMap<String, u64> = ALL_CLASSES.iter().map(|c| (c.to_string(), 0)).collect();
    for (kind, n) in planted {
        for (class, per) in classes_of(kind) {
            *m.get_mut(*class).unwrap() += n * per;
        }
    }
    m
}

/// What a run planted, from its echoed configuration (`config.inject[]` × `config.iterations`,
/// i.e. what the command line asked for): [(kind, faults)].
pub fn planted_from_config(r: &serde_json::Value) -> Vec<(String, u64)> {
    let its = r["config"]["iterations"].as_u64().unwrap();
    r["config"]["inject"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| (i["kind"].as_str().unwrap().to_string(), i["count"].as_u64().unwrap() * its))
        .collect()
}

/// Asserts the report's failures by class are exactly the planted faults × the tests' own
/// table ([`CLASSES_PER_FAULT`]): `summary.by_class`, `summary.blocks_corrupt`, the listed
/// failures' classes (when none were omitted), and each injection's own `predicted` classes.
pub fn assert_classes_match_table(r: &serde_json::Value, ctx: &str) {
    let planted = planted_from_config(r);
    let planted_ref: Vec<(&str, u64)> = planted.iter().map(|(k, n)| (k.as_str(), *n)).collect();
    let want = expected_by_class(&planted_ref);
    let by: std::collections::BTreeMap<String, u64> =
        r["summary"]["by_class"].as_object().unwrap().iter().map(|(k, v)| (k.clone(), v.as_u64().unwrap())).collect();
    assert_eq!(by, want, "{ctx}: summary.by_class differs from planted {planted:?} × the tests' table");
    let total: u64 = want.values().sum();
    assert_eq!(r["summary"]["blocks_corrupt"], total, "{ctx}");
    if r["summary"]["failures_omitted"].as_u64().unwrap_or(0) == 0 {
        let mut listed: std::collections::BTreeMap<String, u64> = ALL_CLASSES.iter().map(|c| (c.to_string(), 0)).collect();
        for f in r["failures"].as_array().unwrap() {
            *listed.entry(f["class"].as_str().unwrap().to_string()).or_default() += 1;
        }
        assert_eq!(listed, want, "{ctx}: the listed failures' classes differ from the tests' table");
    }
    for inj in r["injections"].as_array().unwrap() {
        let kind = inj["kind"].as_str().unwrap();
        let mut got: Vec<(String, u64)> = Vec::new();
        for p in inj["predicted"].as_array().unwrap() {
            let c = p["class"].as_str().unwrap().to_string();
            match got.iter_mut().find(|(k, _)| *k == c) {
                Some(e) => e.1 += 1,
                None => got.push((c, 1)),
            }
        }
        got.sort();
        let mut table: Vec<(String, u64)> = classes_of(kind).iter().map(|(c, n)| (c.to_string(), *n)).collect();
        table.sort();
        assert_eq!(got, table, "{ctx}: the program's prediction for a {kind} injection differs from the tests' table: {inj}");
    }
}

/// Checks that a run with one injection kind reports exactly the predicted failures, and
/// that those are what the tests' own table says the planted faults cause.
pub fn assert_exact_injection(report: &serde_json::Value, class: &str) {
    let failures = failure_set(report);
    let predicted = predicted_set(report);
    assert!(!predicted.is_empty(), "no injections recorded");
    assert_eq!(failures, predicted, "reported failures differ from the injected ones");
    assert_classes_match_table(report, class);
    let by = &report["summary"]["by_class"];
    let total = report["summary"]["blocks_corrupt"].as_u64().unwrap();
    assert!(by[class].as_u64().unwrap() > 0, "no {class} failures: {by}");
    assert_eq!(report["summary"]["unexpected_failures"], 0);
    assert_eq!(report["summary"]["injections_planted"], report["summary"]["injections_detected"]);
    let counted: u64 = by.as_object().unwrap().values().map(|v| v.as_u64().unwrap()).sum();
    assert_eq!(counted, total);
}

/// Mooncake tests run everywhere the set-up commands ran (CI included); a lane without the
/// install sets KVPROBE_SKIP_MOONCAKE to its reason, and the test prints it and passes.
pub fn mooncake_or_skip(test: &str) -> bool {
    match std::env::var("KVPROBE_SKIP_MOONCAKE") {
        Ok(why) if !why.is_empty() => {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "SKIP {test}: {why} (KVPROBE_SKIP_MOONCAKE)");
            false
        }
        _ => true,
    }
}

/// `--inject` arguments planting one fault of every class per iteration (bitflip, drop,
/// misroute, stale, torn): five planted injections per iteration.
pub const EVERY_INJECTION: [&str; 10] =
    ["--inject", "bitflip", "--inject", "drop", "--inject", "misroute", "--inject", "stale", "--inject", "torn"];

/// Asserts a report found exactly the `planted` injections it planted, where predicted, and
/// nothing else; `ctx` names the case in failure messages.
pub fn assert_found_exactly(report: &serde_json::Value, planted: u64, ctx: &str) {
    assert_eq!(report["summary"]["injections_detected"], planted, "{ctx}");
    assert_eq!(report["summary"]["unexpected_failures"], 0, "{ctx}");
    assert_eq!(failure_set(report), predicted_set(report), "{ctx}");
    let planted_cfg: u64 = planted_from_config(report).iter().map(|(_, n)| n).sum();
    assert_eq!(planted_cfg, planted, "{ctx}: the command line planted a different number");
    assert_classes_match_table(report, ctx);
}

/// Asserts a report compared exactly `slices` decode block slices of `slice_bytes` bytes each
/// (`summary.slices_compared`, `summary.bytes_compared`: what the verify passes counted), and
/// that `blocks_checked` says the same. `slices` and `slice_bytes` are the test's own
/// arithmetic (layers × K/V × blocks × iterations × ranks; block_size × heads × head_size ×
/// dtype bytes), not read back from kvprobe; a run that compares nothing fails here.
pub fn assert_compared(report: &serde_json::Value, slices: u64, slice_bytes: u64, ctx: &str) {
    let s = &report["summary"];
    assert_eq!(s["slices_compared"], slices, "{ctx}: slices compared");
    assert_eq!(s["bytes_compared"], slices * slice_bytes, "{ctx}: bytes compared");
    assert_eq!(s["blocks_checked"], slices, "{ctx}: blocks_checked");
}

/// Reads `child`'s stderr until a line contains `marker` (the run is under way: e.g.
/// "iteration 1/"), then keeps draining it on a thread so the child never blocks on a full
/// pipe. Panics with what was read when the child closes stderr first. No time limit: a
/// loaded machine only makes it slower, and a hung child fails the test run as a whole.
pub fn wait_for_stderr_line(child: &mut std::process::Child, marker: &str) -> String {
    use std::io::BufRead;
    let mut stderr = std::io::BufReader::new(child.stderr.take().expect("stderr piped"));
    let mut seen = String::new();
    while !seen.contains(marker) {
        let mut l = String::new();
        if stderr.read_line(&mut l).unwrap() == 0 {
            panic!("kvprobe ended before printing {marker:?}: {seen}");
        }
        seen += &l;
    }
    std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut rest);
    });
    seen
}

/// A loopback TCP address that refuses connections and that no other process can take while
/// the returned socket lives: bound, never listening (a port bound and released could be
/// taken by a Mooncake master or another test in between).
pub fn refusing_addr() -> (std::os::fd::OwnedFd, std::net::SocketAddr) {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket(2)/bind(2)/getsockname(2) on a socket this function owns; the
    // sockaddr_in structures are fully initialised and their sizes passed.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let owned = std::os::fd::OwnedFd::from_raw_fd(fd);
        let mut a: libc::sockaddr_in = std::mem::zeroed();
        a.sin_family = libc::AF_INET as libc::sa_family_t;
        a.sin_addr.s_addr = u32::from_ne_bytes([127, 0, 0, 1]);
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        assert_eq!(libc::bind(fd, &a as *const _ as *const libc::sockaddr, len), 0, "bind: {}", std::io::Error::last_os_error());
        let mut b: libc::sockaddr_in = std::mem::zeroed();
        let mut blen = len;
        assert_eq!(libc::getsockname(fd, &mut b as *mut _ as *mut libc::sockaddr, &mut blen), 0);
        (owned, std::net::SocketAddr::from(([127, 0, 0, 1], u16::from_be(b.sin_port))))
    }
}

/// Child processes of `pid` (of every thread of it), from /proc.
pub fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
                out.extend(s.split_whitespace().filter_map(|x| x.parse::<u32>().ok()));
            }
        }
    }
    out
}

/// The command line of process `pid`, arguments joined by spaces ("" when it is gone).
pub fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline")).map(|b| String::from_utf8_lossy(&b).replace('\0', " ")).unwrap_or_default()
}

/// Makes this test process end without running shared-library destructors, keeping its exit
/// status: call it before a test loads NIXL into the test process itself (not into a kvprobe
/// child). The wheel's UCX bundles its own libnl-route, and with Debian's libibverbs (installed
/// for Mooncake) a second libnl is loaded; the bundled one's destructor `rtnl_tc_unregister`
/// then segfaults in `exit` after every test passed — the crash `kvprobe::nixl::exit_now`
/// avoids in kvprobe itself. glibc's `on_exit` handlers run before the loader's destructors;
/// Rust's stdout is flushed by then, C stdio is flushed here.
pub fn exit_without_library_destructors() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    unsafe extern "C" {
        fn on_exit(f: extern "C" fn(libc::c_int, *mut libc::c_void), arg: *mut libc::c_void) -> libc::c_int;
    }
    extern "C" fn quit(status: libc::c_int, _: *mut libc::c_void) {
        // SAFETY: fflush(NULL) flushes every C stdio stream; _exit ends the process at once
        // with the status exit was given (the tests' outcome).
        unsafe {
            libc::fflush(std::ptr::null_mut());
            libc::_exit(status)
        }
    }
    ONCE.call_once(|| {
        // SAFETY: registers a handler with a static function and no argument.
        let rc = unsafe { on_exit(quit, std::ptr::null_mut()) };
        assert_eq!(rc, 0, "on_exit failed");
    });
}

/// What a decode slice reached by an `--inject torn` of a sweep must hold, byte for byte,
/// computed here from the tear alone and the fingerprint library (not from kvprobe's
/// prediction): `torn_bytes` (the injection record's) is a prefix of the group's prefill
/// slices back to back; each decode row whose prefill row starts inside it holds that row's
/// bytes up to the prefix's end (rows move whole, so a row cut by the tear keeps its start),
/// and everything else the slot's poison of `poison_iteration`. Rows are placed with the
/// layouts' own arithmetic (NHD row `t × heads + h`, HND `h × block + t`, MLA `t`), decode's
/// block at its group token `expected.token_base`. One rank each side (no TP); `r` is the
/// report, `f` the failure record of the slice.
pub fn torn_slice_bytes(r: &serde_json::Value, f: &serde_json::Value, torn_bytes: u64) -> Vec<u8> {
    use kvprobe::fingerprint::{self, BlockIdentity, RowOrder, RowShape};
    assert!(r["config"].get("tp").is_none_or(|t| t.is_null()), "torn_slice_bytes knows one rank each side");
    let cfg = &r["config"];
    let pg = &cfg["geometry"];
    let dg = if cfg["decode_geometry"].is_object() { &cfg["decode_geometry"] } else { pg };
    let mla = pg["mla"].as_bool().unwrap();
    let heads = if mla { 1 } else { pg["num_kv_heads"].as_u64().unwrap() };
    let (bp, bd) = (pg["block_size"].as_u64().unwrap(), dg["block_size"].as_u64().unwrap());
    let rb = pg["slice_bytes"].as_u64().unwrap() / bp / heads;
    let order = |g: &serde_json::Value| match (mla, g["layout"].as_str().unwrap()) {
        (true, _) => RowOrder::Mla,
        (false, "nhd") => RowOrder::Nhd,
        _ => RowOrder::Hnd,
    };
    let (lp, ld) = (order(pg), order(dg));
    let pos = |o: RowOrder, block: u64, t: u64, h: u64| match o {
        RowOrder::Nhd => t * heads + h,
        RowOrder::Hnd => h * block + t,
        RowOrder::Mla | RowOrder::Rows => t,
    };
    let expected: BlockIdentity = serde_json::from_value(f["expected"].clone()).unwrap();
    let shape = RowShape { order: ld, block_size: bd as u32, heads: heads as u32, head_base: 0, row_bytes: rb as u32 };
    let due = fingerprint::expected(cfg["seed"].as_u64().unwrap(), &shape.slice(expected));
    let sbd = (bd * heads * rb) as usize;
    let mut out = vec![0u8; sbd];
    fingerprint::poison(&mut out, f["slot"].as_u64().unwrap() as u32, f["poison_iteration"].as_u64().unwrap() as u32);
    let sbp = bp * heads * rb;
    for t in 0..bd {
        for h in 0..heads {
            let token = expected.token_base as u64 + t;
            let at = (token / bp) * sbp + pos(lp, bp, token % bp, h) * rb;
            if at < torn_bytes {
                let n = rb.min(torn_bytes - at) as usize;
                let d = (pos(ld, bd, t, h) * rb) as usize;
                out[d..d + n].copy_from_slice(&due[d..d + n]);
            }
        }
    }
    out
}

/// Checks every slice an `--inject torn` of sweep report `r` reached against
/// [`torn_slice_bytes`]: its failure's `actual_digest` (SHA-256 of the bytes classified) is
/// the digest of those bytes, and so is the injection record's `digest`. Returns how many
/// slices were checked.
pub fn assert_torn_bytes_exact(r: &serde_json::Value, ctx: &str) -> u64 {
    let mut n = 0;
    for inj in r["injections"].as_array().unwrap().iter().filter(|i| i["kind"] == "torn") {
        let len = inj["torn_bytes"].as_u64().unwrap_or_else(|| panic!("{ctx}: no torn_bytes in {inj}"));
        for p in inj["predicted"].as_array().unwrap() {
            let f = r["failures"]
                .as_array()
                .unwrap()
                .iter()
                .find(|f| {
                    f["iteration"] == inj["iteration"]
                        && f["layer"] == p["layer"]
                        && f["kv"] == p["kv"]
                        && f["block"] == p["block"]
                })
                .unwrap_or_else(|| panic!("{ctx}: no failure listed for {p}"));
            let want = kvprobe::fingerprint::digest(&torn_slice_bytes(r, f, len));
            assert_eq!(f["actual_digest"].as_str().unwrap(), want, "{ctx}: {len} bytes torn: {f}");
            assert_eq!(p["digest"].as_str().unwrap(), want, "{ctx}: {p}");
            n += 1;
        }
    }
    n
}
