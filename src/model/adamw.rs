//! AdamW state (two moments, laid out like the parameters) and the update
//! that walks the layout, decaying 2-D tensors only (nanoGPT, llm.c).

use super::layout::ParamLayout;
use crate::backend::{AdamWStep, Backend, Buf, Category};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

pub struct AdamW {
    pub config: AdamWConfig,
    pub m: Buf,
    pub v: Buf,
    /// Updates taken so far.
    pub step: u32,
}

impl AdamW {
    pub fn new<B: Backend>(backend: &B, n_params: usize, config: AdamWConfig) -> Self {
        AdamW {
            config,
            m: backend.alloc(n_params, Category::Optimizer),
            v: backend.alloc(n_params, Category::Optimizer),
            step: 0,
        }
    }

    /// One update of every tensor in the layout at learning rate `lr`, with
    /// the gradients multiplied by `grad_scale` (clipping) on the way in.
    #[allow(clippy::too_many_arguments)]
    pub fn update<B: Backend>(
        &mut self,
        backend: &B,
        params: &mut [f32],
        grads: &[f32],
        layout: &ParamLayout,
        lr: f32,
        grad_scale: f32,
    ) {
        self.step += 1;
        let c = self.config;
        let hyper = AdamWStep {
            lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            step: self.step,
            grad_scale,
        };
        for t in &layout.tensors {
            let r = t.range();
            let wd = if t.decay { c.weight_decay } else { 0.0 };
            backend.adamw(
                &mut params[r.clone()],
                &grads[r.clone()],
                &mut self.m[r.clone()],
                &mut self.v[r],
                hyper,
                wd,
            );
        }
    }
}
