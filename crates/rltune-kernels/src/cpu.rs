//! CPU setup: thread pools and floating-point mode, made by one explicit call.
//!
//! No constructor of rltune changes the process. Whoever runs the work (the `rltune` binary,
//! a test, a library user's `main`) makes the process-wide settings once, explicitly:
//!
//! ```
//! // At the start of `main`, before any candle op and before other threads start:
//! rltune_kernels::cpu::ProcessSettings::default().install()?;
//! # Ok::<(), rltune_kernels::Error>(())
//! ```
//!
//! [`ProcessSettings::install`] sets, each switchable by its field:
//!
//! | setting | field | scope |
//! |---|---|---|
//! | `CANDLE_NUM_THREADS=1` unless set (candle's element-wise pool runs inline) | `inline_elementwise` | environment, read once by candle |
//! | glibc's mmap and trim thresholds ([`tune_allocator`]) | `tune_allocator` | allocator |
//! | the caller becomes a thread of rayon's global pool | `join_global_pool` | the global pool, if not built yet |
//! | FTZ/DAZ on the caller and every thread of the global pool ([`flush_denormals`]) | `flush_denormals` | those threads' MXCSR |
//! | spin-waiting of the pool during generation and steps ([`keep_pool_awake`]) | `spin_wait` | process |
//! | the CPU matrix products' precision ([`crate::set_matmul_precision`]) | `matmul_precision` | process |
//!
//! `rltune::runtime::Runtime::install` makes the share that follows from a resolved runtime
//! (FTZ/DAZ on the CPU, the matmul precision), so a run's config can choose bf16 after `main`
//! has installed the rest. Results depend on FTZ/DAZ at the level of denormals (~1e-38), so runs
//! and tests that compare numbers bit for bit make the same calls. The global allocator
//! ([`HugePages`]) is a choice of the binary (`#[global_allocator]`), not of this call.
//!
//! # Thread pools
//!
//! candle runs CPU work on two separate pools: matrix products (the `gemm` crate) and rltune's
//! fused ops run on rayon's global pool, while candle's element-wise ops (add, mul, exp, copies of
//! strided tensors, …) run on candle's own `BarrierPool`, whose workers spin-wait between jobs.
//! Both pools default to one thread per core, so on a small machine the spinning workers of one
//! pool take cores from the other: on 2 cores, 25–35% of a PPO step went to spinning. With
//! `CANDLE_NUM_THREADS=1` the element-wise pool has no workers (its ops run inline on the calling
//! thread, and are memory-bound anyway) while matmuls and the fused ops keep every core; a PPO
//! iteration of `rltune bench ppo --preset small` ran 1.9× faster.
//!
//! The `rltune` binary calls [`default_thread_setup`] first thing in `main`, which sets
//! `CANDLE_NUM_THREADS=1` unless the user set it. Library users should do the same: set the
//! variable in the environment, or call [`default_thread_setup`] at the start of `main`, before
//! any candle op runs and before other threads start (candle reads the variable once).
//! `RAYON_NUM_THREADS` still sets the size of the matmul pool.
//!
//! [`default_thread_setup`] also makes the calling thread one of the global pool's threads
//! (rayon's `use_current_thread`; the pool keeps one thread per core in all). A PPO step starts
//! thousands of short parallel ops from the main thread; from outside the pool each one is
//! handed to the pool's threads, which wake, while the caller sleeps until they are done (two
//! wake-ups per op, and three threads on two cores). From inside, the caller runs its share at
//! once and only the other threads wake: `rltune bench ppo --preset small` spent 1.88 instead of
//! 1.97 s per iteration in its optimization (mean of 7 alternating runs). Where the global pool
//! already exists, this part is skipped.
//!
//! # Memory allocator
//!
//! A PPO step allocates and frees buffers of the same sizes (activations, their gradients, the
//! LM head's probabilities) over and over. glibc serves blocks above its mmap threshold
//! (128 KiB, raised adaptively) with fresh `mmap`s and returns the top of the heap to the
//! kernel above its trim threshold, so every minibatch faulted its buffers in anew and the
//! kernel zeroed each page: 592K page faults in `rltune bench ppo --preset small` (3
//! iterations and a warm-up). [`tune_allocator`] sets the mmap threshold to 32 MiB (glibc's
//! largest) and the trim threshold to 1 GiB, so freed blocks are reused: 56K faults, 11% less
//! time, the same peak RSS. [`default_thread_setup`] calls it.
//!
//! # Huge pages
//!
//! A `gpt2` PPO step streams its weights, their Adam moments and the packed copies generation
//! reads from memory, at each minibatch: hundreds of MiB in 4 KiB pages, a TLB miss and a
//! page walk every 64 cache lines, and the hardware prefetcher stops at each page boundary.
//! Where the kernel's transparent huge pages are `madvise` (the default of many distributions),
//! only memory marked `MADV_HUGEPAGE` gets 2 MiB pages. [`HugePages`] is the system allocator
//! that marks each allocation of 4 MiB or more before it is first touched; the `rltune` binary
//! installs it as its global allocator. On a 2-vCPU Xeon (model 167), 2 threads streaming
//! 3 × 256 MiB read and wrote 55 → 58 GB/s with huge pages, read alone 28.6 → 30.7 GB/s; `bench
//! ppo --preset gpt2` ran 8.42 → 8.03 s per iteration (3 alternating pairs, each faster; glibc's
//! own `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, which advises all of its heap, 8.09 s), `small`
//! (21 MiB of weights) 1.152 / 1.152 s, and peak RSS stayed the same; the start of a run costs
//! more (see [`HugePages`]; `RLTUNE_HUGE_PAGES=0` switches it off). Library users opt in with
//! `#[global_allocator] static A: rltune_kernels::cpu::HugePages = rltune_kernels::cpu::HugePages;`.
//!
//! # Keeping the pool awake
//!
//! Between two parallel ops (a PPO step runs about 1.3K matrix products and as many fused ops)
//! the calling thread often works alone for a while: candle's element-wise ops, autograd
//! bookkeeping, the optimizer's loop. rayon's other threads spin briefly, then sleep, and the next
//! parallel op has to wake them again; in a VM that is an inter-processor interrupt through the
//! hypervisor each time, and the op waits for it. [`KeepAwake`] (from [`keep_pool_awake`]) keeps
//! the pool's other threads looking for work without sleeping while it lives, as OpenMP's spin
//! wait does for torch: `rltune bench ppo --preset small` on a 2-vCPU Xeon ran an iteration in
//! 1.453–1.470 s instead of 1.489–1.519 s (3 alternating pairs; generation 0.148 → 0.135 s). The
//! cost is a core that spins during the caller's serial stretches. `rltune::generation::generate`,
//! `rltune::ppo::PpoTrainer::step` and the SFT / reward-model training loops hold one; set
//! `ProcessSettings::spin_wait` to false to switch it off (the `rltune` binary does so for
//! `RLTUNE_SPIN_WAIT=0`).
//!
//! # Denormals
//!
//! Gradients of small activations underflow into denormal floats, which x86 CPUs process up
//! to 100× slower; a backward pass measured 7–12× slower with them. [`flush_denormals`] sets the
//! FTZ (flush-to-zero) and DAZ (denormals-are-zero) bits on the calling thread and on every
//! thread of rayon's global pool (where candle's matmuls and rltune's fused ops run). Values below
//! ~1.2e-38 become 0, which changes no result that matters for training.

/// The process-wide settings of rltune's CPU kernels, made by [`Self::install`] (see the module
/// docs for what each one does and why). [`Default`] is what the `rltune` binary installs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessSettings {
    /// Sets `CANDLE_NUM_THREADS=1` unless the environment has it (default true).
    pub inline_elementwise: bool,
    /// Tunes glibc's allocator with [`tune_allocator`] (default true).
    pub tune_allocator: bool,
    /// Makes the calling thread a thread of rayon's global pool, unless the pool exists
    /// (default true).
    pub join_global_pool: bool,
    /// Sets FTZ/DAZ on the calling thread and rayon's global pool (default true).
    pub flush_denormals: bool,
    /// Lets [`keep_pool_awake`] spin the pool's threads (default true).
    pub spin_wait: bool,
    /// How the CPU kernels run f32 matrix products (default f32).
    pub matmul_precision: crate::MatmulPrecision,
}

impl Default for ProcessSettings {
    fn default() -> Self {
        Self {
            inline_elementwise: true,
            tune_allocator: true,
            join_global_pool: true,
            flush_denormals: true,
            spin_wait: true,
            matmul_precision: crate::MatmulPrecision::F32,
        }
    }
}

impl ProcessSettings {
    /// Makes these settings for the whole process. Call it at the start of `main`, before any
    /// candle op and before spawning threads: it may change the process environment
    /// (`CANDLE_NUM_THREADS`), which is not safe while other threads read it. Calling it again
    /// later is safe and changes only FTZ/DAZ, spin-waiting and the matmul precision (the
    /// environment variable is set by then, and the global pool exists). The one error is a
    /// bf16 matmul precision on a CPU without AMX-BF16.
    pub fn install(&self) -> crate::error::Result<()> {
        crate::check_matmul_precision(self.matmul_precision)?;
        if self.inline_elementwise && std::env::var_os("CANDLE_NUM_THREADS").is_none() {
            std::env::set_var("CANDLE_NUM_THREADS", "1");
        }
        if self.tune_allocator {
            tune_allocator();
        }
        if self.join_global_pool {
            // Fails only when the global pool already exists, which then stays as it is.
            let _ = rayon::ThreadPoolBuilder::new().use_current_thread().build_global();
        }
        if self.flush_denormals {
            flush_denormals();
        }
        SPIN_WAIT.store(self.spin_wait, std::sync::atomic::Ordering::Relaxed);
        crate::set_matmul_precision(self.matmul_precision)
    }
}

/// Whether [`keep_pool_awake`] spins (set by [`ProcessSettings::install`]; on until then).
static SPIN_WAIT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Makes candle's element-wise pool single-threaded unless `CANDLE_NUM_THREADS` is set, tunes
/// the allocator ([`tune_allocator`]) and makes the calling thread a thread of rayon's global
/// pool (unless that pool already exists); see the module docs. Call it at the start of `main`,
/// before any candle op and before spawning threads: it changes the process environment, which
/// is not safe while other threads read it. [`ProcessSettings::install`] does this and the rest.
pub fn default_thread_setup() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    tune_allocator();
    // Fails only when the global pool already exists, which then stays as it is.
    let _ = rayon::ThreadPoolBuilder::new().use_current_thread().build_global();
}

/// Keeps freed memory for reuse instead of handing it back to the kernel (glibc: mmap threshold
/// 32 MiB, trim threshold 1 GiB; see the module docs). A no-op with other C libraries. An
/// explicit `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_` in the environment wins (the
/// `GLIBC_TUNABLES` spelling of the same settings is overridden).
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let set = |var: &str| std::env::var_os(var).is_some();
        // SAFETY: mallopt only changes tunables of glibc's allocator (thread-safe, takes its
        // own locks); the values are within the documented ranges.
        unsafe {
            if !set("MALLOC_MMAP_THRESHOLD_") {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            }
            if !set("MALLOC_TRIM_THRESHOLD_") {
                libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
            }
        }
    }
}

/// The system allocator, asking the kernel for transparent huge pages (2 MiB) for each
/// allocation of at least [`HugePages::MIN`] bytes (`madvise(MADV_HUGEPAGE)` on the whole 2 MiB
/// pages inside it, before anything touches it): see the module docs. The advice is a hint
/// (memory already faulted in keeps its pages; with transparent huge pages `never` nothing
/// changes) and a no-op off Linux. Small allocations go to the system allocator untouched.
/// `RLTUNE_HUGE_PAGES=0` in the environment switches the advice off.
///
/// The cost is at the start: a huge page is zeroed whole when first touched, and on a VM fresh
/// 2 MiB pages are slow to come by: `bench ppo --preset gpt2` spent 6.7–6.9 s of system time
/// instead of 1.7–1.8 (clearing pages while the models, moments and first buffers were
/// faulted in), about 2.5 s more wall time before the first iteration, which pays back after
/// about ten iterations. Later iterations reuse the memory and fault nothing.
pub struct HugePages;

impl HugePages {
    /// Allocations from this size on are advised (a 2 MiB page fits inside at any alignment).
    pub const MIN: usize = 4 << 20;

    /// The whole 2 MiB pages inside `size` bytes from `at`, as (start, length); `None` for
    /// small allocations.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    fn pages(at: usize, size: usize) -> Option<(usize, usize)> {
        const PAGE: usize = 2 << 20;
        let (start, end) = (at.checked_next_multiple_of(PAGE)?, (at + size) / PAGE * PAGE);
        (size >= Self::MIN && end > start).then(|| (start, end - start))
    }

    /// Whether to advise: unless `RLTUNE_HUGE_PAGES=0` (read once, with `getenv`, which does
    /// not allocate: this runs inside the allocator).
    #[cfg(target_os = "linux")]
    fn enabled() -> bool {
        use std::sync::atomic::{AtomicU8, Ordering};
        // 0: not read yet, 1: on, 2: off.
        static STATE: AtomicU8 = AtomicU8::new(0);
        match STATE.load(Ordering::Relaxed) {
            0 => {
                // SAFETY: a NUL-terminated name; the result is only compared, not kept.
                // `getenv` races only with a concurrent `setenv`, and rltune's one
                // (`default_thread_setup`) runs at the start of `main`, before other threads.
                let off = unsafe {
                    let v = libc::getenv(c"RLTUNE_HUGE_PAGES".as_ptr());
                    !v.is_null() && std::ffi::CStr::from_ptr(v).to_bytes() == b"0"
                };
                STATE.store(if off { 2 } else { 1 }, Ordering::Relaxed);
                !off
            }
            state => state == 1,
        }
    }

    fn advise(p: *mut u8, size: usize) {
        #[cfg(target_os = "linux")]
        if let Some((start, len)) = Self::pages(p as usize, size).filter(|_| !p.is_null() && Self::enabled())
        {
            // SAFETY: the range lies inside an allocation just made; MADV_HUGEPAGE only sets a
            // flag on the mapping (its contents stay), and a failure leaves 4 KiB pages.
            unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
        }
        #[cfg(not(target_os = "linux"))]
        let _ = (p, size);
    }
}

// SAFETY: every call is forwarded to `System` unchanged; `advise` only marks pages of the
// allocation it returns.
unsafe impl std::alloc::GlobalAlloc for HugePages {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: as the caller promised for `alloc`.
        let p = unsafe { std::alloc::System.alloc(layout) };
        Self::advise(p, layout.size());
        p
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: as the caller promised for `alloc_zeroed`.
        let p = unsafe { std::alloc::System.alloc_zeroed(layout) };
        Self::advise(p, layout.size());
        p
    }

    unsafe fn realloc(&self, p: *mut u8, layout: std::alloc::Layout, size: usize) -> *mut u8 {
        // SAFETY: as the caller promised for `realloc`.
        let q = unsafe { std::alloc::System.realloc(p, layout, size) };
        Self::advise(q, size);
        q
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: as the caller promised for `dealloc`.
        unsafe { std::alloc::System.dealloc(p, layout) }
    }
}

/// Keeps rayon's other pool threads awake while it lives; see [`keep_pool_awake`].
#[must_use = "the pool sleeps again as soon as the guard is dropped"]
pub struct KeepAwake {
    active: bool,
}

/// How long a spinner looks for work without finding any before it leaves (see
/// [`keep_pool_awake`]): longer than the serial stretches inside generation and a PPO step, short
/// enough that a spinner caught inside another job's wait holds it up only briefly. In a `bench
/// ppo --preset small` run (4 iterations, 8 guards) spinners left early under 2 of the 8 guards
/// at a limit of 2 ms, under none at 20 ms; OpenMP runtimes spin for 0.2–200 ms by default.
const IDLE_LIMIT: std::time::Duration = std::time::Duration::from_millis(20);

/// One generation of spinners: the stop flag, and how many of them are in their loop.
#[derive(Default)]
struct Spinners {
    stop: std::sync::atomic::AtomicBool,
    running: std::sync::atomic::AtomicUsize,
}

/// How many guards are alive, and the spinners the first of them started.
static AWAKE: std::sync::Mutex<(usize, Option<std::sync::Arc<Spinners>>)> = std::sync::Mutex::new((0, None));

/// Makes every thread of the current rayon pool but one look for work without sleeping until the
/// returned guard is dropped (see the module docs). The one left out is the caller when it is a
/// thread of the pool, else the pool's first thread (the caller then needs a core of its own for
/// its serial work). Guards nest, counted per process: the threads of the pool the first guard was
/// created in spin from then to the drop of the last. A no-op where [`ProcessSettings::spin_wait`]
/// was installed false, and in a pool of one thread.
///
/// Each spinner is a broadcast job that runs the pool's other jobs until it is told to stop.
/// Such a job can also start inside another job's wait, and there it holds up that job until it
/// stops; if the job's owner is what keeps a guard alive, nothing would ever stop it. Two rules
/// keep that away: a guard starts spinners only after the previous ones have left their loops
/// (the last drop waits for that) and when its caller has no parallel work out, so the other
/// threads are idle and take the new job first; and a spinner that has found no work for
/// `IDLE_LIMIT` leaves by itself (the pool then sleeps between ops again until the guard is
/// dropped and another taken). The second rule bounds what the first cannot rule out: several
/// threads using one pool, one of them taking a guard while another's job runs (`cargo test`
/// hung once in four runs without it).
pub fn keep_pool_awake() -> KeepAwake {
    use std::sync::atomic::Ordering::SeqCst;
    let enabled = SPIN_WAIT.load(std::sync::atomic::Ordering::Relaxed);
    if !enabled || rayon::current_num_threads() < 2 {
        return KeepAwake { active: false };
    }
    let mut state = AWAKE.lock().unwrap_or_else(|e| e.into_inner());
    state.0 += 1;
    if state.0 == 1 {
        let spinners = std::sync::Arc::new(Spinners::default());
        state.1 = Some(spinners.clone());
        let left_out = rayon::current_thread_index().unwrap_or(0);
        rayon::spawn_broadcast(move |ctx| {
            if ctx.index() == left_out {
                return;
            }
            // Counted before the flag is read (both SeqCst): either the drop sees this spinner
            // and waits for it, or the spinner sees the flag and never enters the loop.
            spinners.running.fetch_add(1, SeqCst);
            // Runs the pool's jobs (stealing from the others, as an idle rayon thread does) until
            // the last guard is dropped, or until it has found nothing to do for IDLE_LIMIT; a
            // short pause between empty looks keeps this thread off the cache lines of the
            // others' queues.
            let mut idle_since: Option<std::time::Instant> = None;
            while !spinners.stop.load(SeqCst) {
                if rayon::yield_now() == Some(rayon::Yield::Executed) {
                    idle_since = None;
                    continue;
                }
                for _ in 0..8 {
                    std::hint::spin_loop();
                }
                let since = *idle_since.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() > IDLE_LIMIT {
                    break;
                }
            }
            spinners.running.fetch_sub(1, SeqCst);
        });
    }
    KeepAwake { active: true }
}

impl Drop for KeepAwake {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering::SeqCst;
        if !self.active {
            return;
        }
        let mut state = AWAKE.lock().unwrap_or_else(|e| e.into_inner());
        state.0 -= 1;
        if state.0 == 0 {
            if let Some(spinners) = state.1.take() {
                spinners.stop.store(true, SeqCst);
                // The spinners are between jobs (the caller has no parallel work out), so they
                // leave at their next look at the flag.
                while spinners.running.load(SeqCst) != 0 {
                    std::hint::spin_loop();
                }
            }
        }
    }
}

/// Runs `f(i)` for every `i` in `0..n` on the current rayon pool: the indices are cut into one
/// contiguous range per thread (the caller's first), each thread that joins takes the next index
/// of its own range and then of the others' until all are taken, and the caller then spins
/// until the tasks the others took are done.
///
/// For a few equal tasks this ends sooner than a `par_iter`, whose halves are split recursively
/// and stolen back and forth: when the caller had stolen part of the other thread's half, each
/// thread ended up waiting on the other in a nested join, and a waiting rayon thread sleeps after
/// a few dozen yields; the wake-up (an inter-processor interrupt through the hypervisor on a VM)
/// came after the last task had ended. In `bench ppo --preset small` on 2 vCPUs the products'
/// `par_iter` returned a median 60 µs after their last task for generation's `64 × 1024 × 256`
/// product (24 ms per iteration over all products). Here a thread waits for at most one task
/// of another, spinning, and a helper job that nobody took finds every range spent and returns.
/// Contiguous ranges keep what neighbouring tasks share (a product's rows of A) on one core:
/// handing out indices in turn from one counter made the optimization 5% slower.
pub(crate) fn for_each_task(n: usize, f: impl Fn(usize) + Sync) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let threads = rayon::current_num_threads().min(n);
    if threads <= 1 {
        (0..n).for_each(f);
        return;
    }
    // Range `r` is `r·n/threads..(r + 1)·n/threads`; `next[r]` is its next untaken index.
    let bound = |r: usize| r * n / threads;
    let next: Vec<AtomicUsize> = (0..threads).map(|r| AtomicUsize::new(bound(r))).collect();
    let done = AtomicUsize::new(0);
    let slots = AtomicUsize::new(1);
    // Counts a task as done when it returns or unwinds (a panic then propagates through the
    // join instead of leaving the caller spinning).
    struct Done<'a>(&'a AtomicUsize);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Release);
        }
    }
    let work = |own: usize| {
        for r in (own..threads).chain(0..own) {
            loop {
                let i = next[r].fetch_add(1, Ordering::Relaxed);
                if i >= bound(r + 1) {
                    break;
                }
                let _done = Done(&done);
                f(i);
            }
        }
    };
    let helper = || work(slots.fetch_add(1, Ordering::Relaxed).min(threads - 1));
    fn helpers(k: usize, helper: &(impl Fn() + Sync)) {
        if k <= 1 {
            helper();
        } else {
            rayon::join(|| helpers(k / 2, helper), || helpers(k - k / 2, helper));
        }
    }
    rayon::join(
        || {
            work(0);
            while done.load(Ordering::Acquire) < n {
                std::hint::spin_loop();
            }
        },
        || helpers(threads - 1, &helper),
    );
}

/// Sets FTZ/DAZ on this thread and on rayon's global pool (idempotent; no-op off x86-64).
pub fn flush_denormals() {
    set_ftz_daz();
    rayon::broadcast(|_| set_ftz_daz());
}

#[cfg(target_arch = "x86_64")]
fn set_ftz_daz() {
    let mut csr: u32 = 0;
    // SAFETY: stmxcsr/ldmxcsr read and write the SSE control register of this thread only;
    // bits 15 (FTZ) and 6 (DAZ) change how denormals are treated, nothing else.
    unsafe {
        std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack));
        csr |= 0x8040;
        std::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack));
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn set_ftz_daz() {}

#[cfg(test)]
mod tests {
    use rayon::prelude::*;

    #[test]
    fn huge_pages_are_the_whole_2_mib_pages_of_large_allocations() {
        const M: usize = 1 << 20;
        assert_eq!(super::HugePages::pages(6 * M, 3 * M), None, "below MIN");
        assert_eq!(super::HugePages::pages(4 * M, 4 * M), Some((4 * M, 4 * M)));
        assert_eq!(super::HugePages::pages(4 * M + 4096, 5 * M), Some((6 * M, 2 * M)));
        assert_eq!(super::HugePages::pages(M, 4 * M), Some((2 * M, 2 * M)));
    }

    /// A large allocation's mapping carries the kernel's huge-page advice (`hg` in
    /// `/proc/self/smaps`' VmFlags), whatever the system's transparent-huge-page mode, unless
    /// `RLTUNE_HUGE_PAGES=0`.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_large_allocation_is_advised_huge_pages() {
        use std::alloc::{GlobalAlloc, Layout};
        let layout = Layout::from_size_align(8 << 20, 64).expect("layout");
        // SAFETY: a valid non-zero layout; freed below with the same layout.
        let p = unsafe { super::HugePages.alloc(layout) };
        assert!(!p.is_null());
        let (start, _) = super::HugePages::pages(p as usize, layout.size()).expect("2 MiB pages inside");
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("read /proc/self/smaps");
        // The mapping that holds `start`, then its VmFlags line.
        let mut inside = false;
        let mut flags = None;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ').filter(|(r, _)| r.contains('-')) {
                let (lo, hi) = range.split_once('-').expect("a mapping's range");
                let (lo, hi) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16));
                inside = matches!((lo, hi), (Ok(lo), Ok(hi)) if lo <= start && start < hi);
            } else if inside && line.starts_with("VmFlags:") {
                flags = Some(line.to_string());
                break;
            }
        }
        // SAFETY: allocated above with this layout.
        unsafe { super::HugePages.dealloc(p, layout) };
        let flags = flags.expect("the allocation's mapping in /proc/self/smaps");
        let advised = flags.split_whitespace().any(|f| f == "hg");
        // Advised unless `RLTUNE_HUGE_PAGES=0`.
        assert_eq!(advised, super::HugePages::enabled(), "huge-page advice: {flags}");
    }

    /// Guards taken and dropped around nested parallel work, many times over, in a pool of two:
    /// the sums come out right and nothing hangs (a spinner started inside a job the caller waits
    /// for would never return).
    #[test]
    fn keep_awake_guards_never_hang() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("thread pool");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let sums: Vec<u64> = pool.install(|| {
                (0..20000u64)
                    .map(|round| {
                        let _outer = super::keep_pool_awake();
                        let inner = (round % 3 == 0).then(super::keep_pool_awake);
                        let s = (0..256u64)
                            .into_par_iter()
                            .map(|i| (0..8u64).into_par_iter().map(|j| i * j + round).sum::<u64>())
                            .sum();
                        drop(inner);
                        s
                    })
                    .collect()
            });
            let _ = tx.send(sums);
        });
        let sums = rx.recv_timeout(std::time::Duration::from_secs(120)).expect("guards deadlocked");
        for (round, s) in sums.into_iter().enumerate() {
            let want: u64 = (0..256u64).map(|i| (0..8u64).map(|j| i * j + round as u64).sum::<u64>()).sum();
            assert_eq!(s, want, "round {round}");
        }
    }

    /// Every index runs exactly once, for task counts around the thread count, called from inside
    /// and outside the pool and nested in another call's task; a panicking task propagates
    /// instead of leaving the caller spinning.
    #[test]
    fn tasks_run_once_each_and_panics_propagate() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("thread pool");
        for n in [0, 1, 2, 3, 7, 64] {
            let hits: Vec<AtomicUsize> = (0..n * n).map(|_| AtomicUsize::new(0)).collect();
            pool.install(|| {
                super::for_each_task(n, |i| {
                    super::for_each_task(n, |j| {
                        hits[i * n + j].fetch_add(1, Ordering::Relaxed);
                    })
                })
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n = {n}");
            let outside = AtomicUsize::new(0);
            super::for_each_task(n, |_| {
                outside.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(outside.load(Ordering::Relaxed), n);
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.install(|| super::for_each_task(8, |i| assert_ne!(i, 5, "task 5 fails")))
            }));
            let _ = tx.send(caught.is_err());
        });
        let panicked = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("the caller hung");
        assert!(panicked);
    }

    #[test]
    fn denormals_flush_after_setup() {
        super::flush_denormals();
        let tiny = std::hint::black_box(1e-38f32);
        let x = std::hint::black_box(tiny / 1000.0);
        #[cfg(target_arch = "x86_64")]
        assert_eq!(x, 0.0);
        let _ = x;
    }
}
