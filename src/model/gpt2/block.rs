//! GPT-2's block forward, written once for training and for decoding:
//!
//! ```text
//! x -> ln1 -> qkv -> attention -> x + proj  = res2
//! res2 -> ln2 -> fc -> gelu -> res2 + fcproj = out   (fc's bias added in gelu's passes)
//! ```
//!
//! What differs is a [`BlockMode`]: training runs whole sequences on the
//! weights as they are (bf16 operands when asked) and keeps what the
//! backward reads; decoding runs one position a row on weights packed for
//! few-row products, and attends against a KV cache.

use super::{BlockParam, LN_EPS};
use crate::backend::{
    Activation, ActivationForward, Backend, Dst, LayerNormForward, MatmulForward,
};
use crate::backend::{MatmulShape, On};
use crate::backend::{Src, WeightLayout};
use crate::comm::Comm;
use crate::error::Result;
use crate::model::gpt2::config::BlockDims;
use crate::model::tp::{self, TpPlace};
use crate::model::ParamLayout;

/// Block `l`'s buffers for `rows` rows: its input and output on the
/// residual stream, and every intermediate it writes.
pub struct BlockIo<'a, B: Backend> {
    pub x: Src<'a, B>,
    pub out: Dst<'a, B>,
    /// ln1's output, mean and rstd.
    pub ln1: [Dst<'a, B>; 3],
    pub qkv: Dst<'a, B>,
    pub atty: Dst<'a, B>,
    pub res2: Dst<'a, B>,
    /// ln2's output, mean and rstd.
    pub ln2: [Dst<'a, B>; 3],
    pub fch: Dst<'a, B>,
    pub fch_gelu: Dst<'a, B>,
}

/// How a block's matmuls and attention run.
pub trait BlockMode<B: Backend> {
    /// `op`, whose weight is block parameter `which` (`op.w` its view).
    fn matmul(&mut self, which: BlockParam, op: MatmulForward<On<'_, B>>) -> Result<()>;
    /// atty (rows, cl) from qkv (rows, 3 cl).
    fn attention(&mut self, atty: Dst<'_, B>, qkv: Src<'_, B>) -> Result<()>;
}

/// Block `l`'s forward: `io.out` from `io.x`; `p` is this rank's slice of
/// the block (in `lay`), `place` its tensor-parallel group and place.
pub fn forward<B: Backend>(
    be: &B,
    mode: &mut impl BlockMode<B>,
    io: BlockIo<'_, B>,
    (lay, l, p): (&ParamLayout, usize, Src<'_, B>),
    (rows, d): (usize, BlockDims),
    place: (Option<&dyn Comm>, TpPlace),
) -> Result<()> {
    let BlockDims { c, cl, fl, .. } = d;
    let w = |bp: BlockParam| p.slice(lay.in_block(l, bp));
    let io_shape = |dims| MatmulShape::new(dims, WeightLayout::InOut);
    let BlockIo {
        x,
        out,
        ln1: [mut ln1, mean1, rstd1],
        mut qkv,
        mut atty,
        mut res2,
        ln2: [mut ln2, mean2, rstd2],
        mut fch,
        mut fch_gelu,
    } = io;
    be.run(LayerNormForward {
        out: ln1.rb(),
        mean: mean1,
        rstd: rstd1,
        inp: x,
        w: w(BlockParam::Ln1W),
        b: w(BlockParam::Ln1B),
        c,
        eps: LN_EPS,
    })?;
    let op = MatmulForward {
        out: qkv.rb(),
        inp: ln1.src(),
        w: w(BlockParam::QkvW),
        bias: Some(w(BlockParam::QkvB)),
        shape: io_shape((rows, c, 3 * cl)),
        accumulate: false,
    };
    mode.matmul(BlockParam::QkvW, op)?;
    mode.attention(atty.rb(), qkv.src())?;
    // the two projections are row-parallel under tensor parallelism
    tp::row_parallel(
        be,
        place,
        (res2.rb(), x),
        (
            atty.src(),
            w(BlockParam::AttnProjW),
            w(BlockParam::AttnProjB),
        ),
        io_shape((rows, cl, c)),
        |op| mode.matmul(BlockParam::AttnProjW, op),
    )?;
    be.run(LayerNormForward {
        out: ln2.rb(),
        mean: mean2,
        rstd: rstd2,
        inp: res2.src(),
        w: w(BlockParam::Ln2W),
        b: w(BlockParam::Ln2B),
        c,
        eps: LN_EPS,
    })?;
    let op = MatmulForward {
        out: fch.rb(),
        inp: ln2.src(),
        w: w(BlockParam::FcW),
        bias: None,
        shape: io_shape((rows, c, fl)),
        accumulate: false,
    };
    mode.matmul(BlockParam::FcW, op)?;
    // fc's bias, added in the GELU's pass (and again in its backward)
    be.run(ActivationForward {
        out: fch_gelu.rb(),
        inp: fch.src(),
        bias: Some(w(BlockParam::FcB)),
        act: Activation::GeluTanh,
    })?;
    tp::row_parallel(
        be,
        place,
        (out, res2.src()),
        (
            fch_gelu.src(),
            w(BlockParam::FcProjW),
            w(BlockParam::FcProjB),
        ),
        io_shape((rows, fl, c)),
        |op| mode.matmul(BlockParam::FcProjW, op),
    )
}
