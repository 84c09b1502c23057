// Tiled matrix product C[m,n] = A[m,k] · B[k,n], 16x16 tiles in workgroup memory.
// params: [m, k, n]

@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@group(0) @binding(3) var<storage, read> params: array<u32>;

var<workgroup> ta: array<array<f32, 16>, 16>;
var<workgroup> tb: array<array<f32, 16>, 16>;

@compute @workgroup_size(16, 16)
fn matmul(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let m = params[0];
    let k = params[1];
    let n = params[2];
    let row = wid.y * 16u + lid.y;
    let col = wid.x * 16u + lid.x;
    var s = 0.0;
    let tiles = (k + 15u) / 16u;
    for (var t = 0u; t < tiles; t++) {
        let ka = t * 16u + lid.x;
        let kb = t * 16u + lid.y;
        // Load only in bounds (select would evaluate the out-of-range read).
        var va = 0.0;
        if (row < m && ka < k) { va = a[row * k + ka]; }
        var vb = 0.0;
        if (kb < k && col < n) { vb = b[kb * n + col]; }
        ta[lid.y][lid.x] = va;
        tb[lid.y][lid.x] = vb;
        workgroupBarrier();
        for (var q = 0u; q < 16u; q++) {
            s += ta[lid.y][q] * tb[q][lid.x];
        }
        workgroupBarrier();
    }
    if (row < m && col < n) { c[row * n + col] = s; }
}
