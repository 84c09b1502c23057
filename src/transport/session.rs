//! A member's session with the relay, without sockets: the one client protocol both relay
//! clients drive — the native one (`ws`, tokio sockets) and the browser's (`browser`, a
//! `WebSocket` and its callbacks). Each feeds [`Session::on_text`] every control message its
//! socket receives and does what the returned [`Event`] says; the rules live here once:
//!
//! - **Joining**: the first message is [`Session::join_text`]; the relay answers `welcome` (our
//!   rank, the room token, who is present, what it offers: a data stream, a frame limit, ICE
//!   servers), then `members` as others come and go, then `ready` once the room is full. A
//!   `ready` before the `welcome`, an `error`, a message the relay does not send, or malformed
//!   JSON ends the session with a reason. A member that leaves before the room is full frees its
//!   seat: the room may still fill (the fill timeout bounds the wait,
//!   [`Session::fill_timeout`]).
//! - **Running**: a peer's leave ([`peer_left`]): a clean one fails only the receives from it
//!   that find nothing, unless its data comes over a link of its own (then the link's end says
//!   so, after its last data); a lost one fails everything at once. A peer's abort
//!   ([`peer_aborted`]) is taken as the abort note on the data path, ahead of data it still holds
//!   up. Our own abort reaches every peer at once ([`abort_all`]).
//!
//! Nothing here blocks or owns a socket: the tests feed it messages.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;

use super::{Mailbox, Tag, Transport};
use crate::error::Error;
use crate::wire::{Control, LEFT_CLEANLY};

/// What a member asks for when it joins.
#[derive(Debug, Clone, PartialEq)]
pub struct JoinRequest {
    /// Room name.
    pub room: String,
    /// Room token (required to join an existing room; sets it when creating one).
    pub token: Option<String>,
    /// World size.
    pub world: u32,
    /// Wanted rank, or any free one.
    pub rank: Option<u32>,
    /// This member will attach a data stream (native members; see [`crate::wire::StreamHello`]).
    pub stream: bool,
}

/// What the relay's `welcome` told this member.
#[derive(Debug, Clone, PartialEq)]
pub struct Welcome {
    /// This member's rank.
    pub rank: u32,
    /// The room token (to share with the others).
    pub token: String,
    /// Ranks present now.
    pub members: Vec<u32>,
    /// The key that attaches this member's data stream, where the relay takes one.
    pub stream_key: Option<String>,
    /// The relay's Unix-domain socket for the data stream, where it has one.
    pub stream_path: Option<String>,
    /// The relay's largest data-frame payload, where it is not the default.
    pub max_frame: Option<usize>,
    /// The STUN/TURN servers for WebRTC, where the relay's operator gave some.
    pub ice_servers: Option<serde_json::Value>,
}

/// What a control message from the relay means for the member.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Admitted (joining): see [`Welcome`].
    Welcome(Welcome),
    /// The ranks present now.
    Members(Vec<u32>),
    /// The room is full: collectives may start.
    Ready {
        /// Every rank.
        members: Vec<u32>,
        /// The direct-link keys, one per rank (native members).
        link_keys: Option<Vec<String>>,
        /// The STUN/TURN servers for this member's WebRTC links, where the relay has some.
        ice_servers: Option<serde_json::Value>,
    },
    /// A member left: before `ready` its seat is free again; after, apply [`peer_left`].
    PeerLeft {
        /// Its rank.
        rank: u32,
        /// Why ([`LEFT_CLEANLY`] for a clean leave).
        reason: String,
    },
    /// A peer aborted its group: apply [`peer_aborted`].
    PeerAborted {
        /// Its rank.
        from: u32,
        /// Why.
        reason: String,
    },
    /// A signaling message from a peer (WebRTC offers, direct-link addresses).
    Signal {
        /// Its rank.
        from: u32,
        /// The payload.
        data: serde_json::Value,
    },
}

/// Why a session with the relay ended (its message is the reason every pending receive fails
/// with).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SessionEnd {
    /// The relay sent text that is not a control message.
    #[error("malformed control message from relay: {0}")]
    Malformed(String),
    /// The room was announced ready before this member was welcomed.
    #[error("ready before welcome")]
    ReadyBeforeWelcome,
    /// The relay refused the join (its reason).
    #[error("relay refused: {0}")]
    Refused(String),
    /// The relay failed the member once the room ran (its reason).
    #[error("relay error: {0}")]
    Failed(String),
    /// A message the relay does not send at this point.
    #[error("unexpected control message {0}")]
    Unexpected(String),
    /// A message after the session ended.
    #[error("the session with the relay is over")]
    Over,
}

/// Where a session is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Joined or joining, the room not full yet.
    Joining,
    /// The room is full.
    Ready,
    /// Ended (the relay refused or failed, or broke the protocol).
    Ended,
}

/// A member's session with the relay (see the module docs).
#[derive(Debug, Clone)]
pub struct Session {
    join: JoinRequest,
    phase: Phase,
    welcome: Option<Welcome>,
}

impl Session {
    /// A session that will ask for `join`.
    pub fn new(join: JoinRequest) -> Session {
        Session {
            join,
            phase: Phase::Joining,
            welcome: None,
        }
    }

    /// The first message to send: the join.
    pub fn join_text(&self) -> String {
        let j = &self.join;
        let join = Control::Join {
            room: j.room.clone(),
            token: j.token.clone(),
            world: j.world,
            rank: j.rank,
            stream: j.stream,
        };
        // A Control of strings and numbers always serializes.
        serde_json::to_string(&join).unwrap_or_default()
    }

    /// What the relay's control message `text` means; `Err`: the session is over, and why.
    pub fn on_text(&mut self, text: &str) -> Result<Event, SessionEnd> {
        let msg = serde_json::from_str::<Control>(text)
            .map_err(|e| self.end(SessionEnd::Malformed(e.to_string())))?;
        self.on_control(msg)
    }

    /// [`Session::on_text`] of a parsed message.
    pub fn on_control(&mut self, msg: Control) -> Result<Event, SessionEnd> {
        if self.phase == Phase::Ended {
            return Err(SessionEnd::Over);
        }
        let joining = self.phase == Phase::Joining;
        match msg {
            Control::Welcome {
                rank,
                token,
                members,
                stream_key,
                stream_path,
                max_frame,
                ice_servers,
                ..
            } if joining && self.welcome.is_none() => {
                let w = Welcome {
                    rank,
                    token,
                    members,
                    stream_key,
                    stream_path,
                    max_frame,
                    ice_servers,
                };
                self.welcome = Some(w.clone());
                Ok(Event::Welcome(w))
            }
            Control::Members { members } => Ok(Event::Members(members)),
            Control::Ready { .. } if self.welcome.is_none() => {
                Err(self.end(SessionEnd::ReadyBeforeWelcome))
            }
            Control::Ready {
                members,
                link_keys,
                ice_servers,
            } if joining => {
                self.phase = Phase::Ready;
                Ok(Event::Ready {
                    members,
                    link_keys,
                    ice_servers,
                })
            }
            Control::PeerLeft { rank, reason } => Ok(Event::PeerLeft { rank, reason }),
            Control::Abort {
                from: Some(from),
                reason,
            } => Ok(Event::PeerAborted { from, reason }),
            Control::Signal {
                from: Some(from),
                data,
                ..
            } => Ok(Event::Signal { from, data }),
            Control::Error { message } if joining => Err(self.end(SessionEnd::Refused(message))),
            Control::Error { message } => Err(self.end(SessionEnd::Failed(message))),
            other => Err(self.end(SessionEnd::Unexpected(format!("{other:?}")))),
        }
    }

    fn end(&mut self, reason: SessionEnd) -> SessionEnd {
        self.phase = Phase::Ended;
        reason
    }

    /// Whether the room is full.
    pub fn ready(&self) -> bool {
        self.phase == Phase::Ready
    }

    /// The relay's welcome, once it came.
    pub fn welcome(&self) -> Option<&Welcome> {
        self.welcome.as_ref()
    }

    /// The error of a room that did not fill within `limit`.
    pub fn fill_timeout(&self, limit: Duration) -> Error {
        Error::Relay {
            detail: format!(
                "room {:?} did not fill to {} ranks within {limit:?}",
                self.join.room, self.join.world
            ),
        }
    }
}

/// Per peer rank: whether our data with it goes over a link of its own (set once the links are
/// up). Such a peer's clean leave is the end of its link, which comes after its last data on it;
/// the relay's note could overtake that data.
pub struct Linked(Box<[AtomicBool]>);

impl Linked {
    /// No peer linked, in a world of `world` ranks.
    pub fn new(world: usize) -> Linked {
        Linked((0..world).map(|_| AtomicBool::new(false)).collect())
    }

    /// `rank`'s data goes over a link of its own from now on.
    pub fn set(&self, rank: usize) {
        if let Some(l) = self.0.get(rank) {
            l.store(true, Ordering::Release);
        }
    }

    /// Whether `rank`'s data goes over a link of its own.
    pub fn get(&self, rank: usize) -> bool {
        self.0.get(rank).is_some_and(|l| l.load(Ordering::Acquire))
    }
}

/// The relay says `rank` left with `reason`: a clean leave makes receives from it that find
/// nothing fail, except for a linked peer (its link's end says so, after its last data); a lost
/// connection fails everything at once.
pub fn peer_left(mb: &Mailbox, linked: &Linked, rank: u32, reason: &str) {
    let rank = rank as usize;
    if reason != LEFT_CLEANLY {
        mb.peer_lost(rank, reason);
    } else if !linked.get(rank) {
        mb.peer_gone(rank);
    }
}

/// The relay forwards peer `from`'s abort (its control note, which may overtake that peer's data):
/// taken as the abort note on the data path. A `from` that is not another rank of the world
/// (`me` is ours) is ignored.
pub fn peer_aborted(mb: &Mailbox, me: usize, world: usize, from: u32, reason: String) {
    let from = from as usize;
    if from < world && from != me {
        mb.deliver(from, Tag::ABORT, Bytes::from(reason.into_bytes()));
    }
}

/// Abort `t`: our own receives fail first (`local`, this rank's mailbox), then every peer is told
/// at once, so one frozen peer holds the others up for one send wait at most, not one each.
pub async fn abort_all<T: Transport>(t: &T, local: Option<&Mailbox>, reason: &str) {
    let reason = &crate::wire::clip(reason, crate::wire::MAX_ABORT_REASON);
    if let Some(mb) = local {
        mb.abort_local(reason);
    }
    let note = Bytes::copy_from_slice(reason.as_bytes());
    futures::future::join_all(
        (0..t.world())
            .filter(|&r| r != t.rank())
            .map(|r| t.send(r, Tag::ABORT, note.clone())),
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(seq: u64) -> Tag {
        Tag {
            group: 1,
            seq,
            channel: crate::wire::Channel::Data,
        }
    }

    fn session() -> Session {
        Session::new(JoinRequest {
            room: "r".into(),
            token: None,
            world: 3,
            rank: None,
            stream: false,
        })
    }

    fn welcome(rank: u32) -> String {
        format!(
            r#"{{"type": "welcome", "rank": {rank}, "world": 3, "token": "t", "members": [{rank}]}}"#
        )
    }

    #[test]
    fn the_join_is_the_first_message() {
        let s = Session::new(JoinRequest {
            room: "class".into(),
            token: Some("k".into()),
            world: 4,
            rank: Some(2),
            stream: true,
        });
        let v: serde_json::Value = serde_json::from_str(&s.join_text()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"type": "join", "room": "class", "token": "k", "world": 4,
                               "rank": 2, "stream": true})
        );
    }

    #[test]
    fn welcome_members_ready_then_running() {
        let mut s = session();
        let Ok(Event::Welcome(w)) = s.on_text(&welcome(1)) else {
            panic!("a welcome");
        };
        assert_eq!(
            (w.rank, w.token.as_str(), w.members.as_slice()),
            (1, "t", &[1][..])
        );
        assert!(!s.ready());
        assert_eq!(
            s.on_text(r#"{"type": "members", "members": [0, 1]}"#),
            Ok(Event::Members(vec![0, 1]))
        );
        // A member that leaves before the room is full frees its seat: the session goes on.
        assert_eq!(
            s.on_text(r#"{"type": "peer_left", "rank": 0, "reason": "closed"}"#),
            Ok(Event::PeerLeft {
                rank: 0,
                reason: "closed".into()
            })
        );
        assert_eq!(
            s.on_text(r#"{"type": "ready", "members": [0, 1, 2]}"#),
            Ok(Event::Ready {
                members: vec![0, 1, 2],
                link_keys: None,
                ice_servers: None
            })
        );
        assert!(s.ready());
        assert_eq!(
            s.on_text(r#"{"type": "abort", "from": 2, "reason": "x"}"#),
            Ok(Event::PeerAborted {
                from: 2,
                reason: "x".into()
            })
        );
        assert_eq!(
            s.on_text(r#"{"type": "signal", "from": 0, "data": {"a": 1}}"#),
            Ok(Event::Signal {
                from: 0,
                data: serde_json::json!({"a": 1})
            })
        );
        // A second welcome or ready is not the protocol.
        assert!(matches!(
            s.on_text(&welcome(1)),
            Err(SessionEnd::Unexpected(_))
        ));
        // Once over, it stays over.
        assert_eq!(
            s.on_text(r#"{"type": "members", "members": []}"#),
            Err(SessionEnd::Over)
        );
    }

    #[test]
    fn what_ends_a_session_says_why() {
        let mut s = session();
        assert_eq!(
            s.on_text(r#"{"type": "ready", "members": [0]}"#),
            Err(SessionEnd::ReadyBeforeWelcome)
        );
        let mut s = session();
        assert_eq!(
            s.on_text(r#"{"type": "error", "message": "wrong token for room \"r\""}"#),
            Err(SessionEnd::Refused("wrong token for room \"r\"".into()))
        );
        let mut s = session();
        s.on_text(&welcome(0)).unwrap();
        s.on_text(r#"{"type": "ready", "members": [0, 1, 2]}"#)
            .unwrap();
        assert_eq!(
            s.on_text(r#"{"type": "error", "message": "idle"}"#),
            Err(SessionEnd::Failed("idle".into()))
        );
        let mut s = session();
        assert!(
            s.on_text("{not json")
                .unwrap_err()
                .to_string()
                .starts_with("malformed control message from relay")
        );
        let mut s = session();
        assert!(
            s.on_text(r#"{"type": "join", "room": "r", "world": 3}"#)
                .unwrap_err()
                .to_string()
                .contains("unexpected control message")
        );
        let e = session().fill_timeout(Duration::from_secs(2)).to_string();
        assert!(
            e.contains("room \"r\" did not fill to 3 ranks within 2s"),
            "{e}"
        );
    }

    #[test]
    fn leave_and_abort_rules() {
        let mb = Mailbox::new(0, 3);
        let linked = Linked::new(3);
        linked.set(2);
        // A clean leave of a peer without a link of its own: its receives that find nothing fail.
        peer_left(&mb, &linked, 1, LEFT_CLEANLY);
        let gone = futures::executor::block_on(mb.recv(1, tag(0)));
        assert!(gone.is_err());
        // A linked peer's clean leave waits for its link's end: a message still arrives.
        peer_left(&mb, &linked, 2, LEFT_CLEANLY);
        mb.deliver(2, tag(0), Bytes::from_static(b"late"));
        let late = futures::executor::block_on(mb.recv(2, tag(0)));
        assert_eq!(late.unwrap(), Bytes::from_static(b"late"));
        // An abort from outside the world, or from ourselves, is ignored; a peer's is taken.
        let mb = Mailbox::new(0, 3);
        peer_aborted(&mb, 0, 3, 7, "no".into());
        peer_aborted(&mb, 0, 3, 0, "no".into());
        mb.deliver(1, tag(1), Bytes::from_static(b"ok"));
        assert!(futures::executor::block_on(mb.recv(1, tag(1))).is_ok());
        peer_aborted(&mb, 0, 3, 2, "stop".into());
        let e = futures::executor::block_on(mb.recv(1, tag(2))).unwrap_err();
        assert!(e.to_string().contains("stop"), "{e}");
    }
}
