//! Fused softmax + cross-entropy over a padded vocabulary: columns v..vp are
//! padding, excluded from the softmax, the loss and the gradient. A row
//! whose target is `data::IGNORE` has loss 0 and gradient 0.
//!
//! As kernels: `kernels/crossentropy.cu` on a GPU.

use super::{need, Checked, Extent, Host, Kernel, Lower, Operands, Queued};
use crate::backend::cpu::math::{exp, exp_shifted_sum, row_max, LANES};
use crate::backend::gpu::{u32s, Arg, Queue, Raw, Runtime};
use crate::data::IGNORE;
use rayon::prelude::*;

operation! {
    /// losses (rows) from logits (rows, vp) whose first v columns are real; a
    /// row whose target is `data::IGNORE` has loss 0 (and gradient 0). rows is
    /// `targets.len()`.
    pub struct CrossEntropyForward<O> {
        output losses: f32,
        input logits: f32,
        input targets: u32,
        value v: usize,
        value vp: usize,
    }
}

operation! {
    /// logits (rows, vp) -> dloss * d(sum of losses)/d logits, in place.
    pub struct CrossEntropyBackward<O> {
        output logits: f32,
        input targets: u32,
        value v: usize,
        value vp: usize,
        value dloss: f32,
    }
}

/// A vocabulary of `v` real columns in rows of `vp`.
fn check_vocab(v: usize, vp: usize) -> Result<(), String> {
    if v == 0 || v > vp {
        return Err(format!("need 0 < v <= vp, got v = {v}, vp = {vp}"));
    }
    Ok(())
}

impl<O: Operands> Kernel<O> for CrossEntropyForward<O> {
    const NAME: &'static str = "crossentropy_forward";

    fn check(&self) -> Result<(), String> {
        let rows = self.targets.extent();
        check_vocab(self.v, self.vp)?;
        need("losses", &self.losses, rows)?;
        need("logits", &self.logits, rows * self.vp)
    }

    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>) {
        forward(self.lower(host))
    }

    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let op = self.lower(raw);
        let args = [
            Arg::View(op.losses),
            Arg::View(op.logits),
            Arg::View(op.targets),
            u32s("v", op.v)?,
            u32s("vp", op.vp)?,
        ];
        q.launch("crossentropy_forward", op.targets.len, &args)
    }
}

impl<O: Operands> Kernel<O> for CrossEntropyBackward<O> {
    const NAME: &'static str = "crossentropy_backward";

    fn check(&self) -> Result<(), String> {
        check_vocab(self.v, self.vp)?;
        need("logits", &self.logits, self.targets.extent() * self.vp)
    }

    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>) {
        backward(self.lower(host))
    }

    /// Padding columns' gradients 0.
    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let op = self.lower(raw);
        let args = [
            Arg::View(op.logits),
            Arg::View(op.targets),
            u32s("v", op.v)?,
            u32s("vp", op.vp)?,
            Arg::F32(op.dloss),
        ];
        q.launch("crossentropy_backward_inplace", op.targets.len, &args)
    }
}

/// (max, sum of exp(x - max)) over a row, a vector of lanes at a time.
fn row_max_sum(row: &[f32]) -> (f32, f32) {
    let max = row_max(row);
    let mut lanes = [0.0f32; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(chunk) {
            *l += exp(x - max);
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|&x| exp(x - max)).sum();
    (max, lanes.iter().sum::<f32>() + tail)
}

/// losses (rows) = -log `softmax(logits row)[target]`; logits are (rows, vp).
fn forward(op: CrossEntropyForward<Host<'_>>) {
    let CrossEntropyForward {
        losses,
        logits,
        targets,
        v,
        vp,
    } = op;
    losses[..targets.len()]
        .par_iter_mut()
        .zip(logits.par_chunks(vp).zip(targets.par_iter()))
        .for_each(|(loss, (row, &tgt))| {
            *loss = if tgt == IGNORE {
                0.0
            } else {
                let (max, sum) = row_max_sum(&row[..v]);
                max + sum.ln() - row[tgt as usize]
            };
        });
}

/// logits (rows, vp) become d loss / d logits in place, where the loss is
/// `dloss * sum of row losses`: (softmax - onehot) * dloss, padding zeroed.
fn backward(op: CrossEntropyBackward<Host<'_>>) {
    let CrossEntropyBackward {
        logits,
        targets,
        v,
        vp,
        dloss,
    } = op;
    logits[..targets.len() * vp]
        .par_chunks_mut(vp)
        .zip(targets.par_iter())
        .for_each(|(row, &tgt)| {
            if tgt == IGNORE {
                return row.fill(0.0);
            }
            // exp(x - max) written and summed in one pass, then scaled
            let max = row_max(&row[..v]);
            let inv = dloss / exp_shifted_sum(&mut row[..v], max);
            row[..v].iter_mut().for_each(|x| *x *= inv);
            row[tgt as usize] -= dloss;
            row[v..].fill(0.0);
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::check::*;
    use crate::rng::Rng;

    fn reference(logits: &[f64], targets: &[u32], v: usize, vp: usize) -> Vec<f64> {
        logits
            .chunks(vp)
            .zip(targets)
            .map(|(row, &t)| {
                if t == IGNORE {
                    return 0.0;
                }
                let max = row[..v].iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = row[..v].iter().map(|x| (x - max).exp()).sum();
                max + z.ln() - row[t as usize]
            })
            .collect()
    }

    #[test]
    fn crossentropy_backward_matches_finite_differences_and_ignores_padding() {
        let (v, vp) = (11, 16);
        // an ignored row: no loss, no gradient
        let targets = [0u32, 10, IGNORE, 3, 7];
        let mut rng = Rng::new(8);
        let logits = randn(&mut rng, targets.len() * vp, 2.0);
        let mut losses = vec![0.0; targets.len()];
        forward(CrossEntropyForward {
            losses: &mut losses,
            logits: &logits,
            targets: &targets,
            v,
            vp,
        });
        assert_close(
            "loss",
            &losses,
            &reference(&to64(&logits), &targets, v, vp),
            1e-5,
        );

        let dloss = 0.25f32;
        let mut d = logits.clone();
        backward(CrossEntropyBackward {
            logits: &mut d,
            targets: &targets,
            v,
            vp,
            dloss,
        });
        let fd = finite_diff(&logits, |x| {
            reference(x, &targets, v, vp).iter().sum::<f64>() * dloss as f64
        });
        assert_close("dlogits", &d, &fd, 1e-5);
        assert!(d[2 * vp..3 * vp].iter().all(|&x| x == 0.0) && losses[2] == 0.0);
        for row in d.chunks(vp) {
            assert!(row[v..].iter().all(|&x| x == 0.0));
        }
    }
}
