//! GPT-2 configurations as plain data: the named presets and their checks.

use crate::error::Error;
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
}

impl std::fmt::Display for GptConfig {
    /// "6 layers x 6 heads x 384 wide, block 256, vocabulary 65".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} layers x {} heads x {} wide, block {}, vocabulary {}",
            self.n_layer, self.n_head, self.n_embd, self.block_size, self.vocab_size
        )
    }
}

/// The largest model accepted (2^36 parameters, far past GPT-2 XL's 1.6B):
/// a bound on what a crafted `model.json` or checkpoint index can ask to allocate.
pub const MAX_PARAMS: usize = 1 << 36;

/// The GPT-2 BPE vocabulary (`r50k_base`).
pub const GPT2_VOCAB: usize = 50257;

/// Vocabulary of nanoGPT's character-level Tiny Shakespeare (bench default).
pub const CHAR_VOCAB: usize = 65;

/// A named model shape.
pub struct Preset {
    pub name: &'static str,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub block_size: usize,
    pub vocab_size: usize,
    pub about: &'static str,
}

const fn preset(
    name: &'static str,
    n_layer: usize,
    n_head: usize,
    n_embd: usize,
    block_size: usize,
    vocab_size: usize,
    about: &'static str,
) -> Preset {
    Preset {
        name,
        n_layer,
        n_head,
        n_embd,
        block_size,
        vocab_size,
        about,
    }
}

pub const PRESETS: [Preset; 7] = [
    preset(
        "gpt2",
        12,
        12,
        768,
        1024,
        GPT2_VOCAB,
        "GPT-2 small, 124M parameters",
    ),
    preset(
        "gpt2-medium",
        24,
        16,
        1024,
        1024,
        GPT2_VOCAB,
        "GPT-2 medium, 350M",
    ),
    preset(
        "gpt2-large",
        36,
        20,
        1280,
        1024,
        GPT2_VOCAB,
        "GPT-2 large, 774M",
    ),
    preset("gpt2-xl", 48, 25, 1600, 1024, GPT2_VOCAB, "GPT-2 XL, 1.5B"),
    preset(
        "shakespeare-char",
        6,
        6,
        384,
        256,
        CHAR_VOCAB,
        "nanoGPT's shakespeare_char, 10.7M",
    ),
    preset(
        "shakespeare-char-small",
        4,
        4,
        128,
        128,
        CHAR_VOCAB,
        "learns Shakespeare in minutes on 2 cores",
    ),
    preset("tiny", 2, 2, 32, 64, CHAR_VOCAB, "for tests"),
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
        let Some(p) = PRESETS.iter().find(|p| p.name == name) else {
            let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
            return Err(Error::Config(format!(
                "unknown model preset '{name}' (known: {})",
                names.join(", ")
            )));
        };
        Ok(GptConfig {
            n_layer: p.n_layer,
            n_head: p.n_head,
            n_embd: p.n_embd,
            block_size: p.block_size,
            vocab_size: p.vocab_size,
        })
    }

    /// Vocabulary rounded up to a multiple of 64 (the embedding's row count).
    pub fn padded_vocab(&self) -> usize {
        self.vocab_size.div_ceil(64) * 64
    }

    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Refuses shapes the kernels cannot run.
    pub fn validate(&self) -> Result<(), Error> {
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
        if c.vocab_size > u32::MAX as usize {
            return Err(Error::Config(format!(
                "vocab_size {} is too large",
                c.vocab_size
            )));
        }
        match c.checked_num_params() {
            Some(n) if n <= MAX_PARAMS => Ok(()),
            _ => Err(Error::Config(format!(
                "{} layers x {} wide with a vocabulary of {} and {} positions is more than {MAX_PARAMS} parameters",
                c.n_layer, c.n_embd, c.vocab_size, c.block_size
            ))),
        }
    }

    /// [`GptConfig::num_params`] without overflow: `None` past `usize`.
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
        let block =
            2 * c + 3 * c * c + 3 * c + c * c + c + 2 * c + 4 * c * c + 4 * c + 4 * c * c + c;
        self.padded_vocab() * c + self.block_size * c + self.n_layer * block + 2 * c
    }

    /// Training FLOPs per token: 6 per matmul weight (blocks and LM head;
    /// position embeddings excluded) plus attention's 6 * 2 * L * T * C
    /// (QK^T and AV, forward and backward, without causal savings), as in
    /// the PaLM appendix and nanoGPT's `estimate_mfu`.
    pub fn flops_per_token(&self, t: usize) -> f64 {
        let matmul_params = self.num_params() - self.block_size * self.n_embd;
        6.0 * matmul_params as f64 + 12.0 * (self.n_layer * t * self.n_embd) as f64
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
}
