//! Time limits on the relay's HTTP connections, below the HTTP server: a request's headers must
//! arrive within the join timeout of its first byte (a client sending one byte at a time cannot
//! hold a connection, the slowloris attack), and a connection that moves nothing in either
//! direction for the idle timeout between requests is closed. A request that asks for an upgrade
//! (the WebSocket handshake) ends the watch once the server answers it `101 Switching Protocols`:
//! the WebSocket's own idle check (pings) takes over. Any other answer (a refused handshake, or an
//! `Upgrade:` header on a plain request) leaves the connection watched like any other.
//!
//! The relay answers only `GET`s (the page's files, the WebSocket handshake), so a request is its
//! header block: the watch follows the bytes read for the blank line that ends it.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// Longest header block the watch follows (the relay's requests are small `GET`s): a longer one
/// ends the connection.
pub(super) const MAX_HEADERS: usize = 64 << 10;

/// Where the connection is in its requests.
enum Phase {
    /// Between requests: closed after `idle` without a byte either way.
    Between,
    /// Reading a request's header block (`seen`: its bytes so far): it must end by the deadline
    /// set at its first byte.
    Headers { seen: Vec<u8> },
    /// A request asked for an upgrade; waiting for the server's answer (its first bytes so far,
    /// `answer`; bytes the client sent meanwhile, `early`): `101` turns the watch off, anything
    /// else goes back to between requests.
    Upgrading { answer: Vec<u8>, early: Vec<u8> },
    /// Upgraded: the watch is off.
    Off,
}

/// The start of the answer that switches protocols.
const SWITCHING: &[u8] = b"HTTP/1.1 101";

/// `io` with the relay's HTTP time limits (see the module's documentation).
pub(super) struct Watched<T> {
    io: T,
    phase: Phase,
    headers: Duration,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl<T> Watched<T> {
    /// Watch `io`: each request's headers within `headers` of its first byte; `idle` between
    /// requests.
    pub(super) fn new(io: T, headers: Duration, idle: Duration) -> Watched<T> {
        Watched {
            io,
            phase: Phase::Between,
            headers,
            idle,
            deadline: Box::pin(tokio::time::sleep(idle)),
        }
    }

    /// Follow `bytes`, just read: returns why the connection must end, if it must.
    fn follow(&mut self, bytes: &[u8]) -> Option<&'static str> {
        let mut rest = bytes;
        while !rest.is_empty() {
            match &mut self.phase {
                Phase::Off => return None,
                Phase::Upgrading { early, .. } => {
                    if early.len() + rest.len() > MAX_HEADERS {
                        return Some("request headers too large");
                    }
                    early.extend_from_slice(rest);
                    return None;
                }
                Phase::Between => {
                    self.phase = Phase::Headers { seen: Vec::new() };
                    self.deadline.as_mut().reset(Instant::now() + self.headers);
                }
                Phase::Headers { seen } => {
                    if seen.len() >= MAX_HEADERS {
                        return Some("request headers too large");
                    }
                    seen.push(rest[0]);
                    rest = &rest[1..];
                    if seen.ends_with(b"\r\n\r\n") {
                        self.phase = if asks_upgrade(seen) {
                            Phase::Upgrading {
                                answer: Vec::new(),
                                early: Vec::new(),
                            }
                        } else {
                            Phase::Between
                        };
                        self.deadline.as_mut().reset(Instant::now() + self.idle);
                    }
                }
            }
        }
        None
    }

    /// Follow `bytes`, just written: the first bytes of the answer to an upgrade request say
    /// whether the watch ends. Returns why the connection must end, if it must.
    fn answered(&mut self, bytes: &[u8]) -> Option<&'static str> {
        let Phase::Upgrading { answer, early } = &mut self.phase else {
            return None;
        };
        let want = SWITCHING.len() - answer.len().min(SWITCHING.len());
        answer.extend_from_slice(&bytes[..bytes.len().min(want)]);
        if answer.len() < SWITCHING.len() {
            return None;
        }
        if answer.as_slice() == SWITCHING {
            self.phase = Phase::Off;
            return None;
        }
        let early = std::mem::take(early);
        self.phase = Phase::Between;
        self.deadline.as_mut().reset(Instant::now() + self.idle);
        self.follow(&early)
    }

    /// Bytes moved: between requests, the idle clock starts again.
    fn moved(&mut self) {
        if matches!(self.phase, Phase::Between | Phase::Upgrading { .. }) {
            self.deadline.as_mut().reset(Instant::now() + self.idle);
        }
    }

    /// Whether the deadline of the phase has passed (registering the task to be woken when it
    /// does): the reason if so.
    fn expired(&mut self, cx: &mut Context<'_>) -> Option<&'static str> {
        match self.phase {
            Phase::Off => None,
            _ if self.deadline.as_mut().poll(cx).is_pending() => None,
            Phase::Between | Phase::Upgrading { .. } => Some("idle between requests"),
            Phase::Headers { .. } => Some("request headers not complete in time"),
        }
    }
}

/// Whether a header block has an `Upgrade` header (the WebSocket handshake).
fn asks_upgrade(block: &[u8]) -> bool {
    block
        .split(|&b| b == b'\n')
        .skip(1)
        .any(|line| line.len() >= 8 && line[..8].eq_ignore_ascii_case(b"upgrade:"))
}

fn timed_out(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, why.to_string())
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if matches!(me.phase, Phase::Off) {
            return Pin::new(&mut me.io).poll_read(cx, buf);
        }
        let before = buf.filled().len();
        match Pin::new(&mut me.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let new = buf.filled()[before..].to_vec();
                if new.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                me.moved();
                match me.follow(&new) {
                    Some(why) => Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, why))),
                    None => Poll::Ready(Ok(())),
                }
            }
            Poll::Pending => match me.expired(cx) {
                Some(why) => Poll::Ready(Err(timed_out(why))),
                None => Poll::Pending,
            },
            other => other,
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        if matches!(me.phase, Phase::Off) {
            return Pin::new(&mut me.io).poll_write(cx, buf);
        }
        let r = Pin::new(&mut me.io).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r
            && n > 0
        {
            me.moved();
            if let Some(why) = me.answered(&buf[..n]) {
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, why)));
            }
        }
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        if matches!(me.phase, Phase::Off) {
            return Pin::new(&mut me.io).poll_write_vectored(cx, bufs);
        }
        let r = Pin::new(&mut me.io).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = r
            && n > 0
        {
            me.moved();
            // The written bytes, in order, as far as the answer's first bytes go.
            let mut left = n.min(SWITCHING.len());
            for b in bufs {
                if left == 0 {
                    break;
                }
                let take = b.len().min(left);
                if let Some(why) = me.answered(&b[..take]) {
                    return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, why)));
                }
                left -= take;
            }
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watched() -> Watched<()> {
        Watched {
            io: (),
            phase: Phase::Between,
            headers: Duration::from_secs(1),
            idle: Duration::from_secs(1),
            deadline: Box::pin(tokio::time::sleep_until(Instant::now())),
        }
    }

    /// The blank line ending a header block is found within a read and across reads of any
    /// split; an upgrade request ends the watch, a plain one returns to between requests.
    #[tokio::test]
    async fn header_blocks_are_followed_across_reads() {
        let plain = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n";
        let upgrade = b"GET /ws HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\n\r\n";
        for split in 1..plain.len() {
            let mut w = watched();
            assert_eq!(w.follow(&plain[..split]), None);
            assert!(matches!(w.phase, Phase::Headers { .. }), "split {split}");
            assert_eq!(w.follow(&plain[split..]), None);
            assert!(matches!(w.phase, Phase::Between), "split {split}");
        }
        for split in 1..upgrade.len() {
            let mut w = watched();
            w.follow(&upgrade[..split]);
            w.follow(&upgrade[split..]);
            assert!(matches!(w.phase, Phase::Upgrading { .. }), "split {split}");
            // The answer, in two writes: 101 ends the watch.
            w.answered(b"HTTP/1.1 1");
            w.answered(b"01 Switching Protocols\r\n");
            assert!(matches!(w.phase, Phase::Off), "split {split}");
        }
        // Refused (or an Upgrade header on a plain request): watched again, and what the client
        // sent meanwhile is the next request.
        let mut w = watched();
        w.follow(upgrade);
        w.follow(b"GET /x");
        assert_eq!(w.answered(b"HTTP/1.1 403 Forbidden\r\n"), None);
        assert!(matches!(&w.phase, Phase::Headers { seen } if seen == b"GET /x"));
        // Two requests in one read (pipelined), then the start of a third.
        let mut w = watched();
        let mut two = plain.to_vec();
        two.extend_from_slice(plain);
        two.extend_from_slice(b"GE");
        w.follow(&two);
        assert!(matches!(&w.phase, Phase::Headers { seen } if seen == b"GE"));
        // Everything after the switch is the WebSocket's: not followed.
        let mut w = watched();
        w.follow(upgrade);
        w.answered(b"HTTP/1.1 101 Switching Protocols\r\n");
        w.follow(&[0x81, 0x05, b'h', b'e', b'l', b'l', b'o']);
        assert!(matches!(w.phase, Phase::Off));
        // A header block without end, beyond the bound, ends the connection.
        let mut w = watched();
        let long = vec![b'a'; MAX_HEADERS + 1];
        assert_eq!(w.follow(&long), Some("request headers too large"));
    }
}
