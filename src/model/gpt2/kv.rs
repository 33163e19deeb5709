//! Incremental decoding with a KV cache: one token per row per step, each
//! block's keys and values kept per position, so a step costs O(T) rather
//! than a full forward; a prompt's first positions go in one pass (a
//! prefill). Works on a tensor-parallel part of the model too (each rank
//! caches its own heads; the projections are all-reduced).

use crate::backend::{
    AttentionDecode, AttentionForward, AttnShape, Backend, Buf, Category, DecodeShape, Dst,
    EncoderForward, LayerNormForward, MatmulDecode, MatmulForward, MatmulShape, On, Src, StoredDst,
    StoredSrc, WeightFormat, WeightLayout,
};
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::model::gpt2::block::{self, BlockIo, BlockMode, BlockParams};
use crate::model::gpt2::config::BlockDims;
use crate::model::gpt2::{BlockParam, LN_EPS};
use crate::model::ops::Normed;
use crate::model::{GptConfig, ParamLayout, TpPlace};

/// A (tensor-parallel part of a) model ready to decode: its flat parameters
/// and its matrices packed once by the backend for few-row products, in fp32
/// or bf16 (the vectors, biases and layer norms stay fp32). Only tp rank 0
/// computes logits, so only it packs the LM head.
pub struct DecodeWeights<'a, B: Backend> {
    params: Src<'a, B>,
    format: WeightFormat,
    /// Per block: qkv, attention projection, fc, fc projection.
    blocks: Vec<[B::Packed; 4]>,
    lm_head: Option<B::Packed>,
}

impl<'a, B: Backend> DecodeWeights<'a, B> {
    pub fn new(
        backend: &B,
        config: &GptConfig,
        tp: TpPlace,
        params: Src<'a, B>,
        format: WeightFormat,
    ) -> Result<Self> {
        let lay = super::layout::layout(config, tp.size);
        if params.len() != lay.total() {
            return Err(Error::Input(format!(
                "decoding needs {} parameters for tp rank {} of {}, got {}",
                lay.total(),
                tp.rank,
                tp.size,
                params.len()
            )));
        }
        let c = config.n_embd;
        let pack =
            |w: Src<'_, B>, layout, k, n| backend.pack_decode_weight(w, layout, k, n, format);
        let blocks = (0..config.n_layer)
            .map(|l| {
                let p = params.slice(lay.block(l));
                let w = |bp: BlockParam| p.slice(lay.in_block(l, bp));
                let BlockDims { cl, fl, .. } = config.dims(l, tp.size);
                Ok([
                    pack(w(BlockParam::QkvW), WeightLayout::InOut, c, 3 * cl)?,
                    pack(w(BlockParam::AttnProjW), WeightLayout::InOut, cl, c)?,
                    pack(w(BlockParam::FcW), WeightLayout::InOut, c, fl)?,
                    pack(w(BlockParam::FcProjW), WeightLayout::InOut, fl, c)?,
                ])
            })
            .collect::<Result<_>>()?;
        let lm_head = (tp.rank == 0)
            .then(|| {
                pack(
                    params.slice(lay.wte()),
                    WeightLayout::OutIn,
                    c,
                    config.padded_vocab(),
                )
            })
            .transpose()?;
        Ok(DecodeWeights {
            params,
            format,
            blocks,
            lm_head,
        })
    }

    /// Whether a prefill runs its products on the training matmul: with
    /// fp32 weights, whose packing is for few rows (bf16 and int8 weights
    /// stay on theirs, to keep their format).
    fn dense_prefill(&self) -> bool {
        self.format == WeightFormat::F32
    }
}

/// A decoder: a batch's rows, run as one part or, where the backend finds
/// it faster ([`Threads::decode_parts`](crate::backend::Threads::decode_parts)), as several parts of consecutive
/// rows that step side by side, each through the whole model.
pub struct Decoder<B: Backend> {
    pub(super) config: GptConfig,
    layout: ParamLayout,
    backend: B,
    tp: TpPlace,
    b: usize,
    max_t: usize,
    parts: Vec<Part<B>>,
}

/// Some consecutive rows of a [`Decoder`], with their own cache and buffers.
struct Part<B: Backend> {
    /// The first of the decoder's rows this part holds.
    first: usize,
    b: usize,
    tokens: Buf<B, u32>,
    kcache: Buf<B>,
    vcache: Buf<B>,
    /// A step's activations: one position of each row.
    acts: Acts<B>,
    logits: Buf<B>,
}

/// The activations of a pass through the blocks, for some rows.
struct Acts<B: Backend> {
    /// The residual stream, in and out of a block (swapped after each).
    x: Buf<B>,
    y: Buf<B>,
    /// ln1's (and the final norm's) output, mean and rstd; ln2's.
    ln: Buf<B>,
    mean: Buf<B>,
    rstd: Buf<B>,
    ln2: Buf<B>,
    mean2: Buf<B>,
    rstd2: Buf<B>,
    qkv: Buf<B>,
    atty: Buf<B>,
    res2: Buf<B>,
    fch: Buf<B>,
    fch_gelu: Buf<B>,
}

impl<B: Backend> Acts<B> {
    /// A block's buffers for `rows` rows of widths `cl` (attention) and
    /// `fl` (MLP) on this rank: from `x` into `y`.
    fn block_io(&mut self, rows: usize, cl: usize, fl: usize) -> BlockIo<'_, B> {
        BlockIo {
            x: self.x.s(),
            out: self.y.d(),
            ln1: Normed {
                out: self.ln.d().into(),
                mean: self.mean.d(),
                rstd: self.rstd.d(),
            },
            qkv: self.qkv.slice_mut(0..rows * 3 * cl).into(),
            atty: self.atty.slice_mut(0..rows * cl).into(),
            res2: self.res2.d(),
            ln2: Normed {
                out: self.ln2.d().into(),
                mean: self.mean2.d(),
                rstd: self.rstd2.d(),
            },
            fch: self.fch.slice_mut(0..rows * fl).into(),
            fch_gelu: self.fch_gelu.slice_mut(0..rows * fl).into(),
        }
    }

    /// For `rows` rows of the widest block on this tp rank.
    fn new(backend: &B, config: &GptConfig, tp: TpPlace, rows: usize) -> Result<Self> {
        let c = config.n_embd;
        let BlockDims { cl, fl, .. } = config.widest(tp.size);
        let a = |n: usize| backend.alloc(rows * n, Category::Activations);
        Ok(Acts {
            x: a(c)?,
            y: a(c)?,
            ln: a(c)?,
            mean: a(1)?,
            rstd: a(1)?,
            ln2: a(c)?,
            mean2: a(1)?,
            rstd2: a(1)?,
            qkv: a(3 * cl)?,
            atty: a(cl)?,
            res2: a(c)?,
            fch: a(fl)?,
            fch_gelu: a(fl)?,
        })
    }
}

/// What [`Decoder::prefill_logits`] calls with each (row, position) and
/// its next-token logits.
pub type Visit<'v> = dyn FnMut(usize, usize, &[f32]) -> Result<()> + 'v;

/// Which next-token logits a pass computes.
enum Scores<'a, 'v> {
    None,
    /// A step's, into the part's `logits`.
    Last,
    /// Every position's, handed to the visitor.
    Every(&'a mut Visit<'v>),
}

/// Rows of logits a prefill scores at a time: at most this many bytes.
const SCORED_BYTES: usize = 64 << 20;

/// What every part of a step shares.
struct StepIn<'s, 'w, B: Backend> {
    backend: &'s B,
    config: &'s GptConfig,
    layout: &'s ParamLayout,
    tp: TpPlace,
    max_t: usize,
    weights: &'s DecodeWeights<'w, B>,
    pos: usize,
    logits: bool,
}

impl<B: Backend> Decoder<B> {
    /// Buffers for `b` rows of up to `max_t` positions (at most the block size).
    pub fn new(backend: B, config: GptConfig, tp: TpPlace, b: usize, max_t: usize) -> Result<Self> {
        if max_t == 0 || max_t > config.block_size {
            return Err(Error::Input(format!(
                "{max_t} positions do not fit the block size {}",
                config.block_size
            )));
        }
        // tensor-parallel ranks all-reduce inside a step: one part
        let parts = match tp.size {
            1 => backend
                .threads()
                .decode_parts(b, config.matmul_params())
                .clamp(1, b.max(1)),
            _ => 1,
        };
        let parts = (0..parts)
            .map(|i| {
                let first = b * i / parts;
                Part::new(
                    &backend,
                    &config,
                    tp,
                    first,
                    b * (i + 1) / parts - first,
                    max_t,
                )
            })
            .collect::<Result<_>>()?;
        Ok(Decoder {
            layout: super::layout::layout(&config, tp.size),
            config,
            backend,
            tp,
            b,
            max_t,
            parts,
        })
    }

    /// Feeds `tokens` (one per row) at position `pos` through this rank's
    /// weights. Afterwards, with `logits`, tp rank 0's `logits` holds the
    /// next-token scores; without (a step no row samples after: inside the
    /// prompts), the final LayerNorm and the LM head are skipped and
    /// `logits` is left as it was.
    pub fn step(
        &mut self,
        weights: &DecodeWeights<'_, B>,
        tokens: &[u32],
        pos: usize,
        tp: Option<&dyn Comm>,
        logits: bool,
    ) -> Result<()> {
        let scores = match logits {
            true => Scores::Last,
            false => Scores::None,
        };
        self.pass(weights, tokens, pos, 1, tp, scores)
    }

    /// Feeds the first `t` tokens of every row's prompt (`tokens`: `t` a
    /// row, row after row) at positions 0..t in one pass, as `t` steps
    /// without logits would: each block's products over every position at
    /// once, attention causal among them. Decoding goes on with a step at
    /// position `t`.
    pub fn prefill(
        &mut self,
        weights: &DecodeWeights<'_, B>,
        tokens: &[u32],
        t: usize,
        tp: Option<&dyn Comm>,
    ) -> Result<()> {
        self.pass(weights, tokens, 0, t, tp, Scores::None)
    }

    /// [`Decoder::prefill`] on a whole model (one tp rank) that also scores
    /// every position: `visit(row, pos, logits)` sees the next-token logits
    /// after each (padding dropped), a few rows' at a time in host memory.
    pub fn prefill_logits(
        &mut self,
        weights: &DecodeWeights<'_, B>,
        tokens: &[u32],
        t: usize,
        visit: &mut Visit<'_>,
    ) -> Result<()> {
        if self.tp.size != 1 {
            return Err(Error::Input(format!(
                "every position's logits need the whole model on one rank, not tp {}",
                self.tp.size
            )));
        }
        self.pass(weights, tokens, 0, t, None, Scores::Every(visit))
    }

    /// [`Decoder::step`] where `t` is 1 and not every position is scored,
    /// else a prefill (from position 0): positions `pos..pos + t` of every
    /// row, scored as `scores` says.
    fn pass(
        &mut self,
        weights: &DecodeWeights<'_, B>,
        tokens: &[u32],
        pos: usize,
        t: usize,
        tp: Option<&dyn Comm>,
        scores: Scores<'_, '_>,
    ) -> Result<()> {
        let (b, max_t) = (self.b, self.max_t);
        if t == 0 || pos + t > max_t || tokens.len() != b * t {
            return Err(Error::Input(format!(
                "decoding positions {pos}..{} of {b} rows takes {} tokens, got {} (the cache holds {max_t} positions)",
                pos + t,
                b * t,
                tokens.len()
            )));
        }
        self.check(weights, tokens)?;
        let shared = StepIn {
            backend: &self.backend,
            config: &self.config,
            layout: &self.layout,
            tp: self.tp,
            max_t,
            weights,
            pos,
            logits: !matches!(scores, Scores::None),
        };
        let (step, mut every) = match scores {
            Scores::Every(visit) => (false, Some(visit)),
            _ => (t == 1, None),
        };
        match self.parts.as_mut_slice() {
            [one] if step => one.step(&shared, tokens, tp),
            parts if step => self
                .backend
                .threads()
                .for_each_part(parts, |p| {
                    p.step(&shared, &tokens[p.first..p.first + p.b], None)
                })
                .into_iter()
                .collect(),
            // each part's prefill spans the pool: one after another
            parts => parts.iter_mut().try_for_each(|p| {
                let rows = &tokens[p.first * t..(p.first + p.b) * t];
                p.prefill(&shared, rows, t, tp, every.as_deref_mut())
            }),
        }
    }

    /// That `tokens` are in the vocabulary and `weights` were packed for
    /// this decoder's model and tp rank.
    fn check(&self, weights: &DecodeWeights<'_, B>, tokens: &[u32]) -> Result<()> {
        let v = self.config.vocab_size;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= v) {
            return Err(Error::Input(format!(
                "token id {bad} is outside the vocabulary of {v}"
            )));
        }
        let lead = self.tp.rank == 0;
        if weights.params.len() != self.layout.total()
            || weights.blocks.len() != self.config.n_layer
            || weights.lm_head.is_some() != lead
        {
            return Err(Error::Input(format!(
                "decode weights were packed for another model or tp rank than this decoder's (tp rank {} of {})",
                self.tp.rank, self.tp.size
            )));
        }
        Ok(())
    }

    /// Next-token logits of row r (padding dropped), copied to the host.
    pub fn logits(&self, r: usize) -> Result<Vec<f32>> {
        let part = self
            .parts
            .iter()
            .find(|p| (p.first..p.first + p.b).contains(&r))
            .ok_or_else(|| Error::Input(format!("row {r} of a decoder of {} rows", self.b)))?;
        let (vp, r) = (self.config.padded_vocab(), r - part.first);
        self.backend
            .to_host(part.logits.slice(r * vp..r * vp + self.config.vocab_size))
    }
}

/// The decoding mode of GPT-2's block forward: the block's matrices packed
/// (qkv, attention projection, fc, fc projection), its keys and values
/// written to the cache and attended against. A step is one position a
/// row, appended at the shape's last position; a prefill is a prompt's
/// first positions a row, attended causally among themselves.
struct Decoding<'s, 'c, B: Backend> {
    be: &'s B,
    packed: &'s [B::Packed; 4],
    /// A prefill's products on the training matmul
    /// ([`DecodeWeights::dense_prefill`]), not on `packed`.
    dense: bool,
    /// This block's caches: (rows, max_t, cl) each.
    kcache: Dst<'c, B>,
    vcache: Dst<'c, B>,
    /// `len`: the positions cached after this pass.
    shape: DecodeShape,
    /// A prefill's positions a row and its attention's log-sum-exp
    /// scratch; `None` for a step.
    prefill: Option<(usize, Dst<'c, B>)>,
}

impl<B: Backend> BlockMode<B> for Decoding<'_, '_, B> {
    fn matmul(&mut self, which: BlockParam, op: MatmulForward<On<'_, B>>) -> Result<()> {
        if self.dense {
            return self.be.run(op);
        }
        let w = match which {
            BlockParam::QkvW => &self.packed[0],
            BlockParam::AttnProjW => &self.packed[1],
            BlockParam::FcW => &self.packed[2],
            BlockParam::FcProjW => &self.packed[3],
            other => {
                return Err(Error::Config(format!(
                    "{other:?} is not a block matrix: no packed weight to decode with"
                )))
            }
        };
        let MatmulShape { rows, k, n, .. } = op.shape;
        let (mut out, inp) = (
            op.out.fp32().ok_or_else(not_fp32)?,
            op.inp.fp32().ok_or_else(not_fp32)?,
        );
        // the packed product adds onto the residual copied into out
        if let Some(r) = op.residual {
            self.be.copy(out.rb(), r);
        }
        self.be.matmul_decode(MatmulDecode {
            out,
            inp,
            w,
            bias: op.bias,
            dims: (rows, k, n),
            accumulate: op.accumulate || op.residual.is_some(),
        });
        Ok(())
    }
    fn attention(&mut self, atty: StoredDst<'_, B>, qkv: StoredSrc<'_, B>) -> Result<()> {
        let atty = atty.fp32().ok_or_else(not_fp32)?;
        let qkv = qkv.fp32().ok_or_else(not_fp32)?;
        let DecodeShape {
            b,
            len,
            c,
            nh,
            max_t,
        } = self.shape;
        // qkv's rows: t positions a row, the last at len - 1 (a step's t is 1)
        let t = self.prefill.as_ref().map_or(1, |p| p.0);
        for r in 0..b {
            for j in 0..t {
                let at = (r * max_t + len - t + j) * c;
                let row = qkv.slice((r * t + j) * 3 * c..(r * t + j + 1) * 3 * c);
                self.be
                    .copy(self.kcache.rb().slice(at..at + c), row.slice(c..2 * c));
                self.be
                    .copy(self.vcache.rb().slice(at..at + c), row.slice(2 * c..3 * c));
            }
        }
        match &mut self.prefill {
            None => {
                self.be.attention_decode(AttentionDecode {
                    out: atty,
                    qkv,
                    kcache: self.kcache.src().first(b * max_t * c),
                    vcache: self.vcache.src().first(b * max_t * c),
                    shape: self.shape,
                });
                Ok(())
            }
            Some((t, lse)) => self.be.run(AttentionForward {
                out: atty.into(),
                lse: lse.rb(),
                qkv: qkv.into(),
                lens: None,
                shape: AttnShape {
                    b,
                    t: *t,
                    c,
                    nh,
                    bf16: false,
                },
            }),
        }
    }
}

impl<B: Backend> Part<B> {
    /// Buffers for rows first..first + b.
    fn new(
        backend: &B,
        config: &GptConfig,
        tp: TpPlace,
        first: usize,
        b: usize,
        max_t: usize,
    ) -> Result<Self> {
        let l = config.n_layer;
        let cl = config.widest(tp.size).cl;
        let a = |n: usize| backend.alloc(n, Category::Activations);
        Ok(Part {
            tokens: backend.alloc_typed(b, Category::Activations)?,
            kcache: a(l * b * max_t * cl)?,
            vcache: a(l * b * max_t * cl)?,
            acts: Acts::new(backend, config, tp, b)?,
            logits: a(b * config.padded_vocab())?,
            first,
            b,
        })
    }

    /// [`Decoder::step`] for this part's rows (`tokens`, checked).
    fn step(
        &mut self,
        at: &StepIn<'_, '_, B>,
        tokens: &[u32],
        tp: Option<&dyn Comm>,
    ) -> Result<()> {
        let (be, b) = (at.backend, self.b);
        be.upload(self.tokens.d(), tokens)?;
        let (k, v) = (&mut self.kcache, &mut self.vcache);
        blocks(at, k, v, self.tokens.s(), &mut self.acts, None, tp)?;
        if at.logits {
            final_norm(at, &mut self.acts)?;
            lm_head(at, self.acts.ln.s(), self.logits.d(), b, false)?;
        }
        Ok(())
    }

    /// [`Decoder::prefill`] for this part's rows (`tokens`, checked: `t`
    /// positions a row, row after row); with `every`, each position's
    /// logits to it, a chunk of rows at a time.
    fn prefill(
        &mut self,
        at: &StepIn<'_, '_, B>,
        tokens: &[u32],
        t: usize,
        tp: Option<&dyn Comm>,
        every: Option<&mut Visit<'_>>,
    ) -> Result<()> {
        let (be, cfg) = (at.backend, at.config);
        let rows = self.b * t;
        let mut ids = be.alloc_typed(rows, Category::Activations)?;
        be.upload(ids.d(), tokens)?;
        let mut acts = Acts::new(be, cfg, at.tp, rows)?;
        let heads = cfg.widest(at.tp.size).nhl;
        let mut lse = be.alloc(self.b * heads * t, Category::Activations)?;
        let (k, v) = (&mut self.kcache, &mut self.vcache);
        blocks(at, k, v, ids.s(), &mut acts, Some((t, &mut lse)), tp)?;
        let Some(visit) = every else {
            return Ok(());
        };
        final_norm(at, &mut acts)?;
        let (c, v, vp) = (cfg.n_embd, cfg.vocab_size, cfg.padded_vocab());
        let most = (SCORED_BYTES / (4 * vp)).clamp(1, rows);
        let mut out = be.alloc(most * vp, Category::Activations)?;
        for r0 in (0..rows).step_by(most) {
            let n = most.min(rows - r0);
            let inp = acts.ln.s().slice(r0 * c..(r0 + n) * c);
            lm_head(at, inp, out.slice_mut(0..n * vp), n, true)?;
            let host = be.to_host(out.s().first(n * vp))?;
            for (i, row) in host.chunks_exact(vp).enumerate() {
                let (r, pos) = ((r0 + i) / t, (r0 + i) % t);
                visit(self.first + r, pos, &row[..v])?;
            }
        }
        Ok(())
    }
}

/// The embeddings of `tokens` through every block into `acts.x`, their
/// keys and values into `kcache` and `vcache`: a step's one position a row
/// at `at.pos`, or a prefill's first `t` positions a row (with its
/// attention's log-sum-exp scratch), row after row.
fn blocks<B: Backend>(
    at: &StepIn<'_, '_, B>,
    kcache: &mut Buf<B>,
    vcache: &mut Buf<B>,
    tokens: Src<'_, B, u32>,
    acts: &mut Acts<B>,
    mut prefill: Option<(usize, &mut Buf<B>)>,
    tp: Option<&dyn Comm>,
) -> Result<()> {
    let (cfg, lay, weights, max_t) = (at.config, at.layout, at.weights, at.max_t);
    let (t, pos) = prefill.as_ref().map_or((1, at.pos), |p| (p.0, 0));
    let b = tokens.len() / t;
    let c = cfg.n_embd;
    let rows = b * t;
    let be = at.backend;
    let tp = at.tp.in_group(tp);
    let wide = cfg.widest(at.tp.size).cl;
    let params = weights.params;
    be.run(EncoderForward {
        out: acts.x.d(),
        tokens,
        wte: params.slice(lay.wte()),
        wpe: params.slice(lay.wpe()).slice(pos * c..(pos + t) * c),
        t,
        c,
    })?;
    for l in 0..cfg.n_layer {
        let d = cfg.dims(l, at.tp.size);
        let BlockDims { cl, nhl, fl, .. } = d;
        let io = acts.block_io(rows, cl, fl);
        let cache = l * b * max_t * wide..(l * b * max_t + b * max_t) * wide;
        let mut mode = Decoding {
            be,
            packed: &weights.blocks[l],
            dense: prefill.is_some() && weights.dense_prefill(),
            kcache: kcache.slice_mut(cache.clone()),
            vcache: vcache.slice_mut(cache),
            shape: DecodeShape {
                b,
                len: pos + t,
                c: cl,
                nh: nhl,
                max_t,
            },
            prefill: prefill
                .as_mut()
                .map(|(t, lse)| (*t, lse.slice_mut(0..b * nhl * *t))),
        };
        let p = params.slice(lay.block(l));
        block::forward(
            be,
            &mut mode,
            io,
            BlockParams {
                lay,
                l,
                p: p.into(),
            },
            rows,
            d,
            tp,
        )?;
        std::mem::swap(&mut acts.x, &mut acts.y);
    }
    Ok(())
}

/// Why decoding refuses a tensor stored in bf16.
fn not_fp32() -> Error {
    Error::Config("decoding keeps its tensors in fp32, not bf16".into())
}

/// The final LayerNorm of `acts.x` (every row) into `acts.ln`.
fn final_norm<B: Backend>(at: &StepIn<'_, '_, B>, acts: &mut Acts<B>) -> Result<()> {
    let c = at.config.n_embd;
    let lnf = at.weights.params.slice(at.layout.head());
    at.backend.run(LayerNormForward {
        out: acts.ln.d().into(),
        mean: acts.mean.d(),
        rstd: acts.rstd.d(),
        inp: acts.x.s(),
        w: lnf.first(c),
        b: lnf.from(c),
        c,
        eps: LN_EPS,
    })
}

/// `rows` rows' next-token logits (padded vocabulary) from their final
/// LayerNorm's output `inp`, where this rank has the LM head (tp rank 0):
/// a prefill's with fp32 weights on the training matmul (the tied
/// embedding as it is), as `Decoding` runs its products, else on the
/// packed head.
fn lm_head<B: Backend>(
    at: &StepIn<'_, '_, B>,
    inp: Src<'_, B>,
    out: Dst<'_, B>,
    rows: usize,
    prefill: bool,
) -> Result<()> {
    let Some(head) = &at.weights.lm_head else {
        return Ok(());
    };
    let dims = (rows, at.config.n_embd, at.config.padded_vocab());
    if prefill && at.weights.dense_prefill() {
        return at.backend.run(MatmulForward {
            out: out.into(),
            inp: inp.into(),
            w: at.weights.params.slice(at.layout.wte()).into(),
            bias: None,
            residual: None,
            shape: MatmulShape::new(dims, WeightLayout::OutIn),
            accumulate: false,
        });
    }
    at.backend.matmul_decode(MatmulDecode {
        out,
        inp,
        w: head,
        bias: None,
        dims,
        accumulate: false,
    });
    Ok(())
}
