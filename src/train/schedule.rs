//! Learning rate: linear warmup, then cosine decay to `min_lr` (nanoGPT).

#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct LrSchedule {
    pub max_lr: f32,
    pub min_lr: f32,
    pub warmup_steps: usize,
    pub total_steps: usize,
}

impl LrSchedule {
    /// Learning rate of step `step` (0-based).
    pub fn at(&self, step: usize) -> f32 {
        if step < self.warmup_steps {
            return self.max_lr * (step + 1) as f32 / self.warmup_steps as f32;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
        let progress = ((step - self.warmup_steps) as f32 / span as f32).min(1.0);
        let cosine = 0.5 * (1.0 + (std::f32::consts::PI * progress).cos());
        self.min_lr + cosine * (self.max_lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warms_up_then_decays_to_min() {
        let s = LrSchedule {
            max_lr: 1.0,
            min_lr: 0.1,
            warmup_steps: 10,
            total_steps: 110,
        };
        assert!((s.at(0) - 0.1).abs() < 1e-6);
        assert!((s.at(9) - 1.0).abs() < 1e-6);
        assert!((s.at(60) - 0.55).abs() < 1e-5);
        assert!((s.at(110) - 0.1).abs() < 1e-6);
        assert!(s.at(30) > s.at(31));
    }
}
