//! File helpers: atomic writes, JSON reading with errors that name the file.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Writes a file through `write(tmp_path)`, then renames it over `path`.
///
/// A crash mid-write leaves the old file (or none), never a truncated one. `E` is the caller's
/// error type: `write`'s errors come back as they are.
pub fn write_atomic<F, E>(path: &Path, write: F) -> std::result::Result<(), E>
where
    F: FnOnce(&Path) -> std::result::Result<(), E>,
    E: From<Error>,
{
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let tmp: PathBuf = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let res = write(&tmp).and_then(|()| Ok(plain_file_mode(&tmp)?));
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return res;
    }
    Ok(std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?)
}

/// The files of one model.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    /// The directory (local, or the hub cache snapshot).
    pub dir: PathBuf,
    /// `config.json`
    pub config: PathBuf,
    /// The safetensors files holding the weights.
    pub weights: Vec<PathBuf>,
    /// `tokenizer.json`, when present.
    pub tokenizer: Option<PathBuf>,
    /// `generation_config.json`, when present.
    pub generation_config: Option<PathBuf>,
}

/// Fills a fresh temporary directory with `fill`, then moves it to `dir` (replacing it). `E`
/// is the caller's error type: `fill`'s errors come back as they are.
pub fn save_dir_atomic<F, E>(dir: &Path, fill: F) -> std::result::Result<(), E>
where
    F: FnOnce(&Path) -> std::result::Result<(), E>,
    E: From<Error>,
{
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    let name = dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_else(|| "model".into());
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    if let Err(e) = fill(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let old = parent.join(format!(".{name}.old-{}", std::process::id()));
    if dir.exists() {
        std::fs::rename(dir, &old).map_err(|e| Error::io(dir, e))?;
    }
    std::fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))?;
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
    }
    Ok(())
}

/// Gives `path` the mode a new plain file gets under the process umask (`0666 & !umask`), as
/// transformers' `save_pretrained` files have: writers that go through a `tempfile` (the
/// safetensors crate does) leave 0600, which other users of a shared machine cannot read.
fn plain_file_mode(path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = 0o666 & !process_umask();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| Error::io(path, e))?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// The process umask, read from `/proc/self/status` (Linux ≥ 4.7; changing it to read it
/// would race with other threads); 0o022 where that is unavailable.
#[cfg(unix)]
fn process_umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Umask:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        })
        .unwrap_or(0o022)
}

/// Writes `tensors` to `path` as safetensors, atomically and with the plain file mode.
pub fn save_safetensors(
    path: &Path,
    tensors: &std::collections::HashMap<String, candle_core::Tensor>,
) -> Result<()> {
    write_atomic(path, |tmp| {
        candle_core::safetensors::save(tensors, tmp)
            .map_err(|e| Error::weights(tmp, format!("cannot write safetensors: {e}")))
    })
}

/// Writes `bytes` to `path` atomically.
pub fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic(path, |tmp| std::fs::write(tmp, bytes).map_err(|e| Error::io(tmp, e)))
}

/// Reads and parses a JSON file; parse errors name the file, line and column.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::config(path, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (issue #28, defect 5): safetensors files were left with tempfile's 0600.
    #[cfg(unix)]
    #[test]
    fn written_files_get_the_umask_mode_not_0600() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let t = candle_core::Tensor::zeros(3, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        save_safetensors(&path, &[("w".to_string(), t)].into_iter().collect()).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o666 & !process_umask(), "mode {mode:o}");
        if process_umask() & 0o044 == 0 {
            assert_ne!(mode & 0o044, 0, "readable by group and others");
        }
    }
}
