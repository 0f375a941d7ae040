//! TextWorld through the bridge (`tools/textworld/bridge.py`) and `CommandEnv`, on games made by
//! `tools/textworld/make_games.sh`. Runs when `RLTUNE_TEXTWORLD_PYTHON` (a Python with
//! `textworld`) and `RLTUNE_TEXTWORLD_GAMES` (the games' folder) are set, as `.ci/run` sets them
//! after installing TextWorld; otherwise it says loudly that it was skipped, and fails if
//! `RLTUNE_REQUIRE_TEXTWORLD` is set.

use std::path::PathBuf;

use rltune::agent::config::{EnvKind, EnvSection};
use rltune::envs::play::{play, PlayReport, RandomAgent};
use rltune::envs::Reset;

/// The interpreter and the games folder, or `None` (after saying why) when TextWorld is absent.
fn textworld() -> Option<(String, PathBuf)> {
    let python = std::env::var("RLTUNE_TEXTWORLD_PYTHON").ok();
    let games = std::env::var("RLTUNE_TEXTWORLD_GAMES").ok().map(PathBuf::from);
    match (python, games) {
        (Some(p), Some(g)) if g.join("coin5_s6.z8").is_file() => Some((p, g)),
        _ => {
            let why = "SKIPPED: TextWorld tests need RLTUNE_TEXTWORLD_PYTHON and RLTUNE_TEXTWORLD_GAMES \
                       (tools/textworld/install.sh, then make_games.sh)";
            assert!(std::env::var_os("RLTUNE_REQUIRE_TEXTWORLD").is_none(), "{why}");
            eprintln!("{why}");
            None
        }
    }
}

fn section(python: String, games: &std::path::Path, num_envs: usize) -> EnvSection {
    EnvSection {
        kind: EnvKind::Textworld,
        num_envs,
        max_steps: 20,
        python,
        games: vec![games.join("*.z8").to_string_lossy().into_owned()],
        timeout_s: 60.0,
        ..EnvSection::default()
    }
}

#[test]
fn the_bridge_plays_generated_games_through_command_env() {
    let Some((python, games)) = textworld() else { return };
    let cfg = section(python, &games, 2);
    let files = cfg.game_files().unwrap();
    assert!(files.len() >= 2, "{files:?}");
    let mut env = cfg.build().unwrap();
    let first = env
        .reset(&[0, 1], &[Reset { seed: None, game: Some(0) }, Reset { seed: None, game: Some(1) }])
        .unwrap();
    for s in &first {
        assert!(!s.observation.is_empty() && !s.admissible_commands.is_empty() && s.max_score > 0.0, "{s:?}");
        assert!(
            !s.observation.contains("-= ") || !s.observation.trim_end().ends_with("0/0"),
            "status line kept"
        );
    }
    // A newline runs only the first line; an out-of-game command is refused, not sent.
    let out =
        env.step(&[(0, format!("{}\nquit", first[0].admissible_commands[0])), (1, "quit".into())]).unwrap();
    let (a, b) = (out[0].as_ref().unwrap(), out[1].as_ref().unwrap());
    assert!(!a.invalid, "the first line was admissible: {a:?}");
    assert!(b.invalid && b.infos.get("sent") == Some(&serde_json::Value::Bool(false)), "{b:?}");
    assert_eq!(b.moves, 1, "a refused action still counts a move");
}

#[test]
fn a_random_agent_plays_textworld_episodes() {
    let Some((python, games)) = textworld() else { return };
    let cfg = section(python, &games, 4);
    let n = cfg.game_files().unwrap().len();
    let mut env = cfg.build().unwrap();
    let start = std::time::Instant::now();
    let (eps, dropped) =
        play(env.as_mut(), &mut RandomAgent::new(0), 12, &|i| cfg.reset_for(0, i, n)).unwrap();
    let report = PlayReport::of(&eps, dropped, start.elapsed().as_secs_f64());
    println!("random agent on {n} TextWorld games: {report:?}");
    assert_eq!((report.episodes, dropped), (12, 0));
    assert!(eps.iter().all(|e| e.steps <= 20 && (e.won || e.lost || e.truncated)));
    assert!(report.mean_steps > 1.0);
}

/// The bridge's walkthroughs make demonstrations: without noise they replay TextWorld's plan and
/// win; with noise they take detours (every label is then the plan from the detour's state, which
/// walks back) and still end in the win.
#[test]
fn demonstrations_come_from_the_bridges_walkthroughs_with_detours() {
    use rltune::envs::demos::demonstrations;
    use rltune::envs::play::PromptTemplate;
    let Some((python, games)) = textworld() else { return };
    let mut cfg = section(python, &games, 1);
    cfg.games = vec![games.join("coin5_s6.z8").to_string_lossy().into_owned()];
    let mut env = cfg.build_with(true).unwrap();
    let first = env.reset(&[0], &[Reset::default()]).unwrap().remove(0);
    let plan = env.walkthrough(0).expect("the bridge sends walkthroughs when asked");
    assert!(!plan.is_empty() && plan.last().unwrap() == "take coin", "{plan:?}");
    assert!(first.admissible_commands.contains(&plan[0]), "{plan:?} vs {:?}", first.admissible_commands);
    let t = PromptTemplate::default();
    let reset = [Reset { seed: None, game: Some(0) }];
    let clean = demonstrations(env.as_mut(), &t, &reset, 20, 0.0, 1).unwrap();
    let actions: Vec<&str> = clean.iter().map(|d| d.action.as_str()).collect();
    assert_eq!(actions, plan.iter().map(String::as_str).collect::<Vec<_>>());
    let mut longer = 0;
    for seed in 0..4 {
        let noisy = demonstrations(env.as_mut(), &t, &reset, 40, 0.5, seed).unwrap();
        assert_eq!(noisy.last().map(|d| d.action.as_str()), Some("take coin"), "seed {seed}: {noisy:?}");
        longer += usize::from(noisy.len() > clean.len());
    }
    assert!(longer > 0, "noise at 0.5 made no detour in 4 episodes");
    // Without the flag the bridge sends none.
    let mut plain = cfg.build().unwrap();
    plain.reset(&[0], &[Reset::default()]).unwrap();
    assert_eq!(plain.walkthrough(0), None);
}

/// `rltune quickstart --task textworld --preset tiny` as a library call: every stage runs on real
/// TextWorld games (one for training, one for validation, one held out) and the summary compares
/// the three agents on the same held-out episodes, and BC and the RL policy on the validation
/// episodes. The default RL stage is trajectory GRPO; PPO (`--algorithm ppo`) then trains from
/// the same cached BC policy in the same directory.
#[test]
fn the_textworld_quickstart_runs_end_to_end() {
    use rltune_cli::tasks::{run_textworld_quickstart, TextworldGames, TextworldQuickstartConfig};
    let Some((python, games)) = textworld() else { return };
    let path = |name: &str| games.join(name).to_string_lossy().into_owned();
    let mut cfg = TextworldQuickstartConfig::tiny();
    cfg.game = TextworldGames {
        python,
        train: vec![path("custom_w3_o5_q3_s2.z8")],
        heldout: vec![path("treasure5_s4.z8")],
        validation: vec![path("coin5_s6.z8")],
    };
    let dir = tempfile::tempdir().unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let runtime = rltune::runtime::Runtime::cpu();
    let mut stages = Vec::new();
    let s = run_textworld_quickstart(dir.path(), &cfg, &runtime, &stop, &mut |e| {
        if let rltune_cli::tasks::Event::Done { stage, .. } = e {
            stages.push(stage);
        }
    })
    .unwrap();
    assert_eq!(stages, ["demos", "tokenizer", "bc", "grpo", "eval"]);
    assert_eq!(s.config.rl_stage(), "grpo", "GRPO is TextWorld's default");
    assert!(s.demonstrations >= cfg.demo_games, "{}", s.demonstrations);
    for r in [&s.random, &s.bc, &s.ppo] {
        assert_eq!((r.episodes, r.dropped_episodes), (cfg.eval_episodes, 0), "{r:?}");
        assert!(r.mean_steps >= 1.0 && r.mean_steps <= cfg.max_steps as f64, "{r:?}");
    }
    let v = s.validation.as_ref().expect("the validation games are played");
    for r in [&v.bc, &v.rl] {
        assert_eq!((r.episodes, r.dropped_episodes), (cfg.validation_episodes, 0), "{r:?}");
    }
    assert!(dir.path().join("summary-grpo.json").is_file());
    let mut ppo = cfg.clone();
    ppo.algorithm = rltune::run::config::AlgorithmKind::Ppo;
    let mut stages = Vec::new();
    let p = run_textworld_quickstart(dir.path(), &ppo, &runtime, &stop, &mut |e| {
        if let rltune_cli::tasks::Event::Done { stage, .. } = e {
            stages.push(stage);
        }
    })
    .unwrap();
    assert_eq!(stages, ["ppo", "eval"], "PPO reuses the demonstrations, the tokenizer and BC");
    let rates = |r: &PlayReport| (r.win_rate, r.mean_steps, r.mean_normalized_score);
    assert_eq!(rates(&p.bc), rates(&s.bc), "the same BC policy on the same test episodes");
    assert!(dir.path().join("summary.json").is_file());
    for stage in ["grpo", "ppo"] {
        let toml = std::fs::read_to_string(dir.path().join(format!("{stage}.toml"))).unwrap();
        assert!(toml.contains("coin5_s6.z8"), "{stage}'s evaluation plays the validation games:\n{toml}");
        assert!(!toml.contains("treasure5_s4.z8"), "{stage} never plays the test games:\n{toml}");
    }
    // Overlapping splits, a missing validation set and a missing interpreter are refused before
    // anything runs.
    let mut both = cfg.clone();
    both.game.heldout = vec![path("custom_w3_o5_q3_s2.z8")];
    let e = run_textworld_quickstart(&dir.path().join("x"), &both, &runtime, &stop, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("both a training and a held-out game"), "{e}");
    let mut both = cfg.clone();
    both.game.validation = vec![path("treasure5_s4.z8")];
    let e = run_textworld_quickstart(&dir.path().join("w"), &both, &runtime, &stop, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("both a validation and a held-out game"), "{e}");
    let mut old = cfg.clone();
    old.game.validation = vec![path("validation/*.z8")];
    let e = run_textworld_quickstart(&dir.path().join("v"), &old, &runtime, &stop, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("game.validation") && e.to_string().contains("make_game_set.sh"), "{e}");
    let mut nopy = cfg.clone();
    nopy.game.python = "/no/such/venv/bin/python".into();
    let e = run_textworld_quickstart(&dir.path().join("y"), &nopy, &runtime, &stop, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("tools/textworld/install.sh"), "{e}");
}
