//! rltune's integration tests: one binary, one module per area.

mod common;
mod generation;
mod gpt2;
mod ppo_parity;
