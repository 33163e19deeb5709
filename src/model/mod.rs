//! Model families and what they share: the flat parameter layout a family
//! declares (`layout`), the unit-by-unit seam strategies drive (`unit`),
//! the AdamW state that mirrors the layout, and the families (`gpt2`, `bert`).

pub mod adamw;
pub mod alloc;
pub mod bert;
pub mod bf16;
pub mod family;
pub mod files;
pub mod gpt2;
pub mod layout;
pub mod ops;
pub mod parts;
pub mod tp;
pub mod unit;

pub use adamw::{AdamW, AdamWConfig, Segment, Updated};
pub use bf16::Precision;
pub use family::ModelConfig;
pub use gpt2::config::GptConfig;
pub use gpt2::{Engine, Gpt2};
pub use layout::ParamLayout;
pub use tp::{TpPlace, TpSplit};
pub use unit::{
    EngineCore, Span, SpanRun, StageModel, UnitGrads, UnitKind, UnitModel, UnitParams, Weights,
    Whole,
};
