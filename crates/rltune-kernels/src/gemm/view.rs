//! The shared pieces of the CPU products: a strided matrix view ([`MatRef`]), a pointer rayon
//! tasks may share ([`SendPtr`]) and the per-thread aligned buffers ([`with_buffer`]). A leaf:
//! the portable driver (`gemm`), the x86 kernels and AMX (`crate::amx`) all build on it.

/// A strided read-only matrix: element `(i, j)` is `data[off + i·rs + j·cs]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MatRef<'a> {
    pub data: &'a [f32],
    pub off: usize,
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> MatRef<'a> {
    /// A row-major `rows × cols` matrix.
    #[cfg(test)]
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self { data, off: 0, rows, cols, rs: cols, cs: 1 }
    }

    /// The transpose (a view; nothing moves).
    pub fn t(self) -> Self {
        Self { rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs, ..self }
    }

    /// Whether every element the view addresses lies inside `data`.
    pub(super) fn in_bounds(&self) -> bool {
        if self.rows == 0 || self.cols == 0 {
            return true;
        }
        let last = (self.rows - 1)
            .checked_mul(self.rs)
            .and_then(|r| (self.cols - 1).checked_mul(self.cs).and_then(|c| r.checked_add(c)))
            .and_then(|x| x.checked_add(self.off));
        matches!(last, Some(l) if l < self.data.len())
    }

    #[inline(always)]
    pub(super) fn at(&self, i: usize, j: usize) -> f32 {
        self.data[self.off + i * self.rs + j * self.cs]
    }
}

/// A raw pointer that rayon tasks may share; they write disjoint tiles.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub(crate) *mut T);
// SAFETY: tasks write disjoint regions, and the owner outlives the parallel section.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// A buffer of at least `len` values whose start is 64-byte aligned, reused per thread.
pub(crate) fn with_buffer<T: Copy + Default, R>(
    key: &'static std::thread::LocalKey<std::cell::RefCell<Vec<T>>>,
    len: usize,
    f: impl FnOnce(&mut [T]) -> R,
) -> R {
    // Values per 64 bytes: enough slack to align the start.
    let pad = 64 / std::mem::size_of::<T>();
    let run = |v: &mut Vec<T>| {
        if v.len() < len + pad {
            *v = vec![T::default(); len + pad];
        }
        let skip = v.as_ptr().align_offset(64).min(pad - 1);
        f(&mut v[skip..skip + len])
    };
    key.with(|b| match b.try_borrow_mut() {
        Ok(mut v) => run(&mut v),
        // Re-entered on this thread (a rayon task nested in another): use a fresh buffer.
        Err(_) => run(&mut Vec::new()),
    })
}
