//! The relay's errors: [`Refusal`], why it turns a connection or a join away, with what it
//! checked (the room, the world, the rank, the address and its count; its message is what the
//! client is told: a JSON `error`, then the close reason), and [`ConfigError`], why a
//! [`super::RelayConfig`] cannot work.

use std::net::IpAddr;
use std::time::Duration;

/// Why the relay refuses a connection or a join.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Refusal {
    /// The address already has as many connections open as the relay allows one address.
    #[error("too many connections from {ip} ({open} open, the relay's limit per address)")]
    TooManyConnections {
        /// The source address.
        ip: IpAddr,
        /// Its connections open now.
        open: usize,
    },
    /// The relay has as many connections open as it allows (a bound below its file limit).
    #[error("the relay is at its connection limit ({open} open): try again shortly")]
    RelayBusy {
        /// Connections open now.
        open: usize,
    },
    /// No join message came in time.
    #[error("no join within {0:?}")]
    NoJoin(Duration),
    /// The first message was not a text message.
    #[error("the first message must be a JSON join")]
    NotText,
    /// The socket failed before the join.
    #[error("socket error before join: {0}")]
    Socket(String),
    /// The socket closed before the join.
    #[error("closed before join")]
    Closed,
    /// The first message was another control message.
    #[error("expected join, got {0}")]
    NotJoin(String),
    /// The first message was not a control message.
    #[error("malformed join: {0}")]
    Malformed(String),
    /// A room name of no bytes or too many.
    #[error("room name must be 1..=128 bytes")]
    RoomName,
    /// A world of 0 or beyond the relay's limit.
    #[error("world {world} outside 1..={max}")]
    World {
        /// The world asked for.
        world: u32,
        /// The relay's largest.
        max: u32,
    },
    /// A rank asked for outside the world.
    #[error("rank {rank} outside world {world}")]
    RankOutside {
        /// The rank asked for.
        rank: u32,
        /// The world.
        world: u32,
    },
    /// A new room's token chosen by the client, on a relay that makes every room's token.
    #[error(
        "this relay makes room tokens: leave the token out to create room {room:?} (a token of your own needs a relay started with --client-tokens); to join an existing room, check its name"
    )]
    ClientToken {
        /// The room that does not exist.
        room: String,
    },
    /// A client-chosen token not in the form the relay makes (32 hex digits).
    #[error(
        "a room token chosen by a client must be 32 hex digits, what `openssl rand -hex 16` prints (this one has {len} characters{why}); leave it out and the relay makes one"
    )]
    TokenForm {
        /// Its length in characters.
        len: usize,
        /// What else is wrong with it (empty, or ", not all hex digits").
        why: &'static str,
    },
    /// The relay could not make a token or key (the OS's random number generator failed).
    #[error("{0}")]
    Random(String),
    /// The token does not open the room.
    #[error("wrong token for room {room:?}")]
    WrongToken {
        /// The room.
        room: String,
    },
    /// The room exists with another world.
    #[error("room {room:?} has world {has}, not {asked}")]
    WorldMismatch {
        /// The room.
        room: String,
        /// Its world.
        has: u32,
        /// The world asked for.
        asked: u32,
    },
    /// The room is running; no one joins it now.
    #[error("room {room:?} has already started")]
    Started {
        /// The room.
        room: String,
    },
    /// The relay holds as many rooms as it allows.
    #[error("relay is full ({rooms} rooms)")]
    Full {
        /// Its limit.
        rooms: usize,
    },
    /// The address already has as many rooms open as it may create.
    #[error(
        "{ip} already has {open} rooms open (the relay's limit per address, started rooms included): join one of them, or wait until one closes"
    )]
    RoomsPerAddress {
        /// The creator's address (an IPv6 address's /64, where the rest is zero).
        ip: IpAddr,
        /// Its rooms open.
        open: usize,
    },
    /// The rank asked for has a member.
    #[error("rank {rank} is taken in room {room:?}")]
    RankTaken {
        /// The rank.
        rank: u32,
        /// The room.
        room: String,
    },
    /// Every rank of the room has a member.
    #[error("room {room:?} is full")]
    RoomFull {
        /// The room.
        room: String,
    },
}

/// Why a relay's configuration cannot work (every join or frame would fail).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// The frame limit is outside what the protocol allows.
    #[error("max_frame {max_frame} is outside {min}..={max} bytes")]
    MaxFrame {
        /// The limit given.
        max_frame: usize,
        /// The protocol's smallest.
        min: usize,
        /// The protocol's largest.
        max: usize,
    },
    /// No member or no room would fit.
    #[error("max_members ({members}) and max_rooms ({rooms}) must be at least 1")]
    Capacity {
        /// `max_members`.
        members: u32,
        /// `max_rooms`.
        rooms: usize,
    },
    /// A member's queue could not hold one frame.
    #[error(
        "max_pending_bytes {pending} cannot hold one frame of max_frame {max_frame} plus its {header}-byte header"
    )]
    Pending {
        /// `max_pending_bytes`.
        pending: usize,
        /// `max_frame`.
        max_frame: usize,
        /// The frame header's length.
        header: usize,
    },
    /// The relay's memory budget could not hold one frame.
    #[error(
        "memory_budget {budget} cannot hold one frame of max_frame {max_frame} plus its {header}-byte header"
    )]
    MemoryBudget {
        /// `memory_budget`.
        budget: usize,
        /// `max_frame`.
        max_frame: usize,
        /// The frame header's length.
        header: usize,
    },
    /// An entry of `connect_src` that is not an origin.
    #[error("connect_src entry {0:?} is not an origin (e.g. wss://relay.example.org)")]
    ConnectSrc(String),
    /// TLS required without a certificate.
    #[error("require_tls needs a certificate (tls; --tls-cert and --tls-key)")]
    RequireTls,
    /// A timeout of zero.
    #[error("idle_timeout, join_timeout and room_fill_timeout must be above zero")]
    ZeroTimeout,
    /// No connection at all, or none or no room per address, would be allowed.
    #[error(
        "max_conns ({total}), max_conns_per_addr ({conns}) and max_rooms_per_addr ({rooms}) must be at least 1"
    )]
    PerAddress {
        /// `max_conns`.
        total: usize,
        /// `max_conns_per_addr`.
        conns: usize,
        /// `max_rooms_per_addr`.
        rooms: usize,
    },
    /// The ICE servers are not a WebRTC `iceServers` array.
    #[error("{0}")]
    IceServers(String),
    /// The folder of static files does not exist.
    #[error("static_dir {0} is not a folder")]
    StaticDir(std::path::PathBuf),
}
