//! Datasets from the Hugging Face hub: which files, fetched into the hub cache.
//!
//! `owner/name:path/in/repo.jsonl` fetches that file; `owner/name` lists the repository (the
//! hub API, or the cached snapshot when offline) and takes the files of the split
//! ([`super::files::select_split_files`]). Files come from the hub cache first
//! ([`crate::models::hub`]), so a dataset downloaded once works offline (offline options skip
//! the network entirely). [`super::rows`] reads the files this returns.

use std::path::PathBuf;

use hf_hub::{Repo, RepoType};

use super::files::{extension, list_files, select_split_files, SUPPORTED_EXTENSIONS};
use crate::error::{Error, Result};
use crate::models::hub::HubOptions;

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

/// Hub datasets under some hub options: their cache, and whether the network may be used.
pub(crate) struct Hub {
    options: HubOptions,
    cache: hf_hub::Cache,
}

/// The local paths of a hub dataset's files (`file`, or the split's), through the installed hub
/// options' cache, online unless they say offline ([`crate::models::hub`]).
pub(crate) fn hub_files(id: &str, file: Option<&str>, split: Option<&str>) -> Result<Vec<PathBuf>> {
    Hub::new(crate::models::hub::current())?.files(id, file, split)
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
    /// Datasets under `options`.
    pub(crate) fn new(options: HubOptions) -> Result<Self> {
        Ok(Self { cache: options.cache()?, options })
    }

    /// The local paths of `file`, or of the split's files when `file` is `None`.
    pub(crate) fn files(&self, id: &str, file: Option<&str>, split: Option<&str>) -> Result<Vec<PathBuf>> {
        let files = match file {
            Some(f) => vec![f.to_string()],
            None => select_split_files(&self.list(id)?, split)
                .map_err(|m| Error::Hub(format!("hub dataset {id:?}: {m}")))?,
        };
        files.iter().map(|f| self.get(id, f)).collect()
    }

    /// The local path of `file`: from the cache, else downloaded.
    fn get(&self, id: &str, file: &str) -> Result<PathBuf> {
        if let Some(p) = self.cache.dataset(id.to_string()).get(file) {
            return Ok(p);
        }
        let what = format!("file {file:?}");
        if self.options.offline {
            return Err(unavailable(id, &what, &"it is not in the hub cache and HF_HUB_OFFLINE is set"));
        }
        let api = self.options.api().map_err(|e| unavailable(id, &what, &e))?;
        api.dataset(id.to_string()).get(file).map_err(|e| unavailable(id, &what, &e))
    }

    /// The repository's files: from the hub API, else (offline, or when the API fails) from the
    /// cached snapshot of `main`.
    fn list(&self, id: &str) -> Result<Vec<String>> {
        let cached = self.cached_files(id).filter(|f| !f.is_empty());
        if self.options.offline {
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
