//! The bundle's environment capture (`kvprobe::env_capture`, issue 14 item 2): every file is
//! written or its source recorded with a status and a reason; missing tools and hung tools
//! are statuses, never errors; what a tool prints is kept verbatim; env-vars.txt holds the
//! UCX_* / NIXL_* variables and nothing else; the UCX log given is copied verbatim.
//!
//! Tests that need another PATH, environment or bound run the capture in a child: this test
//! binary re-executed on the ignored test [`capture_child`] (environment variables are
//! process-wide, and the tests of this binary run in parallel threads).

use crate::common::tmpdir;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The files capture() writes, in its order.
const FILES: &[&str] = &[
    "nvidia-smi-q.txt",
    "nvidia-smi-topo.txt",
    "uname.txt",
    "ucx-info-v.txt",
    "env-vars.txt",
    "ucx-protocols.txt",
    "infiniband.txt",
    "ibv_devinfo.txt",
    "gpudirect.txt",
    "pcie.txt",
    "kernel-gpu.txt",
    "versions.txt",
    "capture.json",
];

fn manifest(dir: &Path) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("capture.json")).unwrap()).unwrap();
    assert_eq!(v["schema"], "kvprobe.capture/1");
    v
}

fn entry<'a>(m: &'a serde_json::Value, file: &str) -> &'a serde_json::Value {
    m["sources"].as_array().unwrap().iter().find(|s| s["file"] == file).unwrap_or_else(|| panic!("{file} not in capture.json"))
}

/// Checks the shape every capture has: each file written once, each listed in capture.json
/// with a known status, a reason for every status but ok, and a seconds figure.
fn check_complete(dir: &Path, returned: &[PathBuf]) -> serde_json::Value {
    let want: Vec<PathBuf> = FILES.iter().map(PathBuf::from).collect();
    assert_eq!(returned, want.as_slice(), "paths returned (relative to out)");
    for f in FILES {
        assert!(dir.join(f).is_file(), "{f} written");
    }
    let m = manifest(dir);
    let sources = m["sources"].as_array().unwrap();
    assert_eq!(sources.len(), FILES.len() - 1, "{m:#}");
    for s in sources {
        let st = s["status"].as_str().unwrap();
        assert!(["ok", "missing", "unreadable", "timed-out", "failed"].contains(&st), "{s}");
        if st != "ok" {
            assert!(s["reason"].as_str().is_some_and(|r| !r.is_empty()), "a {st} source says why: {s}");
        }
        assert!(s["seconds"].as_f64().is_some_and(|x| x >= 0.0), "{s}");
        assert!(s["source"].as_str().is_some_and(|x| !x.is_empty()), "{s}");
    }
    m
}

/// Runs capture() in a child (this binary on [`capture_child`]) with `env` only (plus what
/// it adds) and the UCX log `ucx_log`; returns the capture directory and the paths returned.
/// The child must exit 0 (capture returned Ok) within a generous bound (it never hangs).
fn capture_in_child(name: &str, env: &[(&str, &str)], ucx_log: Option<&Path>) -> (PathBuf, Vec<PathBuf>) {
    let d = tmpdir(name);
    let out = d.join("capture");
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["capture::capture_child", "--exact", "--ignored", "--nocapture", "--test-threads=1"]);
    c.env_clear().env("KVPROBE_TEST_CAPTURE_OUT", &out).env("HOME", &d);
    if let Some(l) = ucx_log {
        c.env("KVPROBE_TEST_CAPTURE_UCX_LOG", l);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            panic!("the capture did not return in 300 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let o = child.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(status.success(), "capture in the child failed: {text}");
    assert!(text.contains("1 passed"), "the child ran capture_child: {text}");
    let returned: Vec<PathBuf> = std::fs::read_to_string(d.join("returned.txt")).unwrap().lines().map(PathBuf::from).collect();
    (out, returned)
}

/// Not a test on its own: the child of [`capture_in_child`] (does nothing without
/// KVPROBE_TEST_CAPTURE_OUT).
#[test]
#[ignore]
fn capture_child() {
    let Some(out) = std::env::var_os("KVPROBE_TEST_CAPTURE_OUT").map(PathBuf::from) else { return };
    let log = std::env::var_os("KVPROBE_TEST_CAPTURE_UCX_LOG").map(PathBuf::from);
    let returned = kvprobe::env_capture::capture(&out, log.as_deref()).expect("capture returns Ok");
    let list: String = returned.iter().map(|p| format!("{}\n", p.display())).collect();
    std::fs::write(out.parent().unwrap().join("returned.txt"), list).unwrap();
}

/// An executable script `name` in `dir`.
fn script(dir: &Path, name: &str, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// This machine as it is (no GPU here: nvidia-smi absent): every file is written and
/// accounted for; the files read from /proc and /sys are ok.
#[test]
fn capture_here_writes_every_file_or_says_why() {
    let d = tmpdir("capture-here").join("nested/out");
    let returned = kvprobe::env_capture::capture(&d, None).expect("capture never fails on a missing source");
    let m = check_complete(&d, &returned);
    assert_eq!(entry(&m, "env-vars.txt")["status"], "ok");
    assert_eq!(entry(&m, "versions.txt")["status"], "ok");
    let versions = std::fs::read_to_string(d.join("versions.txt")).unwrap();
    assert!(versions.contains("NVRTC:") && versions.contains("NIXL"), "{versions}");
    // /proc/modules is absent on kernels without modules (and in some sandboxes): a status.
    let gd = std::fs::read_to_string(d.join("gpudirect.txt")).unwrap();
    assert!(gd.contains("release: "), "{gd}");
    let g = entry(&m, "gpudirect.txt");
    if std::path::Path::new("/proc/modules").is_file() {
        assert_eq!(g["status"], "ok", "{g}");
        assert!(gd.contains("nvidia_peermem: "), "{gd}");
    } else {
        assert_eq!(g["status"], "missing", "{g}");
        assert!(g["reason"].as_str().unwrap().contains("/proc/modules"), "{g}");
    }
    // Without nvidia-smi on PATH the tool is missing, not an error.
    let on_path = std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("nvidia-smi").is_file()));
    if !on_path {
        let e = entry(&m, "nvidia-smi-q.txt");
        assert_eq!(e["status"], "missing", "{e}");
        assert!(e["reason"].as_str().unwrap().contains("not found on PATH"), "{e}");
        assert_eq!(std::fs::read(d.join("nvidia-smi-q.txt")).unwrap(), b"");
    }
    // No UCX log given and none in this process: recorded missing.
    let u = entry(&m, "ucx-protocols.txt");
    assert!(u["status"] == "missing" || u["status"] == "ok", "{u}");
}

/// With PATH holding no tool at all, every command is `missing` (with its name in the
/// reason) and capture still returns Ok with every file.
#[test]
fn capture_with_no_tools_records_them_missing() {
    let empty = tmpdir("capture-empty-path");
    let (out, returned) = capture_in_child("capture-missing", &[("PATH", empty.to_str().unwrap())], None);
    let m = check_complete(&out, &returned);
    for (file, tool) in [
        ("nvidia-smi-q.txt", "nvidia-smi"),
        ("nvidia-smi-topo.txt", "nvidia-smi"),
        ("uname.txt", "uname"),
        ("ucx-info-v.txt", "ucx_info"),
        ("ibv_devinfo.txt", "ibv_devinfo"),
    ] {
        let e = entry(&m, file);
        assert_eq!(e["status"], "missing", "{e}");
        assert!(e["reason"].as_str().unwrap().contains(&format!("{tool} not found on PATH")), "{e}");
    }
    let pcie = entry(&m, "pcie.txt");
    assert!(pcie["parts"][0].as_str().unwrap().starts_with("lspci -tv: missing"), "{pcie}");
    // dmesg missing: /dev/kmsg is tried; either way the entry names dmesg's fate.
    let k = entry(&m, "kernel-gpu.txt");
    let all = k.to_string();
    assert!(all.contains("dmesg: missing"), "{k}");
    // No UCX log given and the child started no NIXL agent.
    let u = entry(&m, "ucx-protocols.txt");
    assert_eq!(u["status"], "missing", "{u}");
}

/// A tool that never answers is killed at the bound and recorded `timed-out`; the capture
/// returns (no assert on how fast: only that it returns and says so).
#[test]
fn capture_times_out_a_hung_tool() {
    let bin = tmpdir("capture-hung-bin");
    // A wrapper that starts a child of its own: both must go.
    let pids = bin.join("pids");
    script(&bin, "nvidia-smi", &format!("sleep 600 &\necho $! >> '{}'\nwait\n", pids.display()));
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let (out, returned) = capture_in_child("capture-hung", &[("PATH", &path), ("KVPROBE_CAPTURE_TIMEOUT", "1")], None);
    let m = check_complete(&out, &returned);
    assert_eq!(m["command_bound_seconds"], 1.0);
    for file in ["nvidia-smi-q.txt", "nvidia-smi-topo.txt"] {
        let e = entry(&m, file);
        assert_eq!(e["status"], "timed-out", "{e}");
        assert!(e["reason"].as_str().unwrap().contains("killed"), "{e}");
    }
    // The wrapper's own children were killed with it (their process group): none is left
    // running (gone, or a zombie until init reaps it). Generous bound: only "not left".
    let started: Vec<String> = std::fs::read_to_string(&pids).unwrap().lines().map(str::to_string).collect();
    assert_eq!(started.len(), 2, "nvidia-smi -q and topo -m each started a sleep");
    let t0 = Instant::now();
    for pid in started {
        let alive = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.rsplit_once(") ").is_some_and(|(_, r)| !r.starts_with('Z')))
        };
        while alive() && t0.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(!alive(), "the hung tool's child {pid} is still running");
    }
}

/// What a tool prints is the file, byte for byte; UCX_* / NIXL_* variables and nothing else
/// are in env-vars.txt; the UCX log given is copied verbatim.
#[test]
fn capture_keeps_tool_output_env_vars_and_ucx_log_verbatim() {
    let bin = tmpdir("capture-fake-bin");
    let q = "\n==============NVSMI LOG==============\n\nTimestamp : Tue Dec  1 03:00:00 2026\nDriver Version : 580.95.05\n\tCUDA Version : 13.0\n";
    let topo = "\tGPU0\tGPU1\nGPU0\t X \tNV18\nGPU1\tNV18\t X \n";
    std::fs::write(bin.join("q.txt"), q).unwrap();
    std::fs::write(bin.join("topo.txt"), topo).unwrap();
    script(
        &bin,
        "nvidia-smi",
        &format!(
            "if [ \"$1\" = -q ]; then cat '{0}/q.txt'; elif [ \"$1 $2\" = 'topo -m' ]; then cat '{0}/topo.txt'; else exit 3; fi\n",
            bin.display()
        ),
    );
    script(&bin, "ucx_info", "echo '# Library version: 1.23.0'; echo 'oops' >&2; exit 2\n");
    let log = bin.join("ucx.log");
    let ucx = "[1764558000.123456] [host:42:0]   +---------------------------+\n\
               [1764558000.123456] [host:42:0]   | remote memory read by ucp_get* from host memory |\n\
               [1764558000.123456] [host:42:0]   | 0..inf | zero-copy | cma/memory |\n\u{2713} tail\n";
    std::fs::write(&log, ucx).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let env = [
        ("PATH", path.as_str()),
        ("UCX_TLS", "tcp,self"),
        ("UCX_NET_DEVICES", "lo"),
        ("NIXL_PLUGIN_DIR", "/nowhere/plugins"),
        ("NOT_UCX_X", "1"),
        ("UCXNOPE", "1"),
        ("XNIXL_Y", "1"),
        ("ucx_tls", "lower"),
    ];
    let (out, returned) = capture_in_child("capture-fake", &env, Some(&log));
    let m = check_complete(&out, &returned);
    assert_eq!(std::fs::read_to_string(out.join("nvidia-smi-q.txt")).unwrap(), q);
    assert_eq!(std::fs::read_to_string(out.join("nvidia-smi-topo.txt")).unwrap(), topo);
    assert_eq!(entry(&m, "nvidia-smi-q.txt")["status"], "ok");
    assert_eq!(entry(&m, "nvidia-smi-q.txt")["source"], "nvidia-smi -q");
    assert_eq!(entry(&m, "nvidia-smi-topo.txt")["source"], "nvidia-smi topo -m");
    // A failing tool: its stdout kept, exit code and stderr in the reason.
    let u = entry(&m, "ucx-info-v.txt");
    assert_eq!(u["status"], "failed", "{u}");
    assert!(u["reason"].as_str().unwrap().starts_with("exit 2: oops"), "{u}");
    assert_eq!(std::fs::read_to_string(out.join("ucx-info-v.txt")).unwrap(), "# Library version: 1.23.0\n");
    assert_eq!(
        std::fs::read_to_string(out.join("env-vars.txt")).unwrap(),
        "NIXL_PLUGIN_DIR=/nowhere/plugins\nUCX_NET_DEVICES=lo\nUCX_TLS=tcp,self\n"
    );
    assert_eq!(std::fs::read(out.join("ucx-protocols.txt")).unwrap(), ucx.as_bytes());
    assert_eq!(entry(&m, "ucx-protocols.txt")["source"], log.to_str().unwrap());
}

/// A UCX log path that does not exist is `missing` (not an error); an output directory that
/// cannot be created is the one error (Io).
#[test]
fn capture_missing_ucx_log_is_a_status_and_unwritable_out_an_error() {
    let d = tmpdir("capture-nolog");
    let out = d.join("out");
    kvprobe::env_capture::capture(&out, Some(&d.join("no-such.log"))).unwrap();
    let u = entry(&manifest(&out), "ucx-protocols.txt").clone();
    assert_eq!(u["status"], "missing", "{u}");
    std::fs::write(d.join("a-file"), "x").unwrap();
    let e = kvprobe::env_capture::capture(&d.join("a-file/out"), None).unwrap_err();
    assert!(matches!(e, kvprobe::Error::Io(_)), "{e:?}");
}
