//! Measurements for `distgrad bench`: how fast NCCL's all_reduce is on its own, through the
//! staged and the shared data paths ([`NcclComm::bench_all_reduce`], one [`NcclBenchRow`] per
//! size), beside the device's own copy bandwidth ([`NcclComm::copy_gbps`], [`cuda_copy_gbps`]).
//!
//! Named for what it does rather than `bench.rs`: the benchmark tables live with the `bench`
//! command; this file only takes the NCCL timings that command prints. Every rank calls the same
//! measurement with the same arguments (the calls are collectives).

use cudarc::driver::CudaContext;

use super::comm::to_nccl;
use super::probe::device_count;
use super::{NcclComm, nccl_err};
use crate::backend::Device;
use crate::collective::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// GB/s, counting bytes read and written, of CUDA's device-to-device copy between two buffers of
/// `bytes` on CUDA device `ordinal`: the device's own copy, which `distgrad bench kernels` puts
/// beside the WGSL kernels (wgpu's buffer-to-buffer copy may take another route). Best of three
/// batches, each long enough that the stream synchronization is a small part of it.
pub fn cuda_copy_gbps(ordinal: usize, bytes: usize) -> Result<f64> {
    let n = device_count()?;
    if ordinal >= n {
        return Err(Error::Nccl {
            op: "copy",
            rank: None,
            detail: format!("CUDA device {ordinal} asked for, this machine has {n}"),
        });
    }
    let err = |e: cudarc::driver::DriverError| nccl_err("copy", 0, e);
    let ctx = CudaContext::new(ordinal).map_err(err)?;
    let stream = ctx.default_stream();
    let elems = (bytes / 4).max(1);
    let src = stream.alloc_zeros::<f32>(elems).map_err(err)?;
    let mut dst = stream.alloc_zeros::<f32>(elems).map_err(err)?;
    let moved = 8.0 * elems as f64;
    let batch = ((32e9 / moved).ceil() as usize).clamp(1, 256);
    stream.memcpy_dtod(&src, &mut dst).map_err(err)?;
    stream.synchronize().map_err(err)?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t0 = std::time::Instant::now();
        for _ in 0..batch {
            stream.memcpy_dtod(&src, &mut dst).map_err(err)?;
        }
        stream.synchronize().map_err(err)?;
        best = best.min(t0.elapsed().as_secs_f64() / batch as f64);
    }
    Ok(moved / best / 1e9)
}

/// One size of the NCCL all_reduce benchmark ([`NcclComm::bench_all_reduce`]).
#[derive(Debug, Clone, Copy)]
pub struct NcclBenchRow {
    /// Bytes per rank.
    pub bytes: usize,
    /// Seconds per call with both buffers resident on the GPU (NCCL alone: what a zero-copy
    /// path from the compute buffers can reach).
    pub device_s: f64,
    /// Seconds per call through the [`Communicator`] API with a host tensor: host staging
    /// (upload, NCCL, download) plus the call check.
    pub staged_s: f64,
    /// Seconds per call through the [`Communicator`] API with a tensor on the shared GPU
    /// ([`DataPath::Shared`]: device copies in and out, NCCL, the call check); `None` when the
    /// communicator stages.
    ///
    /// [`DataPath::Shared`]: super::DataPath::Shared
    pub shared_s: Option<f64>,
}

impl NcclComm {
    /// Device-to-device copy bandwidth of this rank's GPU (GB/s of bytes copied; the baseline
    /// beside NCCL's bus bandwidth).
    pub fn copy_gbps(&self, bytes: usize) -> Result<f64> {
        let n = (bytes / 4).max(1);
        let src = self.zeros("bench", n)?;
        let mut dst = self.zeros("bench", n)?;
        let sync = |s: &Self| s.stream.synchronize().map_err(|e| s.err("bench", e));
        self.stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| self.err("bench", e))?;
        sync(self)?;
        let iters = 20;
        let t0 = std::time::Instant::now();
        for _ in 0..iters {
            self.stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(|e| self.err("bench", e))?;
        }
        sync(self)?;
        Ok((n * 4 * iters) as f64 / t0.elapsed().as_secs_f64() / 1e9)
    }

    /// all_reduce(SUM) of `bytes` per rank over the world, `iters` calls after one warm-up, both
    /// with GPU-resident buffers and through the Communicator API with a host tensor. Every rank
    /// must call it with the same arguments.
    pub fn bench_all_reduce(&self, bytes: usize, iters: usize) -> Result<NcclBenchRow> {
        let g = self.world();
        let (c, _) = self.comm(&g, "bench")?;
        let n = (bytes / 4).max(1);
        let iters = iters.max(1);
        let sync = |s: &Self| s.stream.synchronize().map_err(|e| s.err("bench", e));
        let send = self.upload("bench", &vec![1.0f32; n])?;
        let mut recv = self.zeros("bench", n)?;
        let op = to_nccl(ReduceOp::Sum);
        c.all_reduce(&send, &mut recv, &op)
            .map_err(|e| self.err("bench", e))?;
        sync(self)?;
        let t0 = std::time::Instant::now();
        for _ in 0..iters {
            c.all_reduce(&send, &mut recv, &op)
                .map_err(|e| self.err("bench", e))?;
        }
        sync(self)?;
        let device_s = t0.elapsed().as_secs_f64() / iters as f64;
        let x = Tensor::full(&[n], 1.0);
        futures::executor::block_on(self.all_reduce(&x, ReduceOp::Sum, &g))?;
        let t0 = std::time::Instant::now();
        for _ in 0..iters {
            futures::executor::block_on(self.all_reduce(&x, ReduceOp::Sum, &g))?;
        }
        let staged_s = t0.elapsed().as_secs_f64() / iters as f64;
        let shared_s = match &self.shared {
            None => None,
            Some(s) => {
                let x = x.to_device(&Device::Gpu(s.gpu.clone()))?;
                let y = futures::executor::block_on(self.all_reduce(&x, ReduceOp::Sum, &g))?;
                // Check the result once: every rank gave ones, so each element is the world size.
                let got = y.try_to_vec()?;
                let want = self.world as f32;
                if let Some((i, v)) = got.iter().enumerate().find(|(_, v)| **v != want) {
                    return Err(Error::Nccl {
                        op: "bench",
                        rank: Some(self.rank),
                        detail: format!("shared all_reduce gave {v} at {i}, expected {want}"),
                    });
                }
                let t0 = std::time::Instant::now();
                for _ in 0..iters {
                    futures::executor::block_on(self.all_reduce(&x, ReduceOp::Sum, &g))?;
                }
                Some(t0.elapsed().as_secs_f64() / iters as f64)
            }
        };
        Ok(NcclBenchRow {
            bytes: n * 4,
            device_s,
            staged_s,
            shared_s,
        })
    }
}
