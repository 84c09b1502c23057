//! The zero-copy data path between wgpu and NCCL ([`super::DataPath::Shared`]).
//!
//! A pool of buffers, each allocated by Vulkan as exportable memory (wgpu uses it as a storage
//! buffer: [`Gpu::alloc_exportable`]) and imported into CUDA once (`cuImportExternalMemory`, then
//! mapped as a device pointer), so NCCL reads and writes the very bytes wgpu's kernels see. A
//! collective copies its inputs into a leased buffer on the GPU (a device copy, no kernel), lets NCCL
//! work in place there, and copies the results out into fresh tensors on the GPU: no byte crosses
//! to the host.
//!
//! Ordering: wgpu's queue is drained ([`Gpu::sync`]) before NCCL reads, and the CUDA stream is
//! synchronized before wgpu reads NCCL's results; a lease goes back to the pool only after both
//! (dropping a [`Lease`] synchronizes the stream).

use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, IntoRawFd};
use std::rc::Rc;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop, result,
    sys,
};

use crate::backend::gpu::{Gpu, GpuBuf};
use crate::error::{Error, Result};

/// Free buffers the pool keeps (the smallest goes when more come back).
const KEEP: usize = 8;
/// Bytes of free buffers the pool keeps (the largest go first above it).
const KEEP_BYTES: usize = 2 << 30;

/// Elements to allocate for a request of `n`: rounded up by less than 1/8, so that a few buffers
/// serve nearby sizes without doubling the memory.
fn rounded(n: usize) -> usize {
    let g = ((n / 8).max(1).next_power_of_two() / 2).max(1);
    n.div_ceil(g).saturating_mul(g)
}

fn cuda_err(op: &'static str, rank: usize, what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Nccl {
        op,
        rank: Some(rank),
        detail: format!("{what}: {e:?}"),
    }
}

/// One exportable wgpu buffer, imported into CUDA.
pub(crate) struct SharedBuf {
    gpu_buf: GpuBuf,
    ext: sys::CUexternalMemory,
    ptr: sys::CUdeviceptr,
    ctx: Arc<CudaContext>,
}

impl SharedBuf {
    fn new(
        op: &'static str,
        rank: usize,
        gpu: &Gpu,
        ctx: &Arc<CudaContext>,
        n: usize,
    ) -> Result<SharedBuf> {
        let (gpu_buf, mem) = gpu.alloc_exportable(n)?;
        ctx.bind_to_thread()
            .map_err(|e| cuda_err(op, rank, "binding the CUDA context", e))?;
        let desc = sys::CUDA_EXTERNAL_MEMORY_HANDLE_DESC {
            type_: sys::CUexternalMemoryHandleType::CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD,
            handle: sys::CUDA_EXTERNAL_MEMORY_HANDLE_DESC_st__bindgen_ty_1 {
                fd: mem.fd().as_raw_fd(),
            },
            size: mem.size(),
            flags: if mem.dedicated() {
                sys::CUDA_EXTERNAL_MEMORY_DEDICATED
            } else {
                0
            },
            reserved: [0; 16],
        };
        let mut ext = MaybeUninit::uninit();
        // SAFETY: a valid descriptor of `mem.size` bytes of opaque-fd memory.
        unsafe { sys::cuImportExternalMemory(ext.as_mut_ptr(), &desc) }
            .result()
            .map_err(|e| {
                cuda_err(
                    op,
                    rank,
                    &format!("importing {} bytes of Vulkan memory into CUDA", mem.size()),
                    e,
                )
            })?;
        let size = mem.size();
        // CUDA owns the descriptor after a successful import.
        let _ = mem.into_fd().into_raw_fd();
        // SAFETY: initialized by the successful call.
        let ext = unsafe { ext.assume_init() };
        // SAFETY: the whole imported range.
        let ptr = match unsafe { result::external_memory::get_mapped_buffer(ext, 0, size) } {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: ours, unmapped.
                let _ = unsafe { result::external_memory::destroy_external_memory(ext) };
                return Err(cuda_err(op, rank, "mapping the imported memory", e));
            }
        };
        Ok(SharedBuf {
            gpu_buf,
            ext,
            ptr,
            ctx: ctx.clone(),
        })
    }

    fn capacity(&self) -> usize {
        self.gpu_buf.len()
    }
}

impl Drop for SharedBuf {
    fn drop(&mut self) {
        // CUDA's view goes first; wgpu frees the Vulkan memory when `gpu_buf` drops after this.
        let _ = self.ctx.bind_to_thread();
        // SAFETY: our own mapping and import, no longer used (leases sync before returning).
        unsafe {
            let _ = result::memory_free(self.ptr);
            let _ = result::external_memory::destroy_external_memory(self.ext);
        }
    }
}

/// The pool of shared buffers of one communicator, on its GPU.
pub(crate) struct Shared {
    pub(crate) gpu: Gpu,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    rank: usize,
    free: Rc<RefCell<Vec<SharedBuf>>>,
}

impl Shared {
    pub(crate) fn new(gpu: Gpu, stream: Arc<CudaStream>, rank: usize) -> Shared {
        Shared {
            gpu,
            ctx: stream.context().clone(),
            stream,
            rank,
            free: Rc::new(RefCell::new(Vec::new())),
        }
    }

    /// A buffer of at least `n` f32 (at least one: NCCL refuses empty buffers on some paths).
    pub(crate) fn lease(&self, op: &'static str, n: usize) -> Result<Lease> {
        let n = n.max(1);
        let found = {
            let mut free = self.free.borrow_mut();
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= n)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i);
            best.map(|i| free.swap_remove(i))
        };
        let buf = match found {
            Some(b) => b,
            None => SharedBuf::new(op, self.rank, &self.gpu, &self.ctx, rounded(n))
                .or_else(|_| SharedBuf::new(op, self.rank, &self.gpu, &self.ctx, n))?,
        };
        Ok(Lease {
            buf: Some(buf),
            len: n,
            free: self.free.clone(),
            stream: self.stream.clone(),
            gpu: self.gpu.clone(),
        })
    }
}

/// A shared buffer lent to one collective; back to the pool when dropped.
pub(crate) struct Lease {
    buf: Option<SharedBuf>,
    len: usize,
    free: Rc<RefCell<Vec<SharedBuf>>>,
    stream: Arc<CudaStream>,
    gpu: Gpu,
}

impl Lease {
    fn buf(&self) -> &SharedBuf {
        self.buf
            .as_ref()
            .expect("a lease holds its buffer until dropped")
    }

    /// The wgpu view of the whole buffer (its capacity may exceed the lease).
    pub(crate) fn gpu_buf(&self) -> &GpuBuf {
        &self.buf().gpu_buf
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // NCCL or wgpu may still be reading or writing it (both queue their work): the buffer is
        // reused only after both have finished (on the success paths they already have, and
        // these waits return at once).
        let _ = self.stream.synchronize();
        let _ = self.gpu.sync();
        if let Some(b) = self.buf.take() {
            let mut free = self.free.borrow_mut();
            free.push(b);
            free.sort_by_key(|b| std::cmp::Reverse(b.capacity()));
            free.truncate(KEEP);
            while free.len() > 1
                && free.iter().map(|b| b.capacity() * 4).sum::<usize>() > KEEP_BYTES
            {
                free.remove(0);
            }
        }
    }
}

/// A device buffer NCCL works on: a plain CUDA allocation (host staging) or a shared one.
pub(crate) enum DevBuf {
    /// Allocated by CUDA; filled from and read back to the host.
    Cuda(CudaSlice<f32>),
    /// Exported by wgpu, imported into CUDA.
    Shared(Lease),
}

impl DeviceSlice<f32> for DevBuf {
    fn len(&self) -> usize {
        match self {
            DevBuf::Cuda(s) => s.len(),
            DevBuf::Shared(l) => l.len,
        }
    }

    fn stream(&self) -> &Arc<CudaStream> {
        match self {
            DevBuf::Cuda(s) => s.stream(),
            DevBuf::Shared(l) => &l.stream,
        }
    }
}

impl DevicePtr<f32> for DevBuf {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        match self {
            DevBuf::Cuda(s) => s.device_ptr(stream),
            // The communicator orders shared buffers itself (see the module docs), always on the
            // lease's stream.
            DevBuf::Shared(l) => {
                debug_assert!(std::ptr::eq(stream, &*l.stream));
                (l.buf().ptr, SyncOnDrop::Sync(None))
            }
        }
    }
}

impl DevicePtrMut<f32> for DevBuf {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        match self {
            DevBuf::Cuda(s) => s.device_ptr_mut(stream),
            DevBuf::Shared(l) => {
                debug_assert!(std::ptr::eq(stream, &*l.stream));
                (l.buf().ptr, SyncOnDrop::Sync(None))
            }
        }
    }
}

/// `len` elements of a [`DevBuf`] from `start`: what one NCCL send reads (or one download).
pub(crate) struct Part<'a> {
    pub(crate) buf: &'a DevBuf,
    pub(crate) start: usize,
    pub(crate) len: usize,
}

impl<'a> Part<'a> {
    /// The region, or an error if it does not lie inside the buffer.
    pub(crate) fn new(buf: &'a DevBuf, start: usize, len: usize) -> Result<Part<'a>> {
        // Empty regions are never sent or read; a buffer holds at least one element.
        let inside = len == 0 || start.checked_add(len).is_some_and(|e| e <= buf.len());
        if !inside {
            return Err(Error::Nccl {
                op: "send",
                rank: None,
                detail: format!(
                    "region {start}..{start}+{len} outside a buffer of {}",
                    buf.len()
                ),
            });
        }
        Ok(Part { buf, start, len })
    }
}

impl DeviceSlice<f32> for Part<'_> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.buf.stream()
    }
}

impl DevicePtr<f32> for Part<'_> {
    fn device_ptr<'b>(&'b self, stream: &'b CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        let (ptr, sync) = self.buf.device_ptr(stream);
        (ptr + (self.start * std::mem::size_of::<f32>()) as u64, sync)
    }
}
