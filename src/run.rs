//! Run N ranks as threads of this process over the in-process transport, each driving its own
//! future with a simple executor (no async runtime needed).

use std::future::Future;

use crate::collective::{CommOptions, P2p};
use crate::error::{Error, Result};
use crate::transport::local::LocalTransport;

/// The communicator type of in-process ranks.
pub type LocalComm = P2p<LocalTransport>;

/// Run `f(comm)` on `world` ranks (one thread each) and return each rank's result, index = rank.
/// A rank that panics yields an error (and its peers see it as gone).
pub fn run_local<R, F, Fut>(world: usize, opts: CommOptions, f: F) -> Vec<Result<R>>
where
    F: Fn(LocalComm) -> Fut + Sync,
    Fut: Future<Output = Result<R>>,
    R: Send,
{
    let transports = LocalTransport::world(world);
    std::thread::scope(|s| {
        let handles: Vec<_> = transports
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let f = &f;
                let opts = opts.clone();
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(s, move || futures::executor::block_on(f(P2p::new(t, opts))))
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Ok(h) => h.join().unwrap_or_else(|_| {
                    Err(Error::Transport {
                        rank,
                        detail: "rank thread panicked".into(),
                    })
                }),
                Err(e) => Err(Error::Transport {
                    rank,
                    detail: format!("could not start rank thread: {e}"),
                }),
            })
            .collect()
    })
}
