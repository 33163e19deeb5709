//! `--precision`: the matmuls' arithmetic, shared by every model family.
//! With bf16, a matmul's products take its input, weight and output
//! gradient rounded to bfloat16 and accumulate in fp32 (a bias's gradient,
//! a sum, from the output gradient's values as they are held). Every
//! backend's matmul rounds its fp32 operands (`MatmulShape::bf16`: the CPU
//! as it packs them, a GPU into its runtime's scratch); the weights come
//! rounded already where the strategy keeps their bf16 copy (`UnitParams`'
//! `Weights`). The family routes its matmuls through [`matmul_forward`]
//! and [`matmul_backward`].

use crate::backend::{Backend, MatmulBackward, MatmulForward, MatmulShape, On};
use crate::error::Result;

/// The arithmetic of the matmuls.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// fp32 everywhere.
    #[default]
    Fp32,
    /// Matmul operands (inputs, weights, output gradients) rounded to
    /// bfloat16, products accumulated in fp32; GPT-2's logits and their
    /// gradient, its norms', q|k|v's (each sum rounded after the bias,
    /// rounded to bf16, is added), attention's, fc's and GELU's outputs
    /// (BERT's intermediate product and GELU output) held in bf16, and GELU's
    /// input gradient (the fc product's output gradient, which its
    /// backward would round) and q|k|v's gradient (its bias's gradient
    /// summed from those values); the weights' bf16 copy beside their fp32
    /// values, which the products read; moments, the other gradients,
    /// their reduction and every other tensor stay fp32.
    Bf16,
}
crate::display_as_flag!(Precision);

/// `op`, its products in bf16 where `bf16`.
pub fn matmul_forward<B: Backend>(be: &B, bf16: bool, op: MatmulForward<On<'_, B>>) -> Result<()> {
    let shape = MatmulShape { bf16, ..op.shape };
    be.run(MatmulForward { shape, ..op })
}

/// `op`, its products in bf16 where `bf16` (the bias's gradient, a sum, is
/// the output gradient's, as it is held, on every backend).
pub fn matmul_backward<B: Backend>(
    be: &B,
    bf16: bool,
    op: MatmulBackward<On<'_, B>>,
) -> Result<()> {
    let shape = MatmulShape { bf16, ..op.shape };
    be.run(MatmulBackward { shape, ..op })
}
