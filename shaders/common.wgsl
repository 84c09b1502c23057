// Shared by the elementwise and reduce kernels: the binary ops, bit for bit as the CPU backend
// (backend::BinaryOp::apply) on numbers; a NaN operand gives NaN (its payload bits may differ from
// the CPU's). NaN is tested on the bits: WGSL may assume finite math otherwise. The NaN result is
// made at run time (x + y with a NaN operand): a constant NaN is rejected by some WGSL compilers.

fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

fn apply_binary(op: u32, x: f32, y: f32) -> f32 {
    switch op {
        case 0u: { return x + y; }
        case 1u: { return x - y; }
        case 2u: { return x * y; }
        case 3u: { return x / y; }
        case 4u: {
            if (is_nan(x) || is_nan(y)) { return x + y; }
            return select(y, x, x >= y);
        }
        case 5u: {
            if (is_nan(x) || is_nan(y)) { return x + y; }
            return select(y, x, x <= y);
        }
        default: { return select(0.0, 1.0, x == y); }
    }
}

// Linear invocation index for 2-D dispatches (more than 65535 workgroups).
fn linear_index(gid: vec3<u32>, nwg: vec3<u32>, wg: u32) -> u32 {
    return gid.x + gid.y * nwg.x * wg;
}
