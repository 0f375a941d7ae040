//! The application side of the `rltune` command: its end-to-end pipelines, built on the
//! `rltune` library's public API only.
//!
//! - [`tasks`]: the offline quickstarts (`rltune quickstart --task …`): a synthetic corpus, a
//!   BPE tokenizer, SFT, a reward model and PPO; LM agents for text games; arithmetic with GRPO
//!   or RLOO; RL on a task's own metric (essays, WNUT-2016 NER).
//!
//! ```no_run
//! use rltune_cli::tasks::{run_quickstart, QuickstartConfig};
//!
//! # fn main() -> rltune::Result<()> {
//! // The sentiment quickstart's tiny preset, written into ./qs-out.
//! let cfg = QuickstartConfig::tiny();
//! let summary = run_quickstart(&cfg, std::path::Path::new("qs-out"), &mut |_event| {})?;
//! println!("{} checks", summary.checks.len());
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

pub mod tasks;
