//! Data-parallel passes over host memory that never fail for want of a thread.
//!
//! The CPU fill, poison, verify and copy passes split a pool into parts and work on them in
//! parallel. `std::thread::scope`'s `spawn` panics when the OS refuses a thread (EAGAIN under
//! `ulimit -v` or `ulimit -u`), which with NIXL loaded ended in a segfault and no report. Here
//! the parts go through a shared queue: up to `threads - 1` helper threads and the calling
//! thread take parts from it until it is empty, so a refused thread only means fewer workers.

use std::sync::Mutex;

/// Runs `f` once on every item of `items`, on up to `threads` threads (the caller's included;
/// 0 counts as 1). Threads the OS refuses are done without: the caller works through the
/// rest. Returns when every item is done. A panic in `f` propagates as from
/// `std::thread::scope`.
pub fn for_each<T: Send>(items: impl IntoIterator<Item = T>, threads: usize, f: impl Fn(T) + Sync) {
    let queue = Mutex::new(items.into_iter().collect::<Vec<T>>().into_iter());
    let work = || {
        loop {
            let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
            match next {
                Some(item) => f(item),
                None => break,
            }
        }
    };
    std::thread::scope(|sc| {
        for _ in 1..threads.max(1) {
            if std::thread::Builder::new().spawn_scoped(sc, work).is_err() {
                break;
            }
        }
        work();
    });
}
