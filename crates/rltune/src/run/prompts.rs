//! Prompts as the loops use them: `[data]` (or `[eval] source`) encoded with the policy's
//! tokenizer (and its chat template where the rows are conversations), and sampled completions
//! decoded into the reward functions' inputs. Shared by PPO, GRPO/RLOO and the held-out
//! evaluation.

use super::config::RunConfig;
use crate::data::prompts::{load_prompts_with, PromptRow};
use crate::error::Result;
use crate::generation::Sample;
use crate::rewards::RewardInput;
use crate::tokenizer::Tokenizer;

/// The prompts of `[data]`, encoded; empty ones are left out.
pub(crate) fn encode_prompts(
    config: &RunConfig,
    tokenizer: &Tokenizer,
) -> Result<Vec<(Vec<u32>, PromptRow)>> {
    encode_from(config, &config.data.source, tokenizer)
}

/// [`encode_prompts`] of another file of the same form (`[eval] source`).
pub(crate) fn encode_from(
    config: &RunConfig,
    source: &str,
    tokenizer: &Tokenizer,
) -> Result<Vec<(Vec<u32>, PromptRow)>> {
    // `[data] split` is the training prompts'; another source (`[eval]`) takes its default split.
    let opts = crate::data::rows::DataOptions {
        split: config.data.split.clone().filter(|_| source == config.data.source),
        columns: config.data.columns.clone(),
    };
    let rows = load_prompts_with(source, &config.data.text_column, &opts)?;
    let column = &config.data.text_column;
    let template = crate::data::prompts::template_if_needed(&rows, column, &config.model.path)?;
    rows.into_iter()
        .map(|r| Ok((crate::data::prompts::encode_prompt(&r, column, tokenizer, template.as_ref())?, r)))
        .filter(|r: &Result<(Vec<u32>, PromptRow)>| r.as_ref().map_or(true, |(ids, _)| !ids.is_empty()))
        .collect()
}

/// The query and response texts of `samples`.
pub(crate) fn decode(tokenizer: &Tokenizer, samples: &[Sample]) -> Result<Vec<(String, String)>> {
    samples
        .iter()
        .map(|s| Ok((tokenizer.decode(&s.query_ids)?, tokenizer.decode(&s.response_ids)?)))
        .collect()
}

/// The reward functions' inputs: each sample with its texts ([`decode`]) and `metas[i]`, the
/// metadata of its prompt row.
pub(crate) fn reward_inputs<'a>(
    samples: &'a [Sample],
    texts: &'a [(String, String)],
    metas: &[&'a serde_json::Value],
) -> Vec<RewardInput<'a>> {
    samples
        .iter()
        .zip(texts)
        .zip(metas)
        .map(|((s, (q, r)), &meta)| RewardInput {
            query: q,
            response: r,
            query_ids: &s.query_ids,
            response_ids: &s.response_ids,
            meta,
        })
        .collect()
}
