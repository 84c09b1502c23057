//! CPU kernels on plain slices: the reference implementation of every local op and of the local step
//! of every collective (reduce a received chunk into an accumulator, slice, concat, scale).
//!
//! Shapes are checked by the caller ([`crate::Tensor`]); these functions trust their arguments.

use super::{BinaryOp, UnaryOp};

/// `out[i] = op(a[i], b[i])` for equal-length slices.
pub fn binary_same(op: BinaryOp, a: &[f32], b: &[f32]) -> Vec<f32> {
    debug_assert_eq!(a.len(), b.len());
    let mut out = crate::pool::take(a.len());
    // One match outside the loop so each arm's loop vectorizes.
    match op {
        BinaryOp::Add => out.extend(a.iter().zip(b).map(|(x, y)| x + y)),
        BinaryOp::Sub => out.extend(a.iter().zip(b).map(|(x, y)| x - y)),
        BinaryOp::Mul => out.extend(a.iter().zip(b).map(|(x, y)| x * y)),
        _ => out.extend(a.iter().zip(b).map(|(&x, &y)| op.apply(x, y))),
    }
    out
}

/// `acc[i] = op(acc[i], x[i])` in place: the local step of every reducing collective.
pub fn reduce_into(op: BinaryOp, acc: &mut [f32], x: &[f32]) {
    debug_assert_eq!(acc.len(), x.len());
    match op {
        BinaryOp::Add => acc.iter_mut().zip(x).for_each(|(a, b)| *a += b),
        BinaryOp::Mul => acc.iter_mut().zip(x).for_each(|(a, b)| *a *= b),
        _ => acc
            .iter_mut()
            .zip(x)
            .for_each(|(a, &b)| *a = op.apply(*a, b)),
    }
}

/// `op` over every input, element by element, folded left to right:
/// `out[i] = op(..op(op(xs[0][i], xs[1][i]), xs[2][i]).., xs[k-1][i])`: the same operations in the
/// same order as `reduce_into` applied to each input in turn, but in one pass over memory (the
/// fold runs block by block, so the partial result stays in L1 instead of streaming through memory
/// once per input). Every input must have the same length; no inputs gives an empty result.
pub fn fold_all(op: BinaryOp, xs: &[&[f32]]) -> Vec<f32> {
    const BLOCK: usize = 2048;
    let Some((first, rest)) = xs.split_first() else {
        return Vec::new();
    };
    debug_assert!(rest.iter().all(|x| x.len() == first.len()));
    let mut out = crate::pool::take(first.len());
    let mut start = 0;
    while start < first.len() {
        let end = (start + BLOCK).min(first.len());
        out.extend_from_slice(&first[start..end]);
        for x in rest {
            reduce_into(op, &mut out[start..end], &x[start..end]);
        }
        start = end;
    }
    out
}

/// `acc = op(..op(op(acc, xs[0]), xs[1]).., xs[k-1])` in place, element by element: the same
/// operations in the same order as [`reduce_into`] with each input in turn, in one pass over
/// memory (block by block, the block of `acc` staying in L1).
pub fn reduce_into_many(op: BinaryOp, acc: &mut [f32], xs: &[&[f32]]) {
    const BLOCK: usize = 2048;
    debug_assert!(xs.iter().all(|x| x.len() == acc.len()));
    let mut start = 0;
    while start < acc.len() {
        let end = (start + BLOCK).min(acc.len());
        for x in xs {
            reduce_into(op, &mut acc[start..end], &x[start..end]);
        }
        start = end;
    }
}

/// Little-endian f32 bytes as f32s: borrowed when aligned (messages of this process, most
/// received buffers), decoded into a copy otherwise.
pub fn f32s_of_le_bytes(x: &[u8]) -> std::borrow::Cow<'_, [f32]> {
    match bytemuck::try_cast_slice::<u8, f32>(x) {
        Ok(xs) if cfg!(target_endian = "little") => std::borrow::Cow::Borrowed(xs),
        _ => std::borrow::Cow::Owned(f32s_from_le_bytes(x)),
    }
}

/// Like [`reduce_into`], reading `x` from little-endian f32 bytes (a received message).
pub fn reduce_into_le_bytes(op: BinaryOp, acc: &mut [f32], x: &[u8]) {
    debug_assert_eq!(acc.len() * 4, x.len());
    match bytemuck::try_cast_slice::<u8, f32>(x) {
        Ok(xs) if cfg!(target_endian = "little") => reduce_into(op, acc, xs),
        _ => acc
            .iter_mut()
            .zip(x.chunks_exact(4))
            .for_each(|(a, b)| *a = op.apply(*a, f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
    }
}

/// `out[i] = op(a[i], x[i])` where `x` is little-endian f32 bytes: reduce a received chunk into a
/// fresh buffer (one read of each input, one write).
pub fn combine_le_bytes(op: BinaryOp, a: &[f32], x: &[u8]) -> Vec<f32> {
    debug_assert_eq!(a.len() * 4, x.len());
    match bytemuck::try_cast_slice::<u8, f32>(x) {
        Ok(xs) if cfg!(target_endian = "little") => binary_same(op, a, xs),
        _ => a
            .iter()
            .zip(x.chunks_exact(4))
            .map(|(&a, b)| op.apply(a, f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect(),
    }
}

/// Decode little-endian f32 bytes.
pub fn f32s_from_le_bytes(x: &[u8]) -> Vec<f32> {
    let mut out = crate::pool::take(x.len() / 4);
    crate::pool::extend_from_le_bytes(&mut out, x);
    out
}

/// Row-major strides of a shape.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Binary op with NumPy broadcasting. `out_shape` is the broadcast shape; `a_shape`/`b_shape` are
/// right-aligned against it.
pub fn binary_broadcast(
    op: BinaryOp,
    a: &[f32],
    a_shape: &[usize],
    b: &[f32],
    b_shape: &[usize],
    out_shape: &[usize],
) -> Vec<f32> {
    let n: usize = out_shape.iter().product();
    if a.len() == n && b.len() == n {
        return binary_same(op, a, b);
    }
    if b.len() == 1 {
        return a.iter().map(|&x| op.apply(x, b[0])).collect();
    }
    if a.len() == 1 {
        return b.iter().map(|&y| op.apply(a[0], y)).collect();
    }
    let sa = broadcast_strides(a_shape, out_shape);
    let sb = broadcast_strides(b_shape, out_shape);
    let mut out = Vec::with_capacity(n);
    let mut idx = vec![0usize; out_shape.len()];
    let (mut ia, mut ib) = (0usize, 0usize);
    for _ in 0..n {
        out.push(op.apply(a[ia], b[ib]));
        // Odometer increment over the output index, updating both input offsets.
        for d in (0..out_shape.len()).rev() {
            idx[d] += 1;
            ia += sa[d];
            ib += sb[d];
            if idx[d] < out_shape[d] {
                break;
            }
            ia -= sa[d] * out_shape[d];
            ib -= sb[d] * out_shape[d];
            idx[d] = 0;
        }
    }
    out
}

/// Strides of `shape` seen through `out_shape` (0 where broadcast).
pub fn broadcast_strides(shape: &[usize], out_shape: &[usize]) -> Vec<usize> {
    let st = strides(shape);
    let off = out_shape.len() - shape.len();
    (0..out_shape.len())
        .map(|d| {
            if d < off || shape[d - off] == 1 {
                0
            } else {
                st[d - off]
            }
        })
        .collect()
}

/// Sum `a` (of `shape`) down to `target` (a shape `shape` broadcasts from): the backward of broadcasting.
pub fn sum_to(a: &[f32], shape: &[usize], target: &[usize]) -> Vec<f32> {
    let n_out: usize = target.iter().product();
    if n_out == a.len() {
        return a.to_vec();
    }
    let st = broadcast_strides(target, shape);
    let mut out = vec![0.0f32; n_out];
    let mut idx = vec![0usize; shape.len()];
    let mut io = 0usize;
    for &x in a {
        out[io] += x;
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            io += st[d];
            if idx[d] < shape[d] {
                break;
            }
            io -= st[d] * shape[d];
            idx[d] = 0;
        }
    }
    out
}

/// `out[i] = op(a[i])`.
pub fn unary(op: UnaryOp, a: &[f32]) -> Vec<f32> {
    match op {
        UnaryOp::Scale(c) => a.iter().map(|x| c * x).collect(),
        _ => a.iter().map(|&x| op.apply(x)).collect(),
    }
}

/// `[m,k] x [k,n] -> [m,n]`, i-k-j loop order (rows of `b` stream through cache).
pub fn matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; m * n];
    for i in 0..m {
        let row = &mut out[i * n..(i + 1) * n];
        for p in 0..k {
            let aip = a[i * k + p];
            let brow = &b[p * n..(p + 1) * n];
            row.iter_mut().zip(brow).for_each(|(o, &bv)| *o += aip * bv);
        }
    }
    out
}

/// Transpose of an `[m,n]` matrix.
pub fn transpose(a: &[f32], m: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            out[j * m + i] = a[i * n + j];
        }
    }
    out
}

/// Sum of all elements, accumulated in f64 in index order (deterministic, accurate).
pub fn sum_all(a: &[f32]) -> f32 {
    a.iter().map(|&x| x as f64).sum::<f64>() as f32
}

/// Elements `start..start+len` along `dim` of a tensor of `shape`.
pub fn slice(a: &[f32], shape: &[usize], dim: usize, start: usize, len: usize) -> Vec<f32> {
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let mut out = Vec::with_capacity(outer * len * inner);
    for o in 0..outer {
        let base = (o * shape[dim] + start) * inner;
        out.extend_from_slice(&a[base..base + len * inner]);
    }
    out
}

/// Concatenate along `dim`; `parts` are `(data, size along dim)`, all other dims equal, `inner` is the
/// product of the dims after `dim` and `outer` of those before it.
pub fn concat(parts: &[(&[f32], usize)], outer: usize, inner: usize) -> Vec<f32> {
    let total: usize = parts.iter().map(|(_, d)| d * inner).sum::<usize>() * outer;
    let mut out = Vec::with_capacity(total);
    for o in 0..outer {
        for (data, d) in parts {
            let w = d * inner;
            out.extend_from_slice(&data[o * w..(o + 1) * w]);
        }
    }
    out
}

/// For inputs `x_0..x_{n-1}` (equal lengths) return `p_j = prod_{k != j} x_k`, elementwise, without
/// division (exact when inputs contain zeros): prefix and suffix products.
pub fn product_of_others(xs: &[&[f32]]) -> Vec<Vec<f32>> {
    let n = xs.len();
    if n == 0 {
        return Vec::new();
    }
    let len = xs[0].len();
    // prefix[j] = x_0 * ... * x_{j-1}
    let mut prefix = vec![vec![1.0f32; len]];
    for x in xs.iter().take(n - 1) {
        let next = binary_same(BinaryOp::Mul, prefix.last().expect("non-empty"), x);
        prefix.push(next);
    }
    let mut out = vec![Vec::new(); n];
    let mut suffix = vec![1.0f32; len];
    for j in (0..n).rev() {
        out[j] = binary_same(BinaryOp::Mul, &prefix[j], &suffix);
        if j > 0 {
            reduce_into(BinaryOp::Mul, &mut suffix, xs[j]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_row_and_column() {
        // [2,3] + [3] adds the row to each row; [2,1] + [3] makes a [2,3] outer sum.
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [10.0, 20.0, 30.0];
        let out = binary_broadcast(BinaryOp::Add, &a, &[2, 3], &b, &[3], &[2, 3]);
        assert_eq!(out, vec![11.0, 22.0, 33.0, 14.0, 25.0, 36.0]);
        let c = [1.0, 2.0];
        let out = binary_broadcast(BinaryOp::Mul, &c, &[2, 1], &b, &[3], &[2, 3]);
        assert_eq!(out, vec![10.0, 20.0, 30.0, 20.0, 40.0, 60.0]);
        // and back: summing [2,3] to [3] adds the rows, to [2,1] adds the columns.
        assert_eq!(sum_to(&a, &[2, 3], &[3]), vec![5.0, 7.0, 9.0]);
        assert_eq!(sum_to(&a, &[2, 3], &[2, 1]), vec![6.0, 15.0]);
    }

    #[test]
    fn product_of_others_with_zeros() {
        let x0 = [2.0, 0.0, 1.0];
        let x1 = [3.0, 5.0, 0.0];
        let x2 = [4.0, 7.0, 0.0];
        let p = product_of_others(&[&x0, &x1, &x2]);
        assert_eq!(p[0], vec![12.0, 35.0, 0.0]);
        assert_eq!(p[1], vec![8.0, 0.0, 0.0]);
        assert_eq!(p[2], vec![6.0, 0.0, 0.0]);
    }

    #[test]
    fn slice_and_concat_are_inverse() {
        let a: Vec<f32> = (0..24).map(|x| x as f32).collect();
        let shape = [2, 3, 4];
        let l = slice(&a, &shape, 1, 0, 1);
        let r = slice(&a, &shape, 1, 1, 2);
        assert_eq!(l, vec![0.0, 1.0, 2.0, 3.0, 12.0, 13.0, 14.0, 15.0]);
        assert_eq!(concat(&[(&l, 1), (&r, 2)], 2, 4), a);
    }

    #[test]
    fn matmul_small() {
        // [[1,2],[3,4]] x [[5],[6]] = [[17],[39]]
        assert_eq!(
            matmul(&[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0], 2, 2, 1),
            vec![17.0, 39.0]
        );
        assert_eq!(
            transpose(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2, 3),
            vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]
        );
    }
}
