//! Reading user data: rollout files for `ppo-step` and `grpo-step`/`rloo-step`, prompt datasets.

pub mod chat;
pub mod files;
pub mod group_rollouts;
pub(crate) mod hub;
pub mod prompts;
pub mod rollouts;
pub mod rows;

use std::path::Path;

use crate::error::{Error, Result};

/// Reads a text file that must be UTF-8. Invalid bytes are reported with their 1-based line and
/// the fix, where `std::fs::read_to_string` names neither.
pub(crate) fn read_utf8(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let bytes = e.as_bytes();
        let line = bytes[..at].iter().filter(|&&b| b == b'\n').count() + 1;
        let col = at - bytes[..at].iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1) + 1;
        Error::data(
            format!("{} line {line}", path.display()),
            format!(
                "byte {col} of the line (0x{:02x}) is not valid UTF-8; rltune reads text files as \
                 UTF-8: re-encode the file, e.g. `iconv -f latin1 -t utf-8 IN > OUT`",
                bytes[at]
            ),
        )
    })
}
