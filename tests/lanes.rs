//! Issue 13.14: the GPU lane driver (scripts/gpu-lane.sh and its suites) fails when it
//! must — a failing or skipping test binary, a step exiting otherwise than it must, a host with
//! fewer GPUs than the lane's kind — and the GPU tests' gate (tests/common `gpu_decision`)
//! fails instead of skipping where GPUs are required, naming a `cuInit` failure. The lanes run
//! here with stand-in `kvprobe` and `tests` binaries (no GPU needed).

use crate::common::{gpu_decision, tmpdir};
use std::path::{Path, PathBuf};
use std::process::Command;

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts").join(name)
}

fn write_exe(p: &Path, body: &str) {
    std::fs::write(p, body).unwrap();
    std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
}

/// A bundle in `d/b`: an empty NIXL tarball, a stand-in `kvprobe` (`env --json` lists
/// $FAKE_GPUS GPUs; `run` exits 1 with --inject, else $FAKE_RUN_RC, default 0, and writes a
/// report whose injections were all found to its `--report`; `ab` exits $FAKE_RUN_RC) and a
/// stand-in `tests` (prints $FAKE_TESTS_OUT, exits $FAKE_TESTS_RC).
fn bundle(d: &Path) {
    let b = d.join("b");
    std::fs::create_dir_all(&b).unwrap();
    let st = Command::new("tar").args(["cJf", "b/nixl.tar.xz", "--files-from", "/dev/null"]).current_dir(d).status().unwrap();
    assert!(st.success());
    write_exe(
        &b.join("kvprobe"),
        r#"#!/bin/bash
case "$1 $2" in
  "env --json") printf '{"gpus": ['; for ((i = 0; i < ${FAKE_GPUS:-1}; i++)); do [ $i -gt 0 ] && printf ','; printf '{}'; done; echo ']}' ;;
  env*) echo "fake env" ;;
  run*)
    rc=${FAKE_RUN_RC:-0}; prev=
    for a in "$@"; do
      [ "$a" = --inject ] && rc=1
      [ "$prev" = --report ] && report=$a
      prev=$a
    done
    body='{"outcome": {"exit_code": 0}, "summary": {"per_iteration": [], "injections_planted": 2, "injections_detected": 2, "unexpected_failures": 0}}'
    if [ "${report:-}" = - ]; then echo "$body"; elif [ -n "${report:-}" ]; then echo "$body" > "$report"; fi
    exit "$rc" ;;
  ab*) exit "${FAKE_RUN_RC:-0}" ;;
  serve*) echo "kvprobe serve: listening on 127.0.0.1:9 (peer protocol 1; stand-in)"; exit "${FAKE_RUN_RC:-0}" ;;
  *) exit 0 ;;
esac
"#,
    );
    write_exe(
        &b.join("tests"),
        "#!/bin/sh\nprintf '%b\\n' \"${FAKE_TESTS_OUT:-test result: ok. 1 passed}\"\nexit \"${FAKE_TESTS_RC:-0}\"\n",
    );
}

/// Runs the lane driver with `suites` on a stand-in bundle with `env`, from a directory that
/// has the repository's bench/; (exit code, the lane's log).
fn lane(suites: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    lane_with(|_| Some("b".into()), suites, env)
}

/// [`lane`], the bundle argument made from the lane's directory by `arg` (`None`: none given).
fn lane_with(arg: impl Fn(&Path) -> Option<String>, suites: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let d = tmpdir("lane");
    bundle(&d);
    std::os::unix::fs::symlink(Path::new(env!("CARGO_MANIFEST_DIR")).join("bench"), d.join("bench")).unwrap();
    let out = d.join("out");
    let mut c = Command::new("bash");
    c.arg(script("gpu-lane.sh"))
        .args(arg(&d))
        .args(suites)
        .current_dir(&d)
        .env("OUT", &out)
        .env("KVPROBE_LANE_TMP", d.join("tmp"));
    c.env_remove("KVPROBE_REQUIRE_GPUS").env_remove("KVPROBE_REQUIRE_GPU").env("PATH", std::env::var("PATH").unwrap());
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    let log = std::fs::read_to_string(out.join("log.txt")).unwrap_or_default();
    (
        o.status.code().unwrap_or(-1),
        format!("{log}\n--- stdout/stderr:\n{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)),
    )
}

#[test]
fn a_one_gpu_lane_passes_only_when_every_step_does() {
    // Everything as it must be: the lane passes (so the failures below are the steps' own).
    let (code, log) = lane(&["final"], &[]);
    assert_eq!(code, 0, "{log}");
    assert!(log.contains("GPUs: 1 present, 1 required"), "{log}");
    for (why, env) in [
        ("the test binary fails", &[("FAKE_TESTS_RC", "101"), ("FAKE_TESTS_OUT", "test result: FAILED. 1 failed")][..]),
        ("a test skipped", &[("FAKE_TESTS_OUT", "SKIP gpu_test: no CUDA GPU present\ntest result: ok. 1 passed")][..]),
        ("a skip amid another test's line", &[("FAKE_TESTS_OUT", "test a ... SKIP mooncake_x: no install\nok")][..]),
        ("a run that must be clean exits 3", &[("FAKE_RUN_RC", "3")][..]),
        ("the host shows no GPU", &[("FAKE_GPUS", "0")][..]),
    ] {
        let (code, log) = lane(&["final"], env);
        assert_eq!(code, 1, "{why}: {log}");
        assert!(log.contains("FAIL: ") && log.contains("LANE FAILED"), "{why}: {log}");
    }
    // A two-GPU test not run on a one-GPU kind is no skip, nor is a message naming SKIP_GEN.
    let out = "NOT RUN x: needs 2 CUDA GPU(s), 1 present; the lane requires 1\ntest skip_gen ... ok (SKIP_GEN checked)";
    let (code, log) = lane(&["tests"], &[("FAKE_TESTS_OUT", out)]);
    assert_eq!(code, 0, "{log}");
}

#[test]
fn a_two_gpu_lane_requires_two_gpus_from_its_kind() {
    let (code, log) = lane(&["x2"], &[("FAKE_GPUS", "2")]);
    assert_eq!(code, 0, "{log}");
    assert!(log.contains("GPUs: 2 present, 2 required"), "{log}");
    // One GPU visible on the two-GPU kind: the lane fails, whatever the caller's environment says.
    let (code, log) = lane(&["tests", "x2-bench"], &[("FAKE_GPUS", "1"), ("KVPROBE_REQUIRE_GPUS", "1")]);
    assert_eq!(code, 1, "{log}");
    assert!(log.contains("FAIL: kvprobe env: 1 GPU(s), the lane requires 2"), "{log}");
    // One-GPU suites take the count from the caller (the host kind), not from nvidia-smi.
    let (code, log) = lane(&["final"], &[("FAKE_GPUS", "1"), ("KVPROBE_REQUIRE_GPUS", "2")]);
    assert_eq!(code, 1, "{log}");
    assert!(log.contains("the lane requires 2"), "{log}");
}

#[test]
fn every_suite_runs_to_its_end_and_names_are_checked() {
    // Each suite on stand-ins with two GPUs: every step runs and passes (a typo in a suite, a
    // step whose exit is checked wrongly, fails here), and each suite is announced in the log.
    let all = ["tests", "main", "inject", "mooncake", "sustained", "pair", "perf", "perf-ucx", "perf-procs", "x2", "x2-bench"];
    let (code, log) = lane(&all, &[("FAKE_GPUS", "2"), ("KVPROBE_MOONCAKE_VENV", "/nonexistent")]);
    assert_eq!(code, 0, "{log}");
    for s in all {
        assert!(log.contains(&format!("##### suite {s}\n")), "{s} not run: {log}");
    }
    // An unknown suite, or none, is refused (exit 2) before anything runs.
    for args in [&["mian"][..], &[][..]] {
        let (code, log) = lane(args, &[]);
        assert_eq!(code, 2, "{args:?}: {log}");
        assert!(log.contains("suites (one GPU unless marked x2"), "{args:?}: {log}");
    }
    // The bundle given by an absolute path; a suite named like a folder (`tests/` of the
    // repository) is a suite, not a bundle: with no bundle named, .carry is looked for.
    let (code, log) = lane_with(|d| Some(d.join("b").display().to_string()), &["main"], &[]);
    assert_eq!(code, 0, "{log}");
    let (code, log) = lane_with(
        |d| {
            std::fs::create_dir_all(d.join("tests")).unwrap();
            std::fs::rename(d.join("b"), d.join(".carry")).unwrap();
            None
        },
        &["tests"],
        &[],
    );
    assert_eq!(code, 0, "{log}");
    assert!(log.contains("##### suite tests"), "{log}");
    // `list` prints them and exits 0.
    let (code, log) = lane(&["list"], &[]);
    assert_eq!(code, 0, "{log}");
    assert!(log.contains("x2-bench") && log.contains("final"), "{log}");
}

#[test]
fn the_failure_bookkeeping_collects_every_failure_and_keeps_logging() {
    let d = tmpdir("lane-lib");
    let out = d.join("out");
    let body = format!(
        "set -uo pipefail\nsource '{}'\nexpect 0 0 fine\nexpect 1 0 'an injection run that found nothing'\n\
         echo 'exit 2' > \"$out/ab.txt\"\nexpect_file 0 \"$out/ab.txt\" ab\n: > \"$out/none.txt\"\nexpect_file 0 \"$out/none.txt\" gone\n\
         echo after >> \"$log\"\n",
        script("gpu-lane.sh").display()
    );
    let o = Command::new("bash").args(["-c", &body]).env("OUT", &out).env("KVPROBE_LANE_NO_SETUP", "1").output().unwrap();
    let log = std::fs::read_to_string(out.join("log.txt")).unwrap();
    assert_eq!(o.status.code(), Some(1), "{log}");
    assert!(log.contains("LANE FAILED: 3 failure(s)"), "{log}");
    assert!(log.contains("an injection run that found nothing exited 0 (must be 1)"), "{log}");
    assert!(log.contains("ab exited 2 (must be 0)") && log.contains("gone exited  (must be 0)"), "{log}");
    assert!(log.contains("after"), "a failure stopped the lane: {log}");
}

#[test]
fn gpu_tests_fail_instead_of_skipping_where_gpus_are_required() {
    let cuinit = || Err("cuInit failed (no usable GPU?): DriverError(CUDA_ERROR_NO_DEVICE)".to_string());
    // Nothing required: skip, with the reason.
    let skip = gpu_decision("t", cuinit(), 1, 0).unwrap().unwrap();
    assert!(skip.starts_with("SKIP t: ") && skip.contains("CUDA_ERROR_NO_DEVICE"), "{skip}");
    assert_eq!(
        gpu_decision("t", Ok(0), 1, 0).unwrap().unwrap(),
        "SKIP t: needs 1 CUDA GPU(s), 0 present (set KVPROBE_REQUIRE_GPUS=1 to fail instead)"
    );
    // Required: a cuInit failure is an error naming it, not "0 GPUs".
    let e = gpu_decision("t", cuinit(), 1, 1).unwrap_err();
    assert!(e.contains("requires 1 GPU(s)") && e.contains("cuInit failed") && e.contains("CUDA_ERROR_NO_DEVICE"), "{e}");
    assert!(gpu_decision("t", Ok(0), 1, 1).is_err());
    // Two needed: run with two, fail in a two-GPU lane with one, not run (no SKIP) in a one-GPU lane.
    assert_eq!(gpu_decision("t", Ok(2), 2, 2), Ok(None));
    assert!(gpu_decision("t", Ok(1), 2, 2).unwrap_err().contains("needs 2 CUDA GPU(s), 1 present"));
    let not_run = gpu_decision("t", Ok(1), 2, 1).unwrap().unwrap();
    assert!(not_run.starts_with("NOT RUN t: ") && !not_run.contains("SKIP"), "{not_run}");
    assert_eq!(gpu_decision("t", Ok(1), 1, 1), Ok(None));
}

#[test]
fn try_device_count_names_why_cuda_gives_no_count() {
    // Where CUDA cannot answer (no driver here, or every GPU hidden), the count is an error
    // that says why; device_count() keeps its 0 for the callers that only branch on it.
    let hidden = Command::new(crate::common::bin())
        .args(["env", "--json", "--no-probe"])
        .env("CUDA_VISIBLE_DEVICES", "-1")
        .output()
        .unwrap();
    let gpus = serde_json::from_slice::<serde_json::Value>(&hidden.stdout).unwrap()["gpus"].as_array().unwrap().len();
    assert_eq!(gpus, 0);
    if !kvprobe::cuda::driver_present() {
        let e = kvprobe::cuda::try_device_count().unwrap_err().to_string();
        assert!(e.contains("libcuda.so.1"), "{e}");
        assert_eq!(kvprobe::cuda::device_count(), 0);
    }
}
