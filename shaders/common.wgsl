// Shared by the elementwise and reduce kernels: the binary ops, bit for bit as the CPU backend
// (backend::BinaryOp::apply) on numbers; a NaN operand gives NaN (its payload bits may differ from
// the CPU's). NaN is tested on the bits: WGSL may assume finite math otherwise. The NaN result is
// made at run time (x + y with a NaN operand): a constant NaN is rejected by some WGSL compilers.
// The op codes (OP_ADD, ..., UN_NEG, ...) are constants that the Rust side prepends to every
// kernel from its one table (backend/gpu.rs, `binary_code` / `unary_code`).

fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

fn apply_binary(op: u32, x: f32, y: f32) -> f32 {
    switch op {
        case OP_ADD: { return x + y; }
        case OP_SUB: { return x - y; }
        case OP_MUL: { return x * y; }
        case OP_DIV: { return x / y; }
        case OP_MAX: {
            if (is_nan(x) || is_nan(y)) { return x + y; }
            return select(y, x, x >= y);
        }
        case OP_MIN: {
            if (is_nan(x) || is_nan(y)) { return x + y; }
            return select(y, x, x <= y);
        }
        case OP_EQ: { return select(0.0, 1.0, x == y); }
        // WGSL needs a default; no other code is ever sent (the codes are the Rust table's).
        default: { return 0.0; }
    }
}

// Linear invocation index for 2-D dispatches (more than 65535 workgroups).
fn linear_index(gid: vec3<u32>, nwg: vec3<u32>, wg: u32) -> u32 {
    return gid.x + gid.y * nwg.x * wg;
}
