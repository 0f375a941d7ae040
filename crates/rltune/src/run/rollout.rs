//! The rollout that the prompt steps share: PPO's, rejection sampling's, GRPO's and RLOO's. A
//! step draws its prompts ([`super::run_loop::Algorithm::draw`]), samples this process's share
//! of them ([`PromptSampler::roll_out`]), scores the samples with its reward
//! ([`Rollout::reward_inputs`]), and updates the policy on them (its trainer's step).

use std::time::Instant;

use candle_core::Device;

use super::prompts::{decode, reward_inputs};
use crate::data::prompts::PromptRow;
use crate::error::Result;
use crate::generation::{generate, GenerationConfig, Sample};
use crate::models::{CausalLm, ValueHead};
use crate::rewards::RewardInput;
use crate::tokenizer::Tokenizer;

/// What samples a step's prompts: the policy, and the run's settings.
pub(crate) struct PromptSampler<'a> {
    /// The policy.
    pub lm: &'a CausalLm,
    /// The value head that values each sampled token (PPO without a critic), if any.
    pub v_head: Option<&'a ValueHead>,
    /// Decodes the samples for the reward.
    pub tokenizer: &'a Tokenizer,
    /// `[generation]`: each step samples with its seed plus the step.
    pub generation: &'a GenerationConfig,
    /// `[data] text_column`: a conversation in it is used whole.
    pub text_column: &'a str,
    /// The processes, each sampling its share of the prompts.
    pub dist: &'a crate::dist::Dist,
    /// Where to compute.
    pub device: &'a Device,
}

/// One step's share of prompts, sampled and decoded.
pub(crate) struct Rollout {
    /// The prompt of each row (an index into the prompts sampled from).
    pub rows: Vec<usize>,
    /// Each row's query: its prompt's tokens, cut to the drawn length.
    pub queries: Vec<Vec<u32>>,
    /// Each row's sample.
    pub samples: Vec<Sample>,
    /// Each sample's query and response texts.
    pub texts: Vec<(String, String)>,
    /// Seconds spent sampling (`time/rollout/generation`).
    pub time_gen: f64,
    /// Seconds spent decoding (counted in `time/rollout/reward`, with the scoring).
    pub time_decode: f64,
}

impl PromptSampler<'_> {
    /// Samples this process's share of step `step`'s `picks` (prompt index, query length),
    /// each prompt `repeat` times in consecutive rows (a group). A text prompt is cut to its
    /// drawn length (TRL's `LengthSampler`); a conversation rendered with the chat template is
    /// used whole, since its first tokens are the template's header, not the user's words. Row
    /// `r` of the whole step draws from its own stream (the global index of this process's first
    /// row keys them), so the samples do not depend on the number of processes.
    pub fn roll_out(
        &self,
        prompts: &[(Vec<u32>, PromptRow)],
        picks: &[(usize, usize)],
        repeat: usize,
        step: usize,
    ) -> Result<Rollout> {
        let share = self.dist.shard(picks.len(), "the prompts of a step")?;
        let row_offset = (share.start * repeat) as u64;
        let mut rows = Vec::with_capacity(share.len() * repeat);
        let mut queries = Vec::with_capacity(share.len() * repeat);
        for &(i, len) in &picks[share] {
            let (ids, row) = &prompts[i];
            let n = if row.is_conversation(self.text_column) { ids.len() } else { ids.len().min(len) };
            for _ in 0..repeat {
                rows.push(i);
                queries.push(ids[..n].to_vec());
            }
        }
        let t = Instant::now();
        let cfg = GenerationConfig {
            seed: self.generation.seed.wrapping_add(step as u64),
            row_offset,
            ..self.generation.clone()
        };
        let samples = generate(self.lm, self.v_head, &queries, &cfg, self.device)?;
        let time_gen = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let texts = decode(self.tokenizer, &samples)?;
        let time_decode = t.elapsed().as_secs_f64();
        Ok(Rollout { rows, queries, samples, texts, time_gen, time_decode })
    }
}

impl Rollout {
    /// The reward's inputs: each sample with its texts and its prompt row's metadata.
    pub fn reward_inputs<'a>(&'a self, prompts: &'a [(Vec<u32>, PromptRow)]) -> Vec<RewardInput<'a>> {
        let metas: Vec<&serde_json::Value> = self.rows.iter().map(|&i| &prompts[i].1.meta).collect();
        reward_inputs(&self.samples, &self.texts, &metas)
    }

    /// The sampled tokens of each row.
    pub fn responses(&self) -> Vec<Vec<u32>> {
        self.samples.iter().map(|s| s.response_ids.clone()).collect()
    }

    /// With truncated sampling, the ids each response token was drawn from (what the training
    /// forward renormalizes over); `None` when sampled from the whole vocabulary.
    pub fn supports(&self) -> Option<Vec<Vec<Vec<u32>>>> {
        self.samples.iter().map(|s| s.support.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{gpt2::Gpt2Config, CausalLmConfig};

    /// A text prompt is cut to its drawn length and a conversation is used whole; each prompt
    /// fills `repeat` consecutive rows, each row draws from its own stream, and a step replays.
    #[test]
    fn prompts_are_cut_repeated_and_sampled_per_row() {
        crate::runtime::Runtime::cpu().install().expect("the CPU runtime installs");
        let words: Vec<String> = (0..21).map(|i| format!("w{i}")).collect();
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        let tokenizer = Tokenizer::word_level(&words, false).unwrap();
        let cfg = CausalLmConfig::Gpt2(Gpt2Config::tiny(23, 16, 2, 2, 32));
        let store =
            crate::params::ParamStore::random(3, false, candle_core::DType::F32, &Device::Cpu).unwrap();
        let lm = CausalLm::load(&store.root(), &cfg).unwrap();
        let row = |meta: serde_json::Value| PromptRow { text: String::new(), meta };
        let prompts = vec![
            (vec![1, 2, 3, 4, 5], row(serde_json::json!({ "query": "w0 w1 w2 w3 w4" }))),
            (vec![6, 7, 8, 9], row(serde_json::json!({ "query": [{ "role": "user", "content": "hi" }] }))),
        ];
        let generation = GenerationConfig { max_new_tokens: 4, stop_at_eos: false, ..Default::default() };
        let dist = crate::dist::Dist::default();
        let sampler = PromptSampler {
            lm: &lm,
            v_head: None,
            tokenizer: &tokenizer,
            generation: &generation,
            text_column: "query",
            dist: &dist,
            device: &Device::Cpu,
        };
        let picks = [(0, 2), (1, 2)];
        let r = sampler.roll_out(&prompts, &picks, 3, 7).unwrap();
        assert_eq!(r.rows, vec![0, 0, 0, 1, 1, 1]);
        let cut: Vec<Vec<u32>> = [[1, 2].to_vec(), [6, 7, 8, 9].to_vec()]
            .iter()
            .flat_map(|q| std::iter::repeat_n(q.clone(), 3))
            .collect();
        assert_eq!(r.queries, cut);
        assert!(r.samples.iter().zip(&r.queries).all(|(s, q)| &s.query_ids == q));
        assert_eq!(r.texts[0].0, "w1 w2");
        let metas: Vec<&serde_json::Value> = r.reward_inputs(&prompts).iter().map(|i| i.meta).collect();
        assert_eq!(metas[2], &prompts[0].1.meta);
        assert_eq!(metas[3], &prompts[1].1.meta);
        // One prompt's rows draw different samples; the same step draws them again.
        let responses = r.responses();
        assert!(responses[..3].iter().any(|x| x != &responses[0]), "{responses:?}");
        assert_eq!(sampler.roll_out(&prompts, &picks, 3, 7).unwrap().responses(), responses);
        assert_ne!(sampler.roll_out(&prompts, &picks, 3, 8).unwrap().responses(), responses);
    }
}
