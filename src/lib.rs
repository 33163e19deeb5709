//! distgpt: GPT-2-family training on one device or many, llm.c style.

pub mod backend;
pub mod checkpoint;
pub mod comm;
pub mod compare;
pub mod data;
pub mod error;
pub mod figure;
pub mod metrics;
pub mod model;
pub mod parallel;
pub mod plan;
pub mod plot;
pub mod prune;
pub mod rng;
pub mod sample;
pub mod store;
#[cfg(test)]
mod testdir;
pub mod train;
