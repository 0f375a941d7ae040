//! Prompt datasets from the Hugging Face hub, and choosing a split's files.
//!
//! `owner/name:path/in/repo.jsonl` fetches that file; `owner/name` lists the repository (the
//! hub API, or the cached snapshot when offline) and takes the files of the split. Files come
//! from the hub cache first (`$HF_HOME/hub`), so a dataset downloaded once works offline
//! (`HF_HUB_OFFLINE=1` skips the network entirely).

use std::path::PathBuf;

use hf_hub::{Repo, RepoType};

use crate::data::rows::{extension, list_files, read_file, Row, SUPPORTED_EXTENSIONS};
use crate::error::{Error, Result};

/// Splits `owner/name[:path/in/repo]` into the id and the file, when `source` looks like a hub
/// dataset: one `/` in the id, names of letters, digits, `-`, `_`, `.`, and no data-file
/// extension on the id (`data/prompts.jsonl` is a missing local file, not a dataset).
pub(crate) fn parse_hub_id(source: &str) -> Option<(&str, Option<&str>)> {
    let (id, file) = match source.split_once(':') {
        Some((id, file)) if !file.is_empty() => (id, Some(file)),
        Some(_) => return None,
        None => (source, None),
    };
    let (owner, name) = id.split_once('/')?;
    let valid = |s: &str| {
        !s.is_empty()
            && !s.starts_with('.')
            && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    let data_ext = SUPPORTED_EXTENSIONS.contains(&extension(std::path::Path::new(name)).as_str());
    (valid(owner) && valid(name) && !data_ext).then_some((id, file))
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

/// Chooses the data files (by extension, see [`SUPPORTED_EXTENSIONS`]) of `split` among `files`
/// (`/`-separated paths in a directory or hub repository).
///
/// With `split = None`, the only data file if there is one, else split `train`. A file is in a
/// split when a folder on its path is named after it, or its name is the split or starts with it
/// followed by `-`, `_` or `.` (the hub's `data/train-00000-of-00001.parquet`). Fails, listing
/// the data files, when none match, or when the matches lie in different folders (e.g. two
/// dataset configurations): then name one file.
pub fn select_split_files(files: &[String], split: Option<&str>) -> std::result::Result<Vec<String>, String> {
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
        return Err(format!("no data files ({exts}) among its {} files", files.len()));
    }
    if let (None, [only]) = (split, data.as_slice()) {
        return Ok(vec![only.to_string()]);
    }
    let split = split.unwrap_or("train");
    let chosen: Vec<String> = data.iter().filter(|f| in_split(f, split)).map(|f| f.to_string()).collect();
    if chosen.is_empty() {
        return Err(format!(
            "no data files for split {split:?}; data files: {}; choose the split, or name one file",
            listed()
        ));
    }
    let folder = |f: &String| f.rsplit_once('/').map_or(String::new(), |(d, _)| d.to_string());
    let mut folders: Vec<String> = chosen.iter().map(folder).collect();
    folders.sort();
    folders.dedup();
    if folders.len() > 1 {
        return Err(format!(
            "the files of split {split:?} lie in several folders (dataset configurations?): {}; name one file",
            chosen.join(", ")
        ));
    }
    Ok(chosen)
}

/// The hub cache, and whether the network may be used.
pub(super) struct Hub {
    pub(super) cache: hf_hub::Cache,
    pub(super) offline: bool,
    /// The endpoint and the rest, for the client.
    pub(super) options: crate::models::hub::HubOptions,
}

/// Loads a hub dataset through the installed hub options' cache, online unless they say
/// offline ([`crate::models::hub`]).
pub(crate) fn load_hub(id: &str, file: Option<&str>, split: Option<&str>) -> Result<Vec<Row>> {
    let options = crate::models::hub::current();
    Hub { cache: options.cache()?, offline: options.offline, options }.load(id, file, split)
}

/// The error for a hub dataset that cannot be had, with what to do instead.
fn unavailable(id: &str, what: &str, why: &dyn std::fmt::Display) -> Error {
    Error::Hub(format!(
        "cannot get {what} of hub dataset {id:?}: {why}. Download the file on a machine that is online \
         (e.g. `huggingface-cli download --repo-type dataset {id} FILE`) and pass its local path, or name \
         one file of the repository as `{id}:path/in/repo.jsonl`"
    ))
}

impl Hub {
    /// The rows of `file`, or of the split's files when `file` is `None`.
    pub(super) fn load(&self, id: &str, file: Option<&str>, split: Option<&str>) -> Result<Vec<Row>> {
        let files = match file {
            Some(f) => vec![f.to_string()],
            None => select_split_files(&self.list(id)?, split)
                .map_err(|m| Error::Hub(format!("hub dataset {id:?}: {m}")))?,
        };
        let mut rows = Vec::new();
        for f in files {
            rows.extend(read_file(&self.get(id, &f)?)?);
        }
        Ok(rows)
    }

    /// The local path of `file`: from the cache, else downloaded.
    fn get(&self, id: &str, file: &str) -> Result<PathBuf> {
        if let Some(p) = self.cache.dataset(id.to_string()).get(file) {
            return Ok(p);
        }
        let what = format!("file {file:?}");
        if self.offline {
            return Err(unavailable(id, &what, &"it is not in the hub cache and HF_HUB_OFFLINE is set"));
        }
        let api = self.options.api().map_err(|e| unavailable(id, &what, &e))?;
        api.dataset(id.to_string()).get(file).map_err(|e| unavailable(id, &what, &e))
    }

    /// The repository's files: from the hub API, else (offline, or when the API fails) from the
    /// cached snapshot of `main`.
    fn list(&self, id: &str) -> Result<Vec<String>> {
        let cached = self.cached_files(id).filter(|f| !f.is_empty());
        if self.offline {
            return cached.ok_or_else(|| {
                unavailable(id, "the file list", &"it is not in the hub cache and HF_HUB_OFFLINE is set")
            });
        }
        let online = self.options.api().and_then(|api| {
            api.dataset(id.to_string()).info().map_err(|e| crate::models::Error::Hub(e.to_string()))
        });
        match (online, cached) {
            (Ok(info), _) => Ok(info.siblings.into_iter().map(|s| s.rfilename).collect()),
            (Err(e), Some(files)) => {
                tracing::warn!("cannot list hub dataset {id:?} ({e}); using the files in the hub cache");
                Ok(files)
            }
            (Err(e), None) => Err(unavailable(id, "the file list", &e)),
        }
    }

    /// The files of the cached snapshot of `main`, if any.
    fn cached_files(&self, id: &str) -> Option<Vec<String>> {
        let repo_dir = self.cache.path().join(Repo::new(id.to_string(), RepoType::Dataset).folder_name());
        let sha = std::fs::read_to_string(repo_dir.join("refs").join("main")).ok()?;
        let snapshot = repo_dir.join("snapshots").join(sha.trim());
        let mut files = Vec::new();
        list_files(&snapshot, &snapshot, &mut files).ok()?;
        Some(files)
    }
}
