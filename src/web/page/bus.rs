//! The tab-to-tab control bus: rank 0 orders every tab's requests and announces each to every
//! rank, on reserved group ids ([`BUS_GROUP`], [`TRACE_GROUP`](super::TRACE_GROUP)) that never
//! mix with collectives.

use std::cell::RefCell;
use std::rc::Rc;

use bytes::Bytes;
use wasm_bindgen_futures::spawn_local;

use crate::collective::Communicator;
use crate::error::{Error, Result};
use crate::transport::{Channel, Tag, Transport};

use super::dom::{show_error, show_notice};
use super::{App, BUS_GROUP, Bus};

/// Rank 0's look at a request before it announces it: the announcement every tab performs, or
/// `None` where rank 0 handled it alone (the page's `dispatch::announce`).
pub(super) type Announce = fn(&Rc<App>, Bus) -> Option<Bus>;

/// What every tab does with an announcement (the page's `dispatch::perform`).
pub(super) type Perform = for<'a> fn(&'a App, Bus) -> futures::future::LocalBoxFuture<'a, ()>;

/// Start the bus on this tab: rank 0 takes every tab's requests in one order, passes each through
/// `announce` and tells every rank; every rank hands what it is told to `perform`.
pub(super) fn start_bus(app: &Rc<App>, announce: Announce, perform: Perform) {
    let (me, world) = match &app.comm {
        Some(c) => (c.rank(), c.world_size()),
        None => (0, app.world),
    };
    if me != 0 {
        // Followers: run what rank 0 announces.
        let a = app.clone();
        listen(app, 0, Channel::Sig, move |msg| {
            let a = a.clone();
            async move { perform(&a, msg).await }
        });
        return;
    }
    let (tx, mut rx) = futures::channel::mpsc::unbounded::<Bus>();
    *app.queue.borrow_mut() = Some(tx.clone());
    // Rank 0: every peer's requests go into the one queue.
    if app.comm.is_some() {
        for peer in 1..world {
            let tx = tx.clone();
            listen(app, peer, Channel::Data, move |msg| {
                let _ = tx.unbounded_send(msg);
                async {}
            });
        }
    }
    let a = app.clone();
    spawn_local(async move {
        use futures::StreamExt;
        let mut seq = 0;
        while let Some(msg) = rx.next().await {
            let Some(msg) = announce(&a, msg) else {
                continue;
            };
            if let Some(comm) = &a.comm {
                let Ok(text) = serde_json::to_vec(&msg) else {
                    continue;
                };
                let tag = Tag {
                    group: BUS_GROUP,
                    seq,
                    channel: Channel::Sig,
                };
                seq += 1;
                for peer in 1..world {
                    if let Err(e) = comm
                        .transport()
                        .send(peer, tag, Bytes::from(text.clone()))
                        .await
                    {
                        show_error(&format!("telling rank {peer}: {e}"));
                        return;
                    }
                }
            }
            perform(&a, msg).await;
        }
    });
}

/// Receive bus messages from `src` on `channel` (numbered from 0) and hand each to `handle`, in
/// order, until the transport fails.
fn listen<F, Fut>(app: &Rc<App>, src: usize, channel: Channel, handle: F)
where
    F: Fn(Bus) -> Fut + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let a = app.clone();
    spawn_local(async move {
        let Some(comm) = &a.comm else { return };
        for seq in 0.. {
            let tag = Tag {
                group: BUS_GROUP,
                seq,
                channel,
            };
            let Ok(bytes) = comm.transport().recv(src, tag).await else {
                return;
            };
            match serde_json::from_slice::<Bus>(&bytes) {
                Ok(msg) => handle(msg).await,
                Err(e) => show_notice(&format!("rank {src} sent an unreadable bus message: {e}")),
            }
        }
    });
}

/// Send a request to rank 0 (or handle it here on rank 0 and in single-tab mode).
pub(super) async fn request(app: &App, msg: Bus) -> Result<()> {
    let me = app.comm.as_ref().map_or(0, |c| c.rank());
    if me == 0 {
        let q = app.queue.borrow().clone();
        return q
            .and_then(|q| q.unbounded_send(msg).ok())
            .ok_or_else(|| Error::Input("the request queue is closed".into()));
    }
    let comm = app
        .comm
        .as_ref()
        .ok_or_else(|| Error::Input("no group".into()))?;
    let text = serde_json::to_vec(&msg).map_err(|e| Error::Input(e.to_string()))?;
    let tag = next_tag(&app.requests_sent, BUS_GROUP);
    comm.transport().send(0, tag, Bytes::from(text)).await
}

/// The next tag of a numbered stream of `group` (the counter counts the messages sent).
pub(super) fn next_tag(counter: &RefCell<u64>, group: u32) -> Tag {
    let mut n = counter.borrow_mut();
    let seq = *n;
    *n += 1;
    Tag {
        group,
        seq,
        channel: Channel::Data,
    }
}
