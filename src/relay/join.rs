//! Admitting a member: its `join` read and checked, its room found or created (and closed if it
//! does not fill in time), its rank assigned, its `welcome` sent.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::extract::ws::{Message, WebSocket};
use futures::StreamExt;

use super::admission::{addr_bucket, client_token_refusal};
use super::{
    Control, DEFAULT_FRAME_PAYLOAD, Link, Member, Out, Refusal, RelayConfig, Room, Seat, Shared,
    control, random_token, ready_check, secret_eq, stopped,
};

/// What a `join` asks for, checked as far as it can be without the room.
struct Ask {
    room: String,
    token: Option<String>,
    world: u32,
    rank: Option<u32>,
    stream: bool,
}

/// Wait for the join message and seat the client, or say why not. The Unix-domain socket is named
/// only to members `on_host` (others could not reach it, and need not know where it is).
pub(super) async fn join(
    shared: &Arc<Shared>,
    stream: &mut futures::stream::SplitStream<WebSocket>,
    link: &Link,
    on_host: bool,
    peer: Option<IpAddr>,
) -> Result<Seat, Refusal> {
    let ask = read_join(stream, &shared.cfg).await?;
    // Made before the lock (they may fail); the token is used only if this join creates the room.
    let fresh_token = match &ask.token {
        Some(_) => None,
        None => Some(random_token().map_err(|e| Refusal::Random(e.to_string()))?),
    };
    let key = match ask.stream && shared.cfg.streams {
        true => Some(random_token().map_err(|e| Refusal::Random(e.to_string()))?),
        false => None,
    };
    let mut rooms = shared.rooms();
    let (r, created) = room_for(shared, &mut rooms, &ask, peer.map(addr_bucket), fresh_token)?;
    let rank = match ask.rank {
        Some(k) if r.members.contains_key(&k) => {
            return Err(Refusal::RankTaken {
                rank: k,
                room: ask.room,
            });
        }
        Some(k) => k,
        None => (0..ask.world)
            .find(|k| !r.members.contains_key(k))
            .ok_or_else(|| Refusal::RoomFull {
                room: ask.room.clone(),
            })?,
    };
    r.members.insert(
        rank,
        Member {
            link: link.clone(),
            settled: key.is_none(),
            key: key.clone(),
            addr: peer,
            since: std::time::Instant::now(),
        },
    );
    let mut members: Vec<u32> = r.members.keys().copied().collect();
    members.sort_unstable();
    let cfg = &shared.cfg;
    let _ = link.tx.send(Out::Text(control(&Control::Welcome {
        rank,
        world: ask.world,
        token: r.token.clone(),
        members: members.clone(),
        stream_path: key
            .as_ref()
            .filter(|_| on_host)
            .and_then(|_| shared.local_path.get().cloned()),
        stream_key: key,
        // Named only where it differs from the default, which every member assumes anyway: a
        // member of an earlier build (which refuses unknown fields) still joins a default relay.
        max_frame: (cfg.max_frame != DEFAULT_FRAME_PAYLOAD).then_some(cfg.max_frame),
        // Handed out in `ready`, to members of a full room only (TURN credentials expire).
        ice_servers: None,
    })));
    // A full room whose last data streams are still attaching announces `ready` shortly.
    if !ready_check(r, cfg) && members.len() as u32 != ask.world {
        let text = control(&Control::Members { members });
        for m in r.members.values() {
            let _ = m.link.tx.send(Out::Text(text.clone()));
        }
    }
    let seat = Seat {
        room: ask.room,
        room_id: r.id,
        rank,
    };
    drop(rooms);
    if created {
        tokio::spawn(close_if_unfilled(shared.clone(), seat.clone()));
    }
    if ask.stream && cfg.streams {
        tokio::spawn(drop_if_no_stream(shared.clone(), seat.clone()));
    }
    Ok(seat)
}

/// The first message, which must be a `join`, checked as far as it can be without the room: a
/// refused join must not create a room.
async fn read_join(
    stream: &mut futures::stream::SplitStream<WebSocket>,
    cfg: &RelayConfig,
) -> Result<Ask, Refusal> {
    let first = tokio::time::timeout(cfg.join_timeout, stream.next())
        .await
        .map_err(|_| Refusal::NoJoin(cfg.join_timeout))?;
    let text = match first {
        Some(Ok(Message::Text(t))) => t,
        Some(Ok(_)) => return Err(Refusal::NotText),
        Some(Err(e)) => return Err(Refusal::Socket(e.to_string())),
        None => return Err(Refusal::Closed),
    };
    let ask = match serde_json::from_str::<Control>(&text) {
        Ok(Control::Join {
            room,
            token,
            world,
            rank,
            stream,
        }) => Ask {
            room,
            token,
            world,
            rank,
            stream,
        },
        Ok(other) => return Err(Refusal::NotJoin(format!("{other:?}"))),
        Err(e) => return Err(Refusal::Malformed(e.to_string())),
    };
    if ask.room.is_empty() || ask.room.len() > 128 {
        return Err(Refusal::RoomName);
    }
    if ask.world == 0 || ask.world > cfg.max_members {
        return Err(Refusal::World {
            world: ask.world,
            max: cfg.max_members,
        });
    }
    if let Some(k) = ask.rank
        && k >= ask.world
    {
        return Err(Refusal::RankOutside {
            rank: k,
            world: ask.world,
        });
    }
    Ok(ask)
}

/// The room `ask` names, opened with its token, or created (with `fresh_token` unless the client
/// chose one) where the relay's and the creator's (`creator`, its address's bucket) limits allow:
/// the room and whether it was created. Runs under the rooms' lock, so the token's check and the
/// room's creation are one step.
fn room_for<'a>(
    shared: &Shared,
    rooms: &'a mut HashMap<String, Room>,
    ask: &Ask,
    creator: Option<IpAddr>,
    fresh_token: Option<String>,
) -> Result<(&'a mut Room, bool), Refusal> {
    let cfg = &shared.cfg;
    let n_rooms = rooms.len();
    let open_here = rooms
        .values()
        .filter(|r| creator.is_some() && r.creator == creator)
        .count();
    let vacant = match rooms.entry(ask.room.clone()) {
        Entry::Occupied(o) => {
            let r = o.into_mut();
            let room = ask.room.clone();
            if !ask.token.as_deref().is_some_and(|t| secret_eq(t, &r.token)) {
                return Err(Refusal::WrongToken { room });
            }
            if r.world != ask.world {
                return Err(Refusal::WorldMismatch {
                    room,
                    has: r.world,
                    asked: ask.world,
                });
            }
            if r.started {
                return Err(Refusal::Started { room });
            }
            return Ok((r, false));
        }
        Entry::Vacant(v) => v,
    };
    if n_rooms >= cfg.max_rooms {
        return Err(Refusal::Full {
            rooms: cfg.max_rooms,
        });
    }
    if let Some(ip) = creator
        && open_here >= cfg.max_rooms_per_addr
    {
        return Err(Refusal::RoomsPerAddress {
            ip,
            open: open_here,
        });
    }
    if let Some(why) = ask
        .token
        .as_deref()
        .and_then(|t| client_token_refusal(cfg, &ask.room, t))
    {
        return Err(why);
    }
    let room = Room {
        id: shared.next_room.fetch_add(1, Ordering::Relaxed),
        token: ask.token.clone().or(fresh_token).unwrap_or_default(),
        creator,
        world: ask.world,
        members: HashMap::new(),
        started: false,
        created: std::time::Instant::now(),
    };
    Ok((vacant.insert(room), true))
}

/// Close `seat`'s room if it has not filled within the room fill timeout, telling its members.
async fn close_if_unfilled(shared: Arc<Shared>, seat: Seat) {
    let limit = shared.cfg.room_fill_timeout;
    let mut stopping = shared.stopping.clone();
    tokio::select! {
        () = tokio::time::sleep(limit) => {}
        () = stopped(&mut stopping) => return,
    }
    let mut rooms = shared.rooms();
    let Some(r) = seat.room_in(&mut rooms).filter(|r| !r.started) else {
        return;
    };
    let why = format!(
        "room {:?} did not fill within {limit:?} ({} of {} members joined); it is closed: \
         create it again when everyone is ready to join",
        seat.room,
        r.members.len(),
        r.world
    );
    for m in r.members.values() {
        m.link.budget.close();
        let _ = m.link.kill.send(Some(why.clone()));
    }
    rooms.remove(&seat.room);
}

/// End `seat` if the data stream its join announced has not attached within the join timeout
/// (its room would otherwise wait for it forever).
async fn drop_if_no_stream(shared: Arc<Shared>, seat: Seat) {
    let limit = shared.cfg.join_timeout;
    tokio::time::sleep(limit).await;
    let mut rooms = shared.rooms();
    if let Some(m) = seat
        .room_in(&mut rooms)
        .and_then(|r| r.members.get(&seat.rank))
        .filter(|m| !m.settled)
    {
        let _ = m.link.kill.send(Some(format!(
            "its announced data stream did not attach within {limit:?}"
        )));
    }
}
