//! Native WebSocket transport through the relay ([`crate::relay`]). Needs a tokio runtime (its
//! reader and writer are tokio tasks); the collectives on top stay runtime-free.
//!
//! Messages larger than the relay's frame limit are split into fragments; the reader task
//! reassembles them and delivers whole messages into the [`Mailbox`]. The outgoing queue is bounded,
//! so a sender waits when the relay pushes back.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

use super::{Mailbox, Tag, Transport};
use crate::error::{Error, Result};
use crate::wire::{Control, HEADER_LEN, Header, LEFT_CLEANLY, Reassembler, fragments};

/// How to join a room.
#[derive(Debug, Clone)]
pub struct JoinOptions {
    /// Room name.
    pub room: String,
    /// Room token (required to join an existing room; sets it when creating one).
    pub token: Option<String>,
    /// World size.
    pub world: u32,
    /// Wanted rank, or any free one.
    pub rank: Option<u32>,
    /// How long to wait for the room to fill.
    pub ready_timeout: Duration,
    /// Largest frame payload to send (at most the relay's `max_frame`, which also counts payload).
    pub max_payload: usize,
    /// Largest message to reassemble from fragments; a peer sending more is a protocol fault.
    pub max_message: usize,
    /// Longest wait for room in the outgoing queue (the relay pushing back) before a send fails.
    pub send_timeout: Duration,
}

impl JoinOptions {
    /// Defaults: any rank, 60 s to fill, 1 MiB fragments.
    pub fn new(room: &str, world: u32) -> Self {
        JoinOptions {
            room: room.to_string(),
            token: None,
            world,
            rank: None,
            ready_timeout: Duration::from_secs(60),
            max_payload: 1 << 20,
            max_message: 1 << 30,
            send_timeout: Duration::from_secs(60),
        }
    }
}

/// One rank connected to a relay room.
pub struct WsTransport {
    rank: usize,
    world: usize,
    token: String,
    mailbox: Arc<Mailbox>,
    out: Option<mpsc::Sender<Bytes>>,
    max_payload: usize,
    send_timeout: Duration,
    reader: Option<tokio::task::JoinHandle<()>>,
    writer: Option<tokio::task::JoinHandle<()>>,
}

fn relay_err(detail: impl Into<String>) -> Error {
    Error::Relay {
        detail: detail.into(),
    }
}

impl WsTransport {
    /// Connect to `url` (e.g. `ws://127.0.0.1:8080/ws`), join, and wait until the room is full.
    pub async fn connect(url: &str, opts: JoinOptions) -> Result<WsTransport> {
        let (ws, _) = tokio_tungstenite::connect_async_with_config(url, None, true)
            .await
            .map_err(|e| relay_err(format!("cannot connect to {url}: {e}")))?;
        let (mut sink, mut stream) = ws.split();
        let join = Control::Join {
            room: opts.room.clone(),
            token: opts.token.clone(),
            world: opts.world,
            rank: opts.rank,
        };
        let text = serde_json::to_string(&join).map_err(|e| relay_err(e.to_string()))?;
        sink.send(Message::text(text))
            .await
            .map_err(|e| relay_err(format!("sending join: {e}")))?;

        let mut welcome = None;
        let wait = async {
            while let Some(msg) = stream.next().await {
                let msg = msg.map_err(|e| relay_err(format!("while joining: {e}")))?;
                let Message::Text(t) = msg else { continue };
                match serde_json::from_str::<Control>(&t) {
                    Ok(Control::Welcome { rank, token, .. }) => welcome = Some((rank, token)),
                    Ok(Control::Ready { .. }) => return Ok(()),
                    Ok(Control::Error { message }) => {
                        return Err(relay_err(format!("relay refused: {message}")));
                    }
                    Ok(Control::PeerLeft { rank, reason }) => {
                        return Err(relay_err(format!(
                            "rank {rank} left before the room was full: {reason}"
                        )));
                    }
                    Ok(_) => {}
                    Err(e) => {
                        return Err(relay_err(format!(
                            "malformed control message from relay: {e}"
                        )));
                    }
                }
            }
            Err(relay_err("relay closed the connection while joining"))
        };
        match tokio::time::timeout(opts.ready_timeout, wait).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(relay_err(format!(
                    "room {:?} did not fill to {} ranks within {:?}",
                    opts.room, opts.world, opts.ready_timeout
                )));
            }
        }
        let (rank, token) = welcome.ok_or_else(|| relay_err("ready before welcome"))?;
        let (rank, world) = (rank as usize, opts.world as usize);
        let mailbox = Arc::new(Mailbox::new(rank, world));

        let (tx, mut rx) = mpsc::channel::<Bytes>(64);
        let writer = tokio::spawn(async move {
            while let Some(frame) = rx.recv().await {
                if sink.send(Message::binary(frame)).await.is_err() {
                    break;
                }
            }
            let _ = sink.close().await;
        });
        let mb = mailbox.clone();
        let max_message = opts.max_message;
        let reader = tokio::spawn(async move {
            let mut parts = Reassembler::new(max_message);
            let reason = loop {
                let msg = match stream.next().await {
                    None => break "the relay closed the connection".to_string(),
                    Some(Err(e)) => break format!("connection to the relay failed: {e}"),
                    Some(Ok(m)) => m,
                };
                match msg {
                    Message::Binary(b) => {
                        let h = match Header::decode(&b) {
                            Ok(h) => h,
                            Err(e) => break format!("the relay sent a bad frame: {e}"),
                        };
                        match parts.push(h.src, &h, b.slice(HEADER_LEN..)) {
                            Ok(Some(m)) => mb.deliver(h.src as usize, h.tag, m),
                            Ok(None) => {}
                            Err(e) => break e,
                        }
                    }
                    Message::Text(t) => match serde_json::from_str::<Control>(&t) {
                        // A clean leave fails only receives from that rank; a lost connection
                        // fails everything, since any pending collective may depend on it.
                        Ok(Control::PeerLeft { rank, reason }) if reason == LEFT_CLEANLY => {
                            mb.peer_gone(rank as usize)
                        }
                        Ok(Control::PeerLeft { rank, reason }) => {
                            mb.peer_lost(rank as usize, &reason)
                        }
                        Ok(Control::Error { message }) => break format!("relay error: {message}"),
                        Ok(_) => {}
                        Err(e) => break format!("malformed control message from relay: {e}"),
                    },
                    Message::Close(_) => break "the relay closed the connection".to_string(),
                    _ => {}
                }
            };
            mb.abort_local(&reason);
        });
        Ok(WsTransport {
            rank,
            world,
            token,
            mailbox,
            out: Some(tx),
            max_payload: opts.max_payload.max(1),
            send_timeout: opts.send_timeout,
            reader: Some(reader),
            writer: Some(writer),
        })
    }

    /// The room token (share it with the ranks that join later).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Flush what is queued, close the connection and wait (up to 10 s) for the relay to answer
    /// the close, so that everything sent before reached the relay (peers then see a clean leave).
    pub async fn close(mut self) {
        self.out.take();
        let limit = Duration::from_secs(10);
        if let Some(w) = self.writer.take() {
            let _ = tokio::time::timeout(limit, w).await;
        }
        if let Some(r) = self.reader.as_mut() {
            let _ = tokio::time::timeout(limit, r).await;
        }
    }
}

impl Drop for WsTransport {
    fn drop(&mut self) {
        // Dropping the sender lets the writer flush what is queued and close; the reader stops now.
        self.out.take();
        if let Some(r) = &self.reader {
            r.abort();
        }
    }
}

impl Transport for WsTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    async fn send(&self, dst: usize, tag: Tag, payload: Bytes) -> Result<()> {
        let out = self.out.as_ref().ok_or_else(|| Error::Transport {
            rank: self.rank,
            detail: "transport closed".into(),
        })?;
        let closed = || Error::Transport {
            rank: self.rank,
            detail: "connection to the relay is closed".into(),
        };
        let push = |frame: Bytes| async move {
            match tokio::time::timeout(self.send_timeout, out.send(frame)).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(_)) => Err(closed()),
                Err(_) => Err(Error::Transport {
                    rank: self.rank,
                    detail: format!(
                        "the relay accepted nothing for {:?} (receiver stalled?)",
                        self.send_timeout
                    ),
                }),
            }
        };
        for frame in fragments(
            self.rank as u32,
            dst as u32,
            tag,
            &payload,
            self.max_payload,
        ) {
            push(frame).await?;
        }
        Ok(())
    }

    async fn recv(&self, src: usize, tag: Tag) -> Result<Bytes> {
        if src >= self.world {
            return Err(Error::Transport {
                rank: self.rank,
                detail: format!("recv from rank {src} outside world of {}", self.world),
            });
        }
        self.mailbox.recv(src, tag).await
    }

    async fn abort(&self, reason: &str) {
        for r in 0..self.world {
            if r != self.rank {
                let _ = self
                    .send(r, Tag::ABORT, Bytes::copy_from_slice(reason.as_bytes()))
                    .await;
            }
        }
        self.mailbox.abort_local(reason);
    }
}
