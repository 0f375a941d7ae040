//! A model's `tokenizer.json` (and `tokenizer_config.json`) as GGUF tokenizer metadata, as
//! llama.cpp's `convert_hf_to_gguf.py` writes it (`TextModel._set_vocab_gpt2` and
//! `get_vocab_base`, `_set_vocab_llama_hf`, gguf-py `vocab.py` `SpecialVocab` and `LlamaHfVocab`):
//!
//! - byte-level BPE (`ByteLevel` pre-tokenizer, no byte fallback): `tokenizer.ggml.model = "gpt2"`,
//!   `tokenizer.ggml.pre` named after the pre-tokenizer ([`pre_tokenizer_name`]: `smollm`,
//!   `qwen2`, `llama-bpe`, `gpt-2`), the merges;
//! - sentencepiece BPE (byte fallback, Metaspace; what `rltune convert` writes for a `"llama"`
//!   vocabulary): `"llama"`, `pre = "default"`, scores, `<0xXX>` pieces typed BYTE, and the merges
//!   too. Deviation: the converter's `LlamaHfVocab` gives every piece the score −1000 and writes
//!   no merges; here a piece made by merge `r` scores −r (llama.cpp's SPM tokenizer merges the
//!   best-scoring pair first, so this keeps the BPE's order) and the merges are kept so that
//!   rltune and transformers, which prefer them, rebuild the same tokenizer.
//!
//! Tokens are listed by id up to the model's `vocab_size`; ids without a token get `[PAD{i}]`,
//! type UNUSED. Added tokens are CONTROL when special (or when they look special: `<|…|>`),
//! else USER_DEFINED. BOS/EOS/UNK/PAD ids come from `tokenizer_config.json`'s tokens, then
//! `config.json`'s `*_token_id`; `add_bos_token` from the post-processor, then
//! `tokenizer_config.json`; the chat template from `tokenizer_config.json` or `chat_template.jinja`.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use serde_json::Value as Json;

use crate::error::{Error, Result};
use crate::gguf::{LLAMA3_SPLIT, QWEN2_SPLIT};
use crate::io::{read_json, ModelFiles};

/// gguf-py `TokenType`.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

/// llama.cpp's `tokenizer.ggml.pre` for a byte-level `pre_tokenizer` of tokenizer.json, or
/// `None` when rltune does not know it (the names llama.cpp's converter finds for SmolLM, Qwen2,
/// Llama 3 and GPT-2, and that [`crate::gguf`] reads back).
pub fn pre_tokenizer_name(pre: &Json) -> Option<&'static str> {
    let ty = |p: &Json| p.get("type").and_then(Json::as_str).map(str::to_string);
    let byte_level = |p: &Json, regex: bool| {
        ty(p).as_deref() == Some("ByteLevel")
            && p.get("use_regex").and_then(Json::as_bool).unwrap_or(true) == regex
    };
    if byte_level(pre, true) {
        return Some("gpt-2");
    }
    let parts = pre.get("pretokenizers").and_then(Json::as_array)?;
    match parts.as_slice() {
        [d, b] if ty(d).as_deref() == Some("Digits") && byte_level(b, true) => {
            d.get("individual_digits").and_then(Json::as_bool).filter(|&x| x).map(|_| "smollm")
        }
        [s, b] if ty(s).as_deref() == Some("Split") && byte_level(b, false) => {
            match s.pointer("/pattern/Regex").and_then(Json::as_str) {
                Some(r) if r == QWEN2_SPLIT => Some("qwen2"),
                Some(r) if r == LLAMA3_SPLIT => Some("llama-bpe"),
                _ => None,
            }
        }
        _ => None,
    }
}

/// gguf-py `TextModel.does_token_look_special`.
fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<｜") && t.ends_with("｜>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// A merge of tokenizer.json (`"a b"` or `["a", "b"]`) as gguf-py writes it: `"a b"`, a space
/// inside a part written as U+0120 (`SpecialVocab._try_load_from_tokenizer_json`).
fn merge_string(m: &Json) -> Option<String> {
    match m {
        Json::String(s) => Some(s.clone()),
        Json::Array(p) if p.len() == 2 => {
            let part = |x: &Json| x.as_str().map(|s| s.replace(' ', "\u{120}"));
            Some(format!("{} {}", part(&p[0])?, part(&p[1])?))
        }
        _ => None,
    }
}

/// The id of a special token named in tokenizer_config.json (a string or `{"content": …}`).
fn config_token(tc: &Json, key: &str, ids: &HashMap<String, u32>) -> Option<u32> {
    let v = tc.get(key)?;
    let s = v.as_str().or_else(|| v.get("content").and_then(Json::as_str))?;
    ids.get(s).copied()
}

/// Whether the post-processor puts BOS first (gguf-py `SpecialVocab`'s reading of a
/// `TemplateProcessing`; `ByteLevel` adds nothing); `None` when it does not say.
fn post_processor_adds_bos(tok: &Json, bos: Option<&str>) -> Option<bool> {
    let pp = tok.get("post_processor").filter(|p| !p.is_null())?;
    let procs = pp.get("processors").and_then(Json::as_array).cloned().unwrap_or_else(|| vec![pp.clone()]);
    let mut said = None;
    for p in &procs {
        match p.get("type").and_then(Json::as_str) {
            Some("ByteLevel") => said = said.or(Some(false)),
            Some("TemplateProcessing") => {
                let single = p.get("single").and_then(Json::as_array);
                let first = single.filter(|s| s.len() > 1).and_then(|s| s[0].pointer("/SpecialToken/id"));
                said = Some(first.and_then(Json::as_str).is_some_and(|f| Some(f) == bos));
            }
            _ => {}
        }
    }
    said
}

/// The tokenizer metadata of `files` for a model of `vocab_size` tokens.
pub fn tokenizer_metadata(
    files: &ModelFiles,
    config: &Json,
    vocab_size: usize,
) -> Result<Vec<(String, Value)>> {
    let path = files.tokenizer.clone().ok_or_else(|| {
        Error::Tokenizer(format!(
            "{}: no tokenizer.json; a GGUF file carries its tokenizer, so export needs one: copy the \
             base model's tokenizer.json (and tokenizer_config.json, for the chat template) into that \
             directory",
            files.dir.display()
        ))
    })?;
    let tok: Json = read_json(&path)?;
    let bad = |msg: String| Error::Tokenizer(format!("{}: {msg}", path.display()));
    let model = tok.get("model").ok_or_else(|| bad("no \"model\" object".into()))?;
    if model.get("type").and_then(Json::as_str) != Some("BPE") {
        return Err(bad(format!(
            "model type {} cannot be exported; rltune writes byte-level BPE (\"gpt2\") and sentencepiece \
             BPE (\"llama\") GGUF tokenizers; convert this model with llama.cpp's convert_hf_to_gguf.py",
            model.get("type").unwrap_or(&Json::Null)
        )));
    }
    let spm = model.get("byte_fallback").and_then(Json::as_bool).unwrap_or(false);
    let vocab =
        model.get("vocab").and_then(Json::as_object).ok_or_else(|| bad("no model.vocab object".into()))?;
    let mut tokens: Vec<Option<(String, i32)>> = vec![None; vocab_size];
    let mut ids: HashMap<String, u32> = HashMap::new();
    let mut put = |tokens: &mut Vec<Option<(String, i32)>>, t: &str, id: u64, ty: i32| -> Result<()> {
        let slot = tokens.get_mut(id as usize).ok_or_else(|| {
            bad(format!(
                "token {t:?} has id {id}, past the model's vocab_size {vocab_size} (config.json); the \
                 tokenizer does not belong to this model"
            ))
        })?;
        *slot = Some((t.to_string(), ty));
        ids.entry(t.to_string()).or_insert(id as u32);
        Ok(())
    };
    let byte_piece = regex::Regex::new(r"^<0x[0-9A-Fa-f]{2}>$").map_err(|e| bad(e.to_string()))?;
    for (t, id) in vocab {
        let id = id.as_u64().ok_or_else(|| bad(format!("model.vocab[{t:?}] is not an id")))?;
        put(&mut tokens, t, id, if spm && byte_piece.is_match(t) { BYTE } else { NORMAL })?;
    }
    for a in tok.get("added_tokens").and_then(Json::as_array).into_iter().flatten() {
        let (Some(t), Some(id)) =
            (a.get("content").and_then(Json::as_str), a.get("id").and_then(Json::as_u64))
        else {
            return Err(bad(format!("added token {a} lacks content or id")));
        };
        let special = a.get("special").and_then(Json::as_bool).unwrap_or(false) || looks_special(t);
        put(&mut tokens, t, id, if special { CONTROL } else { USER_DEFINED })?;
    }
    let merges: Vec<String> = model
        .get("merges")
        .and_then(Json::as_array)
        .map(|m| m.iter().map(merge_string).collect::<Option<Vec<_>>>())
        .unwrap_or(Some(Vec::new()))
        .ok_or_else(|| bad("model.merges holds an entry that is neither \"a b\" nor [a, b]".into()))?;

    let (names, types): (Vec<Value>, Vec<Value>) = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| match t {
            Some((s, ty)) => (Value::String(s.clone()), Value::I32(*ty)),
            None => (Value::String(format!("[PAD{i}]")), Value::I32(UNUSED)),
        })
        .unzip();
    let s = |x: &str| Value::String(x.into());
    let mut meta: Vec<(String, Value)> = Vec::new();
    if spm {
        meta.push(("tokenizer.ggml.model".into(), s("llama")));
        meta.push(("tokenizer.ggml.pre".into(), s("default")));
    } else {
        let pre = tok.get("pre_tokenizer").unwrap_or(&Json::Null);
        let name = pre_tokenizer_name(pre).ok_or_else(|| {
            bad(format!(
                "pre_tokenizer {pre} is not one rltune can name for llama.cpp (known: SmolLM's, Qwen2's, \
                 Llama 3's and GPT-2's byte-level splits); convert this model with llama.cpp's \
                 convert_hf_to_gguf.py, which identifies more"
            ))
        })?;
        meta.push(("tokenizer.ggml.model".into(), s("gpt2")));
        meta.push(("tokenizer.ggml.pre".into(), s(name)));
    }
    meta.push(("tokenizer.ggml.tokens".into(), Value::Array(names)));
    if spm {
        // A piece made by merge r scores −r; the others 0 (see the module docs).
        let mut score = vec![0f32; vocab_size];
        for (r, m) in merges.iter().enumerate().rev() {
            if let Some(&id) = ids.get(&m.replacen(' ', "", 1)) {
                score[id as usize] = -(r as f32);
            }
        }
        meta.push((
            "tokenizer.ggml.scores".into(),
            Value::Array(score.into_iter().map(Value::F32).collect()),
        ));
    }
    meta.push(("tokenizer.ggml.token_type".into(), Value::Array(types)));
    // llama.cpp's BPE vocabulary requires the key even when there are no merges.
    if !spm || !merges.is_empty() {
        meta.push((
            "tokenizer.ggml.merges".into(),
            Value::Array(merges.into_iter().map(Value::String).collect()),
        ));
    }
    meta.extend(special_tokens(files, config, &tok, &ids, vocab_size, spm)?);
    Ok(meta)
}

/// BOS/EOS/UNK/PAD ids, the add-BOS/EOS flags and the chat template.
fn special_tokens(
    files: &ModelFiles,
    config: &Json,
    tok: &Json,
    ids: &HashMap<String, u32>,
    vocab_size: usize,
    spm: bool,
) -> Result<Vec<(String, Value)>> {
    let tc_path = files.dir.join("tokenizer_config.json");
    let tc: Json = if tc_path.exists() { read_json(&tc_path)? } else { Json::Null };
    let mut meta = Vec::new();
    let mut bos_token = None;
    for (typ, key) in [
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("unk", "unknown_token_id"),
        ("pad", "padding_token_id"),
    ] {
        let from_config = config.get(format!("{typ}_token_id")).and_then(Json::as_u64).map(|v| v as u32);
        if let Some(id) = config_token(&tc, &format!("{typ}_token"), ids)
            .or(from_config)
            .filter(|&i| (i as usize) < vocab_size)
        {
            meta.push((format!("tokenizer.ggml.{key}"), Value::U32(id)));
            if typ == "bos" {
                bos_token = ids.iter().find(|(_, v)| **v == id).map(|(k, _)| k.clone());
            }
        }
    }
    let flag = |k: &str| tc.get(k).and_then(Json::as_bool);
    let add_bos =
        post_processor_adds_bos(tok, bos_token.as_deref()).or(flag("add_bos_token")).unwrap_or(false);
    meta.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(add_bos)));
    if let Some(add_eos) = flag("add_eos_token") {
        meta.push(("tokenizer.ggml.add_eos_token".into(), Value::Bool(add_eos)));
    }
    if spm {
        // transformers' LlamaTokenizer (and rltune's reader) strip the Metaspace prefix; say so.
        meta.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(true)));
    }
    let jinja = files.dir.join("chat_template.jinja");
    let template = match tc.get("chat_template") {
        Some(Json::String(t)) => Some(t.clone()),
        Some(Json::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template").and_then(Json::as_str).map(str::to_string)),
        _ if jinja.exists() => Some(std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?),
        _ => None,
    };
    if let Some(t) = template {
        meta.push(("tokenizer.chat_template".into(), Value::String(t)));
    }
    Ok(meta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pre_tokenizers_get_llama_cpp_names() {
        let bl = |r: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "use_regex": r});
        assert_eq!(pre_tokenizer_name(&bl(true)), Some("gpt-2"));
        let smollm = json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, bl(true)]});
        assert_eq!(pre_tokenizer_name(&smollm), Some("smollm"));
        let split = |r: &str| {
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false}, bl(false)]})
        };
        assert_eq!(pre_tokenizer_name(&split(QWEN2_SPLIT)), Some("qwen2"));
        assert_eq!(pre_tokenizer_name(&split(LLAMA3_SPLIT)), Some("llama-bpe"));
        assert_eq!(pre_tokenizer_name(&split(r"\s+")), None);
        assert_eq!(pre_tokenizer_name(&json!({"type": "Whitespace"})), None);
    }

    #[test]
    fn merges_with_spaces_are_written_as_gguf_py_does() {
        assert_eq!(merge_string(&json!(["a b", "c"])).as_deref(), Some("a\u{120}b c"));
        assert_eq!(merge_string(&json!("x y")).as_deref(), Some("x y"));
        assert_eq!(merge_string(&json!([1, 2])), None);
    }

    #[test]
    fn special_looking_tokens_are_control() {
        assert!(looks_special("<|im_start|>") && looks_special("<pad>") && !looks_special("<eos>"));
    }
}
