//! The page (`www/index.html`): one browser tab = one rank, or N simulated ranks in one tab.
//!
//! The URL says which room and world (`?room=r&world=4`, plus `token` to join an existing room,
//! `net=webrtc|channel|relay` for the data path between tabs (default `auto`: MessageChannels from
//! the port hub to tabs of this browser, `ports=0` BroadcastChannels, WebRTC to others),
//! `device=cpu|gpu|auto`, `relay=ws://...` for another relay), or `?sim=N` for N ranks simulated
//! inside this page (no server: for a projector). The page picks the compute backend (WebGPU when
//! the browser has an adapter, else the CPU) and says which, joins the room through the relay,
//! connects a direct path to every peer (or says which pairs fell back to the relay, and why), and
//! shows a share link and a diagram of the ranks with itself highlighted.
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
//! Run button), `benchAllReduce(numel)` (forward + backward of a SUM all_reduce; resolves to JSON
//! with the milliseconds and checksums), `runProgram(json)` / `checkProgram(json)` (ask for a
//! program to run / its gradients to be checked on every tab), `runProgramHere(json)` /
//! `checkProgramHere(json)` (this rank's part of a program or of its check, without asking the
//! other tabs: every rank must call it at the same time or be a native `distgrad worker --program`;
//! resolves to the rank's run or the check's report), `programResult()` (JSON of the last
//! program's result on this tab, or `null`), `benchRoom()` (ask for the room benchmark on every
//! tab: raw round trips and throughput of the tabs' links beside all_reduce's figures),
//! `benchResult()` (its table, or `null`), and for the transport's leave ordering
//! `sendAndLeave(dst, numel)` (send values to `dst`, then leave the room at once) with
//! `recvFrom(src, numel)` (receive them and count mismatches).
//!
//! One file per concern: the page's state, start and the types every part shares are here;
//! `dom.rs` (DOM helpers), `params.rs` (URL parameters, share links), `ranks.rs` (network events,
//! the ranks diagram), `bus.rs` (the control bus between tabs), `play.rs` (free play),
//! `dispatch.rs` (what each bus message does in the views), `lessons.rs` (the lesson view),
//! `programs.rs` (programs and the gradient check),
//! `diagram.rs` (SVG drawings, the loss plot), `room_bench.rs`,
//! `api.rs` (`window.distgrad` and the handlers).

mod api;
mod bus;
mod data;
mod diagram;
mod dispatch;
mod dom;
mod lessons;
mod params;
mod play;
mod programs;
mod ranks;
mod room_bench;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use wasm_bindgen::JsCast;
use wasm_bindgen::prelude::Closure;
use wasm_bindgen_futures::spawn_local;
use web_sys::{HtmlElement, HtmlSelectElement};

use crate::backend::{Choice, Device};
use crate::collective::P2p;
use crate::collective::events::Algorithm;
use crate::error::{Error, Result};
use crate::lesson::{Lesson, Trace};
use crate::transport::Transport;
use crate::transport::browser::{BrowserTransport, Links, PORT_HUB, WebJoin};
use crate::vjp::{Case, RankResult, TensorJson};

use api::install_api;
use bus::start_bus;
use dom::{doc, el, log, now_ms, set_hidden, set_text, show_error};
use lessons::{control, load_lesson_list};
use params::{chosen_relay, params, relay_url};
use programs::load_program_list;
use ranks::{on_net_event, render_ranks};

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
    /// per rank: "self", "webrtc", "channel", "port", "relay" or "" (not decided yet)
    links: Vec<String>,
    /// why pairs fell back to the relay
    fallbacks: Vec<String>,
    device: String,
    /// the WebGPU adapter's own description, where there is one (the compute line's tooltip)
    adapter: String,
    /// what the page's waits sleep on: "worker" (a hidden tab wakes on time) or "page timers"
    /// (no worker could be started: a hidden tab's waits stretch to its clamped timers)
    clock: String,
    share: String,
    error: Option<String>,
    /// milliseconds from navigation start to "ready"
    ready_ms: Option<f64>,
    /// milliseconds from navigation start to the first lesson on screen
    first_lesson_ms: Option<f64>,
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
    /// programs run or checked on this tab
    program_runs: usize,
    /// the last program's result: `{"kind": "run", "ranks": [...]}` or the gradient check's
    /// report (`{"kind": "check", "verdict": ..., "rows": [...], ...}`)
    program_result: Option<serde_json::Value>,
    /// room benchmarks completed on this tab
    bench_runs: usize,
    /// the last room benchmark's table (rank 0's figures)
    bench_result: Option<serde_json::Value>,
}

/// Messages of the bus: requests to rank 0, and rank 0's announcements.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Bus {
    /// Run a collective case on every rank.
    Run {
        case: Box<Case>,
    },
    /// Run a program on every rank (`check`: check its gradients).
    Program {
        text: String,
        check: bool,
    },
    /// Run the room benchmark on every rank.
    Bench {},
    /// Run a lesson on every rank (its collectives taking `algorithm` where they have the
    /// choice, instead of the lesson's).
    Lesson {
        name: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        algorithm: Option<Algorithm>,
    },
    /// Show step `step` (announced by rank 0).
    Goto {
        step: usize,
    },
    /// Show round `round` of the algorithm view at step `step` (`None`: the call's result).
    Round {
        step: usize,
        round: Option<u32>,
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

impl App {
    /// The room's group; an error in single-tab mode (no other tabs to talk to).
    fn group(&self) -> Result<&P2p<BrowserTransport>> {
        self.comm
            .as_ref()
            .ok_or_else(|| Error::Input("no group in single-tab mode".into()))
    }
}

/// The lesson shown.
#[derive(Default)]
struct View {
    lesson: Option<Lesson>,
    trace: Option<Trace>,
    step: usize,
    /// The algorithm view's round (`None`: the call's result), this tab's own.
    round: Option<u32>,
    playing: bool,
    /// Edited inputs, per rank (a tab edits only its own).
    inputs: Vec<Option<Vec<TensorJson>>>,
    /// The notice shown says a lesson needs more ranks (cleared when a lesson runs).
    refused: bool,
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

#[derive(Clone)]
struct Params {
    room: Option<String>,
    world: usize,
    sim: Option<usize>,
    token: Option<String>,
    rank: Option<u32>,
    /// The direct path between tabs (`net=auto|webrtc|channel|relay`; `relay`: none).
    net: Links,
    /// Whether tabs of this browser move their data to a MessageChannel from the port hub
    /// (`ports=0`: they keep the BroadcastChannel, for comparing the two).
    ports: bool,
    device: Choice,
    relay: Option<String>,
    /// An example program to load (`program=NAME`, from `www/programs/`).
    program: Option<String>,
    /// A lesson to open once the room is ready (`lesson=NAME`; single-tab mode opens the first
    /// lesson without it), at step `step=K`: a link to a lesson step.
    lesson: Option<String>,
    /// The step of `lesson` to show (`step=K`).
    step: Option<usize>,
    /// Whether the URL named the world (`world=N`): the lobby's form takes it.
    world_asked: bool,
    /// Projector mode (`projector=1`): large text, high contrast.
    projector: bool,
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
    // What the compute line says, in a student's words; the adapter's own name goes in the
    // line's tooltip.
    let (device, text, adapter) = match device {
        Device::Cpu if choice == Choice::Cpu => (
            Device::Cpu,
            "CPU (you chose it: ?device=cpu)".to_string(),
            String::new(),
        ),
        Device::Cpu => (
            Device::Cpu,
            "CPU fallback (this browser has no WebGPU adapter)".to_string(),
            String::new(),
        ),
        // A software adapter (SwiftShader) runs the kernels on the same CPU with a queue and
        // readbacks in between: 1 MiB all_reduce forward + backward in 4 tabs took about twice as
        // long on it as on the CPU backend, so the automatic choice takes the CPU.
        #[cfg(feature = "wgpu")]
        Device::Gpu(g) if choice == Choice::Auto && g.is_software() => (
            Device::Cpu,
            "CPU: this browser's WebGPU is software-only, slower here than the CPU (?device=gpu uses it anyway)"
                .to_string(),
            g.describe(),
        ),
        #[cfg(feature = "wgpu")]
        Device::Gpu(g) => {
            let text = if g.is_software() {
                "WebGPU: software-only, on the CPU (chosen with ?device=gpu)".to_string()
            } else {
                "WebGPU: this computer's GPU".to_string()
            };
            (Device::Gpu(g.clone()), text, g.describe())
        }
    };
    state(|s| s.adapter = adapter.clone());
    if let Some(e) = el::<web_sys::HtmlElement>("device") {
        e.set_title(&if adapter.is_empty() {
            String::new()
        } else {
            format!("WebGPU adapter: {adapter}")
        });
    }
    state(|s| s.device = text.clone());
    set_text("device", &text);
    Ok(device)
}

async fn run() -> Result<()> {
    state(|s| {
        s.clock = if crate::transport::clock::unthrottled() {
            "worker".into()
        } else {
            "page timers".into()
        }
    });
    state(|s| s.phase = "starting".into());
    let p = params()?;
    PARAMS.with(|x| *x.borrow_mut() = Some(p.clone()));
    if p.projector {
        api::set_projector(true);
    }
    view(|v| v.inputs = vec![None; p.world]);
    // The lists and (in single-tab mode) the compute backend are asked for at once: the first
    // lesson is on screen sooner.
    let lists = async {
        futures::join!(load_lesson_list(), load_program_list(p.program.clone()));
    };
    if let Some(n) = p.sim {
        let ((), device) = futures::join!(lists, choose_device(p.device));
        return run_simulated_page(n, device?);
    }
    lists.await;
    let Some(room) = p.room.clone() else {
        // No room yet: the lobby creates one (or joins one by name and token).
        if let Some(sel) = el::<HtmlSelectElement>("new-net") {
            sel.set_value(p.net.name());
        }
        // `?world=N` (what scripts/web.sh prints) fills the form's ranks.
        if p.world_asked
            && let Some(i) = el::<web_sys::HtmlInputElement>("new-world")
        {
            i.set_value(&p.world.to_string());
        }
        set_hidden("create", false);
        set_hidden("lobby", true);
        set_hidden("lesson-panel", true);
        set_hidden("free-play", true);
        set_hidden("program-panel", true);
        set_hidden("bench-panel", true);
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
    let url = match &p.relay {
        Some(asked) => chosen_relay(asked)?,
        None => relay_url(),
    };
    let mut join = WebJoin::new(&url, &room, p.world as u32);
    join.token = p.token.clone();
    join.rank = p.rank;
    join.links = p.net;
    join.port_hub = p.ports.then(|| PORT_HUB.to_string());
    let t = BrowserTransport::join(join, Rc::new(on_net_event)).await?;
    let rank = t.rank();
    render_ranks();
    let opts = crate::collective::CommOptions {
        device: device.clone(),
        // One readback per reduction instead of one per ring step: 1 MiB all_reduce forward +
        // backward on WebGPU (SwiftShader, 4 tabs) 104-106 ms against 122-128 ms folding on the GPU.
        fold_on_device: false,
        ..crate::collective::CommOptions::room()
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

fn run_simulated_page(n: usize, device: Device) -> Result<()> {
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
    // The room benchmark measures the tabs' links: nothing to measure in one tab.
    set_hidden("bench-panel", true);
    if let Some(b) = doc().and_then(|d| d.body()) {
        let _ = b.class_list().add_1("sim");
    }
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
    start_bus(&app, dispatch::announce, dispatch::perform);
    // A tab that goes away says goodbye on its links after its last data, so its peers know
    // they have everything (rather than racing the relay's notice).
    if let (Some(w), Some(_)) = (web_sys::window(), app.comm.as_ref()) {
        let a = app.clone();
        let c = Closure::<dyn Fn()>::new(move || {
            if let Some(comm) = &a.comm {
                comm.transport().close();
            }
        });
        let _ = w.add_event_listener_with_callback("pagehide", c.as_ref().unchecked_ref());
        c.forget();
    }
    let ready_ms = now_ms();
    state(|s| {
        s.phase = "ready".into();
        s.ready_ms = Some(ready_ms);
    });
    set_text(
        "phase",
        &format!("ready ({ready_ms:.0} ms after the page started loading)"),
    );
    for id in [
        "run",
        "lesson-start",
        "program-run",
        "program-check",
        "bench-run",
    ] {
        if let Some(b) = el::<HtmlElement>(id) {
            let _ = b.remove_attribute("disabled");
        }
    }
    log(&format!("distgrad: {what}"));
    open_linked_lesson(&app);
}

/// Open the lesson the link names (`lesson=NAME&step=K`), or in single-tab mode the first lesson:
/// asked once, by rank 0, so that every tab shows it.
fn open_linked_lesson(app: &App) {
    let (lesson, step) = PARAMS.with(|p| {
        p.borrow()
            .as_ref()
            .map_or((None, None), |p| (p.lesson.clone(), p.step))
    });
    let first = || el::<HtmlSelectElement>("lesson").map(|s| s.value());
    let name = match (lesson, &app.comm) {
        (Some(name), _) => Some(name),
        (None, None) => first().filter(|n| !n.is_empty()),
        (None, Some(_)) => None,
    };
    let leader = app.comm.as_ref().is_none_or(|c| c.transport().rank() == 0);
    if let (Some(name), true) = (name, leader) {
        control(Bus::Lesson {
            name,
            algorithm: None,
        });
        if let Some(step) = step {
            control(Bus::Goto { step });
        }
    }
}
