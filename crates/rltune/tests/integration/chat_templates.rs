//! Chat templates: rltune's minijinja rendering equals transformers' `apply_chat_template` on the
//! templates of SmolLM2, Qwen2.5, Llama 3 and Llama 2 (tools/fixtures/make_chat_template_fixture.py).

use rltune::models::chat_template::ChatTemplate;

use crate::common::fixture;

#[test]
fn chat_templates_match_transformers_apply_chat_template() {
    let path = fixture("chat_templates/expected.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut checked = 0;
    for (name, t) in v["templates"].as_object().unwrap() {
        let special = t["special_tokens"].as_object().unwrap().clone();
        let tmpl = ChatTemplate::new(t["template"].as_str().unwrap(), special, name).unwrap();
        for (i, case) in t["cases"].as_array().unwrap().iter().enumerate() {
            for (key, agp) in [("without_generation_prompt", false), ("with_generation_prompt", true)] {
                let got = tmpl.render(&case["messages"], agp);
                match (&case[key], got) {
                    (serde_json::Value::String(want), Ok(got)) => {
                        assert_eq!(&got, want, "{name} conversation {i} {key}");
                        checked += 1;
                    }
                    (serde_json::Value::Null, Err(e)) => {
                        let want = case["error"].as_str().unwrap();
                        assert!(e.to_string().contains(want), "{name} conversation {i}: {e} lacks {want:?}");
                        checked += 1;
                    }
                    (want, got) => panic!("{name} conversation {i} {key}: want {want}, got {got:?}"),
                }
            }
        }
    }
    println!("chat templates: {checked} renderings equal transformers'");
    assert_eq!(checked, 4 * 5 * 2);
}

#[test]
fn chat_template_is_read_from_tokenizer_config() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tokenizer_config.json");
    let cfg = serde_json::json!({
        "bos_token": {"content": "<s>", "special": true},
        "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "x"},
                          {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}],
    });
    std::fs::write(&p, cfg.to_string()).unwrap();
    let t = ChatTemplate::for_model_dir(dir.path()).unwrap().unwrap();
    let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
    assert_eq!(t.render(&msgs, false).unwrap(), "<s>hi</s>");
    std::fs::write(&p, r#"{"eos_token": "</s>"}"#).unwrap();
    assert!(ChatTemplate::for_model_dir(dir.path()).unwrap().is_none());
    std::fs::write(&p, r#"{"chat_template": 3}"#).unwrap();
    let e = ChatTemplate::for_model_dir(dir.path()).unwrap_err().to_string();
    assert!(e.contains("tokenizer_config.json") && e.contains("chat_template"), "{e}");
}

/// TRL's conversational prompts: `{"prompt": [messages]}` rows are rendered with the chat template
/// (with the generation prompt) before tokenizing; text rows are tokenized as before.
#[test]
fn conversational_prompt_rows_are_rendered_with_the_chat_template() {
    use rltune::data::prompts::encode_prompt;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("prompts.jsonl");
    let rows =
        "{\"prompt\": [{\"role\": \"user\", \"content\": \"hello world\"}]}\n{\"prompt\": \"world\"}\n";
    std::fs::write(&p, rows).unwrap();
    let rows = rltune::data::prompts::load_prompts(p.to_str().unwrap(), "prompt", None).unwrap();
    assert_eq!(rows[0].text, "hello world");
    let tok = crate::common::word_tokenizer(&["hello", "world", "user", "assistant"], false);
    let src = "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}\
               {% if add_generation_prompt %}assistant{% endif %}";
    let t = ChatTemplate::new(src, Default::default(), "t").unwrap();
    assert_eq!(encode_prompt(&rows[0], "prompt", &tok, Some(&t)).unwrap(), vec![2, 0, 1, 3]);
    assert_eq!(encode_prompt(&rows[1], "prompt", &tok, Some(&t)).unwrap(), vec![1]);
    let e = encode_prompt(&rows[0], "prompt", &tok, None).unwrap_err().to_string();
    assert!(e.contains("chat template"), "{e}");
}
