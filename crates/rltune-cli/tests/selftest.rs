//! `rltune selftest`, the checks a GPU verification run makes first (`tools/cuda/verify.sh`),
//! run here on the CPU: every check passes, and its JSON lines carry what the report needs.

mod common;
use common::{fixture, rltune};

#[test]
fn selftest_passes_on_the_cpu_and_reports_each_check() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("selftest.jsonl");
    let fx = fixture("");
    let o = rltune(&[
        "selftest",
        "--device",
        "cpu",
        "--fixtures",
        fx.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&o.stderr));
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&json).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let names: Vec<&str> = lines.iter().map(|l| l["name"].as_str().unwrap()).collect();
    for want in [
        "models/gpt2",
        "models/llama",
        "models/qwen2",
        "sampler/chi-square",
        "sampler/logprobs",
        "ppo/trl-0.11.4",
        "grpo/kl",
        "rloo/rloo_default",
        "dpo/hinge",
        "kernels/swiglu_bf16",
        "kernels/scaled_masked_softmax_bf16",
        "kernels/rope_bf16",
        "models/bf16-activations",
        "models/bf16-attention",
    ] {
        assert!(names.contains(&want), "no check {want} in {names:?}");
    }
    for l in &lines {
        assert_eq!(l["pass"], true, "{l}");
        assert_eq!(l["device"], "cpu");
        let (d, tol) = (l["max_abs_diff"].as_f64().unwrap(), l["tolerance"].as_f64().unwrap());
        assert!(d <= tol, "{l}");
    }
    println!("{stdout}");
}

#[test]
fn selftest_names_a_missing_fixture_folder_and_an_unknown_check() {
    let o = rltune(&["selftest", "--device", "cpu", "--fixtures", "/nonexistent/fixtures"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("/nonexistent/fixtures") && err.contains("--fixtures"),
        "{err}"
    );
    let fx = fixture("");
    let o = rltune(&["selftest", "--device", "cpu", "--fixtures", fx.to_str().unwrap(), "--only", "nothing"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("matches no check"), "{err}");
}
