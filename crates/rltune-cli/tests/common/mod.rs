//! Helpers shared by the CLI's test binaries (each uses some of them).
#![allow(dead_code)]

pub mod http;

use std::path::PathBuf;
use std::process::{Command, Output};

/// `tools/fixtures/<rel>` in the repository.
pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures").join(rel)
}

/// Runs `rltune ARGS…` offline (a hub cache that cannot reach the network), logging warnings;
/// fails on a panic, and on ANSI colour codes in the captured (non-terminal) stderr.
pub fn rltune(args: &[&str]) -> Output {
    let hf_home = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_rltune"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HOME", hf_home.path())
        .env("RUST_LOG", "warn")
        .output()
        .expect("run rltune");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "rltune panicked:\n{stderr}");
    // Regression (issue #28, defect 6): logs to a pipe were coloured with raw ESC[…m codes.
    assert!(!stderr.contains('\u{1b}'), "ANSI escape codes in logs that are not on a terminal:\n{stderr}");
    out
}
