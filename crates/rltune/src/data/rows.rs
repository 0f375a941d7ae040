//! The one reader of dataset rows behind every trainer: prompts (PPO, GRPO, RLOO), SFT, reward
//! and DPO data.
//!
//! [`read_rows`] reads a local file by extension — JSON lines (`.jsonl`), JSON (`.json`: an
//! array of objects, or JSON lines), CSV (`.csv`, with a header row), Parquet (`.parquet`),
//! Arrow IPC (`.arrow`) and plain text (`.txt`, one `{"text": line}` row per non-empty line) —
//! a directory, or a Hugging Face hub dataset (see `super::hub`). A directory is one of:
//!
//! - a `datasets` `DatasetDict.save_to_disk` directory (`dataset_dict.json` and one
//!   subdirectory per split): the split's subdirectory (default `train`);
//! - a `Dataset.save_to_disk` directory (`state.json`, `dataset_info.json`, and the Arrow
//!   files `data-0000x-of-0000n.arrow` that `state.json` lists, read in its order);
//! - any other directory: its data files of the split ([`super::files::select_split_files`]).
//!
//! Parquet needs the `parquet` cargo feature, Arrow (and `save_to_disk` directories) the `arrow`
//! feature; the `rltune` binary has both.
//!
//! Every row is a JSON object ([`Row`]) with its origin for messages (`file line 3`, `file row
//! 3`). CSV values are strings. [`ColumnMap`] renames columns to the names a trainer reads
//! (`[data] columns = { prompt = "question" }`).

#[cfg(feature = "arrow")]
mod arrow;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Error, Result};

pub use super::files::SUPPORTED_EXTENSIONS;
use super::files::{extension, list_files, select_split_files};

/// One dataset row: its columns, and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The columns (after [`ColumnMap`] renaming).
    pub fields: Map<String, Value>,
    /// Where the row is, for messages: `data.jsonl line 3`, `data.parquet row 3`.
    pub origin: String,
}

impl Row {
    /// The row as a JSON object value.
    pub fn to_value(&self) -> Value {
        Value::Object(self.fields.clone())
    }
}

/// Which dataset columns hold the fields a trainer reads: `{ prompt = "question" }` reads the
/// `question` column as `prompt`. Columns that are not named keep their names.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct ColumnMap(pub BTreeMap<String, String>);

impl ColumnMap {
    /// Whether no column is renamed.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Renames the mapped columns of `row`; fails, naming the row and the setting, when a mapped
    /// column is missing.
    pub fn apply(&self, row: &mut Row) -> Result<()> {
        for (field, column) in &self.0 {
            if field == column {
                continue;
            }
            match row.fields.remove(column) {
                Some(v) => {
                    row.fields.insert(field.clone(), v);
                }
                None => {
                    return Err(Error::data(
                        &row.origin,
                        format!(
                            "no column {column:?} (read as {field:?} through `[data] columns`); columns \
                         present: {}; fix the column name in `[data] columns`",
                            column_list(&row.fields)
                        ),
                    ))
                }
            }
        }
        Ok(())
    }
}

/// Where to read and how: the split of a directory or hub dataset, and the column mapping.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataOptions {
    /// The split of a dataset directory or hub dataset (default: the only one, else `train`).
    pub split: Option<String>,
    /// Column renaming: `{ prompt = "question" }`.
    pub columns: ColumnMap,
}

/// `"a", "b"`: the columns of a row, for messages.
pub(crate) fn column_list(fields: &Map<String, Value>) -> String {
    fields.keys().map(|k| format!("{k:?}")).collect::<Vec<_>>().join(", ")
}

/// Reads every row of `source` (a file, a directory or a hub dataset) and applies `opts.columns`.
///
/// Fails on an empty dataset, naming `source`.
pub fn read_rows(source: &str, opts: &DataOptions) -> Result<Vec<Row>> {
    let path = Path::new(source);
    let split = opts.split.as_deref();
    let mut rows = if path.is_file() {
        read_file(path)?
    } else if path.is_dir() {
        read_dir(path, split)?
    } else if let Some((id, file)) = super::hub::parse_hub_id(source) {
        let mut rows = Vec::new();
        for f in super::hub::hub_files(id, file, split)? {
            rows.extend(read_file(&f)?);
        }
        rows
    } else {
        return Err(Error::io(
            path,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no such data file or directory (nor a hub dataset id `owner/name`)",
            ),
        ));
    };
    if rows.is_empty() {
        return Err(Error::data(source, "the dataset has no rows"));
    }
    for row in &mut rows {
        opts.columns.apply(row)?;
    }
    Ok(rows)
}

/// Reads one local file, by extension.
pub fn read_file(path: &Path) -> Result<Vec<Row>> {
    let ext = extension(path);
    match ext.as_str() {
        "jsonl" => read_json_lines(path, &super::read_utf8(path)?),
        "json" => {
            let s = super::read_utf8(path)?;
            if s.trim_start().starts_with('[') {
                read_json_array(path, &s)
            } else {
                read_json_lines(path, &s)
            }
        }
        "csv" => read_csv(path),
        "txt" => read_text_lines(path),
        "parquet" => read_parquet(path),
        "arrow" => read_arrow(path),
        _ => Err(Error::data(
            path.display(),
            format!(
                "unknown data file type {:?}; supported extensions: {}, .txt",
                ext,
                SUPPORTED_EXTENSIONS.iter().map(|e| format!(".{e}")).collect::<Vec<_>>().join(", ")
            ),
        )),
    }
}

/// A directory: a `save_to_disk` dataset or dataset dict, else the files of `split`.
fn read_dir(dir: &Path, split: Option<&str>) -> Result<Vec<Row>> {
    if dir.join("dataset_dict.json").is_file() {
        return read_dataset_dict(dir, split);
    }
    if dir.join("state.json").is_file() {
        return read_saved_dataset(dir);
    }
    let mut files = Vec::new();
    list_files(dir, dir, &mut files)?;
    let chosen = select_split_files(&files, split).map_err(|m| Error::data(dir.display(), m))?;
    let mut rows = Vec::new();
    for f in chosen {
        rows.extend(read_file(&dir.join(&f))?);
    }
    Ok(rows)
}

/// `DatasetDict.save_to_disk`: `dataset_dict.json` (`{"splits": [..]}`) and a directory per split.
fn read_dataset_dict(dir: &Path, split: Option<&str>) -> Result<Vec<Row>> {
    let file = dir.join("dataset_dict.json");
    let v: Value = serde_json::from_str(&super::read_utf8(&file)?)
        .map_err(|e| Error::data(file.display(), format!("invalid JSON: {e}")))?;
    let splits: Vec<String> = v
        .get("splits")
        .and_then(|s| s.as_array())
        .map(|a| a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect())
        .ok_or_else(|| {
            Error::data(file.display(), "no \"splits\" list; a `DatasetDict.save_to_disk` directory has {\"splits\": [\"train\", ..]}")
        })?;
    let split = split.unwrap_or("train");
    if !splits.iter().any(|s| s == split) {
        return Err(Error::data(
            dir.display(),
            format!(
                "no split {split:?}; the dataset has {}; choose one with `[data] split`",
                splits.iter().map(|s| format!("{s:?}")).collect::<Vec<_>>().join(", ")
            ),
        ));
    }
    read_saved_dataset(&dir.join(split))
}

/// `Dataset.save_to_disk`: the Arrow files `state.json` lists under `_data_files`.
fn read_saved_dataset(dir: &Path) -> Result<Vec<Row>> {
    let state = dir.join("state.json");
    let v: Value = serde_json::from_str(&super::read_utf8(&state)?)
        .map_err(|e| Error::data(state.display(), format!("invalid JSON: {e}")))?;
    let files: Vec<PathBuf> =
        v.get("_data_files")
            .and_then(|f| f.as_array())
            .and_then(|a| a.iter().map(|f| f.get("filename")?.as_str().map(|n| dir.join(n))).collect())
            .ok_or_else(|| {
                Error::data(state.display(),
                "no \"_data_files\" list of {\"filename\": ..}; is this a `Dataset.save_to_disk` directory?",
            )
            })?;
    if v.get("_indices_data_files").and_then(|x| x.as_array()).is_some_and(|a| !a.is_empty()) {
        return Err(Error::data(
            state.display(),
            "the dataset has an indices mapping (a `select`/`shuffle` view); save it with \
             `ds.flatten_indices().save_to_disk(..)`",
        ));
    }
    let mut rows = Vec::new();
    for f in files {
        rows.extend(read_arrow(&f)?);
    }
    Ok(rows)
}

/// `v` as JSON, cut to about 200 bytes: error messages quote rows, and a row can be megabytes.
pub(crate) fn shorten(v: &Value) -> String {
    const MAX: usize = 200;
    let s = v.to_string();
    if s.len() <= MAX {
        return s;
    }
    let cut = (0..=MAX).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
    format!("{}… ({} bytes)", &s[..cut], s.len())
}

/// A row that must be a JSON object.
fn object(v: Value, origin: String) -> Result<Row> {
    match v {
        Value::Object(fields) => Ok(Row { fields, origin }),
        other => Err(Error::data(&origin, format!("a row must be a JSON object, got {}", shorten(&other)))),
    }
}

/// JSON lines: one object per non-blank line.
fn read_json_lines(path: &Path, text: &str) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = format!("{} line {}", path.display(), i + 1);
        let v: Value = serde_json::from_str(line).map_err(|e| {
            if e.is_syntax() && (line.contains("NaN") || line.contains("Infinity")) {
                return Error::data(
                    &at,
                    "invalid JSON: a value is NaN or Infinity, which JSON cannot hold; write finite numbers \
                     (or drop the field)",
                );
            }
            Error::data(&at, format!("invalid JSON: {e}"))
        })?;
        rows.push(object(v, at)?);
    }
    Ok(rows)
}

/// A JSON array of objects.
fn read_json_array(path: &Path, text: &str) -> Result<Vec<Row>> {
    let items: Vec<Value> = serde_json::from_str(text)
        .map_err(|e| Error::data(path.display(), format!("invalid JSON array of rows: {e}")))?;
    items
        .into_iter()
        .enumerate()
        .map(|(i, v)| object(v, format!("{} row {}", path.display(), i + 1)))
        .collect()
}

/// Plain text: one `{"text": line}` row per non-empty line.
fn read_text_lines(path: &Path) -> Result<Vec<Row>> {
    let text = super::read_utf8(path)?;
    Ok(text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            let mut fields = Map::new();
            fields.insert("text".into(), l.into());
            Row { fields, origin: format!("{} line {}", path.display(), i + 1) }
        })
        .collect())
}

/// CSV with a header row; every value is a string.
fn read_csv(path: &Path) -> Result<Vec<Row>> {
    // Read as UTF-8 first: invalid bytes then get the line and the fix.
    let text = super::read_utf8(path)?;
    let mut reader = csv::ReaderBuilder::new().has_headers(true).from_reader(text.as_bytes());
    let bad = |e: csv::Error| Error::data(path.display(), format!("invalid CSV: {e}"));
    let headers = reader.headers().map_err(bad)?.clone();
    let mut rows = Vec::new();
    for record in reader.records() {
        let record = record.map_err(bad)?;
        let line = record.position().map_or(0, |p| p.line());
        let fields: Map<String, Value> =
            headers.iter().zip(record.iter()).map(|(h, v)| (h.to_string(), v.into())).collect();
        rows.push(Row { fields, origin: format!("{} line {line}", path.display()) });
    }
    Ok(rows)
}

/// Parquet, through the `parquet` crate's row API (values converted to JSON).
#[cfg(feature = "parquet")]
fn read_parquet(path: &Path) -> Result<Vec<Row>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};

    let bad = |e: parquet::errors::ParquetError| Error::data(path.display(), format!("invalid Parquet: {e}"));
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let reader = SerializedFileReader::new(file).map_err(bad)?;
    let mut rows = Vec::new();
    for (i, row) in reader.get_row_iter(None).map_err(bad)?.enumerate() {
        let v = row.map_err(bad)?.to_json_value();
        rows.push(object(v, format!("{} row {}", path.display(), i + 1))?);
    }
    Ok(rows)
}

/// Arrow IPC (stream or file format), as `datasets` writes it.
#[cfg(feature = "arrow")]
fn read_arrow(path: &Path) -> Result<Vec<Row>> {
    arrow::read_arrow(path)
}

#[cfg(not(feature = "parquet"))]
fn read_parquet(path: &Path) -> Result<Vec<Row>> {
    Err(needs_feature(
        path,
        "Parquet",
        "parquet",
        "pd.read_parquet('IN.parquet').to_json('OUT.jsonl', orient='records', lines=True)",
    ))
}

#[cfg(not(feature = "arrow"))]
fn read_arrow(path: &Path) -> Result<Vec<Row>> {
    Err(needs_feature(path, "Arrow", "arrow", "datasets.load_from_disk('DIR').to_json('OUT.jsonl')"))
}

/// Without the `parquet` or `arrow` feature: an error that says how to get it.
#[cfg(any(not(feature = "parquet"), not(feature = "arrow")))]
fn needs_feature(path: &Path, what: &str, feature: &str, read: &str) -> Error {
    Error::data(
        path.display(),
        format!(
            "reading {what} needs the `{feature}` cargo feature, which this build was made without: \
         the `rltune` binary has it by default (`cargo build --release -p rltune-cli`, without \
         `--no-default-features`); a program using the library adds `features = [\"{feature}\"]` to its \
         `rltune` dependency. Or convert the data to JSON lines in Python, e.g. `{read}`"
        ),
    )
}

#[cfg(test)]
mod tests;
