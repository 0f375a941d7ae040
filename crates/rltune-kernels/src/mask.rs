//! Additive attention masks: the causal bias of decoders and the padding bias of encoders.

use candle_core::{DType, Device, Tensor};

/// Additive mask value for disallowed keys. Finite (as transformers' `finfo.min`), so a fully
/// masked row gives a uniform distribution instead of NaN.
pub const MASK_MIN: f64 = -1e9;

/// Additive attention bias `(B, 1, T, S)` for the last `q_len` of `S` positions: 0 where a query
/// may attend (key not padding, key not in the future), [`MASK_MIN`] elsewhere.
pub fn causal_bias(
    key_mask: &[Vec<u8>],
    q_len: usize,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let b = key_mask.len();
    let s = key_mask.first().map_or(0, Vec::len);
    let past = s.saturating_sub(q_len);
    let mut data = vec![0f32; b * q_len * s];
    for (bi, row) in key_mask.iter().enumerate() {
        for t in 0..q_len {
            let base = (bi * q_len + t) * s;
            for (j, &m) in row.iter().enumerate() {
                if m == 0 || j > past + t {
                    data[base + j] = MASK_MIN as f32;
                }
            }
        }
    }
    Tensor::from_vec(data, (b, 1, q_len, s), device)?.to_dtype(dtype)
}

/// Additive bias `(B, 1, 1, S)` for bidirectional encoders: 0 for real keys, [`MASK_MIN`] for padding.
pub fn padding_bias(key_mask: &[Vec<u8>], dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
    let b = key_mask.len();
    let s = key_mask.first().map_or(0, Vec::len);
    let data: Vec<f32> =
        key_mask.iter().flat_map(|r| r.iter().map(|&m| if m == 0 { MASK_MIN as f32 } else { 0.0 })).collect();
    Tensor::from_vec(data, (b, 1, 1, s), device)?.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_bias_masks_future_and_padding() {
        let b = causal_bias(&[vec![0, 1, 1, 1]], 2, DType::F32, &Device::Cpu).unwrap();
        let v = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let m = MASK_MIN as f32;
        // Queries are positions 2 and 3 of 4.
        assert_eq!(v, vec![m, 0.0, 0.0, m, m, 0.0, 0.0, 0.0]);
    }
}
