//! SIGINT/SIGTERM handling: the first signal asks the run to stop at the next iteration
//! boundary (the transfer in flight completes, the partial report is written and marked
//! `interrupted`); a second one exits at once with 130.

use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

static FLAG: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// Installs the handlers (idempotent). Errors: the signal handlers cannot be registered.
pub fn install() -> std::io::Result<()> {
    if FLAG.get().is_some() {
        return Ok(());
    }
    let flag = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // A second signal, when the flag is already set, exits with 130.
        signal_hook::flag::register_conditional_shutdown(sig, 130, flag.clone())?;
        signal_hook::flag::register(sig, flag.clone())?;
    }
    let _ = FLAG.set(flag);
    Ok(())
}

/// True once SIGINT or SIGTERM arrived.
pub fn requested() -> bool {
    FLAG.get().is_some_and(|f| f.load(Ordering::SeqCst))
}
