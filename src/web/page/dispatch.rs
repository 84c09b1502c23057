//! What the page does with the bus's messages ([`super::bus`] carries them and knows nothing of
//! the views): rank 0 turns the lesson controls into an absolute step (so every tab shows the same
//! one), plays or pauses, and checks a program before any tab hears of it ([`announce`]); every
//! tab runs what is announced in its view ([`perform`]).

use std::rc::Rc;

use futures::future::LocalBoxFuture;

use super::dom::{set_html, set_text, show_error, show_notice};
use super::lessons::{render_lesson, run_lesson, show_round, start_playing};
use super::play::run_and_show;
use super::programs::{perform_program, plan_text};
use super::room_bench::{bench_room, show_bench};
use super::{App, Bus, state, view};

/// Rank 0, before announcing a request: step, back and reset become the step to show; play and
/// pause are rank 0's own (playing sends steps).
pub(super) fn announce(app: &Rc<App>, msg: Bus) -> Option<Bus> {
    match msg {
        Bus::Step | Bus::Back | Bus::Reset => {
            let (step, len) = view(|v| (v.step, v.trace.as_ref().map_or(0, |t| t.steps.len())));
            if len == 0 {
                return None;
            }
            let k = match msg {
                Bus::Step => (step + 1).min(len - 1),
                Bus::Back => step.saturating_sub(1),
                _ => 0,
            };
            if matches!(msg, Bus::Reset) {
                view(|v| v.playing = false);
            }
            Some(Bus::Goto { step: k })
        }
        Bus::Play => {
            start_playing(app);
            None
        }
        Bus::Pause => {
            view(|v| v.playing = false);
            state(|s| s.playing = false);
            render_lesson();
            None
        }
        // A program goes to every tab only once rank 0 has checked it (a member's own check is
        // the member's word).
        Bus::Program { ref text, .. } => match plan_text(text, app.world) {
            Ok(_) => Some(msg),
            Err(e) => {
                show_notice(&format!("a program asked for by a tab was not run: {e}"));
                None
            }
        },
        other => Some(other),
    }
}

/// Every tab: run an announcement in its view.
pub(super) fn perform(app: &App, msg: Bus) -> LocalBoxFuture<'_, ()> {
    Box::pin(async move {
        match msg {
            Bus::Run { case } => run_and_show(app, &case).await,
            Bus::Program { text, check } => perform_program(app, &text, check).await,
            Bus::Bench {} => bench(app).await,
            Bus::Lesson { name, algorithm } => {
                if let Err(e) = run_lesson(app, &name, algorithm).await {
                    show_error(&format!("lesson {name}: {e}"));
                }
            }
            Bus::Goto { step } => {
                view(|v| {
                    v.step = step;
                    v.round = None;
                });
                render_lesson();
            }
            Bus::Round { step, round } => show_round(step, round),
            Bus::Step | Bus::Back | Bus::Reset | Bus::Play | Bus::Pause => {}
        }
    })
}

/// The room benchmark on every tab, its table shown.
async fn bench(app: &App) {
    set_text("phase", "measuring the links and all_reduce on every tab");
    set_html("bench-result", "<p>Measuring…</p>");
    let _busy = app.busy.lock().await;
    let run = state(|s| s.bench_runs) as u64;
    match bench_room(app, run).await {
        Ok(v) => {
            show_bench(&v);
            state(|s| {
                s.bench_runs += 1;
                s.bench_result = Some(v);
            });
            set_text("phase", "ready");
        }
        Err(e) => show_error(&format!("the room benchmark failed: {e}")),
    }
}
