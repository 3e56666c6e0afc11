//! `serve`'s door: which connections may start a handshake, so that guessing the token is
//! slow and a guesser cannot keep the real client out.
//!
//! - Handshakes run side by side (at most [`MAX_HANDSHAKES`], [`MAX_HANDSHAKES_PER_SOURCE`]
//!   from one source), so a client that holds its handshake open or fails it does not hold
//!   the door shut for the others; one session runs at a time (the others are told serve is
//!   busy).
//! - A source whose handshakes failed (a wrong proof, not a hello, or no hello within the
//!   handshake's bound) more than [`FREE_FAILURES`] times is refused at once, without a
//!   challenge, for a time that doubles with each further failure, from 1 s up to
//!   [`MAX_BLOCK`]: online guessing from one source gets about one guess a minute. Other
//!   sources are not affected; a source's count is forgotten after its proof holds, or after
//!   [`FORGET_AFTER`] without a failure.
//!
//! A source is an IPv4 address, or an IPv6 address's /64 prefix (one host usually holds a
//! whole /64). The state is bounded ([`MAX_SOURCES`]). Times come in as arguments, so the
//! rules are tested without clocks.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Failed handshakes a source may have before it is refused for a while (a mistyped token, a
/// port scan).
pub const FREE_FAILURES: u32 = 3;

/// Longest time a source is refused after a failure.
pub const MAX_BLOCK: Duration = Duration::from_secs(60);

/// A source's failures are forgotten this long after its last one.
pub const FORGET_AFTER: Duration = Duration::from_secs(600);

/// Handshakes in progress at once, from every source together.
pub const MAX_HANDSHAKES: usize = 32;

/// Handshakes in progress at once from one source.
pub const MAX_HANDSHAKES_PER_SOURCE: usize = 4;

/// Sources whose failures are remembered (the oldest is forgotten beyond this).
pub const MAX_SOURCES: usize = 4096;

/// What the door says to a new connection ([`Gate::arrive`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Door {
    /// Start its handshake (counted in progress until [`Gate::leave`]).
    Open,
    /// A session is running: refused, serve is busy.
    Busy,
    /// Its source failed too often: refused for this long still.
    Blocked(Duration),
    /// Too many handshakes in progress (from its source, or in all).
    Crowded,
}

#[derive(Clone, Copy, Debug)]
struct Failures {
    count: u32,
    last: Instant,
    until: Option<Instant>,
}

/// The door's state (see the module's rules).
#[derive(Debug, Default)]
pub struct Gate {
    session: bool,
    in_flight: usize,
    per_source: HashMap<IpAddr, usize>,
    failures: HashMap<IpAddr, Failures>,
}

/// The source `ip` counts under: the address itself (IPv4, an IPv4-mapped IPv6 address as its
/// IPv4), or an IPv6 address's /64 prefix.
pub fn source(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        },
    }
}

/// How long a source is refused after its `count`-th failure: nothing up to
/// [`FREE_FAILURES`], then 1 s, 2 s, 4 s, ... up to [`MAX_BLOCK`].
pub fn block_after(count: u32) -> Duration {
    match count.checked_sub(FREE_FAILURES + 1) {
        None => Duration::ZERO,
        Some(k) => Duration::from_secs(1u64 << k.min(16)).min(MAX_BLOCK),
    }
}

impl Gate {
    /// An open door: no session, no failures.
    pub fn new() -> Gate {
        Gate::default()
    }

    /// A new connection from `ip` at `now`: whether its handshake may start.
    pub fn arrive(&mut self, ip: IpAddr, now: Instant) -> Door {
        let src = source(ip);
        if self.session {
            return Door::Busy;
        }
        if let Some(left) = self.blocked_for(ip, now) {
            return Door::Blocked(left);
        }
        let mine = self.per_source.get(&src).copied().unwrap_or(0);
        if self.in_flight >= MAX_HANDSHAKES || mine >= MAX_HANDSHAKES_PER_SOURCE {
            return Door::Crowded;
        }
        self.in_flight += 1;
        self.per_source.insert(src, mine + 1);
        Door::Open
    }

    /// The handshake of a connection from `ip` that [`Gate::arrive`] opened for is over.
    pub fn leave(&mut self, ip: IpAddr) {
        let src = source(ip);
        self.in_flight = self.in_flight.saturating_sub(1);
        match self.per_source.get(&src).copied().unwrap_or(0) {
            0 | 1 => self.per_source.remove(&src),
            n => self.per_source.insert(src, n - 1),
        };
    }

    /// A handshake from `ip` failed at `now`. Returns how long its source is refused from now
    /// on (`None` while it has failures left).
    pub fn failed(&mut self, ip: IpAddr, now: Instant) -> Option<Duration> {
        let src = source(ip);
        if !self.failures.contains_key(&src) && self.failures.len() >= MAX_SOURCES {
            self.failures.retain(|_, f| now.saturating_duration_since(f.last) < FORGET_AFTER || f.until.is_some_and(|u| u > now));
            if self.failures.len() >= MAX_SOURCES
                && let Some(oldest) = self.failures.iter().min_by_key(|(_, f)| f.last).map(|(k, _)| *k)
            {
                self.failures.remove(&oldest);
            }
        }
        let f = self.failures.entry(src).or_insert(Failures { count: 0, last: now, until: None });
        if now.saturating_duration_since(f.last) >= FORGET_AFTER {
            f.count = 0;
        }
        f.count = f.count.saturating_add(1);
        f.last = now;
        let block = block_after(f.count);
        f.until = (!block.is_zero()).then(|| now + block);
        f.until.map(|_| block)
    }

    /// `ip` proved the token: its source's failures are forgotten, and it takes the session
    /// unless one is running. Errors: the busy refusal's reason.
    pub fn claim(&mut self, ip: IpAddr) -> std::result::Result<(), String> {
        self.failures.remove(&source(ip));
        if self.session {
            return Err("this kvprobe serve is busy with another client".into());
        }
        self.session = true;
        Ok(())
    }

    /// The session has ended: the next client may take one.
    pub fn session_over(&mut self) {
        self.session = false;
    }

    /// Whether a session is running.
    pub fn in_session(&self) -> bool {
        self.session
    }

    /// Failed handshakes counted for `ip`'s source.
    pub fn failures(&self, ip: IpAddr) -> u32 {
        self.failures.get(&source(ip)).map_or(0, |f| f.count)
    }

    /// How long `ip`'s source is still refused at `now` (`None`: not refused).
    pub fn blocked_for(&self, ip: IpAddr, now: Instant) -> Option<Duration> {
        let until = self.failures.get(&source(ip))?.until?;
        (until > now).then(|| until - now)
    }

    /// Handshakes in progress.
    pub fn handshakes(&self) -> usize {
        self.in_flight
    }
}
