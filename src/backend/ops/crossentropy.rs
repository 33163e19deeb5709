//! Fused softmax + cross-entropy over a padded vocabulary: columns v..vp are
//! padding, excluded from the softmax, the loss and the gradient. A row
//! whose target is `data::IGNORE` has loss 0 and gradient 0.
//!
//! The logits are held in fp32 or bf16 (`--precision bf16`, as PyTorch's
//! autocast leaves a bf16 matmul's output); the arithmetic is fp32 either
//! way, a bf16 gradient rounded as it is stored.
//!
//! As kernels: `kernels/crossentropy.cu` on a GPU.

use super::{
    need, via_fp32, widened, Checked, Extent, Host, Kernel, Lower, Operands, Queued, Stored,
};
use crate::backend::cpu::math::{exp, exp_shifted_sum, row_max, Scratch, LANES};
use crate::backend::gpu::{stored_view, u32s, Arg, Queue, Raw, Runtime};
use crate::data::IGNORE;
use rayon::prelude::*;

operation! {
    /// losses (rows) from logits (rows, vp) whose first v columns are real; a
    /// row whose target is `data::IGNORE` has loss 0 (and gradient 0). rows is
    /// `targets.len()`.
    pub struct CrossEntropyForward<O> {
        output losses: f32,
        stored_input logits: f32,
        input targets: u32,
        value v: usize,
        value vp: usize,
    }
}

operation! {
    /// logits (rows, vp) -> dloss * d(sum of losses)/d logits, in place.
    pub struct CrossEntropyBackward<O> {
        stored_output logits: f32,
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
        let (logits, bf16) = stored_view(op.logits);
        let args = [
            Arg::View(op.losses),
            Arg::View(logits),
            Arg::View(op.targets),
            u32s("v", op.v)?,
            u32s("vp", op.vp)?,
            Arg::U32(bf16),
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
        let (logits, bf16) = stored_view(op.logits);
        let args = [
            Arg::View(logits),
            Arg::View(op.targets),
            u32s("v", op.v)?,
            u32s("vp", op.vp)?,
            Arg::F32(op.dloss),
            Arg::U32(bf16),
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
    let loss = |row: &[f32], tgt: u32| match tgt {
        IGNORE => 0.0,
        _ => {
            let (max, sum) = row_max_sum(&row[..v]);
            max + sum.ln() - row[tgt as usize]
        }
    };
    losses[..targets.len()]
        .par_iter_mut()
        .zip(targets.par_iter())
        .enumerate()
        .for_each(|(i, (l, &tgt))| {
            let row = logits.part(i * vp..(i + 1) * vp);
            *l = widened(&WIDE, row, false, |row| loss(row, tgt))
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
    let grad = |row: &mut [f32], tgt: u32| {
        if tgt == IGNORE {
            return row.fill(0.0);
        }
        // exp(x - max) written and summed in one pass, then scaled
        let max = row_max(&row[..v]);
        let inv = dloss / exp_shifted_sum(&mut row[..v], max);
        row[..v].iter_mut().for_each(|x| *x *= inv);
        row[tgt as usize] -= dloss;
        row[v..].fill(0.0);
    };
    let rows = targets.len();
    match logits {
        Stored::F32(logits) => logits[..rows * vp]
            .par_chunks_mut(vp)
            .zip(targets.par_iter())
            .for_each(|(row, &tgt)| grad(row, tgt)),
        Stored::Bf16(logits) => logits[..rows * vp]
            .par_chunks_mut(vp)
            .zip(targets.par_iter())
            .for_each(|(row, &tgt)| via_fp32(&WIDE, row, true, false, |row| grad(row, tgt))),
    }
}

thread_local! {
    /// A bf16 row widened, a thread's.
    static WIDE: Scratch<f32> = const { Scratch::new(Vec::new()) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::check::*;
    use crate::backend::Bf16;
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

    /// Logits held in bf16 give the losses their fp32 values give, and a
    /// gradient that is theirs rounded.
    #[test]
    fn bf16_logits_are_their_fp32_values() {
        let (v, vp) = (11, 16);
        let targets = [0u32, 10, IGNORE, 3];
        let mut rng = Rng::new(9);
        let held: Vec<Bf16> = randn(&mut rng, targets.len() * vp, 2.0)
            .into_iter()
            .map(Bf16::from_f32)
            .collect();
        let wide: Vec<f32> = held.iter().map(|x| x.to_f32()).collect();
        let losses = |logits| {
            let mut losses = vec![f32::NAN; targets.len()];
            forward(CrossEntropyForward {
                losses: &mut losses,
                logits,
                targets: &targets,
                v,
                vp,
            });
            losses
        };
        assert_eq!(losses(Stored::Bf16(&held)), losses(Stored::F32(&wide)));
        let (mut got, mut want) = (held.clone(), wide.clone());
        backward(CrossEntropyBackward {
            logits: Stored::Bf16(&mut got),
            targets: &targets,
            v,
            vp,
            dloss: 0.5,
        });
        backward(CrossEntropyBackward {
            logits: Stored::F32(&mut want),
            targets: &targets,
            v,
            vp,
            dloss: 0.5,
        });
        let rounded: Vec<Bf16> = want.iter().map(|&x| Bf16::from_f32(x)).collect();
        assert!(
            got == rounded,
            "the bf16 gradient is not the fp32 one rounded"
        );
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
            logits: Stored::F32(&logits),
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
            logits: Stored::F32(&mut d),
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
