use super::*;
use crate as ops;
use crate::grad_sink::{GradSlot, SinkState};
use candle_core::Device;

/// Gradients holding `g` for the single variable `var`.
fn grads_of(var: &Var, g: Tensor) -> Grads {
    let mut grads = Grads::new(std::slice::from_ref(var));
    grads.add(0, &g).unwrap();
    grads
}

#[test]
fn adam_first_step_moves_each_weight_by_lr() {
    // With bias correction, step 1 moves every weight by lr·sign(g) (up to ε).
    let var = Var::from_tensor(&Tensor::new(&[1f32, -2.0, 3.0], &Device::Cpu).unwrap()).unwrap();
    let mut adam = Adam::new(vec![var.clone()], AdamConfig { lr: 0.1, ..Default::default() }).unwrap();
    adam.step(&grads_of(&var, Tensor::new(&[0.5f32, -3.0, 1e-3], &Device::Cpu).unwrap())).unwrap();
    let p = var.as_tensor().to_vec1::<f32>().unwrap();
    for (got, want) in p.iter().zip([0.9f32, -1.9, 2.9]) {
        assert!((got - want).abs() < 1e-4, "{got} vs {want}");
    }
    let err = adam.step(&Grads::new(&[])).unwrap_err().to_string();
    assert!(err.contains("gradients for 0 variables given to an optimizer over 1"), "{err}");
    let other = Var::new(&[0f32, 0.0, 0.0], &Device::Cpu).unwrap();
    let err = adam.step(&Grads::new(&[other])).unwrap_err().to_string();
    assert!(err.contains("build Grads from Adam::vars"), "{err}");
}

#[test]
fn inplace_update_equals_copy_update() {
    // An f64 variable takes the copy path (computed in f32, like the in-place f32 path).
    let init: Vec<f32> = (0..9000).map(|i| ((i as f32) * 0.37).sin()).collect();
    let dev = Device::Cpu;
    let a = Var::from_tensor(&Tensor::from_vec(init.clone(), (90, 100), &dev).unwrap()).unwrap();
    let b = Var::from_tensor(&Tensor::from_vec(init, (90, 100), &dev).unwrap().to_dtype(DType::F64).unwrap())
        .unwrap();
    let cfg = AdamConfig { lr: 0.01, ..Default::default() };
    let (mut oa, mut ob) =
        (Adam::new(vec![a.clone()], cfg).unwrap(), Adam::new(vec![b.clone()], cfg).unwrap());
    let (mut ga, mut gb) = (Grads::new(std::slice::from_ref(&a)), Grads::new(std::slice::from_ref(&b)));
    for s in 0..3 {
        let g: Vec<f32> = (0..9000).map(|i| ((i * (s + 2)) as f32 * 0.11).cos()).collect();
        let g = Tensor::from_vec(g, (90, 100), &dev).unwrap();
        ga.clear();
        gb.clear();
        ga.add(0, &g).unwrap();
        gb.add(0, &g.to_dtype(DType::F64).unwrap()).unwrap();
        oa.step(&ga).unwrap();
        ob.step(&gb).unwrap();
    }
    let pa = a.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let pb = b.as_tensor().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(pa, pb);
    let flat = |(m, v): (Tensor, Tensor)| {
        (
            m.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        )
    };
    assert_eq!(flat(oa.moments(0).unwrap()), flat(ob.moments(0).unwrap()));
}

/// Issue #30: the GPU's update (moments as device tensors, candle ops) against the fused CPU
/// one, on the CPU: the same weights and moments to float rounding, three steps in, and the
/// moments survive a checkpoint round trip.
#[test]
fn device_moments_update_like_the_fused_cpu_path() {
    let init = |seed: u64| crate::testutil::randn(&[37, 19], seed).to_dtype(DType::F32).unwrap();
    let vars = |_| vec![Var::from_tensor(&init(1)).unwrap(), Var::from_tensor(&init(2)).unwrap()];
    let (va, vb): (Vec<Var>, Vec<Var>) = (vars(0), vars(1));
    let cfg = AdamConfig { lr: 0.01, ..Default::default() };
    let mut oa = Adam::new(va.clone(), cfg).unwrap();
    let mut ob = Adam::with_device_moments(vb.clone(), cfg).unwrap();
    assert!(matches!(oa.moments[0], Moments::Host { .. }) && matches!(ob.moments[0], Moments::Device { .. }));
    let (mut ga, mut gb) = (Grads::new(&va), Grads::new(&vb));
    for step in 0..3u64 {
        ga.clear();
        gb.clear();
        for i in 0..2 {
            let g = (crate::testutil::randn(&[37, 19], 10 * step + i as u64).to_dtype(DType::F32).unwrap()
                * 0.1)
                .unwrap();
            ga.add(i, &g).unwrap();
            gb.add(i, &g).unwrap();
        }
        oa.step(&ga).unwrap();
        ob.step(&gb).unwrap();
    }
    let max_diff = |a: &Tensor, b: &Tensor| {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    };
    for i in 0..2 {
        let d = max_diff(va[i].as_tensor(), vb[i].as_tensor());
        assert!(d < 1e-6, "weights of variable {i}: max diff {d}");
        let moved = max_diff(va[i].as_tensor(), &init(i as u64 + 1));
        assert!(moved > 1e-3, "the update moved the weights ({moved})");
        let ((ma, sa), (mb, sb)) = (oa.moments(i).unwrap(), ob.moments(i).unwrap());
        assert!(max_diff(&ma, &mb) < 1e-6 && max_diff(&sa, &sb) < 1e-6, "moments of variable {i}");
    }
    let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (m, v): (Vec<_>, Vec<_>) =
        (0..2).map(|i| ob.moments(i).unwrap()).map(|(m, v)| (flat(m), flat(v))).unzip();
    let mut restored = Adam::with_device_moments(vb.clone(), cfg).unwrap();
    restored.restore(m.clone(), v, 3).unwrap();
    assert_eq!((flat(restored.moments(1).unwrap().0), restored.steps()), (m[1].clone(), 3));
    let err = restored.restore(vec![vec![0.0; 3]; 2], vec![vec![0.0; 3]; 2], 1).unwrap_err().to_string();
    assert!(err.contains("variable 0") && err.contains("703"), "{err}");
}

#[test]
fn clipping_scales_to_max_norm_in_buffers_and_tensors() {
    let dev = Device::Cpu;
    let vars = [
        Var::new(&[0f32, 0.0], &dev).unwrap(),
        Var::new(&[0f64], &dev).unwrap(),
        Var::new(&[0f32], &dev).unwrap(),
    ];
    let mut g = Grads::new(&vars);
    g.add(0, &Tensor::new(&[3f32, 0.0], &dev).unwrap()).unwrap();
    g.add(1, &Tensor::new(&[4f64], &dev).unwrap()).unwrap();
    assert!(g.has(0) && g.has(1) && !g.has(2));
    let n = g.clip_norm(1.0).unwrap();
    assert!((n - 5.0).abs() < 1e-9);
    let v0 = g.get(0).unwrap().unwrap().to_vec1::<f32>().unwrap();
    let v1 = g.get(1).unwrap().unwrap().to_vec1::<f64>().unwrap();
    assert!((v0[0] - 0.6).abs() < 1e-5 && v0[1] == 0.0 && (v1[0] - 0.8).abs() < 1e-5);
    assert!(g.get(2).unwrap().is_none());
    g.clear();
    assert!(!g.has(0) && !g.has(1));
}

/// The device path of the gradient norm (rows first, then their sums) equals the CPU's single
/// pass to f64 rounding, for every rank and for 1-D lengths that do and do not split in rows.
#[test]
fn the_norm_summed_by_rows_equals_the_single_pass() {
    let dev = Device::Cpu;
    let shapes: [&[usize]; 6] = [&[], &[5], &[3 * 1024], &[7, 300], &[3, 4, 1030], &[2, 3, 4, 5]];
    for (k, shape) in shapes.into_iter().enumerate() {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|i| ((i * 7919 + k * 31) % 1000) as f32 / 97.0 - 5.0).collect();
        let g = Tensor::from_vec(data.clone(), shape, &dev).unwrap();
        let by_rows = super::grads::sum_sq_by_rows(&g).unwrap();
        assert_eq!(by_rows.rank(), 0, "shape {shape:?}");
        let by_rows = by_rows.to_scalar::<f64>().unwrap();
        let single: f64 = data.iter().map(|&x| x as f64 * x as f64).sum();
        assert!((by_rows - single).abs() <= 1e-12 * single, "shape {shape:?}: {by_rows} vs {single}");
    }
}

/// A tiny model through every op that writes into gradient buffers (the linear layers, layer
/// norm, the embedding and the LM head, tied), plus a candle matmul whose gradient arrives in
/// candle's store: two backward passes into [`Grads`] give the sums of candle's own gradients.
#[test]
fn buffered_gradients_equal_candle_gradients() {
    let dev = Device::Cpu;
    let r = |shape: &[usize], seed| {
        let t = crate::testutil::randn(shape, seed).to_dtype(DType::F32).unwrap();
        Var::from_tensor(&t).unwrap()
    };
    let (wte, w1, b1, w2, lnw, lnb, vh) =
        (r(&[11, 8], 1), r(&[8, 8], 2), r(&[8], 3), r(&[8, 8], 4), r(&[8], 5), r(&[8], 6), r(&[8, 1], 7));
    let vars = [wte.clone(), w1.clone(), b1.clone(), w2.clone(), lnw.clone(), lnb.clone(), vh.clone()];
    let ids = Tensor::new(&[[1u32, 4, 4, 9], [0, 10, 3, 1]], &dev).unwrap();
    let targets = Tensor::new(&[2u32, 5, 5, 1, 7, 0, 3, 3], &dev).unwrap();
    let slot = GradSlot::new();
    let loss = |scale: f64| {
        let x = ops::embedding_with(&wte, &ids, &slot).unwrap().reshape((8, 8)).unwrap();
        let x = ops::linear_with(&x, &w1, Some(&b1), &slot).unwrap();
        let x = ops::gelu_tanh(&x).unwrap();
        let x = ops::linear_in_out_with(&x, &w2, None, &slot).unwrap();
        let h = ops::layer_norm_with(&x, &lnw, &lnb, 1e-5, &slot).unwrap();
        let (lp, _) = ops::lm_head_logprobs_with(&h, &wte, &targets, None, 1.0, true, &slot).unwrap();
        let v = h.matmul(&vh).unwrap().sqr().unwrap().sum_all().unwrap();
        ((lp.sum_all().unwrap() + v).unwrap() * scale).unwrap()
    };
    let store = |scale| loss(scale).backward().unwrap();
    let (s1, s2) = (store(1.0), store(-0.5));
    let mut grads = Grads::new(&vars);
    grads.bind(&slot);
    {
        // The weights of the fused ops go to the buffers, the matmul's to candle's store.
        let s = loss(1.0).backward().unwrap();
        for (i, var) in vars.iter().enumerate() {
            assert_eq!(s.get(var).is_some(), i == 6, "variable {i} in candle's store");
        }
    }
    for _ in 0..2 {
        grads.clear();
        grads.backward(&loss(1.0)).unwrap();
        grads.backward(&loss(-0.5)).unwrap();
        for (i, var) in vars.iter().enumerate() {
            let want = (s1.get(var).unwrap() + s2.get(var).unwrap()).unwrap();
            let got = grads.get(i).unwrap().unwrap();
            let d = crate::testutil::max_diff(&got, &want);
            assert!(d < 1e-5, "variable {i}: max diff {d}");
        }
    }
}

/// A small model through the ops that write gradient buffers: a tied embedding / LM head
/// (two writes), an untied head, both linear layouts, a bias, layer norm and a candle
/// matmul (candle's store). `twice` runs `w1` a second time. The ops write their weights'
/// gradients where `slot` points; the embedding where `table` points (an unbound slot: the
/// table's rows go to candle's store, and the LM head's product cannot consume the table).
fn fused_model_loss(vars: &[Var], twice: bool, slot: &GradSlot, table: &GradSlot) -> Tensor {
    let dev = Device::Cpu;
    let [wte, w1, b1, w2, lnw, lnb, vh, wh] = vars else { panic!("8 variables") };
    let ids = Tensor::new(&[[1u32, 4, 4, 9], [0, 10, 3, 1]], &dev).unwrap();
    let targets = Tensor::new(&[2u32, 5, 5, 1, 7, 0, 3, 3], &dev).unwrap();
    let x = ops::embedding_with(wte, &ids, table).unwrap().reshape((8, 8)).unwrap();
    let mut x = ops::linear_with(&x, w1, Some(b1), slot).unwrap();
    if twice {
        x = ops::linear_with(&x, w1, None, slot).unwrap();
    }
    let x = ops::gelu_tanh(&x).unwrap();
    let x = ops::linear_in_out_with(&x, w2, None, slot).unwrap();
    let h = ops::layer_norm_with(&x, lnw, lnb, 1e-5, slot).unwrap();
    let (lp, _) = ops::lm_head_logprobs_with(&h, wte, &targets, None, 1.0, true, slot).unwrap();
    let (lp2, _) = ops::lm_head_logprobs_with(&h, wh, &targets, None, 1.0, true, slot).unwrap();
    let v = h.matmul(vh).unwrap().sqr().unwrap().sum_all().unwrap();
    ((lp.sum_all().unwrap() + lp2.sum_all().unwrap()).unwrap() + v).unwrap()
}

fn fused_model_vars() -> Vec<Var> {
    let shapes: [&[usize]; 8] = [&[11, 8], &[8, 8], &[8], &[8, 8], &[8], &[8], &[8, 1], &[11, 8]];
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let t = crate::testutil::randn(s, 20 + i as u64).to_dtype(DType::F32).unwrap();
            Var::from_tensor(&t).unwrap()
        })
        .collect()
}

/// Three steps of `backward` then `step` on one copy of the model and of `step_fused` on
/// another (its embedding bound to the gradients too with `held`, so that it holds the rows it
/// looks up), which must give the same bits; `check(step, grads)` looks at the fused side's
/// gradients after each step. Returns the fused side, and its slot.
fn unfused_and_fused_steps(held: bool, check: impl Fn(usize, &Grads)) -> (Adam, Vec<Var>, Grads, GradSlot) {
    let cfg = AdamConfig { lr: 1e-2, ..AdamConfig::default() };
    let (va, vb) = (fused_model_vars(), fused_model_vars());
    let (mut oa, mut ob) = (Adam::new(va.clone(), cfg).unwrap(), Adam::new(vb.clone(), cfg).unwrap());
    let (mut ga, mut gb) = (Grads::new(&va), Grads::new(&vb));
    let (sa, sb) = (GradSlot::new(), GradSlot::new());
    ga.bind(&sa);
    gb.bind(&sb);
    let table_a = if held { sa.clone() } else { GradSlot::new() };
    let table_b = if held { sb.clone() } else { GradSlot::new() };
    for step in 0..3 {
        ga.clear();
        ga.backward(&fused_model_loss(&va, false, &sa, &table_a)).unwrap();
        oa.step(&ga).unwrap();
        gb.clear();
        let ran = ob
            .step_fused(&mut gb, |g| {
                let loss = fused_model_loss(&vb, false, &sb, &table_b);
                g.backward(&loss)?;
                Ok::<_, Error>(true)
            })
            .unwrap();
        assert_eq!(ran, FusedStep::Updated);
        for (i, (a, b)) in va.iter().zip(&vb).enumerate() {
            let (a, b) = (
                a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "step {step}, variable {i} differs"
            );
        }
        check(step, &gb);
    }
    assert_eq!(oa.steps(), ob.steps());
    (ob, vb, gb, sb)
}

/// Per sink of `grads`, `flag` of its state (false without a sink).
fn sink_flags(grads: &Grads, flag: impl Fn(&SinkState) -> bool) -> Vec<bool> {
    grads.sinks.iter().map(|s| s.as_ref().is_some_and(|s| flag(&s.state()))).collect()
}

#[test]
fn fused_steps_equal_backward_then_step() {
    let (mut ob, vb, mut gb, _) = unfused_and_fused_steps(false, |step, gb| {
        // From the second step the single-product weights (w1, w2, the untied head) are
        // updated inside their products; the tied table (its rows went to candle's store), the
        // bias and the norm are not.
        let want = step > 0;
        let applied = sink_flags(gb, |s| s.applied);
        assert_eq!(applied, [false, want, false, want, false, false, false, want], "step {step}");
    });
    // A skipped backward changes nothing.
    let before = vb[1].flatten_all().unwrap().to_vec1::<f32>().unwrap();
    gb.clear();
    assert_eq!(ob.step_fused(&mut gb, |_| Ok::<_, Error>(false)).unwrap(), FusedStep::Skipped);
    assert_eq!(ob.steps(), 3);
    assert_eq!(vb[1].flatten_all().unwrap().to_vec1::<f32>().unwrap(), before);
}

/// Issue #28: a non-finite gradient never reaches the weights or the moments, in the fused
/// products (armed after the steps above) or in the update after the backward.
#[test]
fn a_non_finite_gradient_is_not_applied() {
    let (mut ob, vb, mut gb, slot) = unfused_and_fused_steps(false, |_, _| {});
    let flat = |v: &Var| v.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let before: Vec<Vec<f32>> = vb.iter().map(flat).collect();
    let host = |o: &Adam, i: usize| {
        let (m, v) = o.moments(i).unwrap();
        (
            m.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        )
    };
    let moments: Vec<(Vec<f32>, Vec<f32>)> = (0..vb.len()).map(|i| host(&ob, i)).collect();
    gb.clear();
    let ran = ob
        .step_fused(&mut gb, |g| {
            g.backward(&(fused_model_loss(&vb, false, &slot, &GradSlot::new()) * f64::INFINITY)?)?;
            Ok::<_, Error>(true)
        })
        .unwrap();
    assert_eq!(ran, FusedStep::NonFinite);
    assert_eq!(ob.steps(), 3, "no Adam step counted");
    for (i, v) in vb.iter().enumerate() {
        assert_eq!(flat(v), before[i], "variable {i} changed");
        assert_eq!(host(&ob, i), moments[i], "moments {i} changed");
    }
    assert!(!all_finite(&[1f32, f32::NAN]) && !all_finite(&[f32::NEG_INFINITY]) && all_finite(&[0f32; 100]));
}

#[test]
fn a_tied_table_with_held_rows_is_updated_in_its_product_with_the_same_bits() {
    unfused_and_fused_steps(true, |step, gb| {
        // From the second step the table (the LM head's product, then the embedding's
        // rows) is updated in its product but for the held rows.
        let partial = sink_flags(gb, |s| s.partial);
        assert_eq!(partial, [step > 0, false, false, false, false, false, false, false], "step {step}");
        if step > 0 {
            assert!(gb.get(0).unwrap().is_none(), "a partly consumed gradient is not handed out");
        }
    });
}

#[test]
fn a_second_gradient_after_a_fused_update_is_an_error() {
    let vars = fused_model_vars();
    let mut opt = Adam::new(vars.clone(), AdamConfig::default()).unwrap();
    let mut grads = Grads::new(&vars);
    let slot = GradSlot::new();
    grads.bind(&slot);
    let loss = |twice| fused_model_loss(&vars, twice, &slot, &slot);
    grads.backward(&loss(false)).unwrap();
    opt.step(&grads).unwrap();
    // w1 had one product last time and is armed; now it gets two.
    grads.clear();
    let err = opt
        .step_fused(&mut grads, |g| {
            g.backward(&loss(true))?;
            Ok::<_, Error>(true)
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("already updated inside this backward"), "{err}");
    // Nothing stays armed: a plain backward and step work again.
    grads.clear();
    grads.backward(&loss(true)).unwrap();
    opt.step(&grads).unwrap();
}
