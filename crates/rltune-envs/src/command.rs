//! [`CommandEnv`]: environments that live in another process and speak the JSON-lines protocol
//! of `docs/env-protocol.md` (the TextWorld bridge `tools/textworld/bridge.py` is one).
//!
//! Every request has a timeout. Stdout lines that are not a response to the request in flight
//! (stray prints, responses to an abandoned request) are skipped and counted. A process that
//! dies, hangs or answers garbage gives an error naming the program, with its exit status and
//! the end of its stderr; with `restarts > 0` it is restarted instead (hello and init again)
//! and the episodes that were in flight are dropped: their environments get a per-env error
//! saying so, and [`CommandEnv::dropped_episodes`] counts them.
//!
//! When `init` asks for walkthroughs (`"walkthrough": true`, `docs/env-protocol.md`), each
//! result's `walkthrough` member is kept per environment and served by
//! [`TextEnv::walkthrough`], so [`super::demos`] can demonstrate on the program's games.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{check_indices, EnvStep, Reset, TextEnv};
use crate::error::{Error, Result};
use crate::process::{quote, LineProcess, Received};

/// The protocol version this client speaks.
pub const PROTOCOL: u64 = 1;
/// The longest response line read, in bytes (a batch of 64 results with long observations
/// fits many times over).
const RESPONSE_LINE_MAX: usize = 16 << 20;

/// How to start and drive an environment program.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandEnvConfig {
    /// Program and arguments (no shell).
    pub command: Vec<String>,
    /// The `init` params: `num_envs` is added; typically `games`, `max_steps`.
    pub init: serde_json::Map<String, Value>,
    /// Number of environments.
    pub num_envs: usize,
    /// Seconds to wait for each response.
    pub timeout: Duration,
    /// How many times a dead or hung program may be restarted before it is an error.
    pub restarts: usize,
}

/// A batch of environments served by a child process (see the module docs).
pub struct CommandEnv {
    cfg: CommandEnvConfig,
    process: LineProcess,
    /// What `hello` answered.
    hello: serde_json::Map<String, Value>,
    next_id: u64,
    stray_lines: usize,
    restarts_done: usize,
    dropped: usize,
    /// Per env: the walkthrough of its last result (`None` when the program sent none).
    walkthroughs: Vec<Option<Vec<String>>>,
}

impl std::fmt::Debug for CommandEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommandEnv").field("command", &self.process.shown).field("cfg", &self.cfg).finish()
    }
}

/// Why a request failed: the program broke (restartable) or it answered with an error.
enum Failure {
    /// Dead, hung, or unreadable output.
    Transport(String),
    /// A request-level error response, or a result that does not parse.
    Answer(String),
}

impl CommandEnv {
    /// Starts the program, then `hello` and `init`.
    pub fn spawn(cfg: CommandEnvConfig) -> Result<Self> {
        let process = LineProcess::spawn(&cfg.command, "environment command", RESPONSE_LINE_MAX)?;
        let mut env = Self {
            cfg,
            process,
            hello: serde_json::Map::new(),
            next_id: 0,
            stray_lines: 0,
            restarts_done: 0,
            dropped: 0,
            walkthroughs: Vec::new(),
        };
        env.start().map_err(|f| env.failure_error("start", f))?;
        Ok(env)
    }

    /// `hello` then `init` on the current process.
    fn start(&mut self) -> std::result::Result<(), Failure> {
        let hello = self.request("hello", json!({"protocol": PROTOCOL}))?;
        if hello.get("protocol").and_then(Value::as_u64) != Some(PROTOCOL) {
            return Err(Failure::Answer(format!(
                "hello: the program speaks protocol {}, this rltune speaks {PROTOCOL}",
                hello.get("protocol").map_or("(none)".into(), Value::to_string)
            )));
        }
        self.hello = hello.as_object().cloned().unwrap_or_default();
        let mut init = self.cfg.init.clone();
        init.insert("num_envs".into(), self.cfg.num_envs.into());
        self.request("init", Value::Object(init))?;
        self.walkthroughs = vec![None; self.cfg.num_envs];
        Ok(())
    }

    /// What the program said in `hello` (`name`, `version`, …).
    pub fn hello(&self) -> &serde_json::Map<String, Value> {
        &self.hello
    }

    /// Stdout lines skipped because they were no response to the request in flight.
    pub fn stray_lines(&self) -> usize {
        self.stray_lines
    }

    /// Episodes dropped by restarts of the program.
    pub fn dropped_episodes(&self) -> usize {
        self.dropped
    }

    /// Restarts so far.
    pub fn restarts(&self) -> usize {
        self.restarts_done
    }

    /// Sends one request and waits for its response's `result`.
    fn request(&mut self, method: &str, params: Value) -> std::result::Result<Value, Failure> {
        self.next_id += 1;
        let id = self.next_id;
        let line = json!({"id": id, "method": method, "params": params});
        let _ = self.process.send(format!("{line}\n"));
        let deadline = Instant::now() + self.cfg.timeout;
        loop {
            let line = match self.process.recv(Some(deadline)) {
                Received::Line(l) => l,
                Received::Unreadable(why) => return Err(Failure::Transport(why)),
                Received::Timeout => {
                    return Err(Failure::Transport(format!(
                        "no answer to `{method}` within {:.1?}; raise the timeout if the environment is slow",
                        self.cfg.timeout
                    )))
                }
                Received::Closed => {
                    return Err(Failure::Transport("it closed its stdout: it died or exited".into()))
                }
            };
            let msg: Option<serde_json::Map<String, Value>> = serde_json::from_str(line.trim()).ok();
            let Some(msg) = msg.filter(|m| m.get("id").and_then(Value::as_u64) == Some(id)) else {
                self.stray_lines += 1;
                tracing::debug!(
                    "environment {}: skipped a stray stdout line: {}",
                    self.process.shown,
                    quote(line.trim_end())
                );
                continue;
            };
            if let Some(err) = msg.get("error") {
                return Err(Failure::Answer(format!("`{method}` failed: {}", error_text(err))));
            }
            return msg.get("result").cloned().ok_or_else(|| {
                Failure::Answer(format!("the answer to `{method}` has neither result nor error"))
            });
        }
    }

    /// The error for a failure, naming the program (with its exit status and stderr when it broke).
    fn failure_error(&mut self, what: &str, f: Failure) -> Error {
        let shown = self.process.shown.clone();
        match f {
            Failure::Answer(msg) => Error::Program(format!("environment `{shown}` ({what}): {msg}")),
            Failure::Transport(msg) => {
                let (status, stderr) = self.process.ending(Duration::from_millis(500));
                Error::Program(format!("environment `{shown}` ({what}): {msg} ({status}); {stderr}"))
            }
        }
    }

    /// Runs a reset or step request: on a transport failure with restarts left, restarts the
    /// program and drops the listed environments' episodes (a per-env error each).
    fn batched(&mut self, method: &str, params: Value, envs: &[usize]) -> Result<Vec<Result<EnvStep>>> {
        match self.request(method, params) {
            Ok(result) => {
                let parsed = parse_results(method, &result, envs)
                    .map_err(|m| self.failure_error(method, Failure::Answer(m)))?;
                Ok(envs
                    .iter()
                    .zip(parsed)
                    .map(|(&e, r)| {
                        let (step, walkthrough) = match r {
                            Ok((step, w)) => (Ok(step), w),
                            Err(err) => (Err(err), None),
                        };
                        self.walkthroughs[e] = walkthrough;
                        step
                    })
                    .collect())
            }
            Err(Failure::Transport(msg)) if self.restarts_done < self.cfg.restarts => {
                self.restarts_done += 1;
                let (status, stderr) = self.process.ending(Duration::from_millis(200));
                tracing::warn!(
                    "environment `{}` broke during `{method}` ({msg}; {status}); restarting it ({} of {}), \
                     every episode is dropped; {stderr}",
                    self.process.shown,
                    self.restarts_done,
                    self.cfg.restarts
                );
                self.process =
                    LineProcess::spawn(&self.cfg.command, "environment command", RESPONSE_LINE_MAX)?;
                self.start().map_err(|f| self.failure_error("restart", f))?;
                // Every environment lost its episode; the ones in this request are reported.
                self.dropped += self.cfg.num_envs;
                self.walkthroughs = vec![None; self.cfg.num_envs];
                Ok(envs
                    .iter()
                    .map(|e| {
                        Err(Error::not_running(
                            "environment",
                            *e,
                            "dropped its episode when the environment program restarted",
                        ))
                    })
                    .collect())
            }
            Err(f) => Err(self.failure_error(method, f)),
        }
    }
}

impl TextEnv for CommandEnv {
    fn num_envs(&self) -> usize {
        self.cfg.num_envs
    }

    fn reset(&mut self, envs: &[usize], resets: &[Reset]) -> Result<Vec<EnvStep>> {
        check_indices("reset", envs, self.cfg.num_envs, resets.len())?;
        let seeds: Vec<Option<u64>> = resets.iter().map(|r| r.seed).collect();
        let games: Vec<Option<usize>> = resets.iter().map(|r| r.game).collect();
        let params = json!({"envs": envs, "seeds": seeds, "games": games});
        self.batched("reset", params, envs)?.into_iter().collect()
    }

    fn step(&mut self, actions: &[(usize, String)]) -> Result<Vec<Result<EnvStep>>> {
        let envs: Vec<usize> = actions.iter().map(|(e, _)| *e).collect();
        check_indices("step", &envs, self.cfg.num_envs, actions.len())?;
        let list: Vec<Value> = actions.iter().map(|(e, a)| json!({"env": e, "action": a})).collect();
        self.batched("step", json!({ "actions": list }), &envs)
    }

    /// The `walkthrough` member of `env`'s last result (`None` when the program sent none, or
    /// an empty list once nothing is left to win).
    fn walkthrough(&self, env: usize) -> Option<Vec<String>> {
        self.walkthroughs.get(env).cloned().flatten()
    }
}

impl Drop for CommandEnv {
    fn drop(&mut self) {
        self.next_id += 1;
        let _ = self.process.send(format!("{}\n", json!({"id": self.next_id, "method": "close"})));
        self.process.shut_down(Duration::from_millis(500));
    }
}

/// `message (kind)` of a protocol error object.
fn error_text(err: &Value) -> String {
    let message = err.get("message").and_then(Value::as_str).unwrap_or("(no message)");
    match err.get("kind").and_then(Value::as_str) {
        Some(kind) => format!("{message} ({kind})"),
        None => message.to_string(),
    }
}

/// A per-env result and its walkthrough, when it has one.
type Parsed = (EnvStep, Option<Vec<String>>);

/// The per-env entries of a reset or step result, in the order of `envs`.
fn parse_results(
    method: &str,
    result: &Value,
    envs: &[usize],
) -> std::result::Result<Vec<Result<Parsed>>, String> {
    let list = result
        .get("results")
        .and_then(Value::as_array)
        .ok_or_else(|| format!("the `{method}` result has no \"results\" list"))?;
    if list.len() != envs.len() {
        return Err(format!("`{method}` answered {} results for {} environments", list.len(), envs.len()));
    }
    Ok(list
        .iter()
        .zip(envs)
        .map(|(r, &e)| match r.get("error") {
            Some(err) => Err(Error::Program(format!("environment {e}: {}", error_text(err)))),
            None => parse_step(r)
                .map_err(|m| Error::Program(format!("environment {e}: the `{method}` result {m}"))),
        })
        .collect())
}

/// A list of strings member: `None` when absent or `null`.
fn strings(
    o: &serde_json::Map<String, Value>,
    key: &str,
) -> std::result::Result<Option<Vec<String>>, String> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) => a
            .iter()
            .map(|c| c.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .map(Some)
            .ok_or_else(|| format!("has a non-string entry in \"{key}\"")),
        Some(_) => Err(format!("has \"{key}\" that is not a list")),
    }
}

/// One per-env result and its walkthrough; absent or `null` members take their defaults.
fn parse_step(v: &Value) -> std::result::Result<Parsed, String> {
    let o = v.as_object().ok_or("is not an object")?;
    let text = |k: &str| o.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
    let num = |k: &str| o.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    let flag = |k: &str| o.get(k).and_then(Value::as_bool).unwrap_or(false);
    let observation = o.get("observation").and_then(Value::as_str).ok_or("has no \"observation\" string")?;
    let admissible_commands = strings(o, "admissible_commands")?.unwrap_or_default();
    let walkthrough = strings(o, "walkthrough")?;
    let mut infos = o.get("infos").and_then(Value::as_object).cloned().unwrap_or_default();
    for k in ["game", "description", "sanitized_action", "sent", "note"] {
        if let Some(x) = o.get(k).filter(|x| !x.is_null()) {
            infos.insert(k.into(), x.clone());
        }
    }
    let step = EnvStep {
        observation: observation.to_string(),
        reward: num("reward"),
        terminated: flag("terminated"),
        truncated: flag("truncated"),
        won: flag("won"),
        lost: flag("lost"),
        score: num("score"),
        max_score: num("max_score"),
        moves: o.get("moves").and_then(Value::as_u64).unwrap_or(0) as usize,
        admissible_commands,
        objective: text("objective"),
        inventory: text("inventory"),
        invalid: flag("invalid"),
        infos,
    };
    Ok((step, walkthrough))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A protocol server in shell + awk-free sh: answers hello/init, then each reset/step with
    /// one result per env whose observation counts the requests; `extra` runs before each answer.
    fn fake(extra: &str) -> Vec<String> {
        let script = format!(
            r#"n=0; while IFS= read -r l; do n=$((n+1)); id=$(echo "$l" | sed 's/.*"id":\([0-9]*\).*/\1/');
            {extra}
            case "$l" in
              *'"hello"'*) echo "{{\"id\":$id,\"result\":{{\"protocol\":1,\"name\":\"fake\"}}}}";;
              *'"init"'*) echo "{{\"id\":$id,\"result\":{{}}}}";;
              *'"reset"'*|*'"step"'*) echo "{{\"id\":$id,\"result\":{{\"results\":[{{\"observation\":\"obs $n\",\"reward\":1,\"admissible_commands\":[\"go east\"],\"won\":true,\"terminated\":true}}]}}}}";;
              *'"close"'*) echo "{{\"id\":$id,\"result\":{{}}}}"; exit 0;;
            esac; done"#
        );
        vec!["sh".into(), "-c".into(), script]
    }

    fn cfg(command: Vec<String>, restarts: usize) -> CommandEnvConfig {
        CommandEnvConfig {
            command,
            init: Default::default(),
            num_envs: 1,
            timeout: Duration::from_secs(5),
            restarts,
        }
    }

    #[test]
    fn speaks_the_protocol_and_skips_stray_lines() {
        let mut env =
            CommandEnv::spawn(cfg(fake(r#"echo "stray print from the game"; echo '{"id": 999}'"#), 0))
                .unwrap();
        assert_eq!(env.hello()["name"], "fake");
        let r = env.reset(&[0], &[Reset::default()]).unwrap();
        assert_eq!(r[0].observation, "obs 3");
        let s = env.step(&[(0, "go east".into())]).unwrap();
        let s = s[0].as_ref().unwrap();
        assert_eq!(
            (s.reward, s.won, s.terminated, s.admissible_commands.clone()),
            (1.0, true, true, vec!["go east".to_string()])
        );
        assert_eq!(env.stray_lines(), 8, "two stray lines before each of 4 answers");
    }

    #[test]
    fn walkthroughs_are_kept_per_env_from_the_last_result() {
        let script = fake(
            r#"case "$l" in *'"reset"'*) echo "{\"id\":$id,\"result\":{\"results\":[{\"observation\":\"start\",\"walkthrough\":[\"go east\",\"take coin\"]}]}}"; continue;; esac"#,
        );
        let mut env = CommandEnv::spawn(cfg(script, 0)).unwrap();
        assert_eq!(env.walkthrough(0), None, "no result yet");
        env.reset(&[0], &[Reset::default()]).unwrap();
        assert_eq!(env.walkthrough(0), Some(vec!["go east".to_string(), "take coin".to_string()]));
        env.step(&[(0, "go east".into())]).unwrap();
        assert_eq!(env.walkthrough(0), None, "the step's result has no walkthrough member");
        assert_eq!(env.walkthrough(5), None, "an env that does not exist has none");
        let bad = fake(
            r#"case "$l" in *'"reset"'*) echo "{\"id\":$id,\"result\":{\"results\":[{\"observation\":\"o\",\"walkthrough\":[1]}]}}"; continue;; esac"#,
        );
        let mut env = CommandEnv::spawn(cfg(bad, 0)).unwrap();
        let err = env.reset(&[0], &[Reset::default()]).unwrap_err().to_string();
        assert!(err.contains("non-string entry in \"walkthrough\""), "{err}");
    }

    #[test]
    fn a_dead_program_is_an_error_with_its_status_and_stderr() {
        let script = fake(r#"case "$l" in *'"step"'*) echo 'bridge: segfault in frotz' >&2; exit 9;; esac"#);
        let mut env = CommandEnv::spawn(cfg(script, 0)).unwrap();
        env.reset(&[0], &[Reset::default()]).unwrap();
        let err = env.step(&[(0, "x".into())]).unwrap_err().to_string();
        assert!(
            err.contains("exit status: 9") && err.contains("segfault in frotz") && err.contains("(step)"),
            "{err}"
        );
    }

    #[test]
    fn a_hung_program_times_out_and_with_restarts_drops_the_episodes() {
        let script =
            fake(r#"case "$l" in *'"step"'*) [ -e "$0.hung" ] || { touch "$0.hung"; sleep 30; };; esac"#);
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("m").to_string_lossy().into_owned();
        let mut command = script;
        command.push(marker); // $0 of the script: the marker path
        let mut c = cfg(command, 1);
        c.timeout = Duration::from_millis(500);
        let mut env = CommandEnv::spawn(c).unwrap();
        env.reset(&[0], &[Reset::default()]).unwrap();
        let out = env.step(&[(0, "x".into())]).unwrap();
        let err = out[0].as_ref().unwrap_err().to_string();
        assert!(err.contains("dropped") && err.contains("reset it"), "{err}");
        assert_eq!((env.restarts(), env.dropped_episodes()), (1, 1));
        env.reset(&[0], &[Reset::default()]).unwrap();
        assert!(env.step(&[(0, "x".into())]).unwrap()[0].is_ok(), "the restarted program serves steps");
    }

    #[test]
    fn garbage_results_and_error_answers_are_clear_errors() {
        let bad = fake(
            r#"case "$l" in *'"step"'*) echo "{\"id\":$id,\"result\":{\"results\":[{\"reward\":1}]}}"; continue;; esac"#,
        );
        let mut env = CommandEnv::spawn(cfg(bad, 0)).unwrap();
        env.reset(&[0], &[Reset::default()]).unwrap();
        // A result that does not parse fails that environment only.
        let out = env.step(&[(0, "x".into())]).unwrap();
        let err = out[0].as_ref().unwrap_err().to_string();
        assert!(err.contains("environment 0") && err.contains("no \"observation\""), "{err}");
        let refusing = fake(
            r#"case "$l" in *'"init"'*) echo "{\"id\":$id,\"error\":{\"message\":\"game.z8: no such file\",\"kind\":\"game_error\"}}"; continue;; esac"#,
        );
        let err = CommandEnv::spawn(cfg(refusing, 0)).unwrap_err().to_string();
        assert!(err.contains("game.z8: no such file (game_error)") && err.contains("`init` failed"), "{err}");
        let err = CommandEnv::spawn(cfg(vec!["/no/such/program".into()], 0)).unwrap_err().to_string();
        assert!(err.contains("cannot start environment command"), "{err}");
    }
}
