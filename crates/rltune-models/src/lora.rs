//! LoRA adapters with PEFT's format, names and semantics (peft `tuners/lora/layer.py`, `Linear`).
//!
//! For a linear map `W (out, in)` (or GPT-2's Conv1D, `W (in, out)`, PEFT's `fan_in_fan_out`):
//!
//! ```text
//! y = x·Wᵀ + b + (x·Aᵀ·Bᵀ)·scaling      A (r, in), B (out, r)
//! scaling = lora_alpha / r   (lora_alpha / √r with use_rslora)
//! ```
//!
//! `A` starts as PEFT's `kaiming_uniform_(a=√5)` (uniform in ±1/√in), `B` at zero, so a new
//! adapter leaves the model's outputs unchanged. A [`crate::params::ParamStore`] made with
//! [`crate::params::ParamStore::with_lora`] or [`crate::params::ParamStore::with_adapter`] hands
//! an adapter to every `Linear`/`Conv1D` whose module path `target_modules` matches; its base
//! tensors are frozen (plain tensors, no gradient), and its variables are the adapters, the
//! `modules_to_save` copies and TRL's value head (`v_head.*`) only. Its
//! [`crate::params::ParamStore::frozen_copy`] is the same base with the adapters turned off,
//! sharing the tensors: the reference model costs no second copy of the weights.
//!
//! Files, as PEFT's `save_pretrained` writes them: `adapter_config.json` and
//! `adapter_model.safetensors` with keys `base_model.model.<module>.lora_A.weight` and
//! `.lora_B.weight`, and `base_model.model.<module>.weight` for `modules_to_save`. TRL saves a
//! PEFT policy's value head in a pickle beside them; rltune writes it to
//! `value_head.safetensors` (`v_head.summary.weight`, `v_head.summary.bias`).
//!
//! Deviations from PEFT: `lora_dropout` is accepted and saved but not applied (rltune applies no
//! dropout anywhere; docs/trl-deviations.md); `bias` must be `"none"`; the LM head, embeddings
//! and value/score heads take no adapters (PEFT's `all-linear` also leaves the output layer out);
//! `layers_to_transform`, `rank_pattern`, `alpha_pattern` and DoRA are refused.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use candle_core::Tensor;

use crate::error::{ConfigError, Error, Result};

/// The adapter's config file, as PEFT names it.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The adapter's weights, as PEFT names them.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The value head of an adapter checkpoint (TRL keeps it in a pickle beside the adapter).
pub const VALUE_HEAD_WEIGHTS: &str = "value_head.safetensors";
/// The prefix of every key in `adapter_model.safetensors` (PEFT's `PeftModel.base_model.model`).
pub const KEY_PREFIX: &str = "base_model.model.";

/// `target_modules`: a list of names matched as suffixes of module paths, or one string that is a
/// regular expression over the whole path (or `"all-linear"`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
pub enum TargetModules {
    /// Names: `"q_proj"` matches `model.layers.0.self_attn.q_proj` (PEFT: equal, or ends with
    /// `"." + name`).
    Names(Vec<String>),
    /// A regular expression matched against the whole module path (Python's `re.fullmatch`),
    /// or `"all-linear"`: every linear layer but the output head.
    Pattern(String),
}

impl std::fmt::Display for TargetModules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Names(v) => write!(f, "{v:?}"),
            Self::Pattern(s) => write!(f, "{s:?}"),
        }
    }
}

/// `[lora]`: PEFT's `LoraConfig`, with its names, meanings and defaults.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraConfig {
    /// The rank r of `A (r, in)` and `B (out, r)`.
    pub r: usize,
    /// `scaling = lora_alpha / r` (or `/ √r` with `use_rslora`).
    pub lora_alpha: f64,
    /// Dropout on the adapter's input; saved, not applied (rltune applies no dropout).
    pub lora_dropout: f64,
    /// Which linear layers get adapters; default: PEFT's per-architecture default
    /// (`c_attn` for GPT-2, `q_proj`/`v_proj` for Llama, Qwen2, Mistral and GPT-Neo,
    /// `query_key_value` for GPT-NeoX).
    pub target_modules: Option<TargetModules>,
    /// Rank-stabilized LoRA: `scaling = lora_alpha / √r`.
    pub use_rslora: bool,
    /// Which biases train: only `"none"` (PEFT's default) is supported.
    pub bias: String,
    /// Modules trained in full beside the adapters (a trainable copy; the reference keeps the
    /// original), e.g. `["score"]`.
    pub modules_to_save: Option<Vec<String>>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            r: 8,
            lora_alpha: 8.0,
            lora_dropout: 0.0,
            target_modules: None,
            use_rslora: false,
            bias: "none".into(),
            modules_to_save: None,
        }
    }
}

/// The heads PEFT's `PeftModelForSequenceClassification` adds to `modules_to_save`
/// (`classifier_module_names`): a sequence classifier's head trains in full beside the adapters.
pub const SEQ_CLS_MODULES: [&str; 2] = ["classifier", "score"];

/// PEFT's default `target_modules` for a `model_type`
/// (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`).
pub fn default_target_modules(model_type: &str) -> Option<Vec<String>> {
    let names: &[&str] = match model_type {
        "gpt2" => &["c_attn"],
        "llama" | "qwen2" | "mistral" | "gpt_neo" => &["q_proj", "v_proj"],
        "gpt_neox" => &["query_key_value"],
        "bert" => &["query", "value"],
        "distilbert" => &["q_lin", "v_lin"],
        _ => return None,
    };
    Some(names.iter().map(|s| s.to_string()).collect())
}

impl LoraConfig {
    /// Checks the values; the error names the field in `section`, the table that set it
    /// (`lora`, `critic.lora`; empty for an `adapter_config.json`, whose path the caller adds).
    pub fn validate(&self, section: &str) -> std::result::Result<(), ConfigError> {
        let bad = |field: &str, message: String| ConfigError::new(section, field, message);
        if self.r == 0 {
            return Err(bad("r", "= 0; the rank must be at least 1 (PEFT's default is 8)".into()));
        }
        if !self.lora_alpha.is_finite() || self.lora_alpha <= 0.0 {
            return Err(bad("lora_alpha", format!("= {} must be positive", self.lora_alpha)));
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return Err(bad("lora_dropout", format!("= {} must be in [0, 1)", self.lora_dropout)));
        }
        if self.bias != "none" {
            return Err(bad(
                "bias",
                format!(
                    "= {:?} is not supported; only \"none\" (PEFT's default: no bias trains) is. \
                     Set bias = \"none\", or train the full model without [lora]",
                    self.bias
                ),
            ));
        }
        if let Some(TargetModules::Pattern(p)) = &self.target_modules {
            if p != "all-linear" {
                regex_of(p).map_err(|e| bad("target_modules", format!("= {p:?}: {e}")))?;
            }
        }
        Ok(())
    }

    /// This config as PEFT's `get_peft_model` makes it for `task_type = "SEQ_CLS"`: the
    /// [`SEQ_CLS_MODULES`] join `modules_to_save`, so the classifier head trains in full.
    pub fn for_sequence_classification(&self) -> Self {
        let mut cfg = self.clone();
        let modules = cfg.modules_to_save.get_or_insert_with(Vec::new);
        for m in SEQ_CLS_MODULES {
            if !modules.iter().any(|x| x == m) {
                modules.push(m.to_string());
            }
        }
        cfg
    }

    /// `lora_alpha / r`, or `lora_alpha / √r` with `use_rslora` (PEFT's `update_layer`).
    pub fn scaling(&self) -> f64 {
        if self.use_rslora {
            self.lora_alpha / (self.r as f64).sqrt()
        } else {
            self.lora_alpha / self.r as f64
        }
    }

    /// `target_modules`, or PEFT's default for `model_type`; the error names the key alone (the
    /// caller says which table or file set it).
    pub fn targets(&self, model_type: &str) -> std::result::Result<TargetModules, ConfigError> {
        match &self.target_modules {
            Some(t) => Ok(t.clone()),
            None => default_target_modules(model_type).map(TargetModules::Names).ok_or_else(|| {
                ConfigError::new(
                    "",
                    "target_modules",
                    format!("is not set and PEFT has no default for model_type {model_type:?}; set target_modules"),
                )
            }),
        }
    }

    /// Reads an `adapter_config.json` as PEFT writes it. Fields rltune does not implement are
    /// refused when they change the adapter (`use_dora`, `layers_to_transform`, `rank_pattern`,
    /// `alpha_pattern`, a `peft_type` other than `LORA`); the others are ignored.
    pub fn from_adapter_json(value: &serde_json::Value, path: &Path) -> Result<(Self, AdapterMeta)> {
        let bad = |m: String| Error::config(path, m);
        let obj = value.as_object().ok_or_else(|| bad("not a JSON object".into()))?;
        let peft_type = obj.get("peft_type").and_then(|v| v.as_str()).unwrap_or("LORA");
        if peft_type != "LORA" {
            return Err(bad(format!(
                "peft_type = {peft_type:?}: rltune loads LoRA adapters only (peft_type \"LORA\")"
            )));
        }
        let set = |k: &str| match obj.get(k) {
            None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => false,
            Some(serde_json::Value::Object(m)) => !m.is_empty(),
            Some(serde_json::Value::Array(a)) => !a.is_empty(),
            Some(_) => true,
        };
        const UNSUPPORTED: [&str; 12] = [
            "use_dora",
            "layers_to_transform",
            "rank_pattern",
            "alpha_pattern",
            "layer_replication",
            "lora_bias",
            "exclude_modules",
            "target_parameters",
            "trainable_token_indices",
            "use_qalora",
            "use_bdlora",
            "alora_invocation_tokens",
        ];
        for k in UNSUPPORTED {
            if set(k) {
                return Err(bad(format!(
                    "{k} is set; rltune's LoRA does not implement it. Train the adapter without {k}"
                )));
            }
        }
        let mut cfg = Self::default();
        let num = |k: &str| obj.get(k).and_then(|v| v.as_f64());
        if let Some(r) = obj.get("r").and_then(|v| v.as_u64()) {
            cfg.r = r as usize;
        }
        if let Some(a) = num("lora_alpha") {
            cfg.lora_alpha = a;
        }
        if let Some(d) = num("lora_dropout") {
            cfg.lora_dropout = d;
        }
        cfg.use_rslora = obj.get("use_rslora").and_then(|v| v.as_bool()).unwrap_or(false);
        if let Some(b) = obj.get("bias").and_then(|v| v.as_str()) {
            cfg.bias = b.to_string();
        }
        let field = |k: &str| -> Result<Option<serde_json::Value>> {
            Ok(obj.get(k).filter(|v| !v.is_null()).cloned())
        };
        if let Some(t) = field("target_modules")? {
            cfg.target_modules =
                Some(serde_json::from_value(t).map_err(|e| bad(format!("target_modules: {e}")))?);
        }
        if let Some(m) = field("modules_to_save")? {
            cfg.modules_to_save =
                Some(serde_json::from_value(m).map_err(|e| bad(format!("modules_to_save: {e}")))?);
        }
        cfg.validate("").map_err(|m| Error::config(path, m))?;
        let meta = AdapterMeta {
            base_model: obj.get("base_model_name_or_path").and_then(|v| v.as_str()).map(str::to_string),
            task_type: obj.get("task_type").and_then(|v| v.as_str()).map(str::to_string),
        };
        Ok((cfg, meta))
    }

    /// The `adapter_config.json` PEFT's `LoraConfig.save_pretrained` would write for this config.
    pub fn to_adapter_json(
        &self,
        targets: &TargetModules,
        meta: &AdapterMeta,
        fan_in_fan_out: bool,
    ) -> serde_json::Value {
        let alpha = if self.lora_alpha.fract() == 0.0 {
            serde_json::json!(self.lora_alpha as i64)
        } else {
            serde_json::json!(self.lora_alpha)
        };
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": meta.task_type.clone().unwrap_or_else(|| "CAUSAL_LM".into()),
            "base_model_name_or_path": meta.base_model,
            "r": self.r,
            "lora_alpha": alpha,
            "lora_dropout": self.lora_dropout,
            "target_modules": targets,
            "use_rslora": self.use_rslora,
            "bias": self.bias,
            "modules_to_save": self.modules_to_save,
            "fan_in_fan_out": fan_in_fan_out,
            "inference_mode": true,
            "init_lora_weights": true,
        })
    }
}

/// What an adapter file says beyond the [`LoraConfig`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AdapterMeta {
    /// `base_model_name_or_path`: the model the adapter was trained on.
    pub base_model: Option<String>,
    /// `task_type` (`CAUSAL_LM`, `SEQ_CLS`, …).
    pub task_type: Option<String>,
}

/// Python's `re.fullmatch(pattern, path)` as a Rust regex (Python-only syntax, such as
/// look-arounds, is refused by the `regex` crate with its own message).
fn regex_of(pattern: &str) -> std::result::Result<regex::Regex, String> {
    regex::Regex::new(&format!("^(?:{pattern})$")).map_err(|e| format!("not a valid regular expression: {e}"))
}

/// Decides which module paths take an adapter (PEFT's `check_target_module_exists`).
#[derive(Debug, Clone)]
pub(crate) enum Matcher {
    Names(Vec<String>),
    Regex(regex::Regex),
    AllLinear,
}

impl Matcher {
    pub(crate) fn new(t: &TargetModules) -> std::result::Result<Self, String> {
        Ok(match t {
            TargetModules::Names(v) => Self::Names(v.clone()),
            TargetModules::Pattern(p) if p == "all-linear" => Self::AllLinear,
            TargetModules::Pattern(p) => Self::Regex(regex_of(p)?),
        })
    }

    /// Whether the linear layer at `module` (e.g. `model.layers.0.self_attn.q_proj`) is a target.
    pub(crate) fn matches(&self, module: &str) -> bool {
        match self {
            Self::Names(v) => v.iter().any(|n| module == n || module.ends_with(&format!(".{n}"))),
            Self::Regex(r) => r.is_match(module),
            Self::AllLinear => true,
        }
    }
}

/// Whether the parameter `name` belongs to one of `modules` (PEFT's `modules_to_save` matching,
/// `_set_trainable`: a module whose path ends with a name, as a plain string, is copied whole; so
/// `"classifier"` also takes DistilBERT's `pre_classifier`, as in PEFT).
pub(crate) fn in_modules(name: &str, modules: &[String]) -> bool {
    let module = name.rsplit_once('.').map_or("", |(m, _)| m);
    // The module and each of its ancestors: a prefix of the path that ends at a dot.
    let mut paths = module.match_indices('.').map(|(i, _)| &module[..i]).chain(std::iter::once(module));
    paths.any(|path| modules.iter().any(|n| path.ends_with(n.as_str())))
}

/// How the base weight of an adapted layer is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightLayout {
    /// `nn.Linear`: `W (out, in)`.
    OutIn,
    /// GPT-2's `Conv1D`: `W (in, out)` (PEFT's `fan_in_fan_out = True`).
    InOut,
}

/// One layer's adapter: `Δy = (x·Aᵀ·Bᵀ)·scaling`.
#[derive(Debug, Clone)]
pub struct LoraLinear {
    /// `A (r, in)`
    pub a: Tensor,
    /// `B (out, r)`
    pub b: Tensor,
    /// `lora_alpha / r` (or `/ √r`).
    pub scaling: f64,
}

impl LoraLinear {
    /// `ΔW = B·A·scaling` in the base weight's layout (PEFT's `get_delta_weight`).
    pub fn delta_weight(&self, layout: WeightLayout) -> Result<Tensor> {
        let d = (self.b.matmul(&self.a)? * self.scaling)?; // (out, in)
        Ok(match layout {
            WeightLayout::OutIn => d,
            WeightLayout::InOut => d.t()?.contiguous()?,
        })
    }
}

/// The LoRA part of a parameter store: config, adapters, and what the model asked for.
#[derive(Debug)]
pub(crate) struct LoraState {
    pub cfg: LoraConfig,
    pub targets: TargetModules,
    pub matcher: Matcher,
    pub meta: AdapterMeta,
    /// Where the config came from, for errors (`[lora]` or an adapter_config.json).
    pub origin: String,
    /// The adapter file read, if any.
    pub file: Option<PathBuf>,
    /// Its tensors by key, as read (claimed by the layers that ask for them).
    pub from_file: BTreeMap<String, Tensor>,
    /// The adapters' variables by key (`base_model.model.<module>.lora_A.weight`).
    pub adapters: BTreeMap<String, candle_core::Var>,
    /// Trainable copies (modules_to_save, the value head) by parameter name.
    pub saved: BTreeMap<String, candle_core::Var>,
    /// Adapted modules and their weight layout.
    pub layouts: BTreeMap<String, WeightLayout>,
    /// Every linear module asked about, adapted or not (for errors).
    pub seen: BTreeSet<String>,
    /// Whether the base is GPT-2 (Conv1D layers: `fan_in_fan_out`).
    pub fan_in_fan_out: bool,
    /// Initializes new `A` matrices.
    pub rng: rand::rngs::StdRng,
    /// The adapter file's `base_model_name_or_path`, for errors.
    pub file_base: Option<String>,
}

impl LoraState {
    /// Whether the parameter `name` trains in full beside the adapters: TRL's value head
    /// (`v_head.*`) and `modules_to_save`.
    pub(crate) fn is_saved(&self, name: &str) -> bool {
        name.starts_with("v_head.")
            || self.cfg.modules_to_save.as_deref().is_some_and(|m| in_modules(name, m))
    }

    pub(crate) fn key(module: &str, which: &str) -> String {
        format!("{KEY_PREFIX}{module}.{which}.weight")
    }

    /// The error when `target_modules` matched none of the model's linear layers.
    pub(crate) fn no_match_error(&self) -> String {
        let mut leaves: Vec<&str> = self.seen.iter().map(|m| m.rsplit('.').next().unwrap_or(m)).collect();
        leaves.sort();
        leaves.dedup();
        let example = self.seen.iter().next().map(String::as_str).unwrap_or("(none)");
        format!(
            "{}: target_modules = {} matches none of the model's linear layers. Their names are: {} \
             (full paths such as {example:?}). PEFT matches a list of names against the end of each \
             module path, and a single string as a regular expression over the whole path",
            self.origin,
            self.targets,
            leaves.join(", ")
        )
    }
}
