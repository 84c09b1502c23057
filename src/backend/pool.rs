//! A cache of large host buffers, so that collectives and ops producing big tensors in a loop (a
//! training step's gradient all_reduce, a benchmark) reuse memory instead of asking the OS for
//! fresh pages every call: the kernel zeroes every new page, which costs more than the
//! collective's own passes over the data. Buffers come back here when the last tensor or message
//! sharing them is dropped; only buffers of at least [`MIN_ELEMS`] elements are kept, at most
//! [`MAX_RETAINED_BYTES`] in all (the oldest go first).

use std::sync::Mutex;

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
