//! `rltune serve`: the policy behind an OpenAI-compatible HTTP API.
//!
//! `POST /v1/completions`, `POST /v1/chat/completions` (the model's chat template), `GET
//! /v1/models`, plus `GET /health` and `GET /metrics` (batching counters, Prometheus' text
//! format). Every choice carries its `token_ids` (and the prompt's, `prompt_token_ids`), as vLLM
//! returns them, and `logprobs` are those of the distribution sampled from: what an RL trainer
//! needs from a rollout server. docs/running.md documents the API.
//!
//! The HTTP side is a thread per connection over `httparse`, hyper's request parser ([`http`]);
//! one worker thread owns the model and batches whatever is queued ([`worker`]). An async stack
//! (axum, tokio, hyper) would add about a hundred crates to a clean build for nothing here: all
//! the work is the one model thread's, and the handlers only parse, tokenize and wait.
//!
//! It listens on 127.0.0.1 by default; there is no authentication, so `--host 0.0.0.0` exposes
//! the model to the network.

mod api;
mod error;
mod handlers;
mod http;
mod respond;
mod worker;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use rltune::models::chat_template::ChatTemplate;
use rltune::models::load::{load_policy_adapted, LoraSpec};
use rltune::tokenizer::Tokenizer;

use handlers::Shared;
use worker::{Stats, Worker};

/// Arguments of `rltune serve`.
#[derive(clap::Args)]
pub struct Args {
    /// Model directory (Hugging Face layout, with tokenizer.json), GGUF file or hub id.
    #[arg(long)]
    model: String,
    /// A LoRA adapter directory (PEFT's format, or an rltune run with [lora]) applied to --model.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// The address to listen on (loopback by default: there is no authentication).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// The port (0: any free one; the address is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model id clients send and /v1/models lists (default: the model path's last part).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Rows (prompts × n) sampled in one batch at most.
    #[arg(long, default_value_t = 32)]
    max_batch_size: usize,
    /// After the first queued request, how long the worker waits for more to batch with it (ms).
    #[arg(long, default_value_t = 2)]
    batch_wait_ms: u64,
    /// Requests waiting for the model at most; more are answered 503.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Open connections at most (one thread each); more are answered 503.
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
    /// The largest request body read, in bytes; larger ones are answered 413.
    #[arg(long, default_value_t = 8 << 20)]
    max_body_bytes: usize,
    /// The seed from which requests without a `seed` get theirs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    runtime: crate::runtime::RuntimeArgs,
}

/// The model id for `model`: its last path component, or the hub id as given.
fn default_name(model: &str) -> String {
    let path = Path::new(model);
    match path.exists().then(|| path.file_name()).flatten() {
        Some(name) => name.to_string_lossy().into_owned(),
        None => model.trim_end_matches('/').to_string(),
    }
}

/// Runs `rltune serve` until Ctrl-C.
pub fn run(args: Args) -> Result<()> {
    if args.max_batch_size == 0 || args.max_queue == 0 || args.max_connections == 0 {
        anyhow::bail!("--max-batch-size, --max-queue and --max-connections must be at least 1");
    }
    let runtime = args.runtime.resolve(Default::default())?;
    let device = runtime.device().clone();
    let adapter = args.adapter.as_ref().map(LoraSpec::from_dir);
    let policy = load_policy_adapted(&args.model, None, adapter.as_ref(), false, runtime.dtype(), &device)
        .with_context(|| format!("cannot load model {:?}", args.model))?;
    let Some(tokenizer_path) = &policy.files.tokenizer else {
        anyhow::bail!("{} has no tokenizer.json, which rltune serve needs", policy.files.dir.display());
    };
    let tokenizer = Tokenizer::from_file(tokenizer_path)?;
    let lm = policy.model.lm;
    tokenizer.check_fits(lm.vocab_size())?;
    let template = ChatTemplate::for_model_dir(&policy.files.dir)?;
    if template.is_none() {
        tracing::warn!("the model has no chat template: /v1/chat/completions will answer 400");
    }
    let stats = Arc::new(Stats::default());
    let (jobs, queue) = mpsc::sync_channel(args.max_queue);
    let context = lm.config().max_positions();
    let shared = Arc::new(Shared {
        served_name: args.served_model_name.clone().unwrap_or_else(|| default_name(&args.model)),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        tokenizer,
        template,
        vocab: lm.vocab_size(),
        context,
        eos: lm.config().eos_token_ids(),
        jobs: Mutex::new(Some(jobs)),
        stats: stats.clone(),
        counter: AtomicU64::new(0),
        seed: args.seed,
    });
    let worker = Worker {
        lm,
        device,
        max_batch: args.max_batch_size,
        batch_wait: Duration::from_millis(args.batch_wait_ms),
        context,
        stats,
    };
    let worker = std::thread::Builder::new()
        .name("rltune-model".into())
        .spawn(move || worker.run(queue))
        .context("cannot start the model worker")?;

    let listener = TcpListener::bind((args.host.as_str(), args.port))
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let addr = listener.local_addr().context("cannot read the listening address")?;
    // Polled, so that Ctrl-C is noticed between connections.
    listener.set_nonblocking(true).context("cannot set up the listening socket")?;
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    ctrlc::set_handler(move || {
        if s.swap(true, Ordering::SeqCst) {
            eprintln!("\ninterrupted twice: exiting now");
            std::process::exit(130);
        }
        eprintln!("\nCtrl-C: finishing the requests in flight, then exiting (Ctrl-C again to abort)");
    })
    .context("cannot install the Ctrl-C handler")?;
    // On stdout, for scripts and tests started with --port 0.
    println!("rltune serve: `{}` listening on http://{addr}/v1", shared.served_name);
    tracing::info!("serving {} as `{}` on http://{addr}/v1", args.model, shared.served_name);

    let active = Arc::new(AtomicUsize::new(0));
    while !stop.load(Ordering::SeqCst) {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => {
                tracing::warn!("accepting a connection failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if active.load(Ordering::SeqCst) >= args.max_connections {
            let busy =
                error::ApiError::unavailable("too many connections at once (--max-connections)".into());
            let mut stream = stream;
            let _ = stream.set_nonblocking(false);
            let _ = http::write_response(&mut stream, &handlers::error_response(&shared, &busy, ""), false);
            continue;
        }
        active.fetch_add(1, Ordering::SeqCst);
        let (shared, active, stop) = (shared.clone(), active.clone(), stop.clone());
        let max_body = args.max_body_bytes;
        let spawned = std::thread::Builder::new().name("rltune-http".into()).spawn(move || {
            // Counted down however the connection ends.
            let _done = Done(&active);
            let handler = |r: &http::HttpRequest| handlers::handle(&shared, r);
            let error = |status: u16, why: String| {
                let e = match status {
                    413 => error::ApiError::too_large(max_body),
                    _ => error::ApiError { status, ..error::ApiError::bad(why, None) },
                };
                handlers::error_response(&shared, &e, "")
            };
            http::serve_connection(stream, max_body, &stop, &handler, &error);
        });
        if let Err(e) = spawned {
            tracing::error!("cannot start a connection thread: {e}");
        }
    }
    drop(listener);
    shut_down(&shared, &active, worker)
}

/// Decrements a counter when dropped.
struct Done<'a>(&'a AtomicUsize);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Stops taking requests, lets the worker answer the queued ones, and waits for the connections
/// (idle ones end within a fraction of a second).
fn shut_down(shared: &Shared, active: &AtomicUsize, worker: std::thread::JoinHandle<()>) -> Result<()> {
    if let Ok(mut jobs) = shared.jobs.lock() {
        jobs.take();
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while active.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    worker.join().map_err(|_| anyhow!("the model worker panicked"))?;
    tracing::info!("stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::default_name;

    #[test]
    fn the_default_model_id_is_the_last_path_part_or_the_hub_id() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("my-model");
        std::fs::create_dir(&model).unwrap();
        assert_eq!(default_name(model.to_str().unwrap()), "my-model");
        assert_eq!(default_name(&format!("{}/", model.display())), "my-model");
        assert_eq!(default_name("HuggingFaceTB/SmolLM2-135M"), "HuggingFaceTB/SmolLM2-135M");
    }
}
