//! Model files that are damaged, hostile or inconsistent: each load fails naming the file, the
//! tensor or the field, and the fix.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use rltune::models::load::load_policy;

use super::{assert_contains_all, err_msg};
use crate::common::fixture;

/// The error message of loading `dir` as a policy.
fn load_err(dir: &Path) -> String {
    err_msg(load_policy(dir.to_str().unwrap(), false, DType::F32, &Device::Cpu), "loading a bad model")
}

/// A model directory with the gpt2 fixture's config.json and `weights` as model.safetensors.
fn gpt2_dir_with_weights(weights: &[u8]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("models/gpt2/config.json"), dir.path().join("config.json")).unwrap();
    std::fs::write(dir.path().join("model.safetensors"), weights).unwrap();
    dir
}

/// A safetensors file by hand: the 8-byte little-endian header length `header_len` (which need
/// not be the header's real length), the header, then `data`.
fn raw_safetensors(header_len: u64, header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = header_len.to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

#[test]
fn damaged_or_hostile_safetensors_are_refused_naming_the_file() {
    let good = std::fs::read(fixture("models/gpt2/model.safetensors")).unwrap();
    let random: Vec<u8> = {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(28);
        (0..4096).map(|_| rng.gen()).collect()
    };
    let huge_shape = r#"{"w":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,16]}}"#;
    let past_the_end = r#"{"w":{"dtype":"F32","shape":[268435456],"data_offsets":[0,1073741824]}}"#;
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("truncated to half", good[..good.len() / 2].to_vec()),
        ("truncated inside the header", good[..20].to_vec()),
        ("random bytes", random),
        ("empty file", Vec::new()),
        ("header length 2^60", raw_safetensors(1 << 60, "{}", &[])),
        ("header length 100 MB", raw_safetensors(100 << 20, "{}", &[0; 64])),
        ("tensor size overflows", raw_safetensors(huge_shape.len() as u64, huge_shape, &[0; 16])),
        ("tensor past the end", raw_safetensors(past_the_end.len() as u64, past_the_end, &[0; 16])),
    ];
    for (name, bytes) in cases {
        println!("--- {name}");
        let dir = gpt2_dir_with_weights(&bytes);
        let start = std::time::Instant::now();
        let err = load_err(dir.path());
        assert!(start.elapsed().as_secs() < 5, "{name}: took {:?}", start.elapsed());
        assert_contains_all(&err, &["model.safetensors", "cannot read safetensors", "save_pretrained"]);
    }
}

/// The gpt2 fixture's tensors with `edit` applied, saved into a model directory.
fn gpt2_with_tensors(edit: impl FnOnce(&mut HashMap<String, Tensor>)) -> tempfile::TempDir {
    let mut tensors = candle_core::safetensors::load(fixture("models/gpt2/model.safetensors"), &Device::Cpu)
        .expect("the fixture loads");
    edit(&mut tensors);
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("models/gpt2/config.json"), dir.path().join("config.json")).unwrap();
    candle_core::safetensors::save(&tensors, dir.path().join("model.safetensors")).unwrap();
    dir
}

/// `name` replaced by a tensor of the same shape through `f`.
fn replace(tensors: &mut HashMap<String, Tensor>, name: &str, f: impl FnOnce(&Tensor) -> Tensor) {
    let t = tensors.get(name).unwrap_or_else(|| panic!("the fixture has no {name}"));
    let new = f(t);
    tensors.insert(name.to_string(), new);
}

#[test]
fn integer_tensor_where_a_float_weight_belongs_names_the_tensor_and_dtype() {
    for (dtype, shown) in [(DType::I64, "i64"), (DType::U8, "u8"), (DType::U32, "u32")] {
        let dir = gpt2_with_tensors(|ts| {
            replace(ts, "transformer.h.0.attn.c_attn.weight", |t| {
                t.ones_like().unwrap().to_dtype(dtype).unwrap()
            })
        });
        let err = load_err(dir.path());
        assert_contains_all(
            &err,
            &[
                "model.safetensors",
                "\"transformer.h.0.attn.c_attn.weight\"",
                shown,
                "float",
                "save_pretrained",
            ],
        );
    }
}

#[test]
fn non_finite_weights_are_refused_at_load_naming_the_tensor() {
    for (value, shown) in [(f32::NAN, "NaN"), (f32::INFINITY, "inf"), (f32::NEG_INFINITY, "-inf")] {
        let dir = gpt2_with_tensors(|ts| {
            replace(ts, "transformer.h.1.mlp.c_fc.weight", |t| {
                let mut v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                v[37] = value;
                Tensor::from_vec(v, t.shape(), &Device::Cpu).unwrap()
            })
        });
        let err = load_err(dir.path());
        assert_contains_all(
            &err,
            &["model.safetensors", "\"transformer.h.1.mlp.c_fc.weight\"", shown, "element 37", "diverged"],
        );
    }
    // Half precision too: the check does not overflow on large finite f16 weights.
    let dir = gpt2_with_tensors(|ts| {
        for t in ts.values_mut() {
            *t = (t.clone() * 1000.0).unwrap().to_dtype(DType::F16).unwrap();
        }
    });
    load_policy(dir.path().to_str().unwrap(), false, DType::F32, &Device::Cpu)
        .expect("large finite f16 weights load");
}

/// The gpt2 fixture with config.json's `edit` applied.
fn gpt2_with_config(edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> tempfile::TempDir {
    let text = std::fs::read_to_string(fixture("models/gpt2/config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(v.as_object_mut().unwrap());
    let dir = gpt2_dir_with_weights(&std::fs::read(fixture("models/gpt2/model.safetensors")).unwrap());
    std::fs::write(dir.path().join("config.json"), v.to_string()).unwrap();
    dir
}

#[test]
fn config_fields_of_the_wrong_type_or_out_of_range_are_named() {
    type Edit = fn(&mut serde_json::Map<String, serde_json::Value>);
    let cases: [(&str, Edit, &[&str]); 5] = [
        (
            "n_layer is a string",
            |c| drop(c.insert("n_layer".into(), "2".into())),
            &["field \"n_layer\"", "invalid type"],
        ),
        ("n_layer is 0", |c| drop(c.insert("n_layer".into(), 0.into())), &["n_layer", "positive"]),
        (
            "n_head does not divide n_embd",
            |c| drop(c.insert("n_head".into(), 3.into())),
            &["n_embd (32)", "n_head (3)"],
        ),
        (
            "vocab_size is negative",
            |c| drop(c.insert("vocab_size".into(), (-101).into())),
            &["vocab_size", "-101"],
        ),
        ("n_embd is a float", |c| drop(c.insert("n_embd".into(), 32.5.into())), &["n_embd", "32.5"]),
    ];
    for (name, edit, parts) in cases {
        println!("--- {name}");
        let dir = gpt2_with_config(edit);
        let err = load_err(dir.path());
        assert_contains_all(&err, &["config.json"]);
        assert_contains_all(&err, parts);
    }
}
