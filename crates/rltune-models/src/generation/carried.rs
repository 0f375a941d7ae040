//! A batch's KV cache carried from call to call: multi-turn sampling where each turn appends
//! only its new tokens (`[agent] memory = "transcript"`, issue #39).
//!
//! Each row is one growing token sequence. A call appends one chunk per row (the tokens the
//! last call sampled but did not feed, then the row's new tokens), left-padded within the
//! chunk: the padding positions stay in the cache with mask 0, so nothing attends to them, and
//! each row's position ids count its real tokens only (`cumsum − 1` of its mask), as a
//! training forward over the unpadded sequence numbers them. A row's logprobs therefore equal
//! those of one forward over its whole sequence, up to the order of floating-point sums.
//!
//! A fresh [`Carried`] with one chunk per row is exactly the left-padded prefill of
//! [`super::admissible::generate_admissible`], which is built on it.

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::layers::{causal_bias, position_ids_from_mask, KvCache};
use crate::CausalLm;

/// The carried state of a batch of growing sequences: the KV cache, each row's mask over the
/// cached positions, each row's next position id, and the tokens sampled last but not yet fed.
#[derive(Debug)]
pub struct Carried {
    cache: KvCache,
    mask: Vec<Vec<u8>>,
    next_pos: Vec<u32>,
    pending: Vec<Vec<u32>>,
    /// Each row's sampling stream: its index when the batch was made, kept by
    /// [`Self::retain`], so a row draws from the same stream however the batch shrinks.
    stream: Vec<u64>,
}

impl Carried {
    /// An empty state for `rows` sequences of `lm`.
    pub fn new(lm: &CausalLm, rows: usize) -> Self {
        Self {
            cache: lm.new_cache(),
            mask: vec![Vec::new(); rows],
            next_pos: vec![0; rows],
            pending: vec![Vec::new(); rows],
            stream: (0..rows as u64).collect(),
        }
    }

    /// Row `row`'s sampling stream (its index in the batch as made).
    pub fn stream(&self, row: usize) -> u64 {
        self.stream[row]
    }

    /// The number of rows.
    pub fn rows(&self) -> usize {
        self.mask.len()
    }

    /// Positions held in the cache, padding included (every row has as many).
    pub fn cached_positions(&self) -> usize {
        self.mask.first().map_or(0, Vec::len)
    }

    /// Row `row`'s real tokens: those in the cache plus those pending.
    pub fn tokens(&self, row: usize) -> usize {
        self.next_pos[row] as usize + self.pending[row].len()
    }

    /// Appends one chunk per row (`pending` tokens first), left-padded to the longest, and runs
    /// the model over them: returns the hidden states `(B, W, C)` of the chunk, `W` its width,
    /// or `None` when every chunk is empty. `pad` fills the padding positions.
    pub(crate) fn prefill(
        &mut self,
        lm: &CausalLm,
        chunks: &[Vec<u32>],
        pad: u32,
        device: &Device,
    ) -> Result<Option<Tensor>> {
        if chunks.len() != self.rows() {
            return Err(Error::Input(format!(
                "{} chunks for a carried batch of {} rows",
                chunks.len(),
                self.rows()
            )));
        }
        let full: Vec<Vec<u32>> = self
            .pending
            .iter_mut()
            .zip(chunks)
            .map(|(p, c)| {
                let mut v = std::mem::take(p);
                v.extend_from_slice(c);
                v
            })
            .collect();
        let width = full.iter().map(Vec::len).max().unwrap_or(0);
        if width == 0 {
            return Ok(None);
        }
        if let Some(max) = lm.config().max_positions() {
            if let Some((i, n)) = full
                .iter()
                .enumerate()
                .map(|(i, c)| (i, self.next_pos[i] as usize + c.len()))
                .find(|&(_, n)| n > max)
            {
                return Err(Error::Input(format!(
                    "row {i}: {n} tokens exceed the model's {max} positions; the caller ends the sequence before"
                )));
            }
        }
        let mut ids = Vec::with_capacity(width * full.len());
        for (i, c) in full.iter().enumerate() {
            ids.extend(std::iter::repeat_n(pad, width - c.len()).chain(c.iter().copied()));
            self.mask[i]
                .extend(std::iter::repeat_n(0u8, width - c.len()).chain(std::iter::repeat_n(1u8, c.len())));
            self.next_pos[i] += c.len() as u32;
        }
        let started = std::time::Instant::now();
        let total = self.cached_positions();
        let input = Tensor::from_vec(ids, (full.len(), width), device)?;
        let positions = position_ids_from_mask(&self.mask, device)?.narrow(1, total - width, width)?;
        let bias = causal_bias(&self.mask, width, DType::F32, device)?;
        let hidden = lm.forward(&input, &positions, &bias, Some(&mut self.cache))?;
        super::add_prefill(started.elapsed(), full.iter().map(Vec::len).sum());
        Ok(Some(hidden))
    }

    /// One decoding step: feeds `next[i]` to every row, visible where `live[i]` (a finished row
    /// feeds padding that nothing attends to); returns the hidden states `(B, 1, C)`.
    pub(crate) fn feed(
        &mut self,
        lm: &CausalLm,
        next: Vec<u32>,
        live: &[bool],
        device: &Device,
    ) -> Result<Tensor> {
        for (m, &l) in self.mask.iter_mut().zip(live) {
            m.push(u8::from(l));
        }
        let pos = self.next_pos.clone();
        self.next_pos.iter_mut().zip(live).for_each(|(p, &l)| *p += u32::from(l));
        let b = next.len();
        let input = Tensor::from_vec(next, (b, 1), device)?;
        let positions = Tensor::from_vec(pos, (b, 1), device)?;
        let bias = causal_bias(&self.mask, 1, DType::F32, device)?;
        lm.forward(&input, &positions, &bias, Some(&mut self.cache))
    }

    /// Keeps the rows `rows` (distinct indices into this batch, in the order given) and drops
    /// the others with their cache: the batch shrinks as its sequences finish. Then the
    /// positions that every row left masks out (the padding of the dropped rows' longer chunks)
    /// leave the cache too, so later turns do not attend over them.
    pub fn retain(&mut self, rows: &[usize]) -> Result<()> {
        if let Some(&bad) = rows.iter().find(|&&r| r >= self.rows()) {
            return Err(Error::Input(format!("carried batch: row {bad} of {}", self.rows())));
        }
        self.cache.select_rows(rows)?;
        self.mask = rows.iter().map(|&r| std::mem::take(&mut self.mask[r])).collect();
        self.next_pos = rows.iter().map(|&r| self.next_pos[r]).collect();
        self.pending = rows.iter().map(|&r| std::mem::take(&mut self.pending[r])).collect();
        self.stream = rows.iter().map(|&r| self.stream[r]).collect();
        let keep: Vec<usize> =
            (0..self.cached_positions()).filter(|&j| self.mask.iter().any(|m| m[j] == 1)).collect();
        if keep.len() < self.cached_positions() {
            self.cache.select_positions(&keep)?;
            for m in &mut self.mask {
                *m = keep.iter().map(|&j| m[j]).collect();
            }
        }
        Ok(())
    }

    /// Marks `tokens` as sampled for `row` but not yet in the cache: the next
    /// [`Self::prefill`] feeds them before the row's new chunk.
    pub(crate) fn set_pending(&mut self, row: usize, tokens: Vec<u32>) {
        self.pending[row] = tokens;
    }
}
