//! The half-precision types a model runs in under mixed precision; each runtime maps them to
//! its Burn's dtype (`PrecisionExt::dtype`).

use std::fmt;

use serde::{Deserialize, Serialize};

/// The half-precision type a model runs in once wrapped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// IEEE half (`torch.half`): MMCV's only choice; needs loss scaling.
    #[default]
    F16,
    /// bfloat16: fp32's range with 8 bits of mantissa.
    Bf16,
}

impl Precision {
    /// The other half type.
    pub fn other(self) -> Precision {
        match self {
            Precision::F16 => Precision::Bf16,
            Precision::Bf16 => Precision::F16,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::F16 => "f16",
            Precision::Bf16 => "bf16",
        })
    }
}
