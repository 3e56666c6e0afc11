//! Mooncake Store parts: the installation is found and reported, and the master kvprobe
//! starts answers on its ports, is seen dying, and leaves no process behind. Needs
//! scripts/install-mooncake.sh (run by scripts/install-deps.sh).

use crate::common::kvprobe_env;
use kvprobe::mooncake::{self, Master};
use std::time::Duration;

/// Mooncake tests run everywhere the set-up commands ran (CI included); a lane without the
/// install (the GPU host's carried bundle) sets KVPROBE_SKIP_MOONCAKE to its reason.
fn mooncake_or_skip(test: &str) -> bool {
    match std::env::var("KVPROBE_SKIP_MOONCAKE") {
        Ok(why) if !why.is_empty() => {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "SKIP {test}: {why} (KVPROBE_SKIP_MOONCAKE)");
            false
        }
        _ => true,
    }
}

fn running(pid: u32) -> bool {
    // A reaped child has no /proc entry; a zombie would show state Z.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.split_whitespace().nth(2).is_none_or(|st| st != "Z"))
}

#[test]
fn env_reports_the_mooncake_install() {
    if !mooncake_or_skip("env_reports_the_mooncake_install") {
        return;
    }
    let (code, out, err) = kvprobe_env(&["env", "--json"], &[]);
    assert_eq!(code, 0, "{err}");
    let e: serde_json::Value = serde_json::from_str(&out).unwrap();
    let m = &e["mooncake"]["install"];
    assert!(m["wheel"].as_str().unwrap().starts_with("mooncake_transfer_engine"), "{e}");
    assert!(m["version"].as_str().unwrap().starts_with("0.3."), "{e}");
    assert!(std::path::Path::new(m["master"].as_str().unwrap()).is_file());
    let (_, text, _) = kvprobe_env(&["env"], &[]);
    assert!(text.contains("Mooncake: mooncake_transfer_engine"), "{text}");
}

#[test]
fn env_says_why_mooncake_is_missing() {
    if !mooncake_or_skip("env_says_why_mooncake_is_missing") {
        return;
    }
    let (_, out, _) = kvprobe_env(&["env", "--json"], &[("KVPROBE_MOONCAKE_VENV", "/nonexistent/venv")]);
    let e: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(e["mooncake"]["install"].is_null());
    let why = e["mooncake"]["error"].as_str().unwrap();
    assert!(why.contains("no virtual environment at /nonexistent/venv") && why.contains("install-mooncake.sh"), "{why}");
}

#[test]
fn master_starts_answers_and_is_always_stopped() {
    if !mooncake_or_skip("master_starts_answers_and_is_always_stopped") {
        return;
    }
    let install = mooncake::find().expect("Mooncake installed by scripts/install-deps.sh");
    let mut m = Master::start(&install, Duration::from_secs(30)).unwrap();
    let pid = m.pid();
    assert!(running(pid));
    m.alive().unwrap();
    assert!(std::net::TcpStream::connect(m.rpc).is_ok());
    assert!(m.metadata_url.starts_with("http://127.0.0.1:") && m.metadata_url.ends_with("/metadata"));
    drop(m);
    assert!(!running(pid), "the master outlived its handle");
}

#[test]
fn a_killed_master_is_a_transport_error_with_its_log() {
    if !mooncake_or_skip("a_killed_master_is_a_transport_error_with_its_log") {
        return;
    }
    let install = mooncake::find().expect("Mooncake installed by scripts/install-deps.sh");
    let mut m = Master::start(&install, Duration::from_secs(30)).unwrap();
    let pid = m.pid();
    let st = std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status().unwrap();
    assert!(st.success());
    let t0 = std::time::Instant::now();
    let e = loop {
        match m.alive() {
            Err(e) => break e,
            Ok(()) => {
                assert!(t0.elapsed() < Duration::from_secs(10), "death not seen");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    assert_eq!(e.exit() as u8, 3, "{e}");
    assert!(e.to_string().contains("mooncake_master exited"), "{e}");
    assert!(e.to_string().contains("log ends"), "{e}");
    drop(m);
    assert!(!running(pid));
}
