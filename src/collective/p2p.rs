//! [`P2p`]: every collective built from a [`Transport`]'s point-to-point messages.
//!
//! A call runs in three steps: `P2p::begin` numbers it in its group (its [`CallSig`] goes to the
//! ring successor with the call's first message); the algorithm exchanges data through
//! `Call::send` / `Call::recv`, which check signatures before any byte is used and bound every
//! wait by the timeout; `P2p::finish` waits for the predecessor's signature if it has not come yet
//! (unless the algorithm checks elsewhere: the star's ranks check only the root's). Every
//! collective runs inside `guarded`, which on any error (bad argument included) aborts the
//! transport once, so that every other rank fails too (never a hang, never garbage).
//!
//! The call itself, its messages and their signature checks are [`super::call`]'s.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use bytes::{Buf, BufMut, BytesMut};

use super::call::{Call, decode_tensor, encode_tensor_async, with_timeout};
use super::events::{Action, Algorithm, CallRecord, Recorder};
use super::sig::{CallSig, Kind};
use super::{Communicator, Group, ReduceOp, Spec, direct, list_shape, ring, tree};
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::transport::{Channel, Tag, Transport};

/// How large all_reduces (at least [`CommOptions::ring_threshold`] bytes per rank) move data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllReduceAlgo {
    /// [`AllReduceAlgo::Shared`] when the transport shares memory between ranks
    /// ([`Transport::shares_memory`]: the in-process one), [`AllReduceAlgo::Ring`] otherwise.
    Auto,
    /// Ring: reduce-scatter then all-gather, `2(n-1)` steps, each rank talking only to its two
    /// neighbours, in segments of [`CommOptions::segment_bytes`]. Best where every step crosses
    /// a network link of its own.
    Ring,
    /// Pairwise: each rank owns one chunk, receives that chunk from every rank, reduces all `n`
    /// contributions in one pass, and sends the result to every rank: 2 rounds, the same bytes
    /// per rank as the ring, about half its passes over memory.
    Pairwise,
    /// Pairwise reduction, then group rank 0 assembles the finished chunks once and every rank's
    /// result shares that one buffer. Sends cost nothing only where ranks share memory; over a
    /// network rank 0 would send the whole result to everyone.
    Shared,
}

impl AllReduceAlgo {
    /// Every variant, `Auto` first.
    pub const ALL: [AllReduceAlgo; 4] = [
        AllReduceAlgo::Auto,
        AllReduceAlgo::Ring,
        AllReduceAlgo::Pairwise,
        AllReduceAlgo::Shared,
    ];

    /// Lower-case name (`auto`, `ring`, `pairwise`, `shared`).
    pub fn name(self) -> &'static str {
        match self {
            AllReduceAlgo::Auto => "auto",
            AllReduceAlgo::Ring => "ring",
            AllReduceAlgo::Pairwise => "pairwise",
            AllReduceAlgo::Shared => "shared",
        }
    }

    /// Parse a [`AllReduceAlgo::name`].
    pub fn parse(s: &str) -> Result<Self> {
        AllReduceAlgo::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| {
                Error::Input(format!(
                    "unknown all_reduce algorithm {s:?} (auto, ring, pairwise, shared)"
                ))
            })
    }
}

/// How small all_reduces (below [`CommOptions::ring_threshold`] bytes per rank) move data, in
/// groups of three ranks or more (two ranks exchange: two messages either way, one round).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SmallAllReduce {
    /// Every rank sends its tensor to every other and folds all of them: one round, `n(n-1)`
    /// messages. Best where a message costs little next to a round (threads of one process, a
    /// network with its own link per pair).
    #[default]
    Exchange,
    /// Every rank sends its tensor to group rank 0, which folds them and sends the result back:
    /// two rounds, `2(n-1)` messages. Best where each message costs the sender and the receiver
    /// a fixed price (tabs of one browser, whose `postMessage` crosses processes). The root checks
    /// every rank's call and every rank the root's.
    Star,
}

impl SmallAllReduce {
    /// Both variants, the default first.
    pub const ALL: [SmallAllReduce; 2] = [SmallAllReduce::Exchange, SmallAllReduce::Star];

    /// Lower-case name (`exchange`, `star`).
    pub fn name(self) -> &'static str {
        match self {
            SmallAllReduce::Exchange => "exchange",
            SmallAllReduce::Star => "star",
        }
    }

    /// Parse a [`SmallAllReduce::name`].
    pub fn parse(s: &str) -> Result<Self> {
        SmallAllReduce::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| {
                Error::Input(format!(
                    "unknown small all_reduce algorithm {s:?} (exchange, star)"
                ))
            })
    }
}

/// The route a call's data takes, written first into its signature ([`CallSig::extra`]): ranks
/// that would take different routes (configured differently, or disagreeing about the size) fail
/// with a mismatch naming both calls, not with a confusing byte count. The codes are the wire's:
/// never renumber one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// Every rank sends to every other (one round).
    Exchange,
    /// Around the ring (an all_reduce's segment size follows the code).
    Ring,
    /// Pairwise exchange of chunks.
    Pairwise,
    /// Pairwise exchange over memory the ranks share (in-process).
    Shared,
    /// Through group rank 0 and back.
    Star,
}

impl Route {
    /// The ring where it is chosen, else the exchange (all_gather, reduce_scatter).
    fn of(ring: bool) -> Route {
        if ring { Route::Ring } else { Route::Exchange }
    }

    /// The algorithm recorded for it.
    fn algorithm(self) -> Algorithm {
        match self {
            Route::Exchange => Algorithm::Exchange,
            Route::Ring => Algorithm::Ring,
            Route::Pairwise => Algorithm::Pairwise,
            Route::Shared => Algorithm::Shared,
            Route::Star => Algorithm::Star,
        }
    }

    /// The code in the signature.
    fn code(self) -> u64 {
        match self {
            Route::Exchange => 0,
            Route::Ring => 1,
            Route::Pairwise => 2,
            Route::Shared => 3,
            Route::Star => 4,
        }
    }
}

/// `algorithm` if a call can be made to take it, else why not.
fn choosable(algorithm: Algorithm) -> Result<Algorithm> {
    match algorithm {
        Algorithm::Ring
        | Algorithm::Pairwise
        | Algorithm::Shared
        | Algorithm::Exchange
        | Algorithm::Star => Ok(algorithm),
        Algorithm::Tree | Algorithm::Direct | Algorithm::PointToPoint => {
            Err(Error::Input(format!(
                "the {} algorithm is not chosen: the collectives that take it always do \
             (choose ring, pairwise, shared, exchange or star)",
                algorithm.name()
            )))
        }
    }
}

/// Tuning and safety knobs of a [`P2p`] communicator.
#[derive(Debug, Clone)]
pub struct CommOptions {
    /// Longest wait for any single message before the call fails with [`Error::Timeout`].
    pub timeout: Duration,
    /// Payloads (bytes per rank) below this use direct exchange instead of the ring.
    pub ring_threshold: usize,
    /// The algorithm of large all_reduces.
    pub all_reduce: AllReduceAlgo,
    /// The algorithm of small all_reduces. Every rank of a group must use the same: ranks
    /// configured differently fail with a mismatch naming both.
    pub small_all_reduce: SmallAllReduce,
    /// Large ring all_reduces run as successive ring passes over segments of `n *` this many
    /// bytes, so the chunks in flight stay in cache (in-process transport).
    pub segment_bytes: usize,
    /// Collectives in which a rank can finish without hearing from every other rank (broadcast,
    /// reduce, gather, scatter, permute), or whose arguments only the receiver can check
    /// (all_to_all_single's split sizes), end with a dissemination round (`ceil(log2 n)` empty
    /// messages), so that every rank learns of a mismatch before returning. Off: saves those rounds;
    /// a mismatch then fails the ranks that see it at once and the others at their next call.
    pub confirm: bool,
    /// Record every call's signature (see [`P2p::take_calls`]); used by `distgrad vjp` to show duals.
    pub record_calls: bool,
    /// Record what this rank does in every call: each message, local reduction and copy, with
    /// its round, chunk and time (see [`P2p::take_events`]). Off, calls record nothing.
    /// Changeable between calls ([`P2p::set_record_events`]).
    pub record_events: bool,
    /// The algorithm every all_reduce, all_gather and reduce_scatter takes whatever its size,
    /// where it can ([`CommOptions::with_algorithm`]); `None`: chosen by size and the options
    /// above. Changeable between calls ([`P2p::set_algorithm`]).
    pub algorithm: Option<Algorithm>,
    /// Where tensors that arrive without an input of this rank's to follow are placed: `recv`'s
    /// result and `scatter`'s on non-root ranks. Other outputs live on their inputs' device.
    pub device: Device,
    /// Reductions of GPU tensors (reduce, large all_reduce and reduce_scatter) fold what they
    /// receive into a partial result on the GPU, reading back only what they send. Off: such a
    /// reduction reads its input back once, runs on the host and uploads its result once (one
    /// readback instead of one per ring step: cheaper where each readback waits for the GPU
    /// queue, as in a browser, and where the host is as fast as the GPU, as on a software GPU).
    pub fold_on_device: bool,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            timeout: Duration::from_secs(60),
            ring_threshold: 64 * 1024,
            all_reduce: AllReduceAlgo::Auto,
            small_all_reduce: SmallAllReduce::Exchange,
            segment_bytes: 256 * 1024,
            confirm: true,
            record_calls: false,
            record_events: false,
            algorithm: None,
            device: Device::Cpu,
            fold_on_device: true,
        }
    }
}

impl CommOptions {
    /// Defaults for transports that cross sockets: large all_reduces use the ring, not split into
    /// cache-sized segments (every ring step costs a network round).
    pub fn for_network() -> Self {
        CommOptions {
            all_reduce: AllReduceAlgo::Ring,
            segment_bytes: 64 << 20,
            ..CommOptions::default()
        }
    }

    /// For runs that show what ran (`distgrad vjp`, lessons, the page): every call recorded
    /// ([`CommOptions::record_calls`], to name the duals), a 10 s timeout.
    pub fn recorded() -> Self {
        CommOptions {
            timeout: Duration::from_secs(10),
            record_calls: true,
            ..CommOptions::default()
        }
    }

    /// These options with every all_reduce, all_gather and reduce_scatter taking `algorithm`,
    /// whatever the size (where the collective has it: an all_reduce of fewer elements than
    /// ranks cannot take the ring or pairwise and takes the exchange; all_gather and
    /// reduce_scatter have the ring and the exchange): `ring`, `pairwise`, `shared`, `exchange`
    /// or `star`, so the teaching views can show each on small tensors. The others (the tree of
    /// rooted collectives, direct, point-to-point) are the collective's own and cannot be chosen.
    /// Every rank of a group must choose the same.
    pub fn with_algorithm(self, algorithm: Algorithm) -> Result<Self> {
        Ok(CommOptions {
            algorithm: Some(choosable(algorithm)?),
            ..self
        })
    }

    /// [`CommOptions::recorded`] for the ranks of a relay room, browser tabs and the native
    /// workers that join them alike (every rank of a group must choose the same algorithms):
    /// small all_reduces go through group rank 0 and back ([`SmallAllReduce::Star`]), where every
    /// message costs the sender and the receiver a fixed price (a tab's `postMessage`, a relay
    /// hop).
    pub fn room() -> Self {
        CommOptions {
            small_all_reduce: SmallAllReduce::Star,
            ..CommOptions::recorded()
        }
    }
}

/// A communicator over a point-to-point transport.
pub struct P2p<T: Transport> {
    transport: T,
    opts: CommOptions,
    next_group: Cell<u32>,
    seqs: RefCell<HashMap<u32, u64>>,
    p2p_seqs: RefCell<HashMap<(u32, usize, usize), u64>>,
    calls: RefCell<Vec<(u32, CallSig)>>,
    events: RefCell<Vec<CallRecord>>,
    aborted: Cell<bool>,
    /// [`CommOptions::small_all_reduce`], changeable between calls ([`P2p::set_small_all_reduce`]).
    small: Cell<SmallAllReduce>,
    /// [`CommOptions::record_events`], changeable ([`P2p::set_record_events`]).
    recording: Cell<bool>,
    /// [`CommOptions::algorithm`], changeable ([`P2p::set_algorithm`]).
    forced: Cell<Option<Algorithm>>,
}

impl<T: Transport> P2p<T> {
    /// Wrap a transport.
    pub fn new(transport: T, opts: CommOptions) -> Self {
        P2p {
            transport,
            next_group: Cell::new(1),
            seqs: RefCell::default(),
            p2p_seqs: RefCell::default(),
            calls: RefCell::default(),
            events: RefCell::default(),
            aborted: Cell::new(false),
            small: Cell::new(opts.small_all_reduce),
            recording: Cell::new(opts.record_events),
            forced: Cell::new(opts.algorithm),
            opts,
        }
    }

    /// The transport underneath.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// Give back the transport (e.g. to close it cleanly).
    pub fn into_transport(self) -> T {
        self.transport
    }

    /// The options this communicator was made with ([`P2p::small_all_reduce`] may differ since).
    pub fn options(&self) -> &CommOptions {
        &self.opts
    }

    /// The algorithm small all_reduces use now.
    pub fn small_all_reduce(&self) -> SmallAllReduce {
        self.small.get()
    }

    /// Change the algorithm of the small all_reduces that follow, e.g. to measure one against
    /// the other in the same run. Every rank of a group must change it before the same call.
    pub fn set_small_all_reduce(&self, algo: SmallAllReduce) {
        self.small.set(algo);
    }

    /// Record events from the next call on (or stop); returns whether it recorded before.
    pub fn set_record_events(&self, on: bool) -> bool {
        self.recording.replace(on)
    }

    /// The algorithm the calls that follow take where they have the choice
    /// ([`CommOptions::with_algorithm`]; `None`: by size). Every rank of a group must set the
    /// same before the same call.
    pub fn set_algorithm(&self, algorithm: Option<Algorithm>) -> Result<()> {
        self.forced.set(algorithm.map(choosable).transpose()?);
        Ok(())
    }

    /// The algorithm set by [`P2p::set_algorithm`] (or the options).
    pub fn algorithm(&self) -> Option<Algorithm> {
        self.forced.get()
    }

    /// Whether a call of `numel` elements per rank on `n` ranks goes around the ring (or, for
    /// an all_reduce, pairwise): the forced algorithm if any, else by size.
    fn large(&self, numel: usize, n: usize) -> bool {
        match self.forced.get() {
            Some(Algorithm::Ring | Algorithm::Pairwise | Algorithm::Shared) => n > 1,
            Some(_) => false,
            None => n > 1 && numel * 4 >= self.opts.ring_threshold,
        }
    }

    /// The calls made since the last `take_calls` as `(group id, signature)`, if recording is on.
    pub fn take_calls(&self) -> Vec<(u32, CallSig)> {
        std::mem::take(&mut self.calls.borrow_mut())
    }

    /// What this rank did in each call since the last `take_events`, in order, if recording is
    /// on ([`CommOptions::record_events`]); a call that failed keeps what it did until then.
    pub fn take_events(&self) -> Vec<CallRecord> {
        std::mem::take(&mut self.events.borrow_mut())
    }

    /// Start a collective on `group` whose data takes `algorithm`: number it (its signature goes
    /// to the ring successor with the call's first message).
    pub(crate) async fn begin<'a>(
        &'a self,
        group: &'a Group,
        sig: CallSig,
        algorithm: Algorithm,
    ) -> Result<Call<'a, T>> {
        let me = group.require_member(sig.kind.name())?;
        let seq = {
            let mut seqs = self.seqs.borrow_mut();
            let s = seqs.entry(group.id()).or_insert(0);
            *s += 1;
            *s - 1
        };
        if self.opts.record_calls {
            self.calls.borrow_mut().push((group.id(), sig.clone()));
        }
        // The signature goes to the successor with the call's first message (see `Call`).
        Ok(Call::new(
            &self.transport,
            self.opts.timeout,
            group,
            (me, seq),
            sig,
            self.recording.get().then_some(algorithm),
        ))
    }

    /// End a call: on success make sure the predecessor's signature was checked (where the call
    /// checks it: see `Call::star`); keep its record.
    pub(crate) async fn finish<R>(&self, mut call: Call<'_, T>, r: Result<R>) -> Result<R> {
        let r = match r {
            Ok(v) => call.check_pred().await.map(|()| v),
            Err(e) => Err(e),
        };
        if let Some(rec) = call.take_record() {
            self.events.borrow_mut().push(rec);
        }
        r
    }

    /// Run one collective; if it fails in any way (bad argument, mismatch, timeout, lost peer), abort
    /// the communicator so that no other rank is left waiting for this one.
    async fn guarded<R>(&self, fut: impl Future<Output = Result<R>>) -> Result<R> {
        match fut.await {
            Ok(v) => Ok(v),
            Err(e) => Err(self.fail(e).await),
        }
    }

    /// For collectives whose data does not reach every rank from every other rank: confirm agreement.
    /// (With two ranks each checks the other's signature anyway: `min_n` = 3 skips that case.)
    /// The confirmation's rounds are recorded after the algorithm's `rounds`.
    async fn agree<R>(
        &self,
        call: &Call<'_, T>,
        r: Result<R>,
        min_n: usize,
        rounds: usize,
    ) -> Result<R> {
        match r {
            Ok(v) if self.opts.confirm && call.n >= min_n => {
                call.confirming();
                direct::barrier(call, rounds).await.map(|()| v)
            }
            r => r,
        }
    }

    /// Tell every peer this communicator is dead (unless the error came from a peer's abort).
    async fn fail(&self, e: Error) -> Error {
        if !matches!(e, Error::Aborted { .. }) {
            self.abort_once(&e.to_string()).await;
        }
        e
    }

    /// Abort at most once: later failures (or the tape's own abort) add no second round.
    async fn abort_once(&self, reason: &str) {
        if !self.aborted.replace(true) {
            let reason = crate::wire::clip(reason, crate::wire::MAX_ABORT_REASON);
            self.transport.abort(&reason).await;
        }
    }

    /// Whether a reduction of a tensor on `dev` folds there (see [`CommOptions::fold_on_device`]).
    fn folds_on(&self, dev: &Device) -> bool {
        on_gpu(dev) && self.opts.fold_on_device
    }

    /// Record a point-to-point message, if events are on: `(action, global peer, payload bytes,
    /// wire bytes)` of message `seq` between this rank (group rank `me`) and its peer.
    fn record_p2p(
        &self,
        group: &Group,
        (me, seq): (usize, u64),
        sig: &CallSig,
        (action, peer, bytes, wire): (Action, usize, usize, usize),
    ) {
        if !self.recording.get() {
            return;
        }
        let head = CallRecord::head(group, (me, seq), sig, Algorithm::PointToPoint);
        let rec = Recorder::new(head);
        rec.message(action, peer, bytes, wire, u32::from(action == Action::Send));
        self.events.borrow_mut().push(rec.finish());
    }

    fn next_p2p_seq(&self, group: u32, from: usize, to: usize) -> u64 {
        let mut m = self.p2p_seqs.borrow_mut();
        let s = m.entry((group, from, to)).or_insert(0);
        *s += 1;
        *s - 1
    }
}

/// GPU tensors stay on the GPU: a collective reads back only the bytes it sends (the transport
/// boundary), a rank's own part of a result is its input itself, and received parts are uploaded
/// to the inputs' device. The reductions fold received data in on the GPU
/// ([`crate::tensor::partial::Partial`]) unless [`CommOptions::fold_on_device`] is off (then
/// they read the input back once and fold on the host); small direct all_reduces and
/// reduce_scatters, whose every contribution is sent anyway, fold on the host.
///
/// Whether `dev` is a GPU.
fn on_gpu(dev: &Device) -> bool {
    !matches!(dev, Device::Cpu)
}

/// `x` itself when its local steps stay where it is, else a host copy.
async fn stage(x: &Tensor, keep: bool) -> Result<Tensor> {
    if keep {
        Ok(x.clone())
    } else {
        x.moved_to(&Device::Cpu).await
    }
}

async fn to_host(xs: &[Tensor]) -> Result<Vec<Tensor>> {
    let mut out = Vec::with_capacity(xs.len());
    for x in xs {
        out.push(x.moved_to(&Device::Cpu).await?);
    }
    Ok(out)
}

fn to_device(xs: &[Tensor], d: &Device) -> Result<Vec<Tensor>> {
    xs.iter().map(|x| x.to_device(d)).collect()
}

impl<T: Transport> Communicator for P2p<T> {
    fn rank(&self) -> usize {
        self.transport.rank()
    }

    fn world_size(&self) -> usize {
        self.transport.world()
    }

    fn world(&self) -> Group {
        let w = self.transport.world();
        Group::new(0, (0..w).collect(), w, self.transport.rank())
            .expect("0..world is a valid group")
    }

    fn device(&self) -> Device {
        self.opts.device.clone()
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Group> {
        let id = self.next_group.get();
        let g = Group::new(
            id,
            ranks.to_vec(),
            self.transport.world(),
            self.transport.rank(),
        )?;
        self.next_group.set(id + 1);
        Ok(g)
    }

    async fn broadcast(&self, x: &Tensor, root: usize, group: &Group) -> Result<Tensor> {
        self.guarded(async {
            let dev = x.device();
            group.check_rank("broadcast", "root", root)?;
            let call = self
                .begin(
                    group,
                    Spec::Broadcast { root }.sig().shape(x.shape()),
                    Algorithm::Tree,
                )
                .await?;
            let r = tree::broadcast(&call, x, root).await;
            let r = self.agree(&call, r, 3, tree::rounds(call.n)).await;
            self.finish(call, r).await?.to_device(&dev)
        })
        .await
    }

    async fn reduce(
        &self,
        x: &Tensor,
        root: usize,
        op: ReduceOp,
        group: &Group,
    ) -> Result<Option<Tensor>> {
        self.guarded(async {
            let dev = x.device();
            // A GPU tensor is reduced on the GPU (each child's contribution folded in there)
            // unless folds stay on the host (`fold_on_device` off).
            let x = &stage(x, x.numel() > 0 && self.folds_on(&dev)).await?;
            group.check_rank("reduce", "root", root)?;
            let call = self
                .begin(
                    group,
                    Spec::Reduce { root, op }.sig().shape(x.shape()),
                    Algorithm::Tree,
                )
                .await?;
            let r = tree::reduce(&call, x, root, op).await;
            let r = self.agree(&call, r, 3, tree::rounds(call.n)).await;
            self.finish(call, r)
                .await?
                .map(|t| t.to_device(&dev))
                .transpose()
        })
        .await
    }

    async fn all_reduce(&self, x: &Tensor, op: ReduceOp, group: &Group) -> Result<Tensor> {
        self.guarded(async {
            let dev = x.device();
            let n = group.size();
            let ring = self.large(x.numel(), n) && x.numel() >= n;
            // A GPU tensor's ring runs its local steps on the GPU (with `fold_on_device`);
            // everything else on the host.
            let host = stage(x, ring && self.folds_on(&dev)).await?;
            // The algorithm (and the ring's segment size) is part of the call: ranks configured
            // differently fail with a mismatch naming both, not with a confusing byte count.
            let algo = match (self.forced.get(), self.opts.all_reduce) {
                (Some(Algorithm::Ring), _) => AllReduceAlgo::Ring,
                (Some(Algorithm::Pairwise), _) => AllReduceAlgo::Pairwise,
                (Some(Algorithm::Shared), _) => AllReduceAlgo::Shared,
                (_, AllReduceAlgo::Auto) if self.transport.shares_memory() => AllReduceAlgo::Shared,
                (_, AllReduceAlgo::Auto) => AllReduceAlgo::Ring,
                (_, a) => a,
            };
            let small = match self.forced.get() {
                Some(Algorithm::Star) => SmallAllReduce::Star,
                Some(Algorithm::Exchange) => SmallAllReduce::Exchange,
                _ => self.small.get(),
            };
            let star = !ring && n > 2 && small == SmallAllReduce::Star;
            let route = match (ring, algo) {
                (false, _) if star => Route::Star,
                (false, _) => Route::Exchange,
                (true, AllReduceAlgo::Ring | AllReduceAlgo::Auto) => Route::Ring,
                (true, AllReduceAlgo::Pairwise) => Route::Pairwise,
                (true, AllReduceAlgo::Shared) => Route::Shared,
            };
            let extra = match route {
                Route::Ring => vec![route.code(), self.opts.segment_bytes as u64],
                _ => vec![route.code()],
            };
            let sig = Spec::AllReduce { op }.sig().shape(x.shape()).extra(extra);
            let call = self.begin(group, sig, route.algorithm()).await?;
            let r = match route {
                Route::Star => direct::all_reduce_star(&call, &host, op).await,
                Route::Exchange => direct::all_reduce(&call, &host, op).await,
                Route::Ring => ring::all_reduce(&call, &host, op, self.opts.segment_bytes).await,
                Route::Pairwise => direct::all_reduce_pairwise(&call, &host, op, false).await,
                Route::Shared => direct::all_reduce_pairwise(&call, &host, op, true).await,
            };
            self.finish(call, r).await?.to_device(&dev)
        })
        .await
    }

    async fn gather(&self, x: &Tensor, root: usize, group: &Group) -> Result<Option<Vec<Tensor>>> {
        self.guarded(async {
            let dev = x.device();
            group.check_rank("gather", "root", root)?;
            let call = self
                .begin(
                    group,
                    Spec::Gather { root }.sig().shape(x.shape()),
                    Algorithm::Direct,
                )
                .await?;
            let r = direct::gather(&call, x, root).await;
            let r = self.agree(&call, r, 3, 1).await;
            self.finish(call, r)
                .await?
                .map(|l| to_device(&l, &dev))
                .transpose()
        })
        .await
    }

    async fn scatter(&self, xs: Option<&[Tensor]>, root: usize, group: &Group) -> Result<Tensor> {
        self.guarded(async {
            let dev = xs
                .and_then(|l| l.first())
                .map_or(self.opts.device.clone(), Tensor::device);
            group.check_rank("scatter", "root", root)?;
            let me = group.require_member("scatter")?;
            let mut sig = Spec::Scatter { root }.sig();
            match (me == root, xs) {
                (true, Some(xs)) => sig = sig.shape(&list_shape("scatter", xs, group.size())?),
                (true, None) => {
                    return Err(Error::invalid(
                        "scatter",
                        "the root must pass the list to scatter",
                    ));
                }
                (false, Some(_)) => {
                    return Err(Error::invalid(
                        "scatter",
                        format!("only the root ({root}) passes a list; this is rank {me}"),
                    ));
                }
                (false, None) => {}
            }
            let call = self.begin(group, sig, Algorithm::Direct).await?;
            let r = direct::scatter(&call, xs, root).await;
            let r = self.agree(&call, r, 3, 1).await;
            self.finish(call, r).await?.to_device(&dev)
        })
        .await
    }

    async fn all_gather(&self, x: &Tensor, group: &Group) -> Result<Vec<Tensor>> {
        self.guarded(async {
            let dev = x.device();
            let ring = self.large(x.numel(), group.size());
            let sig = Spec::AllGather {}
                .sig()
                .shape(x.shape())
                .extra(vec![Route::of(ring).code()]);
            let call = self.begin(group, sig, Route::of(ring).algorithm()).await?;
            let r = if ring {
                ring::all_gather(&call, x).await
            } else {
                direct::all_gather(&call, x).await
            };
            to_device(&self.finish(call, r).await?, &dev)
        })
        .await
    }

    async fn reduce_scatter(&self, xs: &[Tensor], op: ReduceOp, group: &Group) -> Result<Tensor> {
        self.guarded(async {
            let dev = xs.first().map_or(Device::Cpu, Tensor::device);
            let shape = list_shape("reduce_scatter", xs, group.size())?;
            let numel: usize = shape.iter().product();
            let ring = self.large(numel, group.size());
            // GPU inputs of a ring keep their local steps on the GPU (with `fold_on_device`).
            let gpu_ring =
                ring && numel > 0 && self.folds_on(&dev) && xs.iter().all(|x| x.device() == dev);
            let xs = &if gpu_ring {
                xs.to_vec()
            } else {
                to_host(xs).await?
            };
            let sig = Spec::ReduceScatter { op }
                .sig()
                .shape(&shape)
                .extra(vec![Route::of(ring).code()]);
            let call = self.begin(group, sig, Route::of(ring).algorithm()).await?;
            let r = if ring {
                ring::reduce_scatter(&call, xs, op).await
            } else {
                direct::reduce_scatter(&call, xs, op).await
            };
            self.finish(call, r).await?.to_device(&dev)
        })
        .await
    }

    async fn all_to_all(&self, xs: &[Tensor], group: &Group) -> Result<Vec<Tensor>> {
        self.guarded(async {
            let dev = xs.first().map_or(Device::Cpu, Tensor::device);
            if xs.len() != group.size() {
                return Err(Error::invalid(
                    "all_to_all",
                    format!(
                        "need one tensor per group rank ({}), got {}",
                        group.size(),
                        xs.len()
                    ),
                ));
            }
            let call = self
                .begin(group, Spec::AllToAll {}.sig(), Algorithm::Direct)
                .await?;
            let r = direct::all_to_all(&call, xs).await;
            to_device(&self.finish(call, r).await?, &dev)
        })
        .await
    }

    async fn all_to_all_single(
        &self,
        x: &Tensor,
        in_splits: &[usize],
        out_splits: &[usize],
        group: &Group,
    ) -> Result<Tensor> {
        self.guarded(async {
            let dev = x.device();
            let n = group.size();
            let op = "all_to_all_single";
            if x.shape().is_empty() {
                return Err(Error::invalid(op, "input must have at least one dimension"));
            }
            if in_splits.len() != n || out_splits.len() != n {
                return Err(Error::invalid(
                    op,
                    format!(
                        "split lists must have group size {n} entries: in {in_splits:?}, out {out_splits:?}"
                    ),
                ));
            }
            let total = in_splits.iter().try_fold(0usize, |a, &k| a.checked_add(k));
            if total != Some(x.shape()[0]) {
                return Err(Error::invalid(
                    op,
                    format!(
                        "in_splits {in_splits:?} do not sum to dim 0 of shape {:?}",
                        x.shape()
                    ),
                ));
            }
            let call = self
                .begin(
                    group,
                    CallSig::new(Kind::AllToAllSingle).shape(&x.shape()[1..]),
                    Algorithm::Direct,
                )
                .await?;
            let r = direct::all_to_all_single(&call, x, in_splits, out_splits).await;
            let r = self.agree(&call, r, 2, 1).await;
            self.finish(call, r).await?.to_device(&dev)
        })
        .await
    }

    async fn send(&self, x: &Tensor, dst: usize, group: &Group) -> Result<()> {
        self.guarded(async {
            let me = group.require_member("send")?;
            group.check_rank("send", "destination", dst)?;
            if dst == me {
                return Err(Error::invalid("send", "a rank cannot send to itself"));
            }
            let sig = CallSig::new(Kind::Send).shape(x.shape());
            if self.opts.record_calls {
                self.calls.borrow_mut().push((group.id(), sig.clone()));
            }
            let seq = self.next_p2p_seq(group.id(), me, dst);
            let sb = sig.encode();
            let data = encode_tensor_async(x).await?;
            let mut b = BytesMut::with_capacity(4 + sb.len() + data.len());
            b.put_u32_le(sb.len() as u32);
            b.put_slice(&sb);
            b.put_slice(&data);
            let message = (Action::Send, group.global(dst), data.len(), b.len());
            self.record_p2p(group, (me, seq), &sig, message);
            let tag = Tag {
                group: group.id(),
                seq,
                channel: Channel::P2p,
            };
            self.transport
                .send(group.global(dst), tag, b.freeze())
                .await
        })
        .await
    }

    async fn recv(&self, shape: &[usize], src: usize, group: &Group) -> Result<Tensor> {
        self.guarded(async {
            let me = group.require_member("recv")?;
            group.check_rank("recv", "source", src)?;
            if src == me {
                return Err(Error::invalid("recv", "a rank cannot receive from itself"));
            }
            let sig = CallSig::new(Kind::Send).shape(shape);
            if self.opts.record_calls {
                self.calls.borrow_mut().push((group.id(), sig.clone()));
            }
            let seq = self.next_p2p_seq(group.id(), src, me);
            let tag = Tag {
                group: group.id(),
                seq,
                channel: Channel::P2p,
            };
            let describe = || {
                format!(
                    "recv(from={src}, shape={shape:?}) (group {}, message #{seq})",
                    group.id()
                )
            };
            let peer = group.global(src);
            {
                let got = with_timeout(self.opts.timeout, self.transport.recv(peer, tag)).await;
                let mut msg = match got {
                    None => {
                        return Err(Error::Timeout {
                            rank: self.rank(),
                            peer,
                            call: describe(),
                            timeout: self.opts.timeout,
                        });
                    }
                    Some(Err(Error::PeerLost {
                        rank, peer, reason, ..
                    })) => {
                        return Err(Error::PeerLost {
                            rank,
                            peer,
                            call: describe(),
                            reason,
                        });
                    }
                    Some(r) => r?,
                };
                let protocol = |d: &str| Error::Protocol {
                    rank: self.rank(),
                    peer,
                    call: describe(),
                    detail: d.to_string(),
                };
                if msg.len() < 4 {
                    return Err(protocol("short message"));
                }
                let n = msg.get_u32_le() as usize;
                if msg.len() < n {
                    return Err(protocol("signature prefix longer than the message"));
                }
                let theirs = CallSig::decode(&msg.split_to(n))
                    .ok_or_else(|| protocol("undecodable signature"))?;
                if !theirs.agrees(&sig) {
                    return Err(Error::Mismatch {
                        group: group.id(),
                        seq,
                        rank: self.rank(),
                        call: format!("recv(from={src}, shape={shape:?})"),
                        peer,
                        peer_call: format!("{theirs}"),
                    });
                }
                self.record_p2p(group, (me, seq), &sig, (Action::Recv, peer, msg.len(), 0));
                decode_tensor(msg)
                    .ok_or_else(|| protocol("malformed tensor"))?
                    .to_device(&self.opts.device)
            }
        })
        .await
    }

    async fn permute(&self, x: &Tensor, pairs: &[(usize, usize)], group: &Group) -> Result<Tensor> {
        self.guarded(async {
            let dev = x.device();
            super::check_pairs("permute", pairs, group.size())?;
            let extra = pairs
                .iter()
                .flat_map(|&(s, d)| [s as u64, d as u64])
                .collect();
            let call = self
                .begin(
                    group,
                    CallSig::new(Kind::Permute).shape(x.shape()).extra(extra),
                    Algorithm::Direct,
                )
                .await?;
            let r = direct::permute(&call, x, pairs).await;
            let r = self.agree(&call, r, 3, 1).await;
            self.finish(call, r).await?.to_device(&dev)
        })
        .await
    }

    async fn barrier(&self, group: &Group) -> Result<()> {
        self.guarded(async {
            let call = self
                .begin(group, Spec::Barrier {}.sig(), Algorithm::Direct)
                .await?;
            let r = direct::barrier(&call, 0).await;
            self.finish(call, r).await
        })
        .await
    }

    async fn abort(&self, reason: &str) {
        self.abort_once(reason).await;
    }
}
