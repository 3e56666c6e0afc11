//! What kvprobe is setting up or measuring, for the user: long set-up (pools, NIXL
//! registration, the copy ceiling) and `kvprobe bench` would otherwise be silent for seconds
//! to minutes. The library announces each phase here once; the binary installs a sink that
//! shows it (a spinner on a terminal, one plain line per phase otherwise). Without a sink
//! (library use, tests) announcements go nowhere, except to [`crate::sys::trace::trace!`].

use std::sync::OnceLock;

type Sink = Box<dyn Fn(&str) + Send + Sync>;

static SINK: OnceLock<Sink> = OnceLock::new();

/// Installs the sink every later [`announce`] goes to (the first call wins).
pub fn set_sink(f: impl Fn(&str) + Send + Sync + 'static) {
    let _ = SINK.set(Box::new(f));
}

/// Announces a phase, e.g. `setup: allocating pools (2.0 MiB per side)`. Messages start with
/// their area (`setup:` for a run's set-up, `bench:` for what the bench measures).
pub fn announce(msg: &str) {
    crate::sys::trace::trace!("{msg}");
    if let Some(f) = SINK.get() {
        f(msg);
    }
}
