//! `--timeout` bounds every wait (docs/guide.md "What `--timeout` bounds", and exit code 4): each NIXL request from
//! just before it is built — the post call included — to its completion and notification, and
//! every other blocking call; a call that blocks past its deadline still ends the run with
//! exit 4 and a report. Real NIXL on DRAM.
//!
//! Nothing here depends on the machine's speed: a microsecond limit is shorter than any real
//! post call, and the stalls (test-only hooks `KVPROBE_TEST_STALL_*`, see src/sys/deadline.rs)
//! block for an hour, far past the limit; durations are asserted only as "does not hang".

use crate::common::{bin, kvprobe_env, read_report, tmpdir};
use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `kvprobe ARGS --report <tmp>/r.json` with `env`: (exit code, report, stdout + stderr).
fn run_env(name: &str, args: &[&str], env: &[(&str, &str)]) -> (i32, Value, String) {
    let p = tmpdir(name).join("r.json");
    let mut a = args.to_vec();
    a.extend_from_slice(&["--report", p.to_str().unwrap()]);
    let (code, out, err) = kvprobe_env(&a, env);
    assert!(!err.contains("panicked"), "{err}");
    (code, read_report(&p), format!("{out}{err}"))
}

fn assert_timeout(code: i32, r: &Value, log: &str) {
    assert_eq!(code, 4, "{log}");
    assert_eq!(r["outcome"]["exit_code"], 4, "{}", r["outcome"]);
    assert_eq!(r["outcome"]["status"], "timeout", "{}", r["outcome"]);
    assert_eq!(r["outcome"]["error"]["kind"], "timeout", "{}", r["outcome"]);
}

fn message(r: &Value) -> String {
    r["outcome"]["error"]["message"].as_str().unwrap_or("").to_string()
}

const SWEEP: &[&str] = &["run", "--memory", "dram", "--iterations", "3"];
const NIXL_ONLY: &[&str] = &["run", "--memory", "dram", "--scenario", "nixl-only", "--requests", "100"];

#[test]
fn a_microsecond_timeout_fails_every_transfer_path() {
    // Any real transfer, its post call alone included, takes longer than a microsecond.
    for (name, args) in [
        ("us-sweep", SWEEP.to_vec()),
        ("us-write", [SWEEP, &["--op", "write"]].concat()),
        ("us-stages", [SWEEP, &["--pipeline-stages", "4"]].concat()),
        ("us-agent", [SWEEP, &["--decode-process"]].concat()),
        ("us-scenario", NIXL_ONLY.to_vec()),
        ("us-lockstep", [NIXL_ONLY, &["--lockstep"]].concat()),
    ] {
        let args = [&args[..], &["--timeout", "0.000001"]].concat();
        let (code, r, log) = run_env(name, &args, &[]);
        assert_timeout(code, &r, &format!("{name}: {log}"));
        // Nothing was verified under that limit: the first request already ended the run.
        assert_eq!(r["summary"]["blocks_checked"], 0, "{name}: {}", r["summary"]);
    }
}

#[test]
fn a_request_completed_inside_its_post_call_is_still_measured() {
    // The hook makes the post call return only once its request has completed (as NIXL's
    // UCX backend may for DRAM): the request is done when posting returns, and still late.
    for (name, args) in [("in-post-sweep", SWEEP), ("in-post-scenario", NIXL_ONLY)] {
        let args = [args, &["--timeout", "0.000001"]].concat();
        let (code, r, log) = run_env(name, &args, &[("KVPROBE_TEST_STALL_POST", "0")]);
        assert_timeout(code, &r, &format!("{name}: {log}"));
        assert!(message(&r).contains("completed inside the post call"), "{name}: {}", message(&r));
    }
}

#[test]
fn a_generous_timeout_passes_with_slow_post_calls() {
    // Each post call takes 0.2 s (request complete inside it): well inside --timeout 600.
    for (name, args) in [
        ("slow-sweep", SWEEP),
        ("slow-scenario", &["run", "--memory", "dram", "--scenario", "nixl-only", "--requests", "20"][..]),
    ] {
        let args = [args, &["--timeout", "600"]].concat();
        let (code, r, log) = run_env(name, &args, &[("KVPROBE_TEST_STALL_POST", "0.2")]);
        assert_eq!(code, 0, "{name}: {log}");
        assert_eq!(r["outcome"]["status"], "clean", "{name}");
        // What the verify passes counted: the sweep's 3 iterations of 512 slices of 4096
        // bytes (small preset); the scenario's verified requests' slices.
        let slices = if name == "slow-sweep" { 3 * 512 } else { r["summary"]["blocks_checked"].as_u64().unwrap() };
        assert!(slices > 0, "{name}");
        crate::common::assert_compared(&r, slices, 4096, name);
    }
    // --decode-process: the prefill process posts the WRITEs, each post call 0.2 s there.
    let (code, r, log) = run_env(
        "slow-agent",
        &[SWEEP, &["--decode-process", "--op", "write", "--timeout", "600"]].concat(),
        &[("KVPROBE_TEST_STALL_AGENT_POST", "0.2")],
    );
    assert_eq!(code, 0, "{log}");
    assert_eq!(r["outcome"]["status"], "clean");
}

/// Starts kvprobe with `args` (a report path appended) and `env`; returns it, the report path
/// and, with `agent`, the pid of its second process (`--decode-process`: the child `kvprobe
/// serve --fd N` holding prefill's agent and pool) once it runs.
fn spawn(name: &str, args: &[&str], env: &[(&str, &str)], agent: bool) -> (std::process::Child, PathBuf, Option<u32>) {
    let d = tmpdir(name);
    let report = d.join("r.json");
    // stderr to a file: the prefill process inherits it, so a pipe would stay open while it
    // lives.
    let log = std::fs::File::create(d.join("stderr")).unwrap();
    let mut c = Command::new(bin());
    c.args(args).arg("--report").arg(&report).stdout(Stdio::null()).stderr(log);
    for (k, v) in env {
        c.env(k, v);
    }
    let child = c.spawn().unwrap();
    let mut pid = None;
    if agent {
        let t0 = Instant::now();
        while pid.is_none() {
            let out = Command::new("pgrep").args(["-P", &child.id().to_string(), "-f", "serve --fd"]).output().unwrap();
            pid = String::from_utf8_lossy(&out.stdout).split_whitespace().next().and_then(|p| p.parse().ok());
            assert!(t0.elapsed() < Duration::from_secs(120), "{name}: no prefill process started");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    (child, report, pid)
}

/// Waits for kvprobe; returns its exit code, report and stderr.
fn finish(mut child: std::process::Child, report: &std::path::Path) -> (i32, Value, String) {
    let code = child.wait().unwrap().code().unwrap_or(-1);
    let err = std::fs::read_to_string(report.with_file_name("stderr")).unwrap_or_default();
    assert!(!err.contains("panicked"), "{err}");
    (code, read_report(report), err)
}

/// True once process `pid` is gone (or a zombie waiting for its new parent to reap it).
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

fn assert_gone(pid: u32, what: &str) {
    let t0 = Instant::now();
    while !gone(pid) {
        assert!(t0.elapsed() < Duration::from_secs(30), "{what}: process {pid} is still running");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_call_blocked_past_its_deadline_still_ends_the_run_with_exit_4_and_a_report() {
    // The post call never returns (an hour): the watchdog ends the run 5 s past the deadline,
    // with the report so far (environment included) and outcome timeout.
    for (name, args) in [("stuck-sweep", SWEEP), ("stuck-scenario", NIXL_ONLY)] {
        let args = [args, &["--timeout", "1"]].concat();
        let (child, report, _) = spawn(name, &args, &[("KVPROBE_TEST_STALL_POST", "3600")], false);
        let (code, r, err) = finish(child, &report);
        assert_timeout(code, &r, &format!("{name}: {err}"));
        assert!(message(&r).contains("did not return within 1.000 s"), "{name}: {}", message(&r));
        assert!(r["environment"]["nixl"]["library"].is_string(), "{name}: the report keeps the environment");
        if name == "stuck-scenario" {
            assert!(r["scenario"].is_object(), "the scenario section is kept");
        }
    }
    // `--report -`: the watchdog's report goes to stdout like any other, nothing else there.
    let (code, out, err) =
        kvprobe_env(&[SWEEP, &["--timeout", "1", "--report", "-"]].concat(), &[("KVPROBE_TEST_STALL_POST", "3600")]);
    assert_eq!(code, 4, "{err}");
    let r: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("stdout is the report ({e}): {out}"));
    assert_eq!(r["outcome"]["status"], "timeout");
    // A status query that never returns.
    let (child, report, _) =
        spawn("stuck-status", &[SWEEP, &["--timeout", "1"]].concat(), &[("KVPROBE_TEST_STALL_STATUS", "3600")], false);
    let (code, r, err) = finish(child, &report);
    assert_timeout(code, &r, &err);
    assert!(message(&r).contains("NIXL transfer status query"), "{}", message(&r));
}

#[test]
fn a_blocked_call_in_either_process_of_decode_process_ends_the_run_and_the_child() {
    // WRITE: decode (kvprobe) queries its notifications, prefill (the child) posts.
    let args = [SWEEP, &["--decode-process", "--op", "write", "--timeout", "1"]].concat();
    // kvprobe's own notification query never returns: the watchdog ends the run, and the
    // prefill process dies with kvprobe.
    let (child, report, agent) = spawn("stuck-parent", &args, &[("KVPROBE_TEST_STALL_NOTIFICATIONS", "3600")], true);
    let (code, r, err) = finish(child, &report);
    assert_timeout(code, &r, &err);
    assert!(message(&r).contains("notification query"), "{}", message(&r));
    assert_gone(agent.unwrap(), "stuck-parent: the prefill process");
    // The child's post call never returns: its WRITE is not complete by the deadline (exit 4
    // through the normal path), and kvprobe stops the child.
    let (child, report, agent) = spawn("stuck-agent", &args, &[("KVPROBE_TEST_STALL_AGENT_POST", "3600")], true);
    let (code, r, err) = finish(child, &report);
    assert_timeout(code, &r, &err);
    assert!(message(&r).contains("by the prefill process"), "{}", message(&r));
    assert_gone(agent.unwrap(), "stuck-agent: the prefill process");
}

#[test]
fn ab_with_a_blocked_call_reports_the_row_cut_short() {
    let (child, report, _) = spawn(
        "stuck-ab",
        &["ab", "--memory", "dram", "--requests", "50", "--timeout", "1"],
        &[("KVPROBE_TEST_STALL_POST", "3600")],
        false,
    );
    let (code, r, err) = finish(child, &report);
    assert_eq!(code, 4, "{err}");
    assert_eq!(r["outcome"]["status"], "timeout");
    let rows = r["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "the first row (nixl-only) is cut short: {rows:?}");
    assert_eq!(rows[0]["verdict"], "timeout");
    assert_eq!(rows[0]["pass"], false);
    assert_eq!(r["sections"][0]["outcome"]["status"], "timeout");
}

#[test]
fn ctrl_c_is_not_held_up_by_a_blocked_call() {
    // The post call blocks for an hour under --timeout 600: SIGINT still ends the run within
    // seconds (the watchdog, 2 s after the signal), with the report marked interrupted.
    let args = [SWEEP, &["--timeout", "600"]].concat();
    let (child, report, _) = spawn("stuck-sigint", &args, &[("KVPROBE_TEST_STALL_POST", "3600"), ("KVPROBE_TRACE", "1")], false);
    let log = report.with_file_name("stderr");
    let t0 = Instant::now();
    // Past this trace line the run posts its first request, with no check for signals before.
    while !std::fs::read_to_string(&log).unwrap_or_default().contains("iteration 1: posting") {
        assert!(t0.elapsed() < Duration::from_secs(120), "kvprobe did not reach its first transfer");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap().success());
    let (code, r, err) = finish(child, &report);
    assert_eq!(code, 130, "{err}");
    assert_eq!(r["outcome"]["status"], "interrupted");
    assert!(message(&r).contains("still blocked 2 s after the signal"), "{}", message(&r));
}

#[test]
fn vram_a_cuda_wait_blocked_past_its_deadline_ends_the_run_with_exit_4() {
    if !crate::common::gpu_or_skip("vram_a_cuda_wait_blocked_past_its_deadline_ends_the_run_with_exit_4") {
        return;
    }
    // The first wait for the fill kernel never returns: CUDA waits are bounded like the rest.
    let (child, report, _) = spawn(
        "stuck-cuda",
        &["run", "--memory", "vram", "--iterations", "2", "--timeout", "1"],
        &[("KVPROBE_TEST_STALL_SYNC", "3600")],
        false,
    );
    let (code, r, err) = finish(child, &report);
    assert_timeout(code, &r, &err);
    assert!(message(&r).contains("CUDA"), "{}", message(&r));
    // And a microsecond limit on VRAM: any transfer's post call takes longer.
    let (code, r, log) = run_env("us-vram", &["run", "--memory", "vram", "--iterations", "2", "--timeout", "0.000001"], &[]);
    assert_timeout(code, &r, &log);
}

#[test]
fn a_frozen_mooncake_worker_is_a_timeout_with_a_report_and_nothing_left_running() {
    if !crate::common::mooncake_or_skip("a_frozen_mooncake_worker_is_a_timeout_with_a_report_and_nothing_left_running") {
        return;
    }
    let args = [
        "run",
        "--memory",
        "dram",
        "--scenario",
        "stacked",
        "--tier",
        "mooncake",
        "--duration",
        "10m",
        "--timeout",
        "2",
        "--checkpoint",
        "1s",
    ];
    let (child, report, _) = spawn("frozen-worker", &args, &[], false);
    // A checkpoint means the engine runs: the worker is set up and serving saves and loads.
    let t0 = Instant::now();
    while !report.exists() {
        assert!(t0.elapsed() < Duration::from_secs(120), "no checkpoint written");
        std::thread::sleep(Duration::from_millis(50));
    }
    let kids = crate::common::children(child.id());
    let master = kids.iter().copied().find(|k| crate::common::cmdline(*k).contains("mooncake_master")).expect("the master");
    let worker =
        kids.iter().copied().find(|k| crate::common::cmdline(*k).contains("kvprobe-mooncake-worker")).expect("the worker");
    assert!(Command::new("kill").args(["-STOP", &worker.to_string()]).status().unwrap().success());
    let (code, r, err) = finish(child, &report);
    assert_timeout(code, &r, &err);
    assert!(message(&r).contains("Mooncake worker"), "{}", message(&r));
    assert!(r["scenario"]["tier_saves"].as_u64().unwrap() > 0, "the report keeps the run so far");
    assert_gone(master, "the Mooncake master");
    assert_gone(worker, "the Mooncake worker");
}

/// Waits until kvprobe's stderr (next to `report`) holds `marker`.
fn wait_for_log(report: &std::path::Path, marker: &str) {
    let log = report.with_file_name("stderr");
    let t0 = Instant::now();
    while !std::fs::read_to_string(&log).unwrap_or_default().contains(marker) {
        assert!(t0.elapsed() < Duration::from_secs(120), "kvprobe did not print {marker:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(sig: &str, pid: u32) {
    // kvprobe may already have ended (a signal after its exit is not an error here).
    let _ = Command::new("kill").args([sig, &pid.to_string()]).status();
}

#[test]
fn a_second_signal_still_leaves_the_report_so_far() {
    // The run is held up after the first SIGINT (a post call blocked for an hour, in kvprobe or
    // in the prefill process of --decode-process, which posts WRITEs); a second SIGINT 1.2 s
    // later ends it at once — still with the report published so far, marked interrupted.
    let sweep = [SWEEP, &["--timeout", "600"]].concat();
    let agent = [SWEEP, &["--decode-process", "--op", "write", "--timeout", "600"]].concat();
    let ab = ["ab", "--memory", "dram", "--requests", "50", "--timeout", "600"];
    for (name, args, stall, marker) in [
        ("second-sweep", &sweep[..], "KVPROBE_TEST_STALL_POST", "iteration 1: posting"),
        ("second-agent", &agent[..], "KVPROBE_TEST_STALL_AGENT_POST", "iteration 1: posting"),
        ("second-ab", &ab[..], "KVPROBE_TEST_STALL_POST", "connected"),
    ] {
        let (child, report, _) = spawn(name, args, &[(stall, "3600"), ("KVPROBE_TRACE", "1")], false);
        wait_for_log(&report, marker);
        std::thread::sleep(Duration::from_millis(300));
        signal("-INT", child.id());
        std::thread::sleep(Duration::from_millis(1200));
        signal("-INT", child.id());
        let (code, r, err) = finish(child, &report);
        assert_eq!(code, 130, "{name}: {err}");
        assert_eq!(r["outcome"]["status"], "interrupted", "{name}: {}", r["outcome"]);
        assert_eq!(r["outcome"]["exit_code"], 130, "{name}: {}", r["outcome"]);
        assert!(r["environment"]["nixl"]["library"].is_string(), "{name}: the report so far keeps the environment");
    }
}

#[test]
fn ctrl_c_kills_a_stopped_prefill_process_instead_of_waiting_for_it() {
    // The prefill process of --decode-process is stopped (SIGSTOP) mid-run, then kvprobe gets
    // SIGINT: it stops the run, and at shutdown kills the child after a short bound (1 s after
    // a signal) instead of waiting for it to exit; far within --timeout 3600.
    let args = ["run", "--memory", "dram", "--iterations", "100000", "--decode-process", "--timeout", "3600"];
    let (child, report, agent) = spawn("stopped-agent", &args, &[("KVPROBE_TRACE", "1")], true);
    let agent = agent.unwrap();
    wait_for_log(&report, "iteration 2: posting");
    signal("-STOP", agent);
    let t0 = Instant::now();
    signal("-INT", child.id());
    let (code, r, err) = finish(child, &report);
    assert_eq!(code, 130, "{err}");
    assert!(t0.elapsed() < Duration::from_secs(60), "an interrupted run waited {:?} for a stopped agent", t0.elapsed());
    assert_eq!(r["outcome"]["status"], "interrupted", "{}", r["outcome"]);
    // Killed after 1 s, or at once when a READ of its (stopped) memory could not be confirmed
    // finished: told to exit, it would free that memory under the READ.
    assert!(
        err.contains("the prefill process did not exit within 1 s of being told to; kvprobe killed it")
            || err.contains(
                "the prefill process was not told to exit (a request of kvprobe may still move its memory); kvprobe killed it"
            ),
        "{err}"
    );
    assert_gone(agent, "the stopped prefill process");
}

#[test]
fn a_poll_blocked_past_its_requests_deadline_is_a_timeout() {
    // Each status or notification query blocks 5 s, past --timeout 2 from the request's post:
    // the wait exceeded --timeout inside the call, even though the call then finds its request
    // complete or its notification there. In a scenario a query that blocks while no READ is
    // yet posted holds the whole step: decode's liveness bound ends the run and names the
    // notification query that held prefill's step.
    let t2 = ["--timeout", "2"];
    let sweep = [SWEEP, &t2].concat();
    let cases: Vec<(&str, Vec<&str>, &str, &str)> = vec![
        ("poll-notif-read", sweep.clone(), "KVPROBE_TEST_STALL_NOTIFICATIONS", "notification query"),
        ("poll-notif-write", [&sweep[..], &["--op", "write"]].concat(), "KVPROBE_TEST_STALL_NOTIFICATIONS", "notification query"),
        (
            "poll-notif-stages",
            [&sweep[..], &["--pipeline-stages", "4"]].concat(),
            "KVPROBE_TEST_STALL_NOTIFICATIONS",
            "notification query",
        ),
        ("poll-status", sweep.clone(), "KVPROBE_TEST_STALL_STATUS", "status query"),
        // --decode-process: kvprobe (decode) takes WRITE notifications; the prefill process
        // takes READ's and polls its WRITEs (kvprobe bounds them: incomplete past the deadline,
        // or the child's own timeout).
        (
            "poll-agent-write",
            [&sweep[..], &["--decode-process", "--op", "write"]].concat(),
            "KVPROBE_TEST_STALL_NOTIFICATIONS",
            "notification query",
        ),
        (
            "poll-agent-read",
            [&sweep[..], &["--decode-process"]].concat(),
            "KVPROBE_TEST_STALL_AGENT_NOTIFICATIONS",
            "notification",
        ),
        (
            "poll-agent-status",
            [&sweep[..], &["--decode-process", "--op", "write"]].concat(),
            "KVPROBE_TEST_STALL_AGENT_STATUS",
            "the prefill process",
        ),
        ("poll-scenario", [NIXL_ONLY, &t2].concat(), "KVPROBE_TEST_STALL_NOTIFICATIONS", "notification query"),
        ("poll-lockstep", [NIXL_ONLY, &t2, &["--lockstep"]].concat(), "KVPROBE_TEST_STALL_NOTIFICATIONS", "notification query"),
    ];
    for (name, args, stall, says) in cases {
        let (code, r, log) = run_env(name, &args, &[(stall, "5")]);
        assert_timeout(code, &r, &format!("{name}: {log}"));
        // A prefill side (a thread or a process) whose every READ notification query blocks
        // also leaves decode's fills unanswered: which of the two bounded waits ends the run
        // first depends on the load.
        let read_notifications = ["poll-notif-read", "poll-notif-stages", "poll-agent-read"].contains(&name);
        let also = if read_notifications { "did not report its fill" } else { says };
        assert!(message(&r).contains(says) || message(&r).contains(also), "{name}: {}", message(&r));
    }
}

#[test]
fn a_prefill_process_that_never_becomes_ready_is_a_timeout() {
    // The start-up of --decode-process's child (kvprobe serve --fd) blocks for an hour before
    // it says it is ready; the fixed start bound (120 s, here 2 s through the test-only
    // KVPROBE_TEST_AGENT_START_SECS) passes: exit 4 with a report, the child gone.
    let args = [SWEEP, &["--decode-process", "--timeout", "3600"]].concat();
    let (child, report, agent) = spawn(
        "agent-never-ready",
        &args,
        &[("KVPROBE_TEST_STALL_AGENT_START", "3600"), ("KVPROBE_TEST_AGENT_START_SECS", "2")],
        true,
    );
    let (code, r, err) = finish(child, &report);
    assert_timeout(code, &r, &err);
    assert!(message(&r).contains("prefill process"), "{}", message(&r));
    assert!(message(&r).contains("was not ready within 2 s of its start"), "{}", message(&r));
    assert_gone(agent.unwrap(), "the prefill process that never became ready");
}

/// What kvprobe says when requests it dropped in flight were confirmed finished before their
/// pools were freed (src/xfer/nixl.rs, `Registered`).
const DRAINED: &str = "in flight when the run stopped were drained (confirmed finished) before the pools were freed";
/// What kvprobe says when a request could not be confirmed finished: its pools are kept.
const KEPT: &str =
    "could not be confirmed finished within 2 s; the pools they move stay allocated and registered with NIXL until kvprobe exits";

/// Runs kvprobe with `args` and `env` in its own TMPDIR (with `agent`, waits for its prefill
/// process of --decode-process); returns (exit code, report, stderr) once it ended, after
/// checking that it left nothing behind: no child process, nothing in its TMPDIR, no /dev/shm
/// directory.
fn run_leaving_nothing(name: &str, args: &[&str], env: &[(&str, &str)], agent: bool) -> (i32, Value, String) {
    let tmp = tmpdir(&format!("{name}-tmp"));
    let t = tmp.to_str().unwrap().to_string();
    let env = [env, &[("TMPDIR", t.as_str())]].concat();
    let (child, report, agent_pid) = spawn(name, args, &env, agent);
    let pid = child.id();
    let (code, r, err) = finish(child, &report);
    if let Some(a) = agent_pid {
        assert_gone(a, &format!("{name}: the prefill process"));
    }
    let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "{name}: left in TMPDIR: {left:?}");
    let shm: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    let mine: Vec<_> = [Some(pid), agent_pid].into_iter().flatten().map(|p| format!("kvprobe-{p}.")).collect();
    assert!(!shm.iter().any(|n| mine.iter().any(|m| n.starts_with(m))), "{name}: left in /dev/shm: {shm:?}");
    (code, r, err)
}

#[test]
fn requests_left_in_flight_by_a_timeout_are_drained_before_their_pools_are_freed() {
    // Each status query blocks 5 s, past --timeout 2: the run ends on a request it never saw
    // complete (and others posted after it). Dropping them, kvprobe polls them until NIXL says
    // they are done, then frees the pools — and says so; a clean run says nothing of the kind.
    let t2 = ["--timeout", "2"];
    for (name, args) in [
        ("drain-read", [SWEEP, &t2].concat()),
        ("drain-write", [SWEEP, &t2, &["--op", "write"]].concat()),
        ("drain-scenario", [NIXL_ONLY, &t2].concat()),
        // Decode's READs in kvprobe, prefill's agent and pool in the child: the child is gone too.
        ("drain-agent", [SWEEP, &t2, &["--decode-process"]].concat()),
    ] {
        let agent = name == "drain-agent";
        let (code, r, err) = run_leaving_nothing(name, &args, &[("KVPROBE_TEST_STALL_STATUS", "5")], agent);
        assert_timeout(code, &r, &format!("{name}: {err}"));
        // WRITE: prefill's thread polls its WRITEs (its status queries are the stalled ones);
        // decode, which only hears of their completion, times out on the one it never heard
        // of first, or on the WRITE's notification, missing past its deadline or asked for in
        // a query that straddles it.
        let also: &[&str] = if name == "drain-write" { &["still not complete", "notification"] } else { &[] };
        let m = message(&r);
        assert!(m.contains("status query") || also.iter().any(|a| m.contains(a)), "{name}: {m}");
        assert_eq!(err.matches(DRAINED).count(), 1, "{name}: {err}");
        assert!(!err.contains(KEPT), "{name}: {err}");
    }
    let (code, r, err) = run_leaving_nothing("drain-none", SWEEP, &[], false);
    assert_eq!(code, 0, "{err}");
    assert_eq!(r["outcome"]["status"], "clean");
    assert!(!err.contains(DRAINED) && !err.contains(KEPT), "a clean run left no request in flight: {err}");
}

#[test]
fn a_request_that_cannot_be_confirmed_finished_keeps_its_pools_until_exit() {
    // The test-only KVPROBE_TEST_UNRECALLABLE=1 makes every request dropped in flight one that
    // NIXL cannot confirm finished (as a cuda_ipc copy already on a stream): its pools and
    // registrations are never freed before exit, which one line says; the run still ends with
    // exit 4 and its report, and leaves nothing behind.
    let t2 = ["--timeout", "2"];
    let unrecallable = ("KVPROBE_TEST_UNRECALLABLE", "1");
    for (name, args) in [("keep-read", [SWEEP, &t2].concat()), ("keep-scenario", [NIXL_ONLY, &t2].concat())] {
        let (code, r, err) = run_leaving_nothing(name, &args, &[("KVPROBE_TEST_STALL_STATUS", "5"), unrecallable], false);
        assert_timeout(code, &r, &format!("{name}: {err}"));
        assert!(r["environment"]["nixl"]["library"].is_string(), "{name}: the report is whole");
        assert_eq!(err.matches(KEPT).count(), 1, "{name}: {err}");
        assert!(!err.contains(DRAINED), "{name}: {err}");
    }
    // The hook with nothing left in flight: nothing kept, nothing said.
    let (code, _, err) = run_leaving_nothing("keep-none", SWEEP, &[unrecallable], false);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains(KEPT) && !err.contains(DRAINED), "{err}");
}
