//! Free play: any collective run forward and backward on every tab, from the form.

use wasm_bindgen_futures::spawn_local;
use web_sys::{HtmlInputElement, HtmlSelectElement};

use crate::collective::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use crate::vjp::{self, Case, Prepared, RankResult, TensorJson};

use super::bus::request;
use super::dom::{el, esc, set_html, set_text, show_error, show_notice};
use super::{App, Bus, app, state};

pub(super) async fn run_case(app: &App, case: &Case) -> Result<RankResult> {
    let _busy = app.busy.lock().await;
    let comm = app.group()?;
    let prepared = Prepared::new(case)?;
    let r = vjp::rank_result(comm, &prepared).await?;
    state(|s| {
        s.runs += 1;
        s.last = Some(r.clone());
        s.last_collective = Some(case.collective.clone());
    });
    Ok(r)
}

pub(super) async fn run_and_show(app: &App, case: &Case) {
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
                        events: Default::default(),
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
                    dual: Vec::new(),
                    events: Default::default(),
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
pub(super) fn show_results(case: &Case, results: &[RankResult], only: Option<usize>) {
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
    vjp::example_case(which, world, op, root, None)
}

pub(super) async fn request_from_form(collective: String, op: String, root: usize) -> Result<()> {
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

pub(super) fn on_run_click() {
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
