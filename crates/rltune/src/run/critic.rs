//! `[critic]` in `rltune ppo`: loading the separate critic, checking it reads the policy's
//! tokens, and finding it again in a checkpoint (`checkpoints/step-N/critic/`).

use std::path::Path;

use candle_core::{DType, Device};

use super::checkpoint::{CriticFiles, CRITIC_DIR};
use super::config::RunConfig;
use crate::error::{ConfigError, Error, Result};
use crate::models::load::{load_policy_adapted, LoadedPolicy, LoraSpec};

/// Added to `[ppo] seed` for the critic's new LoRA `A` matrices, so that they are not the
/// policy's when both start from one model.
const CRITIC_SEED_OFFSET: u64 = 0x5eed_c217;
use crate::ppo::Critic;
use crate::tokenizer::Tokenizer;

/// Loads the run's critic, if `[critic]` is set: from `ckpt/critic/` when resuming from the
/// checkpoint `ckpt`, else from `[critic] path`. Its vocabulary must be the policy's: the
/// vocab sizes must agree, and when the critic has a `tokenizer.json` it must map every token
/// to the id `policy_tokenizer` does.
pub fn load_critic(
    config: &RunConfig,
    ckpt: Option<&Path>,
    policy_tokenizer: &Tokenizer,
    policy_vocab_size: usize,
    dtype: DType,
    device: &Device,
) -> Result<Option<(Critic, CriticFiles)>> {
    let saved = ckpt.map(|d| d.join(CRITIC_DIR)).filter(|d| d.is_dir());
    let Some(section) = &config.critic else {
        if let Some(dir) = saved {
            return Err(Error::checkpoint(
                dir,
                "holds a critic but the config has no [critic] table; add [critic] (path = the \
                 critic the run started from) to resume this run",
            ));
        }
        return Ok(None);
    };
    // With LoRA the base is always `[critic] path`, and a checkpoint holds the adapter.
    let lora = section.lora.as_ref().map(|l| LoraSpec {
        config: Some(l.clone()),
        adapter: saved.clone(),
        origin: "the run config: [critic.lora]".into(),
        seed: config.ppo.seed.wrapping_add(CRITIC_SEED_OFFSET),
    });
    let src = match (ckpt, saved) {
        _ if lora.is_some() => section.path.clone(),
        (_, Some(dir)) => dir.display().to_string(),
        (Some(dir), None) => {
            return Err(Error::checkpoint(
                dir,
                format!(
                    "has no {CRITIC_DIR}/ (the run was started without a critic) but the config has \
                     [critic]; remove the [critic] table to resume it"
                ),
            ))
        }
        (None, None) => section.path.clone(),
    };
    let spec = Some(config.ppo.value_head_spec());
    let LoadedPolicy { files, config_json, config: cfg, store, model } =
        load_policy_adapted(&src, spec, lora.as_ref(), true, dtype, device).map_err(|e| {
            Error::Setting(ConfigError::table("critic", format!("[critic] path = {:?}: {e}", section.path)))
        })?;
    if cfg.vocab_size() != policy_vocab_size {
        return Err(Error::Setting(ConfigError::table(
            "critic",
            format!(
                "[critic] path = {:?}: the critic's vocab_size is {} but the policy's is \
                 {policy_vocab_size}; the critic reads the policy's token ids, so it needs the \
                 policy's tokenizer: choose a critic of the policy's family",
                section.path,
                cfg.vocab_size()
            ),
        )));
    }
    match &files.tokenizer {
        Some(path) => same_vocabulary(policy_tokenizer, &Tokenizer::from_file(path)?).map_err(|m| {
            Error::Setting(ConfigError::table("critic", format!("[critic] path = {:?}: {m}", section.path)))
        })?,
        None => tracing::warn!(
            "[critic] {}: no tokenizer.json, so only its vocab size was checked against the policy's",
            files.dir.display()
        ),
    }
    let critic = Critic::new(store, model, section.learning_rate(&config.ppo))?;
    Ok(Some((critic, CriticFiles { config_json, files })))
}

/// `Ok` when both tokenizers map every token to the same id; else an [`Error::Tokenizer`] naming
/// a token that differs.
pub fn same_vocabulary(policy: &Tokenizer, critic: &Tokenizer) -> Result<()> {
    let (p, c) = (policy.inner().get_vocab(true), critic.inner().get_vocab(true));
    let mut differs: Vec<(&String, Option<&u32>, &u32)> =
        c.iter().filter(|(t, id)| p.get(*t) != Some(*id)).map(|(t, id)| (t, p.get(t), id)).collect();
    differs.sort_by_key(|(_, _, id)| **id);
    if let Some((tok, pid, cid)) = differs.first() {
        let policy_id = pid.map_or("no id".to_string(), |i| format!("id {i}"));
        return Err(Error::Tokenizer(format!(
            "the critic's tokenizer differs from the policy's ({} tokens differ, e.g. {tok:?} is id {cid} \
             for the critic and {policy_id} for the policy); the critic reads the policy's token ids, \
             so it needs the policy's tokenizer",
            differs.len()
        )));
    }
    if p.len() != c.len() {
        return Err(Error::Tokenizer(format!(
            "the critic's tokenizer has {} tokens and the policy's {}; the critic needs the policy's tokenizer",
            c.len(),
            p.len()
        )));
    }
    Ok(())
}
