//! Call signatures: what a rank believes the current collective is (kind, op, root, dtype, shape).
//! Every rank sends its signature to its successor in the group ring at the start of a call, and
//! messages from other ranks carry the sender's signature as a prefix; a receiver compares before it
//! uses any byte, so mismatched calls fail loudly on every rank instead of hanging or mixing data.

use std::fmt;

use bytes::{BufMut, Bytes, BytesMut};

use super::ReduceOp;

/// Which collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// broadcast
    Broadcast = 0,
    /// reduce
    Reduce = 1,
    /// all_reduce
    AllReduce = 2,
    /// gather
    Gather = 3,
    /// scatter
    Scatter = 4,
    /// all_gather
    AllGather = 5,
    /// reduce_scatter
    ReduceScatter = 6,
    /// all_to_all (list form)
    AllToAll = 7,
    /// all_to_all_single (one tensor, split sizes along dim 0)
    AllToAllSingle = 8,
    /// permute
    Permute = 9,
    /// barrier
    Barrier = 10,
    /// point-to-point send/recv
    Send = 11,
}

impl Kind {
    /// Every kind, in wire-code order.
    pub const ALL: [Kind; 12] = [
        Kind::Broadcast,
        Kind::Reduce,
        Kind::AllReduce,
        Kind::Gather,
        Kind::Scatter,
        Kind::AllGather,
        Kind::ReduceScatter,
        Kind::AllToAll,
        Kind::AllToAllSingle,
        Kind::Permute,
        Kind::Barrier,
        Kind::Send,
    ];

    /// The snake_case name.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Broadcast => "broadcast",
            Kind::Reduce => "reduce",
            Kind::AllReduce => "all_reduce",
            Kind::Gather => "gather",
            Kind::Scatter => "scatter",
            Kind::AllGather => "all_gather",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::AllToAll => "all_to_all",
            Kind::AllToAllSingle => "all_to_all_single",
            Kind::Permute => "permute",
            Kind::Barrier => "barrier",
            Kind::Send => "send/recv",
        }
    }

    /// Whether the collective takes a reduce op.
    pub fn takes_op(self) -> bool {
        matches!(self, Kind::Reduce | Kind::AllReduce | Kind::ReduceScatter)
    }

    /// Whether the collective takes a root.
    pub fn takes_root(self) -> bool {
        matches!(
            self,
            Kind::Broadcast | Kind::Reduce | Kind::Gather | Kind::Scatter
        )
    }
}

/// A rank's view of one collective call; two ranks' views must be [`CallSig::agrees`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CallSig {
    /// The collective.
    pub kind: Kind,
    /// Reduce op, for reducing collectives.
    pub op: Option<ReduceOp>,
    /// Root (group rank), for rooted collectives.
    pub root: Option<usize>,
    /// The shape every rank must agree on, where there is one (`None`: not known on this rank, e.g.
    /// a scatter receiver; or not required to agree).
    pub shape: Option<Vec<usize>>,
    /// Other arguments that must agree (permute pairs, flattened; list lengths).
    pub extra: Vec<u64>,
}

/// Element type on the wire. Only f32 exists today; the byte keeps the wire format honest.
const DTYPE_F32: u8 = 0;

impl CallSig {
    /// A signature with just a kind.
    pub fn new(kind: Kind) -> Self {
        CallSig {
            kind,
            op: None,
            root: None,
            shape: None,
            extra: Vec::new(),
        }
    }

    /// Builder: reduce op.
    pub fn op(mut self, op: ReduceOp) -> Self {
        self.op = Some(op);
        self
    }

    /// Builder: root.
    pub fn root(mut self, root: usize) -> Self {
        self.root = Some(root);
        self
    }

    /// Builder: agreed shape.
    pub fn shape(mut self, shape: &[usize]) -> Self {
        self.shape = Some(shape.to_vec());
        self
    }

    /// Builder: extra agreed arguments.
    pub fn extra(mut self, extra: Vec<u64>) -> Self {
        self.extra = extra;
        self
    }

    /// Whether two ranks' views describe the same call (shapes compared only where both know one).
    pub fn agrees(&self, other: &CallSig) -> bool {
        self.kind == other.kind
            && self.op == other.op
            && self.root == other.root
            && self.extra == other.extra
            && match (&self.shape, &other.shape) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            }
    }

    /// Wire form.
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(
            16 + 8 * (self.shape.as_ref().map_or(0, Vec::len) + self.extra.len()),
        );
        b.put_u8(self.kind as u8);
        b.put_u8(self.op.map_or(u8::MAX, ReduceOp::to_u8));
        b.put_u8(DTYPE_F32);
        b.put_u8(u8::from(self.shape.is_some()));
        b.put_u64_le(self.root.map_or(u64::MAX, |r| r as u64));
        let shape = self.shape.as_deref().unwrap_or(&[]);
        b.put_u32_le(shape.len() as u32);
        for &d in shape {
            b.put_u64_le(d as u64);
        }
        b.put_u32_le(self.extra.len() as u32);
        for &x in &self.extra {
            b.put_u64_le(x);
        }
        b.freeze()
    }

    /// Parse the wire form; `None` if malformed.
    pub fn decode(b: &[u8]) -> Option<CallSig> {
        let mut r = Reader(b);
        let kind = *Kind::ALL.get(r.u8()? as usize)?;
        let op = match r.u8()? {
            u8::MAX => None,
            x => Some(ReduceOp::from_u8(x)?),
        };
        if r.u8()? != DTYPE_F32 {
            return None;
        }
        let has_shape = r.u8()? != 0;
        let root = match r.u64()? {
            u64::MAX => None,
            x => Some(usize::try_from(x).ok()?),
        };
        let nd = r.u32()? as usize;
        if nd > 64 {
            return None;
        }
        let shape: Vec<usize> = (0..nd)
            .map(|_| r.u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<_>>()?;
        let ne = r.u32()? as usize;
        if ne > r.0.len() / 8 {
            return None;
        }
        let extra = (0..ne).map(|_| r.u64()).collect::<Option<_>>()?;
        if !r.0.is_empty() {
            return None;
        }
        Some(CallSig {
            kind,
            op,
            root,
            shape: has_shape.then_some(shape),
            extra,
        })
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

impl fmt::Display for CallSig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(", self.kind.name())?;
        let mut parts = Vec::new();
        if let Some(op) = self.op {
            parts.push(format!("op={}", op.name()));
        }
        if let Some(root) = self.root {
            parts.push(format!("root={root}"));
        }
        if let Some(shape) = &self.shape {
            parts.push(format!("shape={shape:?}"));
        }
        if !self.extra.is_empty() {
            parts.push(format!("args={:?}", self.extra));
        }
        write!(f, "{})", parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejects_garbage() {
        let s = CallSig::new(Kind::Reduce)
            .op(ReduceOp::Max)
            .root(3)
            .shape(&[2, 5])
            .extra(vec![7, 9]);
        assert_eq!(CallSig::decode(&s.encode()), Some(s.clone()));
        assert_eq!(
            s.to_string(),
            "reduce(op=max, root=3, shape=[2, 5], args=[7, 9])"
        );
        let enc = s.encode();
        for cut in 0..enc.len() {
            assert_eq!(CallSig::decode(&enc[..cut]), None, "truncated at {cut}");
        }
        assert_eq!(CallSig::decode(&[200, 0, 0, 0]), None);
    }
}
