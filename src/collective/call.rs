//! One collective call in progress on a rank (`Call`) and the messages it exchanges: the
//! algorithms (ring, tree, direct) send and receive through it, so every message is checked
//! against the call's signature before a byte is used and every wait is bounded; and the
//! whole-tensor message form ([`encode_tensor`], [`decode_tensor`]).
//!
//! Signature checks: the message from the ring predecessor is verified by its signature message
//! (sent first, so checked before the data); messages from any other rank carry the sender's
//! signature as a prefix. Because every rank checks its predecessor, any disagreement anywhere in
//! the group is seen by at least one rank, which aborts the rest. An algorithm whose messages
//! all go through one rank checks at the ends of that star instead (`Call::star`): there the
//! ranks other than the root announce nothing to a successor that is not the root, wait for no
//! predecessor that is not the root, and the root announces with its first message only.
//!
//! The signature message goes out with the call's first message to the successor when that is
//! small (a direct exchange's data: one message fewer per rank and call), else on its own before
//! this rank sends anything else or (except a star's root) waits on anyone. Format:
//! `[u32 length | INLINE][signature]` then, with its inline flag (the length word's top bit), the
//! first data message to the successor.

use std::cell::Cell;
use std::future::Future;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::future::{Either, select};
use futures::pin_mut;

use super::events::{Action, Algorithm, CallRecord, Chunk, Recorder};
use super::sig::CallSig;
use super::{Group, ReduceOp};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::transport::{Channel, Tag, Transport};

/// Payloads from this size up go to a non-successor as two messages (signature, then the payload
/// as is) instead of one with the signature copied in front.
pub const SPLIT_BYTES: usize = 16 * 1024;

/// Bit of a signature prefix's length word: the payload is the next message.
const SPLIT_FLAG: u32 = 1 << 31;

/// Bit of a signature message's length word: the first data message to the successor follows the
/// signature in the same message.
const INLINE_FLAG: u32 = 1 << 31;

/// Wait for `fut` at most `timeout`.
pub(crate) async fn with_timeout<F: Future>(timeout: Duration, fut: F) -> Option<F::Output> {
    pin_mut!(fut);
    // Most messages are already queued: answer those without arming a timer (which costs a
    // registration with the timer thread and a wake-up there).
    if let std::task::Poll::Ready(v) = futures::poll!(fut.as_mut()) {
        return Some(v);
    }
    let delay = futures_timer::Delay::new(timeout);
    match select(fut, delay).await {
        Either::Left((v, _)) => Some(v),
        Either::Right(((), _)) => None,
    }
}

/// One collective call in progress on this rank.
pub(crate) struct Call<'a, T: Transport> {
    transport: &'a T,
    timeout: Duration,
    group: &'a Group,
    /// This rank's group rank.
    pub me: usize,
    /// Group size.
    pub n: usize,
    seq: u64,
    sig: CallSig,
    sig_bytes: Bytes,
    pred_ok: Cell<bool>,
    /// Whether the signature went to the successor.
    announced: Cell<bool>,
    /// The predecessor's first data message, when it came inside its signature message.
    inline: std::cell::RefCell<Option<Bytes>>,
    /// The predecessor sends no signature in this call ([`Call::star`]): one that comes anyway
    /// is checked (it can only disagree), none is waited for, and the predecessor's leaving is
    /// not this rank's error (the root, which waits for its data, fails and aborts the rest).
    pred_silent: Cell<bool>,
    /// A star's root: the signature goes with the first message to the successor, not on its
    /// own before the root's first wait ([`Call::star`]).
    hold: Cell<bool>,
    /// What this rank does in the call, when the communicator records events.
    rec: Option<Recorder>,
}

impl<'a, T: Transport> Call<'a, T> {
    /// Call number `seq` of `group` with signature `sig`, this rank being group rank `me`; every
    /// wait bounded by `timeout`; what it does recorded when `record` (its data taking
    /// `algorithm`).
    pub(super) fn new(
        transport: &'a T,
        timeout: Duration,
        group: &'a Group,
        (me, seq): (usize, u64),
        sig: CallSig,
        record: Option<Algorithm>,
    ) -> Self {
        let n = group.size();
        let sig_bytes = sig.encode();
        let rec = record.map(|a| Recorder::new(CallRecord::head(group, (me, seq), &sig, a)));
        Call {
            transport,
            timeout,
            group,
            me,
            n,
            seq,
            sig,
            sig_bytes,
            pred_ok: Cell::new(n == 1),
            announced: Cell::new(n == 1),
            inline: std::cell::RefCell::new(None),
            pred_silent: Cell::new(false),
            hold: Cell::new(false),
            rec,
        }
    }

    /// The round, and the chunks sent and received, of the messages that follow (recorded with
    /// them when events are on).
    pub(super) fn at(&self, round: usize, sent: Option<Chunk>, received: Option<Chunk>) {
        if let Some(r) = &self.rec {
            r.at(round as u32, sent, received);
        }
    }

    /// Record a local step (`Reduce`, `Copy`) on `chunk`.
    pub(super) fn local(&self, action: Action, chunk: Chunk) {
        if let Some(r) = &self.rec {
            r.local(action, chunk);
        }
    }

    /// The messages that follow are the confirmation round's.
    pub(super) fn confirming(&self) {
        if let Some(r) = &self.rec {
            r.confirming();
        }
    }

    /// The last message received came as `chunk` (known once it came: a tensor that travels
    /// with its shape).
    pub(super) fn received_as(&self, chunk: Chunk) {
        if let Some(r) = &self.rec {
            r.received_as(chunk);
        }
    }

    /// This rank's record of the call, if events are recorded.
    pub(super) fn take_record(&mut self) -> Option<CallRecord> {
        self.rec.take().map(Recorder::finish)
    }

    fn sent(&self, dst: usize, payload: usize, wire: usize, messages: u32) {
        if let Some(r) = &self.rec {
            r.message(
                Action::Send,
                self.group.global(dst),
                payload,
                wire,
                messages,
            );
        }
    }

    /// Announce this call's signature to the ring successor (the first message of every call),
    /// with `first`, the call's first data message to the successor, in the same message. Once
    /// per call: later calls do nothing.
    async fn announce_with(&self, first: Option<Bytes>) -> Result<()> {
        if self.announced.replace(true) {
            return Ok(());
        }
        let len = self.sig_bytes.len() as u32;
        let extra = first.as_ref().map_or(0, Bytes::len);
        let mut b = BytesMut::with_capacity(4 + self.sig_bytes.len() + extra);
        b.put_u32_le(if first.is_some() {
            len | INLINE_FLAG
        } else {
            len
        });
        b.put_slice(&self.sig_bytes);
        let inline = first.is_some();
        if let Some(p) = first {
            b.put_slice(&p);
        }
        if inline {
            self.sent(self.succ(), extra, b.len(), 1);
        } else if let Some(r) = &self.rec {
            r.message(
                Action::Announce,
                self.group.global(self.succ()),
                0,
                b.len(),
                1,
            );
        }
        let to = self.group.global(self.succ());
        self.transport
            .send(to, self.tag(Channel::Sig), b.freeze())
            .await
    }

    /// Check signatures at the ends of a star around group rank `root` instead of around the
    /// ring, for an algorithm whose every message goes to or comes from the root: the root checks
    /// every rank's call (on the data each sends it), and every rank the root's (on the data it
    /// sends back), so if every rank agrees with the root all agree. A rank other than the root
    /// then sends no signature message to a successor that is not the root and waits for none
    /// from a predecessor that is not the root. Its messages to and from the root keep the form
    /// the ring check gives them (the signature inline to a successor, a prefix to anyone else),
    /// so a rank that runs another algorithm in the same call is still caught by a mismatch,
    /// never a hang: and a predecessor that runs another collective announces its call as usual,
    /// which this rank's waits race (the announcement can only disagree), so that rank fails at
    /// once instead of leaving the root to time out waiting for it. The root announces its call
    /// with its first message, the result to its successor, not before it waits: its successor
    /// waits for that message anyway, and a successor in another call is caught by its own
    /// successor's check. The root must send to its successor first. Call before any message.
    pub(super) fn star(&self, root: usize) {
        if self.me == root {
            self.hold.set(true);
        } else {
            if self.succ() != root {
                self.announced.set(true);
            }
            if self.pred() != root {
                self.pred_silent.set(true);
            }
        }
    }

    /// Announce the signature on its own unless it went already: before this rank sends anything
    /// but a small first message to its successor, or waits on any peer (a star's root excepted:
    /// [`Call::star`]).
    pub(super) async fn announce(&self) -> Result<()> {
        self.announce_with(None).await
    }

    fn tag(&self, channel: Channel) -> Tag {
        Tag {
            group: self.group.id(),
            seq: self.seq,
            channel,
        }
    }

    /// Ring successor (group rank).
    pub fn succ(&self) -> usize {
        (self.me + 1) % self.n
    }

    /// Ring predecessor (group rank).
    pub fn pred(&self) -> usize {
        (self.me + self.n - 1) % self.n
    }

    /// The signature as text, for errors.
    pub fn describe(&self) -> String {
        format!(
            "{} (group {}, call #{})",
            self.sig,
            self.group.id(),
            self.seq
        )
    }

    fn my_global(&self) -> usize {
        self.group.global(self.me)
    }

    fn mismatch(&self, peer: usize, theirs: &CallSig) -> Error {
        Error::Mismatch {
            group: self.group.id(),
            seq: self.seq,
            rank: self.my_global(),
            call: self.sig.to_string(),
            peer: self.group.global(peer),
            peer_call: theirs.to_string(),
        }
    }

    /// Error for bytes from `peer` that cannot be what the protocol says.
    pub fn protocol(&self, peer: usize, detail: impl Into<String>) -> Error {
        Error::Protocol {
            rank: self.my_global(),
            peer: self.group.global(peer),
            call: self.describe(),
            detail: detail.into(),
        }
    }

    fn add_context(&self, e: Error) -> Error {
        match e {
            Error::PeerLost {
                rank,
                peer,
                call,
                reason,
            } if call.is_empty() => Error::PeerLost {
                rank,
                peer,
                call: self.describe(),
                reason,
            },
            e => e,
        }
    }

    async fn wait<F: Future<Output = Result<Bytes>>>(&self, peer: usize, fut: F) -> Result<Bytes> {
        match with_timeout(self.timeout, fut).await {
            Some(r) => r.map_err(|e| self.add_context(e)),
            None => Err(Error::Timeout {
                rank: self.my_global(),
                peer: self.group.global(peer),
                call: self.describe(),
                timeout: self.timeout,
            }),
        }
    }

    /// Check the predecessor's signature message and keep the data message inside it, if any.
    fn accept_pred_sig(&self, mut msg: Bytes) -> Result<()> {
        let pred = self.pred();
        if msg.len() < 4 {
            return Err(self.protocol(pred, "signature message shorter than its length word"));
        }
        let head = msg.get_u32_le();
        let n = (head & !INLINE_FLAG) as usize;
        if msg.len() < n || (head & INLINE_FLAG == 0 && msg.len() != n) {
            return Err(self.protocol(
                pred,
                format!(
                    "signature message of {} bytes says its signature has {n}",
                    msg.len()
                ),
            ));
        }
        let sig = msg.split_to(n);
        self.verify(pred, &sig)?;
        self.pred_ok.set(true);
        if head & INLINE_FLAG != 0 {
            *self.inline.borrow_mut() = Some(msg);
        }
        Ok(())
    }

    fn verify(&self, peer: usize, sig_bytes: &[u8]) -> Result<()> {
        let theirs = CallSig::decode(sig_bytes)
            .ok_or_else(|| self.protocol(peer, "undecodable call signature"))?;
        if theirs.agrees(&self.sig) {
            Ok(())
        } else {
            Err(self.mismatch(peer, &theirs))
        }
    }

    /// Announce the signature before a wait, unless this rank is a star's root (which announces
    /// with its first message: see [`Call::star`]).
    async fn announce_before_wait(&self) -> Result<()> {
        if self.hold.get() {
            return Ok(());
        }
        self.announce().await
    }

    /// Wait for and verify the ring predecessor's signature (once per call).
    pub(super) async fn check_pred(&self) -> Result<()> {
        self.announce_before_wait().await?;
        if self.pred_ok.get() || self.pred_silent.get() {
            return Ok(());
        }
        let pred = self.pred();
        let t = self
            .transport
            .recv(self.group.global(pred), self.tag(Channel::Sig));
        let s = self.wait(pred, t).await?;
        self.accept_pred_sig(s)
    }

    /// Send `payload` to group rank `dst`. Messages to the successor go raw (it checks the signature
    /// message); to anyone else they carry this rank's signature first: small payloads in the same
    /// message, large ones ([`SPLIT_BYTES`] and up) as a signature message followed by the payload
    /// untouched, so sending a large chunk never copies it.
    pub async fn send(&self, dst: usize, payload: Bytes) -> Result<()> {
        let t = self.transport;
        let (to, tag) = (self.group.global(dst), self.tag(Channel::Data));
        if dst == self.succ() && !self.announced.get() && payload.len() < SPLIT_BYTES {
            return self.announce_with(Some(payload)).await;
        }
        self.announce().await?;
        if dst == self.succ() {
            self.sent(dst, payload.len(), payload.len(), 1);
            return t.send(to, tag, payload).await;
        }
        let split = payload.len() >= SPLIT_BYTES;
        let mut b = BytesMut::with_capacity(
            4 + self.sig_bytes.len() + if split { 0 } else { payload.len() },
        );
        let flag = if split { SPLIT_FLAG } else { 0 };
        b.put_u32_le(self.sig_bytes.len() as u32 | flag);
        b.put_slice(&self.sig_bytes);
        let head = 4 + self.sig_bytes.len();
        self.sent(
            dst,
            payload.len(),
            head + payload.len(),
            1 + u32::from(split),
        );
        if split {
            t.send(to, tag, b.freeze()).await?;
            t.send(to, tag, payload).await
        } else {
            b.put_slice(&payload);
            t.send(to, tag, b.freeze()).await
        }
    }

    /// The next data message from group rank `src`, its sender's call verified to agree with ours.
    pub async fn recv(&self, src: usize) -> Result<Bytes> {
        let got = self.recv_verified(src).await?;
        if let Some(r) = &self.rec {
            r.message(Action::Recv, self.group.global(src), got.len(), 0, 0);
        }
        Ok(got)
    }

    async fn recv_verified(&self, src: usize) -> Result<Bytes> {
        let t = self.transport;
        self.announce_before_wait().await?;
        if src == self.pred() {
            self.check_pred().await?;
            if let Some(first) = self.inline.borrow_mut().take() {
                return Ok(first);
            }
            let data = t.recv(self.group.global(src), self.tag(Channel::Data));
            return self.wait(src, data).await;
        }
        let data = t.recv(self.group.global(src), self.tag(Channel::Data));
        let msg = if self.pred_ok.get() {
            self.wait(src, data).await?
        } else {
            // Race the predecessor's signature against the data: whichever comes first, a mismatch
            // anywhere ends the wait instead of leaving this rank blocked on a peer in another call.
            let pred = self.pred();
            let sig = t.recv(self.group.global(pred), self.tag(Channel::Sig));
            pin_mut!(sig, data);
            let both = async {
                match select(sig, data).await {
                    // A silent predecessor is no party to this call (`Call::star`): its loss
                    // reaches this rank through the root, which waits for it.
                    Either::Left((Err(_), data)) if self.pred_silent.get() => data.await,
                    Either::Left((s, data)) => {
                        let s = s.map_err(|e| self.add_context(e))?;
                        self.accept_pred_sig(s)?;
                        data.await
                    }
                    Either::Right((d, _)) => d,
                }
            };
            self.wait(src, both).await?
        };
        let (split, payload) = self.strip_sig(src, msg)?;
        if !split {
            return Ok(payload);
        }
        if !payload.is_empty() {
            return Err(self.protocol(src, "bytes after a split signature message"));
        }
        let data = t.recv(self.group.global(src), self.tag(Channel::Data));
        self.wait(src, data).await
    }

    /// Check and remove the signature prefix; `true` when the payload follows in the next message.
    fn strip_sig(&self, src: usize, mut msg: Bytes) -> Result<(bool, Bytes)> {
        if msg.len() < 4 {
            return Err(self.protocol(src, "message shorter than its signature prefix"));
        }
        let head = msg.get_u32_le();
        let n = (head & !SPLIT_FLAG) as usize;
        if msg.len() < n {
            return Err(self.protocol(src, "signature prefix longer than the message"));
        }
        let sig = msg.split_to(n);
        self.verify(src, &sig)?;
        Ok((head & SPLIT_FLAG != 0, msg))
    }

    /// The next data message from `src`, which must be exactly `want` bytes long.
    pub async fn recv_exact(&self, src: usize, want: usize) -> Result<Bytes> {
        let got = self.recv(src).await?;
        if got.len() != want {
            return Err(self.protocol(src, format!("expected {want} bytes, got {}", got.len())));
        }
        Ok(got)
    }

    /// The last step of every reducing algorithm: `Avg` divides the finished sum by the group size.
    pub fn finish_reduction(&self, op: ReduceOp, acc: &mut [f32]) {
        if let Some(k) = op.final_scale(self.n) {
            crate::tensor::partial::scale_host(acc, k);
        }
    }
}

/// Whole-tensor wire form: `[u32 ndim][u64 dim]*[f32 LE data]`.
pub fn encode_tensor(t: &Tensor) -> Result<Bytes> {
    Ok(encode_parts(t.shape(), &t.to_le_bytes()?))
}

/// [`encode_tensor`] of a tensor wherever it lives (a GPU tensor is read back asynchronously: the
/// transport boundary, and the only way out of a GPU in a browser).
pub(crate) async fn encode_tensor_async(t: &Tensor) -> Result<Bytes> {
    Ok(encode_parts(
        t.shape(),
        &crate::tensor::partial::bytes_of(t, 0, t.numel()).await?,
    ))
}

fn encode_parts(shape: &[usize], data: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(4 + 8 * shape.len() + data.len());
    b.put_u32_le(shape.len() as u32);
    for &d in shape {
        b.put_u64_le(d as u64);
    }
    b.put_slice(data);
    b.freeze()
}

/// Parse [`encode_tensor`]'s output; `None` if malformed.
pub fn decode_tensor(mut b: Bytes) -> Option<Tensor> {
    if b.len() < 4 {
        return None;
    }
    let nd = b.get_u32_le() as usize;
    if nd > 64 || b.len() < nd * 8 {
        return None;
    }
    let mut shape = Vec::with_capacity(nd);
    for _ in 0..nd {
        shape.push(usize::try_from(b.get_u64_le()).ok()?);
    }
    let n = crate::tensor::checked_numel(&shape)?;
    if n.checked_mul(4)? != b.len() {
        return None;
    }
    Tensor::from_shared_le_bytes(b, &shape).ok()
}
