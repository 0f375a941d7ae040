//! The `[env]` table of env configs (`rltune play --env FILE.toml`, and later `rltune ppo`):
//! which environment family, how many environments run at once, the step cap, and the family's
//! own settings. Unknown keys are rejected with the closest valid key.
//!
//! ```toml
//! [env]
//! kind = "textworld"                     # "adventure" | "letters" | "command" | "textworld" | "essays" | "ner"
//! games = ["target/textworld-games/*.z8"] # TextWorld game files (globs)
//! python = ".venv-textworld/bin/python"   # the interpreter with `textworld` installed
//! max_steps = 20
//! num_envs = 8
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::envs::adventure::{Adventure, AdventureConfig};
use crate::envs::command::{CommandEnv, CommandEnvConfig};
use crate::envs::essays::{Essays, EssaysConfig};
use crate::envs::letters::Letters;
use crate::envs::ner::{Ner, NerConfig};
use crate::envs::play::PromptTemplate;
use crate::envs::{Reset, TextEnv};
use crate::error::{ConfigError, Error, Result};
use crate::generation::GenerationConfig;

/// Which environment family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EnvKind {
    /// The generated text adventures of [`crate::envs::adventure`].
    #[default]
    Adventure,
    /// The letter toy.
    Letters,
    /// Any program speaking `docs/env-protocol.md`.
    Command,
    /// TextWorld games through `tools/textworld/bridge.py`.
    Textworld,
    /// Labelling generated essays' discourse elements ([`crate::envs::essays`]).
    Essays,
    /// BIO tagging of a CoNLL-style file ([`crate::envs::ner`]).
    Ner,
}

/// Which seeds a generated family plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// Training seeds (for behavioural cloning and RL).
    Train,
    /// Held-out (test) seeds, disjoint from the training ones (for reporting).
    #[default]
    Heldout,
    /// Validation seeds, disjoint from the training and the test ones (for choosing settings;
    /// generated families only: game files are split into train and held-out sets).
    Validation,
}

/// `[env]`
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EnvSection {
    /// The family.
    pub kind: EnvKind,
    /// Environments run at once.
    pub num_envs: usize,
    /// The step cap of an episode (then `truncated`).
    pub max_steps: usize,
    /// Seeds of generated games: the training or the held-out split.
    pub split: Split,
    /// TextWorld game files (glob patterns on the file name; relative to the config's folder).
    pub games: Vec<String>,
    /// TextWorld: the Python interpreter that has `textworld` (tools/textworld/install.sh).
    pub python: String,
    /// TextWorld: the bridge program (default: tools/textworld/bridge.py of this repository).
    pub bridge: Option<PathBuf>,
    /// `command`: the program and its arguments.
    pub command: Vec<String>,
    /// `command`/`textworld`: seconds to wait for each answer.
    pub timeout_s: f64,
    /// `command`/`textworld`: restarts of a dead or hung program (its episodes are dropped).
    pub restarts: usize,
    /// `letters`: turns per episode.
    pub turns: usize,
    /// `adventure`: the family's settings.
    pub adventure: AdventureConfig,
    /// `essays`: the environment's settings.
    pub essays: EssaysConfig,
    /// `ner`: the data file and its split.
    pub ner: NerConfig,
}

impl Default for EnvSection {
    fn default() -> Self {
        Self {
            kind: EnvKind::default(),
            num_envs: 8,
            max_steps: 20,
            split: Split::default(),
            games: Vec::new(),
            python: "python3".into(),
            bridge: None,
            command: Vec::new(),
            timeout_s: 60.0,
            restarts: 2,
            turns: 4,
            adventure: AdventureConfig::default(),
            essays: EssaysConfig::default(),
            ner: NerConfig::default(),
        }
    }
}

/// An env config file: `[env]`, and for model agents `[agent]` and `[generation]`.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EnvConfig {
    /// The environments.
    pub env: EnvSection,
    /// The prompt a model agent reads.
    pub agent: PromptTemplate,
    /// How a model agent samples its actions.
    pub generation: GenerationConfig,
}

impl EnvConfig {
    /// Reads a TOML file (with `table.key=value` overrides); relative paths in it (`games`,
    /// `bridge`, and `python` when it is a path) are resolved against the file's folder.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let mut cfg: Self = crate::config_file::parse_toml(&text, path, overrides)?;
        cfg.env.resolve_paths(path.parent().unwrap_or(Path::new(".")));
        cfg.env.validate().map_err(|m| Error::config(path, m))?;
        Ok(cfg)
    }
}

/// `p` relative to `base` unless absolute.
pub fn resolve(base: &Path, p: &str) -> String {
    if Path::new(p).is_absolute() {
        p.to_string()
    } else {
        base.join(p).to_string_lossy().into_owned()
    }
}

impl EnvSection {
    /// Makes the relative paths (`games`, `bridge`, and `python` when it is a path rather than
    /// a program looked up on PATH) relative to `base`, the config file's folder.
    pub fn resolve_paths(&mut self, base: &Path) {
        self.games = self.games.iter().map(|g| resolve(base, g)).collect();
        self.ner.file = resolve(base, &self.ner.file);
        if self.python.contains('/') {
            self.python = resolve(base, &self.python);
        }
        self.bridge = self.bridge.as_ref().map(|b| PathBuf::from(resolve(base, &b.to_string_lossy())));
    }

    /// Checks the fields of the chosen kind; messages name the key.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        if self.num_envs == 0 || self.max_steps == 0 {
            return Err(ConfigError::new(
                "env",
                "num_envs",
                format!("({}) and max_steps ({}) must be at least 1", self.num_envs, self.max_steps),
            ));
        }
        if !(self.timeout_s > 0.0 && self.timeout_s.is_finite()) {
            return Err(ConfigError::new(
                "env",
                "timeout_s",
                format!("must be a positive number of seconds, got {}", self.timeout_s),
            ));
        }
        match self.kind {
            EnvKind::Textworld if self.games.is_empty() => Err(ConfigError::new(
                "env",
                "kind",
                "= \"textworld\" needs games = [\"path/*.z8\", …] (make some with \
                     tools/textworld/make_games.sh)",
            )),
            EnvKind::Command if self.command.is_empty() => Err(ConfigError::new(
                "env",
                "kind",
                "= \"command\" needs command = [\"program\", \"arg\", …]",
            )),
            _ => Ok(()),
        }
    }

    /// The game files the `games` patterns name, sorted within each pattern; a pattern that
    /// names no file is an error.
    pub fn game_files(&self) -> Result<Vec<PathBuf>> {
        let mut out = Vec::new();
        for pattern in &self.games {
            let found = glob(pattern)?;
            if found.is_empty() {
                return Err(Error::Setting(ConfigError::new(
                    "env",
                    "games",
                    format!(": {pattern:?} names no file; generate games with tools/textworld/make_games.sh"),
                )));
            }
            out.extend(found);
        }
        Ok(out)
    }

    /// The number of TextWorld game files the episodes cycle through (0 for the other kinds,
    /// whose resets name no game file).
    pub fn game_count(&self) -> Result<usize> {
        Ok(if self.kind == EnvKind::Textworld { self.game_files()?.len() } else { 0 })
    }

    /// Starts the environments.
    pub fn build(&self) -> Result<Box<dyn TextEnv>> {
        self.build_with(false)
    }

    /// Starts the environments; with `walkthroughs`, a `command` or `textworld` program is
    /// asked for a walkthrough in every result (`init`'s `walkthrough: true`), which
    /// [`TextEnv::walkthrough`] then serves, for demonstrations. The generated families always
    /// know theirs.
    pub fn build_with(&self, walkthroughs: bool) -> Result<Box<dyn TextEnv>> {
        let n = self.num_envs;
        let mut init = serde_json::Map::new();
        if walkthroughs {
            init.insert("walkthrough".into(), true.into());
        }
        Ok(match self.kind {
            EnvKind::Letters => Box::new(Letters::new(n, self.turns)),
            EnvKind::Adventure => {
                let cfg = AdventureConfig { max_steps: self.max_steps, ..self.adventure.clone() };
                Box::new(Adventure::new(n, cfg)?)
            }
            EnvKind::Essays => Box::new(Essays::new(n, self.essays.clone(), self.max_steps)?),
            EnvKind::Ner => Box::new(Ner::from_config(n, &self.ner, Path::new("."), self.max_steps)?),
            EnvKind::Command => Box::new(self.command_env(self.command.clone(), init)?),
            EnvKind::Textworld => {
                let games: Vec<String> =
                    self.game_files()?.iter().map(|g| g.to_string_lossy().into_owned()).collect();
                let bridge = match &self.bridge {
                    Some(b) => b.clone(),
                    None => default_bridge()?,
                };
                let command = vec![self.python.clone(), bridge.to_string_lossy().into_owned()];
                init.insert("games".into(), games.into());
                init.insert("max_steps".into(), self.max_steps.into());
                Box::new(self.command_env(command, init)?)
            }
        })
    }

    fn command_env(
        &self,
        command: Vec<String>,
        mut init: serde_json::Map<String, serde_json::Value>,
    ) -> Result<CommandEnv> {
        init.entry("max_steps").or_insert(self.max_steps.into());
        Ok(CommandEnv::spawn(CommandEnvConfig {
            command,
            init,
            num_envs: self.num_envs,
            timeout: Duration::from_secs_f64(self.timeout_s),
            restarts: self.restarts,
        })?)
    }

    /// How episode `i` of a run starting at `seed` is reset: a generated family plays seed
    /// `seed + i` of its split; game files are played in turn (episode i: game i mod count).
    pub fn reset_for(&self, seed: u64, i: usize, game_count: usize) -> Reset {
        let k = seed.wrapping_add(i as u64);
        match self.kind {
            EnvKind::Adventure | EnvKind::Essays | EnvKind::Ner => Reset {
                seed: Some(match self.split {
                    Split::Train => crate::envs::adventure::train_seed(k),
                    Split::Heldout => crate::envs::adventure::heldout_seed(k),
                    Split::Validation => crate::envs::adventure::validation_seed(k),
                }),
                game: None,
            },
            EnvKind::Letters => Reset { seed: Some(k), game: None },
            EnvKind::Command | EnvKind::Textworld => {
                Reset { seed: None, game: (game_count > 0).then(|| i % game_count) }
            }
        }
    }
}

/// `tools/textworld/bridge.py` of this source tree (found from the executable's or the
/// working directory's ancestors).
fn default_bridge() -> Result<PathBuf> {
    let rel = Path::new("tools/textworld/bridge.py");
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Ok(cwd) = std::env::current_dir() {
        roots.extend(cwd.ancestors().map(Path::to_path_buf));
    }
    if let Ok(exe) = std::env::current_exe() {
        roots.extend(exe.ancestors().map(Path::to_path_buf));
    }
    roots.iter().map(|r| r.join(rel)).find(|p| p.is_file()).ok_or_else(|| {
        Error::Setting(ConfigError::new(
            "env",
            "kind",
            "= \"textworld\": tools/textworld/bridge.py not found from here; set [env] bridge = \
             \"path/to/bridge.py\"",
        ))
    })
}

/// The files matching `pattern`, whose last component may hold `*` and `?`; sorted.
fn glob(pattern: &str) -> Result<Vec<PathBuf>> {
    let path = Path::new(pattern);
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if !name.contains(['*', '?']) {
        return Ok(if path.is_file() { vec![path.to_path_buf()] } else { Vec::new() });
    }
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(Vec::new()) };
    let mut out: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.file_name().is_some_and(|n| wildcard(&name, &n.to_string_lossy())))
        .collect();
    out.sort();
    Ok(out)
}

/// Whether `text` matches `pattern` (`*`: any run, `?`: one character).
fn wildcard(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    // dp[j]: pattern[..i] matches text[..j]
    let mut dp = vec![false; t.len() + 1];
    dp[0] = true;
    for &c in &p {
        let mut next = vec![false; t.len() + 1];
        if c == '*' {
            let mut any = false;
            for j in 0..=t.len() {
                any |= dp[j];
                next[j] = any;
            }
        } else {
            for j in 1..=t.len() {
                next[j] = dp[j - 1] && (c == '?' || c == t[j - 1]);
            }
        }
        dp = next;
    }
    dp[t.len()]
}

/// The sampling settings of a model agent, with the config's seed replaced by `seed`.
pub fn agent_generation(cfg: &EnvConfig, seed: u64) -> GenerationConfig {
    GenerationConfig { seed, ..cfg.generation.clone() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_match_names() {
        assert!(wildcard("*.z8", "coin5_s6.z8"));
        assert!(wildcard("coin?_*.z8", "coin5_s6.z8"));
        assert!(!wildcard("*.z8", "coin5_s6.json"));
        assert!(wildcard("*", ""));
    }

    #[test]
    fn configs_name_bad_keys_and_missing_games() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("env.toml");
        std::fs::write(&path, "[env]\nkind = \"textworld\"\nmax_step = 3\n").unwrap();
        let e = EnvConfig::load(&path, &[]).unwrap_err().to_string();
        assert!(e.contains("did you mean \"max_steps\""), "{e}");
        std::fs::write(&path, "[env]\nkind = \"textworld\"\n").unwrap();
        let e = EnvConfig::load(&path, &[]).unwrap_err().to_string();
        assert!(e.contains("needs games"), "{e}");
        std::fs::write(&path, "[env]\nkind = \"textworld\"\ngames = [\"nothing/*.z8\"]\n").unwrap();
        let cfg = EnvConfig::load(&path, &[]).unwrap();
        let e = cfg.env.game_files().unwrap_err().to_string();
        assert!(e.contains("names no file") && e.contains("make_games.sh"), "{e}");
        std::fs::write(&path, "[env]\nkind = \"letters\"\nturns = 2\nnum_envs = 3\n").unwrap();
        let cfg = EnvConfig::load(&path, &[]).unwrap();
        assert_eq!(cfg.env.build().unwrap().num_envs(), 3);
    }
}
