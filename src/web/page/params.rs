//! The URL's parameters, the relay's address, share links, and moving to another room.

use crate::backend::Choice;
use crate::error::{Error, Result};
use crate::transport::browser::Links;

use super::{PARAMS, Params};

pub(super) fn params() -> Result<Params> {
    let w = web_sys::window().ok_or_else(|| Error::Input("no window".into()))?;
    let search = w.location().search().unwrap_or_default();
    let q = web_sys::UrlSearchParams::new_with_str(&search)
        .map_err(|_| Error::Input(format!("bad query string {search:?}")))?;
    let count = |key: &str, s: String| {
        s.parse::<usize>()
            .ok()
            .filter(|w| (1..=crate::program::MAX_WORLD).contains(w))
            .ok_or_else(|| {
                Error::Input(format!(
                    "{key}={s:?}: expected a number 1..{}",
                    crate::program::MAX_WORLD
                ))
            })
    };
    let sim = q.get("sim").map(|s| count("sim", s)).transpose()?;
    let world = match q.get("world") {
        None => sim.unwrap_or(2),
        Some(s) => count("world", s)?,
    };
    let device = match q.get("device").as_deref() {
        None | Some("auto") => Choice::Auto,
        Some("cpu") => Choice::Cpu,
        Some("gpu") => Choice::Gpu,
        Some(o) => {
            return Err(Error::Input(format!(
                "device={o:?}: expected auto, cpu or gpu"
            )));
        }
    };
    let net = match q.get("net") {
        None => Links::default(),
        Some(o) => Links::from_name(&o).ok_or_else(|| {
            Error::Input(format!(
                "net={o:?}: expected auto, webrtc, channel or relay"
            ))
        })?,
    };
    let ports = match q.get("ports").as_deref() {
        None | Some("1") => true,
        Some("0") => false,
        Some(o) => return Err(Error::Input(format!("ports={o:?}: expected 1 or 0"))),
    };
    let rank = match q.get("rank") {
        None => None,
        Some(s) => Some(
            s.parse::<u32>()
                .map_err(|_| Error::Input(format!("rank={s:?}: expected a number")))?,
        ),
    };
    Ok(Params {
        room: q.get("room").filter(|r| !r.is_empty()),
        world: sim.unwrap_or(world),
        sim,
        token: q.get("token").filter(|t| !t.is_empty()),
        rank,
        net,
        ports,
        device,
        relay: q.get("relay"),
        program: q.get("program").filter(|n| !n.is_empty()),
        lesson: match q.get("lesson").filter(|n| !n.is_empty()) {
            Some(n) if lesson_name_ok(&n) => Some(n),
            Some(n) => return Err(Error::Input(format!("lesson={n:?}: not a lesson name"))),
            None => None,
        },
        world_asked: q.get("world").is_some(),
        projector: match q.get("projector").as_deref() {
            None | Some("0") => false,
            Some("1") => true,
            Some(o) => return Err(Error::Input(format!("projector={o:?}: expected 1 or 0"))),
        },
        step: match q.get("step") {
            None => None,
            Some(s) => Some(
                s.parse::<usize>()
                    .map_err(|_| Error::Input(format!("step={s:?}: expected a number")))?,
            ),
        },
    })
}

/// Whether a name can be a lesson's (or an example program's) file name: letters, digits, `_`,
/// `-` (nothing that reaches outside `lessons/`).
pub(super) fn lesson_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Whether projector mode is on (large text, high contrast; `projector=1`).
pub(super) fn projector_on() -> bool {
    PARAMS.with(|p| p.borrow().as_ref().is_some_and(|p| p.projector))
}

pub(super) fn relay_url() -> String {
    let loc = web_sys::window().map(|w| w.location());
    let host = loc
        .as_ref()
        .and_then(|l| l.host().ok())
        .unwrap_or_else(|| "127.0.0.1:8080".into());
    let secure = loc
        .and_then(|l| l.protocol().ok())
        .is_some_and(|p| p == "https:");
    format!("{}://{host}/ws", if secure { "wss" } else { "ws" })
}

/// The authority (`host:port`) of a `ws://`, `wss://`, `http://` or `https://` URL, lowercased.
fn authority(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let host = rest.split(['/', '?', '#']).next()?;
    (!host.is_empty()).then(|| host.to_ascii_lowercase())
}

/// The relay this tab joins through, where the link names one (`?relay=`): this page's own relay
/// as asked; another only if the student confirms, since a shared link must not send a tab, its
/// room's token and its data to a server the student did not choose (and the relay's page allows
/// connections only to itself and the relays its teacher named, `--connect-src`).
pub(super) fn chosen_relay(asked: &str) -> Result<String> {
    let own = relay_url();
    if authority(asked).is_some_and(|a| Some(a) == authority(&own)) {
        return Ok(asked.to_string());
    }
    let w = web_sys::window().ok_or_else(|| Error::Input("no window".into()))?;
    let here = authority(&own).unwrap_or_default();
    let ok = w
        .confirm_with_message(&format!(
            "This link connects this tab to another relay:\n\n{asked}\n\nThe room's data and its \
             token would go there instead of to {here}, which served this page. Connect to it?"
        ))
        .unwrap_or(false);
    if ok {
        Ok(asked.to_string())
    } else {
        Err(Error::Input(format!(
            "relay={asked}: not this page's relay ({here}), and not confirmed: open the link \
             without relay= to use this page's relay"
        )))
    }
}

fn page_base() -> String {
    web_sys::window()
        .map(|w| w.location())
        .map(|l| {
            format!(
                "{}{}",
                l.origin().unwrap_or_default(),
                l.pathname().unwrap_or_default()
            )
        })
        .unwrap_or_default()
}

pub(super) fn share_link(p: &Params, room: &str, token: &str) -> String {
    let mut s = format!(
        "{}?room={}&world={}&token={}",
        page_base(),
        enc(room),
        p.world,
        enc(token)
    );
    if p.net != Links::default() {
        s.push_str(&format!("&net={}", p.net.name()));
    }
    if !p.ports {
        s.push_str("&ports=0");
    }
    if let Some(r) = &p.relay {
        s.push_str(&format!("&relay={}", enc(r)));
    }
    if let Some(prog) = &p.program {
        s.push_str(&format!("&program={}", enc(prog)));
    }
    // A teacher's link to a lesson step opens it on every tab that joins.
    if let Some(l) = &p.lesson {
        s.push_str(&format!("&lesson={}", enc(l)));
        if let Some(k) = p.step {
            s.push_str(&format!("&step={k}"));
        }
    }
    if p.projector {
        s.push_str("&projector=1");
    }
    s
}

/// A link that opens lesson `lesson` at step `step` with `world` ranks simulated in one tab: what
/// a teacher shares for one step (anyone can open it; no room needed).
pub(super) fn step_link(world: usize, lesson: &str, step: usize, projector: bool) -> String {
    format!(
        "{}?sim={world}&lesson={}&step={step}{}",
        page_base(),
        enc(lesson),
        if projector { "&projector=1" } else { "" }
    )
}

pub(super) fn enc(s: &str) -> String {
    String::from(js_sys::encode_uri_component(s))
}
