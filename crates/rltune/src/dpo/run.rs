//! A DPO run over a dataset: transformers `Trainer`'s epoch loop around [`DpoTrainer::step`].
//!
//! Each epoch shuffles the pairs (a seeded permutation; transformers draws its own with torch's
//! generator, so the order differs from TRL's but not its distribution), cuts them into
//! micro-batches of `per_device_train_batch_size` (the last one shorter) and groups
//! `gradient_accumulation_steps` micro-batches into an optimizer step (the epoch's last step takes
//! the remainder, as transformers' `_inner_training_loop`). The run stops after
//! [`DpoConfig::total_steps`] optimizer steps.

use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::config::DpoConfig;
use super::data::PreferencePair;
use super::trainer::DpoTrainer;
use crate::engine::Stats;
use crate::error::{Error, Result};

/// The optimizer steps of one epoch: indices into the pairs, grouped into micro-batches.
///
/// On several processes ([`crate::dist`]) every process draws the same permutation, cuts it into
/// global micro-batches of `per_device_train_batch_size` × N pairs, and takes its contiguous
/// share of each (so that N processes train on what one process with N times the batch trains
/// on). A last micro-batch that the processes cannot share evenly is left out, as
/// `dataloader_drop_last` would (logged).
pub fn epoch_plan(cfg: &DpoConfig, n_pairs: usize, rng: &mut rand::rngs::StdRng) -> Vec<Vec<Vec<usize>>> {
    let mut perm: Vec<usize> = (0..n_pairs).collect();
    perm.shuffle(rng);
    let (world, rank) = (crate::dist::world_size(), crate::dist::rank());
    let micro: Vec<Vec<usize>> = perm
        .chunks(cfg.per_device_train_batch_size * world)
        .filter_map(|c| {
            if !c.len().is_multiple_of(world) {
                tracing::warn!(
                    "the epoch's last {} pairs cannot be shared evenly by {world} processes: left out; \
                     make the pair count a multiple of per_device_train_batch_size × processes",
                    c.len()
                );
                return None;
            }
            let per = c.len() / world;
            Some(c[rank * per..(rank + 1) * per].to_vec())
        })
        .collect();
    micro.chunks(cfg.gradient_accumulation_steps).map(<[Vec<usize>]>::to_vec).collect()
}

/// The pairs one process's schedule counts: all of them on one process, a share on N (so that
/// `total_steps` and the epochs count global micro-batches of `per_device_train_batch_size` ×
/// N pairs: ⌈⌈n/N⌉/b⌉ = ⌈n/(N·b)⌉).
pub fn pairs_per_process(n_pairs: usize) -> usize {
    n_pairs.div_ceil(crate::dist::world_size())
}

/// Trains on `pairs` for the run's optimizer steps; `on_step(step, total, stats)` is called after
/// each (from 1). Returns the steps taken.
pub fn train(
    trainer: &mut DpoTrainer,
    pairs: &[PreferencePair],
    on_step: &mut dyn FnMut(usize, usize, &Stats) -> Result<()>,
) -> Result<usize> {
    if pairs.is_empty() {
        return Err(Error::Input("no preference pair to train on".into()));
    }
    let cfg = trainer.config.clone();
    let total = cfg.total_steps(pairs_per_process(pairs.len()));
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed);
    let mut step = 0;
    while step < total {
        for group in epoch_plan(&cfg, pairs.len(), &mut rng) {
            if step == total {
                break;
            }
            let micro: Vec<Vec<&PreferencePair>> =
                group.iter().map(|mb| mb.iter().map(|&i| &pairs[i]).collect()).collect();
            let stats = trainer.step(&micro)?;
            step += 1;
            on_step(step, total, &stats)?;
        }
    }
    Ok(step)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_cover_every_pair_once_in_steps_of_micro_batches() {
        let cfg = DpoConfig {
            per_device_train_batch_size: 2,
            gradient_accumulation_steps: 2,
            ..Default::default()
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let plan = epoch_plan(&cfg, 5, &mut rng);
        // 3 micro-batches (2, 2, 1): a step of two, then the remainder.
        assert_eq!(plan.iter().map(Vec::len).collect::<Vec<_>>(), vec![2, 1]);
        let mut seen: Vec<usize> = plan.iter().flatten().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, vec![0, 1, 2, 3, 4]);
        assert_eq!(cfg.total_steps(5), 3 * plan.len());
    }
}
