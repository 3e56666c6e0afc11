//! Child processes that never outlive kvprobe: the only module with process `unsafe`.
//!
//! kvprobe's helpers (the Mooncake master and store worker) are killed and reaped when their
//! handles drop, on every normal path out of a run. For the abnormal ones — a second Ctrl-C
//! (which exits at once), SIGKILL, a crash — the kernel kills them too: they are started with
//! `PR_SET_PDEATHSIG = SIGKILL` (Linux), so they die when kvprobe's thread that spawned them does.

use std::os::unix::process::CommandExt;
use std::process::Command;

/// Makes the process `cmd` starts receive SIGKILL when the spawning thread of kvprobe exits.
pub fn die_with_parent(cmd: &mut Command) -> &mut Command {
    // SAFETY: the closure runs in the forked child before exec and calls only prctl(2),
    // getppid(2) and _exit(2), which are async-signal-safe; it allocates nothing and touches
    // no locks. If kvprobe already died between fork and prctl, the child exits at once
    // (its parent is no longer the spawner).
    let parent = std::process::id() as libc::pid_t;
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        })
    }
}

/// Makes this process ignore SIGINT and SIGTERM (the decode agent process: a Ctrl-C in the
/// terminal reaches the whole process group, and kvprobe, not the child, decides how to stop;
/// it ends the child by closing its input, or by dying — see [`die_with_parent`]).
pub fn ignore_interrupts() {
    // SAFETY: signal(2) with SIG_IGN installs no handler code; called at the child's start.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
    }
}
