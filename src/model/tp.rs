//! Tensor parallelism (Megatron), written once for every family and for
//! decoding: how each tensor is divided among the tp ranks (`TpSplit`),
//! this rank's place (`TpPlace`), a rank's part of a whole-model buffer
//! (`shard_tp`; `TpSplit::runs` says where its elements lie in the whole),
//! and the one rule of the layers themselves: a column-parallel layer needs no communication forward, a
//! row-parallel one sums its ranks' partial products (`row_parallel`: tp
//! rank 0 alone adds the residual and the replicated bias, so the sum is
//! exact), and a column-parallel layer's input gradient is summed in the
//! backward (`all_reduce`).

use super::layout::ParamLayout;
use crate::backend::{AttnShape, Backend, Dst, MatmulForward, MatmulShape, On, Src, StoredSrc};
use crate::comm::{device, Comm};
use crate::error::{Error, Result};

/// One block's widths on one of `tp` tensor-parallel ranks (any family): the residual
/// width `c`, the attention width `cl` (`nhl` heads) and the MLP width `fl`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockDims {
    pub c: usize,
    pub cl: usize,
    pub nhl: usize,
    pub fl: usize,
}

impl BlockDims {
    /// The attention's shape over b sequences of t tokens on this rank,
    /// its products in bf16 where `bf16`.
    pub fn attn(self, b: usize, t: usize, bf16: bool) -> AttnShape {
        AttnShape {
            b,
            t,
            c: self.cl,
            nh: self.nhl,
            bf16,
        }
    }
}

/// How a tensor is divided among tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpSplit {
    Replicated,
    /// The last dimension is `groups` equal groups, each split in tp parts.
    Cols {
        groups: usize,
    },
    /// The first dimension is split in tp parts.
    Rows,
}

impl TpSplit {
    /// Rank r's part of a full tensor of `full_shape` (row-major).
    pub fn shard(self, full: &[f32], full_shape: &[usize], tp: usize, r: usize) -> Vec<f32> {
        let runs = self.runs(full_shape, tp, r);
        let parts: Vec<&[f32]> = runs.iter().map(|&(at, len)| &full[at..at + len]).collect();
        parts.concat()
    }

    /// (offset in the full tensor, length) of each contiguous run of rank r's part, in local order.
    pub fn runs(self, shape: &[usize], tp: usize, r: usize) -> Vec<(usize, usize)> {
        let total: usize = shape.iter().product();
        match self {
            TpSplit::Replicated => vec![(0, total)],
            TpSplit::Rows => vec![(r * (total / tp), total / tp)],
            TpSplit::Cols { groups } => {
                let n = *shape.last().expect("non-scalar");
                let (w, wl) = (n / groups, n / groups / tp);
                let row = move |row| (0..groups).map(move |g| (row * n + g * w + r * wl, wl));
                (0..total / n).flat_map(row).collect()
            }
        }
    }
}

/// Copies tensor-parallel rank `tp`'s part of a whole-model buffer into
/// `out` (laid out as `local`).
pub fn shard_tp(
    full: &[f32],
    whole: &ParamLayout,
    local: &ParamLayout,
    tp: TpPlace,
    out: &mut [f32],
) {
    for (w, l) in whole.tensors.iter().zip(&local.tensors) {
        let part = w
            .split
            .shard(&full[w.range()], &w.full_shape, tp.size, tp.rank);
        out[l.range()].copy_from_slice(&part);
    }
}

/// Refuses a tensor-parallel size of 0 or one that does not divide `n_head`.
pub fn check_heads(n_head: usize, tp: usize) -> Result<()> {
    if tp == 0 || !n_head.is_multiple_of(tp) {
        return Err(Error::Config(format!(
            "n_head ({n_head}) is not divisible by the tensor-parallel size {tp}: choose --tp among the divisors of n_head"
        )));
    }
    Ok(())
}

/// Tensor-parallel placement of this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpPlace {
    pub rank: usize,
    pub size: usize,
}

impl TpPlace {
    /// No tensor parallelism.
    pub const NONE: TpPlace = TpPlace { rank: 0, size: 1 };

    /// This place in group `comm`.
    pub fn in_group(self, comm: Option<&dyn Comm>) -> TpGroup<'_> {
        TpGroup { comm, place: self }
    }
}

/// A layer's tensor-parallel group (none without tensor parallelism) and
/// this rank's place in it.
#[derive(Clone, Copy)]
pub struct TpGroup<'a> {
    pub comm: Option<&'a dyn Comm>,
    pub place: TpPlace,
}

/// A row-parallel layer and the residual it feeds: `out = residual +
/// inp x w + bias`, where this rank holds rows of `w` (and the matching
/// columns of its input).
pub struct RowParallel<'a, B: Backend> {
    pub out: Dst<'a, B>,
    pub residual: Src<'a, B>,
    /// fp32, or stored in bf16 (GPT-2's GELU output under bf16).
    pub inp: StoredSrc<'a, B>,
    pub w: StoredSrc<'a, B>,
    pub bias: Src<'a, B>,
}

/// Completes a sum whose parts the tp ranks hold (a row-parallel layer's
/// output, a column-parallel layer's input gradient); nothing without
/// tensor parallelism.
pub fn all_reduce<B: Backend>(be: &B, tp: Option<&dyn Comm>, buf: Dst<'_, B>) -> Result<()> {
    tp.map_or(Ok(()), |g| device::all_reduce(g, be, buf))
}

/// Runs `layer` in group `tp`: `matmul` runs this rank's partial product,
/// plus the bias if given: tp rank 0 alone goes onto the residual and adds
/// the replicated bias, then the all-reduce sums every rank's part in.
pub fn row_parallel<B: Backend>(
    be: &B,
    tp: TpGroup<'_>,
    layer: RowParallel<'_, B>,
    shape: MatmulShape,
    matmul: impl FnOnce(MatmulForward<On<'_, B>>) -> Result<()>,
) -> Result<()> {
    let (lead, mut out) = (tp.place.rank == 0, layer.out);
    matmul(MatmulForward {
        out: out.rb().into(),
        inp: layer.inp,
        w: layer.w,
        bias: lead.then_some(layer.bias),
        residual: lead.then_some(layer.residual),
        shape,
        accumulate: false,
    })?;
    all_reduce(be, tp.comm, out)
}
