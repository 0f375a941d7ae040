//! Named model parameters: loaded from safetensors, or initialized, and saved back.
//!
//! A [`ParamStore`] maps checkpoint names (`transformer.h.0.attn.c_attn.weight`) to tensors. A
//! model is built from a [`Params`] view that adds a prefix, so the checkpoint's weight tree can be
//! read off the model code (`p.pp("attn").get("c_attn.weight", (c, 3 * c))`). A trainable store
//! holds every tensor as a [`Var`]; a frozen one (the reference model) holds plain tensors, so its
//! forward passes build no gradient graph.
//!
//! A store created with [`ParamStore::random`] initializes each tensor on first request (the
//! model's loader says how), so tiny models for tests and benchmarks are built in-process with the
//! same code that loads checkpoints.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor, Var};
use rand::{Rng, SeedableRng};
use rltune_kernels::GradSlot;

use crate::error::{Error, Result};
use crate::lora::{LoraLinear, LoraState, WeightLayout};

mod adapters;

/// How a missing parameter is initialized.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// All zeros (biases).
    Zeros,
    /// All ones (norm weights).
    Ones,
    /// Normal with mean 0 and this standard deviation.
    Normal(f64),
    /// Uniform in `[-bound, bound)` (torch's `kaiming_uniform_`).
    Uniform(f64),
}

#[derive(Debug)]
pub(crate) struct Inner {
    /// Tensors by full name, in the store's dtype and device.
    pub(crate) tensors: BTreeMap<String, Tensor>,
    /// The same tensors as variables, when trainable.
    pub(crate) vars: BTreeMap<String, Var>,
    /// Names initialized here rather than loaded.
    pub(crate) initialized: Vec<String>,
    /// Tied duplicates read from the checkpoint (`lm_head.weight` → `transformer.wte.weight`):
    /// not parameters of their own, written back with their target's current value.
    pub(crate) aliases: BTreeMap<String, String>,
    /// Random source for initialization, seeded.
    pub(crate) rng: rand::rngs::StdRng,
    /// The integer dtype a tensor was stored with, for tensors converted to the store's float
    /// dtype: such a tensor is refused when a model asks for it as a weight (checkpoints also
    /// hold integer buffers, e.g. BERT's `position_ids`, that no model reads).
    pub(crate) stored_int: BTreeMap<String, DType>,
    /// LoRA adapters, when the store was made with [`ParamStore::with_lora`].
    pub(crate) lora: Option<LoraState>,
    /// Variables frozen by [`ParamStore::freeze`] (partial freezing): not in `vars()`, shared
    /// rather than copied by `frozen_copy`.
    pub(crate) frozen: std::collections::BTreeSet<String>,
}

/// A set of named parameters shared by a model and its optimizer.
#[derive(Debug, Clone)]
pub struct ParamStore {
    pub(crate) inner: Arc<Mutex<Inner>>,
    pub(crate) trainable: bool,
    /// Initialize missing tensors on request (random models) instead of failing.
    pub(crate) fill_missing: bool,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
    /// Where the tensors came from, for error messages.
    pub(crate) source: PathBuf,
    /// With LoRA: whether models built from this view get their adapters (false for the
    /// reference view, [`ParamStore::frozen_copy`]).
    pub(crate) adapters_on: bool,
    /// Where the backward of the models built from this store writes their weights'
    /// gradients: every layer keeps a clone, and [`rltune_kernels::Grads::bind`] points it at a
    /// `Grads`' buffers (torch's `param.grad`). Shared by the store's clones and views.
    pub(crate) grads: GradSlot,
}

impl ParamStore {
    fn new(
        tensors: BTreeMap<String, Tensor>,
        trainable: bool,
        fill_missing: bool,
        seed: u64,
        source: PathBuf,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let mut vars = BTreeMap::new();
        let mut tensors = tensors;
        let stored_int = BTreeMap::new();
        if trainable {
            for (name, t) in tensors.iter_mut() {
                let v = Var::from_tensor(t)?;
                *t = v.as_tensor().clone();
                vars.insert(name.clone(), v);
            }
        }
        let rng = rand::rngs::StdRng::seed_from_u64(seed);
        let inner = Inner {
            tensors,
            vars,
            initialized: Vec::new(),
            aliases: BTreeMap::new(),
            rng,
            stored_int,
            lora: None,
            frozen: Default::default(),
        };
        Ok(Self {
            inner: Arc::new(Mutex::new(inner)),
            trainable,
            fill_missing,
            dtype,
            device: device.clone(),
            source,
            adapters_on: false,
            grads: GradSlot::new(),
        })
    }

    /// A store whose tensors are initialized on first request, from `seed`.
    pub fn random(seed: u64, trainable: bool, dtype: DType, device: &Device) -> Result<Self> {
        let source = PathBuf::from("<random init>");
        Self::new(BTreeMap::new(), trainable, true, seed, source, dtype, device)
    }

    /// A store holding `tensors` (already named), converted to `dtype` on `device`.
    pub fn from_tensors(
        tensors: HashMap<String, Tensor>,
        trainable: bool,
        dtype: DType,
        device: &Device,
        source: &Path,
    ) -> Result<Self> {
        let mut map = BTreeMap::new();
        let mut stored_int = BTreeMap::new();
        for (name, t) in tensors {
            if !t.dtype().is_float() {
                stored_int.insert(name.clone(), t.dtype());
            }
            map.insert(name, t.to_device(device)?.to_dtype(dtype)?);
        }
        let store = Self::new(map, trainable, false, 0, source.to_path_buf(), dtype, device)?;
        store.lock().stored_int = stored_int;
        Ok(store)
    }

    /// Loads one or more safetensors files (or a GGUF file, see [`crate::gguf`]) into a store.
    pub fn load_safetensors(
        files: &[PathBuf],
        trainable: bool,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let mut map = HashMap::new();
        for f in files {
            if crate::gguf::is_gguf(f) {
                // A GGUF file: dequantized to f32 under transformers' names, then cast below.
                map.extend(crate::gguf::load_tensors(f)?);
                continue;
            }
            let ts = candle_core::safetensors::load(f, &Device::Cpu).map_err(|e| {
                Error::weights(
                    f,
                    format!(
                        "cannot read safetensors: {e}; the file is truncated, corrupt or not \
                         safetensors: download it again, or re-save the model with transformers' \
                         save_pretrained(DIR, safe_serialization=True)"
                    ),
                )
            })?;
            for (name, t) in &ts {
                check_finite(f, name, t)?;
            }
            map.extend(ts);
        }
        let source = match files {
            [one] => one.clone(),
            _ => files.first().and_then(|f| f.parent()).map(Path::to_path_buf).unwrap_or_default(),
        };
        Self::from_tensors(map, trainable, dtype, device, &source)
    }

    /// The root view, with no prefix.
    pub fn root(&self) -> Params<'_> {
        Params { store: self, prefix: String::new() }
    }

    /// The slot through which the models built from this store write their weights' gradients
    /// (see [`GradSlot`]): `grads.bind(store.grad_slot())` sends them to `grads`' buffers.
    pub fn grad_slot(&self) -> &GradSlot {
        &self.grads
    }

    /// Whether gradients are tracked for this store's tensors.
    pub fn trainable(&self) -> bool {
        self.trainable
    }

    /// The dtype of every tensor.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device of every tensor.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Where the tensors came from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A poisoned lock only means another thread panicked mid-insert; the map is still valid.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a tensor of this full name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.lock().tensors.contains_key(name)
    }

    /// The shape of the tensor `name`, if the store holds it.
    pub fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        self.lock().tensors.get(name).map(|t| t.dims().to_vec())
    }

    /// All names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.lock().tensors.keys().cloned().collect()
    }

    /// Names that were initialized rather than loaded.
    pub fn initialized(&self) -> Vec<String> {
        self.lock().initialized.clone()
    }

    /// The trainable variables by name (empty for a frozen store). With LoRA: the adapters (by
    /// their PEFT keys), then the `modules_to_save` copies and the value head; the base is frozen.
    pub fn vars(&self) -> Vec<(String, Var)> {
        let inner = self.lock();
        match &inner.lora {
            Some(l) if self.adapters_on => {
                l.adapters.iter().chain(&l.saved).map(|(k, v)| (k.clone(), v.clone())).collect()
            }
            Some(_) => Vec::new(),
            None => inner
                .vars
                .iter()
                .filter(|(k, _)| !inner.frozen.contains(*k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        }
    }

    /// Freezes the trainable variables that `frozen` selects by name (partial freezing): they
    /// leave [`Self::vars`], so no optimizer moves them, and [`Self::frozen_copy`] shares their
    /// tensors instead of copying them. Returns how many were frozen.
    pub fn freeze(&self, frozen: impl Fn(&str) -> bool) -> usize {
        let mut inner = self.lock();
        let names: Vec<String> = inner.vars.keys().filter(|k| frozen(k)).cloned().collect();
        let n = names.len();
        inner.frozen.extend(names);
        n
    }

    /// A snapshot of every tensor by name (detached copies share no storage with the store),
    /// tied duplicates included with their target's current value.
    pub fn snapshot(&self) -> Result<BTreeMap<String, Tensor>> {
        let inner = self.lock();
        let mut out = BTreeMap::new();
        for (k, t) in inner.tensors.iter() {
            out.insert(k.clone(), t.detach().copy()?);
        }
        for (alias, target) in &inner.aliases {
            if let Some(t) = out.get(target).cloned() {
                out.insert(alias.clone(), t);
            }
        }
        Ok(out)
    }

    /// Makes the checkpoint's tensor `alias` a tied duplicate of `target` (a tied LM head): it
    /// stops being a tensor (and a trainable variable) of its own, and every save writes it with
    /// `target`'s current value, so no file holds a stale copy. Without `alias` in the checkpoint
    /// nothing is recorded and saves leave it out, as transformers' `save_pretrained` does.
    pub fn tie(&self, alias: &str, target: &str) {
        let mut inner = self.lock();
        if inner.tensors.remove(alias).is_some() {
            inner.vars.remove(alias);
            inner.aliases.insert(alias.to_string(), target.to_string());
        }
    }

    /// A frozen deep copy (for a reference model): same names, no gradient tracking. With LoRA,
    /// the base with the adapters turned off, sharing its tensors (they never train): no copy.
    pub fn frozen_copy(&self) -> Result<Self> {
        if self.lock().lora.is_some() {
            return Ok(self.without_adapters());
        }
        let mut map: HashMap<String, Tensor> = self.snapshot()?.into_iter().collect();
        // Frozen variables never change: the copy shares them (the policy and its reference
        // then share a frozen trunk, see `CausalLm::shares_trunk`).
        {
            let inner = self.lock();
            for name in &inner.frozen {
                if let Some(t) = inner.tensors.get(name) {
                    map.insert(name.clone(), t.clone());
                }
            }
        }
        let aliases = self.lock().aliases.clone();
        let mut s = Self::from_tensors(map, false, self.dtype, &self.device, &self.source)?;
        s.fill_missing = false;
        // The snapshot wrote each tied duplicate as a tensor: tie it again.
        for (alias, target) in aliases {
            s.tie(&alias, &target);
        }
        Ok(s)
    }

    /// Writes every tensor to `path` as safetensors, atomically (temp file, then rename).
    pub fn save_safetensors(&self, path: &Path) -> Result<()> {
        let snap = self.snapshot()?;
        let tensors: Vec<(String, Tensor)> = snap
            .into_iter()
            .map(|(k, t)| t.contiguous().map(|t| (k, t)))
            .collect::<std::result::Result<_, _>>()?;
        crate::io::save_safetensors(path, &tensors.into_iter().collect())
    }

    /// The tensor `name` with the expected shape, initializing it if allowed.
    fn get(&self, name: &str, shape: &Shape, init: Option<Init>) -> Result<Tensor> {
        if self.adapters_on && self.lock().lora.as_ref().is_some_and(|l| l.is_saved(name)) {
            return self.get_saved(name, shape, init);
        }
        self.get_plain(name, shape, init)
    }

    /// [`Self::get`] from the tensors themselves (the base, with LoRA).
    pub(crate) fn get_plain(&self, name: &str, shape: &Shape, init: Option<Init>) -> Result<Tensor> {
        let mut inner = self.lock();
        if let Some(dt) = inner.stored_int.get(name) {
            return Err(Error::weights(
                &self.source,
                format!(
                    "tensor {name:?} is stored as {} (integers), but it is a weight and must be a \
                     float (f32, f16 or bf16): the checkpoint is corrupt, quantized or of another \
                     model; re-save it with transformers' save_pretrained",
                    dt.as_str()
                ),
            ));
        }
        if let Some(t) = inner.tensors.get(name) {
            if t.shape() != shape {
                return Err(Error::weights(
                    &self.source,
                    format!(
                        "tensor {name:?} has shape {:?} but the config implies {:?}; config.json \
                         does not match the weights: check its size fields (hidden size, vocab_size, \
                         heads, layers), remembering that an absent field takes transformers' default",
                        t.dims(),
                        shape.dims()
                    ),
                ));
            }
            return Ok(t.clone());
        }
        let init = match init {
            Some(init) => init,
            None => {
                return Err(Error::weights(
                    &self.source,
                    format!("tensor {name:?} (shape {:?}) is missing from the checkpoint", shape.dims()),
                ))
            }
        };
        let n = shape.elem_count();
        let data: Vec<f64> = match init {
            Init::Zeros => vec![0.0; n],
            Init::Ones => vec![1.0; n],
            Init::Normal(std) => {
                let normal = NormalSampler(std);
                (0..n).map(|_| normal.sample(&mut inner.rng)).collect()
            }
            Init::Uniform(bound) => (0..n).map(|_| inner.rng.gen_range(-bound..bound)).collect(),
        };
        let t = Tensor::from_vec(data, shape, &Device::Cpu)?.to_dtype(self.dtype)?.to_device(&self.device)?;
        let t = if self.trainable && inner.lora.is_none() {
            let v = Var::from_tensor(&t)?;
            let t = v.as_tensor().clone();
            inner.vars.insert(name.to_string(), v);
            t
        } else {
            t
        };
        inner.tensors.insert(name.to_string(), t.clone());
        inner.initialized.push(name.to_string());
        Ok(t)
    }
}

/// Fails if the float tensor `name` of `file` holds a NaN or an infinity, naming the first one.
///
/// A weight that is not finite makes every output NaN; the usual cause is a training run that
/// diverged before it saved. Cost: one pass over the weights (a sum; the element is located
/// only when the sum is not finite, and an overflowing sum of finite values is let through).
fn check_finite(file: &Path, name: &str, t: &Tensor) -> Result<()> {
    if !t.dtype().is_float() {
        return Ok(());
    }
    let t = t.flatten_all()?.to_dtype(DType::F32)?;
    if t.sum_all()?.to_scalar::<f32>()?.is_finite() {
        return Ok(());
    }
    let values = t.to_vec1::<f32>()?;
    let Some((i, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) else {
        return Ok(());
    };
    let count = values.iter().filter(|v| !v.is_finite()).count();
    Err(Error::weights(
        file,
        format!(
            "tensor {name:?} holds {v} at element {i} ({count} of its {} values are not finite); \
             a model with NaN or infinite weights outputs NaN. The run that saved it probably \
             diverged: load an earlier checkpoint, or lower the learning rate and train again",
            values.len()
        ),
    ))
}

/// Box–Muller normal sampler (keeps `rand_distr` out of the dependency tree).
struct NormalSampler(f64);

impl NormalSampler {
    fn sample<R: Rng>(&self, rng: &mut R) -> f64 {
        let u1: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
        let u2: f64 = rng.gen();
        self.0 * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// A view of a [`ParamStore`] under a name prefix.
#[derive(Clone)]
pub struct Params<'a> {
    store: &'a ParamStore,
    prefix: String,
}

impl<'a> Params<'a> {
    /// The view one level down: `p.pp("attn")` turns `x` into `attn.x`.
    pub fn pp(&self, name: impl std::fmt::Display) -> Params<'a> {
        let prefix =
            if self.prefix.is_empty() { name.to_string() } else { format!("{}.{name}", self.prefix) };
        Params { store: self.store, prefix }
    }

    /// The gradient slot of the store (see [`ParamStore::grad_slot`]), for a layer to keep.
    pub fn grad_slot(&self) -> &'a GradSlot {
        &self.store.grads
    }

    /// The full name of `name` under this view.
    pub fn full_name(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// Whether `name` exists under this view.
    pub fn contains(&self, name: &str) -> bool {
        self.store.contains(&self.full_name(name))
    }

    /// The tensor `name` with `shape`; initialized with `init` when the store builds a random model.
    pub fn get(&self, name: &str, shape: impl Into<Shape>, init: Init) -> Result<Tensor> {
        let init = self.store.fill_missing.then_some(init);
        self.store.get(&self.full_name(name), &shape.into(), init)
    }

    /// Ties the checkpoint's tensor `alias` (under this view) to `target` (a full name); see
    /// [`ParamStore::tie`].
    pub fn tie(&self, alias: &str, target: &str) {
        self.store.tie(&self.full_name(alias), target)
    }

    /// The tensor `name`, initialized with `init` when absent, whatever the store's mode.
    pub fn get_or_init(&self, name: &str, shape: impl Into<Shape>, init: Init) -> Result<Tensor> {
        self.store.get(&self.full_name(name), &shape.into(), Some(init))
    }

    /// The LoRA adapter of the linear layer under this view (`d_in → d_out`, its weight stored as
    /// `layout`), when the store has adapters on and `target_modules` matches this module.
    pub fn lora(&self, d_in: usize, d_out: usize, layout: WeightLayout) -> Result<Option<LoraLinear>> {
        self.store.adapter_for(&self.prefix, d_in, d_out, layout)
    }

    /// The underlying store.
    pub fn store(&self) -> &'a ParamStore {
        self.store
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_mismatch_names_tensor_and_both_shapes() {
        let mut m = HashMap::new();
        m.insert("a.w".to_string(), Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap());
        let s =
            ParamStore::from_tensors(m, false, DType::F32, &Device::Cpu, Path::new("m.safetensors")).unwrap();
        let err = s.root().pp("a").get("w", (3, 2), Init::Zeros).unwrap_err().to_string();
        assert!(err.contains("\"a.w\"") && err.contains("[2, 3]") && err.contains("[3, 2]"), "{err}");
        let err = s.root().get("b", (1,), Init::Zeros).unwrap_err().to_string();
        assert!(err.contains("missing"), "{err}");
    }

    /// Regression (issue #28, defect 1): a checkpoint with both `wte` and a tied `lm_head`
    /// was saved with the trained `wte` and the stale `lm_head`.
    #[test]
    fn a_tied_duplicate_is_saved_with_its_targets_current_value() {
        let mut m = HashMap::new();
        m.insert("wte".to_string(), Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap());
        m.insert("head".to_string(), Tensor::ones((2, 3), DType::F32, &Device::Cpu).unwrap());
        let s = ParamStore::from_tensors(m, true, DType::F32, &Device::Cpu, Path::new("m")).unwrap();
        s.root().tie("head", "wte");
        s.root().tie("absent", "wte");
        assert_eq!(s.vars().len(), 1, "the duplicate is no parameter of its own");
        let (_, wte) = &s.vars()[0];
        wte.set(&Tensor::full(5f32, (2, 3), &Device::Cpu).unwrap()).unwrap();
        for snap in [s.snapshot().unwrap(), s.frozen_copy().unwrap().snapshot().unwrap()] {
            assert_eq!(snap.keys().collect::<Vec<_>>(), ["head", "wte"]);
            assert_eq!(snap["head"].to_vec2::<f32>().unwrap(), vec![vec![5f32; 3]; 2]);
        }
    }

    #[test]
    fn random_store_is_seeded_and_trainable() {
        let a = ParamStore::random(7, true, DType::F32, &Device::Cpu).unwrap();
        let b = ParamStore::random(7, true, DType::F32, &Device::Cpu).unwrap();
        let ta = a.root().get("w", (4, 4), Init::Normal(0.02)).unwrap();
        let tb = b.root().get("w", (4, 4), Init::Normal(0.02)).unwrap();
        assert_eq!(ta.to_vec2::<f32>().unwrap(), tb.to_vec2::<f32>().unwrap());
        assert_eq!(a.vars().len(), 1);
        let std = ta.sqr().unwrap().mean_all().unwrap().sqrt().unwrap().to_scalar::<f32>().unwrap();
        assert!(std > 0.005 && std < 0.05, "{std}");
    }
}
