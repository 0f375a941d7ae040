//! The routes: reading a request, checking it against the model, queueing it for the worker,
//! and writing the answer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use rltune::generation::row_seed;
use rltune::models::chat_template::ChatTemplate;
use rltune::tokenizer::Tokenizer;
use serde_json::{json, Value};

use super::api::{self, Prompt, Sampling};
use super::error::ApiError;
use super::http::{HttpRequest, HttpResponse};
use super::respond::{self, Choice};
use super::worker::{Job, Params, RowOut, Stats};

/// The default `max_tokens` of `/v1/completions` (OpenAI's).
const COMPLETIONS_MAX_TOKENS: usize = 16;
/// The default `max_tokens` of chat when the model has no position limit.
const CHAT_MAX_TOKENS: usize = 1024;

/// What every handler reads.
pub struct Shared {
    /// The `model` clients name.
    pub served_name: String,
    /// When the server started (seconds since the epoch), the model's `created`.
    pub created: u64,
    /// The model's tokenizer.
    pub tokenizer: Tokenizer,
    /// The model's chat template, when it has one.
    pub template: Option<ChatTemplate>,
    /// Ids below this are valid.
    pub vocab: usize,
    /// Prompt + new tokens at most, when limited.
    pub context: Option<usize>,
    /// The ids that end a sequence.
    pub eos: Vec<u32>,
    /// The worker's queue; `None` once the server stops taking requests.
    pub jobs: Mutex<Option<SyncSender<Job>>>,
    /// Counters.
    pub stats: Arc<Stats>,
    /// Request ids, and the seeds of requests without one.
    pub counter: AtomicU64,
    /// The seed of the seeds of requests without one.
    pub seed: u64,
}

/// Answers one request.
pub fn handle(shared: &Shared, request: &HttpRequest) -> HttpResponse {
    let started = std::time::Instant::now();
    let (method, path) = (request.method.as_str(), request.path.as_str());
    let response = match route(shared, request) {
        Ok(Reply::Json(v)) => HttpResponse::json(200, v.to_string()),
        Ok(Reply::Text(t)) => {
            HttpResponse { content_type: "text/plain; version=0.0.4", ..HttpResponse::json(200, t) }
        }
        Err(e) => error_response(shared, &e, path),
    };
    tracing::debug!("{method} {path} -> {} in {:.0?}", response.status, started.elapsed());
    response
}

/// `e` as an answer, counted in `rltune_http_errors_total`; a 405 says what is allowed.
pub fn error_response(shared: &Shared, e: &ApiError, path: &str) -> HttpResponse {
    shared.stats.http_errors.fetch_add(1, Ordering::Relaxed);
    let mut r = HttpResponse::json(e.status, e.to_json().to_string());
    if e.status == 405 {
        r.headers.push(("Allow", allowed(path).unwrap_or("GET").to_string()));
    }
    r
}

/// A successful answer.
enum Reply {
    Json(Value),
    Text(String),
}

/// The method each route takes.
fn allowed(path: &str) -> Option<&'static str> {
    match path {
        "/v1/completions" | "/v1/chat/completions" => Some("POST"),
        "/v1/models" | "/health" | "/metrics" => Some("GET"),
        p if p.starts_with("/v1/models/") => Some("GET"),
        _ => None,
    }
}

fn route(shared: &Shared, request: &HttpRequest) -> Result<Reply, ApiError> {
    let (method, path) = (request.method.as_str(), request.path.as_str());
    let Some(want) = allowed(path) else {
        return Err(ApiError::not_found(
            format!(
                "no route {method} {path}; this server answers POST /v1/completions, POST /v1/chat/completions, \
                 GET /v1/models, GET /health and GET /metrics"
            ),
            "unknown_url",
            None,
        ));
    };
    if method != want {
        return Err(ApiError::method_not_allowed(method, path, want));
    }
    match path {
        "/v1/models" => Ok(Reply::Json(json!({"object": "list", "data": [model_object(shared)]}))),
        "/health" => Ok(Reply::Json(json!({"status": "ok"}))),
        "/metrics" => Ok(Reply::Text(shared.stats.prometheus())),
        "/v1/completions" => completions(shared, &parse_json(&request.body)?).map(Reply::Json),
        "/v1/chat/completions" => chat(shared, &parse_json(&request.body)?).map(Reply::Json),
        _ => {
            let id = path.trim_start_matches("/v1/models/");
            check_model(shared, id, None)?;
            Ok(Reply::Json(model_object(shared)))
        }
    }
}

fn model_object(shared: &Shared) -> Value {
    json!({"id": shared.served_name, "object": "model", "created": shared.created, "owned_by": "rltune"})
}

/// 404 unless `model` is the served one.
fn check_model(shared: &Shared, model: &str, param: Option<&str>) -> Result<(), ApiError> {
    if model == shared.served_name {
        return Ok(());
    }
    Err(ApiError::not_found(
        format!(
            "the model `{model}` does not exist here; this server serves `{}` (GET /v1/models)",
            shared.served_name
        ),
        "model_not_found",
        param,
    ))
}

/// The body as JSON: 400 when it does not parse.
fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad(
            format!("the body is not valid JSON: {e} (send one JSON object, Content-Type: application/json)"),
            None,
        )
    })
}

/// `POST /v1/completions`.
fn completions(shared: &Shared, body: &Value) -> Result<Value, ApiError> {
    let req = api::completion_request(body)?;
    check_model(shared, &req.model, Some("model"))?;
    let mut prompts = Vec::with_capacity(req.prompts.len());
    for (i, p) in req.prompts.iter().enumerate() {
        let ids = match p {
            Prompt::Text(t) => encode(shared, t, "prompt")?,
            Prompt::Ids(ids) => ids.clone(),
        };
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= shared.vocab) {
            return Err(ApiError::bad(
                format!(
                    "prompt {i} has token id {bad}; ids must be below the vocabulary size {}",
                    shared.vocab
                ),
                Some("prompt"),
            ));
        }
        prompts.push(ids);
    }
    let max_tokens = req.sampling.max_tokens.unwrap_or(COMPLETIONS_MAX_TOKENS);
    for p in &prompts {
        check_context(shared, p.len(), max_tokens, "prompt")?;
    }
    let s = &req.sampling;
    let choices = sample_choices(shared, &prompts, s, max_tokens)?;
    let json_choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let logprobs = s.logprobs.map(|k| respond::completion_logprobs(&shared.tokenizer, c, k));
            json!({"index": i, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish,
                   "token_ids": c.row.ids, "prompt_token_ids": prompts[i / s.n]})
        })
        .collect();
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    Ok(json!({
        "id": format!("cmpl-{}", shared.counter.fetch_add(1, Ordering::Relaxed)),
        "object": "text_completion",
        "created": now(),
        "model": shared.served_name,
        "choices": json_choices,
        "usage": respond::usage(&lens, &choices),
        "system_fingerprint": null,
    }))
}

/// `POST /v1/chat/completions`.
fn chat(shared: &Shared, body: &Value) -> Result<Value, ApiError> {
    let req = api::chat_request(body)?;
    check_model(shared, &req.model, Some("model"))?;
    let Some(template) = &shared.template else {
        return Err(ApiError::bad(
            format!(
                "the model `{}` has no chat template (no chat_template in its tokenizer_config.json); \
                 use /v1/completions",
                shared.served_name
            ),
            Some("messages"),
        ));
    };
    let text = template.render(&req.messages, true).map_err(|e| {
        ApiError::bad(format!("the chat template cannot render these messages: {e}"), Some("messages"))
    })?;
    let prompt = encode(shared, &text, "messages")?;
    let max_tokens = match (req.sampling.max_tokens, shared.context) {
        (Some(m), _) => m,
        (None, Some(ctx)) => ctx.saturating_sub(prompt.len()).max(1),
        (None, None) => CHAT_MAX_TOKENS,
    };
    check_context(shared, prompt.len(), max_tokens, "messages")?;
    let prompts = [prompt];
    let s = &req.sampling;
    let choices = sample_choices(shared, &prompts, s, max_tokens)?;
    let json_choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let logprobs = s.logprobs.map(|_| respond::chat_logprobs(&shared.tokenizer, c));
            json!({"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs,
                   "finish_reason": c.finish, "token_ids": c.row.ids})
        })
        .collect();
    let [prompt] = prompts;
    Ok(json!({
        "id": format!("chatcmpl-{}", shared.counter.fetch_add(1, Ordering::Relaxed)),
        "object": "chat.completion",
        "created": now(),
        "model": shared.served_name,
        "choices": json_choices,
        "usage": respond::usage(&[prompt.len()], &choices),
        "prompt_token_ids": prompt,
        "system_fingerprint": null,
    }))
}

/// `text` as ids; an empty result is refused (there is nothing to continue).
fn encode(shared: &Shared, text: &str, param: &str) -> Result<Vec<u32>, ApiError> {
    let ids = shared.tokenizer.encode(text).map_err(|e| ApiError::bad(e.to_string(), Some(param)))?;
    if ids.is_empty() {
        return Err(ApiError::bad(format!("`{param}` encodes to no tokens; send some text"), Some(param)));
    }
    Ok(ids)
}

/// 400 `context_length_exceeded` when the prompt and `max_tokens` do not fit the model.
fn check_context(shared: &Shared, prompt: usize, max_tokens: usize, param: &str) -> Result<(), ApiError> {
    match shared.context {
        Some(ctx) if prompt + max_tokens > ctx => Err(ApiError::context_length(
            format!(
                "this model's context is {ctx} tokens; the prompt has {prompt} tokens and max_tokens is \
                 {max_tokens} ({} in all): shorten the prompt or lower max_tokens",
                prompt + max_tokens
            ),
            param,
        )),
        _ => Ok(()),
    }
}

/// [`sample`], each row finished into a choice (its text cut at a stop string or EOS).
fn sample_choices(
    shared: &Shared,
    prompts: &[Vec<u32>],
    s: &Sampling,
    max_tokens: usize,
) -> Result<Vec<Choice>, ApiError> {
    sample(shared, prompts, s, max_tokens)?
        .into_iter()
        .map(|row| respond::finish_row(&shared.tokenizer, &shared.eos, &s.stop, max_tokens, row))
        .collect()
}

/// Queues `n` rows per prompt and waits for the worker: row `i` (choice `i % n` of prompt
/// `i / n`) draws from the stream `row_seed(seed, i)`, as `rltune generate --seed S
/// --num-samples N` does.
fn sample(
    shared: &Shared,
    prompts: &[Vec<u32>],
    s: &Sampling,
    max_tokens: usize,
) -> Result<Vec<RowOut>, ApiError> {
    let seed =
        s.seed.unwrap_or_else(|| row_seed(shared.seed, shared.counter.fetch_add(1, Ordering::Relaxed)));
    let rows: Vec<Vec<u32>> = prompts.iter().flat_map(|p| std::iter::repeat_n(p.clone(), s.n)).collect();
    let seeds = (0..rows.len() as u64).map(|i| row_seed(seed, i)).collect();
    let params = if s.temperature == 0.0 {
        Params { max_tokens, temperature: 1.0, top_p: 1.0, top_k: 1, min_p: 0.0 }
    } else {
        Params { max_tokens, temperature: s.temperature, top_p: s.top_p, top_k: s.top_k, min_p: s.min_p }
    };
    let (reply, answer) = mpsc::channel();
    let job = Job { prompts: rows, seeds, params, top_logprobs: s.logprobs.unwrap_or(0), reply };
    let sender =
        shared.jobs.lock().map_err(|_| ApiError::internal("the server's queue is poisoned".into()))?.clone();
    let Some(sender) = sender else {
        return Err(ApiError::unavailable("the server is shutting down".into()));
    };
    match sender.try_send(job) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            return Err(ApiError::unavailable("the server's queue is full (--max-queue); retry later".into()))
        }
        Err(TrySendError::Disconnected(_)) => {
            return Err(ApiError::unavailable("the model worker has stopped".into()))
        }
    }
    drop(sender);
    answer.recv().map_err(|_| ApiError::internal("the model worker stopped before answering".into()))?
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
