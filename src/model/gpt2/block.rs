//! GPT-2's block forward, written once for training and for decoding:
//!
//! ```text
//! x -> ln1 -> qkv -> attention -> x + proj  = res2
//! res2 -> ln2 -> fc -> gelu -> res2 + fcproj = out   (fc's bias added in gelu's passes)
//! ```
//!
//! What differs is a [`BlockMode`]: training runs whole sequences on the
//! weights as they are (bf16 products when asked) and keeps what the
//! backward reads; decoding runs one position a row on weights packed for
//! few-row products, and attends against a KV cache.

use super::{BlockParam, LN_EPS};
use crate::backend::{Activation, Backend, Dst, MatmulForward, On, Src, StoredDst, StoredSrc};
use crate::error::Result;
use crate::model::gpt2::config::BlockDims;
use crate::model::ops::{io, Normed, Ops};
use crate::model::tp::{self, RowParallel, TpGroup};
use crate::model::{ParamLayout, Weights};

/// Block `l`'s buffers for `rows` rows: its input and output on the
/// residual stream, and every intermediate it writes.
pub struct BlockIo<'a, B: Backend> {
    pub x: Src<'a, B>,
    pub out: Dst<'a, B>,
    pub ln1: Normed<'a, B>,
    /// q|k|v: in bf16 under `--precision bf16` (attention's input, which
    /// only its bf16 products read).
    pub qkv: StoredDst<'a, B>,
    /// The attention's output: in bf16 under `--precision bf16` (the
    /// projection's input, and its backward's).
    pub atty: StoredDst<'a, B>,
    pub res2: Dst<'a, B>,
    pub ln2: Normed<'a, B>,
    /// The fc product, before its bias: in bf16 under `--precision bf16`
    /// (GELU's input, which widens it).
    pub fch: StoredDst<'a, B>,
    /// GELU's output: in bf16 under `--precision bf16` (the MLP
    /// projection's input, which only its products read).
    pub fch_gelu: StoredDst<'a, B>,
}

/// How a block's matmuls and attention run.
pub trait BlockMode<B: Backend> {
    /// `op`, whose weight is block parameter `which` (`op.w` its view).
    fn matmul(&mut self, which: BlockParam, op: MatmulForward<On<'_, B>>) -> Result<()>;
    /// atty (rows, cl) from qkv (rows, 3 cl).
    fn attention(&mut self, atty: StoredDst<'_, B>, qkv: StoredSrc<'_, B>) -> Result<()>;
}

/// Block `l` of `lay`, as this rank's slice `p` of its parameters.
pub struct BlockParams<'a, B: Backend> {
    pub lay: &'a ParamLayout,
    pub l: usize,
    pub p: Weights<'a, B>,
}

/// A block's forward on `rows` rows of widths `d`: `io.out` from `io.x`,
/// in tensor-parallel group `tp`.
pub fn forward<B: Backend>(
    be: &B,
    mode: &mut impl BlockMode<B>,
    bufs: BlockIo<'_, B>,
    params: BlockParams<'_, B>,
    rows: usize,
    d: BlockDims,
    tp: TpGroup<'_>,
) -> Result<()> {
    let BlockParams { lay, l, p } = params;
    let BlockDims { c, cl, fl, .. } = d;
    use BlockParam::*;
    let at = |bp: BlockParam| lay.in_block(l, bp);
    let ops = Ops::new(be, false, c, LN_EPS, p, None, &at);
    let (w, mw) = (|bp| ops.w(bp), |bp| ops.mw(bp));
    let BlockIo {
        x,
        out,
        mut ln1,
        mut qkv,
        mut atty,
        mut res2,
        mut ln2,
        mut fch,
        mut fch_gelu,
    } = bufs;
    ops.ln(ln1.rb(), x, Ln1W, Ln1B)?;
    let op = MatmulForward {
        out: qkv.rb(),
        inp: ln1.out.src(),
        w: mw(QkvW),
        bias: Some(w(QkvB)),
        residual: None,
        shape: io(rows, c, 3 * cl),
        accumulate: false,
    };
    mode.matmul(QkvW, op)?;
    mode.attention(atty.rb(), qkv.src())?;
    // the two projections are row-parallel under tensor parallelism
    let proj = RowParallel {
        out: res2.rb(),
        residual: x,
        inp: atty.src(),
        w: mw(AttnProjW),
        bias: w(AttnProjB),
    };
    tp::row_parallel(be, tp, proj, io(rows, cl, c), |op| {
        mode.matmul(AttnProjW, op)
    })?;
    ops.ln(ln2.rb(), res2.src(), Ln2W, Ln2B)?;
    let op = MatmulForward {
        out: fch.rb(),
        inp: ln2.out.src(),
        w: mw(FcW),
        bias: None,
        residual: None,
        shape: io(rows, c, fl),
        accumulate: false,
    };
    mode.matmul(FcW, op)?;
    // fc's bias, added in the GELU's pass (and again in its backward)
    ops.act(fch_gelu.rb(), fch.src(), FcB, Activation::GeluTanh)?;
    let proj = RowParallel {
        out,
        residual: res2.src(),
        inp: fch_gelu.src(),
        w: mw(FcProjW),
        bias: w(FcProjB),
    };
    tp::row_parallel(be, tp, proj, io(rows, fl, c), |op| mode.matmul(FcProjW, op))
}
