//! GPU memory shared with another API (Linux, Vulkan): the zero-copy path of the NCCL target.
//!
//! wgpu cannot export memory it allocated itself, so [`Gpu::alloc_exportable`] allocates the buffer
//! and its memory through Vulkan directly (ash, on wgpu's own `VkDevice`), marks the memory
//! exportable as an opaque file descriptor, and hands the buffer to wgpu
//! (`create_buffer_from_hal`): wgpu's kernels and copies use it like any other [`GpuBuf`], and the
//! descriptor ([`Exported`]) can be imported by CUDA (`cuImportExternalMemory`) or by Vulkan again
//! ([`Gpu::import_opaque_fd`]), all of them reading and writing the same bytes. wgpu frees the
//! Vulkan buffer and memory when the last [`GpuBuf`] goes.
//!
//! Two APIs on one allocation need the same physical device: [`Gpu::device_uuid`] names it (CUDA
//! names its devices with the same UUIDs) and [`Gpu::with_device_uuid`] opens that one.
//!
//! Ordering between the APIs is the caller's: finish the work of one (for wgpu [`Gpu::sync`]) before
//! the other touches the memory.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};

use ash::vk;
use wgpu::hal::api::Vulkan;

use super::{Gpu, GpuBuf, gpu_err};
use crate::error::Result;

/// The handle type every shared allocation uses.
const HANDLE: vk::ExternalMemoryHandleTypeFlags = vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD;

/// What a shared buffer is used for on the Vulkan side (the same as wgpu's storage buffers).
fn usage() -> vk::BufferUsageFlags {
    vk::BufferUsageFlags::STORAGE_BUFFER
        | vk::BufferUsageFlags::TRANSFER_SRC
        | vk::BufferUsageFlags::TRANSFER_DST
}

/// The memory of a [`GpuBuf`] from [`Gpu::alloc_exportable`], as an opaque file descriptor.
/// Only `alloc_exportable` makes one, so what it says about the memory is true.
#[derive(Debug)]
pub struct Exported {
    fd: OwnedFd,
    size: u64,
    dedicated: bool,
    buffer_bytes: u64,
    memory_type: u32,
}

impl Exported {
    /// The descriptor (still owned by this value).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Bytes of the allocation (at least the buffer's; importers must be given exactly this).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether the memory is a dedicated allocation (CUDA's import must then say so:
    /// `CUDA_EXTERNAL_MEMORY_DEDICATED`).
    pub fn dedicated(&self) -> bool {
        self.dedicated
    }

    /// Give up the descriptor: for an importer that took ownership of it (CUDA, after a
    /// successful import), so that it is not closed here.
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }
}

fn vk_err(op: &'static str, what: &str, e: vk::Result) -> crate::error::Error {
    gpu_err(op, format!("{what}: {e}"))
}

impl Gpu {
    /// Run `f` on wgpu's Vulkan device; an error if this device is not a Vulkan one.
    fn with_vulkan<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&wgpu::hal::vulkan::Device) -> Result<R>,
    ) -> Result<R> {
        // SAFETY: the raw handles are used only for calls that wgpu allows on its device (creating,
        // binding and exporting our own objects); nothing wgpu owns is destroyed or changed.
        let hal = unsafe { self.0.device.as_hal::<Vulkan>() }.ok_or_else(|| {
            gpu_err(
                op,
                format!(
                    "{} is not a Vulkan device: sharing memory with CUDA needs Vulkan",
                    self.describe()
                ),
            )
        })?;
        // The queries and exports below are Vulkan 1.1.
        if hal.shared_instance().instance_api_version() < vk::API_VERSION_1_1 {
            return Err(gpu_err(
                op,
                format!(
                    "{} runs Vulkan 1.0; sharing memory needs 1.1",
                    self.describe()
                ),
            ));
        }
        f(&hal)
    }

    /// The UUID of the physical device (Vulkan's `deviceUUID`, which CUDA reports for the same
    /// GPU), or `None` on a device that is not a Vulkan one.
    pub fn device_uuid(&self) -> Option<[u8; 16]> {
        self.with_vulkan("device_uuid", |hal| {
            Ok(physical_uuid(
                hal.shared_instance().raw_instance(),
                hal.raw_physical_device(),
            ))
        })
        .ok()
    }

    /// Open the Vulkan adapter whose device UUID is `uuid` (see [`Gpu::device_uuid`]).
    pub async fn with_device_uuid(uuid: [u8; 16]) -> Result<Gpu> {
        let instance =
            wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let mut seen = Vec::new();
        for adapter in instance.enumerate_adapters(wgpu::Backends::VULKAN).await {
            // SAFETY: only reads properties of the physical device.
            let id = unsafe { adapter.as_hal::<Vulkan>() }
                .filter(|a| a.shared_instance().instance_api_version() >= vk::API_VERSION_1_1)
                .map(|a| {
                    physical_uuid(a.shared_instance().raw_instance(), a.raw_physical_device())
                });
            if id == Some(uuid) {
                return Gpu::open(adapter).await;
            }
            seen.push(adapter.get_info().name);
        }
        Err(gpu_err(
            "adapter",
            format!(
                "no Vulkan adapter has device UUID {} (adapters: {})",
                hex(&uuid),
                if seen.is_empty() {
                    "none".to_string()
                } else {
                    seen.join(", ")
                }
            ),
        ))
    }

    /// A new buffer of `n` f32 whose memory can be exported ([`Exported`]): see the module docs.
    /// Its contents start undefined.
    pub fn alloc_exportable(&self, n: usize) -> Result<(GpuBuf, Exported)> {
        let op = "alloc_exportable";
        let size = self.check_size(op, n)?;
        let (hal_buf, exported) = self.with_vulkan(op, |hal| {
            let dev = hal.raw_device();
            let inst = hal.shared_instance().raw_instance();
            let phys = hal.raw_physical_device();
            if !hal
                .enabled_device_extensions()
                .contains(&ash::khr::external_memory_fd::NAME)
            {
                return Err(gpu_err(
                    op,
                    format!(
                        "{} does not offer VK_KHR_external_memory_fd",
                        self.describe()
                    ),
                ));
            }
            let info = vk::PhysicalDeviceExternalBufferInfo::default()
                .usage(usage())
                .handle_type(HANDLE);
            let mut props = vk::ExternalBufferProperties::default();
            // SAFETY: a query with valid, initialized structures.
            unsafe { inst.get_physical_device_external_buffer_properties(phys, &info, &mut props) };
            let feats = props.external_memory_properties.external_memory_features;
            if !feats.contains(vk::ExternalMemoryFeatureFlags::EXPORTABLE) {
                return Err(gpu_err(
                    op,
                    format!(
                        "{} cannot export storage-buffer memory as an opaque fd",
                        self.describe()
                    ),
                ));
            }
            if !feats.contains(vk::ExternalMemoryFeatureFlags::IMPORTABLE) {
                return Err(gpu_err(
                    op,
                    format!(
                        "{} cannot import storage-buffer memory from an opaque fd",
                        self.describe()
                    ),
                ));
            }
            let dedicated = feats.contains(vk::ExternalMemoryFeatureFlags::DEDICATED_ONLY);
            let buffer = new_buffer(op, dev, size)?;
            // SAFETY: `buffer` was just created on `dev`.
            let req = unsafe { dev.get_buffer_memory_requirements(buffer) };
            let destroy = |memory: Option<vk::DeviceMemory>| {
                // SAFETY: our own objects, never handed to anyone.
                unsafe {
                    dev.destroy_buffer(buffer, None);
                    if let Some(m) = memory {
                        dev.free_memory(m, None);
                    }
                }
            };
            let Some(index) = memory_type(inst, phys, req.memory_type_bits) else {
                destroy(None);
                return Err(gpu_err(op, "no memory type fits an exportable buffer"));
            };
            let mut export = vk::ExportMemoryAllocateInfo::default().handle_types(HANDLE);
            let mut ded = vk::MemoryDedicatedAllocateInfo::default().buffer(buffer);
            let mut alloc = vk::MemoryAllocateInfo::default()
                .allocation_size(req.size)
                .memory_type_index(index)
                .push_next(&mut export);
            if dedicated {
                alloc = alloc.push_next(&mut ded);
            }
            // SAFETY: valid allocation info for `dev`.
            let memory = match unsafe { dev.allocate_memory(&alloc, None) } {
                Ok(m) => m,
                Err(e) => {
                    destroy(None);
                    return Err(vk_err(op, &format!("allocating {} bytes", req.size), e));
                }
            };
            // SAFETY: both objects are ours and unbound; offset 0 satisfies any alignment.
            if let Err(e) = unsafe { dev.bind_buffer_memory(buffer, memory, 0) } {
                destroy(Some(memory));
                return Err(vk_err(op, "binding the memory", e));
            }
            let fd_fns = ash::khr::external_memory_fd::Device::new(inst, dev);
            let get = vk::MemoryGetFdInfoKHR::default()
                .memory(memory)
                .handle_type(HANDLE);
            // SAFETY: `memory` was allocated exportable as HANDLE.
            let fd = match unsafe { fd_fns.get_memory_fd(&get) } {
                // SAFETY: a new descriptor that we now own.
                Ok(fd) if fd >= 0 => unsafe { OwnedFd::from_raw_fd(fd) },
                Ok(fd) => {
                    destroy(Some(memory));
                    return Err(gpu_err(op, format!("vkGetMemoryFdKHR gave fd {fd}")));
                }
                Err(e) => {
                    destroy(Some(memory));
                    return Err(vk_err(op, "exporting the memory", e));
                }
            };
            // SAFETY: `buffer` is bound to the whole of `memory`, which wgpu-hal now owns and frees
            // with the buffer.
            let hal_buf =
                unsafe { wgpu::hal::vulkan::Buffer::from_raw_managed(buffer, memory, 0, req.size) };
            Ok((
                hal_buf,
                Exported {
                    fd,
                    size: req.size,
                    dedicated,
                    buffer_bytes: size,
                    memory_type: index,
                },
            ))
        })?;
        let buf = self.wrap(op, hal_buf, size, n)?;
        // Defined contents (wgpu takes a wrapped buffer as initialized and never clears it).
        let mut enc = self.0.device.create_command_encoder(&Default::default());
        enc.clear_buffer(&buf.buf, 0, None);
        self.0.queue.submit([enc.finish()]);
        self.check(op)?;
        Ok((buf, exported))
    }

    /// A buffer of `n` f32 on memory exported by [`Gpu::alloc_exportable`] on this device: both
    /// buffers see the same bytes. Takes ownership of the descriptor. A dedicated allocation can
    /// only be imported for a buffer of the exported one's size.
    pub fn import_opaque_fd(&self, mem: Exported, n: usize) -> Result<GpuBuf> {
        let op = "import_opaque_fd";
        let size = self.check_size(op, n)?;
        if size > mem.size || (mem.dedicated && size != mem.buffer_bytes) {
            return Err(gpu_err(
                op,
                format!(
                    "{n} f32 ({size} bytes) do not fit the {} bytes shared{}",
                    mem.size,
                    if mem.dedicated {
                        format!(
                            " (a dedicated allocation: exactly {} bytes)",
                            mem.buffer_bytes
                        )
                    } else {
                        String::new()
                    }
                ),
            ));
        }
        let hal_buf = self.with_vulkan(op, |hal| {
            let dev = hal.raw_device();
            let buffer = new_buffer(op, dev, size)?;
            // SAFETY: `buffer` was just created on `dev`.
            let req = unsafe { dev.get_buffer_memory_requirements(buffer) };
            // An import must use the exporter's memory type and size (Vulkan's rules for opaque fds).
            if req.memory_type_bits & (1 << mem.memory_type) == 0 || req.size > mem.size {
                // SAFETY: our own buffer.
                unsafe { dev.destroy_buffer(buffer, None) };
                return Err(gpu_err(
                    op,
                    "the shared memory's type or size does not suit the new buffer",
                ));
            }
            let index = mem.memory_type;
            let raw = mem.fd.as_raw_fd();
            let mut import = vk::ImportMemoryFdInfoKHR::default()
                .handle_type(HANDLE)
                .fd(raw);
            let mut ded = vk::MemoryDedicatedAllocateInfo::default().buffer(buffer);
            let mut alloc = vk::MemoryAllocateInfo::default()
                .allocation_size(mem.size)
                .memory_type_index(index)
                .push_next(&mut import);
            if mem.dedicated {
                alloc = alloc.push_next(&mut ded);
            }
            // SAFETY: valid import info; on success Vulkan owns the descriptor.
            let memory = match unsafe { dev.allocate_memory(&alloc, None) } {
                Ok(m) => {
                    let _ = mem.fd.into_raw_fd();
                    m
                }
                Err(e) => {
                    // SAFETY: our own buffer; the descriptor is still ours and closes on drop.
                    unsafe { dev.destroy_buffer(buffer, None) };
                    return Err(vk_err(op, "importing the memory", e));
                }
            };
            // SAFETY: both objects are ours and unbound.
            if let Err(e) = unsafe { dev.bind_buffer_memory(buffer, memory, 0) } {
                // SAFETY: our own objects.
                unsafe {
                    dev.destroy_buffer(buffer, None);
                    dev.free_memory(memory, None);
                }
                return Err(vk_err(op, "binding the memory", e));
            }
            // SAFETY: as in `alloc_exportable`.
            Ok(unsafe { wgpu::hal::vulkan::Buffer::from_raw_managed(buffer, memory, 0, mem.size) })
        })?;
        self.wrap(op, hal_buf, size, n)
    }

    /// Hand a Vulkan buffer of `size` bytes to wgpu as a storage buffer of `n` f32.
    fn wrap(
        &self,
        op: &'static str,
        hal_buf: wgpu::hal::vulkan::Buffer,
        size: u64,
        n: usize,
    ) -> Result<GpuBuf> {
        // SAFETY: the buffer was created on this device with the usage below, is bound to memory,
        // and is not empty (check_size gives at least 4 bytes).
        let buf = unsafe {
            self.0
                .device
                .create_buffer_from_hal::<Vulkan>(hal_buf, &Gpu::storage_desc(op, size))
        };
        self.buf_of(op, buf, n)
    }
}

/// A new exclusive buffer of `size` bytes whose memory may be external.
fn new_buffer(op: &'static str, dev: &ash::Device, size: u64) -> Result<vk::Buffer> {
    let mut ext = vk::ExternalMemoryBufferCreateInfo::default().handle_types(HANDLE);
    let info = vk::BufferCreateInfo::default()
        .size(size)
        .usage(usage())
        .sharing_mode(vk::SharingMode::EXCLUSIVE)
        .push_next(&mut ext);
    // SAFETY: valid create info for `dev`.
    unsafe { dev.create_buffer(&info, None) }.map_err(|e| vk_err(op, "creating the buffer", e))
}

/// A device-local memory type allowed by `bits` (any allowed one if none is device-local).
fn memory_type(inst: &ash::Instance, phys: vk::PhysicalDevice, bits: u32) -> Option<u32> {
    // SAFETY: a property query on a valid physical device.
    let props = unsafe { inst.get_physical_device_memory_properties(phys) };
    let allowed = |i: &u32| bits & (1 << i) != 0;
    let types = props.memory_types_as_slice();
    (0..types.len() as u32)
        .filter(allowed)
        .find(|&i| {
            types[i as usize]
                .property_flags
                .contains(vk::MemoryPropertyFlags::DEVICE_LOCAL)
        })
        .or_else(|| (0..types.len() as u32).find(allowed))
}

/// `deviceUUID` of a physical device.
fn physical_uuid(inst: &ash::Instance, phys: vk::PhysicalDevice) -> [u8; 16] {
    let mut id = vk::PhysicalDeviceIDProperties::default();
    {
        let mut p2 = vk::PhysicalDeviceProperties2::default().push_next(&mut id);
        // SAFETY: a property query on a valid physical device (Vulkan 1.1, which wgpu requires).
        unsafe { inst.get_physical_device_properties2(phys, &mut p2) };
    }
    id.device_uuid
}

/// Lower-case hex of a UUID.
pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
