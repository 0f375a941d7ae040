//! File helpers: atomic writes, JSON reading with errors that name the file.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Writes a file through `write(tmp_path)`, then renames it over `path`.
///
/// A crash mid-write leaves the old file (or none), never a truncated one.
pub fn write_atomic<F>(path: &Path, write: F) -> Result<()>
where
    F: FnOnce(&Path) -> Result<()>,
{
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let tmp: PathBuf = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let res = write(&tmp);
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return res;
    }
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
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
