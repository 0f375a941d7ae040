//! `rltune ppo` with `[algorithm] kind = "grpo"` / `"rloo"` (issue #31 item 1), through
//! `GroupRun` on a tiny random GPT-2 (V = 50, EOS = 49) and a word tokenizer: the loop learns a
//! toy reward with fixed seeds, logs TRL's metric names (one `rewards/<name>/*` pair per reward
//! function, a missing reward leaving its function out for that sample), and a resumed run ends
//! with the weights and metrics of a straight one.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use candle_core::{DType, Device};
use rltune::models::gpt2::Gpt2Config;
use rltune::models::load::save_pretrained;
use rltune::models::{CausalLm, CausalLmConfig};
use rltune::params::ParamStore;
use rltune::rewards::{FnReward, RewardInput, RewardSource};
use rltune::run::{GroupRun, RunConfig};

/// A tiny GPT-2 policy with a word tokenizer (`w0`…`w47`, `<unk>`, `<eos>` = 49) in `dir`.
fn save_policy(dir: &Path) {
    let cfg = Gpt2Config::tiny(50, 16, 2, 4, 64);
    let store = ParamStore::random(7, true, DType::F32, &Device::Cpu).unwrap();
    // Creates the weights in the store.
    CausalLm::load(&store.root(), &CausalLmConfig::Gpt2(cfg.clone())).unwrap();
    let mut json = serde_json::to_value(&cfg).unwrap();
    json["model_type"] = "gpt2".into();
    save_pretrained(dir, &store, &json).unwrap();
    let words: Vec<String> = (0..48).map(|i| format!("w{i}")).collect();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    crate::common::word_tokenizer(&words, false).inner().save(dir.join("tokenizer.json"), false).unwrap();
}

/// 16 prompts of 3 words; the even rows have an `answer` column (`w7`), the odd ones none.
fn save_prompts(path: &Path) {
    let lines: Vec<String> = (0..16)
        .map(|i| {
            let text = format!("w{} w{} w{}", i, (i * 7) % 40, (i * 5) % 40);
            if i % 2 == 0 {
                format!("{{\"text\": \"{text}\", \"answer\": \"w7\"}}")
            } else {
                format!("{{\"text\": \"{text}\"}}")
            }
        })
        .collect();
    std::fs::write(path, lines.join("\n")).unwrap();
}

/// The fraction of a response's words that are `w7`: a dense toy reward.
fn count_w7() -> Box<dyn RewardSource> {
    Box::new(FnReward::new("count_w7", |s: &RewardInput| {
        let words: Vec<&str> = s.response.split_whitespace().collect();
        Ok(words.iter().filter(|w| **w == "w7").count() as f32 / words.len().max(1) as f32)
    }))
}

struct Setup {
    _tmp: tempfile::TempDir,
    root: PathBuf,
}

fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    save_policy(&root.join("policy"));
    save_prompts(&root.join("prompts.jsonl"));
    Setup { _tmp: tmp, root }
}

/// A GRPO or RLOO run config over the tiny policy: 4 prompts × 4 completions per step.
fn config(s: &Setup, kind: &str, run: &str, steps: usize, extra: &str) -> RunConfig {
    let text = format!(
        "[model]\npath = {:?}\n[algorithm]\nkind = \"{kind}\"\n[data]\nsource = {:?}\n\
         [[reward.sources]]\nkind = \"exact_match\"\ncolumn = \"answer\"\nweight = 0.5\n\
         [generation]\nmax_new_tokens = 4\nseed = 11\n\
         [{kind}]\nnum_generations = 4\nper_device_train_batch_size = 16\nlearning_rate = 1e-2\n\
         max_steps = {steps}\nbeta = 0.02\nlr_scheduler_type = \"constant\"\n{extra}\
         [logging]\ndir = {:?}\n[checkpoint]\nevery = 2\noptimizer_state = true\n",
        s.root.join("policy").to_str().unwrap(),
        s.root.join("prompts.jsonl").to_str().unwrap(),
        s.root.join(run).to_str().unwrap()
    );
    RunConfig::from_toml(&text, Path::new("run.toml"), &[]).unwrap()
}

fn run(cfg: RunConfig, resume: bool) -> GroupRun {
    let mut r = GroupRun::prepare(cfg, vec![(1.0, count_w7())], resume).unwrap();
    r.run(&AtomicBool::new(false), &mut |_| {}).unwrap();
    r
}

fn metrics(s: &Setup, run: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(s.root.join(run).join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            v.as_object_mut().unwrap().retain(|k, _| !k.starts_with("time/"));
            v
        })
        .collect()
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// The toy reward rises: the mean of `rewards/count_w7/mean` over the last 5 of 30 steps is
/// above the first 5's by `margin`; every TRL metric is logged, and the exact-match column is
/// the mean over the rows that have an answer only.
fn learns(kind: &str, margin: f64) {
    let s = setup();
    run(config(&s, kind, kind, 30, ""), false);
    let m = metrics(&s, kind);
    assert_eq!(m.len(), 30);
    let keys = [
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "kl",
        "entropy",
        "clip_ratio/region_mean",
        "clip_ratio/low_mean",
        "clip_ratio/high_max",
        "completions/mean_length",
        "completions/clipped_ratio",
        "completions/mean_terminated_length",
        "rewards/count_w7/mean",
        "rewards/count_w7/std",
        "rewards/exact_match/mean",
        "rewards/exact_match/std",
        "num_tokens",
        "loss",
        "grad_norm",
        "learning_rate",
        "epoch",
    ];
    for k in keys {
        assert!(m[0].get(k).is_some(), "{kind}: no {k} in {}", m[0]);
    }
    let get = |i: usize, k: &str| m[i][k].as_f64().unwrap_or(f64::NAN);
    let r: Vec<f64> = (0..30).map(|i| get(i, "rewards/count_w7/mean")).collect();
    let (first, last) = (mean(&r[..5]), mean(&r[25..]));
    eprintln!("{kind}: count_w7 {first:.3} → {last:.3}; kl at the end {:.4}", get(29, "kl"));
    assert!(last > first + margin, "{kind}: the toy reward did not rise: {first:.3} → {last:.3} ({r:?})");
    // Half the rows have no answer: the exact-match reward is missing there, which leaves it out
    // (its mean is over the rows that have one; null in a step that drew none) but trains on
    // every step.
    assert!(
        m.iter().all(|l| l["reward"].as_f64().is_some() && l["loss"].as_f64().is_some()),
        "a step was skipped"
    );
    let scored = m.iter().filter(|l| l["rewards/exact_match/mean"].as_f64().is_some()).count();
    assert!(scored >= 20, "{scored} of 30 steps have an exact-match mean");
    // Epochs: 30 steps × 4 prompts over 16 prompts.
    assert!((get(29, "epoch") - 7.5).abs() < 1e-9, "epoch {}", get(29, "epoch"));
}

#[test]
fn grpo_loop_learns_a_toy_reward_and_logs_trl_metrics() {
    crate::common::install();
    learns("grpo", 0.5);
}

#[test]
fn rloo_loop_learns_a_toy_reward_and_logs_trl_metrics() {
    crate::common::install();
    learns("rloo", 0.5);
}

/// A run resumed from its step-2 checkpoint ends with the weights and metrics of a straight
/// 4-step run (GRPO with two iterations per batch, so the LR schedule and Adam's state count).
#[test]
fn a_grpo_run_resumes_exactly() {
    crate::common::install();
    let s = setup();
    let extra = "num_iterations = 2\n";
    let straight = run(config(&s, "grpo", "straight", 8, extra), false);
    run(config(&s, "grpo", "resumed", 4, extra), false);
    assert!(s.root.join("resumed/checkpoints/step-2/optimizer.safetensors").is_file());
    let resumed = run(config(&s, "grpo", "resumed", 8, extra), true);
    assert_eq!(resumed.start_step(), 2);
    let (a, b) = (metrics(&s, "straight"), metrics(&s, "resumed"));
    assert_eq!(a.len(), 4);
    assert_eq!(a, b, "the resumed run's metrics differ");
    let snap = |r: &GroupRun| r.store().snapshot().unwrap();
    for ((name, x), (_, y)) in snap(&straight).iter().zip(snap(&resumed).iter()) {
        let d = crate::common::max_diff(x, y);
        assert_eq!(d, 0.0, "{name} differs by {d}");
    }
    // An RLOO config cannot resume it.
    let err = GroupRun::prepare(config(&s, "rloo", "resumed", 8, ""), vec![(1.0, count_w7())], true)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("written by a grpo run") && err.contains("kind = \"grpo\""), "{err}");
}

/// `[eval]`: held-out prompts answered greedily before the first step, every `every` steps and
/// after the last, scored by the run's reward sources; `eval.jsonl` holds what an independent
/// greedy pass over the same prompts scores, and the step lines carry the same `eval_*` numbers.
#[test]
fn held_out_evaluation_scores_greedy_answers_before_and_after() {
    use rltune::generation::{generate, GenerationConfig};
    use rltune::tokenizer::Tokenizer;
    crate::common::install();
    let s = setup();
    let extra = "[eval]\nevery = 2\n";
    let mut cfg = config(&s, "grpo", "eval", 4, extra);
    cfg.eval.source = s.root.join("prompts.jsonl").to_str().unwrap().to_string();
    // The independent pass: greedy completions of every prompt, scored by hand.
    let score = |lm: &CausalLm| -> (f64, f64) {
        let tok = Tokenizer::from_file(&s.root.join("policy/tokenizer.json")).unwrap();
        let rows: Vec<serde_json::Value> = std::fs::read_to_string(s.root.join("prompts.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let prompts: Vec<Vec<u32>> =
            rows.iter().map(|r| tok.encode(r["text"].as_str().unwrap()).unwrap()).collect();
        let gen = GenerationConfig { max_new_tokens: 4, top_k: 1, ..Default::default() };
        let samples = generate(lm, None, &prompts, &gen, &Device::Cpu).unwrap();
        let (mut w7, mut exact, mut n_exact) = (0.0, 0.0, 0.0);
        for (sample, row) in samples.iter().zip(&rows) {
            let text = tok.decode(&sample.response_ids).unwrap();
            let words: Vec<&str> = text.split_whitespace().collect();
            w7 += words.iter().filter(|w| **w == "w7").count() as f64 / words.len().max(1) as f64;
            if let Some(a) = row.get("answer") {
                n_exact += 1.0;
                exact += f64::from(u8::from(text.lines().next().unwrap_or("").trim() == a.as_str().unwrap()));
            }
        }
        (w7 / rows.len() as f64, exact / n_exact)
    };
    let before = {
        let r = GroupRun::prepare(cfg.clone(), vec![(1.0, count_w7())], false).unwrap();
        score(r.policy())
    };
    let after_run = run(cfg, false);
    let after = score(after_run.policy());
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(s.root.join("eval/eval.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let steps: Vec<u64> = lines.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, vec![0, 2, 4]);
    for (line, (w7, exact)) in [(&lines[0], before), (&lines[2], after)] {
        let got_w7 = line["eval_rewards/count_w7/mean"].as_f64().unwrap();
        let got_exact = line["eval_rewards/exact_match/mean"].as_f64().unwrap();
        eprintln!("eval at step {}: count_w7 {got_w7:.4} (by hand {w7:.4}), exact {got_exact}", line["step"]);
        assert!((got_w7 - w7).abs() < 1e-9 && (got_exact - exact).abs() < 1e-9, "{line} vs {w7}, {exact}");
        assert_eq!(line["prompts"].as_u64(), Some(16));
    }
    assert!(
        lines[0]["eval_rewards/count_w7/mean"] != lines[2]["eval_rewards/count_w7/mean"],
        "training changed nothing"
    );
    let m = metrics(&s, "eval");
    assert_eq!(m[1]["eval_reward"], lines[1]["eval_reward"]);
    assert_eq!(m[3]["eval_reward_se"], lines[2]["eval_reward_se"]);
    assert!(m[0].get("eval_reward").is_none(), "step 1 is not an evaluation step");
}

/// `[model] trainable_layers = 1`: a GRPO run trains the last block, the final norm and the
/// head only (the tiny model's head is tied to the frozen embeddings, so it stays); the rest is
/// bitwise the starting policy. With [lora] it is refused.
#[test]
fn grpo_with_trainable_layers_moves_only_the_top_block() {
    crate::common::install();
    let s = setup();
    let mut cfg = config(&s, "grpo", "partial", 2, "");
    cfg.model.trainable_layers = Some(1);
    let start = GroupRun::prepare(cfg.clone(), vec![(1.0, count_w7())], false).unwrap();
    let before = start.store().snapshot().unwrap();
    let after = run(cfg.clone(), false).store().snapshot().unwrap();
    let mut moved = Vec::new();
    for (name, w) in &after {
        let d = crate::common::max_diff(w, &before[name]);
        if d > 0.0 {
            moved.push(name.clone());
        }
        // Two layers, one trainable: block 0 and the embeddings are the frozen trunk.
        if name.contains("h.0.") || name.contains("wte") || name.contains("wpe") {
            assert_eq!(d, 0.0, "{name} is frozen but moved by {d}");
        }
    }
    assert!(
        moved.iter().any(|n| n.contains("h.1.")) && moved.iter().any(|n| n.contains("ln_f")),
        "{moved:?}"
    );
    cfg.lora = Some(Default::default());
    let err = GroupRun::prepare(cfg, vec![(1.0, count_w7())], false).err().unwrap().to_string();
    assert!(err.contains("trainable_layers with [lora]"), "{err}");
}

/// `[model] gradient_checkpointing = true`: a GRPO run (β > 0, two steps) recomputes the blocks
/// in its backward and ends with the plain run's weights, bit for bit. The key under `[grpo]`
/// (TRL's place for it) or `[ref_model]` is refused with the fix.
#[test]
fn grpo_with_gradient_checkpointing_ends_with_the_plain_runs_weights() {
    crate::common::install();
    let _one = crate::common::checkpoint_serial();
    let s = setup();
    let plain = run(config(&s, "grpo", "plain", 2, ""), false).store().snapshot().unwrap();
    let mut cfg = config(&s, "grpo", "ckpt", 2, "");
    cfg.model.gradient_checkpointing = true;
    let before = rltune::ops::checkpoint_recomputations();
    let ckpt = run(cfg, false).store().snapshot().unwrap();
    let recomputed = rltune::ops::checkpoint_recomputations() - before;
    assert!(recomputed >= 4, "2 steps × 2 layers at least: {recomputed} recomputed");
    for (name, w) in &plain {
        let d = crate::common::max_diff(w, &ckpt[name]);
        assert_eq!(d, 0.0, "{name}: the checkpointed run ends {d} apart");
    }
    let err = RunConfig::from_toml(
        "[model]\npath = \"p\"\n[grpo]\ngradient_checkpointing = true\n",
        Path::new("run.toml"),
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("[model] gradient_checkpointing = true"), "{err}");
    let mut cfg = config(&s, "grpo", "ref", 2, "");
    cfg.ref_model = Some(rltune::run::config::ModelSection {
        path: "p".into(),
        adapter: None,
        trainable_layers: None,
        gradient_checkpointing: true,
    });
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("ref_model.gradient_checkpointing"), "{err}");
}

/// Trajectory GRPO and RLOO on text games (issue #39 item 3), the letter toy: each step plays 4
/// episodes of 2 games, an episode's return (0.1 per letter "e" over its 2 turns) is its
/// reward. The policy's words are `e`, `ee`, `eee` and 45 without an "e"; the mean return of the
/// last 5 of 25 steps is above the first 5's (fixed seeds).
fn learns_the_letter_toy(kind: &str) -> (f64, f64) {
    letter_toy(kind, "").unwrap()
}

/// [`learns_the_letter_toy`] with `extra` config lines; the config's error when it is refused.
fn letter_toy(kind: &str, extra: &str) -> Result<(f64, f64), String> {
    let tmp = tempfile::tempdir().unwrap();
    let policy = tmp.path().join("policy");
    save_policy(&policy);
    let mut words: Vec<String> = vec!["e".into(), "ee".into(), "eee".into()];
    words.extend((0..45).map(|i| format!("x{i}")));
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    crate::common::word_tokenizer(&words, false).inner().save(policy.join("tokenizer.json"), false).unwrap();
    let run_dir = tmp.path().join("run");
    let text = format!(
        "[model]\npath = {:?}\n[algorithm]\nkind = \"{kind}\"\n\
         [env]\nkind = \"letters\"\nnum_envs = 8\nturns = 2\n[agent]\nmemory_turns = 1\n\
         [generation]\nmax_new_tokens = 3\nseed = 5\n\
         [{kind}]\nnum_generations = 4\nper_device_train_batch_size = 8\nmax_steps = 25\n\
         learning_rate = 1e-2\nbeta = 0.0\nlr_scheduler_type = \"constant\"\n{extra}\
         [logging]\ndir = {:?}\n[checkpoint]\nevery = 0\n",
        policy.to_str().unwrap(),
        run_dir.to_str().unwrap()
    );
    let cfg = RunConfig::from_toml(&text, Path::new("run.toml"), &[]).map_err(|e| e.to_string())?;
    let mut r = GroupRun::prepare(cfg, Vec::new(), false).unwrap();
    r.run(&AtomicBool::new(false), &mut |_| {}).unwrap();
    let m: Vec<serde_json::Value> = std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(m.len(), 25);
    for k in
        ["reward", "frac_reward_zero_std", "loss", "env/episodes", "env/turns", "rewards/episode_return/mean"]
    {
        assert!(m[0][k].is_number(), "{kind}: no {k} in {}", m[0]);
    }
    assert_eq!(m[0]["env/episodes"].as_f64(), Some(8.0));
    assert_eq!(m[0]["env/turns"].as_f64(), Some(16.0));
    let r: Vec<f64> = m.iter().map(|l| l["reward"].as_f64().unwrap()).collect();
    let ret: Vec<f64> = m.iter().map(|l| l["env/episode_return_mean"].as_f64().unwrap()).collect();
    assert!(
        r.iter().zip(&ret).all(|(a, b)| (a - b).abs() < 1e-6),
        "{kind}: reward is the mean return: {r:?} vs {ret:?}"
    );
    let (first, last) = (mean(&r[..5]), mean(&r[20..]));
    eprintln!("{kind} {extra} on the letter toy: mean return {first:.3} → {last:.3}");
    if extra.contains("gigpo") {
        assert!(m.iter().all(|l| l["gigpo/step_group_size"].as_f64().unwrap() >= 1.0), "{}", m[0]);
    }
    Ok((first, last))
}

#[test]
fn trajectory_grpo_learns_the_letter_toy() {
    crate::common::install();
    let (first, last) = learns_the_letter_toy("grpo");
    assert!(last > first + 0.2, "GRPO: {first:.3} → {last:.3}");
}

/// GiGPO (`[episodes.gigpo]`) learns it too, and is refused with RLOO, naming the fix.
#[test]
fn gigpo_learns_the_letter_toy_and_needs_grpo() {
    crate::common::install();
    let (first, last) = letter_toy("grpo", "[episodes.gigpo]\nstep_advantage_w = 1.0\n").unwrap();
    assert!(last > first + 0.2, "GiGPO: {first:.3} → {last:.3}");
    let err = letter_toy("rloo", "[episodes.gigpo]\n").unwrap_err();
    assert!(err.contains("[episodes.gigpo]") && err.contains("kind = \"grpo\""), "{err}");
}

#[test]
fn trajectory_rloo_learns_the_letter_toy() {
    crate::common::install();
    let (first, last) = learns_the_letter_toy("rloo");
    assert!(last > first + 0.2, "RLOO: {first:.3} → {last:.3}");
}
