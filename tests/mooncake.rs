//! Mooncake Store parts: the installation is found and reported, and the master kvprobe
//! starts answers on its ports, is seen dying, and leaves no process behind. Needs
//! scripts/install-mooncake.sh (run by scripts/install-deps.sh).

use crate::common::{kvprobe_env, mooncake_or_skip};
use kvprobe::mooncake::{self, Master};
use std::time::Duration;

/// Where the masters of these tests listen.
const LOOPBACK: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

fn running(pid: u32) -> bool {
    // A reaped child has no /proc entry; a zombie would show state Z.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.split_whitespace().nth(2).is_none_or(|st| st != "Z"))
}

/// How many descriptors process `pid` holds on kvprobe's shareable pools (`memfd:kvprobe-pool`).
fn pool_memfds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|t| t.to_string_lossy().starts_with("/memfd:kvprobe-pool"))
        .count()
}

/// The socket inodes process `pid` holds (`socket:[N]` links in /proc/PID/fd).
fn socket_inodes(pid: u32) -> std::collections::BTreeSet<u64> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|t| t.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok())
        .collect()
}

/// The IPv4 and IPv6 listening addresses of process `pid`, read here from
/// /proc/PID/net/tcp{,6} (not with kvprobe's reader): "a.b.c.d:port" or "[hex words]:port".
fn listeners(pid: u32) -> Vec<String> {
    let own = socket_inodes(pid);
    let mut out = Vec::new();
    for (table, v6) in [("tcp", false), ("tcp6", true)] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else { continue };
        for l in text.lines().skip(1) {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f[3] != "0A" || !own.contains(&f[9].parse().unwrap()) {
                continue;
            }
            let (addr, port) = f[1].split_once(':').unwrap();
            let port = u16::from_str_radix(port, 16).unwrap();
            if v6 {
                out.push(format!("[{addr}]:{port}"));
            } else {
                // One 32-bit word in host byte order (x86 and arm64 Linux: little-endian).
                let b = u32::from_str_radix(addr, 16).unwrap().to_le_bytes();
                out.push(format!("{}.{}.{}.{}:{port}", b[0], b[1], b[2], b[3]));
            }
        }
    }
    out
}

#[test]
fn the_master_listens_on_loopback_only() {
    if !mooncake_or_skip("the_master_listens_on_loopback_only") {
        return;
    }
    let install = mooncake::find().expect("Mooncake installed by scripts/install-deps.sh");
    let m = Master::start(&install, Duration::from_secs(300), LOOPBACK).unwrap();
    let l = listeners(m.pid());
    // Its RPC and metrics ports, and no metadata server on 0.0.0.0 (Mooncake 0.3.13 binds
    // its embedded one to all interfaces whatever it is asked).
    assert!(l.len() >= 2, "{l:?}");
    assert!(l.iter().all(|a| a.starts_with("127.0.0.1:")), "mooncake_master listens on {l:?}");
    assert!(l.contains(&format!("127.0.0.1:{}", m.rpc.port())), "{l:?}");
    // kvprobe's own reader agrees.
    let mine = kvprobe::mooncake::check_listening("mooncake_master", m.pid(), LOOPBACK).unwrap();
    assert_eq!(mine.len(), l.len(), "{mine:?} vs {l:?}");
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
    // A shareable pool alive when the master starts: the master does not inherit its memfd.
    let pool = kvprobe::hostmem::HostBuffer::alloc_shareable(1 << 16).unwrap();
    let mut m = Master::start(&install, Duration::from_secs(300), LOOPBACK).unwrap();
    let pid = m.pid();
    assert!(running(pid));
    assert_eq!(pool_memfds(pid), 0, "mooncake_master inherited a pool's memfd");
    drop(pool);
    m.alive().unwrap();
    assert!(std::net::TcpStream::connect(m.rpc).is_ok());
    assert_eq!(m.metadata_url, "P2PHANDSHAKE", "the store clients exchange metadata peer to peer: no metadata server");
    drop(m);
    assert!(!running(pid), "the master outlived its handle");
}

#[test]
fn a_killed_master_is_a_transport_error_with_its_log() {
    if !mooncake_or_skip("a_killed_master_is_a_transport_error_with_its_log") {
        return;
    }
    let install = mooncake::find().expect("Mooncake installed by scripts/install-deps.sh");
    let mut m = Master::start(&install, Duration::from_secs(300), LOOPBACK).unwrap();
    let pid = m.pid();
    let st = std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status().unwrap();
    assert!(st.success());
    let t0 = std::time::Instant::now();
    let e = loop {
        match m.alive() {
            Err(e) => break e,
            Ok(()) => {
                assert!(t0.elapsed() < Duration::from_secs(300), "death not seen");
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

#[test]
fn worker_moves_blocks_between_a_shared_pool_and_the_store() {
    if !mooncake_or_skip("worker_moves_blocks_between_a_shared_pool_and_the_store") {
        return;
    }
    use kvprobe::fingerprint::{self, BlockIdentity};
    use kvprobe::geometry::KvPart;
    let install = mooncake::find().expect("Mooncake installed by scripts/install-deps.sh");
    let master = mooncake::Deployment::Started(Master::start(&install, Duration::from_secs(300), LOOPBACK).unwrap());
    // The worker inherits the memfd of the pool passed to it, and of no other buffer (the
    // memfds are close-on-exec: `other`, alive when the worker starts, is not inherited).
    let mut pool = kvprobe::hostmem::HostBuffer::alloc_shareable(1 << 20).unwrap();
    let other = kvprobe::hostmem::HostBuffer::alloc_shareable(4096).unwrap();
    let mut w = mooncake::Worker::start(&install, Duration::from_secs(300), &[&pool]).unwrap();
    assert_eq!(pool_memfds(w.pid()), 1, "the worker holds exactly the pool's memfd");
    w.setup(&master, "tcp", 64 << 20).unwrap();
    // Its Transfer Engine's handshake and TCP-transport ports listen on loopback only, as
    // setup's local_hostname asks (Mooncake alone binds them to 0.0.0.0 and [::]; kvprobe's
    // bind shim narrows them).
    let l = listeners(w.pid());
    assert!(l.len() >= 2, "{l:?}");
    assert!(
        l.iter().all(|a| a.starts_with("127.0.0.1:") || a.starts_with("[0000000000000000FFFF00000100007F]:")),
        "the store client listens on {l:?}"
    );
    let e = w.map_shared(&other).unwrap_err();
    assert!(e.to_string().contains("not passed to the Mooncake worker"), "{e}");
    w.map_shared(&pool).unwrap();
    // A "block" of two slices that are not adjacent in the pool, as a block's K and V are.
    let sb = 4096usize;
    // One K or V slice of 4 tokens × 4 heads × 256-byte rows.
    let shape =
        fingerprint::RowShape { order: fingerprint::RowOrder::Nhd, block_size: 4, heads: 4, head_base: 0, row_bytes: 256 };
    let id = |kv| shape.slice(BlockIdentity::new(0, kv, 77, 3));
    fingerprint::fill_span(&mut pool.span_mut(0, sb).unwrap(), 9, &id(KvPart::K));
    fingerprint::fill_span(&mut pool.span_mut(65536, sb).unwrap(), 9, &id(KvPart::V));
    let key = mooncake::block_key("test", 77, 3);
    assert_eq!(key, "kvprobe/test/0000004d/3");
    assert_eq!(w.exists(std::slice::from_ref(&key)).unwrap(), vec![0]);
    let src = vec![(0u64, sb as u64), (65536, sb as u64)];
    assert_eq!(w.put(0, std::slice::from_ref(&key), std::slice::from_ref(&src)).unwrap(), vec![0]);
    assert_eq!(w.exists(std::slice::from_ref(&key)).unwrap(), vec![1]);
    // Load it into two other places of the pool: the bytes arrive intact.
    let dst = vec![(131072u64, sb as u64), (262144, sb as u64)];
    let got = w.get(0, std::slice::from_ref(&key), std::slice::from_ref(&dst)).unwrap();
    assert_eq!(got, vec![2 * sb as i64], "bytes read");
    assert_eq!(fingerprint::check_span(pool.span(131072, sb).unwrap(), 9, &id(KvPart::K)).0, 0);
    assert_eq!(fingerprint::check_span(pool.span(262144, sb).unwrap(), 9, &id(KvPart::V)).0, 0);
    // A missing key is an error code, not bytes.
    let missing = mooncake::block_key("test", 78, 1);
    assert!(w.get(0, std::slice::from_ref(&missing), std::slice::from_ref(&dst)).unwrap()[0] < 0);
    // Ranges outside the pool are refused by the worker, which stays usable.
    let e = w.put(0, std::slice::from_ref(&key), &[vec![(1 << 20, 16)]]).unwrap_err();
    assert!(e.to_string().contains("outside"), "{e}");
    assert_eq!(w.exists(std::slice::from_ref(&key)).unwrap(), vec![1]);
    let pid = w.pid();
    drop(w);
    assert!(!running(pid), "the worker outlived its handle");
}

#[test]
fn a_killed_worker_is_a_transport_error() {
    if !mooncake_or_skip("a_killed_worker_is_a_transport_error") {
        return;
    }
    let install = mooncake::find().expect("Mooncake installed by scripts/install-deps.sh");
    let mut w = mooncake::Worker::start(&install, Duration::from_secs(300), &[]).unwrap();
    let pid = w.pid();
    assert!(std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status().unwrap().success());
    while running(pid) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let e = w.exists(&["k".to_string()]).unwrap_err();
    assert_eq!(e.exit() as u8, 3, "{e}");
    assert!(e.to_string().contains("Mooncake worker"), "{e}");
    drop(w);
    assert!(!running(pid));
}

/// Starts a 60 s `--tier mooncake` run (report at `report`, if any) and waits until kvprobe
/// has started the master and the worker: (kvprobe, master pid, worker pid). The caller
/// waits for kvprobe.
#[allow(clippy::zombie_processes)]
fn run_with_helpers(report: Option<&std::path::Path>, tmp: &std::path::Path) -> (std::process::Child, u32, u32) {
    let mut cmd = std::process::Command::new(crate::common::bin());
    cmd.env("TMPDIR", tmp);
    cmd.args(["run", "--memory", "dram", "--scenario", "stacked", "--tier", "mooncake", "--duration", "60s"]);
    if let Some(p) = report {
        // A checkpoint soon after the first step tells the caller the run is under way.
        cmd.arg("--report").arg(p).args(["--checkpoint", "200ms"]);
    }
    let mut child = cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let t0 = std::time::Instant::now();
    loop {
        let kids = crate::common::children(child.id());
        let m = kids.iter().copied().find(|k| crate::common::cmdline(*k).contains("mooncake_master"));
        let w = kids.iter().copied().find(|k| crate::common::cmdline(*k).contains("kvprobe-mooncake-worker"));
        if let (Some(m), Some(w)) = (m, w) {
            return (child, m, w);
        }
        if t0.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("master and worker not started");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn scenarios_run_on_the_real_mooncake_store() {
    if !mooncake_or_skip("scenarios_run_on_the_real_mooncake_store") {
        return;
    }
    for sc in ["stacked", "tier-only"] {
        let (code, r, log) = crate::common::run_with_report(
            sc,
            "dram",
            &["--scenario", sc, "--tier", "mooncake", "--requests", "400", "--seed", "3"],
        );
        assert_eq!(code, 0, "{sc}: {log}");
        assert_eq!(r["summary"]["blocks_corrupt"], 0);
        let s = &r["scenario"];
        assert_eq!(s["tier"], "mooncake");
        let detail = s["tier_detail"].as_str().unwrap();
        assert!(
            detail.contains("mooncake_transfer_engine") && detail.contains("tcp") && detail.contains("master 127.0.0.1:"),
            "{detail}"
        );
        assert!(s["tier_saves"].as_u64().unwrap() > 100 && s["tier_hit_blocks"].as_u64().unwrap() > 10, "{s}");
        assert!(r["environment"]["mooncake"]["install"]["version"].is_string());
    }
    let (code, r, log) = crate::common::run_with_report(
        "mc-race",
        "dram",
        &["--race", "save-before-write", "--tier", "mooncake", "--requests", "400", "--lockstep"],
    );
    assert_eq!(code, 1, "{log}");
    assert_eq!(r["scenario"]["unexplained_corrupt"], 0, "{log}");
    let o = r["scenario"]["races"].as_array().unwrap().iter().find(|o| o["mechanism"] == "save-before-write").unwrap().clone();
    assert_eq!(o["verdict"], "detected", "{o}");
}

#[test]
fn a_master_killed_mid_run_is_exit_3_and_nothing_is_left_running() {
    if !mooncake_or_skip("a_master_killed_mid_run_is_exit_3_and_nothing_is_left_running") {
        return;
    }
    let d = crate::common::tmpdir("mc-kill");
    let p = d.join("r.json");
    let (child, master, worker) = run_with_helpers(Some(&p), &d);
    // Mid-run: the first checkpoint is written (no fixed sleep: set-up is slower under load).
    while !p.exists() {
        std::thread::sleep(Duration::from_millis(20));
    }
    // Both run now; the pools were allocated before either started: only the worker, which
    // maps them, holds their memfds.
    assert_eq!(pool_memfds(master), 0, "mooncake_master inherited a pool's memfd");
    assert!(pool_memfds(worker) >= 2, "the worker holds both pools' memfds: {}", pool_memfds(worker));
    // Nor any of kvprobe's sockets (UCX opens them without close-on-exec): a socket held by
    // kvprobe and a helper alike is one the helper inherited.
    let ours = socket_inodes(child.id());
    assert!(!ours.is_empty(), "kvprobe holds no socket mid-run?");
    for (who, pid) in [("mooncake_master", master), ("the worker", worker)] {
        let shared: Vec<u64> = socket_inodes(pid).intersection(&ours).copied().collect();
        assert!(shared.is_empty(), "{who} inherited kvprobe's sockets {shared:?}");
    }
    // The master listens on loopback only, as asked.
    let l = listeners(master);
    assert!(!l.is_empty() && l.iter().all(|a| a.starts_with("127.0.0.1:")), "mooncake_master listens on {l:?}");
    assert!(std::process::Command::new("kill").args(["-KILL", &master.to_string()]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    let r = crate::common::read_report(&p);
    assert_eq!(r["outcome"]["error"]["kind"], "transport");
    let msg = r["outcome"]["error"]["message"].as_str().unwrap();
    assert!(msg.contains("mooncake_master exited") && msg.contains("log ends"), "{msg}");
    assert!(!running(master) && !running(worker), "orphans: master {master} worker {worker}");
}

#[test]
fn a_kvprobe_killed_hard_takes_its_master_and_worker_along() {
    if !mooncake_or_skip("a_kvprobe_killed_hard_takes_its_master_and_worker_along") {
        return;
    }
    let tmp = crate::common::tmpdir("mc-killed-hard");
    let (mut child, master, worker) = run_with_helpers(None, &tmp);
    let pid = child.id();
    child.kill().unwrap(); // SIGKILL: no destructor of kvprobe runs
    child.wait().unwrap();
    // Its private directories go at the next kvprobe's start (here: `env`).
    let (code, _, err) = kvprobe_env(&["env", "--json", "--no-probe"], &[("TMPDIR", tmp.to_str().unwrap())]);
    assert_eq!(code, 0, "{err}");
    let mine = format!("kvprobe-{pid}.");
    for root in [tmp.as_path(), std::path::Path::new("/dev/shm")] {
        let left: Vec<String> = std::fs::read_dir(root)
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        assert!(!left.iter().any(|n| n.starts_with(&mine)), "left in {}: {left:?}", root.display());
    }
    let t0 = std::time::Instant::now();
    while running(master) || running(worker) {
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "left running: master {master} {}, worker {worker} {}",
            running(master),
            running(worker)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_broken_mooncake_install_is_a_set_up_error() {
    if !mooncake_or_skip("a_broken_mooncake_install_is_a_set_up_error") {
        return;
    }
    // A venv whose package directory exists but holds no store client.
    let d = crate::common::tmpdir("broken-venv");
    let site = d.join("lib/python3/site-packages");
    std::fs::create_dir_all(site.join("mooncake")).unwrap();
    std::fs::create_dir_all(site.join("mooncake_transfer_engine_non_cuda-0.0.0.dist-info")).unwrap();
    std::fs::write(site.join("mooncake/mooncake_master"), "#!/bin/sh\nsleep 60\n").unwrap();
    std::fs::create_dir_all(d.join("bin")).unwrap();
    let py = std::process::Command::new("sh").args(["-c", "command -v python3"]).output().unwrap();
    let py = String::from_utf8_lossy(&py.stdout).trim().to_string();
    std::os::unix::fs::symlink(&py, d.join("bin/python")).unwrap();
    let venv = d.to_str().unwrap();
    let (code, out, err) = kvprobe_env(
        &["run", "--memory", "dram", "--scenario", "stacked", "--tier", "mooncake", "--requests", "10"],
        &[("KVPROBE_MOONCAKE_VENV", venv)],
    );
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("install-mooncake.sh"), "{err}");
}

#[test]
fn ab_on_the_real_mooncake_store_passes() {
    if !mooncake_or_skip("ab_on_the_real_mooncake_store_passes") {
        return;
    }
    let d = crate::common::tmpdir("mc-ab");
    let p = d.join("ab.json");
    let (code, out, err) = kvprobe_env(
        &["ab", "--memory", "dram", "--tier", "mooncake", "--requests", "400", "--lockstep", "--report", p.to_str().unwrap()],
        &[],
    );
    assert_eq!(code, 0, "{out}{err}");
    let r = crate::common::read_report(&p);
    let rows = r["rows"].as_array().unwrap();
    assert_eq!(rows.len(), kvprobe::ab::cases().len());
    for row in rows {
        assert_eq!(row["pass"], true, "{row}");
        assert_eq!(row["unexplained"], 0);
    }
    // Every tier row ran on Mooncake.
    for s in r["sections"].as_array().unwrap().iter().skip(1) {
        assert!(s["scenario"]["tier_detail"].as_str().unwrap().starts_with("mooncake"), "{}", s["scenario"]["tier_detail"]);
    }
}

#[test]
fn an_existing_master_is_used_and_left_running() {
    if !mooncake_or_skip("an_existing_master_is_used_and_left_running") {
        return;
    }
    let install = mooncake::find().expect("Mooncake installed by scripts/install-deps.sh");
    let mut m = Master::start(&install, Duration::from_secs(300), LOOPBACK).unwrap();
    let rpc = m.rpc.to_string();
    let (code, r, log) = crate::common::run_with_report(
        "mc-external",
        "dram",
        &[
            "--scenario",
            "stacked",
            "--tier",
            "mooncake",
            "--requests",
            "300",
            "--mooncake-master",
            &rpc,
            "--mooncake-metadata",
            &m.metadata_url,
        ],
    );
    assert_eq!(code, 0, "{log}");
    assert_eq!(r["summary"]["blocks_corrupt"], 0);
    let s = &r["scenario"];
    let detail = s["tier_detail"].as_str().unwrap();
    assert!(detail.contains(&format!("master {rpc} (existing deployment)")), "{detail}");
    assert!(s["tier_saves"].as_u64().unwrap() > 50, "{s}");
    // kvprobe neither started another master nor stopped this one.
    m.alive().expect("the existing master still runs after kvprobe");
}

#[test]
fn an_existing_master_that_does_not_answer_is_exit_3() {
    if !mooncake_or_skip("an_existing_master_that_does_not_answer_is_exit_3") {
        return;
    }
    // A port nothing listens on, held for the test so no other process can take it.
    let (_held, addr) = crate::common::refusing_addr();
    let master = addr.to_string();
    let (code, out, err) = kvprobe_env(
        &[
            "run",
            "--memory",
            "dram",
            "--scenario",
            "stacked",
            "--tier",
            "mooncake",
            "--requests",
            "10",
            "--mooncake-master",
            &master,
            "--mooncake-metadata",
            &format!("http://{master}/metadata"),
        ],
        &[],
    );
    assert_eq!(code, 3, "{out}{err}");
    assert!(err.contains(&format!("the Mooncake master at {master} does not answer")), "{err}");
}
