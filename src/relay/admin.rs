//! A teacher's controls ([`RelayConfig::admin_token`]): a page at `/admin` and its API, both
//! behind the admin token (`Authorization: Bearer <token>`, compared in constant time).
//!
//! - `GET /admin/api/status`: the relay's use against its budgets (bytes queued against the
//!   memory budget, connections against their caps, rooms) and every room with its members (rank,
//!   address, age, bytes queued for it), as JSON.
//! - `POST /admin/api/close?room=NAME`: close a room; every member is told why and disconnected.
//! - `POST /admin/api/remove?room=NAME&rank=K`: remove one member; its room is told it left.
//!
//! Without a token the routes do not exist (404). The page's script is a file of its own
//! (`/admin/admin.js`), so the page needs no inline script.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::json;

use super::budget::{memory_permits, queue_budget};
use super::{RelayConfig, Shared};
use crate::wire::secret_eq;

/// What the admin sees of a member removed or a room closed.
const REMOVED: &str = "removed by the relay's admin";
const CLOSED: &str = "room closed by the relay's admin";

/// The admin routes, where the relay has a token.
pub(super) fn routes(shared: &Arc<Shared>) -> Option<Router<Arc<Shared>>> {
    shared.cfg.admin_token.as_ref()?;
    Some(
        Router::new()
            .route("/admin", get(page))
            .route("/admin/admin.js", get(script))
            .route("/admin/api/status", get(status))
            .route("/admin/api/close", post(close_room))
            .route("/admin/api/remove", post(remove_member)),
    )
}

/// Whether the request carries the admin token.
fn authorized(cfg: &RelayConfig, headers: &HeaderMap) -> bool {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    matches!((&cfg.admin_token, given), (Some(want), Some(g)) if secret_eq(g.trim(), want))
}

/// The answer to a request without the admin token.
fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        "the admin token is required (Authorization: Bearer <token>)",
    )
        .into_response()
}

/// The admin page's Content-Security-Policy: its own script and requests only, its inline
/// styles, never inside a frame.
const PAGE_CSP: &str = "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; \
                        frame-ancestors 'none'";

async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, PAGE_CSP),
        ],
        include_str!("admin.html"),
    )
        .into_response()
}

async fn script() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("admin.js"),
    )
        .into_response()
}

/// The relay's state as the admin page shows it.
async fn status(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if !authorized(&shared.cfg, &headers) {
        return unauthorized();
    }
    let cfg = &shared.cfg;
    let budget = memory_permits(cfg);
    let queued = budget.saturating_sub(shared.memory.available_permits());
    let (open, addrs) = {
        let c = shared.addr_conns.lock().unwrap_or_else(|e| e.into_inner());
        (c.total(), c.addresses())
    };
    let per_queue = queue_budget(cfg);
    let mut rooms: Vec<serde_json::Value> = {
        let rooms = shared.rooms();
        rooms
            .iter()
            .map(|(name, r)| {
                let mut members: Vec<_> = r.members.iter().collect();
                members.sort_unstable_by_key(|(k, _)| **k);
                json!({
                    "name": name,
                    "world": r.world,
                    "started": r.started,
                    "age_s": r.created.elapsed().as_secs(),
                    "creator": r.creator.map(|a| a.to_string()),
                    "members": members.iter().map(|(k, m)| json!({
                        "rank": k,
                        "addr": m.addr.map(|a| a.to_string()),
                        "age_s": m.since.elapsed().as_secs(),
                        "queued_bytes": per_queue.saturating_sub(m.link.budget.available_permits()),
                    })).collect::<Vec<_>>(),
                })
            })
            .collect()
    };
    rooms.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    axum::Json(json!({
        "memory": { "queued_bytes": queued, "budget_bytes": budget },
        "connections": {
            "open": open,
            "max": cfg.max_conns,
            "addresses": addrs,
            "max_per_addr": cfg.max_conns_per_addr,
        },
        "rooms": {
            "open": rooms.len(),
            "max": cfg.max_rooms,
            "max_per_addr": cfg.max_rooms_per_addr,
            "list": rooms,
        },
    }))
    .into_response()
}

#[derive(Deserialize)]
struct Target {
    room: String,
    rank: Option<u32>,
}

/// End the members of `room` that `pick` picks, telling each `why`: how many, or `None` if there
/// is no such room.
fn end_members(
    shared: &Shared,
    room: &str,
    pick: impl Fn(u32) -> bool,
    why: &str,
) -> Option<usize> {
    let rooms = shared.rooms();
    let r = rooms.get(room)?;
    let mut n = 0;
    for (k, m) in &r.members {
        if pick(*k) {
            let _ = m.link.kill.send(Some(why.to_string()));
            n += 1;
        }
    }
    Some(n)
}

async fn close_room(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(t): Query<Target>,
) -> Response {
    if !authorized(&shared.cfg, &headers) {
        return unauthorized();
    }
    match end_members(&shared, &t.room, |_| true, CLOSED) {
        Some(n) => axum::Json(json!({ "closed": t.room, "members": n })).into_response(),
        None => not_found(&t.room),
    }
}

async fn remove_member(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(t): Query<Target>,
) -> Response {
    if !authorized(&shared.cfg, &headers) {
        return unauthorized();
    }
    let Some(rank) = t.rank else {
        return (
            StatusCode::BAD_REQUEST,
            "name the member: ?room=NAME&rank=K",
        )
            .into_response();
    };
    match end_members(&shared, &t.room, |k| k == rank, REMOVED) {
        Some(1) => axum::Json(json!({ "removed": rank, "room": t.room })).into_response(),
        Some(_) => (
            StatusCode::NOT_FOUND,
            format!("room {:?} has no member of rank {rank}", t.room),
        )
            .into_response(),
        None => not_found(&t.room),
    }
}

fn not_found(room: &str) -> Response {
    (StatusCode::NOT_FOUND, format!("no room {room:?}")).into_response()
}
