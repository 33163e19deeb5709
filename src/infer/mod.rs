//! Inference: sampling text from a model.

pub mod generate;
