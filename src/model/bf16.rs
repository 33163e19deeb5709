//! `--precision`: the matmuls' arithmetic, shared by every model family.
//! With bf16, a matmul's input, weight and output gradient are copied into
//! scratch and rounded to bfloat16 (products accumulated in fp32); the
//! family routes its matmuls through [`matmul_forward`] and
//! [`matmul_backward`], which pass straight to the backend in fp32.

use super::alloc::ActAlloc;
use crate::backend::{Backend, Buf, Category, Dst, Src, WeightLayout};
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

/// `--precision bf16`'s scratch: the rounded copies of one matmul's input,
/// weight and output gradient.
pub struct Bf16Operands<B: Backend> {
    inp: Buf<B>,
    w: Buf<B>,
    dout: Buf<B>,
}

impl<B: Backend> Bf16Operands<B> {
    /// Room for the largest input, weight and output gradient the model
    /// rounds (in elements; weights count as `Other`, the rest as activations).
    pub fn new(al: &ActAlloc<'_, B>, (inp, w, dout): (usize, usize, usize)) -> Result<Self> {
        Ok(Bf16Operands {
            inp: al.acts(inp)?,
            w: al.typed(w, Category::Other)?,
            dout: al.acts(dout)?,
        })
    }

    /// A rounded copy of `x` in `buf`.
    fn rounded<'s>(be: &B, buf: &'s mut Buf<B>, x: Src<'_, B>) -> Src<'s, B> {
        let mut r = buf.slice_mut(0..x.len());
        be.copy(r.rb(), x);
        be.round_bf16(r.rb());
        r.into_src()
    }
}

/// `Backend::matmul_forward`, with bf16 operands when `bf16` is given.
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward<B: Backend>(
    be: &B,
    bf16: Option<&mut Bf16Operands<B>>,
    out: Dst<'_, B>,
    inp: Src<'_, B>,
    w: Src<'_, B>,
    bias: Option<Src<'_, B>>,
    layout: WeightLayout,
    (rows, k, n): (usize, usize, usize),
    accumulate: bool,
) {
    let Some(ops) = bf16 else {
        return be.matmul_forward(out, inp, w, bias, layout, rows, k, n, accumulate);
    };
    let inp = Bf16Operands::rounded(be, &mut ops.inp, inp.first(rows * k));
    let w = Bf16Operands::rounded(be, &mut ops.w, w.first(k * n));
    be.matmul_forward_bf16(out, inp, w, bias, layout, rows, k, n, accumulate);
}

/// How `matmul_backward` gets the output gradient in bf16: copied and
/// rounded, or already rounded in place by the caller (the logits').
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Dout {
    Round,
    Rounded,
}

/// `Backend::matmul_backward`, with bf16 operands when `bf16` is given.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward<B: Backend>(
    be: &B,
    bf16: Option<&mut Bf16Operands<B>>,
    dinp: Dst<'_, B>,
    dw: Dst<'_, B>,
    dbias: Option<Dst<'_, B>>,
    (dout, how): (Src<'_, B>, Dout),
    inp: Src<'_, B>,
    w: Src<'_, B>,
    layout: WeightLayout,
    (rows, k, n): (usize, usize, usize),
) {
    let Some(ops) = bf16 else {
        return be.matmul_backward(dinp, dw, dbias, dout, inp, w, layout, rows, k, n);
    };
    let dout = match how {
        Dout::Round => Bf16Operands::rounded(be, &mut ops.dout, dout.first(rows * n)),
        Dout::Rounded => dout,
    };
    let inp = Bf16Operands::rounded(be, &mut ops.inp, inp.first(rows * k));
    let w = Bf16Operands::rounded(be, &mut ops.w, w.first(k * n));
    be.matmul_backward_bf16(dinp, dw, dbias, dout, inp, w, layout, rows, k, n);
}
