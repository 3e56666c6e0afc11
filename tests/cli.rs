//! Bad input: a clear message, exit 2, no panic — and the report still written.

use crate::common::{kvprobe, kvprobe_env, read_report, tmpdir};

fn assert_usage(args: &[&str], needle: &str) {
    // An empty needle is in every message: it would check nothing (issue 13.15).
    assert!(!needle.is_empty(), "{args:?}: an empty needle checks nothing");
    let (code, out, err) = kvprobe(args);
    assert_eq!(code, 2, "{args:?}: stdout {out} stderr {err}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    let all = format!("{out}{err}");
    assert!(all.contains(needle), "{args:?}: expected {needle:?} in: {all}");
}

#[test]
fn bad_flags_exit_2_with_a_message() {
    assert_usage(&["run", "--memory", "dram", "--blocks", "0"], "--blocks must be at least 1");
    assert_usage(&["run", "--memory", "dram", "--inject", "bogus"], "unknown injection");
    assert_usage(&["run", "--memory", "dram", "--inject", "torn:0"], "at least 1");
    assert_usage(&["run", "--memory", "dram", "--inject", "drop:x"], "must be an integer from 1");
    assert_usage(&["run", "--memory", "dram", "--preset", "gpt5"], "invalid value");
    assert_usage(
        &["run", "--memory", "dram", "--head-size", "3", "--kv-heads", "1", "--block-size", "1", "--dtype", "fp8"],
        "multiple of 16",
    );
    assert_usage(&["run", "--memory", "dram", "--iterations", "0"], "--iterations must be at least 1");
    // Issue 13.7: a sweep's generations (1..=iterations) must never reach SKIP_GEN (u32::MAX)
    // nor the poison's 24 bits: the largest counts are refused before anything is set up.
    for n in ["16777215", "4294967294", "4294967295"] {
        assert_usage(&["run", "--memory", "dram", "--iterations", n], "--iterations must be below 16777215");
    }
    assert_eq!(kvprobe::sweep::MAX_ITERATIONS, 16_777_214);
    assert_usage(&["run", "--memory", "dram", "--timeout=-1"], "--timeout must be a positive");
    assert_usage(&["run", "--memory", "dram", "--timeout", "nan"], "--timeout must be a positive");
    assert_usage(&["run", "--memory", "dram", "--layers", "99999"], "65535");
    assert_usage(&["run", "--memory", "dram", "--mla", "--kv-heads", "4"], "--kv-heads must be 1");
    assert_usage(&["run", "--memory", "dram", "--blocks", "1", "--inject", "misroute"], "at least 2 blocks");
    assert_usage(&["run", "--memory", "dram", "--blocks", "1", "--layers", "1", "--inject", "drop:3"], "distinct block slices");
    assert_usage(&["run", "--memory", "hbm"], "invalid value");
    assert_usage(&["frobnicate"], "unrecognized subcommand");
}

#[test]
fn an_existing_mooncake_deployment_is_named_completely() {
    let run = ["run", "--memory", "dram", "--scenario", "stacked"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> { run.iter().chain(extra).copied().collect() };
    let meta = "http://10.0.0.5:8080/metadata";
    assert_usage(&with(&["--tier", "mooncake", "--mooncake-master", "10.0.0.5:50051"]), "--mooncake-metadata");
    assert_usage(&with(&["--tier", "mooncake", "--mooncake-metadata", meta]), "--mooncake-master");
    assert_usage(&with(&["--mooncake-master", "10.0.0.5:50051", "--mooncake-metadata", meta]), "need --tier mooncake");
    assert_usage(&with(&["--tier", "mooncake", "--mooncake-master", "10.0.0.5", "--mooncake-metadata", meta]), "HOST:PORT");
    assert_usage(&with(&["--tier", "mooncake", "--mooncake-master", "10.0.0.5:0", "--mooncake-metadata", meta]), "HOST:PORT");
    for bad in [
        "ftp://x/metadata",
        "redis://10.0.0.5:6379",
        "https://10.0.0.5:8080/metadata",
        "http://10.0.0.5/metadata",
        "http://h:99999/metadata",
        "http://10.0.0.5:8080",
        "http://10.0.0.5:8080/",
    ] {
        assert_usage(
            &with(&["--tier", "mooncake", "--mooncake-master", "10.0.0.5:50051", "--mooncake-metadata", bad]),
            "P2PHANDSHAKE",
        );
    }
    assert_usage(
        &[
            "run",
            "--memory",
            "dram",
            "--scenario",
            "nixl-only",
            "--tier",
            "mooncake",
            "--mooncake-master",
            "10.0.0.5:50051",
            "--mooncake-metadata",
            meta,
        ],
        "apply to tier-only and stacked",
    );
    assert_usage(
        &with(&["--tier", "mooncake", "--mooncake-master", "nonexistent.invalid:50051", "--mooncake-metadata", meta]),
        "\"nonexistent.invalid:50051\": the host does not resolve",
    );
    // Without --scenario these shape nothing.
    assert_usage(
        &["run", "--memory", "dram", "--mooncake-master", "10.0.0.5:50051", "--mooncake-metadata", meta],
        "shapes a request-level load",
    );
}

#[test]
fn a_pool_larger_than_memory_is_refused_before_allocating() {
    // Two 2 MiB-per-block pools of 4 000 000 blocks plus 512 bytes per slice (32 layers x K/V),
    // in binary units with the exact byte count, never a bare byte count.
    let need: u64 = 2 * 4_000_000 * (2 << 20) + 32 * 2 * 4_000_000 * 512;
    assert_eq!(need, 16_908_288_000_000);
    assert_usage(
        &["run", "--memory", "dram", "--preset", "llama3-8b", "--blocks", "4000000"],
        &format!("needs about 15.38 TiB ({need} bytes) of host memory"),
    );
    let (_, _, err) = kvprobe(&["run", "--memory", "dram", "--preset", "llama3-8b", "--blocks", "4000000"]);
    let avail = err.split("; ").nth(1).unwrap_or_else(|| panic!("{err}"));
    assert!(avail.contains("iB (") && avail.contains(" bytes) are available"), "{err}");
}

#[test]
fn duration_and_requests_together_are_refused() {
    // One of them decides when admission stops: both is ambiguous, so refused (run and ab).
    for cmd in ["run", "ab"] {
        let mut a = vec![cmd, "--memory", "dram"];
        if cmd == "run" {
            a.extend(["--scenario", "stacked"]);
        }
        a.extend(["--duration", "10min", "--requests", "5"]);
        let (code, out, err) = kvprobe(&a);
        assert_eq!(code, 2, "{a:?}: {out}{err}");
        assert!(err.contains("'--duration <DURATION>' cannot be used with '--requests <REQUESTS>'"), "{err}");
    }
}

#[test]
fn ab_explains_that_race_and_scenario_belong_to_run() {
    for (flag, value) in [("--race", "save-after-free"), ("--scenario", "stacked")] {
        let (code, out, err) = kvprobe(&["ab", "--memory", "dram", flag, value]);
        assert_eq!(code, 2, "{out}{err}");
        assert!(err.contains(&format!("{flag} is not an ab flag")) && err.contains(&format!("kvprobe run {flag}")), "{err}");
        assert!(!err.contains("--backend"), "no unrelated suggestion: {err}");
    }
}

#[test]
fn report_dash_writes_the_json_to_stdout_and_the_summary_to_stderr() {
    let d = tmpdir("report-stdout");
    let o = std::process::Command::new(crate::common::bin())
        .args(["run", "--memory", "dram", "--iterations", "2", "--report", "-"])
        .current_dir(&d)
        .output()
        .unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "{out}{err}");
    let r: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("stdout is not only JSON ({e}): {out}"));
    assert_eq!(r["schema"], "kvprobe.report/1");
    assert_eq!(r["summary"]["iterations"], 2);
    assert_eq!(r["outcome"]["status"], "clean");
    assert!(err.contains("result:            clean (exit 0)"), "the human summary goes to stderr: {err}");
    assert!(!d.join("-").exists(), "no file named -");
    // A usage error still leaves its report, on stdout too.
    let o = std::process::Command::new(crate::common::bin())
        .args(["run", "--memory", "dram", "--lockstep", "--report", "-"])
        .current_dir(&d)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["outcome"]["exit_code"], 2);
    assert!(!d.join("-").exists());
}

#[test]
fn help_lists_the_exit_codes_and_readme_agrees_on_the_interrupt_grace() {
    // README and --help state the grace a transfer in flight gets after a signal; the code
    // uses kvprobe::interrupt::GRACE.
    let grace = kvprobe::interrupt::GRACE.as_secs();
    let readme = include_str!("../README.md");
    let row = readme.lines().find(|l| l.starts_with("| 130 |")).unwrap();
    assert!(row.contains(&format!("a transfer in flight gets up to {grace} s after the signal")), "{row}");
    assert!(!row.contains("the iteration in flight completes"), "{row}");
    let (_, help, _) = kvprobe(&["run", "--help"]);
    assert!(help.contains(&format!("in flight gets up to {grace} s after the signal")), "{help}");
    let (code, out, _) = kvprobe(&["run", "--help"]);
    assert_eq!(code, 0);
    for line in [
        "0  clean",
        "1  corruption found",
        "2  usage",
        "3  transport",
        "4  a transfer did not complete",
        "5  transfer rate below",
    ] {
        assert!(out.contains(line), "missing {line:?} in help");
    }
}

#[test]
fn missing_nixl_exits_2_with_install_hint_and_a_report() {
    let d = tmpdir("no-nixl");
    let report = d.join("r.json");
    let home = d.join("home");
    let (code, _, err) = kvprobe_env(
        &["run", "--memory", "dram", "--report", report.to_str().unwrap()],
        &[("KVPROBE_NIXL_DIR", d.to_str().unwrap()), ("KVPROBE_HOME", home.to_str().unwrap())],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("libnixl_capi.so not found") && err.contains("install-deps.sh"), "{err}");
    let r = read_report(&report);
    assert_eq!(r["schema"], "kvprobe.report/1");
    assert_eq!(r["outcome"]["exit_code"], 2);
    assert_eq!(r["outcome"]["error"]["kind"], "environment");
    assert_eq!(r["environment"]["nixl"]["library"], serde_json::Value::Null);
}

#[test]
fn vram_without_a_gpu_exits_2() {
    // Runs on GPU hosts too (no SKIP there): CUDA_VISIBLE_DEVICES=-1 hides every GPU.
    let (code, out, err) = crate::common::kvprobe_env(&["run", "--memory", "vram"], &[("CUDA_VISIBLE_DEVICES", "-1")]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("--memory vram needs a CUDA GPU and none was found"), "{err}");
}

#[test]
fn unwritable_report_path_exits_2() {
    let (code, _, err) = kvprobe(&["run", "--memory", "dram", "--iterations", "1", "--report", "/nonexistent-dir/r.json"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("/nonexistent-dir/r.json"), "{err}");
}

#[test]
fn ci_runs_the_readme_test_command() {
    let readme = include_str!("../README.md");
    let ci = include_str!("../.ci/run");
    let cmd = "scripts/install-deps.sh && cargo test";
    assert!(readme.contains(&format!("```sh\n{cmd}\n```")), "README lost its test command");
    assert!(ci.lines().any(|l| l.trim() == cmd), ".ci/run does not run the README's test command");
}

#[test]
fn a_pinned_nixl_dir_is_never_silently_replaced() {
    // The install dir has NIXL (the test command installs it); a wrong pin must still fail.
    let d = tmpdir("pinned");
    let (code, _, err) = kvprobe_env(&["run", "--memory", "dram"], &[("KVPROBE_NIXL_DIR", d.to_str().unwrap())]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains(&format!("{} (KVPROBE_NIXL_DIR)", d.display())), "{err}");
}

#[test]
fn an_unwritable_report_is_refused_before_the_run() {
    let d = tmpdir("report-dir");
    let (code, out, err) = kvprobe(&["run", "--memory", "dram", "--report", d.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("is a directory"), "{err}");
    assert!(!out.contains("block slices") && !err.contains("iteration 1"), "the run started: {out}{err}");
}

#[test]
fn seeds_parse_as_decimal_or_hex() {
    let d = tmpdir("seed");
    let p = d.join("r.json");
    let (code, _, err) =
        kvprobe(&["run", "--memory", "dram", "--iterations", "1", "--seed", "0xff", "--report", p.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(read_report(&p)["config"]["seed"], 255);
    assert_usage(&["run", "--memory", "dram", "--seed", "0xzz"], "not a 64-bit seed");
}

#[test]
fn special_files_are_never_replaced_by_a_report() {
    let d = tmpdir("fifo");
    let fifo = d.join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo on a path in our own temporary directory.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let (code, _, err) = kvprobe(&["run", "--memory", "dram", "--iterations", "1", "--report", fifo.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not a regular file"), "{err}");
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(), "the FIFO was replaced");
}

#[test]
fn a_symlinked_report_path_writes_the_target() {
    let d = tmpdir("symlink");
    let target = d.join("real.json");
    std::fs::write(&target, "old").unwrap();
    let link = d.join("link.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let (code, _, err) = kvprobe(&["run", "--memory", "dram", "--iterations", "1", "--report", link.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link was replaced");
    assert_eq!(read_report(&target)["schema"], "kvprobe.report/1");
}

#[test]
fn odd_environment_and_extreme_values_do_not_panic() {
    use std::os::unix::ffi::OsStrExt;
    let bad = std::ffi::OsStr::from_bytes(b"\xff\xfe");
    let o = std::process::Command::new(crate::common::bin()).args(["env"]).env("UCX_ODD", bad).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    assert_usage(&["run", "--memory", "dram", "--timeout", "1e20"], "at most 1e9 seconds");
    assert_usage(&["run", "--memory", "dram", "--layers", "2", "--blocks", "3", "--mla", "--inject", "misroute:3"], "room for 2");
    // Would need 10^10 slices of bookkeeping: refused before allocating anything.
    assert_usage(
        &[
            "run",
            "--memory",
            "vram",
            "--layers",
            "65535",
            "--blocks",
            "65535",
            "--kv-heads",
            "1",
            "--head-size",
            "16",
            "--block-size",
            "1",
        ],
        "geometry too large: number of block slices (2^32 - 1 at most) overflows",
    );
    let (_, out, err) = kvprobe(&[
        "run",
        "--memory",
        "dram",
        "--layers",
        "65535",
        "--blocks",
        "65535",
        "--kv-heads",
        "1",
        "--head-size",
        "16",
        "--block-size",
        "1",
    ]);
    assert!(!format!("{out}{err}").contains("allocating"), "refused only after allocating: {out}{err}");
}

#[test]
fn a_closed_stdout_costs_neither_the_report_nor_the_exit_code() {
    let d = tmpdir("pipe");
    let p = d.join("r.json");
    let mut child = std::process::Command::new(crate::common::bin())
        .args(["run", "--memory", "dram", "--iterations", "3", "--inject", "drop", "--report", p.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    drop(child.stderr.take());
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(1), "corruption must still exit 1");
    assert_eq!(read_report(&p)["outcome"]["status"], "corrupt");
}

#[test]
fn report_paths_that_cannot_name_a_file_are_refused_up_front() {
    let d = tmpdir("names");
    let slash = format!("{}/new.json/", d.display());
    assert_usage(&["run", "--memory", "dram", "--report", &slash], "trailing /");
    let long = format!("{}/{}.json", d.display(), "x".repeat(300));
    assert_usage(&["run", "--memory", "dram", "--report", &long], "longer than 255");
}

/// `--report -` / `--json -` where stdout is closed (the Rust runtime reopens it on /dev/null)
/// or /dev/null would lose the JSON: refused up front like `--report /dev/null`; and
/// UCX_LOG_FILE=stdout would mix UCX's log into it.
#[test]
fn json_to_a_stdout_that_cannot_take_it_is_refused() {
    use std::process::{Command, Stdio};
    let closed = |args: &[&str], env: &[(&str, &str)], stdout: Stdio| {
        let mut c = Command::new(crate::common::bin());
        c.args(args).stdout(stdout).stderr(Stdio::piped());
        for (k, v) in env {
            c.env(k, v);
        }
        // SAFETY: runs in the forked child before exec; close(2) is async-signal-safe.
        if env.iter().any(|(k, _)| *k == "CLOSE_STDOUT") {
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut c, || {
                    libc::close(1);
                    Ok(())
                });
            }
        }
        let o = c.output().unwrap();
        (o.status.code(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let run = ["run", "--memory", "dram", "--iterations", "1", "--report", "-"];
    let bench = ["bench", "--memory", "dram", "--host-bytes", "1MiB", "--sweep-bytes", "4MiB", "--repeats", "1", "--json", "-"];
    for (args, flag) in [(&run[..], "--report"), (&bench[..], "--json")] {
        let (code, err) = closed(args, &[("CLOSE_STDOUT", "1")], Stdio::inherit());
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains(&format!("{flag} - writes the JSON to stdout, but stdout is closed or /dev/null")), "{err}");
        let (code, err) = closed(args, &[], Stdio::null());
        assert_eq!(code, Some(2), "{err}");
    }
    let (code, err) = closed(&run, &[("UCX_LOG_FILE", "stdout")], Stdio::piped());
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("UCX_LOG_FILE=stdout would mix UCX's log into it"), "{err}");
    // A pipe takes it.
    let (code, err) = closed(&run, &[], Stdio::piped());
    assert_eq!(code, Some(0), "{err}");
}

/// On a host without a GPU, `run --memory vram --decode-process` exits 2 as `run --memory vram`
/// does: its prefill child refuses the GPU it was asked for (exit 2, its reason on stderr), and
/// the run says so instead of calling the child's early exit a transport error (3). Only
/// meaningful without a GPU; on a GPU host the run would simply start.
#[test]
fn decode_process_on_vram_without_a_gpu_exits_2() {
    if kvprobe::cuda::device_count() > 0 {
        return;
    }
    let (code, out, err) = kvprobe(&["run", "--memory", "vram", "--decode-process", "--blocks", "2", "--iterations", "1"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("this host has 0 CUDA GPU(s)") && err.contains("refused to start (exit 2"), "{err}");
}

#[test]
fn a_gpu_flag_with_dram_pools_is_refused_even_when_it_names_the_default_gpu() {
    for cmd in ["run", "ab"] {
        for flag in ["--prefill-device", "--decode-device"] {
            let (code, _, err) = kvprobe(&[cmd, "--memory", "dram", flag, "0", "--layers", "1", "--blocks", "4"]);
            assert_eq!(code, 2, "{cmd} {flag} 0: {err}");
            assert!(err.contains(&format!("{flag} applies to --memory vram only")), "{cmd} {flag}: {err}");
        }
    }
    // serve and bench: their --device, typed with DRAM, refused before listening or timing.
    let (code, out, err) = kvprobe(&["serve", "--memory", "dram", "--device", "0", "--listen", "127.0.0.1:0"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("--device applies to --memory vram only"), "{err}");
    assert!(!out.contains("listening"), "{out}");
    let (code, out, err) = kvprobe(&["bench", "--memory", "dram", "--device", "0", "--host-bytes", "1MiB"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("--device and --decode-device apply to --memory vram only"), "{err}");
}

#[test]
fn the_summary_points_to_where_the_full_list_of_failures_is() {
    // 8 dropped block slices: more than the summary's five.
    let args = ["run", "--memory", "dram", "--layers", "1", "--blocks", "16", "--iterations", "1", "--inject", "drop:8"];
    let (code, out, err) = kvprobe(&args);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("more corrupt slices; --report FILE would list 8"), "{out}");
    let dir = tmpdir("summary-points");
    let path = dir.join("r.json");
    let mut with = args.to_vec();
    with.extend(["--report", path.to_str().unwrap()]);
    let (code, out, err) = kvprobe(&with);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains(&format!("the JSON report ({}) lists 8", path.display())), "{out}");
    let bundle = dir.join("b.tar.gz");
    let mut with = args.to_vec();
    with.extend(["--bundle", bundle.to_str().unwrap()]);
    let (code, out, err) = kvprobe(&with);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains(&format!("the JSON report (report.json in {}) lists 8", bundle.display())), "{out}");
}

/// GitHub's anchor of a Markdown heading: lower case, punctuation but `-` and `_` dropped,
/// spaces as `-`.
fn heading_anchor(h: &str) -> String {
    h.trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .collect::<String>()
        .replace(' ', "-")
}

#[test]
fn the_readme_is_short_and_every_link_of_the_docs_resolves() {
    // Issue 34 item 7: a README a newcomer reads in five minutes, the rest in docs/; each link
    // between them names a file that exists and, after `#`, one of its headings.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    assert!(readme.lines().count() <= 250, "README.md has {} lines", readme.lines().count());
    let mut pages = vec![root.join("README.md")];
    for e in std::fs::read_dir(root.join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            pages.push(p);
        }
    }
    assert!(pages.len() >= 8, "{pages:?}");
    let anchors = |p: &std::path::Path| -> Vec<String> {
        let mut fence = false;
        let mut v = Vec::new();
        for l in std::fs::read_to_string(p).unwrap().lines() {
            if l.starts_with("```") {
                fence = !fence;
            } else if !fence && l.starts_with('#') {
                v.push(heading_anchor(l.trim_start_matches('#')));
            }
        }
        v
    };
    let link = regex::Regex::new(r"\]\(([^)\s]+)\)").unwrap();
    let mut checked = 0;
    // Each page stands alone: a section of another page is a link, never a name in quotes
    // (`see "Report format"`) a reader must hunt for.
    let quoted = regex::Regex::new(r#"see "[A-Z]"#).unwrap();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        assert!(!quoted.is_match(&text), "{}: a section named in quotes, not linked", page.display());
        for c in link.captures_iter(&text) {
            let target = &c[1];
            if target.starts_with("http") {
                continue;
            }
            let (file, anchor) = target.split_once('#').map_or((target, None), |(f, a)| (f, Some(a)));
            let dest = if file.is_empty() { page.clone() } else { page.parent().unwrap().join(file) };
            assert!(dest.exists(), "{}: link {target}: no file {}", page.display(), dest.display());
            if let Some(a) = anchor {
                assert!(anchors(&dest).iter().any(|x| x == a), "{}: link {target}: no such heading", page.display());
            }
            checked += 1;
        }
    }
    assert!(checked >= 40, "only {checked} links");
}

#[test]
fn every_subcommands_help_points_into_the_docs_that_exist() {
    // Issue 34 item 7: `--help` texts point into docs/.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = regex::Regex::new(r"docs/[a-z-]+\.md").unwrap();
    let subs: [&[&str]; 10] = [
        &["run"],
        &["ab"],
        &["bench"],
        &["serve"],
        &["geometry"],
        &["env"],
        &["bundle"],
        &["report", "show"],
        &["report", "check"],
        &["report", "diff"],
    ];
    for sub in subs {
        let (code, out, err) = kvprobe(&[sub, &["--help"]].concat());
        assert_eq!(code, 0, "{sub:?}: {err}");
        let at = out.find("Reference: docs/").unwrap_or_else(|| panic!("{sub:?} --help names no docs page:\n{out}"));
        let pages: Vec<&str> = page.find_iter(&out[at..]).map(|m| m.as_str()).collect();
        assert!(!pages.is_empty());
        for p in pages {
            assert!(root.join(p).is_file(), "{sub:?} --help names {p}, which does not exist");
        }
    }
}
