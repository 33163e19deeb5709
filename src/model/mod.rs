//! GPT-2 family models: configuration presets, the flat parameter layout,
//! the forward/backward driver and the AdamW state that mirrors the layout.

pub mod adamw;
pub mod config;
pub mod gpt2;
pub mod layout;

pub use adamw::{AdamW, AdamWConfig, Segment};
pub use config::GptConfig;
pub use gpt2::{Engine, Gpt2, Precision, TpPlace};
pub use layout::ParamLayout;
