//! Jinja chat templates, rendered as transformers' `apply_chat_template` does.
//!
//! A model's chat template is the `chat_template` of its `tokenizer_config.json` (or
//! `tokenizer.chat_template` in a GGUF, which [`super::gguf`] copies there). transformers renders it
//! with Jinja2 (`utils/chat_template_utils.py`, `_compile_jinja_template`) in an environment with
//! `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that keeps
//! non-ASCII text (`json.dumps(x, ensure_ascii=False)`), and the globals `raise_exception` and
//! `strftime_now`; the context holds `messages`, `add_generation_prompt`, the special tokens
//! (`bos_token`, `eos_token`, …) and any extra variables. Here the same environment is built with
//! `minijinja`, and `minijinja-contrib`'s Python compatibility layer provides the string, dict and
//! list methods templates call (`.strip()`, `.split()`, `.items()`, `.startswith()` …).
//!
//! transformers' `{% generation %}…{% endgeneration %}` tag (its `AssistantTracker` extension,
//! which `apply_chat_template(return_assistant_tokens_mask=True)` reads) is supported: the tag is
//! rewritten to a filter block that brackets its output with markers, and [`Rendered`] returns
//! the text with the byte spans of the generated parts; [`assistant_mask`] turns them into the
//! token mask as transformers 5.24 does.
//!
//! Known differences from Jinja2: `tojson` writes object keys sorted (serde_json's map), where
//! Python keeps insertion order; it only matters for templates that serialize tool schemas.
//! `strftime_now` formats the current UTC time (Python uses local time) and knows `%d %b %B %m %Y
//! %y %H %M %S %j %%`.

use std::path::Path;

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use serde_json::json;

use crate::error::{Error, Result};

/// A compiled chat template and the special tokens it can refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, `unk_token`, `pad_token` as strings, when known.
    special: serde_json::Map<String, serde_json::Value>,
    /// Where the template came from, for errors.
    source: String,
    /// Whether the template has `{% generation %}` blocks.
    has_generation: bool,
}

/// Opens and closes a `{% generation %}` block's output in a rendering (Unicode noncharacters,
/// which text does not contain).
const GEN_OPEN: char = '\u{FDD0}';
const GEN_CLOSE: char = '\u{FDD1}';
const GENERATION_FILTER: &str = "__rltune_generation";

/// `{% generation %}`, with any whitespace control (transformers' and TRL's pattern).
fn generation_tag() -> &'static regex::Regex {
    static RE: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    RE.get_or_init(|| regex::Regex::new(r"\{%-?\s*generation\s*-?%\}").expect("valid regex"))
}

/// Rewrites `{% generation %}` / `{% endgeneration %}` into a filter block (same whitespace
/// control, so `trim_blocks` and `lstrip_blocks` act on it the same way).
fn rewrite_generation_tags(template: &str) -> String {
    static RE: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let re = RE
        .get_or_init(|| regex::Regex::new(r"\{%(-?)(\s*)(end)?generation(\s*)(-?)%\}").expect("valid regex"));
    re.replace_all(template, |c: &regex::Captures| {
        let body =
            if c.get(3).is_some() { "endfilter".to_string() } else { format!("filter {GENERATION_FILTER}") };
        format!("{{%{}{} {body} {}{}%}}", &c[1], &c[2], &c[4], &c[5])
    })
    .into_owned()
}

/// A rendered conversation and the byte ranges of its `{% generation %}` blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// The text.
    pub text: String,
    /// `[start, end)` byte ranges of the generated (assistant) parts, in order.
    pub generation_spans: Vec<(usize, usize)>,
}

/// How to render a conversation (transformers' `apply_chat_template` arguments).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RenderOptions {
    /// Append the assistant header after the messages.
    pub add_generation_prompt: bool,
    /// End the text at the last message's content, so generation continues it.
    pub continue_final_message: bool,
}

/// Strips the generation markers from `raw`, returning the text and the spans they enclosed
/// (nested blocks count once, as their outermost span).
fn strip_markers(raw: &str) -> Rendered {
    let mut text = String::with_capacity(raw.len());
    let (mut spans, mut depth, mut start) = (Vec::new(), 0usize, 0usize);
    for c in raw.chars() {
        match c {
            GEN_OPEN => {
                if depth == 0 {
                    start = text.len();
                }
                depth += 1;
            }
            GEN_CLOSE => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    spans.push((start, text.len()));
                }
            }
            _ => text.push(c),
        }
    }
    Rendered { text, generation_spans: spans }
}

/// transformers' assistant mask: token `t` is 1 when its offsets overlap a generation span
/// (`tokenization_utils_base.py`, `apply_chat_template(return_assistant_tokens_mask=True)`, 5.24:
/// a single pass over spans and token offsets, both in order). `offsets` are the tokens'
/// `[start, end)` byte offsets in the rendered text.
pub fn assistant_mask(offsets: &[(usize, usize)], spans: &[(usize, usize)]) -> Vec<u8> {
    let mut mask = vec![0u8; offsets.len()];
    let mut s = 0;
    for (t, &(start, end)) in offsets.iter().enumerate() {
        while s < spans.len() && start >= spans[s].1 {
            s += 1;
        }
        if s == spans.len() {
            break;
        }
        if end > spans[s].0 {
            mask[t] = 1;
        }
    }
    mask
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("source", &self.source).field("special", &self.special).finish()
    }
}

/// A special token in tokenizer_config.json: a string, or an `AddedToken` dict with `content`.
fn token_string(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
        _ => None,
    }
}

impl ChatTemplate {
    /// Compiles `template`; `special` maps `bos_token` etc. to their strings; `source` names the
    /// file in errors.
    pub fn new(
        template: &str,
        special: serde_json::Map<String, serde_json::Value>,
        source: &str,
    ) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::Input(format!("{source}: chat template syntax config: {e}")))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, format!("raise_exception: {msg}")))
        });
        env.add_function("strftime_now", |fmt: String| -> String { strftime_now(&fmt) });
        env.add_filter("tojson", tojson);
        env.add_filter(GENERATION_FILTER, |body: String| -> Value {
            Value::from_safe_string(format!("{GEN_OPEN}{body}{GEN_CLOSE}"))
        });
        let has_generation = generation_tag().is_match(template);
        let rewritten = rewrite_generation_tags(template);
        env.add_template_owned("chat", rewritten)
            .map_err(|e| Error::Input(format!("{source}: the chat template does not compile: {e:#}")))?;
        Ok(Self { env, special, source: source.to_string(), has_generation })
    }

    /// Whether the template marks the assistant's text with `{% generation %}` blocks (TRL's
    /// `has_generation_markers`).
    pub fn has_generation_markers(&self) -> bool {
        self.has_generation
    }

    /// The chat template of a `tokenizer_config.json`, with its special tokens; `None` when it
    /// has none. A list of named templates (`[{"name": …, "template": …}]`) gives the `default` one.
    pub fn from_tokenizer_config(path: &Path) -> Result<Option<Self>> {
        let v: serde_json::Value = crate::io::read_json(path)?;
        let template = match v.get("chat_template") {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(list)) => {
                let named = |n: &str| {
                    list.iter()
                        .find(|t| t.get("name").and_then(|x| x.as_str()) == Some(n))
                        .and_then(|t| t.get("template"))
                        .and_then(|t| t.as_str())
                };
                named("default")
                    .ok_or_else(|| {
                        Error::config(
                            path,
                            "chat_template is a list without a \"default\" entry; name one \"default\"",
                        )
                    })?
                    .to_string()
            }
            Some(_) => return Err(Error::config(path, "chat_template must be a string (a Jinja template)")),
        };
        let mut special = serde_json::Map::new();
        for name in ["bos_token", "eos_token", "unk_token", "pad_token"] {
            if let Some(t) = v.get(name).and_then(token_string) {
                special.insert(name.into(), t.into());
            }
        }
        Self::new(&template, special, &path.display().to_string()).map(Some)
    }

    /// The chat template beside a model: `chat_template.jinja` in `dir` (where transformers 5
    /// saves it; it wins, as in transformers), else `tokenizer_config.json`'s, with the special
    /// tokens of `tokenizer_config.json`.
    pub fn for_model_dir(dir: &Path) -> Result<Option<Self>> {
        let p = dir.join("tokenizer_config.json");
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let template = std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?;
            let mut special = serde_json::Map::new();
            if p.exists() {
                let v: serde_json::Value = crate::io::read_json(&p)?;
                for name in ["bos_token", "eos_token", "unk_token", "pad_token"] {
                    if let Some(t) = v.get(name).and_then(token_string) {
                        special.insert(name.into(), t.into());
                    }
                }
            }
            return Self::new(&template, special, &jinja.display().to_string()).map(Some);
        }
        if !p.exists() {
            return Ok(None);
        }
        Self::from_tokenizer_config(&p)
    }

    /// Renders `messages` (a JSON list of `{"role", "content", …}`), as
    /// `apply_chat_template(messages, tokenize=False, add_generation_prompt=…)`.
    pub fn render(&self, messages: &serde_json::Value, add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// [`Self::render`] with extra template variables (transformers' `**kwargs`, e.g. `tools`).
    pub fn render_with(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let opts = RenderOptions { add_generation_prompt, continue_final_message: false };
        Ok(self.render_full(messages, opts, extra)?.text)
    }

    /// Renders `messages` as transformers 5.24's `apply_chat_template(messages, tokenize=False,
    /// …)`: message keys whose value is null are dropped first (`_normalize_chat_messages`), and
    /// `continue_final_message` cuts the text after the last message's content (found through a
    /// tag appended to it, as transformers does). Returns the generation spans too.
    pub fn render_full(
        &self,
        messages: &serde_json::Value,
        opts: RenderOptions,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Rendered> {
        const TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";
        if opts.continue_final_message && opts.add_generation_prompt {
            return Err(Error::Input(
                "continue_final_message and add_generation_prompt are not compatible".into(),
            ));
        }
        let mut messages = normalize_messages(messages);
        let mut final_message = String::new();
        if opts.continue_final_message {
            let last = messages.as_array_mut().and_then(|m| m.last_mut()).and_then(|m| m.as_object_mut());
            match last.and_then(|m| m.get_mut("content")) {
                Some(serde_json::Value::String(c)) => {
                    final_message = c.clone();
                    c.push_str(TAG);
                }
                _ => {
                    return Err(Error::Input(
                        "continue_final_message is set but the final message has no string \"content\" to continue"
                            .into(),
                    ))
                }
            }
        }
        let raw = self.render_raw(&messages, opts.add_generation_prompt, extra)?;
        let mut out = strip_markers(&raw);
        if opts.continue_final_message {
            let tag = TAG.trim();
            let (Some(loc), true) = (out.text.rfind(tag), out.text.contains(final_message.trim())) else {
                return Err(Error::Input(format!(
                    "{}: continue_final_message is set but the final message does not appear in the chat after \
                     applying the chat template",
                    self.source
                )));
            };
            let cut = if out.text[loc..].starts_with(TAG) { loc } else { out.text[..loc].trim_end().len() };
            out.text.truncate(cut);
            out.generation_spans.retain(|s| s.0 < cut);
            for s in &mut out.generation_spans {
                s.1 = s.1.min(cut);
            }
        }
        Ok(out)
    }

    /// The template's output with the generation markers in it.
    fn render_raw(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        if !messages.as_array().is_some_and(|m| m.iter().all(|x| x.get("role").is_some())) {
            return Err(Error::Input(format!(
                "a conversation must be a list of {{\"role\": …, \"content\": …}} messages, got {}",
                truncate(&messages.to_string(), 120)
            )));
        }
        let mut ctx = self.special.clone();
        for (k, v) in extra {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), messages.clone());
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        let tmpl = self.env.get_template("chat").map_err(|e| Error::Input(e.to_string()))?;
        tmpl.render(Value::from(minijinja::value::Serde(&ctx)))
            .map_err(|e| Error::Input(format!("{}: rendering the chat template failed: {e:#}", self.source)))
    }
}

/// transformers' `_normalize_chat_messages`: drops the message keys whose value is null (Arrow
/// and Parquet rows hold null for a field that only other messages have).
fn normalize_messages(messages: &serde_json::Value) -> serde_json::Value {
    match messages {
        serde_json::Value::Array(list) => serde_json::Value::Array(
            list.iter()
                .map(|m| match m {
                    serde_json::Value::Object(o) => serde_json::Value::Object(
                        o.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())).collect(),
                    ),
                    other => other.clone(),
                })
                .collect(),
        ),
        other => other.clone(),
    }
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent)` (`", "` and `": "`
/// separators; with an indent, one item per line).
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> std::result::Result<Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let v = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_py_json(&v, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn write_py_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    let newline = |out: &mut String, d: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * d));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        serde_json::Value::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                write_py_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        serde_json::Value::Object(o) if !o.is_empty() => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::Value::String(k.clone()).to_string());
                out.push_str(": ");
                write_py_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// `strftime_now(fmt)` on the current UTC time.
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    strftime(fmt, secs)
}

/// Formats `secs` since the epoch (UTC) with the common strftime codes.
fn strftime(fmt: &str, secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let jday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('j') => out.push_str(&format!("{jday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// A prompt row's `prompt` as text: a string as is, a conversation (a list of messages) through
/// the chat template with `add_generation_prompt` (TRL's `maybe_apply_chat_template`).
pub fn prompt_text(prompt: &serde_json::Value, template: Option<&ChatTemplate>) -> Result<String> {
    match prompt {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Array(_) => match template {
            Some(t) => t.render(prompt, true),
            None => Err(Error::Input(
                "the prompt is a conversation (a list of messages) but the model has no chat template \
                 (tokenizer_config.json has no chat_template); give plain-text prompts, or a model with one"
                    .into(),
            )),
        },
        other => Err(Error::Input(format!(
            "a prompt must be a string or a list of messages, got {}",
            truncate(&other.to_string(), 80)
        ))),
    }
}

/// Whether `msgs` is a conversation: a non-empty list of objects with a string `role`.
pub fn is_conversation(msgs: &[serde_json::Value]) -> bool {
    !msgs.is_empty() && msgs.iter().all(|m| m.get("role").is_some_and(|r| r.is_string()))
}

/// `{"role": "user", "content": text}` as a one-message conversation.
pub fn user_message(text: &str) -> serde_json::Value {
    json!([{"role": "user", "content": text}])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpl(src: &str) -> ChatTemplate {
        let mut special = serde_json::Map::new();
        special.insert("bos_token".into(), "<s>".into());
        special.insert("eos_token".into(), "</s>".into());
        ChatTemplate::new(src, special, "test").unwrap()
    }

    #[test]
    fn blocks_trim_and_python_methods_work() {
        let t = tmpl("{% for m in messages %}\n  {{ m['content'].strip() }}{% if not loop.last %}|{% endif %}\n{% endfor %}{{ eos_token }}");
        let msgs = json!([{"role": "user", "content": "  a "}, {"role": "assistant", "content": "b"}]);
        // Jinja2 (trim_blocks, lstrip_blocks) gives the same: '  a|  b</s>' (the indent precedes a
        // variable tag, which lstrip_blocks leaves alone; the newlines follow block tags).
        assert_eq!(t.render(&msgs, false).unwrap(), "  a|  b</s>");
    }

    #[test]
    fn raise_exception_is_an_error_with_its_message() {
        let t = tmpl("{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}ok");
        let e = t.render(&json!([{"role": "assistant", "content": "x"}]), false).unwrap_err().to_string();
        assert!(e.contains("roles must alternate"), "{e}");
        let e =
            ChatTemplate::new("{{ x", Default::default(), "tokenizer_config.json").unwrap_err().to_string();
        assert!(e.contains("tokenizer_config.json") && e.contains("does not compile"), "{e}");
    }

    #[test]
    fn tojson_writes_python_separators_and_keeps_unicode() {
        let t = tmpl("{{ messages[0] | tojson }}");
        assert_eq!(
            t.render(&json!([{"role": "user", "content": "é"}]), false).unwrap(),
            r#"{"content": "é", "role": "user"}"#
        );
    }

    #[test]
    fn strftime_formats_a_known_date() {
        // Python: datetime.fromtimestamp(1722006309, timezone.utc).strftime(...)
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %j %B %m %y %%", 1_722_006_309),
            "26 Jul 2024 15:05:09 208 July 07 24 %"
        );
    }

    #[test]
    fn generation_blocks_give_spans_and_keep_whitespace_control() {
        let t = tmpl(
            "{% for m in messages %}{% if m.role == 'assistant' %}A:{%- generation -%}\n {{ m.content }}|{% endgeneration %}\n{% else %}U:{{ m.content }}\n{% endif %}{% endfor %}",
        );
        assert!(t.has_generation_markers());
        let msgs = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]);
        let r = t.render_full(&msgs, RenderOptions::default(), &Default::default()).unwrap();
        // `-%}` strips the newline and space after the tag, as in Jinja2.
        assert_eq!(r.text, "U:hi\nA:yo|");
        assert_eq!(r.generation_spans, vec![(7, 10)]);
        assert_eq!(t.render(&msgs, false).unwrap(), r.text);
        // Tokens overlapping a span are 1: "A:y" straddles its start, "|" ends it.
        let offsets = [(0, 2), (2, 4), (4, 5), (5, 8), (8, 9), (9, 10)];
        assert_eq!(assistant_mask(&offsets, &r.generation_spans), vec![0, 0, 0, 1, 1, 1]);
        assert_eq!(assistant_mask(&offsets, &[]), vec![0; 6]);
        assert!(!tmpl("{{ messages[0].content }}").has_generation_markers());
    }

    #[test]
    fn continue_final_message_and_null_keys_follow_transformers() {
        let t = tmpl("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.name is defined %}@{{ m.name }}{% endif %}</s>{% endfor %}");
        let msgs =
            json!([{"role": "user", "content": "hi", "name": null}, {"role": "assistant", "content": "Hel"}]);
        let cont = RenderOptions { add_generation_prompt: false, continue_final_message: true };
        let r = t.render_full(&msgs, cont, &Default::default()).unwrap();
        assert_eq!(r.text, "<user>hi</s><assistant>Hel");
        let both = RenderOptions { add_generation_prompt: true, continue_final_message: true };
        assert!(t.render_full(&msgs, both, &Default::default()).is_err());
    }

    #[test]
    fn prompts_are_text_or_conversations() {
        let t = tmpl("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}");
        assert_eq!(prompt_text(&json!("plain"), Some(&t)).unwrap(), "plain");
        assert_eq!(prompt_text(&user_message("hi"), Some(&t)).unwrap(), "[user]hi[assistant]");
        assert!(prompt_text(&user_message("hi"), None).unwrap_err().to_string().contains("chat template"));
        assert!(prompt_text(&json!(3), Some(&t)).is_err());
        assert!(t.render(&json!([{"content": "no role"}]), true).unwrap_err().to_string().contains("role"));
    }
}
