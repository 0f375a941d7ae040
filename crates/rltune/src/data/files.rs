//! Which files of a dataset directory or hub repository hold its data: the extensions read,
//! listing a directory, and choosing a split's files. No reading: [`super::rows`] reads what
//! is chosen here, for local directories and for `super::hub` alike.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The file extensions a dataset directory or hub repository is searched for.
pub const SUPPORTED_EXTENSIONS: &[&str] = &["jsonl", "json", "csv", "parquet", "arrow"];

/// The lowercased extension of `path` (`""` when none).
pub(crate) fn extension(path: &Path) -> String {
    path.extension().map(|e| e.to_string_lossy().to_lowercase()).unwrap_or_default()
}

/// Every file under `dir`, as `/`-separated paths relative to `root`, skipping hidden entries.
pub(crate) fn list_files(root: &Path, dir: &Path, out: &mut Vec<String>) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    for entry in entries {
        let path: PathBuf = entry.map_err(|e| Error::io(dir, e))?.path();
        if path.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')) {
            continue;
        }
        if path.is_dir() {
            list_files(root, &path, out)?;
        } else if let Ok(rel) = path.strip_prefix(root) {
            out.push(rel.components().map(|c| c.as_os_str().to_string_lossy()).collect::<Vec<_>>().join("/"));
        }
    }
    Ok(())
}

/// Whether `file` (a `/`-separated path) belongs to `split`: a folder named `split`, or a file
/// name that is `split` or starts with `split` followed by `-`, `_` or `.` (`train.jsonl`,
/// `train-00000-of-00001.parquet`, `data/train/0000.parquet`).
fn in_split(file: &str, split: &str) -> bool {
    let mut parts: Vec<&str> = file.split('/').collect();
    let name = parts.pop().unwrap_or_default();
    let stem = name.split('.').next().unwrap_or_default();
    parts.contains(&split)
        || stem == split
        || [format!("{split}-"), format!("{split}_")].iter().any(|p| stem.starts_with(p.as_str()))
}

/// Why [`select_split_files`] found no one set of data files; each says the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SplitFilesError {
    /// None of the files has a supported extension.
    #[error("no data files ({extensions}) among its {files} files")]
    NoDataFiles {
        /// The supported extensions, listed.
        extensions: String,
        /// How many files there are.
        files: usize,
    },
    /// No data file belongs to the split.
    #[error("no data files for split {split:?}; data files: {listed}; choose the split, or name one file")]
    NoSplit {
        /// The split asked for.
        split: String,
        /// The data files (the first 20).
        listed: String,
    },
    /// The split's files lie in several folders (several dataset configurations).
    #[error("the files of split {split:?} lie in several folders (dataset configurations?): {files}; name one file")]
    SeveralFolders {
        /// The split asked for.
        split: String,
        /// Its files.
        files: String,
    },
}

/// Chooses the data files (by extension, see [`SUPPORTED_EXTENSIONS`]) of `split` among `files`
/// (`/`-separated paths in a directory or hub repository).
///
/// With `split = None`, the only data file if there is one, else split `train`. A file is in a
/// split when a folder on its path is named after it, or its name is the split or starts with it
/// followed by `-`, `_` or `.` (the hub's `data/train-00000-of-00001.parquet`). Fails, listing
/// the data files, when none match, or when the matches lie in different folders (e.g. two
/// dataset configurations): then name one file.
pub fn select_split_files(
    files: &[String],
    split: Option<&str>,
) -> std::result::Result<Vec<String>, SplitFilesError> {
    let mut data: Vec<&String> = files
        .iter()
        .filter(|f| SUPPORTED_EXTENSIONS.contains(&extension(std::path::Path::new(f.as_str())).as_str()))
        .collect();
    data.sort();
    let listed = || {
        let shown: Vec<&str> = data.iter().take(20).map(|f| f.as_str()).collect();
        let more = data.len().saturating_sub(20);
        format!("{}{}", shown.join(", "), if more > 0 { format!(" and {more} more") } else { String::new() })
    };
    if data.is_empty() {
        let exts = SUPPORTED_EXTENSIONS.iter().map(|e| format!(".{e}")).collect::<Vec<_>>().join(", ");
        return Err(SplitFilesError::NoDataFiles { extensions: exts, files: files.len() });
    }
    if let (None, [only]) = (split, data.as_slice()) {
        return Ok(vec![only.to_string()]);
    }
    let split = split.unwrap_or("train");
    let chosen: Vec<String> = data.iter().filter(|f| in_split(f, split)).map(|f| f.to_string()).collect();
    if chosen.is_empty() {
        return Err(SplitFilesError::NoSplit { split: split.to_string(), listed: listed() });
    }
    let folder = |f: &String| f.rsplit_once('/').map_or(String::new(), |(d, _)| d.to_string());
    let mut folders: Vec<String> = chosen.iter().map(folder).collect();
    folders.sort();
    folders.dedup();
    if folders.len() > 1 {
        return Err(SplitFilesError::SeveralFolders { split: split.to_string(), files: chosen.join(", ") });
    }
    Ok(chosen)
}
