//! `--precision`: the matmuls' arithmetic, shared by every model family.
//! With bf16, a matmul's input, weight and output gradient are rounded to
//! bfloat16 (products accumulated in fp32; a bias's gradient, a sum, from
//! the fp32 output gradient): copied into scratch and rounded, or, on a
//! backend whose matmuls round a bf16 shape's operands themselves
//! (`Kernels::MATMUL_ROUNDS_BF16`: the CPU), passed as they are. The
//! family routes its matmuls through [`matmul_forward`] and
//! [`matmul_backward`], which pass straight to the backend in fp32. The
//! scratch is allocated only where the copies are made
//! (`ActAlloc::bf16_copies`); `plan` tallies it and leaves it out for a CPU.

use super::alloc::ActAlloc;
use crate::backend::{Backend, Buf, Category, MatmulBackward, MatmulForward, MatmulShape, On, Src};
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
    /// bfloat16, products accumulated in fp32; weights, moments, gradients,
    /// their reduction and every other kernel stay fp32.
    Bf16,
}
crate::display_as_flag!(Precision);

/// `--precision bf16`'s scratch: the rounded copies of one matmul's input,
/// weight and output gradient.
pub struct Bf16Operands<B: Backend> {
    inp: Buf<B>,
    w: Buf<B>,
    dout: Buf<B>,
}

impl<B: Backend> Bf16Operands<B> {
    /// Room for the largest input, weight and output gradient the model
    /// rounds (in elements; weights count as `Other`, the rest as
    /// activations), or none where the backend's matmuls round them.
    pub fn new(al: &ActAlloc<'_, B>, inp: usize, w: usize, dout: usize) -> Result<Self> {
        let n = usize::from(al.bf16_copies());
        Ok(Bf16Operands {
            inp: al.acts(n * inp)?,
            w: al.typed(n * w, Category::Other)?,
            dout: al.acts(n * dout)?,
        })
    }

    /// A rounded copy of `x` in `buf`, or `x` itself where the backend's
    /// matmuls round it.
    fn rounded<'s>(be: &B, buf: &'s mut Buf<B>, x: Src<'s, B>) -> Src<'s, B> {
        if B::MATMUL_ROUNDS_BF16 {
            return x;
        }
        let mut r = buf.slice_mut(0..x.len());
        be.round_bf16(r.rb(), Some(x));
        r.into_src()
    }
}

/// `Kernels::matmul_forward`, with bf16 operands when `bf16` is given.
pub fn matmul_forward<B: Backend>(
    be: &B,
    bf16: Option<&mut Bf16Operands<B>>,
    op: MatmulForward<On<'_, B>>,
) -> Result<()> {
    let Some(ops) = bf16 else {
        return be.run(op);
    };
    let MatmulShape { rows, k, n, .. } = op.shape;
    be.run(MatmulForward {
        inp: Bf16Operands::rounded(be, &mut ops.inp, op.inp.first(rows * k)),
        w: Bf16Operands::rounded(be, &mut ops.w, op.w.first(k * n)),
        shape: MatmulShape {
            bf16: true,
            ..op.shape
        },
        ..op
    })?;
    Ok(())
}

/// How `matmul_backward` gets the output gradient in bf16: copied and
/// rounded, or already rounded in place by the caller (the logits').
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Dout {
    Round,
    Rounded,
}

/// `Kernels::matmul_backward`, with bf16 operands when `bf16` is given
/// (the output gradient rounded as `how` says).
pub fn matmul_backward<B: Backend>(
    be: &B,
    bf16: Option<&mut Bf16Operands<B>>,
    op: MatmulBackward<On<'_, B>>,
    how: Dout,
) -> Result<()> {
    let Some(ops) = bf16 else {
        return be.run(op);
    };
    let MatmulShape { rows, k, n, .. } = op.shape;
    let MatmulBackward { dbias, .. } = op;
    if let Some(dbias) = dbias {
        // a bias's gradient is a sum, not a product: from the fp32 output
        // gradient, as an activation's backward sums it when fused
        be.run(MatmulBackward {
            dinp: None,
            dw: None,
            dbias: Some(dbias),
            ..op
        })?;
    }
    be.run(MatmulBackward {
        dbias: None,
        dout: match how {
            Dout::Round => Bf16Operands::rounded(be, &mut ops.dout, op.dout.first(rows * n)),
            Dout::Rounded => op.dout,
        },
        inp: Bf16Operands::rounded(be, &mut ops.inp, op.inp.first(rows * k)),
        w: Bf16Operands::rounded(be, &mut ops.w, op.w.first(k * n)),
        shape: MatmulShape {
            bf16: true,
            ..op.shape
        },
        ..op
    })?;
    Ok(())
}
