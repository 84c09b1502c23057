//! DOM helpers: elements by id, text and HTML, visibility, the clock, the console, escaping,
//! timers, errors and notices shown on the page.

use std::time::Duration;

use wasm_bindgen::{JsCast, JsValue};
use web_sys::{Document, HtmlElement};

use super::{state, view};

pub(super) fn doc() -> Option<Document> {
    web_sys::window()?.document()
}

pub(super) fn el<T: JsCast>(id: &str) -> Option<T> {
    doc()?.get_element_by_id(id)?.dyn_into::<T>().ok()
}

pub(super) fn set_text(id: &str, text: &str) {
    if let Some(e) = el::<HtmlElement>(id) {
        e.set_text_content(Some(text));
    }
}

pub(super) fn set_html(id: &str, html: &str) {
    if let Some(e) = el::<HtmlElement>(id) {
        e.set_inner_html(html);
    }
}

pub(super) fn set_hidden(id: &str, hidden: bool) {
    if let Some(e) = el::<HtmlElement>(id) {
        e.set_hidden(hidden);
    }
}

pub(super) fn now_ms() -> f64 {
    web_sys::window()
        .and_then(|w| w.performance())
        .map_or(0.0, |p| p.now())
}

pub(super) fn log(msg: &str) {
    web_sys::console::log_1(&JsValue::from_str(msg));
}

pub(super) fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Sleep on a clock a hidden tab does not stretch ([`crate::transport::clock`]).
pub(super) async fn sleep(d: Duration) {
    crate::transport::clock::sleep(d).await;
}

/// Show a fatal error (the group cannot go on) and mark the page failed.
pub(super) fn show_error(msg: &str) {
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
    for id in [
        "run",
        "lesson-start",
        "step",
        "back",
        "reset",
        "play",
        "program-run",
        "program-check",
        "bench-run",
    ] {
        if let Some(b) = el::<HtmlElement>(id) {
            let _ = b.set_attribute("disabled", "");
        }
    }
}

/// A message about a user's mistake (bad input): shown, the group goes on.
pub(super) fn show_notice(msg: &str) {
    set_text("notice", msg);
    set_hidden("notice", msg.is_empty());
}
