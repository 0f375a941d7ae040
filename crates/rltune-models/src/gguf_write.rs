//! Writing GGUF v3 files: metadata, tensor infos and data, as gguf-py's `GGUFWriter` lays them out.
//!
//! The layout (gguf-py `gguf_writer.py`, `constants.py`; ggml's `docs/gguf.md`):
//! magic `GGUF`, version 3, tensor count (u64), metadata count (u64); each metadata entry as key
//! (u64 length + UTF-8), value type (u32) and value; each tensor info as name, `n_dims` (u32),
//! dims innermost first (`ne[0]` = the length of a row), ggml type (u32) and the data offset
//! (u64, relative to the data section); zero padding to the alignment (32, `general.alignment`
//! is not written, as gguf-py does not for the default); then each tensor's data, padded to 32.
//!
//! Tensor types: F32, F16 (IEEE half, round-to-nearest-even, as numpy's `astype(float16)`) and
//! Q8_0 ([`quantize_q8_0`]).

use std::io::Write;
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use candle_core::Tensor;

use crate::error::{Error, Result};

/// GGUF's version written (gguf-py `GGUF_VERSION`).
pub const GGUF_VERSION: u32 = 3;
/// Alignment of the data section and of each tensor (gguf-py `GGUF_DEFAULT_ALIGNMENT`).
pub const ALIGNMENT: usize = 32;
/// Values per Q8_0 block (ggml `QK8_0`).
pub const Q8_0_BLOCK: usize = 32;
/// Bytes per Q8_0 block: an f16 scale and 32 i8 (ggml `block_q8_0`).
pub const Q8_0_BLOCK_BYTES: usize = 2 + Q8_0_BLOCK;

/// The ggml tensor types rltune writes (gguf-py `GGMLQuantizationType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    /// 32-bit float (type 0).
    F32,
    /// IEEE half (type 1).
    F16,
    /// Blocks of 32: f16 scale `d` and 32 i8 `q`, value `d·q` (type 8).
    Q8_0,
}

impl GgmlType {
    /// The type's number in the file.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q8_0 => 8,
        }
    }

    /// Bytes taken by `n` values (`n` a multiple of 32 for Q8_0).
    pub fn bytes(self, n: usize) -> usize {
        match self {
            GgmlType::F32 => 4 * n,
            GgmlType::F16 => 2 * n,
            GgmlType::Q8_0 => n / Q8_0_BLOCK * Q8_0_BLOCK_BYTES,
        }
    }
}

/// One tensor to write: `data` in transformers' layout (row-major, last axis contiguous), f32.
pub struct TensorOut {
    /// llama.cpp's name.
    pub name: String,
    /// The values, any float dtype (cast to f32, then encoded as `ty`).
    pub data: Tensor,
    /// How to encode them.
    pub ty: GgmlType,
}

impl TensorOut {
    /// The dims as ggml counts them: innermost first (transformers' shape reversed).
    pub fn ggml_dims(&self) -> Vec<usize> {
        self.data.dims().iter().rev().copied().collect()
    }
}

/// Q8_0 as ggml's `quantize_row_q8_0_ref` (and gguf-py `quants.Q8_0.quantize_blocks`): per block
/// of 32, `d = max|x| / 127`, `q = round(x / d)` computed as `x · (1/d)` and rounded half away from
/// zero (C's `roundf`), `d` stored as f16. `xs.len()` must be a multiple of 32.
pub fn quantize_q8_0(xs: &[f32], out: &mut Vec<u8>) {
    for block in xs.chunks_exact(Q8_0_BLOCK) {
        let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(half::f16::from_f32(d).to_le_bytes());
        // |x·id| ≤ 127 (up to rounding), so the cast never saturates in practice.
        out.extend(block.iter().map(|&x| ((x * id).round() as i8) as u8));
    }
}

/// The bytes of `t` encoded as `ty` (little-endian).
fn encode(t: &Tensor, ty: GgmlType) -> Result<Vec<u8>> {
    let xs: Vec<f32> = t.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1()?;
    let mut out = Vec::with_capacity(ty.bytes(xs.len()));
    match ty {
        GgmlType::F32 => xs.iter().for_each(|x| out.extend(x.to_le_bytes())),
        GgmlType::F16 => xs.iter().for_each(|&x| out.extend(half::f16::from_f32(x).to_le_bytes())),
        GgmlType::Q8_0 => quantize_q8_0(&xs, &mut out),
    }
    Ok(out)
}

fn put_str(w: &mut Vec<u8>, s: &str) {
    w.extend((s.len() as u64).to_le_bytes());
    w.extend(s.as_bytes());
}

/// gguf-py `GGUFValueType` of a value.
fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_value(w: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => w.push(*x),
        Value::I8(x) => w.extend(x.to_le_bytes()),
        Value::U16(x) => w.extend(x.to_le_bytes()),
        Value::I16(x) => w.extend(x.to_le_bytes()),
        Value::U32(x) => w.extend(x.to_le_bytes()),
        Value::I32(x) => w.extend(x.to_le_bytes()),
        Value::F32(x) => w.extend(x.to_le_bytes()),
        Value::Bool(x) => w.push(u8::from(*x)),
        Value::String(s) => put_str(w, s),
        Value::U64(x) => w.extend(x.to_le_bytes()),
        Value::I64(x) => w.extend(x.to_le_bytes()),
        Value::F64(x) => w.extend(x.to_le_bytes()),
        Value::Array(items) => {
            // An empty array is written as an array of strings: the only empty one rltune
            // writes is a tokenizer's list of merges, which llama.cpp reads as strings.
            w.extend(items.first().map_or(8, value_type).to_le_bytes());
            w.extend((items.len() as u64).to_le_bytes());
            items.iter().for_each(|x| put_value(w, x));
        }
    }
}

fn pad_to(n: usize) -> usize {
    n.div_ceil(ALIGNMENT) * ALIGNMENT
}

/// The header (everything before the data section, padded) of a file with `metadata` and
/// `tensors`. Checks that every array holds one type and every Q8_0 row is whole blocks.
pub fn header(path: &Path, metadata: &[(String, Value)], tensors: &[TensorOut]) -> Result<Vec<u8>> {
    let mut h = Vec::new();
    h.extend(0x4655_4747u32.to_le_bytes()); // "GGUF"
    h.extend(GGUF_VERSION.to_le_bytes());
    h.extend((tensors.len() as u64).to_le_bytes());
    h.extend((metadata.len() as u64).to_le_bytes());
    for (key, v) in metadata {
        if let Value::Array(items) = v {
            if items.iter().any(|x| value_type(x) != value_type(&items[0])) {
                return Err(Error::config(path, format!("metadata {key:?}: an array mixes value types")));
            }
        }
        put_str(&mut h, key);
        h.extend(value_type(v).to_le_bytes());
        put_value(&mut h, v);
    }
    let mut offset = 0usize;
    for t in tensors {
        let dims = t.ggml_dims();
        if t.ty == GgmlType::Q8_0 && dims.first().is_none_or(|d| d % Q8_0_BLOCK != 0) {
            return Err(Error::weights(
                path,
                format!("tensor {:?}: rows of {dims:?}[0] values are not whole Q8_0 blocks of 32", t.name),
            ));
        }
        put_str(&mut h, &t.name);
        h.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| h.extend((*d as u64).to_le_bytes()));
        h.extend(t.ty.id().to_le_bytes());
        h.extend((offset as u64).to_le_bytes());
        offset += pad_to(t.ty.bytes(t.data.elem_count()));
    }
    h.resize(pad_to(h.len()), 0);
    Ok(h)
}

/// Writes a GGUF v3 file at `path` (through a temporary file beside it, renamed when complete).
/// Tensors are encoded one at a time. Returns the file's size in bytes.
pub fn write_gguf(path: &Path, metadata: &[(String, Value)], tensors: &[TensorOut]) -> Result<u64> {
    let head = header(path, metadata, tensors)?;
    let mut size = head.len() as u64;
    crate::io::write_atomic(path, |tmp| {
        let file = std::fs::File::create(tmp).map_err(|e| Error::io(tmp, e))?;
        let mut w = std::io::BufWriter::new(file);
        let io = |e| Error::io(tmp, e);
        w.write_all(&head).map_err(io)?;
        for t in tensors {
            let mut bytes = encode(&t.data, t.ty)?;
            bytes.resize(pad_to(bytes.len()), 0);
            w.write_all(&bytes).map_err(io)?;
            size += bytes.len() as u64;
        }
        w.into_inner().map_err(|e| Error::io(tmp, e.into_error()))?.sync_all().map_err(io)
    })?;
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::Content;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::Device;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        // A fixed, sign-mixed sequence with exact halves (x·id = k + 0.5) among it.
        (0..n).map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0).collect()
    }

    /// Our Q8_0 bytes equal candle's (an independent port of ggml's reference quantizer), and
    /// each value dequantizes within d/2 + |q|·(d − fp16(d)) of the input.
    #[test]
    fn q8_0_matches_ggml_reference_and_its_error_bound() {
        let xs = values(32 * 6, 7);
        let mut ours = Vec::new();
        quantize_q8_0(&xs, &mut ours);
        let t = Tensor::from_vec(xs.clone(), (6, 32), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, GgmlDType::Q8_0).unwrap();
        assert_eq!(ours, q.data().unwrap().to_vec(), "bytes differ from candle's BlockQ8_0::from_float");
        let back: Vec<f32> = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        for (b, block) in xs.chunks(32).zip(back.chunks(32)) {
            let d = b.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
            let bound = d / 2.0 + 127.0 * (d - half::f16::from_f32(d).to_f32()).abs() + 1e-7;
            for (x, y) in b.iter().zip(block) {
                assert!((x - y).abs() <= bound, "{x} -> {y} (bound {bound})");
            }
        }
        // A zero block: d = 0, every q = 0.
        let mut z = Vec::new();
        quantize_q8_0(&[0.0; 32], &mut z);
        assert!(z.iter().all(|&b| b == 0));
    }

    /// candle's GGUF reader reads what we write: version, metadata, dims, types, values.
    #[test]
    fn candle_reads_the_file_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let dev = Device::Cpu;
        let w = Tensor::from_vec(values(64 * 3, 1), (3, 64), &dev).unwrap();
        let n = Tensor::from_vec(values(5, 2), 5, &dev).unwrap();
        let tensors = vec![
            TensorOut { name: "a.weight".into(), data: w.clone(), ty: GgmlType::F32 },
            TensorOut { name: "b.weight".into(), data: w.clone(), ty: GgmlType::F16 },
            TensorOut { name: "c.weight".into(), data: w.clone(), ty: GgmlType::Q8_0 },
            TensorOut { name: "n.weight".into(), data: n.clone(), ty: GgmlType::F32 },
        ];
        let meta = vec![
            ("general.architecture".to_string(), Value::String("llama".into())),
            ("x.list".to_string(), Value::Array(vec![Value::I32(1), Value::I32(-2)])),
            ("x.flag".to_string(), Value::Bool(true)),
            ("x.eps".to_string(), Value::F32(1e-5)),
        ];
        let size = write_gguf(&path, &meta, &tensors).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len() as u64, size);
        assert_eq!(&bytes[..8], b"GGUF\x03\0\0\0");
        let c = Content::read(&mut std::fs::File::open(&path).unwrap()).unwrap();
        assert_eq!(c.tensor_data_offset % ALIGNMENT as u64, 0);
        assert_eq!(c.metadata["x.list"].to_vec().unwrap().len(), 2);
        assert!(c.metadata["x.flag"].to_bool().unwrap());
        let mut f = std::fs::File::open(&path).unwrap();
        for (name, ty, tol) in [
            ("a.weight", GgmlDType::F32, 0.0),
            ("b.weight", GgmlDType::F16, 5e-4),
            ("c.weight", GgmlDType::Q8_0, 5e-3),
        ] {
            let info = &c.tensor_infos[name];
            assert_eq!((info.ggml_dtype, info.shape.dims().to_vec()), (ty, vec![3, 64]), "{name}");
            assert_eq!(info.offset % ALIGNMENT as u64, 0);
            let t = info.read(&mut f, c.tensor_data_offset, &dev).unwrap().dequantize(&dev).unwrap();
            let d = (t - &w).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d <= tol, "{name}: {d}");
        }
        let t = c.tensor_infos["n.weight"].read(&mut f, c.tensor_data_offset, &dev).unwrap();
        assert_eq!(t.dequantize(&dev).unwrap().to_vec1::<f32>().unwrap(), n.to_vec1::<f32>().unwrap());
    }

    #[test]
    fn q8_0_rows_that_are_not_whole_blocks_are_refused() {
        let t = Tensor::zeros((2, 16), candle_core::DType::F32, &Device::Cpu).unwrap();
        let e =
            header(Path::new("x.gguf"), &[], &[TensorOut { name: "w".into(), data: t, ty: GgmlType::Q8_0 }])
                .unwrap_err()
                .to_string();
        assert!(e.contains("x.gguf") && e.contains("Q8_0"), "{e}");
    }
}
