//! The toy every example trains on, so that each runs in seconds with nothing to download: a
//! tiny GPT-2 built in-process, random prompts, and a reward that is the share of completion
//! tokens equal to [`TARGET`]. Each example writes its algorithm out on top of this.

#![allow(dead_code)] // each example uses its own share of the toy

use candle_core::{DType, Device, Tensor, Var};
use rand::Rng;
use rltune::models::gpt2::Gpt2Config;
use rltune::models::layers::causal_bias;
use rltune::models::{CausalLm, CausalLmConfig};
use rltune::ops;
use rltune::optim::{Adam, AdamConfig, Grads};
use rltune::params::ParamStore;

/// The token the reward asks for.
pub const TARGET: u32 = 7;
/// Vocabulary of the toy model (the last id is its end-of-sequence token).
pub const VOCAB: usize = 32;

/// The toy model: a GPT-2 of 2 layers, width 64.
pub fn model_config() -> CausalLmConfig {
    CausalLmConfig::Gpt2(Gpt2Config::tiny(VOCAB, 64, 2, 4, 64))
}

/// A random trainable toy policy: its weights (created as the model loads them) and the model.
pub fn policy(seed: u64, device: &Device) -> rltune::Result<(ParamStore, CausalLm)> {
    let store = ParamStore::random(seed, true, DType::F32, device)?;
    let lm = CausalLm::load(&store.root(), &model_config())?;
    Ok((store, lm))
}

/// The reference: a frozen copy of `store`'s weights as they are now (TRL's
/// `create_reference_model`), and the model over them.
pub fn reference(store: &ParamStore) -> rltune::Result<(ParamStore, CausalLm)> {
    let frozen = store.frozen_copy()?;
    let lm = CausalLm::load(&frozen.root(), &model_config())?;
    Ok((frozen, lm))
}

/// torch's Adam over every trainable variable of `store`, and the gradient buffers it reads,
/// which the models built from `store` write into (torch's `param.grad`).
pub fn adam(store: &ParamStore, lr: f64) -> rltune::Result<(Adam, Grads)> {
    let vars: Vec<Var> = store.vars().into_iter().map(|(_, v)| v).collect();
    let adam = Adam::new(vars.clone(), AdamConfig { lr, ..AdamConfig::default() })?;
    let grads = Grads::new(&vars);
    grads.bind(store.grad_slot());
    Ok((adam, grads))
}

/// A random prompt of `len` tokens (never the end-of-sequence token).
pub fn prompt(rng: &mut impl Rng, len: usize) -> Vec<u32> {
    (0..len).map(|_| rng.gen_range(0..VOCAB as u32 - 1)).collect()
}

/// The reward: the share of `completion`'s tokens that are [`TARGET`].
pub fn reward(completion: &[u32]) -> f64 {
    completion.iter().filter(|&&t| t == TARGET).count() as f64 / completion.len().max(1) as f64
}

/// Log π(completion token) `(B, C)` of prompt + completion rows of one length (no padding).
pub fn completion_logprobs(
    lm: &CausalLm,
    rows: &[Vec<u32>],
    prompt_len: usize,
    device: &Device,
) -> rltune::Result<Tensor> {
    let (b, l) = (rows.len(), rows[0].len());
    let ids = Tensor::from_vec(rows.concat(), (b, l), device)?;
    let positions = Tensor::arange(0u32, l as u32, device)?.unsqueeze(0)?.repeat((b, 1))?;
    let bias = causal_bias(&vec![vec![1u8; l]; b], l, DType::F32, device)?;
    let logits = lm.logits(&lm.forward(&ids, &positions, &bias, None)?)?;
    // Position t predicts token t + 1: positions P−1 .. L−2 predict the completion.
    let predicting = logits.narrow(1, prompt_len - 1, l - prompt_len)?.contiguous()?;
    let targets = ids.narrow(1, prompt_len, l - prompt_len)?.contiguous()?;
    Ok(ops::logprobs_of(&predicting, &targets)?)
}
