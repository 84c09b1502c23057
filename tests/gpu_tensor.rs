//! Tensors living on the GPU: every tensor op against the CPU backend, and whole gradient programs
//! (local ops + collectives + backward) run with GPU tensors equal to the same program on the CPU.
//! Bit-exact where the kernels promise it (elementwise, reduce, copies), within tolerance for sums,
//! matmul and tanh. Skips (with a message) without an adapter unless DISTGRAD_REQUIRE_GPU=1.
#![cfg(feature = "wgpu")]

use distgrad::backend::Device;
use distgrad::{
    AllReduceAlgo, CommOptions, Communicator, ReduceOp, Tape, Tensor, Var, dist, run_local,
};

mod common_gpu;

fn gpu() -> Option<Device> {
    common_gpu::gpu().map(|g| Device::Gpu(g.clone()))
}

fn vals(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0 + 1e-3
        })
        .collect()
}

fn t(seed: u64, shape: &[usize]) -> Tensor {
    Tensor::from_vec(vals(seed, shape.iter().product()), shape).unwrap()
}

/// The bits of `t`'s values as its device holds them (a GPU tensor's buffer, not its host copy).
fn bits(t: &Tensor) -> Vec<u32> {
    t.without_host_copy()
        .to_vec()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// `x` on `d` as a GPU op's result would be: no host copy, so sending it needs a readback.
fn computed(x: Tensor, d: &Device) -> distgrad::Result<Tensor> {
    Ok(x.to_device(d)?.without_host_copy())
}

fn close(a: &Tensor, b: &Tensor, tol: f32, what: &str) {
    assert_eq!(a.shape(), b.shape(), "{what}: shapes");
    let (a, b) = (a.without_host_copy(), b.without_host_copy());
    for (i, (x, y)) in a.to_vec().iter().zip(b.to_vec()).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "{what} at {i}: {x} vs {y}"
        );
    }
}

#[test]
fn tensor_ops_on_the_gpu_match_the_cpu() {
    let Some(d) = gpu() else { return };
    let on = |x: &Tensor| x.to_device(&d).unwrap();
    let (a, b, c) = (t(1, &[3, 4]), t(2, &[4]), t(3, &[3, 1]));
    assert!(matches!(on(&a).device(), Device::Gpu(_)));
    // exact: elementwise with broadcasting, unary, reshape, slice, concat, transpose
    assert_eq!(
        bits(&on(&a).add(&on(&b)).unwrap()),
        bits(&a.add(&b).unwrap())
    );
    assert_eq!(
        bits(&on(&a).mul(&on(&c)).unwrap()),
        bits(&a.mul(&c).unwrap())
    );
    assert_eq!(
        bits(&on(&a).scale(-1.5).unwrap()),
        bits(&a.scale(-1.5).unwrap())
    );
    assert_eq!(
        bits(&on(&a).slice(1, 1, 2).unwrap()),
        bits(&a.slice(1, 1, 2).unwrap())
    );
    assert_eq!(bits(&on(&a).t().unwrap()), bits(&a.t().unwrap()));
    assert_eq!(
        bits(&on(&a).reshape(&[2, 6]).unwrap()),
        bits(&a.reshape(&[2, 6]).unwrap())
    );
    let cat_gpu = Tensor::concat(&[on(&a), on(&c)], 1).unwrap();
    assert_eq!(
        bits(&cat_gpu),
        bits(&Tensor::concat(&[a.clone(), c.clone()], 1).unwrap())
    );
    let others_gpu = Tensor::product_of_others(&[
        on(&a),
        on(&a.scale(2.0).unwrap()),
        on(&a.scale(-1.0).unwrap()),
    ])
    .unwrap();
    let others_cpu =
        Tensor::product_of_others(&[a.clone(), a.scale(2.0).unwrap(), a.scale(-1.0).unwrap()])
            .unwrap();
    for (g, c) in others_gpu.iter().zip(&others_cpu) {
        assert_eq!(bits(g), bits(c), "product of others");
    }
    // within tolerance: sums (the kernels: inputs already on the device) and matmul
    let ga = computed(a.clone(), &d).unwrap();
    close(
        &ga.sum_all().unwrap(),
        &a.sum_all().unwrap(),
        1e-5,
        "sum_all",
    );
    close(
        &ga.sum_to(&[4]).unwrap(),
        &a.sum_to(&[4]).unwrap(),
        1e-5,
        "sum_to",
    );
    assert!(!ga.sum_all().unwrap().has_host_copy(), "a kernel's result");
    let m = t(4, &[4, 5]);
    close(
        &on(&a).matmul(&on(&m)).unwrap(),
        &a.matmul(&m).unwrap(),
        1e-5,
        "matmul",
    );
    // mixing devices is an error, not a silent copy
    let e = on(&a).add(&b).unwrap_err().to_string();
    assert!(e.contains("different backends"), "{e}");
    // and back to the host
    assert_eq!(bits(&on(&a).to_device(&Device::Cpu).unwrap()), bits(&a));
}

/// A data-parallel step with every collective kind the gradients need: returns each rank's
/// (loss, gradients) as host vectors.
fn program(device: Option<Device>, op: ReduceOp) -> Vec<(Vec<f32>, Vec<Vec<f32>>)> {
    let res = run_local(3, CommOptions::default(), |comm| {
        let device = device.clone();
        async move {
            let dev = device.unwrap_or(Device::Cpu);
            let r = comm.rank() as u64;
            let tape = Tape::new();
            let w1 = tape.var(t(10, &[4, 6]).to_device(&dev)?);
            let w2 = tape.var(t(11, &[6, 2]).to_device(&dev)?);
            let x = tape.constant(t(20 + r, &[5, 4]).to_device(&dev)?);
            let g = comm.world();
            let h = x.matmul(&w1)?.tanh()?;
            let y = h.matmul(&w2)?;
            // all_gather + reduce_scatter (tensor-parallel style), then the reduce op under test
            let parts = dist::all_gather(&comm, &y.slice(0, 0, 3)?, &g).await?;
            let z = dist::reduce_scatter(&comm, &parts, ReduceOp::Sum, &g).await?;
            let m = dist::all_reduce(&comm, &z.relu()?, op, &g).await?;
            let b = dist::broadcast(&comm, &m, 2, &g).await?;
            let loss = b.mul(&y.slice(0, 1, 3)?)?.mean()?;
            let grads = tape.backward(&loss, &comm).await?;
            Ok((
                loss.value().without_host_copy().try_to_vec()?,
                vec![
                    grads.wrt(&w1)?.without_host_copy().try_to_vec()?,
                    grads.wrt(&w2)?.without_host_copy().try_to_vec()?,
                ],
            ))
        }
    });
    res.into_iter().map(|r| r.unwrap()).collect()
}

#[test]
fn gradient_programs_on_the_gpu_match_the_cpu() {
    let Some(d) = gpu() else { return };
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Prod] {
        let cpu = program(None, op);
        let gpu = program(Some(d.clone()), op);
        for (r, ((lc, gc), (lg, gg))) in cpu.iter().zip(&gpu).enumerate() {
            let tol = |a: &[f32], b: &[f32], what: &str| {
                for (i, (x, y)) in a.iter().zip(b).enumerate() {
                    assert!(
                        (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                        "{op:?} rank {r} {what}[{i}]: gpu {x} vs cpu {y}"
                    );
                }
            };
            tol(lg, lc, "loss");
            tol(&gg[0], &gc[0], "grad w1");
            tol(&gg[1], &gc[1], "grad w2");
        }
    }
}

#[test]
fn gradients_stay_on_the_gpu() {
    let Some(d) = gpu() else { return };
    let res = run_local(2, CommOptions::default(), |comm| {
        let d = d.clone();
        async move {
            let tape = Tape::new();
            let x: Var = tape.var(Tensor::vector(&[1.0, 2.0]).to_device(&d)?);
            let y = dist::all_reduce(&comm, &x, ReduceOp::Sum, &comm.world()).await?;
            let g = tape.backward(&y.sum()?, &comm).await?.wrt(&x)?;
            Ok(matches!(g.device(), Device::Gpu(_))
                && g.without_host_copy().to_vec() == vec![2.0, 2.0])
        }
    });
    for r in res {
        assert!(
            r.unwrap(),
            "gradient of a GPU var must be a GPU tensor with the right values"
        );
    }
}

/// A GPU tensor's large all_reduce (ring, pairwise and shared) folds the received chunks into the
/// accumulator on the GPU (WGSL reduce-into, AVG's scale too): bitwise the CPU result of the same
/// algorithm, identical on every rank, for every op, odd worlds, chunks that are not multiples of
/// the workgroup or of 4, several ring segments, and chunks large enough to travel as split
/// messages.
#[test]
fn ring_all_reduce_local_steps_on_the_gpu_are_bit_exact() {
    let Some(dev) = gpu() else { return };
    for algo in [
        AllReduceAlgo::Ring,
        AllReduceAlgo::Pairwise,
        AllReduceAlgo::Shared,
    ] {
        for world in [2, 3, 5] {
            for op in ReduceOp::ALL {
                for numel in [world, 1003, 20_001] {
                    let run = |d: Device| -> Vec<Vec<u32>> {
                        let opts = CommOptions {
                            ring_threshold: 0,
                            segment_bytes: 4096,
                            all_reduce: algo,
                            device: d.clone(),
                            ..CommOptions::default()
                        };
                        run_local(world, opts, |comm| {
                            let d = d.clone();
                            async move {
                                let x = t(comm.rank() as u64 + 7, &[numel]).to_device(&d)?;
                                let y = comm.all_reduce(&x, op, &comm.world()).await?;
                                assert_eq!(
                                    y.device().name(),
                                    d.name(),
                                    "result stays on the device"
                                );
                                let v = y.without_host_copy().read().await?;
                                Ok(v.iter().map(|v| v.to_bits()).collect())
                            }
                        })
                        .into_iter()
                        .map(Result::unwrap)
                        .collect()
                    };
                    let (c, g) = (run(Device::Cpu), run(dev.clone()));
                    for r in 0..world {
                        assert_eq!(
                            g[r], c[r],
                            "{algo:?} world {world} {op:?} numel {numel} rank {r}"
                        );
                        assert_eq!(g[r], g[0], "ranks differ");
                    }
                }
            }
        }
    }
}

/// reduce_scatter's ring on GPU tensors: local steps on the GPU, the result left there, bitwise
/// the CPU ring's; the inputs are not modified.
#[test]
fn ring_reduce_scatter_local_steps_on_the_gpu_are_bit_exact() {
    let Some(dev) = gpu() else { return };
    for world in [2, 3, 5] {
        for op in ReduceOp::ALL {
            for shape in [&[1usize][..], &[7, 3], &[1001]] {
                let run = |d: Device| -> Vec<Vec<u32>> {
                    let opts = CommOptions {
                        ring_threshold: 0,
                        device: d.clone(),
                        ..CommOptions::default()
                    };
                    run_local(world, opts, |comm| {
                        let d = d.clone();
                        async move {
                            let r = comm.rank() as u64;
                            let xs = (0..world as u64)
                                .map(|j| t(100 * r + j, shape).to_device(&d))
                                .collect::<distgrad::Result<Vec<_>>>()?;
                            let before: Vec<Vec<f32>> = xs.iter().map(Tensor::to_vec).collect();
                            let y = comm.reduce_scatter(&xs, op, &comm.world()).await?;
                            assert_eq!(y.device().name(), d.name(), "result stays on the device");
                            assert_eq!(y.shape(), shape);
                            let after: Vec<Vec<f32>> = xs.iter().map(Tensor::to_vec).collect();
                            assert_eq!(before, after, "inputs unchanged");
                            Ok(bits(&y))
                        }
                    })
                    .into_iter()
                    .map(Result::unwrap)
                    .collect()
                };
                let (c, g) = (run(Device::Cpu), run(dev.clone()));
                assert_eq!(g, c, "world {world} {op:?} shape {shape:?}");
            }
        }
    }
}

/// reduce (binomial tree) on GPU tensors: children's contributions folded in on the GPU, the
/// root's result left there; bitwise the CPU tree's, for every op, worlds 1..6 and every root.
#[test]
fn tree_reduce_local_steps_on_the_gpu_are_bit_exact() {
    let Some(dev) = gpu() else { return };
    for world in 1..=6 {
        for op in ReduceOp::ALL {
            for root in 0..world {
                let run = |d: Device| -> Vec<Option<Vec<u32>>> {
                    let opts = CommOptions {
                        device: d.clone(),
                        ..CommOptions::default()
                    };
                    run_local(world, opts, |comm| {
                        let d = d.clone();
                        async move {
                            let x = t(comm.rank() as u64 + 11, &[5, 3]).to_device(&d)?;
                            let y = comm.reduce(&x, root, op, &comm.world()).await?;
                            assert_eq!(y.is_some(), comm.rank() == root);
                            Ok(y.map(|y| {
                                assert_eq!(y.device().name(), d.name());
                                bits(&y)
                            }))
                        }
                    })
                    .into_iter()
                    .map(Result::unwrap)
                    .collect()
                };
                assert_eq!(
                    run(dev.clone()),
                    run(Device::Cpu),
                    "world {world} {op:?} root {root}"
                );
            }
        }
    }
}

/// The collectives of [`collectives_read_back_only_what_they_send`].
#[derive(Clone, Copy, Debug)]
enum Coll {
    Broadcast,
    Gather,
    Scatter,
    AllGather,
    AllToAll,
    Permute,
}

/// Run `c` on this rank with its list of inputs; every output as a list.
async fn run_coll<C: Communicator>(
    comm: &C,
    c: Coll,
    x: Vec<Tensor>,
) -> distgrad::Result<Vec<Tensor>> {
    let g = comm.world();
    Ok(match c {
        Coll::Broadcast => vec![comm.broadcast(&x[0], 1, &g).await?],
        Coll::Gather => comm.gather(&x[0], 2, &g).await?.unwrap_or_default(),
        Coll::Scatter => {
            let l = (comm.rank() == 0).then_some(&x[..]);
            vec![comm.scatter(l, 0, &g).await?]
        }
        Coll::AllGather => comm.all_gather(&x[0], &g).await?,
        Coll::AllToAll => comm.all_to_all(&x, &g).await?,
        Coll::Permute => vec![comm.permute(&x[0], &[(0, 1), (1, 2)], &g).await?],
    })
}

/// GPU tensors computed on the GPU (no host copy) leave it only at the transport boundary: each
/// collective reads back exactly the bytes its rank sends (counted by the device), a rank's own
/// part of a result is its input,
/// received parts are uploaded, and the results equal the CPU's. World 4, `B` bytes per tensor:
/// broadcast from 1 reads B (the root), gather to 2 reads 3B (the others), scatter from 0 reads 3B
/// (the parts it sends), all_gather 4B (each rank's own), all_to_all 12B (3 parts per rank),
/// permute 0->1->2 reads 2B (the two senders; rank 2 only receives, rank 3 gets zeros).
#[test]
fn collectives_read_back_only_what_they_send() {
    let Some(_) = gpu() else { return };
    // A device of its own, so that no other test's readbacks are counted.
    let g = futures::executor::block_on(distgrad::backend::gpu::Gpu::new()).unwrap();
    let dev = Device::Gpu(g.clone());
    const W: usize = 4;
    // 1000 B per tensor (direct algorithms) and 80000 B (ring all_gather)
    for numel in [250, 20_000] {
        let b = (numel * 4) as u64;
        for (c, units) in [
            (Coll::Broadcast, 1),
            (Coll::Gather, 3),
            (Coll::Scatter, 3),
            (Coll::AllGather, 4),
            (Coll::AllToAll, 12),
            (Coll::Permute, 2),
        ] {
            let run = |d: &Device| {
                let opts = CommOptions {
                    device: d.clone(),
                    ..CommOptions::default()
                };
                run_local(W, opts, |comm| {
                    let r = comm.rank() as u64;
                    let xs = (0..W as u64)
                        .map(|j| computed(t(100 * r + j, &[numel]), d))
                        .collect::<distgrad::Result<Vec<_>>>();
                    async move { run_coll(&comm, c, xs?).await }
                })
                .into_iter()
                .map(Result::unwrap)
                .collect::<Vec<_>>()
            };
            let before = g.bytes_read_back();
            let on_gpu = run(&dev);
            let read = g.bytes_read_back() - before;
            assert_eq!(read, units * b, "{c:?} numel {numel}: bytes read back");
            let on_cpu = run(&Device::Cpu);
            for (r, (got, want)) in on_gpu.iter().zip(&on_cpu).enumerate() {
                assert_eq!(got.len(), want.len(), "{c:?} rank {r}");
                for (x, y) in got.iter().zip(want) {
                    assert_eq!(
                        x.device().name(),
                        "wgpu",
                        "{c:?} rank {r}: result on the GPU"
                    );
                    assert_eq!(bits(x), bits(y), "{c:?} rank {r}");
                }
            }
        }
    }
}

/// `broadcast_scalar` (the backward of a sum): the one value everywhere, bit for bit (-0.0 and NaN
/// too), on the CPU and the GPU alike; a 0-D target; anything but one element is refused.
#[test]
fn broadcast_scalar_repeats_the_value_bit_for_bit() {
    for v in [2.5f32, -0.0, f32::NAN, f32::INFINITY] {
        let s = Tensor::scalar(v);
        let c = s.broadcast_scalar(&[2, 3]).unwrap();
        assert_eq!(c.shape(), &[2, 3]);
        assert_eq!(bits(&c), vec![v.to_bits(); 6], "CPU {v}");
        assert_eq!(bits(&s.broadcast_scalar(&[]).unwrap()), vec![v.to_bits()]);
        if let Some(d) = gpu() {
            // A value computed on the GPU (the copy kernel) and one known on the host (a fill
            // uploaded, keeping its host copy).
            for host in [false, true] {
                let on = |x: &Tensor| {
                    let x = x.to_device(&d).unwrap();
                    if host { x } else { x.without_host_copy() }
                };
                let g = on(&s).broadcast_scalar(&[5, 1, 7]).unwrap();
                assert!(matches!(g.device(), Device::Gpu(_)));
                assert_eq!(g.has_host_copy(), host);
                assert_eq!(bits(&g), vec![v.to_bits(); 35], "GPU {v} host {host}");
                assert_eq!(g.to_vec().len(), 35);
                let one = on(&Tensor::vector(&[v]));
                assert_eq!(
                    bits(&one.broadcast_scalar(&[3]).unwrap()),
                    vec![v.to_bits(); 3]
                );
            }
        }
    }
    assert!(Tensor::vector(&[1.0, 2.0]).broadcast_scalar(&[2]).is_err());
}

/// `CommOptions::fold_on_device` off (the browser's setting): reductions of GPU tensors computed
/// on the GPU read each input back once, reduce on the host and upload the result: bitwise the CPU's result, the result
/// on the GPU, and exactly one readback of the input per rank (world 3, ring all_reduce,
/// reduce_scatter, tree reduce to root 2).
#[test]
fn reductions_folded_on_the_host_read_each_input_back_once() {
    let Some(_) = gpu() else { return };
    let g = futures::executor::block_on(distgrad::backend::gpu::Gpu::new()).unwrap();
    let dev = Device::Gpu(g.clone());
    const W: usize = 3;
    let numel = 20_001;
    for which in ["all_reduce", "reduce_scatter", "reduce"] {
        for op in ReduceOp::ALL {
            let run = |d: &Device| {
                let opts = CommOptions {
                    ring_threshold: 0,
                    device: d.clone(),
                    fold_on_device: false,
                    ..CommOptions::default()
                };
                run_local(W, opts, |comm| {
                    let r = comm.rank() as u64;
                    let xs = (0..W as u64)
                        .map(|j| computed(t(10 * r + j, &[numel]), d))
                        .collect::<distgrad::Result<Vec<_>>>();
                    async move {
                        let xs = xs?;
                        let w = comm.world();
                        Ok::<_, distgrad::Error>(match which {
                            "all_reduce" => Some(comm.all_reduce(&xs[0], op, &w).await?),
                            "reduce_scatter" => Some(comm.reduce_scatter(&xs, op, &w).await?),
                            _ => comm.reduce(&xs[0], 2, op, &w).await?,
                        })
                    }
                })
                .into_iter()
                .map(Result::unwrap)
                .collect::<Vec<_>>()
            };
            let before = g.bytes_read_back();
            let on_gpu = run(&dev);
            let read = g.bytes_read_back() - before;
            let inputs = if which == "reduce_scatter" { W * W } else { W };
            assert_eq!(
                read,
                (inputs * numel * 4) as u64,
                "{which} {op:?}: bytes read back"
            );
            let on_cpu = run(&Device::Cpu);
            for (r, (x, y)) in on_gpu.iter().zip(&on_cpu).enumerate() {
                match (x, y) {
                    (Some(x), Some(y)) => {
                        assert_eq!(x.device().name(), "wgpu", "{which} rank {r}");
                        assert_eq!(bits(x), bits(y), "{which} {op:?} rank {r}");
                    }
                    (None, None) => {}
                    _ => panic!("{which} rank {r}: a result on one device only"),
                }
            }
        }
    }
}

/// A GPU tensor uploaded from host values keeps them (shared): reading it, moving it to the CPU and
/// sending it need no readback; a slice of a contiguous range and a reshape keep the copy, a GPU
/// op's result has none; the device's buffer holds the same bits as the copy, and is made (the
/// upload) when a kernel first reads it.
#[test]
fn uploads_keep_their_host_copy() {
    let Some(_) = gpu() else { return };
    let g = futures::executor::block_on(distgrad::backend::gpu::Gpu::new()).unwrap();
    let d = Device::Gpu(g.clone());
    let host = t(5, &[4, 3]);
    let x = host.to_device(&d).unwrap();
    assert!(x.has_host_copy() && !host.has_host_copy());
    let before = g.bytes_read_back();
    assert_eq!(x.to_vec(), host.to_vec());
    assert_eq!(
        futures::executor::block_on(x.read()).unwrap(),
        host.to_vec()
    );
    let back = futures::executor::block_on(x.moved_to(&Device::Cpu)).unwrap();
    assert_eq!(back.to_le_bytes().unwrap(), host.to_le_bytes().unwrap());
    let rows = x.slice(0, 1, 2).unwrap();
    let flat = x.reshape(&[12]).unwrap();
    assert!(rows.has_host_copy() && flat.has_host_copy());
    assert_eq!(rows.to_vec(), host.slice(0, 1, 2).unwrap().to_vec());
    assert_eq!(flat.slice(0, 5, 4).unwrap().to_vec(), host.to_vec()[5..9]);
    let seed = Tensor::scalar(-0.0).to_device(&d).unwrap();
    assert!(seed.broadcast_scalar(&[7]).unwrap().has_host_copy());
    assert_eq!(g.bytes_read_back(), before, "nothing read back so far");
    // Every copy kept above holds what the device holds.
    for (a, b) in [(&x, &host), (&rows, &host.slice(0, 1, 2).unwrap())] {
        assert_eq!(
            bits(a),
            b.to_vec().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
    assert_eq!(
        bits(&seed.broadcast_scalar(&[7]).unwrap()),
        vec![(-0.0f32).to_bits(); 7]
    );
    // Results of GPU ops and slices across rows keep none (their values were never on the host).
    assert!(!x.scale(2.0).unwrap().has_host_copy());
    assert!(!x.slice(1, 0, 2).unwrap().has_host_copy());
    assert!(!x.without_host_copy().has_host_copy());
    assert_eq!(
        x.slice(1, 0, 2).unwrap().to_vec(),
        host.slice(1, 0, 2).unwrap().to_vec()
    );
    // The upload is made when a kernel first reads the buffer, once.
    let up = g.bytes_uploaded();
    let v = t(6, &[2000]);
    let lazy = v.to_device(&d).unwrap();
    let _ = lazy.to_vec();
    assert_eq!(
        g.bytes_uploaded(),
        up,
        "nothing uploaded before a kernel reads it"
    );
    let doubled = lazy.scale(2.0).unwrap();
    let tripled = lazy.scale(3.0).unwrap();
    assert_eq!(
        g.bytes_uploaded(),
        up + 8000,
        "uploaded once, when first read"
    );
    assert_eq!(bits(&doubled), bits(&v.scale(2.0).unwrap()));
    assert_eq!(bits(&tripled), bits(&v.scale(3.0).unwrap()));
}

/// A GPU tensor whose values are only on the host (an upload nothing has used yet) is reduced
/// there: `sum_all`, `sum_to` and a small unary op give the CPU backend's bits, keep a host copy
/// and upload nothing; once a kernel has made the buffer, the same ops run on the device.
#[test]
fn ops_on_values_only_on_the_host_run_there() {
    let Some(_) = gpu() else { return };
    let g = futures::executor::block_on(distgrad::backend::gpu::Gpu::new()).unwrap();
    let d = Device::Gpu(g.clone());
    let host = t(7, &[300, 5]);
    let x = host.to_device(&d).unwrap();
    let up = g.bytes_uploaded();
    let (s, s_to, s_rows) = (
        x.sum_all().unwrap(),
        x.sum_to(&[5]).unwrap(),
        x.sum_to(&[300, 1]).unwrap(),
    );
    let small = t(8, &[3]).to_device(&d).unwrap();
    let halved = s.scale(0.5).unwrap();
    let tanh = small.unary(distgrad::backend::UnaryOp::Tanh).unwrap();
    assert_eq!(g.bytes_uploaded(), up, "nothing uploaded");
    for (got, want, what) in [
        (&s, host.sum_all().unwrap(), "sum_all"),
        (&s_to, host.sum_to(&[5]).unwrap(), "sum_to columns"),
        (&s_rows, host.sum_to(&[300, 1]).unwrap(), "sum_to rows"),
        (
            &halved,
            host.sum_all().unwrap().scale(0.5).unwrap(),
            "scale",
        ),
        (
            &tanh,
            t(8, &[3]).unary(distgrad::backend::UnaryOp::Tanh).unwrap(),
            "tanh",
        ),
    ] {
        assert!(got.has_host_copy(), "{what}: keeps its host copy");
        assert!(matches!(got.device(), Device::Gpu(_)), "{what}: on the GPU");
        assert_eq!(got.shape(), want.shape(), "{what}");
        // The device's buffer (made here, from the host copy) holds the CPU's bits.
        assert_eq!(bits(got), bits(&want), "{what}");
    }
    // By hand: the sum of 0, 1, ..., 9 is 45 (the CPU backend is not the only witness).
    let ten = Tensor::from_vec((0..10).map(|i| i as f32).collect(), &[10]).unwrap();
    assert_eq!(
        ten.to_device(&d).unwrap().sum_all().unwrap().to_vec(),
        vec![45.0]
    );
    // A large unary op still runs on the device (an upload, a kernel, no host copy).
    let big = t(9, &[distgrad::tensor::HOST_UNARY_MAX + 1]);
    let up = g.bytes_uploaded();
    let neg = big.to_device(&d).unwrap().scale(-1.0).unwrap();
    assert!(!neg.has_host_copy());
    assert_eq!(g.bytes_uploaded() - up, big.numel() as u64 * 4);
    // Once the buffer is on the device, a sum is a kernel there.
    let _ = x.scale(1.0).unwrap();
    let on_device = x.sum_all().unwrap();
    assert!(!on_device.has_host_copy(), "a kernel's result");
    close(&on_device, &host.sum_all().unwrap(), 1e-5, "sum_all kernel");
}

/// The browser's setting (folds on the host), inputs uploaded from host values: a SUM all_reduce
/// forward and backward (the room benchmark's program) reads nothing back and uploads nothing,
/// small (direct) and large (ring): y's values are on the host, so the loss is summed there; the
/// gradients and the loss are bitwise the CPU's, on the GPU (and the same in the device's buffer,
/// made when the check reads it).
/// With folds on the GPU the in-place folds never see a host copy: bitwise the CPU's too.
#[test]
fn a_collective_of_uploaded_tensors_reads_nothing_back() {
    let Some(_) = gpu() else { return };
    let g = futures::executor::block_on(distgrad::backend::gpu::Gpu::new()).unwrap();
    let dev = Device::Gpu(g.clone());
    const W: usize = 3;
    for fold_on_device in [false, true] {
        for numel in [1, 20_001] {
            let run = |d: &Device| {
                let opts = CommOptions {
                    device: d.clone(),
                    fold_on_device,
                    ..CommOptions::default()
                };
                run_local(W, opts, |comm| {
                    let x = t(comm.rank() as u64 + 3, &[numel]).to_device(d);
                    async move {
                        let tape = Tape::new();
                        let xv = tape.var(x?);
                        let y = dist::all_reduce(&comm, &xv, ReduceOp::Sum, &comm.world()).await?;
                        let loss = y.sum()?;
                        let gr = tape.backward(&loss, &comm).await?.wrt(&xv)?;
                        Ok::<_, distgrad::Error>((y.value(), gr, loss.value()))
                    }
                })
                .into_iter()
                .map(Result::unwrap)
                .collect::<Vec<_>>()
            };
            let (before, up) = (g.bytes_read_back(), g.bytes_uploaded());
            let on_gpu = run(&dev);
            let read = g.bytes_read_back() - before;
            if !fold_on_device {
                assert_eq!(read, 0, "numel {numel}: bytes read back");
                // Uploads are made when a kernel first reads them, and none does: y is summed on
                // the host (its values are there), the input, the seed's broadcast and the
                // gradient only go to collectives.
                assert_eq!(g.bytes_uploaded() - up, 0, "numel {numel}: bytes uploaded");
            }
            let on_cpu = run(&Device::Cpu);
            for (r, ((y, gr, loss), (yc, gc, lc))) in on_gpu.iter().zip(&on_cpu).enumerate() {
                let what = format!("fold_on_device {fold_on_device} numel {numel} rank {r}");
                assert!(y.has_host_copy() && gr.has_host_copy(), "{what}");
                if !fold_on_device {
                    assert!(
                        loss.has_host_copy(),
                        "{what}: the loss is summed on the host"
                    );
                    assert_eq!(bits(loss), bits(lc), "{what}: loss");
                }
                assert_eq!(bits(y), bits(yc), "{what}: y");
                assert_eq!(bits(gr), bits(gc), "{what}: gradient");
                assert_eq!(
                    bits(gr),
                    vec![(W as f32).to_bits(); numel],
                    "{what}: by hand"
                );
                close(loss, lc, 1e-5, &what);
            }
        }
    }
}
