//! Conversational rows as TRL 1.16.0 reads them (`trl/data_utils.py`): telling them apart
//! ([`is_conversational`]), the prompt shared by a preference pair ([`extract_prompt`]), and
//! conversations tokenized through the chat template with their assistant mask ([`encode_chat`],
//! transformers' `apply_chat_template(tokenize=True, return_assistant_tokens_mask=…)`).

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::models::chat_template::{assistant_mask, ChatTemplate, RenderOptions};
use crate::tokenizer::Tokenizer;

/// The fields TRL looks at to tell a conversational row (`is_conversational`'s `supported_keys`).
const CONVERSATIONAL_KEYS: &[&str] = &["prompt", "chosen", "rejected", "completion", "messages"];

/// Whether `v` is a list of messages: a list whose first element is an object with a `role`
/// (TRL's test; the other messages are checked by [`check_messages`]).
pub fn is_messages(v: &Value) -> bool {
    v.as_array()
        .and_then(|a| a.first())
        .is_some_and(|m| m.as_object().is_some_and(|o| o.contains_key("role")))
}

/// TRL's `is_conversational`: the first of `prompt`, `chosen`, `rejected`, `completion`,
/// `messages` present in the row is a list of messages.
pub fn is_conversational(fields: &Map<String, Value>) -> bool {
    CONVERSATIONAL_KEYS.iter().find_map(|k| fields.get(*k)).is_some_and(is_messages)
}

/// Checks that `fields[field]` is a non-empty list of `{"role": string, …}` objects; the error
/// names the origin, the field and the message.
pub fn check_messages(v: &Value, origin: &str, field: &str) -> Result<()> {
    let bad = |m: String| Error::data(origin, format!("field {field:?}: {m}"));
    let list = v.as_array().ok_or_else(|| {
        bad(format!("is {}, not a list of {{\"role\", \"content\"}} messages", crate::data::rows::shorten(v)))
    })?;
    if list.is_empty() {
        return Err(bad("is an empty conversation; every row needs at least one message".into()));
    }
    for (i, m) in list.iter().enumerate() {
        let ok = m.as_object().and_then(|o| o.get("role")).is_some_and(|r| r.is_string());
        if !ok {
            return Err(bad(format!(
                "message {} is {}, not an object with a string \"role\" (e.g. {{\"role\": \"user\", \"content\": \
                 \"Hi\"}})",
                i + 1,
                crate::data::rows::shorten(m)
            )));
        }
    }
    Ok(())
}

/// The same value, as text or messages: preference and prompt fields hold either.
#[derive(Debug, Clone, PartialEq)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// A list of messages.
    Chat(Value),
}

/// TRL's `extract_prompt`: the longest common prefix of `chosen` and `rejected` (messages for a
/// conversation, characters for text) becomes the prompt; returns (prompt, chosen, rejected).
///
/// Quirks kept from TRL: when one is a prefix of the other the loop ends on its last index, so
/// the prompt stops one element short; a text prompt gives its trailing space to the completions
/// (`if example["chosen"][idx - 1] == " ": idx -= 1`, with Python's negative index when `idx` is
/// 0). Fails when either is empty (TRL fails there too).
pub fn extract_prompt(
    chosen: &Content,
    rejected: &Content,
) -> std::result::Result<(Content, Content, Content), PairError> {
    fn split<T: PartialEq + Clone>(
        c: &[T],
        r: &[T],
        is_space: impl Fn(&T) -> bool,
    ) -> Option<(usize, usize)> {
        let n = c.len().min(r.len());
        if n == 0 {
            return None;
        }
        // Python's `for idx in range(n)`: idx is the first difference, else n - 1.
        let mut signed = n as isize - 1;
        if let Some(i) = c.iter().zip(r).position(|(x, y)| x != y) {
            signed = i as isize;
            let prev = if i == 0 { c.last() } else { c.get(i - 1) };
            if prev.is_some_and(&is_space) {
                signed -= 1;
            }
        }
        // Python slicing with a possibly negative index: x[:-1] / x[-1:].
        let cut = |len: usize| if signed < 0 { len.saturating_sub(1) } else { (signed as usize).min(len) };
        Some((cut(c.len()), cut(r.len())))
    }
    match (chosen, rejected) {
        (Content::Text(c), Content::Text(r)) => {
            let (cc, rc): (Vec<char>, Vec<char>) = (c.chars().collect(), r.chars().collect());
            let (i, j) = split(&cc, &rc, |x| *x == ' ').ok_or(PairError::Empty)?;
            let s = |v: &[char]| v.iter().collect::<String>();
            Ok((Content::Text(s(&cc[..i])), Content::Text(s(&cc[i..])), Content::Text(s(&rc[j..]))))
        }
        (Content::Chat(c), Content::Chat(r)) => {
            let (ca, ra) =
                (c.as_array().cloned().unwrap_or_default(), r.as_array().cloned().unwrap_or_default());
            let (i, j) =
                split(&ca, &ra, |m| m == &Value::String(" ".into())).ok_or(PairError::EmptyConversation)?;
            Ok((
                Content::Chat(Value::Array(ca[..i].to_vec())),
                Content::Chat(Value::Array(ca[i..].to_vec())),
                Content::Chat(Value::Array(ra[j..].to_vec())),
            ))
        }
        _ => Err(PairError::Mixed),
    }
}

/// Why [`extract_prompt`] cannot split a preference pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PairError {
    /// A text completion is empty.
    #[error("\"chosen\" or \"rejected\" is empty")]
    Empty,
    /// A conversation has no message.
    #[error("\"chosen\" or \"rejected\" is an empty conversation")]
    EmptyConversation,
    /// One is text and the other a conversation.
    #[error("\"chosen\" and \"rejected\" must both be text or both be conversations")]
    Mixed,
}

/// A conversation's token ids and, when asked, its assistant mask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatIds {
    /// Token ids of the rendered conversation (no special tokens added: the template writes them).
    pub ids: Vec<u32>,
    /// 1 where a token overlaps a `{% generation %}` block.
    pub assistant_mask: Option<Vec<u8>>,
}

/// transformers' `apply_chat_template(messages, tokenize=True, return_dict=True, …)`: renders
/// `messages` and tokenizes the text without adding special tokens; with `assistant_mask`, the
/// tokens overlapping a `{% generation %}` block are 1 (see
/// [`crate::models::chat_template::assistant_mask`]).
pub fn encode_chat(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    messages: &Value,
    opts: RenderOptions,
    with_mask: bool,
) -> Result<ChatIds> {
    let rendered = template.render_full(messages, opts, &Map::new())?;
    let enc = tokenizer
        .inner()
        .encode(rendered.text.as_str(), false)
        .map_err(|e| Error::Tokenizer(format!("cannot tokenize the rendered conversation: {e}")))?;
    let mask = with_mask.then(|| assistant_mask(enc.get_offsets(), &rendered.generation_spans));
    Ok(ChatIds { ids: enc.get_ids().to_vec(), assistant_mask: mask })
}

/// TRL's `common_prefix_length`: how many leading ids `a` and `b` share.
pub fn common_prefix_length(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The error for conversational rows when the model has no chat template.
pub fn no_template(origin: &str) -> Error {
    Error::data(
        origin,
        "the row is a conversation (a list of messages) but the model has no chat template \
         (tokenizer_config.json has no chat_template); add one to the model's tokenizer_config.json, or give \
         plain-text rows",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn text(s: &str) -> Content {
        Content::Text(s.into())
    }

    #[test]
    fn extract_prompt_keeps_trls_quirks() {
        // The common prefix, its trailing space given to the completions.
        let (p, c, r) = extract_prompt(&text("The sky is blue."), &text("The sky is green.")).unwrap();
        assert_eq!((p, c, r), (text("The sky is"), text(" blue."), text(" green.")));
        // One a prefix of the other: the prompt stops one short of the shorter.
        let (p, c, r) = extract_prompt(&text("abc"), &text("abcd")).unwrap();
        assert_eq!((p, c, r), (text("ab"), text("c"), text("cd")));
        // Messages: the shared turns.
        let u = json!({"role": "user", "content": "Hi"});
        let a1 = json!({"role": "assistant", "content": "Hello"});
        let a2 = json!({"role": "assistant", "content": "Go away"});
        let (p, c, r) = extract_prompt(
            &Content::Chat(json!([u.clone(), a1.clone()])),
            &Content::Chat(json!([u.clone(), a2.clone()])),
        )
        .unwrap();
        assert_eq!(
            (p, c, r),
            (Content::Chat(json!([u])), Content::Chat(json!([a1])), Content::Chat(json!([a2])))
        );
        assert!(extract_prompt(&text(""), &text("a")).is_err());
    }

    #[test]
    fn conversational_rows_are_told_by_their_first_field() {
        let row = |v: Value| v.as_object().unwrap().clone();
        assert!(is_conversational(&row(json!({"messages": [{"role": "user", "content": "x"}]}))));
        assert!(is_conversational(&row(
            json!({"prompt": [{"role": "user", "content": "x"}], "completion": []})
        )));
        assert!(!is_conversational(&row(json!({"prompt": "x", "completion": "y"}))));
        assert!(!is_conversational(&row(json!({"text": "x"}))));
        let e =
            check_messages(&json!([{"role": "user"}, {"content": "x"}]), "f line 2", "messages").unwrap_err();
        assert!(e.to_string().contains("f line 2") && e.to_string().contains("message 2"), "{e}");
    }
}
