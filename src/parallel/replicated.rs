//! single, ddp, zero1, tp and the dp x tp mesh: every data-parallel rank
//! keeps whole parameters and gradients (its tensor-parallel part of them).
//! Gradients are all-reduced per unit as soon as that unit's backward is
//! done, on the last micro-step only. zero1 keeps AdamW moments for its
//! shard alone: it reduce-scatters each unit's gradient instead (its shard
//! is all it updates), updates that shard and all-gathers the parameters —
//! the ZeRO paper's 2Ψ per step, as ddp's all-reduce.

use super::{check_finite, local_rows, OwnedState, StepConfig, StepStats, Strategy, Units};
use crate::backend::{Backend, Buf, Category, MemoryReport, Src};
use crate::comm::{device, Comm, CommStats};
use crate::data::Batch;
use crate::error::Result;
use crate::model::layout::{shard_tp, unshard_tp, TpSplit};
use crate::model::{AdamW, AdamWConfig, Segment, TpPlace, UnitModel, Whole};

pub struct Replicated<B: Backend> {
    model: Whole<B, Box<dyn UnitModel<B>>>,
    opt: AdamW<B>,
    dp: Box<dyn Comm>,
    tp: Option<Box<dyn Comm>>,
    /// Present for zero1.
    zero1: Option<Zero1<B>>,
    b: usize,
    t: usize,
}

impl<B: Backend> Replicated<B> {
    pub fn new(
        engine: Box<dyn UnitModel<B>>,
        dp: Box<dyn Comm>,
        tp: Option<Box<dyn Comm>>,
        zero1: bool,
        adamw: AdamWConfig,
        b: usize,
        t: usize,
    ) -> Result<Self> {
        let model = Whole::with_engine(engine)?;
        let zero1 = match zero1 {
            true => Some(Zero1::new(
                model.backend(),
                Units::new(model.layout(), dp.size()),
            )?),
            false => None,
        };
        let opt_len = zero1
            .as_ref()
            .map_or(model.layout().total(), |z| z.units.shard_total());
        let opt = AdamW::new(model.backend(), opt_len, adamw)?;
        Ok(Replicated {
            model,
            opt,
            dp,
            tp,
            zero1,
            b,
            t,
        })
    }

    fn tp_ref(&self) -> Option<&dyn Comm> {
        self.tp.as_deref()
    }

    /// Forward + backward of one local micro-batch; when `sync`, each
    /// unit's gradient is all-reduced over the data-parallel group (zero1:
    /// reduce-scattered into this rank's shard).
    fn forward_backward(
        &mut self,
        mb: &Batch,
        (loss_terms, loss_scale): (f32, f32),
        sync: bool,
    ) -> Result<f32> {
        let Replicated {
            model,
            dp,
            tp,
            zero1,
            b,
            t,
            ..
        } = self;
        let (n, tp) = (dp.size(), tp.as_deref());
        let loss = model
            .run_forward(mb, (*b / n, *t), loss_terms, tp)?
            .expect("targets given");
        model.run_backward(loss_scale, tp, |be, unit, g| match zero1 {
            Some(z) if sync => z.reduce(dp.as_ref(), be, unit, g.into_src()),
            None if sync && n > 1 => device::all_reduce(dp.as_ref(), be, g),
            _ => Ok(()),
        })?;
        Ok(loss)
    }

    /// Global gradient norm: tensor-parallel parts summed over the tp group,
    /// replicated tensors counted once.
    fn grad_norm(&self) -> Result<f32> {
        let be = self.model.backend();
        if let Some(z) = &self.zero1 {
            // The reduced gradient lives in the shards (their padding is zero).
            let mut sq = [be.sum_squares(z.g_shard.s())?];
            self.dp.all_reduce(&mut sq)?;
            return Ok(sq[0].sqrt() as f32);
        }
        let (mut split, mut rep) = (0.0f64, 0.0f64);
        for t in &self.model.layout().tensors {
            let sq = be.sum_squares(self.model.grads.slice(t.range()))?;
            if t.split == TpSplit::Replicated {
                rep += sq;
            } else {
                split += sq;
            }
        }
        if let Some(tp) = self.tp_ref() {
            let mut x = [split as f32];
            tp.all_reduce(&mut x)?;
            split = x[0] as f64;
        }
        Ok((split + rep).sqrt() as f32)
    }

    fn update(&mut self, lr: f32, scale: f32) -> Result<()> {
        let Whole {
            engine,
            params,
            grads,
        } = &mut self.model;
        let (be, lay) = (engine.backend(), engine.layout());
        let Some(Zero1 { units, g_shard, .. }) = &self.zero1 else {
            self.opt.update(
                be,
                params.d(),
                grads.s(),
                lay,
                &Segment::whole(lay.total()),
                lr,
                scale,
            );
            return Ok(());
        };
        let r = self.dp.rank();
        let segs = units.segments(r);
        let mut p_shard = be.alloc(units.shard_total(), Category::Other)?;
        units.shard_from(be, params.s(), r, p_shard.d());
        self.opt
            .update(be, p_shard.d(), g_shard.s(), lay, &segs, lr, scale);
        let mut gathered = be.alloc(units.max_padded(), Category::Other)?;
        for u in 0..units.ranges.len() {
            let range = units.ranges[u].clone();
            let n = units.shard_len[u] * units.n;
            device::all_gather(
                self.dp.as_ref(),
                be,
                p_shard.slice(units.shard_of(u)),
                gathered.slice_mut(0..n),
            )?;
            be.copy(
                params.slice_mut(range.clone()),
                gathered.slice(0..range.len()),
            );
        }
        Ok(())
    }
}

/// zero1's own state: the units whose shards this rank updates, its shard
/// of the reduced gradient, and a unit's gradient padded for the
/// reduce-scatter.
struct Zero1<B: Backend> {
    units: Units,
    g_shard: Buf<B>,
    padded: Buf<B>,
}

impl<B: Backend> Zero1<B> {
    fn new(be: &B, units: Units) -> Result<Self> {
        Ok(Zero1 {
            g_shard: be.alloc(units.shard_total(), Category::Other)?,
            padded: be.alloc(units.max_padded(), Category::Other)?,
            units,
        })
    }

    /// Reduce-scatters unit `u`'s gradient `g` (its whole range) over `dp`
    /// into this rank's shard of it.
    fn reduce(&mut self, dp: &dyn Comm, be: &B, u: usize, g: Src<'_, B>) -> Result<()> {
        let (len, padded) = (g.len(), self.units.shard_len[u] * self.units.n);
        debug_assert_eq!(len, self.units.ranges[u].len());
        be.copy(self.padded.slice_mut(0..len), g);
        be.fill(self.padded.slice_mut(len..padded), 0.0);
        device::reduce_scatter(
            dp,
            be,
            self.padded.slice(0..padded),
            self.g_shard.slice_mut(self.units.shard_of(u)),
        )
    }
}

impl<B: Backend> Strategy for Replicated<B> {
    fn step(&mut self, micro_batches: &[Batch], cfg: StepConfig) -> Result<StepStats> {
        let (r, n) = (self.dp.rank(), self.dp.size());
        self.model.zero_grads();
        let scale = 1.0 / (micro_batches.len() * n) as f32;
        let mut loss = [0.0f32];
        for (i, mb) in micro_batches.iter().enumerate() {
            let local = local_rows(mb, self.b, r, n);
            let terms = mb.loss_terms() as f32 / n as f32;
            loss[0] +=
                self.forward_backward(&local, (terms, scale), i + 1 == micro_batches.len())?;
        }
        self.dp.all_reduce(&mut loss)?;
        let grad_norm = self.grad_norm()?;
        check_finite(loss[0], grad_norm)?;
        let clip = if cfg.grad_clip > 0.0 && grad_norm > cfg.grad_clip {
            cfg.grad_clip / grad_norm
        } else {
            1.0
        };
        self.update(cfg.lr, clip)?;
        self.model.backend().synchronize()?;
        Ok(StepStats {
            loss: loss[0] / (n * micro_batches.len()) as f32,
            grad_norm,
        })
    }

    fn eval_loss(&mut self, batch: &Batch) -> Result<f32> {
        let (r, n) = (self.dp.rank(), self.dp.size());
        let local = local_rows(batch, self.b, r, n);
        let tp = self.tp.as_deref();
        let terms = batch.loss_terms() as f32 / n as f32;
        let mut loss = [self
            .model
            .run_forward(&local, (self.b / n, self.t), terms, tp)?
            .expect("targets")];
        self.dp.all_reduce(&mut loss)?;
        Ok(loss[0] / n as f32)
    }

    fn eval_outputs(&mut self, batch: &Batch) -> Result<(f32, Vec<f32>)> {
        let loss = self.eval_loss(batch)?;
        let mine = self.model.engine.outputs()?;
        let mut all = vec![0.0; mine.len() * self.dp.size()];
        self.dp.all_gather(&mine, &mut all)?;
        Ok((loss, all))
    }

    fn full_params(&mut self) -> Result<Vec<f32>> {
        let local = self.model.params_host()?;
        let Some(tp) = self.tp_ref() else {
            return Ok(local);
        };
        let local_len = local.len();
        let mut all = vec![0.0; local_len * tp.size()];
        tp.all_gather(&local, &mut all)?;
        let whole = self.model.whole_layout();
        let mut full = vec![0.0; whole.total()];
        for r in 0..tp.size() {
            let place = TpPlace {
                rank: r,
                size: tp.size(),
            };
            unshard_tp(
                &all[r * local_len..(r + 1) * local_len],
                whole,
                self.model.layout(),
                place,
                &mut full,
            );
        }
        Ok(full)
    }

    fn load_full(&mut self, full: &[f32]) -> Result<()> {
        self.model.load_full(full)
    }

    fn owned_state(&self) -> Result<OwnedState> {
        let mut st = OwnedState::default();
        let be = self.model.backend();
        let (p, m, v) = (
            be.read(self.model.params.s())?,
            be.read(self.opt.m.s())?,
            be.read(self.opt.v.s())?,
        );
        if let Some(Zero1 { units, .. }) = &self.zero1 {
            for s in units.segments(self.dp.rank()) {
                st.push(
                    s.global,
                    s.len,
                    (&p[..], s.global),
                    (&m[..], s.local),
                    &v[..],
                );
            }
            return Ok(st);
        }
        if self.dp.rank() != 0 {
            return Ok(st);
        }
        let tp = self.model.tp();
        let whole = self.model.whole_layout();
        for (w, l) in whole.tensors.iter().zip(&self.model.layout().tensors) {
            // A replicated tensor is written once, by tp rank 0: every value
            // of a checkpoint has exactly one owner.
            if w.split == TpSplit::Replicated && tp.rank != 0 {
                continue;
            }
            let mut at = l.offset;
            for (full_at, len) in w.split.runs(&w.full_shape, tp.size, tp.rank) {
                st.push(w.offset + full_at, len, (&p[..], at), (&m[..], at), &v[..]);
                at += len;
            }
        }
        Ok(st)
    }

    fn load_state(&mut self, params: &[f32], m: &[f32], v: &[f32], adam_step: u32) -> Result<()> {
        self.load_full(params)?;
        let r = self.dp.rank();
        let e = &self.model.engine;
        let be = e.backend();
        for (full, mine) in [(m, &mut self.opt.m), (v, &mut self.opt.v)] {
            let local = match &self.zero1 {
                Some(z) => z.units.shard_of_host(full, r),
                None => {
                    let mut local = vec![0.0; e.layout().total()];
                    shard_tp(full, e.whole_layout(), e.layout(), e.tp(), &mut local);
                    local
                }
            };
            be.upload(mine.d(), &local)?;
        }
        self.opt.step = adam_step;
        Ok(())
    }

    fn memory(&self) -> MemoryReport {
        self.model.backend().memory_report()
    }

    fn comm_stats(&self) -> CommStats {
        let mut s = self.dp.stats();
        if let Some(tp) = &self.tp {
            s.add(&tp.stats());
        }
        s
    }
}
