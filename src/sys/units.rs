//! Numbers as kvprobe prints them in messages and summaries: byte counts in binary units
//! with their exact value, and counted nouns. Depends on nothing, so every stage (pools,
//! tier, report) words sizes the same way.

/// `n` and `noun`, the noun with an `s` unless `n` is 1: "1 request", "3 requests".
pub fn plural(n: u64, noun: &str) -> String {
    format!("{n} {noun}{}", if n == 1 { "" } else { "s" })
}

/// A byte count in binary units with the exact value, for messages: `196.84 GiB
/// (211353600000 bytes)`; plain `N bytes` below 1 KiB.
pub fn bytes_exact(b: u64) -> String {
    if b < 1024 { format!("{b} bytes") } else { format!("{} ({b} bytes)", bytes_binary(b)) }
}

/// A byte count in binary units (KiB = 1024 B ... EiB), two decimals: `196.84 GiB`; `N B`
/// below 1 KiB.
pub fn bytes_binary(b: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if b < 1024 {
        return format!("{b} B");
    }
    let mut x = b as f64 / 1024.0;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    format!("{x:.2} {}", UNITS[u])
}
