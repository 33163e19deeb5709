//! GPT-2: forward and backward as explicit kernel calls, one unit at a time
//! (`[wte | wpe]`, each block, `[ln_f]`), on parameter slices the caller hands in.
//! `Engine` holds the activations; `Gpt2` adds the full parameter and
//! gradient buffers for the strategies that keep them whole.

pub mod block;
pub mod config;
pub mod family;
pub mod generate;
pub mod hf;
pub mod kv;
pub mod layout;
pub mod rows;

use super::alloc::{part, ActAlloc};
use super::bf16::Precision;
use super::bf16::{matmul_backward, matmul_forward};
use super::layout::ParamLayout;
use super::ops::{io, Dinp, Normed, Ops, Rounded, Stats};
use super::tp;
use super::tp::TpPlace;
use super::unit::{
    check_batch, check_ids, resid, resid_io, resid_mut, EngineCore, Held, Span, SpanRun,
    StageModel, UnitGrads, UnitKind, UnitModel, UnitParams, Weights, Whole,
};
use crate::backend::{
    Activation, AttentionBackward, AttentionForward, AttnShape, Backend, Buf, CrossEntropyBackward,
    CrossEntropyForward, Dst, EncoderBackward, EncoderForward, LayerNormBackward, LayerNormForward,
    MatmulBackward, MatmulForward, MatmulShape, On, Src, StoredBuf, StoredDst, StoredSrc,
    WeightLayout,
};
use crate::comm::Comm;
use crate::data::{Batch as DataBatch, LossTerms};
use crate::error::{Error, Result};
use block::{BlockIo, BlockMode, BlockParams};
use config::{BlockDims, GptConfig};
pub use layout::BlockParam;
use std::ops::Range;

/// GPT-2's layernorm epsilon.
pub const LN_EPS: f32 = 1e-5;

/// Logits a `--recompute` engine holds at once, in floats (256 MiB in fp32):
/// beyond it the head runs in chunks of rows, never the whole (rows,
/// vocabulary) tensor, GPT-2's largest activation.
pub const LOGITS_CHUNK: usize = 1 << 26;

/// Rows of logits the head holds at once: every row's, or when the blocks
/// are recomputed at most `budget` floats' worth (one row at least). In
/// chunks, the head's forward keeps only the last chunk's logits and its
/// backward recomputes the others, chunk by chunk.
fn logits_rows(rows: usize, vp: usize, recompute: bool, budget: usize) -> usize {
    match recompute {
        true => rows.min((budget / vp).max(1)),
        false => rows,
    }
}

/// What one micro-batch keeps from its forward to its backward, for
/// `rows` = B*T tokens: its tokens, the residual stream at the blocks'
/// inputs, and where the head runs its norm, logits and losses. A pipeline
/// holds one of these per micro-batch in flight.
struct Kept<B: Backend> {
    rows: usize,
    tokens: Buf<B, u32>,
    targets: Buf<B, u32>,
    /// Residual stream: block l reads `resid[l]` and writes `resid[l + 1]`;
    /// `resid[0]` is the embedding. Under recomputation a stage without the
    /// head keeps only its blocks' inputs: its output is `Activations::out`.
    resid: Buf<B>,
    /// The final norm's output: in bf16 under `--precision bf16` (only
    /// the head's products read it).
    lnf: StoredBuf<B>,
    lnf_mean: Buf<B>,
    lnf_rstd: Buf<B>,
    /// The head's logits, then their gradient in their place: in bf16
    /// under `--precision bf16` (as PyTorch's autocast holds a bf16
    /// matmul's output), else fp32.
    logits: StoredBuf<B>,
    losses: Buf<B>,
}

/// The blocks' activations and the backward's scratch, for `rows` = B*T
/// tokens. Per-block buffers hold one slot per layer, kept per micro-batch
/// with its [`Kept`]; or, when blocks are recomputed in the backward, a
/// single slot the micro-batches share.
struct Activations<B: Backend> {
    rows: usize,
    /// The stage's output (the residual stream leaving its last block),
    /// where a recomputing stage without the head does not keep it.
    out: Buf<B>,
    /// The norms' outputs, q|k|v, the attention's, the fc product and
    /// GELU's output: in bf16 under `--precision bf16`, as autocast holds a
    /// bf16 product's output and what only bf16 products read.
    ln1: StoredBuf<B>,
    ln1_mean: Buf<B>,
    ln1_rstd: Buf<B>,
    qkv: StoredBuf<B>,
    atty: StoredBuf<B>,
    lse: Buf<B>,
    /// Residual after attention, inside the block.
    res2: Buf<B>,
    ln2: StoredBuf<B>,
    ln2_mean: Buf<B>,
    ln2_rstd: Buf<B>,
    fch: StoredBuf<B>,
    fch_gelu: StoredBuf<B>,
    /// Gradient of the residual stream (backward).
    dres: Buf<B>,
    /// The blocks' and the head's output gradients (`GradsAt`): a
    /// block's worth of scratch for the whole backward, then, with the
    /// backward split in two, what each block's input half and the final
    /// norm's keep for the weight half.
    dgrad: Buf<B>,
    /// Whether the matmuls' products are bf16's (`--precision bf16`).
    bf16: bool,
}

/// Where a block's output gradients sit in `dgrad`: the residual
/// gradient entering the block (`top`, for the MLP projection's weight)
/// and after its MLP (`mid`, for the attention projection's), the MLP's
/// hidden gradient, the two norms' output gradients, the attention
/// output's and the qkv one. The whole backward uses the scratch at the
/// start of `dgrad` for every block, each range reused once what it held
/// is dead: it reads the residual gradient in place (`top` and `mid`
/// empty), the norms' and the attention output's gradients share one
/// range, and the MLP's hidden gradient and the qkv one another. The split
/// backward keeps each block's in its slot after the scratch, where the
/// weight half finds them, and takes only the attention output's from the
/// scratch.
struct GradsAt {
    top: Range<usize>,
    mid: Range<usize>,
    dfch: Range<usize>,
    dln2: Range<usize>,
    datty: Range<usize>,
    dqkv: Range<usize>,
    dln1: Range<usize>,
}

impl GradsAt {
    /// Floats of scratch per row, for blocks no wider than `d`.
    fn scratch(d: BlockDims) -> usize {
        d.c + d.fl.max(3 * d.cl)
    }

    /// Floats a block of widths `d` keeps per row when the backward is split.
    fn per_row(d: BlockDims) -> usize {
        4 * d.c + d.fl + 3 * d.cl
    }

    /// The whole backward's ranges for a block of widths `d`.
    fn whole(d: BlockDims, rows: usize) -> GradsAt {
        let (dln, wide) = (0..rows * d.c, rows * d.c);
        GradsAt {
            top: 0..0,
            mid: 0..0,
            dfch: wide..wide + rows * d.fl,
            dln2: dln.clone(),
            datty: 0..rows * d.cl,
            dqkv: wide..wide + rows * 3 * d.cl,
            dln1: dln,
        }
    }

    /// The split backward's ranges for a block of widths `d` in slot
    /// `slot`, slots being `wide` blocks' size apart.
    fn saved(wide: BlockDims, d: BlockDims, rows: usize, slot: usize) -> GradsAt {
        let mut at = rows * (GradsAt::scratch(wide) + slot * GradsAt::per_row(wide));
        let mut take = |n: usize| {
            at += rows * n;
            at - rows * n..at
        };
        GradsAt {
            top: take(d.c),
            mid: take(d.c),
            dfch: take(d.fl),
            dln2: take(d.c),
            dqkv: take(3 * d.cl),
            dln1: take(d.c),
            datty: GradsAt::whole(d, rows).datty,
        }
    }
}

/// Elements of the activations one rank of tp
/// size `tp` allocates for `run.in_flight` micro-batches of `rows` = B x T
/// tokens each: what each keeps (`Kept`) and the blocks' activations
/// and scratch, a set per micro-batch or, recomputed, one set they share.
/// `Kept::new` and `Activations::new` run against a tally, so the count is
/// the allocation's own (in 4-byte words: bf16 logits count half).
pub fn activation_elems(cfg: &GptConfig, tp: usize, rows: usize, run: &SpanRun) -> usize {
    let head = logits_rows(rows, cfg.padded_vocab(), run.recompute, LOGITS_CHUNK);
    run.in_flight_elems(
        |al| Activations::new(al, cfg, cfg.widest(tp), run, rows),
        |al| Kept::new(al, cfg, run, rows, head),
    )
}

impl<B: Backend> Kept<B> {
    /// A micro-batch's kept buffers: the residual stream at each block's
    /// input (and the stage's output, unless recomputing without the
    /// head), and the head's `logits_rows` rows of logits where it runs.
    fn new(
        al: &ActAlloc<'_, B>,
        cfg: &GptConfig,
        run: &SpanRun,
        rows: usize,
        logits_rows: usize,
    ) -> Result<Self> {
        let (c, span) = (cfg.n_embd, &run.span);
        let a = |n: usize| al.acts(n);
        let h = usize::from(span.head);
        let logits = h * logits_rows * cfg.padded_vocab();
        Ok(Kept {
            rows,
            tokens: al.typed(rows)?,
            targets: al.typed(rows)?,
            resid: a(span.kept_resid(run.recompute) * rows * c)?,
            lnf: al.stored(run.precision, h * rows * c)?,
            lnf_mean: a(h * rows)?,
            lnf_rstd: a(h * rows)?,
            logits: al.stored(run.precision, logits)?,
            losses: a(h * rows)?,
        })
    }

    /// The tied LM head on the final norm's output rows `r`: their logits
    /// at the start of `logits`.
    fn head_logits(
        &mut self,
        be: &B,
        bf16: bool,
        wte: Weights<'_, B>,
        r: Range<usize>,
        c: usize,
        vp: usize,
    ) -> Result<()> {
        let op = MatmulForward {
            out: self.logits.slice_mut(0..r.len() * vp),
            inp: self.lnf.slice(r.start * c..r.end * c),
            w: wte.product(),
            bias: None,
            residual: None,
            shape: MatmulShape::new((r.len(), c, vp), WeightLayout::OutIn),
            accumulate: false,
        };
        matmul_forward(be, bf16, op)
    }
}

impl<B: Backend> Activations<B> {
    fn new(
        al: &ActAlloc<'_, B>,
        cfg: &GptConfig,
        d: BlockDims,
        run: &SpanRun,
        rows: usize,
    ) -> Result<Self> {
        let (span, slots) = (&run.span, run.span.slots(run.recompute));
        let (l, c) = (span.blocks.len(), cfg.n_embd);
        let a = |n: usize| al.acts(n);
        let h = usize::from(span.head);
        let out = usize::from(span.kept_resid(run.recompute) == l);
        Ok(Activations {
            rows,
            out: a(out * rows * c)?,
            ln1: al.stored(run.precision, slots * rows * c)?,
            ln1_mean: a(slots * rows)?,
            ln1_rstd: a(slots * rows)?,
            qkv: al.stored(run.precision, slots * rows * 3 * d.cl)?,
            atty: al.stored(run.precision, slots * rows * d.cl)?,
            lse: a(slots * rows * d.nhl)?,
            res2: a(slots * rows * c)?,
            ln2: al.stored(run.precision, slots * rows * c)?,
            ln2_mean: a(slots * rows)?,
            ln2_rstd: a(slots * rows)?,
            fch: al.stored(run.precision, slots * rows * d.fl)?,
            fch_gelu: al.stored(run.precision, slots * rows * d.fl)?,
            dres: a(rows * c)?,
            dgrad: a(rows
                * (GradsAt::scratch(d)
                    + usize::from(run.split) * (l * GradsAt::per_row(d) + h * c)))?,
            bf16: run.precision == Precision::Bf16,
        })
    }
}

/// The (b, t) and host tokens of the current forward; tokens and targets
/// are on the device in the activations.
struct Batch {
    b: usize,
    t: usize,
    tokens: Vec<u32>,
    has_targets: bool,
    /// What the summed loss is divided by.
    loss_terms: f32,
}

/// The model without its parameters: config, this rank's layout, the
/// activations, and the unit-by-unit forward and backward.
pub struct Engine<B: Backend> {
    pub config: GptConfig,
    pub core: EngineCore<B>,
    /// Keep only block inputs in the forward; recompute each block in the
    /// backward, and the head's logits beyond `logits_budget` floats.
    pub recompute: bool,
    /// Floats of logits a recomputing engine holds at once ([`LOGITS_CHUNK`]).
    logits_budget: usize,
    precision: Precision,
    /// The units this engine runs (all, or a pipeline stage's).
    span: Span,
    /// Each backward runs as an input half and a weight half (`split_backward`).
    split: bool,
    held: Held<Kept<B>, Activations<B>, Batch>,
}

impl<B: Backend> Engine<B> {
    pub fn new(backend: B, config: GptConfig, tp: TpPlace, recompute: bool) -> Result<Self> {
        config.validate()?;
        config.check_tp(tp.size)?;
        let span = Span::all(config.n_layer);
        Ok(Engine {
            core: EngineCore {
                layout: layout::layout(&config, tp.size),
                whole: ParamLayout::new(&config),
                backend,
                tp,
            },
            config,
            recompute,
            logits_budget: LOGITS_CHUNK,
            precision: Precision::Fp32,
            span,
            split: false,
            held: Held::new(recompute),
        })
    }

    /// The matmuls' arithmetic from the next `begin` on.
    pub fn set_precision(&mut self, precision: Precision) {
        if precision != self.precision {
            self.precision = precision;
            self.held.clear();
        }
    }

    /// Floats of logits a recomputing engine holds at once from the next
    /// `begin` on ([`LOGITS_CHUNK`] unless set).
    pub fn set_logits_budget(&mut self, floats: usize) {
        if floats != self.logits_budget {
            self.logits_budget = floats;
            self.held.clear();
        }
    }

    /// Block l's widths on this rank.
    fn dims(&self, l: usize) -> BlockDims {
        self.config.dims(l, self.core.tp.size)
    }

    /// The widths per-block buffers are sized for.
    fn widest(&self) -> BlockDims {
        self.config.widest(self.core.tp.size)
    }

    /// Checks a batch, readies the activations for it and copies its tokens
    /// (and targets) to the device; the mean loss divides by `loss_terms`.
    fn begin_lm(
        &mut self,
        tokens: &[u32],
        targets: Option<&[u32]>,
        b: usize,
        t: usize,
        loss_terms: f32,
    ) -> Result<()> {
        let v = self.config.vocab_size;
        check_batch(tokens, b, t, self.config.block_size)?;
        check_ids("token id", tokens, v, false)?;
        if let Some(tg) = targets {
            if tg.len() != tokens.len() {
                return Err(Error::Input(format!(
                    "{} targets for {} tokens",
                    tg.len(),
                    tokens.len()
                )));
            }
            check_ids("target id", tg, v, false)?;
        }
        let rows = b * t;
        let be = &self.core.backend;
        let al = ActAlloc::on(be);
        let (wd, head) = (self.widest(), self.logits_rows(rows));
        let run = SpanRun::one(&self.span, self.recompute, self.split, self.precision);
        let make = || Activations::new(&al, &self.config, wd, &run, rows);
        self.held.ready_acts(|a| a.rows >= rows, make)?;
        let make = || Kept::new(&al, &self.config, &run, rows, head);
        let k = self.held.ready_kept(|k| k.rows >= rows, make)?;
        be.upload(k.tokens.slice_mut(0..rows), tokens)?;
        if let Some(tg) = targets {
            be.upload(k.targets.slice_mut(0..rows), tg)?;
        }
        self.held.set_batch(Batch {
            b,
            t,
            tokens: tokens.to_vec(),
            has_targets: targets.is_some(),
            loss_terms,
        });
        Ok(())
    }

    fn shape(&self) -> (usize, usize) {
        let b = self.held.batch();
        (b.b, b.t)
    }

    /// Rows of logits this engine holds at once for a batch of `rows`.
    fn logits_rows(&self, rows: usize) -> usize {
        let vp = self.config.padded_vocab();
        logits_rows(rows, vp, self.recompute, self.logits_budget)
    }

    /// The logits of every row of the last forward are held (not only a chunk's).
    fn logits_kept(&self) -> Result<()> {
        let (b, t) = self.shape();
        let n = self.logits_rows(b * t);
        match n < b * t {
            true => Err(Error::Config(format!(
                "a --recompute forward over {} rows holds the logits of {n} at a time, \
                 not every row's: read logits without --recompute or with fewer rows",
                b * t
            ))),
            false => Ok(()),
        }
    }

    fn slot(&self, l: usize) -> usize {
        self.span.slot(l, self.recompute)
    }

    /// `resid[0]` = `wte[tokens]` + wpe; `emb` is the [wte | wpe] unit.
    fn embed_forward(&mut self, emb: Src<'_, B>) -> Result<()> {
        let (b, t) = self.shape();
        let c = self.config.n_embd;
        let (wte_len, rows) = (self.config.padded_vocab() * c, b * t);
        let (k, a, _) = self.held.get_mut();
        self.core.backend.run(EncoderForward {
            out: resid_mut(&mut k.resid, &mut a.out, 0, rows * c),
            tokens: k.tokens.slice(0..rows),
            wte: emb.first(wte_len),
            wpe: emb.from(wte_len),
            t,
            c,
        })
    }

    /// Block l: `resid[l]` -> `resid[l + 1]`; `p` is this rank's slice of the block.
    fn block_forward(&mut self, l: usize, p: Weights<'_, B>, tp: Option<&dyn Comm>) -> Result<()> {
        let (b, t) = self.shape();
        let (d, wd) = (self.dims(l), self.widest());
        let BlockDims { c, cl, nhl, fl } = d;
        let rows = b * t;
        let btc = rows * c;
        let (s, r) = (self.slot(l), self.span.resid(l));
        let (k, a, _) = self.held.get_mut();
        let (x, out) = resid_io(&mut k.resid, &mut a.out, r, btc);
        let io = BlockIo {
            x,
            out,
            ln1: Normed {
                out: a.ln1.slice_mut(part(s, btc, btc)),
                mean: a.ln1_mean.d().part(s, rows),
                rstd: a.ln1_rstd.d().part(s, rows),
            },
            qkv: a.qkv.slice_mut(part(s, 3 * rows * wd.cl, 3 * rows * cl)),
            atty: a.atty.slice_mut(part(s, rows * wd.cl, rows * cl)),
            res2: a.res2.d().part(s, btc),
            ln2: Normed {
                out: a.ln2.slice_mut(part(s, btc, btc)),
                mean: a.ln2_mean.d().part(s, rows),
                rstd: a.ln2_rstd.d().part(s, rows),
            },
            fch: a.fch.slice_mut(part(s, rows * wd.fl, rows * fl)),
            fch_gelu: a.fch_gelu.slice_mut(part(s, rows * wd.fl, rows * fl)),
        };
        let EngineCore { backend: be, .. } = &self.core;
        let mut mode = Training {
            be,
            bf16: a.bf16,
            lse: a.lse.d().part(s, rows * wd.nhl).first(rows * nhl),
            shape: d.attn(b, t, a.bf16),
        };
        let (lay, tp) = (&self.core.layout, self.core.tp.in_group(tp));
        block::forward(be, &mut mode, io, BlockParams { lay, l, p }, rows, d, tp)
    }

    /// ln_f and the tied LM head; the mean loss when the batch has targets.
    /// The head runs in chunks of [`Engine::logits_rows`] rows, keeping
    /// the last chunk's logits (every row's when it is one chunk).
    fn head_forward(&mut self, wte: Weights<'_, B>, lnf: Src<'_, B>) -> Result<Option<f32>> {
        let (b, t) = self.shape();
        let cfg = &self.config;
        let (c, n_layer, v, vp) = (cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.padded_vocab());
        let (rows, be) = (b * t, &self.core.backend);
        let btc = rows * c;
        let top = self.span.resid(n_layer);
        let chunk = self.logits_rows(rows);
        let (k, a, batch) = self.held.get_mut();
        let bf16 = a.bf16;
        be.run(LayerNormForward {
            out: k.lnf.slice_mut(0..btc),
            mean: k.lnf_mean.slice_mut(0..rows),
            rstd: k.lnf_rstd.slice_mut(0..rows),
            inp: resid(&k.resid, &a.out, top, btc),
            w: lnf.first(c),
            b: lnf.from(c),
            c,
            eps: LN_EPS,
        })?;
        if !batch.has_targets {
            // logits for reading, which only a forward in one chunk keeps
            if chunk == rows {
                k.head_logits(be, bf16, wte, 0..rows, c, vp)?;
            }
            return Ok(None);
        }
        for r0 in (0..rows).step_by(chunk) {
            let r = r0..rows.min(r0 + chunk);
            k.head_logits(be, bf16, wte, r.clone(), c, vp)?;
            be.run(CrossEntropyForward {
                losses: k.losses.slice_mut(r.clone()),
                logits: k.logits.slice(0..r.len() * vp),
                targets: k.targets.slice(r),
                v,
                vp,
            })?;
        }
        Ok(Some(
            (be.sum(k.losses.slice(0..rows))? / batch.loss_terms as f64) as f32,
        ))
    }

    /// Logits (vocab_size, padding dropped) at (batch row bi, position ti) of the last forward.
    pub fn logits(&self, bi: usize, ti: usize) -> Result<Vec<f32>> {
        self.logits_kept()?;
        let (k, batch) = (self.held.kept(), self.held.batch());
        let vp = self.config.padded_vocab();
        let row = bi * batch.t + ti;
        k.logits
            .slice(row * vp..row * vp + self.config.vocab_size)
            .to_host(self.backend())
    }

    /// Backward of the head for `loss_scale * mean loss`: the logits'
    /// gradient (in place of the logits), the final norm's output gradient
    /// and the residual gradient it starts. Given `grads` = (dwte, dlnf
    /// `[w | b]`), they accumulate; without, this is the split backward's
    /// input half, and `head_backward_weight` reads what it leaves.
    fn head_backward(
        &mut self,
        wte: Weights<'_, B>,
        lnf: Src<'_, B>,
        grads: Option<(Dst<'_, B>, Dst<'_, B>)>,
        loss_scale: f32,
    ) -> Result<()> {
        let (b, t) = self.shape();
        let cfg = &self.config;
        let (c, n_layer, v, vp) = (cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.padded_vocab());
        let (rows, be) = (b * t, &self.core.backend);
        let btc = rows * c;
        if !self.held.batch().has_targets {
            return Err(Error::Input("backward needs a forward with targets".into()));
        }
        let (top, at) = (
            self.span.resid(n_layer),
            self.head_at(rows, grads.is_some()),
        );
        let chunk = self.logits_rows(rows);
        let (k, a, batch) = self.held.get_mut();
        let (mut dwte, dlnf) = grads.unzip();
        // the last chunk's logits are the forward's; the others' again
        let last = (rows - 1) / chunk;
        for i in (0..=last).rev() {
            let (r0, r) = (i * chunk, i * chunk..rows.min((i + 1) * chunk));
            if i < last {
                k.head_logits(be, a.bf16, wte, r.clone(), c, vp)?;
            }
            let mut logits = k.logits.slice_mut(0..r.len() * vp);
            be.run(CrossEntropyBackward {
                logits: logits.rb(),
                targets: k.targets.slice(r.clone()),
                v,
                vp,
                dloss: loss_scale / batch.loss_terms,
            })?;
            let op = MatmulBackward {
                dinp: Some(a.dgrad.slice_mut(at.start + r0 * c..at.start + r.end * c)),
                dw: dwte.as_mut().map(|d| d.rb()),
                dbias: None,
                dout: logits.src(),
                inp: k.lnf.slice(r0 * c..r.end * c),
                w: wte.product(),
                shape: MatmulShape::new((r.len(), c, vp), WeightLayout::OutIn),
            };
            matmul_backward(be, a.bf16, op)?;
        }
        let dln = a.dgrad.slice(at);
        let dres = a.dres.slice_mut(0..btc);
        be.run(LayerNormBackward {
            dinp: Some(dres),
            dwb: dlnf.map(|d| d.split_at(c)),
            dout: dln,
            inp: resid(&k.resid, &a.out, top, btc),
            w: lnf.first(c),
            mean: k.lnf_mean.slice(0..rows),
            rstd: k.lnf_rstd.slice(0..rows),
            c,
            accumulate: false,
        })
    }

    /// Backward of block l: the residual gradient moves from resid[l + 1]
    /// to `resid[l]`. Given `g`, the block's parameter gradients accumulate
    /// into it, and with recomputation its forward runs again first;
    /// without, this is the split backward's input half, which keeps the
    /// output gradients `block_backward_weight` reads in the block's slot.
    /// Long by design: the block's kernels in reverse order, each on views
    /// of the same activation and gradient buffers (split into functions,
    /// those views would be passed from one to the next).
    fn block_backward(
        &mut self,
        l: usize,
        p: Weights<'_, B>,
        g: Option<Dst<'_, B>>,
        tp: Option<&dyn Comm>,
    ) -> Result<()> {
        use BlockParam::*;
        if self.recompute {
            self.block_forward(l, p, tp)?;
        }
        let (b, t) = self.shape();
        let (d, wd) = (self.dims(l), self.widest());
        let BlockDims { c, cl, nhl, fl } = d;
        let rows = b * t;
        let btc = rows * c;
        let (s, r) = (self.slot(l), self.span.resid(l));
        let (split, at) = match g {
            Some(_) => (false, GradsAt::whole(d, rows)),
            None => (true, GradsAt::saved(wd, d, rows, s)),
        };
        let (be, lay) = (&self.core.backend, &self.core.layout);
        let (k, a, _) = self.held.get_mut();
        let pos = |bp: BlockParam| lay.in_block(l, bp);
        let mut ops = Ops::new(be, a.bf16, c, LN_EPS, p, g, &pos);
        let kept = |m, r| Stats::slot(m, r, s, rows);
        let mut dres = a.dres.slice_mut(0..btc);
        let mut dg = a.dgrad.d();
        if split {
            be.copy(dg.rb().slice(at.top.clone()), dres.src());
        }
        let mut dfch = dg.rb().slice(at.dfch.clone());
        let fch_gelu = a.fch_gelu.slice(part(s, rows * wd.fl, rows * fl));
        let (dinp, shape) = (Some(dfch.rb()), io(rows, fl, c));
        ops.linear_back(dinp, dres.src(), fch_gelu, FcProjW, Some(FcProjB), shape)?;
        // GELU's backward adds the fc bias's gradient in the same pass (in
        // a split backward, the weight half's product adds it); under bf16
        // its result, and later q|k|v's gradient, go into GELU's output
        let fch = a.fch.slice(part(s, rows * wd.fl, rows * fl));
        let gelu_at = part(s, rows * wd.fl, rows * fl);
        let dgelu = Rounded::new(&a.fch_gelu, gelu_at.clone(), rows * fl, !split);
        let dqkv_at = Rounded::new(&a.fch_gelu, gelu_at, 3 * rows * cl, !split);
        ops.act_back(
            dfch,
            fch,
            FcB,
            Activation::GeluTanh,
            dgelu.bf16(&mut a.fch_gelu),
        )?;
        let (dfch, mut dln2) = dg.rb().split2(at.dfch.clone(), at.dln2.clone());
        let dfch = dgelu.src(&a.fch_gelu, dfch.into_src());
        let (ln2, shape) = (a.ln2.slice(part(s, btc, btc)), io(rows, c, fl));
        ops.linear_back(Some(dln2.rb()), dfch, ln2, FcW, None, shape)?;
        tp::all_reduce(be, tp, dln2.rb())?;
        let (res2, kept2) = (a.res2.s().part(s, btc), kept(&a.ln2_mean, &a.ln2_rstd));
        ops.ln_back(Dinp::Add(dres.rb()), dln2.src(), res2, kept2, Ln2W, Ln2B)?;
        if split {
            be.copy(dg.rb().slice(at.mid.clone()), dres.src());
        }
        let (mut datty, mut dqkv) = dg.rb().split2(at.datty.clone(), at.dqkv.clone());
        let atty = a.atty.slice(part(s, rows * wd.cl, rows * cl));
        let (dinp, shape) = (Some(datty.rb()), io(rows, cl, c));
        ops.linear_back(dinp, dres.src(), atty, AttnProjW, Some(AttnProjB), shape)?;
        be.run(AttentionBackward {
            dqkv: dqkv_at.dst(&mut a.fch_gelu, dqkv.rb()),
            dout: datty.src(),
            qkv: a.qkv.slice(part(s, 3 * rows * wd.cl, 3 * rows * cl)),
            out: atty,
            lse: a.lse.s().part(s, rows * wd.nhl).first(rows * nhl),
            lens: None,
            shape: d.attn(b, t, ops.bf16),
        })?;
        dqkv_at.round_scratch(be, dqkv);
        let (dqkv, mut dln1) = dg.rb().split2(at.dqkv.clone(), at.dln1.clone());
        let dqkv = dqkv_at.src(&a.fch_gelu, dqkv.into_src());
        let (ln1, shape) = (a.ln1.slice(part(s, btc, btc)), io(rows, c, 3 * cl));
        ops.linear_back(Some(dln1.rb()), dqkv, ln1, QkvW, Some(QkvB), shape)?;
        tp::all_reduce(be, tp, dln1.rb())?;
        let (x, kept1) = (k.resid.s().part(r, btc), kept(&a.ln1_mean, &a.ln1_rstd));
        ops.ln_back(Dinp::Add(dres), dln1.src(), x, kept1, Ln1W, Ln1B)
    }

    /// Gradient of the [wte | wpe] unit from the residual gradient (accumulates into `demb`).
    fn embed_backward(&mut self, demb: Dst<'_, B>) -> Result<()> {
        let (_, t) = self.shape();
        let c = self.config.n_embd;
        let wte_len = self.config.padded_vocab() * c;
        let (k, a, batch) = self.held.get_mut();
        let rows = batch.tokens.len();
        let (dwte, dwpe) = demb.split_at(wte_len);
        self.core.backend.run(EncoderBackward {
            dwte,
            dwpe,
            dout: a.dres.slice(0..rows * c),
            tokens: k.tokens.slice(0..rows),
            host_tokens: &batch.tokens,
            t,
            c,
        })
    }

    /// Where the final norm's output gradient sits in `dgrad`: in the
    /// scratch for the whole backward, after the blocks' slots for the split one.
    fn head_at(&self, rows: usize, whole: bool) -> Range<usize> {
        let wd = self.widest();
        if whole {
            return GradsAt::whole(wd, rows).dln2;
        }
        let at = rows * (GradsAt::scratch(wd) + self.span.blocks.len() * GradsAt::per_row(wd));
        at..at + rows * self.config.n_embd
    }

    /// The head's weight half: dwte and dlnf from what the input half left.
    fn head_backward_weight(
        &mut self,
        wte: Src<'_, B>,
        lnf: Src<'_, B>,
        dwte: Dst<'_, B>,
        dlnf: Dst<'_, B>,
    ) -> Result<()> {
        let (b, t) = self.shape();
        let cfg = &self.config;
        let (c, n_layer, vp) = (cfg.n_embd, cfg.n_layer, cfg.padded_vocab());
        let (rows, be) = (b * t, &self.core.backend);
        let btc = rows * c;
        let (top, at) = (self.span.resid(n_layer), self.head_at(rows, false));
        let (k, a) = (self.held.kept(), self.held.acts());
        be.run(MatmulBackward {
            dinp: None,
            dw: Some(dwte),
            dbias: None,
            dout: k.logits.slice(0..rows * vp),
            inp: k.lnf.slice(0..btc),
            w: wte.into(),
            shape: MatmulShape::new((rows, c, vp), WeightLayout::OutIn),
        })?;
        be.run(LayerNormBackward {
            dinp: None,
            dwb: Some(dlnf.split_at(c)),
            dout: a.dgrad.slice(at),
            inp: resid(&k.resid, &a.out, top, btc),
            w: lnf.first(c),
            mean: k.lnf_mean.slice(0..rows),
            rstd: k.lnf_rstd.slice(0..rows),
            c,
            accumulate: true,
        })
    }

    /// Block l's weight half: its parameters' gradients accumulate into
    /// `g` from the output gradients its input half saved.
    fn block_backward_weight(&mut self, l: usize, p: Src<'_, B>, g: Dst<'_, B>) -> Result<()> {
        use BlockParam::*;
        let (b, t) = self.shape();
        let (d, wd) = (self.dims(l), self.widest());
        let BlockDims { c, cl, fl, .. } = d;
        let rows = b * t;
        let btc = rows * c;
        let (s, r) = (self.slot(l), self.span.resid(l));
        let (be, lay) = (&self.core.backend, &self.core.layout);
        let (k, a) = (self.held.kept(), self.held.acts());
        let pos = |bp: BlockParam| lay.in_block(l, bp);
        let mut ops = Ops::new(be, false, c, LN_EPS, p, Some(g), &pos);
        let at = GradsAt::saved(wd, d, rows, s);
        let saved = |r: &Range<usize>| a.dgrad.slice(r.clone());
        let kept = |m, r| Stats::slot(m, r, s, rows);
        let fch_gelu = a.fch_gelu.slice(part(s, rows * wd.fl, rows * fl));
        let atty = a.atty.slice(part(s, rows * wd.cl, rows * cl));
        let (ln2, ln1) = (
            a.ln2.slice(part(s, btc, btc)),
            a.ln1.slice(part(s, btc, btc)),
        );
        let top = (saved(&at.top), io(rows, fl, c));
        ops.linear_back(None, top.0, fch_gelu, FcProjW, Some(FcProjB), top.1)?;
        ops.linear_back(None, saved(&at.dfch), ln2, FcW, Some(FcB), io(rows, c, fl))?;
        let mid = (saved(&at.mid), io(rows, cl, c));
        ops.linear_back(None, mid.0, atty, AttnProjW, Some(AttnProjB), mid.1)?;
        let dqkv = (saved(&at.dqkv), io(rows, c, 3 * cl));
        ops.linear_back(None, dqkv.0, ln1, QkvW, Some(QkvB), dqkv.1)?;
        let (res2, kept2) = (a.res2.s().part(s, btc), kept(&a.ln2_mean, &a.ln2_rstd));
        ops.ln_back(Dinp::Skip, saved(&at.dln2), res2, kept2, Ln2W, Ln2B)?;
        let (x, kept1) = (k.resid.s().part(r, btc), kept(&a.ln1_mean, &a.ln1_rstd));
        ops.ln_back(Dinp::Skip, saved(&at.dln1), x, kept1, Ln1W, Ln1B)
    }
}

/// The training mode of the block forward: whole sequences of `shape`,
/// the weights as they are (bf16 products where `bf16`),
/// attention's log-sum-exp kept in `lse` for the backward.
struct Training<'s, 'a, B: Backend> {
    be: &'s B,
    bf16: bool,
    lse: Dst<'a, B>,
    shape: AttnShape,
}

impl<B: Backend> BlockMode<B> for Training<'_, '_, B> {
    fn matmul(&mut self, _: BlockParam, op: MatmulForward<On<'_, B>>) -> Result<()> {
        matmul_forward(self.be, self.bf16, op)
    }
    fn attention(&mut self, atty: StoredDst<'_, B>, qkv: StoredSrc<'_, B>) -> Result<()> {
        self.be.run(AttentionForward {
            out: atty,
            lse: self.lse.rb(),
            qkv,
            lens: None,
            shape: self.shape,
        })
    }
}

impl<B: Backend> UnitModel<B> for Engine<B> {
    fn core(&self) -> &EngineCore<B> {
        &self.core
    }

    fn begin(
        &mut self,
        batch: &DataBatch,
        b: usize,
        t: usize,
        loss_terms: LossTerms,
    ) -> Result<()> {
        let targets = (!batch.targets.is_empty()).then_some(&batch.targets[..]);
        self.begin_lm(&batch.inputs, targets, b, t, loss_terms.targets)
    }

    fn outputs(&self) -> Result<Vec<f32>> {
        self.logits_kept()?;
        let (k, batch) = (self.held.kept(), self.held.batch());
        let (v, vp) = (self.config.vocab_size, self.config.padded_vocab());
        let all = k.logits.slice(0..batch.b * batch.t * vp);
        let all = all.to_host(self.backend())?;
        Ok(all.chunks(vp).flat_map(|r| r[..v].to_vec()).collect())
    }

    /// Unit 0 is [wte | wpe], 1..=L the blocks, L + 1 ln_f with the tied LM head.
    fn forward(
        &mut self,
        u: usize,
        p: UnitParams<'_, B>,
        tp: Option<&dyn Comm>,
    ) -> Result<Option<f32>> {
        match UnitKind::of(u, self.config.n_layer) {
            UnitKind::Embeddings => self.embed_forward(p.own.fp32)?,
            UnitKind::Block(l) => self.block_forward(l, p.own, tp)?,
            UnitKind::Head => {
                return self.head_forward(p.tied.expect("the head reads wte"), p.own.fp32);
            }
        }
        Ok(None)
    }

    fn backward(
        &mut self,
        u: usize,
        p: UnitParams<'_, B>,
        g: UnitGrads<'_, B>,
        tp: Option<&dyn Comm>,
        loss_scale: f32,
    ) -> Result<()> {
        match UnitKind::of(u, self.config.n_layer) {
            UnitKind::Embeddings => self.embed_backward(g.own)?,
            UnitKind::Block(l) => self.block_backward(l, p.own, Some(g.own), tp)?,
            UnitKind::Head => self.head_backward(
                p.tied.expect("the head reads wte"),
                p.own.fp32,
                Some((g.tied.expect("the head accumulates dwte"), g.own)),
                loss_scale,
            )?,
        }
        Ok(())
    }

    fn hold(&mut self, slot: usize) {
        self.held.hold(slot);
    }

    fn free_activations(&mut self) {
        self.held.release();
    }

    fn as_stage(&mut self) -> Result<&mut dyn StageModel<B>> {
        Ok(self)
    }
}

impl<B: Backend> StageModel<B> for Engine<B> {
    fn boundary(&mut self, u: usize) -> Dst<'_, B> {
        let (b, t) = self.shape();
        let (k, a, _) = self.held.get_mut();
        let r = self.span.resid(u - 1);
        resid_mut(&mut k.resid, &mut a.out, r, b * t * self.config.n_embd)
    }

    fn boundary_grad(&mut self) -> Dst<'_, B> {
        let (b, t) = self.shape();
        let (_, a, _) = self.held.get_mut();
        a.dres.slice_mut(0..b * t * self.config.n_embd)
    }

    fn set_units(&mut self, units: Range<usize>) {
        self.span = Span::of_units(units, self.config.n_layer);
        self.held.clear();
    }

    fn split_backward(&mut self) -> Result<()> {
        if self.recompute || self.precision != Precision::Fp32 {
            return Err(Error::Config(
                "a split backward (zb-h1) runs in fp32 without --recompute: \
                 the weight half needs every block's activations, unrounded"
                    .into(),
            ));
        }
        self.split = true;
        self.held.clear();
        Ok(())
    }

    fn backward_input(
        &mut self,
        u: usize,
        p: UnitParams<'_, B>,
        tp: Option<&dyn Comm>,
        loss_scale: f32,
    ) -> Result<()> {
        debug_assert!(self.split, "split_backward first");
        match UnitKind::of(u, self.config.n_layer) {
            UnitKind::Embeddings => Ok(()),
            UnitKind::Block(l) => self.block_backward(l, p.own, None, tp),
            UnitKind::Head => self.head_backward(
                p.tied.expect("the head reads wte"),
                p.own.fp32,
                None,
                loss_scale,
            ),
        }
    }

    fn backward_weight(
        &mut self,
        u: usize,
        p: UnitParams<'_, B>,
        g: UnitGrads<'_, B>,
    ) -> Result<()> {
        match UnitKind::of(u, self.config.n_layer) {
            UnitKind::Embeddings => self.embed_backward(g.own),
            UnitKind::Block(l) => self.block_backward_weight(l, p.own.fp32, g.own),
            UnitKind::Head => self.head_backward_weight(
                p.tied.expect("the head reads wte").fp32,
                p.own.fp32,
                g.tied.expect("the head accumulates dwte"),
                g.own,
            ),
        }
    }
}

/// The GPT-2 engine with whole parameter and gradient buffers.
pub type Gpt2<B> = Whole<B, Engine<B>>;

impl<B: Backend> Whole<B, Engine<B>> {
    /// A whole model with zero parameters (to be loaded or initialised).
    pub fn new(backend: B, config: GptConfig) -> Result<Self> {
        Self::with_engine(Engine::new(backend, config, TpPlace::NONE, false)?)
    }

    /// A whole model on `backend` holding `params`.
    pub fn with_params(backend: B, config: GptConfig, params: &[f32]) -> Result<Self> {
        let mut model = Self::new(backend, config)?;
        model.set_params(params)?;
        Ok(model)
    }

    pub fn backend(&self) -> &B {
        &self.engine.core.backend
    }

    /// GPT-2 initialisation of this rank's parameters.
    pub fn init_weights(&mut self, seed: u64) -> Result<()> {
        let full = init_full(&self.engine.config, seed);
        self.load_full(&full)
    }

    /// Runs the model on tokens (B*T); returns the mean loss when targets are given.
    pub fn forward(
        &mut self,
        tokens: &[u32],
        targets: Option<&[u32]>,
        b: usize,
        t: usize,
    ) -> Result<Option<f32>> {
        let batch = DataBatch::lm(
            tokens.to_vec(),
            targets.map(<[u32]>::to_vec).unwrap_or_default(),
        );
        self.run_forward(&batch, (b, t), LossTerms::of(b * t), None)
    }

    /// Accumulates into `grads` the gradient of `loss_scale * mean loss` of
    /// the last forward (which must have had targets). Consumes the logits.
    pub fn backward(&mut self, loss_scale: f32) -> Result<()> {
        self.run_backward(loss_scale, None, |_, _, _| Ok(()))
    }
}

/// GPT-2 initialisation of the whole model: N(0, 0.02) weights, residual
/// projections scaled by 1/sqrt(2L), zero biases, unit layernorms, zero
/// padded vocabulary rows. Every strategy shards this same tensor.
pub fn init_full(cfg: &GptConfig, seed: u64) -> Vec<f32> {
    let proj_std = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
    let std = |name: &str| match name.ends_with("c_proj.weight") {
        true => proj_std,
        false => 0.02,
    };
    ParamLayout::new(cfg).init(seed, cfg.vocab_size, std)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--precision bf16` rounds the forward's matmul operands too: the
    /// forward's loss moves off fp32's, by no more than bf16's rounding
    /// moves it (a forward multiplying in fp32 would give fp32's loss to
    /// the bit).
    #[test]
    fn a_bf16_forward_rounds_its_matmuls() {
        let cfg = GptConfig::preset("tiny").unwrap();
        let (b, t) = (2, 16);
        let mut rng = crate::rng::Rng::new(3);
        let mut ids = || -> Vec<u32> {
            (0..b * t)
                .map(|_| rng.below(cfg.vocab_size) as u32)
                .collect()
        };
        let (tokens, targets) = (ids(), ids());
        let loss = |precision| {
            let mut m = Gpt2::new(crate::backend::cpu::Cpu::new(), cfg.clone()).unwrap();
            m.init_weights(1).unwrap();
            m.engine.set_precision(precision);
            m.forward(&tokens, Some(&targets), b, t).unwrap().unwrap()
        };
        let (fp32, bf16) = (loss(Precision::Fp32), loss(Precision::Bf16));
        let gap = ((bf16 - fp32) / fp32).abs();
        assert!(gap > 0.0 && gap < 1e-2, "fp32 loss {fp32}, bf16 {bf16}");
    }

    /// Under `--precision bf16` q|k|v's gradient is held in bf16 and its
    /// bias's gradient summed from those values: over one token each
    /// block's qkv bias gradient is that token's q|k|v gradient, every
    /// element a bf16 value (under fp32, not every one); dense, and with
    /// MLPs pruned narrower than q|k|v (GELU's output's slot too small to
    /// hold its gradient: rounded where it lies in fp32 scratch).
    #[test]
    fn a_bf16_qkv_gradient_is_held_in_bf16() {
        let dense = GptConfig::preset("tiny").unwrap();
        let mut pruned = dense.clone();
        pruned.blocks = (0..dense.n_layer)
            .map(|_| config::BlockWidth {
                heads: dense.n_head,
                hidden: 16,
            })
            .collect();
        for ((what, cfg), precision) in [("dense", &dense), ("pruned", &pruned)]
            .into_iter()
            .flat_map(|c| [(c, Precision::Fp32), (c, Precision::Bf16)])
        {
            let lay = ParamLayout::new(cfg);
            let mut m = Gpt2::new(crate::backend::cpu::Cpu::new(), cfg.clone()).unwrap();
            m.init_weights(1).unwrap();
            m.engine.set_precision(precision);
            m.forward(&[3], Some(&[5]), 1, 1).unwrap();
            m.backward(1.0).unwrap();
            let grads = crate::backend::Device::to_host(m.backend(), m.grads.s()).unwrap();
            for l in 0..cfg.n_layer {
                let db = &grads[lay.block_param(l, BlockParam::QkvB)];
                let at = format!("{what} {precision}: block {l}");
                assert!(db.iter().any(|&g| g != 0.0), "{at}");
                let held = db.iter().all(|g| g.to_bits() & 0xffff == 0);
                assert_eq!(held, precision == Precision::Bf16, "{at}");
            }
        }
    }

    /// GPT-2's activations counted by hand, per row (B x T tokens): the
    /// residual stream at every block's edge; per block its two norms'
    /// outputs and statistics, q|k|v, attention's output and log-sum-exp,
    /// the residual between and the MLP's hidden state before and after
    /// GELU (each sized for the widest block); the head's norm, logits and
    /// losses; the backward's residual gradient and its scratch (C, and the
    /// wider of the MLP's hidden gradient and q|k|v's, which are never
    /// alive together). A split backward keeps each block's output
    /// gradients (4C + hidden + q|k|v) and the final norm's (C) besides.
    /// Dense, and pruned to an MLP narrower than q|k|v.
    #[test]
    fn the_activations_are_the_buffers_the_backward_needs_and_no_more() {
        let dense = GptConfig::preset("tiny").unwrap();
        let mut pruned = dense.clone();
        pruned.blocks = vec![
            config::BlockWidth {
                heads: 2,
                hidden: 16,
            },
            config::BlockWidth {
                heads: 1,
                hidden: 40,
            },
        ];
        // (config, the widest block's q|k|v width / 3, heads, MLP width)
        for (cfg, cl, nh, fl) in [(&dense, 32, 2, 128), (&pruned, 32, 2, 40)] {
            let (l, c, vp) = (cfg.n_layer, cfg.n_embd, cfg.padded_vocab());
            let rows = 3 * 5;
            // bf16 norms', q|k|v's, attention's, fc's, GELU's outputs and
            // logits: two to a word
            for (precision, half) in [(Precision::Fp32, 1), (Precision::Bf16, 2)] {
                let block =
                    2 * (c / half + 2) + 3 * cl / half + cl / half + nh + c + 2 * (fl / half);
                let head = c / half + 2 + vp / half + 1;
                let whole = (l + 1) * c + l * block + head + c + (c + fl.max(3 * cl));
                let saved = l * (4 * c + fl + 3 * cl) + c;
                for (split, per_row) in [(false, whole), (true, whole + saved)] {
                    let run = SpanRun::one(&Span::all(l), false, split, precision);
                    // tokens and targets are a row each
                    let want = 2 * rows + rows * per_row;
                    let got = activation_elems(cfg, 1, rows, &run);
                    assert_eq!(got, want, "{cfg}, split {split}, {precision}");
                }
            }
        }
    }

    /// Each micro-batch in flight on a recomputing stage costs its tokens,
    /// its targets and its blocks' inputs (the stage's output is sent on,
    /// and the head's stage keeps its own input and head buffers), counted
    /// by hand; without recomputation it costs its blocks' whole
    /// activations and scratch too.
    #[test]
    fn a_recomputing_stage_keeps_its_blocks_inputs_per_micro_batch() {
        let cfg = GptConfig::preset("tiny").unwrap();
        let (c, rows) = (cfg.n_embd, 4 * 8);
        let elems = |span: &Span, recompute, in_flight| {
            let run = SpanRun {
                in_flight,
                ..SpanRun::one(span, recompute, false, Precision::Fp32)
            };
            activation_elems(&cfg, 1, rows, &run)
        };
        let first = Span::of_units(0..2, cfg.n_layer); // embeddings and block 0
        assert_eq!(first.blocks.len(), 1);
        let each = |span: &Span, recompute| elems(span, recompute, 5) - elems(span, recompute, 4);
        assert_eq!(each(&first, true), rows * (2 + c));
        assert!(each(&first, false) > rows * (2 + 2 * c) + rows * 3 * c);
        // the head's stage keeps block 1's input, the head's input, its
        // norm (C and 2 statistics), its logits and losses
        let last = Span::of_units(2..cfg.n_layer + 2, cfg.n_layer);
        let vp = cfg.padded_vocab();
        assert_eq!(each(&last, true), rows * (2 + 2 * c + c + 2 + vp + 1));
    }

    /// GPT-2's vocabulary over 16 x 1024 rows: 3.3 GB of logits, of which
    /// a recomputing engine holds one chunk of whole rows under
    /// [`LOGITS_CHUNK`] floats (one layer, so recomputation changes no
    /// block's slots).
    #[test]
    fn a_recomputing_head_holds_one_chunk_of_logits() {
        let cfg = GptConfig {
            n_layer: 1,
            n_head: 1,
            n_embd: 8,
            block_size: 1024,
            vocab_size: 50257,
            blocks: Vec::new(),
        };
        let (rows, vp) = (16 * 1024, cfg.padded_vocab());
        let elems = |recompute| {
            let run = SpanRun::one(&Span::all(1), recompute, false, Precision::Fp32);
            activation_elems(&cfg, 1, rows, &run)
        };
        let chunk = LOGITS_CHUNK / vp;
        assert_eq!(elems(false) - elems(true), (rows - chunk) * vp);
        assert!(chunk * vp <= LOGITS_CHUNK && (chunk + 1) * vp > LOGITS_CHUNK);
    }
}
