//! CPU setup: thread pools and floating-point mode.
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
//! # Denormals
//!
//! Gradients of small activations underflow into denormal floats, which x86 CPUs process up
//! to 100× slower; a backward pass measured 7–12× slower with them. [`flush_denormals`] sets the
//! FTZ (flush-to-zero) and DAZ (denormals-are-zero) bits on the calling thread and on every
//! thread of rayon's global pool (where candle's matmuls and rltune's fused ops run). Values below
//! ~1.2e-38 become 0, which changes no result that matters for training.

/// Makes candle's element-wise pool single-threaded unless `CANDLE_NUM_THREADS` is set, tunes
/// the allocator ([`tune_allocator`]) and makes the calling thread a thread of rayon's global
/// pool (unless that pool already exists); see the module docs. Call it at the start of `main`,
/// before any candle op and before spawning threads: it changes the process environment, which
/// is not safe while other threads read it.
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
