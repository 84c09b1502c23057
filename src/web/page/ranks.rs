//! Network events and the diagram of the room's ranks (who is here, which links, fallbacks).

use web_sys::HtmlInputElement;

use crate::transport::browser::{LinkKind, NetEvent};

use super::diagram::diagram;
use super::dom::{el, set_html, set_text, show_error};
use super::params::share_link;
use super::{PARAMS, state, view};

pub(super) fn on_net_event(e: NetEvent) {
    match e {
        NetEvent::Joined { rank, token } => {
            let share = PARAMS.with(|p| {
                p.borrow()
                    .as_ref()
                    .map(|p| share_link(p, &state(|s| s.room.clone()), &token))
            });
            state(|s| {
                s.rank = Some(rank);
                if s.links.len() > rank {
                    s.links[rank] = "self".into();
                }
                if let Some(l) = &share {
                    s.share = l.clone();
                }
            });
            set_text("rank", &rank.to_string());
            if let (Some(i), Some(l)) = (el::<HtmlInputElement>("share"), share) {
                i.set_value(&l);
            }
        }
        NetEvent::Members(m) => {
            state(|s| s.members = m);
            render_ranks();
        }
        NetEvent::PeerLeft { rank, reason } => {
            state(|s| s.members.retain(|&r| r != rank));
            render_ranks();
            if state(|s| s.phase == "ready") {
                show_error(&format!(
                    "rank {rank} left the room ({reason}); the group is broken: reload every tab to start again"
                ));
            }
        }
        NetEvent::Link { peer, kind, detail } => {
            state(|s| {
                if s.links.len() <= peer {
                    s.links.resize(peer + 1, String::new());
                }
                s.links[peer] = kind.name().to_string();
                if kind == LinkKind::Relay && !detail.is_empty() {
                    s.fallbacks.push(format!("rank {peer}: {detail}"));
                }
            });
            render_ranks();
        }
        NetEvent::Closed(reason) => show_error(&format!("disconnected: {reason}")),
    }
}

/// The ranks as a list (who is connected, how) and as the diagram.
pub(super) fn render_ranks() {
    let (world, rank, members, links, fallbacks, sim) = state(|s| {
        (
            s.world,
            s.rank,
            s.members.clone(),
            s.links.clone(),
            s.fallbacks.clone(),
            s.sim,
        )
    });
    let mut html = String::new();
    for r in 0..world {
        let here = members.contains(&(r as u32));
        let me = rank == Some(r);
        let link = links.get(r).cloned().unwrap_or_default();
        let what = if sim {
            "simulated".to_string()
        } else if me {
            "this tab".to_string()
        } else if !here {
            "not connected".to_string()
        } else if link.is_empty() {
            "connected".to_string()
        } else {
            let path = match link.as_str() {
                "channel" => "BroadcastChannel",
                "port" => "MessageChannel",
                "webrtc" => "WebRTC",
                "relay" => "the relay",
                other => other,
            };
            format!("connected via {path}")
        };
        html.push_str(&format!(
            "<li class=\"rank{}{}\">rank {r}: {what}</li>",
            if here { " present" } else { "" },
            if me { " me" } else { "" }
        ));
    }
    set_html("members", &html);
    set_text(
        "links",
        &if fallbacks.is_empty() {
            String::new()
        } else {
            format!("Fell back to the relay: {}", fallbacks.join("; "))
        },
    );
    if view(|v| v.trace.is_none()) {
        let present: Vec<bool> = (0..world).map(|r| members.contains(&(r as u32))).collect();
        set_html("diagram", &diagram(world, rank, &present, None));
    }
}
