//! GFLOP/s of `rltune_kernels::matmul` (the AVX-512 or AVX2 SGEMM of `gemm`) against candle's
//! `Tensor::matmul`, f32 on the CPU, for the shapes of a PPO step on the `small` preset.
//!
//! Each shape `M×K×N` (`(M, K)·(K, N)`) runs for at least 0.3 s after one warm-up call; the
//! median of 5 such batches is printed. `--trans` multiplies `A·Bᵀ` with `B` stored `(N, K)`
//! (nn.Linear's layout), `--trans-a` multiplies `Aᵀ·B` with `A` stored `(K, M)` (a weight
//! gradient). `--cold` cycles through 256 MiB of copies of B, so that each product reads B from
//! memory (as a training step reads each weight). `--shapes 128x768x3072,…` replaces the list. `--bf16` runs rltune's products at `MatmulPrecision::Bf16` (AMX tiles;
//! the last column then shows the bf16 rounding). Thread count: `RAYON_NUM_THREADS` (both
//! libraries use rayon's pool).
//!
//! ```sh
//! CANDLE_NUM_THREADS=1 RAYON_NUM_THREADS=1 cargo run --release -p rltune --example bench_gemm
//! CANDLE_NUM_THREADS=1 RAYON_NUM_THREADS=2 cargo run --release -p rltune --example bench_gemm
//! ```

use std::time::Instant;

use candle_core::{Device, Tensor};

const SHAPES: [(usize, usize, usize); 18] = [
    (512, 256, 768),
    (512, 256, 256),
    (512, 1024, 256),
    (512, 256, 8192),
    (8192, 512, 256),
    (2048, 2048, 2048),
    (16, 768, 50257),
    (128, 768, 2304),
    (128, 768, 50257),
    (128, 768, 768),
    (128, 768, 3072),
    (128, 3072, 768),
    (96, 50257, 768),
    (16, 768, 2304),
    (16, 3072, 768),
    (32, 768, 3072),
    (64, 256, 768),
    (64, 1024, 256),
];

/// Median GFLOP/s of `f` over 5 batches of ≥ 0.3 s.
fn gflops(flops: f64, mut f: impl FnMut()) -> f64 {
    f();
    let mut rates: Vec<f64> = (0..5)
        .map(|_| {
            let start = Instant::now();
            let mut n = 0;
            while start.elapsed().as_secs_f64() < 0.3 {
                f();
                n += 1;
            }
            flops * n as f64 / start.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[2]
}

fn main() -> candle_core::Result<()> {
    rltune_kernels::cpu::flush_denormals();
    let args: Vec<String> = std::env::args().collect();
    let trans = args.iter().any(|a| a == "--trans");
    let trans_a = args.iter().any(|a| a == "--trans-a");
    let cold = args.iter().any(|a| a == "--cold");
    let shapes: Vec<(usize, usize, usize)> = match args.iter().position(|a| a == "--shapes") {
        Some(i) => args
            .get(i + 1)
            .expect("--shapes takes M×K×N[,M×K×N…]")
            .split(',')
            .map(|s| {
                let d: Vec<usize> = s
                    .split(['x', '×'])
                    .map(|d| d.parse().expect("--shapes: a dimension is not a number"))
                    .collect();
                assert_eq!(d.len(), 3, "--shapes: {s:?} is not M×K×N");
                (d[0], d[1], d[2])
            })
            .collect(),
        None => SHAPES.to_vec(),
    };
    if std::env::args().any(|a| a == "--bf16") {
        rltune_kernels::set_matmul_precision(rltune_kernels::MatmulPrecision::Bf16).expect("bf16");
    }
    let threads = rayon::current_num_threads();
    println!(
        "threads {threads}, A {}, B {}",
        if trans_a { "transposed (K, M)" } else { "row-major (M, K)" },
        if trans { "transposed (N, K)" } else { "row-major (K, N)" }
    );
    println!("| M×K×N | rltune GFLOP/s | candle GFLOP/s | speed-up | max rel diff |");
    println!("|---|---|---|---|---|");
    for (m, k, n) in shapes {
        let a = if trans_a {
            Tensor::randn(0f32, 1.0, (k, m), &Device::Cpu)?.t()?
        } else {
            Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?
        };
        let new_b = || {
            if trans {
                Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?.t()
            } else {
                Tensor::randn(0f32, 1.0, (k, n), &Device::Cpu)
            }
        };
        // With --cold, enough copies of B (at least 256 MiB) that each product reads its B from
        // memory, as a PPO step reads each weight once per pass.
        let copies = if cold { (256 << 20) / (4 * k * n) + 1 } else { 1 };
        let bs = (0..copies).map(|_| new_b()).collect::<candle_core::Result<Vec<_>>>()?;
        let b = &bs[0];
        let flops = 2.0 * (m * k * n) as f64;
        let mut i = 0;
        let ours = gflops(flops, || {
            i += 1;
            drop(rltune_kernels::matmul(&a, &bs[i % copies]).expect("matmul"))
        });
        let theirs = gflops(flops, || {
            i += 1;
            drop(a.matmul(&bs[i % copies]).expect("matmul"))
        });
        let (y, yc) = (rltune_kernels::matmul(&a, b)?, a.matmul(b)?);
        let diff = (&y - &yc)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        let scale = yc.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        println!("| {m}×{k}×{n} | {ours:.0} | {theirs:.0} | {:.2}× | {:.1e} |", ours / theirs, diff / scale);
    }
    Ok(())
}
