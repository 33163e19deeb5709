//! A rank's batch in parts, one a thread: `Parts` runs a unit of every
//! part side by side, each part's operations on its own sequences, as
//! thread ranks would but on one copy of the parameters, the gradients
//! and the optimizer state. The parts' gradients are summed into the
//! caller's; their losses (each already divided by the whole batch's loss
//! terms) add up to the batch's mean.
//!
//! Why: on a CPU, two threads sharing every product of one batch
//! measured slower than two thread ranks each running its own half
//! (BENCHMARKS.md, issue 31): the threads meet at every operation and
//! their memory-heavy phases coincide. Parts keep the layout, the
//! checkpoints and every strategy as they are; only a pipeline's stage
//! boundaries, which hold the whole batch's stream, have no place in it
//! (it is no `StageModel`), so `parallel::build` makes parts only for a
//! rank without pipeline stages or tensor parallelism.

use super::unit::{EngineCore, UnitGrads, UnitModel, UnitParams};
use crate::backend::memory::{Buf, Category};
use crate::backend::Backend;
use crate::comm::Comm;
use crate::data::{Batch, LossTerms};
use crate::error::{Error, Result};
use std::ops::Range;

/// Several engines of one family, each running a part of the batch's
/// sequences (see the module comment).
pub struct Parts<B: Backend> {
    parts: Vec<Box<dyn UnitModel<B>>>,
    /// How many parts each slot's batch has rows for (the first ones).
    active: Vec<usize>,
    /// The slot held ([`UnitModel::hold`]).
    at: usize,
    /// Part i's gradient of the unit running backward, for i >= 1 (part 0
    /// accumulates into the caller's), sized for the largest unit.
    shadow: Vec<Buf<B>>,
}

impl<B: Backend> Parts<B> {
    /// `parts` engines of one family, the same layout and settings (at
    /// least one).
    pub fn new(parts: Vec<Box<dyn UnitModel<B>>>) -> Result<Self> {
        let Some(first) = parts.first() else {
            return Err(Error::Config("a batch in no parts".into()));
        };
        let widest = first.layout().widest_unit_grad();
        let be = first.backend();
        let shadow = (1..parts.len())
            .map(|_| be.alloc(widest, Category::Grads))
            .collect::<Result<_>>()?;
        Ok(Parts {
            active: vec![parts.len()],
            at: 0,
            parts,
            shadow,
        })
    }

    /// The rows of a batch of `b` sequences that part i of `n` runs.
    fn rows(b: usize, i: usize, n: usize) -> Range<usize> {
        i * b / n..(i + 1) * b / n
    }
}

impl<B: Backend> UnitModel<B> for Parts<B> {
    fn core(&self) -> &EngineCore<B> {
        self.parts[0].core()
    }
    fn begin(&mut self, batch: &Batch, b: usize, t: usize, loss_terms: LossTerms) -> Result<()> {
        let n = self.parts.len().min(b).max(1);
        self.active.resize(self.active.len().max(self.at + 1), 0);
        self.active[self.at] = n;
        for (i, part) in self.parts[..n].iter_mut().enumerate() {
            let rows = Self::rows(b, i, n);
            part.begin(&batch.rows(b, rows.clone()), rows.len(), t, loss_terms)?;
        }
        Ok(())
    }
    fn outputs(&self) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        for part in &self.parts[..self.active[self.at]] {
            out.extend(part.outputs()?);
        }
        Ok(out)
    }
    fn forward(
        &mut self,
        u: usize,
        p: UnitParams<'_, B>,
        tp: Option<&dyn Comm>,
    ) -> Result<Option<f32>> {
        let be = self.parts[0].backend().clone();
        let (own, tied) = (p.own, p.tied);
        let losses = be
            .threads()
            .for_each_part(&mut self.parts[..self.active[self.at]], |part| {
                part.forward(u, UnitParams { own, tied }, tp)
            });
        let mut loss: Option<f32> = None;
        for l in losses {
            if let Some(l) = l? {
                loss = Some(loss.unwrap_or(0.0) + l);
            }
        }
        Ok(loss)
    }
    fn backward(
        &mut self,
        u: usize,
        p: UnitParams<'_, B>,
        g: UnitGrads<'_, B>,
        tp: Option<&dyn Comm>,
        loss_scale: f32,
    ) -> Result<()> {
        let be = self.parts[0].backend().clone();
        let (own, tied) = (p.own, p.tied);
        let UnitGrads {
            own: mut g_own,
            tied: mut g_tied,
        } = g;
        let (own_len, tied_len) = (g_own.len(), g_tied.as_ref().map_or(0, |d| d.len()));
        let active = self.active[self.at];
        // part 0 into the caller's gradient, the others each into their
        // zeroed scratch
        let first = UnitGrads {
            own: g_own.rb(),
            tied: g_tied.as_mut().map(|d| d.rb()),
        };
        let others = self.shadow.iter_mut().map(|shadow| {
            let mut d = shadow.slice_mut(0..own_len + tied_len);
            be.fill(d.rb(), 0.0);
            let (own, tied) = d.split_at(own_len);
            UnitGrads {
                own,
                tied: (tied_len > 0).then_some(tied),
            }
        });
        let grads = std::iter::once(first).chain(others).map(Some);
        let mut jobs: Vec<_> = self.parts[..active].iter_mut().zip(grads).collect();
        let done = be.threads().for_each_part(&mut jobs, |(part, g)| {
            let g = g.take().expect("each part's gradient is taken once");
            part.backward(u, UnitParams { own, tied }, g, tp, loss_scale)
        });
        drop(jobs);
        done.into_iter().collect::<Result<Vec<()>>>()?;
        for shadow in &self.shadow[..active - 1] {
            be.add_inplace(g_own.rb(), shadow.slice(0..own_len));
            if let Some(d) = g_tied.as_mut() {
                be.add_inplace(d.rb(), shadow.slice(own_len..own_len + tied_len));
            }
        }
        Ok(())
    }
    fn hold(&mut self, slot: usize) {
        self.at = slot;
        self.parts.iter_mut().for_each(|p| p.hold(slot));
    }
    fn free_activations(&mut self) {
        self.parts.iter_mut().for_each(|p| p.free_activations());
    }
    fn batch_parts(&self) -> usize {
        self.parts.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::check::assert_close;
    use crate::backend::cpu::Cpu;
    use crate::backend::Device;
    use crate::model::bert::{BertConfig, BertHead};
    use crate::model::unit::Whole;
    use crate::model::{ModelConfig, Precision, TpPlace};
    use crate::rng::Rng;

    /// A forward and a backward of `batch`: (loss, gradient, outputs).
    fn run<M: UnitModel<Cpu> + ?Sized>(
        w: &mut Whole<Cpu, M>,
        full: &[f32],
        batch: &Batch,
        b: usize,
        t: usize,
    ) -> (f32, Vec<f32>, Vec<f32>) {
        w.load_full(full).unwrap();
        // a gradient accumulated onto, as over micro-batches
        let held: Vec<f32> = (0..w.grads.len()).map(|i| (i % 7) as f32 * 0.01).collect();
        w.engine.backend().upload(w.grads.d(), &held).unwrap();
        let mut terms = batch.loss_terms();
        terms.targets = terms.targets.max(b as f32);
        let loss = w.run_forward(batch, (b, t), terms, None).unwrap();
        let outputs = w.outputs().unwrap();
        w.run_backward(0.5, None, |_, _, _| Ok(())).unwrap();
        let grads = w.engine.backend().to_host(w.grads.s()).unwrap();
        (loss.expect("a batch with targets"), grads, outputs)
    }

    /// One engine on a batch of `b` and `n` engines in parts of it agree:
    /// the loss, every parameter's gradient (the tied ones' included,
    /// accumulated onto what the buffer held) and the outputs.
    fn parts_match_one_engine(model: ModelConfig, b: usize, t: usize, n: usize) {
        let engine = || {
            model
                .engine(Cpu::new(), TpPlace::NONE, false, Precision::Fp32)
                .unwrap()
        };
        let full = model.init_full(11);
        let batch = model.synthetic_batch(&mut Rng::new(5), b, t);
        let mut one = Whole::boxed(engine()).unwrap();
        let parts = Parts::new((0..n).map(|_| engine()).collect()).unwrap();
        let mut parts = Whole::with_engine(parts).unwrap();
        let (loss, grads, outputs) = run(&mut one, &full, &batch, b, t);
        let (p_loss, p_grads, p_outputs) = run(&mut parts, &full, &batch, b, t);
        let what = format!("{} in {n} parts of {b}", model.family());
        assert_close(&format!("{what}: loss"), &[p_loss], &[loss as f64], 1e-5);
        let want: Vec<f64> = grads.iter().map(|&g| g as f64).collect();
        assert_close(&format!("{what}: gradient"), &p_grads, &want, 1e-5);
        let want: Vec<f64> = outputs.iter().map(|&o| o as f64).collect();
        assert_close(&format!("{what}: outputs"), &p_outputs, &want, 1e-5);
        assert!(grads.iter().any(|&g| g != 0.0), "{what}: a gradient at all");
    }

    #[test]
    fn a_batch_in_parts_trains_as_one() {
        let gpt2 = ModelConfig::preset("tiny").unwrap();
        // even, uneven (1 + 2 and 1 + 1 + 2 rows), fewer rows than parts
        for (b, n) in [(4, 2), (3, 2), (4, 3), (1, 2)] {
            parts_match_one_engine(gpt2.clone(), b, 16, n);
        }
        let classify = ModelConfig::preset("bert-tiny").unwrap();
        parts_match_one_engine(classify, 4, 16, 2);
        for head in [BertHead::Mlm, BertHead::Pretrain] {
            let mut bert = BertConfig::preset("bert-tiny").unwrap();
            bert.head = head;
            parts_match_one_engine(ModelConfig::from(bert), 3, 16, 2);
        }
    }
}
