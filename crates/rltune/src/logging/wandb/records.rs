//! The protobuf `Record`s of a `.wandb` file, encoded by hand.
//!
//! The messages and field numbers written (wandb's `wandb/proto/wandb_internal.proto`, as shipped
//! in wandb 0.31's `wandb_internal_pb2`; `Timestamp` is `google/protobuf/timestamp.proto`):
//! ```text
//! Record        { int64 num = 1; HistoryRecord history = 2; SummaryRecord summary = 3;
//!                 ConfigRecord config = 5; RunRecord run = 17; RunExitRecord exit = 18;
//!                 HeaderRecord header = 21; }
//! HeaderRecord  { VersionInfo version_info = 1; }
//! VersionInfo   { string producer = 1; string min_consumer = 2; }
//! RunRecord     { string run_id = 1; string entity = 2; string project = 3; ConfigRecord config = 4;
//!                 string display_name = 8; string host = 13; int64 starting_step = 14;
//!                 Timestamp start_time = 17; bool resumed = 18; }
//! ConfigRecord  { repeated ConfigItem update = 1; }   ConfigItem  { string key = 1; string value_json = 16; }
//! SummaryRecord { repeated SummaryItem update = 1; }  SummaryItem { string key = 1; string value_json = 16; }
//! HistoryRecord { repeated HistoryItem item = 1; HistoryStep step = 2; }
//! HistoryItem   { string key = 1; string value_json = 16; }   HistoryStep { int64 num = 1; }
//! RunExitRecord { int32 exit_code = 1; int32 runtime = 2; }
//! Timestamp     { int64 seconds = 1; int32 nanos = 2; }
//! ```
//! Items carry their name in `key` (wandb 0.31 itself fills `nested_key` with one element; readers
//! take either). Values are JSON text, as wandb's `json.dumps` writes them: `NaN`, `Infinity`
//! and `-Infinity` for the non-finite numbers.

/// A `(key, value_json)` item of a config, summary or history record.
pub type Item = (String, String);

/// One record of a `.wandb` file.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// `HeaderRecord`: the first record, naming the writer.
    Header {
        /// `version_info.producer`.
        producer: String,
        /// `version_info.min_consumer`: the oldest wandb that reads the file.
        min_consumer: String,
    },
    /// `RunRecord`, with the run's config.
    Run(RunInfo),
    /// `HistoryRecord`: one step's values (with `_step`, `_runtime`, `_timestamp`).
    History {
        /// The values, JSON-encoded.
        items: Vec<Item>,
        /// `step.num`.
        step: i64,
    },
    /// `SummaryRecord`: the run's final values.
    Summary(Vec<Item>),
    /// `ConfigRecord`: config updates.
    Config(Vec<Item>),
    /// `RunExitRecord`.
    Exit {
        /// 0 for a finished run.
        exit_code: i32,
        /// Seconds the run lasted.
        runtime: i32,
    },
}

/// The fields of a `RunRecord` that rltune sets.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RunInfo {
    /// The run's id (8 characters of `[a-z0-9]`, as wandb's `generate_id`).
    pub run_id: String,
    /// The W&B project.
    pub project: String,
    /// The W&B entity (user or team); empty: the syncing user's default.
    pub entity: String,
    /// The run's display name.
    pub display_name: String,
    /// The machine's host name.
    pub host: String,
    /// The config, one item per top-level key.
    pub config: Vec<Item>,
    /// Seconds since the Unix epoch at the start.
    pub start_time: f64,
    /// The first step of a resumed run (0 otherwise).
    pub starting_step: i64,
    /// Whether this file continues a run started earlier (a resume).
    pub resumed: bool,
}

impl Record {
    /// The serialized `Record` with sequence number `num`.
    pub fn encode(&self, num: i64) -> Vec<u8> {
        let mut out = Vec::new();
        put_int(&mut out, 1, num);
        match self {
            Record::Header { producer, min_consumer } => {
                let mut version = Vec::new();
                put_str(&mut version, 1, producer);
                put_str(&mut version, 2, min_consumer);
                let mut header = Vec::new();
                put_msg(&mut header, 1, &version);
                put_msg(&mut out, 21, &header);
            }
            Record::Run(run) => put_msg(&mut out, 17, &encode_run(run)),
            Record::History { items, step } => {
                let mut h = Vec::new();
                for item in items {
                    put_msg(&mut h, 1, &encode_item(item));
                }
                let mut s = Vec::new();
                put_int(&mut s, 1, *step);
                put_msg(&mut h, 2, &s);
                put_msg(&mut out, 2, &h);
            }
            Record::Summary(items) => put_msg(&mut out, 3, &encode_updates(items)),
            Record::Config(items) => put_msg(&mut out, 5, &encode_updates(items)),
            Record::Exit { exit_code, runtime } => {
                let mut e = Vec::new();
                put_int(&mut e, 1, *exit_code as i64);
                put_int(&mut e, 2, *runtime as i64);
                put_msg(&mut out, 18, &e);
            }
        }
        out
    }
}

fn encode_run(run: &RunInfo) -> Vec<u8> {
    let mut r = Vec::new();
    put_str(&mut r, 1, &run.run_id);
    put_str(&mut r, 2, &run.entity);
    put_str(&mut r, 3, &run.project);
    put_msg(&mut r, 4, &encode_updates(&run.config));
    put_str(&mut r, 8, &run.display_name);
    put_str(&mut r, 13, &run.host);
    put_int(&mut r, 14, run.starting_step);
    let mut ts = Vec::new();
    put_int(&mut ts, 1, run.start_time.floor() as i64);
    put_int(&mut ts, 2, ((run.start_time - run.start_time.floor()) * 1e9) as i64);
    put_msg(&mut r, 17, &ts);
    if run.resumed {
        put_int(&mut r, 18, 1);
    }
    r
}

/// A `ConfigRecord` / `SummaryRecord` body: `repeated … update = 1`.
fn encode_updates(items: &[Item]) -> Vec<u8> {
    let mut out = Vec::new();
    for item in items {
        put_msg(&mut out, 1, &encode_item(item));
    }
    out
}

/// A `ConfigItem`, `SummaryItem` or `HistoryItem`: `key = 1`, `value_json = 16`.
fn encode_item((key, value_json): &Item) -> Vec<u8> {
    let mut out = Vec::new();
    put_str(&mut out, 1, key);
    put_str(&mut out, 16, value_json);
    out
}

/// A number as wandb's JSON writes it (`NaN`, `Infinity`, `-Infinity` when not finite).
pub fn json_number(v: f64) -> String {
    match serde_json::Number::from_f64(v) {
        Some(n) => n.to_string(),
        None if v.is_nan() => "NaN".into(),
        None if v > 0.0 => "Infinity".into(),
        None => "-Infinity".into(),
    }
}

// Protobuf wire format: a key is `(field << 3) | wire_type`; 0 varint, 2 length-delimited.
// Fields equal to their default (0, "") are left out, as protobuf serializers do.

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_int(out: &mut Vec<u8>, field: u32, v: i64) {
    if v != 0 {
        put_varint(out, (field as u64) << 3);
        // int64 and int32 encode negatives as 10-byte two's complement varints.
        put_varint(out, v as u64);
    }
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_varint(out, ((field as u64) << 3) | 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn put_str(out: &mut Vec<u8>, field: u32, s: &str) {
    if !s.is_empty() {
        put_bytes(out, field, s.as_bytes());
    }
}

/// A sub-message, written even when empty (it marks a `oneof` member as set).
fn put_msg(out: &mut Vec<u8>, field: u32, body: &[u8]) {
    put_bytes(out, field, body);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes checked against wandb 0.31's `Record.ParseFromString` (see
    /// tools/trackers/check_wandb.py for the end-to-end check).
    #[test]
    fn records_encode_as_protobuf() {
        let exit = Record::Exit { exit_code: 0, runtime: 3 }.encode(5);
        assert_eq!(exit, vec![0x08, 5, 0x92, 0x01, 2, 0x10, 3]);
        let h = Record::History { items: vec![("a".into(), "1.5".into())], step: 2 }.encode(1);
        // num=1 | history(2) { item(1) { key(1)="a", value_json(16)="1.5" }, step(2) { num=2 } }
        let item = [0x0a, 1, b'a', 0x82, 0x01, 3, b'1', b'.', b'5'];
        let mut want = vec![0x08, 1, 0x12, (2 + item.len() + 4) as u8, 0x0a, item.len() as u8];
        want.extend_from_slice(&item);
        want.extend_from_slice(&[0x12, 2, 0x08, 2]);
        assert_eq!(h, want);
        assert_eq!(Record::Exit { exit_code: -1, runtime: 0 }.encode(1).len(), 2 + 3 + 11);
    }

    #[test]
    fn non_finite_numbers_are_written_as_python_json_writes_them() {
        assert_eq!(json_number(0.25), "0.25");
        assert_eq!(json_number(f64::NAN), "NaN");
        assert_eq!(json_number(f64::INFINITY), "Infinity");
        assert_eq!(json_number(f64::NEG_INFINITY), "-Infinity");
    }
}
