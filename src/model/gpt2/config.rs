//! GPT-2 configurations as plain data: the named presets and their checks.

use crate::error::Error;
use crate::model::family::MAX_PARAMS;
pub use crate::model::tp::BlockDims;
use serde::{Deserialize, Serialize};

/// Shape of a GPT-2-family model. `vocab_size` is the real vocabulary; the
/// embedding is padded to [`GptConfig::padded_vocab`] rows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GptConfig {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub block_size: usize,
    pub vocab_size: usize,
    /// Each block's widths when they differ from the dense shape's (a
    /// row-pruned model); empty when every block has `n_head` heads and
    /// `4 n_embd` MLP units. Heads keep the dense head size.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blocks: Vec<BlockWidth>,
}

/// One block's attention heads and MLP hidden units.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockWidth {
    pub heads: usize,
    pub hidden: usize,
}

impl std::fmt::Display for GptConfig {
    /// "6 layers x 6 heads x 384 wide, block 256, vocabulary 65", and a
    /// pruned model's per-block heads and MLP units.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} layers x {} heads x {} wide, block {}, vocabulary {}",
            self.n_layer, self.n_head, self.n_embd, self.block_size, self.vocab_size
        )?;
        if !self.blocks.is_empty() {
            let list = |f: fn(&BlockWidth) -> usize| {
                let v: Vec<String> = self.blocks.iter().map(|b| f(b).to_string()).collect();
                v.join(" ")
            };
            write!(
                f,
                ", pruned to heads [{}] and MLP units [{}]",
                list(|b| b.heads),
                list(|b| b.hidden)
            )?;
        }
        Ok(())
    }
}

pub use crate::data::tokenizer::GPT2_VOCAB;

/// Vocabulary of nanoGPT's character-level Tiny Shakespeare (bench default).
pub const CHAR_VOCAB: usize = 65;

/// A named model shape: the dense GPT-2 of these sizes.
const fn preset(
    name: &'static str,
    n_layer: usize,
    n_head: usize,
    n_embd: usize,
    block_size: usize,
    vocab_size: usize,
) -> (&'static str, GptConfig) {
    let blocks = Vec::new();
    let config = GptConfig {
        n_layer,
        n_head,
        n_embd,
        block_size,
        vocab_size,
        blocks,
    };
    (name, config)
}

/// name, layers, heads, width, block size, vocabulary.
pub const PRESETS: [(&str, GptConfig); 7] = [
    preset("gpt2", 12, 12, 768, 1024, GPT2_VOCAB), // GPT-2 small, 124M parameters
    preset("gpt2-medium", 24, 16, 1024, 1024, GPT2_VOCAB), // 350M
    preset("gpt2-large", 36, 20, 1280, 1024, GPT2_VOCAB), // 774M
    preset("gpt2-xl", 48, 25, 1600, 1024, GPT2_VOCAB), // 1.5B
    preset("shakespeare-char", 6, 6, 384, 256, CHAR_VOCAB), // nanoGPT's shakespeare_char, 10.7M
    preset("shakespeare-char-small", 4, 4, 128, 128, CHAR_VOCAB), // minutes on 2 cores
    preset("tiny", 2, 2, 32, 64, CHAR_VOCAB),      // for tests
];

impl GptConfig {
    /// A named preset; training replaces `vocab_size` with its tokenizer's.
    ///
    /// ```
    /// use distgpt::model::GptConfig;
    /// let c = GptConfig::preset("shakespeare-char").unwrap();
    /// assert_eq!((c.n_layer, c.n_head, c.n_embd, c.block_size), (6, 6, 384, 256));
    /// assert_eq!(c.padded_vocab(), 128);
    /// ```
    pub fn preset(name: &str) -> Result<Self, Error> {
        let Some((_, config)) = PRESETS.into_iter().find(|p| p.0 == name) else {
            let names: Vec<&str> = PRESETS.iter().map(|p| p.0).collect();
            return Err(Error::Config(format!(
                "unknown model preset '{name}' (known: {})",
                names.join(", ")
            )));
        };
        Ok(config)
    }

    /// Vocabulary rounded up to a multiple of 64 (the embedding's row count).
    pub fn padded_vocab(&self) -> usize {
        self.vocab_size.div_ceil(64) * 64
    }

    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Block l's heads and MLP units.
    pub fn width(&self, l: usize) -> BlockWidth {
        self.blocks.get(l).copied().unwrap_or(BlockWidth {
            heads: self.n_head,
            hidden: 4 * self.n_embd,
        })
    }

    /// Block l's widths on one of `tp` ranks (`tp` divides its heads and units).
    pub fn dims(&self, l: usize, tp: usize) -> BlockDims {
        let w = self.width(l);
        BlockDims {
            c: self.n_embd,
            cl: w.heads * self.head_dim() / tp,
            nhl: w.heads / tp,
            fl: w.hidden / tp,
        }
    }

    /// The widest block's widths, each taken on its own (what per-block
    /// buffers are sized for).
    pub fn widest(&self, tp: usize) -> BlockDims {
        (0..self.n_layer)
            .map(|l| self.dims(l, tp))
            .fold(self.dims(0, tp), |a, d| BlockDims {
                c: a.c,
                cl: a.cl.max(d.cl),
                nhl: a.nhl.max(d.nhl),
                fl: a.fl.max(d.fl),
            })
    }

    /// The same model before pruning: every block dense.
    pub fn dense(&self) -> GptConfig {
        GptConfig {
            blocks: Vec::new(),
            ..self.clone()
        }
    }

    /// Refuses a tensor-parallel size that does not divide every block's
    /// heads and MLP units.
    pub fn check_tp(&self, tp: usize) -> Result<(), Error> {
        crate::model::tp::check_heads(self.n_head, tp)?;
        // a dense model's blocks are alike: its first speaks for all
        let layers = match self.blocks.is_empty() {
            true => self.n_layer.min(1),
            false => self.n_layer,
        };
        match (0..layers).find(|&l| {
            let w = self.width(l);
            !(w.heads.is_multiple_of(tp) && w.hidden.is_multiple_of(tp))
        }) {
            Some(l) => Err(Error::Config(format!(
                "block {l} of this pruned model has {} heads and {} MLP units, not both divisible by the tensor-parallel size {tp}",
                self.width(l).heads,
                self.width(l).hidden
            ))),
            None => Ok(()),
        }
    }

    /// Refuses shapes the kernels cannot run, and models past
    /// [`MAX_PARAMS`] (a bound on what a file can ask to allocate).
    pub fn validate(&self) -> Result<(), Error> {
        self.validate_shape()?;
        let c = self;
        match c.checked_num_params() {
            Some(n) if n <= MAX_PARAMS => Ok(()),
            _ => Err(Error::Config(format!(
                "{} layers x {} wide with a vocabulary of {} and {} positions is more than {MAX_PARAMS} parameters",
                c.n_layer, c.n_embd, c.vocab_size, c.block_size
            ))),
        }
    }

    /// Refuses shapes the kernels cannot run, of any size whose count of
    /// parameters fits a `usize`: what `plan` prices (it allocates nothing).
    pub fn validate_shape(&self) -> Result<(), Error> {
        let c = self;
        if c.n_layer == 0
            || c.n_head == 0
            || c.n_embd == 0
            || c.block_size == 0
            || c.vocab_size == 0
        {
            return Err(Error::Config(format!(
                "every model dimension must be positive, got {c}"
            )));
        }
        if !c.n_embd.is_multiple_of(c.n_head) {
            return Err(Error::Config(format!(
                "n_embd ({}) must be divisible by n_head ({}): choose n_head among the divisors of n_embd",
                c.n_embd, c.n_head
            )));
        }
        if !c.blocks.is_empty() && c.blocks.len() != c.n_layer {
            return Err(Error::Config(format!(
                "the model lists widths for {} blocks but has {} layers",
                c.blocks.len(),
                c.n_layer
            )));
        }
        if let Some((l, w)) = c.blocks.iter().enumerate().find(|(_, w)| {
            w.heads == 0 || w.heads > c.n_head || w.hidden == 0 || w.hidden > 4 * c.n_embd
        }) {
            return Err(Error::Config(format!(
                "block {l} has {} heads and {} MLP units: a block needs 1 to {} heads and 1 to {} units",
                w.heads,
                w.hidden,
                c.n_head,
                4 * c.n_embd
            )));
        }
        if c.vocab_size > u32::MAX as usize {
            return Err(Error::Config(format!(
                "vocab_size {} is too large",
                c.vocab_size
            )));
        }
        match c.checked_num_params() {
            Some(_) => Ok(()),
            None => Err(Error::Config(format!(
                "{} layers x {} wide with a vocabulary of {} and {} positions has more parameters than can be counted",
                c.n_layer, c.n_embd, c.vocab_size, c.block_size
            ))),
        }
    }

    /// [`GptConfig::num_params`] of the dense shape (a bound on a pruned
    /// one's) without overflow: `None` past `usize`.
    fn checked_num_params(&self) -> Option<usize> {
        let c = self.n_embd;
        let cc = c.checked_mul(c)?;
        let block = cc.checked_mul(12)?.checked_add(c.checked_mul(13)?)?;
        self.vocab_size
            .checked_add(63)?
            .checked_mul(c)?
            .checked_add(self.block_size.checked_mul(c)?)?
            .checked_add(self.n_layer.checked_mul(block)?)?
            .checked_add(2 * c)
    }

    /// Parameters stored (padded embedding included).
    pub fn num_params(&self) -> usize {
        let c = self.n_embd;
        let blocks: usize = (0..self.n_layer)
            .map(|l| {
                let BlockDims { cl: a, fl: f, .. } = self.dims(l, 1);
                // ln1, qkv, attention projection, ln2, fc, fc projection
                2 * c + (c + 1) * 3 * a + a * c + c + 2 * c + (c + 1) * f + f * c + c
            })
            .sum();
        self.padded_vocab() * c + self.block_size * c + blocks + 2 * c
    }

    /// Training FLOPs per token: 6 per matmul weight (blocks and LM head;
    /// position embeddings excluded) plus attention's 6 * 2 * L * T * C
    /// (QK^T and AV, forward and backward, without causal savings), as in
    /// the PaLM appendix and nanoGPT's `estimate_mfu`.
    pub fn flops_per_token(&self, t: usize) -> f64 {
        let attention: usize = (0..self.n_layer).map(|l| self.dims(l, 1).cl).sum();
        6.0 * self.matmul_params() as f64 + 12.0 * (t * attention) as f64
    }

    /// The parameters a token meets in matmuls (and the few vectors beside
    /// them): every stored one but the position embeddings, the tied token
    /// embedding counted once as the LM head.
    pub fn matmul_params(&self) -> usize {
        self.num_params() - self.block_size * self.n_embd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_small_has_124m_parameters() {
        let c = GptConfig::preset("gpt2").unwrap();
        assert_eq!(c.vocab_size, GPT2_VOCAB);
        // 124,439,808 with the unpadded 50257 vocabulary; padding adds 47 rows.
        assert_eq!(c.num_params(), 124_439_808 + 47 * 768);
        assert_eq!(c.padded_vocab(), 50304);
    }

    #[test]
    fn bad_shapes_are_refused_with_the_numbers() {
        let mut c = GptConfig::preset("tiny").unwrap();
        c.n_head = 3;
        let msg = c.validate().unwrap_err().to_string();
        assert!(
            msg.contains("n_embd (32)") && msg.contains("n_head (3)"),
            "{msg}"
        );
        assert!(GptConfig::preset("gpt5")
            .unwrap_err()
            .to_string()
            .contains("gpt5"));
    }

    #[test]
    fn per_block_widths_are_bounded_and_counted() {
        let mut c = GptConfig::preset("tiny").unwrap();
        let dense = c.num_params();
        let w = |heads, hidden| BlockWidth { heads, hidden };
        c.blocks = vec![w(1, 64)];
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("widths for 1 blocks but has 2 layers"));
        c.blocks = vec![w(1, 64), w(3, 64)];
        let msg = c.validate().unwrap_err().to_string();
        assert!(
            msg.contains("block 1 has 3 heads") && msg.contains("1 to 2 heads"),
            "{msg}"
        );
        c.blocks = vec![w(1, 64), w(2, 0)];
        assert!(c.validate().unwrap_err().to_string().contains("block 1"));
        c.blocks = vec![w(1, 64), w(2, 128)];
        c.validate().unwrap();
        // block 0 lost one 16-wide head (q, k, v columns and biases, 16
        // projection rows) and 64 units (fc column and bias, projection row)
        assert_eq!(
            c.num_params(),
            dense - (3 * 16 * 33 + 16 * 32) - 64 * (33 + 32)
        );
        assert_eq!(
            c.widest(1),
            BlockDims {
                c: 32,
                cl: 32,
                nhl: 2,
                fl: 128
            }
        );
        assert_eq!(
            c.dims(0, 1),
            BlockDims {
                c: 32,
                cl: 16,
                nhl: 1,
                fl: 64
            }
        );
        assert!(c.check_tp(2).unwrap_err().to_string().contains("block 0"));
        assert_eq!(c.dense().num_params(), dense);
    }
}
