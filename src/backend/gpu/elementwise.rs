//! The elementwise kernels (`shaders/elementwise.wgsl`): binary ops with NumPy broadcasting and
//! unary ops, window by window over buffers above the binding limit when shapes are equal.

use super::{BinaryOp, Gpu, GpuBuf, Kernel, UnaryOp, fits, gpu_err, op_code, part, unary_code};
use crate::error::Result;

impl Gpu {
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
}
