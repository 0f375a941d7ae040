//! GRPO for a language model, written out top to bottom on rltune's public pieces, as
//! `examples/ppo.rs` writes out PPO. It is TRL 1.16.0's `GRPOTrainer` step (DeepSeekMath's Group
//! Relative Policy Optimization) without its options:
//!
//! 1. **rollout**: sample a *group* of `num_generations` completions for each prompt;
//! 2. **score**: one scalar reward per completion;
//! 3. **advantages**: each reward against its group, `(r − mean)/(std + 1e-4)`: no value model;
//! 4. **old and reference logprobs**: one forward of the policy and of the frozen reference, no
//!    gradient;
//! 5. **update**: `num_iterations` passes over the batch, each the clipped objective
//!    `−min(ρ·A, clip(ρ)·A)` plus `β·KL` (k3) per token, averaged over the batch's tokens
//!    (`loss_type = "dapo"`), backward, Adam.
//!
//! The task is the examples' toy (`examples/toy`): the reward is the share of completion tokens
//! equal to one token, on a tiny GPT-2 built in-process.
//!
//! ```text
//! cargo run --release -p rltune --example grpo
//! ```
//!
//! `rltune::grpo::GrpoTrainer` is this step with every TRL option (the other `loss_type`s,
//! `scale_rewards`, GSPO's sequence ratios, several reward functions, masks for truncated
//! completions) and TRL's metrics; `rltune ppo` with `[algorithm] kind = "grpo"` adds the rest
//! of a run.

mod toy;

use candle_core::{DType, Device, Tensor};
use rand::SeedableRng;
use rltune::generation::{generate, GenerationConfig};
use rltune::grpo::config::{Aggregation, ImportanceSamplingLevel};
use rltune::grpo::math::{aggregate_loss, grpo_advantages, grpo_objective, ObjectiveParams};
use rltune::grpo::{LossType, ScaleRewards};
use rltune::ppo::math::scalar;
use toy::{completion_logprobs, reward};

/// The hyper-parameters, with TRL's GRPOConfig names.
struct Args {
    seed: u64,
    steps: usize,
    /// Prompts per step (`per_device_train_batch_size / num_generations`).
    prompts: usize,
    /// `num_generations`: completions per prompt, the group.
    num_generations: usize,
    prompt_len: usize,
    /// `max_completion_length` (every completion has this length in the toy).
    completion_len: usize,
    /// `learning_rate`
    learning_rate: f64,
    /// `beta` (KL coefficient; TRL's default is 0)
    beta: f64,
    /// `epsilon` (the clip range)
    epsilon: f64,
    /// `num_iterations` (passes over each batch)
    num_iterations: usize,
}

impl Default for Args {
    fn default() -> Self {
        Self {
            seed: 0,
            steps: 30,
            prompts: 8,
            num_generations: 8,
            prompt_len: 4,
            completion_len: 8,
            learning_rate: 1e-3,
            beta: 0.04,
            epsilon: 0.2,
            num_iterations: 2,
        }
    }
}

fn main() -> rltune::Result<()> {
    // The process-wide CPU settings (FTZ/DAZ, the thread pool): one explicit call, at the start.
    rltune::cpu::ProcessSettings::default().install()?;
    let a = Args::default();
    let device = Device::Cpu;
    let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);

    // The policy: the toy GPT-2, trainable (no value head: GRPO has no critic). The reference: a
    // frozen copy of its initial weights.
    let (store, policy) = toy::policy(a.seed, &device)?;
    let (_reference_store, reference) = toy::reference(&store)?;
    let (mut adam, mut grads) = toy::adam(&store, a.learning_rate)?;
    let objective = ObjectiveParams {
        epsilon_low: a.epsilon,
        epsilon_high: a.epsilon,
        delta: None,
        level: ImportanceSamplingLevel::Token,
        beta: a.beta,
        bias_correction_kl: false,
    };

    println!("step  reward  reward_std  kl/token    loss");
    for step in 1..=a.steps {
        // 1. Rollout: each prompt repeated `num_generations` times in a row, one sample each.
        let mut prompts = Vec::new();
        for _ in 0..a.prompts {
            prompts.extend(std::iter::repeat_n(toy::prompt(&mut rng, a.prompt_len), a.num_generations));
        }
        let generation = GenerationConfig {
            max_new_tokens: a.completion_len,
            min_new_tokens: 0, // EOS may be sampled: the samples are exactly π's
            stop_at_eos: false,
            seed: a.seed ^ step as u64,
            ..GenerationConfig::default()
        };
        let samples = generate(&policy, None, &prompts, &generation, &device)?;

        // 2. Score each completion (one reward function, weight 1).
        let rewards: Vec<Vec<f64>> = samples.iter().map(|s| vec![reward(&s.response_ids)]).collect();

        // 3. Group-relative advantages, one per completion, as a (B, 1) column.
        let adv = grpo_advantages(
            &rewards,
            &[1.0],
            a.num_generations,
            ScaleRewards::Group,
            Aggregation::SumThenNormalize,
        );
        let b = samples.len();
        let advantages =
            Tensor::from_vec(adv.advantages.iter().map(|&x| x as f32).collect(), (b, 1), &device)?;

        // 4. Old and reference logprobs, no gradient.
        let rows: Vec<Vec<u32>> =
            samples.iter().map(|s| [&s.query_ids[..], &s.response_ids[..]].concat()).collect();
        let old_logp = completion_logprobs(&policy, &rows, a.prompt_len, &device)?.detach();
        let ref_logp = completion_logprobs(&reference, &rows, a.prompt_len, &device)?.detach();
        let mask = Tensor::ones((b, a.completion_len), DType::F32, &device)?;
        let tokens = (b * a.completion_len) as f64;

        // 5. `num_iterations` updates on the batch: the clipped objective plus β·KL per token.
        let mut loss_sum = 0.0;
        for _ in 0..a.num_iterations {
            grads.clear();
            let logp = completion_logprobs(&policy, &rows, a.prompt_len, &device)?;
            let o = grpo_objective(&logp, &old_logp, Some(&ref_logp), &advantages, &mask, &objective)?;
            let loss = aggregate_loss(&o.per_token_loss, &mask, LossType::Dapo, a.completion_len, tokens)?;
            grads.backward(&loss)?;
            adam.step(&grads)?;
            loss_sum += scalar(&loss)?;
        }

        // 6. Log: the mean reward and its spread, the KL to the reference per token, the loss.
        let r: Vec<f64> = rewards.iter().map(|r| r[0]).collect();
        let mean = r.iter().sum::<f64>() / b as f64;
        let std = (r.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / b as f64).sqrt();
        let kl = scalar(&(&old_logp - &ref_logp)?.mean_all()?)?;
        println!(
            "{step:>4}  {mean:>6.3}  {std:>10.3}  {kl:>8.4}  {:>6.4}",
            loss_sum / a.num_iterations as f64
        );
    }
    Ok(())
}
