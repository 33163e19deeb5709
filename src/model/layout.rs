//! The flat, block-by-block parameter layout shared by params, grads and
//! both AdamW moments:
//! `[wte | wpe] [block 0] ... [block L-1] [ln_f.w ln_f.b]`, each block
//! `ln1.w ln1.b qkv.w qkv.b attn_proj.w attn_proj.b ln2.w ln2.b fc.w fc.b fc_proj.w fc_proj.b`.
//! Matmul weights are stored (in, out) as Hugging Face's Conv1D.

use super::config::GptConfig;
use std::ops::Range;

/// The tensors of one transformer block, in layout order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockParam {
    Ln1W,
    Ln1B,
    QkvW,
    QkvB,
    AttnProjW,
    AttnProjB,
    Ln2W,
    Ln2B,
    FcW,
    FcB,
    FcProjW,
    FcProjB,
}

impl BlockParam {
    pub const ALL: [BlockParam; 12] = [
        BlockParam::Ln1W,
        BlockParam::Ln1B,
        BlockParam::QkvW,
        BlockParam::QkvB,
        BlockParam::AttnProjW,
        BlockParam::AttnProjB,
        BlockParam::Ln2W,
        BlockParam::Ln2B,
        BlockParam::FcW,
        BlockParam::FcB,
        BlockParam::FcProjW,
        BlockParam::FcProjB,
    ];

    /// Shape for width c on one of `tp` tensor-parallel ranks.
    pub fn shape(self, c: usize, tp: usize) -> Vec<usize> {
        use BlockParam::*;
        let cl = c / tp;
        match self {
            Ln1W | Ln1B | Ln2W | Ln2B | AttnProjB | FcProjB => vec![c],
            QkvW => vec![c, 3 * cl],
            QkvB => vec![3 * cl],
            AttnProjW => vec![cl, c],
            FcW => vec![c, 4 * cl],
            FcB => vec![4 * cl],
            FcProjW => vec![4 * cl, c],
        }
    }

    /// How Megatron splits it: qkv and fc by columns (qkv per q/k/v group,
    /// so each rank holds whole heads), the two projections by rows.
    pub fn tp_split(self) -> TpSplit {
        use BlockParam::*;
        match self {
            QkvW | QkvB => TpSplit::Cols { groups: 3 },
            FcW | FcB => TpSplit::Cols { groups: 1 },
            AttnProjW | FcProjW => TpSplit::Rows,
            _ => TpSplit::Replicated,
        }
    }

    /// The Hugging Face name inside `transformer.h.{i}.`.
    pub fn hf_name(self) -> &'static str {
        use BlockParam::*;
        match self {
            Ln1W => "ln_1.weight",
            Ln1B => "ln_1.bias",
            QkvW => "attn.c_attn.weight",
            QkvB => "attn.c_attn.bias",
            AttnProjW => "attn.c_proj.weight",
            AttnProjB => "attn.c_proj.bias",
            Ln2W => "ln_2.weight",
            Ln2B => "ln_2.bias",
            FcW => "mlp.c_fc.weight",
            FcB => "mlp.c_fc.bias",
            FcProjW => "mlp.c_proj.weight",
            FcProjB => "mlp.c_proj.bias",
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
        let mut out = Vec::new();
        self.for_each_run(full_shape, tp, r, |full_at, len| {
            out.extend_from_slice(&full[full_at..full_at + len])
        });
        out
    }

    /// Writes rank r's part back into the full tensor.
    pub fn unshard(
        self,
        full: &mut [f32],
        local: &[f32],
        full_shape: &[usize],
        tp: usize,
        r: usize,
    ) {
        let mut at = 0;
        self.for_each_run(full_shape, tp, r, |full_at, len| {
            full[full_at..full_at + len].copy_from_slice(&local[at..at + len]);
            at += len;
        });
    }

    /// (offset in the full tensor, length) of each contiguous run of rank r's part, in local order.
    pub fn runs(self, full_shape: &[usize], tp: usize, r: usize) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        self.for_each_run(full_shape, tp, r, |at, len| out.push((at, len)));
        out
    }

    /// Calls f(offset in full, length) for each contiguous run of rank r's part, in local order.
    fn for_each_run(self, shape: &[usize], tp: usize, r: usize, mut f: impl FnMut(usize, usize)) {
        let total: usize = shape.iter().product();
        match self {
            TpSplit::Replicated => f(0, total),
            TpSplit::Rows => {
                let part = total / tp;
                f(r * part, part)
            }
            TpSplit::Cols { groups } => {
                let n = *shape.last().expect("non-scalar");
                let rows = total / n;
                let (w, wl) = (n / groups, n / groups / tp);
                for row in 0..rows {
                    for g in 0..groups {
                        f(row * n + g * w + r * wl, wl);
                    }
                }
            }
        }
    }
}

/// One named tensor inside the flat buffer.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    pub offset: usize,
    /// Shape on this rank (a tensor-parallel part where `split` says so).
    pub shape: Vec<usize>,
    /// Shape of the whole tensor.
    pub full_shape: Vec<usize>,
    pub split: TpSplit,
    /// AdamW decays 2-D tensors only (matmul weights and embeddings).
    pub decay: bool,
}

impl TensorSpec {
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.shape.iter().product::<usize>()
    }
}

#[derive(Clone, Debug)]
pub struct ParamLayout {
    pub tensors: Vec<TensorSpec>,
    block_len: usize,
    blocks_start: usize,
    n_layer: usize,
    c: usize,
}

impl ParamLayout {
    /// The whole model's layout.
    pub fn new(cfg: &GptConfig) -> Self {
        Self::new_tp(cfg, 1)
    }

    /// The layout of one of `tp` tensor-parallel ranks (`tp` divides n_head).
    pub fn new_tp(cfg: &GptConfig, tp: usize) -> Self {
        let c = cfg.n_embd;
        let mut tensors = Vec::new();
        let mut offset = 0;
        let mut push = |name: String, shape: Vec<usize>, full_shape: Vec<usize>, split: TpSplit| {
            let len: usize = shape.iter().product();
            let decay = shape.len() == 2;
            tensors.push(TensorSpec {
                name,
                offset,
                shape,
                full_shape,
                split,
                decay,
            });
            offset += len;
        };
        let rep = TpSplit::Replicated;
        push(
            "transformer.wte.weight".into(),
            vec![cfg.padded_vocab(), c],
            vec![cfg.padded_vocab(), c],
            rep,
        );
        push(
            "transformer.wpe.weight".into(),
            vec![cfg.block_size, c],
            vec![cfg.block_size, c],
            rep,
        );
        let blocks_start = (cfg.padded_vocab() + cfg.block_size) * c;
        for l in 0..cfg.n_layer {
            for p in BlockParam::ALL {
                push(
                    format!("transformer.h.{l}.{}", p.hf_name()),
                    p.shape(c, tp),
                    p.shape(c, 1),
                    p.tp_split(),
                );
            }
        }
        push("transformer.ln_f.weight".into(), vec![c], vec![c], rep);
        push("transformer.ln_f.bias".into(), vec![c], vec![c], rep);
        let block_len = BlockParam::ALL
            .iter()
            .map(|p| p.shape(c, tp).iter().product::<usize>())
            .sum();
        ParamLayout {
            tensors,
            block_len,
            blocks_start,
            n_layer: cfg.n_layer,
            c,
        }
    }

    pub fn total(&self) -> usize {
        self.tensors.last().map_or(0, |t| t.range().end)
    }

    pub fn wte(&self) -> Range<usize> {
        self.tensors[0].range()
    }

    pub fn wpe(&self) -> Range<usize> {
        self.tensors[1].range()
    }

    /// Block l as one contiguous slice (an FSDP unit, a DDP bucket).
    pub fn block(&self, l: usize) -> Range<usize> {
        let start = self.blocks_start + l * self.block_len;
        start..start + self.block_len
    }

    pub fn block_param(&self, l: usize, p: BlockParam) -> Range<usize> {
        self.tensors[2 + l * BlockParam::ALL.len() + p as usize].range()
    }

    /// Offsets of p inside its block's slice.
    pub fn in_block(&self, p: BlockParam) -> Range<usize> {
        let r = self.block_param(0, p);
        let start = self.block(0).start;
        r.start - start..r.end - start
    }

    /// The embedding unit [wte | wpe] as one range.
    pub fn embeddings(&self) -> Range<usize> {
        self.wte().start..self.wpe().end
    }

    /// The final layernorm unit [ln_f.w | ln_f.b].
    pub fn final_norm(&self) -> Range<usize> {
        self.lnf_w().start..self.lnf_b().end
    }

    pub fn lnf_w(&self) -> Range<usize> {
        self.tensors[2 + self.n_layer * BlockParam::ALL.len()].range()
    }

    pub fn lnf_b(&self) -> Range<usize> {
        let r = self.lnf_w();
        r.end..r.end + self.c
    }
}

/// Two disjoint mutable slices of one buffer; `a` must end before `b` starts.
pub fn split2(buf: &mut [f32], a: Range<usize>, b: Range<usize>) -> (&mut [f32], &mut [f32]) {
    assert!(a.end <= b.start, "split2 needs ordered, disjoint ranges");
    let (lo, hi) = buf.split_at_mut(b.start);
    (&mut lo[a], &mut hi[..b.end - b.start])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_contiguous_block_by_block() {
        let cfg = GptConfig::preset("tiny").unwrap();
        let lay = ParamLayout::new(&cfg);
        assert_eq!(lay.total(), cfg.num_params());
        let mut end = 0;
        for t in &lay.tensors {
            assert_eq!(t.offset, end, "{}", t.name);
            end = t.range().end;
        }
        assert_eq!(
            lay.block(0).start,
            lay.block_param(0, BlockParam::Ln1W).start
        );
        assert_eq!(lay.block(1).end, lay.lnf_w().start);
        assert_eq!(
            lay.block_param(1, BlockParam::FcProjB).end,
            lay.block(1).end
        );
        assert_eq!(lay.lnf_b().end, lay.total());
    }

    #[test]
    fn tp_shards_cover_each_tensor_exactly_once() {
        let cfg = GptConfig::preset("tiny").unwrap();
        let full = ParamLayout::new(&cfg);
        let tp = 2;
        for spec in &full.tensors {
            let data: Vec<f32> = (0..spec.range().len()).map(|i| i as f32).collect();
            let mut back = vec![-1.0; data.len()];
            for r in 0..tp {
                let part = spec.split.shard(&data, &spec.full_shape, tp, r);
                let local = ParamLayout::new_tp(&cfg, tp);
                let lspec = local.tensors.iter().find(|t| t.name == spec.name).unwrap();
                assert_eq!(part.len(), lspec.range().len(), "{}", spec.name);
                spec.split
                    .unshard(&mut back, &part, &spec.full_shape, tp, r);
            }
            assert_eq!(back, data, "{}", spec.name);
        }
        // rank 1's q columns of a (C, 3C) qkv weight start at C/2 in the first row.
        let qkv = TpSplit::Cols { groups: 3 };
        let w: Vec<f32> = (0..2 * 12).map(|i| i as f32).collect();
        assert_eq!(qkv.shard(&w, &[2, 12], 2, 1)[..2], [2.0, 3.0]);
    }
}
