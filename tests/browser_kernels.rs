//! WGSL kernels in a real browser: headless Chromium with WebGPU (SwiftShader), checked against the
//! CPU backend. Run with `cargo test --target wasm32-unknown-unknown --test browser_kernels`
//! (needs wasm-bindgen-cli and chromium + chromium-driver; `.ci/run` installs them).
#![cfg(all(target_arch = "wasm32", feature = "wgpu"))]

use distgrad::ReduceOp;
use distgrad::backend::gpu::Gpu;
use distgrad::backend::{BinaryOp, Device, UnaryOp, cpu};
use distgrad::{Tensor, tensor::broadcast_shape};
use wasm_bindgen_test::{wasm_bindgen_test, wasm_bindgen_test_configure};

wasm_bindgen_test_configure!(run_in_browser);

fn vals(seed: u32, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000) as f32 / 125.0 - 4.0)
        .collect()
}

#[wasm_bindgen_test]
async fn webgpu_kernels_match_the_cpu() {
    let gpu = Gpu::new()
        .await
        .expect("headless Chromium with --enable-unsafe-webgpu has an adapter");
    web_sys_log(&format!("adapter: {}", gpu.describe()));
    let n = 1000;
    let (a, b) = (vals(1, n), vals(2, n));
    let (ga, gb) = (gpu.upload(&a).unwrap(), gpu.upload(&b).unwrap());
    for op in [BinaryOp::Add, BinaryOp::Mul, BinaryOp::Max] {
        let got = gpu
            .read(&gpu.binary(op, &ga, &gb, n, None).unwrap())
            .await
            .unwrap();
        let want = cpu::binary_same(op, &a, &b);
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{op:?}"
        );
    }
    // reduce-into, the local step of every reducing collective
    let acc = gpu.upload(&a).unwrap();
    gpu.reduce_into(BinaryOp::Add, &acc, &gb).unwrap();
    let mut want = a.clone();
    cpu::reduce_into(BinaryOp::Add, &mut want, &b);
    assert_eq!(gpu.read(&acc).await.unwrap(), want);
    // tensor level: broadcasting and unary ops on the device, read back asynchronously
    let d = Device::Gpu(gpu.clone());
    let x = Tensor::from_vec(vals(3, 12), &[3, 4]).unwrap();
    let y = Tensor::from_vec(vals(4, 4), &[4]).unwrap();
    let z = x
        .to_device(&d)
        .unwrap()
        .add(&y.to_device(&d).unwrap())
        .unwrap()
        .unary(UnaryOp::Relu)
        .unwrap();
    assert_eq!(
        broadcast_shape("t", x.shape(), y.shape()).unwrap(),
        z.shape()
    );
    assert_eq!(
        z.read().await.unwrap(),
        x.add(&y)
            .unwrap()
            .unary(UnaryOp::Relu)
            .unwrap()
            .read()
            .await
            .unwrap()
    );
}

fn web_sys_log(s: &str) {
    wasm_bindgen_test::console_log!("{s}");
}

/// Every collective forward + backward with the ranks simulated inside the page (in-process
/// transport, interleaved on one task: the single-tab mode), tensors on WebGPU, against the same
/// ranks on the CPU; and hand-checked values for one case.
#[wasm_bindgen_test]
async fn collectives_in_one_page_on_webgpu_match_the_cpu() {
    use distgrad::collective::Kind;
    use distgrad::vjp;
    let gpu = Device::Gpu(Gpu::new().await.expect("WebGPU adapter"));
    let world = 3;
    for which in vjp::COLLECTIVES {
        let ops: &[ReduceOp] = if which.takes_op() {
            &ReduceOp::ALL
        } else {
            &[ReduceOp::Sum]
        };
        for &op in ops {
            let root = if which.takes_root() { 2 } else { 0 };
            let case = vjp::example_case(which, world, op, root, None).unwrap();
            let on_cpu = vjp::run_case_interleaved(&case, &Device::Cpu)
                .await
                .unwrap();
            let on_gpu = vjp::run_case_interleaved(&case, &gpu).await.unwrap();
            assert_eq!(on_gpu, on_cpu, "{} {}", which.name(), op.name());
        }
    }
    // Hand-derived: all_reduce(MAX) of [r+1, 2(3-r)] over 3 ranks is [3, 6]; the gradient goes
    // to the holder of each maximum (rank 2 for element 0, rank 0 for element 1) with the summed
    // cotangent [1+1+1, 1+2+3].
    let case = vjp::example_case(Kind::AllReduce, 3, ReduceOp::Max, 0, None).unwrap();
    let out = vjp::run_case_interleaved(&case, &gpu).await.unwrap();
    let v = |t: &vjp::TensorJson| t.data.iter().map(|x| x.unwrap()).collect::<Vec<f32>>();
    for r in 0..3 {
        assert_eq!(v(&out.outputs[r][0]), [3.0, 6.0]);
    }
    assert_eq!(v(&out.grads[0][0]), [0.0, 6.0]);
    assert_eq!(v(&out.grads[1][0]), [0.0, 0.0]);
    assert_eq!(v(&out.grads[2][0]), [3.0, 0.0]);
}

/// The browser transport's framing in the browser: a message fragmented to WebRTC's 256 KiB
/// message limit comes back whole, interleaved with another tag's fragments.
#[wasm_bindgen_test]
fn framing_for_data_channels_round_trips() {
    use distgrad::transport::{Channel, Tag};
    use distgrad::wire::{HEADER_LEN, Header, Reassembler, fragments};
    let tag = |seq| Tag {
        group: 0,
        seq,
        channel: Channel::Data,
    };
    let big: Vec<u8> = (0..(600 * 1024u32)).map(|i| (i % 251) as u8).collect();
    let small = b"sig".to_vec();
    let max = distgrad::transport::browser::RTC_MAX_MESSAGE - HEADER_LEN;
    let fa = fragments(3, 1, tag(5), &big, max);
    let fb = fragments(3, 1, tag(6), &small, max);
    assert_eq!(fa.len(), 3);
    assert!(
        fa.iter()
            .all(|f| f.len() <= distgrad::transport::browser::RTC_MAX_MESSAGE)
    );
    let mut r = Reassembler::new(1 << 30);
    let mut got = Vec::new();
    for f in [&fa[0], &fb[0], &fa[1], &fa[2]] {
        let h = Header::decode(f).unwrap();
        if let Some(m) = r.push(h.src, &h, f.slice(HEADER_LEN..)).unwrap() {
            got.push((h.tag.seq, m));
        }
    }
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].1.as_ref(), small.as_slice());
    assert_eq!(got[1].1.as_ref(), big.as_slice());
}

/// The page's waits sleep on a worker (`transport::clock`): one is there, a sleep lasts at least
/// what it asked for, and a sleep given up (its future dropped before the worker answers) leaves
/// the clock working for the next ones.
#[wasm_bindgen_test]
async fn the_worker_clock_sleeps_as_long_as_asked() {
    use distgrad::transport::clock;
    use std::time::Duration;
    assert!(clock::unthrottled(), "no worker clock in headless Chromium");
    let t0 = js_sys::Date::now();
    clock::sleep(Duration::from_millis(30)).await;
    let slept = js_sys::Date::now() - t0;
    assert!(slept >= 29.0, "asked for 30 ms, woke after {slept} ms");
    // Give one up: the shorter of two sleeps wins, the longer one's future is dropped.
    let long = std::pin::pin!(clock::sleep(Duration::from_millis(500)));
    let short = std::pin::pin!(clock::sleep(Duration::from_millis(5)));
    match futures::future::select(long, short).await {
        futures::future::Either::Right(_) => {}
        futures::future::Either::Left(_) => panic!("the 500 ms sleep ended before the 5 ms one"),
    }
    let t2 = js_sys::Date::now();
    for _ in 0..20 {
        clock::sleep(Duration::from_millis(1)).await;
    }
    let twenty = js_sys::Date::now() - t2;
    assert!(twenty >= 20.0, "20 sleeps of 1 ms took {twenty} ms");
}
