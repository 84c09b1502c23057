//! The WGSL kernels against the CPU backend: bit-exact where promised (elementwise add/sub/mul/max/
//! min/eq, reduce-into, copies), within a stated tolerance elsewhere (div, tanh, sums, matmul).
//! Sizes: 0, 1, non-multiples of the workgroup size, a 2-D dispatch (> 65535 workgroups), and
//! buffers above the device's storage-binding limit (window by window).
//!
//! Runs on any wgpu adapter (lavapipe in CI). Without one each test prints "skipped: ..." and
//! passes, unless DISTGRAD_REQUIRE_GPU=1 (set by .ci/run, which installs lavapipe), where the
//! missing adapter is a failure.
#![cfg(feature = "wgpu")]

use distgrad::backend::gpu::{At, CopyPath, Gpu, Vec4Layout};
use distgrad::backend::{BinaryOp, UnaryOp, cpu};

mod common_gpu;
use common_gpu::gpu;

/// Deterministic normal (non-denormal) values in about [-4, 4], with some exact repeats.
fn vals(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            if i % 7 == 3 {
                1.5
            } else {
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0 + 1e-3
            }
        })
        .collect()
}

const SIZES: [usize; 6] = [0, 1, 255, 257, 1000, 65_536 * 256 + 3];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn read(g: &Gpu, b: &distgrad::backend::gpu::GpuBuf) -> Vec<f32> {
    futures::executor::block_on(g.read(b)).expect("readback")
}

#[test]
fn describes_the_adapter() {
    let Some(g) = gpu() else { return };
    let d = g.describe();
    assert!(!d.is_empty());
    println!("adapter: {d}");
}

#[test]
fn binary_ops_same_shape_are_bit_exact() {
    let Some(g) = gpu() else { return };
    for &n in &SIZES {
        let (a, b) = (vals(1, n), vals(2, n));
        let (ga, gb) = (g.upload(&a).unwrap(), g.upload(&b).unwrap());
        for op in [
            BinaryOp::Add,
            BinaryOp::Sub,
            BinaryOp::Mul,
            BinaryOp::Max,
            BinaryOp::Min,
            BinaryOp::Eq,
        ] {
            let got = read(g, &g.binary(op, &ga, &gb, n, None).unwrap());
            let want = cpu::binary_same(op, &a, &b);
            assert_eq!(bits(&got), bits(&want), "{op:?}, n = {n}");
        }
        let got = read(g, &g.binary(BinaryOp::Div, &ga, &gb, n, None).unwrap());
        for (i, (x, y)) in got
            .iter()
            .zip(cpu::binary_same(BinaryOp::Div, &a, &b))
            .enumerate()
        {
            // WGSL allows 2.5 ulp for division
            assert!(
                (x - y).abs() <= 3.0 * f32::EPSILON * y.abs().max(f32::MIN_POSITIVE),
                "div n = {n} at {i}: {x} vs {y}"
            );
        }
    }
}

#[test]
fn binary_ops_broadcast_are_bit_exact() {
    let Some(g) = gpu() else { return };
    // [2,3,4] op [3,1], [4] op [2,1,1], scalar op [5,7]
    let cases: [(&[usize], &[usize]); 4] = [
        (&[2, 3, 4], &[3, 1]),
        (&[4], &[2, 1, 1]),
        (&[], &[5, 7]),
        (&[6, 1], &[1, 9]),
    ];
    for (sa, sb) in cases {
        let out_shape = distgrad::tensor::broadcast_shape("test", sa, sb).unwrap();
        let n: usize = out_shape.iter().product();
        let (a, b) = (vals(3, sa.iter().product()), vals(4, sb.iter().product()));
        let (ga, gb) = (g.upload(&a).unwrap(), g.upload(&b).unwrap());
        let st_a = cpu::broadcast_strides(sa, &out_shape);
        let st_b = cpu::broadcast_strides(sb, &out_shape);
        for op in [BinaryOp::Add, BinaryOp::Mul, BinaryOp::Max] {
            let got = read(
                g,
                &g.binary(op, &ga, &gb, n, Some((&out_shape, &st_a, &st_b)))
                    .unwrap(),
            );
            let want = cpu::binary_broadcast(op, &a, sa, &b, sb, &out_shape);
            assert_eq!(bits(&got), bits(&want), "{op:?} {sa:?} x {sb:?}");
        }
    }
}

#[test]
fn unary_ops() {
    let Some(g) = gpu() else { return };
    for &n in &SIZES {
        let a = vals(5, n);
        let ga = g.upload(&a).unwrap();
        for op in [
            UnaryOp::Neg,
            UnaryOp::Scale(-0.75),
            UnaryOp::Relu,
            UnaryOp::Step,
            UnaryOp::Square,
        ] {
            let got = read(g, &g.unary(op, &ga).unwrap());
            assert_eq!(bits(&got), bits(&cpu::unary(op, &a)), "{op:?}, n = {n}");
        }
        let got = read(g, &g.unary(UnaryOp::Tanh, &ga).unwrap());
        for (x, y) in got.iter().zip(cpu::unary(UnaryOp::Tanh, &a)) {
            assert!((x - y).abs() <= 1e-5, "tanh n = {n}: {x} vs {y}");
        }
    }
}

#[test]
fn reduce_into_is_bit_exact_for_every_op() {
    let Some(g) = gpu() else { return };
    for &n in &SIZES {
        let (acc, x) = (vals(6, n), vals(7, n));
        for op in [BinaryOp::Add, BinaryOp::Mul, BinaryOp::Max, BinaryOp::Min] {
            let gacc = g.upload(&acc).unwrap();
            g.reduce_into(op, &gacc, &g.upload(&x).unwrap()).unwrap();
            let mut want = acc.clone();
            cpu::reduce_into(op, &mut want, &x);
            assert_eq!(bits(&read(g, &gacc)), bits(&want), "{op:?}, n = {n}");
        }
    }
}

/// Several inputs folded in one pass (groups of three per dispatch): bitwise the same as
/// reduce-into with each input in turn, on the GPU (both thread layouts) and with the CPU's blocked
/// fold, for every op, 1..7 inputs and every size.
#[test]
fn reduce_into_many_is_bit_exact_with_one_input_at_a_time() {
    let Some(g) = gpu() else { return };
    // 1_000_003: the runs layout ends with a partial run and a scalar tail.
    for &n in SIZES.iter().chain(&[1_000_003]) {
        let acc = vals(30, n);
        let xs: Vec<Vec<f32>> = (0..7).map(|k| vals(31 + k, n)).collect();
        // The 2-D dispatch size once (it is slow in a debug build), every case on the others.
        let (ops, ks): (&[BinaryOp], &[usize]) = if n > 100_000 {
            (&[BinaryOp::Max], &[4])
        } else {
            (
                &[BinaryOp::Add, BinaryOp::Mul, BinaryOp::Max, BinaryOp::Min],
                &[1, 2, 3, 4, 7],
            )
        };
        for &op in ops {
            for &k in ks {
                let mut want = acc.clone();
                for x in &xs[..k] {
                    cpu::reduce_into(op, &mut want, x);
                }
                let mut host = acc.clone();
                let refs: Vec<&[f32]> = xs[..k].iter().map(Vec::as_slice).collect();
                cpu::reduce_into_many(op, &mut host, &refs);
                assert_eq!(bits(&host), bits(&want), "cpu {op:?}, {k} inputs, n = {n}");
                let gx: Vec<_> = xs[..k].iter().map(|x| g.upload(x).unwrap()).collect();
                let grefs: Vec<_> = gx.iter().collect();
                for layout in [Vec4Layout::Auto, Vec4Layout::GridStride, Vec4Layout::Runs] {
                    let gacc = g.upload(&acc).unwrap();
                    g.reduce_into_many_in(layout, op, &gacc, &grefs).unwrap();
                    assert_eq!(
                        bits(&read(g, &gacc)),
                        bits(&want),
                        "gpu {op:?}, {k} inputs, n = {n}, {layout:?}"
                    );
                }
            }
        }
    }
}

/// Every layout of the sum (the adapter's, interleaved, runs) within the summation-order bound.
#[test]
fn sums_within_tolerance() {
    let Some(g) = gpu() else { return };
    for &n in &SIZES {
        let a = vals(8, n);
        let ga = g.upload(&a).unwrap();
        let want = cpu::sum_all(&a);
        // Different association order: bound by n * eps * sum|a|.
        let bound = 2.0
            * (n as f32).max(1.0).log2()
            * f32::EPSILON
            * a.iter().map(|x| x.abs()).sum::<f32>()
            + 1e-6;
        for layout in [Vec4Layout::Auto, Vec4Layout::GridStride, Vec4Layout::Runs] {
            let got = read(g, &g.sum_all_in(layout, &ga).unwrap());
            assert!(
                (got[0] - want).abs() <= bound,
                "sum {layout:?} n = {n}: {} vs {want} (bound {bound})",
                got[0]
            );
        }
        // sum_all is the adapter's layout.
        let auto = read(g, &g.sum_all(&ga).unwrap());
        let same = read(g, &g.sum_all_in(Vec4Layout::Auto, &ga).unwrap());
        assert_eq!(bits(&auto), bits(&same), "sum_all n = {n}");
    }
    // A sum whose order matters: 2^24 and 512 ones in f32, where a one added to 2^24 alone is
    // lost (rounded to even) and ones added together first are not. Any order gives an even
    // integer between 2^24 (every one lost) and 2^24 + 512 (none lost); garbage does not.
    let mut a = vec![1.0f32; 513];
    a[0] = 16_777_216.0;
    for layout in [Vec4Layout::GridStride, Vec4Layout::Runs] {
        let got = read(g, &g.sum_all_in(layout, &g.upload(&a).unwrap()).unwrap())[0];
        assert!(
            got % 2.0 == 0.0 && (16_777_216.0..=16_777_728.0).contains(&got),
            "{layout:?}: {got}"
        );
    }
    // sum_to: [4,3,5] -> [3,1] and -> [5]
    let a = vals(9, 60);
    let ga = g.upload(&a).unwrap();
    for target in [&[3usize, 1][..], &[5], &[4, 1, 5], &[]] {
        let got = read(g, &g.sum_to(&ga, &[4, 3, 5], target).unwrap());
        let want = cpu::sum_to(&a, &[4, 3, 5], target);
        assert_eq!(got.len(), want.len(), "{target:?}");
        for (x, y) in got.iter().zip(&want) {
            assert!(
                (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                "sum_to {target:?}: {x} vs {y}"
            );
        }
    }
}

#[test]
fn strided_copies_slice_transpose_concat() {
    let Some(g) = gpu() else { return };
    let shape = [3, 4, 5];
    let a = vals(10, 60);
    let ga = g.upload(&a).unwrap();
    let st = cpu::strides(&shape);
    // slice dim 1, rows 1..3 -> [3, 2, 5]
    let out = g.alloc(30).unwrap();
    let s325 = cpu::strides(&[3, 2, 5]);
    let at = |offset, strides| At { offset, strides };
    g.copy_strided(&ga, at(st[1], &st), &out, at(0, &s325), &[3, 2, 5])
        .unwrap();
    assert_eq!(bits(&read(g, &out)), bits(&cpu::slice(&a, &shape, 1, 1, 2)));
    // transpose of [12, 5]
    let out = g.alloc(60).unwrap();
    g.copy_strided(&ga, at(0, &[1, 5]), &out, at(0, &[12, 1]), &[5, 12])
        .unwrap();
    assert_eq!(bits(&read(g, &out)), bits(&cpu::transpose(&a, 12, 5)));
    // concat along dim 1 of [3,4,5] and [3,2,5] -> [3,6,5]
    let b = vals(11, 30);
    let gb = g.upload(&b).unwrap();
    let out = g.alloc(90).unwrap();
    let so = cpu::strides(&[3, 6, 5]);
    g.copy_strided(&ga, at(0, &st), &out, at(0, &so), &shape)
        .unwrap();
    g.copy_strided(&gb, at(0, &s325), &out, at(4 * so[1], &so), &[3, 2, 5])
        .unwrap();
    assert_eq!(
        bits(&read(g, &out)),
        bits(&cpu::concat(&[(&a, 4), (&b, 2)], 3, 5))
    );
    // a big flat chunk copy (2-D dispatch)
    let n = 65_536 * 256 + 3;
    let big = vals(12, n + 10);
    let gbig = g.upload(&big).unwrap();
    let out = g.alloc(n).unwrap();
    g.copy_strided(&gbig, at(7, &[1]), &out, at(0, &[1]), &[n])
        .unwrap();
    assert_eq!(bits(&read(g, &out)), bits(&big[7..7 + n]));
}

/// Flat copies by both paths (copy engine, kernel) are bit-exact, at aligned and unaligned
/// offsets, lengths that are not multiples of 4 or of the workgroup, and a 2-D-sized one; a copy
/// within one buffer and one out of range are errors.
#[test]
fn flat_copies_by_both_paths_are_bit_exact() {
    let Some(g) = gpu() else { return };
    let n = 65_536 * 256 + 37;
    let a = vals(30, n);
    let ga = g.upload(&a).unwrap();
    for path in [CopyPath::Auto, CopyPath::Engine, CopyPath::Kernel] {
        for (from, to, len) in [
            (0, 0, 1),
            (0, 0, 1000),
            (1, 3, 7),
            (5, 0, 257),
            (3, 11, n - 3),
            (0, 1, n - 1),
        ] {
            let background = vals(31, len + to + 5);
            let dst = g.upload(&background).unwrap();
            g.copy_range_in(path, &ga, from, &dst, to, len).unwrap();
            let mut want = background.clone();
            want[to..to + len].copy_from_slice(&a[from..from + len]);
            assert!(
                bits(&read(g, &dst)) == bits(&want),
                "{path:?}: {len} from {from} to {to}"
            );
        }
        // Within one buffer: a clear error (WebGPU copies between two buffers), the buffer as
        // it was.
        let one = g.upload(&a[..1000]).unwrap();
        let e = g
            .copy_range_in(path, &one, 0, &one, 500, 400)
            .unwrap_err()
            .to_string();
        assert!(e.contains("the same buffer"), "{e}");
        assert_eq!(bits(&read(g, &one)), bits(&a[..1000]), "{path:?} untouched");
        // Out of range: an error, whatever the path.
        let small = g.alloc(10).unwrap();
        let e = g
            .copy_range_in(path, &ga, 0, &small, 5, 6)
            .unwrap_err()
            .to_string();
        assert!(e.contains("6 elements from 0"), "{e}");
    }
}

#[test]
fn matmul_within_tolerance() {
    let Some(g) = gpu() else { return };
    for (m, k, n) in [(1, 1, 1), (3, 5, 2), (17, 33, 16), (64, 70, 31), (0, 3, 2)] {
        let (a, b) = (vals(13, m * k), vals(14, k * n));
        let got = read(
            g,
            &g.matmul(&g.upload(&a).unwrap(), &g.upload(&b).unwrap(), m, k, n)
                .unwrap(),
        );
        let want = cpu::matmul(&a, &b, m, k, n);
        assert_eq!(got.len(), want.len());
        for (i, (x, y)) in got.iter().zip(&want).enumerate() {
            assert!(
                (x - y).abs() <= 1e-4 * k as f32 * 16.0,
                "[{m},{k}]x[{k},{n}] at {i}: {x} vs {y}"
            );
        }
    }
}

#[test]
fn too_large_buffers_are_errors() {
    let Some(g) = gpu() else { return };
    let max = usize::try_from(g.limits().max_buffer_size).unwrap_or(usize::MAX);
    let e = g
        .alloc((max / 4).saturating_add(1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("exceed"), "{e}");
}

/// Buffers above the device's storage-binding limit (128 MiB on lavapipe) run window by window:
/// reduce-into, elementwise ops and copies bit-exact with the CPU, sums within tolerance, on a size
/// that is neither a multiple of 4 nor of the workgroup; a strided region whose span does not fit
/// in one binding is a clear error.
#[test]
fn buffers_above_the_binding_limit_work_window_by_window() {
    let Some(g) = gpu() else { return };
    let w = g.window_elems();
    let n = w + 1003;
    if (n as u64) * 4 > g.limits().max_buffer_size {
        println!(
            "skipped: this adapter's largest buffer ({} bytes) is its binding limit",
            g.limits().max_buffer_size
        );
        return;
    }
    println!(
        "binding window {w} elements; buffers of {n} ({} bytes)",
        n * 4
    );
    let (a, b) = (vals(20, n), vals(21, n));
    let gb = g.upload(&b).unwrap();
    for op in [BinaryOp::Add, BinaryOp::Max] {
        let gacc = g.upload(&a).unwrap();
        g.reduce_into(op, &gacc, &gb).unwrap();
        let mut want = a.clone();
        cpu::reduce_into(op, &mut want, &b);
        assert!(bits(&read(g, &gacc)) == bits(&want), "reduce_into {op:?}");
    }
    let gacc = g.upload(&a).unwrap();
    g.reduce_into_many(BinaryOp::Add, &gacc, &[&gb, &gb])
        .unwrap();
    let mut want = a.clone();
    cpu::reduce_into_many(BinaryOp::Add, &mut want, &[&b, &b]);
    assert!(bits(&read(g, &gacc)) == bits(&want), "reduce_into_many");
    let ga = g.upload(&a).unwrap();
    let got = read(g, &g.binary(BinaryOp::Sub, &ga, &gb, n, None).unwrap());
    assert!(
        bits(&got) == bits(&cpu::binary_same(BinaryOp::Sub, &a, &b)),
        "binary sub"
    );
    let got = read(g, &g.unary(UnaryOp::Scale(0.5), &ga).unwrap());
    assert!(
        bits(&got) == bits(&cpu::unary(UnaryOp::Scale(0.5), &a)),
        "unary scale"
    );
    // Contiguous copies (the copy engine): a chunk across the window boundary, and all but the
    // first 3 elements.
    let at = |offset, strides| At { offset, strides };
    let out = g.alloc(1000).unwrap();
    g.copy_strided(&ga, at(w - 5, &[1]), &out, at(0, &[1]), &[1000])
        .unwrap();
    assert_eq!(bits(&read(g, &out)), bits(&a[w - 5..w + 995]));
    let out = g.alloc(n - 3).unwrap();
    g.copy_strided(&ga, at(3, &[1]), &out, at(0, &[1]), &[n - 3])
        .unwrap();
    assert!(bits(&read(g, &out)) == bits(&a[3..]), "big contiguous copy");
    // The same two copies by the copy kernel, chunk by chunk across the window boundary.
    let out = g.alloc(1000).unwrap();
    g.copy_range_in(CopyPath::Kernel, &ga, w - 5, &out, 0, 1000)
        .unwrap();
    assert_eq!(bits(&read(g, &out)), bits(&a[w - 5..w + 995]));
    let out = g.alloc(n - 1).unwrap();
    g.copy_range_in(CopyPath::Kernel, &ga, 3, &out, 2, n - 3)
        .unwrap();
    let got = read(g, &out);
    assert!(
        bits(&got[2..]) == bits(&a[3..]),
        "big contiguous kernel copy"
    );
    // A strided region past the first window (its span fits one binding): 3 rows of 7 with a
    // row stride of 300, starting beyond the first window; and into a big destination.
    let out = g.alloc(21).unwrap();
    g.copy_strided(&ga, at(w + 10, &[300, 1]), &out, at(0, &[7, 1]), &[3, 7])
        .unwrap();
    let want: Vec<f32> = (0..3)
        .flat_map(|r| a[w + 10 + r * 300..w + 17 + r * 300].to_vec())
        .collect();
    assert_eq!(bits(&read(g, &out)), bits(&want));
    let small = vals(22, 21);
    let big = g.upload(&a).unwrap();
    g.copy_strided(
        &g.upload(&small).unwrap(),
        at(0, &[7, 1]),
        &big,
        at(w + 500, &[100, 1]),
        &[3, 7],
    )
    .unwrap();
    let mut want = a.clone();
    for r in 0..3 {
        want[w + 500 + r * 100..w + 507 + r * 100].copy_from_slice(&small[r * 7..r * 7 + 7]);
    }
    assert!(
        bits(&read(g, &big)) == bits(&want),
        "strided copy into a big buffer"
    );
    // A transposing copy whose span is the whole buffer cannot be bound: an error, not a crash.
    let out = g.alloc(n - 3).unwrap();
    let e = g
        .copy_strided(
            &ga,
            at(0, &[1, 2]),
            &out,
            at(0, &[(n - 3) / 2, 1]),
            &[2, (n - 3) / 2],
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("binding limit"), "{e}");
    // sum of everything, within the summation-order bound, in every layout
    let want = cpu::sum_all(&a);
    let bound = 2.0 * (n as f32).log2() * f32::EPSILON * a.iter().map(|x| x.abs()).sum::<f32>();
    for layout in [Vec4Layout::Auto, Vec4Layout::GridStride, Vec4Layout::Runs] {
        let got = read(g, &g.sum_all_in(layout, &ga).unwrap())[0];
        assert!(
            (got - want).abs() <= bound,
            "sum {layout:?} {got} vs {want} (bound {bound})"
        );
    }
    // Kernels that bind whole buffers say so instead of failing inside the driver.
    let e = g
        .matmul(&ga, &g.upload(&[1.0]).unwrap(), n, 1, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("binding limit"), "{e}");
}

#[test]
fn out_of_range_regions_are_errors_not_silent_writes() {
    let Some(g) = gpu() else { return };
    let a = g.upload(&vals(15, 10)).unwrap();
    let b = g.upload(&vals(16, 12)).unwrap();
    let e = g
        .reduce_into(BinaryOp::Add, &a, &b)
        .unwrap_err()
        .to_string();
    assert!(e.contains("10") && e.contains("12"), "{e}");
    let out = g.alloc(10).unwrap();
    // 3 rows of 4 from a 10-element buffer: the last element (index 11) is outside.
    let e = g
        .copy_strided(
            &a,
            At {
                offset: 0,
                strides: &[4, 1],
            },
            &out,
            At {
                offset: 0,
                strides: &[4, 1],
            },
            &[3, 4],
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("leaves buffers"), "{e}");
    let e = g.matmul(&a, &b, 2, 5, 3).unwrap_err().to_string();
    assert!(e.contains("[2,5]x[5,3]"), "{e}");
    let e = g.sum_to(&a, &[2, 5], &[3]).unwrap_err().to_string();
    assert!(e.contains("cannot sum"), "{e}");
}
