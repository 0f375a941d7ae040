use std::collections::HashSet;

use super::generate::generate;
use super::heuristic::{heuristic_labels, HeuristicAgent};
use super::*;
use crate::adventure::{heldout_seed, train_seed};
use crate::play::{play, RandomAgent};

fn label(class: usize, begin: bool) -> Label {
    Label { class, begin }
}

#[test]
fn commands_round_trip_and_others_are_refused() {
    let all = commands();
    assert_eq!(all.len(), 15);
    for c in &all {
        assert_eq!(&Label::parse(c).unwrap().command(), c);
    }
    assert_eq!(Label::parse("  BEGIN   concluding statement\nmore"), Some(label(6, true)));
    assert_eq!(Label::parse("begin Thesis"), None);
    assert_eq!(Label::parse("start Claim"), None);
    assert_eq!(Label::parse(""), None);
}

#[test]
fn labels_make_spans_like_conlleval_chunks() {
    let segs = ["a b", "c", "d e f", "g", "h i"]
        .iter()
        .map(|t| Segment { text: t.to_string(), class: NONE, begin: false })
        .collect();
    let essay = Essay::new(0, segs);
    assert_eq!(essay.word_starts, vec![0, 2, 3, 6, 7, 9]);
    let spans = essay.spans(&[
        label(2, true),     // Claim 0..2
        label(2, false),    // continues: Claim 0..3
        label(5, false),    // continue Evidence after a Claim: a new Evidence 3..6
        label(NONE, false), // outside
        label(5, false),    // continue after none: a new Evidence 7..9
    ]);
    assert_eq!(
        spans,
        vec![Span::new(2, 0..3), Span::new(5, 3..6), Span::new(5, 7..9)],
        "continue of another class, or after none, opens an element"
    );
    // begin after the same class splits.
    let spans = essay.spans(&[label(2, true), label(2, true)]);
    assert_eq!(spans, vec![Span::new(2, 0..2), Span::new(2, 2..3)]);
}

#[test]
fn gold_labels_score_one_and_the_walkthrough_wins() {
    for i in 0..20 {
        let essay = generate(train_seed(i), false);
        assert_eq!(essay.score(&essay.gold_labels()), 1.0);
        let mut env = Essays::new(1, EssaysConfig::default(), 100).unwrap();
        let first = env.reset(&[0], &[Reset { seed: Some(train_seed(i)), game: None }]).unwrap().remove(0);
        assert!(first.observation.starts_with("Segment 1 of "), "{}", first.observation);
        let plan = env.walkthrough(0).unwrap();
        assert_eq!(plan.len(), essay.segments.len());
        let mut total = 0.0;
        for (k, a) in plan.iter().enumerate() {
            let s = env.step(&[(0, a.clone())]).unwrap().remove(0).unwrap();
            total += s.reward;
            assert_eq!(s.done(), k + 1 == plan.len());
        }
        assert_eq!(total, 1.0);
    }
}

#[test]
fn dense_rewards_telescope_to_the_final_score() {
    let mut env =
        Essays::new(1, EssaysConfig { dense_reward: true, ..EssaysConfig::default() }, 100).unwrap();
    let mut rng_labels = commands();
    for seed in 0..10u64 {
        env.reset(&[0], &[Reset { seed: Some(seed), game: None }]).unwrap();
        let (mut total, mut last) = (0.0, EnvStep::default());
        let mut k = seed as usize;
        while !last.done() {
            // a deterministic mix of right and wrong labels
            let action = if k.is_multiple_of(3) {
                rng_labels[k % 15].clone()
            } else {
                env.walkthrough(0).unwrap()[0].clone()
            };
            last = env.step(&[(0, action)]).unwrap().remove(0).unwrap();
            total += last.reward;
            k += 1;
        }
        assert!((total - last.score).abs() < 1e-9, "seed {seed}: {total} vs {}", last.score);
        assert!(last.score < 1.0, "wrong labels cost something");
        rng_labels.rotate_left(1);
    }
}

#[test]
fn invalid_actions_label_none_and_truncation_scores_the_rest_as_none() {
    let mut env = Essays::new(1, EssaysConfig::default(), 3).unwrap();
    env.reset(&[0], &[Reset { seed: Some(5), game: None }]).unwrap();
    let s = env.step(&[(0, "go north".into())]).unwrap().remove(0).unwrap();
    assert!(s.invalid && !s.done() && s.reward == 0.0);
    env.step(&[(0, "none".into())]).unwrap().remove(0).unwrap();
    let s = env.step(&[(0, "none".into())]).unwrap().remove(0).unwrap();
    assert!(s.truncated && !s.terminated && s.score == 0.0 && s.reward == 0.0);
    let e = env.step(&[(0, "none".into())]).unwrap().remove(0).unwrap_err().to_string();
    assert!(e.contains("reset it first"), "{e}");
}

#[test]
fn essays_vary_and_over_split_about_two_to_one() {
    let (mut segs, mut elems) = (0usize, 0usize);
    let mut texts = HashSet::new();
    let mut classes = HashSet::new();
    for i in 0..300 {
        let e = generate(train_seed(i), false);
        segs += e.segments.len();
        elems += e.gold_spans().len();
        texts.insert(e.text());
        for span in e.gold_spans() {
            classes.insert(span.class);
        }
    }
    assert_eq!(classes.len(), CLASSES.len(), "every class occurs");
    let ratio = segs as f64 / elems as f64;
    assert!((1.6..=2.6).contains(&ratio), "segments per element {ratio}");
    assert_eq!(texts.len(), 300, "no two essays alike");
}

#[test]
fn heldout_essays_use_element_texts_training_never_shows() {
    let elements = |heldout: bool, seeds: &mut dyn Iterator<Item = u64>| -> HashSet<String> {
        let mut out = HashSet::new();
        for s in seeds {
            let e = generate(s, heldout);
            let text = e.text();
            let words: Vec<&str> = text.split_whitespace().collect();
            for span in e.gold_spans() {
                out.insert(span.words.iter().map(|&w| words[w]).collect::<Vec<_>>().join(" "));
            }
        }
        out
    };
    let train = elements(false, &mut (0..400).map(train_seed));
    let held = elements(true, &mut (0..400).map(heldout_seed));
    let shared = held.intersection(&train).count();
    assert_eq!(shared, 0, "held-out elements seen in training: {shared} of {}", held.len());
}

#[test]
fn baselines_order_random_below_heuristic_below_gold() {
    let mut env = Essays::new(4, EssaysConfig::default(), 100).unwrap();
    let resets = |i: usize| Reset { seed: Some(heldout_seed(i as u64)), game: None };
    let (random, _) = play(&mut env, &mut RandomAgent::new(1), 40, &resets).unwrap();
    let (heur, _) = play(&mut env, &mut HeuristicAgent, 40, &resets).unwrap();
    let mean = |eps: &[crate::play::Episode]| eps.iter().map(|e| e.score).sum::<f64>() / eps.len() as f64;
    let (r, h) = (mean(&random), mean(&heur));
    assert!(r < 0.2, "random {r}");
    assert!(h > r + 0.2 && h < 0.95, "heuristic {h}, random {r}");
    // The agent and the pure function agree.
    let essay = generate(heldout_seed(0), true);
    let texts: Vec<&str> = essay.segments.iter().map(|s| s.text.as_str()).collect();
    let by_fn = essay.score(&heuristic_labels(&texts));
    assert!((by_fn - heur[0].score).abs() < 1e-12, "{by_fn} vs {}", heur[0].score);
}
