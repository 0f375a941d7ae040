//! Supervised trainers: SFT of a causal LM and reward-model training.
//!
//! - [`sft`]: behavioural cloning on plain text or prompt/completion pairs (TRL's `SFTTrainer`).
//! - [`reward_model`]: a BERT/DistilBERT sequence classifier trained with cross-entropy on
//!   labelled texts, or with the Bradley–Terry loss on preference pairs (TRL's `RewardTrainer`).
//! - [`runner`]: what they share, as an algorithm of the run loop
//!   ([`crate::engine::run_loop`]): seeded eval split and shuffles, gradient accumulation with
//!   token-weighted losses, clipping, Adam, warm-up and decay ([`crate::engine::schedule`]),
//!   periodic eval and a progress callback.
//! - [`checkpoint`]: the `step-N/` checkpoints of these runs and of DPO's, and `--resume`.
//! - [`data`]: reading the example files.
//!
//! Configuration mirrors a TOML file with a `[training]` table ([`TrainingArgs`]) beside `[sft]`
//! ([`sft::SftConfig`]) or `[reward]` ([`reward_model::RewardConfig`]); every struct rejects
//! unknown keys, and its `validate()` names the field at fault.

pub mod checkpoint;
pub mod data;
pub mod reward_model;
pub mod runner;
pub mod sft;

pub use crate::engine::schedule::{LrSchedule, ScheduleKind};
pub use checkpoint::Checkpointing;
pub use runner::{EvalResult, TrainProgress, TrainSummary, TrainingArgs};
