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

    /// Shape for width c.
    pub fn shape(self, c: usize) -> Vec<usize> {
        use BlockParam::*;
        match self {
            Ln1W | Ln1B | Ln2W | Ln2B | AttnProjB | FcProjB => vec![c],
            QkvW => vec![c, 3 * c],
            QkvB => vec![3 * c],
            AttnProjW => vec![c, c],
            FcW => vec![c, 4 * c],
            FcB => vec![4 * c],
            FcProjW => vec![4 * c, c],
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

/// One named tensor inside the flat buffer.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    pub offset: usize,
    pub shape: Vec<usize>,
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
    pub fn new(cfg: &GptConfig) -> Self {
        let c = cfg.n_embd;
        let mut tensors = Vec::new();
        let mut offset = 0;
        let mut push = |name: String, shape: Vec<usize>| {
            let len: usize = shape.iter().product();
            let decay = shape.len() == 2;
            tensors.push(TensorSpec {
                name,
                offset,
                shape,
                decay,
            });
            offset += len;
        };
        push("transformer.wte.weight".into(), vec![cfg.padded_vocab(), c]);
        push("transformer.wpe.weight".into(), vec![cfg.block_size, c]);
        let blocks_start = (cfg.padded_vocab() + cfg.block_size) * c;
        for l in 0..cfg.n_layer {
            for p in BlockParam::ALL {
                push(format!("transformer.h.{l}.{}", p.hf_name()), p.shape(c));
            }
        }
        push("transformer.ln_f.weight".into(), vec![c]);
        push("transformer.ln_f.bias".into(), vec![c]);
        let block_len = BlockParam::ALL
            .iter()
            .map(|p| p.shape(c).iter().product::<usize>())
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
}
