//! Parallel strategies: how a training step is split over ranks. Every
//! strategy follows `single`'s loss curve for the same seed and global batch.

mod single;

pub use single::Single;

use crate::backend::MemoryReport;
use crate::data::Batch;
use crate::error::Result;

/// What one optimizer step reports.
#[derive(Clone, Copy, Debug)]
pub struct StepStats {
    /// Mean loss over the step's micro-batches.
    pub loss: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
}

/// Optimizer-step settings that do not change the model.
#[derive(Clone, Copy, Debug)]
pub struct StepConfig {
    pub lr: f32,
    /// Clip the global gradient norm to this; 0 disables clipping.
    pub grad_clip: f32,
}

/// One training strategy over its ranks.
pub trait Strategy {
    /// Forward and backward over every micro-batch (gradients accumulate),
    /// then one optimizer update.
    fn step(&mut self, micro_batches: &[Batch], cfg: StepConfig) -> Result<StepStats>;
    /// Mean loss on a batch, without touching gradients.
    fn eval_loss(&mut self, batch: &Batch) -> Result<f32>;
    /// Memory counters of the ranks, by category.
    fn memory(&self) -> MemoryReport;
}
