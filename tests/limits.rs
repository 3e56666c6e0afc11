//! Resource limits and leftovers: a report the disk (here: the file-size limit) refuses is
//! not lost, write errors are errors rather than signals, and nothing kvprobe makes outlives
//! it, even on SIGKILL.

use crate::common::{bin, mooncake_or_skip, tmpdir};
use serde_json::Value;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const BEGIN: &str = "-----BEGIN KVPROBE REPORT-----";
const END: &str = "-----END KVPROBE REPORT-----";

/// A kvprobe command with `TMPDIR` = `tmp` and, when given, `RLIMIT_FSIZE` = `fsize` bytes
/// (what `ulimit -f` sets: a write past it fails, or raises SIGXFSZ unless ignored). UCX's
/// posix transport is left out under a limit: its shared-memory segments are files the
/// limit also caps, and UCX would not start at all.
fn command(args: &[&str], tmp: &Path, fsize: Option<u64>) -> Command {
    let mut c = Command::new(bin());
    c.args(args).env("TMPDIR", tmp);
    if let Some(limit) = fsize {
        c.env("UCX_TLS", "^posix");
        // SAFETY: runs in the forked child before exec; setrlimit(2) is async-signal-safe and
        // the closure allocates nothing.
        unsafe {
            c.pre_exec(move || {
                let r = libc::rlimit { rlim_cur: limit, rlim_max: limit };
                if libc::setrlimit(libc::RLIMIT_FSIZE, &r) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    c
}

/// The report between the fallback markers on stderr.
fn fallback_report(stderr: &str) -> Value {
    let body: Vec<&str> = stderr.lines().skip_while(|l| *l != BEGIN).skip(1).take_while(|l| *l != END).collect();
    assert!(stderr.lines().any(|l| l == END), "no complete fallback report on stderr:\n{stderr}");
    serde_json::from_str(&body.join("\n")).unwrap_or_else(|e| panic!("fallback report is not JSON ({e}):\n{stderr}"))
}

/// Entries of `dir` (names).
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|r| r.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// kvprobe's private directories of process `pid` in `root` (`kvprobe-PID.RANDOM`).
fn private_dirs(root: &Path, pid: u32) -> Vec<PathBuf> {
    entries(root).into_iter().filter(|n| n.starts_with(&format!("kvprobe-{pid}."))).map(|n| root.join(n)).collect()
}

/// Asserts that the report directory `d` holds nothing but `keep` (no temporary report).
fn assert_only(d: &Path, keep: &[&str]) {
    let left: Vec<String> = entries(d).into_iter().filter(|n| !keep.contains(&n.as_str())).collect();
    assert!(left.is_empty(), "left in {}: {left:?}", d.display());
}

#[test]
fn a_report_the_file_size_limit_refuses_goes_to_stderr_with_the_runs_outcome() {
    let d = tmpdir("fsize-report");
    let tmp = d.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let p = d.join("r.json");
    // 1 KiB: every report is larger. Clean run: exit 7; corrupt run: keeps exit 1.
    for (extra, code, status) in [(&[][..], 7, "clean"), (&["--inject", "bitflip"][..], 1, "corrupt")] {
        let mut args = vec!["run", "--memory", "dram", "--iterations", "2", "--report", p.to_str().unwrap()];
        args.extend_from_slice(extra);
        let o = command(&args, &tmp, Some(1024)).output().unwrap();
        let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert_eq!(o.status.code(), Some(code), "{extra:?}: not killed by SIGXFSZ, the run's code kept\n{out}{err}");
        assert!(out.contains("NOT WRITTEN") && out.contains("File too large"), "{out}");
        assert!(err.contains(&format!("--report {} was not written", p.display())) && err.contains(BEGIN), "{err}");
        let r = fallback_report(&err);
        assert_eq!(r["schema"], "kvprobe.report/1");
        assert_eq!(r["outcome"]["status"], status, "{err}");
        assert_eq!(r["summary"]["iterations"], 2);
        assert_only(&d, &["tmp"]);
        assert_eq!(entries(&tmp), Vec::<String>::new(), "left in TMPDIR");
    }
    // The same run without the limit writes the report: the limit alone made the difference.
    let o =
        command(&["run", "--memory", "dram", "--iterations", "2", "--report", p.to_str().unwrap()], &tmp, None).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!String::from_utf8_lossy(&o.stderr).contains(BEGIN));
    assert_eq!(crate::common::read_report(&p)["outcome"]["status"], "clean");
}

#[test]
fn under_a_tiny_file_size_limit_ucx_cannot_start_and_kvprobe_says_why() {
    // The issue's own example: `ulimit -f 4` (4 KiB) killed kvprobe by SIGXFSZ inside UCX's
    // shared-memory set-up, leaving a segment in /dev/shm and UCX's log directory.
    let d = tmpdir("fsize-4k");
    let tmp = d.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let p = d.join("r.json");
    let mut cmd = command(&["run", "--memory", "dram", "--iterations", "2", "--report", p.to_str().unwrap()], &tmp, Some(4096));
    cmd.env_remove("UCX_TLS");
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("NIXL backend UCX failed to start") && err.contains("file-size limit (ulimit -f) is 4096 bytes"),
        "{err}"
    );
    // The error report: in the file, or (when larger than the limit) on stderr.
    let r = if p.exists() { crate::common::read_report(&p) } else { fallback_report(&err) };
    assert_eq!(r["outcome"]["error"]["kind"], "environment");
    assert_only(&d, &["tmp", "r.json"]);
    assert_eq!(entries(&tmp), Vec::<String>::new(), "left in TMPDIR");
    assert_eq!(private_dirs(Path::new("/dev/shm"), pid), Vec::<PathBuf>::new(), "left in /dev/shm");
}

#[test]
fn bench_json_the_file_size_limit_refuses_goes_to_stderr() {
    let d = tmpdir("fsize-bench");
    let tmp = d.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let p = d.join("b.json");
    let args = [
        "bench",
        "--memory",
        "dram",
        "--host-bytes",
        "1MiB",
        "--sweep-bytes",
        "4MiB",
        "--repeats",
        "1",
        "--iterations",
        "2",
        "--json",
        p.to_str().unwrap(),
    ];
    let o = command(&args, &tmp, Some(1024)).output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.status.code(), Some(7), "{out}{err}");
    assert!(err.contains(&format!("--json {} was not written", p.display())), "{err}");
    let r = fallback_report(&err);
    assert_eq!(r["schema"], "kvprobe.bench/1");
    assert_eq!(r["outcome"]["status"], "clean");
    assert_only(&d, &["tmp"]);
}

#[test]
fn an_ab_report_the_file_size_limit_refuses_goes_to_stderr() {
    let d = tmpdir("fsize-ab");
    let tmp = d.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let p = d.join("ab.json");
    let o = command(&["ab", "--memory", "dram", "--requests", "20", "--report", p.to_str().unwrap()], &tmp, Some(1024))
        .output()
        .unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(err.contains(&format!("--report {} was not written", p.display())), "{out}{err}");
    assert!(out.contains("NOT WRITTEN"), "{out}");
    let r = fallback_report(&err);
    assert_eq!(r["schema"], "kvprobe.ab/1");
    assert_eq!(r["rows"].as_array().unwrap().len(), r["sections"].as_array().unwrap().len());
    // The matrix's own code, or 7 in place of a clean 0.
    let own = r["outcome"]["exit_code"].as_i64().unwrap();
    assert_eq!(o.status.code().map(i64::from), Some(if own == 0 { 7 } else { own }), "{out}{err}");
    assert_only(&d, &["tmp"]);
    assert_eq!(entries(&tmp), Vec::<String>::new(), "left in TMPDIR");
}

/// A kvprobe child that is SIGKILLed and reaped if the test fails before it ends.
struct Running(Option<Child>);

impl Running {
    fn id(&self) -> u32 {
        self.0.as_ref().expect("running").id()
    }

    fn take(mut self) -> Child {
        self.0.take().expect("running")
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts `cmd` with stderr piped and waits until a stderr line contains `ready`
/// ([`crate::common::wait_for_stderr_line`]: no time limit, the rest drained in the background).
fn start_until(mut cmd: Command, ready: &str) -> Running {
    let mut r = Running(Some(cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap()));
    crate::common::wait_for_stderr_line(r.0.as_mut().expect("running"), ready);
    r
}

/// SIGKILLs `child`, then starts another kvprobe with the same TMPDIR and checks that
/// nothing of the killed one is left there or in /dev/shm.
fn kill_and_check_swept(child: Running, tmp: &Path) {
    let mut child = child.take();
    let pid = child.id();
    child.kill().unwrap(); // SIGKILL: no destructor, no exit path of kvprobe runs
    child.wait().unwrap();
    // What kvprobe makes lives in its private directories (nothing at the top of TMPDIR).
    let shm = Path::new("/dev/shm");
    assert_eq!(entries(tmp).len(), private_dirs(tmp, pid).len(), "outside the private directory: {:?}", entries(tmp));
    // The next kvprobe, of any subcommand, removes them.
    let o = command(&["env", "--no-probe"], tmp, None).output().unwrap();
    assert!(o.status.code().is_some(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(entries(tmp), Vec::<String>::new(), "left in TMPDIR after the next start");
    assert_eq!(private_dirs(shm, pid), Vec::<PathBuf>::new(), "left in /dev/shm after the next start");
}

#[test]
fn a_sweep_killed_hard_leaves_nothing_after_the_next_start() {
    // Killed during set-up (UCX's log still has its name: UCX opened it, kvprobe has not yet
    // taken it over) and mid-run.
    for (name, ready) in [("setup", "decode NIXL agent"), ("mid-run", "iteration 1/")] {
        let d = tmpdir(&format!("kill-sweep-{name}"));
        let tmp = d.join("tmp");
        std::fs::create_dir_all(&tmp).unwrap();
        let mut cmd = command(&["run", "--memory", "dram", "--iterations", "1000000"], &tmp, None);
        cmd.env("KVPROBE_TRACE", "1");
        let child = start_until(cmd, ready);
        let pid = child.id();
        // The run's UCX log and shared-memory segments live in its private directories.
        assert_eq!(private_dirs(&tmp, pid).len(), 1, "{name}: {:?}", entries(&tmp));
        assert_eq!(private_dirs(Path::new("/dev/shm"), pid).len(), 1, "{name}");
        kill_and_check_swept(child, &tmp);
    }
}

#[test]
fn a_mooncake_run_killed_hard_leaves_nothing_after_the_next_start() {
    if !mooncake_or_skip("a_mooncake_run_killed_hard_leaves_nothing_after_the_next_start") {
        return;
    }
    let d = tmpdir("kill-mooncake");
    let tmp = d.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let cmd =
        command(&["run", "--memory", "dram", "--scenario", "stacked", "--tier", "mooncake", "--duration", "10m"], &tmp, None);
    let child = start_until(cmd, "requests verified");
    let pid = child.id();
    // The worker's script is in the private directory; the master's and worker's logs have
    // no name at all.
    let private = private_dirs(&tmp, pid);
    assert_eq!(private.len(), 1, "{:?}", entries(&tmp));
    let inside = entries(&private[0]);
    assert!(inside.iter().any(|n| n.starts_with("kvprobe-mooncake-worker.") && n.ends_with(".py")), "{inside:?}");
    assert!(!inside.iter().any(|n| n.ends_with(".log")), "{inside:?}");
    kill_and_check_swept(child, &tmp);
}

#[test]
fn a_live_runs_private_directory_is_never_swept() {
    let d = tmpdir("live-private");
    let tmp = d.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let child = start_until(command(&["run", "--memory", "dram", "--iterations", "1000000"], &tmp, None), "iteration 1/");
    let pid = child.id();
    let before = private_dirs(&tmp, pid);
    // A stale directory of a dead process (no lock holder) next to it, and a foreign one.
    std::fs::create_dir_all(tmp.join("kvprobe-1.abcdef")).unwrap();
    std::fs::write(tmp.join("kvprobe-1.abcdef/lock"), "").unwrap();
    std::fs::create_dir_all(tmp.join("kvprobe-notes")).unwrap();
    let o = command(&["env", "--no-probe"], &tmp, None).output().unwrap();
    assert!(o.status.code().is_some());
    assert_eq!(private_dirs(&tmp, pid), before, "the live run's directory was taken");
    assert!(!tmp.join("kvprobe-1.abcdef").exists(), "the dead one was kept");
    assert!(tmp.join("kvprobe-notes").exists(), "a directory kvprobe did not name was removed");
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(pid as i32, libc::SIGINT) };
    let st = child.take().wait().unwrap();
    assert_eq!(st.code(), Some(130));
    // A run that ends normally removes its own directories.
    assert_eq!(private_dirs(&tmp, pid), Vec::<PathBuf>::new());
    assert_eq!(private_dirs(Path::new("/dev/shm"), pid), Vec::<PathBuf>::new());
}

#[test]
fn temporary_reports_that_killed_writers_left_are_removed_by_the_next_write() {
    let d = tmpdir("stale-tmp");
    let old = std::time::SystemTime::now() - Duration::from_secs(3600);
    let make = |name: &str, mtime: std::time::SystemTime| {
        let f = std::fs::File::create(d.join(name)).unwrap();
        f.set_modified(mtime).unwrap();
        f
    };
    // A writer killed mid-write an hour ago: unlocked and old.
    drop(make(".kvprobe-report.dead01.tmp", old));
    // One being written now (locked), one just created (not yet locked), and a file kvprobe
    // did not name.
    let live = make(".kvprobe-report.live01.tmp", old);
    live.lock().unwrap();
    drop(make(".kvprobe-report.new001.tmp", std::time::SystemTime::now()));
    drop(make("notes.tmp", old));
    let p = d.join("r.json");
    let o =
        command(&["run", "--memory", "dram", "--iterations", "1", "--report", p.to_str().unwrap()], &d, None).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(entries(&d), [".kvprobe-report.live01.tmp", ".kvprobe-report.new001.tmp", "notes.tmp", "r.json"]);
}

/// Sets the limit `resource` of the command's process to (`soft`, `hard`) before exec.
fn with_rlimit(c: &mut Command, resource: libc::__rlimit_resource_t, soft: u64, hard: u64) {
    // SAFETY: runs in the forked child before exec; setrlimit(2) is async-signal-safe and the
    // closure allocates nothing.
    unsafe {
        c.pre_exec(move || {
            let r = libc::rlimit { rlim_cur: soft, rlim_max: hard };
            if libc::setrlimit(resource, &r) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Under an address-space limit (`ulimit -v`) too tight for UCX (it crashed in registration,
/// or failed to connect, below about 600 MB; the CPU passes once panicked when a thread could
/// not be spawned) kvprobe refuses up front with exit 2 and a report — never a panic or a
/// signal; with enough address space the run is clean.
#[test]
fn an_address_space_limit_is_an_error_with_a_report_never_a_panic() {
    for kib in [150_000u64, 200_000, 400_000, 1_000_000, 4 << 20] {
        let d = tmpdir("rlimit-as");
        let tmp = d.join("tmp");
        std::fs::create_dir_all(&tmp).unwrap();
        let p = d.join("r.json");
        let mut c = command(
            &["run", "--memory", "dram", "--iterations", "2", "--timeout", "5", "--report", p.to_str().unwrap()],
            &tmp,
            None,
        );
        with_rlimit(&mut c, libc::RLIMIT_AS, kib << 10, kib << 10);
        let o = c.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        let want = if kib << 10 >= kvprobe::nixl::MIN_ADDRESS_SPACE { 0 } else { 2 };
        assert_eq!(o.status.code(), Some(want), "ulimit -v {kib}: {:?}: {err}", o.status);
        assert!(!err.contains("panicked"), "ulimit -v {kib}: {err}");
        if want == 2 {
            assert!(err.contains(&format!("the address-space limit (ulimit -v) is {kib} KiB and cannot be raised")), "{err}");
        }
        let r: Value = serde_json::from_str(&std::fs::read_to_string(&p).expect("report written")).unwrap();
        assert_eq!(r["outcome"]["exit_code"], want, "ulimit -v {kib}");
        assert_eq!(entries(&tmp), Vec::<String>::new(), "ulimit -v {kib}: left in TMPDIR");
    }
}

/// An open-file limit UCX cannot start under (it aborted the process below 12 descriptors,
/// failed below 48) is refused up front with exit 2 and a report when it cannot be raised,
/// and raised to the hard limit when it can.
#[test]
fn an_open_file_limit_too_low_is_raised_or_refused_up_front() {
    for n in [5u64, 6, 10, 40] {
        let d = tmpdir("rlimit-nofile");
        let tmp = d.join("tmp");
        std::fs::create_dir_all(&tmp).unwrap();
        let p = d.join("r.json");
        let mut c = command(&["run", "--memory", "dram", "--iterations", "2", "--report", p.to_str().unwrap()], &tmp, None);
        with_rlimit(&mut c, libc::RLIMIT_NOFILE, n, n);
        let o = c.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "ulimit -n {n}: {:?}: {err}", o.status);
        assert!(err.contains(&format!("the open-file limit (ulimit -n) is {n} and cannot be raised")), "{err}");
        // The report: in its file, or — when no descriptor is left to write it with (how many
        // kvprobe has open by then depends on the host) — on stderr (see the file-size tests).
        let r: Value = match std::fs::read_to_string(&p) {
            Ok(text) => serde_json::from_str(&text).unwrap(),
            Err(_) => fallback_report(&err),
        };
        assert_eq!(r["outcome"]["exit_code"], 2, "ulimit -n {n}");
        assert_eq!(entries(&tmp), Vec::<String>::new(), "ulimit -n {n}: left in TMPDIR");
    }
    // A soft limit of 10 under a higher hard one is raised, and the run is clean.
    let d = tmpdir("rlimit-nofile-soft");
    let tmp = d.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let mut c = command(&["run", "--memory", "dram", "--iterations", "2"], &tmp, None);
    with_rlimit(&mut c, libc::RLIMIT_NOFILE, 10, 4096);
    let o = c.output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn sighup_stops_a_run_as_sigterm_does_with_its_report() {
    // A closed terminal: UCX's debug handler took SIGHUP (UCX_DEBUG_SIGNO defaults to it) and
    // the run went on. Now kvprobe sets UCX_DEBUG_SIGNO=0 and treats SIGHUP as SIGTERM.
    let d = tmpdir("sighup");
    let p = d.join("r.json");
    let mut child = Command::new(bin())
        .args(["run", "--memory", "dram", "--iterations", "1000000", "--report", p.to_str().unwrap()])
        .env_remove("UCX_DEBUG_SIGNO")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // UCX is loaded once the first iteration is done (it would have installed its handler).
    crate::common::wait_for_stderr_line(&mut child, "iteration 1/");
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGHUP) };
    // A generous bound that only a run ignoring the signal reaches (a million iterations).
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("SIGHUP did not stop the run");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(130), "{status:?}");
    let r: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    assert_eq!(r["outcome"]["status"], "interrupted");
    assert!(r["summary"]["iterations"].as_u64().unwrap() >= 1);
    assert_eq!(r["environment"]["transport_env"]["UCX_DEBUG_SIGNO"], "0");
}

#[test]
fn kvprobe_turns_on_cuda_ipc_get_zero_copy_unless_the_user_set_it() {
    let run = |name: &str, user: Option<&str>| {
        let d = tmpdir(name);
        let p = d.join("r.json");
        let mut c = Command::new(bin());
        c.args(["run", "--memory", "dram", "--iterations", "1", "--report", p.to_str().unwrap()]);
        match user {
            Some(v) => c.env("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", v),
            None => c.env_remove("UCX_CUDA_IPC_ENABLE_GET_ZCOPY"),
        };
        let out = c.env_remove("UCX_LOG_FILE").env_remove("UCX_PROTO_INFO").env_remove("KVPROBE_UCX_DIAG").output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(0), "{err}");
        let r: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        (r["environment"].clone(), err)
    };
    let defaults = |e: &Value| -> Vec<String> {
        e["transport_env_defaults"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect()
    };
    // Unset: kvprobe's default for its agents, named as such.
    let (e, err) = run("zcopy-default", None);
    assert_eq!(e["transport_env"]["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"], "y", "{e}");
    assert!(defaults(&e).contains(&"UCX_CUDA_IPC_ENABLE_GET_ZCOPY".to_string()), "{e}");
    // UCX's warning that its CUDA transport (absent without a GPU) left it unused is kvprobe's
    // own business, not the user's.
    assert!(!err.contains("unused environment variable: UCX_CUDA_IPC_ENABLE_GET_ZCOPY"), "{err}");
    // The user's value is left alone and not called kvprobe's.
    let (e, _) = run("zcopy-user", Some("n"));
    assert_eq!(e["transport_env"]["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"], "n", "{e}");
    assert!(!defaults(&e).contains(&"UCX_CUDA_IPC_ENABLE_GET_ZCOPY".to_string()), "{e}");
}
