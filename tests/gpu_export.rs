//! Exportable GPU memory (the Vulkan half of the NCCL target's zero-copy path), on lavapipe in CI:
//! a buffer allocated exportable works with every kernel, its descriptor imported again aliases the
//! same bytes both ways, the device UUID names the adapter it came from, and bad imports are errors.
//! The CUDA half (importing the descriptor into CUDA for NCCL) runs in tests/nccl.rs on a GPU.
#![cfg(all(feature = "wgpu", target_os = "linux"))]

use distgrad::backend::BinaryOp;
use distgrad::backend::gpu::{Gpu, GpuBuf};

mod common_gpu;
use common_gpu::gpu;

fn read(g: &Gpu, b: &GpuBuf) -> Vec<f32> {
    g.read_blocking(b).expect("readback")
}

fn vals(seed: u32, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2654435761) ^ seed) as f32 / 4.0e9 - 0.5)
        .collect()
}

/// Exportable memory; lavapipe offers VK_KHR_external_memory_fd, so on it this must work.
fn exportable(g: &Gpu, n: usize) -> (GpuBuf, distgrad::backend::gpu::Exported) {
    g.alloc_exportable(n)
        .unwrap_or_else(|e| panic!("alloc_exportable({n}) on {}: {e}", g.describe()))
}

#[test]
fn exported_memory_aliases_its_import_both_ways() {
    let Some(g) = gpu() else { return };
    for n in [1usize, 3, 1000, 1 << 20] {
        let (a, mem) = exportable(g, n);
        assert!(
            mem.size() >= 4 * n as u64,
            "allocation of {} bytes",
            mem.size()
        );
        assert!(read(g, &a).iter().all(|&v| v == 0.0), "{n}: starts cleared");
        let x = vals(1, n);
        g.copy_range(&g.upload(&x).unwrap(), 0, &a, 0, n).unwrap();
        let b = g.import_opaque_fd(mem, n).unwrap();
        assert_eq!(
            read(g, &b),
            x,
            "{n}: written through the export, read through the import"
        );
        let y = vals(2, n);
        g.copy_range(&g.upload(&y).unwrap(), 0, &b, 0, n).unwrap();
        assert_eq!(
            read(g, &a),
            y,
            "{n}: written through the import, read through the export"
        );
        // A kernel on one view, read on the other.
        g.reduce_into(BinaryOp::Add, &a, &g.upload(&x).unwrap())
            .unwrap();
        let want: Vec<f32> = y.iter().zip(&x).map(|(p, q)| p + q).collect();
        assert_eq!(
            read(g, &b),
            want,
            "{n}: kernel on the export, read on the import"
        );
    }
}

#[test]
fn exported_buffers_work_with_windowed_kernels_above_the_binding_limit() {
    let Some(g) = gpu() else { return };
    let n = g.window_elems() + 5;
    let (a, _mem) = exportable(g, n);
    let x = vals(3, n);
    let gx = g.upload(&x).unwrap();
    g.copy_range(&gx, 0, &a, 0, n).unwrap();
    g.reduce_into(BinaryOp::Max, &a, &gx).unwrap();
    assert_eq!(read(g, &a), x, "max(x, x) = x over {n} elements");
}

#[test]
fn copy_range_moves_a_region_and_refuses_out_of_bounds() {
    let Some(g) = gpu() else { return };
    let x = vals(4, 100);
    let src = g.upload(&x).unwrap();
    let dst = g.upload(&[0.0; 50]).unwrap();
    g.copy_range(&src, 30, &dst, 10, 25).unwrap();
    let got = read(g, &dst);
    assert_eq!(&got[10..35], &x[30..55]);
    assert!(got[..10].iter().chain(&got[35..]).all(|&v| v == 0.0));
    for (s, d, n) in [(90, 0, 11), (0, 40, 11), (usize::MAX, 0, 2)] {
        let e = g.copy_range(&src, s, &dst, d, n).unwrap_err().to_string();
        assert!(e.contains("copy_range"), "{e}");
    }
    g.copy_range(&src, 100, &dst, 50, 0).unwrap();
}

#[test]
fn device_uuid_finds_the_same_adapter_and_an_unknown_one_is_an_error() {
    let Some(g) = gpu() else { return };
    let Some(id) = g.device_uuid() else {
        println!("skipped: {} is not a Vulkan device", g.describe());
        return;
    };
    let again = futures::executor::block_on(Gpu::with_device_uuid(id)).unwrap();
    assert_eq!(again.device_uuid(), Some(id));
    assert_eq!(again.describe(), g.describe());
    let mut other = id;
    other[0] ^= 0xff;
    other[15] ^= 0x5a;
    let e = futures::executor::block_on(Gpu::with_device_uuid(other))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no Vulkan adapter has device UUID"), "{e}");
}

#[test]
fn an_import_larger_than_the_shared_memory_is_refused() {
    let Some(g) = gpu() else { return };
    let (_a, mem) = exportable(g, 16);
    let size = mem.size();
    let too_many = (size / 4) as usize + 1;
    let e = g.import_opaque_fd(mem, too_many).unwrap_err().to_string();
    assert!(e.contains("do not fit"), "{e}");
}
