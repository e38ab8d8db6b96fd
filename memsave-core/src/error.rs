//! memsave's errors: memsave-common's (they name nothing of Burn's), with the record codec's
//! errors as a state's cause.

pub use memsave_common::error::{panic_text, Error, Result, StateCause};

impl From<crate::train::snapshot::codec::CodecError> for StateCause {
    fn from(error: crate::train::snapshot::codec::CodecError) -> Self {
        StateCause::Codec(Box::new(error))
    }
}
