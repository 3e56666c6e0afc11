//! `--redact`: replaces what identifies a machine, its network and its people in text that
//! leaves the company (a bundle's reports and environment capture), consistently: within one
//! [`Redactor`] the same input always becomes the same token and different inputs different
//! tokens, so a redacted bundle still says "these two lines are the same host".
//!
//! What is replaced, in this order (each pass sees the previous passes' output):
//!
//! | what | rule | token |
//! |---|---|---|
//! | serial numbers | the value after `Serial Number`, `serial_number` or `Serial` and `:` or `=` (nvidia-smi's board and module serials); `N/A`, `None`, `0` kept | `serial-N` |
//! | GPU UUIDs | `GPU-` or `MIG-` and a UUID (8-4-4-4-12 hex), as nvidia-smi and CUDA print them | `gpu-uuid-N` |
//! | MAC / hardware addresses | 6 or more pairs of hex digits joined by `:` or `-` (Ethernet MACs, 20-byte IPoIB addresses), not inside a longer word | `mac-N` |
//! | InfiniBand GUIDs | 4 groups of 4 hex digits joined by `:` (node and port GUIDs) | `guid-N` |
//! | IPv6 addresses | a run of hex digits, `:` and `.` with at least two `:` that parses as an IPv6 address (with `%zone`: the zone is kept), not inside a longer word; `::` alone is kept; GIDs (`fe80:0000:...`) are IPv6 and replaced | `ip-N` |
//! | IPv4 addresses | four dot-separated decimal numbers of 1–3 digits, each ≤ 255, not glued to a letter, digit, `_`, `-` or `.` on either side (so `v2.31.0.0`, `lib-2.31.0.0`, `1.2.3.4.5`, `12.4.1`, `570.133.20` stay); a port after it stays (`ip-1:4096`) | `ip-N` |
//! | host names | this machine's names ([`Redactor::new`]) and any added with [`Redactor::add_host`], matched without regard to case, as whole names (not inside a longer word of letters, digits, `_` or `-`); longest first, so a known FQDN becomes one token | `host-N` |
//! | user names | the NAME of every `/home/NAME` and `/Users/NAME` path (learnt as a user name from then on), this machine's users ([`Redactor::new`]) and any added with [`Redactor::add_user`], as whole words (case kept) | `user-N` |
//!
//! **Trade-offs, by rule**: a version of exactly four numbers ≤ 255 standing alone
//! (`2.31.0.0`) is indistinguishable from an IPv4 address and is replaced — the rule prefers
//! losing a version to leaking an address. A host or user name that is also an ordinary word
//! (a host called `node`) is replaced wherever that word stands alone. The system accounts
//! `root`, `nobody`, `daemon`, `bin` and `sys` are not user names to hide (they identify
//! nobody, and `root` is a word of PCIe topology); nor are `localhost` and `localdomain`.
//!
//! **Not replaced**: PCI bus addresses, GPU names and driver versions (needed to act on a
//! report), domain names other than this machine's (a short host name leaves the rest of an
//! unknown FQDN), other machines' host names unless added, user names that appear only
//! outside paths and are not this machine's, generic UUIDs that are not GPU UUIDs, and
//! anything inside binary data. The token map is kept in memory only: nothing writes it out
//! (it would undo the redaction).

use regex::Regex;
use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::sync::OnceLock;

/// Accounts that identify nobody and are not replaced as user names.
const SYSTEM_USERS: &[&str] = &["root", "nobody", "daemon", "bin", "sys"];

/// Names that identify no machine and are not replaced as host names.
const GENERIC_HOSTS: &[&str] = &["localhost", "localdomain", "localhost.localdomain", "(none)"];

/// A consistent replacer of identifying strings (see the module documentation for the rules).
/// Tokens are numbered per kind from 1 in order of first appearance.
pub struct Redactor {
    /// Known host names, lower-cased.
    hosts: Vec<String>,
    /// Known user names.
    users: Vec<String>,
    /// (kind, original as matched; host names lower-cased) → token.
    tokens: HashMap<(&'static str, String), String>,
    /// Tokens handed out per kind.
    counts: HashMap<&'static str, usize>,
}

impl Default for Redactor {
    fn default() -> Self {
        Redactor::new()
    }
}

/// True for a character that continues a word for host and user names.
fn wordy(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '-'
}

fn re(cell: &'static OnceLock<Regex>, pattern: &str) -> &'static Regex {
    cell.get_or_init(|| Regex::new(pattern).expect("a valid built-in pattern"))
}

impl Redactor {
    /// A redactor that knows this machine's host names — `/proc/sys/kernel/hostname` (uname's
    /// nodename), `/etc/hostname`, `$HOSTNAME`, each one's short form (up to the first dot),
    /// `NAME.DOMAIN` with the kernel's domain name when set, and every name of each
    /// `/etc/hosts` line that names one of those — and its users: `$USER`, `$LOGNAME`, the
    /// last part of `$HOME` when under `/home` or `/Users`, and the `/etc/passwd` name of this
    /// process's uid. Sources that are missing are skipped.
    pub fn new() -> Redactor {
        let mut r = Redactor { hosts: Vec::new(), users: Vec::new(), tokens: HashMap::new(), counts: HashMap::new() };
        let read = |p: &str| std::fs::read_to_string(p).ok().map(|s| s.trim().to_string());
        let mut names: Vec<String> = Vec::new();
        names.extend(read("/proc/sys/kernel/hostname"));
        names.extend(read("/etc/hostname").and_then(|s| s.lines().next().map(|l| l.trim().to_string())));
        names.extend(std::env::var("HOSTNAME").ok());
        let domain = read("/proc/sys/kernel/domainname").filter(|d| !d.is_empty() && d != "(none)");
        let mut all: Vec<String> = Vec::new();
        for n in names.iter().filter(|n| !n.is_empty()) {
            all.push(n.clone());
            if let Some((short, _)) = n.split_once('.') {
                all.push(short.to_string());
            }
            if let Some(d) = &domain
                && !n.contains('.')
            {
                all.push(format!("{n}.{d}"));
            }
        }
        if let Some(hosts) = read("/etc/hosts") {
            let lower: Vec<String> = all.iter().map(|n| n.to_ascii_lowercase()).collect();
            for line in hosts.lines() {
                let line = line.split('#').next().unwrap_or("");
                let fields: Vec<&str> = line.split_whitespace().skip(1).collect();
                if fields.iter().any(|f| lower.contains(&f.to_ascii_lowercase())) {
                    all.extend(fields.iter().map(|f| f.to_string()));
                }
            }
        }
        for h in all {
            r.add_host(&h);
        }
        let mut users: Vec<String> = Vec::new();
        users.extend(std::env::var("USER").ok());
        users.extend(std::env::var("LOGNAME").ok());
        if let Ok(home) = std::env::var("HOME") {
            for base in ["/home/", "/Users/"] {
                if let Some(rest) = home.strip_prefix(base) {
                    users.extend(rest.split('/').next().map(str::to_string));
                }
            }
        }
        if let (Ok(me), Some(pw)) = (std::fs::metadata("/proc/self"), read("/etc/passwd")) {
            let uid = me.uid().to_string();
            for l in pw.lines() {
                let f: Vec<&str> = l.split(':').collect();
                if f.len() > 2 && f[2] == uid {
                    users.push(f[0].to_string());
                }
            }
        }
        for u in users {
            r.add_user(&u);
        }
        r
    }

    /// Adds a host name to replace (e.g. a peer's, from `--mooncake-master`); its short form
    /// (up to the first dot) too. Generic names (`localhost`) and empty ones are ignored.
    pub fn add_host(&mut self, name: &str) {
        let n = name.trim().to_ascii_lowercase();
        if n.len() < 2 || GENERIC_HOSTS.contains(&n.as_str()) || !n.chars().all(|c| wordy(c) || c == '.') {
            return;
        }
        let short = n.split('.').next().unwrap_or("").to_string();
        for x in [n, short] {
            if x.len() >= 2 && !GENERIC_HOSTS.contains(&x.as_str()) && !self.hosts.contains(&x) {
                self.hosts.push(x);
            }
        }
        // Longest first: a known FQDN wins over its short name.
        self.hosts.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
    }

    /// Adds a user name to replace. System accounts (`root`, `nobody`, ...) and names that are
    /// empty or contain other than letters, digits, `.`, `_` and `-` are ignored.
    pub fn add_user(&mut self, name: &str) {
        let n = name.trim();
        if n.is_empty()
            || SYSTEM_USERS.contains(&n)
            || !n.chars().all(|c| wordy(c) || c == '.')
            || self.users.iter().any(|u| u == n)
        {
            return;
        }
        self.users.push(n.to_string());
        self.users.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
    }

    /// The token for `original` of `kind` (`host`, `ip`, ...): the same one every time.
    fn token(&mut self, kind: &'static str, original: &str) -> String {
        if let Some(t) = self.tokens.get(&(kind, original.to_string())) {
            return t.clone();
        }
        let n = self.counts.entry(kind).or_insert(0);
        *n += 1;
        let t = format!("{kind}-{n}");
        self.tokens.insert((kind, original.to_string()), t.clone());
        t
    }

    /// `s` with every identifying string replaced by its token (rules: the module
    /// documentation). Never fails; text without anything to hide comes back unchanged.
    pub fn text(&mut self, s: &str) -> String {
        let s = self.serials(s);
        let s = self.gpu_uuids(&s);
        let s = self.macs(&s);
        let s = self.guids(&s);
        let s = self.ipv6(&s);
        let s = self.ipv4(&s);
        let s = self.host_names(&s);
        self.user_names(&s)
    }

    /// Replaces each match of `rx` in `s` whose full match passes `keep_if` (given the text
    /// before and after it) by `f(self, match)`; `None` from `f` keeps the match.
    fn replace(
        &mut self,
        s: &str,
        rx: &Regex,
        mut f: impl FnMut(&mut Self, &regex::Captures, &str, &str) -> Option<String>,
    ) -> String {
        let mut out = String::with_capacity(s.len());
        let mut last = 0;
        for c in rx.captures_iter(s) {
            let m = c.get(0).expect("group 0");
            if let Some(rep) = f(self, &c, &s[..m.start()], &s[m.end()..]) {
                out.push_str(&s[last..m.start()]);
                out.push_str(&rep);
                last = m.end();
            }
        }
        out.push_str(&s[last..]);
        out
    }

    fn serials(&mut self, s: &str) -> String {
        static RX: OnceLock<Regex> = OnceLock::new();
        let rx = re(&RX, r"(?i)\b(serial(?:[ _]number)?)([ \t]*[:=][ \t]*)([A-Za-z0-9][A-Za-z0-9._/-]*)");
        self.replace(s, rx, |me, c, _, _| {
            let v = &c[3];
            if ["n/a", "none", "0", "unknown", "not"].contains(&v.to_ascii_lowercase().as_str()) {
                return None;
            }
            Some(format!("{}{}{}", &c[1], &c[2], me.token("serial", v)))
        })
    }

    fn gpu_uuids(&mut self, s: &str) -> String {
        static RX: OnceLock<Regex> = OnceLock::new();
        let rx = re(&RX, r"\b(?:GPU|MIG)-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b");
        self.replace(s, rx, |me, c, _, _| Some(me.token("gpu-uuid", &c[0].to_ascii_lowercase())))
    }

    fn macs(&mut self, s: &str) -> String {
        static RX: OnceLock<Regex> = OnceLock::new();
        let rx = re(&RX, r"[0-9A-Fa-f]{2}(?:[:-][0-9A-Fa-f]{2}){5,}");
        self.replace(s, rx, |me, c, before, after| {
            let glued_before = before.chars().next_back().is_some_and(|ch| ch.is_ascii_alphanumeric() || ch == ':' || ch == '_');
            let glued_after = after.chars().next().is_some_and(|ch| ch.is_ascii_alphanumeric() || ch == '_')
                || (after.starts_with(':') && after[1..].starts_with(|ch: char| ch.is_ascii_hexdigit()));
            if glued_before || glued_after {
                return None;
            }
            Some(me.token("mac", &c[0].to_ascii_lowercase().replace('-', ":")))
        })
    }

    fn guids(&mut self, s: &str) -> String {
        static RX: OnceLock<Regex> = OnceLock::new();
        let rx = re(&RX, r"[0-9A-Fa-f]{4}(?::[0-9A-Fa-f]{4}){3}");
        self.replace(s, rx, |me, c, before, after| {
            let glued = |ch: char| ch.is_ascii_alphanumeric() || ch == ':' || ch == '_' || ch == '.';
            if before.chars().next_back().is_some_and(glued) || after.chars().next().is_some_and(glued) {
                return None;
            }
            Some(me.token("guid", &c[0].to_ascii_lowercase()))
        })
    }

    fn ipv6(&mut self, s: &str) -> String {
        static RX: OnceLock<Regex> = OnceLock::new();
        let rx = re(&RX, r"[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*");
        self.replace(s, rx, |me, c, before, after| {
            let glued = |ch: char| ch.is_ascii_alphanumeric() || ch == '_';
            if before.chars().next_back().is_some_and(glued) || after.chars().next().is_some_and(glued) {
                return None;
            }
            // Sentence punctuation after it ("fe80::1.") is not part of the address.
            let full = &c[0];
            let addr = full.trim_end_matches('.');
            let addr = if addr.ends_with("::") { addr } else { addr.trim_end_matches(':') };
            if addr.parse::<std::net::Ipv6Addr>().is_err() || !addr.chars().any(|ch| ch.is_ascii_hexdigit()) {
                return None;
            }
            let ip: std::net::Ipv6Addr = addr.parse().ok()?;
            Some(format!("{}{}", me.token("ip", &ip.to_string()), &full[addr.len()..]))
        })
    }

    fn ipv4(&mut self, s: &str) -> String {
        static RX: OnceLock<Regex> = OnceLock::new();
        let rx = re(&RX, r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}");
        self.replace(s, rx, |me, c, before, after| {
            let glued = |ch: char| ch.is_ascii_alphanumeric() || ch == '_' || ch == '-';
            if before.chars().next_back().is_some_and(|ch| glued(ch) || ch == '.') || after.chars().next().is_some_and(glued) {
                return None;
            }
            // "1.2.3.4.5": more dotted numbers follow.
            if after.starts_with('.') && after[1..].starts_with(|ch: char| ch.is_ascii_digit()) {
                return None;
            }
            let octets: Vec<u32> = c[0].split('.').filter_map(|o| o.parse().ok()).collect();
            if octets.len() != 4 || octets.iter().any(|&o| o > 255) {
                return None;
            }
            let canonical = octets.iter().map(u32::to_string).collect::<Vec<_>>().join(".");
            Some(me.token("ip", &canonical))
        })
    }

    /// Replaces whole-word occurrences of `names` (longest first) in `s`.
    fn words(&mut self, s: &str, names: &[String], kind: &'static str, case_insensitive: bool) -> String {
        if names.is_empty() {
            return s.to_string();
        }
        let alt = names.iter().map(|n| regex::escape(n)).collect::<Vec<_>>().join("|");
        let Ok(rx) = Regex::new(&format!("{}(?:{alt})", if case_insensitive { "(?i)" } else { "" })) else {
            return s.to_string();
        };
        self.replace(s, &rx, |me, c, before, after| {
            if before.chars().next_back().is_some_and(wordy) || after.chars().next().is_some_and(wordy) {
                return None;
            }
            let key = if case_insensitive { c[0].to_ascii_lowercase() } else { c[0].to_string() };
            Some(me.token(kind, &key))
        })
    }

    fn host_names(&mut self, s: &str) -> String {
        let names = self.hosts.clone();
        self.words(s, &names, "host", true)
    }

    fn user_names(&mut self, s: &str) -> String {
        static RX: OnceLock<Regex> = OnceLock::new();
        let rx = re(&RX, r"/(?:home|Users)/([A-Za-z0-9._-]+)");
        for c in rx.captures_iter(s) {
            self.add_user(&c[1]);
        }
        let names = self.users.clone();
        self.words(s, &names, "user", false)
    }
}

/// Whether `redacted` could be `plain` after redaction: equal, except that each token of
/// [`Redactor`]'s (`serial-N`, `gpu-uuid-N`, `mac-N`, `guid-N`, `ip-N`, `host-N`, `user-N`,
/// standing alone) stands for some non-empty text of `plain`. Used by `report diff` to leave
/// out of its differences what a redacted bundle's report hid. False when `redacted` holds
/// no token (then only equality makes them the same).
pub fn could_be_redaction_of(redacted: &str, plain: &str) -> bool {
    static TOKEN: OnceLock<Regex> = OnceLock::new();
    let token = TOKEN.get_or_init(|| {
        Regex::new(r"(?:^|\b)(?:serial|gpu-uuid|mac|guid|ip|host|user)-[0-9]+(?:\b|$)").expect("a valid pattern")
    });
    if !token.is_match(redacted) {
        return false;
    }
    let mut pattern = String::from("^");
    let mut at = 0;
    for m in token.find_iter(redacted) {
        pattern += &regex::escape(&redacted[at..m.start()]);
        pattern += ".+?";
        at = m.end();
    }
    pattern += &regex::escape(&redacted[at..]);
    pattern += "$";
    Regex::new(&pattern).is_ok_and(|re| re.is_match(plain))
}
