//! The application side of the `rltune` command: its end-to-end pipelines, built on the
//! `rltune` library's public API only.
//!
//! - [`tasks`]: the offline quickstarts (`rltune quickstart --task …`): a synthetic corpus, a
//!   BPE tokenizer, SFT, a reward model and PPO; LM agents for text games; arithmetic with GRPO
//!   or RLOO; RL on a task's own metric (essays, WNUT-2016 NER).
//!
//! ```no_run
//! use std::sync::atomic::AtomicBool;
//!
//! use rltune::runtime::Runtime;
//! use rltune_cli::tasks::{run_quickstart, QuickstartConfig};
//!
//! # fn main() -> rltune::Result<()> {
//! // The sentiment quickstart's tiny preset on the CPU, written into ./qs-out.
//! let stop = AtomicBool::new(false); // a Ctrl-C handler may set it
//! let cfg = QuickstartConfig::tiny();
//! let summary = run_quickstart("qs-out".as_ref(), &cfg, &Runtime::cpu(), &stop, &mut |_event| {})?;
//! for check in summary.checks() {
//!     println!("{check:?}");
//! }
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

pub mod tasks;
