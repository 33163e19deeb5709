//! AdamW state (two moments, laid out like the parameters) and the update
//! that walks the layout, decaying 2-D tensors only (nanoGPT, llm.c).

use super::layout::ParamLayout;
use crate::backend::{AdamWStep, AdamWUpdate, Backend, Bf16, Buf, Category, Dst, Src};
use crate::error::Result;
use serde::{Deserialize, Serialize};
use std::ops::Range;

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

pub struct AdamW<B: Backend> {
    pub config: AdamWConfig,
    pub m: Buf<B>,
    pub v: Buf<B>,
    /// Updates taken so far.
    pub step: u32,
}

impl<B: Backend> AdamW<B> {
    pub fn new(backend: &B, n_params: usize, config: AdamWConfig) -> Result<Self> {
        Ok(AdamW {
            config,
            m: backend.alloc(n_params, Category::Optimizer)?,
            v: backend.alloc(n_params, Category::Optimizer)?,
            step: 0,
        })
    }

    /// One update at learning rate `lr`, gradients multiplied by
    /// `grad_scale` (clipping) on the way in. `params` (and their bf16
    /// copy, where given), `grads` and the moments are local buffers; each
    /// segment maps a run of them to layout offsets, so a shard knows which
    /// elements are decayed 2-D weights.
    #[allow(clippy::too_many_arguments)]
    pub fn update<'p>(
        &mut self,
        backend: &B,
        params: impl Into<Updated<'p, B>>,
        grads: Src<'_, B>,
        layout: &ParamLayout,
        segments: &[Segment],
        lr: f32,
        grad_scale: f32,
    ) -> Result<()> {
        self.step += 1;
        let Updated {
            mut params,
            mut copy,
        } = params.into();
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
            for (r, decay) in decay_runs(layout) {
                let (start, end) = (r.start.max(seg.global), r.end.min(seg.global + seg.len));
                if start >= end {
                    continue;
                }
                let local = seg.local + start - seg.global..seg.local + end - seg.global;
                backend.run(AdamWUpdate {
                    param: params.rb().slice(local.clone()),
                    grad: grads.slice(local.clone()),
                    m: self.m.slice_mut(local.clone()),
                    v: self.v.slice_mut(local.clone()),
                    copy: copy.as_mut().map(|c| c.rb().slice(local)),
                    step: hyper,
                    weight_decay: if decay { c.weight_decay } else { 0.0 },
                })?;
            }
        }
        Ok(())
    }
}

/// The layout's tensors as runs of adjacent ones that are decayed alike,
/// an update's launch each within a segment: GPT-2's 12 a block in 8 (a
/// projection's bias and the next two norm vectors in one), its 148 in 98
/// (110 launches where a rank updates unit by unit: `bench --profile`).
fn decay_runs(layout: &ParamLayout) -> impl Iterator<Item = (Range<usize>, bool)> + '_ {
    let mut tensors = layout.tensors.iter().peekable();
    std::iter::from_fn(move || {
        let t = tensors.next()?;
        let mut r = t.range();
        while let Some(u) = tensors.next_if(|u| u.decay == t.decay && u.offset == r.end) {
            r.end = u.range().end;
        }
        Some((r, t.decay))
    })
}

/// What an update writes: the parameters and, where the strategy keeps
/// one (`--precision bf16`), their bf16 copy, rounded in the same pass.
pub struct Updated<'a, B> {
    pub params: Dst<'a, B>,
    pub copy: Option<Dst<'a, B, Bf16>>,
}

impl<'a, B> From<Dst<'a, B>> for Updated<'a, B> {
    fn from(params: Dst<'a, B>) -> Self {
        Updated { params, copy: None }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GptConfig;

    #[test]
    fn adjacent_tensors_decayed_alike_share_a_run() {
        let layout = ParamLayout::new(&GptConfig::preset("gpt2").unwrap());
        let runs: Vec<_> = decay_runs(&layout).collect();
        assert_eq!((layout.tensors.len(), runs.len()), (148, 98));
        // the runs tile the layout, alternate, and each tensor lies in one
        // run of its own decay
        assert_eq!(runs[0].0.start, 0);
        assert_eq!(runs.last().unwrap().0.end, layout.total());
        for w in runs.windows(2) {
            assert_eq!((w[0].0.end, !w[0].1), (w[1].0.start, w[1].1));
        }
        for t in &layout.tensors {
            let r = t.range();
            let run = runs.iter().find(|(run, _)| run.contains(&r.start)).unwrap();
            assert!(run.0.end >= r.end && run.1 == t.decay, "{}", t.name);
        }
    }
}
