//! GPT-2: forward and backward as explicit kernel calls, block by block,
//! over one flat parameter buffer (see `layout`).

use super::config::GptConfig;
use super::layout::{split2, BlockParam, ParamLayout};
use crate::backend::{AttnShape, Backend, Buf, Category, WeightLayout};
use crate::error::{Error, Result};
use crate::rng::Rng;

/// Activations of the last forward, kept for the backward, plus the
/// backward's scratch. Sized for `rows` = B*T tokens.
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
    /// Residual after attention, inside block l.
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

impl Activations {
    fn new<B: Backend>(be: &B, cfg: &GptConfig, rows: usize) -> Self {
        let (l, c) = (cfg.n_layer, cfg.n_embd);
        let a = |n: usize| be.alloc(n, Category::Activations);
        Activations {
            rows,
            resid: a((l + 1) * rows * c),
            ln1: a(l * rows * c),
            ln1_mean: a(l * rows),
            ln1_rstd: a(l * rows),
            qkv: a(l * rows * 3 * c),
            atty: a(l * rows * c),
            lse: a(l * rows * cfg.n_head),
            res2: a(l * rows * c),
            ln2: a(l * rows * c),
            ln2_mean: a(l * rows),
            ln2_rstd: a(l * rows),
            fch: a(l * rows * 4 * c),
            fch_gelu: a(l * rows * 4 * c),
            lnf: a(rows * c),
            lnf_mean: a(rows),
            lnf_rstd: a(rows),
            logits: a(rows * cfg.padded_vocab()),
            losses: a(rows),
            dres: a(rows * c),
            dtmp: a(rows * c),
            dqkv: a(rows * 3 * c),
            dfch: a(rows * 4 * c),
        }
    }
}

/// The (b, t) and tokens of the last forward.
struct Batch {
    b: usize,
    t: usize,
    tokens: Vec<u32>,
}

pub struct Gpt2<B: Backend> {
    pub config: GptConfig,
    pub layout: ParamLayout,
    pub params: Buf,
    pub grads: Buf,
    pub backend: B,
    acts: Option<Activations>,
    batch: Option<Batch>,
}

/// Slice i of a buffer cut in pieces of n.
fn part(buf: &[f32], i: usize, n: usize) -> &[f32] {
    &buf[i * n..(i + 1) * n]
}

fn part_mut(buf: &mut [f32], i: usize, n: usize) -> &mut [f32] {
    &mut buf[i * n..(i + 1) * n]
}

impl<B: Backend> Gpt2<B> {
    /// A model with zero parameters (to be loaded or initialised).
    pub fn new(backend: B, config: GptConfig) -> Result<Self> {
        config.validate()?;
        let layout = ParamLayout::new(&config);
        let n = layout.total();
        Ok(Gpt2 {
            params: backend.alloc(n, Category::Params),
            grads: backend.alloc(n, Category::Grads),
            config,
            layout,
            backend,
            acts: None,
            batch: None,
        })
    }

    /// GPT-2 initialisation: N(0, 0.02) weights, residual projections scaled
    /// by 1/sqrt(2L), zero biases, unit layernorms, zero padded vocab rows.
    pub fn init_weights(&mut self, seed: u64) {
        let mut rng = Rng::new(seed);
        let proj_std = 0.02 / (2.0 * self.config.n_layer as f64).sqrt();
        for t in &self.layout.tensors {
            let r = t.range();
            let p = &mut self.params[r];
            if t.name.ends_with("ln_1.weight")
                || t.name.ends_with("ln_2.weight")
                || t.name.ends_with("ln_f.weight")
            {
                p.fill(1.0);
            } else if t.shape.len() == 1 {
                p.fill(0.0);
            } else {
                let std = if t.name.ends_with("c_proj.weight") {
                    proj_std
                } else {
                    0.02
                };
                p.iter_mut().for_each(|x| *x = (rng.normal() * std) as f32);
            }
        }
        let real = self.config.vocab_size * self.config.n_embd;
        let wte = self.layout.wte();
        self.params[wte.start + real..wte.end].fill(0.0);
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn zero_grads(&mut self) {
        self.grads.fill(0.0);
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

    /// Runs the model on tokens (B*T); returns the mean loss when targets are given.
    pub fn forward(
        &mut self,
        tokens: &[u32],
        targets: Option<&[u32]>,
        b: usize,
        t: usize,
    ) -> Result<Option<f32>> {
        let cfg = &self.config;
        if t == 0 || t > cfg.block_size {
            return Err(Error::Input(format!(
                "sequence length {t} must be between 1 and the model's block size {}",
                cfg.block_size
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
            self.acts = Some(Activations::new(&self.backend, cfg, rows));
        }
        let (c, nh, n_layer, v, vp) = (
            cfg.n_embd,
            cfg.n_head,
            cfg.n_layer,
            cfg.vocab_size,
            cfg.padded_vocab(),
        );
        let (be, p, lay) = (&self.backend, &self.params[..], &self.layout);
        let a = self.acts.as_mut().expect("allocated above");
        let btc = rows * c;
        let w = |l: usize, bp: BlockParam| &p[lay.block_param(l, bp)];

        be.encoder_forward(
            &mut a.resid[..btc],
            tokens,
            &p[lay.wte()],
            &p[lay.wpe()],
            t,
            c,
        );
        for l in 0..n_layer {
            let (lo, hi) = a.resid.split_at_mut((l + 1) * btc);
            let x = &lo[l * btc..];
            let out = &mut hi[..btc];
            let ln1 = part_mut(&mut a.ln1, l, btc);
            be.layernorm_forward(
                ln1,
                part_mut(&mut a.ln1_mean, l, rows),
                part_mut(&mut a.ln1_rstd, l, rows),
                x,
                w(l, BlockParam::Ln1W),
                w(l, BlockParam::Ln1B),
                c,
            );
            let qkv = part_mut(&mut a.qkv, l, 3 * btc);
            be.matmul_forward(
                qkv,
                ln1,
                w(l, BlockParam::QkvW),
                Some(w(l, BlockParam::QkvB)),
                WeightLayout::InOut,
                rows,
                c,
                3 * c,
                false,
            );
            let atty = part_mut(&mut a.atty, l, btc);
            be.attention_forward(
                atty,
                part_mut(&mut a.lse, l, rows * nh),
                qkv,
                AttnShape { b, t, c, nh },
            );
            // res2 = x + atty @ W + bias: the residual add is fused into the projection.
            let res2 = part_mut(&mut a.res2, l, btc);
            be.copy(res2, x);
            be.matmul_forward(
                res2,
                atty,
                w(l, BlockParam::AttnProjW),
                Some(w(l, BlockParam::AttnProjB)),
                WeightLayout::InOut,
                rows,
                c,
                c,
                true,
            );
            let ln2 = part_mut(&mut a.ln2, l, btc);
            be.layernorm_forward(
                ln2,
                part_mut(&mut a.ln2_mean, l, rows),
                part_mut(&mut a.ln2_rstd, l, rows),
                res2,
                w(l, BlockParam::Ln2W),
                w(l, BlockParam::Ln2B),
                c,
            );
            let fch = part_mut(&mut a.fch, l, 4 * btc);
            be.matmul_forward(
                fch,
                ln2,
                w(l, BlockParam::FcW),
                Some(w(l, BlockParam::FcB)),
                WeightLayout::InOut,
                rows,
                c,
                4 * c,
                false,
            );
            let fch_gelu = part_mut(&mut a.fch_gelu, l, 4 * btc);
            be.gelu_forward(fch_gelu, fch);
            be.copy(out, res2);
            be.matmul_forward(
                out,
                fch_gelu,
                w(l, BlockParam::FcProjW),
                Some(w(l, BlockParam::FcProjB)),
                WeightLayout::InOut,
                rows,
                4 * c,
                c,
                true,
            );
        }
        let last = part(&a.resid, n_layer, btc);
        be.layernorm_forward(
            &mut a.lnf[..btc],
            &mut a.lnf_mean[..rows],
            &mut a.lnf_rstd[..rows],
            last,
            &p[lay.lnf_w()],
            &p[lay.lnf_b()],
            c,
        );
        be.matmul_forward(
            &mut a.logits,
            &a.lnf[..btc],
            &p[lay.wte()],
            None,
            WeightLayout::OutIn,
            rows,
            c,
            vp,
            false,
        );
        self.batch = Some(Batch {
            b,
            t,
            tokens: tokens.to_vec(),
        });
        Ok(targets.map(|tg| {
            be.crossentropy_forward(&mut a.losses, &a.logits, tg, v, vp);
            a.losses[..rows].iter().map(|&x| x as f64).sum::<f64>() as f32 / rows as f32
        }))
    }

    /// Logits (vocab_size, padding dropped) at (batch row bi, position ti) of the last forward.
    pub fn logits(&self, bi: usize, ti: usize) -> &[f32] {
        let batch = self.batch.as_ref().expect("forward before logits");
        let a = self.acts.as_ref().expect("forward before logits");
        let vp = self.config.padded_vocab();
        let row = bi * batch.t + ti;
        &a.logits[row * vp..row * vp + self.config.vocab_size]
    }

    /// Accumulates into `grads` the gradient of `loss_scale * mean loss` of
    /// the last forward (targets must be the ones given to it). Consumes the logits.
    pub fn backward(&mut self, targets: &[u32], loss_scale: f32) -> Result<()> {
        let Batch { b, t, ref tokens } = *self
            .batch
            .as_ref()
            .ok_or_else(|| Error::Input("backward called before forward".into()))?;
        let cfg = &self.config;
        let (c, nh, n_layer, v, vp) = (
            cfg.n_embd,
            cfg.n_head,
            cfg.n_layer,
            cfg.vocab_size,
            cfg.padded_vocab(),
        );
        let rows = b * t;
        let btc = rows * c;
        if targets.len() != rows {
            return Err(Error::Input(format!(
                "{} targets for {rows} tokens",
                targets.len()
            )));
        }
        let (be, p, g, lay) = (
            &self.backend,
            &self.params[..],
            &mut self.grads[..],
            &self.layout,
        );
        let a = self.acts.as_mut().expect("forward allocated activations");
        let w = |l: usize, bp: BlockParam| &p[lay.block_param(l, bp)];

        be.crossentropy_backward_inplace(&mut a.logits, targets, v, vp, loss_scale / rows as f32);
        let dtmp = &mut a.dtmp[..btc];
        be.matmul_backward(
            dtmp,
            &mut g[lay.wte()],
            None,
            &a.logits,
            &a.lnf,
            &p[lay.wte()],
            WeightLayout::OutIn,
            rows,
            c,
            vp,
        );
        let dres = &mut a.dres[..btc];
        dres.fill(0.0);
        {
            let (dw, db) = split2(g, lay.lnf_w(), lay.lnf_b());
            be.layernorm_backward(
                dres,
                dw,
                db,
                dtmp,
                part(&a.resid, n_layer, btc),
                &p[lay.lnf_w()],
                &a.lnf_mean[..rows],
                &a.lnf_rstd[..rows],
                c,
            );
        }
        for l in (0..n_layer).rev() {
            let x = part(&a.resid, l, btc);
            let dfch = &mut a.dfch[..4 * btc];
            let (dw, db) = split2(
                g,
                lay.block_param(l, BlockParam::FcProjW),
                lay.block_param(l, BlockParam::FcProjB),
            );
            be.matmul_backward(
                dfch,
                dw,
                Some(db),
                dres,
                part(&a.fch_gelu, l, 4 * btc),
                w(l, BlockParam::FcProjW),
                WeightLayout::InOut,
                rows,
                4 * c,
                c,
            );
            be.gelu_backward_inplace(dfch, part(&a.fch, l, 4 * btc));
            let (dw, db) = split2(
                g,
                lay.block_param(l, BlockParam::FcW),
                lay.block_param(l, BlockParam::FcB),
            );
            be.matmul_backward(
                dtmp,
                dw,
                Some(db),
                dfch,
                part(&a.ln2, l, btc),
                w(l, BlockParam::FcW),
                WeightLayout::InOut,
                rows,
                c,
                4 * c,
            );
            let (dw, db) = split2(
                g,
                lay.block_param(l, BlockParam::Ln2W),
                lay.block_param(l, BlockParam::Ln2B),
            );
            be.layernorm_backward(
                dres,
                dw,
                db,
                dtmp,
                part(&a.res2, l, btc),
                w(l, BlockParam::Ln2W),
                part(&a.ln2_mean, l, rows),
                part(&a.ln2_rstd, l, rows),
                c,
            );
            let (dw, db) = split2(
                g,
                lay.block_param(l, BlockParam::AttnProjW),
                lay.block_param(l, BlockParam::AttnProjB),
            );
            be.matmul_backward(
                dtmp,
                dw,
                Some(db),
                dres,
                part(&a.atty, l, btc),
                w(l, BlockParam::AttnProjW),
                WeightLayout::InOut,
                rows,
                c,
                c,
            );
            let dqkv = &mut a.dqkv[..3 * btc];
            be.attention_backward(
                dqkv,
                dtmp,
                part(&a.qkv, l, 3 * btc),
                part(&a.atty, l, btc),
                part(&a.lse, l, rows * nh),
                AttnShape { b, t, c, nh },
            );
            let (dw, db) = split2(
                g,
                lay.block_param(l, BlockParam::QkvW),
                lay.block_param(l, BlockParam::QkvB),
            );
            be.matmul_backward(
                dtmp,
                dw,
                Some(db),
                dqkv,
                part(&a.ln1, l, btc),
                w(l, BlockParam::QkvW),
                WeightLayout::InOut,
                rows,
                c,
                3 * c,
            );
            let (dw, db) = split2(
                g,
                lay.block_param(l, BlockParam::Ln1W),
                lay.block_param(l, BlockParam::Ln1B),
            );
            be.layernorm_backward(
                dres,
                dw,
                db,
                dtmp,
                x,
                w(l, BlockParam::Ln1W),
                part(&a.ln1_mean, l, rows),
                part(&a.ln1_rstd, l, rows),
                c,
            );
        }
        let (dwte, dwpe) = split2(g, lay.wte(), lay.wpe());
        be.encoder_backward(dwte, dwpe, dres, tokens, t, c);
        Ok(())
    }
}
