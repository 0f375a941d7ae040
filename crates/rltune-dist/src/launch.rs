//! Which launcher started this process, and its rank, world size and local rank.

use std::collections::HashMap;

use crate::{Error, Result};

/// The launcher whose variables were found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// No launcher: one process.
    None,
    /// OpenMPI's `mpirun` (`OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`).
    OpenMpi,
    /// MPICH's Hydra (`PMI_RANK`, `PMI_SIZE`; `MPI_LOCALRANKID`).
    Mpich,
    /// Slurm's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`).
    Slurm,
    /// The PyTorch convention (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
    /// `MASTER_PORT`), as torchrun and the Kubernetes training operators set it.
    Torchrun,
}

/// Where this process stands in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// Who set the variables.
    pub launcher: Launcher,
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// The number of processes.
    pub world_size: usize,
    /// The rank among the processes of this machine: the GPU a rank uses (one GPU per rank).
    pub local_rank: usize,
    /// `MASTER_ADDR:MASTER_PORT`, with [`Launcher::Torchrun`].
    pub master: Option<String>,
}

impl Launch {
    /// One process, no launcher.
    pub fn single() -> Self {
        Self { launcher: Launcher::None, rank: 0, world_size: 1, local_rank: 0, master: None }
    }

    /// Reads the launcher's variables from `vars`, in the order OpenMPI, MPICH, Slurm, PyTorch
    /// (an MPI launcher under Slurm sets both: MPI's are the ones its collectives follow).
    /// Without any, one process. A malformed or inconsistent value is an error naming it.
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<Self> {
        Self::from_lookup(|k| vars.get(k).cloned())
    }

    /// [`Self::from_vars`] through a lookup of one variable at a time.
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let kinds: [(Launcher, &str, &str, &[&str]); 4] = [
            (
                Launcher::OpenMpi,
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                &["OMPI_COMM_WORLD_LOCAL_RANK"],
            ),
            (Launcher::Mpich, "PMI_RANK", "PMI_SIZE", &["MPI_LOCALRANKID", "PMI_LOCAL_RANK"]),
            (Launcher::Slurm, "SLURM_PROCID", "SLURM_NTASKS", &["SLURM_LOCALID"]),
            (Launcher::Torchrun, "RANK", "WORLD_SIZE", &["LOCAL_RANK"]),
        ];
        for (launcher, rank_var, size_var, local_vars) in kinds {
            let Some(rank) = var(rank_var) else { continue };
            let rank = number(rank_var, &rank)?;
            let size_text = var(size_var).ok_or_else(|| Error::Env {
                var: size_var.into(),
                msg: format!("{rank_var} is set but {size_var} is not: set both, or neither for one process"),
            })?;
            let world_size = number(size_var, &size_text)?;
            if world_size == 0 || rank >= world_size {
                return Err(Error::Env {
                    var: rank_var.into(),
                    msg: format!("rank {rank} is not below the world size {world_size} ({size_var})"),
                });
            }
            let local_rank = match local_vars.iter().find_map(|v| var(v).map(|t| (v, t))) {
                Some((v, t)) => number(v, &t)?,
                None => rank, // one machine
            };
            let master = match launcher {
                Launcher::Torchrun if world_size > 1 => {
                    let get = |v: &str| {
                        var(v).ok_or_else(|| Error::Env {
                            var: v.into(),
                            msg:
                                "torchrun-style launches set MASTER_ADDR and MASTER_PORT: set it to rank 0's \
                                  address and a free port"
                                    .into(),
                        })
                    };
                    Some(format!("{}:{}", get("MASTER_ADDR")?, get("MASTER_PORT")?))
                }
                _ => None,
            };
            return Ok(Self { launcher, rank, world_size, local_rank, master });
        }
        Ok(Self::single())
    }
}

fn number(var: &str, text: &str) -> Result<usize> {
    text.trim().parse().map_err(|_| Error::Env {
        var: var.into(),
        msg: format!("{text:?} is not a whole number; unset it, or set it to the process's number"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn each_launcher_is_read() {
        assert_eq!(Launch::from_vars(&vars(&[])).unwrap(), Launch::single());
        let l = Launch::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
        ]))
        .unwrap();
        assert_eq!((l.launcher, l.rank, l.world_size, l.local_rank), (Launcher::OpenMpi, 3, 4, 1));
        let l = Launch::from_vars(&vars(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")])).unwrap();
        assert_eq!((l.launcher, l.rank, l.local_rank), (Launcher::Mpich, 1, 1));
        let l =
            Launch::from_vars(&vars(&[("SLURM_PROCID", "5"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "1")]))
                .unwrap();
        assert_eq!((l.launcher, l.rank, l.local_rank), (Launcher::Slurm, 5, 1));
        let l = Launch::from_vars(&vars(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
        assert_eq!((l.launcher, l.rank, l.local_rank), (Launcher::Torchrun, 1, 0));
        assert_eq!(l.master.as_deref(), Some("10.0.0.1:29500"));
    }

    #[test]
    fn bad_values_name_the_variable() {
        let err = |p: &[(&str, &str)]| Launch::from_vars(&vars(p)).unwrap_err().to_string();
        assert!(err(&[("RANK", "x"), ("WORLD_SIZE", "2")]).starts_with("RANK: \"x\" is not a whole number"));
        assert!(err(&[("RANK", "2"), ("WORLD_SIZE", "2")]).contains("not below the world size 2"));
        assert!(err(&[("PMI_RANK", "0")]).starts_with("PMI_SIZE: PMI_RANK is set but PMI_SIZE is not"));
        assert!(err(&[("RANK", "0"), ("WORLD_SIZE", "2")]).starts_with("MASTER_ADDR:"));
    }
}
