//! What every trainer shares, below the algorithms: the statistics map every step returns
//! ([`stats`], under TRL's key names) and the learning-rate schedules ([`schedule`],
//! transformers' `get_scheduler`). The optimizer itself is [`crate::optim`].

pub mod schedule;
pub mod stats;

pub use schedule::{LrSchedule, ScheduleKind};
pub use stats::{Stat, Stats};
