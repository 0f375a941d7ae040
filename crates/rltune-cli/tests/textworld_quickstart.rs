//! The TextWorld quickstart as a library call (skipped, saying why, without TextWorld).

use std::path::PathBuf;

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

/// `rltune quickstart --task textworld --preset tiny` as a library call: every stage runs on real
/// TextWorld games (two for training, one held out) and the summary compares the three agents on
/// the same held-out episodes.
#[test]
fn the_textworld_quickstart_runs_end_to_end() {
    use rltune_cli::tasks::{run_textworld_quickstart, TextworldGames, TextworldQuickstartConfig};
    let Some((python, games)) = textworld() else { return };
    let path = |name: &str| games.join(name).to_string_lossy().into_owned();
    let mut cfg = TextworldQuickstartConfig::tiny();
    cfg.game = TextworldGames {
        python,
        train: vec![path("coin5_s6.z8"), path("custom_w3_o5_q3_s2.z8")],
        heldout: vec![path("treasure5_s4.z8")],
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
    assert_eq!(stages, ["demos", "tokenizer", "bc", "ppo", "eval"]);
    assert!(s.demonstrations >= cfg.demo_games, "{}", s.demonstrations);
    for r in [&s.random, &s.bc, &s.ppo] {
        assert_eq!((r.episodes, r.dropped_episodes), (cfg.eval_episodes, 0), "{r:?}");
        assert!(r.mean_steps >= 1.0 && r.mean_steps <= cfg.max_steps as f64, "{r:?}");
    }
    let ppo_toml = std::fs::read_to_string(dir.path().join("ppo.toml")).unwrap();
    assert!(ppo_toml.contains("treasure5_s4.z8"), "PPO's evaluation plays the held-out games:\n{ppo_toml}");
    // Overlapping splits and a missing interpreter are refused before anything runs.
    let mut both = cfg.clone();
    both.game.heldout = vec![path("coin5_s6.z8")];
    let e = run_textworld_quickstart(&dir.path().join("x"), &both, &runtime, &stop, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("both a training and a held-out game"), "{e}");
    let mut nopy = cfg.clone();
    nopy.game.python = "/no/such/venv/bin/python".into();
    let e = run_textworld_quickstart(&dir.path().join("y"), &nopy, &runtime, &stop, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("tools/textworld/install.sh"), "{e}");
}
