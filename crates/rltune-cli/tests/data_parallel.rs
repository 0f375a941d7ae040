//! Data-parallel training (issue #40): `mpirun -np 2 rltune ppo` against one process with the
//! same global batch, and the launches that must be refused.
//!
//! The MPI runs need OpenMPI (`mpirun`) and the binary built with `--features mpi`, copied to
//! `target/<profile>/rltune-mpi` (`.ci/run` does both); they are skipped loudly otherwise, and
//! required with `RLTUNE_REQUIRE_MPI=1`.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::rltune;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// `target/<profile>/rltune-mpi` and `mpirun`, or a loud skip.
fn mpi_binary() -> Option<PathBuf> {
    let require = std::env::var_os("RLTUNE_REQUIRE_MPI").is_some();
    let bin = Path::new(env!("CARGO_BIN_EXE_rltune")).with_file_name("rltune-mpi");
    let mpirun = Command::new("mpirun").arg("--version").output().is_ok_and(|o| o.status.success());
    if bin.is_file() && mpirun {
        return Some(bin);
    }
    assert!(!require, "RLTUNE_REQUIRE_MPI is set but {} or mpirun is missing", bin.display());
    eprintln!(
        "SKIPPED: needs OpenMPI and `cargo build -p rltune-cli --features mpi` copied to {}",
        bin.display()
    );
    None
}

/// `mpirun --oversubscribe` with `apps`: one `(processes, args)` per application (MPMD).
fn mpirun(bin: &Path, apps: &[(usize, Vec<String>)]) -> Output {
    let mut cmd = Command::new("mpirun");
    cmd.arg("--oversubscribe");
    for (k, (n, args)) in apps.iter().enumerate() {
        if k > 0 {
            cmd.arg(":");
        }
        cmd.args(["-np", &n.to_string()]).arg(bin).args(args);
    }
    // A session directory of its own for each launch: the tests run concurrently, and under load
    // Open MPI's shared one failed once ("orte_session_dir failed").
    static LAUNCH: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = LAUNCH.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let session = std::env::temp_dir().join(format!("rltune-mpirun-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&session).expect("create the mpirun session directory");
    cmd.env("OMPI_MCA_orte_tmpdir_base", &session)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("HF_HUB_OFFLINE", "1")
        .env("RUST_LOG", "warn")
        .env("RLTUNE_DIST_TIMEOUT_S", "60");
    let out = cmd.output().expect("run mpirun");
    let _ = std::fs::remove_dir_all(&session);
    out
}

/// The tiny arithmetic quickstart's SFT policy and GRPO config, with a reward that varies
/// within each group (digits minus half the length), so that every step has gradients.
fn grpo_setup(tmp: &Path) -> Vec<String> {
    let qs = tmp.join("qs");
    let out = rltune(&["quickstart", "--task", "arithmetic", "--preset", "tiny", "--output", s(&qs)]);
    assert!(out.status.success(), "{}", text(&out));
    let reward = tmp.join("reward.py");
    std::fs::write(
        &reward,
        "import json, sys\nfor line in sys.stdin:\n    r = json.loads(line)[\"response\"]\n    \
         print(sum(c.isdigit() for c in r) - 0.5 * len(r), flush=True)\n",
    )
    .unwrap();
    [
        "ppo".to_string(),
        "--config".into(),
        s(&qs.join("grpo.toml")).into(),
        "--set".into(),
        "generation.temperature=2.0".into(),
        "--set".into(),
        "grpo.temperature=2.0".into(),
        "--set".into(),
        "grpo.max_steps=3".into(),
        "--set".into(),
        format!("reward.sources=[{{kind=\"command\",command=[\"python3\",{:?}]}}]", s(&reward)),
    ]
    .to_vec()
}

/// `base`, then `--set S` for each of `sets`.
fn with_sets(base: &[&str], sets: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = base.iter().map(|x| x.to_string()).collect();
    for e in sets {
        a.extend(["--set".into(), e.to_string()]);
    }
    a
}

/// Runs `one` as one process and `two` under `mpirun -np 2`; both must succeed. Returns their
/// outputs.
fn one_and_two(bin: &Path, one: &[String], two: Vec<String>) -> (Output, Output) {
    let out1 = rltune(&one.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(out1.status.success(), "{}", text(&out1));
    let out2 = mpirun(bin, &[(2, two)]);
    assert!(out2.status.success(), "{}", text(&out2));
    (out1, out2)
}

/// The tiny preset of quickstart `task`, written to `dir`.
fn tiny_quickstart(dir: &Path, task: &str) -> PathBuf {
    let out = rltune(&["quickstart", "--task", task, "--preset", "tiny", "--output", s(dir)]);
    assert!(out.status.success(), "{}", text(&out));
    dir.to_path_buf()
}

fn metrics(run: &Path) -> Vec<BTreeMap<String, serde_json::Value>> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn weights(path: &Path) -> BTreeMap<String, Vec<f32>> {
    candle_core::safetensors::load(path, &candle_core::Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

/// The largest difference between the weights in `a` and `b`, and the largest move of a weight
/// of `a` from `init` (tensors `init` lacks, such as a new value head, are not counted).
fn compare_weights(a: &Path, b: &Path, init: &Path) -> (f32, f32) {
    let (w1, w2, w0) = (weights(a), weights(b), weights(init));
    let (mut diff, mut moved) = (0f32, 0f32);
    for (k, a) in &w1 {
        for (i, (x, y)) in a.iter().zip(&w2[k]).enumerate() {
            diff = diff.max((x - y).abs());
            if let Some(z) = w0.get(k).and_then(|w| w.get(i)) {
                moved = moved.max((x - z).abs());
            }
        }
    }
    (diff, moved)
}

/// Compares two runs' metrics (all but timings and the per-token arrays, which each process
/// logs for its share) and final weights; returns (worst metric difference, weights max |Δ|,
/// largest move of a weight from `init`).
fn compare_runs(
    one: &Path,
    two: &Path,
    steps: usize,
    model: &str,
    init: &Path,
    exact: &dyn Fn(&str) -> bool,
) -> (f64, f32, f32) {
    let (m1, m2) = (metrics(one), metrics(two));
    assert_eq!(m1.len(), steps);
    assert_eq!(m2.len(), steps, "rank 0 alone logs");
    let (mut worst, mut worst_key) = (0f64, String::new());
    for (a, b) in m1.iter().zip(&m2) {
        for (k, va) in a {
            // `ppo/policy/ratio_*` summarise a per-token array (padding included) that each
            // process logs for its own rows.
            if k.starts_with("time/") || k.starts_with("ppo/policy/ratio") {
                continue;
            }
            let vb = b.get(k).unwrap_or_else(|| panic!("{k} missing on two processes"));
            match (va.as_f64(), vb.as_f64()) {
                (Some(x), Some(y)) if exact(k) => assert_eq!(x, y, "{k}: the samples differ"),
                (Some(x), Some(y)) => {
                    // Relative, and absolute below 1 (a loss whose advantages cancel is ~1e-8
                    // of rounding either way).
                    let d = (x - y).abs() / x.abs().max(1.0);
                    if d > worst {
                        (worst, worst_key) = (d, k.clone());
                    }
                    assert!(d < 1e-5, "{k}: {x} vs {y}");
                }
                _ => {}
            }
        }
    }
    let (diff, moved) = compare_weights(&one.join(model), &two.join(model), init);
    eprintln!("worst metric: {worst_key}");
    (worst, diff, moved)
}

/// Two processes with 8 completions each (one prompt, 8 generations) against one process with
/// 16, three GRPO steps: the same samples, rewards and advantages, so the same metrics up to
/// the order of sums, and the same weights.
///
/// Tolerance (both tests): the gradient is averaged over the processes, `(g₀ + g₁)/2`, where one
/// process sums the rows in one pass; the two differ by the rounding of f32 sums (~1e-7
/// relative). Adam divides by the gradient's running RMS, so where a gradient is near zero that
/// rounding can move an update by up to the learning rate: the weights must agree within 1e-5
/// (a fifth of PPO's lr 5e-5, a hundredth of DPO's 1e-3), the metrics within 1e-5 (relative,
/// absolute below 1). Measured: GRPO weights 4.9e-8, metrics 1.6e-8; PPO weights 4.1e-7,
/// metrics 6.9e-7; DPO weights 3.7e-6, metrics 5.4e-8.
#[test]
fn grpo_on_two_processes_equals_one_process() {
    let Some(bin) = mpi_binary() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let args = grpo_setup(tmp.path());
    let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
    let dir = |d: &Path| vec!["--set".to_string(), format!("logging.dir={:?}", s(d))];
    let one_args = [args.clone(), dir(&one)].concat();
    let refs: Vec<&str> = one_args.iter().map(String::as_str).collect();
    let out = rltune(&refs);
    assert!(out.status.success(), "{}", text(&out));
    let mut two_args = [args.clone(), dir(&two)].concat();
    two_args.extend(["--set".into(), "grpo.per_device_train_batch_size=8".into()]);
    let out = mpirun(&bin, &[(2, two_args)]);
    assert!(out.status.success(), "{}", text(&out));

    let exact = |k: &str| k.starts_with("reward") || k.starts_with("completions/") || k == "num_tokens";
    let init = tmp.path().join("qs/sft/model.safetensors");
    let (worst, diff, moved) =
        compare_runs(&one, &two, 3, "checkpoints/step-3/model.safetensors", &init, &exact);
    eprintln!("GRPO, two processes vs one: metrics worst {worst:.1e}; weights max |Δ| {diff:.1e} (moved {moved:.1e})");
    assert!(moved > 1e-5, "the weights did not move: the test would prove nothing");
    assert!(diff < 1e-5, "weights differ by {diff}");

    // Two steps on one process, resumed on two. With the global batch changed (16 per process,
    // 32 in all) the resume is refused with the per-process batch that keeps it; with 8 it
    // continues as the straight one-process run did.
    let resumed = tmp.path().join("resumed");
    let mut first = [args.clone(), dir(&resumed)].concat();
    first.extend(["--set".into(), "grpo.max_steps=2".into()]);
    let out = rltune(&first.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(out.status.success(), "{}", text(&out));
    let mut again = [args.clone(), dir(&resumed)].concat();
    again.push("--resume".into());
    let out = mpirun(&bin, &[(2, again.clone())]);
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains("global batch of 16") && t.contains("Set [grpo] per_device_train_batch_size = 8"),
        "{t}"
    );
    again.extend(["--set".into(), "grpo.per_device_train_batch_size=8".into()]);
    let out = mpirun(&bin, &[(2, again)]);
    assert!(out.status.success(), "{}", text(&out));
    let (w1, w2) = (
        weights(&one.join("checkpoints/step-3/model.safetensors")),
        weights(&resumed.join("checkpoints/step-3/model.safetensors")),
    );
    let diff =
        w1.iter().flat_map(|(k, a)| a.iter().zip(&w2[k]).map(|(x, y)| (x - y).abs())).fold(0f32, f32::max);
    eprintln!("GRPO, 2 steps on one process then 1 on two vs 3 on one: weights max |Δ| {diff:.1e}");
    assert!(diff < 1e-5, "the resumed run differs by {diff}");
}

/// PPO on prompts (the tiny sentiment quickstart's policy and classifier reward): two processes
/// with `batch_size` 4 and `mini_batch_size` 2 against one with 8 and 4, two PPO epochs, three
/// steps. The same samples and scores; one permutation of the whole batch cut into global
/// minibatches, each process training on its rows; losses normalised by the global minibatch's
/// tokens. Tolerance: see the GRPO test.
#[test]
fn ppo_on_two_processes_equals_one_process() {
    let Some(bin) = mpi_binary() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let qs = tiny_quickstart(&tmp.path().join("qs"), "sentiment");
    let config = s(&qs.join("ppo.toml")).to_string();
    let init = qs.join("sft/model.safetensors");
    let critic = format!("critic.path={:?}", s(&qs.join("sft")));
    let exact = |k: &str| k.starts_with("env/reward") || k.starts_with("tokens/") || k == "ppo/mean_scores";
    // Without, then with a separate critic (a copy of the policy, its own Adam at lr 1e-3): its
    // value loss is normalised and its gradients averaged as the policy's.
    for (name, extra) in [("plain", vec![]), ("critic", vec![critic.as_str(), "critic.learning_rate=0.001"])]
    {
        let (one, two) = (tmp.path().join(format!("{name}-one")), tmp.path().join(format!("{name}-two")));
        let run = |dir: &Path, sets: &[&str]| {
            let dir = format!("logging.dir={:?}", s(dir));
            let all: Vec<&str> = ["ppo.ppo_epochs=2", &dir]
                .iter()
                .copied()
                .chain(extra.iter().copied())
                .chain(sets.iter().copied())
                .collect();
            with_sets(&["ppo", "--config", &config], &all)
        };
        one_and_two(&bin, &run(&one, &[]), run(&two, &["ppo.batch_size=4", "ppo.mini_batch_size=2"]));
        let (worst, diff, moved) =
            compare_runs(&one, &two, 3, "checkpoints/step-3/model.safetensors", &init, &exact);
        eprintln!("PPO ({name}), two processes vs one: metrics worst {worst:.1e}; weights max |Δ| {diff:.1e} (moved {moved:.1e})");
        assert!(moved > 1e-5, "the weights did not move: the test would prove nothing");
        assert!(diff < 1e-5, "weights differ by {diff}");
        if name == "critic" {
            let (_, diff, moved) =
                compare_runs(&one, &two, 3, "checkpoints/step-3/critic/model.safetensors", &init, &exact);
            eprintln!("  the critic: weights max |Δ| {diff:.1e} (moved {moved:.1e})");
            assert!(moved > 1e-5 && diff < 1e-5, "critic weights differ by {diff} (moved {moved})");
        }
    }
}

/// Rejection sampling on prompts (the tiny sentiment quickstart): the best of each prompt's two
/// samples (groups held by one process), then the best quarter of one sample per prompt (ranked
/// over both processes); the kept examples of both are gathered and fine-tuned on, data-parallel.
/// Two processes with 4 prompts and SFT batches of 2 against one with 8 and 4.
#[test]
fn rejection_sampling_on_two_processes_equals_one_process() {
    let Some(bin) = mpi_binary() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let qs = tiny_quickstart(&tmp.path().join("qs"), "sentiment");
    let config = s(&qs.join("ppo.toml")).to_string();
    let init = qs.join("sft/model.safetensors");
    for (name, keep) in [
        ("best-of-2", ["rejection.samples_per_prompt=2", "rejection.keep_top_n=1"]),
        ("top-quarter", ["rejection.samples_per_prompt=1", "rejection.keep_top_fraction=0.25"]),
    ] {
        let run = |dir: &Path, sets: &[&str]| {
            let dir = format!("logging.dir={:?}", s(dir));
            let all: Vec<&str> = ["algorithm.kind=\"rejection_sampling\"", keep[0], keep[1], &dir]
                .iter()
                .copied()
                .chain(sets.iter().copied())
                .collect();
            with_sets(&["ppo", "--config", &config], &all)
        };
        let (one, two) = (tmp.path().join(format!("{name}-one")), tmp.path().join(format!("{name}-two")));
        one_and_two(
            &bin,
            &run(&one, &["rejection.batch_size=4"]),
            run(&two, &["rejection.batch_size=2", "ppo.batch_size=4"]),
        );
        let exact =
            |k: &str| k.starts_with("env/reward") || k == "rejection/kept" || k == "rejection/candidates";
        let (worst, diff, moved) =
            compare_runs(&one, &two, 3, "checkpoints/step-3/model.safetensors", &init, &exact);
        eprintln!("rejection sampling ({name}), two processes vs one: metrics worst {worst:.1e}; weights max |Δ| {diff:.1e} (moved {moved:.1e})");
        assert!(moved > 1e-5, "the weights did not move: the test would prove nothing");
        assert!(diff < 1e-5, "weights differ by {diff}");
    }
}

/// PPO on text games (the tiny adventure quickstart): each process plays its own environments
/// (rank r the environments r·num_envs.. of each round) and trains on its turns; the episode
/// counts are summed. The turns differ from one process's, so this checks the run, not the
/// numbers: two steps, rank 0's metrics with both processes' episodes, one checkpoint.
#[test]
fn ppo_on_games_runs_on_two_processes() {
    let Some(bin) = mpi_binary() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let qs = tmp.path().join("qs");
    let out = rltune(&["quickstart", "--task", "adventure", "--preset", "tiny", "--output", s(&qs)]);
    assert!(out.status.success(), "{}", text(&out));
    let run = tmp.path().join("run");
    let args: Vec<String> = [
        "ppo",
        "--config",
        s(&qs.join("ppo.toml")),
        "--set",
        &format!("logging.dir={:?}", s(&run)),
        "--set",
        "ppo.batch_size=4",
        "--set",
        "ppo.mini_batch_size=2",
    ]
    .iter()
    .map(|x| x.to_string())
    .collect();
    let out = mpirun(&bin, &[(2, args.clone())]);
    assert!(out.status.success(), "{}", text(&out));
    let m = metrics(&run);
    assert_eq!(m.len(), 2, "rank 0 alone logs");
    for line in &m {
        let episodes = line["env/episodes"].as_f64().unwrap();
        // Each process plays at least one round of its 4 environments.
        assert!(episodes >= 8.0, "both processes' episodes are counted: {episodes}");
        assert!(line["time/dist/all_reduce"].as_f64().is_some_and(|t| t >= 0.0));
    }
    assert!(run.join("checkpoints/step-2/model.safetensors").is_file());

    // `[episodes] train_turns = "round"`: each process trains on every turn of its round but the
    // remainder, as many as the process that played the fewest (agreed through the collective).
    let round_run = tmp.path().join("round");
    let mut round_args = args.clone();
    round_args[4] = format!("logging.dir={:?}", s(&round_run));
    round_args.extend(["--set".to_string(), "episodes.train_turns=\"round\"".to_string()]);
    let out = mpirun(&bin, &[(2, round_args)]);
    assert!(out.status.success(), "{}", text(&out));
    for line in &metrics(&round_run) {
        let trained = line["env/trained_turns"].as_f64().unwrap();
        assert!(trained >= 2.0 && trained % 2.0 == 0.0, "whole minibatches of 2: {trained}");
    }
}

/// Trajectory GRPO and RLOO on text games (the tiny adventure quickstart, `--algorithm grpo` /
/// `rloo`): two processes with one game each (4 plays, `per_device_train_batch_size` 4) against
/// one process with both games (8), three steps of two iterations. Each process's episodes
/// start on a round of the environments, so it plays and samples exactly what one process does
/// for those games; the advantages are computed over both processes' returns and the loss
/// normalised over both processes' turns (which differ in number), so the metrics and weights
/// agree up to the order of sums. Tolerance: see the GRPO test. Measured: GRPO weights 1.8e-8,
/// metrics 7.5e-9; RLOO weights 8.6e-8, metrics 5.6e-8.
#[test]
fn trajectory_grpo_and_rloo_on_games_on_two_processes_equal_one_process() {
    let Some(bin) = mpi_binary() else { return };
    for algorithm in ["grpo", "rloo"] {
        let tmp = tempfile::tempdir().unwrap();
        let qs = tmp.path().join("qs");
        let out = rltune(&[
            "quickstart",
            "--task",
            "adventure",
            "--preset",
            "tiny",
            "--algorithm",
            algorithm,
            "--output",
            s(&qs),
        ]);
        assert!(out.status.success(), "{}", text(&out));
        let config = qs.join(format!("{algorithm}.toml"));
        let steps = format!("{algorithm}.max_steps=6");
        // Admissible actions in one-room, one-object games (no doors: the quickstart's family
        // has them, and one room has none to close): some plays of a game win and some
        // do not, so the groups have advantages (the free-text tiny agent never acts validly).
        let base = [
            "ppo",
            "--config",
            s(&config),
            "--set",
            &steps,
            "--set",
            "agent.actions=\"admissible\"",
            "--set",
            "env.adventure.quest_length=1",
            "--set",
            "env.adventure.rooms=1",
            "--set",
            "env.adventure.doors=false",
            "--set",
            "env.adventure.distractors=0",
        ];
        let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
        let batch = |n: usize| format!("{algorithm}.per_device_train_batch_size={n}");
        let one_args = with_sets(&base, &[&format!("logging.dir={:?}", s(&one)), &batch(8)]);
        let two_args = with_sets(&base, &[&format!("logging.dir={:?}", s(&two)), &batch(4)]);
        one_and_two(&bin, &one_args, two_args);
        let exact = |k: &str| {
            k.starts_with("reward")
                || k.starts_with("completions/")
                || k == "num_tokens"
                || k == "env/episodes"
        };
        let init = qs.join("bc/model.safetensors");
        let (worst, diff, moved) =
            compare_runs(&one, &two, 3, "checkpoints/step-3/model.safetensors", &init, &exact);
        eprintln!(
            "trajectory {algorithm}, two processes vs one: metrics worst {worst:.1e}; weights max |Δ| {diff:.1e} \
             (moved {moved:.1e})"
        );
        assert!(moved > 1e-5, "{algorithm}: the weights did not move: the test would prove nothing");
        assert!(diff < 1e-5, "{algorithm}: weights differ by {diff}");
    }
}

/// DPO (the TRL fixture's tiny GPT-2 and reference): 8 pairs, two processes with 2 pairs per
/// micro-batch against one with 4, two optimizer steps (one epoch). Each process takes its half
/// of each global micro-batch of one shared permutation. Tolerance: see the GRPO test.
#[test]
fn dpo_on_two_processes_equals_one_process() {
    let Some(bin) = mpi_binary() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let fixture = |rel: &str| common::fixture(rel).to_str().unwrap().to_string();
    // The fixture's four distinct pairs, and each again with one more prompt token.
    let rows: Vec<String> = std::fs::read_to_string(common::fixture("dpo/rows.jsonl"))
        .unwrap()
        .lines()
        .take(4)
        .map(String::from)
        .collect();
    let mut data = rows.join("\n") + "\n";
    for r in &rows {
        data.push_str(&r.replacen("\"prompt\": \"", "\"prompt\": \"t1 ", 1));
        data.push('\n');
    }
    let data_path = tmp.path().join("pairs.jsonl");
    std::fs::write(&data_path, data).unwrap();
    let config = tmp.path().join("dpo.toml");
    std::fs::write(
        &config,
        "[dpo]\nlearning_rate = 0.001\nper_device_train_batch_size = 4\nbeta = 0.3\nmax_steps = 2\n",
    )
    .unwrap();
    let (init_dir, ref_dir) = (fixture("dpo/init"), fixture("dpo/ref"));
    let (data, config) = (s(&data_path).to_string(), s(&config).to_string());
    let run = |out: &Path, sets: &[&str]| {
        let base =
            ["dpo", "--model", &init_dir, "--ref-model", &ref_dir, "--data", &data, "--config", &config];
        with_sets(&[&base[..], &["--output", s(out)]].concat(), sets)
    };
    let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
    one_and_two(&bin, &run(&one, &[]), run(&two, &["dpo.per_device_train_batch_size=2"]));
    let init = common::fixture("dpo/init/model.safetensors");
    let (worst, diff, moved) =
        compare_runs(&one, &two, 2, "model.safetensors", &init, &|k| k == "num_tokens");
    eprintln!("DPO, two processes vs one: metrics worst {worst:.1e}; weights max |Δ| {diff:.1e} (moved {moved:.1e})");
    assert!(moved > 1e-5, "the weights did not move: the test would prove nothing");
    assert!(diff < 1e-5, "weights differ by {diff}");
}

/// SFT and a reward model (the tiny sentiment quickstart's policy and reviews): two processes
/// with 4 examples per step against one with 8, three steps each. Each process takes its share
/// of each step's examples; the loss is divided by the tokens (terms) of every process.
/// Tolerance: see the GRPO test.
#[test]
fn sft_and_reward_on_two_processes_equal_one_process() {
    let Some(bin) = mpi_binary() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let qs = tiny_quickstart(&tmp.path().join("qs"), "sentiment");
    let config = tmp.path().join("train.toml");
    std::fs::write(
        &config,
        "[training]\nlearning_rate = 0.001\nbatch_size = 8\nmax_steps = 3\nlr_scheduler_type = \"constant\"\n\
         eval_fraction = 0.05\n",
    )
    .unwrap();
    let (data, config) = (s(&qs.join("data/reviews.jsonl")).to_string(), s(&config).to_string());
    for (command, model) in [("sft", "sft"), ("reward", "classifier")] {
        let model = qs.join(model);
        let run = |out: &Path, sets: &[&str]| {
            let base =
                [command, "--model", s(&model), "--data", &data, "--config", &config, "--output", s(out)];
            with_sets(&base, sets)
        };
        let (one, two) =
            (tmp.path().join(format!("{command}-one")), tmp.path().join(format!("{command}-two")));
        let (out1, out2) = one_and_two(&bin, &run(&one, &[]), run(&two, &["training.batch_size=4"]));
        let (diff, moved) = compare_weights(
            &one.join("model.safetensors"),
            &two.join("model.safetensors"),
            &model.join("model.safetensors"),
        );
        // The final train loss and the eval, as reported: the same to the printed digits.
        let tail = |o: &Output| {
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .filter(|l| l.contains("final train loss") || l.starts_with("eval:"))
                .map(String::from)
                .collect::<Vec<_>>()
        };
        eprintln!("{command}, two processes vs one: weights max |Δ| {diff:.1e} (moved {moved:.1e})");
        assert_eq!(tail(&out1), tail(&out2), "{command}: the reported losses differ");
        assert_eq!(tail(&out1).len(), 2, "{command}: a train and an eval line");
        assert!(moved > 1e-5, "{command}: the weights did not move: the test would prove nothing");
        assert!(diff < 1e-5, "{command}: weights differ by {diff}");
    }
}

/// One process forced through the collectives (`RLTUNE_DIST=single`: every gather, reduction
/// and gradient all-reduce runs, as the identity) gives the plain run's weights bit for bit: the
/// data-parallel code paths change nothing on one process. Also the check the GPU kit runs with
/// `RLTUNE_DIST=nccl` on one GPU. Needs no MPI.
#[test]
fn one_process_through_the_collectives_is_bitwise_the_plain_run() {
    let tmp = tempfile::tempdir().unwrap();
    let args = grpo_setup(tmp.path());
    let run = |dir: &Path, dist: Option<&str>| {
        let mut a = args.clone();
        a.extend(["--set".into(), format!("logging.dir={:?}", s(dir))]);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rltune"));
        cmd.args(&a).env("RUST_LOG", "info");
        if let Some(d) = dist {
            cmd.env("RLTUNE_DIST", d);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", text(&out));
        text(&out)
    };
    let (plain, forced) = (tmp.path().join("plain"), tmp.path().join("forced"));
    run(&plain, None);
    let log = run(&forced, Some("single"));
    assert!(log.contains("RLTUNE_DIST=single: one process through the collectives"), "{log}");
    let init = tmp.path().join("qs/sft/model.safetensors");
    let (diff, moved) = compare_weights(
        &plain.join("checkpoints/step-3/model.safetensors"),
        &forced.join("checkpoints/step-3/model.safetensors"),
        &init,
    );
    assert!(moved > 1e-5, "the weights did not move: the test would prove nothing");
    assert_eq!(diff, 0.0, "one process through the collectives differs by {diff}");
    // NCCL on the CPU, or in a build without it, is refused with the fix.
    let out = Command::new(env!("CARGO_BIN_EXE_rltune"))
        .args(&args)
        .args(["--set", &format!("logging.dir={:?}", s(&tmp.path().join("nccl")))])
        .env("RLTUNE_DIST", "nccl")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let t = text(&out);
    assert!(t.contains("RLTUNE_DIST=nccl needs the run on a GPU"), "{t}");
    let out =
        Command::new(env!("CARGO_BIN_EXE_rltune")).args(&args).env("RLTUNE_DIST", "nvlink").output().unwrap();
    assert!(text(&out).contains("RLTUNE_DIST=\"nvlink\": expected"), "{}", text(&out));
}

/// A process whose command line differs from rank 0's is refused at start-up, and named;
/// every process ends. (`rltune ppo` also compares the resolved configuration, which catches
/// config files that differ between machines.)
#[test]
fn a_rank_with_another_config_is_refused_and_named() {
    let Some(bin) = mpi_binary() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let mut args = grpo_setup(tmp.path());
    args.extend(["--set".into(), format!("logging.dir={:?}", s(&tmp.path().join("run")))]);
    args.extend(["--set".into(), "grpo.per_device_train_batch_size=8".into()]);
    let mut other = args.clone();
    other.extend(["--set".into(), "grpo.learning_rate=0.001".into()]);
    let t = std::time::Instant::now();
    let out = mpirun(&bin, &[(1, args), (1, other)]);
    let t = t.elapsed();
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(all.contains("rank 1 differs from rank 0: the command line"), "{all}");
    assert!(t.as_secs() < 60, "took {t:?}");
}

/// Commands that are not data-parallel are refused under a launcher, as is a build without MPI.
#[test]
fn launches_that_cannot_run_are_refused_with_the_fix() {
    let run = |vars: &[(&str, &str)], args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_rltune"))
            .args(args)
            .envs(vars.iter().copied())
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        text(&out)
    };
    let ompi = [("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")];
    let err = run(&ompi, &["generate", "--model", "nowhere", "--prompt", "x"]);
    assert!(err.contains("`dpo`, `sft` and `reward` are"), "names what is data-parallel: {err}");
    assert!(
        err.contains("`rltune generate` was started as rank 0 of 2") && err.contains("not data-parallel"),
        "{err}"
    );
    let err = run(&ompi, &["play", "--env", "nowhere.toml", "--agent", "random"]);
    assert!(err.contains("`rltune play` was started as rank 0 of 2"), "{err}");
    let err = run(
        &[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")],
        &["ppo", "--config", "nowhere.toml"],
    );
    assert!(err.contains("torchrun-style") && err.contains("mpirun -np 2"), "{err}");
    let err =
        run(&[("OMPI_COMM_WORLD_RANK", "x"), ("OMPI_COMM_WORLD_SIZE", "2")], &["ppo", "--config", "c.toml"]);
    assert!(err.contains("OMPI_COMM_WORLD_RANK: \"x\" is not a whole number"), "{err}");
    if cfg!(not(feature = "mpi")) {
        let err = run(&ompi, &["ppo", "--config", "nowhere.toml"]);
        assert!(err.contains("built without MPI") && err.contains("--features mpi"), "{err}");
    }
}
