//! `KVPROBE_TRACE=1`: each set-up step on stderr, so that a crash inside NIXL, UCX or the CUDA
//! driver (which leaves no report) is located by the last line. The macro is
//! `crate::sys::trace::trace!`.

/// True when `KVPROBE_TRACE=1`: kvprobe then prints each setup step to stderr, so a crash
/// inside NIXL, UCX or the CUDA driver (which leaves no report) is located by the last line.
pub fn tracing() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KVPROBE_TRACE").is_ok_and(|v| v == "1"))
}

/// Prints `kvprobe trace [pid]: <message>` to stderr when [`tracing`] is on.
macro_rules! trace {
    ($($t:tt)*) => {
        if $crate::sys::trace::tracing() {
            eprintln!("kvprobe trace [{}]: {}", std::process::id(), format!($($t)*));
        }
    };
}
pub(crate) use trace;
