//! The offline quickstart: a synthetic review corpus, a BPE tokenizer, SFT, a sentiment reward
//! model and PPO toward positive reviews, end to end on 2 CPU cores (see [`pipeline`]).

pub mod bpe;
pub mod corpus;
pub mod pipeline;

pub use pipeline::{run_quickstart, Check, CurvePoint, Event, PolicyEval, QuickstartConfig, Summary};
