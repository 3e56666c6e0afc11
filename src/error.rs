//! Errors and the documented exit codes.
//!
//! | code | meaning |
//! |------|---------|
//! | 0 | clean: every block slice verified |
//! | 1 | corruption found (wins over every other outcome) |
//! | 2 | usage, configuration or environment error (bad flag, missing NIXL/GPU) |
//! | 3 | transport or device error during the run (NIXL or CUDA call failed) |
//! | 4 | a wait exceeded `--timeout` (a transfer, its notification, a blocking call; `deadline`) |
//! | 5 | transfer rate below `--min-gbps` (only when given) |
//! | 6 | `kvprobe ab`: an unfenced race mechanism was not detected |
//! | 7 | the run was clean but its report could not be written (it went to stderr) |
//! | 130 | interrupted by SIGINT/SIGTERM (the partial report is written) |

/// Process exit codes, as documented in README.md and `kvprobe --help`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[repr(u8)]
pub enum Exit {
    /// Every block slice verified.
    Clean = 0,
    /// Corruption found.
    Corrupt = 1,
    /// Usage, configuration or environment error.
    Usage = 2,
    /// Transport or device error.
    Transport = 3,
    /// Timeout waiting for a transfer.
    Timeout = 4,
    /// Transfer rate below `--min-gbps`.
    BelowRate = 5,
    /// An unfenced race mechanism was not detected (`kvprobe ab`, or `kvprobe run --race`
    /// whose verdict is `not reproduced`): the probe could not have seen that bug on this setup.
    NotReproduced = 6,
    /// The run was clean, but its report (`--report`, `--json`) could not be written (disk
    /// full, file-size limit, I/O error): the report went to stderr instead
    /// (`report::print_fallback`). A run that was not clean keeps its own code.
    ReportNotWritten = 7,
    /// Interrupted by SIGINT or SIGTERM.
    Interrupted = 130,
}

impl Exit {
    /// The exit code `code` stands for; `None` for a code kvprobe never uses (as another
    /// kvprobe process reports it: a node pair's `done`).
    pub fn from_code(code: u8) -> Option<Exit> {
        [
            Exit::Clean,
            Exit::Corrupt,
            Exit::Usage,
            Exit::Transport,
            Exit::Timeout,
            Exit::BelowRate,
            Exit::NotReproduced,
            Exit::ReportNotWritten,
            Exit::Interrupted,
        ]
        .into_iter()
        .find(|e| *e as u8 == code)
    }
}

/// kvprobe's error type; each variant maps to one exit code ([`Error::exit`]).
#[derive(Clone, Debug, thiserror::Error)]
pub enum Error {
    /// Bad flags or geometry (exit 2).
    #[error("{0}")]
    Usage(String),
    /// Something the run needs is missing on this machine (exit 2).
    #[error("{0}")]
    Environment(String),
    /// A NIXL call failed during the run (exit 3).
    #[error("transport error: {0}")]
    Transport(String),
    /// A CUDA call failed (exit 3).
    #[error("device error: {0}")]
    Device(String),
    /// A wait exceeded its bound: a transfer, its notification or a blocking call (exit 4).
    #[error("timeout: {0}")]
    Timeout(String),
    /// Writing the report failed (exit 2). The message names the path.
    #[error("{0}")]
    Io(String),
    /// SIGINT or SIGTERM arrived (exit 130).
    #[error("interrupted by a signal ({0})")]
    Interrupted(String),
    /// A run that a larger job drives (a `kvprobe bench` sweep) found corruption (exit 1).
    #[error("corruption found: {0}")]
    Corrupt(String),
    /// The run's own accounting does not hold: what the verify passes compared differs from
    /// the plan the verdict rests on, or a test-only fault found nowhere to act (exit 3).
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// The message without the kind's prefix ("transport error: " and the like).
    pub fn detail(&self) -> &str {
        match self {
            Error::Usage(m)
            | Error::Environment(m)
            | Error::Transport(m)
            | Error::Device(m)
            | Error::Timeout(m)
            | Error::Io(m)
            | Error::Interrupted(m)
            | Error::Corrupt(m)
            | Error::Internal(m) => m,
        }
    }

    /// The exit code for this error.
    pub fn exit(&self) -> Exit {
        match self {
            Error::Usage(_) | Error::Environment(_) | Error::Io(_) => Exit::Usage,
            Error::Transport(_) | Error::Device(_) | Error::Internal(_) => Exit::Transport,
            Error::Timeout(_) => Exit::Timeout,
            Error::Interrupted(_) => Exit::Interrupted,
            Error::Corrupt(_) => Exit::Corrupt,
        }
    }

    /// Short machine-readable kind for reports.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Usage(_) => "usage",
            Error::Environment(_) => "environment",
            Error::Transport(_) => "transport",
            Error::Device(_) => "device",
            Error::Timeout(_) => "timeout",
            Error::Io(_) => "io",
            Error::Interrupted(_) => "interrupted",
            Error::Corrupt(_) => "corrupt",
            Error::Internal(_) => "internal",
        }
    }
}

/// Result with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
