//! The runtime: where rltune computes (CPU or a CUDA GPU), in which precision, and with which
//! processes.
//!
//! A [`Runtime`] is resolved once, from a config's `[runtime]` table ([`RuntimeSection`]) and the
//! command line's `--device` / `--dtype`, and then passed down explicitly: models, generation,
//! the trainers and classifier rewards take its [`Runtime::device`] and [`Runtime::dtype`], as
//! candle's `VarBuilder` takes a `&Device` and a `DType`. Nothing below it picks a device. A
//! data-parallel run's processes ride along ([`Runtime::with_dist`], [`crate::dist::Dist`]); the
//! runs hand them to their trainers.
//!
//! ```
//! use rltune::runtime::{DeviceChoice, Precision, Runtime, RuntimeSection};
//!
//! let section = RuntimeSection { device: DeviceChoice::Cpu, ..RuntimeSection::default() };
//! let rt = Runtime::resolve(&section)?;
//! assert!(rt.device().is_cpu());
//! assert_eq!(rt.dtype(), candle_core::DType::F32);
//! # Ok::<(), rltune::Error>(())
//! ```
//!
//! # Choices
//!
//! - `device = "auto"` (default): the first CUDA GPU when this build has the `cuda` feature and
//!   it opens, else the CPU. `"cpu"`, `"cuda"` (= `"cuda:0"`) and `"cuda:N"` pick one.
//!   Asking for CUDA from a build without the feature is an error that says how to build it.
//! - `dtype = "f32"` (default) computes in f32, what TRL computes. `"bf16"` is mixed precision:
//!   matrix products with bf16 inputs and f32 accumulation, weights and optimizer state in f32.
//!   On the CPU that is [`MatmulPrecision::Bf16`] (Intel AMX tiles; an error on CPUs without
//!   AMX), so `dtype = "bf16"` and `matmul_precision = "bf16"` mean the same there. On CUDA it is
//!   what `torch.autocast("cuda", dtype=torch.bfloat16)` does: every matrix product (linear
//!   layers, attention, the LM head) casts its inputs to bf16, runs on the tensor cores with f32
//!   accumulation and hands its bf16 result on as f32; norms, softmax, losses and Adam stay f32
//!   ([`crate::ops::set_device_matmul_precision`]).
//! - `matmul_precision` (kept from before `dtype` existed): `"bf16"` is the same as
//!   `dtype = "bf16"`.
//!
//! The parameters' dtype ([`Runtime::dtype`]) is f32 in every case: the bf16 of the CPU is a
//! property of its matrix products, not of the stored weights.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device};

use crate::dist::Dist;
use crate::error::{Error, Result};
use crate::ops::MatmulPrecision;

/// Where to compute, as written in `[runtime] device` or `--device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// The first CUDA GPU when the build and the machine have one, else the CPU.
    #[default]
    Auto,
    /// The CPU (rltune's fused x86 kernels).
    Cpu,
    /// CUDA GPU number `N` (`"cuda"` is `"cuda:0"`).
    Cuda(usize),
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(0) => f.write_str("cuda"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || {
            format!("unknown device {s:?}: expected \"auto\", \"cpu\", \"cuda\" or \"cuda:N\" (N = 0, 1, …)")
        };
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n.parse().map(Self::Cuda).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

/// The compute precision, as written in `[runtime] dtype` or `--dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// f32 everywhere (the default; what TRL computes).
    #[default]
    F32,
    /// bf16 matrix products with f32 accumulation; f32 weights and optimizer state.
    Bf16,
}

/// `Display` and `FromStr` for a two-way choice between f32 and bf16 (`$what` names it in the
/// error), whose `Default` is said in the error.
macro_rules! f32_or_bf16 {
    ($t:ty, $what:literal) => {
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(match self {
                    Self::F32 => "f32",
                    Self::Bf16 => "bf16",
                })
            }
        }

        impl FromStr for $t {
            type Err = String;

            fn from_str(s: &str) -> std::result::Result<Self, String> {
                match s.trim().to_ascii_lowercase().as_str() {
                    "f32" | "float32" => Ok(Self::F32),
                    "bf16" | "bfloat16" => Ok(Self::Bf16),
                    _ => Err(format!(
                        concat!("unknown ", $what, " {:?}: expected \"f32\" or \"bf16\" (default \"{}\")"),
                        s,
                        Self::default()
                    )),
                }
            }
        }
    };
}
f32_or_bf16!(Precision, "dtype");
f32_or_bf16!(AttentionProducts, "attention");
f32_or_bf16!(Activations, "activations");

/// Serializes a [`FromStr`] + [`fmt::Display`] value as its string.
macro_rules! serde_as_string {
    ($t:ty) => {
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}
serde_as_string!(DeviceChoice);
serde_as_string!(Precision);
serde_as_string!(CudaHost);
serde_as_string!(Activations);
serde_as_string!(AttentionProducts);

/// `[runtime]`: how the computation runs (not what it computes). Every field has a default, so
/// the table may be left out.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeSection {
    /// `"auto"` (default: CUDA when built with it and a GPU is present, else CPU), `"cpu"`,
    /// `"cuda"` or `"cuda:N"`.
    pub device: DeviceChoice,
    /// `"f32"` (default) or `"bf16"` (mixed precision; see the module docs).
    pub dtype: Precision,
    /// CPU only: `"f32"` (default) or `"bf16"`, matrix products on AMX tiles with bf16 inputs
    /// and f32 accumulation (see [`crate::ops::MatmulPrecision`]); `dtype = "bf16"` implies it.
    pub matmul_precision: MatmulPrecision,
    /// CUDA only: how the device's memory is managed between ops ([`CudaHost`]); the default
    /// (`"tuned"`) keeps the pool's memory and skips cudarc's per-allocation events. Left out of
    /// a written config at its default.
    #[serde(skip_serializing_if = "CudaHost::is_default")]
    pub cuda_host: CudaHost,
    /// CUDA with `dtype = "bf16"` only: whether the activations between two products stay bf16
    /// where an op between them has a bf16 kernel ([`Activations`]); `"bf16"` (default) or
    /// `"f32"`. Left out of a written config at its default.
    #[serde(skip_serializing_if = "Activations::is_default")]
    pub activations: Activations,
    /// CUDA with `dtype = "bf16"` only: attention's two products in f32 (`"f32"`, default:
    /// rltune's fused attention kernels) or in bf16 on the tensor cores (`"bf16"`, as
    /// `torch.autocast`) ([`AttentionProducts`]). Left out of a written config at its default.
    #[serde(skip_serializing_if = "AttentionProducts::is_default")]
    pub attention: AttentionProducts,
}

/// `[runtime] attention`, CUDA with `dtype = "bf16"` only: how Llama-family attention
/// (Llama, Qwen2, Mistral) computes its two products when it trains or scores
/// ([`crate::ops::set_bf16_attention`]).
///
/// - `"f32"` (default): rltune's fused attention kernels, f32 products and softmax, the
///   probabilities kept in f32.
/// - `"bf16"`: as `torch.autocast`, the products in bf16 with f32 sums on the tensor cores
///   (candle's batched cuBLAS products), the masked softmax between them in bf16 (computed in
///   f32, rounded once). Values change at bf16's precision. Not yet the default: no GPU has
///   timed it (`tools/cuda/verify.sh` runs the A/B).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionProducts {
    /// rltune's fused f32 attention kernels (the default).
    #[default]
    F32,
    /// bf16 products on the tensor cores.
    Bf16,
}

impl AttentionProducts {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// `[runtime] activations`, CUDA with `dtype = "bf16"` only: what autocast hands from one
/// product to the next through an op with a bf16 kernel (today Llama's MLP, `down(swiglu(gate(x),
/// up(x)))`; [`crate::ops::set_bf16_activations`]). Kept switchable so that a benchmark can
/// measure it (issue #53).
///
/// - `"bf16"` (default): the products' bf16 results go on in bf16, as under `torch.autocast`;
///   the values are the same, the backward keeps a third of the bytes and four casts fewer.
/// - `"f32"`: every product's result is cast back to f32 and the next product casts it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activations {
    /// bf16 between the products (the default).
    #[default]
    Bf16,
    /// f32 between the products.
    F32,
}

impl Activations {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// CUDA only, `[runtime] cuda_host`: the host-side settings of the device's memory, kept
/// switchable so that a benchmark can measure them against candle's defaults (issue #53, step 1).
///
/// - `"tuned"` (default): cudarc's per-allocation event tracking off (two `cuEventCreate` per
///   tensor, and a wait on each at free, which synchronize nothing when one stream does all the
///   work, as rltune's does), and the memory pool's release threshold at its maximum, so that
///   freed memory stays in the pool across synchronizations instead of going back to the driver
///   at each one (PyTorch's caching allocator keeps it the same way).
/// - `"events"`: the pool kept, event tracking on. `"trim"`: events off, the pool trimmed at
///   every synchronization. `"candle"`: both as candle leaves them (tracking on, threshold 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CudaHost {
    /// Events off, the pool kept (the default).
    #[default]
    Tuned,
    /// Event tracking on, the pool kept.
    Events,
    /// Events off, the pool trimmed at each synchronization.
    Trim,
    /// candle's defaults: event tracking on, the pool trimmed.
    Candle,
}

impl CudaHost {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// Whether cudarc tracks every allocation's reads and writes with events.
    pub fn event_tracking(self) -> bool {
        matches!(self, Self::Events | Self::Candle)
    }

    /// Whether the memory pool keeps freed memory across synchronizations.
    pub fn keep_pool(self) -> bool {
        matches!(self, Self::Tuned | Self::Events)
    }
}

impl fmt::Display for CudaHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Tuned => "tuned",
            Self::Events => "events",
            Self::Trim => "trim",
            Self::Candle => "candle",
        })
    }
}

impl FromStr for CudaHost {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "tuned" => Ok(Self::Tuned),
            "events" => Ok(Self::Events),
            "trim" => Ok(Self::Trim),
            "candle" => Ok(Self::Candle),
            _ => Err(format!(
                "unknown cuda_host {s:?}: expected \"tuned\" (default), \"events\", \"trim\" or \"candle\""
            )),
        }
    }
}

impl RuntimeSection {
    /// This section with the command line's `--device` / `--dtype` (where given) in place of its
    /// own values.
    pub fn with_overrides(mut self, device: Option<DeviceChoice>, dtype: Option<Precision>) -> Self {
        self.device = device.unwrap_or(self.device);
        self.dtype = dtype.unwrap_or(self.dtype);
        self
    }

    /// This section with `cuda_host` in place of its own (where given).
    pub fn with_cuda_host(mut self, cuda_host: Option<CudaHost>) -> Self {
        self.cuda_host = cuda_host.unwrap_or(self.cuda_host);
        self
    }

    /// This section with `activations` in place of its own (where given).
    pub fn with_activations(mut self, activations: Option<Activations>) -> Self {
        self.activations = activations.unwrap_or(self.activations);
        self
    }

    /// This section with `attention` in place of its own (where given).
    pub fn with_attention(mut self, attention: Option<AttentionProducts>) -> Self {
        self.attention = attention.unwrap_or(self.attention);
        self
    }

    /// The `[runtime]` table of TOML `text` (default when absent); other tables are ignored.
    /// `path` names the source in errors.
    pub fn from_toml_table(text: &str, path: &std::path::Path) -> Result<Self> {
        let doc: toml::Table = toml::from_str(text).map_err(|e| Error::config(path, e.to_string()))?;
        match doc.get("runtime") {
            None => Ok(Self::default()),
            Some(toml::Value::Table(t)) => {
                toml::Value::Table(t.clone()).try_into().map_err(|e: toml::de::Error| {
                    Error::config(
                        path,
                        format!("[runtime]: {}", crate::config_file::suggest_unknown_key(&e.to_string())),
                    )
                })
            }
            Some(_) => Err(Error::config(path, "[runtime] must be a table")),
        }
    }
}

/// Where and in which precision to compute: resolved once ([`Runtime::resolve`]) and passed
/// down. Cheap to clone (a CUDA [`Device`] is a shared handle).
#[derive(Debug, Clone)]
pub struct Runtime {
    device: Device,
    choice: DeviceChoice,
    precision: Precision,
    matmul_precision: MatmulPrecision,
    cuda_host: CudaHost,
    activations: Activations,
    attention: AttentionProducts,
    dist: Dist,
}

impl Runtime {
    /// The CPU in f32: what every test and example without a config uses.
    pub fn cpu() -> Self {
        Self {
            device: Device::Cpu,
            choice: DeviceChoice::Cpu,
            precision: Precision::F32,
            matmul_precision: MatmulPrecision::F32,
            cuda_host: CudaHost::default(),
            activations: Activations::default(),
            attention: AttentionProducts::default(),
            dist: Dist::default(),
        }
    }

    /// Resolves a `[runtime]` section: opens the device (`auto` becomes CUDA or CPU) and checks
    /// that the precision is available there. Errors name the field and the fix. Changes no
    /// process-wide setting; see [`Self::install`].
    pub fn resolve(section: &RuntimeSection) -> Result<Self> {
        let device = open_device(section.device)?;
        let bf16 = section.dtype == Precision::Bf16 || section.matmul_precision == MatmulPrecision::Bf16;
        let matmul_precision = if device.is_cpu() && bf16 {
            crate::ops::check_matmul_precision(MatmulPrecision::Bf16).map_err(|e| {
                Error::Unsupported(format!(
                    "[runtime] {} (or --dtype bf16): {e}",
                    if section.dtype == Precision::Bf16 {
                        "dtype = \"bf16\""
                    } else {
                        "matmul_precision = \"bf16\""
                    }
                ))
            })?;
            MatmulPrecision::Bf16
        } else if bf16 {
            MatmulPrecision::Bf16
        } else {
            MatmulPrecision::F32
        };
        Ok(Self {
            device,
            choice: section.device,
            precision: section.dtype,
            matmul_precision,
            cuda_host: section.cuda_host,
            activations: section.activations,
            attention: section.attention,
            dist: Dist::default(),
        })
    }

    /// This runtime training through `dist`: the processes of a data-parallel run and their
    /// engine (one process without an engine until this is called).
    pub fn with_dist(mut self, dist: Dist) -> Self {
        self.dist = dist;
        self
    }

    /// The processes this run trains with ([`Dist`]); runs hand it to their trainers.
    pub fn dist(&self) -> &Dist {
        &self.dist
    }

    /// The device every tensor of the run lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The dtype of parameters and activations (f32; see the module docs for bf16).
    pub fn dtype(&self) -> DType {
        DType::F32
    }

    /// The compute precision asked for.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// How matrix products run: f32, or bf16 inputs with f32 accumulation (AMX tiles on the CPU,
    /// tensor cores on CUDA).
    pub fn matmul_precision(&self) -> MatmulPrecision {
        self.matmul_precision
    }

    /// Whether this runtime computes on the CPU.
    pub fn is_cpu(&self) -> bool {
        self.device.is_cpu()
    }

    /// The section that resolves to this runtime again (the device as chosen, e.g. `auto`).
    pub fn section(&self) -> RuntimeSection {
        RuntimeSection {
            device: self.choice,
            dtype: self.precision,
            matmul_precision: self.matmul_precision,
            cuda_host: self.cuda_host,
            activations: self.activations,
            attention: self.attention,
        }
    }

    /// Makes the process-wide settings this runtime implies, on the CPU: FTZ/DAZ on the calling
    /// thread and rayon's global pool ([`crate::cpu::flush_denormals`]: denormal floats are
    /// 7–12× slower in a backward pass) and the kernels' matrix-product precision
    /// ([`crate::ops::set_matmul_precision`]). On CUDA, the products' precision
    /// ([`crate::ops::set_device_matmul_precision`]). The one call a
    /// library user makes before training (after [`crate::cpu::ProcessSettings::install`] at
    /// the start of `main`, for the thread pools); the `rltune` commands make it once the
    /// runtime is resolved. No model, trainer or run constructor makes it.
    pub fn install(&self) -> Result<()> {
        if self.device.is_cpu() {
            crate::cpu::flush_denormals();
            crate::ops::set_matmul_precision(self.matmul_precision)?;
        } else {
            crate::ops::set_device_matmul_precision(self.matmul_precision);
            let _ = crate::ops::set_bf16_activations(self.activations == Activations::Bf16);
            let _ = crate::ops::set_bf16_attention(self.attention == AttentionProducts::Bf16);
            apply_cuda_host(&self.device, self.cuda_host)?;
        }
        Ok(())
    }
}

impl fmt::Display for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}, {}", describe(&self.device), self.precision)?;
        if self.matmul_precision == MatmulPrecision::Bf16 {
            f.write_str(if self.device.is_cpu() {
                " (AMX bf16 matrix products)"
            } else {
                " (bf16 matrix products, f32 weights)"
            })?;
        }
        if !self.device.is_cpu() && self.cuda_host != CudaHost::Tuned {
            write!(f, ", cuda_host = {}", self.cuda_host)?;
        }
        if !self.device.is_cpu()
            && self.matmul_precision == MatmulPrecision::Bf16
            && !self.activations.is_default()
        {
            write!(f, ", activations = {}", self.activations)?;
        }
        if !self.device.is_cpu()
            && self.matmul_precision == MatmulPrecision::Bf16
            && !self.attention.is_default()
        {
            write!(f, ", attention = {}", self.attention)?;
        }
        Ok(())
    }
}

/// What the library would otherwise read from the process environment: the hub options and
/// the user's name. The library reads no environment variable; a program builds a `Host` (the
/// `rltune` command: [`Host::from_vars`] over its environment) and installs it once at start-up
/// ([`install_host`]). Without one: online hub access with the standard cache, user "unknown".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Host {
    /// Where hub files come from ([`crate::models::hub`]).
    pub hub: crate::models::hub::HubOptions,
    /// The user's name (MLflow's `mlflow.user`).
    pub user: Option<String>,
    /// In a data-parallel launch, this process's rank on its machine (its GPU).
    pub local_rank: Option<usize>,
    /// The variables a config names by `api_key_env` (an HTTP reward's key), looked up when the
    /// reward is built ([`Host::with_secrets`]); none without.
    pub secrets: Secrets,
}

/// A lookup of the environment variables that configs name for secrets (`api_key_env`): the
/// command line gives `|k| std::env::var(k).ok()`, a program using the library whatever it
/// keeps its keys in. Its `Debug` form shows no value.
#[derive(Clone, Default)]
pub struct Secrets(Option<std::sync::Arc<Lookup>>);

/// A function from a variable's name to its value.
type Lookup = dyn Fn(&str) -> Option<String> + Send + Sync;

impl Secrets {
    /// The value of `name`, if the lookup has one.
    pub fn get(&self, name: &str) -> Option<String> {
        self.0.as_ref().and_then(|f| f(name))
    }
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Secrets(<lookup>)" } else { "Secrets(none)" })
    }
}

/// Two lookups are equal when both are absent or both are the same function.
impl PartialEq for Secrets {
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (None, None) => true,
            (Some(a), Some(b)) => std::sync::Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl Eq for Secrets {}

impl Host {
    /// The host from environment variables read through `var`: the hub's
    /// ([`crate::models::hub::HubOptions::from_vars`]), `USER` (or `USERNAME`), and the
    /// launcher's local rank (`rltune_dist::Launch`: mpirun, MPICH, Slurm, torchrun) when it
    /// starts more than one process.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let user = var("USER").or_else(|| var("USERNAME")).filter(|u| !u.is_empty());
        let launch = rltune_dist::Launch::from_lookup(&var).ok().filter(|l| l.world_size > 1);
        Self {
            hub: crate::models::hub::HubOptions::from_vars(&var),
            user,
            local_rank: launch.map(|l| l.local_rank),
            secrets: Secrets::default(),
        }
    }

    /// This host, looking up the variables that configs name for secrets (`api_key_env`) with
    /// `lookup`.
    pub fn with_secrets(self, lookup: impl Fn(&str) -> Option<String> + Send + Sync + 'static) -> Self {
        Self { secrets: Secrets(Some(std::sync::Arc::new(lookup))), ..self }
    }
}

static HOST: std::sync::RwLock<Option<Host>> = std::sync::RwLock::new(None);

/// Makes `host` the process's (its hub options go to [`crate::models::hub::install`]).
pub fn install_host(host: Host) {
    crate::models::hub::install(host.hub.clone());
    *HOST.write().unwrap_or_else(|e| e.into_inner()) = Some(host);
}

/// The installed [`Host`], or the default.
pub fn host() -> Host {
    HOST.read().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_default()
}

/// The memory in use on `device`'s GPU (all processes, the CUDA context included), in MiB, as
/// the driver reports it (`cuMemGetInfo`: total − free); `None` on the CPU. For benchmarks.
pub fn device_memory_used_mib(device: &Device) -> Option<f64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        let _ = d.cuda_stream().context().bind_to_thread();
        if let Ok((free, total)) = candle_core::cuda_backend::cudarc::driver::result::mem_get_info() {
            return Some((total - free) as f64 / 1048576.0);
        }
    }
    let _ = device;
    None
}

/// Applies [`CudaHost`] to a CUDA device: event tracking for the allocations made from now on,
/// and the release threshold of the device's default memory pool (the pool that candle's
/// stream-ordered allocations draw from). Nothing on the CPU.
fn apply_cuda_host(device: &Device, host: CudaHost) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        use candle_core::cuda_backend::cudarc::driver::{result, sys};
        let failed = |what: &str, e: &dyn fmt::Display| {
            Error::Unsupported(format!("[runtime] cuda_host = \"{host}\": cannot {what} ({e})"))
        };
        // SAFETY: rltune computes on the device's one stream (candle's per-thread stream), so
        // cudarc's events, which order uses across streams, order nothing here.
        unsafe {
            if host.event_tracking() {
                d.cuda_stream().context().enable_event_tracking();
            } else {
                d.disable_event_tracking();
            }
        }
        let ctx = d.cuda_stream().context().clone();
        ctx.bind_to_thread().map_err(|e| failed("bind the CUDA context", &e))?;
        let mut threshold: u64 = if host.keep_pool() { u64::MAX } else { 0 };
        // SAFETY: the pool is the device's own default pool, and the release threshold's value
        // is a cuuint64_t, which `threshold` is.
        unsafe {
            let pool = result::device::get_default_mem_pool(ctx.cu_device())
                .map_err(|e| failed("get the memory pool", &e))?;
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
            .map_err(|e| failed("set the memory pool's release threshold", &e))?;
        }
    }
    let _ = (device, host);
    Ok(())
}

fn describe(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// How to get a CUDA build: the text of the error for a build without the `cuda` feature.
pub const CUDA_BUILD_HINT: &str = "this rltune was built without CUDA support; build it with \
     `cargo build --release --features cuda` (needs nvcc; on a machine without the CUDA toolkit, \
     tools/cuda/build.sh installs it from PyPI and builds: see docs/gpu.md, \"Building with CUDA\"), \
     or use device = \"cpu\" / --device cpu";

/// The GPU of this process in a data-parallel launch: its local rank on its machine (the
/// installed [`Host`]'s, which has one only when the launcher started several processes; one GPU
/// per process); `None` on one process.
fn local_gpu() -> Option<usize> {
    host().local_rank
}

/// Opens the device of `choice`. In a data-parallel run `"auto"`, `"cuda"` and `"cuda:0"` mean
/// the GPU of the process's local rank (one GPU per process; `docs/distributed.md`).
fn open_device(choice: DeviceChoice) -> Result<Device> {
    let local_gpu = local_gpu();
    let choice = match (choice, local_gpu) {
        (DeviceChoice::Cuda(0), Some(n)) => DeviceChoice::Cuda(n),
        (c, _) => c,
    };
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Auto => {
            // candle's `cuda_is_available()` only says whether the feature is built; whether a
            // GPU answers is known by opening it (a CUDA build links the driver, so this is an
            // error without a GPU, not a missing library). The local rank's GPU first.
            if cfg!(feature = "cuda") {
                let mut failed = None;
                for n in local_gpu.into_iter().chain([0]) {
                    match Device::new_cuda(n) {
                        Ok(d) => return Ok(d),
                        Err(e) => failed = Some(e),
                    }
                }
                if let Some(e) = failed {
                    tracing::info!("device = \"auto\": no usable CUDA GPU ({e}); using the CPU");
                }
            }
            Ok(Device::Cpu)
        }
        DeviceChoice::Cuda(n) => {
            if !cfg!(feature = "cuda") {
                return Err(Error::Unsupported(format!(
                    "[runtime] device = \"{choice}\" (or --device {choice}): {CUDA_BUILD_HINT}"
                )));
            }
            open_cuda(n, choice)
        }
    }
}

fn open_cuda(n: usize, choice: DeviceChoice) -> Result<Device> {
    Device::new_cuda(n).map_err(|e| {
        Error::Unsupported(format!(
            "[runtime] device = \"{choice}\": cannot open CUDA device {n} ({e}); check `nvidia-smi` \
             and the driver (CUDA 13 needs driver 580 or newer), or use device = \"cpu\""
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the library used to read from the environment comes from the variables given.
    #[test]
    fn the_host_is_read_from_the_variables_given() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        let h = Host::from_vars(vars(&[
            ("USERNAME", "ada"),
            ("HF_HUB_OFFLINE", "true"),
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ]));
        assert_eq!((h.user.as_deref(), h.hub.offline, h.local_rank), (Some("ada"), true, Some(1)));
        // One process: no local rank; USER wins over USERNAME.
        let h =
            Host::from_vars(vars(&[("USER", "bo"), ("USERNAME", "ada"), ("RANK", "0"), ("WORLD_SIZE", "1")]));
        assert_eq!((h.user.as_deref(), h.local_rank), (Some("bo"), None));
        assert_eq!(Host::from_vars(|_| None), Host::default());
        // Secrets come only from the lookup given, and never print.
        let h = Host::default().with_secrets(|k| (k == "JUDGE_KEY").then(|| "s3cret".to_string()));
        assert_eq!((h.secrets.get("JUDGE_KEY").as_deref(), h.secrets.get("PATH")), (Some("s3cret"), None));
        assert!(!format!("{h:?}").contains("s3cret"), "{h:?}");
        assert_eq!(Host::default().secrets.get("JUDGE_KEY"), None);
    }

    #[test]
    fn device_and_dtype_parse_and_print_round_trip() {
        for (s, d) in [
            ("auto", DeviceChoice::Auto),
            ("cpu", DeviceChoice::Cpu),
            ("cuda", DeviceChoice::Cuda(0)),
            ("cuda:0", DeviceChoice::Cuda(0)),
            ("CUDA:3", DeviceChoice::Cuda(3)),
        ] {
            assert_eq!(s.parse::<DeviceChoice>().unwrap(), d, "{s}");
            assert_eq!(d.to_string().parse::<DeviceChoice>().unwrap(), d);
        }
        for bad in ["tpu", "cuda:", "cuda:x", "cuda:-1", ""] {
            let e = bad.parse::<DeviceChoice>().unwrap_err();
            assert!(e.contains("\"auto\"") && e.contains("\"cuda:N\""), "{e}");
        }
        assert_eq!("bf16".parse::<Precision>().unwrap(), Precision::Bf16);
        assert_eq!("f32".parse::<Precision>().unwrap(), Precision::F32);
        let e = "fp16".parse::<Precision>().unwrap_err();
        assert!(e.contains("\"fp16\"") && e.contains("\"bf16\""), "{e}");
    }

    #[test]
    fn the_cpu_resolves_to_f32_and_overrides_win() {
        let s = RuntimeSection { device: DeviceChoice::Cpu, ..RuntimeSection::default() };
        let rt = Runtime::resolve(&s).unwrap();
        assert!(rt.is_cpu());
        assert_eq!((rt.dtype(), rt.matmul_precision()), (DType::F32, MatmulPrecision::F32));
        assert_eq!(rt.to_string(), "cpu, f32");
        assert_eq!(rt.section(), s);
        let o = RuntimeSection::default().with_overrides(Some(DeviceChoice::Cuda(1)), Some(Precision::Bf16));
        assert_eq!((o.device, o.dtype), (DeviceChoice::Cuda(1), Precision::Bf16));
        assert_eq!(RuntimeSection::default().with_overrides(None, None), RuntimeSection::default());
    }

    #[test]
    fn auto_is_the_cpu_without_the_cuda_feature() {
        let rt = Runtime::resolve(&RuntimeSection::default()).unwrap();
        if !cfg!(feature = "cuda") {
            assert!(rt.is_cpu());
        }
        assert_eq!(rt.section().device, DeviceChoice::Auto);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_says_how_to_build_it() {
        for d in [DeviceChoice::Cuda(0), DeviceChoice::Cuda(2)] {
            let s = RuntimeSection { device: d, ..RuntimeSection::default() };
            let e = Runtime::resolve(&s).unwrap_err().to_string();
            assert!(e.contains(&format!("device = \"{d}\"")), "{e}");
            assert!(e.contains("cargo build --release --features cuda"), "{e}");
            assert!(e.contains("tools/cuda/build.sh"), "{e}");
        }
    }

    #[test]
    fn bf16_on_the_cpu_is_amx_or_a_clear_error() {
        for s in [
            RuntimeSection { device: DeviceChoice::Cpu, dtype: Precision::Bf16, ..RuntimeSection::default() },
            RuntimeSection {
                device: DeviceChoice::Cpu,
                matmul_precision: MatmulPrecision::Bf16,
                ..RuntimeSection::default()
            },
        ] {
            match Runtime::resolve(&s) {
                Ok(rt) => {
                    assert_eq!((rt.dtype(), rt.matmul_precision()), (DType::F32, MatmulPrecision::Bf16))
                }
                Err(e) => {
                    let e = e.to_string();
                    assert!(e.contains("[runtime]") && e.contains("AMX") && e.contains("f32"), "{e}");
                }
            }
        }
    }

    #[test]
    fn activations_parse_round_trip_and_stay_out_of_written_configs() {
        for (s, a) in [("bf16", Activations::Bf16), ("f32", Activations::F32)] {
            assert_eq!(s.parse::<Activations>().unwrap(), a);
            assert_eq!(a.to_string(), s);
        }
        let e = "f16".parse::<Activations>().unwrap_err();
        assert!(e.contains("\"f16\"") && e.contains("\"f32\""), "{e}");
        // Each choice's error names the setting and its own default.
        assert!(e.starts_with("unknown activations") && e.ends_with("(default \"bf16\")"), "{e}");
        let e = "tf32".parse::<AttentionProducts>().unwrap_err();
        assert!(e.starts_with("unknown attention") && e.ends_with("(default \"f32\")"), "{e}");
        let written = toml::to_string(&RuntimeSection::default()).unwrap();
        assert!(!written.contains("activations"), "{written}");
        let section = RuntimeSection { activations: Activations::F32, ..RuntimeSection::default() };
        let text = format!("[runtime]\n{}", toml::to_string(&section).unwrap());
        assert!(text.contains("activations = \"f32\""), "{text}");
        let back = RuntimeSection::from_toml_table(&text, std::path::Path::new("x.toml")).unwrap();
        assert_eq!(back, section);
        assert_eq!(RuntimeSection::default().with_activations(Some(Activations::F32)), section);
        assert_eq!(section.clone().with_activations(None), section);
        // `attention` the same way.
        for (s, a) in [("f32", AttentionProducts::F32), ("bf16", AttentionProducts::Bf16)] {
            assert_eq!(s.parse::<AttentionProducts>().unwrap(), a);
            assert_eq!(a.to_string(), s);
        }
        assert!("tf32".parse::<AttentionProducts>().unwrap_err().contains("\"tf32\""));
        assert!(!written.contains("attention"), "{written}");
        let section = RuntimeSection { attention: AttentionProducts::Bf16, ..RuntimeSection::default() };
        let text = format!("[runtime]\n{}", toml::to_string(&section).unwrap());
        assert!(text.contains("attention = \"bf16\""), "{text}");
        assert_eq!(RuntimeSection::from_toml_table(&text, std::path::Path::new("x.toml")).unwrap(), section);
        assert_eq!(RuntimeSection::default().with_attention(Some(AttentionProducts::Bf16)), section);
    }

    #[test]
    fn cuda_host_parses_round_trips_and_stays_out_of_written_configs() {
        for (s, h, events, keep) in [
            ("tuned", CudaHost::Tuned, false, true),
            ("events", CudaHost::Events, true, true),
            ("trim", CudaHost::Trim, false, false),
            ("candle", CudaHost::Candle, true, false),
        ] {
            assert_eq!(s.parse::<CudaHost>().unwrap(), h);
            assert_eq!(h.to_string(), s);
            assert_eq!((h.event_tracking(), h.keep_pool()), (events, keep));
        }
        let e = "fast".parse::<CudaHost>().unwrap_err();
        assert!(e.contains("\"fast\"") && e.contains("\"candle\""), "{e}");
        let written = toml::to_string(&RuntimeSection::default()).unwrap();
        assert!(!written.contains("cuda_host"), "{written}");
        let section = RuntimeSection { cuda_host: CudaHost::Candle, ..RuntimeSection::default() };
        let text = format!("[runtime]\n{}", toml::to_string(&section).unwrap());
        let back = RuntimeSection::from_toml_table(&text, std::path::Path::new("x.toml")).unwrap();
        assert_eq!(back, section);
        // On the CPU the setting is accepted and changes nothing.
        let cpu = RuntimeSection { device: DeviceChoice::Cpu, ..section };
        let rt = Runtime::resolve(&cpu).unwrap();
        rt.install().unwrap();
        assert_eq!(rt.section(), cpu);
    }

    #[test]
    fn the_runtime_table_is_read_alone_and_names_bad_keys() {
        let p = std::path::Path::new("c.toml");
        let s = RuntimeSection::from_toml_table("[ppo]\nbatch_size = 2\n[runtime]\ndevice = \"cpu\"\n", p)
            .unwrap();
        assert_eq!(s.device, DeviceChoice::Cpu);
        assert_eq!(RuntimeSection::from_toml_table("[ppo]\n", p).unwrap(), RuntimeSection::default());
        let e = RuntimeSection::from_toml_table("[runtime]\ndevise = \"cpu\"\n", p).unwrap_err().to_string();
        assert!(e.contains("c.toml") && e.contains("did you mean \"device\""), "{e}");
        let e = RuntimeSection::from_toml_table("[runtime]\ndevice = \"tpu\"\n", p).unwrap_err().to_string();
        assert!(e.contains("\"tpu\"") && e.contains("\"cuda:N\""), "{e}");
    }
}
