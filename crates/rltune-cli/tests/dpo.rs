//! `rltune dpo`, run as a user runs it: the output directory against TRL 1.16.0's fixture
//! (`tools/fixtures/dpo/`), and bad input.

use std::path::Path;
use std::process::Output;

use candle_core::{Device, Tensor};

mod common;
use common::{fixture, rltune};

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs `rltune dpo --model init --ref-model ref --data DATA --config C --output OUT`.
fn dpo(data: &Path, config: &Path, out: &Path, extra: &[&str]) -> Output {
    let (init, reference) = (fixture("dpo/init"), fixture("dpo/ref"));
    let mut args = vec![
        "dpo",
        "--model",
        init.to_str().unwrap(),
        "--ref-model",
        reference.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ];
    args.extend(extra);
    rltune(&args)
}

/// One step over one batch of every row: the shuffle changes only the order of the batch, so
/// the saved weights and the logged metrics are TRL's (`hinge` variant: weight decay, lr 1e-3).
#[test]
fn dpo_one_full_batch_step_reproduces_trl_through_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let o = dpo(&fixture("dpo/rows.jsonl"), &fixture("dpo/hinge/config.toml"), &out, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    // The fixture's line 5 has identical chosen and rejected: a warning names it.
    assert!(stderr(&o).contains("rows.jsonl line 5") && stderr(&o).contains("identical"), "{}", stderr(&o));
    for f in ["model.safetensors", "config.json", "tokenizer.json", "metrics.jsonl"] {
        assert!(out.join(f).exists(), "{f} missing");
    }
    let want =
        candle_core::safetensors::load(fixture("dpo/hinge/weights.safetensors"), &Device::Cpu).unwrap();
    let got = candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut worst = 0f32;
    for (name, w) in &want {
        let g = &got[name];
        // The attention key bias has an exactly-zero gradient (tests/integration/grpo_parity.rs).
        let part = |t: &Tensor| -> Tensor {
            if !name.ends_with("attn.c_attn.bias") {
                return t.clone();
            }
            let c = t.dim(0).unwrap() / 3;
            Tensor::cat(&[t.narrow(0, 0, c).unwrap(), t.narrow(0, 2 * c, c).unwrap()], 0).unwrap()
        };
        let d = (part(g) - part(w)).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        worst = worst.max(d.to_scalar::<f32>().unwrap());
    }
    assert!(worst < 1e-5, "weights differ from TRL's by {worst}");
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let ours: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("dpo/hinge/expected.json")).unwrap()).unwrap();
    for (k, v) in expected["logs"][0].as_object().unwrap() {
        let (a, b) = (ours[k].as_f64().unwrap(), v.as_f64().unwrap());
        assert!((a - b).abs() < 1e-5, "{k}: ours {a}, TRL {b}");
    }
    println!("rltune dpo vs TRL hinge: weights max diff {worst:.2e}");
}

/// Bad rows fail with the file, line and field; bad settings with the field.
#[test]
fn dpo_bad_input_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let good = "{\"prompt\": \"t5 t9\", \"chosen\": \" t12\", \"rejected\": \" t3\"}";
    let cases = [
        ("{\"prompt\": \"t5\", \"chosen\": \" t1\"}", "line 2: missing field \"rejected\""),
        ("{\"prompt\": \"t5\", \"chosen\": \"\", \"rejected\": \" t3\"}", "line 2: \"chosen\" is empty"),
        (
            "{\"prompt\": \"t5\", \"chosen\": \" t1\", \"rejected\": \" t3\", \"ref_chosen_logps\": NaN, \
             \"ref_rejected_logps\": -2.0}",
            "line 2: invalid JSON: a value is NaN or Infinity",
        ),
    ];
    let config = dir.path().join("c.toml");
    std::fs::write(&config, "[dpo]\nmax_steps = 1\n").unwrap();
    for (i, (line, want)) in cases.iter().enumerate() {
        let data = dir.path().join(format!("d{i}.jsonl"));
        std::fs::write(&data, format!("{good}\n{line}\n")).unwrap();
        let o = dpo(&data, &config, &dir.path().join("out"), &[]);
        assert!(!o.status.success());
        assert!(stderr(&o).contains(&format!("d{i}.jsonl")) && stderr(&o).contains(want), "{}", stderr(&o));
    }
    let data = dir.path().join("ok.jsonl");
    std::fs::write(&data, format!("{good}\n")).unwrap();
    let o = dpo(&data, &config, &dir.path().join("out"), &["--set", "dpo.loss_type=\"aot\""]);
    assert!(!o.status.success() && stderr(&o).contains("dpo.loss_type"), "{}", stderr(&o));
    let o = dpo(&data, &config, &dir.path().join("out"), &["--set", "dpo.betta=0.3"]);
    assert!(!o.status.success() && stderr(&o).contains("beta"), "{}", stderr(&o));
}

/// A row longer than max_length is cut (TRL's keep_start truncation); a row whose prompt fills
/// max_length is dropped with a warning naming it.
#[test]
fn dpo_truncates_long_rows_and_drops_full_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d.jsonl");
    std::fs::write(
        &data,
        "{\"prompt\": \"t5 t9\", \"chosen\": \" t12 t13 t14 t15 t16 t17\", \"rejected\": \" t3\"}\n\
         {\"prompt\": \"t1 t2 t3 t4 t5\", \"chosen\": \" t12\", \"rejected\": \" t3\"}\n",
    )
    .unwrap();
    let config = dir.path().join("c.toml");
    std::fs::write(&config, "[dpo]\nmax_steps = 2\nmax_length = 5\nper_device_train_batch_size = 1\n")
        .unwrap();
    let out = dir.path().join("out");
    let o = dpo(&data, &config, &out, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("d.jsonl line 2") && stderr(&o).contains("dropped"), "{}", stderr(&o));
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 2);
    // Each step: the one kept pair, chosen cut to 3 completion tokens: 5 + 4 real tokens.
    let first: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    assert_eq!(first["num_tokens"].as_f64(), Some(9.0));
    assert_eq!(first["epoch"].as_f64(), Some(1.0));
}

/// configs/dpo.toml is a valid settings file (one step on the fixture's rows).
#[test]
fn dpo_example_config_runs() {
    let dir = tempfile::tempdir().unwrap();
    let config = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../configs/dpo.toml");
    let o = dpo(&fixture("dpo/rows.jsonl"), &config, &dir.path().join("out"), &["--set", "dpo.max_steps=1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(dir.path().join("out/metrics.jsonl").exists());
}
