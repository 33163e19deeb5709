//! A GPT-2's rows (attention heads and MLP units) as units of their own:
//! their norms, and the model that keeps some of them (`shrink`) or holds
//! a row-pruned model in the dense shape it came from (`unshrink`, which
//! its Hugging Face export writes), and which rows a sparsity keeps
//! (`select_rows`, by their norms): GPT-2's answer to `prune --method rows`.

use super::config::{BlockDims, BlockWidth};
use super::BlockParam;
use crate::model::family::Scope;
use crate::model::{GptConfig, ParamLayout};

/// Which heads and MLP units of each block a row-pruned model keeps
/// (indices into the model they are chosen from, increasing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeptRows {
    pub heads: Vec<Vec<usize>>,
    pub hidden: Vec<Vec<usize>>,
}

impl KeptRows {
    /// The config of the model that keeps these rows of `cfg`.
    pub fn config(&self, cfg: &GptConfig) -> GptConfig {
        GptConfig {
            blocks: (self.heads.iter().zip(&self.hidden))
                .map(|(h, f)| BlockWidth {
                    heads: h.len(),
                    hidden: f.len(),
                })
                .collect(),
            ..cfg.clone()
        }
    }
}

/// The rows a `sparsity` fraction of row pruning keeps: in each block the
/// heads and MLP units with the largest norms, `round((1 - sparsity) x` the
/// dense count`)` of each kind per block (`Scope::Matrix`) or over all
/// blocks together (`Scope::Global`); at least one head and one unit
/// stays in every block. Ties go to the lower index.
pub fn select_rows(cfg: &GptConfig, params: &[f32], sparsity: f64, scope: Scope) -> KeptRows {
    let (head_norms, unit_norms) = row_norms(cfg, params);
    let keep = |norms: &[Vec<f64>], dense: usize| -> Vec<Vec<usize>> {
        let n = |total: usize| (((1.0 - sparsity) * total as f64).round() as usize).max(1);
        let by_norm = |l: usize| {
            let mut idx: Vec<usize> = (0..norms[l].len()).collect();
            idx.sort_by(|&a, &b| norms[l][b].total_cmp(&norms[l][a]).then(a.cmp(&b)));
            idx
        };
        let mut kept: Vec<Vec<usize>> = match scope {
            Scope::Matrix => (0..norms.len())
                .map(|l| by_norm(l).into_iter().take(n(dense)).collect())
                .collect(),
            Scope::Global => {
                // each block's best row first, then the best of the rest
                let mut kept: Vec<Vec<usize>> =
                    (0..norms.len()).map(|l| vec![by_norm(l)[0]]).collect();
                let mut rest: Vec<(usize, usize)> = (0..norms.len())
                    .flat_map(|l| by_norm(l).into_iter().skip(1).map(move |i| (l, i)))
                    .collect();
                rest.sort_by(|&(la, a), &(lb, b)| {
                    norms[lb][b]
                        .total_cmp(&norms[la][a])
                        .then((la, a).cmp(&(lb, b)))
                });
                let more = n(dense * norms.len()).saturating_sub(norms.len());
                for (l, i) in rest.into_iter().take(more) {
                    kept[l].push(i);
                }
                kept
            }
        };
        kept.iter_mut().for_each(|k| k.sort_unstable());
        kept
    };
    KeptRows {
        heads: keep(&head_norms, cfg.n_head),
        hidden: keep(&unit_norms, 4 * cfg.n_embd),
    }
}

/// The L2 norm of every weight a head owns (its q, k and v columns and
/// biases, its rows of the attention projection) and of every weight an
/// MLP unit owns (its fc column and bias, its fc-projection row), per block.
pub fn row_norms(cfg: &GptConfig, params: &[f32]) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let lay = ParamLayout::new(cfg);
    let (c, d) = (cfg.n_embd, cfg.head_dim());
    let sq = |x: &[f32]| x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>();
    let t = |l, p| &params[lay.block_param(l, p)];
    (0..cfg.n_layer)
        .map(|l| {
            let BlockDims { cl: a, fl: f, .. } = cfg.dims(l, 1);
            let (qkv_w, qkv_b) = (t(l, BlockParam::QkvW), t(l, BlockParam::QkvB));
            let (proj, fc_w, fc_b) = (
                t(l, BlockParam::AttnProjW),
                t(l, BlockParam::FcW),
                t(l, BlockParam::FcB),
            );
            let fc_proj = t(l, BlockParam::FcProjW);
            let heads = (0..a / d)
                .map(|h| {
                    let cols =
                        |row: &[f32]| (0..3).map(|g| sq(&row[g * a + h * d..][..d])).sum::<f64>();
                    let w: f64 = qkv_w.chunks_exact(3 * a).map(cols).sum();
                    (w + cols(qkv_b) + sq(&proj[h * d * c..(h + 1) * d * c])).sqrt()
                })
                .collect();
            let units = (0..f)
                .map(|j| {
                    let col: f64 = (0..c).map(|r| (fc_w[r * f + j] as f64).powi(2)).sum();
                    (col + (fc_b[j] as f64).powi(2) + sq(&fc_proj[j * c..(j + 1) * c])).sqrt()
                })
                .collect();
            (heads, units)
        })
        .unzip()
}

/// `to`'s parameters from `src` (laid out for `from`): the embeddings and
/// head copied, and in each block l head `h` of the source placed as head
/// `rows(l)[0][h]` of the destination and unit `j` as unit `rows(l)[1][j]`
/// (`None`: dropped); the rest of each tensor zero.
fn place(
    from: &GptConfig,
    src: &[f32],
    to: GptConfig,
    rows: impl Fn(usize) -> [Vec<Option<usize>>; 2],
) -> (GptConfig, Vec<f32>) {
    let (fl, tl) = (ParamLayout::new(from), ParamLayout::new(&to));
    let mut dst = vec![0.0; tl.total()];
    for u in [0, fl.units.len() - 1] {
        dst[tl.unit(u)].copy_from_slice(&src[fl.unit(u)]);
    }
    let (c, d) = (from.n_embd, from.head_dim());
    for l in 0..from.n_layer {
        let [heads, hidden] = rows(l);
        let (sa, sf) = (from.dims(l, 1).cl, from.dims(l, 1).fl);
        let (ta, tf) = (to.dims(l, 1).cl, to.dims(l, 1).fl);
        let s = |p| &src[fl.block_param(l, p)];
        for p in [BlockParam::Ln1W, BlockParam::Ln1B, BlockParam::AttnProjB]
            .into_iter()
            .chain([BlockParam::Ln2W, BlockParam::Ln2B, BlockParam::FcProjB])
        {
            dst[tl.block_param(l, p)].copy_from_slice(s(p));
        }
        let (qkv_w, qkv_b) = (
            tl.block_param(l, BlockParam::QkvW),
            tl.block_param(l, BlockParam::QkvB),
        );
        let (proj, fc_w) = (
            tl.block_param(l, BlockParam::AttnProjW),
            tl.block_param(l, BlockParam::FcW),
        );
        let (fc_b, fc_proj) = (
            tl.block_param(l, BlockParam::FcB),
            tl.block_param(l, BlockParam::FcProjW),
        );
        for (h, th) in heads.iter().enumerate() {
            let Some(th) = *th else { continue };
            for r in 0..=c {
                // rows 0..c of the weight, then the bias as row c
                let (from_row, to_row) = match r < c {
                    true => (
                        &s(BlockParam::QkvW)[r * 3 * sa..][..3 * sa],
                        qkv_w.start + r * 3 * ta,
                    ),
                    false => (s(BlockParam::QkvB), qkv_b.start),
                };
                for g in 0..3 {
                    let at = to_row + g * ta + th * d;
                    dst[at..at + d].copy_from_slice(&from_row[g * sa + h * d..][..d]);
                }
            }
            let at = proj.start + th * d * c;
            dst[at..at + d * c].copy_from_slice(&s(BlockParam::AttnProjW)[h * d * c..][..d * c]);
        }
        for (j, tj) in hidden.iter().enumerate() {
            let Some(tj) = *tj else { continue };
            for r in 0..c {
                dst[fc_w.start + r * tf + tj] = s(BlockParam::FcW)[r * sf + j];
            }
            dst[fc_b.start + tj] = s(BlockParam::FcB)[j];
            let at = fc_proj.start + tj * c;
            dst[at..at + c].copy_from_slice(&s(BlockParam::FcProjW)[j * c..][..c]);
        }
    }
    (to, dst)
}

/// The model that keeps only `kept` of `cfg`'s rows: its config and
/// parameters (physically smaller matrices; everything else copied).
pub fn shrink(cfg: &GptConfig, params: &[f32], kept: &KeptRows) -> (GptConfig, Vec<f32>) {
    let map = |kept: &[usize], n: usize| {
        let mut m = vec![None; n];
        kept.iter()
            .enumerate()
            .for_each(|(to, &from)| m[from] = Some(to));
        m
    };
    place(cfg, params, kept.config(cfg), |l| {
        let w = cfg.width(l);
        [map(&kept.heads[l], w.heads), map(&kept.hidden[l], w.hidden)]
    })
}

/// A row-pruned model as the dense shape it came from: each block's heads
/// and units first, the pruned ones zero (a zero head attends to zero
/// values, a zero unit's GELU is zero), so it computes the same function
/// in a shape every GPT-2 reader accepts.
pub fn unshrink(cfg: &GptConfig, params: &[f32]) -> (GptConfig, Vec<f32>) {
    let same = |n: usize| (0..n).map(Some).collect();
    place(cfg, params, cfg.dense(), |l| {
        let w = cfg.width(l);
        [same(w.heads), same(w.hidden)]
    })
}
