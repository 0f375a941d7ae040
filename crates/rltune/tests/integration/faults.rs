//! Faults and bad inputs (issue #28): every case ends in a clear error that names the file,
//! field, tensor, line or sample at fault and says how to fix it; never a panic, a hang or silent
//! garbage. Each case is bounded in time (reward programs by their timeout, the rest by their
//! size). The binary's side is in `rltune-cli/tests/faults.rs`.
//!
//! Cases, by area (the row names of the table-driven tests):
//!
//! - **models** (`faults/models.rs`): `model.safetensors` truncated to half, truncated inside
//!   the header, random bytes, empty; a header length of 2^60 and of 100 MB; a header claiming
//!   a tensor whose byte size overflows, and one reaching past the end of the file; an i64, a u8
//!   and a u32 tensor where a float weight belongs; a NaN, an inf and a -inf weight (refused at
//!   load, naming the tensor and element; large finite f16 weights still load); config.json
//!   with `n_layer` a string, `n_layer` 0, `n_head` not dividing `n_embd`, a negative
//!   `vocab_size`, a float `n_embd`. (A tokenizer.json larger than the model's vocabulary is in
//!   `errors.rs`, and end to end in the CLI's faults.)
//! - **data** (`faults/data.rs`): prompt datasets (`load_prompts`) with invalid UTF-8 in JSON
//!   lines, a JSON array and CSV; only empty lines; an empty CSV text; a missing column in each
//!   format; a number where the text belongs; a row that is not an object, also 10 MB long; a
//!   10 MB line of broken JSON; and a valid 10 MB prompt, which loads. SFT and reward-model
//!   datasets (`read_sft_records`, `read_reward_records`) with invalid UTF-8 (.txt, .jsonl);
//!   only empty lines; missing `text`, `completion`, `rejected`; a number where `text`,
//!   `completion` or `chosen` belongs; a list as label; a 10 MB line of broken JSON; and a
//!   valid 10 MB line, which loads.
//! - **rollouts** (`faults/rollouts.rs`): `read_rollouts` with an empty query, an empty
//!   response, an id outside the vocabulary, a negative id, NaN and -Infinity scores, scores
//!   beyond f32 and f64, a string score, no score, invalid UTF-8; a query text that merely
//!   contains "NaN" (must load). `PpoTrainer::step` with one sample for a batch of two, too few
//!   scores, an empty query, an empty response, an id outside the vocabulary, NaN and -inf
//!   scores (weights unchanged after all of them), and a sample longer than the context.
//! - **reward commands** (`faults/rewards.rs`, beyond the unit tests in `rewards/command.rs`
//!   and the CLI's `command_reward_faults_are_reported_and_nan_batches_skipped`): a program that
//!   crashes at start, never reads nor answers, answers invalid UTF-8, answers a JSON array,
//!   answers half a line then exits, answers a 100 MB line, answers an endless line, answers on
//!   stderr; one that exits after answering some batches; one that never reads a batch large
//!   enough to fill the pipe.
//! - **checkpoints** (in `rltune-cli/tests/pipeline.rs`, they need the binary):
//!   `sigkill_at_random_moments_leaves_every_checkpoint_readable` (50 kills, every other one
//!   inside a checkpoint write), `a_checkpoint_that_cannot_be_written_stops_the_run_and_loses_no_finished_step`
//!   (a full disk, as a file-size limit), `ppo_resume_after_sigkill_is_bitwise_identical_to_a_straight_run`.
//! - **training**: `ppo_behaviour::a_non_finite_loss_skips_the_update_and_is_counted` (fused and
//!   clipped update paths) and the unit test `optim::tests::a_non_finite_gradient_is_not_applied`.
//! - **environments**: the unit tests of `envs::command` (a program that dies, hangs, babbles or
//!   answers errors) and `envs::play` (a prompt longer than the context).

mod data;
mod models;
mod rewards;
mod rollouts;

/// Prints `msg` and fails unless it contains every one of `parts`.
pub fn assert_contains_all(msg: &str, parts: &[&str]) {
    println!("{msg}");
    for p in parts {
        assert!(msg.contains(p), "expected {p:?} in the error message:\n{msg}");
    }
}

/// The error message of `res`, failing when it is not an error.
pub fn err_msg<T, E: std::fmt::Display>(res: Result<T, E>, what: &str) -> String {
    match res {
        Ok(_) => panic!("{what} should fail"),
        Err(e) => e.to_string(),
    }
}
