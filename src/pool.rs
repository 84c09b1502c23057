//! Host buffers and their byte views, the one low module that the wire, the transports and the
//! compute backends share (it imports nothing else of the crate).
//!
//! - A cache of large host buffers ([`take`], [`give`]), so that collectives and ops producing big
//!   tensors in a loop (a training step's gradient all_reduce, a benchmark) reuse memory instead
//!   of asking the OS for fresh pages every call: the kernel zeroes every new page, which costs
//!   more than the collective's own passes over the data. Buffers come back here when the last
//!   tensor or message sharing them is dropped; only buffers of at least [`MIN_ELEMS`] elements
//!   are kept, at most [`MAX_RETAINED_BYTES`] in all (the oldest go first).
//! - Byte views of f32 buffers: [`f32_bytes`] (a `Vec<f32>` as its little-endian bytes, no copy,
//!   the buffer back to the cache when the last view drops) and [`extend_from_le_bytes`].

use std::sync::Mutex;

use bytes::Bytes;

/// Smallest buffer worth caching (1 MiB of f32): smaller ones are cheap for the allocator.
pub const MIN_ELEMS: usize = 1 << 18;

/// Most bytes the cache holds.
pub const MAX_RETAINED_BYTES: usize = 1 << 30;

/// The cached buffers (the global one behind [`take`] and [`give`]).
struct Cache {
    free: Vec<Vec<f32>>,
    max_bytes: usize,
}

impl Cache {
    const fn new(max_bytes: usize) -> Self {
        Cache {
            free: Vec::new(),
            max_bytes,
        }
    }

    fn take(&mut self, len: usize) -> Vec<f32> {
        if len >= MIN_ELEMS
            && let Some(i) = self.free.iter().rposition(|v| v.capacity() == len)
        {
            let mut v = self.free.swap_remove(i);
            v.clear();
            return v;
        }
        Vec::with_capacity(len)
    }

    fn give(&mut self, v: Vec<f32>) {
        let cap = v.capacity();
        if cap < MIN_ELEMS || cap * 4 > self.max_bytes {
            return;
        }
        let mut held = self.held();
        while held + cap * 4 > self.max_bytes && !self.free.is_empty() {
            held -= self.free.remove(0).capacity() * 4;
        }
        self.free.push(v);
    }

    fn held(&self) -> usize {
        self.free.iter().map(|b| b.capacity() * 4).sum()
    }
}

static CACHE: Mutex<Cache> = Mutex::new(Cache::new(MAX_RETAINED_BYTES));

fn cache() -> std::sync::MutexGuard<'static, Cache> {
    // A list of owned buffers cannot be left inconsistent by a panic elsewhere.
    CACHE.lock().unwrap_or_else(|e| e.into_inner())
}

/// An empty vector with room for exactly `len` elements: a cached buffer of that capacity when
/// there is one.
pub fn take(len: usize) -> Vec<f32> {
    if len < MIN_ELEMS {
        return Vec::with_capacity(len);
    }
    cache().take(len)
}

/// Return a buffer (its contents are discarded).
pub fn give(v: Vec<f32>) {
    if v.capacity() >= MIN_ELEMS {
        cache().give(v);
    }
}

/// Bytes currently cached.
pub fn retained_bytes() -> usize {
    cache().held()
}

/// Little-endian bytes of `v` without copying (on little-endian targets); the buffer goes back to
/// the cache when the last view of it is dropped.
pub fn f32_bytes(v: Vec<f32>) -> Bytes {
    Bytes::from_owner(F32Vec(v))
}

/// Owner that exposes a `Vec<f32>` as its little-endian bytes (4-byte aligned, no copy).
struct F32Vec(Vec<f32>);

impl AsRef<[u8]> for F32Vec {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

impl Drop for F32Vec {
    fn drop(&mut self) {
        give(std::mem::take(&mut self.0));
    }
}

/// Append the f32s whose little-endian bytes are `x` (whole f32s; a trailing partial one is
/// ignored): one copy when `x` is 4-byte aligned on a little-endian target.
pub fn extend_from_le_bytes(out: &mut Vec<f32>, x: &[u8]) {
    match bytemuck::try_cast_slice::<u8, f32>(x) {
        Ok(xs) if cfg!(target_endian = "little") => out.extend_from_slice(xs),
        _ => out.extend(
            x.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuses_a_buffer_of_the_same_capacity_only() {
        let mut c = Cache::new(64 << 20);
        let big = vec![1.0f32; MIN_ELEMS + 3];
        let ptr = big.as_ptr();
        c.give(big);
        assert_eq!(c.held(), (MIN_ELEMS + 3) * 4);
        let other = c.take(MIN_ELEMS + 4);
        assert_ne!(
            other.as_ptr(),
            ptr,
            "a different size is not served from the cache"
        );
        let again = c.take(MIN_ELEMS + 3);
        assert_eq!(again.as_ptr(), ptr, "the cached buffer comes back");
        assert!(again.is_empty(), "contents are discarded");
        assert_eq!(c.held(), 0);
    }

    #[test]
    fn small_buffers_are_not_kept_and_the_oldest_go_first() {
        let mut c = Cache::new(3 * MIN_ELEMS * 4);
        c.give(vec![0.0; 10]);
        assert_eq!(c.held(), 0);
        let a = vec![0.0f32; MIN_ELEMS];
        let a_ptr = a.as_ptr();
        c.give(a);
        c.give(vec![0.0; MIN_ELEMS]);
        c.give(vec![0.0; MIN_ELEMS]);
        c.give(vec![0.0; MIN_ELEMS]);
        assert_eq!(c.held(), 3 * MIN_ELEMS * 4, "bounded");
        assert!(
            c.free.iter().all(|v| v.as_ptr() != a_ptr),
            "the oldest was dropped"
        );
        c.give(vec![0.0; 4 * MIN_ELEMS]);
        assert_eq!(
            c.held(),
            3 * MIN_ELEMS * 4,
            "a buffer larger than the cap is not kept"
        );
    }
}
