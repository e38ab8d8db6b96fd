//! memsave's one error type: every message names the file, field, value, peer or device at
//! fault.

use std::path::PathBuf;

/// The one error type of memsave. Every message names the file, field or value at fault.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration value is out of its valid range or of the wrong type.
    #[error("invalid value for `{field}`: {message}")]
    InvalidValue {
        /// The field, as a dotted path (`fp16.loss_scale`).
        field: String,
        /// What is wrong and what is expected.
        message: String,
    },
    /// A snapshot that cannot be written or loaded: not one, corrupt, truncated, of another
    /// model, or with a state that fails its checks. Users call these files checkpoints (MMCV's
    /// word, `--resume`), and so does the message.
    #[error("checkpoint {}: {message}", path.display())]
    Snapshot {
        /// The snapshot file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
        /// The typed cause, where one is: the file's format, or a record's bytes.
        #[source]
        source: Option<crate::snapshot::SnapshotCause>,
    },
    /// A configuration file that cannot be used; the message names the key at fault.
    #[error("config {}: {message}", path.display())]
    Config {
        /// The configuration file.
        path: PathBuf,
        /// The key and what is wrong with it.
        message: String,
        /// The TOML parser's or deserialiser's own error, where it found the fault.
        #[source]
        source: Option<toml::de::Error>,
    },
    /// A `--set key=value` argument that cannot be applied, or whose value is wrong.
    #[error("`--set {argument}`: {message}")]
    Override {
        /// The argument as written.
        argument: String,
        /// What is wrong with it.
        message: String,
        /// The deserialiser's own error, where it found the fault.
        #[source]
        source: Option<toml::de::Error>,
    },
    /// A state kept as bytes or JSON (the optimizer's, the loss scaler's, a hook's) that
    /// cannot be read or written.
    #[error("{what}: {source}")]
    State {
        /// The state, in words (`optimizer state`, `loss scaler state`).
        what: String,
        /// Why.
        #[source]
        source: StateCause,
    },
    /// Training data that cannot be read.
    #[error("data: {0}")]
    Data(String),
    /// A data file (an annotation, an image, a detections file) that cannot be used: the file,
    /// what is wrong, and the reader's own error.
    #[error("data: {}: {message}: {source}", path.display())]
    DataFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
        /// The reader's error (XML, image, JSON).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A training step that cannot fit in memory, found before it ran (sizes known up front) or
    /// when the device's allocator gave up (CUDA).
    #[error(
        "not enough memory: {what} needs {}, and {place} {}; {advice}",
        crate::human_bytes(*needed),
        match available {
            Some(bytes) => format!("has {} available", crate::human_bytes(*bytes)),
            None => "could not provide it".to_string(),
        }
    )]
    OutOfMemory {
        /// The buffer or buffers, in words (`the input batch (8 images of 3 x 224 x 224, fp32)`).
        what: String,
        /// Bytes they need.
        needed: u64,
        /// Where (`this machine`, `the GPU`).
        place: String,
        /// Bytes available there, when known.
        available: Option<u64>,
        /// What to change.
        advice: String,
    },
    /// Data-parallel training stopped because a peer failed, was lost or did not answer: the
    /// message names the peer (its rank, or the node) and what happened.
    #[error("data-parallel peer {peer}: {message}")]
    Peer {
        /// The peer at fault, in words (`rank 1`, `node 1 (rank 1)`, `another node`).
        peer: String,
        /// What happened.
        message: String,
        /// The peer's own error, where it failed in this process.
        #[source]
        source: Option<Box<Error>>,
    },
    /// The device failed during a step (lost, reset, a copy between it and the host refused):
    /// the message says what failed and where (the checkpointed segment whose input it was
    /// bringing back).
    #[error("device {device}: {message}")]
    Device {
        /// The device, as Burn names it.
        device: String,
        /// What failed, and what to do.
        message: String,
    },
    /// A thread memsave needed could not be started.
    #[error("could not start {what}: {source}")]
    Thread {
        /// The thread, in words.
        what: String,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// A run's context was entered after the run ended (`RunContext::end`).
    #[error(
        "the run `{run}` has ended: its context cannot be entered again (make a new \
         `RunContext` for a new run)"
    )]
    RunEnded {
        /// The run's name.
        run: String,
    },
    /// A run's context was entered on a thread that holds another run's.
    #[error(
        "cannot enter the run `{entering}` on this thread: the run `{installed}` is installed \
         here (one run per thread at a time: enter `{entering}` on another thread, or after \
         `{installed}`'s guard is dropped)"
    )]
    RunInstalled {
        /// The run already installed on the thread.
        installed: String,
        /// The run that was to be entered.
        entering: String,
    },
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file at fault.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// Why a state could not be read or written ([`Error::State`]).
#[derive(Debug, thiserror::Error)]
pub enum StateCause {
    /// Its JSON.
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    /// Its record bytes (the runtime's record codec: Burn's recorder on 0.21).
    #[error("{0}")]
    Codec(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl Error {
    /// A [`Error::State`] of `what`.
    pub fn state(what: impl Into<String>, source: impl Into<StateCause>) -> Self {
        Error::State {
            what: what.into(),
            source: source.into(),
        }
    }

    /// A [`Error::Snapshot`] of `path` with no typed cause.
    pub fn snapshot(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Snapshot {
            path: path.into(),
            message: message.into(),
            source: None,
        }
    }

    /// A [`Error::DataFile`] of `path`: `message`, caused by `source`.
    pub fn data_file(
        path: impl Into<PathBuf>,
        message: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Error::DataFile {
            path: path.into(),
            message: message.into(),
            source: source.into(),
        }
    }
}

/// `Result` with memsave's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An [`Error::InvalidValue`] for `field`.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::InvalidValue {
            field: field.into(),
            message: message.into(),
        }
    }

    /// The error that ended the step of iteration `iter` of a run writing its snapshots to
    /// `work_dir`: a memory or device failure says which iteration, and that the snapshots
    /// written before it are whole (what to resume from); other errors are returned as they
    /// are.
    pub fn in_step(self, iter: usize, work_dir: &std::path::Path) -> Self {
        let snapshots = format!(
            "the snapshots written before it in {} are whole",
            work_dir.display()
        );
        match self {
            Error::OutOfMemory {
                what,
                needed,
                place,
                available,
                advice,
            } => Error::OutOfMemory {
                what: format!("iteration {iter}: {what}"),
                needed,
                place,
                available,
                advice: format!("{advice}; {snapshots}"),
            },
            Error::Device { device, message } => Error::Device {
                device,
                message: format!("iteration {iter}: {message}; {snapshots}"),
            },
            other => other,
        }
    }

    /// The error of a value inside `section`: an [`Error::InvalidValue`]'s field becomes
    /// `section.field` (a runtime type names its own fields; whoever holds it says where it
    /// is). Other errors are returned as they are.
    pub fn within(self, section: &str) -> Self {
        match self {
            Error::InvalidValue { field, message } => Error::InvalidValue {
                field: format!("{section}.{field}"),
                message,
            },
            other => other,
        }
    }
}

/// The text of a panic's payload (`panic!("...")`, with or without arguments); `None` for any
/// other payload. The one place memsave reads a panic's message.
pub fn panic_text(payload: &(dyn std::any::Any + Send)) -> Option<&str> {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
}
