//! The reductions (`shaders/reduce.wgsl`): reduce-into, the local step of every reducing
//! collective (scalar and vec4 kernels, several inputs folded in one pass), the sum of all
//! elements and the sum down to a broadcast shape.

use super::{BinaryOp, CopyPath, Gpu, GpuBuf, Kernel, Vec4Layout, WG, gpu_err, op_code, part};
use crate::error::Result;

impl Gpu {
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
            Vec4Layout::Auto => self.is_software(),
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

    /// Sum of all elements, in passes down to one value. On a GPU each invocation adds an
    /// interleaved share of its workgroup's block (neighbouring invocations read neighbouring
    /// elements), then a tree per workgroup; on a CPU adapter ([`Vec4Layout::Auto`], as for
    /// reduce-into) each invocation adds a run of consecutive elements and writes it out, with no
    /// workgroup barrier (software rasterizers run barriers slowly).
    pub fn sum_all(&self, x: &GpuBuf) -> Result<GpuBuf> {
        self.sum_all_in(Vec4Layout::Auto, x)
    }

    /// [`Gpu::sum_all`] with the kernel chosen by the caller (`GridStride`: interleaved shares and a
    /// tree per workgroup, `Runs`: barrier-free runs); tests and `distgrad bench kernels` compare
    /// them. The sums differ only in the order of the additions.
    pub fn sum_all_in(&self, layout: Vec4Layout, x: &GpuBuf) -> Result<GpuBuf> {
        let tree = match layout {
            Vec4Layout::Auto => !self.is_software(),
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
        if !tree {
            // A run per invocation, no barriers, down to one value: runs of 64 to 1024 elements,
            // longer ones for large inputs so the first pass writes at most 16 Ki partials.
            loop {
                let n = cur.len;
                let per = n.div_ceil(16 << 10).clamp(64, 1024).min(n.max(1));
                let outs = n.div_ceil(per).max(1);
                let out = self.storage("sum", outs)?;
                let m = self.meta(&[n as u32, per as u32, outs as u32]);
                self.run(
                    Kernel::SumRuns,
                    &[
                        (0, out.buf.as_entire_binding()),
                        (1, cur.buf.as_entire_binding()),
                        (2, m.as_entire_binding()),
                    ],
                    Self::groups(outs, 1),
                )?;
                if outs == 1 {
                    return Ok(out);
                }
                cur = out;
            }
        }
        loop {
            let n = cur.len;
            // Each thread sums `per` elements 256 apart; one partial per workgroup of 256.
            let per = n.div_ceil(WG as usize * 64).clamp(1, 256);
            let groups = n.div_ceil(per * WG as usize).max(1);
            let out = self.storage("sum", groups)?;
            let m = self.meta(&[n as u32, per as u32, groups as u32]);
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
        let strides = crate::backend::cpu::strides(shape);
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
}
