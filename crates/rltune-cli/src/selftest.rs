//! `rltune selftest`: checks that this build computes what the references compute, on the device
//! it is asked to use. It is how a CUDA build is verified on a GPU machine (`tools/cuda/verify.sh`
//! runs it first), and what a user runs after building rltune for new hardware.
//!
//! Every check compares with a golden fixture recorded from the reference implementation
//! (`tools/fixtures/`: transformers 4.46.3, TRL 0.11.4 and 1.16.0), or with an exact distribution,
//! and prints one JSON object per line:
//!
//! ```text
//! {"name":"ppo/trl-0.11.4","pass":true,"max_abs_diff":1.1e-5,"tolerance":2e-5,"device":"cuda:0",...}
//! ```
//!
//! | check | what | tolerance |
//! |---|---|---|
//! | `models/<fixture>` | hidden states, logits (and values) of each causal-LM fixture (gpt2, llama, mistral, qwen2, gpt_neo, gpt_neox) against transformers | 1e-4 |
//! | `sampler/chi-square` | the device sampler's draws against softmax(logits / T) | p = 0.001 |
//! | `sampler/logprobs` | logprobs reported by KV-cached generation against a full forward | 1e-4 |
//! | `ppo/trl-0.11.4` | two `PPOTrainer.step`s: stats and weights | stats 1e-5, weights 2e-5 |
//! | `grpo/<variant>`, `rloo/<variant>` | `grpo-step` / `rloo-step` against TRL 1.16.0: weights and metrics | 1e-5 |
//! | `dpo/hinge` | `dpo` against TRL 1.16.0: weights and metrics | 1e-5 |
//! | `kernels/layer_norm`, `rms_norm`, `gelu`, `softmax`, `log_softmax`, `logprobs`, `entropy` | the op on the device (CUDA: its twin in `rltune_kernels::cuda`) against the CPU's fused kernel, on odd shapes: outputs and every input's gradient, as max \|a − b\| / max(1, max \|b\|) | 1e-5 |
//! | `kernels/rope` | the rotary embedding while splitting the heads on the device (CUDA: `rope.cu`) against the CPU's fused kernel, `(B, T, heads, D)` up to Qwen2-0.5B's 14 × 64: output and the input's gradient | 1e-5 |
//! | `kernels/attention` | GPT-2's fused self-attention on the device (CUDA: `attention.cu`) against the CPU's fused kernel, up to 12 heads of 64 at T = 64 and one head of 384 (on CUDA the per-row kernels; the others take the tiled ones), causal (left padding, a fully masked row) and padding biases: output and `dqkv` | 1e-5 |
//! | `kernels/rope_attention` | Llama's fused attention on the device (CUDA: `rope.cu`'s pack and unpack around `attention.cu`) against the CPU's fused kernel, up to 14 query heads over 2 key heads of 64 at T = 64, causal and padding biases: output and the gradients of q, k and v | 1e-5 |
//! | `kernels/scaled_masked_softmax` | attention's scaled masked softmax on the device (CUDA: `softmax.cu`) against the CPU's fused kernel, up to 14 heads at T = S = 128, causal and padding biases: probabilities and the scores' gradient | 1e-5 |
//! | `kernels/grad_norm` | the global gradient norm of gradients on the device (CUDA: one sum-of-squares kernel per tensor) against the CPU's, relative difference | 1e-12 |
//! | `kernels/adam` | three Adam steps on the device (CUDA: the in-place kernel) against the CPU's fused kernel, on odd sizes: weights and moments | 0 (bit for bit) |
//!
//! The tolerances are those of the CPU test suite, which runs these fixtures too; a GPU's
//! cuBLAS sums in another order than the CPU kernels, which moves f32 results by about 1e-6.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use rltune::generation::sampler::{log_distribution, sample_on_device, DeviceNoise, SamplerConfig};
use rltune::generation::{generate, GenerationConfig};
use rltune::models::layers::{causal_bias, position_ids_from_mask};
use rltune::models::load::load_policy;
use rltune::models::CausalLm;
use rltune::ppo::{PpoConfig, PpoTrainer, Stat};
use serde_json::{json, Value};

use crate::runtime::RuntimeArgs;

/// Arguments of `rltune selftest`.
#[derive(clap::Args)]
pub struct Args {
    /// The golden fixtures (the repository's `tools/fixtures`).
    #[arg(long, default_value = "tools/fixtures")]
    fixtures: PathBuf,
    /// Run only the checks whose name starts with one of these (comma-separated), e.g.
    /// `models,ppo`.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Also write the results, one JSON object per line, to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    runtime: RuntimeArgs,
}

/// One check's result.
struct Outcome {
    max_abs_diff: f64,
    tolerance: f64,
    extra: Value,
}

impl Outcome {
    fn new(max_abs_diff: f64, tolerance: f64) -> Self {
        Self { max_abs_diff, tolerance, extra: json!({}) }
    }

    fn pass(&self) -> bool {
        self.max_abs_diff.is_finite() && self.max_abs_diff <= self.tolerance
    }
}

/// One named check, run when selected.
type Check<'a> = Box<dyn Fn() -> Result<Outcome> + 'a>;

/// The fixtures of causal LMs compared with transformers' outputs.
const MODEL_FIXTURES: [&str; 8] =
    ["gpt2", "gpt2_value_head", "llama", "mistral", "qwen2", "gpt_neo", "gpt_neox", "gpt_neox_sequential"];
/// `tools/fixtures/grpo` variants that one `grpo-step` / `rloo-step` reproduces, and whether
/// they take the reference model.
const GROUP_VARIANTS: [(&str, &str, bool); 3] =
    [("grpo-step", "default", false), ("grpo-step", "kl", true), ("rloo-step", "rloo_default", true)];

/// Runs the checks; exits with an error when one fails.
pub fn run(args: Args) -> Result<()> {
    let runtime = args.runtime.resolve(Default::default())?;
    let device = runtime.device().clone();
    let fx = &args.fixtures;
    if !fx.join("ppo/expected.json").is_file() {
        bail!(
            "{}: no golden fixtures there; run from the repository root or pass --fixtures DIR \
             (the repository's tools/fixtures)",
            fx.display()
        );
    }
    let wanted = |name: &str| args.only.is_empty() || args.only.iter().any(|p| name.starts_with(p.as_str()));
    let mut checks: Vec<(String, Check<'_>)> = Vec::new();
    for name in MODEL_FIXTURES {
        let dev = device.clone();
        checks.push((
            format!("models/{name}"),
            Box::new(move || model_fixture(&fx.join("models").join(name), &dev)),
        ));
    }
    let dev = device.clone();
    checks.push(("sampler/chi-square".into(), Box::new(move || sampler_chi_square(&dev))));
    let dev = device.clone();
    checks.push(("sampler/logprobs".into(), Box::new(move || sampler_logprobs(fx, &dev))));
    let dev = device.clone();
    checks.push(("ppo/trl-0.11.4".into(), Box::new(move || ppo_fixture(fx, &dev))));
    let device_arg = device_flag(&device);
    for (cmd, variant, reference) in GROUP_VARIANTS {
        let algo = if cmd == "rloo-step" { "rloo" } else { "grpo" };
        let d = device_arg.clone();
        checks.push((
            format!("{algo}/{variant}"),
            Box::new(move || group_step(fx, cmd, variant, reference, &d)),
        ));
    }
    let d = device_arg.clone();
    checks.push(("dpo/hinge".into(), Box::new(move || dpo_fixture(fx, &d))));
    for op in KERNEL_OPS {
        let dev = device.clone();
        checks.push((format!("kernels/{op}"), Box::new(move || kernel_op(op, &dev))));
    }
    let dev = device.clone();
    checks.push(("kernels/rope".into(), Box::new(move || kernel_rope(&dev))));
    let dev = device.clone();
    checks.push(("kernels/rope_bf16".into(), Box::new(move || kernel_rope_bf16(&dev))));
    let dev = device.clone();
    checks.push(("kernels/attention".into(), Box::new(move || kernel_attention(&dev))));
    let dev = device.clone();
    checks.push(("kernels/rope_attention".into(), Box::new(move || kernel_rope_attention(&dev))));
    let dev = device.clone();
    checks.push(("kernels/scaled_masked_softmax".into(), Box::new(move || kernel_masked_softmax(&dev))));
    let dev = device.clone();
    checks.push(("kernels/adam".into(), Box::new(move || kernel_adam(&dev))));
    let dev = device.clone();
    checks.push(("kernels/grad_norm".into(), Box::new(move || kernel_grad_norm(&dev))));
    let dev = device.clone();
    checks.push(("kernels/swiglu_bf16".into(), Box::new(move || kernel_swiglu_bf16(&dev))));
    let dev = device.clone();
    checks.push((
        "kernels/scaled_masked_softmax_bf16".into(),
        Box::new(move || kernel_masked_softmax_bf16(&dev)),
    ));
    let dev = device.clone();
    checks.push(("models/bf16-activations".into(), Box::new(move || bf16_activations_change_nothing(&dev))));
    let dev = device.clone();
    checks.push(("models/bf16-attention".into(), Box::new(move || bf16_attention_is_close(&dev))));

    let mut lines = Vec::new();
    let mut failed = Vec::new();
    for (name, check) in checks.iter().filter(|(n, _)| wanted(n)) {
        let start = Instant::now();
        let mut line = match check() {
            Ok(o) => {
                let mut v = json!({
                    "name": name, "pass": o.pass(), "max_abs_diff": o.max_abs_diff,
                    "tolerance": o.tolerance,
                });
                if let (Some(v), Some(extra)) = (v.as_object_mut(), o.extra.as_object()) {
                    v.extend(extra.clone());
                }
                v
            }
            Err(e) => json!({"name": name, "pass": false, "error": format!("{e:#}")}),
        };
        line["device"] = json!(device_flag(&device));
        line["seconds"] = json!((start.elapsed().as_secs_f64() * 1000.0).round() / 1000.0);
        if line["pass"] != json!(true) {
            failed.push(name.clone());
        }
        println!("{line}");
        lines.push(line.to_string());
    }
    if lines.is_empty() {
        bail!("--only {:?} matches no check", args.only.join(","));
    }
    if let Some(path) = &args.json {
        rltune::io::write_bytes_atomic(path, (lines.join("\n") + "\n").as_bytes())
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if !failed.is_empty() {
        bail!("{} of {} checks failed: {}", failed.len(), lines.len(), failed.join(", "));
    }
    eprintln!("selftest: {} checks passed on {}", lines.len(), device_flag(&device));
    Ok(())
}

/// The global gradient norm (f64) of the same gradients on the device and on the CPU, on
/// tensors of odd sizes (empty ones too): relative difference.
fn kernel_grad_norm(device: &Device) -> Result<Outcome> {
    use rand::{Rng, SeedableRng};
    use rltune::optim::Grads;
    let sizes = [0usize, 1, 31, 1000, 65_537, 2_000_003];
    let mut rng = rand::rngs::StdRng::seed_from_u64(54);
    let grads: Vec<Vec<f32>> =
        sizes.iter().map(|&n| (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()).collect();
    let norm = |dev: &Device| -> Result<f64> {
        let vars = sizes
            .iter()
            .map(|&n| Ok(candle_core::Var::zeros(n, DType::F32, dev)?))
            .collect::<Result<Vec<_>>>()?;
        let mut g = Grads::new(&vars);
        for (i, v) in grads.iter().enumerate() {
            g.add(i, &Tensor::from_slice(v, v.len(), dev)?)?;
        }
        Ok(g.global_norm()?)
    };
    let (cpu, dev) = (norm(&Device::Cpu)?, norm(device)?);
    let mut o = Outcome::new(((dev - cpu) / cpu).abs(), 1e-12);
    o.extra = json!({"norm": dev, "cpu_norm": cpu, "measure": "relative", "kernel": rltune::ops::cuda_kernels(device)});
    Ok(o)
}

/// `shape` of values drawn uniformly from [−2, 2) by `rng`, on the CPU.
fn uniform(rng: &mut rand::rngs::StdRng, shape: &[usize]) -> Result<Tensor> {
    use rand::Rng;
    let v: Vec<f32> = (0..shape.iter().product::<usize>()).map(|_| rng.gen_range(-2.0f32..2.0)).collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// The worst of max |a − b| / max(1, max |b|) over the pairs of the device's tensors and the
/// CPU's.
fn worst_relative(dev: &[Tensor], cpu: &[Tensor]) -> Result<f64> {
    let mut worst = 0f64;
    for (a, b) in dev.iter().zip(cpu) {
        let scale = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?.max(1.0) as f64;
        worst = worst.max(max_diff(a, b)? / scale);
    }
    Ok(worst)
}

/// A `kernels/<op>` outcome: [`worst_relative`] against the ops' tolerance.
fn kernel_outcome(worst: f64, device: &Device) -> Outcome {
    let mut o = Outcome::new(worst, 1e-5);
    o.extra =
        json!({"measure": "max |a - b| / max(1, max |cpu|)", "kernel": rltune::ops::cuda_kernels(device)});
    o
}

/// The differentiable fused ops compared by `kernels/<op>`.
const KERNEL_OPS: [&str; 8] =
    ["layer_norm", "rms_norm", "gelu", "swiglu", "softmax", "log_softmax", "logprobs", "entropy"];

/// Op `op` on `device` against the CPU's fused kernel: on shapes with odd sizes (one row, rows
/// shorter than a warp, GPT-2's and Qwen2-0.5B's widths), uniform random inputs, the output and the
/// gradients of `Σ y·r` (random `r`) for every input. The measure is max |a − b| over
/// max(1, max |b|), per tensor, the worst of all.
fn kernel_op(op: &str, device: &Device) -> Result<Outcome> {
    use candle_core::Var;
    let shapes: [&[usize]; 6] = [&[1, 1], &[3, 7, 33], &[5, 768], &[2, 64, 896], &[129, 2049], &[3, 50257]];
    let mut worst = 0f64;
    for (case, dims) in shapes.iter().enumerate() {
        let n = *dims.last().unwrap_or(&1);
        let seed = 1000 * case as u64;
        let randn = |shape: &[usize], k: u64| {
            use rand::SeedableRng;
            uniform(&mut rand::rngs::StdRng::seed_from_u64(seed + k), shape)
        };
        let out_dims = if matches!(op, "logprobs" | "entropy") { &dims[..dims.len() - 1] } else { dims };
        let (x, w, b, r) = (randn(dims, 1)?, (randn(&[n], 2)? + 1.0)?, randn(&[n], 3)?, randn(out_dims, 4)?);
        let run = |dev: &Device| -> Result<Vec<Tensor>> {
            let vars = [&x, &w, &b].map(|t| t.to_device(dev).and_then(|t| Var::from_tensor(&t)));
            let [x, w, b] = vars;
            let (x, w, b) = (x?, w?, b?);
            let y = match op {
                "layer_norm" => rltune::ops::layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5)?,
                "rms_norm" => rltune::ops::rms_norm(x.as_tensor(), w.as_tensor(), 1e-6)?,
                "gelu" => rltune::ops::gelu_tanh(&(x.as_tensor() * 3.0)?)?,
                "swiglu" => rltune::ops::swiglu(
                    &(x.as_tensor() * 3.0)?,
                    &x.as_tensor().broadcast_mul(w.as_tensor())?,
                )?,
                "softmax" => rltune::ops::softmax_last_dim(&(x.as_tensor() * 4.0)?)?,
                "log_softmax" => rltune::ops::log_softmax_last_dim(&(x.as_tensor() * 4.0)?)?,
                "entropy" => rltune::ops::entropy_from_logits(&(x.as_tensor() * 4.0)?)?,
                "logprobs" => {
                    let rows = dims[..dims.len() - 1].to_vec();
                    let count = rows.iter().product::<usize>();
                    let ids: Vec<u32> = (0..count).map(|i| ((i * 7919 + case) % n) as u32).collect();
                    let t = Tensor::from_vec(ids, rows, dev)?;
                    rltune::ops::logprobs_of(&(x.as_tensor() * 4.0)?, &t)?
                }
                other => bail!("no kernel check for {other}"),
            };
            let grads = (&y * r.to_device(dev)?)?.sum_all()?.backward()?;
            let mut out = vec![y];
            for v in [&x, &w, &b] {
                if let Some(g) = grads.get(v.as_tensor()) {
                    out.push(g.clone());
                }
            }
            Ok(out)
        };
        let (cpu, dev) = (run(&Device::Cpu)?, run(device)?);
        if cpu.len() != dev.len() {
            bail!("{op} {dims:?}: {} gradients on the device, {} on the CPU", dev.len() - 1, cpu.len() - 1);
        }
        worst = worst.max(worst_relative(&dev, &cpu)?);
    }
    Ok(kernel_outcome(worst, device))
}

/// The distance in bf16 steps between two tensors of bf16 values: the largest number of
/// representable bf16 values between two elements (0 when every bit agrees).
fn bf16_steps(a: &Tensor, b: &Tensor) -> Result<u32> {
    let ordered = |t: &Tensor| -> Result<Vec<i32>> {
        let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        // Sign-magnitude bf16 bits to a line of integers: -0 and +0 meet at 0.
        Ok(v.iter()
            .map(|x| (x.to_bits() >> 16) as i32)
            .map(|h| if h & 0x8000 != 0 { -(h & 0x7fff) } else { h })
            .collect())
    };
    let (a, b) = (ordered(a)?, ordered(b)?);
    if a.len() != b.len() {
        bail!("{} values against {}", a.len(), b.len());
    }
    Ok(a.iter().zip(&b).map(|(x, y)| x.abs_diff(*y)).max().unwrap_or(0))
}

/// SwiGLU in bf16 (autocast's bf16 activations; on CUDA `swiglu.cu`'s bf16 kernels) against its
/// CPU twin, the f32 op rounded to bf16 once (`rltune::ops::swiglu` on bf16 CPU tensors), on
/// [`kernel_op`]'s shapes: the output and both gradients of `Σ y·r`. The measure is the largest
/// distance in bf16 steps ([`bf16_steps`]); the tolerance is one step, for an f32 value that the
/// device's `expf` and the CPU's `exp` put on either side of a rounding boundary.
fn kernel_swiglu_bf16(device: &Device) -> Result<Outcome> {
    use candle_core::Var;
    use rand::SeedableRng;
    let shapes: [&[usize]; 6] = [&[1, 1], &[3, 7, 33], &[5, 768], &[2, 64, 896], &[129, 2049], &[3, 4864]];
    let mut worst = 0u32;
    for (case, dims) in shapes.iter().enumerate() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5000 + case as u64);
        let mut bf =
            |scale: f64| -> Result<Tensor> { Ok((uniform(&mut rng, dims)? * scale)?.to_dtype(DType::BF16)?) };
        let (g, u, r) = (bf(4.0)?, bf(1.0)?, bf(1.0)?);
        let run = |dev: &Device| -> Result<Vec<Tensor>> {
            let (gv, uv) = (Var::from_tensor(&g.to_device(dev)?)?, Var::from_tensor(&u.to_device(dev)?)?);
            let y = rltune::ops::swiglu(gv.as_tensor(), uv.as_tensor())?;
            let grads = (&y * r.to_device(dev)?)?.sum_all()?.backward()?;
            let mut out = vec![y.to_device(&Device::Cpu)?];
            for v in [&gv, &uv] {
                let Some(d) = grads.get(v.as_tensor()) else { bail!("no gradient on {}", device_flag(dev)) };
                out.push(d.to_device(&Device::Cpu)?);
            }
            Ok(out)
        };
        let (cpu, dev) = (run(&Device::Cpu)?, run(device)?);
        for (a, b) in dev.iter().zip(&cpu) {
            if a.dtype() != DType::BF16 {
                bail!("{dims:?}: a {:?} result where bf16 was due", a.dtype());
            }
            worst = worst.max(bf16_steps(a, b)?);
        }
    }
    let mut o = Outcome::new(worst as f64, 1.0);
    o.extra = json!({"measure": "max distance in bf16 steps", "kernel": rltune::ops::cuda_kernels(device)});
    Ok(o)
}

/// The attention softmax on bf16 scores (on CUDA `softmax.cu`'s bf16 kernels) against its CPU
/// twin (the f32 kernels between conversions), on `(B, H, T, S)` scores up to Qwen2-0.5B's 14
/// heads of 256 positions with a causal, left-padded f32 bias: the probabilities and the
/// scores' gradient of `Σ p·r`. The measure is max |a − b| / max(1, max |cpu|), the worst of
/// the two; the tolerance is one bf16 step below 1 (2⁻⁸), for a value that the two sides' f32
/// `exp` and sums put on either side of a rounding boundary.
fn kernel_masked_softmax_bf16(device: &Device) -> Result<Outcome> {
    use candle_core::Var;
    use rand::SeedableRng;
    let mut worst = 0f64;
    for (case, &(b, h, t)) in [(1usize, 1usize, 1usize), (2, 3, 37), (2, 14, 256)].iter().enumerate() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(6000 + case as u64);
        let x = (uniform(&mut rng, &[b, h, t, t])? * 6.0)?.to_dtype(DType::BF16)?;
        let r = uniform(&mut rng, &[b, h, t, t])?.to_dtype(DType::BF16)?;
        let mut mask = vec![vec![1u8; t]; b];
        if t > 2 {
            mask[b - 1][..2].fill(0);
        }
        let bias = causal_bias(&mask, t, DType::F32, &Device::Cpu)?;
        let run = |dev: &Device| -> Result<Vec<Tensor>> {
            let xv = Var::from_tensor(&x.to_device(dev)?)?;
            let p = rltune::ops::scaled_masked_softmax(xv.as_tensor(), &bias.to_device(dev)?, 0.125)?;
            let grads = (&p * r.to_device(dev)?)?.sum_all()?.backward()?;
            let Some(dx) = grads.get(xv.as_tensor()) else { bail!("no gradient on {}", device_flag(dev)) };
            Ok(vec![p.to_dtype(DType::F32)?, dx.to_dtype(DType::F32)?])
        };
        let (cpu, dev) = (run(&Device::Cpu)?, run(device)?);
        worst = worst.max(worst_relative(&dev, &cpu)?);
    }
    let mut o = Outcome::new(worst, 1.0 / 256.0);
    o.extra =
        json!({"measure": "max |a - b| / max(1, max |cpu|)", "kernel": rltune::ops::cuda_kernels(device)});
    Ok(o)
}

/// A tiny Qwen2-shaped model under bf16 autocast with attention's products in bf16
/// (`[runtime] attention = "bf16"`) against the f32 attention (the default): the loss and every
/// gradient. The measure is the worst over the tensors of max |a − b| / max |f32|; the
/// tolerance, 5%, is bf16's precision through two layers (the CPU's test sees about 1%).
fn bf16_attention_is_close(device: &Device) -> Result<Outcome> {
    let (store, run) = tiny_qwen2(device)?;
    let mut out = [Vec::new(), Vec::new()];
    let precision = rltune::ops::device_matmul_precision();
    rltune::ops::set_device_matmul_precision(rltune::ops::MatmulPrecision::Bf16);
    let was = rltune::ops::set_bf16_attention(false);
    let cpu_autocast = device.is_cpu().then(rltune::ops::autocast_composed_scope);
    let mut result = Ok(());
    for (slot, on) in out.iter_mut().zip([false, true]) {
        rltune::ops::set_bf16_attention(on);
        match run(&store) {
            Ok(v) => *slot = v,
            Err(e) => result = Err(e),
        }
    }
    drop(cpu_autocast);
    rltune::ops::set_bf16_attention(was);
    rltune::ops::set_device_matmul_precision(precision);
    result?;
    let [f32s, bf16s] = out;
    let mut worst = 0f64;
    let mut moved = 0;
    for (a, b) in bf16s.iter().zip(&f32s) {
        let scale = b.abs()?.flatten_all()?.max(0)?.to_dtype(DType::F64)?.to_scalar::<f64>()?.max(1e-3);
        let d = max_diff(a, b)?;
        worst = worst.max(d / scale);
        moved += usize::from(d > 0.0);
    }
    let mut o = Outcome::new(worst, 0.05);
    o.extra = json!({"measure": "max |a - b| / max |f32| over the loss and every gradient", "tensors_moved": moved, "tensors": f32s.len()});
    Ok(o)
}

/// A tiny Qwen2 (2 layers, 64 wide, 4 heads over 2 key heads, vocabulary 97) on `device`, and
/// its loss (`Σ sin(logits)` over a left-padded batch of two) with every weight's gradient.
#[allow(clippy::type_complexity)]
fn tiny_qwen2(
    device: &Device,
) -> Result<(
    rltune::models::params::ParamStore,
    Box<dyn Fn(&rltune::models::params::ParamStore) -> Result<Vec<Tensor>>>,
)> {
    use rltune::models::llama::{Llama, LlamaConfig};
    use rltune::models::params::ParamStore;
    let mut v = serde_json::to_value(LlamaConfig::tiny(97, 64, 2, 4, 2))?;
    v["model_type"] = "qwen2".into();
    v["intermediate_size"] = 160.into();
    v["initializer_range"] = 0.2.into();
    let cfg: LlamaConfig = serde_json::from_value(v)?;
    let store = ParamStore::random(9, true, DType::F32, device)?;
    let mask = vec![vec![1u8; 12], [vec![0u8; 3], vec![1; 9]].concat()];
    let ids: Vec<u32> = (0..24).map(|i| (i * 37 % 97) as u32).collect();
    let ids = Tensor::from_vec(ids, (2, 12), device)?;
    let pos = position_ids_from_mask(&mask, device)?;
    let bias = causal_bias(&mask, 12, DType::F32, device)?;
    let model = Llama::load(&store.root(), &cfg)?;
    let run = move |store: &ParamStore| -> Result<Vec<Tensor>> {
        let h = model.forward(&ids, &pos, &bias, None)?;
        let loss = model.logits(&h)?.sin()?.sum_all()?;
        let grads = loss.backward()?;
        let mut out = vec![loss];
        for (name, var) in store.vars() {
            let Some(g) = grads.get(&var) else { bail!("no gradient for {name}") };
            out.push(g.flatten_all()?);
        }
        Ok(out)
    };
    Ok((store, Box::new(run)))
}

/// A tiny Qwen2-shaped model's loss and every weight's gradient under bf16 autocast, with bf16
/// activations through the MLP (`[runtime] activations = "bf16"`, the default) and without
/// (`"f32"`): the same bits (`rltune::ops::set_bf16_activations`). The measure is the largest
/// difference; the tolerance 0. Autocast and the switch are set for the check and put back
/// after it (on the CPU, the GPU's composed path in bf16, `rltune::ops::autocast_composed_scope`).
fn bf16_activations_change_nothing(device: &Device) -> Result<Outcome> {
    let (store, model_run) = tiny_qwen2(device)?;
    let run = |on: bool| -> Result<Vec<Tensor>> {
        rltune::ops::set_bf16_activations(on);
        model_run(&store)
    };
    let precision = rltune::ops::device_matmul_precision();
    rltune::ops::set_device_matmul_precision(rltune::ops::MatmulPrecision::Bf16);
    let was = rltune::ops::set_bf16_activations(true);
    // On the CPU, the GPU's composed bf16 path (the CPU's own products stay f32).
    let cpu_autocast = device.is_cpu().then(rltune::ops::autocast_composed_scope);
    let (on, off) = (run(true), run(false));
    drop(cpu_autocast);
    rltune::ops::set_device_matmul_precision(precision);
    rltune::ops::set_bf16_activations(was);
    let (on, off) = (on?, off?);
    let mut worst = 0f64;
    for (a, b) in on.iter().zip(&off) {
        worst = worst.max(max_diff(a, b)?);
    }
    let mut o = Outcome::new(worst, 0.0);
    o.extra = json!({"measure": "max |a - b| over the loss and every gradient"});
    Ok(o)
}

/// The rotary embedding while splitting the heads (`rltune::ops::rope_heads`; on CUDA `rope.cu`)
/// against the CPU's fused kernel, on `(B, T, heads, D)` shapes from one position and head to
/// Qwen2-0.5B's 14 heads of 64: the output and the input's gradient of `Σ y·r`. Both compute
/// the same products and sums in the same order without contracted multiply-adds, so the
/// measure (as [`kernel_op`]'s) is 0 on a correct kernel; the tolerance is the other ops'.
fn kernel_rope(device: &Device) -> Result<Outcome> {
    kernel_rope_side(device, false)
}

/// [`kernel_rope`] for the bf16 side (`rltune::ops::rope_heads_bf16`: f32 in, bf16 heads out,
/// and its backward from a bf16 gradient to f32), compared in f32: both sides round the same f32
/// values, so the measure is 0 on a correct kernel too.
fn kernel_rope_bf16(device: &Device) -> Result<Outcome> {
    kernel_rope_side(device, true)
}

fn kernel_rope_side(device: &Device, bf16: bool) -> Result<Outcome> {
    use rand::SeedableRng;
    let shapes = [[1usize, 1, 1, 2], [2, 7, 3, 10], [3, 5, 12, 64], [1, 33, 14, 64]];
    let mut worst = 0f64;
    for (case, &[b, t, h, d]) in shapes.iter().enumerate() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(77 + case as u64);
        let mut randn = |shape: &[usize]| uniform(&mut rng, shape);
        let (x, angles, r) = (randn(&[b, t, h * d])?, randn(&[b, 1, t, d / 2])?, randn(&[b, h, t, d])?);
        let (cos, sin) = (angles.cos()?, angles.sin()?);
        worst = worst.max(output_and_gradient(device, &x, &r, |x, dev| {
            let (cos, sin) = (cos.to_device(dev)?, sin.to_device(dev)?);
            Ok(if bf16 {
                rltune::ops::rope_heads_bf16(x, &cos, &sin, h)?.to_dtype(DType::F32)?
            } else {
                rltune::ops::rope_heads(x, &cos, &sin, h)?
            })
        })?);
    }
    Ok(kernel_outcome(worst, device))
}

/// `f(x)` and the gradient of `Σ f(x)·r` in `x`, on `device` and on the CPU: the worst of their
/// [`worst_relative`] differences.
fn output_and_gradient(
    device: &Device,
    x: &Tensor,
    r: &Tensor,
    f: impl Fn(&Tensor, &Device) -> Result<Tensor>,
) -> Result<f64> {
    let run = |dev: &Device| -> Result<Vec<Tensor>> {
        let x = candle_core::Var::from_tensor(&x.to_device(dev)?)?;
        let y = f(x.as_tensor(), dev)?;
        let grads = (&y * r.to_device(dev)?)?.sum_all()?.backward()?;
        let Some(dx) = grads.get(x.as_tensor()) else { bail!("no gradient for the input") };
        Ok(vec![y, dx.clone()])
    };
    let (cpu, dev) = (run(&Device::Cpu)?, run(device)?);
    worst_relative(&dev, &cpu)
}

/// The key masks of `b` sequences of `s` keys (sequence k starts after k pads; the last of
/// several is all padding, so its rows are fully masked), and the two biases attention is
/// checked under: the decoders' causal bias `(B, 1, T, S)` and the encoders' padding bias
/// `(B, 1, 1, S)`.
fn mask_biases(b: usize, t: usize, s: usize, dev: &Device) -> Result<[Tensor; 2]> {
    let keys: Vec<Vec<u8>> =
        (0..b).map(|k| (0..s).map(|j| u8::from(j >= k && !(b > 1 && k == b - 1))).collect()).collect();
    let f32 = candle_core::DType::F32;
    Ok([rltune::ops::causal_bias(&keys, t, f32, dev)?, rltune::ops::padding_bias(&keys, f32, dev)?])
}

/// GPT-2's fused self-attention (`rltune::ops::self_attention`; on CUDA `attention.cu`) against
/// the CPU's fused kernel: `(B, T, C, heads)` from one position and head to GPT-2's 12 × 64 at
/// T = 64, and one head of 384, under [`mask_biases`]; the output and `dqkv` of `Σ y·r`. The measure is
/// [`kernel_op`]'s.
fn kernel_attention(device: &Device) -> Result<Outcome> {
    use rand::SeedableRng;
    // The last: one head of 384, too wide for a tile of queries, so CUDA's query side takes the
    // per-row kernels (and its key side tiles of 10 keys).
    let shapes = [[1usize, 1, 2, 1], [2, 7, 12, 3], [3, 31, 48, 4], [2, 64, 768, 12], [2, 5, 384, 1]];
    let mut worst = 0f64;
    for (case, &[b, t, c, h]) in shapes.iter().enumerate() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(91 + case as u64);
        let (qkv, r) = (uniform(&mut rng, &[b, t, 3 * c])?, uniform(&mut rng, &[b, t, c])?);
        let scale = 1.0 / ((c / h) as f64).sqrt();
        for which in 0..2 {
            worst = worst.max(output_and_gradient(device, &qkv, &r, |x, dev| {
                let bias = &mask_biases(b, t, t, dev)?[which];
                Ok(rltune::ops::self_attention(x, bias, h, scale)?)
            })?);
        }
    }
    Ok(kernel_outcome(worst, device))
}

/// Llama's fused attention (`rltune::ops::rope_attention`: the rotary embedding, grouped-query
/// attention and the merge; on CUDA `rope.cu`'s pack and unpack around `attention.cu`) against
/// the CPU's fused kernel: `(B, T, heads, key heads, D)` from one position and head to
/// SmolLM2-135M's 9 × 64 over 3 key heads and Qwen2-0.5B's 14 × 64 over 2, under
/// [`mask_biases`]. `q`, `k` and `v` are cut from one input, so its gradient holds all three.
/// The measure is [`kernel_op`]'s.
fn kernel_rope_attention(device: &Device) -> Result<Outcome> {
    use rand::SeedableRng;
    let shapes = [[1usize, 1, 1, 1, 2], [2, 7, 4, 2, 10], [3, 31, 9, 3, 64], [2, 64, 14, 2, 64]];
    let mut worst = 0f64;
    for (case, &[b, t, h, kv, d]) in shapes.iter().enumerate() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(131 + case as u64);
        let mut randn = |shape: &[usize]| uniform(&mut rng, shape);
        let (c, ckv) = (h * d, kv * d);
        let (x, angles, r) = (randn(&[b, t, c + 2 * ckv])?, randn(&[b, 1, t, d / 2])?, randn(&[b, t, c])?);
        let (cos, sin) = (angles.cos()?, angles.sin()?);
        let scale = 1.0 / (d as f64).sqrt();
        for which in 0..2 {
            worst = worst.max(output_and_gradient(device, &x, &r, |x, dev| {
                let bias = &mask_biases(b, t, t, dev)?[which];
                let (q, k, v) = (x.narrow(2, 0, c)?, x.narrow(2, c, ckv)?, x.narrow(2, c + ckv, ckv)?);
                let (cos, sin) = (cos.to_device(dev)?, sin.to_device(dev)?);
                Ok(rltune::ops::rope_attention(&q, &k, &v, &cos, &sin, bias, (h, kv), scale)?)
            })?);
        }
    }
    Ok(kernel_outcome(worst, device))
}

/// Attention's scaled masked softmax (`rltune::ops::scaled_masked_softmax`, the probabilities of
/// Llama/Qwen2's attention; on CUDA `softmax.cu`) against the CPU's fused kernel: `(B, H, T, S)`
/// scores up to Qwen2-0.5B's 14 heads at T = S = 128, under [`mask_biases`]; the probabilities
/// and the scores' gradient of `Σ y·r`. The measure is [`kernel_op`]'s.
fn kernel_masked_softmax(device: &Device) -> Result<Outcome> {
    use rand::SeedableRng;
    let shapes = [[1usize, 1, 1, 1], [2, 3, 7, 7], [3, 14, 31, 31], [2, 14, 128, 128]];
    let mut worst = 0f64;
    for (case, &[b, h, t, s]) in shapes.iter().enumerate() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(313 + case as u64);
        let (x, r) = (uniform(&mut rng, &[b, h, t, s])?, uniform(&mut rng, &[b, h, t, s])?);
        for which in 0..2 {
            worst = worst.max(output_and_gradient(device, &(x.clone() * 4.0)?, &r, |x, dev| {
                let bias = &mask_biases(b, t, s, dev)?[which];
                Ok(rltune::ops::scaled_masked_softmax(x, bias, 0.125)?)
            })?);
        }
    }
    Ok(kernel_outcome(worst, device))
}

/// The device's Adam (on CUDA the in-place kernel, `rltune_kernels::cuda`) against the CPU's
/// fused kernel: three steps over variables of odd sizes from the same random weights and
/// gradients (some zero, some large), then weights and both moments compared. Both compute
/// torch's order of operations without contracted multiply-adds, so they agree bit for bit.
fn kernel_adam(device: &Device) -> Result<Outcome> {
    use rand::{Rng, SeedableRng};
    use rltune::optim::{Adam, AdamConfig, Grads};
    let sizes = [1usize, 7, 255, 4099, 65_537, 1_000_003];
    let mut rng = rand::rngs::StdRng::seed_from_u64(53);
    let mut draw = |n: usize, scale: f32| -> Vec<f32> {
        (0..n)
            .map(|_| match rng.gen_range(0..20) {
                0 => 0.0,
                1 => rng.gen_range(-1e3f32..1e3),
                _ => rng.gen_range(-scale..scale),
            })
            .collect()
    };
    let init: Vec<Vec<f32>> = sizes.iter().map(|&n| draw(n, 1.0)).collect();
    let vars = |dev: &Device| -> Result<Vec<candle_core::Var>> {
        init.iter().map(|x| Ok(candle_core::Var::from_vec(x.clone(), x.len(), dev)?)).collect()
    };
    let (cpu_vars, dev_vars) = (vars(&Device::Cpu)?, vars(device)?);
    let cfg = AdamConfig { lr: 3e-3, ..AdamConfig::default() };
    let (mut cpu, mut dev) = (Adam::new(cpu_vars.clone(), cfg)?, Adam::new(dev_vars.clone(), cfg)?);
    for _ in 0..3 {
        let (mut gc, mut gd) = (Grads::new(&cpu_vars), Grads::new(&dev_vars));
        for (i, &n) in sizes.iter().enumerate() {
            let g = draw(n, 0.1);
            gc.add(i, &Tensor::from_slice(&g, n, &Device::Cpu)?)?;
            gd.add(i, &Tensor::from_slice(&g, n, device)?)?;
        }
        cpu.step(&gc)?;
        dev.step(&gd)?;
    }
    let (mut worst, mut differing, mut total) = (0f64, 0usize, 0usize);
    for i in 0..sizes.len() {
        let (mc, vc) = cpu.moments(i)?;
        let (md, vd) = dev.moments(i)?;
        for (a, b) in [(cpu_vars[i].as_tensor().clone(), dev_vars[i].as_tensor().clone()), (mc, md), (vc, vd)]
        {
            let (a, b) =
                (a.to_device(&Device::Cpu)?.to_vec1::<f32>()?, b.to_device(&Device::Cpu)?.to_vec1::<f32>()?);
            total += a.len();
            for (x, y) in a.iter().zip(&b) {
                if x.to_bits() != y.to_bits() {
                    differing += 1;
                    worst = worst.max((*x as f64 - *y as f64).abs()).max(if x.is_nan() != y.is_nan() {
                        f64::INFINITY
                    } else {
                        0.0
                    });
                }
            }
        }
    }
    let mut o = Outcome::new(worst, 0.0);
    o.extra =
        json!({"values": total, "differing_bits": differing, "kernel": rltune::ops::cuda_kernels(device)});
    Ok(o)
}

/// The `--device` value that names `device`.
fn device_flag(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// Largest absolute difference of two tensors of one shape, wherever they live.
fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    if a.dims() != b.dims() {
        bail!("shapes differ: {:?} vs {:?}", a.dims(), b.dims());
    }
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?)
}

/// A transformers fixture (`make_model_fixtures.py`) through our model on `device`: hidden
/// states, logits and values at the unmasked positions.
fn model_fixture(dir: &Path, device: &Device) -> Result<Outcome> {
    let loaded = load_policy(dir.to_str().context("fixture path is not UTF-8")?, false, DType::F32, device)?;
    let exp = candle_core::safetensors::load(dir.join("expected.safetensors"), &Device::Cpu)?;
    let get =
        |k: &str| exp.get(k).with_context(|| format!("{}: no {k} in expected.safetensors", dir.display()));
    let mask: Vec<Vec<u8>> = get("attention_mask")?
        .to_dtype(DType::U32)?
        .to_vec2::<u32>()?
        .into_iter()
        .map(|r| r.into_iter().map(|x| x as u8).collect())
        .collect();
    let ids = get("input_ids")?.to_dtype(DType::U32)?.to_device(device)?;
    let t = ids.dim(1)?;
    let lm = &loaded.model.lm;
    let hidden = lm.forward(
        &ids,
        &position_ids_from_mask(&mask, device)?,
        &causal_bias(&mask, t, DType::F32, device)?,
        None,
    )?;
    let logits = lm.logits(&hidden)?;
    let values = loaded.model.v_head.forward(&hidden)?;
    let mut worst = 0f64;
    for (b, row) in mask.iter().enumerate() {
        for (j, _) in row.iter().enumerate().filter(|(_, &m)| m != 0) {
            let at = |x: &Tensor| -> Result<Tensor> { Ok(x.get(b)?.get(j)?) };
            worst = worst.max(max_diff(&at(&hidden)?, &at(get("hidden")?)?)?);
            worst = worst.max(max_diff(&at(&logits)?, &at(get("logits")?)?)?);
            if let Some(v) = exp.get("values") {
                worst = worst.max(max_diff(&at(&values)?, &at(v)?)?);
            }
        }
    }
    Ok(Outcome::new(worst, 1e-4))
}

/// The device sampler against the exact tempered softmax: Pearson's chi-square over 100,000
/// draws of six tokens (one banned), and each draw's logprob against the exact one.
fn sampler_chi_square(device: &Device) -> Result<Outcome> {
    let row = [1.0f32, 0.0, -1.0, 2.0, 0.5, 1.5];
    let (t, banned) = (0.7, [5u32]);
    let logp = log_distribution(&row, &SamplerConfig { temperature: t, ..Default::default() }, &banned);
    let b = 4000;
    let logits = Tensor::from_vec(row.repeat(b), (b, row.len()), device)?;
    let mut noise = DeviceNoise::new(device, 7)?;
    let mut counts = [0usize; 6];
    let mut worst_lp = 0f64;
    for _ in 0..25 {
        let (ids, lps) = sample_on_device(&logits, t, &banned, &mut noise)?;
        for (&id, &lp) in ids.iter().zip(&lps) {
            if banned.contains(&id) {
                bail!("sampled the banned id {id}");
            }
            worst_lp = worst_lp.max((lp as f64 - logp[id as usize]).abs());
            counts[id as usize] += 1;
        }
    }
    let n: usize = counts.iter().sum();
    let chi2: f64 = (0..5)
        .map(|i| {
            let e = logp[i].exp() * n as f64;
            (counts[i] as f64 - e).powi(2) / e
        })
        .sum();
    // The 0.999 quantile of chi-square with 4 degrees of freedom (five allowed tokens).
    const CRITICAL: f64 = 18.467;
    let mut o = Outcome::new(worst_lp, 1e-5);
    o.extra = json!({"chi_square": chi2, "chi_square_critical_p001": CRITICAL, "draws": n, "counts": counts});
    if chi2 > CRITICAL {
        o.max_abs_diff = f64::INFINITY;
    }
    Ok(o)
}

/// Logprobs that KV-cached generation reports against a full forward over prompt + response.
fn sampler_logprobs(fx: &Path, device: &Device) -> Result<Outcome> {
    let dir = fx.join("ppo/init");
    let policy = load_policy(dir.to_str().context("fixture path is not UTF-8")?, false, DType::F32, device)?;
    let lm: &CausalLm = &policy.model.lm;
    let prompts: Vec<Vec<u32>> = vec![vec![5, 9, 2, 7], vec![11, 3], vec![4, 4, 8, 1, 6, 2]];
    let cfg = GenerationConfig { max_new_tokens: 12, seed: 3, ..Default::default() };
    let samples = generate(lm, None, &prompts, &cfg, device)?;
    let mut worst = 0f64;
    for s in &samples {
        let ids: Vec<u32> = s.query_ids.iter().chain(&s.response_ids).copied().collect();
        let n = ids.len();
        let mask = vec![vec![1u8; n]];
        let input = Tensor::new(ids.as_slice(), device)?.unsqueeze(0)?;
        let hidden = lm.forward(
            &input,
            &position_ids_from_mask(&mask, device)?,
            &causal_bias(&mask, n, DType::F32, device)?,
            None,
        )?;
        let logits = lm.logits(&hidden)?.squeeze(0)?.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
        let q = s.query_ids.len();
        for (k, (&tok, &lp)) in s.response_ids.iter().zip(&s.logprobs).enumerate() {
            let row = &logits[q + k - 1];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
            worst = worst.max((row[tok as usize] as f64 - lse - lp as f64).abs());
        }
    }
    Ok(Outcome::new(worst, 1e-4))
}

/// TRL 0.11.4's two `PPOTrainer.step`s (`make_ppo_fixture.py`): every stat and the weights.
fn ppo_fixture(fx: &Path, device: &Device) -> Result<Outcome> {
    let read = |f: &str| -> Result<Value> {
        let p = fx.join("ppo").join(f);
        Ok(serde_json::from_str(
            &std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?,
        )?)
    };
    let policy = load_policy(
        fx.join("ppo/init").to_str().context("fixture path is not UTF-8")?,
        true,
        DType::F32,
        device,
    )?;
    let ref_store = policy.store.frozen_copy()?;
    let reference = CausalLm::load(&ref_store.root(), &policy.config)?;
    let config = PpoConfig {
        batch_size: 4,
        mini_batch_size: 2,
        ppo_epochs: 2,
        learning_rate: 1e-3,
        ..Default::default()
    };
    let mut trainer = PpoTrainer::new(config, policy.store, policy.model, reference)?;
    let expected = read("expected.json")?;
    let (mut stats_worst, mut weights_worst) = (0f64, 0f64);
    let steps = expected["steps"].as_array().context("ppo/expected.json: no steps")?;
    for (k, step) in steps.iter().enumerate() {
        let ids = |key: &str| -> Result<Vec<Vec<u32>>> { Ok(serde_json::from_value(step[key].clone())?) };
        let perms: Vec<Vec<usize>> = serde_json::from_value(step["permutations"].clone())?;
        trainer.force_permutations(perms);
        let scores: Vec<f32> = serde_json::from_value(step["scores"].clone())?;
        let stats = trainer.step(&ids("queries")?, &ids("responses")?, &scores)?;
        let theirs = read(&format!("step{}_stats.json", k + 1))?;
        for (key, want) in theirs["stats"].as_object().context("no stats")? {
            if key.starts_with("time/") {
                continue;
            }
            let got: Vec<f64> = match stats.get(key) {
                Some(Stat::Scalar(v)) => vec![*v],
                Some(Stat::Array(a)) => a.clone(),
                Some(Stat::Matrix(m)) => m.concat(),
                _ => bail!("stat {key} is missing"),
            };
            let want: Vec<f64> = flatten_numbers(want);
            if got.len() != want.len() {
                bail!("stat {key}: {} values, TRL has {}", got.len(), want.len());
            }
            for (g, w) in got.iter().zip(&want) {
                stats_worst = stats_worst.max((g - w).abs());
            }
        }
        let want = candle_core::safetensors::load(
            fx.join(format!("ppo/step{}_weights.safetensors", k + 1)),
            &Device::Cpu,
        )?;
        let ours: std::collections::HashMap<String, Tensor> = trainer.store.snapshot()?.into_iter().collect();
        for (name, w) in &want {
            let o = ours.get(name).with_context(|| format!("no tensor {name}"))?;
            weights_worst = weights_worst.max(max_diff(o, w)?);
        }
    }
    // Both tolerances must hold: report the weights' difference in units of their tolerance.
    let (stat_tol, weight_tol) = (1e-5, 2e-5);
    let mut o = Outcome::new(weights_worst, weight_tol);
    o.extra = json!({"stats_max_abs_diff": stats_worst, "stats_tolerance": stat_tol});
    if stats_worst > stat_tol {
        o.max_abs_diff = f64::INFINITY;
    }
    Ok(o)
}

fn flatten_numbers(v: &Value) -> Vec<f64> {
    match v {
        Value::Array(a) => a.iter().flat_map(flatten_numbers).collect(),
        v => vec![v.as_f64().unwrap_or(f64::NAN)],
    }
}

/// Runs this binary with `args`; its stderr becomes the error when it fails.
fn rltune(args: &[&str]) -> Result<()> {
    let exe = std::env::current_exe().context("cannot find the rltune binary")?;
    let out = Command::new(exe).args(args).output().context("cannot run rltune")?;
    if !out.status.success() {
        bail!("rltune {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// A fresh output directory for one check under the system's temporary folder.
fn scratch(name: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("rltune-selftest-{}-{name}", std::process::id()));
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    Ok(dir)
}

/// The output directory's weights and first logged metrics against TRL's. The attention key
/// bias has an exactly-zero gradient, so AdamW turns float noise into its update on both sides:
/// it is left out, as in the CPU tests (`tests/integration/grpo_parity.rs`).
fn compare_run(weights: &Path, metrics: &Value, variant_dir: &Path) -> Result<Outcome> {
    let want = candle_core::safetensors::load(variant_dir.join("weights.safetensors"), &Device::Cpu)?;
    let got = candle_core::safetensors::load(weights, &Device::Cpu)?;
    let part = |n: &str, t: &Tensor| -> Result<Tensor> {
        if !n.ends_with("attn.c_attn.bias") {
            return Ok(t.clone());
        }
        let c = t.dim(0)? / 3;
        Ok(Tensor::cat(&[t.narrow(0, 0, c)?, t.narrow(0, 2 * c, c)?], 0)?)
    };
    let mut dw = 0f64;
    for (n, w) in &want {
        let g = got.get(n).with_context(|| format!("{}: no tensor {n}", weights.display()))?;
        dw = dw.max(max_diff(&part(n, g)?, &part(n, w)?)?);
    }
    let expected: Value = serde_json::from_str(&std::fs::read_to_string(variant_dir.join("expected.json"))?)?;
    let mut ds = 0f64;
    for (k, v) in expected["logs"][0].as_object().context("expected.json: no logs")? {
        let ours = metrics[k].as_f64().with_context(|| format!("metric {k} is missing"))?;
        ds = ds.max((ours - v.as_f64().unwrap_or(f64::NAN)).abs());
    }
    let mut o = Outcome::new(dw, 1e-5);
    o.extra = json!({"metrics_max_abs_diff": ds, "metrics_tolerance": 1e-5});
    if ds.is_nan() || ds > 1e-5 {
        o.max_abs_diff = f64::INFINITY;
    }
    Ok(o)
}

/// `rltune grpo-step` / `rloo-step` on a TRL 1.16.0 fixture variant.
fn group_step(fx: &Path, cmd: &str, variant: &str, reference: bool, device: &str) -> Result<Outcome> {
    let out = scratch(variant)?;
    let path = |p: PathBuf| p.to_string_lossy().into_owned();
    let (init, refm, rollouts) =
        (path(fx.join("grpo/init")), path(fx.join("grpo/ref")), path(fx.join("grpo/rollouts.jsonl")));
    let config = path(fx.join("grpo").join(variant).join("config.toml"));
    let out_s = path(out.clone());
    let mut args = vec![
        cmd,
        "--model",
        &init,
        "--rollouts",
        &rollouts,
        "--config",
        &config,
        "--output",
        &out_s,
        "--device",
        device,
    ];
    if reference {
        args.extend(["--ref-model", &refm]);
    }
    rltune(&args)?;
    let stats: Value = serde_json::from_str(&std::fs::read_to_string(out.join("stats.json"))?)?;
    let o = compare_run(&out.join("model.safetensors"), &stats, &fx.join("grpo").join(variant));
    std::fs::remove_dir_all(&out).ok();
    o
}

/// `rltune dpo` on TRL 1.16.0's `hinge` fixture: one step over one batch of every row.
fn dpo_fixture(fx: &Path, device: &str) -> Result<Outcome> {
    let out = scratch("dpo")?;
    let path = |p: PathBuf| p.to_string_lossy().into_owned();
    let (init, refm, data) =
        (path(fx.join("dpo/init")), path(fx.join("dpo/ref")), path(fx.join("dpo/rows.jsonl")));
    let (config, out_s) = (path(fx.join("dpo/hinge/config.toml")), path(out.clone()));
    rltune(&[
        "dpo",
        "--model",
        &init,
        "--ref-model",
        &refm,
        "--data",
        &data,
        "--config",
        &config,
        "--output",
        &out_s,
        "--device",
        device,
    ])?;
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    let first: Value = serde_json::from_str(metrics.lines().next().context("metrics.jsonl is empty")?)?;
    let o = compare_run(&out.join("model.safetensors"), &first, &fx.join("dpo/hinge"));
    std::fs::remove_dir_all(&out).ok();
    o
}
