//! DPO for language models: TRL 1.16.0's `DPOTrainer`, one optimizer step over preference pairs
//! per call.
//!
//! - [`config`]: `DpoConfig`, TRL's names and defaults.
//! - [`data`]: reading `{"prompt", "chosen", "rejected"}` rows and tokenizing them as TRL does.
//! - [`loss`]: TRL's DPO losses (sigmoid, hinge, IPO, robust, …) and their gradients, as pure
//!   functions of each pair's summed logprobs.
//! - [`run`]: the epoch loop over a dataset (shuffle, micro-batches, gradient accumulation).
//! - [`trainer`]: the trainer and its `step`; the optimizer, clipping and schedule are GRPO's
//!   (`grpo::core`): transformers' AdamW with its weight-decay groups.
//!
//! See `docs/algorithms.md` for the formulas and metrics.
//!
//! ```no_run
//! # fn main() -> rltune::Result<()> {
//! use rltune::dpo::{data, DpoConfig, DpoTrainer};
//! use rltune::train::sft::SftModel;
//!
//! let rt = rltune::runtime::Runtime::cpu();
//! let model = SftModel::from_pretrained("gpt2", rt.dtype(), rt.device())?;
//! let path = std::path::Path::new("prefs.jsonl");
//! let records = data::read_preference_records(path)?;
//! let cfg = DpoConfig { learning_rate: 5e-7, ..Default::default() };
//! let prepared = data::prepare_pairs(&records, Some(&model.tokenizer), model.eos_id(), &cfg, path)?;
//! let pairs = prepared.pairs;
//! // No reference given: a frozen copy of the policy, as TRL.
//! let mut trainer = DpoTrainer::new(cfg, model.store.clone(), model.lm.clone(), None, pairs.len())?;
//! let batch: Vec<_> = pairs.iter().take(8).collect();
//! let stats = trainer.step(&[batch])?;
//! println!("{:?}", stats["rewards/margins"]);
//! # Ok(()) }
//! ```

pub mod config;
pub mod data;
pub mod loss;
pub mod run;
pub mod trainer;

pub use config::{DpoConfig, DpoLossType, FDivergence, TruncationMode};
pub use data::{PreferencePair, PreferenceRecord};
pub use trainer::DpoTrainer;
