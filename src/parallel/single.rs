//! `single`: one rank holds everything; the reference the others must match.

use super::{StepConfig, StepStats, Strategy};
use crate::backend::{Backend, MemoryReport};
use crate::data::Batch;
use crate::error::Result;
use crate::model::{AdamW, AdamWConfig, Gpt2};

pub struct Single<B: Backend> {
    pub model: Gpt2<B>,
    pub optimizer: AdamW,
    b: usize,
    t: usize,
}

impl<B: Backend> Single<B> {
    /// Micro-batches are (b, t).
    pub fn new(model: Gpt2<B>, adamw: AdamWConfig, b: usize, t: usize) -> Self {
        let optimizer = AdamW::new(model.backend(), model.layout.total(), adamw);
        Single {
            model,
            optimizer,
            b,
            t,
        }
    }
}

impl<B: Backend> Strategy for Single<B> {
    fn step(&mut self, micro_batches: &[Batch], cfg: StepConfig) -> Result<StepStats> {
        let m = &mut self.model;
        m.zero_grads();
        let mut loss_sum = 0.0f64;
        for mb in micro_batches {
            let loss = m
                .forward(&mb.inputs, Some(&mb.targets), self.b, self.t)?
                .expect("targets given");
            loss_sum += loss as f64;
            m.backward(&mb.targets, 1.0 / micro_batches.len() as f32)?;
        }
        let Gpt2 {
            params,
            grads,
            layout,
            backend,
            ..
        } = m;
        let grad_norm = backend.sum_squares(grads).sqrt() as f32;
        let clip_scale = if cfg.grad_clip > 0.0 && grad_norm > cfg.grad_clip {
            cfg.grad_clip / grad_norm
        } else {
            1.0
        };
        self.optimizer
            .update(backend, params, grads, layout, cfg.lr, clip_scale);
        Ok(StepStats {
            loss: (loss_sum / micro_batches.len() as f64) as f32,
            grad_norm,
        })
    }

    fn eval_loss(&mut self, batch: &Batch) -> Result<f32> {
        Ok(self
            .model
            .forward(&batch.inputs, Some(&batch.targets), self.b, self.t)?
            .expect("targets given"))
    }

    fn memory(&self) -> MemoryReport {
        self.model.backend().memory().report()
    }
}
