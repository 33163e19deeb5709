//! BERT, with Hugging Face `BertModel` semantics: word + position + token
//! type embeddings and a LayerNorm; post-LN blocks (attention over each
//! sequence's unpadded keys in both directions, exact GELU); a masked-LM
//! head (`BertForMaskedLM`) or the pooler and a classifier
//! (`BertForSequenceClassification`). Units as GPT-2's: 0 the embeddings,
//! 1..=L the blocks, L + 1 the head, run through [`UnitModel`].
//!
//! The blocks' and the head's forward and backward are long by design: a
//! layer's kernels in the order they run, each on views of the same
//! activation and gradient buffers (split into functions, those views
//! would be passed from one to the next); read beside `transformers`'
//! `Bert` modules, which they follow op by op.

pub mod config;
pub mod family;
pub mod hf;
pub mod layout;

pub use config::{BertConfig, BertHead, MASKED_PERCENT};
use layout::pooler_index;
pub use layout::BlockParam;

use super::alloc::{part, ActAlloc};
use super::bf16::{matmul_backward, Precision};
use super::ops::{io, Dinp, Normed, Ops, Rounded, Stats};
use super::tp;
use super::tp::{BlockDims, RowParallel, TpPlace};
use super::unit::{
    check_batch, check_ids, resid, resid_io, resid_mut, EngineCore, Held, Span, SpanRun,
    StageModel, UnitGrads, UnitKind, UnitModel, UnitParams, Weights,
};
use crate::backend::{
    Activation, AttentionBackward, AttentionForward, Backend, Buf, CopyRows, Dst, EncoderBackward,
    EncoderForward, LayerNormBackward, LayerNormForward, MatmulBackward, MatmulForward,
    MatmulShape, Src, StoredBuf, WeightLayout,
};
use crate::comm::Comm;
use crate::data::{Batch, LossTerms, IGNORE};
use crate::error::{Error, Result};
use std::ops::Range;

/// The masked-LM head's activations: transform dense out, its GELU, its
/// LayerNorm (with mean, rstd), logits, losses; in a forward with targets,
/// of the rows with a target alone ([`Shape::picked`]), gathered into
/// `picked_x`, with their targets, and a zero row and a scratch row as the
/// gather's and scatter's position table.
struct MlmActs<B: Backend> {
    picked: Buf<B, u32>,
    targets: Buf<B, u32>,
    picked_x: Buf<B>,
    zero_row: Buf<B>,
    scratch_row: Buf<B>,
    t1: Buf<B>,
    t2: Buf<B>,
    t3: Buf<B>,
    mean: Buf<B>,
    rstd: Buf<B>,
    logits: Buf<B>,
    losses: Buf<B>,
}

/// The pooler and its classifier's activations (a sequence classifier's,
/// or pretraining's next-sentence head): one label per sequence, the
/// first-token rows, pooler pre-activation and output, logits, losses, and
/// the backward's gradients of the first-token rows and the pooler.
struct PooledActs<B: Backend> {
    labels: Buf<B, u32>,
    cls: Buf<B>,
    pre: Buf<B>,
    pooled: Buf<B>,
    logits: Buf<B>,
    losses: Buf<B>,
    dcls: Buf<B>,
    dpooled: Buf<B>,
}

/// The head's activations: the masked-LM head's, the pooler's, or both
/// (`BertForPreTraining`).
enum HeadActs<B: Backend> {
    Mlm(MlmActs<B>),
    Classify(PooledActs<B>),
    Pretrain(MlmActs<B>, PooledActs<B>),
}

impl<B: Backend> HeadActs<B> {
    /// The masked-LM head's and the pooler's activations, where the head has them.
    fn parts(&mut self) -> (Option<&mut MlmActs<B>>, Option<&mut PooledActs<B>>) {
        match self {
            HeadActs::Mlm(m) => (Some(m), None),
            HeadActs::Classify(p) => (None, Some(p)),
            HeadActs::Pretrain(m, p) => (Some(m), Some(p)),
        }
    }
}

impl<B: Backend> PooledActs<B> {
    /// `head`'s pooler over the first-token rows of `x` (b sequences of
    /// t) and its classifier: the logits, and with `targets` the summed loss.
    fn forward(
        &mut self,
        ops: &mut Ops<'_, B, usize>,
        x: Src<'_, B>,
        b: usize,
        t: usize,
        head: BertHead,
        targets: bool,
    ) -> Result<Option<f64>> {
        let labels = head.pooled_labels().expect("a pooler has labels");
        let (i, be, c) = (pooler_index(head), ops.be, ops.c);
        let bc = b * c;
        gather_first(be, self.cls.d(), x, b, t, c)?;
        let (pre, cls) = (self.pre.slice_mut(0..bc), self.cls.slice(0..bc));
        ops.linear(pre, cls, i, None, io(b, c, c))?;
        let (pooled, pre) = (self.pooled.slice_mut(0..bc), self.pre.slice(0..bc));
        ops.act(pooled, pre, i + 1, Activation::Tanh)?;
        let mut lg = self.logits.slice_mut(0..b * labels);
        let (pooled, shape) = (self.pooled.slice(0..bc), io(b, c, labels));
        ops.linear(lg.rb(), pooled, i + 2, Some(i + 3), shape)?;
        if !targets {
            return Ok(None);
        }
        let (losses, at) = (self.losses.slice_mut(0..b), self.labels.slice(0..b));
        ops.ce(losses, lg.src(), at, labels, labels)?;
        Ok(Some(be.sum(self.losses.slice(0..b))?))
    }

    /// [`PooledActs::forward`]'s backward for `dloss` a sequence's loss:
    /// its gradients accumulate (in `ops`); `dres` gets the first-token
    /// rows' input gradient, added on beside a masked-LM head (to its
    /// gradient), alone (zeros elsewhere) without.
    fn backward(
        &mut self,
        ops: &mut Ops<'_, B, usize>,
        dres: Dst<'_, B>,
        b: usize,
        t: usize,
        head: BertHead,
        dloss: f32,
    ) -> Result<()> {
        let labels = head.pooled_labels().expect("a pooler has labels");
        let (i, be, c) = (pooler_index(head), ops.be, ops.c);
        let bc = b * c;
        let mut lg = self.logits.slice_mut(0..b * labels);
        ops.ce_back(lg.rb(), self.labels.slice(0..b), labels, labels, dloss)?;
        let mut dp = self.dpooled.slice_mut(0..bc);
        let (pooled, shape) = (self.pooled.slice(0..bc), io(b, c, labels));
        ops.linear_back(Some(dp.rb()), lg.src(), pooled, i + 2, Some(i + 3), shape)?;
        ops.act_back(
            dp.rb(),
            self.pre.slice(0..bc),
            i + 1,
            Activation::Tanh,
            None,
        )?;
        let (dcls, cls) = (self.dcls.slice_mut(0..bc), self.cls.slice(0..bc));
        ops.linear_back(Some(dcls), dp.src(), cls, i, None, io(b, c, c))?;
        scatter_first(be, dres, self.dcls.s(), b, t, c, head.has_mlm())
    }
}

/// What one micro-batch of `rows` = B*T tokens (`b` sequences) keeps
/// from its forward to its backward: its inputs, the embeddings' own
/// activations, the residual stream at its blocks' inputs and the head's
/// activations. A pipeline holds one of these per micro-batch in flight.
struct Kept<B: Backend> {
    rows: usize,
    b: usize,
    tokens: Buf<B, u32>,
    lens: Buf<B, u32>,
    /// One-hot token types (rows, type_vocab).
    types: Buf<B>,
    /// Embedding sum before its LayerNorm, with mean, rstd.
    emb: Buf<B>,
    emb_mean: Buf<B>,
    emb_rstd: Buf<B>,
    /// `resid[0]` the embeddings' output, `resid[l + 1]` block l's. Under
    /// recomputation a stage without the head keeps only its blocks'
    /// inputs: its output is `Acts::out`.
    resid: Buf<B>,
    head: HeadActs<B>,
}

/// The blocks' activations and the backward's scratch for `rows` = B*T
/// tokens (`b` sequences); the per-block ones hold a slot per layer, kept
/// per micro-batch with its [`Kept`], or one the micro-batches share under
/// recomputation.
struct Acts<B: Backend> {
    rows: usize,
    b: usize,
    /// The stage's output, where a recomputing stage without the head does not keep it.
    out: Buf<B>,
    /// q|k|v: in bf16 under `--precision bf16` (attention's input, which
    /// only its bf16 products read), as GPT-2's.
    qkv: StoredBuf<B>,
    atty: Buf<B>,
    lse: Buf<B>,
    /// x + attention output, before the attention LayerNorm; its output.
    h: Buf<B>,
    h1: Buf<B>,
    ln1_mean: Buf<B>,
    ln1_rstd: Buf<B>,
    /// The intermediate product (before its bias) and its GELU: in bf16
    /// under `--precision bf16`, as autocast holds them.
    f: StoredBuf<B>,
    g: StoredBuf<B>,
    /// h1 + MLP output, before the output LayerNorm.
    o: Buf<B>,
    ln2_mean: Buf<B>,
    ln2_rstd: Buf<B>,
    /// The residual stream's gradient, a second (rows, C), the widest scratch, dqkv.
    dres: Buf<B>,
    dalt: Buf<B>,
    dbig: Buf<B>,
    dqkv: Buf<B>,
    /// Whether the matmuls' products are bf16's (`--precision bf16`).
    bf16: bool,
    /// Where this span runs a classifier's last block: its first-token rows.
    first: Option<FirstRows<B>>,
}

/// A classifier's last block, run on the first-token rows alone after
/// its attention (which reads every row's keys and values): the loss reads
/// nothing else of its output. Per sequence: the block's input row, its
/// attention output row, its output row before it goes into the residual
/// stream, two gradients of (b, C) and the attention output's (b, C / tp).
struct FirstRows<B: Backend> {
    x: Buf<B>,
    atty: Buf<B>,
    out: Buf<B>,
    d1: Buf<B>,
    d2: Buf<B>,
    datty: Buf<B>,
}

/// A block's widths on one of `tp` tensor-parallel ranks.
fn block_dims(cfg: &BertConfig, tp: usize) -> BlockDims {
    let c = cfg.n_embd;
    BlockDims {
        c,
        cl: c / tp,
        nhl: cfg.n_head / tp,
        fl: cfg.n_inner / tp,
    }
}

/// Elements of the activations one of `tp` tensor-parallel ranks allocates
/// for `run.in_flight` micro-batches of b sequences of t tokens, each its
/// own set: `Acts::new` run against a tally, so the count is the
/// allocation's own (the same in either precision).
pub fn activation_elems(cfg: &BertConfig, tp: usize, b: usize, t: usize, run: &SpanRun) -> usize {
    run.in_flight_elems(
        |al| Acts::new(al, cfg, block_dims(cfg, tp), run, b * t, b),
        |al| Kept::new(al, cfg, run, b * t, b),
    )
}

impl<B: Backend> Kept<B> {
    /// A micro-batch's kept buffers: its inputs, the embeddings'
    /// activations, the residual stream at each block's input (and the
    /// stage's output, unless recomputing without the head), and the
    /// head's where it runs.
    fn new(
        al: &ActAlloc<'_, B>,
        cfg: &BertConfig,
        run: &SpanRun,
        rows: usize,
        b: usize,
    ) -> Result<Self> {
        let (c, span) = (cfg.n_embd, &run.span);
        let a = |n: usize| al.acts(n);
        // the head's buffers only where the head runs
        let h = usize::from(span.head);
        let (rows_h, b_h) = (h * rows, h * b);
        let mlm = || -> Result<MlmActs<B>> {
            Ok(MlmActs {
                picked: al.typed(rows_h)?,
                targets: al.typed(rows_h)?,
                picked_x: a(rows_h * c)?,
                zero_row: a(h * c)?,
                scratch_row: a(h * c)?,
                t1: a(rows_h * c)?,
                t2: a(rows_h * c)?,
                t3: a(rows_h * c)?,
                mean: a(rows_h)?,
                rstd: a(rows_h)?,
                logits: a(rows_h * cfg.padded_vocab())?,
                losses: a(rows_h)?,
            })
        };
        let pooled = |labels: usize| -> Result<PooledActs<B>> {
            Ok(PooledActs {
                labels: al.typed(b_h)?,
                cls: a(b_h * c)?,
                pre: a(b_h * c)?,
                pooled: a(b_h * c)?,
                logits: a(b_h * labels)?,
                losses: a(b_h)?,
                dcls: a(b_h * c)?,
                dpooled: a(b_h * c)?,
            })
        };
        let head = match cfg.head {
            BertHead::Mlm => HeadActs::Mlm(mlm()?),
            BertHead::Classify { labels } => HeadActs::Classify(pooled(labels)?),
            BertHead::Pretrain => HeadActs::Pretrain(mlm()?, pooled(2)?),
        };
        Ok(Kept {
            rows,
            b,
            tokens: al.typed(rows)?,
            lens: al.typed(b)?,
            types: a(rows * cfg.type_vocab)?,
            emb: a(rows * c)?,
            emb_mean: a(rows)?,
            emb_rstd: a(rows)?,
            resid: a(span.kept_resid(run.recompute) * rows * c)?,
            head,
        })
    }
}

impl<B: Backend> Acts<B> {
    fn new(
        al: &ActAlloc<'_, B>,
        cfg: &BertConfig,
        d: BlockDims,
        run: &SpanRun,
        rows: usize,
        b: usize,
    ) -> Result<Self> {
        let (span, slots) = (&run.span, run.span.slots(run.recompute));
        let (l, c) = (span.blocks.len(), cfg.n_embd);
        let a = |n: usize| al.acts(n);
        let out = usize::from(span.kept_resid(run.recompute) == l);
        Ok(Acts {
            rows,
            b,
            out: a(out * rows * c)?,
            qkv: al.stored(run.precision, slots * rows * 3 * d.cl)?,
            atty: a(slots * rows * d.cl)?,
            lse: a(slots * rows * d.nhl)?,
            h: a(slots * rows * c)?,
            h1: a(slots * rows * c)?,
            ln1_mean: a(slots * rows)?,
            ln1_rstd: a(slots * rows)?,
            f: al.stored(run.precision, slots * rows * d.fl)?,
            g: al.stored(run.precision, slots * rows * d.fl)?,
            o: a(slots * rows * c)?,
            ln2_mean: a(slots * rows)?,
            ln2_rstd: a(slots * rows)?,
            dres: a(rows * c)?,
            dalt: a(rows * c)?,
            dbig: a(rows * d.fl.max(d.cl).max(c))?,
            dqkv: a(rows * 3 * d.cl)?,
            first: match cfg.head {
                BertHead::Classify { .. } if span.blocks.contains(&(cfg.n_layer - 1)) => {
                    Some(FirstRows {
                        x: a(b * c)?,
                        atty: a(b * d.cl)?,
                        out: a(b * c)?,
                        d1: a(b * c)?,
                        d2: a(b * c)?,
                        datty: a(b * d.cl)?,
                    })
                }
                _ => None,
            },
            bf16: run.precision == Precision::Bf16,
        })
    }
}

/// dst (b, w) = the first row of each of src's b sequences of t rows of w
/// (one launch).
fn gather_first<B: Backend>(
    be: &B,
    dst: Dst<'_, B>,
    src: Src<'_, B>,
    b: usize,
    t: usize,
    w: usize,
) -> Result<()> {
    be.run(CopyRows {
        dst,
        src,
        rows: b,
        w,
        dst_stride: w,
        src_stride: t * w,
        add: false,
    })
}

/// The first row of each of dst's b sequences of t rows of w = src's row
/// of that sequence, every other row 0; with `add`, the first rows +=
/// src's and the others left as they are.
fn scatter_first<B: Backend>(
    be: &B,
    mut dst: Dst<'_, B>,
    src: Src<'_, B>,
    b: usize,
    t: usize,
    w: usize,
    add: bool,
) -> Result<()> {
    if !add {
        be.fill(dst.rb(), 0.0);
    }
    be.run(CopyRows {
        dst,
        src,
        rows: b,
        w,
        dst_stride: t * w,
        src_stride: w,
        add,
    })
}

/// The current batch's shape and host tokens.
struct Shape {
    b: usize,
    t: usize,
    tokens: Vec<u32>,
    has_targets: bool,
    loss_terms: LossTerms,
    /// The masked-LM head's rows in a forward with targets: those with a
    /// target (row 0 where none has), the only ones its loss reads.
    picked: Option<Vec<u32>>,
}

/// BERT without its parameters: config, this rank's layout, the
/// activations and the unit-by-unit forward and backward.
pub struct Engine<B: Backend> {
    pub config: BertConfig,
    core: EngineCore<B>,
    recompute: bool,
    precision: Precision,
    /// The units this engine runs (all, or a pipeline stage's).
    span: Span,
    held: Held<Kept<B>, Acts<B>, Shape>,
}

impl<B: Backend> Engine<B> {
    pub fn new(
        backend: B,
        config: BertConfig,
        tp: TpPlace,
        recompute: bool,
        precision: Precision,
    ) -> Result<Self> {
        config.validate()?;
        if tp.size == 0
            || !config.n_head.is_multiple_of(tp.size)
            || !config.n_inner.is_multiple_of(tp.size)
        {
            return Err(Error::Config(format!(
                "the heads ({}) and the intermediate size ({}) must be divisible by the tensor-parallel size ({})",
                config.n_head, config.n_inner, tp.size
            )));
        }
        let span = Span::all(config.n_layer);
        Ok(Engine {
            core: EngineCore {
                layout: layout::layout(&config, tp.size),
                whole: layout::layout(&config, 1),
                backend,
                tp,
            },
            config,
            recompute,
            precision,
            span,
            held: Held::new(recompute),
        })
    }

    fn dims(&self) -> BlockDims {
        block_dims(&self.config, self.core.tp.size)
    }

    fn slot(&self, l: usize) -> usize {
        self.span.slot(l, self.recompute)
    }

    fn shape(&self) -> (usize, usize) {
        let s = self.held.batch();
        (s.b, s.t)
    }

    /// Whether block l runs on the first-token rows alone after its
    /// attention ([`FirstRows`]): a classifier's last block in a forward
    /// with targets. One without (outputs wanted) computes every row, so
    /// that [`Engine::hidden`] is whole.
    fn first_rows_only(&self, l: usize) -> bool {
        l + 1 == self.config.n_layer
            && self.held.acts().first.is_some()
            && self.held.batch().has_targets
    }

    /// The last forward's final hidden states (B*T, C), on the host.
    pub fn hidden(&self) -> Result<Vec<f32>> {
        let (b, t) = self.shape();
        let btc = b * t * self.config.n_embd;
        let top = self.span.resid(self.config.n_layer);
        let (k, a) = (self.held.kept(), self.held.acts());
        self.backend().to_host(resid(&k.resid, &a.out, top, btc))
    }

    /// The last forward's pooled output (B, C): a classifier's or
    /// pretraining's (the masked-LM head alone has no pooler).
    pub fn pooled(&self) -> Result<Vec<f32>> {
        let (b, _) = self.shape();
        match &self.held.kept().head {
            HeadActs::Classify(h) | HeadActs::Pretrain(_, h) => self
                .backend()
                .to_host(h.pooled.slice(0..b * self.config.n_embd)),
            HeadActs::Mlm(_) => Err(Error::Input("the masked-LM head has no pooler".into())),
        }
    }

    /// The last forward's logits: the pooler's classifier's (B, labels)
    /// (pretraining's next-sentence head's (B, 2)), or the masked-LM
    /// head's (B*T, vocabulary), padding dropped, and after a forward with
    /// targets only the rows with a target, in order (the head ran on no
    /// other).
    pub fn logits(&self) -> Result<Vec<f32>> {
        let (b, t) = self.shape();
        let k = self.held.kept();
        match &k.head {
            HeadActs::Classify(h) | HeadActs::Pretrain(_, h) => {
                let labels = self
                    .config
                    .head
                    .pooled_labels()
                    .expect("a pooler has labels");
                self.backend().to_host(h.logits.slice(0..b * labels))
            }
            HeadActs::Mlm(m) => {
                let (v, vp) = (self.config.vocab_size, self.config.padded_vocab());
                let picked = self.held.batch().picked.as_ref();
                let rows = picked.map_or(b * t, Vec::len);
                let all = self.backend().to_host(m.logits.slice(0..rows * vp))?;
                Ok(all.chunks(vp).flat_map(|r| r[..v].to_vec()).collect())
            }
        }
    }

    fn check(&self, batch: &Batch, b: usize, t: usize) -> Result<()> {
        let cfg = &self.config;
        check_batch(&batch.inputs, b, t, cfg.block_size)?;
        check_ids("token id", &batch.inputs, cfg.vocab_size, false)?;
        if !batch.types.is_empty() {
            if batch.types.len() != b * t {
                return Err(Error::Input(format!(
                    "{} token types for {} tokens",
                    batch.types.len(),
                    b * t
                )));
            }
            check_ids("token type", &batch.types, cfg.type_vocab, false)?;
        }
        if !batch.lens.is_empty()
            && (batch.lens.len() != b || batch.lens.iter().any(|&l| l == 0 || l as usize > t))
        {
            return Err(Error::Input(format!(
                "sequence lengths must be one per sequence ({b}), each 1 to {t}"
            )));
        }
        if !batch.targets.is_empty() {
            let (want, what) = match cfg.head.has_mlm() {
                true => (b * t, "one per token (IGNORE where not masked)"),
                false => (b, "one label per sequence"),
            };
            if batch.targets.len() != want {
                return Err(Error::Input(format!(
                    "{} targets for a batch of {b} x {t}: the head wants {what}",
                    batch.targets.len()
                )));
            }
            check_ids("target", &batch.targets, cfg.classes(), true)?;
        }
        // pretraining's next-sentence labels: one per sequence beside the
        // token targets, none elsewhere
        let nsp = cfg.head == BertHead::Pretrain;
        let want = if nsp && !batch.targets.is_empty() {
            b
        } else {
            0
        };
        if batch.seq_targets.len() != want {
            return Err(Error::Input(match nsp {
                true => format!(
                    "{} next-sentence labels for a batch of {b} with {} token targets: \
                     pretraining takes one per sequence beside the token targets",
                    batch.seq_targets.len(),
                    batch.targets.len()
                ),
                false => {
                    format!("next-sentence labels for a {cfg}, which has no next-sentence head")
                }
            }));
        }
        check_ids("next-sentence label", &batch.seq_targets, 2, true)
    }

    /// Embeddings: `resid[0]` = LN(`word[tok]` + `pos[t]` + `type[types]`).
    fn embed_forward(&mut self, p: Src<'_, B>) -> Result<()> {
        let (b, t) = self.shape();
        let (c, tv, eps) = (
            self.config.n_embd,
            self.config.type_vocab,
            self.config.layer_norm_eps,
        );
        let rows = b * t;
        let lay = &self.core.layout;
        let w = |i: usize| p.slice(lay.in_unit(0, i));
        let (be, (k, a, _)) = (&self.core.backend, self.held.get_mut());
        let mut emb = k.emb.slice_mut(0..rows * c);
        be.run(EncoderForward {
            out: emb.rb(),
            tokens: k.tokens.slice(0..rows),
            wte: w(0),
            wpe: w(1),
            t,
            c,
        })?;
        // the token types' one-hot rows times their embeddings, added on
        be.run(MatmulForward {
            out: emb.rb().into(),
            inp: k.types.slice(0..rows * tv).into(),
            w: w(2).into(),
            bias: None,
            residual: None,
            shape: MatmulShape::new((rows, tv, c), WeightLayout::InOut),
            accumulate: true,
        })?;
        be.run(LayerNormForward {
            out: resid_mut(&mut k.resid, &mut a.out, 0, rows * c).into(),
            mean: k.emb_mean.slice_mut(0..rows),
            rstd: k.emb_rstd.slice_mut(0..rows),
            inp: emb.src(),
            w: w(3),
            b: w(4),
            c,
            eps,
        })
    }

    fn embed_backward(&mut self, p: Src<'_, B>, g: Dst<'_, B>) -> Result<()> {
        let (b, t) = self.shape();
        let (c, tv) = (self.config.n_embd, self.config.type_vocab);
        let rows = b * t;
        let lay = &self.core.layout;
        let r = |i: usize| lay.in_unit(0, i);
        let (be, (k, a, shape)) = (&self.core.backend, self.held.get_mut());
        let (dword, rest) = g.split_at(r(0).len());
        let (dpos, rest) = rest.split_at(r(1).len());
        let (dtype, rest) = rest.split_at(r(2).len());
        let (dlnw, dlnb) = rest.split_at(r(3).len());
        let mut demb = a.dalt.slice_mut(0..rows * c);
        be.run(LayerNormBackward {
            dinp: Some(demb.rb()),
            dwb: Some((dlnw, dlnb)),
            dout: a.dres.slice(0..rows * c),
            inp: k.emb.slice(0..rows * c),
            w: p.slice(r(3)),
            mean: k.emb_mean.slice(0..rows),
            rstd: k.emb_rstd.slice(0..rows),
            c,
            accumulate: false,
        })?;
        be.run(EncoderBackward {
            dwte: dword,
            dwpe: dpos,
            dout: demb.src(),
            tokens: k.tokens.slice(0..rows),
            host_tokens: &shape.tokens,
            t,
            c,
        })?;
        // the one-hot token types need no gradient: the weight half alone
        be.run(MatmulBackward {
            dinp: None,
            dw: Some(dtype),
            dbias: None,
            dout: demb.src().into(),
            inp: k.types.slice(0..rows * tv).into(),
            w: p.slice(r(2)).into(),
            shape: MatmulShape::new((rows, tv, c), WeightLayout::InOut),
        })
    }

    /// Block l: `resid[l]` -> `resid[l + 1]`.
    fn block_forward(&mut self, l: usize, p: Weights<'_, B>, tp: Option<&dyn Comm>) -> Result<()> {
        use BlockParam::*;
        let first_only = self.first_rows_only(l);
        let (b, t) = self.shape();
        let d = self.dims();
        let BlockDims { c, cl, nhl, fl } = d;
        let eps = self.config.layer_norm_eps;
        let (rows, s) = (b * t, self.slot(l));
        let btc = rows * c;
        let (be, lay) = (&self.core.backend, &self.core.layout);
        let (k, a, _) = self.held.get_mut();
        let pos = |bp: BlockParam| lay.in_unit(1, bp as usize);
        let mut ops = Ops::new(be, a.bf16, c, eps, p, None, &pos);
        // the attention output and the FFN output are row-parallel under tensor parallelism
        let tp = self.core.tp.in_group(tp);
        let r = self.span.resid(l);
        let (x, hi) = resid_io(&mut k.resid, &mut a.out, r, btc);
        let mut qkv = a.qkv.slice_mut(part(s, 3 * rows * cl, 3 * rows * cl));
        ops.linear(qkv.rb(), x, QkvW, Some(QkvB), io(rows, c, 3 * cl))?;
        let mut atty = a.atty.d().part(s, rows * cl);
        be.run(AttentionForward {
            out: atty.rb().into(),
            lse: a.lse.d().part(s, rows * nhl),
            qkv: qkv.src(),
            lens: Some(k.lens.slice(0..b)),
            shape: d.attn(b, t, ops.bf16),
        })?;
        // after the attention: every row, or a classifier's first-token rows
        let (n, x, atty) = match a.first.as_mut().filter(|_| first_only) {
            Some(fr) => {
                gather_first(be, fr.x.d(), x, b, t, c)?;
                gather_first(be, fr.atty.d(), atty.src(), b, t, cl)?;
                (b, fr.x.slice(0..b * c), fr.atty.slice(0..b * cl))
            }
            None => (rows, x, atty.src()),
        };
        let mut h = a.h.d().part(s, btc).first(n * c);
        let proj = RowParallel {
            out: h.rb(),
            residual: x,
            inp: atty.into(),
            w: ops.mw(AttnOutW),
            bias: ops.w(AttnOutB),
        };
        tp::row_parallel(be, tp, proj, io(n, cl, c), |op| ops.matmul(op))?;
        let mut h1 = a.h1.d().part(s, btc).first(n * c);
        let normed = Normed::slot(h1.rb(), &mut a.ln1_mean, &mut a.ln1_rstd, s, rows, n);
        ops.ln(normed, h.src(), AttnLnW, AttnLnB)?;
        let mut f = a.f.slice_mut(part(s, rows * fl, n * fl));
        ops.linear(f.rb(), h1.src(), InterW, None, io(n, c, fl))?;
        let mut g = a.g.slice_mut(part(s, rows * fl, n * fl));
        ops.act(g.rb(), f.src(), InterB, Activation::GeluErf)?;
        let mut o = a.o.d().part(s, btc).first(n * c);
        let proj = RowParallel {
            out: o.rb(),
            residual: h1.src(),
            inp: g.src(),
            w: ops.mw(OutW),
            bias: ops.w(OutB),
        };
        tp::row_parallel(be, tp, proj, io(n, fl, c), |op| ops.matmul(op))?;
        let mut top = hi;
        let mut fr = a.first.as_mut().filter(|_| first_only);
        let out = match fr.as_mut() {
            Some(fr) => fr.out.d(),
            None => top.rb(),
        };
        let out = Normed::slot(out, &mut a.ln2_mean, &mut a.ln2_rstd, s, rows, n);
        ops.ln(out, o.src(), OutLnW, OutLnB)?;
        if let Some(fr) = fr {
            // the stream's other rows are never read: zeros, not an
            // earlier batch's
            scatter_first(be, top, fr.out.s(), b, t, c, false)?;
        }
        Ok(())
    }

    /// Block l's backward: the residual gradient in `dres` moves from
    /// `resid[l + 1]` to `resid[l]`; grads of its slice accumulate into `g`.
    /// Under `--recompute` the caller runs the block's forward again first.
    fn block_backward(
        &mut self,
        l: usize,
        p: Weights<'_, B>,
        g: Dst<'_, B>,
        tp: Option<&dyn Comm>,
    ) -> Result<()> {
        use BlockParam::*;
        let ((b, t), eps) = (self.shape(), self.config.layer_norm_eps);
        let (d @ BlockDims { c, cl, nhl, fl }, first_only) = (self.dims(), self.first_rows_only(l));
        let (rows, s, btc) = (b * t, self.slot(l), b * t * c);
        let (be, lay, (k, a, _)) = (&self.core.backend, &self.core.layout, self.held.get_mut());
        let pos = |bp: BlockParam| lay.in_unit(1, bp as usize);
        let mut ops = Ops::new(be, a.bf16, c, eps, p, Some(g), &pos);
        let (mut dres, mut dalt) = (a.dres.slice_mut(0..btc), a.dalt.slice_mut(0..btc));
        let (mut dbig, atty) = (a.dbig.d(), a.atty.s().part(s, rows * cl));
        // above the attention, dy at each norm's output and dx at its input: dres and dalt
        // for every row, or [`FirstRows`]' for the first tokens' (a classifier's last block)
        let (n, mut dy, mut dx, atty_in, mut first_datty) =
            match a.first.as_mut().filter(|_| first_only) {
                Some(fr) => {
                    gather_first(be, fr.d1.d(), dres.src(), b, t, c)?;
                    let first_atty = fr.atty.slice(0..b * cl);
                    (b, fr.d1.d(), fr.d2.d(), first_atty, Some(fr.datty.d()))
                }
                None => (rows, dres.rb(), dalt.rb(), atty, None),
            };
        let kept = |m, r| Stats::slot(m, r, s, rows).first(n);
        let cut = |x, w: usize| Buf::s(x).part(s, rows * w).first(n * w);
        // d o = LN2'(d out)
        let (o, kept2) = (cut(&a.o, c), kept(&a.ln2_mean, &a.ln2_rstd));
        ops.ln_back(Dinp::Set(dx.rb()), dy.src(), o, kept2, OutLnW, OutLnB)?;
        // o = h1 + gelu(h1 Wi + bi) Wo2 + bo2
        let mut dg = dbig.rb().first(n * fl);
        let (g_act, shape) = (a.g.slice(part(s, rows * fl, n * fl)), io(n, fl, c));
        ops.linear_back(Some(dg.rb()), dx.src(), g_act, OutW, Some(OutB), shape)?;
        let f = a.f.slice(part(s, rows * fl, n * fl));
        // under bf16 GELU's gradient and q|k|v's go into its output's slot
        let g_at = part(s, rows * fl, rows * fl);
        let dgelu = Rounded::new(&a.g, g_at.clone(), n * fl, true);
        let dqkv_at = Rounded::new(&a.g, g_at, 3 * rows * cl, true);
        let (gelu, rounded) = (Activation::GeluErf, dgelu.bf16(&mut a.g));
        ops.act_back(dg.rb(), f, InterB, gelu, rounded)?;
        let (dg, h1) = (dgelu.src(&a.g, dg.src()), cut(&a.h1, c));
        ops.linear_back(Some(dy.rb()), dg, h1, InterW, None, io(n, c, fl))?;
        tp::all_reduce(be, tp, dy.rb())?;
        be.add_inplace(dy.rb(), dx.src());
        // d h = LN1'(d h1)
        let (h, kept1) = (cut(&a.h, c), kept(&a.ln1_mean, &a.ln1_rstd));
        ops.ln_back(Dinp::Set(dx.rb()), dy.src(), h, kept1, AttnLnW, AttnLnB)?;
        // h = x + attention(x Wqkv + bqkv) Wo + bo
        let every = dbig.rb().first(rows * cl);
        let datty = first_datty.as_mut().map_or(every, |d| d.rb());
        let (dout, shape) = (dx.src(), io(n, cl, c));
        ops.linear_back(Some(datty), dout, atty_in, AttnOutW, Some(AttnOutB), shape)?;
        let mut datty = dbig.rb().first(rows * cl);
        if let Some(d) = first_datty {
            // the other rows' outputs reached no loss
            scatter_first(be, datty.rb(), d.into_src(), b, t, cl, false)?;
        }
        be.run(AttentionBackward {
            dqkv: dqkv_at.dst(&mut a.g, a.dqkv.slice_mut(0..3 * rows * cl)),
            dout: datty.src(),
            qkv: a.qkv.slice(part(s, 3 * rows * cl, 3 * rows * cl)),
            out: atty.into(),
            lse: a.lse.s().part(s, rows * nhl),
            lens: Some(k.lens.slice(0..b)),
            shape: d.attn(b, t, ops.bf16),
        })?;
        dqkv_at.round_scratch(be, a.dqkv.slice_mut(0..3 * rows * cl));
        let dqkv = dqkv_at.src(&a.g, a.dqkv.slice(0..3 * rows * cl));
        let x = k.resid.s().part(self.span.resid(l), btc);
        let shape = io(rows, c, 3 * cl);
        ops.linear_back(Some(dres.rb()), dqkv, x, QkvW, Some(QkvB), shape)?;
        tp::all_reduce(be, tp, dres.rb())?;
        match first_only {
            true => scatter_first(be, dres, dx.src(), b, t, c, true)?,
            false => be.add_inplace(dres, dx.src()),
        }
        Ok(())
    }

    /// The head; the mean loss when the batch has targets.
    fn head_forward(
        &mut self,
        p: Weights<'_, B>,
        word: Option<Weights<'_, B>>,
    ) -> Result<Option<f32>> {
        let (b, t) = self.shape();
        let cfg = &self.config;
        let (c, n_layer, eps) = (cfg.n_embd, cfg.n_layer, cfg.layer_norm_eps);
        let rows = b * t;
        let btc = rows * c;
        let u = n_layer + 1;
        let (be, lay) = (&self.core.backend, &self.core.layout);
        let (k, a, shape) = self.held.get_mut();
        let pos = |i: usize| lay.in_unit(u, i);
        let mut ops = Ops::new(be, a.bf16, c, eps, p, None, &pos);
        let x = resid(&k.resid, &a.out, self.span.resid(n_layer), btc);
        let (has_targets, terms) = (shape.has_targets, shape.loss_terms);
        let mut loss = 0.0f64;
        let (mlm, pooled) = k.head.parts();
        if let Some(m) = mlm {
            let vp = cfg.padded_vocab();
            let word = word.expect("the masked-LM head reads the word embeddings");
            // the rows with a target (gathered: an embedding lookup of the
            // stream's rows), or every row
            let (n, x) = match shape.picked.as_ref() {
                Some(chosen) => {
                    let n = chosen.len();
                    be.run(EncoderForward {
                        out: m.picked_x.slice_mut(0..n * c),
                        tokens: m.picked.slice(0..n),
                        wte: x,
                        wpe: m.zero_row.s(),
                        t: 1,
                        c,
                    })?;
                    (n, m.picked_x.slice(0..n * c))
                }
                None => (rows, x),
            };
            let nc = n * c;
            ops.linear(m.t1.slice_mut(0..nc), x, 0, None, io(n, c, c))?;
            let (t2, t1) = (m.t2.slice_mut(0..nc), m.t1.slice(0..nc));
            ops.act(t2, t1, 1, Activation::GeluErf)?;
            let t3 = Normed {
                out: m.t3.slice_mut(0..nc).into(),
                mean: m.mean.slice_mut(0..n),
                rstd: m.rstd.slice_mut(0..n),
            };
            ops.ln(t3, m.t2.slice(0..nc), 2, 3)?;
            let mut lg = m.logits.slice_mut(0..n * vp);
            ops.matmul(MatmulForward {
                out: lg.rb().into(),
                inp: m.t3.slice(0..nc).into(),
                w: word.product(),
                bias: Some(ops.w(4)),
                residual: None,
                shape: MatmulShape::new((n, c, vp), WeightLayout::OutIn),
                accumulate: false,
            })?;
            if has_targets {
                let (losses, targets) = (m.losses.slice_mut(0..n), m.targets.slice(0..n));
                ops.ce(losses, lg.src(), targets, cfg.vocab_size, vp)?;
                loss += be.sum(m.losses.slice(0..n))? / terms.targets as f64;
            }
        }
        if let Some(h) = pooled {
            if let Some(sum) = h.forward(&mut ops, x, b, t, cfg.head, has_targets)? {
                loss += sum / pooled_terms(cfg.head, terms) as f64;
            }
        }
        Ok(has_targets.then_some(loss as f32))
    }

    /// The head's backward for `loss_scale` times the mean loss: its grads
    /// (and the tied word embeddings') accumulate; `dres` gets d `resid[L]`.
    fn head_backward(
        &mut self,
        p: Weights<'_, B>,
        word: Option<Weights<'_, B>>,
        g: Dst<'_, B>,
        dword: Option<Dst<'_, B>>,
        loss_scale: f32,
    ) -> Result<()> {
        let (b, t) = self.shape();
        if !self.held.batch().has_targets {
            return Err(Error::Input("backward needs a forward with targets".into()));
        }
        let cfg = &self.config;
        let (c, n_layer, eps) = (cfg.n_embd, cfg.n_layer, cfg.layer_norm_eps);
        let (rows, btc, u, vp) = (b * t, b * t * c, n_layer + 1, cfg.padded_vocab());
        let (be, lay) = (&self.core.backend, &self.core.layout);
        let (k, a, shape) = self.held.get_mut();
        let pos = |i: usize| lay.in_unit(u, i);
        let mut ops = Ops::new(be, a.bf16, c, eps, p, Some(g), &pos);
        let x = resid(&k.resid, &a.out, self.span.resid(n_layer), btc);
        let (mlm, pooled) = k.head.parts();
        if let Some(m) = mlm {
            let chosen = shape.picked.as_deref();
            let (n, x) = match chosen {
                Some(chosen) => (chosen.len(), m.picked_x.slice(0..chosen.len() * c)),
                None => (rows, x),
            };
            let nc = n * c;
            let word = word.expect("the masked-LM head reads the word embeddings");
            let dword =
                dword.expect("the masked-LM head accumulates the word embeddings' gradient");
            let mut lg = m.logits.slice_mut(0..n * vp);
            let dloss = loss_scale / shape.loss_terms.targets;
            ops.ce_back(lg.rb(), m.targets.slice(0..n), cfg.vocab_size, vp, dloss)?;
            if ops.bf16 {
                // The logits' gradient rounded where it lies, so the decoder
                // bias's gradient sums it rounded (as it always has).
                be.round_bf16(lg.rb());
            }
            let mut dt3 = a.dalt.slice_mut(0..nc);
            let dbias = ops.g.as_mut().map(|g| g.rb().slice(pos(4)));
            let op = MatmulBackward {
                dinp: Some(dt3.rb()),
                dw: Some(dword),
                dbias,
                dout: lg.src().into(),
                inp: m.t3.slice(0..nc).into(),
                w: word.product(),
                shape: MatmulShape::new((n, c, vp), WeightLayout::OutIn),
            };
            matmul_backward(be, ops.bf16, op)?;
            let mut dt2 = a.dbig.slice_mut(0..nc);
            let (t2, kept) = (m.t2.slice(0..nc), Stats::slot(&m.mean, &m.rstd, 0, n));
            ops.ln_back(Dinp::Set(dt2.rb()), dt3.src(), t2, kept, 2, 3)?;
            ops.act_back(dt2.rb(), m.t1.slice(0..nc), 1, Activation::GeluErf, None)?;
            // d x: into the stream's gradient, or for the picked rows
            // alone, then added into theirs (zeros elsewhere)
            let mut dres = a.dres.slice_mut(0..btc);
            let dx = chosen.map_or(dres.rb().first(nc), |_| dt3.rb());
            ops.linear_back(Some(dx), dt2.src(), x, 0, None, io(n, c, c))?;
            if let Some(chosen) = chosen {
                be.fill(dres.rb(), 0.0);
                be.fill(m.scratch_row.d(), 0.0);
                be.run(EncoderBackward {
                    dwte: dres,
                    dwpe: m.scratch_row.d(),
                    dout: dt3.src(),
                    tokens: m.picked.slice(0..n),
                    host_tokens: chosen,
                    t: 1,
                    c,
                })?;
            }
        }
        if let Some(h) = pooled {
            let dloss = loss_scale / pooled_terms(cfg.head, shape.loss_terms);
            h.backward(&mut ops, a.dres.slice_mut(0..btc), b, t, cfg.head, dloss)?;
        }
        Ok(())
    }
}

/// What the pooler's classifier's mean loss divides by: a classifier's
/// labels are the batch's targets, pretraining's next-sentence labels its
/// per-sequence targets.
fn pooled_terms(head: BertHead, terms: LossTerms) -> f32 {
    match head {
        BertHead::Pretrain => terms.seq_targets,
        _ => terms.targets,
    }
}

impl<B: Backend> UnitModel<B> for Engine<B> {
    fn core(&self) -> &EngineCore<B> {
        &self.core
    }

    fn begin(&mut self, batch: &Batch, b: usize, t: usize, loss_terms: LossTerms) -> Result<()> {
        self.check(batch, b, t)?;
        let rows = b * t;
        let tv = self.config.type_vocab;
        let be = &self.core.backend;
        let al = ActAlloc::on(be);
        let (d, run) = (
            self.dims(),
            SpanRun::one(&self.span, self.recompute, false, self.precision),
        );
        let make = || Acts::new(&al, &self.config, d, &run, rows, b);
        self.held.ready_acts(|a| a.rows >= rows && a.b >= b, make)?;
        let make = || Kept::new(&al, &self.config, &run, rows, b);
        let a = self.held.ready_kept(|k| k.rows >= rows && k.b >= b, make)?;
        be.upload(a.tokens.slice_mut(0..rows), &batch.inputs)?;
        let mut picked = None;
        if self.span.head && !batch.targets.is_empty() {
            let (mlm, pooled) = a.head.parts();
            if let Some(m) = mlm {
                let mut chosen: Vec<u32> = (0..rows as u32)
                    .filter(|&r| batch.targets[r as usize] != IGNORE)
                    .collect();
                if chosen.is_empty() {
                    chosen.push(0);
                }
                let targets: Vec<u32> = chosen.iter().map(|&r| batch.targets[r as usize]).collect();
                be.upload(m.picked.slice_mut(0..chosen.len()), &chosen)?;
                be.upload(m.targets.slice_mut(0..targets.len()), &targets)?;
                be.fill(m.zero_row.d(), 0.0);
                picked = Some(chosen);
            }
            if let Some(h) = pooled {
                let labels = match self.config.head {
                    BertHead::Pretrain => &batch.seq_targets,
                    _ => &batch.targets,
                };
                be.upload(h.labels.slice_mut(0..b), labels)?;
            }
        }
        let lens = match batch.lens.is_empty() {
            true => vec![t as u32; b],
            false => batch.lens.clone(),
        };
        be.upload(a.lens.slice_mut(0..b), &lens)?;
        let mut onehot = vec![0.0f32; rows * tv];
        for (i, row) in onehot.chunks_mut(tv).enumerate() {
            row[batch.types.get(i).copied().unwrap_or(0) as usize] = 1.0;
        }
        be.upload(a.types.slice_mut(0..rows * tv), &onehot)?;
        self.held.set_batch(Shape {
            b,
            t,
            tokens: batch.inputs.clone(),
            has_targets: !batch.targets.is_empty(),
            loss_terms,
            picked,
        });
        Ok(())
    }

    fn outputs(&self) -> Result<Vec<f32>> {
        self.logits()
    }

    fn forward(
        &mut self,
        u: usize,
        p: UnitParams<'_, B>,
        tp: Option<&dyn Comm>,
    ) -> Result<Option<f32>> {
        match UnitKind::of(u, self.config.n_layer) {
            UnitKind::Embeddings => self.embed_forward(p.own.fp32)?,
            UnitKind::Block(l) => self.block_forward(l, p.own, tp)?,
            UnitKind::Head => return self.head_forward(p.own, p.tied),
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
            UnitKind::Embeddings => self.embed_backward(p.own.fp32, g.own)?,
            UnitKind::Block(l) => {
                if self.recompute {
                    self.block_forward(l, p.own, tp)?;
                }
                self.block_backward(l, p.own, g.own, tp)?
            }
            UnitKind::Head => self.head_backward(p.own, p.tied, g.own, g.tied, loss_scale)?,
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
}

/// The same encoder under another head: the tensors both heads have (the
/// embeddings, every block, a pooler) carried over by name, the rest
/// fresh from `seed` (a masked LM's head for a `BertModel`'s encoder, a
/// classifier for a pretrained masked LM's).
pub fn with_head(
    cfg: &BertConfig,
    params: &[f32],
    head: BertHead,
    seed: u64,
) -> (BertConfig, Vec<f32>) {
    let to = BertConfig {
        head,
        ..cfg.clone()
    };
    let (from_lay, to_lay) = (layout::layout(cfg, 1), layout::layout(&to, 1));
    let mut out = init_full(&to, seed);
    for t in &to_lay.tensors {
        if let Some(f) = from_lay.tensor(&t.name) {
            if f.full_shape == t.full_shape {
                out[t.range()].copy_from_slice(&params[f.range()]);
            }
        }
    }
    (to, out)
}

/// `params` of `cfg` with its classifier (weight and bias) drawn afresh
/// from `seed`, as [`init_full`] draws them.
pub fn fresh_classifier(cfg: &BertConfig, params: &mut [f32], seed: u64) {
    let (lay, fresh) = (layout::layout(cfg, 1), init_full(cfg, seed));
    for name in layout::classifier_names(cfg.head) {
        if let Some(t) = lay.tensor(name) {
            params[t.range()].copy_from_slice(&fresh[t.range()]);
        }
    }
}

/// BERT's initialisation of the whole model (Hugging Face's
/// `_init_weights`): N(0, 0.02) matrices and embeddings, zero biases, unit
/// LayerNorms, zero padded vocabulary rows.
pub fn init_full(cfg: &BertConfig, seed: u64) -> Vec<f32> {
    layout::layout(cfg, 1).init(seed, cfg.vocab_size, |_| 0.02)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each micro-batch in flight on a recomputing stage without the head
    /// costs its inputs (tokens, lengths, one-hot types), the embeddings'
    /// sum and statistics and its blocks' inputs, counted by hand; without
    /// recomputation its blocks' whole activations and scratch too.
    #[test]
    fn a_recomputing_stage_keeps_its_blocks_inputs_per_micro_batch() {
        let cfg = BertConfig::preset("bert-tiny").unwrap();
        let (b, t, c, tv) = (2, 8, cfg.n_embd, cfg.type_vocab);
        let rows = b * t;
        let first = Span::of_units(0..2, cfg.n_layer); // embeddings and block 0
        assert_eq!((first.blocks.len(), first.head), (1, false));
        let elems = |recompute, in_flight| {
            let run = SpanRun {
                in_flight,
                ..SpanRun::one(&first, recompute, false, Precision::Fp32)
            };
            activation_elems(&cfg, 1, b, t, &run)
        };
        let each = |recompute| elems(recompute, 3) - elems(recompute, 2);
        let inputs = rows + b + rows * tv;
        assert_eq!(each(true), inputs + rows * (c + 2) + rows * c);
        assert!(each(false) > each(true) + rows * 3 * c);
    }

    /// Under `--precision bf16` q|k|v's gradient is held in bf16 and its
    /// bias's gradient summed from those values, as GPT-2's, and so is the
    /// masked LM's logits' gradient and its decoder bias's: over one token
    /// each block's qkv bias gradient is that token's q|k|v gradient, every
    /// element a bf16 value (under fp32, not every one); the masked-LM
    /// head's and a classifier's (whose last block runs its first rows
    /// alone after attention), with an intermediate wide enough to hold it
    /// in GELU's output's slot (4C) and one too narrow (under 3C: its
    /// fp32 scratch rounded where it lies). q|k|v itself is counted at two
    /// to a word.
    #[test]
    fn a_bf16_qkv_gradient_is_held_in_bf16() {
        use crate::backend::cpu::Cpu;
        use crate::backend::Device as _;
        use crate::model::unit::Whole;
        let heads = [(BertHead::Mlm, 5), (BertHead::Classify { labels: 3 }, 1)];
        for ((head, targets), n_inner) in heads.into_iter().flat_map(|h| [(h, 64), (h, 24)]) {
            let cfg = BertConfig {
                n_layer: 2,
                n_head: 2,
                n_embd: 16,
                n_inner,
                block_size: 4,
                type_vocab: 2,
                vocab_size: 11,
                layer_norm_eps: 1e-12,
                head,
            };
            let lay = layout::layout(&cfg, 1);
            let batch = Batch {
                inputs: vec![3],
                targets: vec![targets],
                types: vec![0],
                lens: vec![1],
                seq_targets: Vec::new(),
            };
            for precision in [Precision::Fp32, Precision::Bf16] {
                let e = Engine::new(Cpu::new(), cfg.clone(), TpPlace::NONE, false, precision);
                let mut m = Whole::with_engine(e.unwrap()).unwrap();
                m.load_full(&init_full(&cfg, 1)).unwrap();
                m.run_forward(&batch, (1, 1), batch.loss_terms(), None)
                    .unwrap();
                m.run_backward(1.0, None, |_, _, _| Ok(())).unwrap();
                let grads = m.backend().to_host(m.grads.s()).unwrap();
                for l in 0..cfg.n_layer {
                    let name = format!("bert.encoder.layer.{l}.{}", BlockParam::QkvB.name());
                    let db = &grads[lay.tensor(&name).unwrap().range()];
                    let at = format!("{head:?} {precision}, intermediate {n_inner}: block {l}");
                    assert!(db.iter().any(|&g| g != 0.0), "{at}");
                    let held = db.iter().all(|g| g.to_bits() & 0xffff == 0);
                    assert_eq!(held, precision == Precision::Bf16, "{at}");
                }
                // the masked LM's decoder bias: its one row's logits'
                // gradient, held in bf16 as it is rounded where it lies
                if let Some(t) = lay.tensor("cls.predictions.bias") {
                    let db = &grads[t.range()];
                    let held = db.iter().all(|g| g.to_bits() & 0xffff == 0);
                    let at = format!("{precision}, intermediate {n_inner}: the logits' gradient");
                    assert_eq!(held, precision == Precision::Bf16, "{at}");
                }
            }
            let one = Span::all(cfg.n_layer);
            let run = |p| SpanRun::one(&one, false, false, p);
            let [fp32, bf16] = [Precision::Fp32, Precision::Bf16]
                .map(|p| activation_elems(&cfg, 1, 2, 4, &run(p)));
            // per row and block: q|k|v and the intermediate product and GELU
            // output, two to a word
            let halved = cfg.n_layer * 8 * (3 * cfg.n_embd + 2 * cfg.n_inner) / 2;
            assert_eq!(fp32 - bf16, halved, "{head:?}");
        }
    }

    #[test]
    fn another_head_keeps_the_encoder_and_starts_its_own_tensors_fresh() {
        let mlm = BertConfig {
            n_layer: 1,
            n_head: 2,
            n_embd: 8,
            n_inner: 16,
            block_size: 6,
            type_vocab: 2,
            vocab_size: 11,
            layer_norm_eps: 1e-12,
            head: BertHead::Mlm,
        };
        let params: Vec<f32> = (0..layout::layout(&mlm, 1).total())
            .map(|i| i as f32)
            .collect();
        let head = BertHead::Classify { labels: 3 };
        let (cls, out) = with_head(&mlm, &params, head, 5);
        assert_eq!(cls.head, head);
        let fresh = init_full(&cls, 5);
        let (from, to) = (layout::layout(&mlm, 1), layout::layout(&cls, 1));
        for t in &to.tensors {
            let got = &out[t.range()];
            match from.tensor(&t.name) {
                Some(f) => assert_eq!(got, &params[f.range()], "{}", t.name),
                None => assert_eq!(got, &fresh[t.range()], "{}", t.name),
            }
        }
        assert!(to.tensor("classifier.weight").is_some());
        assert!(from.tensor("classifier.weight").is_none());
    }
}
