//! The classic PPO loop for a language model, written out top to bottom on rltune's public
//! pieces, as cleanrl's `ppo.py` writes out PPO for Gym. It is TRL 0.11's `PPOTrainer.step`
//! (the algorithm of "Fine-Tuning Language Models from Human Preferences") without its options:
//!
//! 1. **rollout**: sample a response to each prompt from the policy;
//! 2. **score**: one scalar reward per response;
//! 3. **old logprobs and values**: one forward pass of the policy (with its value head) and of
//!    the frozen reference, no gradient;
//! 4. **rewards per token**: a KL penalty `−β·(log π − log π_ref)` on every token, the score added
//!    on the last one;
//! 5. **advantages**: GAE over the response, then whitened;
//! 6. **update**: epochs of shuffled minibatches, each the clipped policy loss plus the clipped
//!    value loss, backward, Adam.
//!
//! The task is a toy (`examples/toy`), so that it runs in seconds on a laptop with a model built
//! in-process: the reward is the share of response tokens equal to one token. The policy learns to say it, and
//! the KL penalty holds it near the reference.
//!
//! ```text
//! cargo run --release -p rltune --example ppo
//! ```
//!
//! `rltune::ppo::PpoTrainer` is this loop with every option TRL has (adaptive KL control, score
//! scaling and clipping, a separate critic, early stopping on the KL, left-padded batches of any
//! length, the fused CPU update) and its statistics under TRL's names; `rltune ppo` adds the rest
//! of a run (prompts, reward models, logging, checkpoints).

mod toy;

use candle_core::{DType, Device, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rltune::generation::{generate, GenerationConfig};
use rltune::models::layers::causal_bias;
use rltune::models::{CausalLm, CausalLmWithValueHead};
use rltune::ops;
use rltune::ppo::math::{compute_advantages, compute_rewards, kl_penalty, masked_mean, ppo_losses, scalar};
use rltune::ppo::KlPenalty;

/// The hyper-parameters, with TRL's PPOConfig names where it has them.
struct Args {
    seed: u64,
    iterations: usize,
    /// Prompts per iteration (`batch_size`).
    batch_size: usize,
    /// `mini_batch_size`
    mini_batch_size: usize,
    /// `ppo_epochs`
    ppo_epochs: usize,
    prompt_len: usize,
    response_len: usize,
    /// `learning_rate`
    learning_rate: f64,
    /// `init_kl_coef` (a fixed coefficient here: TRL's `adap_kl_ctrl = False`)
    kl_coef: f64,
    /// `gamma`, `lam`
    gamma: f64,
    lam: f64,
    /// `cliprange`, `cliprange_value`, `vf_coef`
    cliprange: f64,
    cliprange_value: f64,
    vf_coef: f64,
}

impl Default for Args {
    fn default() -> Self {
        Self {
            seed: 0,
            iterations: 30,
            batch_size: 32,
            mini_batch_size: 8,
            ppo_epochs: 4,
            prompt_len: 4,
            response_len: 8,
            learning_rate: 1e-3,
            kl_coef: 0.05,
            gamma: 1.0,
            lam: 0.95,
            cliprange: 0.2,
            cliprange_value: 0.2,
            vf_coef: 0.1,
        }
    }
}

/// Query and response concatenated, every row the same length (no padding in this toy), with
/// what a forward pass needs.
struct Batch {
    /// `(B, P + R)` token ids.
    ids: Tensor,
    /// `(B, P + R)` positions `0..P+R`.
    positions: Tensor,
    /// `(B, 1, P+R, P+R)` causal attention bias.
    bias: Tensor,
    /// `(B, R)` the response tokens, the targets of positions `P−1 .. P+R−2`.
    targets: Tensor,
    prompt_len: usize,
    response_len: usize,
}

impl Batch {
    fn new(rows: &[Vec<u32>], prompt_len: usize, device: &Device) -> rltune::Result<Self> {
        let (b, l) = (rows.len(), rows[0].len());
        let ids = Tensor::from_vec(rows.concat(), (b, l), device)?;
        let positions = Tensor::arange(0u32, l as u32, device)?.unsqueeze(0)?.repeat((b, 1))?;
        let bias = causal_bias(&vec![vec![1u8; l]; b], l, DType::F32, device)?;
        let targets = ids.narrow(1, prompt_len, l - prompt_len)?.contiguous()?;
        Ok(Self { ids, positions, bias, targets, prompt_len, response_len: l - prompt_len })
    }

    /// The rows `idx` (a minibatch).
    fn select(&self, idx: &Tensor) -> rltune::Result<Self> {
        Ok(Self {
            ids: self.ids.index_select(idx, 0)?,
            positions: self.positions.index_select(idx, 0)?,
            bias: self.bias.index_select(idx, 0)?,
            targets: self.targets.index_select(idx, 0)?,
            ..*self
        })
    }

    /// The logits `(B, P+R, V)` at the positions that predict the response: `(B, R, V)`.
    fn response_part(&self, per_position: &Tensor) -> rltune::Result<Tensor> {
        Ok(per_position.narrow(1, self.prompt_len - 1, self.response_len)?.contiguous()?)
    }
}

/// Log π(response token) `(B, R)` and the value of each state that produced one `(B, R)`.
fn policy_forward(policy: &CausalLmWithValueHead, batch: &Batch) -> rltune::Result<(Tensor, Tensor)> {
    let (logits, values) = policy.forward(&batch.ids, &batch.positions, &batch.bias)?;
    let logp = ops::logprobs_of(&batch.response_part(&logits)?, &batch.targets)?;
    Ok((logp, batch.response_part(&values)?))
}

/// Log π_ref(response token) `(B, R)`.
fn reference_forward(reference: &CausalLm, batch: &Batch) -> rltune::Result<Tensor> {
    let hidden = reference.forward(&batch.ids, &batch.positions, &batch.bias, None)?;
    let logits = reference.logits(&hidden)?;
    Ok(ops::logprobs_of(&batch.response_part(&logits)?, &batch.targets)?)
}

fn main() -> rltune::Result<()> {
    // The process-wide CPU settings (FTZ/DAZ, the thread pool): one explicit call, at the start.
    rltune::cpu::ProcessSettings::default().install()?;
    let a = Args::default();
    let device = Device::Cpu;
    let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);

    // The policy: the toy GPT-2 with a scalar value head, trainable. The reference: a frozen
    // copy of its initial weights (TRL's `create_reference_model`).
    let (store, lm) = toy::policy(a.seed, &device)?;
    let policy = CausalLmWithValueHead::load(&store.root(), lm)?;
    let (_reference_store, reference) = toy::reference(&store)?;

    // torch's Adam over every trainable variable, and the gradient buffers it reads: the
    // models built from `store` write their weights' gradients there (torch's `param.grad`).
    let (mut adam, mut grads) = toy::adam(&store, a.learning_rate)?;

    println!("iter  reward  kl/token  pg_loss  vf_loss  clipfrac");
    for iteration in 1..=a.iterations {
        // 1. Rollout: a response of `response_len` tokens to each random prompt.
        let prompts: Vec<Vec<u32>> = (0..a.batch_size).map(|_| toy::prompt(&mut rng, a.prompt_len)).collect();
        let generation = GenerationConfig {
            max_new_tokens: a.response_len,
            // EOS may be sampled (and generation goes on): the samples are exactly π's, so the
            // logprobs of the update are those of the sampler.
            min_new_tokens: 0,
            stop_at_eos: false,
            seed: a.seed ^ iteration as u64,
            ..GenerationConfig::default()
        };
        let samples = generate(&policy.lm, None, &prompts, &generation, &device)?;

        // 2. Score each response.
        let scores: Vec<f32> = samples.iter().map(|s| toy::reward(&s.response_ids) as f32).collect();

        // 3. Old logprobs and values, and the reference's logprobs: no gradient.
        let rows: Vec<Vec<u32>> =
            samples.iter().map(|s| [&s.query_ids[..], &s.response_ids[..]].concat()).collect();
        let batch = Batch::new(&rows, a.prompt_len, &device)?;
        let (old_logp, old_values) = policy_forward(&policy, &batch)?;
        let (old_logp, old_values) = (old_logp.detach(), old_values.detach());
        let ref_logp = reference_forward(&reference, &batch)?.detach();
        let mask = Tensor::ones((a.batch_size, a.response_len), DType::F32, &device)?;

        // 4. Rewards per token: −β·KL on every token, the score on the last one.
        let kl = kl_penalty(KlPenalty::Kl, &old_logp, &ref_logp)?;
        let (rewards, _non_score) = compute_rewards(&scores, &kl, &mask, a.kl_coef)?;

        // 5. GAE over the response, advantages whitened; returns = advantages + values.
        let (values, advantages, returns) = compute_advantages(&old_values, &rewards, &mask, a.gamma, a.lam)?;

        // 6. Epochs of shuffled minibatches: clipped policy and value losses, backward, Adam.
        let (mut pg, mut vf, mut clipfrac, mut n) = (0.0, 0.0, 0.0, 0.0);
        let mut order: Vec<u32> = (0..a.batch_size as u32).collect();
        for _epoch in 0..a.ppo_epochs {
            order.shuffle(&mut rng);
            for mb in order.chunks(a.mini_batch_size) {
                let idx = Tensor::new(mb, &device)?;
                let pick = |t: &Tensor| t.index_select(&idx, 0);
                grads.clear();
                let (logp, vpred) = policy_forward(&policy, &batch.select(&idx)?)?;
                let loss_parts = ppo_losses(
                    &pick(&old_logp)?,
                    &pick(&values)?,
                    &logp,
                    &vpred,
                    &pick(&mask)?,
                    &pick(&advantages)?,
                    &pick(&returns)?,
                    a.cliprange,
                    a.cliprange_value,
                )?;
                let loss = (&loss_parts.pg_loss + (&loss_parts.vf_loss * a.vf_coef)?)?;
                grads.backward(&loss)?;
                adam.step(&grads)?;
                pg += scalar(&loss_parts.pg_loss)?;
                vf += scalar(&loss_parts.vf_loss)?;
                clipfrac += scalar(&loss_parts.pg_clipfrac)?;
                n += 1.0;
            }
        }

        // 7. Log: the mean score, the KL to the reference per token, the losses.
        let mean_score = scores.iter().sum::<f32>() / scores.len() as f32;
        let kl_per_token = scalar(&masked_mean(&(&old_logp - &ref_logp)?, &mask)?)?;
        println!(
            "{iteration:>4}  {mean_score:>6.3}  {kl_per_token:>8.4}  {:>7.4}  {:>7.4}  {:>8.3}",
            pg / n,
            vf / n,
            clipfrac / n
        );
    }
    Ok(())
}
