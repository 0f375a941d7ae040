//! `rltune serve` (issue #57, item 2) on loopback with the PPO fixture's tiny GPT-2: the API's
//! answers against `rltune generate`, batching under concurrent load, every error case, curl,
//! Ctrl-C, and the `openai` Python client (tools/openai/client_test.py; skipped loudly when
//! `.venv-openai` is absent, required with `RLTUNE_REQUIRE_OPENAI=1`).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;
use common::http::{post, raw, request, send_and_leave, tiny_chat_model, Served};

const NAME: &str = "tiny-gpt2";

fn ids(v: &Value) -> Vec<u64> {
    v.as_array().unwrap_or_else(|| panic!("not a list: {v}")).iter().map(|x| x.as_u64().unwrap()).collect()
}

/// `rltune generate … --json` lines.
fn generate(model: &Path, args: &[&str]) -> Vec<Value> {
    let mut all = vec!["generate", "--model", model.to_str().unwrap(), "--json"];
    all.extend_from_slice(args);
    let out = common::rltune(&all);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn completions_and_chat_answer_what_generate_samples() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(tmp.path(), NAME);
    let server = Served::start(&model, &[]);
    let models = request(&server.addr, "GET", "/v1/models", None);
    assert_eq!(models.status, 200, "{}", models.body);
    assert_eq!(models.json()["data"][0]["id"], NAME);
    assert_eq!(request(&server.addr, "GET", &format!("/v1/models/{NAME}"), None).json()["id"], NAME);

    // Completions: n = 2 with a seed are `rltune generate --seed 7 --num-samples 2`.
    let body = json!({"model": NAME, "prompt": "hello", "max_tokens": 8, "n": 2, "seed": 7, "logprobs": 3});
    let a = post(&server.addr, "/v1/completions", &body);
    assert_eq!(a.status, 200, "{}", a.body);
    let v = a.json();
    assert_eq!(v["object"], "text_completion");
    let want = generate(
        &model,
        &["--prompt", "hello", "--seed", "7", "--num-samples", "2", "--max-new-tokens", "8"],
    );
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    let mut completion_tokens = 0;
    for (c, g) in choices.iter().zip(&want) {
        assert_eq!(ids(&c["token_ids"]), ids(&g["response_ids"]), "{c}");
        assert_eq!(c["logprobs"]["token_logprobs"], g["logprobs"], "the sampled distribution's logprobs");
        assert_eq!(c["text"], g["text"]);
        assert_eq!(ids(&c["prompt_token_ids"]), ids(&g["query_ids"]));
        let n = ids(&c["token_ids"]).len();
        let ends_in_eos = ids(&c["token_ids"]).last() == Some(&0);
        assert_eq!(c["finish_reason"], if ends_in_eos { "stop" } else { "length" }, "{c}");
        let top = c["logprobs"]["top_logprobs"].as_array().unwrap();
        assert_eq!((top.len(), c["logprobs"]["tokens"].as_array().unwrap().len()), (n, n));
        for (pos, alts) in top.iter().enumerate() {
            let mut lps: Vec<f64> = alts.as_object().unwrap().values().map(|x| x.as_f64().unwrap()).collect();
            assert!(!lps.is_empty() && lps.len() <= 3, "{alts}");
            lps.sort_by(|a, b| b.total_cmp(a));
            let sampled = c["logprobs"]["token_logprobs"][pos].as_f64().unwrap();
            assert!(sampled <= lps[0] + 1e-4, "no alternative is below the sampled token's best: {alts}");
        }
        completion_tokens += n;
    }
    let prompt_tokens = ids(&want[0]["query_ids"]).len();
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
               "total_tokens": prompt_tokens + completion_tokens})
    );

    // Chat: the template applied as `generate --chat` applies it; logprobs with alternatives.
    let body = json!({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                      "seed": 1, "logprobs": true, "top_logprobs": 2, "temperature": 0.7});
    let v = post(&server.addr, "/v1/chat/completions", &body).json();
    let want = generate(
        &model,
        &["--prompt", "hi", "--chat", "--seed", "1", "--max-new-tokens", "6", "--temperature", "0.7"],
    );
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(ids(&v["prompt_token_ids"]), ids(&want[0]["query_ids"]));
    let c = &v["choices"][0];
    assert_eq!(ids(&c["token_ids"]), ids(&want[0]["response_ids"]), "{v}");
    assert_eq!(c["message"]["role"], "assistant");
    assert_eq!(c["message"]["content"], want[0]["text"]);
    let content = c["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), ids(&c["token_ids"]).len());
    for (e, lp) in content.iter().zip(want[0]["logprobs"].as_array().unwrap()) {
        assert_eq!(&e["logprob"], lp);
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 2, "{e}");
        assert_eq!(e["bytes"], json!(e["token"].as_str().unwrap().as_bytes()));
    }

    // Greedy decoding is deterministic without a seed; a stop string ends the text before it.
    let greedy = json!({"model": NAME, "prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0});
    let g1 = post(&server.addr, "/v1/completions", &greedy).json();
    let g2 = post(&server.addr, "/v1/completions", &greedy).json();
    assert_eq!(g1["choices"][0]["token_ids"], g2["choices"][0]["token_ids"]);
    let text = g1["choices"][0]["text"].as_str().unwrap().to_string();
    let stop = text.chars().skip(2).find(|c| !c.is_whitespace() && *c != '\u{fffd}');
    if let Some(stop) = stop {
        let mut body = greedy.clone();
        body["stop"] = json!([stop.to_string(), "never-in-the-text"]);
        let s = post(&server.addr, "/v1/completions", &body).json()["choices"][0].clone();
        let cut = &text[..text.find(stop).unwrap()];
        assert_eq!((s["text"].as_str().unwrap(), s["finish_reason"].as_str().unwrap()), (cut, "stop"), "{s}");
        let n = ids(&s["token_ids"]).len();
        assert!(n <= ids(&g1["choices"][0]["token_ids"]).len(), "the ids end with the stop string's token");
        assert_eq!(ids(&s["token_ids"])[..], ids(&g1["choices"][0]["token_ids"])[..n]);
    }
}

#[test]
fn concurrent_requests_are_batched_and_answer_what_each_draws_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(tmp.path(), NAME);
    // A wide batching window, so that requests sent together share a batch.
    let server = Served::start(&model, &["--batch-wait-ms", "300"]);
    let body = |seed: u64| json!({"model": NAME, "prompt": "the same prompt", "max_tokens": 10, "seed": seed, "logprobs": 0});
    let threads: Vec<_> = (0..8u64)
        .map(|seed| {
            let addr = server.addr.clone();
            std::thread::spawn(move || post(&addr, "/v1/completions", &body(seed)))
        })
        .collect();
    let together: Vec<Value> = threads
        .into_iter()
        .map(|t| {
            let a = t.join().unwrap();
            assert_eq!(a.status, 200, "{}", a.body);
            a.json()
        })
        .collect();
    let most = server.metric("rltune_batch_requests_max");
    assert!(most >= 2, "8 concurrent requests were never batched (most per batch: {most})");
    assert!(server.metric("rltune_batches_total") < 8);
    // One at a time: the same ids and logprobs for each seed.
    for (seed, t) in together.iter().enumerate() {
        let alone = post(&server.addr, "/v1/completions", &body(seed as u64)).json();
        assert_eq!(t["choices"][0]["token_ids"], alone["choices"][0]["token_ids"], "seed {seed}");
        assert_eq!(
            t["choices"][0]["logprobs"]["token_logprobs"],
            alone["choices"][0]["logprobs"]["token_logprobs"]
        );
    }
    // Mixed prompts, lengths and settings at once: every answer well formed.
    let mixed: Vec<_> = (0..12u64)
        .map(|i| {
            let addr = server.addr.clone();
            std::thread::spawn(move || {
                let prompt = "x".repeat(1 + i as usize * 3);
                let temperature = [1.0, 0.5, 0.0][i as usize % 3];
                let body = json!({"model": NAME, "prompt": prompt, "max_tokens": 1 + i, "n": 1 + i % 3,
                                  "temperature": temperature, "top_p": 0.9});
                (i, post(&addr, "/v1/completions", &body))
            })
        })
        .collect();
    for t in mixed {
        let (i, a) = t.join().unwrap();
        assert_eq!(a.status, 200, "{}", a.body);
        let v = a.json();
        assert_eq!(v["choices"].as_array().unwrap().len() as u64, 1 + i % 3);
        for c in v["choices"].as_array().unwrap() {
            assert!(ids(&c["token_ids"]).len() as u64 <= 1 + i, "{c}");
        }
    }
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(tmp.path(), NAME);
    let server = Served::start(&model, &["--max-body-bytes", "4000"]);
    let a = &server.addr;
    let check =
        |ans: common::http::Answer, status: u16, param: Option<&str>, code: Option<&str>, text: &str| {
            assert_eq!(ans.status, status, "{}", ans.body);
            let e = &ans.json()["error"];
            assert_eq!(e["param"].as_str(), param, "{e}");
            assert_eq!(e["code"].as_str(), code, "{e}");
            assert!(e["message"].as_str().unwrap().contains(text), "{text:?} not in {e}");
        };
    check(request(a, "POST", "/v1/completions", Some("{\"model\": ")), 400, None, None, "not valid JSON");
    let base = json!({"model": NAME, "prompt": "hi"});
    let with = |k: &str, v: Value| {
        let mut b = base.clone();
        b[k] = v;
        b
    };
    check(
        post(a, "/v1/completions", &with("temprature", json!(1))),
        400,
        Some("temprature"),
        None,
        "unknown field",
    );
    check(
        post(a, "/v1/completions", &with("max_tokens", json!("8"))),
        400,
        Some("max_tokens"),
        None,
        "an integer",
    );
    check(
        post(a, "/v1/completions", &with("stream", json!(true))),
        400,
        Some("stream"),
        None,
        "not supported",
    );
    check(post(a, "/v1/completions", &with("echo", json!(true))), 400, Some("echo"), None, "not supported");
    check(post(a, "/v1/completions", &with("prompt", json!([1, 2, 288]))), 400, Some("prompt"), None, "288");
    check(
        post(a, "/v1/completions", &with("model", json!("gpt-4"))),
        404,
        Some("model"),
        Some("model_not_found"),
        "tiny-gpt2",
    );
    let long = with("prompt", json!("word ".repeat(40)));
    check(
        post(a, "/v1/completions", &long),
        400,
        Some("prompt"),
        Some("context_length_exceeded"),
        "context is 64 tokens",
    );
    check(
        post(a, "/v1/completions", &with("max_tokens", json!(64))),
        400,
        Some("prompt"),
        Some("context_length_exceeded"),
        "max_tokens is 64",
    );
    let chat = json!({"model": NAME, "messages": [{"role": "user", "content": "word ".repeat(40)}]});
    check(
        post(a, "/v1/chat/completions", &chat),
        400,
        Some("messages"),
        Some("context_length_exceeded"),
        "context",
    );
    check(
        post(a, "/v1/chat/completions", &json!({"model": NAME, "messages": "hi"})),
        400,
        Some("messages"),
        None,
        "list",
    );
    check(
        post(a, "/v1/completions", &with("prompt", json!("y".repeat(5000)))),
        413,
        None,
        Some("request_too_large"),
        "4000 bytes",
    );
    let wrong = request(a, "GET", "/v1/completions", None);
    assert!(wrong.headers.contains("allow: post"), "{}", wrong.headers);
    check(wrong, 405, None, Some("method_not_allowed"), "use POST");
    check(request(a, "POST", "/v1/models", Some("{}")), 405, None, Some("method_not_allowed"), "GET");
    check(request(a, "GET", "/v1/engines", None), 404, None, Some("unknown_url"), "/v1/completions");
    check(request(a, "GET", "/v1/models/other", None), 404, None, Some("model_not_found"), "other");
    check(raw(a, b"hello there\r\n\r\n"), 400, None, None, "malformed HTTP request");
    let ok = post(a, "/v1/completions", &base);
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(server.metric("rltune_http_errors_total"), 17, "each error above, counted once");
}

#[test]
fn clients_that_disconnect_do_not_stop_the_server() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(tmp.path(), NAME);
    let server = Served::start(&model, &[]);
    let a = &server.addr;
    // Headers promising 500 bytes, 10 sent, then gone.
    let partial =
        format!("POST /v1/completions HTTP/1.1\r\nHost: {a}\r\nContent-Length: 500\r\n\r\n{{\"model\":");
    send_and_leave(a, partial.as_bytes());
    // A whole request, gone before the answer (the worker samples it, and drops the answer).
    let body = json!({"model": NAME, "prompt": "bye", "max_tokens": 40, "n": 4}).to_string();
    let whole =
        format!("POST /v1/completions HTTP/1.1\r\nHost: {a}\r\nContent-Length: {}\r\n\r\n{body}", body.len());
    for _ in 0..3 {
        send_and_leave(a, whole.as_bytes());
    }
    // Connected, nothing sent.
    send_and_leave(a, b"");
    let deadline = Instant::now() + Duration::from_secs(60);
    while server.metric("rltune_requests_total") < 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(server.metric("rltune_requests_total"), 3, "the abandoned requests were sampled");
    let ok = post(a, "/v1/completions", &json!({"model": NAME, "prompt": "still there?", "max_tokens": 3}));
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(request(a, "GET", "/health", None).json()["status"], "ok");
}

/// One request on an open keep-alive connection; the answer's body.
fn on_connection(s: &mut std::net::TcpStream, method: &str, path: &str, body: &str) -> String {
    use std::io::{BufRead, BufReader, Read, Write};
    let req = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}", body.len());
    s.write_all(req.as_bytes()).unwrap();
    let mut reader = BufReader::new(s);
    let mut length = 0;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if line.trim().is_empty() {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            length = v.trim().parse().unwrap();
        }
    }
    let mut out = vec![0u8; length];
    reader.read_exact(&mut out).unwrap();
    String::from_utf8(out).unwrap()
}

/// Regression: on tiny_http, whose pool serves each open connection on one of its threads, a
/// burst of new connections could stay queued behind the idle keep-alive ones that a client
/// pool holds open (the `openai` client: 4 of 8 concurrent requests waited for its 120 s
/// timeout). Here: 8 clients at once, each keeping its connection open, then reusing it.
#[test]
fn a_burst_of_keep_alive_clients_is_served_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(tmp.path(), NAME);
    let server = Served::start(&model, &[]);
    for round in 0..3 {
        let started = Instant::now();
        let burst: Vec<_> = (0..8)
            .map(|i| {
                let addr = server.addr.clone();
                std::thread::spawn(move || {
                    let mut s = std::net::TcpStream::connect(&addr).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                    let body = json!({"model": NAME, "prompt": "x", "seed": i}).to_string();
                    let answer = on_connection(&mut s, "POST", "/v1/completions", &body);
                    assert!(answer.contains("token_ids"), "{answer}");
                    s
                })
            })
            .collect();
        let mut open: Vec<std::net::TcpStream> = burst.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(started.elapsed() < Duration::from_secs(30), "round {round} took {:?}", started.elapsed());
        for s in &mut open {
            assert!(
                on_connection(s, "GET", "/v1/models", "").contains(NAME),
                "a kept connection serves again"
            );
        }
    }
}

#[test]
fn curl_drives_the_server() {
    if Command::new("curl").arg("--version").stdout(Stdio::null()).status().is_err() {
        assert!(std::env::var_os("RLTUNE_REQUIRE_CURL").is_none(), "curl is not installed");
        eprintln!("SKIPPED: curl is not installed");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(tmp.path(), NAME);
    let server = Served::start(&model, &[]);
    let curl = |args: &[&str]| {
        let out = Command::new("curl").args(["-sS", "--max-time", "60"]).args(args).output().unwrap();
        assert!(out.status.success(), "curl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let url = format!("http://{}/v1", server.addr);
    // Over 1 KiB, so that curl sends `Expect: 100-continue` first.
    let body = json!({"model": NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
                      "user": "u".repeat(2000)});
    let chat = curl(&[
        "-H",
        "Content-Type: application/json",
        "-d",
        &body.to_string(),
        &format!("{url}/chat/completions"),
    ]);
    let v: Value = serde_json::from_str(&chat).unwrap();
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    let code =
        curl(&["-o", "/dev/null", "-w", "%{http_code}", "-d", "{not json", &format!("{url}/completions")]);
    assert_eq!(code, "400");
    let models: Value = serde_json::from_str(&curl(&[&format!("{url}/models")])).unwrap();
    assert_eq!(models["data"][0]["id"], NAME);
}

#[test]
fn ctrl_c_finishes_and_exits_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(tmp.path(), NAME);
    let mut server = Served::start(&model, &[]);
    assert_eq!(post(&server.addr, "/v1/completions", &json!({"model": NAME, "prompt": "a"})).status, 200);
    let kill = Command::new("kill").args(["-INT", &server.pid().to_string()]).status().unwrap();
    assert!(kill.success());
    let status = server.wait_exit(Duration::from_secs(30)).expect("rltune serve exits within 30 s of Ctrl-C");
    assert!(status.success(), "{status:?}:\n{}", server.stderr.lock().unwrap());
    assert!(server.stderr.lock().unwrap().contains("stopped"));
}

/// tools/openai/client_test.py with the `openai` package from PyPI (tools/openai/install.sh).
#[test]
fn the_openai_python_client_works_against_the_server() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = std::env::var("RLTUNE_OPENAI_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| root.join(".venv-openai/bin/python"));
    if !python.exists() {
        let why = format!(
            "SKIPPED: the openai client test needs {} (run tools/openai/install.sh, or set RLTUNE_OPENAI_PYTHON)",
            python.display()
        );
        assert!(std::env::var_os("RLTUNE_REQUIRE_OPENAI").is_none(), "{why}");
        eprintln!("{why}");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(tmp.path(), NAME);
    let server = Served::start_logging(&model, &["--batch-wait-ms", "200"], "debug");
    let mut child = Command::new(&python)
        .arg(root.join("tools/openai/client_test.py"))
        .args(["--base-url", &format!("http://{}/v1", server.addr), "--model", NAME])
        .env("NO_PROXY", "127.0.0.1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(240);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("client_test.py ran over 240 s; the server's log:\n{}", server.stderr.lock().unwrap());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{stdout}");
    if !status.success() {
        panic!(
            "client_test.py failed:\n{stdout}\n{stderr}\nthe server's log:\n{}",
            server.stderr.lock().unwrap()
        );
    }
    assert!(stdout.contains("client_test.py: all checks passed"), "{stdout}");
    assert!(server.metric("rltune_batch_requests_max") >= 2, "the client's concurrent requests were batched");
}
