//! Inference: sampling text from a model with a KV cache.

pub mod generate;
pub mod kv;
