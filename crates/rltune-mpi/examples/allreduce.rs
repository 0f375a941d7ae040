//! `mpirun -np N target/debug/examples/allreduce [MODE]`: the MPI backend end to end, for
//! `tests/mpi.rs`. Each rank contributes `rank + 1` to every value and checks the sums, means,
//! broadcast and gathers; MODE `die` makes rank 1 exit before the all-reduce, `hang` makes it
//! sleep, `config` gives it another configuration fingerprint.

use std::time::Duration;

use rltune_dist::{all_reduce_buckets, Collective, Launch, ReduceOp};
use rltune_mpi::Mpi;

fn main() {
    let mode = std::env::args().nth(1).unwrap_or_default();
    let launch = Launch::from_lookup(|k| std::env::var(k).ok()).expect("launcher variables");
    let mut comm = Mpi::init(Duration::from_secs(5)).expect("MPI");
    let (rank, n) = (comm.rank(), comm.world_size());
    assert_eq!((launch.rank, launch.world_size), (rank, n), "launcher variables agree with MPI");
    let fingerprint = if mode == "config" && rank == 1 { 2 } else { 1 };
    if let Err(e) = comm.check_same(fingerprint, "the resolved configuration") {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
    match (mode.as_str(), rank) {
        ("die", 1) => std::process::exit(1),
        ("hang", 1) => std::thread::sleep(Duration::from_secs(3600)),
        _ => {}
    }
    let mut a = vec![(rank + 1) as f32; 5];
    let mut b = vec![2.0 * (rank + 1) as f32; 3];
    let mut views = vec![a.as_mut_slice(), b.as_mut_slice()];
    all_reduce_buckets(&mut comm, &mut views, ReduceOp::Sum, 4).expect("all-reduce");
    let total = (n * (n + 1) / 2) as f32;
    assert_eq!((a[0], b[2]), (total, 2.0 * total));
    let mut m = vec![(rank + 1) as f32];
    comm.all_reduce_f32(&mut m, ReduceOp::Mean).expect("mean");
    assert_eq!(m[0], total / n as f32);
    let mut bytes = if rank == 0 { *b"rank0" } else { [0u8; 5] };
    comm.broadcast_bytes(&mut bytes).expect("broadcast");
    assert_eq!(&bytes, b"rank0");
    comm.barrier().expect("barrier");
    println!("rank {rank}/{n}: ok");
}
