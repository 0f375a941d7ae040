//! The PPO models' forward on a batch: hidden states of the inputs `ids[:, :L−1]`, optionally at
//! selected positions only.

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::models::CausalLm;

/// Hidden states `(B, L−1, C)` of the model's inputs (`ids[:, :L−1]`); with `select (B, L−1)`,
/// only the marked positions are computed in full (the others are unspecified, see
/// [`CausalLm::forward_rows`]).
pub(crate) fn hidden_states(
    lm: &CausalLm,
    ids: &Tensor,
    pos: &Tensor,
    bias: &Tensor,
    select: Option<&Tensor>,
) -> Result<Tensor> {
    match select {
        Some(sel) => {
            let flat = sel.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            let rows: Vec<usize> = (0..flat.len()).filter(|&r| flat[r] != 0.0).collect();
            Ok(lm.forward_rows(&inputs(ids)?, pos, bias, &rows)?)
        }
        None => Ok(lm.forward(&inputs(ids)?, pos, bias, None)?),
    }
}

/// The models' input `ids[:, :L−1]` (the trainer's batches hold `L` tokens a row).
pub(crate) fn inputs(ids: &Tensor) -> Result<Tensor> {
    Ok(ids.narrow(1, 0, ids.dim(1)? - 1)?)
}
