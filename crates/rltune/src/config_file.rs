//! Reading TOML config files: `--set table.key=value` overrides, and errors that name the file
//! and suggest the closest valid key for a typo. Every config of the library (`[ppo]`, `[grpo]`,
//! `[env]`, `[runtime]`, …) reads through here.

use std::path::Path;

use crate::error::{Error, Result};

/// Deserializes TOML `text` after applying `overrides` (`table.key=value`; the value is parsed as
/// TOML, else taken as a string). Errors name `path`, and an unknown key gets the closest valid
/// one; without overrides they also carry the line and column.
pub fn parse_toml<T: serde::de::DeserializeOwned>(
    text: &str,
    path: &Path,
    overrides: &[String],
) -> Result<T> {
    let unknown = |e: toml::de::Error| Error::config(path, suggest_unknown_key(&e.to_string()));
    if overrides.is_empty() {
        return toml::from_str(text).map_err(unknown);
    }
    let mut doc: toml::Table = toml::from_str(text).map_err(|e| Error::config(path, e.to_string()))?;
    for o in overrides {
        apply_override(&mut doc, o).map_err(|m| Error::config(path, format!("--set {o}: {m}")))?;
    }
    toml::Value::Table(doc).try_into().map_err(unknown)
}

/// Sets `table.key` (any depth) to `value` in `doc`.
fn apply_override(doc: &mut toml::Table, o: &str) -> std::result::Result<(), String> {
    let (key, value) = o.split_once('=').ok_or("expected table.key=value")?;
    let parts: Vec<&str> = key.trim().split('.').collect();
    let (last, tables) = parts.split_last().ok_or("empty key")?;
    let mut cur = doc;
    for t in tables {
        let entry = cur.entry(t.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry.as_table_mut().ok_or_else(|| format!("{t} is not a table"))?;
    }
    let raw = value.trim();
    let parsed = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    cur.insert(last.to_string(), parsed);
    Ok(())
}

/// Rewrites serde's "unknown field `x`, expected one of `a`, `b`" into "did you mean".
pub fn suggest_unknown_key(msg: &str) -> String {
    let Some(rest) = msg.split("unknown field `").nth(1) else { return msg.to_string() };
    let Some(name) = rest.split('`').next() else { return msg.to_string() };
    let expected: Vec<&str> = rest.split('`').skip(2).step_by(2).filter(|s| !s.is_empty()).collect();
    let location = msg.split("unknown field").next().unwrap_or("").trim();
    let head = if location.is_empty() { String::new() } else { format!("{location} ") };
    if name == "gradient_checkpointing" {
        // TRL's TrainingArguments field; rltune keeps it with the model it applies to.
        return format!(
            "{head}unknown key {name:?}; rltune sets gradient checkpointing with the policy: \
             `[model] gradient_checkpointing = true`"
        );
    }
    match closest(name, &expected) {
        Some(best) => format!("{head}unknown key {name:?}; did you mean {best:?}?"),
        None => format!("{head}unknown key {name:?}; valid keys: {}", expected.join(", ")),
    }
}

/// The candidate with the smallest edit distance, if it is close enough to be a typo.
pub fn closest<'a>(name: &str, candidates: &[&'a str]) -> Option<&'a str> {
    candidates
        .iter()
        .map(|c| (levenshtein(name, c), *c))
        .min()
        .filter(|(d, c)| *d <= 3.max(c.len() / 3))
        .map(|(_, c)| c)
}

fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb)).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}
