//! rltune's integration tests: one binary, one module per area.

mod admissible_ppo;
mod chat_templates;
mod common;
mod critic;
mod datasets_parity;
mod dpo_parity;
mod dpo_resume;
mod errors;
mod eval_streams;
mod faults;
mod generation;
mod gguf;
mod gguf_export;
mod gpt2;
mod group_loop;
mod grpo_parity;
mod layout;
mod lora;
mod multiturn;
mod neo;
mod partial_freezing;
mod ppo_behaviour;
mod ppo_parity;
mod train;
mod trajectory_groups;
mod transcript;
