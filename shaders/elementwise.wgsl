// Elementwise ops of the tape: binary with NumPy broadcasting (strides, 0 where broadcast) and unary.
// params (binary): [n, op, ndim, _, out_shape[8], a_strides[8], b_strides[8]]; ndim 0 = same shapes.
// params (unary):  [n, op, scalar bits]

@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<storage, read> params: array<u32>;

@compute @workgroup_size(256)
fn binary(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg, 256u);
    if (i >= params[0]) { return; }
    let ndim = params[2];
    var ia = i;
    var ib = i;
    if (ndim > 0u) {
        ia = 0u;
        ib = 0u;
        var rem = i;
        for (var d = 0u; d < ndim; d++) {
            let k = ndim - 1u - d;
            let size = params[4u + k];
            let idx = rem % size;
            rem = rem / size;
            ia += idx * params[12u + k];
            ib += idx * params[20u + k];
        }
    }
    out[i] = apply_binary(params[1], a[ia], b[ib]);
}

fn apply_unary(op: u32, x: f32, c: f32) -> f32 {
    switch op {
        case UN_NEG: { return -x; }
        case UN_SCALE: { return c * x; }
        case UN_RELU: { return select(0.0, x, x > 0.0); }
        case UN_STEP: { return select(0.0, 1.0, x > 0.0); }
        case UN_TANH: { return tanh(x); }
        case UN_SQUARE: { return x * x; }
        // WGSL needs a default; no other code is ever sent.
        default: { return 0.0; }
    }
}

@compute @workgroup_size(256)
fn unary(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg, 256u);
    if (i >= params[0]) { return; }
    out[i] = apply_unary(params[1], a[i], bitcast<f32>(params[2]));
}
