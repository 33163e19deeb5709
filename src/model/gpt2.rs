//! GPT-2: forward and backward as explicit kernel calls, one unit at a time
//! ([wte | wpe], each block, [ln_f]), on parameter slices the caller hands in.
//! `Engine` holds the activations; `Gpt2` adds the full parameter and
//! gradient buffers for the strategies that keep them whole.

use super::config::GptConfig;
use super::layout::{split2, BlockParam, ParamLayout};
use crate::backend::{AttnShape, Backend, Buf, Category, WeightLayout};
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::rng::Rng;
use std::ops::{Deref, DerefMut};

/// Activations kept for the backward, plus its scratch, for `rows` = B*T
/// tokens. Per-block buffers hold one slot per layer, or a single slot when
/// blocks are recomputed in the backward.
struct Activations {
    rows: usize,
    /// Residual stream: block l reads resid[l] and writes resid[l + 1]; resid[0] is the embedding.
    resid: Buf,
    ln1: Buf,
    ln1_mean: Buf,
    ln1_rstd: Buf,
    qkv: Buf,
    atty: Buf,
    lse: Buf,
    /// Residual after attention, inside the block.
    res2: Buf,
    ln2: Buf,
    ln2_mean: Buf,
    ln2_rstd: Buf,
    fch: Buf,
    fch_gelu: Buf,
    lnf: Buf,
    lnf_mean: Buf,
    lnf_rstd: Buf,
    logits: Buf,
    losses: Buf,
    /// Gradient of the residual stream (backward).
    dres: Buf,
    /// (rows, C) backward scratch.
    dtmp: Buf,
    dqkv: Buf,
    dfch: Buf,
}

/// Per-rank widths: attention width and MLP width are split by tensor parallelism.
#[derive(Clone, Copy)]
struct Dims {
    c: usize,
    cl: usize,
    nhl: usize,
    fl: usize,
}

impl Activations {
    fn new<B: Backend>(be: &B, cfg: &GptConfig, d: Dims, slots: usize, rows: usize) -> Self {
        let (l, c) = (cfg.n_layer, cfg.n_embd);
        let a = |n: usize| be.alloc(n, Category::Activations);
        Activations {
            rows,
            resid: a((l + 1) * rows * c),
            ln1: a(slots * rows * c),
            ln1_mean: a(slots * rows),
            ln1_rstd: a(slots * rows),
            qkv: a(slots * rows * 3 * d.cl),
            atty: a(slots * rows * d.cl),
            lse: a(slots * rows * d.nhl),
            res2: a(slots * rows * c),
            ln2: a(slots * rows * c),
            ln2_mean: a(slots * rows),
            ln2_rstd: a(slots * rows),
            fch: a(slots * rows * d.fl),
            fch_gelu: a(slots * rows * d.fl),
            lnf: a(rows * c),
            lnf_mean: a(rows),
            lnf_rstd: a(rows),
            logits: a(rows * cfg.padded_vocab()),
            losses: a(rows),
            dres: a(rows * c),
            dtmp: a(rows * c),
            dqkv: a(rows * 3 * d.cl),
            dfch: a(rows * d.fl),
        }
    }
}

/// The (b, t), tokens and targets of the current forward.
struct Batch {
    b: usize,
    t: usize,
    tokens: Vec<u32>,
    targets: Option<Vec<u32>>,
}

/// Tensor-parallel placement of this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpPlace {
    pub rank: usize,
    pub size: usize,
}

/// Slice i of a buffer cut in pieces of n.
fn part(buf: &[f32], i: usize, n: usize) -> &[f32] {
    &buf[i * n..(i + 1) * n]
}

fn part_mut(buf: &mut [f32], i: usize, n: usize) -> &mut [f32] {
    &mut buf[i * n..(i + 1) * n]
}

/// The model without its parameters: config, this rank's layout, the
/// activations, and the unit-by-unit forward and backward.
pub struct Engine<B: Backend> {
    pub config: GptConfig,
    pub layout: ParamLayout,
    pub backend: B,
    pub tp: TpPlace,
    /// Keep only block inputs in the forward; recompute each block in the backward.
    pub recompute: bool,
    acts: Option<Activations>,
    batch: Option<Batch>,
}

impl<B: Backend> Engine<B> {
    pub fn new(backend: B, config: GptConfig, tp: TpPlace, recompute: bool) -> Result<Self> {
        config.validate()?;
        if tp.size == 0 || !config.n_head.is_multiple_of(tp.size) {
            return Err(Error::Config(format!(
                "n_head ({}) must be divisible by the tensor-parallel size ({}): choose --tp among the divisors of n_head",
                config.n_head, tp.size
            )));
        }
        Ok(Engine {
            layout: ParamLayout::new_tp(&config, tp.size),
            config,
            backend,
            tp,
            recompute,
            acts: None,
            batch: None,
        })
    }

    fn dims(&self) -> Dims {
        let c = self.config.n_embd;
        let cl = c / self.tp.size;
        Dims {
            c,
            cl,
            nhl: self.config.n_head / self.tp.size,
            fl: 4 * cl,
        }
    }

    fn check_tokens(&self, what: &str, ids: &[u32]) -> Result<()> {
        let v = self.config.vocab_size;
        match ids.iter().position(|&x| x as usize >= v) {
            Some(i) => Err(Error::Input(format!(
                "{what} id {} at position {i} is outside the vocabulary of {v}",
                ids[i]
            ))),
            None => Ok(()),
        }
    }

    /// Checks a batch and readies the activations for it.
    pub fn begin(
        &mut self,
        tokens: &[u32],
        targets: Option<&[u32]>,
        b: usize,
        t: usize,
    ) -> Result<()> {
        let bs = self.config.block_size;
        if t == 0 || t > bs {
            return Err(Error::Input(format!(
                "sequence length {t} must be between 1 and the model's block size {bs}"
            )));
        }
        if tokens.len() != b * t {
            return Err(Error::Input(format!(
                "got {} tokens for a batch of {b} x {t}",
                tokens.len()
            )));
        }
        self.check_tokens("token", tokens)?;
        if let Some(tg) = targets {
            if tg.len() != tokens.len() {
                return Err(Error::Input(format!(
                    "{} targets for {} tokens",
                    tg.len(),
                    tokens.len()
                )));
            }
            self.check_tokens("target", tg)?;
        }
        let rows = b * t;
        if self.acts.as_ref().is_none_or(|a| a.rows < rows) {
            self.acts = None; // free before allocating the larger set
            let slots = if self.recompute {
                1
            } else {
                self.config.n_layer
            };
            self.acts = Some(Activations::new(
                &self.backend,
                &self.config,
                self.dims(),
                slots,
                rows,
            ));
        }
        self.batch = Some(Batch {
            b,
            t,
            tokens: tokens.to_vec(),
            targets: targets.map(<[u32]>::to_vec),
        });
        Ok(())
    }

    fn shape(&self) -> (usize, usize) {
        let b = self.batch.as_ref().expect("begin() before the units");
        (b.b, b.t)
    }

    fn slot(&self, l: usize) -> usize {
        if self.recompute {
            0
        } else {
            l
        }
    }

    /// resid[0] = wte[tokens] + wpe; `emb` is the [wte | wpe] unit.
    pub fn embed_forward(&mut self, emb: &[f32]) {
        let (b, t) = self.shape();
        let c = self.config.n_embd;
        let (wte_len, btc) = (self.config.padded_vocab() * c, b * t * c);
        let batch = self.batch.as_ref().expect("begun");
        let a = self.acts.as_mut().expect("begun");
        self.backend.encoder_forward(
            &mut a.resid[..btc],
            &batch.tokens,
            &emb[..wte_len],
            &emb[wte_len..],
            t,
            c,
        );
    }

    /// Block l: resid[l] -> resid[l + 1]; `p` is this rank's slice of the block.
    pub fn block_forward(&mut self, l: usize, p: &[f32], tp: Option<&dyn Comm>) -> Result<()> {
        let (b, t) = self.shape();
        let Dims { c, cl, nhl, fl } = self.dims();
        let rows = b * t;
        let btc = rows * c;
        let s = self.slot(l);
        let (be, lay) = (&self.backend, &self.layout);
        let a = self.acts.as_mut().expect("begun");
        let w = |bp: BlockParam| &p[lay.in_block(bp)];
        // Under tensor parallelism only tp rank 0 adds the residual and the
        // (replicated) bias to its partial projection; the all-reduce sums the rest in.
        let lead = self.tp.rank == 0;

        let (lo, hi) = a.resid.split_at_mut((l + 1) * btc);
        let x = &lo[l * btc..];
        let out = &mut hi[..btc];
        let ln1 = part_mut(&mut a.ln1, s, btc);
        be.layernorm_forward(
            ln1,
            part_mut(&mut a.ln1_mean, s, rows),
            part_mut(&mut a.ln1_rstd, s, rows),
            x,
            w(BlockParam::Ln1W),
            w(BlockParam::Ln1B),
            c,
        );
        let qkv = part_mut(&mut a.qkv, s, 3 * rows * cl);
        be.matmul_forward(
            qkv,
            ln1,
            w(BlockParam::QkvW),
            Some(w(BlockParam::QkvB)),
            WeightLayout::InOut,
            rows,
            c,
            3 * cl,
            false,
        );
        let atty = part_mut(&mut a.atty, s, rows * cl);
        be.attention_forward(
            atty,
            part_mut(&mut a.lse, s, rows * nhl),
            qkv,
            AttnShape {
                b,
                t,
                c: cl,
                nh: nhl,
            },
        );
        let res2 = part_mut(&mut a.res2, s, btc);
        if lead {
            be.copy(res2, x);
        }
        let bias = lead.then(|| w(BlockParam::AttnProjB));
        be.matmul_forward(
            res2,
            atty,
            w(BlockParam::AttnProjW),
            bias,
            WeightLayout::InOut,
            rows,
            cl,
            c,
            lead,
        );
        if let Some(g) = tp {
            g.all_reduce(res2)?;
        }
        let ln2 = part_mut(&mut a.ln2, s, btc);
        be.layernorm_forward(
            ln2,
            part_mut(&mut a.ln2_mean, s, rows),
            part_mut(&mut a.ln2_rstd, s, rows),
            res2,
            w(BlockParam::Ln2W),
            w(BlockParam::Ln2B),
            c,
        );
        let fch = part_mut(&mut a.fch, s, rows * fl);
        be.matmul_forward(
            fch,
            ln2,
            w(BlockParam::FcW),
            Some(w(BlockParam::FcB)),
            WeightLayout::InOut,
            rows,
            c,
            fl,
            false,
        );
        let fch_gelu = part_mut(&mut a.fch_gelu, s, rows * fl);
        be.gelu_forward(fch_gelu, fch);
        if lead {
            be.copy(out, res2);
        }
        let bias = lead.then(|| w(BlockParam::FcProjB));
        be.matmul_forward(
            out,
            fch_gelu,
            w(BlockParam::FcProjW),
            bias,
            WeightLayout::InOut,
            rows,
            fl,
            c,
            lead,
        );
        if let Some(g) = tp {
            g.all_reduce(out)?;
        }
        Ok(())
    }

    /// ln_f and the tied LM head; the mean loss when the batch has targets.
    pub fn head_forward(&mut self, wte: &[f32], lnf: &[f32]) -> Option<f32> {
        let (b, t) = self.shape();
        let cfg = &self.config;
        let (c, n_layer, v, vp) = (cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.padded_vocab());
        let (rows, be) = (b * t, &self.backend);
        let btc = rows * c;
        let a = self.acts.as_mut().expect("begun");
        let last = part(&a.resid, n_layer, btc);
        be.layernorm_forward(
            &mut a.lnf[..btc],
            &mut a.lnf_mean[..rows],
            &mut a.lnf_rstd[..rows],
            last,
            &lnf[..c],
            &lnf[c..],
            c,
        );
        be.matmul_forward(
            &mut a.logits,
            &a.lnf[..btc],
            wte,
            None,
            WeightLayout::OutIn,
            rows,
            c,
            vp,
            false,
        );
        let targets = self.batch.as_ref().and_then(|x| x.targets.as_ref())?;
        be.crossentropy_forward(&mut a.losses, &a.logits, targets, v, vp);
        Some(a.losses[..rows].iter().map(|&x| x as f64).sum::<f64>() as f32 / rows as f32)
    }

    /// Logits (vocab_size, padding dropped) at (batch row bi, position ti) of the last forward.
    pub fn logits(&self, bi: usize, ti: usize) -> &[f32] {
        let batch = self.batch.as_ref().expect("forward before logits");
        let a = self.acts.as_ref().expect("forward before logits");
        let vp = self.config.padded_vocab();
        let row = bi * batch.t + ti;
        &a.logits[row * vp..row * vp + self.config.vocab_size]
    }

    /// Backward of the head for `loss_scale * mean loss`: dwte (Vp x C) and
    /// dlnf ([w | b]) accumulate; starts the residual gradient. Consumes the logits.
    pub fn head_backward(
        &mut self,
        wte: &[f32],
        lnf: &[f32],
        dwte: &mut [f32],
        dlnf: &mut [f32],
        loss_scale: f32,
    ) -> Result<()> {
        let (b, t) = self.shape();
        let cfg = &self.config;
        let (c, n_layer, v, vp) = (cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.padded_vocab());
        let (rows, be) = (b * t, &self.backend);
        let btc = rows * c;
        let batch = self.batch.as_ref().expect("begun");
        let targets = batch
            .targets
            .as_ref()
            .ok_or_else(|| Error::Input("backward needs a forward with targets".into()))?;
        let a = self.acts.as_mut().expect("begun");
        be.crossentropy_backward_inplace(&mut a.logits, targets, v, vp, loss_scale / rows as f32);
        let dtmp = &mut a.dtmp[..btc];
        be.matmul_backward(
            dtmp,
            dwte,
            None,
            &a.logits,
            &a.lnf,
            wte,
            WeightLayout::OutIn,
            rows,
            c,
            vp,
        );
        let dres = &mut a.dres[..btc];
        dres.fill(0.0);
        let (dw, db) = dlnf.split_at_mut(c);
        be.layernorm_backward(
            dres,
            dw,
            db,
            dtmp,
            part(&a.resid, n_layer, btc),
            &lnf[..c],
            &a.lnf_mean[..rows],
            &a.lnf_rstd[..rows],
            c,
        );
        Ok(())
    }

    /// Backward of block l: grads of its slice `p` accumulate into `g`; the
    /// residual gradient moves from resid[l + 1] to resid[l]. With
    /// recomputation the block's forward runs again first.
    pub fn block_backward(
        &mut self,
        l: usize,
        p: &[f32],
        g: &mut [f32],
        tp: Option<&dyn Comm>,
    ) -> Result<()> {
        if self.recompute {
            self.block_forward(l, p, tp)?;
        }
        let (b, t) = self.shape();
        let Dims { c, cl, nhl, fl } = self.dims();
        let rows = b * t;
        let btc = rows * c;
        let s = self.slot(l);
        let (be, lay) = (&self.backend, &self.layout);
        let a = self.acts.as_mut().expect("begun");
        let w = |bp: BlockParam| &p[lay.in_block(bp)];
        let x = part(&a.resid, l, btc);
        let dres = &mut a.dres[..btc];
        let dtmp = &mut a.dtmp[..btc];
        let dfch = &mut a.dfch[..rows * fl];
        let (dw, db) = split2(
            g,
            lay.in_block(BlockParam::FcProjW),
            lay.in_block(BlockParam::FcProjB),
        );
        be.matmul_backward(
            dfch,
            dw,
            Some(db),
            dres,
            part(&a.fch_gelu, s, rows * fl),
            w(BlockParam::FcProjW),
            WeightLayout::InOut,
            rows,
            fl,
            c,
        );
        be.gelu_backward_inplace(dfch, part(&a.fch, s, rows * fl));
        let (dw, db) = split2(
            g,
            lay.in_block(BlockParam::FcW),
            lay.in_block(BlockParam::FcB),
        );
        be.matmul_backward(
            dtmp,
            dw,
            Some(db),
            dfch,
            part(&a.ln2, s, btc),
            w(BlockParam::FcW),
            WeightLayout::InOut,
            rows,
            c,
            fl,
        );
        if let Some(g) = tp {
            g.all_reduce(dtmp)?;
        }
        let (dw, db) = split2(
            g,
            lay.in_block(BlockParam::Ln2W),
            lay.in_block(BlockParam::Ln2B),
        );
        be.layernorm_backward(
            dres,
            dw,
            db,
            dtmp,
            part(&a.res2, s, btc),
            w(BlockParam::Ln2W),
            part(&a.ln2_mean, s, rows),
            part(&a.ln2_rstd, s, rows),
            c,
        );
        let datty = &mut dtmp[..rows * cl];
        let (dw, db) = split2(
            g,
            lay.in_block(BlockParam::AttnProjW),
            lay.in_block(BlockParam::AttnProjB),
        );
        be.matmul_backward(
            datty,
            dw,
            Some(db),
            dres,
            part(&a.atty, s, rows * cl),
            w(BlockParam::AttnProjW),
            WeightLayout::InOut,
            rows,
            cl,
            c,
        );
        let dqkv = &mut a.dqkv[..3 * rows * cl];
        be.attention_backward(
            dqkv,
            datty,
            part(&a.qkv, s, 3 * rows * cl),
            part(&a.atty, s, rows * cl),
            part(&a.lse, s, rows * nhl),
            AttnShape {
                b,
                t,
                c: cl,
                nh: nhl,
            },
        );
        let (dw, db) = split2(
            g,
            lay.in_block(BlockParam::QkvW),
            lay.in_block(BlockParam::QkvB),
        );
        be.matmul_backward(
            dtmp,
            dw,
            Some(db),
            dqkv,
            part(&a.ln1, s, btc),
            w(BlockParam::QkvW),
            WeightLayout::InOut,
            rows,
            c,
            3 * cl,
        );
        if let Some(g) = tp {
            g.all_reduce(dtmp)?;
        }
        let (dw, db) = split2(
            g,
            lay.in_block(BlockParam::Ln1W),
            lay.in_block(BlockParam::Ln1B),
        );
        be.layernorm_backward(
            dres,
            dw,
            db,
            dtmp,
            x,
            w(BlockParam::Ln1W),
            part(&a.ln1_mean, s, rows),
            part(&a.ln1_rstd, s, rows),
            c,
        );
        Ok(())
    }

    /// Gradient of the [wte | wpe] unit from the residual gradient (accumulates into `demb`).
    pub fn embed_backward(&mut self, demb: &mut [f32]) {
        let (_, t) = self.shape();
        let c = self.config.n_embd;
        let wte_len = self.config.padded_vocab() * c;
        let batch = self.batch.as_ref().expect("begun");
        let a = self.acts.as_ref().expect("begun");
        let (dwte, dwpe) = demb.split_at_mut(wte_len);
        self.backend.encoder_backward(
            dwte,
            dwpe,
            &a.dres[..batch.tokens.len() * c],
            &batch.tokens,
            t,
            c,
        );
    }
}

/// The engine plus whole parameter and gradient buffers (this rank's tensor-parallel part).
pub struct Gpt2<B: Backend> {
    pub engine: Engine<B>,
    pub params: Buf,
    pub grads: Buf,
}

impl<B: Backend> Deref for Gpt2<B> {
    type Target = Engine<B>;
    fn deref(&self) -> &Engine<B> {
        &self.engine
    }
}

impl<B: Backend> DerefMut for Gpt2<B> {
    fn deref_mut(&mut self) -> &mut Engine<B> {
        &mut self.engine
    }
}

impl<B: Backend> Gpt2<B> {
    /// A whole model with zero parameters (to be loaded or initialised).
    pub fn new(backend: B, config: GptConfig) -> Result<Self> {
        Self::with_engine(Engine::new(
            backend,
            config,
            TpPlace { rank: 0, size: 1 },
            false,
        )?)
    }

    pub fn with_engine(engine: Engine<B>) -> Result<Self> {
        let n = engine.layout.total();
        Ok(Gpt2 {
            params: engine.backend.alloc(n, Category::Params),
            grads: engine.backend.alloc(n, Category::Grads),
            engine,
        })
    }

    pub fn backend(&self) -> &B {
        &self.engine.backend
    }

    pub fn zero_grads(&mut self) {
        self.grads.fill(0.0);
    }

    /// GPT-2 initialisation of this rank's parameters.
    pub fn init_weights(&mut self, seed: u64) {
        let full = init_full(&self.engine.config, seed);
        let whole = ParamLayout::new(&self.engine.config);
        shard_tp(
            &full,
            &whole,
            &self.engine.layout,
            self.engine.tp,
            &mut self.params,
        );
    }

    /// Runs the model on tokens (B*T); returns the mean loss when targets are given.
    pub fn forward(
        &mut self,
        tokens: &[u32],
        targets: Option<&[u32]>,
        b: usize,
        t: usize,
    ) -> Result<Option<f32>> {
        self.forward_tp(tokens, targets, b, t, None)
    }

    pub fn forward_tp(
        &mut self,
        tokens: &[u32],
        targets: Option<&[u32]>,
        b: usize,
        t: usize,
        tp: Option<&dyn Comm>,
    ) -> Result<Option<f32>> {
        let Gpt2 { engine, params, .. } = self;
        engine.begin(tokens, targets, b, t)?;
        engine.embed_forward(&params[engine.layout.embeddings()]);
        for l in 0..engine.config.n_layer {
            let r = engine.layout.block(l);
            engine.block_forward(l, &params[r], tp)?;
        }
        Ok(engine.head_forward(
            &params[engine.layout.wte()],
            &params[engine.layout.final_norm()],
        ))
    }

    /// Accumulates into `grads` the gradient of `loss_scale * mean loss` of
    /// the last forward (which must have had targets). Consumes the logits.
    pub fn backward(&mut self, loss_scale: f32) -> Result<()> {
        self.backward_tp(loss_scale, None, |_| Ok(()))
    }

    /// The backward, calling `unit_done` with each unit's gradient slice as
    /// soon as it is final: ln_f, then blocks L-1 .. 0, then [wte | wpe]
    /// (the hook where data parallelism all-reduces it).
    pub fn backward_tp(
        &mut self,
        loss_scale: f32,
        tp: Option<&dyn Comm>,
        mut unit_done: impl FnMut(&mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let Gpt2 {
            engine,
            params,
            grads,
        } = self;
        let lay = engine.layout.clone();
        {
            let (dwte, dlnf) = split2(grads, lay.wte(), lay.final_norm());
            engine.head_backward(
                &params[lay.wte()],
                &params[lay.final_norm()],
                dwte,
                dlnf,
                loss_scale,
            )?;
            unit_done(dlnf)?;
        }
        for l in (0..engine.config.n_layer).rev() {
            let r = lay.block(l);
            engine.block_backward(l, &params[r.clone()], &mut grads[r.clone()], tp)?;
            unit_done(&mut grads[r])?;
        }
        engine.embed_backward(&mut grads[lay.embeddings()]);
        unit_done(&mut grads[lay.embeddings()])
    }
}

/// GPT-2 initialisation of the whole model: N(0, 0.02) weights, residual
/// projections scaled by 1/sqrt(2L), zero biases, unit layernorms, zero
/// padded vocabulary rows. Every strategy shards this same tensor.
pub fn init_full(cfg: &GptConfig, seed: u64) -> Vec<f32> {
    let layout = ParamLayout::new(cfg);
    let mut p = vec![0.0f32; layout.total()];
    let mut rng = Rng::new(seed);
    let proj_std = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
    for t in &layout.tensors {
        let p = &mut p[t.range()];
        if t.name.ends_with("ln_1.weight")
            || t.name.ends_with("ln_2.weight")
            || t.name.ends_with("ln_f.weight")
        {
            p.fill(1.0);
        } else if t.shape.len() == 2 {
            let std = if t.name.ends_with("c_proj.weight") {
                proj_std
            } else {
                0.02
            };
            p.iter_mut().for_each(|x| *x = (rng.normal() * std) as f32);
        }
    }
    let wte = layout.wte();
    p[wte.start + cfg.vocab_size * cfg.n_embd..wte.end].fill(0.0);
    p
}

/// Copies tensor-parallel rank `tp`'s part of a whole-model buffer into `out` (laid out as `local`).
pub fn shard_tp(
    full: &[f32],
    whole: &ParamLayout,
    local: &ParamLayout,
    tp: TpPlace,
    out: &mut [f32],
) {
    for (w, l) in whole.tensors.iter().zip(&local.tensors) {
        let part = w
            .split
            .shard(&full[w.range()], &w.full_shape, tp.size, tp.rank);
        out[l.range()].copy_from_slice(&part);
    }
}

/// Writes rank `tp`'s part (laid out as `local`) back into a whole-model buffer.
pub fn unshard_tp(
    local_buf: &[f32],
    whole: &ParamLayout,
    local: &ParamLayout,
    tp: TpPlace,
    full: &mut [f32],
) {
    for (w, l) in whole.tensors.iter().zip(&local.tensors) {
        w.split.unshard(
            &mut full[w.range()],
            &local_buf[l.range()],
            &w.full_shape,
            tp.size,
            tp.rank,
        );
    }
}
