//! Embedding lookup whose backward scatters rows into the table's gradient sink.
//!
//! candle's `index_select` backward zero-fills a table-sized tensor, adds the rows into it,
//! and its gradient store then zero-fills and adds another: for GPT-2's tied 50257 × 768 `wte`
//! that is four passes over 154 MB per minibatch. [`embedding_with`] gathers the same rows
//! forward; backward, where its [`GradSlot`] pointed at the forward, it adds each row's gradient
//! into the table's sink (after the LM head's product has filled it, for a tied table), and
//! otherwise returns the dense gradient as `index_select` would.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

use rayon::prelude::*;

use super::grad_sink::{GradSlot, Sinks};
use super::{contiguous, CResult, Elem};

/// `(n, C), (N) u32 -> (N, C)`: rows of the table; the backward adds the rows' gradients to the
/// table's sink in `sinks` when it has one.
struct Embedding {
    sinks: Sinks,
}

fn gather<T: Elem>(
    table: (&CpuStorage, &Layout),
    ids: (&CpuStorage, &Layout),
) -> CResult<(CpuStorage, Shape)> {
    let (n, c) = match table.1.dims() {
        &[n, c] => (n, c),
        d => candle_core::bail!("embedding: the table must be a matrix, got shape {d:?}"),
    };
    let table = contiguous::<T>(table.0, table.1, "embedding")?;
    let ids = contiguous::<u32>(ids.0, ids.1, "embedding")?;
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= n) {
        candle_core::bail!("embedding: id {bad} is out of range for a table of {n} rows");
    }
    let mut out = super::zeros_par(ids.len() * c);
    let copy = |(out, ids): (&mut [T], &[u32])| {
        for (row, &id) in out.chunks_exact_mut(c.max(1)).zip(ids) {
            row.copy_from_slice(&table[id as usize * c..(id as usize + 1) * c]);
        }
    };
    // Activation-sized gathers on every core (the training batch's is 0.5 MB at d = 256).
    let rows = super::rows_per_task(c);
    if out.len() >= 1 << 15 {
        out.par_chunks_mut(rows * c.max(1)).zip(ids.par_chunks(rows)).for_each(copy);
    } else {
        copy((&mut out, ids));
    }
    Ok((T::to_cpu_storage_owned(out), (ids.len(), c).into()))
}

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "rltune-embedding"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s1, "embedding", gather((s1, l1), (s2, l2)))
    }

    fn bwd(
        &self,
        table: &Tensor,
        ids: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        if let (Some(sink), DType::F32) = (self.sinks.of(table), g.dtype()) {
            let g = g.flatten_all()?.to_vec1::<f32>()?;
            sink.add_rows(&ids.to_vec1::<u32>()?, table.dim(1)?, &g)?;
            return Ok((None, None));
        }
        let dense = table.zeros_like()?.index_add(ids, g, 0)?;
        Ok((self.sinks.give(table, dense)?, None))
    }
}

/// `table (n, C)`, `ids` of any shape and integer dtype -> `(…ids, C)`, differentiable in `table`
/// (`index_select` on rows). On the CPU (f32, f64) one op; an id out of range is an error naming
/// it. The table's gradient goes to candle's store ([`embedding_with`] writes it where a slot
/// says).
pub fn embedding(table: &Tensor, ids: &Tensor) -> CResult<Tensor> {
    embedding_with(table, ids, &GradSlot::new())
}

/// [`embedding`], whose backward adds the table's gradient rows into the buffers `grads` points
/// at when its forward runs (see [`GradSlot`]).
pub fn embedding_with(table: &Tensor, ids: &Tensor, grads: &GradSlot) -> CResult<Tensor> {
    let mut dims = ids.dims().to_vec();
    dims.push(table.dim(1)?);
    let flat = ids.flatten_all()?.to_dtype(DType::U32)?;
    let rows = if super::cpu_kernels(table.device()) && matches!(table.dtype(), DType::F32 | DType::F64) {
        // With a sink for a tracked table, the looked-up rows are held in it, so that an
        // optimizer fused into a tied LM head's product leaves them for this op's backward.
        // Sampling (a weight-cast scope: nothing trains) runs no backward, so it holds none.
        let sinks = grads.sinks();
        let training = !super::linear::in_weight_cast_scope();
        let sink = sinks.of(table).filter(|_| table.dtype() == DType::F32 && table.track_op() && training);
        if let Some(sink) = sink {
            sink.hold_rows(&flat.to_vec1::<u32>()?, table.dim(1)?)?;
        }
        table.contiguous()?.apply_op2(&flat, Embedding { sinks })?
    } else {
        table.index_select(&flat, 0)?
    };
    rows.reshape(dims)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::grad_sink::{GradSink, SinkMap};
    use crate::testutil::{max_diff, randn};
    use candle_core::{Device, Var};

    fn ids() -> Tensor {
        Tensor::new(&[[3u32, 0, 3], [5, 1, 0]], &Device::Cpu).unwrap()
    }

    #[test]
    fn matches_index_select_in_values_and_gradients() {
        let table = Var::from_tensor(&randn(&[6, 4], 1)).unwrap();
        let y = embedding(&table, &ids()).unwrap();
        let want = table.index_select(&ids().flatten_all().unwrap(), 0).unwrap().reshape((2, 3, 4)).unwrap();
        assert_eq!(max_diff(&y, &want), 0.0);
        let proj = randn(&[2, 3, 4], 9);
        let g = (y * &proj).unwrap().sum_all().unwrap().backward().unwrap();
        let gw = (want * &proj).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(max_diff(g.get(&table).unwrap(), gw.get(&table).unwrap()), 0.0);
    }

    #[test]
    fn large_gathers_match_index_select() {
        // 200 × 256 values take the parallel path.
        let table = randn(&[50, 256], 3);
        let ids = Tensor::from_vec((0..200u32).map(|i| (i * 37) % 50).collect::<Vec<_>>(), 200, &Device::Cpu)
            .unwrap();
        let y = embedding(&table, &ids).unwrap();
        assert_eq!(max_diff(&y, &table.index_select(&ids, 0).unwrap()), 0.0);
        let bad =
            Tensor::from_vec(vec![3u32; 199].into_iter().chain([50]).collect::<Vec<_>>(), 200, &Device::Cpu)
                .unwrap();
        let err = embedding(&table, &bad).unwrap_err().to_string();
        assert!(err.contains("id 50 is out of range for a table of 50 rows"), "{err}");
    }

    #[test]
    fn finite_differences() {
        crate::testutil::fd_check(&[&[6, 4]], |t| embedding(&t[0], &ids()).unwrap());
    }

    #[test]
    fn backward_scatters_into_the_sink() {
        let table = Var::from_tensor(&randn(&[6, 4], 1).to_dtype(DType::F32).unwrap()).unwrap();
        let proj = randn(&[2, 3, 4], 9).to_dtype(DType::F32).unwrap();
        let slot = GradSlot::new();
        let loss = || (embedding_with(&table, &ids(), &slot).unwrap() * &proj).unwrap().sum_all().unwrap();
        let want =
            loss().backward().unwrap().get(&table).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let sink = Arc::new(GradSink::new(24));
        // Stale values in the buffer must not leak into the first write.
        sink.write(|b, _| b.fill(7.0)).unwrap();
        sink.clear();
        let map: Arc<SinkMap> = Arc::new([(table.as_tensor().id(), Arc::clone(&sink))].into_iter().collect());
        slot.bind(&map);
        let store = loss().backward().unwrap();
        assert!(store.get(&table).is_none(), "the gradient went to candle's store");
        assert_eq!(sink.state().buf, want);
        loss().backward().unwrap();
        let worst = sink.state().buf.iter().zip(&want).map(|(g, w)| (g - 2.0 * w).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-5, "second backward added {worst} off");
    }

    /// A lookup holds its rows in the table's sink for the backward, except while sampling (a
    /// weight-cast scope), where no backward follows.
    #[test]
    fn rows_are_held_for_training_not_for_sampling() {
        let table = Var::from_tensor(&randn(&[6, 4], 1).to_dtype(DType::F32).unwrap()).unwrap();
        let (slot, sink) = (GradSlot::new(), Arc::new(GradSink::new(24)));
        let map: Arc<SinkMap> = Arc::new([(table.as_tensor().id(), Arc::clone(&sink))].into_iter().collect());
        slot.bind(&map);
        {
            let _sampling = crate::weight_cast_scope();
            embedding_with(&table, &ids(), &slot).unwrap();
        }
        assert!(sink.state().held.is_none(), "sampling held rows");
        embedding_with(&table, &ids(), &slot).unwrap();
        let held = sink.state().held.clone().map(|(_, rows)| rows);
        assert_eq!(held, Some(vec![true, true, false, true, false, true]));
    }

    #[test]
    fn out_of_range_id_is_an_error() {
        let err = embedding(&randn(&[2, 3], 0), &Tensor::new(&[0u32, 2], &Device::Cpu).unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("id 2 is out of range for a table of 2 rows"), "{err}");
    }
}
