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

/// Least length of a [`CallSig::record`] (a digest record is 76 bytes).
pub const MIN_RECORD: usize = 80;

/// Form bytes of a [`CallSig::record`].
const RECORD_WHOLE: u8 = 0;
const RECORD_DIGEST: u8 = 1;
/// A rank whose own arguments are wrong: the reason instead of a call ([`refusal_record`]).
const RECORD_REFUSED: u8 = 2;

/// A record in place of a call, for a rank whose arguments are wrong: `reason` (cut to fit) in
/// exactly `len` bytes (at least [`MIN_RECORD`]). Every other rank's check then fails naming this
/// rank and the reason, so the whole group fails together instead of waiting for its call.
pub fn refusal_record(reason: &str, len: usize) -> Vec<u8> {
    let len = len.max(MIN_RECORD);
    let mut cut = reason.len().min(len - 5);
    while !reason.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut rec = vec![0u8; len];
    rec[0] = RECORD_REFUSED;
    rec[1..5].copy_from_slice(&(cut as u32).to_le_bytes());
    rec[5..5 + cut].copy_from_slice(&reason.as_bytes()[..cut]);
    rec
}

/// What a call check can compare of a signature too long for its record: kind, op, root and
/// SHA-256 digests of the shape and of the extra arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Digest {
    kind: u8,
    op: u8,
    root: u64,
    /// `None`: no shape known on that rank (agrees with any).
    shape: Option<[u8; 32]>,
    extra: [u8; 32],
}

fn sha256_u64s(xs: &[u64]) -> [u8; 32] {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    h.update((xs.len() as u64).to_le_bytes());
    for x in xs {
        h.update(x.to_le_bytes());
    }
    h.finalize().into()
}

impl CallSig {
    fn digest(&self) -> Digest {
        let shape: Option<Vec<u64>> = self
            .shape
            .as_ref()
            .map(|s| s.iter().map(|&d| d as u64).collect());
        Digest {
            kind: self.kind as u8,
            op: self.op.map_or(u8::MAX, ReduceOp::to_u8),
            root: self.root.map_or(u64::MAX, |r| r as u64),
            shape: shape.as_deref().map(sha256_u64s),
            extra: sha256_u64s(&self.extra),
        }
    }

    /// This signature in exactly `len` bytes (at least [`MIN_RECORD`]), for call checks that
    /// exchange fixed-size records (NCCL's all_gather of one record per rank): the whole encoding
    /// where it fits, else kind, op, root and digests of shape and arguments, so a long signature
    /// (a permute of many pairs, a tensor of many dimensions) is still compared on every rank.
    pub fn record(&self, len: usize) -> Vec<u8> {
        let len = len.max(MIN_RECORD);
        let mut rec = vec![0u8; len];
        let enc = self.encode();
        if 5 + enc.len() <= len {
            rec[0] = RECORD_WHOLE;
            rec[1..5].copy_from_slice(&(enc.len() as u32).to_le_bytes());
            rec[5..5 + enc.len()].copy_from_slice(&enc);
        } else {
            let d = self.digest();
            rec[0] = RECORD_DIGEST;
            rec[1] = d.kind;
            rec[2] = d.op;
            rec[3] = u8::from(d.shape.is_some());
            rec[4..12].copy_from_slice(&d.root.to_le_bytes());
            rec[12..44].copy_from_slice(&d.shape.unwrap_or_default());
            rec[44..76].copy_from_slice(&d.extra);
        }
        rec
    }

    /// Compare another rank's [`CallSig::record`] with this call: `Ok` if they describe the same
    /// call (shapes compared only where both know one, as [`CallSig::agrees`]), else a
    /// description of the other call for the error.
    pub fn agrees_record(&self, theirs: &[u8]) -> Result<(), String> {
        match theirs.first() {
            Some(&RECORD_WHOLE) if theirs.len() >= 5 => {
                let n = u32::from_le_bytes([theirs[1], theirs[2], theirs[3], theirs[4]]) as usize;
                let Some(sig) = theirs.get(5..5 + n).and_then(CallSig::decode) else {
                    return Err("an unreadable call".into());
                };
                // Where ours did not fit whole, only the digest forms can be compared (the other
                // rank's call then differs anyway, or ours would not be longer).
                let agree = if 5 + self.encode().len() <= theirs.len() {
                    self.agrees(&sig)
                } else {
                    digests_agree(&self.digest(), &sig.digest())
                };
                if agree { Ok(()) } else { Err(sig.to_string()) }
            }
            Some(&RECORD_DIGEST) if theirs.len() >= 76 => {
                let mut shape = [0u8; 32];
                shape.copy_from_slice(&theirs[12..44]);
                let mut extra = [0u8; 32];
                extra.copy_from_slice(&theirs[44..76]);
                let d = Digest {
                    kind: theirs[1],
                    op: theirs[2],
                    root: u64::from_le_bytes(theirs[4..12].try_into().unwrap_or_default()),
                    shape: (theirs[3] != 0).then_some(shape),
                    extra,
                };
                if digests_agree(&self.digest(), &d) {
                    return Ok(());
                }
                let name = Kind::ALL
                    .get(usize::from(d.kind))
                    .map_or("an unknown collective", |k| k.name());
                let hex: String = d.extra[..4].iter().map(|b| format!("{b:02x}")).collect();
                Err(format!(
                    "{name}(a signature too long to send whole; arguments digest {hex}…)"
                ))
            }
            Some(&RECORD_REFUSED) if theirs.len() >= 5 => {
                let n = u32::from_le_bytes([theirs[1], theirs[2], theirs[3], theirs[4]]) as usize;
                let why = theirs
                    .get(5..5 + n)
                    .map(String::from_utf8_lossy)
                    .unwrap_or_default();
                Err(format!("no call: its arguments are wrong ({why})"))
            }
            _ => Err("an unreadable call".into()),
        }
    }
}

fn digests_agree(a: &Digest, b: &Digest) -> bool {
    a.kind == b.kind
        && a.op == b.op
        && a.root == b.root
        && a.extra == b.extra
        && match (&a.shape, &b.shape) {
            (Some(x), Some(y)) => x == y,
            _ => true,
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

impl CallSig {
    /// The collective with its op and root, as the teaching views name it:
    /// `all_reduce(op=sum)`, `broadcast(root=2)`, `all_gather`.
    pub fn short(&self) -> String {
        let mut args = Vec::new();
        if let Some(op) = self.op {
            args.push(format!("op={}", op.name()));
        }
        if let Some(r) = self.root {
            args.push(format!("root={r}"));
        }
        if args.is_empty() {
            self.kind.name().to_string()
        } else {
            format!("{}({})", self.kind.name(), args.join(", "))
        }
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
        // A peer's call is decoded from its message: its lists are shown up to a fixed length,
        // so that an error quoting it (a mismatch) stays small whatever the peer sent.
        let list = |v: &[u64], most: usize| {
            let shown: Vec<String> = v.iter().take(most).map(u64::to_string).collect();
            match v.len().checked_sub(most) {
                Some(more) if more > 0 => format!("[{}, … {more} more]", shown.join(", ")),
                _ => format!("[{}]", shown.join(", ")),
            }
        };
        if let Some(shape) = &self.shape {
            let dims: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
            parts.push(format!("shape={}", list(&dims, 8)));
        }
        if !self.extra.is_empty() {
            parts.push(format!("args={}", list(&self.extra, 16)));
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

    /// A peer's call is quoted in a mismatch error that travels to every rank as an abort
    /// reason (#40 item 7): however long its lists, the text stays short and says how much was
    /// left out (before: a 2 MiB list of arguments went into every rank's error).
    #[test]
    fn a_call_with_huge_lists_prints_short() {
        let s = CallSig::new(Kind::Permute)
            .shape(&vec![3; 1000])
            .extra((0..100_000).collect());
        let t = s.to_string();
        assert!(t.len() < 200, "{} bytes: {t}", t.len());
        assert!(
            t.contains("… 992 more") && t.contains("… 99984 more"),
            "{t}"
        );
    }

    /// Fixed-size records (NCCL's call check): short signatures travel whole, long ones (a permute
    /// of many pairs, many dimensions) as digests, and both forms still tell every difference.
    #[test]
    fn records_compare_long_signatures_too() {
        const LEN: usize = 256;
        let permute = |pairs: u64, last: u64| {
            let mut extra: Vec<u64> = (0..2 * pairs).collect();
            *extra.last_mut().unwrap() = last;
            CallSig::new(Kind::Permute).shape(&[4]).extra(extra)
        };
        let short = permute(3, 99);
        assert_eq!(short.record(LEN)[0], RECORD_WHOLE);
        let long = permute(40, 99);
        assert!(
            long.encode().len() + 5 > LEN,
            "the test needs a signature too long"
        );
        assert_eq!(long.record(LEN)[0], RECORD_DIGEST);
        // Same calls agree, in both forms.
        assert_eq!(short.agrees_record(&short.record(LEN)), Ok(()));
        assert_eq!(long.agrees_record(&long.record(LEN)), Ok(()));
        // The last pair differs: before, such a long check was skipped and passed.
        let other = permute(40, 98);
        let e = long.agrees_record(&other.record(LEN)).unwrap_err();
        assert!(e.starts_with("permute(a signature too long"), "{e}");
        assert!(other.agrees_record(&long.record(LEN)).is_err());
        // A long call against a short one (either side), other kinds, ops, roots, shapes.
        assert!(long.agrees_record(&short.record(LEN)).is_err());
        assert!(short.agrees_record(&long.record(LEN)).is_err());
        let many_dims: Vec<usize> = vec![1; 40];
        let a = CallSig::new(Kind::AllReduce)
            .op(ReduceOp::Sum)
            .shape(&many_dims);
        assert_eq!(a.record(LEN)[0], RECORD_DIGEST);
        assert_eq!(a.agrees_record(&a.record(LEN)), Ok(()));
        let mut dims2 = many_dims.clone();
        dims2[39] = 2;
        let b = CallSig::new(Kind::AllReduce)
            .op(ReduceOp::Sum)
            .shape(&dims2);
        assert!(a.agrees_record(&b.record(LEN)).is_err(), "shapes differ");
        let c = CallSig::new(Kind::AllReduce)
            .op(ReduceOp::Max)
            .shape(&many_dims);
        assert!(a.agrees_record(&c.record(LEN)).is_err(), "ops differ");
        // A rank that knows no shape agrees with any (as `agrees`), in the digest form too.
        let mut unknown = CallSig::new(Kind::Scatter).root(1).extra((0..40).collect());
        let known = unknown.clone().shape(&[3, 5]);
        assert_eq!(known.agrees_record(&unknown.record(LEN)), Ok(()));
        unknown.root = Some(2);
        assert!(
            known.agrees_record(&unknown.record(LEN)).is_err(),
            "roots differ"
        );
        // A rank whose arguments are wrong: every other rank is told why, whatever its call.
        let refusal = refusal_record("scatter: the root must pass the list", LEN);
        for sig in [&short, &long, &a] {
            let e = sig.agrees_record(&refusal).unwrap_err();
            assert_eq!(
                e,
                "no call: its arguments are wrong (scatter: the root must pass the list)"
            );
        }
        let long_reason = "é".repeat(300);
        let cut = refusal_record(&long_reason, LEN);
        assert_eq!(cut.len(), LEN);
        assert!(short.agrees_record(&cut).unwrap_err().contains("éé"));
        // Garbage is an unreadable call, never a pass.
        for bad in [
            &[][..],
            &[7u8; LEN][..],
            &[0u8, 255, 255, 255, 255][..],
            &[1u8; 10][..],
        ] {
            assert_eq!(short.agrees_record(bad), Err("an unreadable call".into()));
        }
    }
}
