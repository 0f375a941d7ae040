//! Where Hugging Face hub files come from: the cache, whether the network may be used, the
//! endpoint, and where files derived from a GGUF go.
//!
//! The library reads no environment variable. A program builds [`HubOptions`] (the `rltune`
//! command from `HF_HUB_OFFLINE`, `HF_HOME`, `HF_ENDPOINT` and `RLTUNE_CACHE`, with
//! [`HubOptions::from_vars`]) and installs them once at start-up ([`install`]); every model and
//! dataset loader then reads [`current`]. Without an installation the loaders use
//! [`HubOptions::default`]: online, the standard cache under the home directory.

use std::path::{Path, PathBuf};
use std::sync::RwLock;

use crate::error::{Error, Result};

/// How hub files are found and fetched.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HubOptions {
    /// Never use the network: only the cache (`HF_HUB_OFFLINE=1`).
    pub offline: bool,
    /// The hub cache (`$HF_HOME/hub`); `None`: `~/.cache/huggingface/hub`.
    pub cache_dir: Option<PathBuf>,
    /// The hub's address (`HF_ENDPOINT`); `None`: `https://huggingface.co`.
    pub endpoint: Option<String>,
    /// Where the files derived from a GGUF (config, tokenizer) are written (`RLTUNE_CACHE`);
    /// `None`: the system's temporary directory.
    pub derived_dir: Option<PathBuf>,
}

impl HubOptions {
    /// The options the `huggingface_hub` library would read from the environment, through
    /// `var` (the command line passes `|k| std::env::var(k).ok()`): `HF_HUB_OFFLINE` (`1` or
    /// `true`), `HF_HOME` (the cache is its `hub` folder), `HF_ENDPOINT`, and rltune's
    /// `RLTUNE_CACHE`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let set = |k: &str| var(k).filter(|v| !v.is_empty());
        Self {
            offline: set("HF_HUB_OFFLINE").is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("true")),
            cache_dir: set("HF_HOME").map(|h| PathBuf::from(h).join("hub")),
            endpoint: set("HF_ENDPOINT"),
            derived_dir: set("RLTUNE_CACHE").map(PathBuf::from),
        }
    }

    /// The hub cache.
    pub fn cache(&self) -> Result<hf_hub::Cache> {
        match &self.cache_dir {
            Some(dir) => Ok(hf_hub::Cache::new(dir.clone())),
            None => {
                let home = std::env::home_dir().ok_or_else(|| {
                    Error::Hub(
                        "no home directory for the hub cache; set HF_HOME (or HubOptions::cache_dir)".into(),
                    )
                })?;
                Ok(hf_hub::Cache::new(home.join(".cache").join("huggingface").join("hub")))
            }
        }
    }

    /// A client of the hub (no progress bars), over [`Self::cache`].
    pub fn api(&self) -> Result<hf_hub::api::sync::Api> {
        let mut builder = hf_hub::api::sync::ApiBuilder::from_cache(self.cache()?).with_progress(false);
        if let Some(endpoint) = &self.endpoint {
            builder = builder.with_endpoint(endpoint.clone());
        }
        builder.build().map_err(|e| Error::Hub(format!("cannot set up the hub client: {e}")))
    }

    /// The folder under which files derived from a GGUF are written.
    pub fn derived_root(&self) -> PathBuf {
        self.derived_dir.clone().unwrap_or_else(std::env::temp_dir)
    }

    /// The folder under which the files derived from the GGUF at `model` (canonical) are
    /// written: `RLTUNE_CACHE` where set; else, for a model inside a folder of the system temp
    /// dir (a scratch copy, as tests and staging scripts make), that folder, so that the
    /// derived files go when it goes; else the system temp dir.
    pub fn derived_root_for(&self, model: &Path) -> PathBuf {
        if let Some(dir) = &self.derived_dir {
            return dir.clone();
        }
        let tmp = std::env::temp_dir();
        let tmp = std::fs::canonicalize(&tmp).unwrap_or(tmp);
        match model.parent() {
            Some(parent) if parent != tmp && parent.starts_with(&tmp) => parent.to_path_buf(),
            _ => tmp,
        }
    }
}

static INSTALLED: RwLock<Option<HubOptions>> = RwLock::new(None);

/// Makes `options` the process's hub options (replacing any installed before).
pub fn install(options: HubOptions) {
    *INSTALLED.write().unwrap_or_else(|e| e.into_inner()) = Some(options);
}

/// The installed hub options, or the defaults.
pub fn current() -> HubOptions {
    INSTALLED.read().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GGUF side files go to `RLTUNE_CACHE` where set; else beside a model in a folder of the
    /// temp dir (gone with it); else to the temp dir itself.
    #[test]
    fn derived_files_of_a_scratch_model_stay_in_its_folder() {
        let tmp = std::fs::canonicalize(std::env::temp_dir()).unwrap();
        let scratch = tempfile::tempdir().unwrap();
        let scratch = std::fs::canonicalize(scratch.path()).unwrap();
        let defaults = HubOptions::default();
        assert_eq!(defaults.derived_root_for(&scratch.join("m.gguf")), scratch);
        assert_eq!(defaults.derived_root_for(&tmp.join("m.gguf")), tmp);
        assert_eq!(defaults.derived_root_for(Path::new("/data/models/m.gguf")), tmp);
        let set = HubOptions { derived_dir: Some("/cache/r".into()), ..HubOptions::default() };
        assert_eq!(set.derived_root_for(&scratch.join("m.gguf")), PathBuf::from("/cache/r"));
    }

    #[test]
    fn options_come_from_the_variables_given() {
        let vars = |k: &str| match k {
            "HF_HUB_OFFLINE" => Some("1".to_string()),
            "HF_HOME" => Some("/data/hf".to_string()),
            "RLTUNE_CACHE" => Some("/tmp/r".to_string()),
            "HF_ENDPOINT" => Some(String::new()),
            _ => None,
        };
        let o = HubOptions::from_vars(vars);
        assert!(o.offline);
        assert_eq!(o.cache_dir, Some(PathBuf::from("/data/hf/hub")));
        assert_eq!(o.derived_dir, Some(PathBuf::from("/tmp/r")));
        assert_eq!(o.endpoint, None, "an empty variable is unset");
        assert_eq!(o.cache().unwrap().path(), &PathBuf::from("/data/hf/hub"));
        let o = HubOptions::from_vars(|k| (k == "HF_HUB_OFFLINE").then(|| "0".to_string()));
        assert!(!o.offline && o.cache_dir.is_none());
        assert_eq!(HubOptions::from_vars(|_| None), HubOptions::default());
    }
}
