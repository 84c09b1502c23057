//! Sleeps that a hidden tab does not stretch.
//!
//! Chromium clamps the timers of a hidden page to one wake-up a second, and after five minutes
//! hidden to about one a minute; a user who opens a room's share link in tabs of one window has
//! every tab but one hidden. Timers of a dedicated worker are not clamped, so the page's waits
//! (send buffers draining, link setup, lesson playback) sleep on a tiny worker that answers each
//! request after its delay. Messages from the worker are ordinary tasks, which a hidden page runs
//! at once. Each sleep also arms the page's own timer and ends on whichever fires first, so a
//! late or lost answer from the worker never stretches a visible tab's wait; where no worker can
//! be started (a page without `Worker`), the page's timer is all there is.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use futures::channel::oneshot;
use wasm_bindgen::JsCast;
use wasm_bindgen::closure::Closure;
use web_sys::{Blob, BlobPropertyBag, MessageEvent, Url, Worker};

/// The worker: `[id, ms]` in, `id` back after `ms` milliseconds.
const SOURCE: &str = "onmessage = (e) => { const [id, ms] = e.data; \
                      setTimeout(() => postMessage(id), ms); };";

type Waiting = Rc<RefCell<HashMap<u32, oneshot::Sender<()>>>>;

struct Clock {
    worker: Worker,
    next: Cell<u32>,
    waiting: Waiting,
    _on_message: Closure<dyn FnMut(MessageEvent)>,
}

impl Clock {
    fn start() -> Option<Clock> {
        let parts = js_sys::Array::of1(&SOURCE.into());
        let opts = BlobPropertyBag::new();
        opts.set_type("text/javascript");
        let blob = Blob::new_with_str_sequence_and_options(&parts, &opts).ok()?;
        let url = Url::create_object_url_with_blob(&blob).ok()?;
        let worker = Worker::new(&url);
        let _ = Url::revoke_object_url(&url);
        let worker = worker.ok()?;
        let waiting: Waiting = Rc::default();
        let w = waiting.clone();
        let on_message = Closure::<dyn FnMut(MessageEvent)>::new(move |e: MessageEvent| {
            let Some(id) = e.data().as_f64() else { return };
            if let Some(tx) = w.borrow_mut().remove(&(id as u32)) {
                // The sleeper may be gone (its future dropped): nothing to wake then.
                let _ = tx.send(());
            }
        });
        worker.set_onmessage(Some(on_message.as_ref().unchecked_ref()));
        Some(Clock {
            worker,
            next: Cell::new(0),
            waiting,
            _on_message: on_message,
        })
    }

    /// Ask the worker for a wake-up after `d`: the request's id and the receiver it wakes;
    /// `None` if the request could not be posted.
    fn arm(&self, d: Duration) -> Option<(u32, oneshot::Receiver<()>)> {
        let id = self.next.get();
        self.next.set(id.wrapping_add(1));
        let (tx, rx) = oneshot::channel();
        self.waiting.borrow_mut().insert(id, tx);
        let msg = js_sys::Array::of2(&id.into(), &(d.as_secs_f64() * 1000.0).into());
        if self.worker.post_message(&msg).is_err() {
            self.waiting.borrow_mut().remove(&id);
            return None;
        }
        Some((id, rx))
    }

    /// Forget a request whose sleeper woke by the page's timer first.
    fn disarm(&self, id: u32) {
        self.waiting.borrow_mut().remove(&id);
    }
}

impl Drop for Clock {
    fn drop(&mut self) {
        self.worker.set_onmessage(None);
        self.worker.terminate();
    }
}

thread_local! {
    static CLOCK: Option<Clock> = Clock::start();
}

/// Sleep for `d`: until the worker's clock or the page's timer fires, whichever is first. A hidden
/// tab wakes on the worker's time; a visible one never waits longer than its own timer, even if
/// the worker's answer is late or lost (a worker that failed to start, a busy worker thread).
pub async fn sleep(d: Duration) {
    let timer = futures_timer::Delay::new(d);
    let Some((id, rx)) = CLOCK.with(|c| c.as_ref().and_then(|c| c.arm(d))) else {
        return timer.await;
    };
    // A dropped sender (the clock went away) is not a wake-up: then the timer decides.
    let worker = async {
        if rx.await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    futures::pin_mut!(worker);
    if let futures::future::Either::Right(_) = futures::future::select(worker, timer).await {
        CLOCK.with(|c| {
            if let Some(c) = c {
                c.disarm(id);
            }
        });
    }
}

/// Whether sleeps run on the worker's clock (false: the page's timers, which a hidden tab
/// stretches).
pub fn unthrottled() -> bool {
    CLOCK.with(Option::is_some)
}
