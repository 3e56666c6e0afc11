//! The node pair's authentication and exposure (issue 33 items 2, 14, 15): an impostor serve
//! that does not know the token, a relay that alters a frame, short tokens, hostile text from
//! a peer, and a token guesser next to the real client. The impostors and the relay are written
//! here, speaking the frame protocol (4-byte big-endian length, JSON) from docs/two-hosts.md, not
//! kvprobe's own code.

use crate::common::*;
use crate::pair::{Serve, TOKEN, read_frame, run_peer, run_peer_in};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

/// Writes `v` as one frame.
fn write_frame(s: &mut TcpStream, v: &serde_json::Value) -> std::io::Result<()> {
    let body = serde_json::to_vec(v).unwrap();
    s.write_all(&(body.len() as u32).to_be_bytes())?;
    s.write_all(&body)
}

/// Reads one frame's raw bytes.
fn read_raw(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).ok()?;
    Some(body)
}

/// A frame's JSON: the whole body, or the body without a 32-byte tag at its end.
fn frame_json(body: &[u8]) -> Option<(serde_json::Value, usize)> {
    if let Ok(v) = serde_json::from_slice(body) {
        return Some((v, body.len()));
    }
    let cut = body.len().checked_sub(32)?;
    serde_json::from_slice(&body[..cut]).ok().map(|v| (v, cut))
}

/// Every control character of `s` but the newlines that end lines.
fn controls(s: &str) -> Vec<char> {
    s.chars().filter(|c| c.is_control() && *c != '\n').collect()
}

const HOSTILE: &str = "9.9\nkvprobe serve: run 00000000 from 10.9.9.9 FORGED\u{1b}]0;PWNED\u{7}\u{1b}[2J\r";

/// An impostor serve on a port of its own that knows no token: it sends a challenge (of the
/// protocol this kvprobe speaks, with a nonce of zeros), then answers the hello as `mode`
/// says, and records every frame decode sends until decode closes.
fn impostor(mode: &'static str) -> (String, std::thread::JoinHandle<Vec<serde_json::Value>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(90))).unwrap();
        let challenge = serde_json::json!({"type": "challenge", "kvprobe": "0.1.0", "protocol": kvprobe::peer::PROTOCOL, "nonce": "00".repeat(32)});
        write_frame(&mut s, &challenge).unwrap();
        let mut got = Vec::new();
        let Some((hello, _)) = read_raw(&mut s).and_then(|b| frame_json(&b)) else { return got };
        let answer = match mode {
            // A welcome with a made-up proof.
            "zeros" => serde_json::json!({"type": "welcome", "run_id": hello["run_id"], "proof": "00".repeat(32)}),
            // Decode's own proof sent back as serve's (reflection).
            "reflect" => serde_json::json!({"type": "welcome", "run_id": hello["run_id"], "proof": hello["proof"]}),
            // A welcome with no proof at all (what a serve of protocol 2 sends).
            "bare" => serde_json::json!({"type": "welcome", "run_id": hello["run_id"]}),
            // A refusal whose reason is made to forge lines on decode's terminal.
            _ => serde_json::json!({"type": "refused", "reason": HOSTILE, "field": null, "exit": 2}),
        };
        got.push(hello);
        let _ = write_frame(&mut s, &answer);
        while let Some(b) = read_raw(&mut s) {
            got.push(frame_json(&b).map(|(v, _)| v).unwrap_or_else(|| serde_json::json!({"type": "not json", "bytes": b.len()})));
        }
        got
    });
    (addr, t)
}

#[test]
fn run_peer_refuses_an_impostor_serve_and_sends_it_nothing_about_itself() {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim().to_string();
    for mode in ["zeros", "reflect", "bare"] {
        let (addr, t) = impostor(mode);
        let (code, r, out) = run_peer_in(&[], &addr, TOKEN, &["--iterations", "1"]);
        let got = t.join().unwrap();
        assert_eq!(code, 3, "{mode}: {out}");
        assert_eq!(r["outcome"]["exit_code"], 3, "{mode}");
        assert!(out.contains(&format!("the prefill peer at {addr} did not prove")), "{mode}: {out}");
        // The impostor got decode's hello (versions, run id, decode's nonce, its proof) and at
        // most a refusal: no configuration, environment, NIXL agent or host name.
        let types: Vec<&str> = got.iter().map(|f| f["type"].as_str().unwrap_or("?")).collect();
        assert_eq!(types.first(), Some(&"hello"), "{mode}: {types:?}");
        assert!(types[1..].iter().all(|t| *t == "refused"), "{mode}: decode sent {types:?}");
        let mut keys: Vec<&str> = got[0].as_object().unwrap().keys().map(|k| k.as_str()).collect();
        keys.sort();
        assert_eq!(keys, ["kvprobe", "nonce", "proof", "protocol", "run_id", "type"], "{mode}");
        // Decode's nonce is its own, so the proof is not over a nonce the impostor chose alone.
        let nonce = got[0]["nonce"].as_str().unwrap();
        assert!(nonce.len() == 64 && nonce != "00".repeat(32), "{mode}: {nonce}");
        let sent = serde_json::to_string(&got).unwrap();
        if host.chars().any(|c| !c.is_ascii_hexdigit()) {
            assert!(!sent.contains(&host), "{mode}: the host name {host} reached the impostor: {sent}");
        }
        assert!(!sent.contains(TOKEN), "{mode}");
    }
    // A serve's refusal is printed with its control characters escaped: no forged line, no
    // terminal control sequence.
    let (addr, t) = impostor("refuse-hostile");
    let (code, _, out) = run_peer_in(&[], &addr, TOKEN, &["--iterations", "1"]);
    t.join().unwrap();
    assert_eq!(code, 2, "{out}");
    assert!(controls(&out).is_empty(), "control characters reached run's output: {out:?}");
    assert!(!out.lines().any(|l| l.starts_with("kvprobe serve: run 00000000")), "{out}");
    assert!(out.contains("\\u{1b}]0;PWNED"), "{out}");
}

#[test]
fn a_relay_that_alters_a_frame_ends_the_run_and_the_forged_host_never_shows() {
    // A relay between run --peer and the real serve passes the handshake on unchanged (it
    // knows no token), then rewrites prefill's host name in serve's `accept`.
    let s = Serve::start(&[]);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let relay_addr = l.local_addr().unwrap().to_string();
    let serve_addr = s.addr.clone();
    let rewrote = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = rewrote.clone();
    let relay = std::thread::spawn(move || {
        let (d, _) = l.accept().unwrap();
        let p = TcpStream::connect(&serve_addr).unwrap();
        let (mut d2, mut p2) = (d.try_clone().unwrap(), p.try_clone().unwrap());
        let up = std::thread::spawn(move || {
            let mut d = d;
            let mut p = p;
            while let Some(b) = read_raw(&mut d) {
                if p.write_all(&(b.len() as u32).to_be_bytes()).and_then(|_| p.write_all(&b)).is_err() {
                    break;
                }
            }
            let _ = p.shutdown(std::net::Shutdown::Both);
        });
        while let Some(mut b) = read_raw(&mut p2) {
            if let Some((mut v, cut)) = frame_json(&b)
                && v["type"] == "accept"
            {
                v["prefill"]["host"] = "trusted-prefill-node".into();
                let mut nb = serde_json::to_vec(&v).unwrap();
                nb.extend_from_slice(&b[cut..]); // the tag, if any, as it came
                b = nb;
                flag.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            if d2.write_all(&(b.len() as u32).to_be_bytes()).and_then(|_| d2.write_all(&b)).is_err() {
                break;
            }
        }
        let _ = d2.shutdown(std::net::Shutdown::Both);
        let _ = up.join();
    });
    let (code, r, out) = run_peer_in(&[], &relay_addr, TOKEN, &["--iterations", "1"]);
    relay.join().unwrap();
    assert!(rewrote.load(std::sync::atomic::Ordering::SeqCst), "the relay saw no accept: {out}");
    assert_eq!(code, 3, "an altered frame must end the run: {out}");
    assert!(out.contains("tag does not verify"), "{out}");
    assert!(!out.contains("trusted-prefill-node") && !r.to_string().contains("trusted-prefill-node"), "{out}");
    drop(s);
}

/// Runs kvprobe, killed after 60 s if still running (a serve that took the token would
/// listen for ever): (exit code, stdout and stderr; -1 when killed).
fn kvprobe_bounded(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let mut c = std::process::Command::new(bin())
        .args(args)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut code = None;
    for _ in 0..600 {
        if let Some(st) = c.try_wait().unwrap() {
            code = Some(st.code().unwrap_or(-1));
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if code.is_none() {
        let _ = c.kill();
        let _ = c.wait();
    }
    let mut out = String::new();
    let _ = c.stdout.take().unwrap().read_to_string(&mut out);
    let _ = c.stderr.take().unwrap().read_to_string(&mut out);
    (code.unwrap_or(-1), out)
}

#[test]
fn short_tokens_are_refused_on_both_sides() {
    let short = "fifteen-chars-x"; // 15 characters, one under the minimum
    assert_eq!(short.chars().count() + 1, kvprobe::peer::MIN_TOKEN_CHARS);
    let serve = ["serve", "--listen", "127.0.0.1:0", "--memory", "dram"];
    let (code, out) = kvprobe_bounded(&[&serve[..], &["--token", short]].concat(), &[]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("--token") && out.contains("at least 16"), "{out}");
    let (code, out) = kvprobe_bounded(&serve, &[("KVPROBE_TOKEN", short)]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("KVPROBE_TOKEN") && out.contains("at least 16"), "{out}");
    // Long enough, but of too few distinct characters: the first an offline guesser tries.
    for weak in ["aaaaaaaaaaaaaaaa", "abababababababababab", "abcdabcdabcdabcd"] {
        let (code, out) = kvprobe_bounded(&[&serve[..], &["--token", weak]].concat(), &[]);
        assert_eq!(code, 2, "{weak}: {out}");
        assert!(out.contains("distinct") && out.contains("at least 5"), "{weak}: {out}");
        let (code, out) = kvprobe_bounded(&["run", "--peer", "127.0.0.1:1", "--memory", "dram"], &[("KVPROBE_TOKEN", weak)]);
        assert_eq!(code, 2, "{weak}: {out}");
        assert!(out.contains("distinct") && !out.contains("cannot connect"), "{weak}: {out}");
    }
    // run/ab --peer refuse it before connecting (nothing listens at 127.0.0.1:1 either way).
    for sub in ["run", "ab"] {
        let (code, out) = kvprobe_bounded(&[sub, "--peer", "127.0.0.1:1", "--memory", "dram", "--token", short], &[]);
        assert_eq!(code, 2, "{sub}: {out}");
        assert!(out.contains("at least 16") && !out.contains("cannot connect"), "{sub}: {out}");
        let (code, out) = kvprobe_bounded(&[sub, "--peer", "127.0.0.1:1", "--memory", "dram"], &[("KVPROBE_TOKEN", short)]);
        assert_eq!(code, 2, "{sub}: {out}");
        assert!(out.contains("KVPROBE_TOKEN") && out.contains("at least 16"), "{sub}: {out}");
    }
}

#[test]
fn serve_escapes_what_an_unauthenticated_peer_sends() {
    let s = Serve::start(&[]);
    // A hello whose version string forges a line and carries terminal control sequences.
    let mut c = TcpStream::connect(&s.addr).unwrap();
    assert_eq!(read_frame(&mut c).expect("a challenge")["type"], "challenge");
    let hello = serde_json::json!({"type": "hello", "kvprobe": HOSTILE, "protocol": 7, "run_id": "x", "proof": "00"});
    write_frame(&mut c, &hello).unwrap();
    let refused = read_frame(&mut c).expect("a refusal");
    let reason = refused["reason"].as_str().unwrap();
    assert!(reason.contains("protocol version mismatch") && reason.contains("speaks 7"), "{reason}");
    assert!(controls(reason).is_empty() && !reason.contains('\n'), "{reason:?}");
    // A frame whose type is made of control sequences (serde's error quotes it).
    let mut c = TcpStream::connect(&s.addr).unwrap();
    assert_eq!(read_frame(&mut c).expect("a challenge")["type"], "challenge");
    write_frame(&mut c, &serde_json::json!({"type": "\u{1b}[2J\u{1b}[Hfake\nkvprobe serve: FORGED"})).unwrap();
    assert_eq!(read_frame(&mut c).expect("a refusal")["type"], "refused");
    // Then the real run, the one run serve serves.
    let (code, _, out) = run_peer(&s.addr, &["--iterations", "1"]);
    assert_eq!(code, 0, "{out}");
    let (sc, sout, _) = s.wait();
    assert_eq!(sc, 0, "{sout}");
    assert!(sout.matches("refused the client").count() >= 2, "{sout}");
    assert!(controls(&sout).is_empty(), "control characters reached serve's output: {sout:?}");
    assert!(
        !sout.lines().any(|l| l.starts_with("kvprobe serve: run 00000000") || l.starts_with("kvprobe serve: FORGED")),
        "{sout}"
    );
    assert!(sout.contains("\\u{1b}]0;PWNED"), "{sout}");
}

/// A TCP connection to `to` from the loopback address `from` (another source than 127.0.0.1).
fn connect_from(from: [u8; 4], to: std::net::SocketAddr) -> TcpStream {
    use std::os::fd::FromRawFd;
    let std::net::SocketAddr::V4(to) = to else { panic!("{to}") };
    // SAFETY: plain socket(2)/bind(2)/connect(2) on a socket this function owns (handed to
    // TcpStream, which closes it); the sockaddr_in structures are fully initialised and their
    // sizes passed.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let s = TcpStream::from_raw_fd(fd);
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let mut a: libc::sockaddr_in = std::mem::zeroed();
        a.sin_family = libc::AF_INET as libc::sa_family_t;
        a.sin_addr.s_addr = u32::from_ne_bytes(from);
        assert_eq!(libc::bind(fd, &a as *const _ as *const libc::sockaddr, len), 0, "bind: {}", std::io::Error::last_os_error());
        let mut b: libc::sockaddr_in = std::mem::zeroed();
        b.sin_family = libc::AF_INET as libc::sa_family_t;
        b.sin_addr.s_addr = u32::from_ne_bytes(to.ip().octets());
        b.sin_port = to.port().to_be();
        assert_eq!(
            libc::connect(fd, &b as *const _ as *const libc::sockaddr, len),
            0,
            "connect: {}",
            std::io::Error::last_os_error()
        );
        s
    }
}

#[test]
fn a_token_guesser_is_slowed_and_does_not_keep_the_real_client_out() {
    let s = Serve::start(&[]);
    let to: std::net::SocketAddr = s.addr.parse().unwrap();
    let guesser = [127, 0, 0, 2];
    // One connection of the guesser's source holds its handshake open (reads the challenge,
    // sends nothing).
    let mut stall = connect_from(guesser, to);
    assert_eq!(read_frame(&mut stall).expect("a challenge")["type"], "challenge");
    // The guesser tries wrong proofs until serve refuses its source without a challenge. The
    // refusal time doubles with each failure, so however slow this machine, it comes.
    let mut wrong = 0;
    let mut blocked = None;
    for _ in 0..12 {
        let mut c = connect_from(guesser, to);
        let first = read_frame(&mut c).expect("an answer");
        if first["type"] == "refused" {
            blocked = Some(first["reason"].as_str().unwrap().to_string());
            break;
        }
        assert_eq!(first["type"], "challenge", "{first}");
        let hello = serde_json::json!({"type": "hello", "kvprobe": "0.1.0", "protocol": kvprobe::peer::PROTOCOL,
            "run_id": "0123456789abcdef", "nonce": "11".repeat(32), "proof": "22".repeat(32)});
        write_frame(&mut c, &hello).unwrap();
        let r = read_frame(&mut c).expect("a refusal");
        assert!(r["reason"].as_str().unwrap().contains("wrong token"), "{r}");
        wrong += 1;
    }
    let blocked = blocked.unwrap_or_else(|| panic!("{wrong} wrong proofs from 127.0.0.2 and it was never refused"));
    assert!(blocked.contains("too many failed handshakes from 127.0.0.2"), "{blocked}");
    assert!(wrong > kvprobe::peer::gate::FREE_FAILURES as usize, "refused after {wrong} failures: {blocked}");
    // The real client, from 127.0.0.1, gets in while the guesser's source is refused and its
    // stalled handshake may still be open.
    let (code, _, out) = run_peer(&s.addr, &["--iterations", "1"]);
    assert_eq!(code, 0, "{out}");
    drop(stall);
    let (sc, sout, _) = s.wait();
    assert_eq!(sc, 0, "{sout}");
    assert!(sout.contains("failed handshakes from 127.0.0.2"), "{sout}");
}

#[test]
fn the_gate_slows_a_failing_source_and_serves_the_others() {
    use kvprobe::peer::gate::{Door, FREE_FAILURES, Gate, MAX_BLOCK, MAX_HANDSHAKES_PER_SOURCE, source};
    use std::net::IpAddr;
    let t0 = std::time::Instant::now();
    let s = |x: u64| t0 + Duration::from_millis(x);
    let bad: IpAddr = "10.0.0.9".parse().unwrap();
    let good: IpAddr = "10.0.0.1".parse().unwrap();
    let mut g = Gate::new();
    // FREE_FAILURES failures cost nothing; the next one refuses the source for 1 s, then
    // 2 s, 4 s, ... up to MAX_BLOCK.
    for k in 1..=FREE_FAILURES {
        assert_eq!(g.arrive(bad, s(0)), Door::Open);
        g.leave(bad);
        assert_eq!(g.failed(bad, s(0)), None, "failure {k}");
    }
    assert_eq!(g.failed(bad, s(0)), Some(Duration::from_secs(1)));
    assert_eq!(g.failures(bad), FREE_FAILURES + 1);
    assert_eq!(g.arrive(bad, s(500)), Door::Blocked(Duration::from_millis(500)));
    // Another source is let in meanwhile, and takes the session.
    assert_eq!(g.arrive(good, s(500)), Door::Open);
    assert_eq!(g.claim(good), Ok(()));
    g.leave(good);
    assert_eq!(g.arrive(bad, s(1000)), Door::Busy);
    g.session_over();
    assert_eq!(g.arrive(bad, s(1000)), Door::Open);
    g.leave(bad);
    let mut want = 2;
    for _ in 0..10 {
        let got = g.failed(bad, s(1000)).unwrap();
        assert_eq!(got, Duration::from_secs(want).min(MAX_BLOCK));
        want *= 2;
    }
    assert_eq!(g.blocked_for(bad, s(1000) + MAX_BLOCK), None);
    // Its proof holding forgets its failures (and a session already running refuses it).
    g.claim(good).unwrap();
    assert!(g.claim(bad).is_err());
    assert_eq!(g.failures(bad), 0);
    g.session_over();
    // At most MAX_HANDSHAKES_PER_SOURCE handshakes at once from one source; an IPv6 /64 is one
    // source, an IPv4-mapped address is its IPv4 one.
    let a: IpAddr = "2001:db8::1".parse().unwrap();
    let b: IpAddr = "2001:db8::ffff:2".parse().unwrap();
    assert_eq!(source(a), source(b));
    assert_eq!(source("::ffff:10.0.0.9".parse().unwrap()), bad);
    for k in 0..MAX_HANDSHAKES_PER_SOURCE {
        assert_eq!(g.arrive(if k % 2 == 0 { a } else { b }, s(0)), Door::Open);
    }
    assert_eq!(g.arrive(b, s(0)), Door::Crowded);
    assert_eq!(g.arrive(good, s(0)), Door::Open);
    g.leave(a);
    assert_eq!(g.arrive(b, s(0)), Door::Open);
}
