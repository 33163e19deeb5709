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

    /// One update at learning rate `lr`, gradients multiplied by
    /// `grad_scale` (clipping) on the way in. `params`, `grads` and the
    /// moments are local buffers; each segment maps a run of them to layout
    /// offsets, so a shard knows which elements are decayed 2-D weights.
    #[allow(clippy::too_many_arguments)]
    pub fn update<B: Backend>(
        &mut self,
        backend: &B,
        params: &mut [f32],
        grads: &[f32],
        layout: &ParamLayout,
        segments: &[Segment],
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
        for seg in segments {
            for t in &layout.tensors {
                let r = t.range();
                let (start, end) = (r.start.max(seg.global), r.end.min(seg.global + seg.len));
                if start >= end {
                    continue;
                }
                let local = seg.local + start - seg.global..seg.local + end - seg.global;
                let wd = if t.decay { c.weight_decay } else { 0.0 };
                backend.adamw(
                    &mut params[local.clone()],
                    &grads[local.clone()],
                    &mut self.m[local.clone()],
                    &mut self.v[local],
                    hyper,
                    wd,
                );
            }
        }
    }
}

/// `len` elements at `local` in a rank's buffers that are layout offsets `global..`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub global: usize,
    pub local: usize,
    pub len: usize,
}

impl Segment {
    /// A whole, unsharded buffer.
    pub fn whole(len: usize) -> [Segment; 1] {
        [Segment {
            global: 0,
            local: 0,
            len,
        }]
    }
}
