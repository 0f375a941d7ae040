//! The run config: one TOML file with tables `[model]`, `[ref_model]`, `[reward]`, `[data]`,
//! `[generation]`, `[ppo]`, `[logging]`, `[checkpoint]` and `[runtime]`, plus `--set table.key=value`
//! overrides. Unknown keys are rejected with the closest valid key.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::generation::GenerationConfig;
use crate::ppo::PpoConfig;
use crate::rewards::{ClassifierOutput, ScoredText};

/// `[model]` / `[ref_model]`: where a model comes from.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Local directory (Hugging Face layout) or hub id.
    pub path: String,
}

/// One reward source in `[[reward.sources]]`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum RewardSourceConfig {
    /// A sequence-classification model's label logit or probability.
    Classifier {
        /// Model directory or hub id (bert / distilbert) with its tokenizer.json.
        model: String,
        /// Label name (e.g. "POSITIVE") or index.
        #[serde(default = "default_label")]
        label: String,
        /// "logit" (TRL's sentiment example) or "probability".
        #[serde(default)]
        output: ClassifierOutput,
        /// "query_and_response" (TRL's sentiment example) or "response_only".
        #[serde(default)]
        text: ScoredText,
        /// Samples per classifier forward pass.
        #[serde(default = "default_batch")]
        batch_size: usize,
        /// Weight in the sum of sources.
        #[serde(default = "one")]
        weight: f32,
    },
    /// An external command speaking JSON lines on stdin/stdout.
    Command {
        /// Program and arguments.
        command: Vec<String>,
        /// Seconds to wait for a batch's answers.
        #[serde(default = "default_timeout")]
        timeout_s: f64,
        /// Weight in the sum of sources.
        #[serde(default = "one")]
        weight: f32,
    },
}

fn default_label() -> String {
    "POSITIVE".into()
}
fn default_batch() -> usize {
    16
}
fn one() -> f32 {
    1.0
}
fn default_timeout() -> f64 {
    60.0
}

/// `[reward]`
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardSection {
    /// The sources, summed with their weights.
    pub sources: Vec<RewardSourceConfig>,
}

/// `[data]`: the prompt dataset.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// JSONL, CSV or Parquet file, or hub dataset id.
    pub source: String,
    /// Column holding the prompt text.
    pub text_column: String,
    /// Shortest prompt in tokens (TRL's LengthSampler `min_value`).
    pub min_query_tokens: usize,
    /// Longest prompt in tokens, exclusive (TRL's LengthSampler `max_value`).
    pub max_query_tokens: usize,
}

impl Default for DataSection {
    fn default() -> Self {
        Self { source: String::new(), text_column: "text".into(), min_query_tokens: 2, max_query_tokens: 8 }
    }
}

/// `[logging]`
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoggingSection {
    /// The run directory (metrics.jsonl, report.html, tb/, checkpoints/).
    pub dir: PathBuf,
    /// Samples per step shown in the report's table.
    pub samples_per_step: usize,
    /// Rewrite report.html every this many steps (and at the end).
    pub report_every: usize,
}

impl Default for LoggingSection {
    fn default() -> Self {
        Self { dir: PathBuf::from("runs/ppo"), samples_per_step: 4, report_every: 10 }
    }
}

/// `[checkpoint]`
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointSection {
    /// Save every this many steps (0: only at the end).
    pub every: usize,
    /// Also save the optimizer state (needed for `--resume`).
    pub optimizer_state: bool,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        Self { every: 50, optimizer_state: false }
    }
}

pub use crate::runtime::RuntimeSection;

/// The whole run config.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// The policy to train.
    pub model: ModelSection,
    /// The reference model; default: a frozen copy of the policy.
    #[serde(default)]
    pub ref_model: Option<ModelSection>,
    /// Reward sources.
    #[serde(default)]
    pub reward: RewardSection,
    /// Prompts.
    pub data: DataSection,
    /// Sampling.
    #[serde(default)]
    pub generation: GenerationConfig,
    /// PPO hyper-parameters and the number of steps.
    #[serde(default)]
    pub ppo: PpoConfig,
    /// Where metrics, report and checkpoints go.
    #[serde(default)]
    pub logging: LoggingSection,
    /// Checkpointing.
    #[serde(default)]
    pub checkpoint: CheckpointSection,
    /// Device and precision (see [`crate::runtime`]).
    #[serde(default)]
    pub runtime: RuntimeSection,
}

impl RunConfig {
    /// Reads a TOML file, applies `overrides` (`table.key=value`, value parsed as TOML, else
    /// as a string), then validates.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_toml(&text, path, overrides)
    }

    /// Parses TOML text (see [`Self::load`]); `path` names the source in errors.
    ///
    /// `[ppo] temperature`, when absent, is `[generation] temperature`: the training logprobs
    /// must come from the distribution the responses were sampled from.
    pub fn from_toml(text: &str, path: &Path, overrides: &[String]) -> Result<Self> {
        let mut cfg: Self = parse_toml(text, path, overrides)?;
        if !sets_ppo_temperature(text, overrides) {
            cfg.ppo.temperature = cfg.generation.temperature;
        }
        cfg.validate().map_err(|m| Error::config(path, m))?;
        Ok(cfg)
    }

    /// Checks the sections; messages name the field.
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.ppo.validate()?;
        self.generation.validate().map_err(|e| e.to_string())?;
        if self.ppo.temperature != self.generation.temperature {
            return Err(format!(
                "[ppo] temperature = {} but [generation] temperature = {}: the PPO ratio would compare \
                 logprobs of two different distributions (with the rollout cache on, it is not 1 on \
                 the first minibatch); leave [ppo] temperature out (it follows [generation]) or set \
                 both to the same value",
                self.ppo.temperature, self.generation.temperature
            ));
        }
        if self.model.path.is_empty() {
            return Err("[model] path is empty; set it to a model directory or hub id".into());
        }
        if self.data.source.is_empty() {
            return Err("[data] source is empty; set it to a JSONL/CSV/Parquet file or hub dataset".into());
        }
        if self.data.min_query_tokens == 0 || self.data.max_query_tokens <= self.data.min_query_tokens {
            return Err(format!(
                "[data] needs 0 < min_query_tokens < max_query_tokens (got {} and {}; max is exclusive)",
                self.data.min_query_tokens, self.data.max_query_tokens
            ));
        }
        if self.reward.sources.is_empty() {
            return Err("[reward] has no sources; add a [[reward.sources]] table (kind = \"classifier\" or \"command\")"
                .into());
        }
        Ok(())
    }

    /// The resolved config as TOML (saved in the run directory).
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string_pretty(self).map_err(|e| Error::Input(format!("cannot serialize the config: {e}")))
    }
}

/// Whether `[ppo] temperature` is given in `text` or by an override.
fn sets_ppo_temperature(text: &str, overrides: &[String]) -> bool {
    let in_text = toml::from_str::<toml::Table>(text)
        .ok()
        .and_then(|t| t.get("ppo").and_then(|p| p.as_table()).map(|p| p.contains_key("temperature")))
        .unwrap_or(false);
    in_text || overrides.iter().any(|o| o.split('=').next().is_some_and(|k| k.trim() == "ppo.temperature"))
}

/// Deserializes TOML `text` after applying `overrides` (`table.key=value`; the value is parsed as
/// TOML, else taken as a string). Errors name `path`, and an unknown key gets the closest valid
/// one; without overrides they also carry the line and column.
pub fn parse_toml<T: serde::de::DeserializeOwned>(
    text: &str,
    path: &Path,
    overrides: &[String],
) -> Result<T> {
    let unknown = |e: toml::de::Error| Error::config(path, suggest_unknown_key(&e.to_string()));
    if overrides.is_empty() {
        return toml::from_str(text).map_err(unknown);
    }
    let mut doc: toml::Table = toml::from_str(text).map_err(|e| Error::config(path, e.to_string()))?;
    for o in overrides {
        apply_override(&mut doc, o).map_err(|m| Error::config(path, format!("--set {o}: {m}")))?;
    }
    toml::Value::Table(doc).try_into().map_err(unknown)
}

/// Sets `table.key` (any depth) to `value` in `doc`.
fn apply_override(doc: &mut toml::Table, o: &str) -> std::result::Result<(), String> {
    let (key, value) = o.split_once('=').ok_or("expected table.key=value")?;
    let parts: Vec<&str> = key.trim().split('.').collect();
    let (last, tables) = parts.split_last().ok_or("empty key")?;
    let mut cur = doc;
    for t in tables {
        let entry = cur.entry(t.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry.as_table_mut().ok_or_else(|| format!("{t} is not a table"))?;
    }
    let raw = value.trim();
    let parsed = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    cur.insert(last.to_string(), parsed);
    Ok(())
}

/// Rewrites serde's "unknown field `x`, expected one of `a`, `b`" into "did you mean".
pub fn suggest_unknown_key(msg: &str) -> String {
    let Some(rest) = msg.split("unknown field `").nth(1) else { return msg.to_string() };
    let Some(name) = rest.split('`').next() else { return msg.to_string() };
    let expected: Vec<&str> = rest.split('`').skip(2).step_by(2).filter(|s| !s.is_empty()).collect();
    let location = msg.split("unknown field").next().unwrap_or("").trim();
    let head = if location.is_empty() { String::new() } else { format!("{location} ") };
    match crate::ppo::config::closest(name, &expected) {
        Some(best) => format!("{head}unknown key {name:?}; did you mean {best:?}?"),
        None => format!("{head}unknown key {name:?}; valid keys: {}", expected.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[model]
path = "m"
[data]
source = "prompts.jsonl"
[[reward.sources]]
kind = "command"
command = ["cat"]
"#;

    #[test]
    fn minimal_config_loads_with_defaults_and_overrides() {
        let p = Path::new("run.toml");
        let c =
            RunConfig::from_toml(MINIMAL, p, &["ppo.batch_size=8".into(), "ppo.mini_batch_size=4".into()])
                .unwrap();
        assert_eq!((c.ppo.batch_size, c.ppo.mini_batch_size), (8, 4));
        assert_eq!(c.data.text_column, "text");
        let again = RunConfig::from_toml(&c.to_toml().unwrap(), p, &[]).unwrap();
        assert_eq!(again, c);
    }

    #[test]
    fn typo_gets_the_closest_key() {
        let p = Path::new("run.toml");
        let text = MINIMAL.replace("source = ", "sourse = ");
        let err = RunConfig::from_toml(&text, p, &[]).unwrap_err().to_string();
        assert!(err.contains("\"sourse\"") && err.contains("did you mean \"source\""), "{err}");
        assert!(err.contains("line 5"), "{err}");
        let err =
            RunConfig::from_toml(MINIMAL, p, &["generation.max_new_tokns=3".into()]).unwrap_err().to_string();
        assert!(err.contains("did you mean \"max_new_tokens\""), "{err}");
    }

    /// Regression (issue #28, defect 4): the two temperatures could differ silently, so the
    /// rollout-cached logprobs and the training logprobs came from different distributions.
    #[test]
    fn ppo_temperature_follows_generation_and_a_mismatch_names_both_keys() {
        let p = Path::new("run.toml");
        let c = RunConfig::from_toml(MINIMAL, p, &["generation.temperature=0.7".into()]).unwrap();
        assert_eq!((c.generation.temperature, c.ppo.temperature), (0.7, 0.7));
        let text = format!("{MINIMAL}[generation]\ntemperature = 0.5\n");
        assert_eq!(RunConfig::from_toml(&text, p, &[]).unwrap().ppo.temperature, 0.5);
        let same = ["generation.temperature=0.7".into(), "ppo.temperature=0.7".into()];
        assert_eq!(RunConfig::from_toml(MINIMAL, p, &same).unwrap().ppo.temperature, 0.7);
        for set in [
            vec!["ppo.temperature=0.7".to_string()],
            vec!["generation.temperature=0.7".into(), "ppo.temperature=1.0".into()],
        ] {
            let err = RunConfig::from_toml(MINIMAL, p, &set).unwrap_err().to_string();
            assert!(err.contains("[ppo] temperature") && err.contains("[generation] temperature"), "{err}");
        }
        let text = format!("{MINIMAL}[ppo]\ntemperature = 2.0\n");
        let err = RunConfig::from_toml(&text, p, &[]).unwrap_err().to_string();
        assert!(err.contains("[ppo] temperature = 2"), "{err}");
    }

    #[test]
    fn matmul_precision_is_f32_unless_set_and_names_bad_values() {
        let p = Path::new("run.toml");
        let c = RunConfig::from_toml(MINIMAL, p, &[]).unwrap();
        assert_eq!(c.runtime.matmul_precision, crate::ops::MatmulPrecision::F32);
        let c = RunConfig::from_toml(MINIMAL, p, &["runtime.matmul_precision=bf16".into()]).unwrap();
        assert_eq!(c.runtime.matmul_precision, crate::ops::MatmulPrecision::Bf16);
        let err = RunConfig::from_toml(MINIMAL, p, &["runtime.matmul_precision=fp8".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("fp8") && err.contains("bf16") && err.contains("f32"), "{err}");
        let err = "fp8".parse::<crate::ops::MatmulPrecision>().unwrap_err();
        assert!(err.contains("\"fp8\"") && err.contains("\"bf16\""), "{err}");
    }

    #[test]
    fn runtime_is_auto_f32_unless_set_and_names_bad_values() {
        use crate::runtime::{DeviceChoice, Precision};
        let p = Path::new("run.toml");
        let c = RunConfig::from_toml(MINIMAL, p, &[]).unwrap();
        assert_eq!((c.runtime.device, c.runtime.dtype), (DeviceChoice::Auto, Precision::F32));
        let set = ["runtime.device=cuda:1".into(), "runtime.dtype=bf16".into()];
        let c = RunConfig::from_toml(MINIMAL, p, &set).unwrap();
        assert_eq!((c.runtime.device, c.runtime.dtype), (DeviceChoice::Cuda(1), Precision::Bf16));
        assert_eq!(RunConfig::from_toml(&c.to_toml().unwrap(), p, &[]).unwrap(), c);
        let text = format!("{MINIMAL}[runtime]\ndevice = \"cpu\"\n");
        assert_eq!(RunConfig::from_toml(&text, p, &[]).unwrap().runtime.device, DeviceChoice::Cpu);
        let err = RunConfig::from_toml(MINIMAL, p, &["runtime.device=tpu".into()]).unwrap_err().to_string();
        assert!(err.contains("run.toml") && err.contains("\"tpu\"") && err.contains("\"cuda:N\""), "{err}");
        let err = RunConfig::from_toml(MINIMAL, p, &["runtime.dtype=f16".into()]).unwrap_err().to_string();
        assert!(err.contains("\"f16\"") && err.contains("\"bf16\""), "{err}");
        let err = RunConfig::from_toml(MINIMAL, p, &["runtime.devices=cpu".into()]).unwrap_err().to_string();
        assert!(err.contains("did you mean \"device\""), "{err}");
    }
}
