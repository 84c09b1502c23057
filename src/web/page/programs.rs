//! Programs in the page ([`crate::program`]): load one (an example from `www/programs/`, a file,
//! a paste, or `?program=NAME` in the URL), run it on every tab (each tab runs its rank; the tabs
//! exchange their results, so each shows every rank's loss and gradients), or check its gradients
//! across the tabs ([`crate::gradcheck::check_program_on`]: every tab re-runs its rank for each
//! perturbed coordinate, and every tab gets the same report). In single-tab mode the ranks are
//! simulated in the page.
//!
//! The program's text goes through the bus, so every tab runs the same one whatever its own
//! editor holds; the tab that asks checks it first, so a mistake is a notice there, not a run.

use serde::{Deserialize, Serialize};
use wasm_bindgen_futures::{JsFuture, spawn_local};
use web_sys::{HtmlInputElement, HtmlSelectElement};

use crate::collective::Communicator;
use crate::error::{Error, Result};
use crate::gradcheck::{self, Report};
use crate::program::{Plan, Program, RankRun};

use super::bus::request;
use super::dom::{el, esc, now_ms, set_html, set_text, show_error, show_notice};
use super::lessons::{exchange, fetch_text, fill_select};
use super::params::lesson_name_ok;
use super::{App, Bus, state};

/// Largest program text the page accepts (a program with explicit values for many ranks).
const MAX_PROGRAM_TEXT: usize = 4 << 20;

/// One rank's run as the tabs exchange it and the test API returns it (the shape of `distgrad
/// run --json`'s entries; numbers that are not finite are `null`).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ShownRun {
    rank: usize,
    loss: Option<f32>,
    weight: f64,
    grads: Vec<Option<Vec<Option<f32>>>>,
}

impl ShownRun {
    fn of(rank: usize, r: &RankRun) -> ShownRun {
        let finite = |x: f32| x.is_finite().then_some(x);
        ShownRun {
            rank,
            loss: r.loss.and_then(finite),
            weight: r.weight,
            grads: r
                .grads
                .iter()
                .map(|g| g.as_ref().map(|v| v.iter().map(|&x| finite(x)).collect()))
                .collect(),
        }
    }
}

/// Fill the examples list from `programs/index.json`, and load `?program=NAME` if given.
pub(super) async fn load_program_list(wanted: Option<String>) {
    let first = Some("choose an example…");
    if let Err(e) = fill_select("programs/index.json", "programs", "program-example", first).await {
        show_notice(&format!("no example programs: {e}"));
    }
    if let Some(name) = wanted {
        if let Some(sel) = el::<HtmlSelectElement>("program-example") {
            sel.set_value(&name);
        }
        load_example(&name).await;
    }
}

/// Put example `name` (`www/programs/NAME.json`) into the editor.
pub(super) async fn load_example(name: &str) {
    if name.is_empty() {
        return;
    }
    if !lesson_name_ok(name) {
        return show_notice(&format!("bad program name {name:?}"));
    }
    match fetch_text(&format!("programs/{name}.json")).await {
        Ok(text) => {
            set_editor(&text);
            show_notice("");
        }
        Err(e) => show_notice(&format!("program {name}: {e}")),
    }
}

fn set_editor(text: &str) {
    if let Some(t) = el::<web_sys::HtmlTextAreaElement>("program-text") {
        t.set_value(text);
    }
}

/// The editor's text.
pub(super) fn editor() -> String {
    el::<web_sys::HtmlTextAreaElement>("program-text").map_or_else(String::new, |t| t.value())
}

/// Read the file chosen in the file input into the editor.
pub(super) fn on_program_file() {
    let file = el::<HtmlInputElement>("program-file")
        .and_then(|i| i.files())
        .and_then(|f| f.get(0));
    let Some(file) = file else { return };
    if file.size() > MAX_PROGRAM_TEXT as f64 {
        return show_notice(&format!(
            "{} is {} bytes; a program may have at most {MAX_PROGRAM_TEXT}",
            file.name(),
            file.size()
        ));
    }
    spawn_local(async move {
        match JsFuture::from(file.text())
            .await
            .ok()
            .and_then(|t| t.as_string())
        {
            Some(text) => {
                set_editor(&text);
                if let Some(sel) = el::<HtmlSelectElement>("program-example") {
                    sel.set_value("");
                }
                show_notice("");
            }
            None => show_notice(&format!("could not read {}", file.name())),
        }
    });
}

/// Check a program's text for a world of `world` ranks.
pub(super) fn plan_text(text: &str, world: usize) -> Result<(Program, Plan)> {
    if text.len() > MAX_PROGRAM_TEXT {
        return Err(Error::Input(format!(
            "the program is {} bytes; at most {MAX_PROGRAM_TEXT}",
            text.len()
        )));
    }
    if text.trim().is_empty() {
        return Err(Error::Input(
            "no program: choose an example, a file, or paste one".into(),
        ));
    }
    // A lesson file is a program with its narrative: its program runs here.
    let program = crate::lesson::Work::parse(text)?.program_for(world)?;
    let plan = program.plan(Some(world)).map_err(|e| match program.world {
        w if w != world => Error::Input(format!(
            "{e} (the program was written for {w} ranks; this room has {world})"
        )),
        _ => e,
    })?;
    Ok((program, plan))
}

/// The Run / Check gradients buttons (and the test API): check the editor's program here, then
/// ask rank 0 to run it on every tab.
pub(super) async fn request_program(app: &App, text: String, check: bool) -> Result<()> {
    plan_text(&text, app.world)?;
    request(app, Bus::Program { text, check }).await
}

/// `runProgramHere` / `checkProgramHere`: this rank's part of a program (or of its gradient
/// check) on the room's group, without the bus: every other rank must do the same at the same time,
/// a tab through this call or a native `distgrad worker --program [--gradcheck]` (a mixed group).
/// The result is this rank's run as `worker --program` prints it, or the check's report as
/// `worker --program --gradcheck --report-json` does.
pub(super) async fn program_here(app: &App, text: &str, check: bool) -> Result<String> {
    let (_, plan) = plan_text(text, app.world)?;
    let comm = app.group()?;
    let _busy = app.busy.lock().await;
    if check {
        let o = gradcheck::Options {
            comm: crate::collective::CommOptions {
                device: app.device.clone(),
                ..crate::collective::CommOptions::recorded()
            },
            ..gradcheck::Options::default()
        };
        Ok(gradcheck::check_program_on(comm, &plan, &o)
            .await?
            .to_json()
            .to_string())
    } else {
        serde_json::to_string(&crate::program::run_rank(comm, &plan, None, true).await?)
            .map_err(|e| Error::Input(e.to_string()))
    }
}

/// What every rank does with an announced program.
pub(super) async fn perform_program(app: &App, text: &str, check: bool) {
    let (program, plan) = match plan_text(text, app.world) {
        Ok(p) => p,
        // Every tab planned the same text, so every tab stops here, before any message.
        Err(e) => return show_notice(&format!("program not run: {e}")),
    };
    let what = if check {
        "checking the gradients"
    } else {
        "running the program"
    };
    set_text("phase", &format!("{what} on every rank"));
    set_html(
        "program-result",
        &format!("<p>{}…</p>", esc(&capitalized(what))),
    );
    let _busy = app.busy.lock().await;
    let started = now_ms();
    let shown = if check {
        check_on_every_rank(app, &plan)
            .await
            .map(|r| show_report(&program, &r, now_ms() - started))
    } else {
        run_on_every_rank(app, &plan)
            .await
            .map(|runs| show_runs(app, &program, &runs))
    };
    match shown {
        Ok(result) => {
            state(|s| {
                s.program_runs += 1;
                s.program_result = Some(result);
            });
            set_text("phase", "ready");
        }
        Err(e) if app.comm.is_none() => show_notice(&format!("the program failed: {e}")),
        // A failed collective may have left the group aborted.
        Err(e) => show_error(&format!("the program failed: {e}")),
    }
}

fn capitalized(s: &str) -> String {
    let mut c = s.chars();
    c.next()
        .map(|f| f.to_uppercase().chain(c).collect())
        .unwrap_or_default()
}

async fn run_on_every_rank(app: &App, plan: &Plan) -> Result<Vec<ShownRun>> {
    let opts = crate::collective::CommOptions {
        device: app.device.clone(),
        ..crate::collective::CommOptions::recorded()
    };
    match &app.comm {
        None => {
            let results =
                crate::in_process::run_interleaved(plan.world(), opts, |comm| async move {
                    crate::program::run_rank(&comm, plan, None, true).await
                })
                .await;
            results
                .into_iter()
                .enumerate()
                .map(|(r, run)| {
                    run.map(|x| ShownRun::of(r, &x))
                        .map_err(|e| Error::Input(format!("rank {r}: {e}")))
                })
                .collect()
        }
        Some(comm) => {
            let mine = crate::program::run_rank(comm, plan, None, true).await?;
            exchange(app, comm, ShownRun::of(comm.rank(), &mine)).await
        }
    }
}

async fn check_on_every_rank(app: &App, plan: &Plan) -> Result<Report> {
    let o = gradcheck::Options {
        comm: crate::collective::CommOptions {
            device: app.device.clone(),
            ..crate::collective::CommOptions::recorded()
        },
        ..gradcheck::Options::default()
    };
    match &app.comm {
        None => {
            let o = &o;
            let results = crate::in_process::run_interleaved(
                plan.world(),
                o.comm.clone(),
                |comm| async move { gradcheck::check_program_on(&comm, plan, o).await },
            )
            .await;
            // Every simulated rank got the same report; rank 0's is shown.
            let mut first = None;
            for (r, rep) in results.into_iter().enumerate() {
                let rep = rep.map_err(|e| Error::Input(format!("rank {r}: {e}")))?;
                first.get_or_insert(rep);
            }
            first.ok_or_else(|| Error::Input("no ranks".into()))
        }
        Some(comm) => gradcheck::check_program_on(comm, plan, &o).await,
    }
}

fn title_of(program: &Program) -> String {
    program
        .title
        .as_ref()
        .map_or_else(String::new, |t| format!("<h3>{}</h3>", esc(t)))
}

/// Values as the page shows them: up to 8, then how many more.
fn short(v: &[Option<f32>]) -> String {
    let mut s: Vec<String> = v
        .iter()
        .take(8)
        .map(|x| x.map_or_else(|| "nan".to_string(), |x| format!("{x:.5}")))
        .collect();
    if v.len() > 8 {
        s.push(format!("… ({} more)", v.len() - 8));
    }
    format!("[{}]", s.join(", "))
}

/// Every rank's loss and gradients, this tab's rank marked; returns the test API's JSON.
fn show_runs(app: &App, program: &Program, runs: &[ShownRun]) -> serde_json::Value {
    let me = app.comm.as_ref().map(|c| c.rank());
    let mut html = title_of(program);
    html.push_str(&format!(
        "<p>Forward and backward on every rank (objective: {}). Each gradient is of the \
         global objective with respect to that rank's input.</p>",
        esc(program.objective.objective().describe())
    ));
    html.push_str(
        "<table class=\"values\"><thead><tr><th scope=\"col\">rank</th>\
         <th scope=\"col\">loss</th><th scope=\"col\">weight</th>",
    );
    for inp in &program.inputs {
        html.push_str(&format!("<th scope=\"col\">∂F/∂{}</th>", esc(&inp.name)));
    }
    html.push_str("</tr></thead><tbody>");
    for run in runs {
        let mine = me == Some(run.rank);
        html.push_str(&format!(
            "<tr{}><th scope=\"row\">{}{}</th><td><code>{}</code></td><td>{}</td>",
            if mine { " class=\"me\"" } else { "" },
            run.rank,
            if mine { " (you)" } else { "" },
            run.loss.map_or_else(|| "—".into(), |l| format!("{l:.6}")),
            run.weight
        ));
        for g in &run.grads {
            html.push_str(&format!(
                "<td><code>{}</code></td>",
                g.as_ref().map_or_else(|| "—".into(), |g| esc(&short(g)))
            ));
        }
        html.push_str("</tr>");
    }
    html.push_str("</tbody></table>");
    set_html("program-result", &html);
    serde_json::json!({"kind": "run", "ranks": runs})
}

/// The gradient check's table per rank and input, the kinks and the verdict; returns the
/// report's JSON (with the milliseconds it took).
fn show_report(program: &Program, r: &Report, ms: f64) -> serde_json::Value {
    let me = state(|s| if s.sim { None } else { s.rank });
    let verdict = r.verdict();
    let mut html = title_of(program);
    html.push_str(&format!(
        "<p class=\"verdict {}\"><strong>{verdict}</strong> — {} run(s) of all {} ranks in {:.1} s; \
         F = {:.6}</p>",
        verdict.to_ascii_lowercase(),
        r.evaluations,
        r.world,
        ms / 1000.0,
        r.value
    ));
    if !r.rows.is_empty() {
        html.push_str(
            "<table class=\"values\"><thead><tr><th scope=\"col\">rank</th>\
             <th scope=\"col\">input</th><th scope=\"col\">checked</th>\
             <th scope=\"col\">max abs err</th><th scope=\"col\">max rel err</th>\
             <th scope=\"col\">kinks</th><th scope=\"col\">result</th></tr></thead><tbody>",
        );
        for row in &r.rows {
            let mine = me == Some(row.rank);
            let result = if row.failed > 0 {
                format!("FAIL ({})", row.failed)
            } else if row.inconclusive > 0 {
                format!("inconclusive ({})", row.inconclusive)
            } else {
                "pass".into()
            };
            html.push_str(&format!(
                "<tr{}><th scope=\"row\">{}{}</th><td>{}</td><td>{}</td><td>{:.2e}</td>\
                 <td>{:.2e}</td><td>{}</td><td>{result}</td></tr>",
                if mine { " class=\"me\"" } else { "" },
                row.rank,
                if mine { " (you)" } else { "" },
                esc(&row.input),
                row.checked,
                row.max_abs,
                row.max_rel,
                row.kinks
            ));
        }
        html.push_str("</tbody></table>");
    }
    html.push_str(&format!(
        "<details><summary>The whole report</summary><pre>{}</pre></details>",
        esc(&r.render())
    ));
    set_html("program-result", &html);
    let mut json = r.to_json();
    json["kind"] = "check".into();
    json["ms"] = ms.into();
    json
}
