//! Sampling constrained to a game's admissible commands (issue #39, `[agent] actions =
//! "admissible"`): the policy can only write one of the commands it is offered.
//!
//! Each command is tokenized as it appears after the prompt (leading space, then the action's
//! end token), and the commands' token sequences form a trie ([`ActionTrie`]). At every step
//! the next token is drawn from the policy's distribution **restricted to the trie's children**
//! of the current node: `softmax(logits / T)` renormalized over the allowed tokens, so the
//! sampled command is always admissible and each token's logprob is taken under that
//! constrained distribution (GLAM's and TWOSOME's per-token decomposition of the action
//! softmax). The sample keeps each position's allowed set, so that a training forward pass can
//! take the same log-softmax over the same tokens and PPO's first ratio is exactly 1.
//!
//! A set that allows every token samples exactly what free sampling samples, bit for bit (the
//! same arithmetic, [`sampler::sample_pure`]); a node with one child gives logprob 0.
//!
//! ```
//! use rltune_models::generation::admissible::ActionTrie;
//!
//! // "go north" = [7, 3], "go south" = [7, 4], each followed by the end token 1.
//! let trie = ActionTrie::new(&[vec![7, 3, 1], vec![7, 4, 1]])?;
//! assert_eq!(trie.allowed(ActionTrie::ROOT), &[7]);
//! let after_go = trie.step(ActionTrie::ROOT, 7).unwrap();
//! assert_eq!(trie.allowed(after_go), &[3, 4]);
//! # Ok::<(), rltune_models::Error>(())
//! ```

use candle_core::{DType, Device};
use rand::{Rng, SeedableRng};

use super::carried::Carried;
use super::{sampler, GenerationConfig};
use crate::error::{Error, Result};
use crate::{CausalLm, ValueHead};

/// The token trie of a list of commands, each a token sequence ending in its end token.
#[derive(Debug, Clone)]
pub struct ActionTrie {
    nodes: Vec<Node>,
    n_actions: usize,
}

#[derive(Debug, Clone, Default)]
struct Node {
    /// Allowed next tokens, sorted, and the node each leads to.
    tokens: Vec<u32>,
    next: Vec<usize>,
    /// The command that ends here (a leaf).
    action: Option<usize>,
}

impl ActionTrie {
    /// The node before any token.
    pub const ROOT: usize = 0;

    /// The trie of `actions` (each its tokens, the end token included). An empty list, an empty
    /// command, two commands with the same tokens, or a command that continues past another's
    /// end is an error naming them.
    pub fn new(actions: &[Vec<u32>]) -> Result<Self> {
        if actions.is_empty() {
            return Err(Error::Input(
                "the admissible command list is empty: the game offers no action".into(),
            ));
        }
        let mut nodes = vec![Node::default()];
        for (i, tokens) in actions.iter().enumerate() {
            if tokens.is_empty() {
                return Err(Error::Input(format!("admissible command {i} has no tokens")));
            }
            let mut at = Self::ROOT;
            for &tok in tokens {
                if let Some(other) = nodes[at].action {
                    return Err(Error::Input(format!(
                        "admissible command {i} continues past the end token of command {other}: \
                         the end token must not occur inside a command"
                    )));
                }
                at = match nodes[at].tokens.binary_search(&tok) {
                    Ok(k) => nodes[at].next[k],
                    Err(k) => {
                        let new = nodes.len();
                        nodes.push(Node::default());
                        nodes[at].tokens.insert(k, tok);
                        nodes[at].next.insert(k, new);
                        new
                    }
                };
            }
            if let Some(other) = nodes[at].action {
                return Err(Error::Input(format!(
                    "admissible commands {other} and {i} have the same tokens: remove the duplicate"
                )));
            }
            if !nodes[at].tokens.is_empty() {
                return Err(Error::Input(format!(
                    "another admissible command continues past the end token of command {i}: \
                     the end token must not occur inside a command"
                )));
            }
            nodes[at].action = Some(i);
        }
        Ok(Self { nodes, n_actions: actions.len() })
    }

    /// The number of commands.
    pub fn len(&self) -> usize {
        self.n_actions
    }

    /// Never true: a trie holds at least one command.
    pub fn is_empty(&self) -> bool {
        self.n_actions == 0
    }

    /// The tokens allowed after `node` (sorted; empty at a leaf).
    pub fn allowed(&self, node: usize) -> &[u32] {
        &self.nodes[node].tokens
    }

    /// The node after `tok` at `node`, when `tok` is allowed there.
    pub fn step(&self, node: usize, tok: u32) -> Option<usize> {
        let n = &self.nodes[node];
        n.tokens.binary_search(&tok).ok().map(|k| n.next[k])
    }

    /// The command that ends at `node`, if it is a leaf.
    pub fn action(&self, node: usize) -> Option<usize> {
        self.nodes[node].action
    }
}

/// One constrained draw from `logits` (one row, the whole vocabulary) with the uniform `u`:
/// the token and its logprob under `softmax(logits / T)` renormalized over `allowed` (sorted,
/// non-empty). With every token allowed it is [`sampler::sample_pure`] itself. `temperature`
/// 0 is greedy: the most likely allowed token (the first of equals), with its logprob at
/// temperature 1.
pub fn sample_allowed(logits: &[f32], temperature: f64, allowed: &[u32], u: f64) -> (u32, f64) {
    if temperature == 0.0 {
        let logit = |t: u32| logits.get(t as usize).copied().unwrap_or(f32::NEG_INFINITY);
        let tok =
            allowed.iter().copied().fold(allowed[0], |best, t| if logit(t) > logit(best) { t } else { best });
        return (tok, allowed_logprob(logits, 1.0, allowed, tok));
    }
    if allowed.len() == logits.len() {
        let (tok, lp) = sampler::sample_pure(logits, temperature, &[], u);
        return (tok as u32, lp);
    }
    let row: Vec<f32> =
        allowed.iter().map(|&t| logits.get(t as usize).copied().unwrap_or(f32::NEG_INFINITY)).collect();
    let (k, lp) = sampler::sample_pure(&row, temperature, &[], u);
    (allowed[k], lp)
}

/// The logprob of `tok` under `softmax(logits / T)` renormalized over `allowed`, in f64: what a
/// training forward pass compares a constrained sample's logprob with.
pub fn allowed_logprob(logits: &[f32], temperature: f64, allowed: &[u32], tok: u32) -> f64 {
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    let xs: Vec<f64> = allowed.iter().map(|&a| logits[a as usize] as f64 / t).collect();
    let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + xs.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    logits[tok as usize] as f64 / t - lse
}

/// A command sampled under the trie's constraint.
#[derive(Debug, Clone, PartialEq)]
pub struct ActionSample {
    /// The prompt.
    pub query_ids: Vec<u32>,
    /// The command's tokens (its end token last).
    pub response_ids: Vec<u32>,
    /// Each token's logprob under the constrained distribution it was drawn from.
    pub logprobs: Vec<f32>,
    /// The tokens allowed at each response position (what a training forward renormalizes over).
    pub allowed: Vec<Vec<u32>>,
    /// With a value head: the value of the state before each response token (the first is the
    /// prompt's), as [`super::Sample::values`]; empty without one.
    pub values: Vec<f32>,
    /// Which command: its index in the list the trie was built from.
    pub action: usize,
}

/// Samples one admissible command per prompt (`tries[i]` for `prompts[i]`), in one left-padded
/// batch with a KV cache, exactly on the host; with `v_head`, each sample's values too (what a
/// PPO rollout caches beside the logprobs).
///
/// `cfg` is read as free sampling reads it, where it applies to a constrained draw: the
/// temperature; `top_k = 1` (greedy decoding) is temperature 0, the most likely allowed token;
/// each row draws from its own stream keyed by `seed` and its global index (`row_offset`), so
/// a sample depends on neither its batch's other rows nor the thread count, and the processes
/// of a data-parallel run draw what one process would. Other `top_k`, `top_p` and `min_p` are refused:
/// truncating an action set that the trie already restricts is not defined here. The token
/// counts (`max_new_tokens`, EOS) do not apply: a command ends at its trie's leaf.
pub fn generate_admissible(
    lm: &CausalLm,
    v_head: Option<&ValueHead>,
    prompts: &[Vec<u32>],
    tries: &[ActionTrie],
    cfg: &GenerationConfig,
    device: &Device,
) -> Result<Vec<ActionSample>> {
    if prompts.len() != tries.len() {
        return Err(Error::Input(format!("{} prompts but {} admissible lists", prompts.len(), tries.len())));
    }
    if prompts.is_empty() {
        return Ok(Vec::new());
    }
    if prompts.iter().any(Vec::is_empty) {
        return Err(Error::Input("an empty prompt: every turn's prompt needs at least one token".into()));
    }
    let mut carried = Carried::new(lm, prompts.len());
    let tries: Vec<Option<&ActionTrie>> = tries.iter().map(Some).collect();
    let out = generate_admissible_carried(lm, v_head, &mut carried, prompts, &tries, cfg, device)?;
    Ok(out.into_iter().flatten().collect())
}

/// [`generate_admissible`] on a batch whose KV cache is carried from call to call (multi-turn
/// transcripts, [`Carried`]): row `i` appends `chunks[i]` (after the tokens its last command
/// left pending) and samples one command from `tries[i]`. A row without a trie samples
/// nothing: with a chunk, it returns an empty command whose one value is that of the state
/// after its chunk (a truncated episode's final state); without one, `None`. Each sample's
/// `query_ids` is its chunk. The command's last token is left pending: the next call feeds it.
pub fn generate_admissible_carried(
    lm: &CausalLm,
    v_head: Option<&ValueHead>,
    carried: &mut Carried,
    chunks: &[Vec<u32>],
    tries: &[Option<&ActionTrie>],
    cfg: &GenerationConfig,
    device: &Device,
) -> Result<Vec<Option<ActionSample>>> {
    if cfg.top_k > 1 || cfg.top_p < 1.0 || cfg.min_p > 0.0 {
        return Err(Error::Input(format!(
            "[agent] actions = \"admissible\" samples from the softmax over the allowed commands' tokens: \
             top_k = {}, top_p = {} and min_p = {} cannot apply there; set top_k = 0 (or 1 for greedy), \
             top_p = 1.0 and min_p = 0",
            cfg.top_k, cfg.top_p, cfg.min_p
        )));
    }
    let temperature = if cfg.top_k == 1 { 0.0 } else { cfg.temperature };
    let b = carried.rows();
    if chunks.len() != b || tries.len() != b {
        return Err(Error::Input(format!(
            "{} chunks and {} admissible lists for a batch of {b} rows",
            chunks.len(),
            tries.len()
        )));
    }
    let vocab = lm.vocab_size();
    for (i, trie) in tries.iter().enumerate() {
        let Some(trie) = trie else { continue };
        if let Some(bad) = trie.nodes.iter().flat_map(|n| &n.tokens).find(|&&t| t as usize >= vocab) {
            return Err(Error::Input(format!(
                "admissible list {i}: token id {bad} is not below the model's vocab_size {vocab}: \
                 the commands were tokenized with another tokenizer"
            )));
        }
    }
    if let Some((i, bad)) =
        chunks.iter().enumerate().find_map(|(i, c)| c.iter().find(|&&t| t as usize >= vocab).map(|t| (i, t)))
    {
        return Err(Error::Input(format!(
            "prompt {i}: token id {bad} is not below the model's vocab_size {vocab}"
        )));
    }
    if let Some(i) = (0..b).find(|&i| tries[i].is_some() && carried.tokens(i) + chunks[i].len() == 0) {
        return Err(Error::Input(format!(
            "row {i}: an empty prompt: every turn's prompt needs at least one token"
        )));
    }
    if let Some(i) =
        (0..b).find(|&i| !cfg.row_seeds.is_empty() && carried.stream(i) >= cfg.row_seeds.len() as u64)
    {
        return Err(Error::Input(format!(
            "generation: {} row_seeds given, but row {i} draws from stream {}; give one per row of the \
             batch as made, or none",
            cfg.row_seeds.len(),
            carried.stream(i)
        )));
    }
    let pad = lm.config().pad_token_id().unwrap_or(0);
    // Row i draws from stream `row_offset + carried.stream(i)` (its index in the batch as made),
    // or from `row_seeds[carried.stream(i)]` when given.
    let mut rngs: Vec<rand::rngs::StdRng> =
        (0..b).map(|i| rand::rngs::StdRng::seed_from_u64(cfg.stream_seed(carried.stream(i)))).collect();
    let Some(mut hidden) = carried.prefill(lm, chunks, pad, device)? else {
        return Ok(vec![None; b]);
    };
    let mut node = vec![ActionTrie::ROOT; b];
    let mut out: Vec<Option<ActionSample>> = chunks
        .iter()
        .zip(tries)
        .map(|(p, t)| {
            (t.is_some() || !p.is_empty()).then(|| ActionSample {
                query_ids: p.clone(),
                response_ids: vec![],
                logprobs: vec![],
                allowed: vec![],
                values: vec![],
                action: 0,
            })
        })
        .collect();
    let allowed_at = |i: usize, node: usize| tries[i].map_or(&[][..], |t| t.allowed(node));
    let mut first = true;
    loop {
        let last = hidden.narrow(1, hidden.dim(1)? - 1, 1)?;
        let values = match v_head {
            Some(h) => Some(h.forward(&last)?.squeeze(1)?.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            None => None,
        };
        let logits =
            lm.logits(&last)?.squeeze(1)?.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
        let mut next = vec![pad; b];
        for i in 0..b {
            let allowed = allowed_at(i, node[i]);
            if allowed.is_empty() {
                // A value-only row: the value of the state after its chunk.
                if let (true, Some(o), None, Some(v)) = (first, out[i].as_mut(), tries[i], &values) {
                    o.values.push(v[i]);
                }
                continue; // this row's command is complete, or it samples none
            }
            let o = out[i].as_mut().ok_or_else(|| Error::Internal(format!("row {i} has no sample")))?;
            let u: f64 = rngs[i].gen();
            let (tok, lp) = sample_allowed(&logits[i], temperature, allowed, u);
            o.allowed.push(allowed.to_vec());
            o.response_ids.push(tok);
            o.logprobs.push(lp as f32);
            if let Some(v) = &values {
                o.values.push(v[i]);
            }
            let trie = tries[i].ok_or_else(|| Error::Internal(format!("row {i} has no trie")))?;
            node[i] = trie.step(node[i], tok).ok_or_else(|| {
                Error::Input(format!("row {i}: sampled token {tok} is not in its allowed set"))
            })?;
            if let Some(a) = trie.action(node[i]) {
                o.action = a;
            }
            next[i] = tok;
        }
        first = false;
        let live: Vec<bool> = (0..b).map(|i| !allowed_at(i, node[i]).is_empty()).collect();
        if !live.iter().any(|&l| l) {
            break;
        }
        // Finished rows feed padding that nothing attends to.
        hidden = carried.feed(lm, next, &live, device)?;
    }
    // A command's last token was sampled but never fed (mask 0 or the loop's end): the next
    // turn's chunk starts with it.
    for (i, o) in out.iter().enumerate() {
        if let Some(&last) = o.as_ref().and_then(|o| o.response_ids.last()) {
            carried.set_pending(i, vec![last]);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::{causal_bias, position_ids_from_mask};
    use candle_core::Tensor;

    #[test]
    fn temperature_zero_picks_the_most_likely_allowed_token() {
        let logits = [0.5f32, 3.0, 1.0, 2.0, -1.0];
        let (tok, lp) = sample_allowed(&logits, 0.0, &[0, 2, 3], 0.99);
        assert_eq!(tok, 3, "token 1 is likelier but not allowed");
        assert!((lp - allowed_logprob(&logits, 1.0, &[0, 2, 3], 3)).abs() < 1e-12);
        assert_eq!(sample_allowed(&logits, 0.0, &[4], 0.5), (4, 0.0));
    }
    use crate::params::ParamStore;
    use crate::{gpt2::Gpt2Config, CausalLmConfig};

    fn sampling(temperature: f64, seed: u64) -> GenerationConfig {
        GenerationConfig { temperature, seed, ..Default::default() }
    }

    fn tiny_lm() -> CausalLm {
        let cfg = CausalLmConfig::Gpt2(Gpt2Config::tiny(40, 16, 2, 2, 32));
        let store = ParamStore::random(3, false, DType::F32, &Device::Cpu).unwrap();
        CausalLm::load(&store.root(), &cfg).unwrap()
    }

    /// Log-probability of each whole command under the constrained policy, by full forwards.
    fn exact_action_logprobs(
        lm: &CausalLm,
        prompt: &[u32],
        actions: &[Vec<u32>],
        trie: &ActionTrie,
    ) -> Vec<f64> {
        actions
            .iter()
            .map(|a| {
                let ids: Vec<u32> = prompt.iter().chain(a).copied().collect();
                let n = ids.len();
                let mask = vec![vec![1u8; n]];
                let dev = Device::Cpu;
                let input = Tensor::new(ids.as_slice(), &dev).unwrap().unsqueeze(0).unwrap();
                let h = lm
                    .forward(
                        &input,
                        &position_ids_from_mask(&mask, &dev).unwrap(),
                        &causal_bias(&mask, n, DType::F32, &dev).unwrap(),
                        None,
                    )
                    .unwrap();
                let logits = lm.logits(&h).unwrap().squeeze(0).unwrap().to_vec2::<f32>().unwrap();
                let mut node = ActionTrie::ROOT;
                let mut total = 0.0;
                for (k, &tok) in a.iter().enumerate() {
                    total += allowed_logprob(&logits[prompt.len() + k - 1], 1.0, trie.allowed(node), tok);
                    node = trie.step(node, tok).unwrap();
                }
                total
            })
            .collect()
    }

    #[test]
    fn bad_lists_are_named() {
        let err = |a: &[Vec<u32>]| ActionTrie::new(a).unwrap_err().to_string();
        assert!(err(&[]).contains("empty"));
        assert!(err(&[vec![1, 2, 9], vec![]]).contains("command 1 has no tokens"));
        assert!(err(&[vec![1, 2, 9], vec![1, 2, 9]]).contains("commands 0 and 1 have the same tokens"));
        assert!(err(&[vec![1, 9], vec![1, 9, 3, 9]]).contains("continues past the end token of command 0"));
        assert!(err(&[vec![1, 9, 3, 9], vec![1, 9]]).contains("continues past the end token of command 1"));
    }

    /// The sampled commands' frequencies match the constrained distribution (Pearson's
    /// chi-square below its 0.999 quantile), every command is admissible, and each sample's
    /// logprobs sum to its command's exact constrained logprob.
    #[test]
    fn commands_follow_the_constrained_distribution() {
        let lm = tiny_lm();
        let (end, prompt) = (39u32, vec![5u32, 9, 2]);
        let actions =
            vec![vec![7, 3, end], vec![7, 4, end], vec![7, 4, 11, end], vec![12, end], vec![13, 14, 15, end]];
        let trie = ActionTrie::new(&actions).unwrap();
        let exact = exact_action_logprobs(&lm, &prompt, &actions, &trie);
        let total: f64 = exact.iter().map(|l| l.exp()).sum();
        assert!((total - 1.0).abs() < 1e-9, "the constrained action probabilities sum to {total}");
        let n_rows = 500;
        let mut counts = vec![0usize; actions.len()];
        for seed in 0..8 {
            let prompts = vec![prompt.clone(); n_rows];
            let tries = vec![trie.clone(); n_rows];
            for s in
                generate_admissible(&lm, None, &prompts, &tries, &sampling(1.0, seed), &Device::Cpu).unwrap()
            {
                assert_eq!(s.response_ids, actions[s.action], "an admissible command");
                let lp: f64 = s.logprobs.iter().map(|&l| l as f64).sum();
                assert!((lp - exact[s.action]).abs() < 1e-5, "logprob {lp} vs exact {}", exact[s.action]);
                counts[s.action] += 1;
            }
        }
        let n: usize = counts.iter().sum();
        let chi2: f64 = counts
            .iter()
            .zip(&exact)
            .map(|(&c, l)| (c as f64 - l.exp() * n as f64).powi(2) / (l.exp() * n as f64))
            .sum();
        // The 0.999 quantile of chi-square with 4 degrees of freedom.
        assert!(
            chi2 < 18.467,
            "chi-square {chi2} (counts {counts:?}, p {:?})",
            exact.iter().map(|l| l.exp()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn one_command_has_logprob_zero_and_a_full_mask_is_free_sampling() {
        let lm = tiny_lm();
        let trie = ActionTrie::new(&[vec![3, 8, 39]]).unwrap();
        let s = &generate_admissible(&lm, None, &[vec![1, 2]], &[trie], &sampling(0.7, 4), &Device::Cpu)
            .unwrap()[0];
        assert_eq!(s.response_ids, vec![3, 8, 39]);
        assert!(s.logprobs.iter().all(|&l| l == 0.0), "{:?}", s.logprobs);
        // Every token allowed: the same token and the same logprob bits as free sampling.
        let row: Vec<f32> = (0..40).map(|i| ((i * 37 % 11) as f32 - 5.0) / 3.0).collect();
        let all: Vec<u32> = (0..40).collect();
        for u in [0.0, 0.13, 0.5, 0.77, 0.999_999] {
            let (tok, lp) = sample_allowed(&row, 0.8, &all, u);
            let (free_tok, free_lp) = sampler::sample_pure(&row, 0.8, &[], u);
            assert_eq!((tok as usize, lp.to_bits()), (free_tok, free_lp.to_bits()));
        }
    }

    #[test]
    fn tokens_outside_the_vocabulary_are_named() {
        let lm = tiny_lm();
        let trie = ActionTrie::new(&[vec![3, 99]]).unwrap();
        let err = generate_admissible(&lm, None, &[vec![1]], &[trie], &sampling(1.0, 0), &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(err.contains("token id 99") && err.contains("another tokenizer"), "{err}");
    }

    /// `top_k = 1` is greedy (the most likely allowed token at each step, whatever the seed);
    /// a row's command depends on its global index, not on its batch; other truncations are
    /// refused.
    #[test]
    fn the_generation_config_is_honoured_or_refused() {
        let lm = tiny_lm();
        let actions = vec![vec![7, 3, 39], vec![7, 4, 39], vec![12, 39], vec![13, 14, 39]];
        let trie = ActionTrie::new(&actions).unwrap();
        let prompt = vec![5u32, 9, 2];
        let exact = exact_action_logprobs(&lm, &prompt, &actions, &trie);
        // One command for the prompt alone.
        let one = |cfg: &GenerationConfig| {
            generate_admissible(
                &lm,
                None,
                std::slice::from_ref(&prompt),
                std::slice::from_ref(&trie),
                cfg,
                &Device::Cpu,
            )
        };
        let greedy = |seed| one(&GenerationConfig { top_k: 1, ..sampling(1.0, seed) }).unwrap()[0].action;
        let picks: Vec<usize> = (0..4).map(greedy).collect();
        assert!(picks.iter().all(|&a| a == picks[0]), "greedy varies with the seed: {picks:?}");
        // Token by token: the first token's best continuation, then the best among its children.
        let (mut node, mut want) = (ActionTrie::ROOT, Vec::new());
        while !trie.allowed(node).is_empty() {
            let best = trie
                .allowed(node)
                .iter()
                .copied()
                .max_by(|&a, &b| {
                    let lp = |t: u32| {
                        let mut ids = prompt.clone();
                        ids.extend(&want);
                        ids.push(t);
                        let prefix = ids.len();
                        (0..actions.len())
                            .filter(|&k| {
                                actions[k].len() >= prefix - prompt.len()
                                    && actions[k][..prefix - prompt.len()] == ids[prompt.len()..]
                            })
                            .map(|k| exact[k].exp())
                            .sum::<f64>()
                    };
                    lp(a).total_cmp(&lp(b))
                })
                .unwrap();
            want.push(best);
            node = trie.step(node, best).unwrap();
        }
        assert_eq!(actions[picks[0]], want, "greedy is not the token-wise argmax");
        // Row 3 of a batch of 4 draws what row 0 of a batch of 1 draws at row_offset 3.
        let batch: Vec<usize> = generate_admissible(
            &lm,
            None,
            &vec![prompt.clone(); 4],
            &vec![trie.clone(); 4],
            &sampling(1.0, 9),
            &Device::Cpu,
        )
        .unwrap()
        .iter()
        .map(|s| s.action)
        .collect();
        let alone = one(&GenerationConfig { row_offset: 3, ..sampling(1.0, 9) }).unwrap()[0].action;
        assert_eq!(batch[3], alone);
        for cfg in [
            GenerationConfig { top_k: 5, ..sampling(1.0, 0) },
            GenerationConfig { top_p: 0.9, ..sampling(1.0, 0) },
        ] {
            let e = one(&cfg).unwrap_err().to_string();
            assert!(e.contains("top_k") && e.contains("top_p = 1.0"), "{e}");
        }
    }

    /// Three turns on a carried cache (two rows of different lengths; the second row idle on
    /// turn 2 and value-only on turn 3) sample what one fresh prefill of each row's whole
    /// sequence samples: the same commands, logprobs and values within 1e-5.
    #[test]
    fn a_carried_cache_samples_what_the_whole_sequence_samples() {
        use crate::value_head::ValueHead;
        let lm = tiny_lm();
        let store = ParamStore::random(9, false, DType::F32, &Device::Cpu).unwrap();
        let head = ValueHead::load(&store.root().pp("v_head"), 16).unwrap();
        let dev = Device::Cpu;
        let trie = ActionTrie::new(&[vec![5, 6, 1], vec![5, 7, 1], vec![9, 1]]).unwrap();
        let cfg = sampling(1.0, 4);
        let mut carried = Carried::new(&lm, 2);
        let mut whole: Vec<Vec<u32>> = vec![Vec::new(), Vec::new()];
        let turns: [[(Vec<u32>, bool); 2]; 3] = [
            [(vec![2, 3, 4], true), (vec![8, 2], true)],
            [(vec![11, 12], true), (vec![], false)],
            [(vec![13], true), (vec![14, 15, 16], false)],
        ];
        let mut worst = 0f64;
        for (t, turn) in turns.iter().enumerate() {
            let chunks: Vec<Vec<u32>> = turn.iter().map(|(c, _)| c.clone()).collect();
            let tries: Vec<Option<&ActionTrie>> = turn.iter().map(|(_, s)| s.then_some(&trie)).collect();
            let got =
                generate_admissible_carried(&lm, Some(&head), &mut carried, &chunks, &tries, &cfg, &dev)
                    .unwrap();
            for i in 0..2 {
                whole[i].extend(&chunks[i]);
                let Some(g) = &got[i] else {
                    assert!(chunks[i].is_empty() && !turn[i].1, "turn {t} row {i}");
                    continue;
                };
                // The same row alone, its whole sequence prefilled, with the same stream.
                let one = GenerationConfig { row_offset: i as u64, ..cfg.clone() };
                let fresh = generate_admissible(
                    &lm,
                    Some(&head),
                    &[whole[i].clone()],
                    std::slice::from_ref(&trie),
                    &one,
                    &dev,
                )
                .unwrap();
                if turn[i].1 {
                    assert_eq!(g.response_ids, fresh[0].response_ids, "turn {t} row {i}");
                    for (a, b) in
                        g.logprobs.iter().zip(&fresh[0].logprobs).chain(g.values.iter().zip(&fresh[0].values))
                    {
                        worst = worst.max((a - b).abs() as f64);
                    }
                    whole[i].extend(&g.response_ids);
                } else {
                    assert!(g.response_ids.is_empty() && g.values.len() == 1, "turn {t} row {i}: value only");
                    worst = worst.max((g.values[0] - fresh[0].values[0]).abs() as f64);
                }
            }
        }
        assert!(worst < 1e-5, "carried vs whole sequence: {worst:e}");
        assert_eq!(carried.tokens(0), whole[0].len());
    }
}
