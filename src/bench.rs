//! Benchmarks behind `distgrad bench` (figures to read, never asserted): an nccl-tests-style table
//! of collectives on any communicator (in-process threads or processes through the relay) with a
//! memcpy baseline measured in the same run, the latency of a 16-byte all_reduce, and the tape's
//! overhead per local op.
//!
//! Bus bandwidth uses nccl-tests' factors: all_reduce `2(n-1)/n`, all_gather `(n-1)/n` (size = the
//! gathered total), broadcast `1`.

use std::time::{Duration, Instant};

use crate::autograd::Tape;
use crate::backend::Device;
use crate::collective::{Communicator, Group, ReduceOp};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// A benchmarked collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchOp {
    /// all_reduce(SUM)
    AllReduce,
    /// all_gather
    AllGather,
    /// broadcast from rank 0
    Broadcast,
}

impl BenchOp {
    /// Every benchmarked collective.
    pub const ALL: [BenchOp; 3] = [BenchOp::AllReduce, BenchOp::AllGather, BenchOp::Broadcast];

    /// Name.
    pub fn name(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "all_reduce",
            BenchOp::AllGather => "all_gather",
            BenchOp::Broadcast => "broadcast",
        }
    }

    /// Parse a name.
    pub fn parse(s: &str) -> Result<Self> {
        BenchOp::ALL
            .into_iter()
            .find(|o| o.name() == s)
            .ok_or_else(|| {
                Error::Input(format!(
                    "unknown bench op {s:?} (all_reduce, all_gather, broadcast)"
                ))
            })
    }

    /// nccl-tests bus bandwidth factor.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            BenchOp::AllReduce => 2.0 * (n - 1.0) / n,
            BenchOp::AllGather => (n - 1.0) / n,
            BenchOp::Broadcast => 1.0,
        }
    }
}

/// One row of the table.
#[derive(Debug, Clone)]
pub struct Row {
    /// The collective.
    pub op: BenchOp,
    /// Bytes (all_gather: the gathered total, as nccl-tests).
    pub bytes: usize,
    /// Mean time per call.
    pub time: Duration,
    /// Algorithm bandwidth, GB/s.
    pub algbw: f64,
    /// Bus bandwidth, GB/s.
    pub busbw: f64,
    /// With tensors on a GPU: bytes read back from the device per call and rank (all ranks of
    /// the process share one device; the counter is [`crate::backend::gpu::Gpu::bytes_read_back`]).
    pub read_back: Option<f64>,
}

/// Iterations for a payload: enough to amortize timer noise, bounded for big sizes.
fn iters_for(bytes: usize) -> usize {
    ((256usize << 20) / bytes.max(1)).clamp(5, 500)
}

/// Run `op` once on this rank.
async fn run_op<C: Communicator>(comm: &C, op: BenchOp, x: &Tensor, g: &Group) -> Result<()> {
    match op {
        BenchOp::AllReduce => drop(comm.all_reduce(x, ReduceOp::Sum, g).await?),
        BenchOp::AllGather => drop(comm.all_gather(x, g).await?),
        BenchOp::Broadcast => drop(comm.broadcast(x, 0, g).await?),
    }
    Ok(())
}

/// Benchmark every op at every size (bytes per rank) on this rank of `comm`'s world, with the
/// tensors on `device`. Every rank must call it with the same arguments. Time per call = this
/// rank's time between two barriers around `iters` calls, after one warm-up call. With `print`,
/// rows are printed as they finish.
pub async fn bench_all<C: Communicator>(
    comm: &C,
    ops: &[BenchOp],
    sizes: &[usize],
    memcpy_gbps: f64,
    print: bool,
    device: &Device,
) -> Result<Vec<Row>> {
    let g = comm.world();
    let world = comm.world_size();
    let mut rows = Vec::new();
    for &op in ops {
        for &bytes_per_rank in sizes {
            let numel = (bytes_per_rank / 4).max(1);
            let iters = iters_for(numel * 4);
            // As a GPU op's result would be (no host copy): the read-back column counts what a
            // collective of a computed tensor reads.
            let x = Tensor::full(&[numel], comm.rank() as f32 + 1.0)
                .to_device(device)?
                .without_host_copy();
            run_op(comm, op, &x, &g).await?;
            comm.barrier(&g).await?;
            // Every rank is past its warm-up here and none has started the timed calls.
            let read_before = read_back(device);
            comm.barrier(&g).await?;
            let t0 = Instant::now();
            for _ in 0..iters {
                run_op(comm, op, &x, &g).await?;
            }
            comm.barrier(&g).await?;
            let time = t0.elapsed() / iters as u32;
            let read_back = read_before
                .zip(read_back(device))
                .map(|(a, b)| b.saturating_sub(a) as f64 / (iters * world) as f64);
            let bytes = match op {
                BenchOp::AllGather => numel * 4 * world,
                _ => numel * 4,
            };
            let algbw = bytes as f64 / time.as_secs_f64() / 1e9;
            let row = Row {
                op,
                bytes,
                time,
                algbw,
                busbw: algbw * op.bus_factor(world),
                read_back,
            };
            if print {
                println!("{}", format_row(&row, memcpy_gbps));
            }
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Bytes read back from `device` so far, where it is a GPU.
fn read_back(device: &Device) -> Option<u64> {
    match device {
        Device::Cpu => None,
        #[cfg(feature = "wgpu")]
        Device::Gpu(g) => Some(g.bytes_read_back()),
    }
}

/// Header of the table [`format_row`] prints; `read_back` adds the column of bytes read back
/// from the GPU per call and rank.
pub fn table_header(read_back: bool) -> String {
    let mut h = format!(
        "{:>12} {:>12} {:>12} {:>10} {:>10} {:>12}",
        "op", "size", "time(us)", "algbw GB/s", "busbw GB/s", "busbw/memcpy"
    );
    if read_back {
        h += &format!(" {:>14}", "read back/call");
    }
    h
}

/// One table row.
pub fn format_row(r: &Row, memcpy_gbps: f64) -> String {
    let mut line = format!(
        "{:>12} {:>12} {:>12.1} {:>10.3} {:>10.3} {:>12.2}",
        r.op.name(),
        fmt_bytes(r.bytes),
        r.time.as_secs_f64() * 1e6,
        r.algbw,
        r.busbw,
        r.busbw / memcpy_gbps
    );
    if let Some(b) = r.read_back {
        line += &format!(" {:>14}", fmt_bytes(b.round() as usize));
    }
    line
}

/// Per-call latency of a 16-byte all_reduce on this rank: `(p50, p99)` over `iters` calls.
pub async fn latency_16b<C: Communicator>(comm: &C, iters: usize) -> Result<(Duration, Duration)> {
    let g = comm.world();
    let x = Tensor::full(&[4], 1.0);
    for _ in 0..10 {
        comm.all_reduce(&x, ReduceOp::Sum, &g).await?;
    }
    comm.barrier(&g).await?;
    let mut lat = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        let t0 = Instant::now();
        comm.all_reduce(&x, ReduceOp::Sum, &g).await?;
        lat.push(t0.elapsed());
    }
    lat.sort_unstable();
    let pct = |p: f64| lat[((lat.len() - 1) as f64 * p).round() as usize];
    Ok((pct(0.5), pct(0.99)))
}

/// Single-thread memcpy bandwidth (GB/s of bytes copied) for `bytes`-sized buffers.
pub fn memcpy_gbps(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src); // fault pages in
    let iters = iters_for(bytes).min(20);
    let t0 = Instant::now();
    for i in 0..iters {
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
        std::hint::black_box(i);
    }
    bytes as f64 * iters as f64 / t0.elapsed().as_secs_f64() / 1e9
}

/// Human-readable size.
pub fn fmt_bytes(b: usize) -> String {
    if b >= 1 << 20 {
        format!("{} MiB", b >> 20)
    } else if b >= 1 << 10 {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b} B")
    }
}

/// Sizes from `min` to `max` bytes, ×4 each step (nccl-tests' -f 4).
pub fn sizes(min: usize, max: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min.max(4);
    while s <= max {
        v.push(s);
        match s.checked_mul(4) {
            Some(next) => s = next,
            None => break,
        }
    }
    v
}

/// Tape overhead: µs per recorded local op on 1-element tensors, and µs per raw tensor op, measured
/// side by side. Returns `(taped_us, raw_us)`.
pub fn tape_overhead(ops: usize) -> Result<(f64, f64)> {
    let a = Tensor::vector(&[1.5]);
    let b = Tensor::vector(&[0.5]);
    let t0 = Instant::now();
    let mut acc = a.clone();
    for _ in 0..ops {
        acc = acc.mul(&b)?.add(&a)?;
    }
    std::hint::black_box(&acc);
    let raw = t0.elapsed().as_secs_f64() * 1e6 / (2 * ops) as f64;

    let tape = Tape::new();
    let va = tape.var(a);
    let vb = tape.constant(b);
    let t0 = Instant::now();
    let mut v = va.clone();
    for _ in 0..ops {
        v = v.mul(&vb)?.add(&va)?;
    }
    std::hint::black_box(&v);
    let taped = t0.elapsed().as_secs_f64() * 1e6 / (2 * ops) as f64;
    Ok((taped, raw))
}

/// One line of the kernel benchmark.
#[derive(Debug, Clone)]
pub struct KernelRow {
    /// What was measured.
    pub name: &'static str,
    /// GB/s on the GPU: bytes the kernel reads and writes in device memory, per second.
    pub gpu_gbps: f64,
    /// GB/s of the same work as a 1-thread CPU loop, same run (`None` where it was not measured).
    pub cpu_gbps: Option<f64>,
}

/// The kernel benchmark at one size: the device's own buffer-to-buffer copy (the copy engine, no
/// shader) measured in the same run as the baseline, and each kernel's figure.
#[derive(Debug, Clone)]
pub struct KernelBench {
    /// f32 elements per input.
    pub n: usize,
    /// GB/s of the device's buffer-to-buffer copy, bytes read + written.
    pub device_copy_gbps: f64,
    /// One row per kernel.
    pub rows: Vec<KernelRow>,
    /// Microseconds from submitting a one-element kernel to its end seen by the host (median of
    /// 20): what every wait on the device costs.
    pub sync_us: f64,
    /// Microseconds to read one f32 back to the host (median of 20): the floor of every readback.
    pub readback_us: f64,
}

/// Best seconds per call of `f` on the GPU: after one warm-up call, `reps` batches of `batch`
/// calls each with one wait at the end (so the wait and the submissions overlap the device's
/// work instead of being counted once per call).
#[cfg(all(feature = "wgpu", not(target_arch = "wasm32")))]
fn gpu_time(
    gpu: &crate::backend::gpu::Gpu,
    reps: usize,
    batch: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    f()?;
    gpu.sync()?;
    let batch = batch.max(1);
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t0 = Instant::now();
        for _ in 0..batch {
            f()?;
        }
        gpu.sync()?;
        best = best.min(t0.elapsed().as_secs_f64() / batch as f64);
    }
    Ok(best)
}

/// Time `f` (best of `reps` after one warm-up) in seconds.
#[cfg(all(feature = "wgpu", not(target_arch = "wasm32")))]
fn best_of(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// GB/s of the WGSL kernels on `gpu` for `n` f32 per input, each counted as the bytes it reads
/// and writes in device memory, beside the device's own buffer-to-buffer copy measured in the same
/// run: the copy kernel (8 bytes per element), reduce-into of 1 input (`acc ⊕= x`: 12), of 4
/// inputs as three passes (36) and in one pass (20; with the adapter's thread layout, then each
/// layout), and sum-to-scalar (4; the adapter's layout, then each). With `with_cpu`, each beside
/// the same work as a 1-thread CPU loop. Native only: a browser cannot wait for the device.
#[cfg(all(feature = "wgpu", not(target_arch = "wasm32")))]
pub fn kernels(gpu: &crate::backend::gpu::Gpu, n: usize, with_cpu: bool) -> Result<KernelBench> {
    use crate::backend::gpu::{CopyPath, Vec4Layout};
    use crate::backend::{BinaryOp, cpu};
    let n = n.max(4);
    let xs: Vec<Vec<f32>> = (0..4)
        .map(|k| (0..n).map(|i| ((i * 7 + k) % 13) as f32 - 6.0).collect())
        .collect();
    let g: Vec<_> = xs.iter().map(|x| gpu.upload(x)).collect::<Result<_>>()?;
    let acc = gpu.upload(&xs[0])?;
    let dst = gpu.alloc(n)?;
    // Enough calls per wait that one batch moves about 32 GB (milliseconds on a data-centre GPU),
    // so that the wait itself (see `sync_us`) is a small part of the time.
    let batch = |bytes: f64| ((32e9 / bytes).ceil() as usize).clamp(1, 256);
    let gbps = |bytes: f64, s: f64| bytes / s / 1e9;
    let on_cpu = |bytes: f64, f: &mut dyn FnMut()| -> Result<Option<f64>> {
        if !with_cpu {
            return Ok(None);
        }
        let s = best_of(3, || {
            f();
            Ok(())
        })?;
        Ok(Some(gbps(bytes, s)))
    };
    let mut cacc = xs[0].clone();
    let mut rows = Vec::new();

    let copy_bytes = 8.0 * n as f64;
    let t = gpu_time(gpu, 3, batch(copy_bytes), || {
        gpu.copy_range_in(CopyPath::Engine, &g[1], 0, &dst, 0, n)
    })?;
    let device_copy_gbps = gbps(copy_bytes, t);
    let mut cdst = vec![0.0f32; n];
    let cpu_copy = on_cpu(copy_bytes, &mut || {
        cdst.copy_from_slice(&xs[1]);
        std::hint::black_box(&cdst);
    })?;
    rows.push(KernelRow {
        name: "device copy (baseline)",
        gpu_gbps: device_copy_gbps,
        cpu_gbps: cpu_copy,
    });
    let t = gpu_time(gpu, 3, batch(copy_bytes), || {
        gpu.copy_range_in(CopyPath::Kernel, &g[1], 0, &dst, 0, n)
    })?;
    rows.push(KernelRow {
        name: "copy kernel",
        gpu_gbps: gbps(copy_bytes, t),
        cpu_gbps: cpu_copy,
    });

    let one = 12.0 * n as f64;
    let t = gpu_time(gpu, 3, batch(one), || {
        gpu.reduce_into(BinaryOp::Add, &acc, &g[1])
    })?;
    rows.push(KernelRow {
        name: "reduce-into, 1 input",
        gpu_gbps: gbps(one, t),
        cpu_gbps: on_cpu(one, &mut || {
            cpu::reduce_into(BinaryOp::Add, &mut cacc, &xs[1]);
            std::hint::black_box(&cacc);
        })?,
    });

    let three = 3.0 * one;
    let t = gpu_time(gpu, 3, batch(three), || {
        for x in &g[1..] {
            gpu.reduce_into(BinaryOp::Add, &acc, x)?;
        }
        Ok(())
    })?;
    rows.push(KernelRow {
        name: "reduce-into, 4 inputs",
        gpu_gbps: gbps(three, t),
        cpu_gbps: on_cpu(three, &mut || {
            for x in &xs[1..] {
                cpu::reduce_into(BinaryOp::Add, &mut cacc, x);
            }
            std::hint::black_box(&cacc);
        })?,
    });

    let refs: Vec<&crate::backend::gpu::GpuBuf> = g[1..].iter().collect();
    let inputs: Vec<&[f32]> = xs[1..].iter().map(Vec::as_slice).collect();
    let pass = 20.0 * n as f64;
    let mut cpu_pass = None;
    for (name, layout) in [
        ("reduce-into, 4 in 1 pass", Vec4Layout::Auto),
        ("  1 pass, grid-stride", Vec4Layout::GridStride),
        ("  1 pass, runs", Vec4Layout::Runs),
    ] {
        let t = gpu_time(gpu, 3, batch(pass), || {
            gpu.reduce_into_many_in(layout, BinaryOp::Add, &acc, &refs)
        })?;
        if layout == Vec4Layout::Auto {
            cpu_pass = on_cpu(pass, &mut || {
                cpu::reduce_into_many(BinaryOp::Add, &mut cacc, &inputs);
                std::hint::black_box(&cacc);
            })?;
        }
        rows.push(KernelRow {
            name,
            gpu_gbps: gbps(pass, t),
            cpu_gbps: cpu_pass,
        });
    }

    let sum = 4.0 * n as f64;
    let cpu_sum = on_cpu(sum, &mut || {
        std::hint::black_box(cpu::sum_all(&xs[2]));
    })?;
    for (name, layout) in [
        ("sum-to-scalar", Vec4Layout::Auto),
        ("  sum, interleaved", Vec4Layout::GridStride),
        ("  sum, runs", Vec4Layout::Runs),
    ] {
        let t = gpu_time(gpu, 3, batch(sum), || {
            gpu.sum_all_in(layout, &g[2]).map(drop)
        })?;
        rows.push(KernelRow {
            name,
            gpu_gbps: gbps(sum, t),
            cpu_gbps: cpu_sum,
        });
    }
    let (one_elem, other) = (gpu.upload(&[1.0])?, gpu.upload(&[0.0])?);
    let median_us = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let mut t = Vec::with_capacity(20);
        for _ in 0..20 {
            let t0 = Instant::now();
            f()?;
            t.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        t.sort_by(f64::total_cmp);
        Ok(t[t.len() / 2])
    };
    let sync_us = median_us(&mut || {
        gpu.reduce_into(BinaryOp::Add, &one_elem, &other)?;
        gpu.sync()
    })?;
    let readback_us = median_us(&mut || gpu.read_blocking(&one_elem).map(drop))?;
    Ok(KernelBench {
        n,
        device_copy_gbps,
        rows,
        sync_us,
        readback_us,
    })
}
