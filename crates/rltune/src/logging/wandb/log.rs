//! The framing of a W&B `.wandb` file: LevelDB's log format with W&B's own file header.
//!
//! As wandb's `wandb/sdk/internal/datastore.py` (the Python writer and reader; wandb-core's Go
//! `leveldb` package writes the same bytes) describes it:
//! ```text
//! file   := header block*
//! header := ident ":W&B" (4 bytes) | magic 0xBEE1 (u16 LE) | version 0 (u8)
//! block  := record* trailer?            32 KiB each, counted from the start of the file
//! record := checksum (u32 LE) | length (u16 LE) | type (u8) | data[length]
//! ```
//! `type` is FULL (1), FIRST (2), MIDDLE (3) or LAST (4): a payload that does not fit in what is
//! left of a block is split into FIRST, MIDDLE… and LAST pieces. Fewer than 7 bytes left in a
//! block (no room for a record header) are zero-filled. The checksum is zlib's CRC-32 (IEEE,
//! not LevelDB's masked CRC-32C) of the type byte followed by the data:
//! `zlib.crc32(data, zlib.crc32(bytes([type])))`.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A block's size.
pub const BLOCK_LEN: usize = 32 * 1024;
/// A record header's size: checksum, length, type.
pub const HEADER_LEN: usize = 7;
/// The record types.
pub const FULL: u8 = 1;
/// The first piece of a payload split across blocks.
pub const FIRST: u8 = 2;
/// A middle piece.
pub const MIDDLE: u8 = 3;
/// The last piece.
pub const LAST: u8 = 4;

/// The file header: `":W&B"`, magic `0xBEE1` (LE), version 0.
pub const FILE_HEADER: [u8; HEADER_LEN] = [b':', b'W', b'&', b'B', 0xE1, 0xBE, 0];

/// zlib's CRC-32 (reflected polynomial `0xEDB88320`) of `data`, continuing from `crc`
/// (0 to start): `crc32(b"123456789", 0) == 0xCBF4_3926`.
pub fn crc32(data: &[u8], crc: u32) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut bit = 0;
            while bit < 8 {
                c = if c & 1 == 1 { (c >> 1) ^ 0xEDB8_8320 } else { c >> 1 };
                bit += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    let mut c = !crc;
    for &b in data {
        c = TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// The checksum of one record: CRC-32 of its type byte, then its data.
pub fn record_crc(kind: u8, data: &[u8]) -> u32 {
    crc32(data, crc32(&[kind], 0))
}

/// The bytes that append `payload` to a file whose length is `offset` (header included).
pub fn frame(offset: usize, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 2 * HEADER_LEN);
    let mut pos = offset;
    let mut rest = payload;
    let mut first = true;
    loop {
        let left = BLOCK_LEN - pos % BLOCK_LEN;
        if left < HEADER_LEN {
            out.resize(out.len() + left, 0);
            pos += left;
            continue;
        }
        let room = left - HEADER_LEN;
        let (piece, tail) = rest.split_at(rest.len().min(room));
        let kind = match (first, tail.is_empty()) {
            (true, true) => FULL,
            (true, false) => FIRST,
            (false, false) => MIDDLE,
            (false, true) => LAST,
        };
        out.extend_from_slice(&record_crc(kind, piece).to_le_bytes());
        out.extend_from_slice(&(piece.len() as u16).to_le_bytes());
        out.push(kind);
        out.extend_from_slice(piece);
        pos += HEADER_LEN + piece.len();
        if tail.is_empty() {
            return out;
        }
        rest = tail;
        first = false;
    }
}

/// An append-only `.wandb` file: every payload is framed and written in one write, flushed and
/// synced, so a crash loses at most the record being written (a reader stops at a torn tail).
#[derive(Debug)]
pub struct LogWriter {
    path: PathBuf,
    file: File,
    offset: usize,
}

impl LogWriter {
    /// Creates `path` (it must not exist) and writes the file header.
    pub fn create(path: &Path) -> Result<Self> {
        let io = |e| Error::io(path, e);
        let mut file = File::options().write(true).create_new(true).open(path).map_err(io)?;
        file.write_all(&FILE_HEADER).and_then(|_| file.sync_data()).map_err(io)?;
        Ok(LogWriter { path: path.to_path_buf(), file, offset: HEADER_LEN })
    }

    /// Appends one payload (a serialized protobuf `Record`).
    pub fn append(&mut self, payload: &[u8]) -> Result<()> {
        let bytes = frame(self.offset, payload);
        let io = |e| Error::io(&self.path, e);
        self.file.write_all(&bytes).and_then(|_| self.file.flush()).map_err(io)?;
        self.file.sync_data().map_err(io)?;
        self.offset += bytes.len();
        Ok(())
    }
}

/// Why the bytes are not a well-formed `.wandb` file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WandbFileError {
    /// The file does not start with W&B's header.
    #[error("not a .wandb file (no \":W&B\" header)")]
    NoHeader,
    /// A record at byte `pos` is cut short, fails its checksum, or a block trailer is not zero.
    #[error("byte {pos}: {what}")]
    Record {
        /// The record's offset in the file.
        pos: usize,
        /// What is wrong with it.
        what: &'static str,
    },
    /// A record of type `kind` where the FIRST…LAST order does not allow it.
    #[error("byte {pos}: record type {kind} out of order")]
    OutOfOrder {
        /// The record's offset in the file.
        pos: usize,
        /// Its record type.
        kind: u8,
    },
    /// The file ends after a FIRST or MIDDLE record.
    #[error("the file ends inside a split record")]
    EndsInsideRecord,
}

/// Splits the bytes of a `.wandb` file into its payloads, checking the header, every checksum
/// and the FIRST…LAST order. A verifier for tests: a torn tail is an error.
pub fn read_payloads(bytes: &[u8]) -> std::result::Result<Vec<Vec<u8>>, WandbFileError> {
    let at = |pos: usize, what: &'static str| WandbFileError::Record { pos, what };
    if bytes.get(..HEADER_LEN) != Some(&FILE_HEADER[..]) {
        return Err(WandbFileError::NoHeader);
    }
    let (mut pos, mut out, mut partial): (usize, Vec<Vec<u8>>, Option<Vec<u8>>) = (HEADER_LEN, vec![], None);
    while pos < bytes.len() {
        let left = BLOCK_LEN - pos % BLOCK_LEN;
        if left < HEADER_LEN {
            if bytes[pos..(pos + left).min(bytes.len())].iter().any(|&b| b != 0) {
                return Err(at(pos, "block trailer is not zero"));
            }
            pos += left;
            continue;
        }
        let h = bytes.get(pos..pos + HEADER_LEN).ok_or(at(pos, "torn record header"))?;
        let crc = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
        let (len, kind) = (u16::from_le_bytes([h[4], h[5]]) as usize, h[6]);
        let data = bytes.get(pos + HEADER_LEN..pos + HEADER_LEN + len).ok_or(at(pos, "torn record"))?;
        if record_crc(kind, data) != crc {
            return Err(at(pos, "checksum mismatch"));
        }
        match (kind, partial.as_mut()) {
            (FULL, None) => out.push(data.to_vec()),
            (FIRST, None) => partial = Some(data.to_vec()),
            (MIDDLE, Some(p)) => p.extend_from_slice(data),
            (LAST, Some(p)) => {
                p.extend_from_slice(data);
                out.extend(partial.take());
            }
            _ => return Err(WandbFileError::OutOfOrder { pos, kind }),
        }
        pos += HEADER_LEN + len;
    }
    match partial {
        Some(_) => Err(WandbFileError::EndsInsideRecord),
        None => Ok(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_is_zlibs() {
        assert_eq!(crc32(b"123456789", 0), 0xCBF4_3926);
        // zlib.crc32(b"\x01") and chaining: crc32(b"ab") == crc32(b"b", crc32(b"a")).
        assert_eq!(crc32(&[1], 0), 0xA505_DF1B);
        assert_eq!(crc32(b"ab", 0), crc32(b"b", crc32(b"a", 0)));
    }

    /// Payloads that fit, fill a block exactly, leave under 7 bytes, or span several blocks.
    #[test]
    fn framing_round_trips_across_block_boundaries() {
        let sizes = [0, 10, BLOCK_LEN - 2 * HEADER_LEN - 10 - 3, 2, BLOCK_LEN * 2 + 100, 5];
        let payloads: Vec<Vec<u8>> =
            sizes.iter().enumerate().map(|(i, &n)| (0..n).map(|j| (i * 31 + j) as u8).collect()).collect();
        let mut file = FILE_HEADER.to_vec();
        for p in &payloads {
            let framed = frame(file.len(), p);
            file.extend_from_slice(&framed);
        }
        assert_eq!(read_payloads(&file).unwrap(), payloads);
        // No record header straddles a block boundary.
        let mut bad = file.clone();
        let n = bad.len();
        bad[n - 1] ^= 1;
        assert!(read_payloads(&bad).unwrap_err().to_string().contains("checksum"));
        assert!(read_payloads(&file[..file.len() - 3]).is_err(), "a torn tail is reported");
    }

    #[test]
    fn the_writer_appends_what_frame_computes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run-x.wandb");
        let mut w = LogWriter::create(&path).unwrap();
        let big = vec![7u8; BLOCK_LEN + 5];
        for p in [&b"abc"[..], &big, b""] {
            w.append(p).unwrap();
        }
        let got = read_payloads(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(got, vec![b"abc".to_vec(), big, vec![]]);
        assert!(LogWriter::create(&path).is_err(), "an existing file is not overwritten");
    }
}
