//! The repository's own bookkeeping: every test file is compiled, every cited test exists.
//!
//! `tests/integration/train.rs` once sat beside `main.rs` without a `mod train;`, so its six
//! tests were never compiled (`every_test_file_belongs_to_a_test_target`). A doc cited a
//! `gradients` test file that did not exist (`cited_test_files_and_tests_exist`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The workspace root.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("workspace root")
}

/// Every file below `dir` (recursively) whose name ends with `ext`, skipping `target/` and dot folders.
fn files_with(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().to_string();
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                files_with(&path, ext, out);
            }
        } else if name.ends_with(ext) {
            out.push(path);
        }
    }
}

/// The crates of the workspace (folders under `crates/` with a Cargo.toml).
fn crates() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(root().join("crates"))
        .expect("crates/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("Cargo.toml").exists())
        .collect();
    out.sort();
    out
}

/// The root files of a crate's test targets: `[[test]] path = …` entries plus, unless
/// `autotests = false`, the `.rs` files directly in `tests/` (cargo's auto-discovery).
fn test_roots(krate: &Path) -> Vec<PathBuf> {
    let manifest = std::fs::read_to_string(krate.join("Cargo.toml")).expect("Cargo.toml");
    let mut roots = Vec::new();
    let mut in_test = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_test = line == "[[test]]";
        } else if in_test {
            if let Some(path) = line.strip_prefix("path").map(str::trim).and_then(|l| l.strip_prefix('=')) {
                roots.push(krate.join(path.trim().trim_matches('"')));
            }
        }
    }
    if !manifest.contains("autotests = false") {
        if let Ok(entries) = std::fs::read_dir(krate.join("tests")) {
            roots.extend(
                entries.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == "rs")),
            );
        }
    }
    roots
}

/// The files a module file declares with `mod name;` (not inline `mod name { … }`).
fn declared_modules(file: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string(file).expect("readable test file");
    let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
    // `main.rs`, `lib.rs` and `mod.rs` declare siblings; `foo.rs` declares files in `foo/`.
    let base =
        if matches!(stem, "main" | "lib" | "mod") || file.parent().is_some_and(|p| p.ends_with("tests")) {
            file.parent().expect("a parent").to_path_buf()
        } else {
            file.with_extension("")
        };
    text.lines()
        .map(str::trim)
        .filter_map(|l| l.strip_prefix("pub ").unwrap_or(l).strip_prefix("mod "))
        .filter_map(|l| l.strip_suffix(';'))
        .flat_map(|name| [base.join(format!("{name}.rs")), base.join(name).join("mod.rs")])
        .filter(|p| p.exists())
        .collect()
}

#[test]
fn every_test_file_belongs_to_a_test_target() {
    let mut orphans = Vec::new();
    for krate in crates() {
        let mut reachable = BTreeSet::new();
        let mut todo = test_roots(&krate);
        while let Some(file) = todo.pop() {
            if reachable.insert(file.clone()) {
                todo.extend(declared_modules(&file));
            }
        }
        let mut all = Vec::new();
        files_with(&krate.join("tests"), ".rs", &mut all);
        orphans.extend(all.into_iter().filter(|f| !reachable.contains(f)));
    }
    assert!(
        orphans.is_empty(),
        "these test files belong to no test target, so they are never compiled: {orphans:#?}\n\
         declare each with `mod name;` in its folder's main.rs, or add a [[test]] target"
    );
}

/// `(cited text, where)` for each `tests/….rs` path cited in the docs and sources.
fn cited_test_paths() -> Vec<(String, String)> {
    let mut files = Vec::new();
    for ext in [".rs", ".md", ".toml", ".sh", ".py"] {
        files_with(&root(), ext, &mut files);
    }
    let mut out = Vec::new();
    for file in files {
        let Ok(text) = std::fs::read_to_string(&file) else { continue };
        for (n, line) in text.lines().enumerate() {
            let mut rest = line;
            while let Some(at) = rest.find("tests/") {
                let tail = &rest[at..];
                let end =
                    tail.find(|c: char| !(c.is_alphanumeric() || "_/.-".contains(c))).unwrap_or(tail.len());
                let path = tail[..end].trim_end_matches('.');
                if path.ends_with(".rs") {
                    out.push((path.to_string(), format!("{}:{}", file.display(), n + 1)));
                }
                rest = &tail[end.max(1)..];
            }
        }
    }
    out
}

#[test]
fn cited_test_files_and_tests_exist() {
    let root = root();
    let mut all_tests = Vec::new();
    for krate in crates() {
        files_with(&krate.join("tests"), ".rs", &mut all_tests);
    }
    let mut missing = Vec::new();
    for (path, at) in cited_test_paths() {
        // A citation is a path from the root, from a crate, or the tail of one.
        let exists = root.join(&path).exists() || all_tests.iter().any(|t| t.ends_with(&path));
        if !exists {
            missing.push(format!("{at}: {path}"));
        }
    }
    // `module::test_name` citations in docs/: the module file must define that function.
    for doc in ["docs/trl-deviations.md", "docs/metrics.md", "README.md"] {
        let text = std::fs::read_to_string(root.join(doc)).unwrap_or_default();
        for word in text.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')) {
            let Some((module, test)) = word.split_once("::") else { continue };
            let file = root.join("crates/rltune/tests/integration").join(format!("{module}.rs"));
            if test.is_empty() || !file.exists() {
                continue;
            }
            let body = std::fs::read_to_string(&file).expect("readable");
            if !body.contains(&format!("fn {test}(")) {
                missing.push(format!("{doc}: {module}::{test}"));
            }
        }
    }
    assert!(missing.is_empty(), "cited tests that do not exist: {missing:#?}");
}

/// The library crates read no environment variable (issue #54): what they used to read comes
/// through `runtime::Host` (hub options, user, local rank, the secrets lookup) and
/// `Launch::from_lookup`. The one read kept by design is `ProcessSettings::install`'s
/// `CANDLE_NUM_THREADS` (`rltune-kernels/src/cpu.rs`). Unit-test modules (after a file's
/// `#[cfg(test)]`) and comments are not library code.
#[test]
fn the_library_reads_no_environment_variable() {
    let reads =
        ["env::var(", "env::var_os(", "env::vars(", "env::vars_os(", "env::set_var(", "env::remove_var("];
    let mut found = Vec::new();
    for krate in ["rltune", "rltune-models", "rltune-kernels", "rltune-envs", "rltune-dist"] {
        let mut files = Vec::new();
        files_with(&root().join("crates").join(krate).join("src"), ".rs", &mut files);
        for file in files {
            let rel = file.strip_prefix(root()).unwrap_or(&file).to_string_lossy().replace('\\', "/");
            if rel == "crates/rltune-kernels/src/cpu.rs" {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            for (i, line) in text.lines().enumerate() {
                if line == "#[cfg(test)]" {
                    break;
                }
                let code = line.trim_start();
                if !code.starts_with("//") && reads.iter().any(|r| code.contains(r)) {
                    found.push(format!("{rel}:{}: {code}", i + 1));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "the library reads the environment; take the value through runtime::Host (or a lookup the \
         caller passes) instead:\n{}",
        found.join("\n")
    );
}
