//! Sockets of a process as the kernel lists them: which TCP addresses it listens on
//! (`/proc/PID/net/tcp{,6}`), and this host's loopback interface. Used to check that every
//! server kvprobe starts, or a library starts for it (UCX's TCP interfaces, Mooncake's
//! Transfer Engine), binds no wider than asked.

use std::net::{IpAddr, SocketAddr};

/// The TCP addresses process `pid` listens on: its socket descriptors (`/proc/PID/fd`,
/// `socket:[INODE]`) matched with the listening sockets of its network namespace
/// (`/proc/PID/net/tcp` and `tcp6`, state `0A`). Errors: /proc unreadable (the process is
/// gone, or another user's).
pub fn listening(pid: u32) -> std::io::Result<Vec<SocketAddr>> {
    let mut inodes = std::collections::HashSet::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))?.flatten() {
        if let Ok(t) = std::fs::read_link(e.path())
            && let Some(n) = t.to_str().and_then(|t| t.strip_prefix("socket:[")).and_then(|t| t.strip_suffix(']'))
            && let Ok(n) = n.parse::<u64>()
        {
            inodes.insert(n);
        }
    }
    let mut out = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = match std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue, // no IPv6
            Err(e) => return Err(e),
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 || f[3] != "0A" || !f[9].parse::<u64>().is_ok_and(|i| inodes.contains(&i)) {
                continue;
            }
            if let Some(a) = proc_net_addr(f[1]) {
                out.push(a);
            }
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// An address of /proc/net/tcp{,6} (`0100007F:1F90`: the address as 32-bit words in host byte
/// order, then the port), as a socket address.
pub fn proc_net_addr(s: &str) -> Option<SocketAddr> {
    let (a, p) = s.split_once(':')?;
    let port = u16::from_str_radix(p, 16).ok()?;
    let words: Vec<u32> =
        (0..a.len() / 8).map(|i| u32::from_str_radix(a.get(8 * i..8 * i + 8)?, 16).ok()).collect::<Option<_>>()?;
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let ip = match bytes.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
        16 => IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// True for a loopback address: 127.0.0.0/8, ::1, or an IPv4-mapped IPv6 form of
/// 127.0.0.0/8.
pub fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()),
    }
}

/// The name of this host's loopback network interface (`IFF_LOOPBACK`, 0x8, in
/// `/sys/class/net/NAME/flags`), "lo" on Linux unless renamed; `None` when none is listed.
pub fn loopback_interface() -> Option<String> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/class/net")
        .ok()?
        .flatten()
        .filter_map(|e| {
            let flags = std::fs::read_to_string(e.path().join("flags")).ok()?;
            let f = u64::from_str_radix(flags.trim().trim_start_matches("0x"), 16).ok()?;
            (f & 0x8 != 0).then(|| e.file_name().to_string_lossy().into_owned())
        })
        .collect();
    names.sort();
    names.into_iter().next()
}
