//! Transcript memory (`[agent] memory = "transcript"`, issue #39): each episode is one growing
//! token sequence, sampled on a KV cache carried from turn to turn.
//!
//! - The tokens a turn trains on are bitwise the tokens sampled: turn k+1's query is turn k's
//!   query, its action's tokens, and the new state's tokens, each tokenized once.
//! - The sampler's logprobs (under the admissible renormalisation) and values equal one
//!   uncached forward over the whole sequence, and each bootstrap is `game_gamma · V(next
//!   query)`, within 1e-5.
//! - A full context ends the episode, truncated, bootstrapping from the value of the
//!   sequence's last tokens that fit.
//! - `play_model` plays transcripts in rounds of the environments.

use candle_core::{DType, Device, Tensor, D};
use rltune::agent::model_agent::play_model;
use rltune::agent::rollout::{collect_episodes, Collected, RolloutConfig, Shaping};
use rltune::envs::play::{ActionMode, Memory, PromptTemplate};
use rltune::envs::{EnvStep, Reset, TextEnv};
use rltune::generation::GenerationConfig;
use rltune::models::gpt2::Gpt2Config;
use rltune::models::layers::{causal_bias, position_ids_from_mask};
use rltune::models::{CausalLm, CausalLmConfig, CausalLmWithValueHead};
use rltune::params::ParamStore;
use rltune::tokenizer::Tokenizer;

/// A byte-level BPE without merges: every byte one token (256), so any text round-trips.
pub(crate) fn byte_tokenizer() -> Tokenizer {
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    let mut chars: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    chars.sort_unstable();
    let vocab: serde_json::Map<String, serde_json::Value> =
        chars.iter().enumerate().map(|(i, c)| (c.to_string(), i.into())).collect();
    let level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": level, "post_processor": null, "decoder": level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "vocab": vocab, "merges": []}
    });
    let inner: tokenizers::Tokenizer = json.to_string().parse().unwrap();
    Tokenizer::from_inner(inner)
}

/// A random tiny GPT-2 over bytes with a value head and `positions` positions.
pub(crate) fn policy(positions: usize) -> CausalLmWithValueHead {
    let cfg = CausalLmConfig::Gpt2(Gpt2Config::tiny(258, 16, 2, 2, positions));
    let store = ParamStore::random(5, false, DType::F32, &Device::Cpu).unwrap();
    let lm = CausalLm::load(&store.root(), &cfg).unwrap();
    CausalLmWithValueHead::load(&store.root(), lm).unwrap()
}

/// Three commands each turn; "go" earns 1; environment e's episode ends after `turns[e]`
/// turns, truncated (so the last turn bootstraps from the final state).
struct Hall {
    turns: Vec<usize>,
    at: Vec<usize>,
}

impl Hall {
    fn new(turns: &[usize]) -> Self {
        Self { turns: turns.to_vec(), at: vec![0; turns.len()] }
    }
}

fn state(k: usize) -> EnvStep {
    EnvStep {
        observation: format!("Room {k}."),
        admissible_commands: vec!["go".into(), "look".into(), "wait".into()],
        ..EnvStep::default()
    }
}

impl TextEnv for Hall {
    fn num_envs(&self) -> usize {
        self.at.len()
    }
    fn reset(&mut self, envs: &[usize], _: &[Reset]) -> rltune::envs::Result<Vec<EnvStep>> {
        Ok(envs
            .iter()
            .map(|&e| {
                self.at[e] = 0;
                state(0)
            })
            .collect())
    }
    fn step(
        &mut self,
        actions: &[(usize, String)],
    ) -> rltune::envs::Result<Vec<rltune::envs::Result<EnvStep>>> {
        Ok(actions
            .iter()
            .map(|(e, a)| {
                self.at[*e] += 1;
                let k = self.at[*e];
                Ok(EnvStep {
                    reward: f64::from(u8::from(a == "go")),
                    truncated: k == self.turns[*e],
                    ..state(k)
                })
            })
            .collect())
    }
}

fn template() -> PromptTemplate {
    PromptTemplate {
        instruction: ">".into(),
        actions: ActionMode::Admissible,
        memory: Memory::Transcript,
        ..PromptTemplate::default()
    }
}

fn config() -> RolloutConfig {
    RolloutConfig {
        template: template(),
        generation: GenerationConfig { seed: 3, ..GenerationConfig::default() },
        game_gamma: 0.6,
        example_turn_prob: 0.0,
        shaping: Shaping::default(),
    }
}

fn collect(model: &CausalLmWithValueHead, turns: &[usize]) -> Collected {
    let mut env = Hall::new(turns);
    let resets = vec![Reset::default(); turns.len()];
    collect_episodes(&mut env, model, &byte_tokenizer(), &config(), &resets, 11, &Device::Cpu).unwrap()
}

/// The hidden states `(T, C)` of one uncached forward over `ids`.
fn hidden(lm: &CausalLm, ids: &[u32]) -> Tensor {
    let dev = Device::Cpu;
    let mask = vec![vec![1u8; ids.len()]];
    let input = Tensor::new(ids, &dev).unwrap().unsqueeze(0).unwrap();
    let pos = position_ids_from_mask(&mask, &dev).unwrap();
    let bias = causal_bias(&mask, ids.len(), DType::F32, &dev).unwrap();
    lm.forward(&input, &pos, &bias, None).unwrap().squeeze(0).unwrap()
}

/// V(ids): the value head at the last position of one uncached forward.
fn value(model: &CausalLmWithValueHead, ids: &[u32]) -> f32 {
    let h = hidden(&model.lm, ids);
    let v = model.v_head.forward(&h.unsqueeze(0).unwrap()).unwrap().squeeze(0).unwrap();
    v.to_vec1::<f32>().unwrap()[ids.len() - 1]
}

#[test]
fn turns_extend_one_token_sequence_tokenized_once() {
    crate::common::install();
    let model = policy(512);
    let tok = byte_tokenizer();
    let got = collect(&model, &[4, 4, 4]);
    assert_eq!(got.transitions.len(), 12, "3 episodes of 4 turns");
    assert_eq!(got.episodes.len(), 3);
    let first = tok.encode(&template().render(&state(0), &[], 0)).unwrap();
    for e in 0..3 {
        let turns: Vec<_> = got.transitions.iter().filter(|t| t.env == e).collect();
        assert_eq!(turns[0].query_ids, first, "env {e}: the first prompt");
        for k in 0..turns.len() - 1 {
            let (t, next) = (turns[k], turns[k + 1]);
            let mut want = t.query_ids.clone();
            want.extend(&t.response_ids);
            want.extend(tok.encode(&template().render_next(&state(k + 1))).unwrap());
            assert_eq!(next.query_ids, want, "env {e} turn {}: not the previous sequence extended", k + 1);
            // The action's tokens are the command as the trie writes it: " go\n".
            assert_eq!(t.response_ids, tok.encode(&format!(" {}\n", t.action)).unwrap());
        }
    }
    // Each turn prefilled its new state only (and its previous action's last token).
    let whole: usize = got.transitions.iter().map(|t| t.query_ids.len()).sum();
    println!("prefilled {} tokens; window-style prompts would be {whole}", got.counts.prefill_tokens);
    assert!(got.counts.prefill_tokens < whole / 2, "{} of {whole}", got.counts.prefill_tokens);
}

#[test]
fn logprobs_values_and_bootstraps_equal_an_uncached_forward() {
    crate::common::install();
    let model = policy(512);
    // Episodes of 4, 2 and 3 turns: finished rows leave the carried batch mid-round.
    let got = collect(&model, &[4, 2, 3]);
    assert_eq!(got.transitions.len(), 9);
    let mut worst = 0f64;
    for (i, t) in got.transitions.iter().enumerate() {
        let mut ids = t.query_ids.clone();
        ids.extend(&t.response_ids);
        let h = hidden(&model.lm, &ids);
        let logits = model.lm.logits(&h.unsqueeze(0).unwrap()).unwrap().squeeze(0).unwrap();
        let values = model.v_head.forward(&h.unsqueeze(0).unwrap()).unwrap().squeeze(0).unwrap();
        let values = values.to_vec1::<f32>().unwrap();
        let q = t.query_ids.len();
        for (j, &tok) in t.response_ids.iter().enumerate() {
            let row = logits.get(q - 1 + j).unwrap();
            let allowed = Tensor::new(t.allowed[j].as_slice(), &Device::Cpu).unwrap();
            let lse = row.index_select(&allowed, 0).unwrap();
            let lse = lse.exp().unwrap().sum(D::Minus1).unwrap().log().unwrap().to_scalar::<f32>().unwrap();
            let lp = row.get(tok as usize).unwrap().to_scalar::<f32>().unwrap() - lse;
            worst = worst.max(f64::from((lp - t.logprobs[j]).abs()));
            worst = worst.max(f64::from((values[q - 1 + j] - t.values[j]).abs()));
        }
        assert!(
            !t.next_query_ids.is_empty(),
            "turn {i}: every episode is truncated, so every turn bootstraps"
        );
        let v = value(&model, &t.next_query_ids);
        worst = worst.max(f64::from((t.bootstrap - 0.6 * v).abs()));
    }
    println!("transcript sampling vs an uncached forward: max |Δ| {worst:.1e}");
    assert!(worst < 1e-5, "{worst}");
}

#[test]
fn a_full_context_ends_the_episode_truncated() {
    crate::common::install();
    // 96 positions: the first prompt (~60 bytes) and two or three turns fit, not twenty.
    let model = policy(96);
    let got = collect(&model, &[20, 20]);
    assert_eq!(got.episodes.len(), 2);
    for ep in &got.episodes {
        assert!(ep.truncated && ep.steps < 20, "steps {}", ep.steps);
    }
    for t in &got.transitions {
        assert!(t.query_ids.len() + t.response_ids.len() <= 96);
    }
    for e in 0..2 {
        let last = got.transitions.iter().rfind(|t| t.env == e).unwrap();
        assert!(last.next_query_ids.len() < 96, "the cut prompt fits with one token to spare");
        let v = value(&model, &last.next_query_ids);
        assert!((last.bootstrap - 0.6 * v).abs() < 1e-5, "{} vs 0.6 × {v}", last.bootstrap);
    }
}

#[test]
fn play_model_plays_transcripts_in_rounds() {
    crate::common::install();
    let model = policy(512);
    let mut env = Hall::new(&[3, 3]);
    let gen = GenerationConfig { seed: 1, ..GenerationConfig::default() };
    let tok = byte_tokenizer();
    let resets = |_: usize| Reset::default();
    let (eps, dropped) =
        play_model(&mut env, &model.lm, &tok, &template(), &gen, 5, &resets, &Device::Cpu).unwrap();
    assert_eq!(dropped, 0);
    assert_eq!(eps.iter().map(|e| e.episode).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
    assert!(eps.iter().all(|e| e.steps == 3 && e.turns.iter().all(|t| t.logprob.is_some())));
    // Free-text actions cannot keep a transcript exact: refused, naming the fix.
    let free = PromptTemplate { actions: ActionMode::Free, ..template() };
    let err = play_model(&mut env, &model.lm, &tok, &free, &gen, 1, &resets, &Device::Cpu).unwrap_err();
    assert!(err.to_string().contains("needs actions = \"admissible\""), "{err}");
}

#[test]
fn run_configs_refuse_what_a_transcript_cannot_hold() {
    use rltune::run::RunConfig;
    let base = "[model]\npath = \"m\"\n[env]\nkind = \"letters\"\n[agent]\nmemory = \"transcript\"\n";
    let err = |extra: &[&str]| {
        let sets: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        RunConfig::from_toml(base, std::path::Path::new("run.toml"), &sets).unwrap_err().to_string()
    };
    let e = err(&[]);
    assert!(e.contains("run.toml") && e.contains("needs actions = \"admissible\""), "{e}");
    let e = err(&["agent.actions=\"admissible\"", "episodes.example_turn_prob=0.2"]);
    assert!(e.contains("example_turn_prob = 0.2") && e.contains("memory = \"window\""), "{e}");
    let ok = ["agent.actions=\"admissible\"".to_string()];
    assert!(RunConfig::from_toml(base, std::path::Path::new("run.toml"), &ok).is_ok());
}

/// A row keeps its environment's sampling stream as the batch sheds finished episodes: an
/// episode plays the same actions whether the others in its round end early or not.
#[test]
fn an_episode_does_not_depend_on_when_the_others_end() {
    crate::common::install();
    let model = policy(512);
    // Environment 2 becomes row 0 once 0 and 1 have ended.
    let (a, b) = (collect(&model, &[5, 5, 5]), collect(&model, &[1, 2, 5]));
    for e in [2usize] {
        let (ta, tb): (Vec<_>, Vec<_>) = (
            a.transitions.iter().filter(|t| t.env == e).collect(),
            b.transitions.iter().filter(|t| t.env == e).collect(),
        );
        assert_eq!(ta.len(), tb.len());
        for (x, y) in ta.iter().zip(&tb) {
            assert_eq!((&x.query_ids, &x.response_ids), (&y.query_ids, &y.response_ids));
            let d = x.logprobs.iter().zip(&y.logprobs).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
            assert!(d < 1e-5, "{d}");
        }
    }
}
