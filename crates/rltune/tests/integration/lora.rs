//! LoRA adapters against PEFT (`tools/fixtures/make_lora_fixture.py`): PEFT's adapters give
//! PEFT's logprobs in rltune, and rltune's adapters give rltune's logprobs in PEFT.
//!
//! Tolerance 1e-5 on logprobs: tiny f32 models on both sides, differences are rounding (the
//! models' own parity with transformers is ~1e-7); a wrong scaling, transposed Conv1D adapter or
//! missed module moves logprobs by 1e-2 or more (the adapters' B are ~0.3).

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rltune::models::load::{load_lm_adapted, LoraSpec};
use rltune::models::lora::{LoraConfig, TargetModules, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
use rltune::models::CausalLm;

use crate::common::{fixture, install, max_diff};

const TOL: f64 = 1e-5;

/// `(B, T-1)` logprobs of each next token of `ids` under `lm`.
fn logprobs(lm: &CausalLm, ids: &Tensor) -> Tensor {
    let (b, t) = ids.dims2().unwrap();
    let dev = Device::Cpu;
    let mask = vec![vec![1u8; t]; b];
    let pos = rltune::models::layers::position_ids_from_mask(&mask, &dev).unwrap();
    let bias = rltune::models::layers::causal_bias(&mask, t, DType::F32, &dev).unwrap();
    let logits = lm.logits(&lm.forward(ids, &pos, &bias, None).unwrap()).unwrap();
    rltune::ops::logprobs_of(&logits.narrow(1, 0, t - 1).unwrap(), &ids.narrow(1, 1, t - 1).unwrap()).unwrap()
}

fn expected(model: &str) -> std::collections::HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture(&format!("lora/{model}/expected.safetensors")), &Device::Cpu)
        .unwrap()
}

fn load(model: &str, spec: Option<&LoraSpec>) -> CausalLm {
    let base = fixture(&format!("lora/{model}/base"));
    load_lm_adapted(base.to_str().unwrap(), spec, false, DType::F32, &Device::Cpu).unwrap().lm
}

#[test]
fn peft_made_adapters_give_peft_logprobs() {
    install();
    for model in ["gpt2", "llama"] {
        let exp = expected(model);
        let ids = exp["input_ids"].to_dtype(DType::U32).unwrap();
        let base = max_diff(&logprobs(&load(model, None), &ids), &exp["base_logprobs"]);
        let spec = LoraSpec::from_dir(fixture(&format!("lora/{model}/peft_adapter")));
        let got = logprobs(&load(model, Some(&spec)), &ids);
        let d = max_diff(&got, &exp["peft_adapter_logprobs"]);
        let moved = max_diff(&exp["peft_adapter_logprobs"], &exp["base_logprobs"]);
        println!("{model}: PEFT's adapter: logprobs maxdiff {d:.2e} (base {base:.2e}; the adapter moves them {moved:.2e})");
        assert!(moved > 1e-2, "{model}: the fixture's adapter changes nothing");
        assert!(base < TOL && d < TOL, "{model}: base {base:.2e}, adapted {d:.2e}");
    }
}

/// The adapters rltune writes for the fixture (a fixed seed, random B): GPT-2 with names; Llama
/// with rank-stabilized scaling and `modules_to_save = ["lm_head"]`.
fn rltune_adapter(model: &str, dir: &Path) {
    let cfg = match model {
        "gpt2" => LoraConfig {
            r: 4,
            lora_alpha: 16.0,
            target_modules: Some(TargetModules::Names(vec!["c_attn".into(), "c_fc".into()])),
            ..Default::default()
        },
        _ => LoraConfig {
            r: 2,
            lora_alpha: 4.0,
            use_rslora: true,
            target_modules: Some(TargetModules::Names(
                ["q_proj", "k_proj", "o_proj", "up_proj"].map(String::from).to_vec(),
            )),
            modules_to_save: Some(vec!["lm_head".into()]),
            ..Default::default()
        },
    };
    let base = format!("tools/fixtures/lora/{model}/base");
    let spec = LoraSpec::new(cfg, "test [lora]", 11);
    let loaded = load_lm_adapted(
        fixture(&format!("lora/{model}/base")).to_str().unwrap(),
        Some(&spec),
        false,
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    for (name, var) in loaded.store.vars() {
        let n = var.elem_count();
        let noise: Vec<f32> = (0..n).map(|_| rng.gen_range(-0.3f32..0.3)).collect();
        let noise = Tensor::from_vec(noise, var.shape(), &Device::Cpu).unwrap();
        // B from zero to random; the saved lm_head copy nudged from the base's.
        let scale = if name.ends_with("lora_B.weight") { 1.0 } else { 0.1 };
        if !name.ends_with("lora_A.weight") {
            var.set(&(var.as_tensor() + (noise * scale).unwrap()).unwrap()).unwrap();
        }
    }
    loaded.store.save_adapter(dir, Some(&base)).unwrap();
}

/// rltune's adapters (committed under `lora/*/rltune_adapter`, rewritten with
/// `RLTUNE_WRITE_LORA_FIXTURE=1`) are what rltune writes today, and PEFT's
/// `PeftModel.from_pretrained` on them gives rltune's logprobs.
#[test]
fn rltune_adapters_are_what_rltune_writes_and_peft_agrees() {
    install();
    for model in ["gpt2", "llama"] {
        let committed = fixture(&format!("lora/{model}/rltune_adapter"));
        if std::env::var_os("RLTUNE_WRITE_LORA_FIXTURE").is_some() {
            std::fs::create_dir_all(&committed).unwrap();
            rltune_adapter(model, &committed);
            continue;
        }
        let tmp = tempfile::tempdir().unwrap();
        rltune_adapter(model, tmp.path());
        let read = |d: &Path| std::fs::read_to_string(d.join(ADAPTER_CONFIG)).unwrap();
        assert_eq!(read(tmp.path()), read(&committed), "{model}: adapter_config.json changed");
        let tensors =
            |d: &Path| candle_core::safetensors::load(d.join(ADAPTER_WEIGHTS), &Device::Cpu).unwrap();
        let (now, then) = (tensors(tmp.path()), tensors(&committed));
        assert_eq!(now.keys().collect::<std::collections::BTreeSet<_>>(), then.keys().collect());
        for (k, t) in &now {
            assert_eq!(max_diff(t, &then[k]), 0.0, "{model}: {k} changed");
        }
        let exp = expected(model);
        let ids = exp["input_ids"].to_dtype(DType::U32).unwrap();
        let got = logprobs(&load(model, Some(&LoraSpec::from_dir(&committed))), &ids);
        let d = max_diff(&got, &exp["rltune_adapter_logprobs"]);
        let moved = max_diff(&exp["rltune_adapter_logprobs"], &exp["base_logprobs"]);
        println!("{model}: rltune's adapter in PEFT: logprobs maxdiff {d:.2e} (the adapter moves them {moved:.2e})");
        assert!(moved > 1e-2 && d < TOL, "{model}: {d:.2e}");
    }
}
