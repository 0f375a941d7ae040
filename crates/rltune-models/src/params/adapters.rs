//! The LoRA half of [`ParamStore`]: building a store with adapters ([`ParamStore::with_lora`],
//! [`ParamStore::with_adapter`]), handing them to the layers, saving and merging them. The
//! adapters' format and semantics are in [`crate::lora`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Shape, Tensor, Var};
use rand::{Rng, SeedableRng};

use super::{Init, Inner, ParamStore};
use crate::error::{Error, Result};
use crate::lora::*;

impl ParamStore {
    /// This store's tensors as a frozen base with new LoRA adapters from `cfg` (`model_type`
    /// picks PEFT's default `target_modules`; `origin` names where `cfg` was set, for errors;
    /// `seed` draws the `A` matrices). The tensors are shared, not copied: load the base frozen
    /// (`trainable = false`) to avoid a copy into variables first.
    pub fn with_lora(&self, cfg: &LoraConfig, model_type: &str, origin: &str, seed: u64) -> Result<Self> {
        cfg.validate("").map_err(|e| Error::Input(format!("{origin}: {e}")))?;
        if cfg.lora_dropout > 0.0 {
            tracing::warn!(
                "{origin}: lora_dropout = {} is saved in adapter_config.json but not applied (rltune \
                 applies no dropout; see docs/trl-deviations.md)",
                cfg.lora_dropout
            );
        }
        let targets = cfg.targets(model_type).map_err(|m| Error::Input(format!("{origin}: {m}")))?;
        let matcher = Matcher::new(&targets).map_err(|m| Error::Input(format!("{origin}: {m}")))?;
        let state = LoraState {
            cfg: cfg.clone(),
            targets,
            matcher,
            meta: AdapterMeta::default(),
            origin: origin.to_string(),
            file: None,
            from_file: BTreeMap::new(),
            adapters: BTreeMap::new(),
            saved: BTreeMap::new(),
            layouts: BTreeMap::new(),
            seen: BTreeSet::new(),
            fan_in_fan_out: false,
            rng: rand::rngs::StdRng::seed_from_u64(seed),
            file_base: None,
        };
        Ok(self.with_state(state, BTreeMap::new()))
    }

    /// This store's tensors as a frozen base with the adapter saved in `dir`
    /// (`adapter_config.json`, `adapter_model.safetensors`, and `value_head.safetensors` when
    /// present), trainable: to continue training it, or to apply it.
    pub fn with_adapter(&self, dir: &Path, model_type: &str) -> Result<Self> {
        let cfg_path = dir.join(ADAPTER_CONFIG);
        if !cfg_path.is_file() {
            return Err(Error::config(
                &cfg_path,
                format!(
                    "no {ADAPTER_CONFIG}: --adapter takes a directory written by PEFT's save_pretrained \
                     or by an rltune run with [lora] (it holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
                ),
            ));
        }
        let value: serde_json::Value = crate::io::read_json(&cfg_path)?;
        let (cfg, meta) = LoraConfig::from_adapter_json(&value, &cfg_path)?;
        let weights = dir.join(ADAPTER_WEIGHTS);
        let from_file: BTreeMap<String, Tensor> =
            candle_core::safetensors::load(&weights, &candle_core::Device::Cpu)
                .map_err(|e| {
                    Error::weights(
                        &weights,
                        format!(
                    "cannot read the adapter's weights: {e} (PEFT writes them with safe_serialization=True)"
                ),
                    )
                })?
                .into_iter()
                .collect();
        let mut extra = BTreeMap::new();
        let head = dir.join(VALUE_HEAD_WEIGHTS);
        if head.is_file() {
            let ts = candle_core::safetensors::load(&head, &candle_core::Device::Cpu)
                .map_err(|e| Error::weights(&head, format!("cannot read the value head: {e}")))?;
            extra.extend(ts);
        }
        let origin = cfg_path.display().to_string();
        let store = self.with_lora(&cfg, model_type, &origin, 0)?;
        {
            let mut inner = store.lock();
            for (k, t) in extra {
                let t = t.to_device(&self.device)?.to_dtype(self.dtype)?;
                inner.tensors.insert(k, t);
            }
            let l = inner.lora.as_mut().expect("with_lora sets the LoRA state");
            l.file_base = meta.base_model.clone();
            l.meta = meta;
            l.file = Some(weights);
            l.from_file = from_file;
        }
        Ok(store)
    }

    fn with_state(&self, state: LoraState, extra: BTreeMap<String, Tensor>) -> Self {
        let inner = self.lock();
        let mut tensors: BTreeMap<String, Tensor> =
            inner.tensors.iter().map(|(k, t)| (k.clone(), t.detach())).collect();
        tensors.extend(extra);
        let new = Inner {
            tensors,
            vars: BTreeMap::new(),
            initialized: inner.initialized.clone(),
            aliases: inner.aliases.clone(),
            rng: inner.rng.clone(),
            stored_int: inner.stored_int.clone(),
            lora: Some(state),
            frozen: Default::default(),
        };
        Self {
            inner: Arc::new(Mutex::new(new)),
            trainable: true,
            fill_missing: self.fill_missing,
            dtype: self.dtype,
            device: self.device.clone(),
            source: self.source.clone(),
            adapters_on: true,
            grads: rltune_kernels::GradSlot::new(),
        }
    }

    /// Records `base` as the adapter's `base_model_name_or_path` (the model it was loaded on).
    pub fn set_lora_base(&self, base: &str) {
        if let Some(l) = self.lock().lora.as_mut() {
            l.meta.base_model = Some(base.to_string());
        }
    }

    /// Records the adapter's `task_type` (`"SEQ_CLS"` for a sequence classifier; PEFT's
    /// `CAUSAL_LM` when unset).
    pub fn set_lora_task_type(&self, task_type: &str) {
        if let Some(l) = self.lock().lora.as_mut() {
            l.meta.task_type = Some(task_type.to_string());
        }
    }

    /// Whether this store has LoRA adapters (on or off).
    pub fn has_lora(&self) -> bool {
        self.lock().lora.is_some()
    }

    /// The LoRA config, when the store has adapters.
    pub fn lora_config(&self) -> Option<LoraConfig> {
        self.lock().lora.as_ref().map(|l| l.cfg.clone())
    }

    /// The adapted modules (their paths), sorted.
    pub fn lora_modules(&self) -> Vec<String> {
        self.lock().lora.as_ref().map(|l| l.layouts.keys().cloned().collect()).unwrap_or_default()
    }

    /// The same base with the adapters turned off: a model built from it is the base model (the
    /// reference). Shares every tensor; holds no variables.
    pub fn without_adapters(&self) -> Self {
        Self { trainable: false, adapters_on: false, ..self.clone() }
    }

    /// The adapter of the linear layer `module`, created (or read from the adapter file) on
    /// first request; `None` when adapters are off or `target_modules` does not match it.
    pub(crate) fn adapter_for(
        &self,
        module: &str,
        d_in: usize,
        d_out: usize,
        layout: WeightLayout,
    ) -> Result<Option<LoraLinear>> {
        if !self.adapters_on {
            return Ok(None);
        }
        let (dtype, device) = (self.dtype, self.device.clone());
        let mut inner = self.lock();
        let Some(l) = inner.lora.as_mut() else { return Ok(None) };
        l.seen.insert(module.to_string());
        if !l.matcher.matches(module) {
            return Ok(None);
        }
        let r = l.cfg.r;
        let mut get = |which: &str, shape: (usize, usize), bound: f64| -> Result<Tensor> {
            let key = LoraState::key(module, which);
            if let Some(v) = l.adapters.get(&key) {
                return Ok(v.as_tensor().clone());
            }
            let t = match (l.from_file.remove(&key), &l.file) {
                (Some(t), file) => {
                    if t.dims() != [shape.0, shape.1] {
                        let file = file.clone().unwrap_or_default();
                        return Err(Error::weights(
                            &file,
                            format!(
                                "{key} has shape {:?}, but the model's layer {module} ({d_in} → {d_out}) \
                                 with r = {r} needs {:?}: the adapter was made for another base model{}; \
                                 pass the base model it was trained on",
                                t.dims(),
                                [shape.0, shape.1],
                                base_hint(l.file_base.as_deref())
                            ),
                        ));
                    }
                    t.to_device(&device)?.to_dtype(dtype)?
                }
                (None, Some(file)) => {
                    return Err(Error::weights(
                        file,
                        format!(
                            "no {key}: target_modules {} matches the model's layer {module}, but the \
                             adapter has no weights for it; the adapter was made for another base \
                             model{}",
                            l.targets,
                            base_hint(l.file_base.as_deref())
                        ),
                    ))
                }
                (None, None) => {
                    let n = shape.0 * shape.1;
                    let data: Vec<f32> = if bound == 0.0 {
                        vec![0.0; n]
                    } else {
                        (0..n).map(|_| l.rng.gen_range(-bound..bound) as f32).collect()
                    };
                    Tensor::from_vec(data, shape, &candle_core::Device::Cpu)?
                        .to_dtype(dtype)?
                        .to_device(&device)?
                }
            };
            let v = Var::from_tensor(&t)?;
            let t = v.as_tensor().clone();
            l.adapters.insert(key, v);
            Ok(t)
        };
        // PEFT's reset_lora_parameters: kaiming_uniform_(A, a=√5) is uniform in ±1/√fan_in; B = 0.
        let a = get("lora_A", (r, d_in), 1.0 / (d_in as f64).sqrt())?;
        let b = get("lora_B", (d_out, r), 0.0)?;
        l.layouts.insert(module.to_string(), layout);
        l.fan_in_fan_out |= layout == WeightLayout::InOut;
        Ok(Some(LoraLinear { a, b, scaling: l.cfg.scaling() }))
    }

    /// After a model is built from this store: fails when `target_modules` matched none of its
    /// linear layers (listing their names), or the adapter file holds adapters of layers the model
    /// does not have. A no-op without LoRA or with the adapters off.
    pub fn check_lora(&self) -> Result<()> {
        if !self.adapters_on {
            return Ok(());
        }
        let inner = self.lock();
        let Some(l) = &inner.lora else { return Ok(()) };
        if l.seen.is_empty() {
            return Ok(()); // no model built yet
        }
        if l.layouts.is_empty() {
            return Err(match &l.file {
                Some(_) => Error::config(PathBuf::from(&l.origin), l.no_match_error()),
                None => Error::Input(l.no_match_error()),
            });
        }
        let left: Vec<&String> = l
            .from_file
            .keys()
            .filter(|k| k.ends_with(".lora_A.weight") || k.ends_with(".lora_B.weight"))
            .collect();
        if let (Some(file), false) = (&l.file, left.is_empty()) {
            let shown: Vec<&str> = left.iter().take(4).map(|s| s.as_str()).collect();
            return Err(Error::weights(
                file,
                format!(
                    "{} adapter tensors name layers this model does not have (e.g. {}); the model's \
                     adapted layers are like {:?}: the adapter was made for another base model{}",
                    left.len(),
                    shown.join(", "),
                    l.layouts.keys().next().map(String::as_str).unwrap_or(""),
                    base_hint(l.file_base.as_deref())
                ),
            ));
        }
        if let Some(m) = &l.cfg.modules_to_save {
            let known = |n: &String| inner.tensors.keys().any(|k| in_modules(k, std::slice::from_ref(n)));
            // PEFT adds both of SEQ_CLS_MODULES to a classifier's adapter; a model has one.
            let seq_cls = l.meta.task_type.as_deref() == Some("SEQ_CLS");
            let checked = |n: &&String| !(seq_cls && SEQ_CLS_MODULES.contains(&n.as_str()));
            if !self.fill_missing {
                if let Some(missing) = m.iter().filter(checked).find(|n| !known(n)) {
                    return Err(Error::Input(format!(
                        "{}: modules_to_save names {missing:?}, which is no module of the model",
                        l.origin
                    )));
                }
            }
        }
        Ok(())
    }

    /// The trainable copy of `name` (a `modules_to_save` parameter or the value head), made on
    /// first request from the adapter file's copy, else the base's tensor (or `init`).
    pub(crate) fn get_saved(&self, name: &str, shape: &Shape, init: Option<Init>) -> Result<Tensor> {
        let from_file = {
            let mut inner = self.lock();
            let l = inner.lora.as_mut().expect("get_saved is called with LoRA");
            if let Some(v) = l.saved.get(name) {
                return Ok(v.as_tensor().clone());
            }
            l.from_file.remove(&format!("{KEY_PREFIX}{name}"))
        };
        let t = match from_file {
            Some(t) if t.shape() == shape => t.to_device(&self.device)?.to_dtype(self.dtype)?,
            Some(t) => {
                return Err(Error::weights(
                    &self.source,
                    format!(
                        "{KEY_PREFIX}{name} has shape {:?} but the model needs {:?}",
                        t.dims(),
                        shape.dims()
                    ),
                ))
            }
            None => self.get_plain(name, shape, init)?,
        };
        let v = Var::from_tensor(&t.detach().copy()?)?;
        let t = v.as_tensor().clone();
        self.lock().lora.as_mut().expect("LoRA").saved.insert(name.to_string(), v);
        Ok(t)
    }

    /// Writes the adapter into `dir` as PEFT's `save_pretrained` does: `adapter_config.json` and
    /// `adapter_model.safetensors` (adapters, `modules_to_save`), plus `value_head.safetensors`
    /// when the model has a value head. `base_model` is `base_model_name_or_path`. Each file is
    /// written to a temporary file and renamed.
    pub fn save_adapter(&self, dir: &Path, base_model: Option<&str>) -> Result<()> {
        let inner = self.lock();
        let l = inner
            .lora
            .as_ref()
            .ok_or_else(|| Error::Input("save_adapter: the store has no LoRA adapters".into()))?;
        let mut meta = l.meta.clone();
        if let Some(b) = base_model {
            meta.base_model = Some(b.to_string());
        }
        let json = l.cfg.to_adapter_json(&l.targets, &meta, l.fan_in_fan_out);
        let text = serde_json::to_string_pretty(&json).map_err(|e| Error::Input(e.to_string()))?;
        crate::io::write_bytes_atomic(&dir.join(ADAPTER_CONFIG), text.as_bytes())?;
        let owned = |v: &Var| v.as_tensor().detach().contiguous();
        let mut weights = HashMap::new();
        let mut head = HashMap::new();
        for (k, v) in &l.adapters {
            weights.insert(k.clone(), owned(v)?);
        }
        for (k, v) in &l.saved {
            if k.starts_with("v_head.") {
                head.insert(k.clone(), owned(v)?);
            } else {
                weights.insert(format!("{KEY_PREFIX}{k}"), owned(v)?);
            }
        }
        crate::io::save_safetensors(&dir.join(ADAPTER_WEIGHTS), &weights)?;
        if !head.is_empty() {
            crate::io::save_safetensors(&dir.join(VALUE_HEAD_WEIGHTS), &head)?;
        }
        Ok(())
    }

    /// A frozen store without LoRA whose adapted weights hold `W + ΔW` (PEFT's
    /// `merge_and_unload`), with the `modules_to_save` copies and the value head in place of the
    /// originals: what `rltune merge` saves.
    pub fn merged(&self) -> Result<Self> {
        let inner = self.lock();
        let l = inner
            .lora
            .as_ref()
            .ok_or_else(|| Error::Input("merge: the store has no LoRA adapters".into()))?;
        let mut map: HashMap<String, Tensor> =
            inner.tensors.iter().map(|(k, t)| (k.clone(), t.detach())).collect();
        for (module, &layout) in &l.layouts {
            let get = |which: &str| {
                l.adapters
                    .get(&LoraState::key(module, which))
                    .map(|v| v.as_tensor().detach())
                    .ok_or_else(|| Error::Input(format!("merge: no {which} for {module}")))
            };
            let lora = LoraLinear { a: get("lora_A")?, b: get("lora_B")?, scaling: l.cfg.scaling() };
            let name = format!("{module}.weight");
            let w = map.get(&name).ok_or_else(|| Error::Input(format!("merge: no base weight {name}")))?;
            // In f32, then back to the base's dtype (PEFT merges in the weight's dtype).
            let d = lora.delta_weight(layout)?;
            let merged = (w.to_dtype(DType::F32)? + d.to_dtype(DType::F32)?)?.to_dtype(w.dtype())?;
            map.insert(name, merged);
        }
        for (k, v) in &l.saved {
            map.insert(k.clone(), v.as_tensor().detach());
        }
        let aliases = inner.aliases.clone();
        drop(inner);
        let s = Self::from_tensors(map, false, self.dtype, &self.device, &self.source)?;
        for (alias, target) in aliases {
            s.tie(&alias, &target);
        }
        Ok(s)
    }
}

/// `" (its adapter_config.json names base_model_name_or_path = …)"`, when it does.
fn base_hint(base: Option<&str>) -> String {
    match base {
        Some(b) => format!(" (its {ADAPTER_CONFIG} names base_model_name_or_path = {b:?})"),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::gpt2::Gpt2Config;
    use crate::layers::{causal_bias, position_ids_from_mask};
    use crate::llama::LlamaConfig;
    use crate::{CausalLm, CausalLmConfig};
    use candle_core::{Device, D};

    fn configs() -> Vec<CausalLmConfig> {
        vec![
            CausalLmConfig::Gpt2(Gpt2Config::tiny(23, 16, 2, 2, 16)),
            CausalLmConfig::Llama(LlamaConfig::tiny(23, 16, 2, 4, 2)),
        ]
    }

    /// `(B, T, V)` logits of `lm` on a fixed left-padded batch.
    fn logits(lm: &CausalLm, dtype: DType) -> Tensor {
        let dev = Device::Cpu;
        let mask = vec![vec![1u8; 5], vec![0, 1, 1, 1, 1]];
        let ids = Tensor::new(&[[1u32, 4, 9, 16, 3], [0, 5, 7, 2, 11]], &dev).unwrap();
        let pos = position_ids_from_mask(&mask, &dev).unwrap();
        let bias = causal_bias(&mask, 5, dtype, &dev).unwrap();
        lm.logits(&lm.forward(&ids, &pos, &bias, None).unwrap()).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        let d = (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(D::Minus1).unwrap();
        d.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
    }

    /// Sets every `B` to random values, so the adapters change the outputs.
    fn randomize_b(store: &ParamStore, seed: u64) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for (name, v) in store.vars().iter().filter(|(n, _)| n.ends_with("lora_B.weight")) {
            let n = v.elem_count();
            let data: Vec<f32> = (0..n).map(|_| rng.gen_range(-0.5f32..0.5)).collect();
            let t = Tensor::from_vec(data, v.shape(), &Device::Cpu).unwrap().to_dtype(v.dtype()).unwrap();
            v.set(&t).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    fn lora_cfg(targets: &[&str]) -> LoraConfig {
        LoraConfig {
            r: 4,
            lora_alpha: 8.0,
            target_modules: Some(TargetModules::Names(targets.iter().map(|s| s.to_string()).collect())),
            ..Default::default()
        }
    }

    #[test]
    fn new_adapters_leave_the_model_unchanged_and_only_they_train() {
        for cfg in configs() {
            let base = ParamStore::random(3, false, DType::F32, &Device::Cpu).unwrap();
            let plain = logits(&CausalLm::load(&base.root(), &cfg).unwrap(), DType::F32);
            let store = base.with_lora(&LoraConfig::default(), cfg.model_type(), "[lora]", 1).unwrap();
            let lm = CausalLm::load(&store.root(), &cfg).unwrap();
            assert_eq!(max_diff(&logits(&lm, DType::F32), &plain), 0.0, "{}", cfg.model_type());
            let names: Vec<String> = store.vars().into_iter().map(|(n, _)| n).collect();
            // PEFT's defaults: c_attn for GPT-2, q_proj and v_proj for Llama; two layers each.
            let per_layer = if cfg.model_type() == "gpt2" { 2 } else { 4 };
            assert_eq!(names.len(), 2 * per_layer, "{names:?}");
            assert!(names.iter().all(|n| n.starts_with(KEY_PREFIX) && n.contains(".lora_")), "{names:?}");
            // The reference view shares the store and holds no variables.
            let reference = store.frozen_copy().unwrap();
            assert!(Arc::ptr_eq(&reference.inner, &store.inner));
            assert!(reference.vars().is_empty() && !reference.trainable());
        }
    }

    #[test]
    fn adapted_logits_equal_the_merged_models_and_the_base_when_off() {
        for cfg in configs() {
            let targets: &[&str] = if cfg.model_type() == "gpt2" {
                &["c_attn", "c_fc", "c_proj"]
            } else {
                &["q_proj", "o_proj", "down_proj"]
            };
            let base = ParamStore::random(5, false, DType::F32, &Device::Cpu).unwrap();
            let plain = logits(&CausalLm::load(&base.root(), &cfg).unwrap(), DType::F32);
            let store = base.with_lora(&lora_cfg(targets), cfg.model_type(), "[lora]", 2).unwrap();
            let lm = CausalLm::load(&store.root(), &cfg).unwrap();
            randomize_b(&store, 9);
            let adapted = logits(&lm, DType::F32);
            let moved = max_diff(&adapted, &plain);
            assert!(moved > 1e-2, "the adapters do not change the logits ({moved:.3e})");
            let merged = logits(&CausalLm::load(&store.merged().unwrap().root(), &cfg).unwrap(), DType::F32);
            let d = max_diff(&adapted, &merged);
            println!("{}: merged vs adapted logits maxdiff {d:.3e}", cfg.model_type());
            assert!(d < 1e-5, "{}: {d:.3e}", cfg.model_type());
            let off =
                logits(&CausalLm::load(&store.frozen_copy().unwrap().root(), &cfg).unwrap(), DType::F32);
            assert_eq!(max_diff(&off, &plain), 0.0);
        }
    }

    /// The adapters' gradients (through `ops::linear`'s hand-written backward) against central
    /// finite differences in f64, on Llama (`nn.Linear`) and GPT-2 (`Conv1D`).
    #[test]
    fn adapter_gradients_match_finite_differences() {
        let configs = vec![
            CausalLmConfig::Gpt2(Gpt2Config::tiny(23, 8, 1, 2, 16)),
            CausalLmConfig::Llama(LlamaConfig::tiny(23, 8, 1, 2, 1)),
        ];
        for cfg in configs {
            let dev = Device::Cpu;
            let base = ParamStore::random(7, false, DType::F64, &dev).unwrap();
            let targets: &[&str] =
                if cfg.model_type() == "gpt2" { &["c_attn", "c_proj"] } else { &["q_proj", "down_proj"] };
            let store = base.with_lora(&lora_cfg(targets), cfg.model_type(), "[lora]", 4).unwrap();
            let lm = CausalLm::load(&store.root(), &cfg).unwrap();
            randomize_b(&store, 1);
            let mut rng = rand::rngs::StdRng::seed_from_u64(3);
            // Zero at the padding position (row 1, position 0): its fully masked attention row is
            // too coarse in f64 for finite differences (see llama.rs's gradient test).
            let proj: Vec<f64> =
                (0..2 * 5 * 23).map(|i| if i / 23 == 5 { 0.0 } else { rng.gen_range(-1.0..1.0) }).collect();
            let proj = Tensor::from_vec(proj, (2, 5, 23), &dev).unwrap();
            let loss = || (logits(&lm, DType::F64) * &proj).unwrap().sum_all().unwrap();
            let grads = loss().backward().unwrap();
            let mut worst = 0f64;
            for (name, var) in store.vars() {
                let g = grads.get(&var).unwrap_or_else(|| panic!("no gradient for {name}"));
                let g = g.flatten_all().unwrap().to_vec1::<f64>().unwrap();
                let flat = var.as_tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap();
                for _ in 0..3 {
                    let i = rng.gen_range(0..flat.len());
                    let eval = |delta: f64| {
                        let mut f = flat.clone();
                        f[i] += delta;
                        var.set(&Tensor::from_vec(f, var.shape(), &dev).unwrap()).unwrap();
                        loss().to_scalar::<f64>().unwrap()
                    };
                    let h = 1e-5;
                    let fd = (eval(h) - eval(-h)) / (2.0 * h);
                    var.set(&Tensor::from_vec(flat.clone(), var.shape(), &dev).unwrap()).unwrap();
                    let err = (fd - g[i]).abs() / fd.abs().max(1.0);
                    worst = worst.max(err);
                    assert!(err < 1e-6, "{name}[{i}]: analytic {} vs finite difference {fd}", g[i]);
                }
            }
            println!(
                "{}: adapter gradients vs finite differences, worst relative error {worst:.2e}",
                cfg.model_type()
            );
            // The base is frozen: no gradient reaches it.
            let base_names = store.names();
            assert!(base_names.len() > 10 && store.vars().iter().all(|(n, _)| !base_names.contains(n)));
        }
    }

    #[test]
    fn target_modules_matching_nothing_lists_the_linear_layers() {
        let cfg = CausalLmConfig::Llama(LlamaConfig::tiny(23, 16, 1, 4, 2));
        let base = ParamStore::random(3, false, DType::F32, &Device::Cpu).unwrap();
        let store = base.with_lora(&lora_cfg(&["c_attn"]), "llama", "run.toml [lora]", 1).unwrap();
        let e = CausalLm::load(&store.root(), &cfg).unwrap_err().to_string();
        assert!(e.contains("run.toml [lora]") && e.contains("target_modules = [\"c_attn\"]"), "{e}");
        for name in ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] {
            assert!(e.contains(name), "{e}");
        }
    }

    #[test]
    fn an_adapter_round_trips_and_refuses_another_base() {
        let dev = Device::Cpu;
        let dir = tempfile::tempdir().unwrap();
        let cfg = CausalLmConfig::Gpt2(Gpt2Config::tiny(23, 16, 2, 2, 16));
        let base = ParamStore::random(3, false, DType::F32, &dev).unwrap();
        let mut lc = lora_cfg(&["c_attn", "c_fc"]);
        lc.use_rslora = true;
        let store = base.with_lora(&lc, "gpt2", "[lora]", 1).unwrap();
        let lm = CausalLm::load(&store.root(), &cfg).unwrap();
        randomize_b(&store, 2);
        store.save_adapter(dir.path(), Some("tiny-gpt2")).unwrap();
        let json: serde_json::Value = crate::io::read_json(&dir.path().join(ADAPTER_CONFIG)).unwrap();
        assert_eq!(json["fan_in_fan_out"], true);
        assert_eq!(json["base_model_name_or_path"], "tiny-gpt2");
        let again = base.with_adapter(dir.path(), "gpt2").unwrap();
        let lm2 = CausalLm::load(&again.root(), &cfg).unwrap();
        assert_eq!(max_diff(&logits(&lm, DType::F32), &logits(&lm2, DType::F32)), 0.0);
        // Another base: wider (shapes), and another architecture (names).
        let wide = CausalLmConfig::Gpt2(Gpt2Config::tiny(23, 32, 2, 2, 16));
        let other =
            ParamStore::random(3, false, DType::F32, &dev).unwrap().with_adapter(dir.path(), "gpt2").unwrap();
        let e = CausalLm::load(&other.root(), &wide).unwrap_err().to_string();
        assert!(
            e.contains("adapter_model.safetensors")
                && e.contains("has shape [4, 16]")
                && e.contains("tiny-gpt2"),
            "{e}"
        );
        let shallow = CausalLmConfig::Gpt2(Gpt2Config::tiny(23, 16, 1, 2, 16));
        let other =
            ParamStore::random(3, false, DType::F32, &dev).unwrap().with_adapter(dir.path(), "gpt2").unwrap();
        let e = CausalLm::load(&other.root(), &shallow).unwrap_err().to_string();
        assert!(e.contains("layers this model does not have") && e.contains("transformer.h.1"), "{e}");
    }

    #[test]
    fn names_match_as_suffixes_and_a_string_as_a_full_regex() {
        let m = Matcher::new(&TargetModules::Names(vec!["q_proj".into(), "c_attn".into()])).unwrap();
        assert!(m.matches("model.layers.0.self_attn.q_proj"));
        assert!(m.matches("q_proj"));
        assert!(!m.matches("model.layers.0.self_attn.xq_proj"));
        assert!(m.matches("transformer.h.1.attn.c_attn"));
        let r = Matcher::new(&TargetModules::Pattern(r".*\.0\..*_proj".into())).unwrap();
        assert!(r.matches("model.layers.0.self_attn.q_proj"));
        assert!(!r.matches("model.layers.1.self_attn.q_proj"));
        // fullmatch: a pattern matching a part of the path is no match.
        let r = Matcher::new(&TargetModules::Pattern("q_proj".into())).unwrap();
        assert!(!r.matches("model.layers.0.self_attn.q_proj"));
    }

    #[test]
    fn scaling_is_alpha_over_r_or_over_root_r() {
        let c = LoraConfig { r: 4, lora_alpha: 16.0, ..Default::default() };
        assert_eq!(c.scaling(), 4.0);
        assert_eq!(LoraConfig { use_rslora: true, ..c }.scaling(), 8.0);
    }

    #[test]
    fn bias_other_than_none_is_refused_naming_the_field() {
        let c = LoraConfig { bias: "all".into(), ..Default::default() };
        let e = c.validate("lora").unwrap_err();
        assert_eq!((e.section.as_str(), e.field.as_str()), ("lora", "bias"));
        let e = e.to_string();
        assert!(e.contains("lora.bias = \"all\"") && e.contains("\"none\""), "{e}");
        let c = LoraConfig { target_modules: Some(TargetModules::Pattern("(".into())), ..Default::default() };
        assert_eq!(c.validate("lora").unwrap_err().field, "target_modules");
    }

    #[test]
    fn a_peft_adapter_config_round_trips() {
        let c = LoraConfig {
            r: 4,
            lora_alpha: 8.0,
            target_modules: Some(TargetModules::Names(vec!["q_proj".into()])),
            modules_to_save: Some(vec!["score".into()]),
            ..Default::default()
        };
        let meta = AdapterMeta { base_model: Some("base".into()), task_type: None };
        let j = c.to_adapter_json(c.target_modules.as_ref().unwrap(), &meta, false);
        assert_eq!(j["lora_alpha"], serde_json::json!(8));
        let (back, m) = LoraConfig::from_adapter_json(&j, Path::new("a.json")).unwrap();
        assert_eq!(back, c);
        assert_eq!(m.base_model.as_deref(), Some("base"));
        let mut dora = j.clone();
        dora["use_dora"] = serde_json::json!(true);
        let e = LoraConfig::from_adapter_json(&dora, Path::new("a.json")).unwrap_err().to_string();
        assert!(e.contains("a.json") && e.contains("use_dora"), "{e}");
    }

    #[test]
    fn modules_to_save_match_parameter_names() {
        let m = vec!["score".to_string(), "v_head".to_string()];
        assert!(in_modules("score.weight", &m));
        assert!(in_modules("v_head.summary.weight", &m));
        assert!(in_modules("model.score.bias", &m));
        assert!(!in_modules("model.scores.bias", &m));
        // PEFT matches module paths as strings: "classifier" takes "pre_classifier" too, and a
        // matched module's children ("classifier.dense").
        let c = vec!["classifier".to_string()];
        assert!(in_modules("pre_classifier.weight", &c));
        assert!(in_modules("classifier.dense.bias", &c));
        assert!(!in_modules("distilbert.embeddings.word_embeddings.weight", &c));
    }
}
