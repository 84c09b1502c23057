//! The NCCL communicator (feature `native-nccl`). Without CUDA (CI, this VM) the checks that need
//! a GPU report "skipped: no CUDA device" and the rest checks that a missing driver or NCCL is an
//! error that says what to install, never a panic. On a GPU machine (`scripts/gpu-check.sh`): every
//! collective forward and backward on NCCL equals the in-process group, and with two or more GPUs a
//! mismatched call fails on both ranks instead of hanging.
#![cfg(feature = "native-nccl")]

use std::time::Duration;

use distgrad::backend::Device;
use distgrad::nccl::{NcclComm, NcclOptions, check_libraries, device_count};
use distgrad::rendezvous::LaunchEnv;
use distgrad::{CommOptions, Communicator, ReduceOp, Tape, Tensor, dist};

fn gpus() -> Result<usize, String> {
    match device_count() {
        Ok(0) => Err("no CUDA device".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("no CUDA device ({e})")),
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn env(rank: usize, world: usize, port: u16) -> LaunchEnv {
    LaunchEnv {
        rank,
        world,
        local_rank: rank,
        master: format!("127.0.0.1:{port}"),
    }
}

#[test]
fn a_missing_driver_or_nccl_is_an_error_not_a_panic() {
    match check_libraries() {
        Ok(()) => eprintln!("libcuda and libnccl present"),
        Err(e) => {
            let m = e.to_string();
            assert!(m.contains("libcuda") || m.contains("libnccl"), "{m}");
            // Building a communicator fails the same way, with the fix in the message.
            let r = std::panic::catch_unwind(|| {
                NcclComm::from_launch(&env(0, 1, free_port()), NcclOptions::default()).err()
            });
            let err = r
                .expect("no panic")
                .expect("an error without CUDA")
                .to_string();
            assert!(err.contains("libcuda") || err.contains("libnccl"), "{err}");
            eprintln!("as expected without CUDA: {err}");
        }
    }
}

/// Every collective forward + backward with fixed inputs; returns each output and gradient.
async fn program<C: Communicator>(comm: &C) -> distgrad::Result<Vec<Vec<f32>>> {
    let g = comm.world();
    let n = comm.world_size();
    let r = comm.rank() as f32;
    let mut out = Vec::new();
    let x0 = Tensor::from_vec(vec![r + 1.0, -2.0 * r - 0.5, 3.0], &[3])?;
    for op in ReduceOp::ALL {
        let tape = Tape::new();
        let x = tape.var(x0.clone());
        let y = dist::all_reduce(comm, &x, op, &g).await?;
        let gr = tape.backward(&y.mul(&y)?.sum()?, comm).await?;
        out.push(y.value().to_vec());
        out.push(gr.wrt(&x)?.to_vec());
    }
    let tape = Tape::new();
    let x = tape.var(x0.clone());
    let b = dist::broadcast(comm, &x, n - 1, &g).await?;
    let parts = dist::all_gather(comm, &b, &g).await?;
    let cat = distgrad::Var::concat(&parts, 0)?;
    let rs = dist::reduce_scatter(comm, &parts, ReduceOp::Sum, &g).await?;
    let a2a = dist::all_to_all(comm, &parts, &g).await?;
    let perm: Vec<(usize, usize)> = (0..n).map(|i| (i, (i + 1) % n)).collect();
    let p = dist::permute(comm, &rs, &perm, &g).await?;
    let red = dist::reduce(comm, &p, 0, ReduceOp::Max, &g).await?;
    let gat = dist::gather(comm, &a2a[0], 0, &g).await?;
    let mut loss = cat.square()?.sum()?.add(&p.sum()?)?;
    for v in red.into_iter().chain(gat.unwrap_or_default()) {
        loss = loss.add(&v.square()?.sum()?)?;
    }
    let gr = tape.backward(&loss, comm).await?;
    out.push(cat.value().to_vec());
    out.push(p.value().to_vec());
    out.push(gr.wrt(&x)?.to_vec());
    Ok(out)
}

#[test]
fn gradients_on_nccl_equal_the_in_process_group() {
    let n = match gpus() {
        Ok(n) => n,
        Err(why) => return eprintln!("skipped: {why}"),
    };
    // One process drives one GPU; ranks as threads here, one GPU each (world 1 on a single GPU).
    let world = n.min(4);
    let want = distgrad::run_local(world, CommOptions::default(), |c| async move {
        program(&c).await
    });
    let port = free_port();
    let got: Vec<distgrad::Result<Vec<Vec<f32>>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                s.spawn(move || {
                    let comm = NcclComm::from_launch(&env(r, world, port), NcclOptions::default())?;
                    futures::executor::block_on(program(&comm))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, (g, w)) in got.into_iter().zip(want).enumerate() {
        let (g, w) = (g.unwrap(), w.unwrap());
        assert_eq!(g.len(), w.len());
        for (i, (a, b)) in g.iter().zip(&w).enumerate() {
            assert_eq!(a.len(), b.len(), "rank {r} value {i}");
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x - y).abs() <= 1e-5 * y.abs().max(1.0),
                    "rank {r} value {i}: {a:?} vs {b:?}"
                );
            }
        }
    }
    eprintln!("NCCL == in-process on {world} GPU rank(s)");
}

#[test]
fn a_mismatched_call_fails_on_both_ranks() {
    match gpus() {
        Ok(n) if n >= 2 => {}
        Ok(n) => return eprintln!("skipped: needs 2 CUDA devices, found {n}"),
        Err(why) => return eprintln!("skipped: {why}"),
    }
    let port = free_port();
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                s.spawn(move || {
                    let comm = NcclComm::from_launch(
                        &env(r, 2, port),
                        NcclOptions {
                            rendezvous_timeout: Duration::from_secs(60),
                            ..NcclOptions::default()
                        },
                    )
                    .unwrap();
                    let x = Tensor::vector(&[1.0, 2.0]);
                    let g = comm.world();
                    let r = if r == 0 {
                        futures::executor::block_on(comm.all_reduce(&x, ReduceOp::Sum, &g))
                    } else {
                        futures::executor::block_on(comm.broadcast(&x, 0, &g))
                    };
                    r.unwrap_err().to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errs {
        assert!(e.contains("all_reduce") && e.contains("broadcast"), "{e}");
    }
    let _ = Device::Cpu;
}

#[test]
fn the_program_compared_on_nccl_runs_in_process_on_1_to_4_ranks() {
    // The reference side of the GPU comparison, checked everywhere so that a GPU failure is NCCL's.
    for world in 1..=4 {
        for r in distgrad::run_local(world, CommOptions::default(), |c| async move {
            program(&c).await
        }) {
            let v = r.unwrap();
            assert_eq!(v.len(), 2 * ReduceOp::ALL.len() + 3);
        }
    }
}
