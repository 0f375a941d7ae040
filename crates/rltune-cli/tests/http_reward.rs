//! The HTTP reward sources (issue #57, item 3) end to end: `rltune ppo` with `[algorithm] kind =
//! "grpo"` scored by a scoring service on loopback (a thread here, which fails its first
//! request: the retry re-sends the batch and nothing is counted twice), and the LLM judge against
//! `rltune serve` itself, from the library and from the command line.

use std::path::Path;
use std::time::Duration;

use rltune::rewards::{JudgeConfig, LlmJudgeReward, RetryPolicy, RewardInput, RewardSource};
use serde_json::{json, Value};

mod common;
use common::http::{post, tiny_chat_model, Reply, ScoringService, Served};

const NAME: &str = "tiny-gpt2";

/// A GRPO run over the tiny model: 2 prompts × 2 completions per step, `steps` steps, with
/// `reward` as its only `[[reward.sources]]` table.
fn grpo_config(dir: &Path, model: &Path, steps: usize, reward: &str) -> std::path::PathBuf {
    let prompts: String =
        ["the cat", "a dog", "my hat", "one cup"].iter().map(|p| format!("{{\"text\": {p:?}}}\n")).collect();
    std::fs::write(dir.join("prompts.jsonl"), prompts).unwrap();
    let text = format!(
        "[model]\npath = {:?}\n[algorithm]\nkind = \"grpo\"\n[data]\nsource = {:?}\n\
         [[reward.sources]]\n{reward}\n\
         [generation]\nmax_new_tokens = 6\nseed = 5\n\
         [grpo]\nnum_generations = 2\nper_device_train_batch_size = 4\nlearning_rate = 1e-3\n\
         max_steps = {steps}\nlr_scheduler_type = \"constant\"\n\
         [logging]\ndir = {:?}\n",
        model.to_str().unwrap(),
        dir.join("prompts.jsonl").to_str().unwrap(),
        dir.join("run").to_str().unwrap()
    );
    let path = dir.join("grpo.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn run_ppo(config: &Path) -> std::process::Output {
    let out = common::rltune(&["ppo", "--config", config.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "rltune ppo failed:\n{err}");
    out
}

fn metrics(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Scores a request: each completion's length in characters, over 10.
fn lengths(body: &Value) -> Vec<f64> {
    body["samples"]
        .as_array()
        .map(|s| {
            s.iter().map(|x| x["completion"].as_str().unwrap_or("").chars().count() as f64 / 10.0).collect()
        })
        .unwrap_or_default()
}

#[test]
fn grpo_scored_by_an_http_service_retries_without_counting_twice() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(tmp.path(), NAME);
    let service = ScoringService::start(|n, body| {
        if n == 0 {
            return Reply { status: 503, body: "\"warming up\"".into(), delay: Duration::ZERO };
        }
        Reply { status: 200, body: json!({"scores": lengths(body)}).to_string(), delay: Duration::ZERO }
    });
    let reward = format!(
        "kind = \"http\"\nurl = \"{}/score\"\ntimeout_s = 30\nmax_retries = 2\nbackoff_s = 0.05",
        service.url
    );
    let config = grpo_config(tmp.path(), &model, 2, &reward);
    let out = run_ppo(&config);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("attempt 1 of 3 failed (HTTP 503: \"warming up\")"), "{stderr}");

    let bodies = service.bodies.lock().unwrap().clone();
    assert_eq!(bodies.len(), 3, "two steps, the first request retried once: {bodies:?}");
    assert_eq!(bodies[0], bodies[1], "the retry re-sends the whole batch with its request_id");
    assert_ne!(bodies[1]["request_id"], bodies[2]["request_id"]);
    let m = metrics(tmp.path());
    assert_eq!(m.len(), 2);
    // Each step's reward is the mean of the one answer that succeeded for it.
    for (step, body) in [&bodies[1], &bodies[2]].into_iter().enumerate() {
        let samples = body["samples"].as_array().unwrap();
        assert_eq!(samples.len(), 4, "one request per step: 2 prompts × 2 completions");
        let scores = lengths(body);
        let want = scores.iter().sum::<f64>() / scores.len() as f64;
        let got = m[step]["rewards/http/mean"].as_f64().unwrap();
        assert!((got - want).abs() < 1e-5, "step {step}: logged {got}, the service scored {want}");
        assert!((m[step]["reward"].as_f64().unwrap() - want).abs() < 1e-5);
    }
}

#[test]
fn an_http_reward_that_keeps_failing_stops_the_run_naming_the_url_and_status() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(tmp.path(), NAME);
    let service = ScoringService::start(|_, _| Reply {
        status: 500,
        body: "\"scorer crashed: CUDA out of memory\"\nTraceback ...".into(),
        delay: Duration::ZERO,
    });
    let url = format!("{}/score", service.url);
    let reward = format!("kind = \"http\"\nurl = {url:?}\nmax_retries = 1\nbackoff_s = 0");
    let config = grpo_config(tmp.path(), &model, 1, &reward);
    let out = common::rltune(&["ppo", "--config", config.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&url) && err.contains("HTTP 500") && err.contains("CUDA out of memory"), "{err}");
    assert!(err.contains("after 2 attempts") && !err.contains("Traceback"), "{err}");
    // A bad value is named with its source.
    let reward = format!("kind = \"http\"\nurl = {url:?}\ntimeout_s = -1");
    let config = grpo_config(tmp.path(), &model, 1, &reward);
    let out = common::rltune(&["ppo", "--config", config.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("kind = \"http\"") && err.contains("timeout_s") && err.contains("-1"), "{err}");
}

/// The answer `rltune serve` gives the judge's request for one sample, asked directly.
fn direct_answer(addr: &str, user: &str) -> String {
    let body = json!({"model": NAME, "messages": [{"role": "user", "content": user}], "max_tokens": 8,
                      "temperature": 0.0, "seed": 3});
    let a = post(addr, "/v1/chat/completions", &body);
    assert_eq!(a.status, 200, "{}", a.body);
    a.json()["choices"][0]["message"]["content"].as_str().unwrap().to_string()
}

#[test]
fn the_llm_judge_scores_through_rltune_serve() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(tmp.path(), NAME);
    let server = Served::start(&model, &["--batch-wait-ms", "200"]);
    // The tiny model answers noise: the score is its first digit, else the default. What
    // matters is that the judge reads what the server answers.
    let mut cfg = JudgeConfig::new(&format!("http://{}/v1", server.addr), NAME, "Rate: {completion}");
    cfg.score_regex = r"([0-9])".into();
    cfg.default = Some(-1.0);
    cfg.max_tokens = 8;
    cfg.seed = Some(3);
    cfg.policy = RetryPolicy { timeout: Duration::from_secs(60), max_retries: 0, backoff: Duration::ZERO };
    let mut judge = LlmJudgeReward::new(cfg).unwrap();
    let completions = ["good", "bad", "fine", "ok", "meh", "yes"];
    let batch: Vec<RewardInput> = completions.iter().map(|c| RewardInput::text("q", c)).collect();
    let scores = judge.score(&batch).unwrap();
    for (c, s) in completions.iter().zip(&scores) {
        let answer = direct_answer(&server.addr, &format!("Rate: {c}"));
        assert_eq!(*s, first_digit(&answer).unwrap_or(-1.0), "{c}: the server answered {answer:?}");
    }
    assert_eq!(server.metric("rltune_requests_total"), 12, "one request per sample, then the direct ones");
    assert!(server.metric("rltune_batch_requests_max") >= 2, "the judge's concurrent requests were batched");
}

/// What `score_regex = "([0-9])"` reads: the first digit.
fn first_digit(s: &str) -> Option<f32> {
    s.chars().find(|c| c.is_ascii_digit()).and_then(|c| c.to_digit(10)).map(|d| d as f32)
}

#[test]
fn grpo_with_an_llm_judge_served_by_rltune_serve() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(tmp.path(), NAME);
    let server = Served::start(&model, &["--served-model-name", "judge"]);
    let reward = format!(
        "kind = \"llm_judge\"\nurl = \"http://{}/v1\"\nmodel = \"judge\"\n\
         prompt_template = \"Q: {{prompt}} A: {{completion}}\"\n\
         score_regex = \"([0-9])\"\ndefault = 0.0\nmax_tokens = 4\nseed = 1",
        server.addr
    );
    let config = grpo_config(tmp.path(), &model, 2, &reward);
    run_ppo(&config);
    let m = metrics(tmp.path());
    assert_eq!(m.len(), 2);
    assert!(m.iter().all(|l| l["rewards/llm_judge/mean"].as_f64().is_some()), "{m:?}");
    assert_eq!(server.metric("rltune_requests_total"), 8, "each of 2 × 4 completions judged once");
}
