//! TensorBoard event files, written without TensorFlow: hand-encoded protobuf in TFRecord frames.
//!
//! The messages (`tensorflow/core/util/event.proto`, `tensorflow/core/framework/summary.proto`):
//! ```text
//! Event          { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//! Summary        { repeated Value value = 1; }
//! Value          { string tag = 1; float simple_value = 2; HistogramProto histo = 5; }
//! HistogramProto { double min = 1; double max = 2; double num = 3; double sum = 4;
//!                  double sum_squares = 5; repeated double bucket_limit = 6 [packed];
//!                  repeated double bucket = 7 [packed]; }
//! ```
//! The first event of a file carries `file_version = "brain.Event:2"`. Histograms use equal-width
//! buckets (`bucket[i]` counts values in `(bucket_limit[i-1], bucket_limit[i]]`, as
//! tensorboardX's `make_histogram` writes them) rather than TensorFlow's exponential ones.
//!
//! The decoder below reads back only what this writer writes; it exists for tests and checks.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::tfrecord;
use crate::error::{Error, Result};

/// The number of equal-width buckets in the histograms written.
pub const HISTOGRAM_BUCKETS: usize = 30;

/// A TensorBoard histogram (`HistogramProto`).
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
    /// Number of values.
    pub num: f64,
    /// Sum of the values.
    pub sum: f64,
    /// Sum of the squared values.
    pub sum_squares: f64,
    /// Right edge of each bucket.
    pub bucket_limit: Vec<f64>,
    /// Count in each bucket.
    pub bucket: Vec<f64>,
}

impl Histogram {
    /// Equal-width histogram of the finite values in `xs`; `None` when there are none.
    pub fn from_values(xs: &[f64], buckets: usize) -> Option<Self> {
        let vals: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
        let min = vals.iter().copied().fold(f64::INFINITY, f64::min);
        let max = vals.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if vals.is_empty() {
            return None;
        }
        let n = if max > min { buckets.max(1) } else { 1 };
        let width = (max - min) / n as f64;
        let bucket_limit: Vec<f64> =
            (1..=n).map(|i| if i == n { max } else { min + width * i as f64 }).collect();
        let mut bucket = vec![0.0; n];
        for &x in &vals {
            let i = if width > 0.0 { ((x - min) / width).ceil() as usize } else { 0 };
            bucket[i.saturating_sub(1).min(n - 1)] += 1.0;
        }
        Some(Histogram {
            min,
            max,
            num: vals.len() as f64,
            sum: vals.iter().sum(),
            sum_squares: vals.iter().map(|x| x * x).sum(),
            bucket_limit,
            bucket,
        })
    }
}

/// One value of a summary: a scalar or a histogram, under a tag.
#[derive(Debug, Clone, PartialEq)]
pub enum SummaryValue {
    /// `simple_value`.
    Scalar(String, f32),
    /// `histo`.
    Histogram(String, Histogram),
}

/// An event as decoded by [`decode_event`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Event {
    /// Seconds since the Unix epoch.
    pub wall_time: f64,
    /// Training step.
    pub step: i64,
    /// `brain.Event:2` on a file's first event.
    pub file_version: Option<String>,
    /// The summary values.
    pub values: Vec<SummaryValue>,
}

// ---------------------------------------------------------------------------------------------
// Protobuf encoding (wire types: 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32).

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire: u8) {
    put_varint(out, ((field as u64) << 3) | wire as u64);
}

fn put_f64(out: &mut Vec<u8>, field: u32, v: f64) {
    put_key(out, field, 1);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn put_packed_f64(out: &mut Vec<u8>, field: u32, vs: &[f64]) {
    let bytes: Vec<u8> = vs.iter().flat_map(|v| v.to_le_bytes()).collect();
    put_bytes(out, field, &bytes);
}

fn encode_histogram(h: &Histogram) -> Vec<u8> {
    let mut out = Vec::new();
    for (field, v) in [(1, h.min), (2, h.max), (3, h.num), (4, h.sum), (5, h.sum_squares)] {
        put_f64(&mut out, field, v);
    }
    put_packed_f64(&mut out, 6, &h.bucket_limit);
    put_packed_f64(&mut out, 7, &h.bucket);
    out
}

fn encode_value(v: &SummaryValue) -> Vec<u8> {
    let mut out = Vec::new();
    match v {
        SummaryValue::Scalar(tag, x) => {
            put_bytes(&mut out, 1, tag.as_bytes());
            put_key(&mut out, 2, 5);
            out.extend_from_slice(&x.to_le_bytes());
        }
        SummaryValue::Histogram(tag, h) => {
            put_bytes(&mut out, 1, tag.as_bytes());
            put_bytes(&mut out, 5, &encode_histogram(h));
        }
    }
    out
}

/// The protobuf bytes of `event`.
pub fn encode_event(event: &Event) -> Vec<u8> {
    let mut out = Vec::new();
    put_f64(&mut out, 1, event.wall_time);
    put_key(&mut out, 2, 0);
    put_varint(&mut out, event.step as u64);
    if let Some(v) = &event.file_version {
        put_bytes(&mut out, 3, v.as_bytes());
    }
    if !event.values.is_empty() {
        let mut summary = Vec::new();
        for v in &event.values {
            put_bytes(&mut summary, 1, &encode_value(v));
        }
        put_bytes(&mut out, 5, &summary);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Protobuf decoding of the subset above.

/// One decoded field: number and payload.
enum Field<'a> {
    Varint(u32, u64),
    Fixed64(u32, [u8; 8]),
    Bytes(u32, &'a [u8]),
    Fixed32(u32, [u8; 4]),
}

fn get_varint(buf: &[u8], pos: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *buf.get(*pos)?;
        *pos += 1;
        v |= ((b & 0x7f) as u64) << shift;
        if b < 0x80 {
            return Some(v);
        }
    }
    None
}

fn fields(buf: &[u8]) -> Option<Vec<Field<'_>>> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < buf.len() {
        let key = get_varint(buf, &mut pos)?;
        let (field, wire) = ((key >> 3) as u32, key & 7);
        let take = |pos: &mut usize, n: usize| -> Option<&[u8]> {
            let s = buf.get(*pos..pos.checked_add(n)?)?;
            *pos += n;
            Some(s)
        };
        out.push(match wire {
            0 => Field::Varint(field, get_varint(buf, &mut pos)?),
            1 => Field::Fixed64(field, take(&mut pos, 8)?.try_into().ok()?),
            2 => {
                let n = usize::try_from(get_varint(buf, &mut pos)?).ok()?;
                Field::Bytes(field, take(&mut pos, n)?)
            }
            5 => Field::Fixed32(field, take(&mut pos, 4)?.try_into().ok()?),
            _ => return None,
        });
    }
    Some(out)
}

fn decode_histogram(buf: &[u8]) -> Option<Histogram> {
    let mut h = Histogram {
        min: 0.0,
        max: 0.0,
        num: 0.0,
        sum: 0.0,
        sum_squares: 0.0,
        bucket_limit: Vec::new(),
        bucket: Vec::new(),
    };
    let packed =
        |b: &[u8]| b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect();
    for f in fields(buf)? {
        match f {
            Field::Fixed64(1, b) => h.min = f64::from_le_bytes(b),
            Field::Fixed64(2, b) => h.max = f64::from_le_bytes(b),
            Field::Fixed64(3, b) => h.num = f64::from_le_bytes(b),
            Field::Fixed64(4, b) => h.sum = f64::from_le_bytes(b),
            Field::Fixed64(5, b) => h.sum_squares = f64::from_le_bytes(b),
            Field::Bytes(6, b) => h.bucket_limit = packed(b),
            Field::Bytes(7, b) => h.bucket = packed(b),
            _ => {}
        }
    }
    Some(h)
}

fn decode_value(buf: &[u8]) -> Option<SummaryValue> {
    let (mut tag, mut scalar, mut histo) = (String::new(), None, None);
    for f in fields(buf)? {
        match f {
            Field::Bytes(1, b) => tag = String::from_utf8(b.to_vec()).ok()?,
            Field::Fixed32(2, b) => scalar = Some(f32::from_le_bytes(b)),
            Field::Bytes(5, b) => histo = Some(decode_histogram(b)?),
            _ => {}
        }
    }
    match (scalar, histo) {
        (Some(x), _) => Some(SummaryValue::Scalar(tag, x)),
        (None, Some(h)) => Some(SummaryValue::Histogram(tag, h)),
        _ => None,
    }
}

/// Decodes an `Event` written by [`encode_event`]; `None` if the bytes are not one.
pub fn decode_event(buf: &[u8]) -> Option<Event> {
    let mut ev = Event::default();
    for f in fields(buf)? {
        match f {
            Field::Fixed64(1, b) => ev.wall_time = f64::from_le_bytes(b),
            Field::Varint(2, v) => ev.step = v as i64,
            Field::Bytes(3, b) => ev.file_version = Some(String::from_utf8(b.to_vec()).ok()?),
            Field::Bytes(5, summary) => {
                for f in fields(summary)? {
                    if let Field::Bytes(1, v) = f {
                        ev.values.push(decode_value(v)?);
                    }
                }
            }
            _ => {}
        }
    }
    Some(ev)
}

/// Reads every event of an event file, CRCs checked.
pub fn read_events(path: &Path) -> Result<Vec<Event>> {
    let records = tfrecord::read_records(path)?;
    records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            decode_event(r).ok_or_else(|| Error::data(path.display(), format!("record {i} is not an Event")))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The writer.

/// Appends events to `events.out.tfevents.<unix_ts>.<hostname>`, one flushed write per event.
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    file: File,
}

impl EventWriter {
    /// Creates a new event file in `dir` (never reusing an existing one) and writes the
    /// `file_version` event.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let now = wall_time();
        let base = format!("events.out.tfevents.{}.{}", now as u64, hostname());
        let mut suffix = 0u32;
        let (path, file) = loop {
            let name = if suffix == 0 { base.clone() } else { format!("{base}.{suffix}") };
            let path = dir.join(name);
            match File::options().write(true).create_new(true).open(&path) {
                Ok(f) => break (path, f),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => suffix += 1,
                Err(e) => return Err(Error::io(&path, e)),
            }
        };
        let mut w = EventWriter { path, file };
        let first =
            Event { wall_time: now, file_version: Some("brain.Event:2".into()), ..Default::default() };
        w.write_event(&first)?;
        Ok(w)
    }

    /// The event file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event and flushes it.
    pub fn write_event(&mut self, event: &Event) -> Result<()> {
        let framed = tfrecord::frame_record(&encode_event(event));
        self.file.write_all(&framed).and_then(|_| self.file.flush()).map_err(|e| Error::io(&self.path, e))
    }

    /// Appends the summary values of `step`, stamped with the current time.
    pub fn write_summary(&mut self, step: usize, values: Vec<SummaryValue>) -> Result<()> {
        let ev = Event { wall_time: wall_time(), step: step as i64, file_version: None, values };
        self.write_event(&ev)
    }
}

fn wall_time() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// The kernel's host name (as TensorBoard's writer, `socket.gethostname()`), reduced to characters
/// safe in a file name; `localhost` if unknown. Read from the system, not the environment.
pub(crate) fn hostname() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .unwrap_or_default();
    let clean: String =
        raw.trim().chars().filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')).collect();
    if clean.is_empty() {
        "localhost".into()
    } else {
        clean
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varint_encoding_matches_protobuf() {
        let mut out = Vec::new();
        put_varint(&mut out, 300);
        assert_eq!(out, [0xac, 0x02]);
        let mut pos = 0;
        assert_eq!(get_varint(&out, &mut pos), Some(300));
    }

    #[test]
    fn scalar_event_bytes_are_the_protobuf_encoding() {
        let ev = Event {
            wall_time: 1.5,
            step: 3,
            file_version: None,
            values: vec![SummaryValue::Scalar("a".into(), 2.0)],
        };
        let mut want = vec![0x09];
        want.extend_from_slice(&1.5f64.to_le_bytes());
        want.extend_from_slice(&[0x10, 0x03, 0x2a, 0x0a, 0x0a, 0x08, 0x0a, 0x01, b'a', 0x15]);
        want.extend_from_slice(&2.0f32.to_le_bytes());
        assert_eq!(encode_event(&ev), want);
        assert_eq!(decode_event(&want), Some(ev));
    }

    #[test]
    fn histogram_counts_every_finite_value_once() {
        let h = Histogram::from_values(&[0.0, 1.0, 1.0, 2.0, f64::NAN, 10.0], 5).unwrap();
        assert_eq!(h.num, 5.0);
        assert_eq!(h.bucket.iter().sum::<f64>(), 5.0);
        assert_eq!(h.bucket_limit.len(), 5);
        assert_eq!(*h.bucket_limit.last().unwrap(), 10.0);
        assert_eq!(h.bucket[0], 4.0); // 0, 1, 1, 2 all <= 2
        let single = Histogram::from_values(&[3.0, 3.0], 5).unwrap();
        assert_eq!((single.bucket.clone(), single.bucket_limit.clone()), (vec![2.0], vec![3.0]));
        assert!(Histogram::from_values(&[f64::NAN], 5).is_none());
    }

    #[test]
    fn writer_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        let h = Histogram::from_values(&[1.0, 2.0, 3.0], 4).unwrap();
        w.write_summary(
            7,
            vec![SummaryValue::Scalar("x/y".into(), 0.25), SummaryValue::Histogram("d".into(), h.clone())],
        )
        .unwrap();
        let name = w.path().file_name().unwrap().to_string_lossy().to_string();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        let evs = read_events(w.path()).unwrap();
        assert_eq!(evs.len(), 2);
        assert_eq!(evs[0].file_version.as_deref(), Some("brain.Event:2"));
        assert_eq!(evs[1].step, 7);
        assert_eq!(
            evs[1].values,
            vec![SummaryValue::Scalar("x/y".into(), 0.25), SummaryValue::Histogram("d".into(), h)]
        );
        // A second writer in the same second gets its own file.
        let w2 = EventWriter::create(dir.path()).unwrap();
        assert_ne!(w2.path(), w.path());
    }
}
