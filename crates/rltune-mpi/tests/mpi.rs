//! The MPI backend under `mpirun -np 2` on localhost: collectives, and the faults of issue #40
//! (a rank that dies, a rank that hangs, a rank with another configuration) end every rank
//! within a bounded time with an error naming the rank. Needs OpenMPI (`mpirun`) and the
//! example built with `--features mpi`; skipped loudly otherwise, required with
//! `RLTUNE_REQUIRE_MPI=1` (CI installs OpenMPI).

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// `target/<profile>/examples/allreduce`, when it was built.
fn example() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let bin = exe.parent()?.parent()?.join("examples/allreduce");
    bin.is_file().then_some(bin)
}

fn mpirun(args: &[&str]) -> Option<(Output, Duration)> {
    let require = std::env::var_os("RLTUNE_REQUIRE_MPI").is_some();
    let (Some(bin), true) = (example(), Command::new("mpirun").arg("--version").output().is_ok()) else {
        assert!(!require, "RLTUNE_REQUIRE_MPI is set but mpirun or the allreduce example is missing");
        eprintln!(
            "SKIPPED: needs OpenMPI (apt-get install openmpi-bin libopenmpi-dev libclang-dev) and \
             `cargo build -p rltune-mpi --features mpi --examples`"
        );
        return None;
    };
    // A session directory of its own for each launch: the four tests run concurrently, and
    // Open MPI's shared one raced ("Directory: /tmp/ompi.vm.0, Error: File exists", then
    // "orte_session_dir failed"; CI on a fresh clone, 2026-12-02).
    static LAUNCH: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = LAUNCH.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let session = std::env::temp_dir().join(format!("rltune-mpi-test-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&session).expect("create the mpirun session directory");
    let start = Instant::now();
    let out = Command::new("mpirun")
        .args(["-np", "2", "--oversubscribe"])
        .arg(bin)
        .args(args)
        .env("OMPI_MCA_orte_tmpdir_base", &session)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .expect("run mpirun");
    let took = start.elapsed();
    let _ = std::fs::remove_dir_all(&session);
    Some((out, took))
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn two_ranks_reduce_broadcast_and_gather() {
    let Some((o, _)) = mpirun(&[]) else { return };
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("rank 0/2: ok") && t.contains("rank 1/2: ok"), "{t}");
}

#[test]
fn a_rank_that_dies_ends_the_job_and_is_named() {
    let Some((o, took)) = mpirun(&["die"]) else { return };
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(took < Duration::from_secs(30), "took {took:?}");
    // mpirun names the process that exited as `Process name: [[JOB,1],RANK]`.
    assert!(t.contains("rank 1") || t.contains(",1],1]"), "the dead rank is named: {t}");
}

#[test]
fn a_rank_that_hangs_ends_the_job_within_the_timeout() {
    let Some((o, took)) = mpirun(&["hang"]) else { return };
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert!(t.contains("rank 0: MPI all-reduce did not complete"), "{t}");
}

#[test]
fn a_rank_with_another_config_is_refused_at_start() {
    let Some((o, took)) = mpirun(&["config"]) else { return };
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert!(t.contains("rank 1 differs from rank 0: the resolved configuration"), "{t}");
}
