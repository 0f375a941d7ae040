//! What every trainer shares, below the algorithms: the one outer loop every trainer runs in
//! ([`run_loop`]: data order, steps, checkpoints, `--resume`, Ctrl-C, the report), the optimizer
//! step ([`optimizer`]: transformers' `Trainer` step with torch's AdamW, its decay groups,
//! clipping and schedule), the learning-rate schedules ([`schedule`], transformers'
//! `get_scheduler`) and the statistics map every step returns ([`stats`], under TRL's key names).
//! Adam itself and the gradient buffers are [`crate::optim`].

pub(crate) mod constraint;
pub mod optimizer;
pub mod run_loop;
pub mod schedule;
pub mod stats;
pub(crate) mod training_arguments;

pub use optimizer::{decays, OptimArgs, Optimizer};
pub use schedule::{LrSchedule, ScheduleKind};
pub use stats::{Stat, Stats};
