//! The NCCL communicator (feature `native-nccl`). Without CUDA (CI, this VM) the checks that need
//! a GPU report "skipped: no CUDA device" and the rest checks that a missing driver or NCCL is an
//! error that says what to install, never a panic. On a GPU machine (`scripts/gpu-check.sh`): every
//! collective forward and backward on NCCL equals the in-process group, on host tensors (staging)
//! and on wgpu tensors through shared Vulkan/CUDA memory (no host copy inside the collectives), and
//! with two or more GPUs a mismatched call fails on both ranks instead of hanging.
#![cfg(feature = "native-nccl")]

use std::time::Duration;

use distgrad::backend::Device;
use distgrad::nccl::{DataPath, NcclComm, NcclOptions, check_libraries, device_count};
use distgrad::rendezvous::LaunchEnv;
use distgrad::{CommOptions, Communicator, ReduceOp, Tape, Tensor, dist};

fn gpus() -> Result<usize, String> {
    match device_count() {
        Ok(0) => Err("no CUDA device".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("no CUDA device ({e})")),
    }
}

/// Whether wgpu finds a Vulkan adapter (the shared data path needs the loader and the GPU's driver).
fn vulkan() -> Result<(), String> {
    futures::executor::block_on(distgrad::backend::gpu::Gpu::new())
        .map(|_| ())
        .map_err(|e| format!("the shared data path needs Vulkan: {e}"))
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
        secret: Some("nccl-test-secret".into()),
        served: false,
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

/// Every collective forward + backward with fixed inputs (every reduce op of all_reduce; broadcast,
/// all_gather, reduce_scatter, all_to_all, permute, reduce MAX, gather, scatter and
/// all_to_all_single, roots ≠ 0 where the world allows); returns each output and gradient.
/// The inputs live on `dev`.
async fn program<C: Communicator>(comm: &C, dev: &Device) -> distgrad::Result<Vec<Vec<f32>>> {
    let g = comm.world();
    let n = comm.world_size();
    let r = comm.rank() as f32;
    let mut out = Vec::new();
    let x0 = Tensor::from_vec(vec![r + 1.0, -2.0 * r - 0.5, 3.0], &[3])?.to_device(dev)?;
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
    let root_parts = (comm.rank() == n - 1).then_some(&parts[..]);
    let sc = dist::scatter(comm, x.tape(), root_parts, n - 1, &g).await?;
    let single = dist::all_to_all_single(comm, &cat, &vec![3; n], &vec![3; n], &g).await?;
    let mut loss = cat.square()?.sum()?.add(&p.sum()?)?;
    loss = loss
        .add(&sc.mul(&sc)?.sum()?)?
        .add(&single.square()?.sum()?)?;
    for v in red.into_iter().chain(gat.unwrap_or_default()) {
        loss = loss.add(&v.square()?.sum()?)?;
    }
    let gr = tape.backward(&loss, comm).await?;
    out.push(cat.value().to_vec());
    out.push(p.value().to_vec());
    out.push(sc.value().to_vec());
    out.push(single.value().to_vec());
    out.push(gr.wrt(&x)?.to_vec());
    Ok(out)
}

/// Every collective forward + backward on NCCL with `path` (inputs on the communicator's device
/// for the shared path) against the in-process group.
fn compare_with_in_process(path: DataPath) {
    let n = match gpus() {
        Ok(n) => n,
        Err(why) => return eprintln!("skipped: {why}"),
    };
    if path == DataPath::Shared
        && let Err(why) = vulkan()
    {
        return eprintln!("skipped: {why}");
    }
    // One process drives one GPU; ranks as threads here, one GPU each (world 1 on a single GPU).
    let world = n.min(4);
    let want = distgrad::run_local(world, CommOptions::default(), |c| async move {
        program(&c, &Device::Cpu).await
    });
    let port = free_port();
    let got: Vec<distgrad::Result<Vec<Vec<f32>>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                s.spawn(move || {
                    let opts = NcclOptions {
                        data_path: path,
                        ..NcclOptions::default()
                    };
                    let comm = NcclComm::from_launch(&env(r, world, port), opts)?;
                    let dev = comm.device();
                    futures::executor::block_on(program(&comm, &dev))
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
    eprintln!("NCCL ({path:?}) == in-process on {world} GPU rank(s)");
}

#[test]
fn gradients_on_nccl_equal_the_in_process_group() {
    compare_with_in_process(DataPath::Staging);
}

#[test]
fn gradients_on_the_shared_data_path_equal_the_in_process_group() {
    compare_with_in_process(DataPath::Shared);
}

#[test]
fn shared_collectives_keep_gpu_tensors_on_the_gpu() {
    if let Err(why) = gpus().and_then(|_| vulkan()) {
        return eprintln!("skipped: {why}");
    }
    let port = free_port();
    let opts = NcclOptions {
        data_path: DataPath::Shared,
        ..NcclOptions::default()
    };
    let comm = NcclComm::from_launch(&env(0, 1, port), opts).unwrap();
    let Device::Gpu(gpu) = comm.device() else {
        panic!("the shared data path gave {:?}", comm.device());
    };
    let g = comm.world();
    for n in [1usize, 1000, (1 << 22) + 3] {
        let x: Vec<f32> = (0..n).map(|i| (i % 97) as f32 - 48.0).collect();
        // Without the host copy an upload keeps: reading the tensor back would show in the count.
        let t = Tensor::from_vec(x.clone(), &[n])
            .unwrap()
            .to_device(&comm.device())
            .unwrap()
            .without_host_copy();
        let before = gpu.bytes_read_back();
        let y = futures::executor::block_on(comm.all_reduce(&t, ReduceOp::Max, &g)).unwrap();
        let parts = futures::executor::block_on(comm.all_gather(&t, &g)).unwrap();
        let b = futures::executor::block_on(comm.broadcast(&t, 0, &g)).unwrap();
        assert_eq!(
            gpu.bytes_read_back(),
            before,
            "{n}: a collective read the tensor back to the host"
        );
        for (what, v) in [
            ("all_reduce", &y),
            ("all_gather", &parts[0]),
            ("broadcast", &b),
        ] {
            assert_eq!(v.device(), comm.device(), "{what} left the GPU");
            assert_eq!(v.to_vec(), x, "{what} of {n} on one rank is the identity");
        }
    }
    eprintln!("shared path: results stay on {}", gpu.describe());
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
            program(&c, &Device::Cpu).await
        }) {
            let v = r.unwrap();
            assert_eq!(v.len(), 2 * ReduceOp::ALL.len() + 5);
        }
    }
}

/// Bad calls on one GPU are clear errors, raised before anything reaches NCCL, and the
/// communicator stays usable after them.
#[test]
fn bad_calls_are_errors_and_the_communicator_goes_on() {
    if let Err(why) = gpus() {
        return eprintln!("skipped: {why}");
    }
    let comm = NcclComm::from_launch(&env(0, 1, free_port()), NcclOptions::default()).unwrap();
    let g = comm.world();
    let x = Tensor::vector(&[1.0, 2.0, 3.0]);
    let root = futures::executor::block_on(comm.broadcast(&x, 1, &g))
        .unwrap_err()
        .to_string();
    assert!(root.contains("root 1 is not a rank"), "{root}");
    let parts = futures::executor::block_on(comm.all_to_all(&[x.clone(), x.clone()], &g))
        .unwrap_err()
        .to_string();
    assert!(
        parts.contains("one tensor per group rank (1), got 2"),
        "{parts}"
    );
    let splits = futures::executor::block_on(comm.all_to_all_single(&x, &[2], &[3], &g))
        .unwrap_err()
        .to_string();
    assert!(splits.contains("in_splits [2]"), "{splits}");
    let y = futures::executor::block_on(comm.all_reduce(&x, ReduceOp::Sum, &g)).unwrap();
    assert_eq!(y.to_vec(), vec![1.0, 2.0, 3.0]);
    eprintln!("NCCL bad calls: {root} | {parts} | {splits}");
}
