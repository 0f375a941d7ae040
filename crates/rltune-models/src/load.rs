//! Finding, loading and saving models in Hugging Face layout.
//!
//! A model is a directory with `config.json`, `model.safetensors` (or shards listed in
//! `model.safetensors.index.json`), and optionally `tokenizer.json` and `generation_config.json`;
//! or a hub id, fetched through the `hf-hub` crate and its cache. Only safetensors are loaded:
//! pickle checkpoints (`pytorch_model.bin`) can run arbitrary code when unpickled.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use super::{CausalLm, CausalLmConfig, CausalLmWithValueHead, ValueHeadSpec};
use crate::error::{Error, Result};
use crate::io::{read_json, write_bytes_atomic};
pub use crate::io::{save_dir_atomic, ModelFiles};
use crate::lora::LoraConfig;
use crate::params::{ParamStore, Params};

const PICKLE_NAMES: &[&str] = &["pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin"];

fn pickle_error(dir: &Path, name: &str) -> Error {
    Error::weights(
        dir.join(name),
        "this is a pickle checkpoint; rltune loads only safetensors, because unpickling can execute \
         arbitrary code. Convert it once, with Python, from a source you trust: `from transformers \
         import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR, \
         safe_serialization=True)`, or, keeping every tensor (e.g. a TRL value head), \
         `safetensors.torch.save_file(torch.load(FILE, weights_only=True), DIR + '/model.safetensors')`",
    )
}

/// The weight files listed in a sharded checkpoint's index.
fn shards(dir: &Path, index: &Path) -> Result<Vec<PathBuf>> {
    let v: serde_json::Value = read_json(index)?;
    let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| {
        Error::config(index, "missing object field \"weight_map\" (tensor name -> shard file name)")
    })?;
    let files: BTreeSet<String> = map.values().filter_map(|f| f.as_str().map(str::to_string)).collect();
    for f in &files {
        if !dir.join(f).exists() {
            let tensor = map.iter().find(|(_, v)| v.as_str() == Some(f.as_str())).map_or("", |(k, _)| k);
            return Err(Error::weights(
                index,
                format!(
                    "weight_map lists shard {f:?} (holding e.g. {tensor:?}) but {} does not exist; copy \
                     every shard into the directory, or re-save the model",
                    dir.join(f).display()
                ),
            ));
        }
    }
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
}

/// The files of a local model directory.
pub fn local_files(dir: &Path) -> Result<ModelFiles> {
    if !dir.is_dir() {
        return Err(Error::io(dir, std::io::Error::new(std::io::ErrorKind::NotFound, "not a directory")));
    }
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    // A pickle-only directory gets the pickle explanation first: converting it also writes config.json.
    if !single.exists() && !index.exists() {
        if let Some(p) = PICKLE_NAMES.iter().find(|n| dir.join(n).exists()) {
            return Err(pickle_error(dir, p));
        }
    }
    let config = dir.join("config.json");
    if !config.exists() {
        return Err(Error::config(
            &config,
            "not found; a model directory needs config.json and model.safetensors (Hugging Face \
             layout, as written by transformers' save_pretrained)",
        ));
    }
    let weights = if single.exists() {
        vec![single]
    } else if index.exists() {
        shards(dir, &index)?
    } else {
        return Err(Error::weights(
            dir,
            "no model.safetensors or model.safetensors.index.json found; save the weights with \
             transformers' save_pretrained(DIR, safe_serialization=True)",
        ));
    };
    let opt = |name: &str| Some(dir.join(name)).filter(|p| p.exists());
    Ok(ModelFiles {
        dir: dir.to_path_buf(),
        config,
        weights,
        tokenizer: opt("tokenizer.json"),
        generation_config: opt("generation_config.json"),
    })
}

/// The files of `model`: a local directory, a `.gguf` file ([`super::gguf::model_files`]), or a
/// hub id (cache first, then the network).
pub fn locate(model: &str) -> Result<ModelFiles> {
    let path = Path::new(model);
    if path.is_file() && super::gguf::is_gguf(path) {
        return super::gguf::model_files(path);
    }
    if path.exists() {
        return local_files(path);
    }
    if model.starts_with('.') || model.starts_with('/') || model.matches('/').count() > 1 {
        return Err(Error::io(
            path,
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such model directory"),
        ));
    }
    hub_files(model)
}

/// Fetches a model from the Hugging Face hub (or its local cache).
fn hub_files(id: &str) -> Result<ModelFiles> {
    let offline_hint = |what: &str, e: &dyn std::fmt::Display| {
        Error::Hub(format!(
            "cannot get {what} of hub model {id:?}: {e}. If this machine is offline, pass a local \
             directory in Hugging Face layout (config.json + model.safetensors) instead, or populate \
             the hub cache ($HF_HOME, default ~/.cache/huggingface) on a machine that is online"
        ))
    };
    let hub = super::hub::current();
    let cached = hub.cache()?.model(id.to_string());
    let get = |name: &str| -> Result<Option<PathBuf>> {
        if let Some(p) = cached.get(name) {
            return Ok(Some(p));
        }
        if hub.offline {
            return Ok(None);
        }
        let api = hub.api().map_err(|e| offline_hint(name, &e))?;
        match api.model(id.to_string()).get(name) {
            Ok(p) => Ok(Some(p)),
            Err(e) => {
                let msg = e.to_string();
                if msg.contains("404") {
                    Ok(None)
                } else {
                    Err(offline_hint(name, &e))
                }
            }
        }
    };
    let config = get("config.json")?.ok_or_else(|| offline_hint("config.json", &"not in the cache"))?;
    let weights = if let Some(w) = get("model.safetensors")? {
        vec![w]
    } else if let Some(index) = get("model.safetensors.index.json")? {
        let v: serde_json::Value = read_json(&index)?;
        let names: BTreeSet<String> = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .map(|m| m.values().filter_map(|f| f.as_str().map(str::to_string)).collect())
            .unwrap_or_default();
        names
            .iter()
            .map(|n| get(n)?.ok_or_else(|| offline_hint(n, &"missing shard")))
            .collect::<Result<Vec<_>>>()?
    } else {
        return Err(Error::Hub(format!(
            "hub model {id:?} has no safetensors weights; rltune does not load pickle checkpoints \
             (unpickling can execute arbitrary code). Convert it with transformers' \
             save_pretrained(DIR, safe_serialization=True) and pass DIR"
        )));
    };
    let dir = config.parent().map(Path::to_path_buf).unwrap_or_default();
    Ok(ModelFiles {
        dir,
        config,
        weights,
        tokenizer: get("tokenizer.json").ok().flatten(),
        generation_config: get("generation_config.json").ok().flatten(),
    })
}

/// A causal LM with a value head, loaded with its config.
#[derive(Debug, Clone)]
pub struct LoadedPolicy {
    /// Where it came from.
    pub files: ModelFiles,
    /// The raw config.json (kept so saving preserves every field).
    pub config_json: serde_json::Value,
    /// The parsed config.
    pub config: CausalLmConfig,
    /// The parameters (trainable or frozen).
    pub store: ParamStore,
    /// The model.
    pub model: CausalLmWithValueHead,
}

/// Loads a causal LM with a value head from a directory or hub id.
///
/// The value head is the one the checkpoint holds (see [`super::ValueHead::load`]); a missing
/// one is initialized (and logged). Weights are converted to `dtype`.
pub fn load_policy(model: &str, trainable: bool, dtype: DType, device: &Device) -> Result<LoadedPolicy> {
    load_policy_with(model, None, trainable, dtype, device)
}

/// [`load_policy`] with the value head `head` asks for (`None`: the checkpoint's); a checkpoint
/// holding another kind of head is an error naming `[ppo] value_head`.
pub fn load_policy_with(
    model: &str,
    head: Option<ValueHeadSpec>,
    trainable: bool,
    dtype: DType,
    device: &Device,
) -> Result<LoadedPolicy> {
    load_policy_adapted(model, head, None, trainable, dtype, device)
}

/// How to put LoRA adapters on a model as it is loaded ([`crate::lora`]).
#[derive(Debug, Clone, Default)]
pub struct LoraSpec {
    /// New adapters from this config (a `[lora]` table).
    pub config: Option<LoraConfig>,
    /// Or the adapter saved in this directory (`--adapter`, a checkpoint): it wins over `config`.
    pub adapter: Option<PathBuf>,
    /// Where `config` was set, for errors (e.g. `run.toml: [lora]`).
    pub origin: String,
    /// Seed of the new `A` matrices.
    pub seed: u64,
}

impl LoraSpec {
    /// New adapters from `config`, set at `origin`.
    pub fn new(config: LoraConfig, origin: impl Into<String>, seed: u64) -> Self {
        Self { config: Some(config), adapter: None, origin: origin.into(), seed }
    }

    /// The adapter saved in `dir`.
    pub fn from_dir(dir: impl Into<PathBuf>) -> Self {
        Self { adapter: Some(dir.into()), ..Default::default() }
    }

    /// `store` (loaded frozen) as the base of these adapters.
    pub fn apply(&self, store: &ParamStore, config: &CausalLmConfig) -> Result<ParamStore> {
        self.apply_to(store, config.model_type())
    }

    /// [`Self::apply`] for a model of any `model_type` (a sequence classifier's too).
    pub fn apply_to(&self, store: &ParamStore, model_type: &str) -> Result<ParamStore> {
        match (&self.adapter, &self.config) {
            (Some(dir), cfg) => {
                let s = store.with_adapter(dir, model_type)?;
                if let (Some(want), Some(got)) = (cfg, s.lora_config()) {
                    if want.r != got.r
                        || want.target_modules.is_some() && want.target_modules != got.target_modules
                    {
                        tracing::warn!(
                            "{}: [lora] differs from the adapter's {} (r = {}, target_modules = {:?}); the \
                             adapter's config is used",
                            self.origin,
                            dir.join(crate::lora::ADAPTER_CONFIG).display(),
                            got.r,
                            got.target_modules
                        );
                    }
                }
                Ok(s)
            }
            (None, Some(cfg)) => store.with_lora(cfg, model_type, &self.origin, self.seed),
            (None, None) => Ok(store.clone()),
        }
    }
}

/// [`load_policy_with`], with LoRA adapters when `lora` is given: the base is then loaded frozen
/// and only the adapters, `modules_to_save` and the value head train. [`load_lm_adapted`] with a
/// value head on top.
pub fn load_policy_adapted(
    model: &str,
    head: Option<ValueHeadSpec>,
    lora: Option<&LoraSpec>,
    trainable: bool,
    dtype: DType,
    device: &Device,
) -> Result<LoadedPolicy> {
    let LoadedLm { files, config_json, config, store, lm } =
        load_lm_adapted(model, lora, trainable, dtype, device)?;
    let model = match head {
        Some(spec) => CausalLmWithValueHead::load_with(&store.root(), lm, spec)?,
        None => CausalLmWithValueHead::load(&store.root(), lm)?,
    };
    Ok(LoadedPolicy { files, config_json, config, store, model })
}

/// Reads `config.json`; a syntax error names the file, line and column, and says how to fix it.
pub fn read_config_json(path: &Path) -> Result<serde_json::Value> {
    read_json(path).map_err(|e| match e {
        Error::Config { path, msg } => Error::config(
            path,
            format!(
                "not valid JSON ({msg}); fix the syntax there, or re-save the model with transformers' \
                 save_pretrained"
            ),
        ),
        other => other,
    })
}

/// Builds the policy (LM + value head) over an existing store.
pub fn policy_from_store(store: &ParamStore, config: &CausalLmConfig) -> Result<CausalLmWithValueHead> {
    let lm = CausalLm::load(&store.root(), config)?;
    CausalLmWithValueHead::load(&store.root(), lm)
}

/// Saves a model directory that transformers (and TRL's value-head wrapper) can load:
/// `config.json` and `model.safetensors` holding every tensor in `store` under its name.
///
/// The directory is written beside the target and renamed into place, so an interrupted save
/// never leaves a half-written model; an existing directory is replaced.
pub fn save_pretrained(dir: &Path, store: &ParamStore, config_json: &serde_json::Value) -> Result<()> {
    save_dir_atomic(dir, |tmp| {
        store.save_safetensors(&tmp.join("model.safetensors"))?;
        let text =
            serde_json::to_string_pretty(config_json).map_err(|e| Error::config(tmp, e.to_string()))?;
        write_bytes_atomic(&tmp.join("config.json"), text.as_bytes())
    })
}

/// Copies `tokenizer.json` and `generation_config.json` (when present) from `files` into `dir`.
pub fn copy_side_files(files: &ModelFiles, dir: &Path) -> Result<()> {
    // tokenizer_config.json holds the chat template that conversational data is rendered with.
    let tc = files.dir.join("tokenizer_config.json");
    let tokenizer_config = tc.is_file().then_some(tc);
    for src in [&files.tokenizer, &files.generation_config, &tokenizer_config].into_iter().flatten() {
        if let Some(name) = src.file_name() {
            let dst = dir.join(name);
            std::fs::copy(src, &dst).map_err(|e| Error::io(&dst, e))?;
        }
    }
    Ok(())
}

/// Loads a frozen causal LM (no value head) from a directory or hub id: a reference model.
pub fn load_reference(model: &str, dtype: DType, device: &Device) -> Result<(ModelFiles, CausalLm)> {
    let LoadedLm { files, lm, .. } = load_lm(model, false, dtype, device)?;
    Ok((files, lm))
}

/// A causal LM without a value head, with what it was loaded from ([`load_lm`]).
pub struct LoadedLm {
    /// Where it came from.
    pub files: ModelFiles,
    /// Its config.json as read.
    pub config_json: serde_json::Value,
    /// The parsed config.
    pub config: CausalLmConfig,
    /// Its parameters (trainable or frozen as asked).
    pub store: ParamStore,
    /// The model.
    pub lm: CausalLm,
}

/// Loads the causal LM `model` (a directory or hub id) on `device` in `dtype`.
pub fn load_lm(model: &str, trainable: bool, dtype: DType, device: &Device) -> Result<LoadedLm> {
    load_lm_adapted(model, None, trainable, dtype, device)
}

/// [`load_lm`] with LoRA adapters when `lora` is given (the base loaded frozen).
pub fn load_lm_adapted(
    model: &str,
    lora: Option<&LoraSpec>,
    trainable: bool,
    dtype: DType,
    device: &Device,
) -> Result<LoadedLm> {
    let files = locate(model)?;
    let config_json = read_config_json(&files.config)?;
    let config = CausalLmConfig::from_json(&config_json, &files.config)?;
    let store = ParamStore::load_safetensors(&files.weights, trainable && lora.is_none(), dtype, device)?;
    let store = match lora {
        Some(l) => {
            let s = l.apply(&store, &config)?;
            s.set_lora_base(model);
            s
        }
        None => store,
    };
    let lm = CausalLm::load(&store.root(), &config)?;
    Ok(LoadedLm { files, config_json, config, store, lm })
}

/// A pretrained checkpoint's tensors completed for a model with a new head: the tensors that
/// `build` (the model's loader, run on a store initialized from `seed`) reads, taken from
/// `checkpoint` where it holds them with the right shape and initialized from `seed` otherwise;
/// also the names initialized. A plain encoder checkpoint (`embeddings.*`) gets `prefix` (e.g.
/// `"bert."`), as transformers' `from_pretrained` maps a `BertModel` into a task model.
/// Checkpoint tensors the model does not read (a masked-LM head, a pooler) are dropped.
pub fn complete_checkpoint(
    mut checkpoint: HashMap<String, Tensor>,
    prefix: &str,
    seed: u64,
    dtype: DType,
    device: &Device,
    build: impl FnOnce(&Params) -> Result<()>,
) -> Result<(HashMap<String, Tensor>, Vec<String>)> {
    let fresh = ParamStore::random(seed, false, dtype, device)?;
    build(&fresh.root())?;
    if checkpoint.contains_key("embeddings.word_embeddings.weight") {
        checkpoint = checkpoint.into_iter().map(|(k, v)| (format!("{prefix}{k}"), v)).collect();
    }
    let (mut out, mut initialized) = (HashMap::new(), Vec::new());
    for (name, init) in fresh.snapshot()? {
        match checkpoint.remove(&name) {
            Some(t) if t.dims() == init.dims() => {
                out.insert(name, t);
            }
            other => {
                if let Some(t) = other {
                    tracing::info!("{name}: checkpoint shape {:?}, model needs {:?}", t.dims(), init.dims());
                }
                initialized.push(name.clone());
                out.insert(name, init);
            }
        }
    }
    if !checkpoint.is_empty() {
        let mut unused: Vec<&String> = checkpoint.keys().collect();
        unused.sort();
        tracing::info!("{} checkpoint tensors unused by the model (e.g. {})", unused.len(), unused[0]);
    }
    initialized.sort();
    Ok((out, initialized))
}
