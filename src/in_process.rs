//! Run N ranks in this process over the in-process transport: as threads, each driving its own
//! future with a simple executor (no async runtime needed), or interleaved on the caller's task
//! ([`run_interleaved`], which also works in a browser page).

use std::future::Future;

use crate::collective::CommOptions;
use crate::collective::P2p;
#[cfg(not(target_arch = "wasm32"))]
use crate::error::Error;
use crate::error::Result;
use crate::transport::local::LocalTransport;

/// The communicator type of in-process ranks.
pub type LocalComm = P2p<LocalTransport>;

/// Each rank's result; a rank whose thread could not start or panicked yields an error.
#[cfg(not(target_arch = "wasm32"))]
fn join_ranks<R>(
    handles: Vec<std::io::Result<std::thread::ScopedJoinHandle<'_, Result<R>>>>,
) -> Vec<Result<R>> {
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
}

/// Run `f(comm)` on `world` ranks (one thread each) and return each rank's result, index = rank.
/// Native only (a browser page has no threads; it runs ranks as tabs or on a local executor).
/// A rank that panics yields an error (and its peers see it as gone).
#[cfg(not(target_arch = "wasm32"))]
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
        join_ranks(handles)
    })
}

/// A communicator of one rank, alone in its world (for a tape that never communicates: its
/// collectives, of one rank, copy).
pub fn solo() -> LocalComm {
    let mut ranks = LocalTransport::world(1);
    P2p::new(ranks.remove(0), CommOptions::default())
}

/// Run `f(comm)` on `world` ranks interleaved on the calling task (one thread: a browser page's
/// "simulated ranks", or anywhere threads are unwanted); result index = rank. The ranks' futures are
/// polled together, so a rank waiting on a peer lets the others progress.
pub async fn run_interleaved<R, F, Fut>(world: usize, opts: CommOptions, f: F) -> Vec<Result<R>>
where
    F: Fn(LocalComm) -> Fut,
    Fut: Future<Output = Result<R>>,
{
    let ranks = LocalTransport::world(world)
        .into_iter()
        .map(|t| f(P2p::new(t, opts.clone())));
    futures::future::join_all(ranks).await
}

/// How ranks started by `run_over_relay_via` (native) send their data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelayRoute {
    /// Through the relay, on each rank's WebSocket (as browsers do).
    WebSocket,
    /// Through the relay, on each rank's data stream (the native default: on the relay's
    /// Unix-domain socket, as members on the relay's host attach).
    Stream,
    /// Through the relay, on data streams over TCP (as members on other hosts attach).
    StreamTcp,
    /// Over direct TCP links between the ranks, the relay only introducing them
    /// (`transport::tcp_links`, native).
    Direct,
}

#[cfg(not(target_arch = "wasm32"))]
impl RelayRoute {
    /// How a rank joins room `room` of `world` as `rank` to send its data by this route (direct
    /// links listen on an ephemeral loopback port); token and limits are the defaults.
    pub fn join_options(
        self,
        room: &str,
        world: u32,
        rank: u32,
    ) -> crate::transport::ws::JoinOptions {
        let mut join = crate::transport::ws::JoinOptions::new(room, world);
        join.rank = Some(rank);
        join.stream = self != RelayRoute::WebSocket;
        join.local_stream = self != RelayRoute::StreamTcp;
        if self == RelayRoute::Direct {
            join.direct = Some(([127, 0, 0, 1], 0).into());
        }
        join
    }
}

/// Run `f(comm)` on `world` ranks (threads, each with its own tokio runtime and its own connection)
/// through a relay started for the occasion on an ephemeral loopback port, stopped afterwards;
/// data through the relay on data streams (native clients' default).
#[cfg(not(target_arch = "wasm32"))]
pub fn run_over_relay<R, F>(
    world: usize,
    relay: crate::relay::RelayConfig,
    opts: CommOptions,
    f: F,
) -> Result<Vec<Result<R>>>
where
    F: AsyncFn(&P2p<crate::transport::ws::WsTransport>) -> Result<R> + Sync,
    R: Send,
{
    run_over_relay_via(world, relay, opts, RelayRoute::Stream, f)
}

/// [`run_over_relay`] with the data sent by `route`.
#[cfg(not(target_arch = "wasm32"))]
pub fn run_over_relay_via<R, F>(
    world: usize,
    relay: crate::relay::RelayConfig,
    opts: CommOptions,
    route: RelayRoute,
    f: F,
) -> Result<Vec<Result<R>>>
where
    F: AsyncFn(&P2p<crate::transport::ws::WsTransport>) -> Result<R> + Sync,
    R: Send,
{
    use crate::transport::ws::WsTransport;
    let io = |e: std::io::Error| Error::Relay {
        detail: e.to_string(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(io)?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .map_err(io)?;
    let url = format!("ws://{}/ws", listener.local_addr().map_err(io)?);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let max_payload = relay.max_frame;
    // Its own relay, whose ranks all start with the token made here.
    let relay = crate::relay::RelayConfig {
        client_tokens: true,
        ..relay
    };
    let server = rt.spawn(crate::relay::serve(listener, relay, async {
        let _ = stop_rx.await;
    }));
    let token = crate::relay::random_token().map_err(io)?;
    let world_u32 =
        u32::try_from(world).map_err(|_| Error::invalid("run_over_relay", "world too large"))?;
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (f, url, token, opts) = (&f, &url, &token, opts.clone());
                std::thread::Builder::new()
                    .name(format!("relay-rank-{rank}"))
                    .spawn_scoped(s, move || -> Result<R> {
                        let rt = tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .map_err(io)?;
                        rt.block_on(async move {
                            let mut join = route.join_options("run", world_u32, rank as u32);
                            join.token = Some(token.clone());
                            join.max_payload = max_payload;
                            let t = WsTransport::connect(url, join).await?;
                            let comm = P2p::new(t, opts);
                            let r = f(&comm).await;
                            // Flush what this rank still has to send before its runtime stops.
                            comm.into_transport().close().await;
                            r
                        })
                    })
            })
            .collect();
        join_ranks(handles)
    });
    let _ = stop_tx.send(());
    let _ = rt.block_on(server);
    Ok(results)
}
