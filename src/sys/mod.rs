//! Floor sys: the process — children, signals, temporary files, deadlines, host memory, CPU
//! threads, progress phases, byte units, text from outside, test hooks.

#[allow(unsafe_code)] // fork/exec, prctl, close_range
pub mod child;
pub mod deadline;
#[allow(unsafe_code)] // mmap, memfd, raw spans
pub mod hostmem;
#[allow(unsafe_code)] // signal handlers
pub mod interrupt;
pub mod net;
pub mod parallel;
#[allow(unsafe_code)] // set_var while one thread, rlimits, dlopen, _exit
pub mod process;
pub mod progress;
pub mod tempdir;
pub mod test_hooks;
pub mod text;
pub mod trace;
pub mod units;
