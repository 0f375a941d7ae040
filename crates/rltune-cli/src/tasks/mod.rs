//! The offline quickstart: a synthetic review corpus, a BPE tokenizer, SFT, a sentiment reward
//! model and PPO toward positive reviews, end to end on 2 CPU cores (see [`pipeline`]); and
//! an LM agent for text games: walkthrough demonstrations, behavioural cloning, then PPO on the
//! games (see [`agent`]), on the Rust-native adventures ([`adventure`]) or on TextWorld games
//! ([`textworld`]); and a verifiable-reward task, two-digit arithmetic: SFT of a tiny GPT-2, then
//! GRPO or RLOO with an exact-match reward (see [`arithmetic`]); and RL on a task's own metric,
//! essay discourse labelling scored by the Feedback Prize F-score (see [`essays`]), and WNUT-2016
//! Twitter NER scored by entity-level F1 (see [`wnut`]).

pub mod adventure;
pub mod agent;
pub mod arithmetic;
pub mod bpe;
pub mod corpus;
pub mod essays;
pub mod pipeline;
pub mod rlhf;
pub mod textworld;
pub mod wnut;

pub use adventure::{run_adventure_quickstart, AdventureQuickstartConfig, AdventureSummary};
pub use agent::{run_agent_quickstart, summary_file, AgentGames, AgentQuickstartConfig, AgentSummary};
pub use arithmetic::{run_arithmetic_quickstart, ArithmeticQuickstartConfig, ArithmeticSummary};
pub use essays::{run_essays_quickstart, EssaysQuickstartConfig, EssaysSummary};
pub use pipeline::{run_quickstart, Check, CurvePoint, Event, PolicyEval, QuickstartConfig, Summary};
pub use rlhf::{run_rlhf_quickstart, EvalSplit, RlhfQuickstartConfig, RlhfSummary};
pub use textworld::{run_textworld_quickstart, TextworldGames, TextworldQuickstartConfig, TextworldSummary};
pub use wnut::{run_wnut_quickstart, WnutQuickstartConfig, WnutSummary};
