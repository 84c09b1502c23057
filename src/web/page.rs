//! The rank page (`www/index.html`): one browser tab = one rank.
//!
//! The URL says which room and world (`?room=r&world=4`, plus `token` to join an existing room,
//! `net=relay` to skip WebRTC, `device=cpu|gpu|auto`, `relay=ws://...` for another relay). The page
//! picks the compute backend (WebGPU when the browser has an adapter, else the CPU) and shows it,
//! joins the room through the relay, connects WebRTC data channels to every peer (or says which
//! pairs fell back to the relay), and shows a share link for the other tabs.
//!
//! Running a collective from any tab: the tab builds the example case and asks rank 0, which puts
//! the requests of all tabs in one order and tells every rank to run it (the "bus", on its own
//! group id so it never mixes with collectives). Every tab then shows its input, output,
//! cotangent, the backward collective that ran, and its gradient.
//!
//! For tests and scripts the page exposes `window.distgrad`: `state()` (JSON of the page's state),
//! `runCase(json)` (run this rank's part of a `distgrad vjp` case; resolves to the rank's result
//! JSON), `request(collective, op, root)` (what the Run button does) and `benchAllReduce(numel)`
//! (forward + backward of a SUM all_reduce; resolves to JSON with the milliseconds).

use std::cell::RefCell;
use std::rc::Rc;

use bytes::Bytes;
use serde::Serialize;
use wasm_bindgen::JsCast;
use wasm_bindgen::prelude::*;
use web_sys::{Document, HtmlElement, HtmlInputElement, HtmlSelectElement};

use super::net::{BrowserTransport, LinkKind, NetEvent, WebJoin};
use crate::backend::{Choice, Device};
use crate::collective::{Communicator, P2p, ReduceOp};
use crate::error::{Error, Result};
use crate::transport::{Channel, Tag, Transport};
use crate::vjp::{self, Case, Prepared, RankResult, TensorJson, Which};
use crate::{Tape, Tensor, dist};

/// The bus's group id (no communicator group reaches it).
const BUS_GROUP: u32 = u32::MAX;

/// What `window.distgrad.state()` returns.
#[derive(Debug, Clone, Default, Serialize)]
struct PageState {
    /// starting | joining | connecting | ready | failed
    phase: String,
    room: String,
    world: usize,
    rank: Option<usize>,
    members: Vec<u32>,
    /// per rank: "self", "webrtc", "relay" or "" (not decided yet)
    links: Vec<String>,
    /// why pairs fell back to the relay
    fallbacks: Vec<String>,
    device: String,
    share: String,
    error: Option<String>,
    /// milliseconds from navigation start to "ready"
    ready_ms: Option<f64>,
    /// runs completed on this tab
    runs: usize,
    /// the last run's result on this rank
    last: Option<RankResult>,
    last_collective: Option<String>,
}

struct App {
    comm: P2p<BrowserTransport>,
    busy: futures::lock::Mutex<()>,
    /// Requests this rank sent to rank 0.
    requests_sent: RefCell<u64>,
    /// rank 0: cases to announce, in order.
    queue: RefCell<Option<futures::channel::mpsc::UnboundedSender<Case>>>,
}

thread_local! {
    static PARAMS: RefCell<Option<Params>> = const { RefCell::new(None) };
    static STATE: RefCell<PageState> = RefCell::new(PageState::default());
    static APP: RefCell<Option<Rc<App>>> = const { RefCell::new(None) };
}

fn state<R>(f: impl FnOnce(&mut PageState) -> R) -> R {
    STATE.with(|s| f(&mut s.borrow_mut()))
}

fn app() -> Result<Rc<App>> {
    APP.with(|a| a.borrow().clone())
        .ok_or_else(|| Error::Input("the page has not joined its room yet".into()))
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

fn now_ms() -> f64 {
    web_sys::window()
        .and_then(|w| w.performance())
        .map_or(0.0, |p| p.now())
}

fn log(msg: &str) {
    web_sys::console::log_1(&JsValue::from_str(msg));
}

/// Show an error on the page (and in the console) and mark the page failed.
fn show_error(msg: &str) {
    web_sys::console::error_1(&JsValue::from_str(msg));
    state(|s| {
        s.phase = "failed".into();
        s.error = Some(msg.to_string());
    });
    if let Some(e) = el::<HtmlElement>("error") {
        e.set_text_content(Some(msg));
        e.set_hidden(false);
    }
    set_text("phase", "failed");
    if let Some(b) = el::<HtmlElement>("run") {
        let _ = b.set_attribute("disabled", "");
    }
}

fn render_members() {
    let (world, rank, members, links) =
        state(|s| (s.world, s.rank, s.members.clone(), s.links.clone()));
    let Some(list) = el::<HtmlElement>("members") else {
        return;
    };
    let mut html = String::new();
    for r in 0..world {
        let here = members.contains(&(r as u32));
        let me = rank == Some(r);
        let link = links.get(r).cloned().unwrap_or_default();
        let what = if me {
            "this tab".to_string()
        } else if !here {
            "not connected".to_string()
        } else if link.is_empty() {
            "connected".to_string()
        } else {
            format!("connected via {link}")
        };
        html.push_str(&format!(
            "<li class=\"rank{}{}\">rank {r}: {what}</li>",
            if here { " present" } else { "" },
            if me { " me" } else { "" }
        ));
    }
    list.set_inner_html(&html);
    let fallbacks = state(|s| s.fallbacks.clone());
    set_text(
        "links",
        &if fallbacks.is_empty() {
            String::new()
        } else {
            format!("Fell back to the relay: {}", fallbacks.join("; "))
        },
    );
}

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
            render_members();
        }
        NetEvent::PeerLeft { rank, reason } => {
            state(|s| s.members.retain(|&r| r != rank));
            render_members();
            let ready = state(|s| s.phase == "ready");
            if ready {
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
            render_members();
        }
        NetEvent::Closed(reason) => show_error(&format!("disconnected: {reason}")),
    }
}

#[derive(Clone)]
struct Params {
    room: Option<String>,
    world: usize,
    token: Option<String>,
    rank: Option<u32>,
    webrtc: bool,
    device: Choice,
    relay: Option<String>,
}

fn params() -> Result<Params> {
    let w = web_sys::window().ok_or_else(|| Error::Input("no window".into()))?;
    let search = w.location().search().unwrap_or_default();
    let q = web_sys::UrlSearchParams::new_with_str(&search)
        .map_err(|_| Error::Input(format!("bad query string {search:?}")))?;
    let world = match q.get("world") {
        None => 2,
        Some(s) => s
            .parse::<usize>()
            .ok()
            .filter(|w| (1..=64).contains(w))
            .ok_or_else(|| Error::Input(format!("world={s:?}: expected a number 1..64")))?,
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
    let webrtc = match q.get("net").as_deref() {
        None | Some("webrtc") => true,
        Some("relay") => false,
        Some(o) => return Err(Error::Input(format!("net={o:?}: expected webrtc or relay"))),
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
        world,
        token: q.get("token").filter(|t| !t.is_empty()),
        rank,
        webrtc,
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

fn share_link(p: &Params, room: &str, token: &str) -> String {
    let loc = web_sys::window().map(|w| w.location());
    let base = loc
        .map(|l| {
            format!(
                "{}{}",
                l.origin().unwrap_or_default(),
                l.pathname().unwrap_or_default()
            )
        })
        .unwrap_or_default();
    let mut s = format!(
        "{base}?room={}&world={}&token={}",
        enc(room),
        p.world,
        enc(token)
    );
    if !p.webrtc {
        s.push_str("&net=relay");
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
    wasm_bindgen_futures::spawn_local(async {
        if let Err(e) = run().await {
            show_error(&e.to_string());
        }
    });
}

async fn run() -> Result<()> {
    state(|s| s.phase = "starting".into());
    let p = params()?;
    let Some(room) = p.room.clone() else {
        // A fresh room: give it a name and put it in the URL, so the link can be shared.
        let name = format!("room-{:06}", (js_sys::Math::random() * 1e6) as u32);
        if let Some(w) = web_sys::window() {
            let _ = w
                .location()
                .set_search(&format!("room={name}&world={}", p.world));
        }
        return Ok(());
    };
    PARAMS.with(|x| *x.borrow_mut() = Some(p.clone()));
    state(|s| {
        s.room = room.clone();
        s.world = p.world;
        s.links = vec![String::new(); p.world];
    });
    set_text("room", &room);
    set_text("world", &p.world.to_string());
    set_text("phase", "choosing a compute backend");
    let device = match crate::backend::select(p.device).await {
        Ok(d) => d,
        Err(e) => return Err(e),
    };
    let device_text = match &device {
        Device::Cpu => "CPU (no WebGPU adapter in this browser: CPU fallback)".to_string(),
        #[cfg(feature = "wgpu")]
        Device::Gpu(g) => format!("WebGPU: {}", g.describe()),
    };
    state(|s| s.device = device_text.clone());
    set_text("device", &device_text);
    set_text("phase", &format!("waiting for {} tabs to join", p.world));
    state(|s| s.phase = "joining".into());
    let url = p.relay.clone().unwrap_or_else(relay_url);
    let mut join = WebJoin::new(&url, &room, p.world as u32);
    join.token = p.token.clone();
    join.rank = p.rank;
    join.webrtc = p.webrtc;
    let t = BrowserTransport::join(join, Rc::new(on_net_event)).await?;
    let rank = t.rank();
    render_members();
    let opts = crate::collective::CommOptions {
        device,
        ..vjp::case_options()
    };
    let app = Rc::new(App {
        comm: P2p::new(t, opts),
        busy: futures::lock::Mutex::new(()),
        requests_sent: RefCell::new(0),
        queue: RefCell::new(None),
    });
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
    if let Some(b) = el::<HtmlElement>("run") {
        let _ = b.remove_attribute("disabled");
    }
    log(&format!("distgrad: rank {rank} of {} ready", p.world));
    Ok(())
}

/// The bus: every tab sends its requests to rank 0; rank 0 announces each case to everyone, in one
/// order, and every rank runs the announced cases one after another.
fn start_bus(app: &Rc<App>) {
    let me = app.comm.rank();
    let world = app.comm.world_size();
    if me == 0 {
        let (tx, mut rx) = futures::channel::mpsc::unbounded::<Case>();
        *app.queue.borrow_mut() = Some(tx.clone());
        for peer in 1..world {
            let a = app.clone();
            let tx = tx.clone();
            wasm_bindgen_futures::spawn_local(async move {
                let mut seq = 0;
                loop {
                    let tag = Tag {
                        group: BUS_GROUP,
                        seq,
                        channel: Channel::Data,
                    };
                    let Ok(bytes) = a.comm.transport().recv(peer, tag).await else {
                        return;
                    };
                    seq += 1;
                    match serde_json::from_slice::<Case>(&bytes) {
                        Ok(case) => {
                            let _ = tx.unbounded_send(case);
                        }
                        Err(e) => show_error(&format!("rank {peer} sent a bad request: {e}")),
                    }
                }
            });
        }
        let a = app.clone();
        wasm_bindgen_futures::spawn_local(async move {
            use futures::StreamExt;
            let mut seq = 0;
            while let Some(case) = rx.next().await {
                let Ok(text) = serde_json::to_vec(&case) else {
                    continue;
                };
                let tag = Tag {
                    group: BUS_GROUP,
                    seq,
                    channel: Channel::Sig,
                };
                seq += 1;
                for peer in 1..world {
                    if let Err(e) = a
                        .comm
                        .transport()
                        .send(peer, tag, Bytes::from(text.clone()))
                        .await
                    {
                        show_error(&format!("announcing the run: {e}"));
                        return;
                    }
                }
                run_and_show(&a, &case).await;
            }
        });
    } else {
        let a = app.clone();
        wasm_bindgen_futures::spawn_local(async move {
            let mut seq = 0;
            loop {
                let tag = Tag {
                    group: BUS_GROUP,
                    seq,
                    channel: Channel::Sig,
                };
                let Ok(bytes) = a.comm.transport().recv(0, tag).await else {
                    return;
                };
                seq += 1;
                match serde_json::from_slice::<Case>(&bytes) {
                    Ok(case) => run_and_show(&a, &case).await,
                    Err(e) => show_error(&format!("rank 0 announced a bad case: {e}")),
                }
            }
        });
    }
}

/// Ask rank 0 to have every rank run `case`.
async fn request(app: &App, case: Case) -> Result<()> {
    if app.comm.rank() == 0 {
        let q = app.queue.borrow().clone();
        return q
            .and_then(|q| q.unbounded_send(case).ok())
            .ok_or_else(|| Error::Input("the run queue is closed".into()));
    }
    let text = serde_json::to_vec(&case).map_err(|e| Error::Input(e.to_string()))?;
    let seq = {
        let mut n = app.requests_sent.borrow_mut();
        *n += 1;
        *n - 1
    };
    let tag = Tag {
        group: BUS_GROUP,
        seq,
        channel: Channel::Data,
    };
    app.comm.transport().send(0, tag, Bytes::from(text)).await
}

async fn run_case(app: &App, case: &Case) -> Result<RankResult> {
    let _busy = app.busy.lock().await;
    let prepared = Prepared::new(case)?;
    let r = vjp::run_rank(&app.comm, &prepared).await?;
    state(|s| {
        s.runs += 1;
        s.last = Some(r.clone());
        s.last_collective = Some(case.collective.clone());
    });
    Ok(r)
}

async fn run_and_show(app: &App, case: &Case) {
    set_text("phase", &format!("running {}", case.collective));
    match run_case(app, case).await {
        Ok(r) => {
            show_result(app.comm.rank(), case, &r);
            set_text("phase", "ready");
        }
        Err(e) => show_error(&format!("{} failed: {e}", case.collective)),
    }
}

fn cell(list: &[TensorJson]) -> String {
    if list.is_empty() {
        "—".into()
    } else {
        list.iter().map(vjp::fmt_t).collect::<Vec<_>>().join("  ")
    }
}

fn show_result(rank: usize, case: &Case, r: &RankResult) {
    let Some(out) = el::<HtmlElement>("result") else {
        return;
    };
    let ones;
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
                .collect::<Vec<_>>();
            &ones
        }
    };
    let mut title = case.collective.clone();
    if let Some(op) = &case.op {
        title.push_str(&format!(" op={op}"));
    }
    if let Some(root) = case.root {
        title.push_str(&format!(" root={root}"));
    }
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
    let mut html = format!("<h2>rank {rank}: {}</h2><table><tbody>", esc(&title));
    for (k, v) in rows {
        html.push_str(&format!(
            "<tr><th scope=\"row\">{k}</th><td><code>{v}</code></td></tr>"
        ));
    }
    html.push_str("</tbody></table>");
    out.set_inner_html(&html);
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The case the form describes (the built-in example for this world).
async fn form_case(collective: &str, op: &str, root: usize) -> Result<Case> {
    let world = state(|s| s.world);
    let which = Which::parse(collective)?;
    let op = ReduceOp::parse(op)?;
    if which.uses_root() && root >= world {
        return Err(Error::Input(format!(
            "root {root} is not a rank of a world of {world}"
        )));
    }
    vjp::example_case_async(which, world, op, root, None).await
}

async fn request_from_form(collective: String, op: String, root: usize) -> Result<()> {
    let app = app()?;
    let case = form_case(&collective, &op, root).await?;
    request(&app, case).await
}

fn on_run_click() {
    let collective = el::<HtmlSelectElement>("collective").map_or_else(String::new, |s| s.value());
    let op = el::<HtmlSelectElement>("op").map_or_else(|| "sum".into(), |s| s.value());
    let root = el::<HtmlInputElement>("root")
        .and_then(|i| i.value().parse::<usize>().ok())
        .unwrap_or(0);
    wasm_bindgen_futures::spawn_local(async move {
        if let Err(e) = request_from_form(collective, op, root).await {
            show_error(&e.to_string());
        }
    });
}

async fn bench_all_reduce(numel: usize) -> Result<String> {
    let app = app()?;
    let _busy = app.busy.lock().await;
    let device = app.comm.options().device.clone();
    let x = Tensor::from_vec((0..numel).map(|i| (i % 7) as f32).collect(), &[numel])?
        .to_device(&device)?;
    let t0 = now_ms();
    let tape = Tape::new();
    let xv = tape.var(x);
    let group = app.comm.world();
    let y = dist::all_reduce(&app.comm, &xv, ReduceOp::Sum, &group).await?;
    let loss = y.sum()?;
    let grads = tape.backward(&loss, &app.comm).await?;
    let g = grads.wrt(&xv)?;
    let first = g.slice(0, 0, 1)?.read().await?;
    let ms = now_ms() - t0;
    app.comm.take_calls();
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

/// `window.distgrad` and the form's handlers.
fn install_api() {
    let Some(w) = web_sys::window() else { return };
    let api = js_sys::Object::new();
    let f = Closure::<dyn Fn() -> String>::new(|| {
        state(|s| serde_json::to_string(s).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}")))
    });
    set_fn(&api, "state", f.as_ref());
    f.forget();
    let f = Closure::<dyn Fn(String) -> js_sys::Promise>::new(|json: String| {
        promise(async move {
            let app = app()?;
            let case = vjp::parse_case(&json)?;
            let r = run_case(&app, &case).await;
            match &r {
                Ok(r) => show_result(app.comm.rank(), &case, r),
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

    if let Some(b) = el::<HtmlElement>("run") {
        let f = Closure::<dyn Fn(web_sys::Event)>::new(|e: web_sys::Event| {
            e.prevent_default();
            on_run_click();
        });
        if let Some(form) = el::<HtmlElement>("run-form") {
            let _ = form.add_event_listener_with_callback("submit", f.as_ref().unchecked_ref());
        } else {
            let _ = b.add_event_listener_with_callback("click", f.as_ref().unchecked_ref());
        }
        f.forget();
    }
    if let Some(b) = el::<HtmlElement>("copy") {
        let f = Closure::<dyn Fn()>::new(|| {
            if let Some(i) = el::<HtmlInputElement>("share") {
                i.select();
            }
        });
        let _ = b.add_event_listener_with_callback("click", f.as_ref().unchecked_ref());
        f.forget();
    }
    if let Some(sel) = el::<HtmlSelectElement>("collective") {
        let mut html = String::new();
        for w in Which::ALL {
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
