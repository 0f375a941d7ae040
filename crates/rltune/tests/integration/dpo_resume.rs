//! DPO's checkpoints and `--resume` (`dpo::run::train_with`), beside the supervised loops' in
//! `train.rs`: a run stopped and resumed equals one that never stopped, bit for bit, and a
//! checkpoint that does not fit the run is refused, naming why.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use rltune::dpo::data::{prepare_pairs, read_preference_records};
use rltune::dpo::run::{train_with, DpoSummary};
use rltune::dpo::{DpoConfig, DpoTrainer, PreferencePair};
use rltune::tokenizer::Tokenizer;
use rltune::train::Checkpointing;

use crate::common::fixture;
use crate::grpo_parity::load_lm;
use crate::train::weights;

/// The DPO fixture's five rows (one with identical chosen and rejected), tokenized.
fn fixture_pairs(cfg: &DpoConfig) -> Vec<PreferencePair> {
    let rows = fixture("dpo/rows.jsonl");
    let records = read_preference_records(&rows).unwrap();
    let tok = Tokenizer::from_file(&fixture("dpo/init/tokenizer.json")).unwrap();
    prepare_pairs(&records, Some(&tok), Some(0), cfg, &rows).unwrap().pairs
}

/// 3 epochs of 3 micro-batches (2, 2, 1 pairs), 2 per step: 6 steps of 2 and 1 micro-batches;
/// warm-up, linear decay, weight decay; a checkpoint every 2 steps.
fn config() -> DpoConfig {
    DpoConfig {
        learning_rate: 1e-2,
        weight_decay: 0.01,
        warmup_steps: 1.0,
        per_device_train_batch_size: 2,
        gradient_accumulation_steps: 2,
        save_steps: 2,
        ..Default::default()
    }
}

/// A fresh trainer on the fixture's initial policy (its own frozen copy as reference): a run
/// resumed in a new process starts from these weights too.
fn trainer(cfg: &DpoConfig, n_pairs: usize) -> DpoTrainer {
    let (store, policy) = load_lm(&fixture("dpo/init"), true);
    DpoTrainer::new(cfg.clone(), store, policy, None, n_pairs).unwrap()
}

/// Each step's (step, loss, learning rate).
type StepLog = Vec<(usize, f64, f64)>;

/// Runs `trainer`, setting `stop_at.1` after step `stop_at.0`; returns the summary and each
/// step's [`StepLog`].
fn run(
    trainer: &mut DpoTrainer,
    pairs: &[PreferencePair],
    ckpt: Option<Checkpointing>,
    metrics: &Path,
    stop_at: Option<(usize, &AtomicBool)>,
) -> rltune::Result<(DpoSummary, StepLog)> {
    let mut log = Vec::new();
    let summary = train_with(trainer, pairs, ckpt, Some(metrics), &mut |step, _, stats| {
        let get = |k: &str| stats[k].as_f64().unwrap();
        log.push((step, get("loss"), get("learning_rate")));
        if let Some((_, flag)) = stop_at.filter(|(at, _)| *at == step) {
            flag.store(true, Ordering::SeqCst);
        }
        Ok(())
    })?;
    Ok((summary, log))
}

/// Stopped after step 3 (checkpoints at 2 and, on the stop, 3), then resumed from a fresh
/// policy: the weights, each later step's loss and learning rate and every `metrics.jsonl` line
/// (`num_tokens`, `epoch` and the skip count carry over) equal the straight run's bit for bit.
#[test]
fn dpo_stopped_and_resumed_equals_one_run_bit_for_bit() {
    crate::common::install();
    let cfg = config();
    let pairs = fixture_pairs(&cfg);
    assert_eq!((pairs.len(), cfg.total_steps(pairs.len())), (5, 6));
    let tmp = tempfile::tempdir().unwrap();
    let (straight_metrics, cut_metrics) = (tmp.path().join("straight.jsonl"), tmp.path().join("cut.jsonl"));

    let mut straight = trainer(&cfg, pairs.len());
    let (whole, whole_log) = run(&mut straight, &pairs, None, &straight_metrics, None).unwrap();
    assert_eq!((whole.steps, whole.metrics.len()), (6, 6));

    let dir = tmp.path().join("checkpoints");
    let stop = AtomicBool::new(false);
    let ckpt = Checkpointing { dir: &dir, resume: false, stop: Some(&stop) };
    let mut first = trainer(&cfg, pairs.len());
    let (cut, _) = run(&mut first, &pairs, Some(ckpt), &cut_metrics, Some((3, &stop))).unwrap();
    assert_eq!((cut.steps, cut.total_steps), (3, 6), "stopped after the step under way");
    for step in [2, 3] {
        let d = dir.join(format!("step-{step}"));
        for f in ["trainable.safetensors", "optimizer.safetensors", "trainer_state.json", "metrics.jsonl"] {
            assert!(d.join(f).is_file(), "step-{step}/{f}");
        }
    }
    let saved = std::fs::read_to_string(dir.join("step-3/metrics.jsonl")).unwrap();
    assert_eq!(saved.lines().collect::<Vec<_>>(), whole.metrics[..3]);

    // A stray line after the checkpoint (a step that ran before a kill) is not kept.
    std::fs::write(&cut_metrics, format!("{saved}{}\n", whole.metrics[3])).unwrap();
    let ckpt = Checkpointing { dir: &dir, resume: true, stop: None };
    let mut resumed = trainer(&cfg, pairs.len());
    let (again, log) = run(&mut resumed, &pairs, Some(ckpt), &cut_metrics, None).unwrap();
    assert_eq!(again.steps, 6);
    assert_eq!(log, whole_log[3..], "steps 4–6: (step, loss, learning rate)");
    assert_eq!(weights(resumed.store()), weights(straight.store()));
    assert_eq!(again.metrics, whole.metrics);
    assert_eq!(std::fs::read(&cut_metrics).unwrap(), std::fs::read(&straight_metrics).unwrap());
    let last: serde_json::Value = serde_json::from_str(&whole.metrics[5]).unwrap();
    assert_eq!(last["epoch"].as_f64(), Some(3.0));
    assert_eq!(last["rltune/skipped_updates"].as_f64(), Some(0.0));
    assert!(last["num_tokens"].as_f64().unwrap() > 0.0);
}

/// `--resume` with nothing to resume, or a checkpoint of other settings or of another trainer:
/// an error naming the folder or file, what differs, and the fix.
#[test]
fn dpo_resume_refuses_checkpoints_that_do_not_fit() {
    crate::common::install();
    let cfg = DpoConfig { max_steps: 2, ..config() };
    let pairs = fixture_pairs(&cfg);
    let tmp = tempfile::tempdir().unwrap();
    let (dir, metrics) = (tmp.path().join("checkpoints"), tmp.path().join("metrics.jsonl"));
    let resume = Checkpointing { dir: &dir, resume: true, stop: None };
    let err = |cfg: &DpoConfig| {
        let mut t = trainer(cfg, pairs.len());
        run(&mut t, &pairs, Some(resume), &metrics, None).unwrap_err().to_string()
    };

    let e = err(&cfg);
    assert!(
        e.contains("no checkpoint") && e.contains("checkpoints") && e.contains("without --resume"),
        "{e}"
    );

    let fresh = Checkpointing { dir: &dir, resume: false, stop: None };
    run(&mut trainer(&cfg, pairs.len()), &pairs, Some(fresh), &metrics, None).unwrap();
    let e = err(&DpoConfig { beta: 0.5, ..cfg.clone() });
    assert!(
        e.contains("step-2/trainer_state.json") && e.contains("dpo.beta = 0.1") && e.contains("0.5"),
        "{e}"
    );
    let e = err(&DpoConfig { max_steps: 3, ..cfg.clone() });
    assert!(e.contains("total_steps") && e.contains("= 2 but this run has 3"), "{e}");
    // save_steps alone may change.
    let mut t = trainer(&DpoConfig { save_steps: 1, ..cfg.clone() }, pairs.len());
    assert_eq!(run(&mut t, &pairs, Some(resume), &metrics, None).unwrap().0.steps, 2);

    // A supervised run's checkpoint (no `trainer` field: written before DPO had checkpoints).
    let sft = tmp.path().join("sft");
    std::fs::create_dir_all(sft.join("step-4")).unwrap();
    std::fs::write(sft.join("step-4/trainer_state.json"), "{\"step\": 4, \"total_steps\": 8}").unwrap();
    let mut t = trainer(&cfg, pairs.len());
    let resume = Checkpointing { dir: &sft, resume: true, stop: None };
    let e = run(&mut t, &pairs, Some(resume), &metrics, None).unwrap_err().to_string();
    assert!(e.contains("rltune sft or rltune reward, not of rltune dpo"), "{e}");
}
