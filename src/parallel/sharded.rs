//! zero2 and fsdp (ZeRO-3, FULL_SHARD). Rank r owns slice r of every unit
//! ([wte | wpe], each block, [ln_f]) of the gradients and AdamW moments, and
//! under fsdp of the parameters too: each block is all-gathered right
//! before its forward and again before its backward, and its gradient is
//! reduce-scattered as soon as the unit's backward is done. [wte | wpe] is
//! gathered once per forward and kept until the head's backward (the tied
//! `wte` serves the embedding and the LM head), as FSDP's root unit keeps
//! them. Gathered parameters count as params ([wte | wpe], one block and
//! [ln_f]); the one-unit gradient scratch counts as `other`.

use super::{check_finite, local_rows, OwnedState, StepConfig, StepStats, Strategy, Units};
use crate::backend::{Backend, Buf, Category, MemoryReport, Src};
use crate::comm::{device, Comm, CommStats};
use crate::data::Batch;
use crate::error::Result;
use crate::model::{AdamW, AdamWConfig, Engine};

pub struct Sharded<B: Backend> {
    engine: Engine<B>,
    units: Units,
    params: Params<B>,
    g_shard: Buf<B>,
    opt: AdamW<B>,
    /// One unit's full gradient before it is reduce-scattered, and ln_f's.
    grad_unit: [Buf<B>; 2],
    rs_out: Buf<B>,
    dp: Box<dyn Comm>,
    b: usize,
    t: usize,
}

/// fsdp's gather slots.
const BLOCK: usize = 0;
const LNF: usize = 1;
const EMB: usize = 2;

/// Where the parameters live.
enum Params<B: Backend> {
    /// zero2: whole on every rank.
    Whole(Buf<B>),
    /// fsdp: this rank's shard, and a gather buffer per kind of unit:
    /// [BLOCK], [LNF], [EMB].
    Sharded {
        shard: Buf<B>,
        gathered: [Buf<B>; 3],
    },
}

impl<B: Backend> Params<B> {
    /// Unit u's parameters: from the whole buffer (zero2) or gather slot `slot` (fsdp).
    fn unit(&self, units: &Units, u: usize, slot: usize) -> Src<'_, B> {
        match self {
            Params::Whole(p) => p.slice(units.ranges[u].clone()),
            Params::Sharded { gathered, .. } => gathered[slot].slice(0..units.ranges[u].len()),
        }
    }
}

impl<B: Backend> Sharded<B> {
    pub fn new(
        engine: Engine<B>,
        dp: Box<dyn Comm>,
        fsdp: bool,
        adamw: AdamWConfig,
        b: usize,
        t: usize,
    ) -> Result<Self> {
        let units = Units::new(&engine.layout, engine.config.n_layer, dp.size());
        let be = &engine.backend;
        let lnf_padded = units.shard_len[units.final_norm()] * units.n;
        let params = if fsdp {
            Params::Sharded {
                shard: be.alloc(units.shard_total(), Category::Params)?,
                gathered: [
                    be.alloc(units.max_block_padded(), Category::Params)?,
                    be.alloc(lnf_padded, Category::Params)?,
                    be.alloc(units.padded(units.embeddings()), Category::Params)?,
                ],
            }
        } else {
            Params::Whole(be.alloc(engine.layout.total(), Category::Params)?)
        };
        Ok(Sharded {
            g_shard: be.alloc(units.shard_total(), Category::Grads)?,
            opt: AdamW::new(be, units.shard_total(), adamw)?,
            grad_unit: [
                be.alloc(units.max_padded(), Category::Other)?,
                be.alloc(lnf_padded, Category::Other)?,
            ],
            rs_out: be.alloc(
                units.shard_len.iter().copied().max().unwrap_or(0),
                Category::Other,
            )?,
            params,
            units,
            engine,
            dp,
            b,
            t,
        })
    }

    /// fsdp: all-gathers unit u into gather slot `slot`.
    fn fetch(&mut self, u: usize, slot: usize) -> Result<()> {
        if let Params::Sharded { shard, gathered } = &mut self.params {
            let n = self.units.shard_len[u] * self.units.n;
            device::all_gather(
                self.dp.as_ref(),
                &self.engine.backend,
                shard.slice(self.units.shard_of(u)),
                gathered[slot].slice_mut(0..n),
            )?;
        }
        Ok(())
    }

    /// Reduce-scatters unit u's gradient from scratch `slot` and adds this rank's part to its shard.
    fn reduce(&mut self, u: usize, slot: usize) -> Result<()> {
        let s = self.units.shard_len[u];
        let be = &self.engine.backend;
        device::reduce_scatter(
            self.dp.as_ref(),
            be,
            self.grad_unit[slot].slice(0..s * self.units.n),
            self.rs_out.slice_mut(0..s),
        )?;
        be.add_inplace(
            self.g_shard.slice_mut(self.units.shard_of(u)),
            self.rs_out.slice(0..s),
        );
        Ok(())
    }

    fn clear_grad(&mut self, u: usize, slot: usize) {
        let n = self.units.shard_len[u] * self.units.n;
        self.engine
            .backend
            .fill(self.grad_unit[slot].slice_mut(0..n), 0.0);
    }

    fn forward(&mut self, mb: &Batch) -> Result<f32> {
        let (emb, lnf) = (self.units.embeddings(), self.units.final_norm());
        self.engine.begin(
            &mb.inputs,
            Some(&mb.targets),
            self.b / self.dp.size(),
            self.t,
        )?;
        self.fetch(emb, EMB)?;
        self.engine
            .embed_forward(self.params.unit(&self.units, emb, EMB));
        for l in 0..self.engine.config.n_layer {
            let u = self.units.block(l);
            self.fetch(u, BLOCK)?;
            self.engine
                .block_forward(l, self.params.unit(&self.units, u, BLOCK), None)?;
        }
        self.fetch(lnf, LNF)?;
        let wte_len = self.engine.layout.wte().len();
        let wte = self.params.unit(&self.units, emb, EMB).first(wte_len);
        let loss = self
            .engine
            .head_forward(wte, self.params.unit(&self.units, lnf, LNF))?;
        Ok(loss.expect("targets given"))
    }

    /// Backward right after `forward` (the head's units are still gathered).
    fn backward(&mut self, loss_scale: f32) -> Result<()> {
        let (emb, lnf) = (self.units.embeddings(), self.units.final_norm());
        let wte_len = self.engine.layout.wte().len();
        self.clear_grad(emb, 0);
        self.clear_grad(lnf, 1);
        {
            let wte = self.params.unit(&self.units, emb, EMB).first(wte_len);
            let lnf_p = self.params.unit(&self.units, lnf, LNF);
            let [g0, g1] = &mut self.grad_unit;
            let lnf_len = self.units.ranges[lnf].len();
            self.engine.head_backward(
                wte,
                lnf_p,
                g0.slice_mut(0..wte_len),
                g1.slice_mut(0..lnf_len),
                loss_scale,
            )?;
        }
        self.reduce(emb, 0)?;
        self.reduce(lnf, 1)?;
        for l in (0..self.engine.config.n_layer).rev() {
            let u = self.units.block(l);
            self.fetch(u, BLOCK)?;
            self.clear_grad(u, 0);
            let len = self.units.ranges[u].len();
            let p = self.params.unit(&self.units, u, BLOCK);
            self.engine
                .block_backward(l, p, self.grad_unit[0].slice_mut(0..len), None)?;
            self.reduce(u, 0)?;
        }
        self.clear_grad(emb, 0);
        let emb_len = self.units.ranges[emb].len();
        self.engine
            .embed_backward(self.grad_unit[0].slice_mut(0..emb_len));
        self.reduce(emb, 0)
    }
}

impl<B: Backend> Strategy for Sharded<B> {
    fn step(&mut self, micro_batches: &[Batch], cfg: StepConfig) -> Result<StepStats> {
        let (r, n) = (self.dp.rank(), self.dp.size());
        self.engine.backend.fill(self.g_shard.d(), 0.0);
        let scale = 1.0 / (micro_batches.len() * n) as f32;
        let mut loss = [0.0f32];
        for mb in micro_batches {
            let local = local_rows(mb, self.b, self.t, r, n);
            loss[0] += self.forward(&local)?;
            self.backward(scale)?;
        }
        self.dp.all_reduce(&mut loss)?;
        let be = &self.engine.backend;
        let mut sq = [be.sum_squares(self.g_shard.s())? as f32];
        self.dp.all_reduce(&mut sq)?;
        let grad_norm = sq[0].sqrt();
        check_finite(loss[0], grad_norm)?;
        let clip = if cfg.grad_clip > 0.0 && grad_norm > cfg.grad_clip {
            cfg.grad_clip / grad_norm
        } else {
            1.0
        };
        let segs = self.units.segments(r);
        let lay = &self.engine.layout;
        match &mut self.params {
            Params::Sharded { shard, .. } => {
                self.opt
                    .update(be, shard.d(), self.g_shard.s(), lay, &segs, cfg.lr, clip)
            }
            Params::Whole(full) => {
                let mut p = be.alloc(self.units.shard_total(), Category::Other)?;
                self.units.shard_from(be, full.s(), r, p.d());
                self.opt
                    .update(be, p.d(), self.g_shard.s(), lay, &segs, cfg.lr, clip);
                let mut g = be.alloc(self.units.max_padded(), Category::Other)?;
                for u in 0..self.units.ranges.len() {
                    let range = self.units.ranges[u].clone();
                    device::all_gather(
                        self.dp.as_ref(),
                        be,
                        p.slice(self.units.shard_of(u)),
                        g.slice_mut(0..self.units.shard_len[u] * n),
                    )?;
                    be.copy(full.slice_mut(range.clone()), g.slice(0..range.len()));
                }
            }
        }
        self.engine.backend.synchronize()?;
        Ok(StepStats {
            loss: loss[0] / (n * micro_batches.len()) as f32,
            grad_norm,
        })
    }

    fn eval_loss(&mut self, batch: &Batch) -> Result<f32> {
        let n = self.dp.size();
        let local = local_rows(batch, self.b, self.t, self.dp.rank(), n);
        let mut loss = [self.forward(&local)?];
        self.dp.all_reduce(&mut loss)?;
        Ok(loss[0] / n as f32)
    }

    fn full_params(&mut self) -> Result<Vec<f32>> {
        if let Params::Whole(full) = &self.params {
            return self.engine.backend.to_host(full.s());
        }
        let mut out = vec![0.0; self.engine.layout.total()];
        for u in 0..self.units.ranges.len() {
            self.fetch(u, 0)?;
            let range = self.units.ranges[u].clone();
            self.engine
                .backend
                .download(self.params.unit(&self.units, u, 0), &mut out[range])?;
        }
        Ok(out)
    }

    fn load_full(&mut self, full: &[f32]) -> Result<()> {
        let be = &self.engine.backend;
        match &mut self.params {
            Params::Whole(p) => be.upload(p.d(), full),
            Params::Sharded { shard, .. } => {
                be.upload(shard.d(), &self.units.shard_of_host(full, self.dp.rank()))
            }
        }
    }

    fn owned_state(&self) -> Result<OwnedState> {
        let be = &self.engine.backend;
        let mut st = OwnedState::default();
        let (m, v) = (be.read(self.opt.m.s())?, be.read(self.opt.v.s())?);
        let (p, whole) = match &self.params {
            Params::Sharded { shard, .. } => (be.read(shard.s())?, false),
            Params::Whole(full) => (be.read(full.s())?, true),
        };
        for s in self.units.segments(self.dp.rank()) {
            let at = if whole { s.global } else { s.local };
            st.push(s.global, s.len, (&p[..], at), (&m[..], s.local), &v[..]);
        }
        Ok(st)
    }

    fn load_state(&mut self, params: &[f32], m: &[f32], v: &[f32], adam_step: u32) -> Result<()> {
        self.load_full(params)?;
        let r = self.dp.rank();
        let be = &self.engine.backend;
        be.upload(self.opt.m.d(), &self.units.shard_of_host(m, r))?;
        be.upload(self.opt.v.d(), &self.units.shard_of_host(v, r))?;
        self.opt.step = adam_step;
        Ok(())
    }

    fn memory(&self) -> MemoryReport {
        self.engine.backend.memory_report()
    }

    fn comm_stats(&self) -> CommStats {
        self.dp.stats()
    }
}
