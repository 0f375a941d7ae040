//! DPO for a language model, written out top to bottom on rltune's public pieces, as
//! `examples/ppo.rs` writes out PPO. It is TRL 1.16.0's `DPOTrainer` step (Rafailov et al.
//! 2023, "Direct Preference Optimization") without its options:
//!
//! 1. **data**: pairs of a prompt, a chosen and a rejected completion, fixed before training;
//! 2. **reference logprobs**: each completion's summed logprob under the frozen reference,
//!    once;
//! 3. **loss**: per pair, `−log σ(β·((c − c_ref) − (r − r_ref)))` with `c`, `r` the policy's
//!    summed logprobs of the chosen and the rejected completion; its exact derivatives in `c`
//!    and `r` come from `rltune::dpo::loss`, and the surrogate `Σ ∂L/∂c·c + ∂L/∂r·r` carries
//!    them into the weights;
//! 4. **update**: backward, Adam, over shuffled minibatches for a few epochs.
//!
//! The task is the examples' toy (`examples/toy`) turned into preferences: the chosen completion is half
//! [`TARGET`] tokens, the rejected one has none. After training the policy says [`TARGET`] far
//! more often when it samples, without ever seeing a reward.
//!
//! ```text
//! cargo run --release -p rltune --example dpo
//! ```
//!
//! `rltune::dpo::DpoTrainer` is this step with TRL's other losses (IPO, hinge, robust, f-DPO, …
//! and their weighted mixtures), padding, truncation, precomputed reference logprobs and
//! TRL's metrics; `rltune dpo` adds the rest of a run (datasets, chat templates, LoRA,
//! checkpoints).

mod toy;

use candle_core::{Device, Tensor};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rltune::dpo::loss::{batch_loss, LossParams, PairLogps};
use rltune::dpo::{DpoLossType, FDivergence};
use rltune::generation::{generate, GenerationConfig};
use rltune::models::CausalLm;
use toy::{TARGET, VOCAB};

/// The hyper-parameters, with TRL's DPOConfig names.
struct Args {
    seed: u64,
    /// Preference pairs.
    pairs: usize,
    /// `num_train_epochs`
    epochs: usize,
    /// `per_device_train_batch_size`
    batch_size: usize,
    prompt_len: usize,
    completion_len: usize,
    /// `learning_rate`
    learning_rate: f64,
    /// `beta`
    beta: f64,
}

impl Default for Args {
    fn default() -> Self {
        Self {
            seed: 0,
            pairs: 256,
            epochs: 4,
            batch_size: 16,
            prompt_len: 4,
            completion_len: 8,
            learning_rate: 1e-3,
            beta: 0.1,
        }
    }
}

/// Each row's summed logprob of its completion `(B,)`.
fn sequence_logprobs(
    lm: &CausalLm,
    rows: &[Vec<u32>],
    prompt_len: usize,
    device: &Device,
) -> rltune::Result<Tensor> {
    Ok(toy::completion_logprobs(lm, rows, prompt_len, device)?.sum(1)?)
}

/// The share of [`TARGET`] in completions the policy samples for `n` fresh prompts.
fn target_share(lm: &CausalLm, a: &Args, n: usize, seed: u64, device: &Device) -> rltune::Result<f64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let prompts: Vec<Vec<u32>> = (0..n).map(|_| toy::prompt(&mut rng, a.prompt_len)).collect();
    let generation = GenerationConfig {
        max_new_tokens: a.completion_len,
        min_new_tokens: 0, // EOS may be sampled: the samples are exactly π's
        stop_at_eos: false,
        seed,
        ..GenerationConfig::default()
    };
    let samples = generate(lm, None, &prompts, &generation, device)?;
    Ok(samples.iter().map(|s| toy::reward(&s.response_ids)).sum::<f64>() / n as f64)
}

fn main() -> rltune::Result<()> {
    // The process-wide CPU settings (FTZ/DAZ, the thread pool): one explicit call, at the start.
    rltune::cpu::ProcessSettings::default().install()?;
    let a = Args::default();
    let device = Device::Cpu;
    let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);

    // The policy: the toy GPT-2, trainable. The reference: a frozen copy of its initial weights.
    let (store, policy) = toy::policy(a.seed, &device)?;
    let (_reference_store, reference) = toy::reference(&store)?;

    // 1. The preference pairs: a random prompt; chosen = half TARGET, rejected = none.
    let other = |rng: &mut rand::rngs::StdRng| loop {
        let t = rng.gen_range(0..VOCAB as u32 - 1);
        if t != TARGET {
            break t;
        }
    };
    let mut chosen = Vec::new();
    let mut rejected = Vec::new();
    for _ in 0..a.pairs {
        let prompt = toy::prompt(&mut rng, a.prompt_len);
        let c: Vec<u32> =
            (0..a.completion_len).map(|i| if i % 2 == 0 { TARGET } else { other(&mut rng) }).collect();
        let r: Vec<u32> = (0..a.completion_len).map(|_| other(&mut rng)).collect();
        chosen.push([&prompt[..], &c[..]].concat());
        rejected.push([&prompt[..], &r[..]].concat());
    }

    // 2. The reference's logprobs, once (TRL's `precompute_ref_log_probs` computes the same).
    let ref_chosen: Vec<f32> = sequence_logprobs(&reference, &chosen, a.prompt_len, &device)?.to_vec1()?;
    let ref_rejected: Vec<f32> =
        sequence_logprobs(&reference, &rejected, a.prompt_len, &device)?.to_vec1()?;

    let (mut adam, mut grads) = toy::adam(&store, a.learning_rate)?;
    let params = LossParams {
        losses: vec![(DpoLossType::Sigmoid, 1.0)],
        beta: a.beta,
        label_smoothing: 0.0,
        f_divergence: FDivergence::ReverseKl,
        f_alpha: 1.0,
        discopop_tau: 0.05,
    };

    let share = target_share(&policy, &a, 64, 99, &device)?;
    println!("before training: {:.1}% of sampled tokens are the target", 100.0 * share);
    println!("epoch    loss  rewards/chosen  rewards/rejected  rewards/accuracies");
    let mut order: Vec<usize> = (0..a.pairs).collect();
    for epoch in 1..=a.epochs {
        order.shuffle(&mut rng);
        let (mut loss_sum, mut chosen_sum, mut rejected_sum, mut right, mut batches) = (0.0, 0.0, 0.0, 0, 0);
        for idx in order.chunks(a.batch_size) {
            let pick = |rows: &[Vec<u32>]| idx.iter().map(|&i| rows[i].clone()).collect::<Vec<_>>();
            grads.clear();
            // 3. The policy's summed logprobs, the loss and its derivatives in them.
            let seqs = |rows: &[Vec<u32>]| sequence_logprobs(&policy, &pick(rows), a.prompt_len, &device);
            let (c, r) = (seqs(&chosen)?, seqs(&rejected)?);
            let (cv, rv): (Vec<f32>, Vec<f32>) = (c.to_vec1()?, r.to_vec1()?);
            let pairs: Vec<PairLogps> = idx
                .iter()
                .enumerate()
                .map(|(k, &i)| PairLogps {
                    chosen: f64::from(cv[k]),
                    rejected: f64::from(rv[k]),
                    ref_chosen: f64::from(ref_chosen[i]),
                    ref_rejected: f64::from(ref_rejected[i]),
                    chosen_len: a.completion_len as f64,
                    rejected_len: a.completion_len as f64,
                    chosen_scored: a.completion_len as f64,
                })
                .collect();
            let g = batch_loss(&pairs, &params);
            for p in &pairs {
                let (dc, dr) = (a.beta * (p.chosen - p.ref_chosen), a.beta * (p.rejected - p.ref_rejected));
                chosen_sum += dc;
                rejected_sum += dr;
                right += usize::from(dc > dr);
            }
            let weight =
                |d: &[f64]| Tensor::from_vec(d.iter().map(|&x| x as f32).collect(), d.len(), &device);
            let surrogate =
                ((&c * weight(&g.d_chosen)?)?.sum_all()? + (&r * weight(&g.d_rejected)?)?.sum_all()?)?;
            let loss = g.loss;
            // 4. Backward through the surrogate (its gradient is the loss's), Adam.
            grads.backward(&surrogate)?;
            adam.step(&grads)?;
            loss_sum += loss;
            batches += 1;
        }
        let n = a.pairs as f64;
        println!(
            "{epoch:>5}  {:>6.4}  {:>14.3}  {:>16.3}  {:>18.3}",
            loss_sum / batches as f64,
            chosen_sum / n,
            rejected_sum / n,
            right as f64 / n
        );
    }
    let share = target_share(&policy, &a, 64, 99, &device)?;
    println!("after training: {:.1}% of sampled tokens are the target", 100.0 * share);
    Ok(())
}
