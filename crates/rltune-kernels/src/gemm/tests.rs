use super::prepack::packed_copies;
use super::*;

fn data(len: usize, seed: u64) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen_range(-1.0..1.0)).collect()
}

/// The vector kernels this CPU can run (each is tested, not only the one `sgemm` picks).
fn kernels() -> Vec<Isa> {
    #[cfg(target_arch = "x86_64")]
    {
        let mut v = vec![];
        if is_x86_feature_detected!("avx512f") {
            v.push(Isa::Avx512);
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            v.push(Isa::Avx2);
        }
        v
    }
    #[cfg(not(target_arch = "x86_64"))]
    vec![]
}

/// Max |x − y| / (1 + |y|) between our product and the f64 triple loop, over `sgemm` and
/// every kernel of [`kernels`] run directly.
fn check(a: MatRef, b: MatRef, bias: Option<&[f32]>, accumulate: bool) -> f32 {
    let (m, n) = (a.rows, b.cols);
    let init = data(m * n, 9);
    let fresh = || if accumulate { init.clone() } else { vec![f32::NAN; m * n] };
    let mut results = vec![{
        let mut c = fresh();
        sgemm(a, b, &mut c, bias, accumulate);
        c
    }];
    #[cfg(target_arch = "x86_64")]
    for isa in kernels() {
        let mut c = fresh();
        if m > 0 && n > 0 && a.cols > 0 {
            // SAFETY: the CPU has `isa`; the views are in bounds and c has m × n values.
            unsafe { x86::sgemm(isa, a, b, c.as_mut_ptr(), bias, accumulate) };
        } else {
            sgemm(a, b, &mut c, bias, accumulate);
        }
        results.push(c);
    }
    let mut worst = 0f32;
    for i in 0..m {
        for j in 0..n {
            let mut s = 0f64;
            for p in 0..a.cols {
                s += a.at(i, p) as f64 * b.at(p, j) as f64;
            }
            if accumulate {
                s += init[i * n + j] as f64;
            } else if let Some(bias) = bias {
                s += bias[j] as f64;
            }
            for ours in &results {
                let d = (ours[i * n + j] as f64 - s).abs() / (1.0 + s.abs());
                worst = worst.max(if d.is_nan() { f32::INFINITY } else { d as f32 });
            }
        }
    }
    worst
}

#[test]
fn odd_shapes_match_the_triple_loop() {
    for &(m, k, n) in &[
        (1, 1, 1),
        (17, 33, 65),
        (14, 256, 32),
        (15, 257, 33),
        (3, 600, 2),
        (100, 7, 1000),
        (6, 16, 16),
        (7, 513, 17),
        // Row-major B packed inside the tasks (one row chunk, several depth blocks), and
        // packed up front (more than one row chunk).
        (40, 600, 50),
        (150, 300, 70),
    ] {
        let a = data(m * k, 1);
        let b = data(k * n, 2);
        let bias = data(n, 3);
        let (a, b) = (MatRef::row_major(&a, m, k), MatRef::row_major(&b, k, n));
        for (bias, acc) in [(None, false), (Some(&bias[..]), false), (None, true)] {
            // On 2 threads, as on the dev machines: with many threads the small shapes
            // split their rows and would skip the one-row-chunk path.
            let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("thread pool");
            let d = pool.install(|| check(a, b, bias, acc));
            assert!(d < 1e-5, "{m}×{k}×{n} bias {} acc {acc}: {d}", bias.is_some());
        }
    }
}

#[test]
fn transposed_a_packed_once_for_several_column_ranges_matches_the_triple_loop() {
    // A column-major (a weight gradient's `xᵀ`): with more than one column range per row
    // range, A is packed once up front and shared by the tasks; partial tiles, several depth
    // blocks, a partial last panel.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("thread pool");
    for &(m, k, n) in &[(256, 300, 768), (97, 513, 300), (7, 40, 1000)] {
        let a = data(k * m, 1);
        let b = data(k * n, 2);
        let bias = data(n, 3);
        let (a, b) = (MatRef::row_major(&a, k, m).t(), MatRef::row_major(&b, k, n));
        let s = split(m, n, k, 2, (6, 16));
        assert!(n.div_ceil(16).div_ceil(s.col_panels) > 1, "{m}×{k}×{n}: one column range");
        for (bias, acc) in [(None, false), (Some(&bias[..]), false), (None, true)] {
            let d = pool.install(|| check(a, b, bias, acc));
            assert!(d < 1e-5, "{m}×{k}×{n} bias {} acc {acc}: {d}", bias.is_some());
        }
    }
}

#[test]
fn products_on_prepacked_weights_equal_the_packing_ones() {
    use candle_core::{CpuStorage, Device, Storage, Tensor};
    // On the test's thread: the scope is a thread's. Row-major B (a Conv1D weight) and
    // column-major B (a transposed nn.Linear weight or LM head); several depth blocks and a
    // partial last panel.
    for (k, n, transposed) in [(300, 70, false), (300, 70, true), (513, 17, false)] {
        let shape = if transposed { (n, k) } else { (k, n) };
        let w = Tensor::from_vec(data(k * n, 2), shape, &Device::Cpu).expect("tensor");
        let other = Tensor::from_vec(data(k * n, 4), shape, &Device::Cpu).expect("tensor");
        let run = |w: &Tensor, m: usize, bias: Option<&[f32]>, acc: bool| -> Vec<f32> {
            let (st, _) = w.storage_and_layout();
            let Storage::Cpu(CpuStorage::F32(v)) = &*st else { panic!("f32 CPU tensor") };
            let b = if transposed { MatRef::row_major(v, n, k).t() } else { MatRef::row_major(v, k, n) };
            let a_data = data(m * k, 1);
            let a = MatRef::row_major(&a_data, m, k);
            if acc {
                let mut c = data(m * n, 9);
                sgemm(a, b, &mut c, None, true);
                c
            } else {
                sgemm_new(a, b, bias)
            }
        };
        let bias = data(n, 3);
        let cases = [(None, false), (Some(&bias[..]), false), (None, true)];
        let plain: Vec<Vec<f32>> =
            [16, 40, 100].iter().flat_map(|&m| cases.map(|(b, acc)| run(&w, m, b, acc))).collect();
        let other_plain = run(&other, 40, None, false);
        let scope = pack_scope(std::slice::from_ref(&w));
        assert_eq!(packed_copies(), Some(0));
        let mut packed = Vec::new();
        for m in [16, 40, 100] {
            for (b, acc) in cases {
                packed.push(run(&w, m, b, acc));
            }
            // One copy from the first product on, whatever its rows.
            let want = usize::from(isa().is_some());
            assert_eq!(packed_copies(), Some(want), "{k}×{n} transposed {transposed}, m = {m}");
        }
        assert!(run(&other, 40, None, false) == other_plain, "an unregistered B's product changed");
        assert_eq!(packed_copies(), Some(usize::from(isa().is_some())));
        // Without the scope, column-major B at up to 128 rows is multiplied transposed, which
        // adds the bias (or C) after the last depth block instead of the first: the same
        // products, rounded in another order.
        let tol = if transposed { 1e-6 } else { 0.0 };
        let check = |x: &[f32], y: &[f32], what: &str| {
            let worst = x.iter().zip(y).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0f32, f32::max);
            assert!(worst <= tol, "{k}×{n} transposed {transposed}, {what}: differs by {worst}");
        };
        for (i, (x, y)) in packed.iter().zip(&plain).enumerate() {
            check(x, y, &format!("case {i}"));
        }
        drop(scope);
        assert_eq!(packed_copies(), None);
        // The next scope packs `other` (the same size) into the dropped scope's buffer, over
        // `w`'s values.
        let spares = prepack::spare_count;
        assert_eq!(spares(), usize::from(isa().is_some()));
        let scope = pack_scope(std::slice::from_ref(&other));
        check(&run(&other, 40, None, false), &other_plain, "a reused buffer");
        assert_eq!(spares(), 0);
        drop(scope);
        assert_eq!(spares(), usize::from(isa().is_some()));
    }
}

/// Runs `run(a, b, bias, seen)` on 2 threads for the epilogue tests' shapes — one row chunk
/// with several depth blocks (B packed in the tasks), several row chunks (B packed up front),
/// a weight gradient's transposed A, partial tiles everywhere; with and without a bias —
/// where `run` records each value its epilogue sees into `seen` (value, times seen), then
/// checks that every value was seen once with `sgemm`'s bits; returns what `run` returned
/// for each case, with `sgemm`'s result.
fn each_value_once<R: Send>(
    run: impl Fn(MatRef, MatRef, Option<&[f32]>, &std::sync::Mutex<(Vec<f32>, Vec<u32>)>) -> R + Sync,
) -> Vec<(R, Vec<f32>)> {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("thread pool");
    let mut out = Vec::new();
    for (m, k, n, a_transposed) in [
        (1, 1, 1, false),
        (40, 600, 50, false),
        (150, 300, 70, false),
        (200, 96, 130, true),
        (13, 5, 700, true),
    ] {
        let a_data = data(m * k, 1);
        let b_data = data(k * n, 2);
        let a = match a_transposed {
            true => MatRef::row_major(&a_data, k, m).t(),
            false => MatRef::row_major(&a_data, m, k),
        };
        let b = MatRef::row_major(&b_data, k, n);
        let bias_data = data(n, 3);
        for bias in [None, Some(&bias_data[..])] {
            let mut want = vec![0f32; m * n];
            pool.install(|| sgemm(a, b, &mut want, bias, false));
            let seen = std::sync::Mutex::new((vec![f32::NAN; m * n], vec![0u32; m * n]));
            let r = pool.install(|| run(a, b, bias, &seen));
            let (got, count) = seen.into_inner().unwrap();
            assert!(
                count.iter().all(|&s| s == 1),
                "{m}×{k}×{n}: a value handed over {:?} times",
                count.iter().max()
            );
            let same = got.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{m}×{k}×{n}, bias {}: the epilogue's values differ from sgemm's", bias.is_some());
            out.push((r, want));
        }
    }
    out
}

#[test]
fn epilogue_gets_every_block_once_with_the_products_values() {
    each_value_once(|a, b, bias, seen| {
        let n = b.cols;
        sgemm_epilogue(a, b, bias, &|i0, rows, j0, cols, block, ld| {
            let mut s = seen.lock().unwrap();
            for r in 0..rows {
                for c in 0..cols {
                    s.0[(i0 + r) * n + j0 + c] = block[r * ld + c];
                    s.1[(i0 + r) * n + j0 + c] += 1;
                }
            }
        })
    });
}

#[test]
fn row_epilogue_sees_every_row_segment_once_in_place() {
    // The epilogue records what it saw, then doubles the row in place.
    let cases = each_value_once(|a, b, bias, seen| {
        let n = b.cols;
        let mut c = vec![f32::NAN; a.rows * n];
        let cp = SendPtr(c.as_mut_ptr());
        // SAFETY: `c` has m × n values and nothing else touches it during the call.
        unsafe {
            sgemm_rows_then(a, b, bias, cp.get(), &|i, j0, row| {
                let mut s = seen.lock().unwrap();
                for (j, v) in row.iter_mut().enumerate() {
                    s.0[i * n + j0 + j] = *v;
                    s.1[i * n + j0 + j] += 1;
                    *v *= 2.0;
                }
            })
        };
        c
    });
    for (c, want) in cases {
        let kept = c.iter().zip(&want).all(|(x, y)| x.to_bits() == (2.0 * y).to_bits());
        assert!(kept, "{} values: the epilogue's writes did not stay in C", c.len());
    }
}

#[test]
fn transposed_and_strided_operands() {
    let (m, k, n) = (37, 300, 45);
    // Stored transposed: aᵀ is k × m row-major, bᵀ is n × k row-major.
    let at = data(k * m, 4);
    let bt = data(n * k, 5);
    let a = MatRef::row_major(&at, k, m).t();
    let b = MatRef::row_major(&bt, n, k).t();
    let a_rm = data(m * k, 6);
    let b_rm = data(k * n, 7);
    for (a, b) in [(a, b), (a, MatRef::row_major(&b_rm, k, n)), (MatRef::row_major(&a_rm, m, k), b)] {
        assert!(check(a, b, None, false) < 1e-5);
    }
    // Column-major B wider than A is computed as (Bᵀ·Aᵀ)ᵀ: bias and accumulation, a
    // generation-like single row, and a wide matrix (several transpose blocks).
    let bias = data(n, 11);
    let a_rm = MatRef::row_major(&a_rm, m, k);
    for (bias, acc) in [(Some(&bias[..]), false), (None, true)] {
        assert!(check(a_rm, b, bias, acc) < 1e-5);
    }
    let (k2, n2) = (64, 100);
    let bt2 = data(n2 * k2, 12);
    let b2 = MatRef::row_major(&bt2, n2, k2).t();
    let a_row = data(k2, 13);
    assert!(check(MatRef::row_major(&a_row, 1, k2), b2, None, false) < 1e-5);
    let a_wide = data(40 * k2, 14);
    assert!(check(MatRef::row_major(&a_wide, 40, k2), b2, None, true) < 1e-5);
    // A strided view: every other row and column of a larger matrix, from an offset.
    let big = data(3 + 2 * m * 2 * k, 8);
    let a = MatRef { data: &big, off: 3, rows: m, cols: k, rs: 4 * k, cs: 2 };
    let b = MatRef { data: &big, off: 1, rows: k, cols: n, rs: 3, cs: 2 * k + 1 };
    assert!(check(a, b, None, false) < 1e-5);
}

/// A read in place (row-major: the assembly loop of the AVX-512 kernel) and packed (the
/// same values stored column-major) give the same bits: both add each product in depth
/// order. Depths cover the unrolled 16-step blocks, their remainder and several `KC` blocks.
#[test]
fn a_in_place_and_packed_give_the_same_bits() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("thread pool");
    for &(m, k, n) in &[(28, 16, 32), (42, 37, 64), (30, 600, 40), (14, 5, 32)] {
        let a = data(m * k, 21);
        let at: Vec<f32> = (0..k * m).map(|x| a[(x % m) * k + x / m]).collect();
        let b = data(k * n, 22);
        let b = MatRef::row_major(&b, k, n);
        #[cfg(target_arch = "x86_64")]
        for isa in kernels() {
            let run = |a: MatRef| {
                let mut c = vec![f32::NAN; m * n];
                // SAFETY: the CPU has `isa`; the views are in bounds and c has m × n values.
                pool.install(|| unsafe { x86::sgemm(isa, a, b, c.as_mut_ptr(), None, false) });
                c
            };
            let in_place = run(MatRef::row_major(&a, m, k));
            let packed = run(MatRef::row_major(&at, k, m).t());
            let same = in_place.iter().zip(&packed).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{isa:?} {m}×{k}×{n}");
        }
    }
}

#[test]
fn empty_and_zero_depth() {
    let a: Vec<f32> = vec![];
    let mut c = vec![1f32; 6];
    sgemm(MatRef::row_major(&a, 2, 0), MatRef::row_major(&a, 0, 3), &mut c, Some(&[1.0, 2.0, 3.0]), false);
    assert_eq!(c, vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
    sgemm(MatRef::row_major(&a, 0, 0), MatRef::row_major(&a, 0, 3), &mut [], None, false);
}

#[test]
fn splits_cover_the_output() {
    for &(m, n, k, t) in &[
        (512, 768, 256, 2),
        (64, 8192, 256, 2),
        (1, 1, 1, 2),
        (8192, 256, 512, 2),
        (5, 5, 5, 1),
        (128, 3072, 768, 2),
        (384, 8192, 256, 2),
        (496, 1024, 256, 2),
    ] {
        for (mr, nr) in [(14, 32), (6, 16)] {
            let s = split(m, n, k, t, (mr, nr));
            assert!(s.row_tiles >= 1 && s.col_panels >= 1);
            assert!(s.row_tiles <= ONE_ROW_CHUNK_WIDE && s.col_panels <= 32);
            let (mt, nt) = (m.div_ceil(mr), n.div_ceil(nr));
            // A wide B (the LM head's forward) keeps up to ONE_ROW_CHUNK_WIDE tiles in one
            // chunk; others up to ONE_ROW_CHUNK.
            let one = mt <= ONE_ROW_CHUNK || (n >= 8 * m && mt <= ONE_ROW_CHUNK_WIDE);
            assert_eq!(s.row_tiles == mt, one, "{m}×{k}×{n} on ({mr}, {nr}): {s:?}");
            // Even chunks: padding the last one to full size takes fewer tiles than there
            // are chunks (22 tiles are 2 × 11, not 16 + 6).
            assert!(mt.div_ceil(s.row_tiles) * s.row_tiles - mt < mt.div_ceil(s.row_tiles));
            assert!(nt.div_ceil(s.col_panels) * s.col_panels - nt < nt.div_ceil(s.col_panels));
        }
    }
}

#[test]
fn a_large_a_is_cut_into_one_task_per_thread() {
    let tasks = |s: Split, m: usize, n: usize| m.div_ceil(14 * s.row_tiles) * n.div_ceil(32 * s.col_panels);
    // GPT-2's LM head backward: A (96 × 50257) is read once per column range.
    let (m, n, k): (usize, usize, usize) = (96, 768, 50257);
    assert!(14 * m.div_ceil(14) * k > BIG_A_ROWS);
    assert_eq!(tasks(split(m, n, k, 2, (14, 32)), m, n), 2);
    // A small enough to stay in L2: about four tasks per thread.
    let (m, n, k): (usize, usize, usize) = (128, 2304, 768);
    assert!(14 * m.div_ceil(14) * k <= BIG_A_ROWS);
    assert!(tasks(split(m, n, k, 2, (14, 32)), m, n) >= 8);
}
