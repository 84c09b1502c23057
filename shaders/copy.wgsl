// Strided copies: slice, concat, transpose and the chunk copies of gather / scatter / all_gather /
// all_to_all. For each index of a `shape`-shaped region:
//   dst[dst_off + Σ idx·dst_strides] = src[src_off + Σ idx·src_strides]
// params: [n, ndim, src_off, dst_off, shape[8], src_strides[8], dst_strides[8]]

@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@group(0) @binding(2) var<storage, read> params: array<u32>;

@compute @workgroup_size(256)
fn copy_strided(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= params[0]) { return; }
    let ndim = params[1];
    var s = params[2];
    var d = params[3];
    var rem = i;
    for (var t = 0u; t < ndim; t++) {
        let k = ndim - 1u - t;
        let idx = rem % params[4u + k];
        rem = rem / params[4u + k];
        s += idx * params[12u + k];
        d += idx * params[20u + k];
    }
    dst[d] = src[s];
}

// Flat copy: dst[dst_off + i] = src[src_off + i] for i < n, as a grid-stride loop (neighbouring
// invocations copy neighbouring elements). params: [n, src_off, dst_off, total invocations]
@compute @workgroup_size(256)
fn copy_flat(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let n = params[0];
    let s = params[1];
    let d = params[2];
    let stride = params[3];
    for (var i = linear_index(gid, nwg, 256u); i < n; i += stride) {
        dst[d + i] = src[s + i];
    }
}
