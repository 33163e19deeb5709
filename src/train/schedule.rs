//! Learning rate: linear warmup, then cosine decay to `min_lr` (nanoGPT).

#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct LrSchedule {
    pub max_lr: f32,
    pub min_lr: f32,
    pub warmup_steps: usize,
    pub total_steps: usize,
}

impl LrSchedule {
    /// Learning rate of step `step` (0-based); `min_lr` past the schedule's
    /// steps (a run extended), warmed up or not.
    pub fn at(&self, step: usize) -> f32 {
        if step >= self.total_steps {
            return self.min_lr;
        }
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

    /// A run extended past a schedule it never finished warming up in runs
    /// at `min_lr`, as past any schedule (it went on warming up: 6e-5 for
    /// 1e-4 at step 6 of a 5-step schedule warming up over 100).
    #[test]
    fn past_its_steps_a_schedule_is_at_min_lr_even_while_warming_up() {
        let s = LrSchedule {
            max_lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 100,
            total_steps: 5,
        };
        assert!((s.at(4) - 5e-5).abs() < 1e-10);
        assert_eq!(s.at(5), 1e-4);
        assert_eq!(s.at(7), 1e-4);
    }
}
