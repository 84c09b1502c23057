//! Device buffers: how a tensor's numbers get into a buffer NCCL can use and how NCCL's results
//! become tensors again, on either data path (see [`DataPath`](super::DataPath)), and the grouped
//! send/recv that the collectives NCCL lacks are built from.
//!
//! A [`DevBuf`] is a plain CUDA buffer (staging: through the host) or a lease from the shared pool
//! (wgpu memory imported into CUDA: device copies only). Buffers hold at least one element, since
//! NCCL refuses empty ones on some paths. The ordering between wgpu and CUDA is kept here: wgpu's
//! queue is drained before NCCL reads, the stream synchronized before wgpu reads.

use cudarc::driver::CudaSlice;
use cudarc::nccl::{self as nc, Comm};

use super::NcclComm;
use super::shared::{DevBuf, Part, Shared};
use crate::backend::{Device, Storage};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

impl NcclComm {
    pub(super) fn upload(&self, op: &'static str, v: &[f32]) -> Result<CudaSlice<f32>> {
        // NCCL rejects zero-length buffers on some paths: keep at least one element.
        if v.is_empty() {
            return self
                .stream
                .alloc_zeros::<f32>(1)
                .map_err(|e| self.err(op, e));
        }
        self.stream.clone_htod(v).map_err(|e| self.err(op, e))
    }

    pub(super) fn zeros(&self, op: &'static str, n: usize) -> Result<CudaSlice<f32>> {
        self.stream
            .alloc_zeros::<f32>(n.max(1))
            .map_err(|e| self.err(op, e))
    }

    pub(super) fn download(
        &self,
        op: &'static str,
        b: &CudaSlice<f32>,
        n: usize,
    ) -> Result<Vec<f32>> {
        let mut v = self.stream.clone_dtoh(b).map_err(|e| self.err(op, e))?;
        v.truncate(n);
        Ok(v)
    }

    /// The shared pool, when tensors on `dev` can reach NCCL without the host.
    fn shared_on(&self, dev: &Device) -> Option<&Shared> {
        match (dev, &self.shared) {
            (Device::Gpu(g), Some(s)) if *g == s.gpu => Some(s),
            _ => None,
        }
    }

    /// A device buffer holding `xs` one after another (at least one element).
    pub(super) fn input(&self, op: &'static str, xs: &[&Tensor]) -> Result<DevBuf> {
        let n: usize = xs.iter().map(|x| x.numel()).sum();
        let shared = self
            .shared
            .as_ref()
            .filter(|_| xs.iter().all(|x| self.shared_on(&x.device()).is_some()));
        let Some(s) = shared else {
            let mut host = Vec::with_capacity(n);
            for x in xs {
                host.extend(Self::host(x)?);
            }
            return Ok(DevBuf::Cuda(self.upload(op, &host)?));
        };
        let lease = s.lease(op, n)?;
        let mut at = 0;
        for x in xs {
            if let Storage::Gpu(b) = x.storage() {
                s.gpu.copy_range(b, 0, lease.gpu_buf(), at, x.numel())?;
                at += x.numel();
            }
        }
        // NCCL reads only after wgpu has written.
        s.gpu.sync()?;
        Ok(DevBuf::Shared(lease))
    }

    /// A device buffer for `n` results that go to `dev` (at least one element).
    pub(super) fn output(&self, op: &'static str, n: usize, dev: &Device) -> Result<DevBuf> {
        match self.shared_on(dev) {
            Some(s) => Ok(DevBuf::Shared(s.lease(op, n)?)),
            None => Ok(DevBuf::Cuda(self.zeros(op, n)?)),
        }
    }

    /// Tensors on `dev` from NCCL's results in `b`: `count` consecutive runs of `shape`'s elements,
    /// each `stride` elements after the previous.
    pub(super) fn finish(
        &self,
        op: &'static str,
        b: DevBuf,
        shape: &[usize],
        count: usize,
        stride: usize,
        dev: &Device,
    ) -> Result<Vec<Tensor>> {
        let n: usize = shape.iter().product();
        match b {
            DevBuf::Cuda(c) => {
                let all = self.download(op, &c, stride * count.saturating_sub(1) + n)?;
                (0..count)
                    .map(|i| self.out(all[i * stride..i * stride + n].to_vec(), shape, dev))
                    .collect()
            }
            DevBuf::Shared(lease) => {
                let s = self.shared_on(dev).ok_or_else(|| Error::Nccl {
                    op,
                    rank: Some(self.rank),
                    detail: "shared results for a device that is not the shared GPU".into(),
                })?;
                // wgpu reads only after NCCL has written.
                self.stream.synchronize().map_err(|e| self.err(op, e))?;
                let mut out = Vec::with_capacity(count);
                for i in 0..count {
                    let t = s.gpu.alloc(n)?;
                    s.gpu.copy_range(lease.gpu_buf(), i * stride, &t, 0, n)?;
                    out.push(Tensor::from_gpu(shape.to_vec(), t));
                }
                // The lease goes back to the pool only after wgpu's copies are done.
                s.gpu.sync()?;
                Ok(out)
            }
        }
    }

    /// The one tensor of [`NcclComm::finish`] with `count` 1.
    pub(super) fn finish_one(
        &self,
        op: &'static str,
        b: DevBuf,
        shape: &[usize],
        dev: &Device,
    ) -> Result<Tensor> {
        let mut v = self.finish(op, b, shape, 1, 0, dev)?;
        v.pop().ok_or_else(|| Error::Nccl {
            op,
            rank: Some(self.rank),
            detail: "no result".into(),
        })
    }

    fn host(x: &Tensor) -> Result<Vec<f32>> {
        x.try_to_vec()
    }

    fn out(&self, data: Vec<f32>, shape: &[usize], dev: &Device) -> Result<Tensor> {
        Tensor::from_vec(data, shape)?.to_device(dev)
    }

    /// Receive buffers for `(peer, element count)` pairs, for results on `dev`.
    pub(super) fn recv_bufs(
        &self,
        op: &'static str,
        recvs: &[(usize, usize)],
        dev: &Device,
    ) -> Result<Vec<(usize, usize, DevBuf)>> {
        recvs
            .iter()
            .map(|&(p, n)| Ok((p, n, self.output(op, n, dev)?)))
            .collect()
    }

    /// Grouped NCCL send/recv: `sends` (peer group rank, region) and `recvs` (peer, element
    /// count, buffer of exactly that many elements, or one for zero). Empty transfers are skipped.
    pub(super) fn exchange(
        &self,
        op: &'static str,
        comm: &Comm,
        sends: &[(usize, Part<'_>)],
        recvs: &mut [(usize, usize, DevBuf)],
    ) -> Result<()> {
        nc::group_start().map_err(|e| self.err(op, e))?;
        let mut res = Ok(());
        for (p, part) in sends {
            if part.len == 0 {
                continue;
            }
            if let Err(e) = comm.send(part, *p as i32) {
                res = Err(self.err(op, e));
            }
        }
        for (p, n, b) in recvs.iter_mut() {
            if *n == 0 {
                continue;
            }
            debug_assert!(
                cudarc::driver::DeviceSlice::len(b) >= *n,
                "{op}: receive buffer shorter than the message"
            );
            if let Err(e) = comm.recv(b, *p as i32) {
                res = Err(self.err(op, e));
            }
        }
        let end = nc::group_end().map_err(|e| self.err(op, e));
        res?;
        end.map(|_| ())
    }

    /// One tensor of `shape` on `dev` from consecutive regions of device buffers (all staged or
    /// all shared).
    pub(super) fn finish_concat(
        &self,
        op: &'static str,
        parts: &[Part<'_>],
        shape: &[usize],
        dev: &Device,
    ) -> Result<Tensor> {
        let total: usize = parts.iter().map(|p| p.len).sum();
        let all_shared = parts.iter().all(|p| matches!(p.buf, DevBuf::Shared(_)));
        match self.shared_on(dev) {
            Some(s) if all_shared => {
                self.stream.synchronize().map_err(|e| self.err(op, e))?;
                let out = s.gpu.alloc(total)?;
                let mut at = 0;
                for p in parts {
                    if let DevBuf::Shared(l) = p.buf {
                        s.gpu.copy_range(l.gpu_buf(), p.start, &out, at, p.len)?;
                    }
                    at += p.len;
                }
                s.gpu.sync()?;
                Ok(Tensor::from_gpu(shape.to_vec(), out))
            }
            _ if parts.iter().all(|p| matches!(p.buf, DevBuf::Cuda(_))) => {
                let mut host = Vec::with_capacity(total);
                for p in parts.iter().filter(|p| p.len > 0) {
                    host.extend(self.stream.clone_dtoh(p).map_err(|e| self.err(op, e))?);
                }
                self.out(host, shape, dev)
            }
            _ => Err(Error::Nccl {
                op,
                rank: Some(self.rank),
                detail: "staged and shared buffers mixed in one result".into(),
            }),
        }
    }
}
