//! AdamW on a slice of the flat parameter buffer (torch.optim.AdamW's
//! update, decoupled weight decay), as a kernel (`kernels/adamw.cu` on a
//! GPU).

use super::{convert, need, Checked, Extent, Host, Kernel, Lower, Operands, Queued};
use crate::backend::gpu::{groups, u32s, Arg, Queue, Raw, Runtime};
use crate::backend::Bf16;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

operation! {
    /// One AdamW update of a parameter slice and its moments.
    pub struct AdamWUpdate<O> {
        output param: f32,
        input grad: f32,
        output m: f32,
        output v: f32,
        /// The parameters' bf16 copy, rounded from their new values.
        maybe_output copy: Bf16,
        value step: AdamWStep,
        /// 0 for tensors that are not decayed (biases, layernorms).
        value weight_decay: f32,
    }
}

impl<O: Operands> Kernel<O> for AdamWUpdate<O> {
    const NAME: &'static str = "adamw";

    fn check(&self) -> Result<(), String> {
        let n = self.param.extent();
        need("grad", &self.grad, n)?;
        need("m", &self.m, n)?;
        need("v", &self.v, n)?;
        self.copy.as_ref().map_or(Ok(()), |c| need("copy", c, n))
    }

    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>) {
        update(self.lower(host))
    }

    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let op = self.lower(raw);
        let (n, step) = (op.param.len, op.step);
        // The same constants, in f32, as the CPU's.
        let bc1 = 1.0 - step.beta1.powi(step.step as i32);
        let bc2_sqrt = (1.0 - step.beta2.powi(step.step as i32)).sqrt();
        let args = [
            Arg::View(op.param),
            Arg::View(op.grad),
            Arg::View(op.m),
            Arg::View(op.v),
            u32s("n", n)?,
            Arg::F32(step.beta1),
            Arg::F32(step.beta2),
            Arg::F32(step.eps),
            Arg::F32(step.lr / bc1),
            Arg::F32(1.0 - step.lr * op.weight_decay),
            Arg::F32(bc2_sqrt),
            Arg::F32(step.grad_scale),
            // without a copy, any view: the kernel does not write it
            Arg::View(op.copy.unwrap_or(op.param)),
            Arg::U32(u32::from(op.copy.is_some())),
        ];
        q.launch("adamw", groups(n), &args)
    }
}

/// Optimizer hyper-parameters of one step; `step` counts from 1.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub step: u32,
    /// Multiplies every gradient first: gradient clipping fused into the
    /// update, saving a pass over the gradients.
    pub grad_scale: f32,
}

/// Updates param, m, v in place from grad; `weight_decay` is 0 for tensors
/// that are not decayed (biases, layernorms).
fn update(op: AdamWUpdate<Host<'_>>) {
    let AdamWUpdate {
        param,
        grad,
        m,
        v,
        copy,
        step: h,
        weight_decay,
    } = op;
    const CHUNK: usize = 1 << 14;
    let bc1 = 1.0 - h.beta1.powi(h.step as i32);
    let bc2_sqrt = (1.0 - h.beta2.powi(h.step as i32)).sqrt();
    let step_size = h.lr / bc1;
    let decay = 1.0 - h.lr * weight_decay;
    let step = |p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]| {
        for i in 0..p.len() {
            let gi = g[i] * h.grad_scale;
            m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * gi;
            v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * gi * gi;
            let denom = v[i].sqrt() / bc2_sqrt + h.eps;
            p[i] = p[i] * decay - step_size * m[i] / denom;
        }
    };
    let chunks = param
        .par_chunks_mut(CHUNK)
        .zip(grad.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)));
    match copy {
        Some(copy) => chunks
            .zip(copy.par_chunks_mut(CHUNK))
            .for_each(|(((p, g), (m, v)), c)| {
                step(p, g, m, v);
                convert(c, p, false, Bf16::from_f32);
            }),
        None => chunks.for_each(|((p, g), (m, v))| step(p, g, m, v)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adamw_matches_closed_form_first_step() {
        // On step 1, m_hat = g and v_hat = g^2, so the update is lr * g / (|g| + eps).
        let h = AdamWStep {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            step: 1,
            grad_scale: 0.5,
        };
        let mut p = vec![1.0f32, -2.0, 0.5];
        let g = vec![0.3f32, -0.1, 0.0];
        let (mut m, mut v) = (vec![0.0; 3], vec![0.0; 3]);
        update(AdamWUpdate {
            param: &mut p,
            grad: &g,
            m: &mut m,
            v: &mut v,
            copy: None,
            step: h,
            weight_decay: 0.1,
        });
        let want = [1.0 * 0.99 - 0.1, -2.0 * 0.99 + 0.1, 0.5 * 0.99];
        for (a, b) in p.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
    }
}
