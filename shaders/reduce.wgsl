// Reductions: the local step of every reducing collective (acc = acc ⊕ x, in place, 4 elements per
// thread), sum of all elements (serial then a tree on a GPU, barrier-free runs on a CPU adapter),
// and sum down to a broadcast shape.

@group(0) @binding(0) var<storage, read_write> acc: array<f32>;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> params: array<u32>;

// params: [n, op, offset into acc, offset into x]
@compute @workgroup_size(256)
fn reduce_into(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = linear_index(gid, nwg, 256u);
    let n = params[0];
    let op = params[1];
    let base = t * 4u;
    for (var k = 0u; k < 4u; k++) {
        let i = base + k;
        if (i < n) {
            acc[params[2] + i] = apply_binary(op, acc[params[2] + i], x[params[3] + i]);
        }
    }
}

// Sum of x[0..n] into acc[group]: workgroup `group` covers elements [group·256·per, +256·per);
// thread t adds every 256th of them from t (neighbouring invocations read neighbouring
// elements, coalesced on a GPU), then the workgroup adds its 256 partial sums as a tree.
// params: [n, per, groups]
var<workgroup> partial: array<f32, 256>;

@compute @workgroup_size(256)
fn sum_partials(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let n = params[0];
    let per = params[1];
    let group = wid.x + wid.y * nwg.x;
    // A 2-D grid may have more workgroups than partial sums: the extra ones do nothing (the test is
    // uniform across the workgroup, so the barriers below stay in uniform control flow).
    if (group >= params[2]) { return; }
    let start = group * 256u * per + lid.x;
    var s = 0.0;
    for (var k = 0u; k < per; k++) {
        let i = start + k * 256u;
        if (i < n) { s += x[i]; }
    }
    partial[lid.x] = s;
    workgroupBarrier();
    for (var stride = 128u; stride > 0u; stride = stride / 2u) {
        if (lid.x < stride) { partial[lid.x] += partial[lid.x + stride]; }
        workgroupBarrier();
    }
    if (lid.x == 0u) { acc[group] = partial[0]; }
}

// Sum of x[0..n] into acc[0..outs]: invocation j adds its run x[j·per, (j+1)·per) serially, with
// no workgroup memory and no barrier: the sum on CPU adapters, which run barriers slowly
// (SwiftShader in Chromium: 1 MiB in ~60 ms with the tree above, 3-9 ms with this; lavapipe:
// 1.5-1.7x faster). params: [n, per, outs]
@compute @workgroup_size(256)
fn sum_runs(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let j = linear_index(gid, nwg, 256u);
    if (j >= params[2]) { return; }
    let n = params[0];
    let per = params[1];
    let start = j * per;
    var s = 0.0;
    for (var k = 0u; k < per; k++) {
        let i = start + k;
        if (i < n) { s += x[i]; }
    }
    acc[j] = s;
}

// out[j] = sum of x over the broadcast dims. params: [n_out, n_red, nk, nr, kept_sizes[8],
// kept_strides[8], red_sizes[8], red_strides[8]]
@compute @workgroup_size(256)
fn sum_to(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let j = linear_index(gid, nwg, 256u);
    if (j >= params[0]) { return; }
    let nk = params[2];
    let nr = params[3];
    var base = 0u;
    var rem = j;
    for (var d = 0u; d < nk; d++) {
        let k = nk - 1u - d;
        base += (rem % params[4u + k]) * params[12u + k];
        rem = rem / params[4u + k];
    }
    var s = 0.0;
    for (var r = 0u; r < params[1]; r++) {
        var off = 0u;
        var q = r;
        for (var d = 0u; d < nr; d++) {
            let k = nr - 1u - d;
            off += (q % params[20u + k]) * params[28u + k];
            q = q / params[20u + k];
        }
        s += x[base + off];
    }
    acc[j] = s;
}

// The same local step, fast path: 16-byte aligned whole vec4s, the op fixed when the pipeline is
// built (so no per-element switch), and each invocation does many vec4s (software rasterizers pay
// per invocation). params: [n_vec4, total threads, (inputs), per]. Two layouts, the same
// operations on every element: `per` = 0 is a grid-stride loop (neighbouring invocations touch
// neighbouring vec4s: coalesced on a real GPU); `per` > 0 gives each invocation its own run of
// `per` consecutive vec4s, which a CPU rasterizer (lavapipe: one SIMD lane per invocation) runs
// about 4x faster.
fn span4(t: u32, n: u32, stride: u32, per: u32) -> vec3<u32> {
    if (per == 0u) { return vec3<u32>(t, n, stride); }
    let start = t * per;
    return vec3<u32>(start, min(start + per, n), 1u);
}
override OP: u32 = 0u;

@group(0) @binding(3) var<storage, read_write> acc4: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> x4: array<vec4<f32>>;

fn apply4(a: vec4<f32>, b: vec4<f32>) -> vec4<f32> {
    switch OP {
        case OP_ADD: { return a + b; }
        case OP_MUL: { return a * b; }
        // The other ops, lane by lane (the same code as the scalar kernels).
        default: {
            return vec4<f32>(apply_binary(OP, a.x, b.x), apply_binary(OP, a.y, b.y),
                             apply_binary(OP, a.z, b.z), apply_binary(OP, a.w, b.w));
        }
    }
}

@compute @workgroup_size(256)
fn reduce_into_vec4(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = span4(linear_index(gid, nwg, 256u), params[0], params[1], params[3]);
    for (var i = r.x; i < r.y; i += r.z) {
        acc4[i] = apply4(acc4[i], x4[i]);
    }
}

// Several inputs folded into the accumulator in one pass: acc = ((acc ⊕ y1) ⊕ y2) ⊕ y3, the same
// operations in the same order as three reduce-into passes (bit for bit), with one read of each
// input and one write. params: [n_vec4, total threads, inputs (1..3), per] (see span4)
@group(0) @binding(7) var<storage, read> y2: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read> y3: array<vec4<f32>>;

@compute @workgroup_size(256)
fn fold_into_vec4(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let k = params[2];
    let r = span4(linear_index(gid, nwg, 256u), params[0], params[1], params[3]);
    for (var i = r.x; i < r.y; i += r.z) {
        var a = apply4(acc4[i], x4[i]);
        if (k >= 2u) { a = apply4(a, y2[i]); }
        if (k >= 3u) { a = apply4(a, y3[i]); }
        acc4[i] = a;
    }
}
