//! The WGSL compute backend on wgpu (Vulkan / Metal / DX12 natively, WebGPU in a browser).
//!
//! [`Gpu`] owns the device and queue and compiles each kernel once; [`GpuBuf`] is a buffer of f32
//! on it. Kernels live in `shaders/` (one file per family, each kernel with a bounds guard) and are
//! dispatched from here: the device setup is apart from the work so tests can inject it.
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

#[cfg(target_os = "linux")]
mod export;
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
    buf: Arc<wgpu::Buffer>,
    len: usize,
    gpu: Gpu,
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
            Kernel::SumTo => "sum_to",
            Kernel::CopyStrided => "copy_strided",
            Kernel::CopyFlat => "copy_flat",
            Kernel::Matmul => "matmul",
        }
    }

    /// (file name, WGSL source with the shared helpers prepended).
    fn source(self) -> (&'static str, String) {
        let common = include_str!("../../shaders/common.wgsl");
        let (file, src) = match self {
            Kernel::Binary | Kernel::Unary => (
                "elementwise.wgsl",
                include_str!("../../shaders/elementwise.wgsl"),
            ),
            Kernel::ReduceInto
            | Kernel::ReduceInto4
            | Kernel::FoldInto4
            | Kernel::SumPartials
            | Kernel::SumTo => ("reduce.wgsl", include_str!("../../shaders/reduce.wgsl")),
            Kernel::CopyStrided | Kernel::CopyFlat => {
                ("copy.wgsl", include_str!("../../shaders/copy.wgsl"))
            }
            Kernel::Matmul => ("matmul.wgsl", include_str!("../../shaders/matmul.wgsl")),
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
        })))
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
        Ok(GpuBuf {
            buf: Arc::new(buf),
            len: n,
            gpu: self.clone(),
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
        if !bytes.len().is_multiple_of(4) {
            return Err(gpu_err(
                "upload",
                format!("{} bytes are not whole f32s", bytes.len()),
            ));
        }
        let n = bytes.len() / 4;
        self.check_size("upload", n)?;
        let contents: &[u8] = if bytes.is_empty() { &[0u8; 4] } else { bytes };
        let buf = self
            .0
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("upload"),
                contents,
                usage: STORAGE_USAGE,
            });
        self.buf_of("upload", buf, n)
    }

    /// Copy `n` elements of `src` starting at `src_start` into `dst` at `dst_start`, on the device
    /// (queued like the kernels, so ordered with them; [`CopyPath::Auto`] picks how).
    pub fn copy_range(
        &self,
        src: &GpuBuf,
        src_start: usize,
        dst: &GpuBuf,
        dst_start: usize,
        n: usize,
    ) -> Result<()> {
        self.copy_range_in(CopyPath::Auto, src, src_start, dst, dst_start, n)
    }

    /// [`Gpu::copy_range`] by the given path (tests and `distgrad bench kernels` compare them;
    /// the bytes are the same either way). Source and destination must be two buffers.
    pub fn copy_range_in(
        &self,
        path: CopyPath,
        src: &GpuBuf,
        src_start: usize,
        dst: &GpuBuf,
        dst_start: usize,
        n: usize,
    ) -> Result<()> {
        let fits = |start: usize, len: usize| start.checked_add(n).is_some_and(|end| end <= len);
        if !fits(src_start, src.len) || !fits(dst_start, dst.len) {
            return Err(gpu_err(
                "copy_range",
                format!(
                    "{n} elements from {src_start} of {} into {dst_start} of {}",
                    src.len, dst.len
                ),
            ));
        }
        if Arc::ptr_eq(&src.buf, &dst.buf) {
            return Err(gpu_err(
                "copy_range",
                "source and destination are the same buffer (WebGPU copies between two buffers)",
            ));
        }
        self.copy_contiguous(path, src, src_start, dst, dst_start, n)?;
        self.check("copy_range")
    }

    /// Bytes read back from this device to the host so far (every readback counts): how tests
    /// check that tensors leave the GPU only at the transport boundary.
    pub fn bytes_read_back(&self) -> u64 {
        self.0.read_back.load(std::sync::atomic::Ordering::Relaxed)
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

    /// `op(a, b)` with broadcasting: `strides` are (out shape, a strides, b strides), all of the
    /// output's rank (≤ 8), or `None` when the shapes are equal.
    pub fn binary(
        &self,
        op: BinaryOp,
        a: &GpuBuf,
        b: &GpuBuf,
        n: usize,
        strides: Option<(&[usize], &[usize], &[usize])>,
    ) -> Result<GpuBuf> {
        match strides {
            None if a.len != n || b.len != n => {
                return Err(gpu_err(
                    "binary",
                    format!(
                        "operands of {} and {} elements for {n} outputs",
                        a.len, b.len
                    ),
                ));
            }
            Some((shape, sa, sb)) => {
                let ok = sa.len() == shape.len()
                    && sb.len() == shape.len()
                    && shape.iter().product::<usize>() == n
                    && fits(a, 0, shape, sa)
                    && fits(b, 0, shape, sb);
                if !ok {
                    return Err(gpu_err(
                        "binary",
                        format!(
                            "strides {sa:?} / {sb:?} do not fit shape {shape:?} over buffers of {} and {}",
                            a.len, b.len
                        ),
                    ));
                }
            }
            None => {}
        }
        let out = self.storage("binary", n)?;
        let Some((shape, sa, sb)) = strides else {
            // Equal shapes: window by window over buffers of any size.
            for (st, len) in self.windows(n) {
                let m = self.meta(&[len as u32, op_code(op), 0, 0]);
                self.run(
                    Kernel::Binary,
                    &[
                        (0, part(a, st, len)),
                        (1, part(b, st, len)),
                        (2, part(&out, st, len)),
                        (3, m.as_entire_binding()),
                    ],
                    Self::groups(len, 1),
                )?;
            }
            return Ok(out);
        };
        self.require_bindable("binary", &[a, b, &out])?;
        if shape.len() > 8 {
            return Err(gpu_err("binary", format!("rank {} above 8", shape.len())));
        }
        let mut meta = vec![0u32; 28];
        meta[0] = n as u32;
        meta[1] = op_code(op);
        meta[2] = shape.len() as u32;
        for (d, ((&s, &x), &y)) in shape.iter().zip(sa).zip(sb).enumerate() {
            meta[4 + d] = s as u32;
            meta[12 + d] = x as u32;
            meta[20 + d] = y as u32;
        }
        let m = self.meta(&meta);
        self.run(
            Kernel::Binary,
            &[
                (0, a.buf.as_entire_binding()),
                (1, b.buf.as_entire_binding()),
                (2, out.buf.as_entire_binding()),
                (3, m.as_entire_binding()),
            ],
            Self::groups(n, 1),
        )?;
        Ok(out)
    }

    /// `op(a)` elementwise.
    pub fn unary(&self, op: UnaryOp, a: &GpuBuf) -> Result<GpuBuf> {
        let out = self.storage("unary", a.len)?;
        let code = unary_code(op).0;
        let c = match op {
            UnaryOp::Scale(c) => c,
            _ => 0.0,
        };
        for (st, len) in self.windows(a.len) {
            let m = self.meta(&[len as u32, code, c.to_bits()]);
            self.run(
                Kernel::Unary,
                &[
                    (0, part(a, st, len)),
                    (2, part(&out, st, len)),
                    (3, m.as_entire_binding()),
                ],
                Self::groups(len, 1),
            )?;
        }
        Ok(out)
    }

    /// `acc[i] = op(acc[i], x[i])` in place: the local step of every reducing collective
    /// ([`Gpu::reduce_into_many`] with one input).
    pub fn reduce_into(&self, op: BinaryOp, acc: &GpuBuf, x: &GpuBuf) -> Result<()> {
        self.reduce_into_many(op, acc, &[x])
    }

    /// `acc = op(..op(op(acc, xs[0]), xs[1]).., xs[k-1])` in place: several inputs folded in with
    /// one pass over memory per three inputs (bitwise the same as [`Gpu::reduce_into`] with each
    /// input in turn): the local step that reduces many ranks' contributions at once.
    pub fn reduce_into_many(&self, op: BinaryOp, acc: &GpuBuf, xs: &[&GpuBuf]) -> Result<()> {
        self.reduce_into_many_in(Vec4Layout::Auto, op, acc, xs)
    }

    /// [`Gpu::reduce_into_many`] with the kernels' thread layout chosen by the caller (tests and
    /// `distgrad bench kernels` compare them; the result is the same either way).
    pub fn reduce_into_many_in(
        &self,
        layout: Vec4Layout,
        op: BinaryOp,
        acc: &GpuBuf,
        xs: &[&GpuBuf],
    ) -> Result<()> {
        if let Some(x) = xs.iter().find(|x| x.len != acc.len) {
            return Err(gpu_err(
                "reduce_into",
                format!("accumulator of {} and input of {} elements", acc.len, x.len),
            ));
        }
        for group in xs.chunks(3) {
            for (st, n) in self.windows(acc.len) {
                let n4 = n / 4;
                if n4 > 0 {
                    let (groups, per) = self.vec4_layout(layout, n4);
                    let m = self.meta(&[n4 as u32, groups * WG, group.len() as u32, per]);
                    let mut b = vec![
                        (2, m.as_entire_binding()),
                        (3, part(acc, st, n4 * 4)),
                        (4, part(group[0], st, n4 * 4)),
                    ];
                    // One input: the plain kernel (the fold kernel's input count costs ~20 % on
                    // software GPUs). More: the fold kernel; unused inputs bind the first again
                    // (never read).
                    let kernel = if group.len() == 1 {
                        Kernel::ReduceInto4
                    } else {
                        let y = |i: usize| group.get(i).copied().unwrap_or(group[0]);
                        b.push((7, part(y(1), st, n4 * 4)));
                        b.push((8, part(y(2), st, n4 * 4)));
                        Kernel::FoldInto4
                    };
                    self.run_op(kernel, Some(op_code(op)), &b, groups)?;
                }
                let tail = n - n4 * 4;
                if tail > 0 {
                    let off = (n4 * 4) as u32;
                    for x in group {
                        let m = self.meta(&[tail as u32, op_code(op), off, off]);
                        self.run(
                            Kernel::ReduceInto,
                            &[
                                (0, part(acc, st, n)),
                                (1, part(x, st, n)),
                                (2, m.as_entire_binding()),
                            ],
                            Self::groups(tail, 4),
                        )?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Workgroups and vec4s per invocation of the vec4 reduce kernels for `n4` vec4s. A real GPU
    /// gets a grid-stride loop (per = 0: neighbouring invocations read neighbouring vec4s, so
    /// accesses coalesce). A CPU adapter (lavapipe) runs one invocation per SIMD lane and loads
    /// lane by lane; there each invocation gets its own run of consecutive vec4s, about 4x faster
    /// (measured with `distgrad bench kernels`). Runs are sized to give each CPU thread several
    /// workgroups. Both layouts do the same operations on every element: results are identical.
    fn vec4_layout(&self, layout: Vec4Layout, n4: usize) -> (u32, u32) {
        let runs = match layout {
            Vec4Layout::Auto => self.0.info.device_type == wgpu::DeviceType::Cpu,
            Vec4Layout::GridStride => false,
            Vec4Layout::Runs => true,
        };
        if runs {
            let per = n4.div_ceil(WG as usize * 8).clamp(1, 256);
            let groups = n4.div_ceil(per * WG as usize);
            (groups as u32, per as u32)
        } else {
            (n4.div_ceil(WG as usize).min(1024) as u32, 0)
        }
    }

    /// Sum of all elements: each invocation adds its share serially, then a tree per workgroup,
    /// repeated down to one value. The share is interleaved within the workgroup's block on a GPU
    /// (neighbouring invocations read neighbouring elements) and a run of consecutive elements on
    /// a CPU adapter ([`Vec4Layout::Auto`], as for reduce-into).
    pub fn sum_all(&self, x: &GpuBuf) -> Result<GpuBuf> {
        self.sum_all_in(Vec4Layout::Auto, x)
    }

    /// [`Gpu::sum_all`] with the share of each invocation chosen by the caller (`GridStride`:
    /// interleaved, `Runs`: consecutive); tests and `distgrad bench kernels` compare them. The
    /// sums differ only in the order of the additions.
    pub fn sum_all_in(&self, layout: Vec4Layout, x: &GpuBuf) -> Result<GpuBuf> {
        let interleave = match layout {
            Vec4Layout::Auto => self.0.info.device_type != wgpu::DeviceType::Cpu,
            Vec4Layout::GridStride => true,
            Vec4Layout::Runs => false,
        };
        let wins = self.windows(x.len);
        if wins.len() > 1 {
            // Above the binding limit: each window's sum, then the sum of those.
            let sums = self.alloc(wins.len())?;
            for (i, &(st, len)) in wins.iter().enumerate() {
                let w = self.alloc(len)?;
                self.copy_contiguous(CopyPath::Auto, x, st, &w, 0, len)?;
                let s = self.sum_all_in(layout, &w)?;
                self.copy_contiguous(CopyPath::Auto, &s, 0, &sums, i, 1)?;
            }
            self.check("sum")?;
            return self.sum_all_in(layout, &sums);
        }
        let mut cur = x.clone();
        loop {
            let n = cur.len;
            // Each thread sums `per` consecutive elements; one partial per workgroup of 256.
            let per = n.div_ceil(WG as usize * 64).clamp(1, 256);
            let groups = n.div_ceil(per * WG as usize).max(1);
            let out = self.storage("sum", groups)?;
            let m = self.meta(&[n as u32, per as u32, groups as u32, u32::from(interleave)]);
            self.run(
                Kernel::SumPartials,
                &[
                    (0, out.buf.as_entire_binding()),
                    (1, cur.buf.as_entire_binding()),
                    (2, m.as_entire_binding()),
                ],
                groups as u32,
            )?;
            if groups == 1 {
                return Ok(out);
            }
            cur = out;
        }
    }

    /// Sum a tensor of `shape` down to `target` (right-aligned broadcast source shape).
    pub fn sum_to(&self, x: &GpuBuf, shape: &[usize], target: &[usize]) -> Result<GpuBuf> {
        let n_out: usize = target.iter().product();
        let broadcastable = target.len() <= shape.len()
            && target
                .iter()
                .rev()
                .zip(shape.iter().rev())
                .all(|(t, s)| t == s || *t == 1);
        if !broadcastable || shape.iter().product::<usize>() != x.len {
            return Err(gpu_err(
                "sum_to",
                format!("cannot sum {shape:?} ({} elements) to {target:?}", x.len),
            ));
        }
        let off = shape.len() - target.len();
        let strides = super::cpu::strides(shape);
        let (mut kept, mut red) = (Vec::new(), Vec::new());
        for d in 0..shape.len() {
            let keep = d >= off && target[d - off] == shape[d];
            if keep { &mut kept } else { &mut red }.push((shape[d], strides[d]));
        }
        if kept.len() > 8 || red.len() > 8 {
            return Err(gpu_err("sum_to", format!("rank {} above 8", shape.len())));
        }
        let mut meta = vec![0u32; 36];
        meta[0] = n_out as u32;
        meta[1] = red.iter().map(|r| r.0).product::<usize>() as u32;
        meta[2] = kept.len() as u32;
        meta[3] = red.len() as u32;
        for (i, (s, st)) in kept.iter().enumerate() {
            meta[4 + i] = *s as u32;
            meta[12 + i] = *st as u32;
        }
        for (i, (s, st)) in red.iter().enumerate() {
            meta[20 + i] = *s as u32;
            meta[28 + i] = *st as u32;
        }
        let out = self.storage("sum_to", n_out)?;
        self.require_bindable("sum_to", &[x, &out])?;
        let m = self.meta(&meta);
        self.run(
            Kernel::SumTo,
            &[
                (0, out.buf.as_entire_binding()),
                (1, x.buf.as_entire_binding()),
                (2, m.as_entire_binding()),
            ],
            Self::groups(n_out, 1),
        )?;
        Ok(out)
    }

    /// Strided copy of a `shape`-shaped region from `src` into `dst` (see `shaders/copy.wgsl`).
    pub fn copy_strided(
        &self,
        src: &GpuBuf,
        from: At<'_>,
        dst: &GpuBuf,
        to: At<'_>,
        shape: &[usize],
    ) -> Result<()> {
        let (src_off, src_strides, dst_off, dst_strides) =
            (from.offset, from.strides, to.offset, to.strides);
        if shape.len() > 8 || src_strides.len() != shape.len() || dst_strides.len() != shape.len() {
            return Err(gpu_err(
                "copy",
                format!(
                    "shape {shape:?} (rank at most 8) needs strides of its rank, got {src_strides:?} and {dst_strides:?}"
                ),
            ));
        }
        let n: usize = shape.iter().product();
        if n == 0 {
            return Ok(());
        }
        // Out-of-range indices would not fault on a GPU (robust access may write anywhere in the
        // buffer): check the last element of the region on both sides here.
        if !fits(src, src_off, shape, src_strides) || !fits(dst, dst_off, shape, dst_strides) {
            return Err(gpu_err(
                "copy",
                format!(
                    "region {shape:?} at {src_off}/{dst_off} with strides {src_strides:?}/{dst_strides:?} leaves buffers of {} and {}",
                    src.len, dst.len
                ),
            ));
        }
        let dense = super::cpu::strides(shape);
        if src_strides == dense && dst_strides == dense {
            // A contiguous block on both sides: a flat copy, by the path this adapter copies
            // fastest with, in chunks where it is a kernel (no binding limit either way).
            self.copy_contiguous(CopyPath::Auto, src, src_off, dst, dst_off, n)?;
            return self.check("copy");
        }
        // Bind only the span each side touches, so a region of a buffer above the binding limit
        // works when its span fits in one binding.
        let (src_lo, src_len) = self.span(src, src_off, shape, src_strides);
        let (dst_lo, dst_len) = self.span(dst, dst_off, shape, dst_strides);
        let w = self.window_elems();
        if src_len > w || dst_len > w {
            return Err(gpu_err(
                "copy",
                format!(
                    "a strided region {shape:?} spanning {} elements is above the device's \
                     storage binding limit of {w} elements",
                    src_len.max(dst_len)
                ),
            ));
        }
        let mut meta = vec![0u32; 28];
        meta[0] = n as u32;
        meta[1] = shape.len() as u32;
        meta[2] = (src_off - src_lo) as u32;
        meta[3] = (dst_off - dst_lo) as u32;
        for d in 0..shape.len() {
            meta[4 + d] = shape[d] as u32;
            meta[12 + d] = src_strides[d] as u32;
            meta[20 + d] = dst_strides[d] as u32;
        }
        let m = self.meta(&meta);
        self.run(
            Kernel::CopyStrided,
            &[
                (0, part(src, src_lo, src_len)),
                (1, part(dst, dst_lo, dst_len)),
                (2, m.as_entire_binding()),
            ],
            Self::groups(n, 1),
        )
    }

    /// Copy `n` contiguous elements (checked to fit by the caller) by `path`; no binding limit
    /// (the kernel copies chunk by chunk).
    fn copy_contiguous(
        &self,
        path: CopyPath,
        src: &GpuBuf,
        src_off: usize,
        dst: &GpuBuf,
        dst_off: usize,
        n: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let kernel = match path {
            CopyPath::Auto => self.0.info.device_type == wgpu::DeviceType::DiscreteGpu,
            CopyPath::Engine => false,
            CopyPath::Kernel => true,
        };
        if kernel {
            return self.copy_flat(src, src_off, dst, dst_off, n);
        }
        let mut enc = self.0.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(
            &src.buf,
            (src_off * 4) as u64,
            &dst.buf,
            (dst_off * 4) as u64,
            (n * 4) as u64,
        );
        self.0.queue.submit([enc.finish()]);
        Ok(())
    }

    /// The copy kernel: `dst[dst_off + i] = src[src_off + i]` for `i < n`, in chunks whose spans
    /// fit one storage binding on both sides (each binding starts at an aligned offset below its
    /// chunk); a grid-stride loop over each chunk.
    fn copy_flat(
        &self,
        src: &GpuBuf,
        src_off: usize,
        dst: &GpuBuf,
        dst_off: usize,
        n: usize,
    ) -> Result<()> {
        let align = (self.0.limits.min_storage_buffer_offset_alignment.max(16) / 4) as usize;
        // A chunk plus the misalignment of its start must fit one binding.
        let chunk = self.window_elems().saturating_sub(align).max(align);
        let mut done = 0;
        while done < n {
            let len = chunk.min(n - done);
            let (s, d) = (src_off + done, dst_off + done);
            let (s_lo, d_lo) = (s / align * align, d / align * align);
            let groups = Self::groups(len, 1).min(1024);
            let m = self.meta(&[
                len as u32,
                (s - s_lo) as u32,
                (d - d_lo) as u32,
                groups * WG,
            ]);
            self.run(
                Kernel::CopyFlat,
                &[
                    (0, part(src, s_lo, s + len - s_lo)),
                    (1, part(dst, d_lo, d + len - d_lo)),
                    (2, m.as_entire_binding()),
                ],
                groups,
            )?;
            done += len;
        }
        Ok(())
    }

    /// The aligned window `(start, len)` of `buf` holding every element of a non-empty strided
    /// region that starts at `offset` (checked to fit by the caller).
    fn span(
        &self,
        buf: &GpuBuf,
        offset: usize,
        shape: &[usize],
        strides: &[usize],
    ) -> (usize, usize) {
        let last = shape
            .iter()
            .zip(strides)
            .fold(offset, |acc, (&s, &st)| acc + (s - 1) * st);
        let align = (self.0.limits.min_storage_buffer_offset_alignment.max(16) / 4) as usize;
        let lo = offset / align * align;
        if lo == 0 && last + 1 == buf.len {
            return (0, buf.len);
        }
        (lo, last + 1 - lo)
    }

    /// A new buffer of `n` elements, contents unspecified (to be filled by copies).
    pub fn alloc(&self, n: usize) -> Result<GpuBuf> {
        self.storage("alloc", n)
    }

    /// `[m,k] · [k,n]`.
    pub fn matmul(&self, a: &GpuBuf, b: &GpuBuf, m: usize, k: usize, n: usize) -> Result<GpuBuf> {
        if m.checked_mul(k) != Some(a.len) || k.checked_mul(n) != Some(b.len) {
            return Err(gpu_err(
                "matmul",
                format!(
                    "[{m},{k}]x[{k},{n}] over buffers of {} and {}",
                    a.len, b.len
                ),
            ));
        }
        let out = self.storage("matmul", m * n)?;
        if m * n == 0 {
            return Ok(out);
        }
        self.require_bindable("matmul", &[a, b, &out])?;
        let meta = self.meta(&[m as u32, k as u32, n as u32]);
        let p = self.pipeline(Kernel::Matmul);
        let layout = p.get_bind_group_layout(0);
        let bufs = [&a.buf, &b.buf, &out.buf, &meta];
        let entries: Vec<wgpu::BindGroupEntry<'_>> = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: b.as_entire_binding(),
            })
            .collect();
        let bg = self.0.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("matmul"),
            layout: &layout,
            entries: &entries,
        });
        let (gx, gy) = (n.div_ceil(16) as u32, m.div_ceil(16) as u32);
        if gx > MAX_GROUPS || gy > MAX_GROUPS {
            return Err(gpu_err(
                "matmul",
                format!("[{m},{k}]x[{k},{n}] needs too many workgroups"),
            ));
        }
        let mut enc = self.0.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(&p);
            pass.set_bind_group(0, &bg, &[]);
            pass.dispatch_workgroups(gx, gy, 1);
        }
        self.0.queue.submit([enc.finish()]);
        self.check("matmul")?;
        Ok(out)
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
