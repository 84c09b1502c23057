//! The wire format shared by the relay and every client (native and, later, browser): binary data
//! frames with a fixed 24-byte header, and JSON control messages. Defined once, here.
//!
//! Data frame (WebSocket binary message), all integers little-endian:
//! ```text
//! 0  u8  magic 0xD6
//! 1  u8  channel ([`Channel`])
//! 2  u8  flags (bit 0: more fragments of this message follow)
//! 3  u8  reserved (0)
//! 4  u32 src rank  (set by the relay: a client cannot spoof it)
//! 8  u32 dst rank
//! 12 u32 group id
//! 16 u64 seq
//! 24 ..  payload
//! ```
//! Messages larger than the frame limit are split into fragments (`more` set on all but the last);
//! fragments of one (src, dst) pair arrive in order, so the receiver just concatenates.

use bytes::{BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

/// Send buffer asked for on a relay data stream over a Unix-domain socket, on both ends (the
/// kernel caps it at `net.core.wmem_max`). A Unix stream has no autotuning: with the default
/// (~200 KiB) a 4 MiB message crosses in ~20 wake-ups of sender and receiver, and the 4-rank
/// all_reduce through the relay ran ~25% slower (TCP tunes its own buffers; setting them there
/// changed nothing).
#[cfg(unix)]
pub const UNIX_STREAM_BUFFER: usize = 4 << 20;

/// Enlarge the send buffer of a Unix-domain data stream to [`UNIX_STREAM_BUFFER`]. Best effort:
/// a refusal leaves the default, which works, only slower.
#[cfg(all(unix, not(target_arch = "wasm32")))]
pub fn enlarge_unix_buffer(s: &tokio::net::UnixStream) {
    let _ = socket2::SockRef::from(s).set_send_buffer_size(UNIX_STREAM_BUFFER);
}

/// Which stream of a call a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Channel {
    /// Payload of a collective (chunks, tensors).
    Data = 0,
    /// A collective's call signature, sent to the successor in the group ring.
    Sig = 1,
    /// Point-to-point send/recv; `seq` counts the messages of one ordered pair of ranks.
    P2p = 2,
    /// The sender aborts: every pending and later receive fails. `group`/`seq` are ignored.
    Abort = 3,
}

impl Channel {
    /// Decode from a frame header.
    pub fn from_u8(x: u8) -> Option<Self> {
        match x {
            0 => Some(Channel::Data),
            1 => Some(Channel::Sig),
            2 => Some(Channel::P2p),
            3 => Some(Channel::Abort),
            _ => None,
        }
    }
}

/// What a message is matched on (besides its source rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag {
    /// Group id (a communicator's group, `collective::Group`).
    pub group: u32,
    /// Sequence number of the call within the group (or of the p2p message within the pair).
    pub seq: u64,
    /// The stream.
    pub channel: Channel,
}

impl Tag {
    /// The tag of abort messages.
    pub const ABORT: Tag = Tag {
        group: 0,
        seq: 0,
        channel: Channel::Abort,
    };
}

/// Whether two secrets (room tokens, stream keys, store secrets) are equal, in time that does not
/// depend on where they differ (an attacker timing refusals learns nothing of the prefix).
pub fn secret_eq(a: &str, b: &str) -> bool {
    secret_eq_bytes(a.as_bytes(), b.as_bytes())
}

/// [`secret_eq`] for bytes.
pub fn secret_eq_bytes(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    bool::from(a.ct_eq(b))
}

/// Header length in bytes.
pub const HEADER_LEN: usize = 24;
/// A relay's data-frame payload limit unless it is configured otherwise, and the fragment size
/// members use unless its welcome names another (it names only a different one).
pub const DEFAULT_FRAME_PAYLOAD: usize = 1 << 20;
/// Smallest data-frame payload limit a relay may set (members fragment messages to its limit).
pub const MIN_FRAME_PAYLOAD: usize = 1024;
/// Largest data-frame payload limit a relay may set.
pub const MAX_FRAME_PAYLOAD: usize = 1 << 30;
/// First byte of every data frame.
pub const MAGIC: u8 = 0xD6;
/// Flag: more fragments of this message follow.
pub const FLAG_MORE: u8 = 1;

/// The `reason` of a [`Control::PeerLeft`] for a clean leave (the member closed its connection);
/// any other reason means the connection was lost.
pub const LEFT_CLEANLY: &str = "closed";

/// A decoded data-frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Source rank (stamped by the relay).
    pub src: u32,
    /// Destination rank.
    pub dst: u32,
    /// Tag (group, seq, channel).
    pub tag: Tag,
    /// More fragments follow.
    pub more: bool,
}

/// Why a frame could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Shorter than a header.
    #[error("frame of {0} bytes is shorter than the {HEADER_LEN}-byte header")]
    Truncated(usize),
    /// Wrong magic byte.
    #[error("bad magic byte {0:#04x} (expected {MAGIC:#04x})")]
    Magic(u8),
    /// Unknown channel.
    #[error("unknown channel {0}")]
    Channel(u8),
    /// Flags or reserved bits this version does not know.
    #[error("unknown flags {0:#04x} or reserved byte {1:#04x}")]
    Flags(u8, u8),
}

impl Header {
    /// Encode the header followed by `payload` into one frame.
    pub fn frame(&self, payload: &[u8]) -> Bytes {
        let mut b = BytesMut::with_capacity(HEADER_LEN + payload.len());
        self.put(&mut b);
        b.put_slice(payload);
        b.freeze()
    }

    /// Append the 24 header bytes.
    pub fn put(&self, b: &mut BytesMut) {
        b.put_u8(MAGIC);
        b.put_u8(self.tag.channel as u8);
        b.put_u8(if self.more { FLAG_MORE } else { 0 });
        b.put_u8(0);
        b.put_u32_le(self.src);
        b.put_u32_le(self.dst);
        b.put_u32_le(self.tag.group);
        b.put_u64_le(self.tag.seq);
    }

    /// Decode the header of `frame`; the payload is `frame[HEADER_LEN..]`.
    pub fn decode(frame: &[u8]) -> Result<Header, FrameError> {
        if frame.len() < HEADER_LEN {
            return Err(FrameError::Truncated(frame.len()));
        }
        if frame[0] != MAGIC {
            return Err(FrameError::Magic(frame[0]));
        }
        let channel = Channel::from_u8(frame[1]).ok_or(FrameError::Channel(frame[1]))?;
        if frame[2] & !FLAG_MORE != 0 || frame[3] != 0 {
            return Err(FrameError::Flags(frame[2], frame[3]));
        }
        let u32_at =
            |i: usize| u32::from_le_bytes([frame[i], frame[i + 1], frame[i + 2], frame[i + 3]]);
        let mut seq = [0u8; 8];
        seq.copy_from_slice(&frame[16..24]);
        Ok(Header {
            src: u32_at(4),
            dst: u32_at(8),
            tag: Tag {
                group: u32_at(12),
                seq: u64::from_le_bytes(seq),
                channel,
            },
            more: frame[2] & FLAG_MORE != 0,
        })
    }

    /// Overwrite the source rank of an encoded frame (the relay's anti-spoofing stamp).
    pub fn stamp_src(frame: &mut [u8], src: u32) {
        frame[4..8].copy_from_slice(&src.to_le_bytes());
    }
}

/// Split `payload` into frames (header + at most `max_payload` bytes each; `more` set on all but the
/// last). An empty payload is one empty frame.
pub fn fragments(src: u32, dst: u32, tag: Tag, payload: &[u8], max_payload: usize) -> Vec<Bytes> {
    let max = max_payload.max(1);
    let n = payload.len().div_ceil(max).max(1);
    (0..n)
        .map(|i| {
            let part = &payload[(i * max).min(payload.len())..((i + 1) * max).min(payload.len())];
            Header {
                src,
                dst,
                tag,
                more: i + 1 < n,
            }
            .frame(part)
        })
        .collect()
}

/// What each held fragment costs against its source's bound of unfinished bytes besides its
/// payload ([`Reassembler`]).
pub const FRAGMENT_COST: usize = 64;

/// Puts fragmented messages back together, per (source, tag); fragments of one pair arrive in order.
/// Fragments are held as received and copied once, when the last one arrives, into one buffer of
/// the exact size (a recycled one for large f32 payloads: see [`crate::pool`]).
#[derive(Debug)]
pub struct Reassembler {
    partial: std::collections::HashMap<(u32, Tag), (Vec<Bytes>, usize)>,
    /// Bytes of unfinished messages per source (all its tags together).
    unfinished: std::collections::HashMap<u32, usize>,
    max_message: usize,
}

impl Reassembler {
    /// Accept messages up to `max_message` bytes, and at most that many bytes of unfinished
    /// messages per source across all its tags.
    pub fn new(max_message: usize) -> Self {
        Reassembler {
            partial: std::collections::HashMap::new(),
            unfinished: std::collections::HashMap::new(),
            max_message,
        }
    }

    /// Take one frame's payload from `src`: the whole message once its last fragment arrived, or
    /// an error (a peer sending more than allowed is a protocol fault).
    pub fn push(&mut self, src: u32, h: &Header, payload: Bytes) -> Result<Option<Bytes>, String> {
        let key = (src, h.tag);
        let so_far = self.partial.get(&key).map_or(0, |p| p.1);
        if so_far + payload.len() > self.max_message {
            self.partial.remove(&key);
            return Err(format!(
                "rank {src} sent a message above {} bytes (tag {:?})",
                self.max_message, h.tag
            ));
        }
        if h.more {
            // Every held fragment costs its entry besides its payload: empty fragments are not
            // free.
            let cost = payload.len() + FRAGMENT_COST;
            let unfinished = self.unfinished.entry(src).or_default();
            if *unfinished + cost > self.max_message {
                return Err(format!(
                    "rank {src} has more than {} bytes of unfinished messages (fragments of \
                     messages it never completes, {FRAGMENT_COST} bytes counted per fragment \
                     besides its payload)",
                    self.max_message
                ));
            }
            *unfinished += cost;
            let p = self.partial.entry(key).or_default();
            p.1 += payload.len();
            p.0.push(payload);
            return Ok(None);
        }
        let Some((mut parts, total)) = self.partial.remove(&key) else {
            return Ok(Some(payload));
        };
        if let Some(u) = self.unfinished.get_mut(&src) {
            *u -= total + parts.len() * FRAGMENT_COST;
        }
        let total = total + payload.len();
        parts.push(payload);
        Ok(Some(concat(&parts, total)))
    }
}

/// The concatenation of `parts` (`total` bytes) in one new buffer.
fn concat(parts: &[Bytes], total: usize) -> Bytes {
    if parts.iter().all(|p| p.len().is_multiple_of(4)) {
        // Most messages are f32 payloads cut at f32 boundaries: an f32 buffer keeps them aligned
        // and recyclable.
        let mut v = crate::pool::take(total / 4);
        for p in parts {
            crate::pool::extend_from_le_bytes(&mut v, p);
        }
        crate::pool::f32_bytes(v)
    } else {
        let mut b = BytesMut::with_capacity(total);
        for p in parts {
            b.extend_from_slice(p);
        }
        b.freeze()
    }
}

/// JSON control messages (WebSocket text messages), tagged by `"type"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Control {
    /// Client → relay: join (or create) a room.
    Join {
        /// Room name.
        room: String,
        /// Room token: sets it when creating the room (random if absent), must match otherwise.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<String>,
        /// World size of the room.
        world: u32,
        /// Wanted rank (any free rank if absent).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rank: Option<u32>,
        /// The client will attach a TCP data stream (native clients; see [`StreamHello`]). The
        /// room is not announced ready before it did, or said [`Control::NoStream`].
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        stream: bool,
    },
    /// Relay → client: you joined.
    Welcome {
        /// Your rank.
        rank: u32,
        /// World size.
        world: u32,
        /// The room token (to share with the other members).
        token: String,
        /// Ranks present now.
        members: Vec<u32>,
        /// The key that attaches this member's data stream (present when the join asked for a
        /// stream and the relay accepts them).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stream_key: Option<String>,
        /// The relay's Unix-domain socket for data streams (with `stream_key`, when the relay has
        /// one): a member on the relay's host may attach its stream there instead of over TCP.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stream_path: Option<String>,
        /// The largest data-frame payload this relay takes on the WebSocket (its `max_frame`),
        /// when it is not the default 1 MiB: members fragment their messages to at most this (and
        /// their own limit).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_frame: Option<usize>,
        /// The STUN/TURN servers the relay's operator configured, as WebRTC's `iceServers` (an
        /// array of `{urls, username?, credential?}`). Relays of this version send them in
        /// `ready` instead (TURN credentials go to members of a full room only); a member takes
        /// them from either.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ice_servers: Option<serde_json::Value>,
    },
    /// Client → relay: the data stream the join announced could not be attached; data goes
    /// through the WebSocket.
    NoStream,
    /// Relay → all members: membership changed.
    Members {
        /// Ranks present now.
        members: Vec<u32>,
    },
    /// Relay → each member: the room is full; collectives may start.
    Ready {
        /// All ranks.
        members: Vec<u32>,
        /// One key per rank (32 hex digits; this member's own entry empty) that only this member
        /// and that peer were given: direct links between native members prove their ranks with
        /// it (`src/transport/tcp_links.rs`). Absent from relays that issue none (no direct links).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        link_keys: Option<Vec<String>>,
        /// The STUN/TURN servers for this member's WebRTC links, as WebRTC's `iceServers` (a TURN
        /// credential here is this member's own and expires). Absent: none.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ice_servers: Option<serde_json::Value>,
    },
    /// Relay → all members: a member left or was lost.
    PeerLeft {
        /// Its rank.
        rank: u32,
        /// Why (closed, timed out, ...).
        reason: String,
    },
    /// Client ↔ relay ↔ client: WebRTC signaling (offer / answer / ICE), relayed within the room.
    Signal {
        /// Destination rank (client → relay).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        to: Option<u32>,
        /// Source rank (relay → client, stamped by the relay).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        from: Option<u32>,
        /// Opaque signaling payload.
        data: serde_json::Value,
    },
    /// Client → relay → every other member: the sender aborted its group (a failed collective,
    /// a bad argument). Native members send it on the WebSocket beside the data-path notes; with
    /// a data stream (the default) the WebSocket carries no data, so it overtakes data held up
    /// for a member that stopped reading (without a stream, and from tabs, which send only the
    /// data-path notes, it waits in line with the data). The relay forwards one per member,
    /// stamped with `from`, without waiting for any receiver's queue. Members take it as they
    /// take the abort note on the data path ([`Tag::ABORT`]). Relays and members of one build
    /// know it; an older peer would take it for a malformed control message.
    Abort {
        /// Source rank (relay → client, stamped by the relay).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        from: Option<u32>,
        /// Why (at most [`MAX_ABORT_REASON`] bytes are forwarded).
        reason: String,
    },
    /// Relay → client: a refusal or fault; the relay closes the connection after sending it.
    Error {
        /// What was wrong.
        message: String,
    },
}

/// Longest abort reason the relay forwards (bytes; longer ones are cut at a character boundary).
/// Members cut theirs to it where they make them ([`clip`]), and cut what they receive too.
pub const MAX_ABORT_REASON: usize = 1024;

/// Longest piece of a peer's message quoted in a reason or an error (an unexpected control
/// message, a peer's call in a mismatch).
pub const MAX_QUOTED: usize = 200;

/// `s` cut to at most `max` bytes at a character boundary, `…` marking the cut: every text that
/// crosses the network (reasons, errors, notices) is bounded where it is made.
pub fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max.saturating_sub('…'.len_utf8());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// First bytes of a data stream's hello. The first byte is not ASCII, so the relay tells a data
/// stream from an HTTP request (which opens a WebSocket) by it.
pub const STREAM_MAGIC: [u8; 4] = [0xD7, b'd', b'g', b's'];

/// Bit of a data stream's length word marking a control frame: the relay sends a member with a
/// stream its [`Control::PeerLeft`] notices this way, in order with the data it forwarded, followed
/// by `length & !STREAM_CONTROL` bytes of JSON.
pub const STREAM_CONTROL: u32 = 1 << 31;

/// Longest JSON body of a control frame on a data stream.
pub const MAX_STREAM_CONTROL: usize = 64 << 10;

/// Largest payload of one data-stream frame; longer messages are sent as fragments of this size.
pub const MAX_STREAM_PAYLOAD: usize = 1 << 30;

/// Longest JSON body of a [`StreamHello`].
pub const MAX_STREAM_HELLO: usize = 4096;

/// A native member's TCP data stream to the relay, on the relay's own port. It carries data frames
/// only (control stays on the WebSocket), without WebSocket framing or masking:
/// `[u32 length][24-byte header][payload]`, length counting header + payload. Frames are not
/// limited to the relay's frame size (only to [`MAX_STREAM_PAYLOAD`]): the relay forwards them
/// piece by piece. Relay → member, a length with [`STREAM_CONTROL`] set is a control message.
///
/// Opening: [`STREAM_MAGIC`], `u32` body length, then this JSON; the relay answers one byte, 1 if
/// the stream is attached (0, or a closed connection, otherwise).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamHello {
    /// The member's room.
    pub room: String,
    /// Its rank.
    pub rank: u32,
    /// The key from its [`Control::Welcome`].
    pub key: String,
}

impl StreamHello {
    /// The opening bytes of a stream.
    pub fn encode(&self) -> Vec<u8> {
        let body = serde_json::to_vec(self).unwrap_or_default();
        let mut b = Vec::with_capacity(8 + body.len());
        b.extend_from_slice(&STREAM_MAGIC);
        b.extend_from_slice(&(body.len() as u32).to_le_bytes());
        b.extend_from_slice(&body);
        b
    }

    /// The body length announced by the first 8 bytes, or why they are not a stream hello.
    pub fn body_len(head: &[u8; 8]) -> Result<usize, String> {
        if head[..4] != STREAM_MAGIC {
            return Err("not a data stream hello".into());
        }
        let n = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
        if n > MAX_STREAM_HELLO {
            return Err(format!(
                "stream hello of {n} bytes (limit {MAX_STREAM_HELLO})"
            ));
        }
        Ok(n)
    }

    /// Decode the JSON body.
    pub fn decode(body: &[u8]) -> Result<StreamHello, String> {
        serde_json::from_slice(body).map_err(|e| format!("malformed stream hello: {e}"))
    }
}

/// Feed `data` to every decoder of the wire (frame header, control JSON, stream hello); the crate's
/// `fuzz_decoders` adds the collectives' decoders. None of them may panic.
pub fn fuzz_decoders(data: &[u8]) {
    let _ = Header::decode(data);
    let _ = serde_json::from_slice::<Control>(data);
    if let Some(head) = data.first_chunk::<8>() {
        let _ = StreamHello::body_len(head);
    }
    let _ = StreamHello::decode(data);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(all(unix, not(target_arch = "wasm32")))]
    #[test]
    fn unix_data_streams_get_a_large_send_buffer() {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
            let (a, _b) = tokio::net::UnixStream::pair().unwrap();
            let before = socket2::SockRef::from(&a).send_buffer_size().unwrap();
            enlarge_unix_buffer(&a);
            let after = socket2::SockRef::from(&a).send_buffer_size().unwrap();
            // Linux caps the request at wmem_max (and reports double what it grants).
            let cap = std::fs::read_to_string("/proc/sys/net/core/wmem_max")
                .ok()
                .and_then(|s| s.trim().parse::<usize>().ok())
                .unwrap_or(UNIX_STREAM_BUFFER);
            assert!(after >= before, "never smaller: {after} (was {before})");
            if cap * 2 > before {
                // Room to grow: Linux grants min(request, cap) and reports twice that.
                assert!(
                    after >= 2 * UNIX_STREAM_BUFFER.min(cap),
                    "send buffer {after} after asking for {UNIX_STREAM_BUFFER} (cap {cap}, was {before})"
                );
            } else {
                eprintln!(
                    "skipped: net.core.wmem_max {cap} leaves no room above the default {before}"
                );
            }
        });
    }

    #[test]
    fn header_round_trip_and_rejects() {
        let h = Header {
            src: 3,
            dst: 7,
            tag: Tag {
                group: 2,
                seq: u64::MAX - 5,
                channel: Channel::Sig,
            },
            more: true,
        };
        let f = h.frame(b"abc");
        assert_eq!(f.len(), HEADER_LEN + 3);
        assert_eq!(Header::decode(&f), Ok(h));
        let mut g = f.to_vec();
        Header::stamp_src(&mut g, 9);
        assert_eq!(Header::decode(&g).unwrap().src, 9);
        assert_eq!(Header::decode(&f[..10]), Err(FrameError::Truncated(10)));
        let mut bad = f.to_vec();
        bad[0] = 0;
        assert_eq!(Header::decode(&bad), Err(FrameError::Magic(0)));
        bad[0] = MAGIC;
        bad[1] = 9;
        assert_eq!(Header::decode(&bad), Err(FrameError::Channel(9)));
    }

    #[test]
    fn clip_cuts_at_a_character_boundary_and_marks_the_cut() {
        assert_eq!(clip("short", 10), "short");
        let long = "é".repeat(1000);
        let c = clip(&long, 101);
        assert!(c.len() <= 101 && c.ends_with('…'), "{} bytes", c.len());
        assert!(c.trim_end_matches('…').chars().all(|ch| ch == 'é'));
        assert_eq!(
            clip(&"x".repeat(2 << 20), MAX_ABORT_REASON).len(),
            MAX_ABORT_REASON
        );
    }

    #[test]
    fn empty_fragments_marked_more_are_charged() {
        // #40 item 3: before, 0-byte fragments marked "more" cost nothing against the bound and
        // grew the held list without end.
        let max = 1 << 16;
        let mut r = Reassembler::new(max);
        let tag = |seq| Tag {
            group: 1,
            seq,
            channel: Channel::Data,
        };
        let h = Header {
            src: 1,
            dst: 0,
            tag: tag(7),
            more: true,
        };
        let mut held = 0;
        let err = loop {
            match r.push(1, &h, Bytes::new()) {
                Ok(None) => held += 1,
                Ok(Some(_)) => panic!("a fragment marked more completed a message"),
                Err(e) => break e,
            }
            assert!(held <= max, "{held} empty fragments held");
        };
        assert_eq!(held, max / FRAGMENT_COST);
        assert!(err.contains("unfinished messages"), "{err}");
        // A message in fragments still completes, and frees what it held.
        let mut r = Reassembler::new(max);
        let data: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        for round in 0..100 {
            let mut got = None;
            for f in fragments(1, 0, tag(round), &data, 64) {
                let hdr = Header::decode(&f).unwrap();
                got = r.push(1, &hdr, f.slice(HEADER_LEN..)).unwrap();
            }
            assert_eq!(got.as_deref(), Some(&data[..]));
        }
    }

    #[test]
    fn fragments_reassemble_in_any_interleaving_of_tags() {
        let tag = |seq| Tag {
            group: 1,
            seq,
            channel: Channel::Data,
        };
        let a: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        let b: Vec<u8> = (0..37u32).map(|i| (i * 7) as u8).collect();
        let fa = fragments(2, 0, tag(1), &a, 300);
        let fb = fragments(2, 0, tag(2), &b, 10);
        assert_eq!(fa.len(), 4);
        assert_eq!(fb.len(), 4);
        assert_eq!(fragments(2, 0, tag(3), &[], 10).len(), 1);
        let mut r = Reassembler::new(1 << 20);
        let mut done = Vec::new();
        // Interleave the two messages' fragments (each message's own order kept).
        for f in fa.iter().zip(&fb).flat_map(|(x, y)| [x, y]) {
            let h = Header::decode(f).unwrap();
            if let Some(m) = r.push(h.src, &h, f.slice(HEADER_LEN..)).unwrap() {
                done.push((h.tag.seq, m));
            }
        }
        done.sort_by_key(|d| d.0);
        assert_eq!(done[0].1.as_ref(), a.as_slice());
        assert_eq!(done[1].1.as_ref(), b.as_slice());
        // Over the limit: an error naming the rank, and the partial message dropped.
        let mut small = Reassembler::new(500);
        let mut err = None;
        for f in &fa {
            let h = Header::decode(f).unwrap();
            if let Err(e) = small.push(h.src, &h, f.slice(HEADER_LEN..)) {
                err = Some(e);
                break;
            }
        }
        assert!(err.unwrap().contains("rank 2"));
        // Unfinished messages on many tags count together: each fits alone, all of them do not.
        let mut r = Reassembler::new(1000 + 3 * FRAGMENT_COST);
        let mut err = None;
        for seq in 0..10 {
            let f = &fragments(3, 0, tag(seq), &[5u8; 400], 300)[0];
            let h = Header::decode(f).unwrap();
            if let Err(e) = r.push(h.src, &h, f.slice(HEADER_LEN..)) {
                err = Some((seq, e));
                break;
            }
        }
        let (seq, e) = err.expect("unfinished fragments must be bounded per source");
        assert_eq!(seq, 3, "300 + 300 + 300 fit in 1000, a fourth does not");
        assert!(e.contains("rank 3") && e.contains("unfinished"), "{e}");
        // Finishing messages frees their bytes.
        let mut r = Reassembler::new(1000);
        for seq in 0..20 {
            for f in fragments(3, 0, tag(seq), &[5u8; 400], 300) {
                let h = Header::decode(&f).unwrap();
                r.push(h.src, &h, f.slice(HEADER_LEN..)).unwrap();
            }
        }
    }

    #[test]
    fn control_json_shape() {
        let j = Control::Join {
            room: "r".into(),
            token: None,
            world: 4,
            rank: Some(1),
            stream: false,
        };
        let s = serde_json::to_string(&j).unwrap();
        // A join without a stream reads as browsers (which never send the field) write it.
        assert_eq!(s, r#"{"type":"join","room":"r","world":4,"rank":1}"#);
        assert_eq!(serde_json::from_str::<Control>(&s).unwrap(), j);
        let with = r#"{"type":"join","room":"r","world":4,"stream":true}"#;
        match serde_json::from_str::<Control>(with).unwrap() {
            Control::Join { stream, rank, .. } => assert!(stream && rank.is_none()),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            serde_json::to_string(&Control::NoStream).unwrap(),
            r#"{"type":"no_stream"}"#
        );
        assert!(serde_json::from_str::<Control>(r#"{"type":"nope"}"#).is_err());
    }

    #[test]
    fn stream_hello_round_trip_and_rejects() {
        let h = StreamHello {
            room: "r".into(),
            rank: 3,
            key: "k".into(),
        };
        let b = h.encode();
        let head: &[u8; 8] = b.first_chunk().unwrap();
        // Not ASCII: the relay tells a stream from an HTTP request by the first byte.
        assert!(!head[0].is_ascii());
        assert_eq!(StreamHello::body_len(head), Ok(b.len() - 8));
        assert_eq!(StreamHello::decode(&b[8..]), Ok(h));
        assert!(StreamHello::body_len(b"GET / HT").is_err());
        let mut big = *head;
        big[4..].copy_from_slice(&(MAX_STREAM_HELLO as u32 + 1).to_le_bytes());
        assert!(StreamHello::body_len(&big).unwrap_err().contains("limit"));
        assert!(StreamHello::decode(b"{\"room\":1}").is_err());
    }
}
