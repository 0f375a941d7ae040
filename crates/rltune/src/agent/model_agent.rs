//! [`ModelAgent`]: a causal LM playing text games. It reads the [`PromptTemplate`]'s prompt
//! (fitted to its context), samples up to `max_new_tokens` tokens, and plays the text up to the
//! first newline or sentence punctuation ([`extract_action`]). With `[agent] actions =
//! "admissible"` it samples only the tokens of the game's admissible commands
//! ([`crate::generation::admissible`]), so it always plays one of them.

use candle_core::Device;

use super::turns::{command_trie, prompt_budget};
use crate::envs::play::{episode_stream, extract_action, ActionMode, Agent, Memory, Pending, PromptTemplate};
use crate::error::{Error, Result};
use crate::generation::admissible::{generate_admissible, ActionTrie};
use crate::generation::{generate, GenerationConfig};
use crate::models::CausalLm;
use crate::tokenizer::Tokenizer;

/// Plays `episodes` episodes with `lm`: as [`crate::envs::play::play`] plays them with a
/// [`ModelAgent`], or with `[agent] memory = "transcript"` as one token sequence per episode on
/// a KV cache carried from turn to turn (`super::transcript`), in rounds of the environments.
/// Returns the episodes in order and the number dropped by failing environments.
#[allow(clippy::too_many_arguments)]
pub fn play_model(
    env: &mut dyn crate::envs::TextEnv,
    lm: &CausalLm,
    tokenizer: &Tokenizer,
    template: &PromptTemplate,
    generation: &GenerationConfig,
    episodes: usize,
    resets: crate::envs::play::ResetPlan,
    device: &Device,
) -> Result<(Vec<crate::envs::play::Episode>, usize)> {
    template.validate()?;
    match template.memory {
        Memory::Transcript => super::transcript::play_transcripts(
            env, lm, tokenizer, template, generation, episodes, resets, device,
        ),
        Memory::Window => {
            let mut agent = ModelAgent::new(lm, tokenizer, template.clone(), generation.clone(), device)?;
            Ok(crate::envs::play::play(env, &mut agent, episodes, resets)?)
        }
    }
}

/// A language model as an [`Agent`].
pub struct ModelAgent<'a> {
    lm: &'a CausalLm,
    tokenizer: &'a Tokenizer,
    template: PromptTemplate,
    generation: GenerationConfig,
    device: Device,
    /// The longest prompt: the context less the tokens sampled.
    max_prompt_tokens: usize,
    /// The logprob of each action of the last call (the sum over its sampled tokens).
    last_logprobs: Vec<f64>,
}

impl<'a> ModelAgent<'a> {
    /// An agent sampling with `generation`: turn `t` of episode `i` draws from the stream
    /// [`episode_stream`]`(seed, i, t)`, whatever batch it is sampled in.
    pub fn new(
        lm: &'a CausalLm,
        tokenizer: &'a Tokenizer,
        template: PromptTemplate,
        generation: GenerationConfig,
        device: &Device,
    ) -> Result<Self> {
        generation.validate()?;
        let max_prompt_tokens = prompt_budget(lm, generation.max_new_tokens)?;
        Ok(Self {
            lm,
            tokenizer,
            template,
            generation,
            device: device.clone(),
            max_prompt_tokens,
            last_logprobs: Vec::new(),
        })
    }
}

impl Agent for ModelAgent<'_> {
    fn act(&mut self, states: &[Pending]) -> crate::envs::Result<Vec<String>> {
        self.choose(states).map_err(|e| crate::envs::Error::Agent(Box::new(e)))
    }

    fn last_logprobs(&self) -> Option<Vec<f64>> {
        Some(self.last_logprobs.clone())
    }
}

impl ModelAgent<'_> {
    /// One sampled action per state (what [`Agent::act`] returns).
    fn choose(&mut self, states: &[Pending]) -> Result<Vec<String>> {
        // Admissible commands: their tries, and the room the longest needs after its prompt.
        let mut budget = self.max_prompt_tokens;
        let mut tries = Vec::new();
        if self.template.actions == ActionMode::Admissible {
            for p in states {
                let (trie, longest) = self.trie(&p.state.admissible_commands)?;
                budget = budget.min(prompt_budget(self.lm, longest)?);
                tries.push(trie);
            }
        }
        let prompts = states
            .iter()
            .map(|p| {
                self.template.fit(p.state, p.turns, budget, |t| Ok::<_, Error>(self.tokenizer.encode(t)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let seed = self.generation.seed;
        let cfg = GenerationConfig {
            row_seeds: states.iter().map(|p| episode_stream(seed, p.episode, p.turns.len())).collect(),
            ..self.generation.clone()
        };
        if self.template.actions == ActionMode::Admissible {
            let picked = generate_admissible(self.lm, None, &prompts, &tries, &cfg, &self.device)?;
            self.last_logprobs =
                picked.iter().map(|p| p.logprobs.iter().map(|&l| f64::from(l)).sum()).collect();
            return Ok(picked
                .iter()
                .zip(states)
                .map(|(a, p)| p.state.admissible_commands[a.action].clone())
                .collect());
        }
        let samples = generate(self.lm, None, &prompts, &cfg, &self.device)?;
        self.last_logprobs = samples.iter().map(|s| s.logprobs.iter().map(|&l| f64::from(l)).sum()).collect();
        samples.iter().map(|s| Ok(extract_action(&self.tokenizer.decode(&s.response_ids)?))).collect()
    }

    /// The token trie of `commands`, each written as the agent writes an action after its prompt:
    /// `" {command}\n"` (the demonstrations' completion form), and the longest one's tokens.
    fn trie(&self, commands: &[String]) -> Result<(ActionTrie, usize)> {
        command_trie(self.tokenizer, commands)
    }
}
