//! Matrix product (`shaders/matmul.wgsl`).

use super::{Gpu, GpuBuf, Kernel, MAX_GROUPS, gpu_err};
use crate::error::Result;

impl Gpu {
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
