//! The copies (`shaders/copy.wgsl`): flat copies of a contiguous range (the queue's copy engine or
//! the copy kernel: [`CopyPath`]) and strided copies (slice, concat, transpose, the chunk copies
//! of the collectives).

use super::{At, CopyPath, Gpu, GpuBuf, Kernel, WG, fits, gpu_err, part};
use crate::error::Result;

impl Gpu {
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
        if std::sync::Arc::ptr_eq(&src.buf, &dst.buf) {
            return Err(gpu_err(
                "copy_range",
                "source and destination are the same buffer (WebGPU copies between two buffers)",
            ));
        }
        self.copy_contiguous(path, src, src_start, dst, dst_start, n)?;
        self.check("copy_range")
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
        let dense = crate::backend::cpu::strides(shape);
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
    pub(super) fn copy_contiguous(
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
}
