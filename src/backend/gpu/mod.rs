//! The WGSL compute backend on wgpu (Vulkan / Metal / DX12 natively, WebGPU in a browser).
//!
//! [`Gpu`] owns the device and queue and compiles each kernel once; [`GpuBuf`] is a buffer of f32
//! on it. Kernels live in `shaders/`, one WGSL file per family, each kernel with a bounds guard,
//! and each family is dispatched from the file of its name here: `elementwise.rs`
//! (`shaders/elementwise.wgsl`: binary ops with broadcasting, unary ops), `reduce.rs`
//! (`reduce.wgsl`: reduce-into, sums), `copy.rs` (`copy.wgsl`: flat and strided copies),
//! `matmul.rs` (`matmul.wgsl`); `export.rs` allocates memory CUDA can import. This file holds
//! the device, buffers, uploads and readbacks, the pipeline cache and the op codes every family
//! shares. The device setup is apart from the work so tests can inject it.
//!
//! [`crate::Tensor`]s hold `GpuBuf`s (`Tensor::to_device`), and every tensor op runs here; the
//! reducing collectives fold received data in here too (`collective::partial`).
//!
//! Buffers may be as large as the device's largest buffer; kernels bind at most the storage-binding
//! limit (128 MiB on lavapipe), so elementwise ops, reduce-into, copies and sums over larger
//! buffers run window by window ([`Gpu::window_elems`]); the others say so with an error.
//!
//! Bit-exactness: add, sub, mul, max, min, eq and the reduce-into step use the same single IEEE
//! operation per element as the CPU backend and match it bit for bit on normal numbers (GPUs may
//! flush denormals). Division, tanh, sums and matmul are within a stated tolerance (WGSL allows
//! 2.5 ulp for division; sums and matmul add in a different order).

// wgpu's WebGPU types are neither Send nor Sync on wasm32 (one thread there); the Arcs are shared
// across threads natively.
#![cfg_attr(target_arch = "wasm32", allow(clippy::arc_with_non_send_sync))]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use wgpu::util::DeviceExt;

use super::{BinaryOp, UnaryOp};
use crate::error::{Error, Result};

mod copy;
mod elementwise;
#[cfg(target_os = "linux")]
mod export;
mod matmul;
mod reduce;
#[cfg(target_os = "linux")]
pub use export::Exported;
#[cfg(all(target_os = "linux", feature = "native-nccl"))]
pub(crate) use export::hex;

/// Workgroup size of the 1-D kernels (must match the WGSL).
const WG: u32 = 256;
/// Most workgroups along one dispatch dimension.
const MAX_GROUPS: u32 = 65535;
/// Usage of every storage buffer.
const STORAGE_USAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

struct Ctx {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    limits: wgpu::Limits,
    pipelines: Mutex<HashMap<(Kernel, u32), Arc<wgpu::ComputePipeline>>>,
    error: Arc<Mutex<Option<String>>>,
    read_back: std::sync::atomic::AtomicU64,
    uploaded: std::sync::atomic::AtomicU64,
}

/// How the vec4 reduce-into kernels and the sum spread their work over invocations (reduce-into:
/// the same operations on every element either way, so the results are identical; the sum adds in
/// a different order, within its stated tolerance).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Vec4Layout {
    /// `Runs` on a CPU adapter (lavapipe), `GridStride` on any other.
    Auto,
    /// Grid-stride loop: neighbouring invocations touch neighbouring vec4s (coalesced on a GPU).
    GridStride,
    /// Each invocation folds its own run of consecutive vec4s (fast on a CPU rasterizer).
    Runs,
}

/// How a contiguous device-to-device copy runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyPath {
    /// `Kernel` on a discrete GPU, `Engine` on any other adapter. On an NVIDIA H200 (Vulkan,
    /// driver 580) the buffer-to-buffer copy moved 0.1-0.2x of CUDA's device copy bandwidth and
    /// the kernel about 0.9x (`distgrad bench kernels`, results/h200-2026-12-04).
    Auto,
    /// The queue's buffer-to-buffer copy (no shader, no binding limit).
    Engine,
    /// A copy kernel, in chunks that fit one storage binding.
    Kernel,
}

/// A wgpu device ready to run distgrad's kernels. Cheap to clone (shared).
#[derive(Clone)]
pub struct Gpu(Arc<Ctx>);

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({})", self.describe())
    }
}

impl PartialEq for Gpu {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Where a strided region starts in a buffer and how it steps along each dimension (elements).
#[derive(Debug, Clone, Copy)]
pub struct At<'a> {
    /// First element.
    pub offset: usize,
    /// Step per dimension.
    pub strides: &'a [usize],
}

/// A buffer of f32 on a [`Gpu`].
#[derive(Clone)]
pub struct GpuBuf {
    buf: Arc<BufCell>,
    len: usize,
    gpu: Gpu,
}

/// A device buffer, or host bytes that become one the first time anything uses it
/// ([`Gpu::upload_lazy`]): a tensor uploaded from the host that no kernel ever reads (a gradient
/// that only goes on to a collective over host links, a backward seed) never costs an upload. It
/// dereferences to the buffer, making it on first use.
struct BufCell {
    cell: std::sync::OnceLock<wgpu::Buffer>,
    /// The values of a buffer made on first use, until then (`None` for one made at once): the
    /// host memory goes with the upload.
    pending: Mutex<Option<bytes::Bytes>>,
    gpu: Gpu,
}

impl std::ops::Deref for BufCell {
    type Target = wgpu::Buffer;

    fn deref(&self) -> &wgpu::Buffer {
        self.cell.get_or_init(|| {
            let bytes = self
                .pending
                .lock()
                .map(|mut p| p.take())
                .unwrap_or_else(|poisoned| poisoned.into_inner().take())
                .unwrap_or_default();
            self.gpu.create_init("upload", &bytes)
        })
    }
}

impl std::fmt::Debug for GpuBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuBuf({} f32 on {})", self.len, self.gpu.describe())
    }
}

impl GpuBuf {
    /// Number of f32 elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device holding it.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Whether the buffer exists on the device: false for a lazy upload ([`Gpu::upload_lazy`])
    /// that nothing has used yet, whose values are still only in host memory.
    pub fn is_on_device(&self) -> bool {
        self.buf.cell.get().is_some()
    }
}

fn gpu_err(op: &'static str, detail: impl Into<String>) -> Error {
    Error::Gpu {
        op,
        detail: detail.into(),
    }
}

/// Every kernel, by entry point. Each belongs to one shader family (one WGSL file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kernel {
    Binary,
    Unary,
    ReduceInto,
    ReduceInto4,
    FoldInto4,
    SumPartials,
    SumRuns,
    SumTo,
    CopyStrided,
    CopyFlat,
    Matmul,
}

impl Kernel {
    fn entry(self) -> &'static str {
        match self {
            Kernel::Binary => "binary",
            Kernel::Unary => "unary",
            Kernel::ReduceInto => "reduce_into",
            Kernel::ReduceInto4 => "reduce_into_vec4",
            Kernel::FoldInto4 => "fold_into_vec4",
            Kernel::SumPartials => "sum_partials",
            Kernel::SumRuns => "sum_runs",
            Kernel::SumTo => "sum_to",
            Kernel::CopyStrided => "copy_strided",
            Kernel::CopyFlat => "copy_flat",
            Kernel::Matmul => "matmul",
        }
    }

    /// (file name, WGSL source with the shared helpers prepended).
    fn source(self) -> (&'static str, String) {
        let common = include_str!("../../../shaders/common.wgsl");
        let (file, src) = match self {
            Kernel::Binary | Kernel::Unary => (
                "elementwise.wgsl",
                include_str!("../../../shaders/elementwise.wgsl"),
            ),
            Kernel::ReduceInto
            | Kernel::ReduceInto4
            | Kernel::FoldInto4
            | Kernel::SumPartials
            | Kernel::SumRuns
            | Kernel::SumTo => ("reduce.wgsl", include_str!("../../../shaders/reduce.wgsl")),
            Kernel::CopyStrided | Kernel::CopyFlat => {
                ("copy.wgsl", include_str!("../../../shaders/copy.wgsl"))
            }
            Kernel::Matmul => ("matmul.wgsl", include_str!("../../../shaders/matmul.wgsl")),
        };
        (file, format!("{}{common}\n{src}", op_constants()))
    }
}

impl Gpu {
    /// Open the best adapter (high-performance preference). Errors say why none is usable.
    pub async fn new() -> Result<Gpu> {
        #[cfg(target_arch = "wasm32")]
        let desc = {
            let mut d = wgpu::InstanceDescriptor::new_without_display_handle();
            d.backends = wgpu::Backends::BROWSER_WEBGPU;
            d
        };
        #[cfg(not(target_arch = "wasm32"))]
        let desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
        let instance = wgpu::Instance::new(desc);
        let adapter = instance
            .request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                ..Default::default()
            })
            .await
            .map_err(|e| gpu_err("adapter", format!("no GPU adapter: {e}")))?;
        Self::open(adapter).await
    }

    /// Open a device on `adapter` with the adapter's own limits.
    async fn open(adapter: wgpu::Adapter) -> Result<Gpu> {
        let limits = adapter.limits();
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("distgrad"),
                // Memory shared with CUDA (the NCCL target), where the driver offers it.
                required_features: adapter.features() & wgpu::Features::VULKAN_EXTERNAL_MEMORY_FD,
                required_limits: limits.clone(),
                ..Default::default()
            })
            .await
            .map_err(|e| {
                gpu_err(
                    "device",
                    format!("cannot open {}: {e}", adapter.get_info().name),
                )
            })?;
        let error = Arc::new(Mutex::new(None));
        let sink = error.clone();
        // wgpu's default reaction to an uncaptured error is a panic; record it and fail the op instead.
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut slot = sink.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert_with(|| e.to_string());
        }));
        Ok(Gpu(Arc::new(Ctx {
            device,
            queue,
            info: adapter.get_info(),
            limits,
            pipelines: Mutex::new(HashMap::new()),
            error,
            read_back: std::sync::atomic::AtomicU64::new(0),
            uploaded: std::sync::atomic::AtomicU64::new(0),
        })))
    }

    /// Whether the adapter is a software rasterizer on the CPU (lavapipe, SwiftShader): kernels
    /// there compete with the host for the same cores.
    pub fn is_software(&self) -> bool {
        self.0.info.device_type == wgpu::DeviceType::Cpu
    }

    /// `name (backend, device type[, driver])` of the adapter: the driver's own version string
    /// where it gives one (e.g. `Mesa 22.3.6 (LLVM 15.0.6)` for lavapipe), since kernel figures
    /// depend on it.
    pub fn describe(&self) -> String {
        let i = &self.0.info;
        let name = if i.name.is_empty() {
            "unnamed adapter"
        } else {
            &i.name
        };
        let driver = if i.driver_info.is_empty() {
            String::new()
        } else {
            format!(", {}", i.driver_info)
        };
        format!("{name} ({:?}, {:?}{driver})", i.backend, i.device_type)
    }

    /// The adapter's limits in force.
    pub fn limits(&self) -> &wgpu::Limits {
        &self.0.limits
    }

    fn check(&self, op: &'static str) -> Result<()> {
        let mut slot = self.0.error.lock().unwrap_or_else(|p| p.into_inner());
        match slot.take() {
            Some(e) => Err(gpu_err(op, e)),
            None => Ok(()),
        }
    }

    fn pipeline(&self, k: Kernel) -> Arc<wgpu::ComputePipeline> {
        self.pipeline_op(k, None)
    }

    /// The pipeline of `entry`, with the override constant `OP` fixed to `op` if given.
    fn pipeline_op(&self, k: Kernel, op: Option<u32>) -> Arc<wgpu::ComputePipeline> {
        let mut cache = self.0.pipelines.lock().unwrap_or_else(|p| p.into_inner());
        cache
            .entry((k, op.unwrap_or(u32::MAX)))
            .or_insert_with(|| {
                let constants: Vec<(&str, f64)> = op.iter().map(|&o| ("OP", o as f64)).collect();
                let (file, src) = k.source();
                let entry = k.entry();
                let module = self
                    .0
                    .device
                    .create_shader_module(wgpu::ShaderModuleDescriptor {
                        label: Some(file),
                        source: wgpu::ShaderSource::Wgsl(src.into()),
                    });
                Arc::new(
                    self.0
                        .device
                        .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                            label: Some(entry),
                            layout: None,
                            module: &module,
                            entry_point: Some(entry),
                            compilation_options: wgpu::PipelineCompilationOptions {
                                constants: &constants,
                                ..Default::default()
                            },
                            cache: None,
                        }),
                )
            })
            .clone()
    }

    fn check_size(&self, op: &'static str, n: usize) -> Result<u64> {
        // u32 first: the kernels index with u32, and it keeps the byte count from overflowing a
        // 32-bit usize (wasm32).
        let n32 = u32::try_from(n).map_err(|_| {
            gpu_err(
                op,
                format!("{n} elements exceed the kernels' 32-bit indices"),
            )
        })?;
        let bytes = u64::from(n32.max(1)) * 4;
        let max = self.0.limits.max_buffer_size;
        if bytes > max {
            return Err(gpu_err(
                op,
                format!("{bytes} bytes exceed the device's largest buffer ({max} bytes)"),
            ));
        }
        Ok(bytes)
    }

    /// Most elements one binding of a storage buffer may cover: the device's storage-binding limit
    /// (128 MiB on lavapipe), rounded down to the binding-offset alignment so that windows of a
    /// larger buffer start at legal offsets. Kernels over larger buffers run window by window.
    pub fn window_elems(&self) -> usize {
        let lim = self.0.limits.max_storage_buffer_binding_size;
        let align = u64::from(self.0.limits.min_storage_buffer_offset_alignment).max(16);
        usize::try_from((lim / align) * align / 4).unwrap_or(usize::MAX)
    }

    /// `[start, start+len)` windows of at most [`Gpu::window_elems`] covering `n` elements (one
    /// empty window for `n == 0`).
    fn windows(&self, n: usize) -> Vec<(usize, usize)> {
        let w = self.window_elems().max(4);
        if n <= w {
            return vec![(0, n)];
        }
        (0..n).step_by(w).map(|s| (s, w.min(n - s))).collect()
    }

    /// Fail with a clear error if a kernel that binds whole buffers gets one above the binding
    /// limit (the windowed kernels are elementwise, reduce-into, copies and sums).
    fn require_bindable(&self, op: &'static str, bufs: &[&GpuBuf]) -> Result<()> {
        let w = self.window_elems();
        match bufs.iter().find(|b| b.len > w) {
            Some(b) => Err(gpu_err(
                op,
                format!(
                    "a buffer of {} elements is above the device's storage binding limit of {w} \
                     elements; {op} is not split into windows (elementwise ops on equal shapes, \
                     reduce-into, copies and sums are)",
                    b.len
                ),
            )),
            None => Ok(()),
        }
    }

    fn storage(&self, op: &'static str, n: usize) -> Result<GpuBuf> {
        let size = self.check_size(op, n)?;
        let buf = self.0.device.create_buffer(&Self::storage_desc(op, size));
        self.buf_of(op, buf, n)
    }

    /// How every storage buffer of distgrad is made (kernels bind it, copies go both ways).
    fn storage_desc(label: &str, size: u64) -> wgpu::BufferDescriptor<'_> {
        wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: STORAGE_USAGE,
            mapped_at_creation: false,
        }
    }

    /// A [`GpuBuf`] of `n` f32 in `buf`, once the device reported no error making it.
    fn buf_of(&self, op: &'static str, buf: wgpu::Buffer, n: usize) -> Result<GpuBuf> {
        self.check(op)?;
        let cell = std::sync::OnceLock::new();
        let _ = cell.set(buf);
        Ok(GpuBuf {
            buf: Arc::new(BufCell {
                cell,
                pending: Mutex::new(None),
                gpu: self.clone(),
            }),
            len: n,
            gpu: self.clone(),
        })
    }

    /// A buffer holding `bytes` (little-endian f32, as [`Gpu::upload_le_bytes`] takes them), made
    /// the first time a kernel, copy or readback uses it: until then it costs no device memory and
    /// no transfer. `bytes` are shared, not copied. (A device error making it shows at the next
    /// check, as any kernel's.)
    pub fn upload_lazy(&self, bytes: bytes::Bytes) -> Result<GpuBuf> {
        let n = self.upload_len(bytes.len())?;
        Ok(GpuBuf {
            buf: Arc::new(BufCell {
                cell: std::sync::OnceLock::new(),
                pending: Mutex::new(Some(bytes)),
                gpu: self.clone(),
            }),
            len: n,
            gpu: self.clone(),
        })
    }

    /// The f32 count of `bytes` bytes to upload, checked: whole f32s, within the device's limits.
    fn upload_len(&self, bytes: usize) -> Result<usize> {
        if !bytes.is_multiple_of(4) {
            return Err(gpu_err(
                "upload",
                format!("{bytes} bytes are not whole f32s"),
            ));
        }
        let n = bytes / 4;
        self.check_size("upload", n)?;
        Ok(n)
    }

    /// A new storage buffer holding `bytes` (at least one element's worth of space), counted in
    /// [`Gpu::bytes_uploaded`].
    fn create_init(&self, label: &str, bytes: &[u8]) -> wgpu::Buffer {
        self.0
            .uploaded
            .fetch_add(bytes.len() as u64, std::sync::atomic::Ordering::Relaxed);
        let contents: &[u8] = if bytes.is_empty() { &[0u8; 4] } else { bytes };
        self.0
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents,
                usage: STORAGE_USAGE,
            })
    }

    /// Wait until all submitted work has finished (native; in a browser reads are the only sync).
    pub fn sync(&self) -> Result<()> {
        #[cfg(not(target_arch = "wasm32"))]
        self.0
            .device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| gpu_err("sync", format!("device poll failed: {e}")))?;
        self.check("sync")
    }

    /// Copy host values to a new device buffer.
    pub fn upload(&self, data: &[f32]) -> Result<GpuBuf> {
        self.upload_le_bytes(bytemuck::cast_slice(data))
    }

    /// Copy little-endian f32 bytes (e.g. a received message, whatever its alignment) to a new
    /// device buffer, with no host-side conversion.
    pub fn upload_le_bytes(&self, bytes: &[u8]) -> Result<GpuBuf> {
        let n = self.upload_len(bytes.len())?;
        let buf = self.create_init("upload", bytes);
        self.buf_of("upload", buf, n)
    }

    /// Bytes read back from this device to the host so far (every readback counts): how tests
    /// check that tensors leave the GPU only at the transport boundary.
    pub fn bytes_read_back(&self) -> u64 {
        self.0.read_back.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes uploaded from the host to this device so far (a lazy upload counts when it is made):
    /// how tests check that a tensor no kernel reads never goes to the device.
    pub fn bytes_uploaded(&self) -> u64 {
        self.0.uploaded.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Copy `b` into a new mappable staging buffer (the first half of every readback).
    fn stage(&self, b: &GpuBuf) -> wgpu::Buffer {
        let size = (b.len * 4) as u64;
        self.0
            .read_back
            .fetch_add(size, std::sync::atomic::Ordering::Relaxed);
        let staging = self.0.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self.0.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(&b.buf, 0, &staging, 0, size);
        self.0.queue.submit([enc.finish()]);
        staging
    }

    /// Copy a mapped staging buffer's values out and unmap it (the second half of a readback).
    fn unstage(&self, staging: &wgpu::Buffer) -> Result<Vec<f32>> {
        let out = {
            let view = staging
                .get_mapped_range(..)
                .map_err(|e| gpu_err("read", format!("mapped range: {e}")))?;
            bytemuck::cast_slice::<u8, f32>(&view).to_vec()
        };
        staging.unmap();
        self.check("read")?;
        Ok(out)
    }

    /// Read a buffer back to the host, blocking this thread on the device (native only; no async
    /// executor involved, so it may be called from inside one).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_blocking(&self, b: &GpuBuf) -> Result<Vec<f32>> {
        if b.len == 0 {
            return Ok(Vec::new());
        }
        let staging = self.stage(b);
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        // Another thread polling the same device may be the one that runs our callback, so wait
        // for it (polling again meanwhile) rather than assume our own poll ran it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let mut wait = wgpu::PollType::wait_indefinitely();
        let mapped = loop {
            self.0
                .device
                .poll(wait)
                .map_err(|e| gpu_err("read", format!("device poll failed: {e}")))?;
            wait = wgpu::PollType::Poll;
            match rx.recv_timeout(std::time::Duration::from_millis(5)) {
                Ok(r) => break r,
                Err(_) if std::time::Instant::now() < deadline => continue,
                Err(_) => {
                    return Err(gpu_err(
                        "read",
                        "the readback never completed (device lost?)",
                    ));
                }
            }
        };
        mapped.map_err(|e| gpu_err("read", format!("cannot map the readback buffer: {e}")))?;
        self.unstage(&staging)
    }

    /// Read a buffer back to the host.
    pub async fn read(&self, b: &GpuBuf) -> Result<Vec<f32>> {
        if b.len == 0 {
            return Ok(Vec::new());
        }
        let staging = self.stage(b);
        let (tx, rx) = futures::channel::oneshot::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        #[cfg(not(target_arch = "wasm32"))]
        self.0
            .device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| gpu_err("read", format!("device poll failed: {e}")))?;
        rx.await
            .map_err(|_| gpu_err("read", "map callback dropped (device lost?)"))?
            .map_err(|e| gpu_err("read", format!("cannot map the readback buffer: {e}")))?;
        self.unstage(&staging)
    }

    fn meta(&self, words: &[u32]) -> wgpu::Buffer {
        self.0
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("meta"),
                contents: bytemuck::cast_slice(words),
                usage: wgpu::BufferUsages::STORAGE,
            })
    }

    /// Run `entry` over `threads` invocations of a 256-wide 1-D kernel (2-D grid when needed).
    /// Bindings are `(binding index, resource)`: with automatic layouts a kernel's layout holds
    /// only the bindings its entry point uses.
    fn run(
        &self,
        k: Kernel,
        bindings: &[(u32, wgpu::BindingResource<'_>)],
        groups: u32,
    ) -> Result<()> {
        self.run_op(k, None, bindings, groups)
    }

    fn run_op(
        &self,
        k: Kernel,
        op: Option<u32>,
        bindings: &[(u32, wgpu::BindingResource<'_>)],
        groups: u32,
    ) -> Result<()> {
        if groups == 0 {
            return Ok(());
        }
        let entry = k.entry();
        let p = self.pipeline_op(k, op);
        let layout = p.get_bind_group_layout(0);
        let entries: Vec<wgpu::BindGroupEntry<'_>> = bindings
            .iter()
            .map(|(i, r)| wgpu::BindGroupEntry {
                binding: *i,
                resource: r.clone(),
            })
            .collect();
        let bg = self.0.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(entry),
            layout: &layout,
            entries: &entries,
        });
        let (x, y) = if groups <= MAX_GROUPS {
            (groups, 1)
        } else {
            (MAX_GROUPS, groups.div_ceil(MAX_GROUPS))
        };
        let mut enc = self.0.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(&p);
            pass.set_bind_group(0, &bg, &[]);
            pass.dispatch_workgroups(x, y, 1);
        }
        self.0.queue.submit([enc.finish()]);
        self.check(entry)
    }

    fn groups(n: usize, per_thread: usize) -> u32 {
        (n.div_ceil(per_thread)).div_ceil(WG as usize) as u32
    }

    /// A new buffer of `n` elements, contents unspecified (to be filled by copies).
    pub fn alloc(&self, n: usize) -> Result<GpuBuf> {
        self.storage("alloc", n)
    }
}

/// Elements `start..start+len` of `b` as a binding (the whole buffer when that is all of it, so
/// empty buffers, which hold one padding element, bind too).
fn part(b: &GpuBuf, start: usize, len: usize) -> wgpu::BindingResource<'_> {
    if start == 0 && len == b.len {
        return b.buf.as_entire_binding();
    }
    wgpu::BindingResource::Buffer(wgpu::BufferBinding {
        buffer: &b.buf,
        offset: (start * 4) as u64,
        size: std::num::NonZeroU64::new((len.max(1) * 4) as u64),
    })
}

/// Whether every index `offset + Σ idx·strides` of a non-empty `shape` region lies in `buf`.
fn fits(buf: &GpuBuf, offset: usize, shape: &[usize], strides: &[usize]) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let last = shape
        .iter()
        .zip(strides)
        .try_fold(offset, |acc, (&s, &st)| {
            (s - 1).checked_mul(st).and_then(|x| acc.checked_add(x))
        });
    matches!(last, Some(l) if l < buf.len && u32::try_from(l).is_ok())
}

/// The op codes the kernels switch on, with their WGSL names: one table for both sides. The
/// shaders see them as constants ([`op_constants`], prepended to every kernel's source), so a
/// code means the same op on both sides by construction, and the exhaustive matches here give
/// every op a code.
fn binary_code(op: BinaryOp) -> (u32, &'static str) {
    match op {
        BinaryOp::Add => (0, "OP_ADD"),
        BinaryOp::Sub => (1, "OP_SUB"),
        BinaryOp::Mul => (2, "OP_MUL"),
        BinaryOp::Div => (3, "OP_DIV"),
        BinaryOp::Max => (4, "OP_MAX"),
        BinaryOp::Min => (5, "OP_MIN"),
        BinaryOp::Eq => (6, "OP_EQ"),
    }
}

fn op_code(op: BinaryOp) -> u32 {
    binary_code(op).0
}

/// [`binary_code`] for the unary ops (the scale's factor travels beside the code).
fn unary_code(op: UnaryOp) -> (u32, &'static str) {
    match op {
        UnaryOp::Neg => (0, "UN_NEG"),
        UnaryOp::Scale(_) => (1, "UN_SCALE"),
        UnaryOp::Relu => (2, "UN_RELU"),
        UnaryOp::Step => (3, "UN_STEP"),
        UnaryOp::Tanh => (4, "UN_TANH"),
        UnaryOp::Square => (5, "UN_SQUARE"),
    }
}

/// The WGSL constants of every op code (`const OP_ADD: u32 = 0u;` ...).
fn op_constants() -> String {
    let binary = BinaryOp::ALL.map(binary_code);
    let unary = UnaryOp::ALL.map(unary_code);
    binary
        .iter()
        .chain(&unary)
        .map(|(code, name)| format!("const {name}: u32 = {code}u;\n"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each family's codes are distinct and its `ALL` lists every op (the exhaustive matches give
    /// each op a code, so as many distinct codes as ops means none is left out), and every
    /// kernel's source declares the constants it switches on.
    #[test]
    fn op_codes_are_one_table() {
        let distinct = |codes: Vec<(u32, &str)>| {
            let mut c: Vec<u32> = codes.iter().map(|x| x.0).collect();
            let mut n: Vec<&str> = codes.iter().map(|x| x.1).collect();
            c.sort_unstable();
            c.dedup();
            n.sort_unstable();
            n.dedup();
            (c.len(), n.len())
        };
        assert_eq!(distinct(BinaryOp::ALL.map(binary_code).to_vec()), (7, 7));
        assert_eq!(distinct(UnaryOp::ALL.map(unary_code).to_vec()), (6, 6));
        let consts = op_constants();
        assert!(consts.contains("const OP_EQ: u32 = 6u;"), "{consts}");
        assert!(consts.contains("const UN_SQUARE: u32 = 5u;"), "{consts}");
        for k in [Kernel::Binary, Kernel::Unary, Kernel::ReduceInto4] {
            assert!(k.source().1.starts_with(&consts), "{:?}", k.entry());
        }
    }
}
