//! Reward programs that misbehave. Extends the unit tests in `rewards/command.rs` (a crash after
//! one answer, a timeout after one answer, a word instead of a number) and the CLI's
//! `command_reward_faults_are_reported_and_nan_batches_skipped` (a program that dies, one that
//! sleeps): every case here is bounded by the batch timeout, or by the program's own end.

use std::time::{Duration, Instant};

use rltune::rewards::{CommandReward, RewardInput, RewardSource};

use super::{assert_contains_all, err_msg};

/// `sh -c script` with a batch timeout of `timeout_ms`.
fn sh(script: &str, timeout_ms: u64) -> CommandReward {
    CommandReward::spawn(vec!["sh".into(), "-c".into(), script.into()])
        .unwrap()
        .with_timeout(Some(Duration::from_millis(timeout_ms)))
}

fn batch(n: usize) -> Vec<RewardInput<'static>> {
    (0..n).map(|_| RewardInput::text("a query", "a response")).collect()
}

/// Scores one batch of `n`, failing unless it errs within `limit`; the message.
fn score_err(r: &mut CommandReward, n: usize, limit: Duration) -> String {
    let start = Instant::now();
    let err = err_msg(r.score(&batch(n)), "scoring with a faulty program");
    assert!(start.elapsed() < limit, "took {:?}:\n{err}", start.elapsed());
    err
}

#[test]
fn faulty_reward_programs_fail_the_batch_with_a_clear_error() {
    let cases: [(&str, &str, &[&str]); 8] = [
        (
            "crashes at start, before reading",
            "echo 'cannot load reward model' >&2; exit 7",
            &["after answering 0 of 2", "exit status: 7", "cannot load reward model"],
        ),
        ("never reads nor answers", "sleep 30", &["timed out", "sample 0 of 2", "0 answered"]),
        ("answers invalid UTF-8", r"read l; printf '\377\376\n'", &["answer line 1", "not a number"]),
        ("answers a JSON array", "read l; echo '[0.5]'", &["answer line 1", "\"[0.5]\"", "an array"]),
        (
            "answers half a line, then exits",
            "read l; printf '0.7'",
            &["\"0.7\"", "middle of a line", "exit status: 0"],
        ),
        (
            "answers a 100 MB line",
            "read l; head -c 100000000 /dev/zero | tr '\\0' 7; echo",
            &["longer than", "one short line"],
        ),
        ("answers an endless line", "read l; tr '\\0' 7 < /dev/zero", &["longer than", "one short line"]),
        ("answers on stderr", "while read l; do echo 1 >&2; done", &["timed out", "sample 0 of 2"]),
    ];
    for (name, script, parts) in cases {
        println!("--- {name}");
        let mut r = sh(script, 2000);
        let err = score_err(&mut r, 2, Duration::from_secs(8));
        assert_contains_all(&err, &["reward command(sh -c"]);
        assert_contains_all(&err, parts);
        assert!(err.len() < 4000, "{name}: the message quotes too much ({} bytes)", err.len());
        let start = Instant::now();
        drop(r);
        assert!(start.elapsed() < Duration::from_secs(2), "{name}: dropping took {:?}", start.elapsed());
    }
}

#[test]
fn program_that_exits_after_some_good_batches_is_reported_then_refused() {
    // Answers three samples, then exits cleanly in the middle of the second batch.
    let mut r = sh("for i in 1 2 3; do read l; echo $i; done; echo 'quota exhausted' >&2", 5000);
    assert_eq!(r.score(&batch(2)).unwrap(), vec![1.0, 2.0]);
    let err = score_err(&mut r, 2, Duration::from_secs(5));
    assert_contains_all(&err, &["after answering 1 of 2", "exit status: 0", "quota exhausted"]);
    let again = score_err(&mut r, 1, Duration::from_secs(1));
    assert_contains_all(&again, &["unusable after an earlier error", "start a new one"]);
}

#[test]
fn program_that_does_not_read_a_large_batch_times_out_and_drops() {
    // 2000 samples of 1 KB fill the pipe; the writer thread blocks, and the timeout still fires.
    let long = "x".repeat(1024);
    let inputs: Vec<RewardInput<'_>> = (0..2000).map(|_| RewardInput::text("q", &long)).collect();
    let mut r = sh("sleep 30", 500);
    let start = Instant::now();
    let err = err_msg(r.score(&inputs), "scoring with a program that never reads");
    assert_contains_all(&err, &["timed out", "sample 0 of 2000"]);
    drop(r);
    assert!(start.elapsed() < Duration::from_secs(4), "took {:?}", start.elapsed());
}
