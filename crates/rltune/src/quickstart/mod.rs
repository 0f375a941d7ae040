//! The offline quickstart: a synthetic review corpus, a BPE tokenizer, SFT, a sentiment reward
//! model and PPO toward positive reviews, end to end on 2 CPU cores (see [`pipeline`]); and
//! an LM agent for text adventures: walkthrough demonstrations, behavioural cloning, then PPO
//! on the games (see [`adventure`]); and a verifiable-reward task, two-digit arithmetic: SFT
//! of a tiny GPT-2, then GRPO or RLOO with an exact-match reward (see [`arithmetic`]).

pub mod adventure;
pub mod arithmetic;
pub mod bpe;
pub mod corpus;
pub mod pipeline;

pub use adventure::{run_adventure_quickstart, AdventureQuickstartConfig, AdventureSummary};
pub use arithmetic::{run_arithmetic_quickstart, ArithmeticQuickstartConfig, ArithmeticSummary};
pub use pipeline::{run_quickstart, Check, CurvePoint, Event, PolicyEval, QuickstartConfig, Summary};
