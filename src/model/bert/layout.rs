//! BERT's parameter layout, under `BertForMaskedLM` /
//! `BertForSequenceClassification` / `BertForPreTraining` names where a tensor has one:
//! `[word | position | token type | LN]` `[block 0] ... [block L-1]` `[head]`,
//! each block
//! `qkv.w qkv.b attn_out.w attn_out.b attn_ln.w attn_ln.b inter.w inter.b out.w out.b out_ln.w out_ln.b`.
//! Matmul weights are stored (in, out), so Hugging Face's (out, in)
//! `nn.Linear` weights are transposed on the way in and out, and its
//! separate query, key and value are one (C, 3C) `qkv` here (the checkpoint
//! reader splits it). The masked-LM head reads the tied word embeddings.

use super::config::{BertConfig, BertHead};
use crate::model::layout::ParamLayout;
use crate::model::tp::TpSplit;

crate::named_enum! {
    /// The tensors of one encoder block, in layout order.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum BlockParam {
        QkvW = "attention.self.qkv.weight",
        QkvB = "attention.self.qkv.bias",
        AttnOutW = "attention.output.dense.weight",
        AttnOutB = "attention.output.dense.bias",
        AttnLnW = "attention.output.LayerNorm.weight",
        AttnLnB = "attention.output.LayerNorm.bias",
        InterW = "intermediate.dense.weight",
        InterB = "intermediate.dense.bias",
        OutW = "output.dense.weight",
        OutB = "output.dense.bias",
        OutLnW = "output.LayerNorm.weight",
        OutLnB = "output.LayerNorm.bias",
    }
    /// The name inside `bert.encoder.layer.{i}.` (`qkv` is ours: Hugging
    /// Face keeps `attention.self.{query,key,value}`).
    fn name
}

impl BlockParam {
    /// Whole shape for width c and MLP width f.
    pub fn shape(self, c: usize, f: usize) -> Vec<usize> {
        use BlockParam::*;
        match self {
            QkvW => vec![c, 3 * c],
            QkvB => vec![3 * c],
            AttnOutW => vec![c, c],
            InterW => vec![c, f],
            InterB => vec![f],
            OutW => vec![f, c],
            AttnOutB | AttnLnW | AttnLnB | OutB | OutLnW | OutLnB => vec![c],
        }
    }

    /// Megatron's split, as GPT-2's: qkv and the intermediate by columns,
    /// the two output projections by rows.
    pub fn tp_split(self) -> TpSplit {
        use BlockParam::*;
        match self {
            QkvW | QkvB => TpSplit::Cols { groups: 3 },
            InterW | InterB => TpSplit::Cols { groups: 1 },
            AttnOutW | OutW => TpSplit::Rows,
            _ => TpSplit::Replicated,
        }
    }
}

/// Tensors of the embeddings unit, in order.
pub const EMBEDDINGS: [&str; 5] = [
    "bert.embeddings.word_embeddings.weight",
    "bert.embeddings.position_embeddings.weight",
    "bert.embeddings.token_type_embeddings.weight",
    "bert.embeddings.LayerNorm.weight",
    "bert.embeddings.LayerNorm.bias",
];

/// The masked-LM head's tensors, first in the head unit where it is on
/// (the decoder is the tied word embeddings).
pub const HEAD_MLM: [&str; 5] = [
    "cls.predictions.transform.dense.weight",
    "cls.predictions.transform.dense.bias",
    "cls.predictions.transform.LayerNorm.weight",
    "cls.predictions.transform.LayerNorm.bias",
    "cls.predictions.bias",
];

/// The pooler's classifier (weight, bias) under `head`'s Hugging Face
/// names: `BertForPreTraining`'s next-sentence head or a sequence
/// classifier's.
pub fn classifier_names(head: BertHead) -> [&'static str; 2] {
    match head {
        BertHead::Pretrain => ["cls.seq_relationship.weight", "cls.seq_relationship.bias"],
        _ => ["classifier.weight", "classifier.bias"],
    }
}

/// The index in the head unit of its first pooler tensor: after the
/// masked-LM head's where that is on.
pub fn pooler_index(head: BertHead) -> usize {
    match head.has_mlm() {
        true => HEAD_MLM.len(),
        false => 0,
    }
}

/// BERT's layout for one of `tp` tensor-parallel ranks.
pub fn layout(cfg: &BertConfig, tp: usize) -> ParamLayout {
    let (c, f, rep) = (cfg.n_embd, cfg.n_inner, TpSplit::Replicated);
    let mut b = ParamLayout::builder(tp);
    b.unit("embeddings")
        .tensor(EMBEDDINGS[0], &[cfg.padded_vocab(), c], rep)
        .tensor(EMBEDDINGS[1], &[cfg.block_size, c], rep)
        .tensor(EMBEDDINGS[2], &[cfg.type_vocab, c], rep)
        .tensor(EMBEDDINGS[3], &[c], rep)
        .tensor(EMBEDDINGS[4], &[c], rep);
    for l in 0..cfg.n_layer {
        b.unit(format!("block {l}"));
        for p in BlockParam::ALL {
            b.tensor(
                format!("bert.encoder.layer.{l}.{}", p.name()),
                &p.shape(c, f),
                p.tp_split(),
            );
        }
    }
    b.unit("head");
    if cfg.head.has_mlm() {
        b.tensor(HEAD_MLM[0], &[c, c], rep)
            .tensor(HEAD_MLM[1], &[c], rep)
            .tensor(HEAD_MLM[2], &[c], rep)
            .tensor(HEAD_MLM[3], &[c], rep)
            .tensor(HEAD_MLM[4], &[cfg.padded_vocab()], rep)
            .tie(EMBEDDINGS[0]);
    }
    if let Some(labels) = cfg.head.pooled_labels() {
        let [w, bias] = classifier_names(cfg.head);
        b.tensor("bert.pooler.dense.weight", &[c, c], rep)
            .tensor("bert.pooler.dense.bias", &[c], rep)
            .tensor(w, &[c, labels], rep)
            .tensor(bias, &[labels], rep);
    }
    b.build()
}

/// Parameters of the whole model, `None` past `usize` (checked before a
/// layout is built from an untrusted config).
pub fn layout_len(cfg: &BertConfig) -> Option<usize> {
    let (c, f) = (cfg.n_embd as u128, cfg.n_inner as u128);
    let vp = (cfg.vocab_size as u128).div_ceil(64) * 64;
    let emb = (vp + cfg.block_size as u128 + cfg.type_vocab as u128 + 2) * c;
    let block = 4 * c * c + 2 * c * f + f + 9 * c;
    let mlm = match cfg.head.has_mlm() {
        true => c * c + 3 * c + vp,
        false => 0,
    };
    let pooled = cfg
        .head
        .pooled_labels()
        .map_or(0, |labels| c * c + c + (c + 1) * labels as u128);
    let head = mlm + pooled;
    let total = emb + cfg.n_layer as u128 * block + head;
    usize::try_from(total).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_tile_the_layout_and_the_mlm_head_ties_the_word_embeddings() {
        for head in [
            BertHead::Mlm,
            BertHead::Classify { labels: 3 },
            BertHead::Pretrain,
        ] {
            let mut cfg = BertConfig::mini_lm(head);
            cfg.n_layer = 2;
            let lay = layout(&cfg, 1);
            assert_eq!(Some(lay.total()), layout_len(&cfg));
            assert_eq!(lay.units.len(), 4);
            let mut end = 0;
            for u in &lay.units {
                assert_eq!(u.range.start, end, "{}", u.name);
                end = u.range.end;
            }
            assert_eq!(end, lay.total());
            let tied = lay.units[3].tied.as_ref().map(|t| t.range.clone());
            let word = lay.tensor(EMBEDDINGS[0]).unwrap().range();
            match head.has_mlm() {
                true => assert_eq!(tied, Some(word)),
                false => assert_eq!(tied, None),
            }
        }
    }
}
