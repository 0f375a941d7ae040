//! TFRecord framing, the container of TensorBoard event files.
//!
//! Each record is `u64 length (LE) | u32 masked_crc32c(length bytes) | data | u32 masked_crc32c(data)`
//! (TensorFlow `tensorflow/core/lib/io/record_writer.cc`). CRC-32C is the Castagnoli polynomial
//! (reflected `0x82F63B78`); the mask is `((crc >> 15) | (crc << 17)) + 0xa282ead8`
//! (`tensorflow/core/lib/hash/crc32c.h`, `Mask`).

use std::io::Write;
use std::path::Path;

use crate::error::{Error, Result};

/// The reflected Castagnoli polynomial.
const CASTAGNOLI: u32 = 0x82F6_3B78;
/// TensorFlow's CRC mask delta.
const MASK_DELTA: u32 = 0xa282_ead8;

/// The byte-at-a-time lookup table for CRC-32C, built at compile time.
const TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ CASTAGNOLI } else { crc >> 1 };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// CRC-32C (Castagnoli) of `data`; `crc32c(b"123456789") == 0xE306_9283`.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc = TABLE[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TensorFlow's masked CRC: a CRC stored next to the data it covers is rotated and offset, so
/// that a CRC of data that itself holds CRCs stays well distributed.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    // `(crc >> 15) | (crc << 17)` in TensorFlow's spelling.
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

/// The framed bytes of one record holding `data`.
pub fn frame_record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// Appends one framed record to `w` in a single write.
pub fn write_record<W: Write>(w: &mut W, data: &[u8]) -> std::io::Result<()> {
    w.write_all(&frame_record(data))
}

/// Splits TFRecord bytes into records, checking both CRCs of every record.
///
/// `what` names the source in errors (usually the file path). A truncated final record (a
/// writer killed mid-write) is an error too: this is a verifier, not a tolerant reader.
pub fn parse_records(bytes: &[u8], what: &str) -> Result<Vec<Vec<u8>>> {
    let mut records = Vec::new();
    let mut pos = 0usize;
    while pos < bytes.len() {
        let n = records.len();
        let bad = |msg: &str| Error::data(what, format!("record {n} at byte {pos}: {msg}"));
        let header = bytes.get(pos..pos + 12).ok_or_else(|| bad("truncated header"))?;
        let (len_bytes, len_crc) = header.split_at(8);
        if masked_crc32c(len_bytes) != u32::from_le_bytes(le4(len_crc)) {
            return Err(bad("length CRC mismatch"));
        }
        let len = usize::try_from(u64::from_le_bytes(le8(len_bytes))).map_err(|_| bad("length overflows"))?;
        let start = pos + 12;
        let end = start.checked_add(len).ok_or_else(|| bad("length overflows"))?;
        let data = bytes.get(start..end).ok_or_else(|| bad("truncated data"))?;
        let crc = bytes.get(end..end + 4).ok_or_else(|| bad("truncated data CRC"))?;
        if masked_crc32c(data) != u32::from_le_bytes(le4(crc)) {
            return Err(bad("data CRC mismatch"));
        }
        records.push(data.to_vec());
        pos = end + 4;
    }
    Ok(records)
}

/// Reads a TFRecord file and returns its records, CRCs checked (see [`parse_records`]).
pub fn read_records(path: &Path) -> Result<Vec<Vec<u8>>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    parse_records(&bytes, &path.display().to_string())
}

fn le4(b: &[u8]) -> [u8; 4] {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    a
}

fn le8(b: &[u8]) -> [u8; 8] {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_known_vectors() {
        // The check value of CRC-32C (RFC 3720, B.4) and the empty string.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
        // RFC 3720 B.4: 32 bytes of zeros.
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
    }

    #[test]
    fn masked_crc_matches_tensorflow_formula() {
        let crc = crc32c(b"123456789");
        #[allow(clippy::manual_rotate)] // spelled as in TensorFlow on purpose
        let want = ((crc >> 15) | (crc << 17)).wrapping_add(0xa282ead8);
        assert_eq!(masked_crc32c(b"123456789"), want);
    }

    #[test]
    fn frame_layout_and_round_trip() {
        let framed = frame_record(b"hello");
        assert_eq!(framed.len(), 8 + 4 + 5 + 4);
        assert_eq!(&framed[..8], &5u64.to_le_bytes());
        assert_eq!(&framed[12..17], b"hello");
        let mut two = framed.clone();
        write_record(&mut two, b"").unwrap();
        let recs = parse_records(&two, "mem").unwrap();
        assert_eq!(recs, vec![b"hello".to_vec(), Vec::new()]);
    }

    #[test]
    fn corruption_is_detected() {
        let mut framed = frame_record(b"hello");
        framed[13] ^= 1;
        let err = parse_records(&framed, "mem").unwrap_err().to_string();
        assert!(err.contains("data CRC mismatch"), "{err}");
        let mut framed = frame_record(b"hello");
        framed[0] ^= 1;
        assert!(parse_records(&framed, "mem").unwrap_err().to_string().contains("length CRC"));
        let framed = frame_record(b"hello");
        let err = parse_records(&framed[..framed.len() - 1], "mem").unwrap_err().to_string();
        assert!(err.contains("truncated"), "{err}");
    }
}
