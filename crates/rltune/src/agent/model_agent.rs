//! [`ModelAgent`]: a causal LM playing text games. It reads the [`PromptTemplate`]'s prompt
//! (fitted to its context), samples up to `max_new_tokens` tokens, and plays the text up to the
//! first newline or sentence punctuation ([`extract_action`]).

use candle_core::Device;

use crate::envs::play::{extract_action, Agent, PromptTemplate, Turn};
use crate::envs::EnvStep;
use crate::error::{Error, Result};
use crate::generation::{generate, GenerationConfig};
use crate::models::CausalLm;
use crate::tokenizer::Tokenizer;

/// A language model as an [`Agent`].
pub struct ModelAgent<'a> {
    lm: &'a CausalLm,
    tokenizer: &'a Tokenizer,
    template: PromptTemplate,
    generation: GenerationConfig,
    device: Device,
    /// The longest prompt: the context less the tokens sampled.
    max_prompt_tokens: usize,
    /// Calls so far (each gets its own sampling seed).
    calls: u64,
}

impl<'a> ModelAgent<'a> {
    /// An agent sampling with `generation` (its `seed` starts the per-call seeds).
    pub fn new(
        lm: &'a CausalLm,
        tokenizer: &'a Tokenizer,
        template: PromptTemplate,
        generation: GenerationConfig,
        device: &Device,
    ) -> Result<Self> {
        generation.validate()?;
        let max_prompt_tokens = prompt_budget(lm, generation.max_new_tokens)?;
        Ok(Self { lm, tokenizer, template, generation, device: device.clone(), max_prompt_tokens, calls: 0 })
    }
}

impl Agent for ModelAgent<'_> {
    fn act(&mut self, states: &[(&EnvStep, &[Turn])]) -> crate::envs::Result<Vec<String>> {
        self.choose(states).map_err(|e| crate::envs::Error::Agent(Box::new(e)))
    }
}

impl ModelAgent<'_> {
    /// One sampled action per state (what [`Agent::act`] returns).
    fn choose(&mut self, states: &[(&EnvStep, &[Turn])]) -> Result<Vec<String>> {
        let prompts = states
            .iter()
            .map(|(s, memory)| {
                self.template
                    .fit(s, memory, self.max_prompt_tokens, |t| Ok::<_, Error>(self.tokenizer.encode(t)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let cfg = GenerationConfig {
            seed: self.generation.seed.wrapping_add(self.calls),
            ..self.generation.clone()
        };
        self.calls += 1;
        let samples = generate(self.lm, None, &prompts, &cfg, &self.device)?;
        samples.iter().map(|s| Ok(extract_action(&self.tokenizer.decode(&s.response_ids)?))).collect()
    }
}

/// The longest prompt a model can read when it samples `max_new_tokens` after it: its context
/// less those tokens; an error when nothing is left.
pub fn prompt_budget(lm: &CausalLm, max_new_tokens: usize) -> Result<usize> {
    let context = lm.config().max_positions().unwrap_or(usize::MAX);
    context.checked_sub(max_new_tokens).filter(|&n| n > 0).ok_or_else(|| {
        Error::Input(format!(
            "generation.max_new_tokens = {max_new_tokens} leaves no room for a prompt in the model's {context} positions"
        ))
    })
}
