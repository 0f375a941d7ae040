//! Reward sources. Placeholder.
