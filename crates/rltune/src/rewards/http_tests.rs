use std::time::{Duration, Instant};

use serde_json::json;

use super::*;
use crate::rewards::test_server::{Reply, TestServer};

fn fast(max_retries: usize) -> RetryPolicy {
    RetryPolicy { timeout: Duration::from_millis(500), max_retries, backoff: Duration::from_millis(10) }
}

fn batch(n: usize) -> Vec<RewardInput<'static>> {
    let responses = ["a", "bb", "ccc", "dddd", "eeeee"];
    (0..n).map(|i| RewardInput::text("q", responses[i % 5])).collect()
}

/// Scores each sample by its completion's length.
fn lengths(body: &Value) -> Value {
    let scores: Vec<usize> = body["samples"]
        .as_array()
        .map(|s| s.iter().map(|x| x["completion"].as_str().unwrap_or("").len()).collect())
        .unwrap_or_default();
    json!({"scores": scores})
}

#[test]
fn scores_in_requests_of_batch_size_with_the_documented_schema() {
    let server = TestServer::start(|_, body| Reply::json(200, lengths(body)));
    let mut r = HttpReward::new(&format!("{}/score", server.url)).unwrap().with_batch_size(2).unwrap();
    assert_eq!(r.name(), format!("http({}/score)", server.url));
    let meta = json!({"answer": 4});
    let mut b = batch(5);
    b[0].meta = &meta;
    assert_eq!(r.score(&b).unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0]);
    let seen = server.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "5 samples in requests of 2");
    let (path, headers, first) = &seen[0];
    assert_eq!(path, "/score");
    assert_eq!(
        first["samples"],
        json!([{"index": 0, "prompt": "q", "completion": "a", "meta": {"answer": 4}},
               {"index": 1, "prompt": "q", "completion": "bb", "meta": null}])
    );
    let id = first["request_id"].as_str().unwrap();
    assert!(headers.contains(&format!("idempotency-key: {}", id.to_ascii_lowercase())), "{headers}");
    assert_ne!(seen[1].2["request_id"], first["request_id"], "each request has its own id");
}

#[test]
fn a_failed_attempt_is_retried_whole_with_the_same_id_and_counted_once() {
    // The first attempt fails with 503 after the service has "seen" it; the retry succeeds.
    let server = TestServer::start(|n, body| {
        if n == 0 {
            Reply::json(503, json!({"error": "warming up"}))
        } else {
            Reply::json(200, lengths(body))
        }
    });
    let mut r = HttpReward::new(&server.url).unwrap().with_policy(fast(2));
    assert_eq!(r.score(&batch(3)).unwrap(), vec![1.0, 2.0, 3.0]);
    let bodies = server.bodies();
    assert_eq!(bodies.len(), 2);
    assert_eq!(bodies[0], bodies[1], "the retry re-sends the whole batch, same request_id");
}

#[test]
fn a_timed_out_attempt_is_retried_and_scores_come_from_one_answer() {
    // The first answer comes too late (and with wrong scores): only the retry's count.
    let server = TestServer::start(|n, body| {
        if n == 0 {
            Reply { delay: Duration::from_millis(1500), ..Reply::json(200, json!({"scores": [9, 9]})) }
        } else {
            Reply::json(200, lengths(body))
        }
    });
    let mut r = HttpReward::new(&server.url).unwrap().with_policy(fast(1));
    let t = Instant::now();
    assert_eq!(r.score(&batch(2)).unwrap(), vec![1.0, 2.0]);
    assert!(t.elapsed() < Duration::from_millis(1400), "the first attempt was cut at the timeout");
    let bodies = server.bodies();
    assert_eq!((bodies.len(), &bodies[0]), (2, &bodies[1]));
}

#[test]
fn errors_name_the_url_the_status_and_the_body() {
    // A plain-text body: only its first line is quoted.
    let server = TestServer::start(|_, _| Reply {
        body: "model crashed\nstack trace".into(),
        ..Reply::json(500, json!(null))
    });
    let mut r = HttpReward::new(&server.url).unwrap().with_policy(fast(2));
    let err = r.score(&batch(1)).unwrap_err().to_string();
    assert!(err.contains(&server.url) && err.contains("HTTP 500") && err.contains("model crashed"), "{err}");
    assert!(err.contains("after 3 attempts") && !err.contains("stack trace"), "{err}");
    assert_eq!(server.bodies().len(), 3, "the first attempt and two retries");

    // A 4xx is the request's fault: not retried.
    let server = TestServer::start(|_, _| Reply::json(422, json!({"detail": "missing field completion"})));
    let mut r = HttpReward::new(&server.url).unwrap().with_policy(fast(3));
    let err = r.score(&batch(1)).unwrap_err().to_string();
    assert!(
        err.contains("HTTP 422") && err.contains("missing field completion") && err.contains("not retried"),
        "{err}"
    );
    assert_eq!(server.bodies().len(), 1);

    // Nobody listening: a transport error, retried, then named.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}/score");
    let err = HttpReward::new(&url).unwrap().with_policy(fast(1)).score(&batch(1)).unwrap_err().to_string();
    assert!(err.contains(&url) && err.contains("after 2 attempts"), "{err}");
}

#[test]
fn retry_after_is_honoured() {
    let server = TestServer::start(|n, body| {
        if n == 0 {
            Reply {
                headers: vec![("Retry-After".into(), "0.3".into())],
                ..Reply::json(429, json!("slow down"))
            }
        } else {
            Reply::json(200, lengths(body))
        }
    });
    let t = Instant::now();
    let mut r = HttpReward::new(&server.url).unwrap().with_policy(fast(1));
    assert_eq!(r.score(&batch(1)).unwrap(), vec![1.0]);
    assert!(t.elapsed() >= Duration::from_millis(300), "{:?}", t.elapsed());
}

#[test]
fn answers_are_matched_by_index_and_checked() {
    assert_eq!(parse_scores(&json!({"scores": [1, null, -2.5]}), 3).unwrap()[2], -2.5);
    assert!(parse_scores(&json!({"scores": [1, null]}), 2).unwrap()[1].is_nan());
    let by_index = json!({"scores": [{"index": 1, "score": 7}, {"index": 0, "score": 3}]});
    assert_eq!(parse_scores(&by_index, 2).unwrap(), vec![3.0, 7.0]);
    for (answer, n, want) in [
        (json!({"score": [1]}), 1, "no \"scores\""),
        (json!({"scores": [1, 2]}), 3, "2 scores for 3"),
        (json!({"scores": ["high"]}), 1, "not a number"),
        (json!({"scores": [{"index": 0, "score": 1}, {"index": 0, "score": 2}]}), 2, "scored twice"),
        (json!({"scores": [{"index": 5, "score": 1}]}), 1, "no \"index\" below 1"),
    ] {
        let err = parse_scores(&answer, n).unwrap_err();
        assert!(err.contains(want), "{answer}: {err}");
    }
    // Through the source: the error names the URL and the expected schema.
    let server = TestServer::start(|_, _| Reply::json(200, json!({"scores": [1, 2, 3]})));
    let err = HttpReward::new(&server.url).unwrap().score(&batch(2)).unwrap_err().to_string();
    assert!(
        err.contains(&server.url) && err.contains("3 scores for 2 samples") && err.contains("in order"),
        "{err}"
    );
}

#[test]
fn config_values_are_checked() {
    assert!(HttpReward::new("ftp://x").unwrap_err().to_string().contains("http:// or https://"));
    assert!(HttpReward::new("http://x").unwrap().with_batch_size(0).is_err());
    let err = RetryPolicy::from_secs(-1.0, 3, 1.0, "reward http(x)").unwrap_err().to_string();
    assert!(err.contains("reward http(x)") && err.contains("timeout_s") && err.contains("-1"), "{err}");
    assert!(RetryPolicy::from_secs(f64::NAN, 3, 1.0, "r").is_err());
    assert!(RetryPolicy::from_secs(1.0, 3, -0.5, "r").unwrap_err().to_string().contains("backoff_s"));
    let p = RetryPolicy::from_secs(1.0, 3, 0.5, "r").unwrap();
    assert_eq!(
        (p.delay(0), p.delay(2), p.delay(40)),
        (Duration::from_millis(500), Duration::from_secs(2), MAX_BACKOFF)
    );
}
