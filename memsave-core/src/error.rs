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
    },
    /// A configuration file that cannot be used; the message names the key at fault.
    #[error("config {}: {message}", path.display())]
    Config {
        /// The configuration file.
        path: PathBuf,
        /// The key and what is wrong with it.
        message: String,
    },
    /// A `--set key=value` argument that cannot be applied, or whose value is wrong.
    #[error("`--set {argument}`: {message}")]
    Override {
        /// The argument as written.
        argument: String,
        /// What is wrong with it.
        message: String,
    },
    /// Training data that cannot be read.
    #[error("data: {0}")]
    Data(String),
    /// A training step that cannot fit in memory, found before it ran (sizes known up front) or
    /// when the device's allocator gave up (CUDA).
    #[error(
        "not enough memory: {what} needs {}, and {place} {}; {advice}",
        crate::memory::human(*needed),
        match available {
            Some(bytes) => format!("has {} available", crate::memory::human(*bytes)),
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
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file at fault.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
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
