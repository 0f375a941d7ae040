//! With the `cuda` feature: compiles the CUDA twins of the fused kernels (`src/cuda/*.cu`) to
//! PTX, which `src/cuda.rs` embeds. nvcc is `$RLTUNE_REAL_NVCC` (set where candle's own kernels
//! are stubbed for a type check: ours are small and are compiled for real), else `$NVCC`, else
//! `nvcc` on the PATH; the target is `compute_$CUDA_COMPUTE_CAP` (default 90: H100, H200),
//! loaded by the driver's JIT on that generation and newer.
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/cuda");
    for var in ["RLTUNE_REAL_NVCC", "NVCC", "CUDA_COMPUTE_CAP"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var("RLTUNE_REAL_NVCC")
        .or_else(|_| std::env::var("NVCC"))
        .unwrap_or_else(|_| "nvcc".into());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let mut sources: Vec<PathBuf> = std::fs::read_dir("src/cuda")
        .expect("src/cuda: the CUDA sources")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    for src in sources {
        let stem = src.file_stem().and_then(|s| s.to_str()).expect("a .cu file name");
        let ptx = out.join(format!("{stem}.ptx"));
        compile(&nvcc, &cap, &src, &ptx);
    }
}

fn compile(nvcc: &str, cap: &str, src: &Path, ptx: &Path) {
    let status = Command::new(nvcc)
        .args(["--ptx", &format!("-arch=compute_{cap}"), "-O3", "--fmad=false", "-std=c++17", "-o"])
        .arg(ptx)
        .arg(src)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{nvcc} failed on {} ({s}); see its output above", src.display()),
        Err(e) => panic!(
            "cannot run nvcc ({nvcc}: {e}) to compile {}: the `cuda` feature needs the CUDA \
             toolkit; tools/cuda/build.sh installs it from PyPI and sets NVCC",
            src.display()
        ),
    }
}
