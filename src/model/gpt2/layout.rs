//! GPT-2's parameter layout:
//! `[wte | wpe] [block 0] ... [block L-1] [ln_f.w ln_f.b]`, each block
//! `ln1.w ln1.b qkv.w qkv.b attn_proj.w attn_proj.b ln2.w ln2.b fc.w fc.b fc_proj.w fc_proj.b`.
//! Matmul weights are stored (in, out) as Hugging Face's Conv1D, so
//! checkpoints need no transposes. The head (ln_f) reads the tied `wte`.

use crate::model::gpt2::config::{BlockDims, GptConfig};
use crate::model::layout::ParamLayout;
use crate::model::tp::TpSplit;
use std::ops::Range;

/// The word embeddings' name (tied to the LM head).
pub const WTE: &str = "transformer.wte.weight";

crate::named_enum! {
    /// The tensors of one transformer block, in layout order.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum BlockParam {
        Ln1W = "ln_1.weight",
        Ln1B = "ln_1.bias",
        QkvW = "attn.c_attn.weight",
        QkvB = "attn.c_attn.bias",
        AttnProjW = "attn.c_proj.weight",
        AttnProjB = "attn.c_proj.bias",
        Ln2W = "ln_2.weight",
        Ln2B = "ln_2.bias",
        FcW = "mlp.c_fc.weight",
        FcB = "mlp.c_fc.bias",
        FcProjW = "mlp.c_proj.weight",
        FcProjB = "mlp.c_proj.bias",
    }
    /// The Hugging Face name inside `transformer.h.{i}.`.
    fn name
}

impl BlockParam {
    /// Shape in a block of widths `d` (residual, attention, MLP).
    pub fn shape(self, d: BlockDims) -> Vec<usize> {
        use BlockParam::*;
        let BlockDims { c, cl, fl, .. } = d;
        match self {
            Ln1W | Ln1B | Ln2W | Ln2B | AttnProjB | FcProjB => vec![c],
            QkvW => vec![c, 3 * cl],
            QkvB => vec![3 * cl],
            AttnProjW => vec![cl, c],
            FcW => vec![c, fl],
            FcB => vec![fl],
            FcProjW => vec![fl, c],
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
}

/// GPT-2's layout for one of `tp` tensor-parallel ranks (`tp` divides
/// every block's heads and MLP units).
pub fn layout(cfg: &GptConfig, tp: usize) -> ParamLayout {
    let (c, rep) = (cfg.n_embd, TpSplit::Replicated);
    let mut b = ParamLayout::builder(tp);
    b.unit("embeddings")
        .tensor(WTE, &[cfg.padded_vocab(), c], rep)
        .tensor("transformer.wpe.weight", &[cfg.block_size, c], rep);
    for l in 0..cfg.n_layer {
        b.unit(format!("block {l}"));
        for p in BlockParam::ALL {
            b.tensor(
                format!("transformer.h.{l}.{}", p.name()),
                &p.shape(cfg.dims(l, 1)),
                p.tp_split(),
            );
        }
    }
    b.unit("head")
        .tensor("transformer.ln_f.weight", &[c], rep)
        .tensor("transformer.ln_f.bias", &[c], rep)
        .tie("transformer.wte.weight")
        .build()
}

/// GPT-2's own accessors.
impl ParamLayout {
    /// The whole model's layout.
    pub fn new(cfg: &GptConfig) -> Self {
        layout(cfg, 1)
    }

    pub fn wte(&self) -> Range<usize> {
        self.unit_tensor(0, 0)
    }

    pub fn wpe(&self) -> Range<usize> {
        self.unit_tensor(0, 1)
    }

    pub fn block_param(&self, l: usize, p: BlockParam) -> Range<usize> {
        self.unit_tensor(1 + l, p as usize)
    }

    /// Offsets of p inside block l's slice.
    pub fn in_block(&self, l: usize, p: BlockParam) -> Range<usize> {
        self.in_unit(1 + l, p as usize)
    }
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
        assert_eq!(lay.block(1).end, lay.head().start);
        assert_eq!(
            lay.block_param(1, BlockParam::FcProjB).end,
            lay.block(1).end
        );
        assert_eq!(lay.head().end, lay.total());
    }
}
