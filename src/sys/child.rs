//! Child processes that never outlive kvprobe and inherit nothing by accident: the only
//! module with process `unsafe`.
//!
//! Every child kvprobe starts (the Mooncake master and store worker, the prefill process of
//! `run --decode-process`, `env`'s probe runs, `nvidia-smi`) goes through [`spawn`] or [`output`]. They
//! are killed and reaped when their handles drop, on every normal path out of a run. For the
//! abnormal ones — a second Ctrl-C (which exits at once), SIGKILL, a crash — the kernel kills
//! them too: they are started with `PR_SET_PDEATHSIG = SIGKILL` (Linux).
//!
//! The death signal fires when the *thread* that forked the child exits, not the process
//! (prctl(2)). A child forked from a short-lived thread (a test's thread, a helper thread of
//! a run) would be killed when that thread ends, while kvprobe still uses it. So every child
//! is forked by one dedicated spawner thread that is started on the first spawn and never
//! exits: it ends only with the process, which is exactly when its children must die.
//! [`spawn`] hands the [`Command`] to that thread and waits for the [`Child`]; the child's
//! pipes and handle work from any thread as usual.
//!
//! Descriptors: a child inherits only stdin, stdout, stderr and the descriptors its spawn
//! names ([`spawn_keeping`]), whatever the parent holds. Rust's std and kvprobe open theirs
//! close-on-exec, but libraries do not all do so (UCX opens its listening and connected
//! sockets without `SOCK_CLOEXEC`, and they would reach the Mooncake master and worker). So
//! in the forked child, before exec, every descriptor from 3 up is marked close-on-exec
//! (`close_range(3, ~0, CLOSE_RANGE_CLOEXEC)`, Linux 5.11; older kernels: `fcntl` on each
//! descriptor below the open-file limit), and only then is the flag cleared on the ones kept
//! — in that child alone, so no other child (spawned at the same time or later) sees them.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Output};
use std::sync::Mutex;
use std::sync::mpsc::{Sender, channel};

type Request = (Command, Sender<std::io::Result<Child>>);

/// The spawner thread's queue; the thread (and so the sender) lives until the process exits.
static SPAWNER: Mutex<Option<Sender<Request>>> = Mutex::new(None);

fn spawner() -> std::io::Result<Sender<Request>> {
    let mut s = SPAWNER.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(tx) = s.as_ref() {
        return Ok(tx.clone());
    }
    let (tx, rx) = channel::<Request>();
    std::thread::Builder::new().name("kvprobe-spawner".into()).spawn(move || {
        // The sender stays in SPAWNER, so `recv` never fails: this thread never exits.
        while let Ok((mut cmd, reply)) = rx.recv() {
            #[allow(clippy::disallowed_methods)] // the one place children are forked
            let _ = reply.send(cmd.spawn());
        }
    })?;
    *s = Some(tx.clone());
    Ok(tx)
}

/// Starts `cmd` from kvprobe's spawner thread (see the module documentation) with
/// `PR_SET_PDEATHSIG = SIGKILL`: the child is killed when kvprobe exits, however it exits.
/// It inherits no descriptor but its standard streams. Errors: the spawner thread cannot
/// start, or the spawn failed (`Command::spawn`'s error).
pub fn spawn(cmd: Command) -> std::io::Result<Child> {
    spawn_keeping(cmd, &[])
}

/// [`spawn`], the child inheriting descriptors `keep` (same numbers) besides its standard
/// streams: kvprobe holds them close-on-exec, and the flag is cleared in the forked child
/// only. The caller keeps them open until this returns. Errors: as [`spawn`]; a kept
/// descriptor that is not open fails the spawn.
pub fn spawn_keeping(mut cmd: Command, keep: &[i32]) -> std::io::Result<Child> {
    inherit_only(&mut cmd, keep.to_vec());
    die_with_parent(&mut cmd);
    let (tx, rx) = channel();
    spawner()?.send((cmd, tx)).map_err(|_| std::io::Error::other("the spawner thread is gone"))?;
    rx.recv().map_err(|_| std::io::Error::other("the spawner thread is gone"))?
}

/// Runs `cmd` to completion like `Command::output` (stdin null, stdout and stderr
/// captured), started through [`spawn`]. Errors as [`spawn`], or reading its output failed.
pub fn output(mut cmd: Command) -> std::io::Result<Output> {
    use std::process::Stdio;
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    spawn(cmd)?.wait_with_output()
}

/// Makes the child `cmd` starts inherit descriptors `keep` and no other but 0, 1 and 2: in
/// the forked child, every descriptor from 3 up is marked close-on-exec, then the flag is
/// cleared on `keep`.
fn inherit_only(cmd: &mut Command, keep: Vec<i32>) -> &mut Command {
    // SAFETY: the closure runs in the forked child before exec and calls only close_range(2)
    // (through syscall(2)), getrlimit(2) and fcntl(2), which are async-signal-safe system
    // calls; it allocates nothing (`keep` was allocated before the fork) and touches no
    // locks. It changes the child's copy of the descriptor table only.
    unsafe {
        cmd.pre_exec(move || {
            let all = libc::syscall(libc::SYS_close_range, 3 as libc::c_uint, libc::c_uint::MAX, libc::CLOSE_RANGE_CLOEXEC);
            if all != 0 {
                // Before Linux 5.11 (ENOSYS, or EINVAL for the flag): each descriptor number
                // below the open-file limit, one by one (EBADF for those not open).
                let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
                let top = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur != libc::RLIM_INFINITY {
                    r.rlim_cur.min(i32::MAX as libc::rlim_t) as i32
                } else {
                    1 << 20
                };
                for fd in 3..top {
                    let flags = libc::fcntl(fd, libc::F_GETFD);
                    if flags >= 0 && flags & libc::FD_CLOEXEC == 0 {
                        libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
                    }
                }
            }
            for &fd in &keep {
                let flags = libc::fcntl(fd, libc::F_GETFD);
                if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        })
    }
}

/// Makes the process `cmd` starts receive SIGKILL when the thread that forks it exits (the
/// spawner thread, which lives as long as kvprobe: only [`spawn`] calls this).
fn die_with_parent(cmd: &mut Command) -> &mut Command {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and calls only prctl(2),
    // getppid(2) and _exit(2), which are async-signal-safe; it allocates nothing and touches
    // no locks. If kvprobe already died between fork and prctl, the child exits at once
    // (its parent is no longer the spawner).
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

/// Takes over the Unix socket this process inherited as descriptor `fd` (the prefill process
/// of `run --decode-process`, started with [`spawn_keeping`]) and marks it close-on-exec again, so
/// nothing this process starts inherits it. Errors: `fd` is not open, or not a socket (a
/// `kvprobe serve --fd N` started by hand with a wrong N); the descriptor is then left alone.
pub fn inherited_socket(fd: i32) -> std::io::Result<std::os::unix::net::UnixStream> {
    use std::os::fd::FromRawFd;
    if fd < 3 {
        return Err(std::io::Error::other(format!("descriptor {fd} is stdin, stdout or stderr")));
    }
    // SAFETY: fcntl(2) on an integer descriptor only reads or sets its flags; an fd that is
    // not open gives EBADF and nothing is changed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat(2) writes a `struct stat` into `st`, which is sized for it; it is read
    // only when the call succeeded.
    let is_socket =
        unsafe { libc::fstat(fd, st.as_mut_ptr()) == 0 && (st.assume_init().st_mode & libc::S_IFMT) == libc::S_IFSOCK };
    if !is_socket {
        return Err(std::io::Error::other(format!("descriptor {fd} is not a socket")));
    }
    // SAFETY: as above; sets FD_CLOEXEC on a descriptor just checked to be open.
    unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) };
    // SAFETY: `fd` is open and a socket (checked above) and was handed to this process for
    // its sole use by its parent (`spawn_keeping`); nothing else in this process owns or closes it,
    // so the stream becomes its only owner.
    Ok(unsafe { std::os::unix::net::UnixStream::from_raw_fd(fd) })
}

/// Makes this process ignore SIGINT, SIGTERM and SIGHUP (the prefill process of `run
/// --decode-process`: a Ctrl-C or a hangup of the terminal reaches the whole process group, and kvprobe,
/// not the child, decides how to stop; it ends the child's session over their socket, or by
/// dying — see [`spawn`]).
pub fn ignore_interrupts() {
    // SAFETY: signal(2) with SIG_IGN installs no handler code; called at the child's start.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
    }
}

/// Flushes every C stdio stream: UCX writes its log and diagnostics through buffered ones,
/// which a process ending with `_exit` (or a child inheriting them) would otherwise lose or repeat.
pub fn flush_c_stdio() {
    // SAFETY: fflush(NULL) flushes all open output streams; it takes the streams' own locks.
    unsafe { libc::fflush(std::ptr::null_mut()) };
}
