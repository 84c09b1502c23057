//! `window.distgrad` (the page's API for tests and scripts) and the controls' handlers.

use wasm_bindgen::JsCast;
use wasm_bindgen::prelude::{Closure, JsValue};
use wasm_bindgen_futures::spawn_local;
use web_sys::{HtmlElement, HtmlInputElement, HtmlSelectElement};

use crate::collective::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use crate::transport::browser::Links;
use crate::vjp::{self, RankResult};

use super::bus::request;
use super::dom::{doc, el, show_error, show_notice};
use super::lessons::{algo_round, chosen_algorithm, control, on_edit};
use super::params::{enc, projector_on};
use super::play::{on_run_click, request_from_form, run_case, show_results};
use super::programs::{editor, load_example, on_program_file, program_here, request_program};
use super::room_bench::{bench_all_reduce, recv_from, send_and_leave};
use super::{Bus, PARAMS, app, state, view};

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

/// The program panel's Run and Check gradients buttons.
fn program_button(check: bool) {
    let text = editor();
    spawn_local(async move {
        let r = match app() {
            Ok(a) => request_program(&a, text, check).await,
            Err(e) => Err(e),
        };
        if let Err(e) = r {
            show_notice(&format!("program not run: {e}"));
        }
    });
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
        .is_ok_and(|n| (1..=crate::program::MAX_WORLD).contains(&n));
    if !ok || room.is_empty() {
        show_notice(&format!(
            "a room needs a name and 1..{} ranks",
            crate::program::MAX_WORLD
        ));
        return;
    }
    let q = web_sys::UrlSearchParams::new_with_str(&w.location().search().unwrap_or_default()).ok();
    let mut search = format!("room={}&world={world}", enc(room));
    if let Some(t) = token.filter(|t| !t.is_empty()) {
        search.push_str(&format!("&token={}", enc(t)));
    }
    for key in [
        "net",
        "device",
        "relay",
        "program",
        "lesson",
        "step",
        "projector",
    ] {
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

/// Turn projector mode on or off: the page's class, the button, and the links it makes (share
/// link, step link) carry it.
pub(super) fn set_projector(on: bool) {
    PARAMS.with(|p| {
        if let Some(p) = p.borrow_mut().as_mut() {
            p.projector = on;
        }
    });
    if let Some(root) = web_sys::window()
        .and_then(|w| w.document())
        .and_then(|d| d.document_element())
    {
        let _ = if on {
            root.class_list().add_1("projector")
        } else {
            root.class_list().remove_1("projector")
        };
    }
    if let Some(b) = el::<web_sys::HtmlElement>("projector") {
        let _ = b.set_attribute("aria-pressed", if on { "true" } else { "false" });
    }
    super::lessons::render_lesson();
}

/// `window.distgrad` and the page's handlers.
pub(super) fn install_api() {
    let Some(w) = web_sys::window() else { return };
    let api = js_sys::Object::new();
    install_view_api(&api);
    install_run_api(&api);
    install_program_api(&api);
    install_bench_api(&api);
    install_leave_api(&api);
    // `digits`: the shipped digits, fetched from the app's files and checked (a summary).
    let f = Closure::<dyn Fn() -> js_sys::Promise>::new(|| promise(super::data::digits_summary()));
    set_fn(&api, "digits", f.as_ref());
    f.forget();
    let _ = js_sys::Reflect::set(&w, &JsValue::from_str("distgrad"), &api);
    install_room_handlers();
    install_panel_handlers();
    install_lesson_keys();
    fill_run_form();
}

/// `state`, `lessonTrace`, `startLesson` and `control`: the page's state and the lesson's controls.
fn install_view_api(api: &js_sys::Object) {
    let f = Closure::<dyn Fn() -> String>::new(|| {
        state(|s| serde_json::to_string(s).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}")))
    });
    set_fn(api, "state", f.as_ref());
    f.forget();
    let f = Closure::<dyn Fn() -> String>::new(|| {
        view(|v| serde_json::to_string(&v.trace).unwrap_or_else(|_| "null".into()))
    });
    set_fn(api, "lessonTrace", f.as_ref());
    f.forget();
    let f = Closure::<dyn Fn(String) -> js_sys::Promise>::new(|name: String| {
        promise(async move {
            let a = app()?;
            let algorithm = chosen_algorithm();
            request(&a, Bus::Lesson { name, algorithm }).await?;
            Ok("requested".into())
        })
    });
    set_fn(api, "startLesson", f.as_ref());
    f.forget();
    let f = Closure::<dyn Fn(String) -> js_sys::Promise>::new(|what: String| {
        promise(async move {
            let a = app()?;
            request(&a, parse_control(&what)?).await?;
            Ok("requested".into())
        })
    });
    set_fn(api, "control", f.as_ref());
    f.forget();
}

/// `runCase` (this rank's part of a vjp case) and `request` (the Run button).
fn install_run_api(api: &js_sys::Object) {
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
                            dual: Vec::new(),
                            events: Default::default(),
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
    set_fn(api, "runCase", f.as_ref());
    f.forget();
    let f = Closure::<dyn Fn(String, String, u32) -> js_sys::Promise>::new(
        |collective: String, op: String, root: u32| {
            promise(async move {
                request_from_form(collective, op, root as usize).await?;
                Ok("requested".into())
            })
        },
    );
    set_fn(api, "request", f.as_ref());
    f.forget();
}

/// `runProgram` / `checkProgram` (on every tab), `runProgramHere` / `checkProgramHere` (this
/// rank's part only) and `programResult`.
fn install_program_api(api: &js_sys::Object) {
    for (name, check) in [("runProgram", false), ("checkProgram", true)] {
        let f = Closure::<dyn Fn(String) -> js_sys::Promise>::new(move |text: String| {
            promise(async move {
                let a = app()?;
                request_program(&a, text, check).await?;
                Ok("requested".into())
            })
        });
        set_fn(api, name, f.as_ref());
        f.forget();
    }
    for (name, check) in [("runProgramHere", false), ("checkProgramHere", true)] {
        let f = Closure::<dyn Fn(String) -> js_sys::Promise>::new(move |text: String| {
            promise(async move {
                let a = app()?;
                program_here(&a, &text, check).await
            })
        });
        set_fn(api, name, f.as_ref());
        f.forget();
    }
    let f = Closure::<dyn Fn() -> String>::new(|| {
        state(|s| serde_json::to_string(&s.program_result).unwrap_or_else(|_| "null".into()))
    });
    set_fn(api, "programResult", f.as_ref());
    f.forget();
}

/// `benchRoom` (on every tab), `benchResult` (its table) and `benchAllReduce` (forward +
/// backward of one all_reduce).
fn install_bench_api(api: &js_sys::Object) {
    let f = Closure::<dyn Fn() -> js_sys::Promise>::new(|| {
        promise(async move {
            let a = app()?;
            request(&a, Bus::Bench {}).await?;
            Ok("requested".into())
        })
    });
    set_fn(api, "benchRoom", f.as_ref());
    f.forget();
    let f = Closure::<dyn Fn() -> String>::new(|| {
        state(|s| serde_json::to_string(&s.bench_result).unwrap_or_else(|_| "null".into()))
    });
    set_fn(api, "benchResult", f.as_ref());
    f.forget();
    let f = Closure::<dyn Fn(u32) -> js_sys::Promise>::new(|numel: u32| {
        promise(bench_all_reduce(numel as usize))
    });
    set_fn(api, "benchAllReduce", f.as_ref());
    f.forget();
}

/// `sendAndLeave` and `recvFrom`: the transport's leave ordering, tested from the page.
fn install_leave_api(api: &js_sys::Object) {
    let f = Closure::<dyn Fn(u32, u32) -> js_sys::Promise>::new(|dst: u32, numel: u32| {
        promise(send_and_leave(dst as usize, numel as usize))
    });
    set_fn(api, "sendAndLeave", f.as_ref());
    f.forget();
    let f = Closure::<dyn Fn(u32, u32) -> js_sys::Promise>::new(|src: u32, numel: u32| {
        promise(recv_from(src as usize, numel as usize))
    });
    set_fn(api, "recvFrom", f.as_ref());
    f.forget();
}

/// The lobby's forms (create a room, join one) and the share link's copy button.
fn install_room_handlers() {
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
    on("projector", "click", |_| set_projector(!projector_on()));
    on("copy", "click", |_| {
        if let Some(i) = el::<HtmlInputElement>("share") {
            i.select();
        }
    });
}

/// The panels' buttons: free play's Run, the lesson's controls and input edit, the program's
/// Run / Check / example / file, the room benchmark.
fn install_panel_handlers() {
    on("run-form", "submit", |e| {
        e.prevent_default();
        on_run_click();
    });
    on("lesson-form", "submit", |e| {
        e.prevent_default();
        let name = el::<HtmlSelectElement>("lesson").map_or_else(String::new, |s| s.value());
        view(|v| v.inputs.iter_mut().for_each(|x| *x = None));
        let algorithm = chosen_algorithm();
        control(Bus::Lesson { name, algorithm });
    });
    on("program-form", "submit", |e| {
        e.prevent_default();
        program_button(false);
    });
    on("program-check", "click", |_| program_button(true));
    on("bench-run", "click", |_| control(Bus::Bench {}));
    on("program-example", "change", |_| {
        let name =
            el::<HtmlSelectElement>("program-example").map_or_else(String::new, |s| s.value());
        spawn_local(async move { load_example(&name).await });
    });
    on("program-file", "change", |_| on_program_file());
    on("edit-form", "submit", |e| {
        e.prevent_default();
        on_edit();
    });
    on("algo-first", "click", |_| algo_round(|_, _| None));
    on("algo-back", "click", |_| {
        algo_round(|r, last| match r {
            None => Some(last),
            Some(0) => None,
            Some(k) => Some(k - 1),
        })
    });
    on("algo-next", "click", |_| {
        algo_round(|r, last| match r {
            None => Some(0),
            Some(k) if k >= last => None,
            Some(k) => Some(k + 1),
        })
    });
    on("algo-choice", "change", |_| {
        // Every tab runs the lesson again with the algorithm chosen, at the same step.
        let (name, step) = view(|v| (v.lesson.as_ref().map(|l| l.name.clone()), v.step));
        if let Some(name) = name {
            let algorithm = chosen_algorithm();
            control(Bus::Lesson { name, algorithm });
            control(Bus::Goto { step });
        }
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
}

/// Arrow keys step through the lesson (unless typing in a field).
fn install_lesson_keys() {
    let Some(d) = doc() else { return };
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

/// Free play's choices: every collective (all_reduce selected) and every reduce op.
fn fill_run_form() {
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
