//! The lesson view: the list, running a lesson on every tab, exchanging the traces, rendering the
//! current step, editing a rank's input.

use std::rc::Rc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use wasm_bindgen::JsCast;
use wasm_bindgen_futures::{JsFuture, spawn_local};
use web_sys::{HtmlElement, HtmlInputElement, HtmlSelectElement};

use crate::collective::events::Algorithm;
use crate::collective::{Communicator, P2p};
use crate::error::{Error, Result};
use crate::lesson;
use crate::transport::Transport;
use crate::transport::browser::BrowserTransport;
use crate::vjp::TensorJson;
use crate::web::algorithm_view::{call_svg, caption, messages_text};
use crate::web::lesson_view::{one_device_table, step_note, step_table};

use super::bus::{next_tag, request};
use super::diagram::{diagram, loss_plot};
use super::dom::{el, esc, now_ms, set_hidden, set_html, set_text, show_notice, sleep};
use super::params::{lesson_name_ok, projector_on, step_link};
use super::{App, Bus, PLAY_EVERY, TRACE_GROUP, app, state, view};

/// The answer to a fetch of the app's file at `path`, when it is a success.
pub(super) async fn fetch_ok(path: &str) -> Result<web_sys::Response> {
    let w = web_sys::window().ok_or_else(|| Error::Input("no window".into()))?;
    let fail = |what: &str| Error::Input(format!("fetching {path}: {what}"));
    let resp = JsFuture::from(w.fetch_with_str(path))
        .await
        .map_err(|_| fail("network error"))?;
    let resp: web_sys::Response = resp.dyn_into().map_err(|_| fail("not a response"))?;
    if !resp.ok() {
        return Err(fail(&format!("HTTP {}", resp.status())));
    }
    Ok(resp)
}

pub(super) async fn fetch_text(path: &str) -> Result<String> {
    let fail = |what: &str| Error::Input(format!("fetching {path}: {what}"));
    let resp = fetch_ok(path).await?;
    let text = JsFuture::from(resp.text().map_err(|_| fail("no body"))?)
        .await
        .map_err(|_| fail("reading the body"))?;
    text.as_string().ok_or_else(|| fail("body is not text"))
}

/// An entry of an index file (`www/lessons/index.json`, `www/programs/index.json`).
#[derive(Deserialize)]
struct IndexEntry {
    name: String,
    title: String,
    /// The fewest ranks a lesson runs on (lessons on a subgroup), said in the list.
    #[serde(default)]
    min_world: Option<usize>,
}

/// Fill `<select id=select>` from the index file at `path` (`{"<key>": [{"name", "title"}, ...]}`),
/// after a first entry `first` (value "") if given.
pub(super) async fn fill_select(
    path: &str,
    key: &str,
    select: &str,
    first: Option<&str>,
) -> Result<()> {
    let text = fetch_text(path).await?;
    let mut index: std::collections::HashMap<String, Vec<IndexEntry>> =
        serde_json::from_str(&text).map_err(|e| Error::Input(format!("{path}: {e}")))?;
    let entries = index
        .remove(key)
        .ok_or_else(|| Error::Input(format!("{path}: no {key:?} list")))?;
    let mut html = first.map_or_else(String::new, |f| {
        format!("<option value=\"\">{}</option>", esc(f))
    });
    for e in entries {
        let needs = match e.min_world {
            Some(n) if n > 1 => format!(" ({n} ranks or more)"),
            _ => String::new(),
        };
        html.push_str(&format!(
            "<option value=\"{}\">{}{}</option>",
            esc(&e.name),
            esc(&e.title),
            esc(&needs)
        ));
    }
    set_html(select, &html);
    Ok(())
}

pub(super) async fn load_lesson_list() {
    if let Err(e) = fill_select("lessons/index.json", "lessons", "lesson", None).await {
        show_notice(&format!("no lessons: {e}"));
    }
}

/// Run lesson `name` on every tab (this tab's part), its collectives taking `algorithm` where
/// they have the choice (`None`: the lesson's own).
pub(super) async fn run_lesson(app: &App, name: &str, algorithm: Option<Algorithm>) -> Result<()> {
    if !lesson_name_ok(name) {
        return Err(Error::Input(format!("bad lesson name {name:?}")));
    }
    set_text("phase", &format!("running lesson {name}"));
    let mut lesson = lesson::parse(&fetch_text(&format!("lessons/{name}.json")).await?)?;
    if algorithm.is_some() {
        lesson.algorithm = algorithm;
    }
    // A lesson on a subgroup needs its ranks: say so and leave the room as it is.
    if app.world < lesson.min_world {
        set_text("phase", "ready");
        show_notice(&format!(
            "The lesson \"{}\" needs at least {} ranks and this room has {}: pick another lesson, or make a room of {} ranks (or simulate them: ?sim={}&lesson={}).",
            lesson.title,
            lesson.min_world,
            app.world,
            lesson.min_world,
            lesson.min_world,
            lesson.name
        ));
        view(|v| v.refused = true);
        return Ok(());
    }
    if view(|v| std::mem::take(&mut v.refused)) {
        show_notice("");
    }
    let _busy = app.busy.lock().await;
    let inputs = view(|v| v.inputs.clone());
    let trace = match &app.comm {
        None => lesson::run_simulated(&lesson, app.world, &app.device, &inputs).await?,
        Some(comm) => {
            let own = inputs.get(comm.rank()).cloned().flatten();
            let mine = lesson::rank_trace(comm, &lesson, own).await?;
            let all = exchange(app, comm, mine).await?;
            lesson::assemble(&lesson, all).await?
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
        v.round = None;
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
    let shown = now_ms();
    state(|s| {
        s.first_lesson_ms.get_or_insert(shown);
    });
    Ok(())
}

/// Send this rank's part (a lesson trace, a program's run) to every other rank and collect theirs
/// (index = rank).
pub(super) async fn exchange<T>(app: &App, comm: &P2p<BrowserTransport>, mine: T) -> Result<Vec<T>>
where
    T: Serialize + serde::de::DeserializeOwned + Clone,
{
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
            std::pin::pin!(futures_timer::Delay::new(comm.options().timeout)),
        )
        .await
        {
            futures::future::Either::Left((r, _)) => r?,
            futures::future::Either::Right(_) => {
                return Err(Error::Input(format!(
                    "rank {p} sent no result within {:?}",
                    comm.options().timeout
                )));
            }
        };
        let t: T = serde_json::from_slice(&b)
            .map_err(|e| Error::Input(format!("rank {p}'s result: {e}")))?;
        all.push(t);
    }
    Ok(all)
}

pub(super) fn render_lesson() {
    let me = state(|s| if s.sim { None } else { s.rank });
    let (members, world) = state(|s| (s.members.clone(), s.world));
    let present: Vec<bool> = (0..world).map(|r| members.contains(&(r as u32))).collect();
    let html = view(|v| {
        let (Some(trace), Some(lesson)) = (&v.trace, &v.lesson) else {
            return None;
        };
        let k = v.step.min(trace.steps.len().saturating_sub(1));
        let st = trace.steps.get(k)?;
        let table = step_table(st, me).into_string();
        let note = step_note(st, lesson.trains()).into_string();
        let plot = lesson.trains().then(|| loss_plot(trace, k));
        // One device's gradients for the whole problem, with the last step.
        let one = (k + 1 == trace.steps.len())
            .then_some(trace.one_device.as_ref())
            .flatten()
            .map(|o| one_device_table(o, me).into_string());
        Some((
            format!("{} ", esc(&trace.title)),
            esc(&trace.why),
            format!("Step {k} of {}: {}", trace.steps.len() - 1, st.label),
            diagram(world, me, &present, Some(&with_sent_arrows(st))),
            table,
            note,
            plot,
            one,
            k,
            trace.steps.len(),
            matches!(lesson.view, lesson::View::Collective(_)),
            v.playing,
        ))
    });
    let Some((title, why, label, svg, table, note, plot, one, k, len, editable, playing)) = html
    else {
        return;
    };
    state(|s| {
        s.lesson_step = k;
        s.lesson_steps = len;
    });
    set_html("lesson-title", &title);
    set_html("lesson-why", &why);
    set_text("lesson-step", &label);
    if let (Some(a), Some(name)) = (
        el::<HtmlElement>("step-link"),
        view(|v| v.lesson.as_ref().map(|l| l.name.clone())),
    ) {
        let _ = a.set_attribute("href", &step_link(world, &name, k, projector_on()));
    }
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
    set_html("one-device", one.as_deref().unwrap_or(""));
    set_hidden("one-device", one.is_none());
    set_hidden("edit-form", !editable);
    render_algorithm();
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

/// `st` with its arrows where messages really went, where its calls were recorded (the ring's
/// n arrows instead of the n(n−1) of who needs whose data); as it is otherwise.
fn with_sent_arrows(st: &lesson::Step) -> lesson::Step {
    let mut arrows = Vec::new();
    for call in &st.calls {
        for k in 0..call.rounds() {
            for m in call.messages(k).iter().filter(|m| !m.confirm) {
                if !arrows.contains(&(m.from, m.to)) {
                    arrows.push((m.from, m.to));
                }
            }
        }
    }
    let mut out = st.clone();
    if !arrows.is_empty() {
        out.arrows = arrows;
    }
    out
}

/// The algorithm chosen in the algorithm view's list (`None`: the lesson's own).
pub(super) fn chosen_algorithm() -> Option<Algorithm> {
    el::<HtmlSelectElement>("algo-choice")
        .map(|s| s.value())
        .filter(|v| !v.is_empty())
        .and_then(|v| Algorithm::parse(&v).ok())
}

/// Move the algorithm view to the round `to(round, last round)` says, on every tab.
pub(super) fn algo_round(to: impl FnOnce(Option<u32>, u32) -> Option<u32>) {
    let (step, round) = view(|v| {
        let last = v
            .trace
            .as_ref()
            .and_then(|t| t.steps.get(v.step))
            .and_then(|st| st.calls.first())
            .map_or(0, |c| c.rounds().saturating_sub(1));
        (v.step, to(v.round, last))
    });
    control(Bus::Round { step, round });
}

/// Show round `round` of the algorithm view (announced), if this tab is at step `step`.
pub(super) fn show_round(step: usize, round: Option<u32>) {
    if view(|v| {
        let here = v.step == step;
        if here {
            v.round = round;
        }
        here
    }) {
        render_algorithm();
    }
}

/// The algorithm view of the step shown: its first collective call, round by round (hidden
/// where the step ran none or none was recorded).
fn render_algorithm() {
    let width = el::<HtmlElement>("algo-svg")
        .map(|e| f64::from(e.client_width()))
        .filter(|w| *w > 0.0)
        .unwrap_or(480.0)
        .min(520.0);
    let shown = view(|v| {
        let st = v.trace.as_ref()?.steps.get(v.step)?;
        let call = st.calls.first()?;
        let round = v.round.filter(|&k| k < call.rounds());
        let items: String = round
            .map(|k| messages_text(call, k))
            .unwrap_or_default()
            .iter()
            .map(|m| format!("<li>{}</li>", esc(m)))
            .collect();
        // Only all_reduce, all_gather and reduce_scatter have a choice of algorithm.
        let chooses = !matches!(
            call.algorithm,
            Algorithm::Tree | Algorithm::Direct | Algorithm::PointToPoint
        );
        Some((
            caption(call, round),
            call_svg(call, round, width).into_string(),
            items,
            (round, call.rounds()),
            chooses,
        ))
    });
    let Some((cap, svg, items, (round, rounds), chooses)) = shown else {
        set_hidden("algo", true);
        return;
    };
    set_hidden("algo", false);
    set_hidden("algo-choose", !chooses);
    set_text("algo-caption", &cap);
    set_html("algo-svg", &svg);
    set_html("algo-messages", &items);
    for (id, off) in [
        ("algo-first", round.is_none()),
        ("algo-back", rounds == 0),
        ("algo-next", rounds == 0),
    ] {
        if let Some(b) = el::<HtmlElement>(id) {
            if off {
                let _ = b.set_attribute("disabled", "");
            } else {
                let _ = b.remove_attribute("disabled");
            }
        }
    }
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

pub(super) fn on_edit() {
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
                let algorithm = chosen_algorithm();
                control(Bus::Lesson { name, algorithm });
            }
        }
        Err(e) => show_notice(&format!("input not changed: {e}")),
    }
}

pub(super) fn control(msg: Bus) {
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

/// Rank 0: step forward every [`PLAY_EVERY`] until the last step or a pause.
pub(super) fn start_playing(app: &Rc<App>) {
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
