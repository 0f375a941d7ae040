//! The OpenAI request bodies, read field by field: every error names its field (the error
//! object's `param`), unknown fields are refused, and options rltune does not implement are
//! accepted only at their no-op values (`echo: false`, `stream: false`, penalties 0).

use serde_json::{Map, Value};

use super::error::ApiError;

/// The most `logprobs` / `top_logprobs` alternatives per token (OpenAI's chat limit).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// The most stop strings (OpenAI's limit).
const MAX_STOP: usize = 4;
/// The most samples per prompt.
pub const MAX_N: usize = 128;

/// How to sample, shared by the two endpoints.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// Tokens per choice at most; `None`: the endpoint's default.
    pub max_tokens: Option<usize>,
    /// 0 is greedy decoding.
    pub temperature: f64,
    /// Nucleus threshold in (0, 1].
    pub top_p: f64,
    /// Keep the k most likely tokens; 0 is off (an extension, as vLLM's).
    pub top_k: usize,
    /// Drop the tokens less likely than `min_p` times the most likely one; 0 is off (an
    /// extension, as vLLM's).
    pub min_p: f64,
    /// Choices per prompt.
    pub n: usize,
    /// The seed of choice 0 of prompt 0; `None`: the server picks one.
    pub seed: Option<u64>,
    /// Strings that end a choice (not included in its text).
    pub stop: Vec<String>,
    /// Alternatives per token in `logprobs`; `None`: no logprobs in the response.
    pub logprobs: Option<usize>,
}

/// A prompt of `/v1/completions`: text or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Text, tokenized without special tokens (as `rltune generate --prompt`).
    Text(String),
    /// Token ids, used as they are.
    Ids(Vec<u32>),
}

/// A `/v1/completions` request.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    /// The `model` asked for.
    pub model: String,
    /// One or more prompts (`prompt` may be a list).
    pub prompts: Vec<Prompt>,
    /// Sampling options.
    pub sampling: Sampling,
}

/// A `/v1/chat/completions` request.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// The `model` asked for.
    pub model: String,
    /// The conversation, as `[{"role", "content"}]` with text content (parts joined).
    pub messages: Value,
    /// Sampling options (`logprobs` is `top_logprobs` when `logprobs: true`).
    pub sampling: Sampling,
}

/// A JSON object's fields, taken one by one; [`Fields::finish`] refuses the ones left.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    taken: Vec<&'static str>,
}

impl<'a> Fields<'a> {
    fn new(body: &'a Value) -> Result<Self, ApiError> {
        match body {
            Value::Object(obj) => Ok(Self { obj, taken: Vec::new() }),
            other => Err(ApiError::bad(format!("the body must be a JSON object, got {}", kind(other)), None)),
        }
    }

    /// The field's value, `None` when absent or null.
    fn get(&mut self, name: &'static str) -> Option<&'a Value> {
        self.taken.push(name);
        self.obj.get(name).filter(|v| !v.is_null())
    }

    fn string(&mut self, name: &'static str) -> Result<Option<String>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(wrong_type(name, "a string", v)),
        }
    }

    fn number(&mut self, name: &'static str) -> Result<Option<f64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(x)) => Ok(x.as_f64()),
            Some(v) => Err(wrong_type(name, "a number", v)),
        }
    }

    fn integer(&mut self, name: &'static str) -> Result<Option<i64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(x)) if x.is_i64() || x.is_u64() => Ok(Some(x.as_i64().unwrap_or(i64::MAX))),
            Some(v) => Err(wrong_type(name, "an integer", v)),
        }
    }

    fn boolean(&mut self, name: &'static str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(wrong_type(name, "true or false", v)),
        }
    }

    /// An integer in `lo..=hi`, when given.
    fn int_in(&mut self, name: &'static str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        match self.integer(name)? {
            Some(x) if x < lo || x > hi => {
                Err(ApiError::bad(format!("`{name}` must be between {lo} and {hi}, got {x}"), Some(name)))
            }
            x => Ok(x),
        }
    }

    /// A field rltune accepts only at the value that changes nothing (`ok`), naming what to do.
    fn only_noop(&mut self, name: &'static str, ok: fn(&Value) -> bool, why: &str) -> Result<(), ApiError> {
        match self.get(name) {
            Some(v) if !ok(v) => {
                Err(ApiError::bad(format!("`{name}` = {v} is not supported: {why}"), Some(name)))
            }
            _ => Ok(()),
        }
    }

    /// Refuses the fields not taken, naming the first.
    fn finish(self, endpoint: &str) -> Result<(), ApiError> {
        let mut unknown: Vec<&String> =
            self.obj.keys().filter(|k| !self.taken.contains(&k.as_str())).collect();
        unknown.sort();
        match unknown.first() {
            None => Ok(()),
            Some(k) => {
                let mut known = self.taken.clone();
                known.sort_unstable();
                known.dedup();
                Err(ApiError::bad(
                    format!("unknown field `{k}` for {endpoint}; known fields: {}", known.join(", ")),
                    Some(k),
                ))
            }
        }
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong_type(name: &'static str, want: &str, got: &Value) -> ApiError {
    ApiError::bad(format!("`{name}` must be {want}, got {}", kind(got)), Some(name))
}

/// The options both endpoints share; `max_tokens` and `logprobs` are read by the caller.
fn sampling(f: &mut Fields<'_>) -> Result<Sampling, ApiError> {
    let temperature = f.number("temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad(
            format!("`temperature` must be in [0, 2], got {temperature}"),
            Some("temperature"),
        ));
    }
    let top_p = f.number("top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad(format!("`top_p` must be in (0, 1], got {top_p}"), Some("top_p")));
    }
    // vLLM's extensions: top_k -1 (or 0) is off, min_p 0 is off.
    let top_k = f.int_in("top_k", -1, 1 << 20)?.map_or(0, |k| k.max(0) as usize);
    let min_p = f.number("min_p")?.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::bad(format!("`min_p` must be in [0, 1], got {min_p}"), Some("min_p")));
    }
    let n = f.int_in("n", 1, MAX_N as i64)?.unwrap_or(1) as usize;
    let seed = match f.get("seed") {
        None => None,
        Some(Value::Number(x)) => match (x.as_u64(), x.as_i64()) {
            (Some(s), _) => Some(s),
            // A negative seed is a valid i64: its bits.
            (None, Some(s)) => Some(s as u64),
            _ => return Err(wrong_type("seed", "an integer", &Value::Number(x.clone()))),
        },
        Some(v) => return Err(wrong_type("seed", "an integer", v)),
    };
    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_string).ok_or_else(|| wrong_type("stop", "a list of strings", s)))
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(wrong_type("stop", "a string or a list of strings", v)),
    };
    if stop.len() > MAX_STOP || stop.iter().any(String::is_empty) {
        return Err(ApiError::bad(format!("`stop` takes 1 to {MAX_STOP} non-empty strings"), Some("stop")));
    }
    for penalty in ["presence_penalty", "frequency_penalty"] {
        f.only_noop(penalty, |v| v.as_f64() == Some(0.0), "rltune samples from the policy as it is; send 0")?;
    }
    f.only_noop("stream", |v| v == &Value::Bool(false), "responses come whole; send false")?;
    f.only_noop("stream_options", |_| false, "responses come whole")?;
    f.only_noop("logit_bias", |v| v.as_object().is_some_and(Map::is_empty), "send {} or leave it out")?;
    // Accepted and ignored: `user`; `return_token_ids` (vLLM's flag: the ids always come back).
    f.string("user")?;
    f.boolean("return_token_ids")?;
    Ok(Sampling { max_tokens: None, temperature, top_p, top_k, min_p, n, seed, stop, logprobs: None })
}

/// `max_tokens` (or `max_completion_tokens`): at least 1.
fn max_tokens(f: &mut Fields<'_>, name: &'static str) -> Result<Option<usize>, ApiError> {
    Ok(f.int_in(name, 1, i64::from(u32::MAX))?.map(|m| m as usize))
}

/// The model, which every request names.
fn model(f: &mut Fields<'_>) -> Result<String, ApiError> {
    f.string("model")?.ok_or_else(|| ApiError::bad("`model` is required".into(), Some("model")))
}

/// Parses a `/v1/completions` body.
pub fn completion_request(body: &Value) -> Result<CompletionRequest, ApiError> {
    let mut f = Fields::new(body)?;
    let model = model(&mut f)?;
    let prompts = match f.get("prompt") {
        None => return Err(ApiError::bad("`prompt` is required".into(), Some("prompt"))),
        Some(p) => prompts(p)?,
    };
    let mut sampling = sampling(&mut f)?;
    sampling.max_tokens = max_tokens(&mut f, "max_tokens")?;
    sampling.logprobs = f.int_in("logprobs", 0, MAX_TOP_LOGPROBS as i64)?.map(|k| k as usize);
    f.only_noop("echo", |v| v == &Value::Bool(false), "the prompt is not repeated; send false")?;
    f.only_noop("suffix", |_| false, "insertion is not supported")?;
    let n = sampling.n;
    match f.integer("best_of")? {
        Some(b) if b != n as i64 => {
            return Err(ApiError::bad(format!("`best_of` must equal `n` ({n}), got {b}"), Some("best_of")))
        }
        _ => {}
    }
    f.finish("/v1/completions")?;
    Ok(CompletionRequest { model, prompts, sampling })
}

/// `prompt`: a string, a list of strings, a list of token ids, or a list of lists of ids.
fn prompts(p: &Value) -> Result<Vec<Prompt>, ApiError> {
    let ids = |v: &Value| -> Option<Vec<u32>> {
        v.as_array()?.iter().map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok())).collect()
    };
    let bad =
        || wrong_type("prompt", "a string, a list of strings, or a list of token ids (or of such lists)", p);
    let out = match p {
        Value::String(s) => vec![Prompt::Text(s.clone())],
        Value::Array(a) if a.is_empty() => return Err(bad()),
        Value::Array(a) if a[0].is_number() => vec![Prompt::Ids(ids(p).ok_or_else(bad)?)],
        Value::Array(a) if a[0].is_string() => a
            .iter()
            .map(|s| s.as_str().map(|s| Prompt::Text(s.to_string())).ok_or_else(bad))
            .collect::<Result<_, _>>()?,
        Value::Array(a) => {
            a.iter().map(|x| ids(x).map(Prompt::Ids).ok_or_else(bad)).collect::<Result<_, _>>()?
        }
        _ => return Err(bad()),
    };
    if out.iter().any(|p| matches!(p, Prompt::Ids(ids) if ids.is_empty())) {
        return Err(ApiError::bad("`prompt` has an empty list of token ids".into(), Some("prompt")));
    }
    Ok(out)
}

/// Parses a `/v1/chat/completions` body.
pub fn chat_request(body: &Value) -> Result<ChatRequest, ApiError> {
    let mut f = Fields::new(body)?;
    let model = model(&mut f)?;
    let messages = match f.get("messages") {
        None => return Err(ApiError::bad("`messages` is required".into(), Some("messages"))),
        Some(m) => messages(m)?,
    };
    let mut sampling = sampling(&mut f)?;
    let a = max_tokens(&mut f, "max_tokens")?;
    let b = max_tokens(&mut f, "max_completion_tokens")?;
    sampling.max_tokens = b.or(a);
    let logprobs = f.boolean("logprobs")?.unwrap_or(false);
    let top = f.int_in("top_logprobs", 0, MAX_TOP_LOGPROBS as i64)?;
    if top.is_some() && !logprobs {
        return Err(ApiError::bad("`top_logprobs` needs `logprobs: true`".into(), Some("top_logprobs")));
    }
    sampling.logprobs = logprobs.then_some(top.unwrap_or(0) as usize);
    f.only_noop("tools", |v| v.as_array().is_some_and(Vec::is_empty), "tool calls are not supported")?;
    f.only_noop("tool_choice", |v| v == "none", "tool calls are not supported")?;
    f.get("parallel_tool_calls");
    f.only_noop(
        "response_format",
        |v| v.get("type").and_then(Value::as_str) == Some("text"),
        "only {\"type\": \"text\"}",
    )?;
    f.finish("/v1/chat/completions")?;
    Ok(ChatRequest { model, messages, sampling })
}

/// `messages`: a non-empty list of `{"role", "content"}`, content a string, null, or a list of
/// `{"type": "text", "text"}` parts (joined). Returns the list with text contents.
fn messages(m: &Value) -> Result<Value, ApiError> {
    let Some(list) = m.as_array().filter(|l| !l.is_empty()) else {
        return Err(wrong_type("messages", "a non-empty list of {\"role\", \"content\"} objects", m));
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, msg) in list.iter().enumerate() {
        let at = |what: &str| ApiError::bad(format!("`messages[{i}]`: {what}"), Some("messages"));
        let Some(obj) = msg.as_object() else { return Err(at("must be an object")) };
        let Some(role) = obj.get("role").and_then(Value::as_str) else {
            return Err(at("needs a string `role`"));
        };
        let content = match obj.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        _ => {
                            return Err(at(
                                "only text parts ({\"type\": \"text\", \"text\": …}) are supported",
                            ))
                        }
                    }
                }
                text
            }
            Some(_) => return Err(at("`content` must be a string or a list of text parts")),
        };
        let mut clean = obj.clone();
        clean.insert("role".into(), role.into());
        clean.insert("content".into(), content.into());
        out.push(Value::Object(clean));
    }
    Ok(Value::Array(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(r: Result<impl std::fmt::Debug, ApiError>) -> (String, Option<String>) {
        let e = r.unwrap_err();
        (e.message, e.param)
    }

    #[test]
    fn completion_defaults_and_prompt_forms() {
        let r = completion_request(&json!({"model": "m", "prompt": "hi"})).unwrap();
        assert_eq!(r.prompts, vec![Prompt::Text("hi".into())]);
        assert_eq!(r.sampling.temperature, 1.0);
        assert_eq!((r.sampling.n, r.sampling.max_tokens, r.sampling.logprobs), (1, None, None));
        let r =
            completion_request(&json!({"model": "m", "prompt": [[1, 2], [3]], "logprobs": 2, "stop": "x"}))
                .unwrap();
        assert_eq!(r.prompts, vec![Prompt::Ids(vec![1, 2]), Prompt::Ids(vec![3])]);
        assert_eq!((r.sampling.logprobs, r.sampling.stop.clone()), (Some(2), vec!["x".to_string()]));
        let r =
            completion_request(&json!({"model": "m", "prompt": [5, 6], "seed": -1, "top_k": -1})).unwrap();
        assert_eq!((r.prompts.len(), r.sampling.seed, r.sampling.top_k), (1, Some(u64::MAX), 0));
        assert_eq!(r.sampling.min_p, 0.0, "off unless given");
        let r = completion_request(&json!({"model": "m", "prompt": [5], "min_p": 0.1})).unwrap();
        assert_eq!(r.sampling.min_p, 0.1);
    }

    #[test]
    fn errors_name_the_field() {
        for (body, param, want) in [
            (json!([1]), None, "JSON object"),
            (json!({"prompt": "x"}), Some("model"), "`model` is required"),
            (json!({"model": "m"}), Some("prompt"), "`prompt` is required"),
            (json!({"model": "m", "prompt": "x", "temperature": "hot"}), Some("temperature"), "a number"),
            (json!({"model": "m", "prompt": "x", "temperature": 3}), Some("temperature"), "[0, 2]"),
            (json!({"model": "m", "prompt": "x", "top_p": 0}), Some("top_p"), "(0, 1]"),
            (json!({"model": "m", "prompt": "x", "min_p": 1.5}), Some("min_p"), "[0, 1]"),
            (json!({"model": "m", "prompt": "x", "max_tokens": 0}), Some("max_tokens"), "between 1"),
            (json!({"model": "m", "prompt": "x", "n": 1.5}), Some("n"), "an integer"),
            (json!({"model": "m", "prompt": "x", "echo": true}), Some("echo"), "not supported"),
            (json!({"model": "m", "prompt": "x", "stream": true}), Some("stream"), "not supported"),
            (json!({"model": "m", "prompt": "x", "best_of": 3}), Some("best_of"), "equal `n`"),
            (json!({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}), Some("stop"), "1 to 4"),
            (json!({"model": "m", "prompt": "x", "logprobs": 21}), Some("logprobs"), "between 0 and 20"),
            (json!({"model": "m", "prompt": "x", "frobnicate": 1}), Some("frobnicate"), "unknown field"),
            (json!({"model": "m", "prompt": [1, "a"]}), Some("prompt"), "token ids"),
            (json!({"model": "m", "prompt": []}), Some("prompt"), "token ids"),
            (json!({"model": "m", "prompt": [[]]}), Some("prompt"), "empty list"),
        ] {
            let (msg, p) = err(completion_request(&body));
            assert_eq!(p.as_deref(), param, "{body}: {msg}");
            assert!(msg.contains(want), "{body}: {msg}");
        }
    }

    #[test]
    fn chat_reads_messages_logprobs_and_text_parts() {
        let body = json!({"model": "m", "messages": [
            {"role": "system", "content": null},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "logprobs": true, "top_logprobs": 3, "max_completion_tokens": 7});
        let r = chat_request(&body).unwrap();
        assert_eq!(r.messages, json!([{"role": "system", "content": ""}, {"role": "user", "content": "ab"}]));
        assert_eq!((r.sampling.logprobs, r.sampling.max_tokens), (Some(3), Some(7)));
        let r = chat_request(&json!({"model": "m", "messages": [{"role": "user", "content": "x"}]})).unwrap();
        assert_eq!(r.sampling.logprobs, None);
        for (body, param, want) in [
            (json!({"model": "m", "messages": []}), "messages", "non-empty"),
            (json!({"model": "m", "messages": [{"content": "x"}]}), "messages", "messages[0]"),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                "messages",
                "text parts",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user"}], "top_logprobs": 2}),
                "top_logprobs",
                "logprobs: true",
            ),
            (json!({"model": "m", "messages": [{"role": "user"}], "tools": [{}]}), "tools", "not supported"),
        ] {
            let (msg, p) = err(chat_request(&body));
            assert_eq!(p.as_deref(), Some(param), "{body}: {msg}");
            assert!(msg.contains(want), "{body}: {msg}");
        }
    }
}
