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
    let sq = |x: &[f32]| x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>();
    (0..cfg.n_layer)
        .map(|l| {
            let d = cfg.dims(l, 1);
            // row i of n's squares in p, summed row by row of p as stored
            let squares = |p: BlockParam, n: usize, i: usize| -> f64 {
                let (t, shape) = (&params[lay.block_param(l, p)], p.shape(d));
                let width = shape[shape.len() - 1];
                let runs = p.tp_split().runs(&shape, n, i);
                let rows = runs.chunk_by(|a, b| a.0 / width == b.0 / width);
                rows.map(|r| r.iter().map(|&(at, len)| sq(&t[at..][..len])).sum::<f64>())
                    .sum()
            };
            let [heads, units]: [Vec<f64>; 2] = [0, 1].map(|k| {
                let n = counts(d)[k];
                let ps = BlockParam::ALL
                    .into_iter()
                    .filter(move |&p| row_kind(p) == Some(k));
                let norm = |i| ps.clone().map(|p| squares(p, n, i)).sum::<f64>().sqrt();
                (0..n).map(norm).collect()
            });
            (heads, units)
        })
        .unzip()
}

/// Which rows own a part of block tensor p (0: the heads, 1: the MLP
/// units; none where every row reads all of it): row i of a kind owns what
/// tensor-parallel rank i holds with a rank for each row of the kind.
fn row_kind(p: BlockParam) -> Option<usize> {
    use BlockParam::*;
    match p {
        QkvW | QkvB | AttnProjW => Some(0),
        FcW | FcB | FcProjW => Some(1),
        _ => None,
    }
}

/// A block's rows of each kind (`row_kind`): its heads, its MLP units.
fn counts(d: BlockDims) -> [usize; 2] {
    [d.nhl, d.fl]
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
    for l in 0..from.n_layer {
        let (rows, fd, td) = (rows(l), from.dims(l, 1), to.dims(l, 1));
        for p in BlockParam::ALL {
            let (s, t) = (&src[fl.block_param(l, p)], tl.block_param(l, p));
            let Some(k) = row_kind(p) else {
                dst[t].copy_from_slice(s);
                continue;
            };
            let runs = |d: BlockDims, i| p.tp_split().runs(&p.shape(d), counts(d)[k], i);
            for (i, ti) in rows[k].iter().enumerate() {
                let Some(ti) = *ti else { continue };
                for ((at, len), (to_at, _)) in runs(fd, i).into_iter().zip(runs(td, ti)) {
                    dst[t.start + to_at..][..len].copy_from_slice(&s[at..][..len]);
                }
            }
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
