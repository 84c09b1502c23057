//! The browser's [`Transport`]: a WebSocket to the relay, plus a direct path to each peer where one
//! connects: a BroadcastChannel to a tab open in the same browser, or a WebRTC data channel
//! signaled through the relay. [`Links`] says which to try ([`Links::Auto`], the default: the
//! BroadcastChannel, then WebRTC). Each peer is reached over one [`LinkKind`]: the direct path that
//! connected, else the relay (per pair, decided once after the room is full). Incoming frames from
//! any path land in the one [`Mailbox`].
//!
//! A BroadcastChannel reaches only pages of the same origin in the same browser profile: no
//! network at all between them. Each pair of ranks uses its own channel, named after the room, its
//! token and the pair; the two tabs find each other with a short hello exchange on it (a tab in
//! another browser, or a native worker, never answers: that pair tries the next path). The
//! exchange runs on message events, not timers, so it completes at once in background tabs too
//! (browsers slow their timers). A tab always listens on its pair channels, so a pair that decided
//! differently at the time limit still delivers; each direction keeps one route for the whole
//! session.
//!
//! Where the page names a port hub ([`WebJoin::port_hub`], the SharedWorker `www/port-hub.js`),
//! two tabs that found each other on their BroadcastChannel then ask the hub for a MessageChannel
//! and send their data on its ports ([`LinkKind::Port`]): a pipe between the two tabs, where a
//! BroadcastChannel message goes through the browser's broadcast of the channel name (Chromium on
//! the 2-core VM, 4 tabs, bare JavaScript: a round trip 0.10-0.15 ms against 0.25-0.6 ms, every
//! tab 4 bytes to every other 0.5-0.9 ms against 0.9-2.1 ms; the room benchmark: a 4-byte
//! all_reduce forward + backward in 0.5-0.86x the time, medians 0.53x and 0.80x over two series,
//! 1 MiB in 0.6x). A tab listens on every port the hub hands it, so a pair whose other side gave up
//! waiting still delivers; a tab whose port does not come in time keeps the BroadcastChannel. The
//! pair's name at the hub carries both tabs' session ids (sent in their hellos): a request an
//! earlier session of the same room left at the hub never matches.
//!
//! Frames are the relay's wire format ([`crate::wire`]) on every path; over WebRTC a frame is at
//! most 256 KiB (Chromium's data-channel message limit), and its source rank is the channel's peer,
//! whatever the header says. Sends wait while the browser's send buffer is above a high-water mark,
//! so a large tensor does not pile up in memory or overflow a data channel.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::channel::{mpsc, oneshot};
use js_sys::{ArrayBuffer, Reflect, Uint8Array};
use wasm_bindgen::JsCast;
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::{JsFuture, spawn_local};
use web_sys::{
    BinaryType, BroadcastChannel, MessageEvent, MessagePort, RtcConfiguration, RtcDataChannel,
    RtcDataChannelInit, RtcDataChannelState, RtcDataChannelType, RtcIceGatheringState,
    RtcPeerConnection, RtcSdpType, RtcSessionDescriptionInit, SharedWorker, WebSocket,
};

// Polls, link setup and grace periods sleep on a clock a hidden tab does not stretch.
use super::clock::sleep;
use super::session::{self, Event, JoinRequest, Linked, Session};
use super::{Mailbox, Tag, Transport};
use crate::error::{Error, Result};
use crate::wire::{
    Control, HEADER_LEN, Header, LEFT_CLEANLY, MIN_FRAME_PAYLOAD, Reassembler, fragments,
};

/// Largest WebRTC data-channel message Chromium accepts (`sctp.maxMessageSize`).
pub const RTC_MAX_MESSAGE: usize = 256 * 1024;
/// Largest frame payload sent through the relay (its default frame limit; a relay whose welcome
/// names a lower one gets that).
pub const RELAY_MAX_PAYLOAD: usize = crate::wire::DEFAULT_FRAME_PAYLOAD;
/// Largest frame payload posted on a BroadcastChannel (no browser limit; bounds each copy).
pub const CHANNEL_MAX_PAYLOAD: usize = 4 << 20;
const WS_HIGH_WATER: u32 = 8 << 20;
/// A tab's goodbye on a link (a data channel's text message, a BroadcastChannel string), sent by
/// [`BrowserTransport::close`] after its last data there.
const BYE: &str = "bye";
/// How long a linked peer's data may still arrive after the relay says it left cleanly without
/// its goodbye on the link (a tab closed before it could say it).
const LINK_END_GRACE: Duration = Duration::from_secs(2);
const RTC_HIGH_WATER: u32 = 2 << 20;
/// The port hub's script, beside the web app's page (www/port-hub.js).
pub const PORT_HUB: &str = "port-hub.js";
/// How long a tab waits for the port hub to hand it a pair's MessagePort once both tabs heard
/// each other (milliseconds when both ask; the other may have given up on the pair).
const PORT_WAIT: Duration = Duration::from_secs(2);

/// How a peer is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkKind {
    /// Through the relay's WebSocket.
    Relay,
    /// A direct WebRTC data channel.
    WebRtc,
    /// A BroadcastChannel between two tabs of the same browser.
    Channel,
    /// A MessageChannel between two tabs of the same browser, handed out by the port hub.
    Port,
}

impl LinkKind {
    /// "relay", "webrtc", "channel" or "port".
    pub fn name(self) -> &'static str {
        match self {
            LinkKind::Relay => "relay",
            LinkKind::WebRtc => "webrtc",
            LinkKind::Channel => "channel",
            LinkKind::Port => "port",
        }
    }
}

/// Which direct path a tab tries to each peer before the relay (`net=` in the page's URL).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Links {
    /// Where the peer is a tab of this browser, a BroadcastChannel (and then, with a port hub, a
    /// MessageChannel), else a WebRTC data channel, else the relay.
    #[default]
    Auto,
    /// A WebRTC data channel (tabs in any browsers), else the relay.
    WebRtc,
    /// Tabs of this browser only: a BroadcastChannel (and then, with a port hub, a
    /// MessageChannel), else the relay.
    Channel,
    /// No direct path: all data through the relay.
    Relay,
}

impl Links {
    /// Every choice, the default first.
    pub const ALL: [Links; 4] = [Links::Auto, Links::WebRtc, Links::Channel, Links::Relay];

    /// "auto", "webrtc", "channel" or "relay" (the page's `net=` values).
    pub fn name(self) -> &'static str {
        match self {
            Links::Auto => "auto",
            Links::WebRtc => "webrtc",
            Links::Channel => "channel",
            Links::Relay => "relay",
        }
    }

    /// The choice [`Links::name`] calls `name`.
    pub fn from_name(name: &str) -> Option<Links> {
        Links::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// What the page is told about the network.
#[derive(Debug, Clone)]
pub enum NetEvent {
    /// This tab joined: its rank and the room token (the room may not be full yet).
    Joined {
        /// This tab's rank.
        rank: usize,
        /// The room token, for share links.
        token: String,
    },
    /// Ranks present in the room now.
    Members(Vec<u32>),
    /// A rank left (`reason` = [`LEFT_CLEANLY`] for a clean close) or was lost.
    PeerLeft {
        /// Its rank.
        rank: u32,
        /// Why.
        reason: String,
    },
    /// How a peer is reached, decided after the room filled; `detail` says why a pair fell back.
    Link {
        /// The peer.
        peer: usize,
        /// The path.
        kind: LinkKind,
        /// Empty, or why no direct path was used.
        detail: String,
    },
    /// The connection to the relay closed, or a fault stopped this transport.
    Closed(String),
}

/// How to join a room from a page.
#[derive(Debug, Clone)]
pub struct WebJoin {
    /// Relay WebSocket URL (`ws://host/ws`).
    pub url: String,
    /// Room name.
    pub room: String,
    /// Room token (required to join an existing room).
    pub token: Option<String>,
    /// World size.
    pub world: u32,
    /// Wanted rank, or any free one.
    pub rank: Option<u32>,
    /// The direct path to try to every peer, falling back to the relay per pair.
    pub links: Links,
    /// How long to wait for the room to fill.
    pub ready_timeout: Duration,
    /// How long to wait for a data channel to open, or (with [`Links::Channel`]) for the peer to
    /// answer on the pair's BroadcastChannel, before that pair falls back to the relay.
    pub rtc_timeout: Duration,
    /// With [`Links::Auto`]: how long to wait for an answer on the pair's BroadcastChannel before
    /// trying WebRTC (a tab of this browser answers within milliseconds of joining).
    pub channel_probe: Duration,
    /// Largest message to reassemble; a peer sending more is a protocol fault.
    pub max_message: usize,
    /// Longest wait for a full send buffer (the relay's WebSocket, a data channel) to take a
    /// message before the send fails: a frozen peer cannot hold a sender forever.
    pub send_timeout: Duration,
    /// URL of the port hub script (the web app ships it as [`PORT_HUB`]): a pair of tabs that
    /// found each other on a BroadcastChannel moves its data to a MessageChannel the hub hands
    /// both ([`LinkKind::Port`]). `None` (the default) or a browser without SharedWorker: the
    /// BroadcastChannel carries the data.
    pub port_hub: Option<String>,
}

impl WebJoin {
    /// Defaults: any rank, [`Links::Auto`], 10 min to fill (people open tabs by hand), 10 s per
    /// data channel, 2 s for a tab of this browser to answer.
    pub fn new(url: &str, room: &str, world: u32) -> Self {
        WebJoin {
            url: url.to_string(),
            room: room.to_string(),
            token: None,
            world,
            rank: None,
            links: Links::Auto,
            ready_timeout: Duration::from_secs(600),
            rtc_timeout: Duration::from_secs(10),
            channel_probe: Duration::from_secs(2),
            max_message: 1 << 30,
            send_timeout: Duration::from_secs(60),
            port_hub: None,
        }
    }
}

type Handler = Closure<dyn FnMut(JsValue)>;
/// Hears the transport's [`NetEvent`]s.
pub type Listener = Rc<dyn Fn(NetEvent)>;

struct Shared {
    world: usize,
    rank: Cell<Option<usize>>,
    mailbox: RefCell<Option<Arc<Mailbox>>>,
    parts: RefCell<Reassembler>,
    /// The session with the relay: what each control message means.
    session: RefCell<Session>,
    /// What the join waits for: the room ready (`Ok`), or why joining failed.
    joining: mpsc::UnboundedSender<std::result::Result<(), String>>,
    signals: Vec<mpsc::UnboundedSender<serde_json::Value>>,
    listener: RefCell<Option<Listener>>,
    closed: RefCell<Option<String>>,
    /// Largest frame payload sent through the relay: [`RELAY_MAX_PAYLOAD`], or less where the
    /// relay's welcome says its limit is lower.
    relay_payload: Cell<usize>,
    /// The relay's STUN/TURN servers (`iceServers` JSON), if it named any.
    ice_servers: RefCell<Option<String>>,
    /// Peers whose data comes over a link of their own (a data channel, a BroadcastChannel, a
    /// MessagePort).
    linked: Linked,
    /// Peers that said goodbye on their link ([`BYE`]): everything they sent has arrived.
    ended: Vec<Cell<bool>>,
}

impl Shared {
    /// `peer` said goodbye on its link, after its last data there: receives from it that find
    /// nothing fail from now on.
    fn link_ended(&self, peer: usize) {
        if let Some(e) = self.ended.get(peer) {
            e.set(true);
        }
        if let Some(mb) = self.mailbox.borrow().as_ref() {
            mb.peer_gone(peer);
        }
    }

    fn emit(&self, e: NetEvent) {
        let l = self.listener.borrow().clone();
        if let Some(l) = l {
            l(e);
        }
    }

    fn fail(&self, reason: &str) {
        if self.closed.borrow().is_some() {
            return;
        }
        *self.closed.borrow_mut() = Some(reason.to_string());
        if let Some(mb) = self.mailbox.borrow().as_ref() {
            mb.abort_local(reason);
        }
        let _ = self.joining.unbounded_send(Err(reason.to_string()));
        self.emit(NetEvent::Closed(reason.to_string()));
    }

    /// A data frame from the relay (`peer` None: the header's stamped source) or a data channel.
    fn on_frame(&self, frame: Bytes, peer: Option<usize>) {
        let h = match Header::decode(&frame) {
            Ok(h) => h,
            Err(e) => return self.fail(&format!("bad frame: {e}")),
        };
        let src = peer.map_or(h.src, |p| p as u32);
        if src as usize >= self.world {
            return self.fail(&format!("frame from rank {src} outside the world"));
        }
        let whole = self
            .parts
            .borrow_mut()
            .push(src, &h, frame.slice(HEADER_LEN..));
        match whole {
            Err(e) => self.fail(&e),
            Ok(None) => {}
            Ok(Some(msg)) => match self.mailbox.borrow().as_ref() {
                Some(mb) => mb.deliver(src as usize, h.tag, msg),
                None => self.fail("data frame before the room was joined"),
            },
        }
    }

    fn on_control(&self, text: &str) {
        let event = self.session.borrow_mut().on_text(text);
        match event {
            Err(why) => self.fail(&why.to_string()),
            Ok(Event::Welcome(w)) => {
                self.rank.set(Some(w.rank as usize));
                *self.ice_servers.borrow_mut() = w.ice_servers.as_ref().map(|v| v.to_string());
                if let Some(m) = w.max_frame {
                    self.relay_payload
                        .set(m.clamp(MIN_FRAME_PAYLOAD, RELAY_MAX_PAYLOAD));
                }
                *self.mailbox.borrow_mut() =
                    Some(Arc::new(Mailbox::new(w.rank as usize, self.world)));
                self.emit(NetEvent::Joined {
                    rank: w.rank as usize,
                    token: w.token,
                });
                self.emit(NetEvent::Members(w.members));
            }
            Ok(Event::Members(members)) => self.emit(NetEvent::Members(members)),
            Ok(Event::Ready {
                members,
                ice_servers,
                ..
            }) => {
                // This member's STUN/TURN servers (a TURN credential of its own, expiring).
                if let Some(v) = ice_servers {
                    *self.ice_servers.borrow_mut() = Some(v.to_string());
                }
                self.emit(NetEvent::Members(members));
                let _ = self.joining.unbounded_send(Ok(()));
            }
            Ok(Event::PeerLeft { rank, reason }) => self.peer_left(rank, reason),
            // A peer's abort, ahead of whatever its data path still holds (a native member
            // sends it on its WebSocket).
            Ok(Event::PeerAborted { from, reason }) => {
                if let (Some(mb), Some(me)) = (self.mailbox.borrow().as_ref(), self.rank.get()) {
                    session::peer_aborted(mb, me, self.world, from, reason);
                }
            }
            Ok(Event::Signal { from, data }) => {
                if let Some(tx) = self.signals.get(from as usize) {
                    let _ = tx.unbounded_send(data);
                }
            }
        }
    }

    /// The relay says `rank` left ([`session::peer_left`]); a linked peer that went without its
    /// goodbye gets a grace period.
    fn peer_left(&self, rank: u32, reason: String) {
        if let Some(mb) = self.mailbox.borrow().as_ref() {
            session::peer_left(mb, &self.linked, rank, &reason);
            let r = rank as usize;
            if reason == LEFT_CLEANLY
                && self.linked.get(r)
                && !self.ended.get(r).is_some_and(Cell::get)
            {
                // A linked peer's goodbye comes on its link, after its data. A tab that went
                // without one (closed before it could say it): its link has ended too, so give
                // data still on the way a moment, then stop waiting.
                let mb = mb.clone();
                spawn_local(async move {
                    sleep(LINK_END_GRACE).await;
                    mb.peer_gone(r);
                });
            }
        }
        self.emit(NetEvent::PeerLeft { rank, reason });
    }
}

/// A peer's direct path.
#[derive(Clone)]
enum Link {
    Rtc(RtcDataChannel),
    Channel(BroadcastChannel),
    Port(MessagePort),
}

impl Link {
    fn kind(&self) -> LinkKind {
        match self {
            Link::Rtc(_) => LinkKind::WebRtc,
            Link::Channel(_) => LinkKind::Channel,
            Link::Port(_) => LinkKind::Port,
        }
    }
}

/// This browser's port hub (a SharedWorker): hands two tabs that ask for the same pair one end
/// each of a new MessageChannel.
struct Hub {
    worker: SharedWorker,
    port: MessagePort,
    state: Rc<HubState>,
    _on_message: Handler,
    _on_error: Handler,
}

/// A pair asked of the port hub: the peer, and where its port goes while the request waits.
type Asked = (usize, Option<oneshot::Sender<MessagePort>>);

#[derive(Default)]
struct HubState {
    /// Per pair name asked for: the peer, and where its port goes while the request waits.
    asked: RefCell<std::collections::HashMap<String, Asked>>,
    /// Every port the hub handed over, with its handler: each is listened to, whether or not its
    /// request still waited.
    ports: RefCell<Vec<(MessagePort, Handler)>>,
    /// Set when the hub's script failed (not found, not JavaScript): no port will come.
    failed: Cell<bool>,
}

impl Hub {
    /// Connect to the hub at `url`; frames arriving on the ports it hands over go to `shared`.
    fn start(url: &str, shared: Rc<Shared>) -> std::result::Result<Hub, String> {
        let worker =
            SharedWorker::new(url).map_err(|v| format!("SharedWorker {url}: {}", js_err("", v)))?;
        let port = worker.port();
        let state = Rc::new(HubState::default());
        let st = state.clone();
        let on_message: Handler = Closure::new(move |ev: JsValue| {
            let ev: MessageEvent = ev.unchecked_into();
            let pair = Reflect::get(&ev.data(), &JsValue::from_str("pair"))
                .ok()
                .and_then(|v| v.as_string());
            let Some(p) = ev.ports().get(0).dyn_into::<MessagePort>().ok() else {
                return;
            };
            let asked = pair.and_then(|pair| {
                let mut asked = st.asked.borrow_mut();
                asked.get_mut(&pair).map(|(peer, w)| (*peer, w.take()))
            });
            let Some((peer, waiter)) = asked else {
                // Not a pair of this tab's: nothing will ever read it.
                return p.close();
            };
            let on_data = link_handler(shared.clone(), peer);
            p.set_onmessage(Some(on_data.as_ref().unchecked_ref()));
            st.ports.borrow_mut().push((p.clone(), on_data));
            if let Some(tx) = waiter {
                // The requester may have given up: the port is listened to all the same.
                let _ = tx.send(p);
            }
        });
        port.set_onmessage(Some(on_message.as_ref().unchecked_ref()));
        // A script that cannot load fails every request at once instead of after PORT_WAIT.
        let st = state.clone();
        let on_error: Handler = Closure::new(move |_| {
            st.failed.set(true);
            for (_, waiter) in st.asked.borrow_mut().values_mut() {
                waiter.take();
            }
        });
        worker.set_onerror(Some(on_error.as_ref().unchecked_ref()));
        Ok(Hub {
            worker,
            port,
            state,
            _on_message: on_message,
            _on_error: on_error,
        })
    }

    /// Ask for the MessagePort of `pair` (this tab being `rank`, the other `peer`); it comes once
    /// the other tab asks too, or not within `limit`.
    async fn pair(
        &self,
        pair: &str,
        rank: usize,
        peer: usize,
        limit: Duration,
    ) -> std::result::Result<MessagePort, String> {
        let failed = || "the port hub's script did not start".to_string();
        if self.state.failed.get() {
            return Err(failed());
        }
        let (tx, rx) = oneshot::channel();
        self.state
            .asked
            .borrow_mut()
            .insert(pair.to_string(), (peer, Some(tx)));
        let msg = js_sys::Object::new();
        let set = |k: &str, v: JsValue| Reflect::set(&msg, &JsValue::from_str(k), &v);
        set("pair", JsValue::from_str(pair))
            .and_then(|_| set("rank", JsValue::from(rank as u32)))
            .and_then(|_| self.port.post_message(&msg))
            .map_err(|v| format!("port hub: {}", js_err("", v)))?;
        match within(limit, rx).await {
            Some(Ok(p)) => Ok(p),
            Some(Err(_)) => Err(failed()),
            None => Err(format!("no MessagePort from the port hub within {limit:?}")),
        }
    }

    /// Stop listening and close every port.
    fn close(&self) {
        self.worker.set_onerror(None);
        self.port.set_onmessage(None);
        self.port.close();
        for (p, _) in self.state.ports.borrow().iter() {
            p.set_onmessage(None);
            p.close();
        }
    }
}

/// One browser tab's connection to its room: see the module docs.
pub struct BrowserTransport {
    shared: Rc<Shared>,
    rank: usize,
    world: usize,
    token: String,
    ws: WebSocket,
    send_timeout: Duration,
    links: RefCell<Vec<Option<Link>>>,
    /// Every pair channel opened (also those whose hello went unanswered: still listened to).
    channels: RefCell<Vec<BroadcastChannel>>,
    /// Per peer: the WebRTC connection tried to it, if any.
    peers: RefCell<Vec<Option<RtcPeerConnection>>>,
    handlers: RefCell<Vec<Handler>>,
    /// The port hub, where the page names one and the browser has SharedWorker.
    hub: Option<Hub>,
    /// This tab's session: random, new at every join, sent in its BroadcastChannel hellos.
    session: String,
}

fn js_err(what: &str, e: JsValue) -> Error {
    Error::Relay {
        detail: format!(
            "{what}: {}",
            e.as_string()
                .or_else(|| js_sys::JSON::stringify(&e).ok().map(String::from))
                .unwrap_or_else(|| "unknown JavaScript error".into())
        ),
    }
}

fn bytes_of(data: &JsValue) -> Option<Bytes> {
    data.dyn_ref::<ArrayBuffer>()
        .map(|b| Bytes::from(Uint8Array::new(b).to_vec()))
}

/// The message handler of a link to `peer` that carries only its frames and its goodbye (a data
/// channel, a MessagePort).
fn link_handler(shared: Rc<Shared>, peer: usize) -> Handler {
    Closure::new(move |ev: JsValue| {
        let ev: MessageEvent = ev.unchecked_into();
        let data = ev.data();
        if let Some(b) = bytes_of(&data) {
            shared.on_frame(b, Some(peer));
        } else if data.as_string().as_deref() == Some(BYE) {
            shared.link_ended(peer);
        }
    })
}

/// Post `hello` (a `hello:0:`) on `bc` every 50 ms while the peer has not been `heard`; returns
/// only when a post fails (why).
async fn hello_until_heard(bc: &BroadcastChannel, heard: &Cell<bool>, hello: &str) -> String {
    loop {
        if !heard.get()
            && let Err(v) = bc.post_message(&JsValue::from_str(hello))
        {
            return format!("BroadcastChannel post: {}", js_err("", v));
        }
        sleep(Duration::from_millis(50)).await;
    }
}

/// `fut` or, after `limit`, `None`.
async fn within<F: std::future::Future>(limit: Duration, fut: F) -> Option<F::Output> {
    let fut = std::pin::pin!(fut);
    // A timeout, on the page's timer: a hidden tab may take longer to notice, never less long.
    let timer = std::pin::pin!(futures_timer::Delay::new(limit));
    match futures::future::select(fut, timer).await {
        futures::future::Either::Left((v, _)) => Some(v),
        futures::future::Either::Right(_) => None,
    }
}

/// The WebSocket to the relay at `url`, its messages fed to `shared` (control messages to the
/// session, data frames to the mailbox), `join_text` sent once it opens; with the handlers that
/// must live as long as it.
fn open_socket(
    url: &str,
    shared: &Rc<Shared>,
    join_text: String,
) -> Result<(WebSocket, Vec<Handler>)> {
    let ws = WebSocket::new(url).map_err(|e| js_err(&format!("WebSocket {url}"), e))?;
    ws.set_binary_type(BinaryType::Arraybuffer);
    let s = shared.clone();
    let onmessage: Handler = Closure::new(move |ev: JsValue| {
        let ev: MessageEvent = ev.unchecked_into();
        let data = ev.data();
        if let Some(text) = data.as_string() {
            s.on_control(&text);
        } else if let Some(b) = bytes_of(&data) {
            s.on_frame(b, None);
        }
    });
    ws.set_onmessage(Some(onmessage.as_ref().unchecked_ref()));
    let s = shared.clone();
    let onclose: Handler = Closure::new(move |_| s.fail("the connection to the relay closed"));
    ws.set_onclose(Some(onclose.as_ref().unchecked_ref()));
    let s = shared.clone();
    let at = url.to_string();
    let onerror: Handler = Closure::new(move |_| {
        s.fail(&format!("cannot reach the relay at {at}"));
    });
    ws.set_onerror(Some(onerror.as_ref().unchecked_ref()));
    let ws2 = ws.clone();
    let onopen: Handler = Closure::new(move |_| {
        let _ = ws2.send_with_str(&join_text);
    });
    ws.set_onopen(Some(onopen.as_ref().unchecked_ref()));
    Ok((ws, vec![onmessage, onclose, onerror, onopen]))
}

impl BrowserTransport {
    /// Connect to the relay, join `opts.room`, wait until the room is full, then open the direct
    /// path `opts.links` asks for to every peer. `on_event` hears membership and link
    /// changes from the start (also while waiting for the room to fill).
    pub async fn join(opts: WebJoin, on_event: Listener) -> Result<BrowserTransport> {
        let world = opts.world as usize;
        let (jtx, mut jrx) = mpsc::unbounded();
        let mut signal_rx = Vec::with_capacity(world);
        let mut signal_tx = Vec::with_capacity(world);
        for _ in 0..world {
            let (t, r) = mpsc::unbounded();
            signal_tx.push(t);
            signal_rx.push(Some(r));
        }
        let session = Session::new(JoinRequest {
            room: opts.room.clone(),
            token: opts.token.clone(),
            world: opts.world,
            rank: opts.rank,
            stream: false,
        });
        let join_text = session.join_text();
        let shared = Rc::new(Shared {
            world,
            session: RefCell::new(session),
            rank: Cell::new(None),
            mailbox: RefCell::new(None),
            parts: RefCell::new(Reassembler::new(opts.max_message)),
            joining: jtx,
            signals: signal_tx,
            listener: RefCell::new(Some(on_event)),
            closed: RefCell::new(None),
            relay_payload: Cell::new(RELAY_MAX_PAYLOAD),
            ice_servers: RefCell::new(None),
            linked: Linked::new(world),
            ended: (0..world).map(|_| Cell::new(false)).collect(),
        });
        let (ws, handlers) = open_socket(&opts.url, &shared, join_text)?;
        let relay_err = |detail: String| Error::Relay { detail };
        let wait = async {
            match jrx.next().await {
                Some(r) => r.map_err(relay_err),
                None => Err(relay_err("the relay connection ended while joining".into())),
            }
        };
        match within(opts.ready_timeout, wait).await {
            Some(r) => r?,
            None => {
                ws.close().ok();
                return Err(shared.session.borrow().fill_timeout(opts.ready_timeout));
            }
        }
        let (rank, token) = match shared.session.borrow().welcome() {
            Some(w) => (w.rank as usize, w.token.clone()),
            None => return Err(relay_err("ready before welcome".into())),
        };
        // The port hub, where one is named and the browser can run it; without it, the pairs that
        // find each other keep their BroadcastChannel.
        let hub = match (&opts.port_hub, opts.links) {
            (Some(url), Links::Auto | Links::Channel) => Hub::start(url, shared.clone())
                .map_err(|why| {
                    web_sys::console::warn_1(
                        &format!("no port hub, BroadcastChannels carry the data: {why}").into(),
                    )
                })
                .ok(),
            _ => None,
        };
        let t = BrowserTransport {
            shared,
            rank,
            world,
            token,
            send_timeout: opts.send_timeout,
            ws,
            links: RefCell::new(vec![None; world]),
            channels: RefCell::new(Vec::new()),
            peers: RefCell::new(vec![None; world]),
            handlers: RefCell::new(handlers),
            hub,
            session: {
                let word = || (js_sys::Math::random() * 4_294_967_296.0) as u32;
                format!("{:08x}{:08x}", word(), word())
            },
        };
        let base = format!("distgrad/{}/{}", opts.room, t.token);
        let attempts = (0..world)
            .filter(|&p| p != rank)
            .map(|p| t.link_peer(&opts, &base, p, signal_rx[p].take()));
        futures::future::join_all(attempts).await;
        Ok(t)
    }

    /// Open the direct path to `peer` that `opts.links` asks for (a MessageChannel or
    /// BroadcastChannel to a tab of this browser, else a WebRTC data channel, signalled through
    /// `signals`), and say which it got and, where the relay carries the data, why.
    async fn link_peer(
        &self,
        opts: &WebJoin,
        base: &str,
        peer: usize,
        signals: Option<mpsc::UnboundedReceiver<serde_json::Value>>,
    ) {
        let channel = |limit| self.connect_channel(base, peer, limit);
        let r = match (opts.links, signals) {
            (Links::WebRtc, Some(rx)) => self
                .connect_peer(peer, rx, opts.rtc_timeout)
                .await
                .map(Link::Rtc),
            (Links::Channel, _) => channel(opts.rtc_timeout).await,
            (Links::Auto, Some(rx)) => match channel(opts.channel_probe).await {
                Ok(link) => Ok(link),
                Err(no_channel) => self
                    .connect_peer(peer, rx, opts.rtc_timeout)
                    .await
                    .map(Link::Rtc)
                    .map_err(|no_rtc| format!("{no_channel}; WebRTC: {no_rtc}")),
            },
            // Direct links off by choice: the relay is not a fallback, so no reason to show.
            _ => Err(String::new()),
        };
        let (kind, detail) = match r {
            Ok(link) => {
                let kind = link.kind();
                self.links.borrow_mut()[peer] = Some(link);
                self.shared.linked.set(peer);
                (kind, String::new())
            }
            Err(why) => (LinkKind::Relay, why),
        };
        self.shared.emit(NetEvent::Link { peer, kind, detail });
    }

    /// Open the BroadcastChannel of the pair (this rank, `peer`) and find out whether `peer` is on
    /// it (a tab of this browser). A channel delivers only to pages that have it open at the time,
    /// so each side posts `hello:0:ID` every 50 ms until it hears the other; whoever hears a
    /// `hello:0:` answers `hello:1:ID` at once (delivered: the sender has the channel open), and
    /// whoever hears a `hello:1:` and has not answered yet answers it too (ID: the tab's session,
    /// so the pair's name at the port hub is this session's). A side that has heard a `hello:1:`
    /// and sent one knows the link works both ways and that the peer will know it too. The answers
    /// run in the message handler, so in a background tab (timers slowed to one a second or less) the
    /// exchange still completes as soon as both tabs have the channel open. Frames arriving on the
    /// channel are delivered from the start, whatever is decided. With a port hub, a pair that
    /// found each other then asks it for a MessageChannel and sends on its port
    /// ([`LinkKind::Port`]); without one, or when the port does not come, on the channel.
    async fn connect_channel(
        &self,
        base: &str,
        peer: usize,
        limit: Duration,
    ) -> std::result::Result<Link, String> {
        let (lo, hi) = (self.rank.min(peer), self.rank.max(peer));
        let name = format!("{base}/{lo}-{hi}");
        let bc = BroadcastChannel::new(&name)
            .map_err(|v| format!("BroadcastChannel: {}", js_err("", v)))?;
        self.channels.borrow_mut().push(bc.clone());
        let heard = Rc::new(Cell::new(false));
        let (done_tx, done_rx) = futures::channel::oneshot::channel::<()>();
        let mut done_tx = Some(done_tx);
        let (confirmed, answered) = (Cell::new(false), Cell::new(false));
        let s = self.shared.clone();
        let (h, answer) = (heard.clone(), bc.clone());
        let theirs: Rc<RefCell<String>> = Rc::default();
        let their_id = theirs.clone();
        let reply = JsValue::from_str(&format!("hello:1:{}", self.session));
        let onmessage: Handler = Closure::new(move |ev: JsValue| {
            let ev: MessageEvent = ev.unchecked_into();
            let data = ev.data();
            if let Some(b) = bytes_of(&data) {
                return s.on_frame(b, Some(peer));
            }
            let Some(text) = data.as_string() else { return };
            if text == BYE {
                return s.link_ended(peer);
            }
            let (first, id) = match (text.strip_prefix("hello:0:"), text.strip_prefix("hello:1:")) {
                (Some(id), _) => (true, id),
                (None, Some(id)) => (false, id),
                (None, None) => return,
            };
            if !first {
                confirmed.set(true);
            }
            *their_id.borrow_mut() = id.to_string();
            h.set(true);
            if first || !answered.get() {
                let _ = answer.post_message(&reply);
                answered.set(true);
            }
            if confirmed.get()
                && answered.get()
                && let Some(tx) = done_tx.take()
            {
                let _ = tx.send(());
            }
        });
        bc.set_onmessage(Some(onmessage.as_ref().unchecked_ref()));
        self.handlers.borrow_mut().push(onmessage);
        let call = async {
            let hello = format!("hello:0:{}", self.session);
            let repeat = std::pin::pin!(hello_until_heard(&bc, &heard, &hello));
            match futures::future::select(done_rx, repeat).await {
                futures::future::Either::Left((Ok(()), _)) => Ok(()),
                futures::future::Either::Left((Err(_), _)) => {
                    Err("the BroadcastChannel's handler was dropped".to_string())
                }
                futures::future::Either::Right((why, _)) => Err(why),
            }
        };
        match within(limit, call).await {
            Some(Ok(())) => match &self.hub {
                None => Ok(Link::Channel(bc)),
                Some(hub) => {
                    // Named after both tabs' sessions: a request left at the hub by an earlier
                    // session of this room (same link, same names) never matches this one.
                    let theirs = theirs.borrow().clone();
                    let ids = if self.rank < peer {
                        format!("{}-{theirs}", self.session)
                    } else {
                        format!("{theirs}-{}", self.session)
                    };
                    self.port_of(hub, &format!("{name}/{ids}"), peer, bc).await
                }
            },
            Some(Err(why)) => Err(why),
            None => Err(format!(
                "not in this browser (no answer on a BroadcastChannel within {limit:?})"
            )),
        }
    }

    /// The MessagePort of hub pair `pair` to `peer` as the link, else (no port in time) `bc`.
    async fn port_of(
        &self,
        hub: &Hub,
        pair: &str,
        peer: usize,
        bc: BroadcastChannel,
    ) -> std::result::Result<Link, String> {
        match hub.pair(pair, self.rank, peer, PORT_WAIT).await {
            Ok(port) => Ok(Link::Port(port)),
            Err(why) => {
                web_sys::console::warn_1(
                    &format!("rank {peer} stays on the BroadcastChannel: {why}").into(),
                );
                Ok(Link::Channel(bc))
            }
        }
    }

    /// Open a negotiated data channel to `peer`: the lower rank offers, the higher answers; the SDP
    /// is sent whole after ICE gathering (no trickle), through the relay.
    async fn connect_peer(
        &self,
        peer: usize,
        mut signals: mpsc::UnboundedReceiver<serde_json::Value>,
        limit: Duration,
    ) -> std::result::Result<RtcDataChannel, String> {
        let e = |what: &str, v: JsValue| format!("{what}: {}", js_err("", v));
        let cfg = RtcConfiguration::new();
        // The relay operator's STUN/TURN servers, else none (host candidates: one network).
        let servers = self
            .shared
            .ice_servers
            .borrow()
            .as_deref()
            .and_then(|t| js_sys::JSON::parse(t).ok())
            .and_then(|v| v.dyn_into::<js_sys::Array>().ok())
            .unwrap_or_default();
        cfg.set_ice_servers(&servers);
        let pc = RtcPeerConnection::new_with_configuration(&cfg)
            .map_err(|v| e("RTCPeerConnection", v))?;
        if let Some(slot) = self.peers.borrow_mut().get_mut(peer) {
            *slot = Some(pc.clone());
        }
        let init = RtcDataChannelInit::new();
        init.set_negotiated(true);
        init.set_id(0);
        init.set_ordered(true);
        let dc = pc.create_data_channel_with_data_channel_dict("distgrad", &init);
        dc.set_binary_type(RtcDataChannelType::Arraybuffer);
        let onmessage = link_handler(self.shared.clone(), peer);
        dc.set_onmessage(Some(onmessage.as_ref().unchecked_ref()));
        let s = self.shared.clone();
        let opened = Rc::new(Cell::new(false));
        let was_open = opened.clone();
        let onclose: Handler = Closure::new(move |_| {
            // After a goodbye the channel's end is the expected one.
            if was_open.get()
                && !s.ended.get(peer).is_some_and(Cell::get)
                && let Some(mb) = s.mailbox.borrow().as_ref()
            {
                mb.peer_lost(peer, "its WebRTC data channel closed");
            }
        });
        dc.set_onclose(Some(onclose.as_ref().unchecked_ref()));
        self.handlers.borrow_mut().extend([onmessage, onclose]);

        let describe = |kind: RtcSdpType, sdp: &str| {
            let d = RtcSessionDescriptionInit::new(kind);
            d.set_sdp(sdp);
            d
        };
        let sdp_of = |v: &JsValue| {
            Reflect::get(v, &JsValue::from_str("sdp"))
                .ok()
                .and_then(|s| s.as_string())
                .unwrap_or_default()
        };
        let negotiate = async {
            let send_local = |kind: &str| -> std::result::Result<(), String> {
                let sdp = pc.local_description().map(|d| d.sdp()).unwrap_or_default();
                let msg = Control::Signal {
                    to: Some(peer as u32),
                    from: None,
                    data: serde_json::json!({ "kind": kind, "sdp": sdp }),
                };
                let text = serde_json::to_string(&msg).map_err(|x| x.to_string())?;
                self.ws
                    .send_with_str(&text)
                    .map_err(|v| e("sending the signal", v))
            };
            let gathered = async {
                while pc.ice_gathering_state() != RtcIceGatheringState::Complete {
                    sleep(Duration::from_millis(20)).await;
                }
            };
            let next_sdp = |want: &'static str, got: Option<serde_json::Value>| match got {
                Some(v) if v["kind"] == want => v["sdp"]
                    .as_str()
                    .map(str::to_string)
                    .ok_or_else(|| format!("{want} without sdp")),
                // A native worker announces its direct-link address instead: no WebRTC there.
                Some(v) if v["kind"] == "tcp" => {
                    Err("it is a native process (no WebRTC)".to_string())
                }
                Some(v) => Err(format!("expected an {want}, got {v}")),
                None => Err("signaling ended".to_string()),
            };
            if self.rank < peer {
                let offer = JsFuture::from(pc.create_offer())
                    .await
                    .map_err(|v| e("createOffer", v))?;
                JsFuture::from(
                    pc.set_local_description(&describe(RtcSdpType::Offer, &sdp_of(&offer))),
                )
                .await
                .map_err(|v| e("setLocalDescription", v))?;
                gathered.await;
                send_local("offer")?;
                let answer = next_sdp("answer", signals.next().await)?;
                JsFuture::from(pc.set_remote_description(&describe(RtcSdpType::Answer, &answer)))
                    .await
                    .map_err(|v| e("setRemoteDescription", v))?;
            } else {
                let offer = next_sdp("offer", signals.next().await)?;
                JsFuture::from(pc.set_remote_description(&describe(RtcSdpType::Offer, &offer)))
                    .await
                    .map_err(|v| e("setRemoteDescription", v))?;
                let answer = JsFuture::from(pc.create_answer())
                    .await
                    .map_err(|v| e("createAnswer", v))?;
                JsFuture::from(
                    pc.set_local_description(&describe(RtcSdpType::Answer, &sdp_of(&answer))),
                )
                .await
                .map_err(|v| e("setLocalDescription", v))?;
                gathered.await;
                send_local("answer")?;
            }
            while dc.ready_state() != RtcDataChannelState::Open {
                if matches!(
                    dc.ready_state(),
                    RtcDataChannelState::Closed | RtcDataChannelState::Closing
                ) {
                    return Err("the data channel closed while opening".to_string());
                }
                sleep(Duration::from_millis(10)).await;
            }
            Ok(())
        };
        match within(limit, negotiate).await {
            Some(Ok(())) => {
                opened.set(true);
                Ok(dc)
            }
            Some(Err(why)) => {
                pc.close();
                Err(why)
            }
            None => {
                pc.close();
                Err(format!("no WebRTC connection within {limit:?}"))
            }
        }
    }

    /// The room token (the share link carries it).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// How each rank is reached (`None` for this rank).
    pub fn links(&self) -> Vec<Option<LinkKind>> {
        let links = self.links.borrow();
        (0..self.world)
            .map(|p| {
                (p != self.rank).then(|| links[p].as_ref().map_or(LinkKind::Relay, Link::kind))
            })
            .collect()
    }

    /// Why this transport stopped, if it did.
    pub fn closed(&self) -> Option<String> {
        self.shared.closed.borrow().clone()
    }

    /// Leave the room cleanly: a goodbye on every link after the data already sent there (so
    /// each peer knows it has everything), then every connection closed. A data channel sends
    /// what it still holds before it closes; its peer connection is closed once that is out (or
    /// after the send timeout).
    pub fn close(&self) {
        let bye = JsValue::from_str(BYE);
        let mut draining = Vec::new();
        for (link, pc) in self.links.borrow().iter().zip(self.peers.borrow().iter()) {
            match link {
                Some(Link::Rtc(dc)) => {
                    if dc.ready_state() == RtcDataChannelState::Open {
                        let _ = dc.send_with_str(BYE);
                    }
                    dc.close();
                    if let Some(pc) = pc {
                        draining.push((dc.clone(), pc.clone()));
                    }
                }
                Some(Link::Channel(bc)) => {
                    let _ = bc.post_message(&bye);
                }
                Some(Link::Port(port)) => {
                    let _ = port.post_message(&bye);
                }
                None => {}
            }
        }
        for bc in self.channels.borrow().iter() {
            bc.close();
        }
        // Peer connections that carry no link of ours (attempts that fell back) close now.
        for pc in self.peers.borrow().iter().flatten() {
            if !draining.iter().any(|(_, p)| p == pc) {
                pc.close();
            }
        }
        let limit = self.send_timeout;
        if !draining.is_empty() {
            spawn_local(async move {
                let _ = within(limit, async {
                    while draining.iter().any(|(dc, _)| dc.buffered_amount() > 0) {
                        sleep(Duration::from_millis(5)).await;
                    }
                })
                .await;
                for (_, pc) in draining {
                    pc.close();
                }
            });
        }
        let _ = self.ws.close();
    }

    fn transport_err(&self, detail: String) -> Error {
        Error::Transport {
            rank: self.rank,
            detail,
        }
    }

    async fn push_ws(&self, frame: &[u8]) -> Result<()> {
        let room = async {
            while self.ws.buffered_amount() > WS_HIGH_WATER {
                if self.ws.ready_state() != WebSocket::OPEN {
                    break;
                }
                sleep(Duration::from_millis(1)).await;
            }
        };
        // Most sends find room at once: no timer armed for those.
        if self.ws.buffered_amount() > WS_HIGH_WATER
            && within(self.send_timeout, room).await.is_none()
        {
            return Err(self.transport_err(format!(
                "the connection to the relay accepted nothing for {:?} (its send buffer stayed full)",
                self.send_timeout
            )));
        }
        if self.ws.ready_state() != WebSocket::OPEN {
            return Err(self.transport_err(
                self.closed()
                    .unwrap_or_else(|| "the connection to the relay is closed".into()),
            ));
        }
        self.ws
            .send_with_u8_array(frame)
            .map_err(|v| self.transport_err(js_err("WebSocket send", v).to_string()))
    }

    async fn push_rtc(&self, dc: &RtcDataChannel, dst: usize, frame: &[u8]) -> Result<()> {
        let room = async {
            while dc.buffered_amount() > RTC_HIGH_WATER
                && dc.ready_state() == RtcDataChannelState::Open
            {
                sleep(Duration::from_millis(1)).await;
            }
        };
        if dc.buffered_amount() > RTC_HIGH_WATER && within(self.send_timeout, room).await.is_none()
        {
            return Err(self.transport_err(format!(
                "the data channel to rank {dst} accepted nothing for {:?} (a frozen tab?)",
                self.send_timeout
            )));
        }
        if dc.ready_state() != RtcDataChannelState::Open {
            return Err(self.transport_err(format!("the data channel to rank {dst} is closed")));
        }
        dc.send_with_u8_array(frame)
            .map_err(|v| self.transport_err(js_err("data channel send", v).to_string()))
    }
}

impl Drop for BrowserTransport {
    fn drop(&mut self) {
        // Detach the handlers before they are freed, then close.
        self.ws.set_onmessage(None);
        self.ws.set_onclose(None);
        self.ws.set_onerror(None);
        self.ws.set_onopen(None);
        for link in self.links.borrow().iter().flatten() {
            if let Link::Rtc(dc) = link {
                dc.set_onmessage(None);
                dc.set_onclose(None);
            }
        }
        for bc in self.channels.borrow().iter() {
            bc.set_onmessage(None);
        }
        self.close();
        // After the goodbyes close() posted on them.
        if let Some(hub) = &self.hub {
            hub.close();
        }
    }
}

impl Transport for BrowserTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    async fn send(&self, dst: usize, tag: Tag, payload: Bytes) -> Result<()> {
        if dst >= self.world {
            return Err(self.transport_err(format!(
                "send to rank {dst} outside world of {}",
                self.world
            )));
        }
        let link = self.links.borrow().get(dst).cloned().flatten();
        let max = match link {
            Some(Link::Rtc(_)) => RTC_MAX_MESSAGE - HEADER_LEN,
            Some(Link::Channel(_) | Link::Port(_)) => CHANNEL_MAX_PAYLOAD,
            None => self.shared.relay_payload.get(),
        };
        for frame in fragments(self.rank as u32, dst as u32, tag, &payload, max) {
            match &link {
                Some(Link::Rtc(dc)) => self.push_rtc(dc, dst, &frame).await?,
                Some(Link::Channel(bc)) => {
                    // Posted as an ArrayBuffer (the receiver gets a copy).
                    let buf = Uint8Array::from(&frame[..]).buffer();
                    bc.post_message(&buf).map_err(|v| {
                        self.transport_err(js_err("BroadcastChannel post", v).to_string())
                    })?;
                }
                Some(Link::Port(port)) => {
                    // Transferred: the sender keeps no copy of it.
                    let buf = Uint8Array::from(&frame[..]).buffer();
                    port.post_message_with_transferable(&buf, &js_sys::Array::of1(&buf))
                        .map_err(|v| {
                            self.transport_err(js_err("MessagePort post", v).to_string())
                        })?;
                }
                None => self.push_ws(&frame).await?,
            }
        }
        Ok(())
    }

    async fn recv(&self, src: usize, tag: Tag) -> Result<Bytes> {
        if src >= self.world {
            return Err(self.transport_err(format!(
                "recv from rank {src} outside world of {}",
                self.world
            )));
        }
        let mb = self.shared.mailbox.borrow().clone();
        match mb {
            Some(mb) => mb.recv(src, tag).await,
            None => Err(self.transport_err("not joined".into())),
        }
    }

    async fn abort(&self, reason: &str) {
        let mb = self.shared.mailbox.borrow().clone();
        session::abort_all(self, mb.as_deref(), reason).await;
    }
}
