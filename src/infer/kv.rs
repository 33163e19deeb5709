//! Incremental decoding with a KV cache: one token per row per step, each
//! block's keys and values kept per position, so a step costs O(T) rather
//! than a full forward. Works on a tensor-parallel part of the model too
//! (each rank caches its own heads; the projections are all-reduced).

use crate::backend::{
    Activation, AttentionDecode, Backend, Buf, Category, DecodeShape, EncoderForward,
    LayerNormForward, MatmulDecode, Src, WeightFormat, WeightLayout,
};
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::model::gpt2::config::BlockDims;
use crate::model::gpt2::{BlockParam, LN_EPS};
use crate::model::{tp, GptConfig, ParamLayout, TpPlace};

/// A (tensor-parallel part of a) model ready to decode: its flat parameters
/// and its matrices packed once by the backend for few-row products, in fp32
/// or bf16 (the vectors, biases and layer norms stay fp32). Only tp rank 0
/// computes logits, so only it packs the LM head.
pub struct DecodeWeights<'a, B: Backend> {
    params: Src<'a, B>,
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
        let lay = ParamLayout::new_tp(config, tp.size);
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
            blocks,
            lm_head,
        })
    }
}

/// A decoder: a batch's rows, run as one part or, where the backend finds
/// it faster ([`Decode::decode_parts`](crate::backend::Decode::decode_parts)), as several parts of consecutive
/// rows that step side by side, each through the whole model.
pub struct Decoder<B: Backend> {
    config: GptConfig,
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
    x: Buf<B>,
    ln: Buf<B>,
    mean: Buf<B>,
    rstd: Buf<B>,
    qkv: Buf<B>,
    atty: Buf<B>,
    res2: Buf<B>,
    fch: Buf<B>,
    fch_gelu: Buf<B>,
    logits: Buf<B>,
}

/// What every part of a step shares.
struct StepIn<'s, 'w, B: Backend> {
    backend: &'s B,
    config: &'s GptConfig,
    layout: &'s ParamLayout,
    tp: TpPlace,
    max_t: usize,
    weights: &'s DecodeWeights<'w, B>,
    pos: usize,
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
            layout: ParamLayout::new_tp(&config, tp.size),
            config,
            backend,
            tp,
            b,
            max_t,
            parts,
        })
    }

    /// Feeds `tokens` (one per row) at position `pos` through this rank's
    /// weights. Afterwards tp rank 0's `logits` holds the next-token scores.
    pub fn step(
        &mut self,
        weights: &DecodeWeights<'_, B>,
        tokens: &[u32],
        pos: usize,
        tp: Option<&dyn Comm>,
    ) -> Result<()> {
        let cfg = &self.config;
        let (b, v) = (self.b, cfg.vocab_size);
        if pos >= self.max_t || tokens.len() != b {
            return Err(Error::Input(format!(
                "decode step at position {pos} with {} tokens (cache: {} positions, {b} rows)",
                tokens.len(),
                self.max_t
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= v) {
            return Err(Error::Input(format!(
                "token id {bad} is outside the vocabulary of {v}"
            )));
        }
        let lead = self.tp.rank == 0;
        if weights.params.len() != self.layout.total()
            || weights.blocks.len() != cfg.n_layer
            || weights.lm_head.is_some() != lead
        {
            return Err(Error::Input(format!(
                "decode weights were packed for another model or tp rank than this decoder's (tp rank {} of {})",
                self.tp.rank, self.tp.size
            )));
        }
        let shared = StepIn {
            backend: &self.backend,
            config: cfg,
            layout: &self.layout,
            tp: self.tp,
            max_t: self.max_t,
            weights,
            pos,
        };
        match self.parts.as_mut_slice() {
            [one] => one.step(&shared, tokens, tp),
            parts => self
                .backend
                .for_each_part(parts, |p| {
                    p.step(&shared, &tokens[p.first..p.first + p.b], None)
                })
                .into_iter()
                .collect(),
        }
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
        let (c, l) = (config.n_embd, config.n_layer);
        let BlockDims { cl, fl, .. } = config.widest(tp.size);
        let a = |n: usize| backend.alloc(n, Category::Activations);
        Ok(Part {
            tokens: backend.alloc_typed(b, Category::Activations)?,
            kcache: a(l * b * max_t * cl)?,
            vcache: a(l * b * max_t * cl)?,
            x: a(b * c)?,
            ln: a(b * c)?,
            mean: a(b)?,
            rstd: a(b)?,
            qkv: a(b * 3 * cl)?,
            atty: a(b * cl)?,
            res2: a(b * c)?,
            fch: a(b * fl)?,
            fch_gelu: a(b * fl)?,
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
        let (cfg, lay, weights, pos, max_t) = (at.config, at.layout, at.weights, at.pos, at.max_t);
        let (b, c, vp) = (self.b, cfg.n_embd, cfg.padded_vocab());
        let be = at.backend;
        // the two projections are row-parallel under tensor parallelism
        let place = (tp, at.tp);
        let wide = cfg.widest(at.tp.size).cl;
        let params = weights.params;
        be.upload(self.tokens.d(), tokens)?;
        // Every row is at position `pos`: a one-position slice of wpe.
        be.encoder_forward(EncoderForward {
            out: self.x.d(),
            tokens: self.tokens.s(),
            wte: params.slice(lay.wte()),
            wpe: params.slice(lay.wpe()).part(pos, c),
            t: 1,
            c,
        });
        for l in 0..cfg.n_layer {
            let p = params.slice(lay.block(l));
            let w = |bp: BlockParam| p.slice(lay.in_block(l, bp));
            let [qkv_w, proj_w, fc_w, fcproj_w] = &weights.blocks[l];
            let BlockDims { cl, nhl, fl, .. } = cfg.dims(l, at.tp.size);
            let (qkv, atty, fch) = (0..b * 3 * cl, 0..b * cl, 0..b * fl);
            be.layernorm_forward(LayerNormForward {
                out: self.ln.d(),
                mean: self.mean.d(),
                rstd: self.rstd.d(),
                inp: self.x.s(),
                w: w(BlockParam::Ln1W),
                b: w(BlockParam::Ln1B),
                c,
                eps: LN_EPS,
            });
            be.matmul_decode(MatmulDecode {
                out: self.qkv.slice_mut(qkv.clone()),
                inp: self.ln.s(),
                w: qkv_w,
                bias: Some(w(BlockParam::QkvB)),
                dims: (b, c, 3 * cl),
                accumulate: false,
            });
            let cache = l * b * max_t * wide;
            for r in 0..b {
                let at = cache + (r * max_t + pos) * cl;
                let row = self.qkv.slice(r * 3 * cl..(r + 1) * 3 * cl);
                be.copy(self.kcache.slice_mut(at..at + cl), row.slice(cl..2 * cl));
                be.copy(
                    self.vcache.slice_mut(at..at + cl),
                    row.slice(2 * cl..3 * cl),
                );
            }
            be.attention_decode(AttentionDecode {
                out: self.atty.slice_mut(atty.clone()),
                qkv: self.qkv.slice(qkv),
                kcache: self.kcache.slice(cache..cache + b * max_t * cl),
                vcache: self.vcache.slice(cache..cache + b * max_t * cl),
                shape: DecodeShape {
                    b,
                    len: pos + 1,
                    c: cl,
                    nh: nhl,
                    max_t,
                },
            });
            let atty = self.atty.slice(atty);
            let (out, x) = (self.res2.d(), self.x.s());
            tp::row_parallel(
                be,
                place,
                out,
                x,
                w(BlockParam::AttnProjB),
                |out, bias, accumulate| {
                    be.matmul_decode(MatmulDecode {
                        out,
                        inp: atty,
                        w: proj_w,
                        bias,
                        dims: (b, cl, c),
                        accumulate,
                    })
                },
            )?;
            be.layernorm_forward(LayerNormForward {
                out: self.ln.d(),
                mean: self.mean.d(),
                rstd: self.rstd.d(),
                inp: self.res2.s(),
                w: w(BlockParam::Ln2W),
                b: w(BlockParam::Ln2B),
                c,
                eps: LN_EPS,
            });
            be.matmul_decode(MatmulDecode {
                out: self.fch.slice_mut(fch.clone()),
                inp: self.ln.s(),
                w: fc_w,
                bias: Some(w(BlockParam::FcB)),
                dims: (b, c, fl),
                accumulate: false,
            });
            let gelu = Activation::GeluTanh;
            be.activation_forward(
                self.fch_gelu.slice_mut(fch.clone()),
                self.fch.slice(fch.clone()),
                gelu,
            );
            let (out, res2, gelu) = (self.x.d(), self.res2.s(), self.fch_gelu.slice(fch));
            tp::row_parallel(
                be,
                place,
                out,
                res2,
                w(BlockParam::FcProjB),
                |out, bias, accumulate| {
                    be.matmul_decode(MatmulDecode {
                        out,
                        inp: gelu,
                        w: fcproj_w,
                        bias,
                        dims: (b, fl, c),
                        accumulate,
                    })
                },
            )?;
        }
        let lnf = params.slice(lay.final_norm());
        be.layernorm_forward(LayerNormForward {
            out: self.ln.d(),
            mean: self.mean.d(),
            rstd: self.rstd.d(),
            inp: self.x.s(),
            w: lnf.first(c),
            b: lnf.from(c),
            c,
            eps: LN_EPS,
        });
        if let Some(head) = &weights.lm_head {
            be.matmul_decode(MatmulDecode {
                out: self.logits.d(),
                inp: self.ln.s(),
                w: head,
                bias: None,
                dims: (b, c, vp),
                accumulate: false,
            });
        }
        Ok(())
    }
}
