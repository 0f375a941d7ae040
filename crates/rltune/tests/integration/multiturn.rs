//! Multi-turn PPO (issue #29): episodes of the letter toy collected with `agent::rollout`, each
//! turn a transition for `PpoTrainer::step_with`, bootstrapped from the next turn's value.

use candle_core::{DType, Device};
use rltune::agent::rollout::{
    action_cut, collect_episodes, rebootstrap, Collected, RolloutConfig, Shaping, Transition,
};
use rltune::envs::letters::Letters;
use rltune::envs::play::PromptTemplate;
use rltune::envs::{EnvStep, Reset, TextEnv};
use rltune::generation::{generate, GenerationConfig};
use rltune::models::gpt2::Gpt2Config;
use rltune::models::{CausalLm, CausalLmConfig, CausalLmWithValueHead};
use rltune::params::ParamStore;
use rltune::ppo::{Critic, PpoConfig, PpoTrainer, RolloutCache, Stat, Stats, StepInput};
use rltune::tokenizer::Tokenizer;

use crate::common::{self, word_tokenizer};

const WORDS: [&str; 12] = ["e", "ee", "a", "b", "c", "d", ".", "Turn", "of", "Say", "something", ">"];

fn tokenizer() -> Tokenizer {
    word_tokenizer(&WORDS, false)
}

/// A random tiny GPT-2 with a value head over [`WORDS`] (+ `<unk>`, `<eos>`), 64 positions.
fn policy(seed: u64) -> (ParamStore, CausalLmWithValueHead, CausalLm) {
    let cfg = CausalLmConfig::Gpt2(Gpt2Config::tiny(WORDS.len() + 2, 16, 1, 2, 64));
    let store = ParamStore::random(seed, true, DType::F32, &Device::Cpu).unwrap();
    let lm = CausalLm::load(&store.root(), &cfg).unwrap();
    let model = CausalLmWithValueHead::load(&store.root(), lm).unwrap();
    let reference = CausalLm::load(&store.frozen_copy().unwrap().root(), &cfg).unwrap();
    (store, model, reference)
}

fn rollout_config() -> RolloutConfig {
    RolloutConfig {
        template: PromptTemplate { memory_turns: 1, instruction: ">".into(), ..PromptTemplate::default() },
        generation: GenerationConfig { max_new_tokens: 4, ..GenerationConfig::default() },
        game_gamma: 0.6,
        example_turn_prob: 0.0,
        shaping: Shaping::default(),
    }
}

fn collect(model: &CausalLmWithValueHead, envs: usize, turns: usize, seed: u64) -> Vec<Transition> {
    let mut env = Letters::new(envs, turns);
    let resets = vec![Reset::default(); envs];
    collect_episodes(&mut env, model, &tokenizer(), &rollout_config(), &resets, seed, &Device::Cpu)
        .unwrap()
        .transitions
}

/// A deterministic game: every action earns `rewards[turn]` (the letter "e" earns nothing), and
/// the episode terminates after the last of them.
struct Fixed {
    rewards: Vec<f64>,
    turn: Vec<usize>,
}

impl TextEnv for Fixed {
    fn num_envs(&self) -> usize {
        self.turn.len()
    }
    fn reset(&mut self, envs: &[usize], _: &[Reset]) -> rltune::envs::Result<Vec<EnvStep>> {
        Ok(envs
            .iter()
            .map(|&e| {
                self.turn[e] = 0;
                EnvStep { observation: "Say something".into(), ..EnvStep::default() }
            })
            .collect())
    }
    fn step(
        &mut self,
        actions: &[(usize, String)],
    ) -> rltune::envs::Result<Vec<rltune::envs::Result<EnvStep>>> {
        Ok(actions
            .iter()
            .map(|(e, _)| {
                let k = self.turn[*e];
                self.turn[*e] += 1;
                Ok(EnvStep {
                    observation: format!("Turn {k}"),
                    reward: self.rewards[k],
                    terminated: k + 1 == self.rewards.len(),
                    ..EnvStep::default()
                })
            })
            .collect())
    }
}

fn collect_fixed(model: &CausalLmWithValueHead, rewards: &[f64], envs: usize, seed: u64) -> Collected {
    let mut env = Fixed { rewards: rewards.to_vec(), turn: vec![0; envs] };
    let resets = vec![Reset::default(); envs];
    collect_episodes(&mut env, model, &tokenizer(), &rollout_config(), &resets, seed, &Device::Cpu).unwrap()
}

fn step_on(trainer: &mut PpoTrainer, turns: &[Transition], bootstrap: bool) -> Stats {
    let queries: Vec<Vec<u32>> = turns.iter().map(|t| t.query_ids.clone()).collect();
    let responses: Vec<Vec<u32>> = turns.iter().map(|t| t.response_ids.clone()).collect();
    let scores: Vec<f32> = turns.iter().map(|t| t.reward).collect();
    let next: Vec<f32> = turns.iter().map(|t| t.bootstrap).collect();
    let caches: Vec<RolloutCache> = turns
        .iter()
        .map(|t| RolloutCache { logprobs: t.logprobs.clone(), values: t.values.clone() })
        .collect();
    trainer
        .step_with(StepInput {
            queries: &queries,
            responses: &responses,
            scores: &scores,
            response_masks: None,
            rollout: Some(&caches),
            bootstrap: bootstrap.then_some(next.as_slice()),
            allowed: None,
        })
        .unwrap()
}

fn scalar(stats: &Stats, key: &str) -> f64 {
    stats.get(key).and_then(Stat::as_f64).unwrap_or_else(|| panic!("no {key}"))
}

/// Issue #29: with one turn per episode (the game terminates after it) every bootstrap is 0 and
/// the multi-turn step is the plain step, bit for bit.
#[test]
fn one_turn_episodes_step_exactly_as_the_plain_step() {
    crate::common::install();
    let cfg = PpoConfig { batch_size: 4, mini_batch_size: 2, seed: 1, ..PpoConfig::default() };
    let (store, model, reference) = policy(21);
    let got = collect_fixed(&model, &[1.0], 4, 3);
    assert_eq!((got.transitions.len(), got.episodes.len()), (4, 4));
    assert!(got.transitions.iter().all(|t| t.bootstrap == 0.0 && t.reward == 1.0));
    assert!(got.episodes.iter().all(|e| e.steps == 1 && !e.truncated));
    let mut a = PpoTrainer::new(cfg.clone(), store, model, reference).unwrap();
    let (store, model, reference) = policy(21);
    let mut b = PpoTrainer::new(cfg, store, model, reference).unwrap();
    let sa = step_on(&mut a, &got.transitions, true);
    let sb = step_on(&mut b, &got.transitions, false);
    for key in ["ppo/loss/total", "ppo/returns/mean", "ppo/val/error", "objective/kl"] {
        assert_eq!(scalar(&sa, key).to_bits(), scalar(&sb, key).to_bits(), "{key}");
    }
    let wb = b.store.snapshot().unwrap();
    for (name, wa) in a.store.snapshot().unwrap() {
        assert_eq!(common::max_diff(&wa, &wb[&name]), 0.0, "{name}");
    }
}

/// Issue #29: on a deterministic two-turn game the step's returns are GAE by hand: token rewards
/// 0 … 0, r at the last token, plus γ·game_gamma·V(next prompt) after the first turn (the KL
/// penalty is off), γ = 1, λ = 0.95, over the rollout's values.
#[test]
fn two_turn_returns_equal_a_hand_computation() {
    crate::common::install();
    let cfg = PpoConfig {
        batch_size: 8,
        mini_batch_size: 8,
        ppo_epochs: 1,
        init_kl_coef: 0.0,
        adap_kl_ctrl: false,
        ..PpoConfig::default()
    };
    let (store, model, reference) = policy(5);
    let got = collect_fixed(&model, &[0.5, 2.0], 4, 9);
    assert_eq!(got.transitions.len(), 8, "4 episodes of 2 turns");
    let (mut sum, mut sq, mut n) = (0.0f64, 0.0f64, 0usize);
    let mut returns_all = Vec::new();
    for (i, t) in got.transitions.iter().enumerate() {
        let first = i % 2 == 0;
        assert_eq!(t.reward, if first { 0.5 } else { 2.0 });
        assert_eq!(t.bootstrap == 0.0, !first, "turn {i}: only the first turn bootstraps");
        let v: Vec<f64> = t.values.iter().map(|&x| f64::from(x)).collect();
        let len = v.len();
        let (mut adv, mut returns) = (0.0f64, vec![0.0; len]);
        for j in (0..len).rev() {
            let mut r = 0.0;
            if j + 1 == len {
                r = f64::from(t.reward) + f64::from(t.bootstrap);
            }
            let next = if j + 1 < len { v[j + 1] } else { 0.0 };
            adv = r + next - v[j] + 0.95 * adv;
            returns[j] = adv + v[j];
        }
        returns_all.extend(returns);
    }
    for &r in &returns_all {
        sum += r;
        sq += r * r;
        n += 1;
    }
    let mean = sum / n as f64;
    let var = (sq / n as f64 - mean * mean) * n as f64 / (n - 1) as f64;
    let mut trainer = PpoTrainer::new(cfg, store, model, reference).unwrap();
    let stats = step_on(&mut trainer, &got.transitions, true);
    let (m, v) = (scalar(&stats, "ppo/returns/mean"), scalar(&stats, "ppo/returns/var"));
    println!("returns mean {m} (hand {mean}), var {v} (hand {var})");
    assert!((m - mean).abs() < 1e-5, "mean {m} vs {mean}");
    assert!((v - var).abs() < 1e-4, "var {v} vs {var}");
}

/// Each turn bootstraps from `game_gamma · V(next turn's prompt)`; the last turn of a truncated
/// episode from its final state (never 0 here: the letter toy only truncates); responses are
/// cut after the token that ends the action, with logprobs and values cut alike.
#[test]
fn turns_bootstrap_from_the_next_turns_value_and_actions_end_at_their_stop() {
    crate::common::install();
    let (_, model, _) = policy(3);
    let tok = tokenizer();
    let turns = collect(&model, 2, 3, 7);
    assert_eq!(turns.len(), 6, "2 episodes of 3 turns");
    for (i, t) in turns.iter().enumerate() {
        assert_eq!((t.logprobs.len(), t.values.len()), (t.response_ids.len(), t.response_ids.len()));
        assert_eq!(
            action_cut(&t.response_ids, &tok).unwrap(),
            t.response_ids.len(),
            "turn {i}: nothing after the stop"
        );
        let same_episode_next = turns.get(i + 1).filter(|n| n.env == t.env);
        if let Some(next) = same_episode_next {
            // V(next prompt), from a one-token generation of the same prompt.
            let cfg = GenerationConfig { max_new_tokens: 1, ..GenerationConfig::default() };
            let s = generate(
                &model.lm,
                Some(&model.v_head),
                std::slice::from_ref(&next.query_ids),
                &cfg,
                &Device::Cpu,
            )
            .unwrap();
            let v = s[0].values.as_ref().unwrap()[0];
            assert!((t.bootstrap - 0.6 * v).abs() < 1e-6, "turn {i}: bootstrap {} vs 0.6 × {v}", t.bootstrap);
        } else {
            assert!(t.bootstrap != 0.0, "turn {i}: a truncated episode bootstraps from its final state");
        }
        let e = t.action.chars().filter(|&c| c == 'e').count() as f32;
        assert!((t.reward - 0.1 * e).abs() < 1e-6, "turn {i}: {} for {:?}", t.reward, t.action);
    }
}

/// PPO over the turns of letter-toy episodes learns to say "e": the mean turn reward rises
/// (measured 0.14 over the first 5 iterations, 0.80 over the last 5: four "ee" tokens a turn).
#[test]
fn multi_turn_ppo_learns_the_letter_toy() {
    crate::common::install();
    let (store, model, reference) = policy(11);
    let batch = 32;
    let cfg = PpoConfig {
        batch_size: batch,
        mini_batch_size: 8,
        learning_rate: 1e-2,
        init_kl_coef: 0.01,
        seed: 5,
        ..PpoConfig::default()
    };
    let mut trainer = PpoTrainer::new(cfg, store, model, reference).unwrap();
    let mean = |ts: &[Transition]| ts.iter().map(|t| f64::from(t.reward)).sum::<f64>() / ts.len() as f64;
    let mut curve = Vec::new();
    for it in 0..30u64 {
        let turns = collect(&trainer.policy, 16, 2, 100 + it);
        assert_eq!(turns.len(), batch);
        curve.push(mean(&turns));
        step_on(&mut trainer, &turns, true);
    }
    let first: f64 = curve[..5].iter().sum::<f64>() / 5.0;
    let last: f64 = curve[curve.len() - 5..].iter().sum::<f64>() / 5.0;
    println!("mean turn reward: first 5 iterations {first:.3}, last 5 {last:.3}; {curve:.2?}");
    assert!(last > first + 0.4, "no learning: {first:.3} -> {last:.3}");
}

/// A trainer on `policy(seed)` with a separate critic on `policy(critic_seed)`'s backbone and head.
fn critic_trainer(cfg: PpoConfig, seed: u64, critic_seed: u64, critic_lr: f64) -> PpoTrainer {
    let (store, model, reference) = policy(seed);
    let (cstore, cmodel, _) = policy(critic_seed);
    let critic = Critic::new(cstore, cmodel, critic_lr).unwrap();
    PpoTrainer::new(cfg, store, model, reference).unwrap().with_critic(critic).unwrap()
}

/// Issue #29 (critic with `[env]`): with a separate critic each turn bootstraps from
/// `game_gamma · V_critic(next state)`. A critic that is a copy of the policy reproduces the
/// policy head's bootstraps (KV-cached sampler vs full forward: within 1e-5); another critic
/// gives its own values, as one-at-a-time calls compute them; terminated turns keep 0.
#[test]
fn a_critic_bootstraps_each_turn_from_its_value_of_the_next_state() {
    crate::common::install();
    let cfg = PpoConfig { batch_size: 6, mini_batch_size: 2, ..PpoConfig::default() };
    let (_, model, _) = policy(3);
    let turns = collect(&model, 2, 3, 7);
    assert!(turns.iter().all(|t| !t.next_query_ids.is_empty()), "the letter toy only truncates");
    let rebooted = |trainer: &PpoTrainer, turns: &[Transition]| {
        let mut out = turns.to_vec();
        rebootstrap(&mut out, 0.6, trainer.pad_id(), |q, r| trainer.values(q, r)).unwrap();
        out
    };
    let twin = critic_trainer(cfg.clone(), 3, 3, 1e-3);
    let worst = rebooted(&twin, &turns)
        .iter()
        .zip(&turns)
        .map(|(a, b)| (a.bootstrap - b.bootstrap).abs())
        .fold(0f32, f32::max);
    println!("twin critic: bootstraps within {worst:e} of the policy head's");
    assert!(worst < 1e-5, "a copy of the policy as critic moved a bootstrap by {worst}");

    let other = critic_trainer(cfg, 3, 4, 1e-3);
    for (i, (a, b)) in rebooted(&other, &turns).iter().zip(&turns).enumerate() {
        let v = other.values(std::slice::from_ref(&b.next_query_ids), &[vec![0]]).unwrap()[0][0];
        assert!((a.bootstrap - 0.6 * v).abs() < 1e-6, "turn {i}: {} vs 0.6 × {v}", a.bootstrap);
        assert!((a.bootstrap - b.bootstrap).abs() > 1e-4, "turn {i}: the critic's value is the policy's");
    }
    let fixed = collect_fixed(&model, &[0.5, 2.0], 2, 9).transitions;
    for (i, t) in rebooted(&other, &fixed).iter().enumerate() {
        assert_eq!(t.bootstrap == 0.0, i % 2 == 1, "turn {i}: only the terminal turn keeps 0");
    }
}

/// Issue #29: a separate critic learns on text games. On the deterministic two-turn game (0.5
/// then 2.0, so V = 0.5 + 0.6 · V(turn 2) before turn 1 and 2.0 before turn 2), PPO with a
/// critic on its own backbone (lr 1e-2; the policy's lr 1e-5 barely moves it): the critic's
/// `ppo/val/error` falls (measured 0.513, 0.205, 0.091 over the first 3 iterations, 0.0005,
/// 0.0004, 0.0002 over the last 3).
#[test]
fn a_separate_critic_learns_the_values_of_a_multi_turn_game() {
    crate::common::install();
    let cfg = PpoConfig {
        batch_size: 32,
        mini_batch_size: 8,
        learning_rate: 1e-5,
        init_kl_coef: 0.0,
        adap_kl_ctrl: false,
        seed: 5,
        ..PpoConfig::default()
    };
    let mut trainer = critic_trainer(cfg, 11, 12, 1e-2);
    let mut errors = Vec::new();
    for it in 0..12u64 {
        let mut turns = collect_fixed(&trainer.policy, &[0.5, 2.0], 16, 200 + it).transitions;
        let t = &trainer;
        rebootstrap(&mut turns, 0.6, t.pad_id(), |q, r| t.values(q, r)).unwrap();
        errors.push(scalar(&step_on(&mut trainer, &turns, true), "ppo/val/error"));
    }
    let (first, last) = (errors[..3].iter().sum::<f64>() / 3.0, errors[9..].iter().sum::<f64>() / 3.0);
    println!("critic ppo/val/error: first 3 iterations {first:.4}, last 3 {last:.4}; {errors:.4?}");
    assert!(last < 0.2 * first, "the critic did not learn: {first:.4} -> {last:.4}");
}
