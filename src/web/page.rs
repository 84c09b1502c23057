//! The page (`www/index.html`): one browser tab = one rank, or N simulated ranks in one tab.
//!
//! The URL says which room and world (`?room=r&world=4`, plus `token` to join an existing room,
//! `net=webrtc|channel|relay` for the data path between tabs (default `auto`: BroadcastChannels
//! to tabs of this browser, WebRTC to others), `device=cpu|gpu|auto`, `relay=ws://...` for another
//! relay), or `?sim=N` for N ranks simulated inside this page (no server: for a projector). The
//! page picks the compute backend (WebGPU when the browser has an adapter, else the CPU) and says
//! which, joins the room through the relay, connects a direct path to every peer (or says which
//! pairs fell back to the relay, and why), and shows a share link and a diagram of the ranks with
//! itself highlighted.
//!
//! Lessons ([`crate::lesson`], files in `www/lessons/`) and free runs of any collective start from
//! any tab: the tab asks rank 0, which puts every tab's requests in one order and announces each to
//! every rank (the "bus", on its own group ids so it never mixes with collectives). The step / play
//! / reset controls go through the same bus, so every tab shows the same step. After a lesson runs,
//! the tabs exchange their traces so each can draw every rank's values.
//!
//! For tests and scripts the page exposes `window.distgrad`: `state()` (JSON of the page's state),
//! `lessonTrace()` (JSON of the lesson trace shown, or `null`), `startLesson(name)`, `control(what)`
//! (`step`, `back`, `reset`, `play`, `pause`), `runCase(json)` (run this rank's part of a
//! `distgrad vjp` case; resolves to the rank's result JSON), `request(collective, op, root)` (the
//! Run button) and `benchAllReduce(numel)` (forward + backward of a SUM all_reduce; resolves to JSON
//! with the milliseconds and checksums).

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use wasm_bindgen::JsCast;
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::{JsFuture, spawn_local};
use web_sys::{Document, HtmlElement, HtmlInputElement, HtmlSelectElement};

use super::net::{BrowserTransport, LinkKind, Links, NetEvent, WebJoin};
use crate::backend::{Choice, Device};
use crate::collective::{Communicator, P2p, ReduceOp};
use crate::error::{Error, Result};
use crate::lesson::{self, Lesson, LessonKind, Phase, RankTrace, Trace};
use crate::transport::{Channel, Tag, Transport};
use crate::vjp::{self, Case, Prepared, RankResult, TensorJson};
use crate::{Tape, Tensor, dist};

/// The bus's group id (no communicator group reaches it).
const BUS_GROUP: u32 = u32::MAX;
/// Group id of the lesson-trace exchange.
const TRACE_GROUP: u32 = u32::MAX - 1;
/// Seconds between steps when playing.
const PLAY_EVERY: Duration = Duration::from_millis(1200);

/// What `window.distgrad.state()` returns.
#[derive(Debug, Clone, Default, Serialize)]
struct PageState {
    /// starting | joining | ready | failed
    phase: String,
    room: String,
    world: usize,
    /// Simulated ranks in this page (single-tab mode).
    sim: bool,
    rank: Option<usize>,
    members: Vec<u32>,
    /// per rank: "self", "webrtc", "channel", "relay" or "" (not decided yet)
    links: Vec<String>,
    /// why pairs fell back to the relay
    fallbacks: Vec<String>,
    device: String,
    share: String,
    error: Option<String>,
    /// milliseconds from navigation start to "ready"
    ready_ms: Option<f64>,
    /// collective runs completed on this tab
    runs: usize,
    /// the last run's result on this rank (all ranks' in single-tab mode: rank 0's here)
    last: Option<RankResult>,
    last_collective: Option<String>,
    /// lesson shown, its step and number of steps, lessons completed
    lesson: Option<String>,
    lesson_step: usize,
    lesson_steps: usize,
    lesson_runs: usize,
    playing: bool,
}

/// Messages of the bus: requests to rank 0, and rank 0's announcements.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Bus {
    /// Run a collective case on every rank.
    Run {
        case: Box<Case>,
    },
    /// Run a lesson on every rank.
    Lesson {
        name: String,
    },
    /// Show step `step` (announced by rank 0).
    Goto {
        step: usize,
    },
    /// Requests that rank 0 turns into a `Goto`.
    Step,
    Back,
    Reset,
    Play,
    Pause,
}

struct App {
    /// None in single-tab mode.
    comm: Option<P2p<BrowserTransport>>,
    device: Device,
    world: usize,
    busy: futures::lock::Mutex<()>,
    /// Requests this rank sent to rank 0.
    requests_sent: RefCell<u64>,
    /// Rank 0 (and single-tab mode): requests to handle, in order.
    queue: RefCell<Option<futures::channel::mpsc::UnboundedSender<Bus>>>,
    /// Lesson-trace exchanges so far.
    exchanges: RefCell<u64>,
}

/// The lesson shown.
#[derive(Default)]
struct View {
    lesson: Option<Lesson>,
    trace: Option<Trace>,
    step: usize,
    playing: bool,
    /// Edited inputs, per rank (a tab edits only its own).
    inputs: Vec<Option<Vec<TensorJson>>>,
}

thread_local! {
    static PARAMS: RefCell<Option<Params>> = const { RefCell::new(None) };
    static STATE: RefCell<PageState> = RefCell::new(PageState::default());
    static APP: RefCell<Option<Rc<App>>> = const { RefCell::new(None) };
    static VIEW: RefCell<View> = RefCell::new(View::default());
}

fn state<R>(f: impl FnOnce(&mut PageState) -> R) -> R {
    STATE.with(|s| f(&mut s.borrow_mut()))
}

fn view<R>(f: impl FnOnce(&mut View) -> R) -> R {
    VIEW.with(|v| f(&mut v.borrow_mut()))
}

fn app() -> Result<Rc<App>> {
    APP.with(|a| a.borrow().clone()).ok_or_else(|| {
        Error::Input("the page is not ready yet (waiting for the other ranks)".into())
    })
}

fn doc() -> Option<Document> {
    web_sys::window()?.document()
}

fn el<T: JsCast>(id: &str) -> Option<T> {
    doc()?.get_element_by_id(id)?.dyn_into::<T>().ok()
}

fn set_text(id: &str, text: &str) {
    if let Some(e) = el::<HtmlElement>(id) {
        e.set_text_content(Some(text));
    }
}

fn set_html(id: &str, html: &str) {
    if let Some(e) = el::<HtmlElement>(id) {
        e.set_inner_html(html);
    }
}

fn set_hidden(id: &str, hidden: bool) {
    if let Some(e) = el::<HtmlElement>(id) {
        e.set_hidden(hidden);
    }
}

fn now_ms() -> f64 {
    web_sys::window()
        .and_then(|w| w.performance())
        .map_or(0.0, |p| p.now())
}

fn log(msg: &str) {
    web_sys::console::log_1(&JsValue::from_str(msg));
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

async fn sleep(d: Duration) {
    futures_timer::Delay::new(d).await;
}

/// Show a fatal error (the group cannot go on) and mark the page failed.
fn show_error(msg: &str) {
    web_sys::console::warn_1(&JsValue::from_str(msg));
    state(|s| {
        s.phase = "failed".into();
        s.error = Some(msg.to_string());
        s.playing = false;
    });
    view(|v| v.playing = false);
    if let Some(e) = el::<HtmlElement>("error") {
        e.set_text_content(Some(msg));
        e.set_hidden(false);
    }
    set_text("phase", "failed");
    for id in ["run", "lesson-start", "step", "back", "reset", "play"] {
        if let Some(b) = el::<HtmlElement>(id) {
            let _ = b.set_attribute("disabled", "");
        }
    }
}

/// A message about a user's mistake (bad input): shown, the group goes on.
fn show_notice(msg: &str) {
    set_text("notice", msg);
    set_hidden("notice", msg.is_empty());
}

// ---------------------------------------------------------------- parameters and start

#[derive(Clone)]
struct Params {
    room: Option<String>,
    world: usize,
    sim: Option<usize>,
    token: Option<String>,
    rank: Option<u32>,
    /// The direct path between tabs (`net=auto|webrtc|channel|relay`; `relay`: none).
    net: Links,
    device: Choice,
    relay: Option<String>,
}

fn params() -> Result<Params> {
    let w = web_sys::window().ok_or_else(|| Error::Input("no window".into()))?;
    let search = w.location().search().unwrap_or_default();
    let q = web_sys::UrlSearchParams::new_with_str(&search)
        .map_err(|_| Error::Input(format!("bad query string {search:?}")))?;
    let count = |key: &str, s: String| {
        s.parse::<usize>()
            .ok()
            .filter(|w| (1..=vjp::MAX_WORLD).contains(w))
            .ok_or_else(|| {
                Error::Input(format!(
                    "{key}={s:?}: expected a number 1..{}",
                    vjp::MAX_WORLD
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
        device,
        relay: q.get("relay"),
    })
}

fn relay_url() -> String {
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

fn share_link(p: &Params, room: &str, token: &str) -> String {
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
    if let Some(r) = &p.relay {
        s.push_str(&format!("&relay={}", enc(r)));
    }
    s
}

fn enc(s: &str) -> String {
    String::from(js_sys::encode_uri_component(s))
}

/// Entry point of the web app (called by the binary's `main` on wasm32).
pub fn start() {
    std::panic::set_hook(Box::new(|info| {
        show_error(&format!("internal error (please report): {info}"));
    }));
    install_api();
    spawn_local(async {
        if let Err(e) = run().await {
            show_error(&e.to_string());
        }
    });
}

async fn choose_device(choice: Choice) -> Result<Device> {
    let device = crate::backend::select(choice).await?;
    let text = match &device {
        Device::Cpu if choice == Choice::Cpu => "CPU (chosen with ?device=cpu)".to_string(),
        Device::Cpu => "CPU fallback (this browser has no WebGPU adapter)".to_string(),
        #[cfg(feature = "wgpu")]
        Device::Gpu(g) => format!("WebGPU: {}", g.describe()),
    };
    state(|s| s.device = text.clone());
    set_text("device", &text);
    Ok(device)
}

async fn run() -> Result<()> {
    state(|s| s.phase = "starting".into());
    let p = params()?;
    PARAMS.with(|x| *x.borrow_mut() = Some(p.clone()));
    view(|v| v.inputs = vec![None; p.world]);
    load_lesson_list().await;
    if let Some(n) = p.sim {
        return run_simulated_page(&p, n).await;
    }
    let Some(room) = p.room.clone() else {
        // No room yet: the lobby creates one (or joins one by name and token).
        if let Some(sel) = el::<HtmlSelectElement>("new-net") {
            sel.set_value(p.net.name());
        }
        set_hidden("create", false);
        set_hidden("lobby", true);
        set_hidden("lesson-panel", true);
        set_hidden("free-play", true);
        set_text("phase", "choose a room");
        set_text("device", "chosen when the room starts");
        state(|s| s.phase = "lobby".into());
        return Ok(());
    };
    state(|s| {
        s.room = room.clone();
        s.world = p.world;
        s.links = vec![String::new(); p.world];
    });
    set_text("room", &room);
    set_text("world", &p.world.to_string());
    render_ranks();
    set_text("phase", "choosing a compute backend");
    let device = choose_device(p.device).await?;
    set_text(
        "phase",
        &format!("waiting for {} tabs to join (share the link)", p.world),
    );
    state(|s| s.phase = "joining".into());
    let url = p.relay.clone().unwrap_or_else(relay_url);
    let mut join = WebJoin::new(&url, &room, p.world as u32);
    join.token = p.token.clone();
    join.rank = p.rank;
    join.links = p.net;
    let t = BrowserTransport::join(join, Rc::new(on_net_event)).await?;
    let rank = t.rank();
    render_ranks();
    let opts = crate::collective::CommOptions {
        device: device.clone(),
        ..vjp::case_options()
    };
    let app = Rc::new(App {
        comm: Some(P2p::new(t, opts)),
        device,
        world: p.world,
        busy: futures::lock::Mutex::new(()),
        requests_sent: RefCell::new(0),
        queue: RefCell::new(None),
        exchanges: RefCell::new(0),
    });
    ready(app, &format!("rank {rank} of {} ready", p.world));
    Ok(())
}

async fn run_simulated_page(p: &Params, n: usize) -> Result<()> {
    state(|s| {
        s.sim = true;
        s.world = n;
        s.room = "single-tab mode".into();
        s.members = (0..n as u32).collect();
        s.links = vec!["simulated".into(); n];
    });
    set_text("room", "single tab (simulated ranks)");
    set_text("world", &n.to_string());
    set_text("rank", &format!("0–{} (simulated)", n - 1));
    set_hidden("share-row", true);
    if let Some(b) = doc().and_then(|d| d.body()) {
        let _ = b.class_list().add_1("sim");
    }
    let device = choose_device(p.device).await?;
    render_ranks();
    let app = Rc::new(App {
        comm: None,
        device,
        world: n,
        busy: futures::lock::Mutex::new(()),
        requests_sent: RefCell::new(0),
        queue: RefCell::new(None),
        exchanges: RefCell::new(0),
    });
    ready(app, &format!("{n} simulated ranks ready"));
    Ok(())
}

fn ready(app: Rc<App>, what: &str) {
    APP.with(|a| *a.borrow_mut() = Some(app.clone()));
    start_bus(&app);
    let ready_ms = now_ms();
    state(|s| {
        s.phase = "ready".into();
        s.ready_ms = Some(ready_ms);
    });
    set_text(
        "phase",
        &format!("ready ({ready_ms:.0} ms after the page started loading)"),
    );
    for id in ["run", "lesson-start"] {
        if let Some(b) = el::<HtmlElement>(id) {
            let _ = b.remove_attribute("disabled");
        }
    }
    log(&format!("distgrad: {what}"));
}

// ---------------------------------------------------------------- network events, ranks diagram

fn on_net_event(e: NetEvent) {
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
fn render_ranks() {
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

// ---------------------------------------------------------------- the bus

fn start_bus(app: &Rc<App>) {
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
            // Controls become an absolute step, so every tab shows the same one.
            let msg = match msg {
                Bus::Step | Bus::Back | Bus::Reset => {
                    let (step, len) =
                        view(|v| (v.step, v.trace.as_ref().map_or(0, |t| t.steps.len())));
                    if len == 0 {
                        continue;
                    }
                    let k = match msg {
                        Bus::Step => (step + 1).min(len - 1),
                        Bus::Back => step.saturating_sub(1),
                        _ => 0,
                    };
                    if matches!(msg, Bus::Reset) {
                        view(|v| v.playing = false);
                    }
                    Bus::Goto { step: k }
                }
                Bus::Play => {
                    start_playing(&a);
                    continue;
                }
                Bus::Pause => {
                    view(|v| v.playing = false);
                    state(|s| s.playing = false);
                    render_lesson();
                    continue;
                }
                other => other,
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

/// Rank 0: step forward every [`PLAY_EVERY`] until the last step or a pause.
fn start_playing(app: &Rc<App>) {
    if view(|v| std::mem::replace(&mut v.playing, true)) {
        return;
    }
    state(|s| s.playing = true);
    render_lesson();
    let a = app.clone();
    spawn_local(async move {
        loop {
            sleep(PLAY_EVERY).await;
            let (playing, step, len) = view(|v| {
                (
                    v.playing,
                    v.step,
                    v.trace.as_ref().map_or(0, |t| t.steps.len()),
                )
            });
            if !playing || step + 1 >= len {
                view(|v| v.playing = false);
                state(|s| s.playing = false);
                render_lesson();
                return;
            }
            if request(&a, Bus::Step).await.is_err() {
                return;
            }
        }
    });
}

/// Send a request to rank 0 (or handle it here on rank 0 and in single-tab mode).
async fn request(app: &App, msg: Bus) -> Result<()> {
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
fn next_tag(counter: &RefCell<u64>, group: u32) -> Tag {
    let mut n = counter.borrow_mut();
    let seq = *n;
    *n += 1;
    Tag {
        group,
        seq,
        channel: Channel::Data,
    }
}

/// What every rank does with an announcement.
async fn perform(app: &App, msg: Bus) {
    match msg {
        Bus::Run { case } => run_and_show(app, &case).await,
        Bus::Lesson { name } => {
            if let Err(e) = run_lesson(app, &name).await {
                show_error(&format!("lesson {name}: {e}"));
            }
        }
        Bus::Goto { step } => {
            view(|v| v.step = step);
            render_lesson();
        }
        Bus::Step | Bus::Back | Bus::Reset | Bus::Play | Bus::Pause => {}
    }
}

// ---------------------------------------------------------------- collectives (free play)

async fn run_case(app: &App, case: &Case) -> Result<RankResult> {
    let _busy = app.busy.lock().await;
    let comm = app
        .comm
        .as_ref()
        .ok_or_else(|| Error::Input("no group in single-tab mode".into()))?;
    let prepared = Prepared::new(case)?;
    let r = vjp::run_rank(comm, &prepared).await?;
    state(|s| {
        s.runs += 1;
        s.last = Some(r.clone());
        s.last_collective = Some(case.collective.clone());
    });
    Ok(r)
}

async fn run_and_show(app: &App, case: &Case) {
    set_text("phase", &format!("running {}", case.collective));
    if app.comm.is_none() {
        match vjp::run_case_interleaved(case, &app.device).await {
            Ok(out) => {
                let results: Vec<RankResult> = out
                    .outputs
                    .iter()
                    .zip(&out.grads)
                    .map(|(o, g)| RankResult {
                        outputs: o.clone(),
                        grads: g.clone(),
                        dual: vec![out.dual.clone()],
                    })
                    .collect();
                state(|s| {
                    s.runs += 1;
                    s.last = results.first().cloned();
                    s.last_collective = Some(case.collective.clone());
                });
                show_results(case, &results, None);
                set_text("phase", "ready");
            }
            Err(e) => show_notice(&format!("{} failed: {e}", case.collective)),
        }
        return;
    }
    let me = app.comm.as_ref().map_or(0, |c| c.rank());
    match run_case(app, case).await {
        Ok(r) => {
            let mut all = vec![
                RankResult {
                    outputs: Vec::new(),
                    grads: Vec::new(),
                    dual: Vec::new()
                };
                me
            ];
            all.push(r);
            show_results(case, &all, Some(me));
            set_text("phase", "ready");
        }
        Err(e) => show_error(&format!("{} failed: {e}", case.collective)),
    }
}

fn cell(list: &[TensorJson]) -> String {
    if list.is_empty() {
        "—".into()
    } else {
        esc(&list.iter().map(vjp::fmt_t).collect::<Vec<_>>().join("  "))
    }
}

/// The free-play result: one table per rank shown (`only`: this tab's rank).
fn show_results(case: &Case, results: &[RankResult], only: Option<usize>) {
    let mut title = case.collective.clone();
    if let Some(op) = &case.op {
        title.push_str(&format!(" op={op}"));
    }
    if let Some(root) = case.root {
        title.push_str(&format!(" root={root}"));
    }
    let mut html = format!("<h3>{}</h3>", esc(&title));
    for (rank, r) in results.iter().enumerate() {
        if only.is_some_and(|o| o != rank) {
            continue;
        }
        let ones: Vec<TensorJson>;
        let cot: &[TensorJson] = match &case.cotangents {
            Some(c) => c.get(rank).map_or(&[], Vec::as_slice),
            None => {
                ones = r
                    .outputs
                    .iter()
                    .map(|o| TensorJson {
                        shape: o.shape.clone(),
                        data: vec![Some(1.0); o.data.len()],
                    })
                    .collect();
                &ones
            }
        };
        let dual = if r.dual.is_empty() {
            "nothing".to_string()
        } else {
            r.dual.join(" + ")
        };
        let rows = [
            (
                "input x",
                cell(case.inputs.get(rank).map_or(&[], Vec::as_slice)),
            ),
            ("forward output y", cell(&r.outputs)),
            ("cotangent dL/dy", cell(cot)),
            ("backward ran", esc(&dual)),
            ("gradient dL/dx", cell(&r.grads)),
        ];
        html.push_str(&format!(
            "<table class=\"result\"><caption>rank {rank}</caption><tbody>"
        ));
        for (k, v) in rows {
            html.push_str(&format!(
                "<tr><th scope=\"row\">{k}</th><td><code>{v}</code></td></tr>"
            ));
        }
        html.push_str("</tbody></table>");
    }
    set_html("result", &html);
}

/// The case the form describes (the built-in example for this world).
async fn form_case(collective: &str, op: &str, root: usize) -> Result<Case> {
    let world = state(|s| s.world);
    let which = vjp::parse_collective(collective)?;
    let op = ReduceOp::parse(op)?;
    if which.takes_root() && root >= world {
        return Err(Error::Input(format!(
            "root {root} is not a rank of a world of {world}"
        )));
    }
    vjp::example_case_async(which, world, op, root, None).await
}

async fn request_from_form(collective: String, op: String, root: usize) -> Result<()> {
    let app = app()?;
    let case = form_case(&collective, &op, root).await?;
    request(
        &app,
        Bus::Run {
            case: Box::new(case),
        },
    )
    .await
}

fn on_run_click() {
    let collective = el::<HtmlSelectElement>("collective").map_or_else(String::new, |s| s.value());
    let op = el::<HtmlSelectElement>("op").map_or_else(|| "sum".into(), |s| s.value());
    let root = el::<HtmlInputElement>("root")
        .and_then(|i| i.value().parse::<usize>().ok())
        .unwrap_or(0);
    spawn_local(async move {
        match request_from_form(collective, op, root).await {
            Ok(()) => show_notice(""),
            Err(e) => show_notice(&e.to_string()),
        }
    });
}

// ---------------------------------------------------------------- lessons

async fn fetch_text(path: &str) -> Result<String> {
    let w = web_sys::window().ok_or_else(|| Error::Input("no window".into()))?;
    let fail = |what: &str| Error::Input(format!("fetching {path}: {what}"));
    let resp = JsFuture::from(w.fetch_with_str(path))
        .await
        .map_err(|_| fail("network error"))?;
    let resp: web_sys::Response = resp.dyn_into().map_err(|_| fail("not a response"))?;
    if !resp.ok() {
        return Err(fail(&format!("HTTP {}", resp.status())));
    }
    let text = JsFuture::from(resp.text().map_err(|_| fail("no body"))?)
        .await
        .map_err(|_| fail("reading the body"))?;
    text.as_string().ok_or_else(|| fail("body is not text"))
}

#[derive(Deserialize)]
struct LessonIndex {
    lessons: Vec<LessonEntry>,
}

#[derive(Deserialize)]
struct LessonEntry {
    name: String,
    title: String,
}

async fn load_lesson_list() {
    let list = match fetch_text("lessons/index.json").await {
        Ok(t) => serde_json::from_str::<LessonIndex>(&t)
            .map_err(|e| Error::Input(format!("lessons/index.json: {e}"))),
        Err(e) => Err(e),
    };
    match list {
        Ok(idx) => {
            let mut html = String::new();
            for l in idx.lessons {
                html.push_str(&format!(
                    "<option value=\"{}\">{}</option>",
                    esc(&l.name),
                    esc(&l.title)
                ));
            }
            set_html("lesson", &html);
        }
        Err(e) => show_notice(&format!("no lessons: {e}")),
    }
}

fn lesson_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

async fn run_lesson(app: &App, name: &str) -> Result<()> {
    if !lesson_name_ok(name) {
        return Err(Error::Input(format!("bad lesson name {name:?}")));
    }
    set_text("phase", &format!("running lesson {name}"));
    let lesson = lesson::parse(&fetch_text(&format!("lessons/{name}.json")).await?)?;
    let _busy = app.busy.lock().await;
    let inputs = view(|v| v.inputs.clone());
    let trace = match &app.comm {
        None => lesson::run_simulated(&lesson, app.world, &app.device, &inputs).await?,
        Some(comm) => {
            let own = inputs.get(comm.rank()).cloned().flatten();
            let mine = lesson::run_rank(comm, &lesson, own).await?;
            let all = exchange(app, comm, mine).await?;
            lesson::assemble(&lesson, all)?
        }
    };
    let steps = trace.steps.len();
    if let Some(sel) = el::<HtmlSelectElement>("lesson") {
        sel.set_value(&lesson.name);
    }
    view(|v| {
        v.lesson = Some(lesson.clone());
        v.trace = Some(trace);
        v.step = 0;
        v.playing = false;
    });
    state(|s| {
        s.lesson = Some(lesson.name.clone());
        s.lesson_step = 0;
        s.lesson_steps = steps;
        s.lesson_runs += 1;
        s.playing = false;
    });
    set_hidden("lesson-view", false);
    set_text("phase", "ready");
    render_lesson();
    Ok(())
}

/// Send this rank's trace to every other rank and collect theirs (index = rank).
async fn exchange(
    app: &App,
    comm: &P2p<BrowserTransport>,
    mine: RankTrace,
) -> Result<Vec<RankTrace>> {
    let me = comm.rank();
    let world = comm.world_size();
    let tag = next_tag(&app.exchanges, TRACE_GROUP);
    let bytes = Bytes::from(serde_json::to_vec(&mine).map_err(|e| Error::Input(e.to_string()))?);
    for p in (0..world).filter(|&p| p != me) {
        comm.transport().send(p, tag, bytes.clone()).await?;
    }
    let mut all = Vec::with_capacity(world);
    for p in 0..world {
        if p == me {
            all.push(mine.clone());
            continue;
        }
        let recv = comm.transport().recv(p, tag);
        let b = match futures::future::select(
            std::pin::pin!(recv),
            std::pin::pin!(sleep(comm.options().timeout)),
        )
        .await
        {
            futures::future::Either::Left((r, _)) => r?,
            futures::future::Either::Right(_) => {
                return Err(Error::Input(format!(
                    "rank {p} sent no lesson trace within {:?}",
                    comm.options().timeout
                )));
            }
        };
        let t: RankTrace = serde_json::from_slice(&b)
            .map_err(|e| Error::Input(format!("rank {p}'s lesson trace: {e}")))?;
        all.push(t);
    }
    Ok(all)
}

const FWD: &str = "#1f6feb";
const BWD: &str = "#d4580a";

/// The ranks on a circle, with the messages of `step` as arrows and each rank's first value.
fn diagram(
    world: usize,
    me: Option<usize>,
    present: &[bool],
    step: Option<&lesson::Step>,
) -> String {
    let (w, h, cx, cy) = (480.0f64, 380.0f64, 240.0f64, 190.0f64);
    let radius = if world <= 1 { 0.0 } else { 112.0 };
    let angle = |r: usize| {
        -std::f64::consts::FRAC_PI_2 + std::f64::consts::TAU * r as f64 / world.max(1) as f64
    };
    let pos = |r: usize| {
        let a = angle(r);
        (cx + radius * a.cos(), cy + radius * a.sin())
    };
    // Values sit outside the circle of ranks, away from the arrows.
    let label_pos = |r: usize| {
        let (x, y) = pos(r);
        // Above the nodes of the upper half, below the others.
        let y = if world > 1 && angle(r).sin() < -0.3 {
            y - 40.0
        } else {
            y + 48.0
        };
        (x.clamp(75.0, w - 75.0), y)
    };
    let mut s = format!(
        "<svg viewBox=\"0 0 {w} {h}\" role=\"img\" aria-label=\"{world} ranks{}\">\
         <defs><marker id=\"head-f\" viewBox=\"0 0 10 10\" refX=\"9\" refY=\"5\" markerWidth=\"7\" markerHeight=\"7\" orient=\"auto\"><path d=\"M0,0 L10,5 L0,10 z\" fill=\"{FWD}\"/></marker>\
         <marker id=\"head-b\" viewBox=\"0 0 10 10\" refX=\"9\" refY=\"5\" markerWidth=\"7\" markerHeight=\"7\" orient=\"auto\"><path d=\"M0,0 L10,5 L0,10 z\" fill=\"{BWD}\"/></marker></defs>",
        step.map_or(String::new(), |st| format!(": {}", esc(&st.label)))
    );
    if let Some(st) = step {
        let (class, head) = match st.phase {
            Phase::Backward => ("arrow bwd", "head-b"),
            _ => ("arrow fwd", "head-f"),
        };
        for &(a, b) in &st.arrows {
            if a >= world || b >= world {
                continue;
            }
            let ((x1, y1), (x2, y2)) = (pos(a), pos(b));
            let (dx, dy) = (x2 - x1, y2 - y1);
            let len = (dx * dx + dy * dy).sqrt().max(1.0);
            let (ux, uy) = (dx / len, dy / len);
            // Offset sideways so a→b and b→a are both visible.
            let (ox, oy) = (-uy * 6.0, ux * 6.0);
            s.push_str(&format!(
                "<line class=\"{class}\" x1=\"{:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" marker-end=\"url(#{head})\"/>",
                x1 + ux * 34.0 + ox,
                y1 + uy * 34.0 + oy,
                x2 - ux * 38.0 + ox,
                y2 - uy * 38.0 + oy
            ));
        }
    }
    for r in 0..world {
        let (x, y) = pos(r);
        let mut class = String::from("node");
        if me == Some(r) {
            class.push_str(" me");
        }
        if !present.get(r).copied().unwrap_or(true) {
            class.push_str(" absent");
        }
        let value = step
            .and_then(|st| st.ranks.get(r))
            .and_then(|vals| vals.first())
            .map(|n| {
                let v = n.show();
                let v = if v.chars().count() > 26 {
                    format!("{}…", v.chars().take(25).collect::<String>())
                } else {
                    v
                };
                format!("{} = {v}", n.name)
            })
            .unwrap_or_default();
        let (lx, ly) = label_pos(r);
        s.push_str(&format!(
            "<g class=\"{class}\"><circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"30\"/>\
             <text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">rank {r}</text>{}\
             <text class=\"val\" x=\"{lx:.1}\" y=\"{ly:.1}\" text-anchor=\"middle\">{}</text></g>",
            if me == Some(r) { y } else { y + 5.0 },
            if me == Some(r) {
                format!("<text class=\"you\" x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">you</text>", y + 15.0)
            } else {
                String::new()
            },
            esc(&value)
        ));
    }
    s.push_str("</svg>");
    s
}

/// Loss per rank (thin) and of the group (thick) up to the shown step (data_parallel).
fn loss_plot(trace: &Trace, upto: usize) -> String {
    let value = |st: &lesson::Step, r: usize, name: &str| -> Option<f64> {
        st.ranks
            .get(r)?
            .iter()
            .find(|n| n.name == name)?
            .tensors
            .first()?
            .data
            .first()
            .copied()
            .flatten()
            .map(f64::from)
    };
    let steps: Vec<&lesson::Step> = trace
        .steps
        .iter()
        .filter(|s| s.phase == Phase::Train)
        .collect();
    let n = steps.len().max(1);
    let max = steps
        .iter()
        .flat_map(|st| (0..trace.world).filter_map(|r| value(st, r, "loss")))
        .fold(0.0f64, f64::max)
        .max(1e-12);
    let (w, h, l, b) = (480.0, 200.0, 40.0, 170.0);
    let x = |i: usize| l + (w - l - 10.0) * i as f64 / n as f64;
    let y = |v: f64| b - (b - 10.0) * (v / max);
    let colors = [
        "#1f6feb", "#d4580a", "#1a7f37", "#8250df", "#bf3989", "#0a7ea4", "#9a6700", "#57606a",
    ];
    let mut s = format!(
        "<svg viewBox=\"0 0 {w} {h}\" role=\"img\" aria-label=\"loss per rank and of the group\">\
         <line x1=\"{l}\" y1=\"{b}\" x2=\"{}\" y2=\"{b}\" class=\"axis\"/><line x1=\"{l}\" y1=\"10\" x2=\"{l}\" y2=\"{b}\" class=\"axis\"/>\
         <text x=\"4\" y=\"16\" class=\"tick\">{max:.2}</text><text x=\"4\" y=\"{b}\" class=\"tick\">0</text>\
         <text x=\"{}\" y=\"195\" class=\"tick\" text-anchor=\"end\">step</text>",
        w - 10.0,
        w - 10.0
    );
    let shown: Vec<&&lesson::Step> = steps.iter().take(upto).collect();
    let line = |name: &str, r: usize| -> String {
        shown
            .iter()
            .enumerate()
            .filter_map(|(i, st)| {
                value(st, r, name).map(|v| format!("{:.1},{:.1}", x(i + 1), y(v)))
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    for r in 0..trace.world {
        s.push_str(&format!(
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\"><title>rank {r}</title></polyline>",
            line("loss", r),
            colors[r % colors.len()]
        ));
    }
    s.push_str(&format!(
        "<polyline points=\"{}\" fill=\"none\" stroke=\"#1b1f24\" stroke-width=\"3\"><title>group</title></polyline></svg>",
        line("group loss", 0)
    ));
    let mut legend = String::from("<p class=\"legend\">");
    for r in 0..trace.world {
        legend.push_str(&format!(
            "<span style=\"color:{}\">━ rank {r}</span> ",
            colors[r % colors.len()]
        ));
    }
    legend.push_str("<span>▬ group (mean)</span></p>");
    s + &legend
}

fn render_lesson() {
    let me = state(|s| if s.sim { None } else { s.rank });
    let (members, world) = state(|s| (s.members.clone(), s.world));
    let present: Vec<bool> = (0..world).map(|r| members.contains(&(r as u32))).collect();
    let html = view(|v| {
        let (Some(trace), Some(lesson)) = (&v.trace, &v.lesson) else {
            return None;
        };
        let k = v.step.min(trace.steps.len().saturating_sub(1));
        let st = trace.steps.get(k)?;
        let mut table =
            String::from("<table class=\"values\"><thead><tr><th scope=\"col\">rank</th>");
        let names: Vec<String> = st
            .ranks
            .first()
            .map(|vals| vals.iter().map(|n| n.name.clone()).collect())
            .unwrap_or_default();
        for n in &names {
            table.push_str(&format!("<th scope=\"col\">{}</th>", esc(n)));
        }
        table.push_str("</tr></thead><tbody>");
        for (r, vals) in st.ranks.iter().enumerate() {
            table.push_str(&format!(
                "<tr{}><th scope=\"row\">{r}{}</th>",
                if me == Some(r) { " class=\"me\"" } else { "" },
                if me == Some(r) { " (you)" } else { "" }
            ));
            for n in vals {
                table.push_str(&format!("<td><code>{}</code></td>", esc(&n.show())));
            }
            table.push_str("</tr>");
        }
        table.push_str("</tbody></table>");
        let mut note = String::new();
        if let Some(c) = &st.collective {
            let what = match st.phase {
                Phase::Backward => "backward ran",
                _ => "forward ran",
            };
            note = format!("{what}: <strong>{}</strong>", esc(c));
        }
        if lesson.kind == LessonKind::DataParallel {
            let hashes: Vec<String> = st
                .ranks
                .iter()
                .filter_map(|vals| {
                    vals.iter()
                        .find(|n| n.name == "replica hash")
                        .and_then(|n| n.text.clone())
                })
                .collect();
            let same = hashes.windows(2).all(|w| w[0] == w[1]);
            note.push_str(&format!(
                " replica hashes: {} — {}",
                esc(&hashes.join(", ")),
                if same {
                    "all replicas identical ✓"
                } else {
                    "REPLICAS DIFFER ✗"
                }
            ));
        }
        let plot = (lesson.kind == LessonKind::DataParallel).then(|| loss_plot(trace, k));
        Some((
            format!("{} ", esc(&trace.title)),
            esc(&trace.why),
            format!("Step {k} of {}: {}", trace.steps.len() - 1, st.label),
            diagram(world, me, &present, Some(st)),
            table,
            note,
            plot,
            k,
            trace.steps.len(),
            lesson.kind == LessonKind::Collective,
            v.playing,
        ))
    });
    let Some((title, why, label, svg, table, note, plot, k, len, editable, playing)) = html else {
        return;
    };
    state(|s| {
        s.lesson_step = k;
        s.lesson_steps = len;
    });
    set_html("lesson-title", &title);
    set_html("lesson-why", &why);
    set_text("lesson-step", &label);
    set_html("diagram", &svg);
    set_html("lesson-table", &table);
    set_html("lesson-note", &note);
    match plot {
        Some(p) => {
            set_html("lesson-plot", &p);
            set_hidden("lesson-plot", false);
        }
        None => set_hidden("lesson-plot", true),
    }
    set_hidden("edit-form", !editable);
    let failed = state(|s| s.phase == "failed");
    for (id, off) in [
        ("step", k + 1 >= len),
        ("back", k == 0),
        ("reset", false),
        ("play", false),
    ] {
        if let Some(b) = el::<HtmlElement>(id) {
            if off || failed {
                let _ = b.set_attribute("disabled", "");
            } else {
                let _ = b.remove_attribute("disabled");
            }
        }
    }
    set_text("play", if playing { "Pause" } else { "Play" });
}

/// "1, 6 | 2, 4": tensors separated by `|`, shaped like the lesson's inputs on `rank`.
fn parse_input(text: &str, rank: usize) -> Result<Vec<TensorJson>> {
    let like: Vec<TensorJson> = view(|v| {
        v.trace
            .as_ref()
            .and_then(|t| t.steps.first())
            .and_then(|s| s.ranks.get(rank))
            .and_then(|vals| vals.first())
            .map(|n| n.tensors.clone())
    })
    .ok_or_else(|| Error::Input("start a lesson first".into()))?;
    let parts: Vec<&str> = text.split('|').collect();
    if parts.len() != like.len() {
        return Err(Error::Input(format!(
            "rank {rank} has {} input tensor(s): separate them with |",
            like.len()
        )));
    }
    parts
        .iter()
        .zip(&like)
        .map(|(p, t)| {
            let vals = p
                .split([',', ' '])
                .filter(|s| !s.trim().is_empty())
                .map(|s| {
                    s.trim()
                        .parse::<f32>()
                        .ok()
                        .filter(|x| x.is_finite())
                        .ok_or_else(|| Error::Input(format!("{s:?} is not a finite number")))
                })
                .collect::<Result<Vec<f32>>>()?;
            if vals.len() != t.data.len() {
                return Err(Error::Input(format!(
                    "{} number(s) given, the input has {} (shape {:?})",
                    vals.len(),
                    t.data.len(),
                    t.shape
                )));
            }
            Ok(TensorJson {
                shape: t.shape.clone(),
                data: vals.into_iter().map(Some).collect(),
            })
        })
        .collect()
}

fn on_edit() {
    let me = state(|s| if s.sim { None } else { s.rank });
    let rank = me.unwrap_or_else(|| {
        el::<HtmlInputElement>("edit-rank")
            .and_then(|i| i.value().parse::<usize>().ok())
            .unwrap_or(0)
    });
    let text = el::<HtmlInputElement>("edit-x").map_or_else(String::new, |i| i.value());
    match parse_input(&text, rank) {
        Ok(x) => {
            view(|v| {
                if v.inputs.len() <= rank {
                    v.inputs.resize(rank + 1, None);
                }
                v.inputs[rank] = Some(x);
            });
            show_notice("");
            if let Some(name) = view(|v| v.lesson.as_ref().map(|l| l.name.clone())) {
                control(Bus::Lesson { name });
            }
        }
        Err(e) => show_notice(&format!("input not changed: {e}")),
    }
}

fn control(msg: Bus) {
    spawn_local(async move {
        let r = match app() {
            Ok(a) => request(&a, msg).await,
            Err(e) => Err(e),
        };
        if let Err(e) = r {
            show_notice(&e.to_string());
        }
    });
}

// ---------------------------------------------------------------- benchmark

async fn bench_all_reduce(numel: usize) -> Result<String> {
    let app = app()?;
    let _busy = app.busy.lock().await;
    let comm = app
        .comm
        .as_ref()
        .ok_or_else(|| Error::Input("no group in single-tab mode".into()))?;
    let x = Tensor::from_vec((0..numel).map(|i| (i % 7) as f32).collect(), &[numel])?
        .to_device(&app.device)?;
    let t0 = now_ms();
    let tape = Tape::new();
    let xv = tape.var(x);
    let group = comm.world();
    let y = dist::all_reduce(comm, &xv, ReduceOp::Sum, &group).await?;
    let loss = y.sum()?;
    let grads = tape.backward(&loss, comm).await?;
    let g = grads.wrt(&xv)?;
    let first = g.slice(0, 0, 1)?.read().await?;
    let ms = now_ms() - t0;
    comm.take_calls();
    // Checksums outside the timed part: every output element is world * (i % 7), every gradient
    // element is world (d/dx of sum(all_reduce(x)) on every rank, summed over ranks).
    let sum = |v: Vec<f32>| v.iter().map(|&x| f64::from(x)).sum::<f64>();
    Ok(serde_json::json!({
        "numel": numel,
        "bytes": numel * 4,
        "ms": ms,
        "grad0": first.first().copied(),
        "y_sum": sum(y.value().read().await?),
        "grad_sum": sum(g.read().await?),
    })
    .to_string())
}

// ---------------------------------------------------------------- window.distgrad and handlers

fn promise<F>(fut: F) -> js_sys::Promise
where
    F: std::future::Future<Output = Result<String>> + 'static,
{
    wasm_bindgen_futures::future_to_promise(async move {
        fut.await
            .map(|s| JsValue::from_str(&s))
            .map_err(|e| JsValue::from_str(&e.to_string()))
    })
}

fn set_fn(obj: &js_sys::Object, name: &str, f: &JsValue) {
    let _ = js_sys::Reflect::set(obj, &JsValue::from_str(name), f);
}

fn on(id: &str, event: &str, f: impl Fn(web_sys::Event) + 'static) {
    if let Some(e) = el::<HtmlElement>(id) {
        let c = Closure::<dyn Fn(web_sys::Event)>::new(f);
        let _ = e.add_event_listener_with_callback(event, c.as_ref().unchecked_ref());
        c.forget();
    }
}

fn parse_control(what: &str) -> Result<Bus> {
    Ok(match what {
        "step" => Bus::Step,
        "back" => Bus::Back,
        "reset" => Bus::Reset,
        "play" => Bus::Play,
        "pause" => Bus::Pause,
        o => {
            return Err(Error::Input(format!(
                "unknown control {o:?} (step, back, reset, play, pause)"
            )));
        }
    })
}

/// Load this page for `room` (a new one: `token` None), keeping the other URL parameters (device,
/// relay, and net unless `net` gives the data path chosen in the lobby).
fn go_to_room(room: &str, world: &str, token: Option<&str>, net: Option<&str>) {
    let Some(w) = web_sys::window() else { return };
    let ok = world
        .parse::<usize>()
        .is_ok_and(|n| (1..=vjp::MAX_WORLD).contains(&n));
    if !ok || room.is_empty() {
        show_notice(&format!(
            "a room needs a name and 1..{} ranks",
            vjp::MAX_WORLD
        ));
        return;
    }
    let q = web_sys::UrlSearchParams::new_with_str(&w.location().search().unwrap_or_default()).ok();
    let mut search = format!("room={}&world={world}", enc(room));
    if let Some(t) = token.filter(|t| !t.is_empty()) {
        search.push_str(&format!("&token={}", enc(t)));
    }
    for key in ["net", "device", "relay"] {
        let v = match (key, net) {
            // The default needs no parameter.
            ("net", Some(n)) => Some(n.to_string()).filter(|n| n != Links::default().name()),
            _ => q.as_ref().and_then(|q| q.get(key)),
        };
        if let Some(v) = v {
            search.push_str(&format!("&{key}={}", enc(&v)));
        }
    }
    let _ = w.location().set_search(&search);
}

/// `window.distgrad` and the page's handlers.
fn install_api() {
    let Some(w) = web_sys::window() else { return };
    let api = js_sys::Object::new();
    let f = Closure::<dyn Fn() -> String>::new(|| {
        state(|s| serde_json::to_string(s).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}")))
    });
    set_fn(&api, "state", f.as_ref());
    f.forget();
    let f = Closure::<dyn Fn() -> String>::new(|| {
        view(|v| serde_json::to_string(&v.trace).unwrap_or_else(|_| "null".into()))
    });
    set_fn(&api, "lessonTrace", f.as_ref());
    f.forget();
    let f = Closure::<dyn Fn(String) -> js_sys::Promise>::new(|name: String| {
        promise(async move {
            let a = app()?;
            request(&a, Bus::Lesson { name }).await?;
            Ok("requested".into())
        })
    });
    set_fn(&api, "startLesson", f.as_ref());
    f.forget();
    let f = Closure::<dyn Fn(String) -> js_sys::Promise>::new(|what: String| {
        promise(async move {
            let a = app()?;
            request(&a, parse_control(&what)?).await?;
            Ok("requested".into())
        })
    });
    set_fn(&api, "control", f.as_ref());
    f.forget();
    let f = Closure::<dyn Fn(String) -> js_sys::Promise>::new(|json: String| {
        promise(async move {
            let app = app()?;
            let case = vjp::parse_case(&json)?;
            let r = run_case(&app, &case).await;
            let me = app.comm.as_ref().map_or(0, |c| c.rank());
            match &r {
                Ok(r) => {
                    let mut all = vec![
                        RankResult {
                            outputs: Vec::new(),
                            grads: Vec::new(),
                            dual: Vec::new()
                        };
                        me
                    ];
                    all.push(r.clone());
                    show_results(&case, &all, Some(me));
                }
                Err(e) => show_error(&format!("{} failed: {e}", case.collective)),
            }
            serde_json::to_string(&r?).map_err(|e| Error::Input(e.to_string()))
        })
    });
    set_fn(&api, "runCase", f.as_ref());
    f.forget();
    let f = Closure::<dyn Fn(String, String, u32) -> js_sys::Promise>::new(
        |collective: String, op: String, root: u32| {
            promise(async move {
                request_from_form(collective, op, root as usize).await?;
                Ok("requested".into())
            })
        },
    );
    set_fn(&api, "request", f.as_ref());
    f.forget();
    let f = Closure::<dyn Fn(u32) -> js_sys::Promise>::new(|numel: u32| {
        promise(bench_all_reduce(numel as usize))
    });
    set_fn(&api, "benchAllReduce", f.as_ref());
    f.forget();
    let _ = js_sys::Reflect::set(&w, &JsValue::from_str("distgrad"), &api);

    on("create-form", "submit", |e| {
        e.prevent_default();
        let world = el::<HtmlInputElement>("new-world").map_or_else(String::new, |i| i.value());
        let name = format!("room-{:06}", (js_sys::Math::random() * 1e6) as u32);
        let net = el::<HtmlSelectElement>("new-net").map(|s| s.value());
        go_to_room(&name, &world, None, net.as_deref());
    });
    on("join-form", "submit", |e| {
        e.prevent_default();
        let value = |id: &str| el::<HtmlInputElement>(id).map_or_else(String::new, |i| i.value());
        let world = value("new-world");
        go_to_room(
            value("join-room").trim(),
            &world,
            Some(value("join-token").trim()),
            None,
        );
    });
    on("run-form", "submit", |e| {
        e.prevent_default();
        on_run_click();
    });
    on("lesson-form", "submit", |e| {
        e.prevent_default();
        let name = el::<HtmlSelectElement>("lesson").map_or_else(String::new, |s| s.value());
        view(|v| v.inputs.iter_mut().for_each(|x| *x = None));
        control(Bus::Lesson { name });
    });
    on("edit-form", "submit", |e| {
        e.prevent_default();
        on_edit();
    });
    on("step", "click", |_| control(Bus::Step));
    on("back", "click", |_| control(Bus::Back));
    on("reset", "click", |_| control(Bus::Reset));
    on("play", "click", |_| {
        control(if view(|v| v.playing) {
            Bus::Pause
        } else {
            Bus::Play
        })
    });
    on("copy", "click", |_| {
        if let Some(i) = el::<HtmlInputElement>("share") {
            i.select();
        }
    });
    // Arrow keys step through the lesson (unless typing in a field).
    if let Some(d) = doc() {
        let c = Closure::<dyn Fn(web_sys::KeyboardEvent)>::new(|e: web_sys::KeyboardEvent| {
            let typing = e
                .target()
                .and_then(|t| t.dyn_into::<web_sys::Element>().ok())
                .is_some_and(|t| matches!(t.tag_name().as_str(), "INPUT" | "SELECT" | "TEXTAREA"));
            if typing || view(|v| v.trace.is_none()) {
                return;
            }
            match e.key().as_str() {
                "ArrowRight" => control(Bus::Step),
                "ArrowLeft" => control(Bus::Back),
                _ => {}
            }
        });
        let _ = d.add_event_listener_with_callback("keydown", c.as_ref().unchecked_ref());
        c.forget();
    }
    if let Some(sel) = el::<HtmlSelectElement>("collective") {
        let mut html = String::new();
        for w in vjp::COLLECTIVES {
            html.push_str(&format!("<option value=\"{0}\">{0}</option>", w.name()));
        }
        sel.set_inner_html(&html);
        sel.set_value("all_reduce");
    }
    if let Some(sel) = el::<HtmlSelectElement>("op") {
        let mut html = String::new();
        for op in ReduceOp::ALL {
            html.push_str(&format!("<option value=\"{0}\">{0}</option>", op.name()));
        }
        sel.set_inner_html(&html);
    }
}
