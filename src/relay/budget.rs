//! What the relay's queues may hold: each member's outgoing queue is bounded in bytes
//! ([`RelayConfig::max_pending_bytes`]) and all queues together by the relay's memory budget
//! ([`RelayConfig::memory_budget`]). A message queued for a member holds a [`Charge`] in both
//! until it is written; a sender waits for room in both, at most [`max_wait`] (then it is
//! dropped, saying why), so a member that stops reading slows its senders instead of growing the
//! relay's memory, and rooms that never read cannot pin more than the budget.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{RelayConfig, Shared};

/// Permits (bytes) of one member's outgoing queue: at least 1, at most what a `u32` acquire can
/// take.
pub(super) fn queue_budget(cfg: &RelayConfig) -> usize {
    cfg.max_pending_bytes.clamp(1, u32::MAX as usize)
}

/// What a message of `len` bytes costs in a queue budget (a message larger than the whole budget
/// takes all of it, so it still goes through, alone).
pub(super) fn queue_cost(cfg: &RelayConfig, len: usize) -> u32 {
    len.clamp(1, queue_budget(cfg)) as u32
}

/// Permits (bytes) of the relay's memory budget (at most what a semaphore holds).
pub(super) fn memory_permits(cfg: &RelayConfig) -> usize {
    cfg.memory_budget.clamp(1, Semaphore::MAX_PERMITS)
}

/// The longest a sender waits for room for one message: twice the idle timeout. A destination
/// whose writes stall is dropped after one idle timeout, which frees its queue; waiting longer
/// means the relay's memory budget stays full.
pub(super) fn max_wait(cfg: &RelayConfig) -> Duration {
    cfg.idle_timeout
        .saturating_mul(2)
        .max(Duration::from_millis(20))
}

/// Room held by one queued message: in its destination's queue and in the relay's memory budget
/// (given back when dropped, once written).
pub(super) struct Charge {
    _queue: OwnedSemaphorePermit,
    _memory: OwnedSemaphorePermit,
}

/// Room for a message of `len` bytes in `queue` (the destination's) and in the relay's memory
/// budget, waited for at most [`max_wait`]. `Ok(None)`: the destination left meanwhile (its queue
/// is closed; the message is dropped, its peers were told). `Err`: why the sender must go.
pub(super) async fn charge(
    shared: &Shared,
    queue: &Arc<Semaphore>,
    len: usize,
) -> Result<Option<Charge>, String> {
    let cfg = &shared.cfg;
    let cost = queue_cost(cfg, len);
    let wait = max_wait(cfg);
    let both = async {
        let Ok(q) = queue.clone().acquire_many_owned(cost).await else {
            return None;
        };
        // The budget is never closed; a failure would mean it was, and the message is dropped.
        let m = shared.memory.clone().acquire_many_owned(cost).await.ok()?;
        Some(Charge {
            _queue: q,
            _memory: m,
        })
    };
    tokio::time::timeout(wait, both).await.map_err(|_| {
        format!(
            "waited {wait:?} for room to send (the destination's queue of {} bytes, or the \
             relay's memory budget of {} bytes, stayed full)",
            queue_budget(cfg),
            memory_permits(cfg)
        )
    })
}

/// The default of [`RelayConfig::memory_budget`]: a quarter of the host's memory, at most 4 GiB
/// (1 GiB where the host's memory cannot be read).
pub fn default_memory_budget() -> usize {
    const CAP: usize = 4 << 30;
    host_memory().map_or(1 << 30, |m| (m / 4).min(CAP))
}

/// The host's physical memory in bytes, where the OS says.
fn host_memory() -> Option<usize> {
    #[cfg(unix)]
    {
        // SAFETY: sysconf only reads system configuration values.
        let (pages, size) = unsafe {
            (
                libc::sysconf(libc::_SC_PHYS_PAGES),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        if pages > 0 && size > 0 {
            return usize::try_from(pages)
                .ok()?
                .checked_mul(usize::try_from(size).ok()?);
        }
    }
    None
}

/// A byte count as a person writes it: digits, optionally followed by `K`, `M`, `G` or `T`
/// (powers of 1024; `KiB`, `MB` and the like mean the same).
pub fn parse_bytes(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: usize = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a byte count (e.g. 2G, 512M, 1048576)"))?;
    let shift = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (K, M, G or T)")),
    };
    n.checked_mul(1usize << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::{default_memory_budget, parse_bytes};

    #[test]
    fn byte_counts_read_as_people_write_them() {
        assert_eq!(parse_bytes("1048576"), Ok(1 << 20));
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes(" 3 g "), Ok(3 << 30));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("2X").is_err());
        assert!(parse_bytes("99999999999999999999T").is_err());
    }

    #[test]
    fn the_default_budget_is_a_quarter_of_the_host_at_most_4_gib() {
        let b = default_memory_budget();
        assert!(b > 0 && b <= 4 << 30, "{b}");
    }
}
