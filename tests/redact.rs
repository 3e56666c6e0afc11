//! `--redact` (`kvprobe::redact`, issue 14 item 2): host names, IP addresses (v4, v6, with
//! ports, in URLs), MACs, user names and `/home/NAME` paths replaced by consistent tokens;
//! version strings kept; a redacted capture of this machine holds none of its names.

use kvprobe::redact::Redactor;

/// True when `w` occurs in `text` as a whole word (not inside a longer run of letters,
/// digits, `_` or `-`): the boundary the redactor documents.
fn has_word(text: &str, w: &str) -> bool {
    let wordy = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    let lt = text.to_ascii_lowercase();
    let lw = w.to_ascii_lowercase();
    lt.match_indices(&lw)
        .any(|(i, _)| !lt[..i].chars().next_back().is_some_and(wordy) && !lt[i + lw.len()..].chars().next().is_some_and(wordy))
}

/// The tokens `kind-N` in `s`, in order.
fn tokens(s: &str, kind: &str) -> Vec<String> {
    let rx = regex::Regex::new(&format!(r"\b{kind}-\d+\b")).unwrap();
    rx.find_iter(s).map(|m| m.as_str().to_string()).collect()
}

#[test]
fn redact_replaces_ipv4_and_ipv6_with_ports_and_in_urls() {
    let mut r = Redactor::new();
    let s = r.text(
        "master 10.1.2.3 at http://127.0.0.1:4096/metadata and etcd://192.168.0.10:2379, \
         peer [fe80::1]:4096 inet6 2001:db8::5/64 zone fe80::1%eth0 mapped ::ffff:10.9.9.9 \
         gid fe80:0000:0000:0000:0e42:a1ff:fe00:0001.",
    );
    for ip in ["10.1.2.3", "127.0.0.1", "192.168.0.10", "fe80::1", "2001:db8::5", "10.9.9.9", "fe80:0000", "0e42:a1ff"] {
        assert!(!s.contains(ip), "{ip} left in: {s}");
    }
    let url = regex::Regex::new(r"http://ip-\d+:4096/metadata and etcd://ip-\d+:2379, peer \[(ip-\d+)\]:4096").unwrap();
    let peer = url.captures(&s).unwrap_or_else(|| panic!("ports and URLs kept around the tokens: {s}"))[1].to_string();
    assert!(s.contains(&format!("zone {peer}%eth0")), "fe80::1 twice, one token; the zone stays: {s}");
    // Seven different addresses (the GID is fe80::e42:a1ff:fe00:1, not fe80::1): seven tokens.
    let mut t = tokens(&s, "ip");
    assert_eq!(t.len(), 8, "{s}");
    t.sort();
    t.dedup();
    assert_eq!(t.len(), 7, "{s}");
    assert!(s.ends_with('.'), "the full stop after the GID stays: {s}");
}

#[test]
fn redact_is_consistent_across_calls() {
    let mut r = Redactor::new();
    r.add_host("gpu-node-17.corp.example.com");
    r.add_user("alice");
    let a = r.text("10.0.0.7 gpu-node-17 alice 00:1a:2b:3c:4d:5e 10.0.0.8");
    let b = r.text("x=10.0.0.8,y=10.0.0.7 GPU-NODE-17 /home/alice/x 00-1A-2B-3C-4D-5E gpu-node-17.corp.example.com");
    let (ta, tb) = (tokens(&a, "ip"), tokens(&b, "ip"));
    assert_eq!(ta.len(), 2);
    assert_ne!(ta[0], ta[1], "two addresses, two tokens: {a}");
    assert_eq!(tb, [ta[1].clone(), ta[0].clone()], "{a} / {b}");
    assert_eq!(tokens(&a, "host"), tokens(&b, "host")[..1], "{a} / {b}");
    assert_eq!(tokens(&b, "host").len(), 2, "the FQDN is its own name: {b}");
    assert_ne!(tokens(&b, "host")[0], tokens(&b, "host")[1], "{b}");
    assert_eq!(tokens(&a, "user"), tokens(&b, "user"), "{a} / {b}");
    assert_eq!(tokens(&a, "mac"), tokens(&b, "mac"), "one MAC, however written: {a} / {b}");
    for leak in ["gpu-node-17", "alice", "corp.example", "4d:5e", "4D-5E", "10.0.0"] {
        assert!(!a.contains(leak) && !b.to_lowercase().contains(&leak.to_lowercase()), "{leak}: {a} / {b}");
    }
    assert!(b.contains("/home/user-1/x"), "{b}");
}

#[test]
fn redact_replaces_home_paths_and_learns_their_users() {
    let mut r = Redactor::new();
    let s = r.text("/home/bob/.cache/x and /Users/carol/lib; later bob and carol, not bobby or bob_x");
    assert!(!has_word(&s, "bob") && !has_word(&s, "carol"), "{s}");
    assert!(s.contains("/home/user-") && s.contains("/Users/user-"), "{s}");
    assert!(s.contains("bobby") && s.contains("bob_x"), "whole words only: {s}");
    let again = r.text("bob");
    assert_eq!(tokens(&s, "user")[0], again, "{s}");
}

#[test]
fn redact_keeps_versions_pci_addresses_and_code() {
    let mut r = Redactor::new();
    let keep = [
        "CUDA 13.0.2",
        "nixl-cu13 1.5.1",
        "Driver Version : 570.133.20",
        "UCX 1.23.0",
        "glibc v2.31.0.0",
        "libibverbs-2.31.0.0",
        "1.2.3.4.5",
        "VBIOS Version : 96.00.74.00.1C",
        "0000:17:00.0",
        "at 03:47:32.123 on 2026-12-01",
        "nixl::Agent and std::vector",
        "0..inf zero-copy via cuda_ipc/cuda",
        "256.1.1.1",
    ];
    for k in keep {
        assert_eq!(r.text(k), k);
    }
}

#[test]
fn redact_replaces_gpu_uuids_serials_and_guids() {
    let mut r = Redactor::new();
    let s = r.text(
        "GPU UUID : GPU-0a1b2c3d-4e5f-6789-abcd-ef0123456789\nSerial Number : 1650123456789\n\
         Serial Number : N/A\nnode_guid: 0c42:a103:00de:ad01\nGPU-0A1B2C3D-4E5F-6789-ABCD-EF0123456789",
    );
    assert!(s.contains("GPU UUID : gpu-uuid-1\n"), "{s}");
    assert!(s.ends_with("gpu-uuid-1"), "one UUID, either case: {s}");
    assert!(s.contains("Serial Number : serial-1\n"), "{s}");
    assert!(s.contains("Serial Number : N/A"), "{s}");
    assert!(s.contains("node_guid: guid-1"), "{s}");
}

/// The local IPv4 addresses (/proc/net/fib_trie "/32 host LOCAL") and IPv6 addresses
/// (/proc/net/if_inet6) of this machine, read independently of the redactor.
fn local_ips() -> Vec<String> {
    let mut v = Vec::new();
    if let Ok(t) = std::fs::read_to_string("/proc/net/fib_trie") {
        let lines: Vec<&str> = t.lines().collect();
        for w in lines.windows(2) {
            if w[1].contains("/32 host LOCAL")
                && let Some(ip) = w[0].trim().strip_prefix("|-- ")
            {
                v.push(ip.to_string());
            }
        }
    }
    if let Ok(t) = std::fs::read_to_string("/proc/net/if_inet6") {
        for l in t.lines() {
            if let Some(h) = l.split_whitespace().next()
                && let Ok(n) = u128::from_str_radix(h, 16)
            {
                v.push(std::net::Ipv6Addr::from(n).to_string());
            }
        }
    }
    v.sort();
    v.dedup();
    v
}

fn cmd(c: &str, args: &[&str]) -> Option<String> {
    let o = std::process::Command::new(c).args(args).output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

/// A capture of this machine, redacted, holds none of its host names, its user (unless a
/// system account, which the rules keep) or its addresses — each read here independently —
/// while a text built from the same values (with ports, in URLs, in /home paths) is cleaned.
#[test]
fn redacted_capture_of_this_machine_holds_none_of_its_names() {
    let d = crate::common::tmpdir("redact-capture");
    kvprobe::env_capture::capture(&d, None).unwrap();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_string();
    let mut hosts = vec![host.clone()];
    hosts.extend(cmd("uname", &["-n"]));
    hosts.extend(cmd("hostname", &[]));
    let user = cmd("id", &["-un"]).or_else(|| std::env::var("USER").ok()).unwrap_or_default();
    let ips = local_ips();
    assert!(!ips.is_empty(), "this machine has addresses");
    let mut r = Redactor::new();
    let mut all = String::new();
    for f in std::fs::read_dir(&d).unwrap().flatten() {
        let text = String::from_utf8_lossy(&std::fs::read(f.path()).unwrap()).into_owned();
        all += &r.text(&text);
    }
    let mut made = String::new();
    for ip in &ips {
        let shown = if ip.contains(':') { format!("[{ip}]") } else { ip.clone() };
        made += &format!("addr {ip} url http://{shown}:4096/x\n");
    }
    for h in &hosts {
        made += &format!("[{h}:1234:0] host {h} ssh://{h}:22\n");
    }
    made += &format!("/home/{user}/.cache owner {user}\n");
    all += &r.text(&made);
    for h in &hosts {
        assert!(!has_word(&all, h), "host name {h:?} left in the redacted capture");
    }
    for ip in &ips {
        assert!(!has_word(&all, ip), "address {ip} left in the redacted capture");
    }
    if ["root", "nobody", "daemon", "bin", "sys"].contains(&user.as_str()) {
        // A system account is not hidden (documented); the /home path still is.
        assert!(all.contains(&format!("/home/{user}/.cache")), "system accounts are kept");
    } else {
        assert!(!has_word(&all, &user), "user {user:?} left in the redacted capture");
    }
}

/// An nvidia-smi -q / ibv_devinfo / UCX log excerpt as those tools print it: only the
/// serial, the UUID, the GUIDs, the address and the host name change; every version, bus id,
/// part number and timestamp stays.
#[test]
fn redact_tool_output_changes_only_identifiers() {
    let mut r = Redactor::new();
    r.add_host("h200-node-3");
    let text = "Timestamp                                 : Tue Dec  1 03:00:00 2026\n\
                Driver Version                            : 570.133.20\n\
                CUDA Version                              : 12.8\n\
                Product Name                          : NVIDIA H200\n\
                Serial Number                         : 1654123456789\n\
                GPU UUID                              : GPU-5e2f0c1a-9b7d-4c3e-8f21-0a1b2c3d4e5f\n\
                VBIOS Version                         : 96.00.A5.00.01\n\
                Board Part Number                     : 692-2G520-0280-000\n\
                Inforom Image Version                 : G520.0200.00.05\n\
                Bus Id                                : 00000000:18:00.0\n\
                \tfw_ver:\t\t\t\t28.39.1002\n\
                \tnode_guid:\t\t\t0c42:a103:00de:ad01\n\
                \tsys_image_guid:\t\t\t0c42:a103:00de:ad00\n\
                [1764558000.123456] [h200-node-3:4242:0]  tcp_iface.c:911 UCX  DEBUG tcp/eth0 10.20.30.40:35000\n";
    let s = r.text(text);
    let want = text
        .replace("1654123456789", "serial-1")
        .replace("GPU-5e2f0c1a-9b7d-4c3e-8f21-0a1b2c3d4e5f", "gpu-uuid-1")
        .replace("0c42:a103:00de:ad01", "guid-1")
        .replace("0c42:a103:00de:ad00", "guid-2")
        .replace("h200-node-3", "host-1")
        .replace("10.20.30.40", "ip-1");
    let host_token = tokens(&s, "host");
    assert_eq!(host_token.len(), 1, "{s}");
    assert_eq!(s, want.replace("host-1", &host_token[0]));
}

#[test]
fn a_redacted_value_matches_the_plain_one_it_could_come_from() {
    use kvprobe::redact::could_be_redaction_of as could;
    assert!(could("host-1", "gpu-node-7"));
    assert!(could("ip-1:4096", "10.0.0.1:4096"));
    assert!(could("/home/user-2/kvprobe on host-1", "/home/alice/kvprobe on node7"));
    // Text outside the tokens must be equal; no token, no match (equality decides then).
    assert!(!could("ip-1:4096", "10.0.0.1:4097"));
    assert!(!could("host-1 (rack 2)", "node7 (rack 3)"));
    assert!(!could("node7", "node7"));
    // A token inside a longer word is no token.
    assert!(!could("ghost-1", "ghost-2"));
}
