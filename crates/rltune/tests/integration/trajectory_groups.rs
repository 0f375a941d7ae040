//! Trajectory-level GRPO and RLOO (`step_turns`, issue #39 item 3): the turns of groups of
//! episodes, each turn carrying its episode's advantage.
//!
//! - Episodes of one turn each are exactly the prompt step (`step_with`, which the TRL 1.16.0
//!   fixtures pin), bit for bit, for GRPO with a reference and for RLOO with its KL-in-reward.
//! - Turns of one episode share its advantage: the first iteration's loss is the
//!   token-weighted mean of the episodes' advantages.
//! - Allowed sets (admissible actions): with every token allowed the step is the unconstrained
//!   one (another code path for the head, so this pins its gradients); with one allowed token
//!   everywhere every logprob is 0 and no weight moves.
//! - GiGPO's step credit: each turn's advantage is its episode's plus ω times its step
//!   return's, against the other turns from the same state in the game's group.
//! - Bad batches are refused, naming the turn or the episode.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use rltune::grpo::{GroupBatch, GrpoConfig, GrpoTrainer, RewardTable, RlooConfig, RlooTrainer, TurnBatch};
use rltune::models::gpt2::Gpt2Config;
use rltune::models::{CausalLm, CausalLmConfig};
use rltune::params::ParamStore;
use rltune::ppo::{Stat, Stats};

use crate::common::max_diff;

const VOCAB: usize = 50;

/// A tiny random GPT-2 without a value head.
fn policy(seed: u64) -> (ParamStore, CausalLm) {
    let cfg = CausalLmConfig::Gpt2(Gpt2Config::tiny(VOCAB, 16, 2, 4, 64));
    let store = ParamStore::random(seed, true, DType::F32, &Device::Cpu).unwrap();
    let lm = CausalLm::load(&store.root(), &cfg).unwrap();
    (store, lm)
}

fn grpo(config: GrpoConfig) -> GrpoTrainer {
    let (store, lm) = policy(3);
    GrpoTrainer::new(config, store, lm, None).unwrap()
}

fn rloo(config: RlooConfig) -> RlooTrainer {
    let (store, lm) = policy(3);
    RlooTrainer::new(config, store, lm, None).unwrap()
}

fn grpo_config() -> GrpoConfig {
    GrpoConfig {
        num_generations: 4,
        max_completion_length: 6,
        learning_rate: 1e-2,
        beta: 0.04,
        num_iterations: 2,
        ..GrpoConfig::default()
    }
}

fn rloo_config() -> RlooConfig {
    RlooConfig {
        num_generations: 4,
        max_completion_length: 6,
        learning_rate: 1e-2,
        beta: 0.05,
        ..RlooConfig::default()
    }
}

/// A deterministic token in `1..48` (49 is the tiny model's EOS).
fn token(i: usize, j: usize, salt: usize) -> u32 {
    ((i * 31 + j * 17 + salt * 7) % 47 + 1) as u32
}

/// `groups` groups of 4 rows: each group's rows share a prompt of 3 tokens (one length, so
/// TRL's position numbering, `0..L−1` from the first pad, is each row's own); completions of 1
/// to 5 tokens.
fn rows(groups: usize) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let mut prompts = Vec::new();
    let mut completions = Vec::new();
    for g in 0..groups {
        let p: Vec<u32> = (0..3).map(|j| token(g, j, 1)).collect();
        for k in 0..4 {
            let i = g * 4 + k;
            prompts.push(p.clone());
            completions.push((0..1 + i % 5).map(|j| token(i, j, 2)).collect());
        }
    }
    (prompts, completions)
}

/// A batch of every turn as given, no allowed sets, in one pass.
fn turn_batch<'a>(
    prompts: &'a [Vec<u32>],
    completions: &'a [Vec<u32>],
    episodes: &'a [usize],
    returns: &'a [f64],
) -> TurnBatch<'a> {
    TurnBatch { prompts, completions, allowed: None, episodes, returns, micro_batch: 0, step_credit: None }
}

fn returns(n: usize) -> Vec<f64> {
    (0..n).map(|i| ((i * 7) % 5) as f64 * 0.5 - 0.7).collect()
}

fn snapshot(store: &ParamStore) -> BTreeMap<String, Tensor> {
    store.snapshot().unwrap().into_iter().collect()
}

fn weights_diff(a: &ParamStore, b: &ParamStore) -> f64 {
    let (a, b) = (snapshot(a), snapshot(b));
    a.iter().map(|(k, x)| max_diff(x, &b[k])).fold(0.0, f64::max)
}

fn scalar(s: &Stats, k: &str) -> f64 {
    s.get(k).and_then(Stat::as_f64).unwrap_or_else(|| panic!("no {k} in {s:?}"))
}

/// The metrics of two steps, `rewards/<name>/*` renamed to one name, compared exactly.
fn same_metrics(a: &[Stats], b: &[Stats]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        let norm = |s: &Stats| -> BTreeMap<String, u64> {
            s.iter()
                .filter_map(|(k, v)| {
                    let k = k.replace("rewards/episode_return/", "rewards/reward/");
                    v.as_f64().map(|f| (k, f.to_bits()))
                })
                .collect()
        };
        assert_eq!(norm(x), norm(y));
    }
}

#[test]
fn one_turn_episodes_are_the_prompt_step_bit_for_bit() {
    crate::common::install();
    let (prompts, completions) = rows(3);
    let r = returns(prompts.len());
    let table = RewardTable::single(&r.iter().map(|&x| x as f32).collect::<Vec<_>>());
    let r: Vec<f64> = table.values.iter().map(|v| v[0]).collect();
    let no_cut = vec![false; prompts.len()];
    let batch = GroupBatch {
        prompts: &prompts,
        completions: &completions,
        rewards: &table,
        truncated: Some(&no_cut),
        allowed: None,
    };
    let episodes: Vec<usize> = (0..prompts.len()).collect();
    let turns = turn_batch(&prompts, &completions, &episodes, &r);

    let (mut a, mut b) = (grpo(grpo_config()), grpo(grpo_config()));
    let (sa, sb) = (a.step_with(&batch).unwrap(), b.step_turns(&turns).unwrap());
    same_metrics(&sa, &sb);
    assert_eq!(weights_diff(a.store(), b.store()), 0.0, "GRPO");
    assert!(scalar(&sa[0], "kl").is_finite());

    let (mut a, mut b) = (rloo(rloo_config()), rloo(rloo_config()));
    let (sa, sb) = (a.step_with(&batch).unwrap(), b.step_turns(&turns).unwrap());
    same_metrics(&sa, &sb);
    assert_eq!(weights_diff(a.store(), b.store()), 0.0, "RLOO");
}

/// Two groups of 4 episodes, the episodes having 1 to 3 turns of different prompts: with one
/// iteration and no reference the GRPO loss (dapo) is `−Σ_turns A_e · len / Σ len`, `A_e` the
/// episode's group-normalised return; RLOO's is `−mean_turns A_e` with the leave-one-out `A_e`.
/// Two groups of 4 episodes of 1 to 3 turns; prompts of 2 to 4 tokens, actions of 1 to 4.
type Episodes = (Vec<Vec<u32>>, Vec<Vec<u32>>, Vec<usize>, Vec<f64>);

fn multi_turn() -> Episodes {
    let r = vec![1.0, 0.0, 0.5, 2.0, -1.0, -1.0, 0.5, 0.0];
    let (mut prompts, mut completions, mut episodes) = (Vec::new(), Vec::new(), Vec::new());
    for (e, _) in r.iter().enumerate() {
        for t in 0..1 + e % 3 {
            prompts.push((0..2 + t + e % 2).map(|j| token(e, j, t)).collect::<Vec<u32>>());
            completions.push((0..1 + (e + t) % 4).map(|j| token(e, j, 9 + t)).collect::<Vec<u32>>());
            episodes.push(e);
        }
    }
    (prompts, completions, episodes, r)
}

#[test]
fn the_turns_of_an_episode_share_its_advantage() {
    crate::common::install();
    let (prompts, completions, episodes, r) = multi_turn();
    let turns = turn_batch(&prompts, &completions, &episodes, &r);
    let group = |e: usize| &r[e / 4 * 4..e / 4 * 4 + 4];
    let mean = |g: &[f64]| g.iter().sum::<f64>() / 4.0;
    let std = |g: &[f64]| (g.iter().map(|x| (x - mean(g)).powi(2)).sum::<f64>() / 3.0).sqrt();
    let lens: Vec<f64> = completions.iter().map(|c| c.len() as f64).collect();

    let mut t = grpo(GrpoConfig { beta: 0.0, num_iterations: 1, ..grpo_config() });
    let s = t.step_turns(&turns).unwrap();
    let adv: Vec<f64> = episodes.iter().map(|&e| (r[e] - mean(group(e))) / (std(group(e)) + 1e-4)).collect();
    let want = -adv.iter().zip(&lens).map(|(a, l)| a * l).sum::<f64>() / lens.iter().sum::<f64>();
    let got = scalar(&s[0], "loss");
    assert!((got - want).abs() < 1e-5, "GRPO loss {got}, want {want}");
    assert_eq!(scalar(&s[0], "reward"), r.iter().sum::<f64>() / 8.0);

    let mut t = rloo(RlooConfig { beta: 0.0, ..rloo_config() });
    let s = t.step_turns(&turns).unwrap();
    let adv: Vec<f64> =
        episodes.iter().map(|&e| r[e] - (group(e).iter().sum::<f64>() - r[e]) / 3.0).collect();
    let want = -adv.iter().sum::<f64>() / adv.len() as f64;
    let got = scalar(&s[0], "loss");
    assert!((got - want).abs() < 1e-5, "RLOO loss {got}, want {want}");
}

/// GiGPO on [`multi_turn`]'s episodes: turn t of an episode is in state t (so the turns at the
/// same depth of one game's plays form an anchor group), with rewards of its own. With one
/// iteration and no reference the loss is `−Σ_turns (A_e + ω·A^S_t) · len / Σ len`, the step
/// advantage computed here from the definition (discounted returns, group means).
#[test]
fn gigpo_adds_each_turns_advantage_within_its_state() {
    use rltune::grpo::gigpo::{GigpoArgs, StepCredit, StepNorm};
    crate::common::install();
    let (prompts, completions, episodes, r) = multi_turn();
    let n = episodes.len();
    let mut states = vec![0u64; n];
    for i in 1..n {
        if episodes[i] == episodes[i - 1] {
            states[i] = states[i - 1] + 1;
        }
    }
    let rewards: Vec<f64> = (0..n).map(|i| ((i * 5) % 3) as f64 * 0.5).collect();
    let args = GigpoArgs { step_advantage_w: 0.7, gamma: 0.9, mode: StepNorm::MeanNorm };
    let credit = StepCredit { rewards: &rewards, states: &states, args: &args };
    let turns = TurnBatch { step_credit: Some(credit), ..turn_batch(&prompts, &completions, &episodes, &r) };

    // R_t = r_t + γ·R_{t+1} within the episode.
    let mut ret = vec![0.0; n];
    for i in (0..n).rev() {
        let next = if i + 1 < n && episodes[i + 1] == episodes[i] { ret[i + 1] } else { 0.0 };
        ret[i] = rewards[i] + 0.9 * next;
    }
    let step_adv: Vec<f64> = (0..n)
        .map(|i| {
            let same: Vec<f64> = (0..n)
                .filter(|&j| episodes[j] / 4 == episodes[i] / 4 && states[j] == states[i])
                .map(|j| ret[j])
                .collect();
            ret[i] - same.iter().sum::<f64>() / same.len() as f64
        })
        .collect();
    assert!(step_adv.iter().any(|a| a.abs() > 0.1), "the fixture must exercise the step advantage");
    let group = |e: usize| &r[e / 4 * 4..e / 4 * 4 + 4];
    let mean = |g: &[f64]| g.iter().sum::<f64>() / 4.0;
    let std = |g: &[f64]| (g.iter().map(|x| (x - mean(g)).powi(2)).sum::<f64>() / 3.0).sqrt();
    let lens: Vec<f64> = completions.iter().map(|c| c.len() as f64).collect();
    let adv: Vec<f64> = (0..n)
        .map(|i| {
            let e = episodes[i];
            (r[e] - mean(group(e))) / (std(group(e)) + 1e-4) + 0.7 * step_adv[i]
        })
        .collect();
    let want = -adv.iter().zip(&lens).map(|(a, l)| a * l).sum::<f64>() / lens.iter().sum::<f64>();

    let mut t = grpo(GrpoConfig { beta: 0.0, num_iterations: 1, ..grpo_config() });
    let s = t.step_turns(&turns).unwrap();
    let got = scalar(&s[0], "loss");
    assert!((got - want).abs() < 1e-5, "GiGPO loss {got}, want {want}");
    let abs = step_adv.iter().map(|a| a.abs()).sum::<f64>() / n as f64;
    assert!((scalar(&s[0], "gigpo/step_advantage_abs") - abs).abs() < 1e-12);

    // ω = 0 is trajectory GRPO, bit for bit.
    let zero = GigpoArgs { step_advantage_w: 0.0, ..args.clone() };
    let off = TurnBatch {
        step_credit: Some(StepCredit { args: &zero, ..credit }),
        ..turn_batch(&prompts, &completions, &episodes, &r)
    };
    let (mut a, mut b) = (grpo(grpo_config()), grpo(grpo_config()));
    a.step_turns(&off).unwrap();
    b.step_turns(&turn_batch(&prompts, &completions, &episodes, &r)).unwrap();
    assert_eq!(weights_diff(a.store(), b.store()), 0.0);

    // RLOO refuses it, and a short list of states is named.
    let e = rloo(rloo_config()).step_turns(&turns).unwrap_err().to_string();
    assert!(e.contains("GiGPO") && e.contains("grpo"), "{e}");
    let short = StepCredit { states: &states[1..], ..credit };
    let bad = TurnBatch { step_credit: Some(short), ..turn_batch(&prompts, &completions, &episodes, &r) };
    let e = grpo(grpo_config()).step_turns(&bad).unwrap_err().to_string();
    assert!(e.contains("anchor states"), "{e}");
}

fn allowed_sets(completions: &[Vec<u32>], every: bool) -> Vec<Vec<Vec<u32>>> {
    completions
        .iter()
        .map(|c| c.iter().map(|&t| if every { (0..VOCAB as u32).collect() } else { vec![t] }).collect())
        .collect()
}

#[test]
fn allowed_sets_renormalise_the_policy() {
    crate::common::install();
    let (prompts, completions) = rows(2);
    let r = returns(prompts.len());
    let episodes: Vec<usize> = (0..prompts.len()).collect();
    let every = allowed_sets(&completions, true);
    let one = allowed_sets(&completions, false);
    let turns = |allowed| TurnBatch { allowed, ..turn_batch(&prompts, &completions, &episodes, &r) };
    // Every token allowed: the unconstrained step, up to the order of the head's sums (Adam's
    // first steps move each weight by about ±lr whatever its gradient's size, so rounding-level
    // differences of tiny gradients show at 1e-5 of lr = 1e-2).
    let (mut a, mut b) = (grpo(grpo_config()), grpo(grpo_config()));
    let sa = a.step_turns(&turns(None)).unwrap();
    let sb = b.step_turns(&turns(Some(every.as_slice()))).unwrap();
    let d = weights_diff(a.store(), b.store());
    assert!(d < 1e-4, "GRPO weights differ by {d}");
    for k in ["loss", "entropy", "kl"] {
        let (x, y) = (scalar(&sa[1], k), scalar(&sb[1], k));
        assert!((x - y).abs() < 1e-5, "{k}: {x} vs {y}");
    }
    let (mut a, mut b) = (rloo(rloo_config()), rloo(rloo_config()));
    a.step_turns(&turns(None)).unwrap();
    b.step_turns(&turns(Some(every.as_slice()))).unwrap();
    let d = weights_diff(a.store(), b.store());
    assert!(d < 1e-4, "RLOO weights differ by {d}");

    // One token allowed everywhere: logprob 0, no entropy, no gradient, no weight moves.
    let mut t = grpo(GrpoConfig { beta: 0.0, ..grpo_config() });
    let before = snapshot(t.store());
    let s = t.step_turns(&turns(Some(one.as_slice()))).unwrap();
    assert_eq!(scalar(&s[0], "entropy"), 0.0);
    assert_eq!(scalar(&s[0], "grad_norm"), 0.0);
    let after = snapshot(t.store());
    let moved = before.iter().map(|(k, x)| max_diff(x, &after[k])).fold(0.0, f64::max);
    assert_eq!(moved, 0.0);
}

#[test]
fn bad_turn_batches_are_refused_naming_the_turn() {
    crate::common::install();
    let (prompts, completions) = rows(1);
    let r = returns(4);
    let episodes: Vec<usize> = (0..4).collect();
    let mut t = grpo(grpo_config());
    let err = |t: &mut GrpoTrainer, b: TurnBatch| t.step_turns(&b).unwrap_err().to_string();
    let base = turn_batch(&prompts, &completions, &episodes, &r);

    let e = err(&mut t, TurnBatch { returns: &r[..3], ..base });
    assert!(e.contains("3 episodes") && e.contains("num_generations = 4"), "{e}");
    let mut lost = r.clone();
    lost[2] = f64::NAN;
    let e = err(&mut t, TurnBatch { returns: &lost, ..base });
    assert!(e.contains("turn 2") && e.contains("episode 2 has no return"), "{e}");
    let typed = t.step_turns(&TurnBatch { returns: &lost, ..base }).unwrap_err();
    assert!(matches!(typed, rltune::Error::Batch { sample: Some(2), unit: "turn", .. }), "{typed:?}");
    let mut bad = completions.clone();
    bad[1] = vec![VOCAB as u32];
    let e = err(&mut t, TurnBatch { completions: &bad, ..base });
    assert!(e.contains("turn 1") && e.contains("vocab_size"), "{e}");
    let mut sets = allowed_sets(&completions, false);
    sets[3][0] = vec![completions[3][0] + 1];
    let e = err(&mut t, TurnBatch { allowed: Some(&sets), ..base });
    assert!(e.contains("row 3") && e.contains("not in its allowed set"), "{e}");
}

/// The sampler's logprobs of admissible commands (prompts of different lengths, as a game's
/// turns are) equal what the trajectory step computes for the same tokens: the first
/// iteration's ratio is 1 and the KL compares the same constrained distributions.
#[test]
fn sampled_command_logprobs_equal_the_training_forward() {
    use rltune::generation::admissible::{generate_admissible, ActionTrie};
    use rltune::generation::GenerationConfig;
    crate::common::install();
    let t = grpo(grpo_config());
    let commands = vec![vec![7, 21, 49], vec![7, 33, 49], vec![12, 49], vec![7, 21, 5, 49]];
    let trie = ActionTrie::new(&commands).unwrap();
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| (0..2 + 5 * i).map(|j| token(i, j, 4)).collect()).collect();
    let tries = vec![trie; prompts.len()];
    let cfg = GenerationConfig { seed: 17, temperature: 1.0, ..Default::default() };
    let samples = generate_admissible(t.policy(), None, &prompts, &tries, &cfg, &Device::Cpu).unwrap();
    let completions: Vec<Vec<u32>> = samples.iter().map(|s| s.response_ids.clone()).collect();
    let allowed: Vec<Vec<Vec<u32>>> = samples.iter().map(|s| s.allowed.clone()).collect();
    let got = t.turn_logprobs(&prompts, &completions, Some(&allowed)).unwrap();
    let mut worst = 0f32;
    for (s, g) in samples.iter().zip(&got) {
        assert_eq!(s.logprobs.len(), g.len());
        for (a, b) in s.logprobs.iter().zip(g) {
            worst = worst.max((a - b).abs());
        }
    }
    assert!(worst < 1e-5, "sampler and training logprobs differ by {worst}");
    // The last token of every command is forced (49 after a complete command): logprob 0.
    assert!(got.iter().all(|g| g.last().unwrap().abs() < 1e-6), "{got:?}");
}

/// Micro-batches (`TurnBatch::micro_batch`: turns ordered by length, each chunk padded on its
/// own, gradients summed with each chunk weighted by its share of the normaliser) give the
/// one-batch step, for every GRPO `loss_type` and for RLOO with its KL in the reward, up to the
/// order of floating-point sums.
#[test]
fn micro_batches_are_the_one_batch_step() {
    use rltune::grpo::LossType;
    crate::common::install();
    let (prompts, completions, episodes, r) = multi_turn();
    let every = allowed_sets(&completions, true);
    let batch = |micro_batch: usize, allowed| TurnBatch {
        allowed,
        micro_batch,
        ..turn_batch(&prompts, &completions, &episodes, &r)
    };
    let close = |a: &[Stats], b: &[Stats], what: &str| {
        for (x, y) in a.iter().zip(b) {
            for k in ["loss", "entropy", "kl", "clip_ratio/region_mean", "grad_norm"] {
                if let (Some(p), Some(q)) = (x.get(k).and_then(Stat::as_f64), y.get(k).and_then(Stat::as_f64))
                {
                    assert!((p - q).abs() <= 1e-5 * (1.0 + p.abs()), "{what} {k}: {p} vs {q}");
                }
            }
        }
    };
    for loss_type in [LossType::Dapo, LossType::Grpo, LossType::Bnpo, LossType::DrGrpo] {
        let cfg = GrpoConfig { loss_type, learning_rate: 1e-3, ..grpo_config() };
        for allowed in [None, Some(every.as_slice())] {
            let (mut one, mut three) = (grpo(cfg.clone()), grpo(cfg.clone()));
            let (a, b) =
                (one.step_turns(&batch(0, allowed)).unwrap(), three.step_turns(&batch(3, allowed)).unwrap());
            let what = format!("GRPO {loss_type:?}, allowed {}", allowed.is_some());
            close(&a, &b, &what);
            let d = weights_diff(one.store(), three.store());
            assert!(d < 1e-5, "{what}: weights differ by {d}");
        }
    }
    let cfg = RlooConfig { learning_rate: 1e-3, num_iterations: 2, ..rloo_config() };
    let (mut one, mut three) = (rloo(cfg.clone()), rloo(cfg));
    let (a, b) = (one.step_turns(&batch(0, None)).unwrap(), three.step_turns(&batch(3, None)).unwrap());
    close(&a, &b, "RLOO");
    let d = weights_diff(one.store(), three.store());
    assert!(d < 1e-5, "RLOO: weights differ by {d}");
}
