//! Generation throughput on a random GPT-2-small-shaped model (f32, CPU).
//!
//! Batch B = 16 prompts of 8 tokens, 24 new tokens each, `stop_at_eos: false`, so every run
//! samples exactly 16 · 24 = 384 tokens. One warm-up run, then `--runs N` (default 5, at least 3)
//! timed runs of [`rltune_models::generation::generate`]; prints the median and tokens/s, then one JSON
//! line (`"bench": "generate"`). `--batch N` changes B, `--new-tokens N` the 24 new tokens, and
//! `--family neox` takes a random Pythia-160M-shaped GPT-NeoX instead, whose KV cache is the
//! tensor path's (what every family takes on a GPU), `--family llama` a SmolLM2-135M-shaped
//! Llama (grouped-query attention), and `--composed` runs candle's composed ops (the GPU's code
//! path, on which Llama takes the tensor path too); the profile runs only on GPT-2 at the
//! defaults.
//!
//! Set `CANDLE_NUM_THREADS=1` to measure what the `rltune` binary runs (it sets that variable:
//! candle's spinning element-wise pool otherwise takes cores from the matmul pool, see
//! `rltune_kernels::cpu`); unset, candle's default is one element-wise thread per core.
//!
//! `--profile` then re-runs the same loop as `generate` with a timer around each phase (prefill,
//! and per decode step: forward through the blocks, lm_head matmul, `to_vec2`, the sampler's
//! `sample_pure` per row, mask/bias building), checks that it draws the same tokens as
//! `generate`, and times a few alternatives that the optimization proposals relied on. The
//! op-by-op breakdown of block 0 times the composed attention (head split, KV concatenation,
//! batched matmuls), which `generate` replaced by `ops::cached_self_attention`.
//!
//! ```sh
//! cargo run --release -p rltune --example bench_generate -- --profile
//! ```

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use rand::SeedableRng;
use rltune_models::generation::sampler::{self, SamplerConfig};
use rltune_models::generation::{generate, GenerationConfig};
use rltune_models::gpt2::Gpt2Config;
use rltune_models::layers::{
    attention, causal_bias, merge_heads, position_ids_from_mask, split_heads, Activation, Conv1D, LayerNorm,
};
use rltune_models::params::{Init, ParamStore};
use rltune_models::tokenizer::{pad, PaddingSide};
use rltune_models::{CausalLm, CausalLmConfig};

/// Shape legend: B batch, P prompt length, N new tokens, C hidden, V vocabulary.
const B: usize = 16;
const P: usize = 8;
const N: usize = 24;
const C: usize = 768;
const V: usize = 50257;

fn main() -> rltune_models::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let profile = args.iter().any(|a| a == "--profile");
    // The number after `flag`, else `default`.
    let number = |flag: &str, default: usize| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .and_then(|s| s.parse().ok())
            .unwrap_or(default)
    };
    let runs = number("--runs", 5).max(3);
    let b_sz = number("--batch", B).max(1);
    let n = number("--new-tokens", N).max(1);
    let _composed = args.iter().any(|a| a == "--composed").then(rltune_kernels::composed_scope);

    let dev = Device::Cpu;
    // `--family neox`: a Pythia-160M-shaped GPT-NeoX, whose cache is the tensor path's
    // (`layers::KvCache::append`, what every family takes on a GPU).
    // `--family llama`: a SmolLM2-135M-shaped Llama (9 query heads sharing 3 key heads); on the
    // CPU in f32 it decodes through its in-place `KvBlock` unless `--composed` (candle's
    // composed ops, the GPU's code path) is given too.
    let family = args.windows(2).find(|w| w[0] == "--family").map_or("gpt2", |w| w[1].as_str());
    let (model, cfg) = match family {
        "neox" => {
            let mut c = rltune_models::gpt_neox::GptNeoXConfig::tiny(V, C, 12, 12);
            c.max_position_embeddings = 2048;
            ("pythia-160m-random", CausalLmConfig::GptNeoX(c))
        }
        "llama" => {
            let mut c = rltune_models::llama::LlamaConfig::tiny(49152, 576, 30, 9, 3);
            c.max_position_embeddings = Some(2048);
            ("smollm2-135m-random", CausalLmConfig::Llama(c))
        }
        "gpt2" => ("gpt2-small-random", CausalLmConfig::Gpt2(Gpt2Config::tiny(V, C, 12, 12, 1024))),
        other => {
            return Err(rltune_models::Error::Input(format!(
                "--family {other}: expected gpt2, neox or llama"
            )))
        }
    };
    let store = ParamStore::random(0, false, DType::F32, &dev)?;
    let t0 = Instant::now();
    let lm = CausalLm::load(&store.root(), &cfg)?;
    eprintln!("built random {model} in {:.1}s", t0.elapsed().as_secs_f64());

    // (B, P) prompt ids, deterministic.
    let prompts: Vec<Vec<u32>> =
        (0..b_sz).map(|i| (0..P).map(|j| ((i * 131 + j * 17 + 1) % (V - 1)) as u32).collect()).collect();
    let gen = GenerationConfig { max_new_tokens: n, stop_at_eos: false, seed: 0, ..Default::default() };

    let warm = Instant::now();
    let reference = generate(&lm, None, &prompts, &gen, &dev)?;
    eprintln!("warm-up: {:.3}s", warm.elapsed().as_secs_f64());
    let mut times = Vec::with_capacity(runs);
    for r in 0..runs {
        let t = Instant::now();
        let out = generate(&lm, None, &prompts, &gen, &dev)?;
        times.push(t.elapsed().as_secs_f64());
        assert!(out.iter().all(|s| s.response_ids.len() == n));
        eprintln!("run {r}: {:.3}s", times[r]);
    }
    let median = median(&times);
    let tps = (b_sz * n) as f64 / median;
    println!("generate: {model} B={b_sz} prompt={P} new={n} ({} tokens/run), {runs} runs", b_sz * n);
    println!("median {median:.3} s, {tps:.1} tokens/s");
    // candle's element-wise pool size; the `rltune` binary sets 1 (see `rltune_kernels::cpu`).
    let candle_threads = std::env::var("CANDLE_NUM_THREADS").unwrap_or_else(|_| "default".into());
    println!("CANDLE_NUM_THREADS={candle_threads}");
    let times_json: Vec<String> = times.iter().map(|t| format!("{t:.4}")).collect();
    println!(
        "{{\"bench\":\"generate\",\"model\":\"{model}\",\"dtype\":\"f32\",\"device\":\"cpu\",\
         \"batch\":{b_sz},\"prompt_len\":{P},\"new_tokens\":{n},\"runs\":{runs},\"times_s\":[{}],\
         \"median_s\":{median:.4},\"tokens_per_s\":{tps:.2},\"candle_num_threads\":\"{candle_threads}\"}}",
        times_json.join(",")
    );

    if profile && b_sz == B && family == "gpt2" && n == N {
        let mut prof = Profile::default();
        let mut drawn = Vec::new();
        for _ in 0..runs {
            drawn = profiled_generate(&lm, &prompts, &gen, &dev, &mut prof)?;
        }
        let same = drawn.iter().zip(&reference).all(|(d, s)| d == &s.response_ids);
        assert!(same, "the profiled loop must draw the same tokens as generate()");
        prof.report(runs);
        block_breakdown(&store, runs)?;
        alternatives(&store, &lm, &prompts, &gen, &dev, runs)?;
    }
    Ok(())
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Accumulated time per phase, over all profiled runs.
#[derive(Default)]
struct Profile {
    prefill: Duration,
    decode_forward: Duration,
    lm_head: Duration,
    to_vec2: Duration,
    sample: Duration,
    inputs: Duration,
    total: Duration,
    steps: usize,
}

impl Profile {
    fn report(&self, runs: usize) {
        let per_run = |d: Duration| d.as_secs_f64() * 1e3 / runs as f64;
        let total = per_run(self.total);
        let steps = self.steps as f64 / runs as f64;
        println!("\nprofile (ms per run, mean of {runs} runs; {steps} sampling steps per run):");
        let rows = [
            ("prefill forward (B x P through 12 blocks)", self.prefill, 1.0),
            ("decode forward (embeddings + 12 blocks + ln_f)", self.decode_forward, steps - 1.0),
            ("lm_head matmul (B x 768 @ 768 x 50257)", self.lm_head, steps),
            ("to_vec2 of (B, V) logits", self.to_vec2, steps),
            ("sampler::sample_pure (f32 pass + f64 scan, per row)", self.sample, steps),
            ("mask / positions / bias tensors", self.inputs, steps),
        ];
        let mut accounted = 0.0;
        for (name, d, n) in rows {
            let ms = per_run(d);
            accounted += ms;
            println!("  {name:<48} {ms:>9.2} ms {:>5.1}%   {:>8.3} ms/step", 100.0 * ms / total, ms / n);
        }
        println!(
            "  {:<48} {:>9.2} ms {:>5.1}%",
            "other",
            total - accounted,
            100.0 * (total - accounted) / total
        );
        println!("  {:<48} {total:>9.2} ms", "total");
    }
}

fn timed<T>(acc: &mut Duration, f: impl FnOnce() -> rltune_models::Result<T>) -> rltune_models::Result<T> {
    let t = Instant::now();
    let out = f();
    *acc += t.elapsed();
    out
}

/// The loop of [`generate`] (no value head, `stop_at_eos: false`), with a timer per phase.
fn profiled_generate(
    lm: &CausalLm,
    prompts: &[Vec<u32>],
    gen: &GenerationConfig,
    dev: &Device,
    prof: &mut Profile,
) -> rltune_models::Result<Vec<Vec<u32>>> {
    let start = Instant::now();
    let pad_id = lm.config().eos_token_ids()[0];
    let b = prompts.len();
    let (ids, mut mask) = pad(prompts, pad_id, PaddingSide::Left);
    let prompt_len = ids[0].len();
    let mut rng = rand::rngs::StdRng::seed_from_u64(gen.seed);
    let mut cache = lm.new_cache();
    let mut out = vec![Vec::new(); b];
    let mut next_pos: Vec<u32> = mask.iter().map(|m| m.iter().map(|&x| x as u32).sum()).collect();
    let (input, positions, bias) = timed(&mut prof.inputs, || {
        Ok((
            Tensor::new(ids, dev)?,
            position_ids_from_mask(&mask, dev)?,
            causal_bias(&mask, prompt_len, DType::F32, dev)?,
        ))
    })?;
    let mut hidden = timed(&mut prof.prefill, || lm.forward(&input, &positions, &bias, Some(&mut cache)))?;
    for step in 0..gen.max_new_tokens {
        prof.steps += 1;
        let logits = timed(&mut prof.lm_head, || {
            let last = hidden.narrow(1, hidden.dim(1)? - 1, 1)?; // (B, 1, C)
            lm.logits(&last)?.squeeze(1)?.to_dtype(DType::F32).map_err(Into::into)
        })?;
        let logits = timed(&mut prof.to_vec2, || Ok(logits.to_vec2::<f32>()?))?;
        let mut next = vec![pad_id; b];
        for (i, row) in logits.iter().enumerate() {
            // As generate(): one uniform per row in row order, the pure-sampling path.
            let u: f64 = rand::Rng::gen(&mut rng);
            let t = Instant::now();
            let (tok, _) = sampler::sample_pure(row, gen.temperature, &[], u);
            prof.sample += t.elapsed();
            out[i].push(tok as u32);
            next[i] = tok as u32;
        }
        if step + 1 == gen.max_new_tokens {
            break;
        }
        let (input, positions, bias) = timed(&mut prof.inputs, || {
            mask.iter_mut().for_each(|m| m.push(1));
            let pos = next_pos.clone();
            next_pos.iter_mut().for_each(|p| *p += 1);
            Ok((
                Tensor::from_vec(next, (b, 1), dev)?,
                Tensor::from_vec(pos, (b, 1), dev)?,
                causal_bias(&mask, 1, DType::F32, dev)?,
            ))
        })?;
        hidden = timed(&mut prof.decode_forward, || lm.forward(&input, &positions, &bias, Some(&mut cache)))?;
    }
    prof.total += start.elapsed();
    Ok(out)
}

/// One decode step through block 0 (B rows, one new position, S = P + N/2 cached keys), op by
/// op, with the block's real weights; times 12 gives the blocks' share of a decode step. Also
/// times the same matmuls with the weights stored `[out, in]` (nn.Linear layout) and multiplied
/// through a transposed view, which is what `lm_head` does.
fn block_breakdown(store: &ParamStore, runs: usize) -> rltune_models::Result<()> {
    let reps = runs.max(5) * 4;
    let dev = Device::Cpu;
    let h0 = store.root().pp("transformer").pp("h").pp(0);
    let ln_1 = LayerNorm::load(&h0.pp("ln_1"), C, 1e-5)?;
    let ln_2 = LayerNorm::load(&h0.pp("ln_2"), C, 1e-5)?;
    let c_attn = Conv1D::load(&h0.pp("attn").pp("c_attn"), C, 3 * C, 0.02)?;
    let attn_proj = Conv1D::load(&h0.pp("attn").pp("c_proj"), C, C, 0.02)?;
    let c_fc = Conv1D::load(&h0.pp("mlp").pp("c_fc"), C, 4 * C, 0.02)?;
    let mlp_proj = Conv1D::load(&h0.pp("mlp").pp("c_proj"), 4 * C, C, 0.02)?;
    let act = Activation::parse("activation_function", "gelu_new")?;
    let (n_head, s) = (12, P + N / 2);
    let x = Tensor::randn(0f32, 1.0, (B, 1, C), &dev)?;
    let past_k = Tensor::randn(0f32, 1.0, (B, n_head, s - 1, C / n_head), &dev)?;
    let past_v = past_k.clone();
    let bias = causal_bias(&vec![vec![1u8; s]; B], 1, DType::F32, &dev)?;

    let ms = |t: f64| t * 1e3;
    let mut rows: Vec<(&str, f64)> = Vec::new();
    let xn = ln_1.forward(&x)?;
    rows.push((
        "ln_1 + ln_2",
        bench(reps, || {
            ln_1.forward(&x)?;
            ln_2.forward(&x).map(|_| ())
        })?,
    ));
    rows.push(("attn.c_attn (B x 768 @ 768 x 2304)", bench(reps, || c_attn.forward(&xn).map(|_| ()))?));
    let qkv = c_attn.forward(&xn)?;
    rows.push((
        "split heads + KV cache cat",
        bench(reps, || {
            let k = split_heads(&qkv.narrow(2, C, C)?, n_head)?;
            let v = split_heads(&qkv.narrow(2, 2 * C, C)?, n_head)?;
            std::hint::black_box(Tensor::cat(&[&past_k, &k], 2)?);
            std::hint::black_box(Tensor::cat(&[&past_v, &v], 2)?);
            std::hint::black_box(split_heads(&qkv.narrow(2, 0, C)?, n_head)?);
            Ok(())
        })?,
    ));
    let q = split_heads(&qkv.narrow(2, 0, C)?, n_head)?;
    let k = Tensor::cat(&[&past_k, &split_heads(&qkv.narrow(2, C, C)?, n_head)?], 2)?;
    let v = Tensor::cat(&[&past_v, &split_heads(&qkv.narrow(2, 2 * C, C)?, n_head)?], 2)?;
    let scale = 1.0 / ((C / n_head) as f64).sqrt();
    rows.push((
        "attention (scores, softmax, @ v)",
        bench(reps, || attention(&q, &k, &v, &bias, scale).map(|_| ()))?,
    ));
    let y = merge_heads(&attention(&q, &k, &v, &bias, scale)?)?;
    rows.push(("attn.c_proj (B x 768 @ 768 x 768)", bench(reps, || attn_proj.forward(&y).map(|_| ()))?));
    rows.push(("mlp.c_fc (B x 768 @ 768 x 3072)", bench(reps, || c_fc.forward(&xn).map(|_| ()))?));
    let hid = c_fc.forward(&xn)?;
    rows.push(("gelu_new (B x 3072)", bench(reps, || act.forward(&hid).map(|_| ()))?));
    rows.push(("mlp.c_proj (B x 3072 @ 3072 x 768)", bench(reps, || mlp_proj.forward(&hid).map(|_| ()))?));
    let whole = rows.iter().map(|r| r.1).sum::<f64>();
    println!("\ndecode block 0, op by op (median ms; B = {B}, S = {s}); x12 = blocks' cost per step:");
    for (name, t) in &rows {
        println!(
            "  {name:<44} {:>8.3} ms {:>5.1}%   x12 = {:>7.2} ms",
            ms(*t),
            100.0 * t / whole,
            12.0 * ms(*t)
        );
    }
    println!("  {:<44} {:>8.3} ms          x12 = {:>7.2} ms", "sum", ms(whole), 12.0 * ms(whole));

    // Cache effects: layer 0's weights reused 12 times (as above) vs each layer's own weights,
    // streamed from memory once per step as in the real forward.
    let fcs = (0..12)
        .map(|i| {
            Conv1D::load(&store.root().pp("transformer").pp("h").pp(i).pp("mlp").pp("c_fc"), C, 4 * C, 0.02)
        })
        .collect::<rltune_models::Result<Vec<_>>>()?;
    let same = bench(reps, || (0..12).try_for_each(|_| c_fc.forward(&xn).map(|_| ())))?;
    let each = bench(reps, || fcs.iter().try_for_each(|fc| fc.forward(&xn).map(|_| ())))?;
    let gbs = 12.0 * (C * 4 * C * 4) as f64 / each / 1e9;
    println!(
        "  mlp.c_fc x12: layer 0's weights 12 times {:>7.2} ms; each layer's own weights {:>7.2} ms \
         ({gbs:.1} GB/s of weights)",
        ms(same),
        ms(each)
    );

    // The same four matmuls with `[out, in]` weights multiplied through `.t()` (nn.Linear layout).
    let x2 = xn.squeeze(1)?; // (B, C)
    let hid2 = hid.squeeze(1)?; // (B, 4C)
    let mut conv = 0.0;
    let mut linear = 0.0;
    for (w, input) in
        [(&c_attn.weight, &x2), (&attn_proj.weight, &x2), (&c_fc.weight, &x2), (&mlp_proj.weight, &hid2)]
    {
        let w_out_in = w.t()?.contiguous()?; // (out, in)
        conv += bench(reps, || Ok(input.matmul(w).map(|_| ())?))?;
        linear += bench(reps, || Ok(input.matmul(&w_out_in.t()?).map(|_| ())?))?;
    }
    println!(
        "  block matmuls, Conv1D [in, out] weights (as now): {:>7.3} ms; [out, in] weights via .t(): {:>7.3} ms",
        ms(conv),
        ms(linear)
    );
    Ok(())
}

/// Median seconds of `f` over `runs` calls (after one warm-up call).
fn bench(runs: usize, mut f: impl FnMut() -> rltune_models::Result<()>) -> rltune_models::Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(median(&times))
}

/// Times the alternatives behind the optimization proposals, on one decode step's data.
fn alternatives(
    store: &ParamStore,
    lm: &CausalLm,
    prompts: &[Vec<u32>],
    gen: &GenerationConfig,
    dev: &Device,
    runs: usize,
) -> rltune_models::Result<()> {
    let reps = runs.max(5) * 4;
    let ms = |s: f64| s * 1e3;
    // A realistic (B, 1, C) hidden state: the prefill's last position.
    let (ids, mask) = pad(prompts, 0, PaddingSide::Left);
    let input = Tensor::new(ids, dev)?;
    let hidden = lm.forward(
        &input,
        &position_ids_from_mask(&mask, dev)?,
        &causal_bias(&mask, P, DType::F32, dev)?,
        None,
    )?;
    let last = hidden.narrow(1, P - 1, 1)?.contiguous()?; // (B, 1, C)
    let last2 = last.squeeze(1)?; // (B, C)
    let wte = store.root().pp("transformer").pp("wte").get("weight", (V, C), Init::Zeros)?; // (V, C)
    let wte_t = wte.t()?.contiguous()?; // (C, V), contiguous

    println!("\nalternatives (median ms per sampling step, B = {B}):");
    let t = bench(reps, || lm.logits(&last).map(|_| ()))?;
    println!("  lm_head as now: (B, C) @ wte.t() (strided view)           {:>8.2} ms", ms(t));
    let t = bench(reps, || Ok(last2.matmul(&wte_t).map(|_| ())?))?;
    println!("  lm_head with a contiguous (C, V) copy of wte              {:>8.2} ms", ms(t));
    let bf = wte_t.to_dtype(DType::BF16)?;
    let last_bf = last2.to_dtype(DType::BF16)?;
    let t = bench(reps, || Ok(last_bf.matmul(&bf).map(|_| ())?))?;
    println!("  lm_head in bf16 (contiguous (C, V))                       {:>8.2} ms", ms(t));
    let hidden_b1 = last2.narrow(0, 0, 1)?;
    let t = bench(reps, || Ok(hidden_b1.matmul(&wte_t).map(|_| ())?))?;
    println!("  lm_head for B = 1 (contiguous), for scale                 {:>8.2} ms", ms(t));

    let logits_t = lm.logits(&last)?.squeeze(1)?; // (B, V)
    let logits = logits_t.to_vec2::<f32>()?;
    let t = bench(reps, || Ok(logits_t.to_vec2::<f32>().map(|_| ())?))?;
    println!("  to_vec2 of (B, V)                                         {:>8.2} ms", ms(t));
    let t = bench(reps, || Ok(logits_t.flatten_all()?.to_vec1::<f32>().map(|_| ())?))?;
    println!("  flatten_all + to_vec1 of (B, V) (one buffer)              {:>8.2} ms", ms(t));
    let t = bench(reps, || Ok(rltune_kernels::log_softmax_last_dim(&logits_t).map(|_| ())?))?;
    println!("  log_softmax on the (B, V) tensor (rltune_models::ops, f32)       {:>8.2} ms", ms(t));

    let scfg =
        SamplerConfig { temperature: gen.temperature, top_k: gen.top_k, top_p: gen.top_p, min_p: gen.min_p };
    let t = bench(reps, || {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        for row in &logits {
            let lp = sampler::log_distribution(row, &scfg, &[]);
            std::hint::black_box(sampler::sample(&lp, &mut rng));
        }
        Ok(())
    })?;
    println!("  sampler as now: B x (log_distribution + sample)           {:>8.2} ms", ms(t));
    let t = bench(reps, || {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        for row in &logits {
            std::hint::black_box(fused_sample(row, gen.temperature, &mut rng));
        }
        Ok(())
    })?;
    println!("  fused sampler: no Vec<f64>, one exp pass + partial scan   {:>8.2} ms", ms(t));
    let t = bench(reps, || {
        use rayon::prelude::*;
        let us: Vec<f64> = {
            use rand::Rng;
            let mut rng = rand::rngs::StdRng::seed_from_u64(0);
            (0..logits.len()).map(|_| rng.gen()).collect()
        };
        let picks: Vec<(usize, f64)> = logits
            .par_iter()
            .zip(us.par_iter())
            .map(|(row, &u)| fused_pick(row, gen.temperature, u))
            .collect();
        std::hint::black_box(picks);
        Ok(())
    })?;
    println!("  fused sampler, rows in parallel (rayon, same draws)      {:>8.2} ms", ms(t));
    // Agreement of the fused sampler with the current one (same uniform draws).
    let mut rng_a = rand::rngs::StdRng::seed_from_u64(9);
    let mut rng_b = rand::rngs::StdRng::seed_from_u64(9);
    let mut worst = 0f64;
    for row in &logits {
        let lp = sampler::log_distribution(row, &scfg, &[]);
        let a = sampler::sample(&lp, &mut rng_a);
        let (b, lp_b) = fused_sample(row, gen.temperature, &mut rng_b);
        assert_eq!(a, b, "fused sampler must draw the same token");
        worst = worst.max((lp[a] - lp_b).abs());
    }
    println!("  (fused sampler draws the same tokens; max |logprob diff| {worst:.1e})");
    Ok(())
}

/// One draw from `softmax(row / t)` without materializing the distribution: returns the index
/// and its logprob. Same arithmetic (f64) and the same `u` as `sampler::sample`.
fn fused_sample<R: rand::Rng>(row: &[f32], t: f64, rng: &mut R) -> (usize, f64) {
    fused_pick(row, t, rng.gen())
}

fn fused_pick(row: &[f32], t: f64, u: f64) -> (usize, f64) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64 / t;
    let z: f64 = row.iter().map(|&l| (l as f64 / t - max).exp()).sum();
    let lse = max + z.ln();
    // Scan the CDF as `sampler::sample` does, on exp(x - lse).
    let mut cum = 0.0;
    for (i, &l) in row.iter().enumerate() {
        let lp = l as f64 / t - lse;
        cum += lp.exp();
        if u < cum {
            return (i, lp);
        }
    }
    let i = row.len() - 1;
    (i, row[i] as f64 / t - lse)
}
