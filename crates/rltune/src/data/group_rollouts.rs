//! Group rollout files for `rltune grpo-step` / `rloo-step`: JSON lines of
//! `{"prompt_ids": [...], "completion_ids": [...], "reward": <float or null>}`, or with several
//! reward functions `"rewards": {"name": <float or null>, ...}`, optionally `"truncated": true`.
//! Consecutive lines with the same prompt form one group (TRL's order). `null` is TRL's `None`:
//! that function does not score that sample. Every problem is reported with the file and line.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{Error, Result};
use crate::grpo::RewardTable;

/// The rollouts of one GRPO/RLOO step.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupRollouts {
    /// Prompt ids per line.
    pub prompts: Vec<Vec<u32>>,
    /// Completion ids per line.
    pub completions: Vec<Vec<u32>>,
    /// `"truncated"` per line, when given.
    pub truncated: Vec<Option<bool>>,
    /// The rewards, one column per function.
    pub rewards: RewardTable,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    prompt_ids: Vec<u32>,
    completion_ids: Vec<u32>,
    #[serde(default, deserialize_with = "some_null")]
    reward: Option<Option<f64>>,
    rewards: Option<BTreeMap<String, Option<f64>>>,
    truncated: Option<bool>,
}

/// Keeps `"reward": null` apart from an absent `"reward"`.
fn some_null<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<Option<f64>>, D::Error> {
    <Option<f64> as serde::Deserialize>::deserialize(d).map(Some)
}

/// Reads a group rollouts file. The reward functions are ordered as `reward_funcs` (the config's
/// list, whose order `reward_weights` follows) when given, else by name.
pub fn read_group_rollouts(path: &Path, reward_funcs: Option<&[String]>) -> Result<GroupRollouts> {
    let text = super::read_utf8(path)?;
    let mut prompts = Vec::new();
    let mut completions = Vec::new();
    let mut truncated = Vec::new();
    let mut rows: Vec<BTreeMap<String, f64>> = Vec::new();
    let mut names: Option<Vec<String>> = None;
    let mut first_line = 0;
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let at = |msg: String| Error::data(format!("{} line {n}", path.display()), msg);
        if raw.trim().is_empty() {
            continue;
        }
        let line: Line = serde_json::from_str(raw).map_err(|e| {
            if e.is_syntax() && (raw.contains("NaN") || raw.contains("Infinity")) {
                return at("a reward is NaN or infinite; give a finite number, or null for a missing one".into());
            }
            at(format!(
                "{e}; expected {{\"prompt_ids\": [..], \"completion_ids\": [..], \"reward\": x}} (x a number or \
                 null), or \"rewards\": {{\"name\": x, ..}} for several reward functions, and optionally \
                 \"truncated\": true"
            ))
        })?;
        let row: BTreeMap<String, f64> = match (line.reward, line.rewards) {
            (Some(r), None) => [("reward".to_string(), r.unwrap_or(f64::NAN))].into(),
            (None, Some(map)) if !map.is_empty() => {
                map.into_iter().map(|(k, v)| (k, v.unwrap_or(f64::NAN))).collect()
            }
            (None, Some(_)) => {
                return Err(at("\"rewards\" is empty; give at least one reward function".into()))
            }
            (Some(_), Some(_)) => return Err(at("give either \"reward\" or \"rewards\", not both".into())),
            (None, None) => return Err(at("missing \"reward\" (or \"rewards\": {\"name\": x, ..})".into())),
        };
        let these: Vec<String> = row.keys().cloned().collect();
        match &names {
            None => {
                names = Some(these);
                first_line = n;
            }
            Some(prev) if *prev != these => {
                let msg = format!(
                    "reward functions {these:?} differ from line {first_line}'s {prev:?}; every line needs \
                     the same ones (null for a missing value)"
                );
                return Err(at(msg));
            }
            Some(_) => {}
        }
        prompts.push(line.prompt_ids);
        completions.push(line.completion_ids);
        truncated.push(line.truncated);
        rows.push(row);
    }
    let Some(found) = names else {
        return Err(Error::data(path.display(), "no rollouts (the file is empty)"));
    };
    let order: Vec<String> = match reward_funcs {
        Some(list) => {
            let mut sorted = list.to_vec();
            sorted.sort();
            if sorted != found {
                return Err(Error::data(
                    path.display(),
                    format!(
                        "reward functions {found:?}, but the config's reward_funcs lists {list:?}; make \
                         them the same names"
                    ),
                ));
            }
            list.to_vec()
        }
        None => found,
    };
    let values = rows.iter().map(|r| order.iter().map(|k| r[k]).collect()).collect();
    Ok(GroupRollouts { prompts, completions, truncated, rewards: RewardTable { names: order, values } })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str, funcs: Option<&[String]>) -> Result<GroupRollouts> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.jsonl");
        std::fs::write(&p, text).unwrap();
        read_group_rollouts(&p, funcs)
    }

    #[test]
    fn single_and_multiple_rewards_with_nulls() {
        let r = read(
            "{\"prompt_ids\": [1], \"completion_ids\": [2, 3], \"reward\": 1.5}\n\n\
             {\"prompt_ids\": [1], \"completion_ids\": [4], \"reward\": null, \"truncated\": true}\n",
            None,
        )
        .unwrap();
        assert_eq!(r.rewards.names, vec!["reward"]);
        assert_eq!(r.rewards.values[0], vec![1.5]);
        assert!(r.rewards.values[1][0].is_nan());
        assert_eq!(r.truncated, vec![None, Some(true)]);
        let text = "{\"prompt_ids\": [1], \"completion_ids\": [2], \"rewards\": {\"b\": 1, \"a\": null}}\n";
        let order = vec!["b".to_string(), "a".to_string()];
        let r = read(text, Some(&order)).unwrap();
        assert_eq!(r.rewards.names, order);
        assert_eq!(r.rewards.values[0][0], 1.0);
    }

    #[test]
    fn errors_name_the_line_and_the_fix() {
        let err = read("{\"prompt_ids\": [1], \"completion_ids\": [2]}\n", None).unwrap_err().to_string();
        assert!(err.contains("line 1") && err.contains("missing \"reward\""), "{err}");
        let err = read("{\"prompt_ids\": [1], \"completion_ids\": [2], \"reward\": NaN}\n", None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 1") && err.contains("null for a missing one"), "{err}");
        let text = "{\"prompt_ids\": [1], \"completion_ids\": [2], \"rewards\": {\"a\": 1}}\n\
                    {\"prompt_ids\": [1], \"completion_ids\": [2], \"rewards\": {\"b\": 1}}\n";
        let err = read(text, None).unwrap_err().to_string();
        assert!(err.contains("line 2") && err.contains("line 1"), "{err}");
        let err = read("", None).unwrap_err().to_string();
        assert!(err.contains("no rollouts"), "{err}");
    }
}
