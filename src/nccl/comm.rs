//! The [`Communicator`] over NCCL: one mapping per collective (see the module docs of
//! [`crate::nccl`] for which are NCCL's own calls and which are grouped send/recv).
//!
//! Every collective first runs the call check (checks.rs), then moves its tensors into device
//! buffers, calls NCCL and turns the results back into tensors (buffers.rs). send and recv skip
//! the check: it is an all_gather over the group, and only two of its ranks take part. A wrong
//! argument found only after the transfer (all_to_all_single's split to itself) is reported after
//! it, so that the peers' calls complete (NCCL cannot time out).
//!
//! Scatter is the one collective whose receivers do not know the size: the root first sends a
//! fixed-size head with the shape (`shape_head`, `read_head`).

use cudarc::nccl::{self as nc, Comm};

use super::NcclComm;
use super::shared::{DevBuf, Part};
use crate::backend::Device;
use crate::collective::{
    CallSig, Communicator, Group, Kind, ReduceOp, Spec, check_pairs, list_shape,
};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Elements of scatter's shape head: the number of dimensions, then up to 8 sizes.
const HEAD: usize = 9;

/// Scatter's head marker for "the root's shape does not fit the head": every rank fails.
const HEAD_REFUSED: u32 = u32::MAX;

/// NCCL's reduction for ours (AVG is NCCL's own).
pub(super) fn to_nccl(op: ReduceOp) -> nc::ReduceOp {
    match op {
        ReduceOp::Sum => nc::ReduceOp::Sum,
        ReduceOp::Avg => nc::ReduceOp::Avg,
        ReduceOp::Prod => nc::ReduceOp::Prod,
        ReduceOp::Min => nc::ReduceOp::Min,
        ReduceOp::Max => nc::ReduceOp::Max,
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn world(&self) -> Group {
        Group::new(0, (0..self.world).collect(), self.world, self.rank)
            .expect("0..world is a valid group")
    }

    /// The device results without an input go to ([`NcclOptions::device`]; the shared GPU when
    /// the data path is shared and no device was given).
    ///
    /// [`NcclOptions::device`]: super::NcclOptions::device
    fn device(&self) -> Device {
        self.opts.device.clone()
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Group> {
        let id = self.next_group.get();
        let g = Group::new(id, ranks.to_vec(), self.world, self.rank)?;
        self.next_group.set(id + 1);
        if let Some(me) = g.rank() {
            self.join_group(id, me, g.size())?;
        }
        Ok(g)
    }

    async fn broadcast(&self, x: &Tensor, root: usize, group: &Group) -> Result<Tensor> {
        let (c, me) = self.comm(group, "broadcast")?;
        let sig = group
            .check_rank("broadcast", "root", root)
            .map(|()| Spec::Broadcast { root }.sig().shape(x.shape()));
        self.check_args(&c, group, sig)?;
        let dev = x.device();
        let mut recv = self.output("broadcast", x.numel(), &dev)?;
        if me == root {
            let send = self.input("broadcast", &[x])?;
            c.broadcast(Some(&send), &mut recv, root as i32)
        } else {
            c.broadcast(None::<&DevBuf>, &mut recv, root as i32)
        }
        .map_err(|e| self.err("broadcast", e))?;
        self.finish_one("broadcast", recv, x.shape(), &dev)
    }

    async fn reduce(
        &self,
        x: &Tensor,
        root: usize,
        op: ReduceOp,
        group: &Group,
    ) -> Result<Option<Tensor>> {
        let (c, me) = self.comm(group, "reduce")?;
        let sig = group
            .check_rank("reduce", "root", root)
            .map(|()| Spec::Reduce { root, op }.sig().shape(x.shape()));
        self.check_args(&c, group, sig)?;
        let dev = x.device();
        let send = self.input("reduce", &[x])?;
        let mut recv = if me == root {
            Some(self.output("reduce", x.numel(), &dev)?)
        } else {
            None
        };
        c.reduce(&send, recv.as_mut(), &to_nccl(op), root as i32)
            .map_err(|e| self.err("reduce", e))?;
        match recv {
            Some(recv) => Ok(Some(self.finish_one("reduce", recv, x.shape(), &dev)?)),
            None => {
                // Keep the stream ordered before `send` is freed.
                self.stream
                    .synchronize()
                    .map_err(|e| self.err("reduce", e))?;
                Ok(None)
            }
        }
    }

    async fn all_reduce(&self, x: &Tensor, op: ReduceOp, group: &Group) -> Result<Tensor> {
        let (c, _) = self.comm(group, "all_reduce")?;
        self.check(&c, group, &Spec::AllReduce { op }.sig().shape(x.shape()))?;
        let dev = x.device();
        let send = self.input("all_reduce", &[x])?;
        let mut recv = self.output("all_reduce", x.numel(), &dev)?;
        c.all_reduce(&send, &mut recv, &to_nccl(op))
            .map_err(|e| self.err("all_reduce", e))?;
        self.finish_one("all_reduce", recv, x.shape(), &dev)
    }

    async fn gather(&self, x: &Tensor, root: usize, group: &Group) -> Result<Option<Vec<Tensor>>> {
        let (c, me) = self.comm(group, "gather")?;
        let sig = group
            .check_rank("gather", "root", root)
            .map(|()| Spec::Gather { root }.sig().shape(x.shape()));
        self.check_args(&c, group, sig)?;
        let n = x.numel();
        if me != root {
            let send = self.input("gather", &[x])?;
            self.exchange("gather", &c, &[(root, Part::new(&send, 0, n)?)], &mut [])?;
            return Ok(None);
        }
        let dev = x.device();
        let peers: Vec<(usize, usize)> = (0..group.size())
            .filter(|&r| r != me)
            .map(|r| (r, n))
            .collect();
        let mut recvs = self.recv_bufs("gather", &peers, &dev)?;
        self.exchange("gather", &c, &[], &mut recvs)?;
        let mut got = recvs.into_iter();
        let mut out = Vec::with_capacity(group.size());
        for r in 0..group.size() {
            if r == me {
                out.push(x.clone());
            } else if let Some((_, _, b)) = got.next() {
                out.push(self.finish_one("gather", b, x.shape(), &dev)?);
            }
        }
        Ok(Some(out))
    }

    async fn scatter(&self, xs: Option<&[Tensor]>, root: usize, group: &Group) -> Result<Tensor> {
        let (c, me) = self.comm(group, "scatter")?;
        if let Err(e) = group.check_rank("scatter", "root", root) {
            self.check_args(&c, group, Err(e.clone()))?;
            return Err(e);
        }
        if me == root {
            self.scatter_from_root(&c, group, root, xs)
        } else {
            self.check(&c, group, &Spec::Scatter { root }.sig())?;
            self.scatter_from_peer(&c, root)
        }
    }

    async fn all_gather(&self, x: &Tensor, group: &Group) -> Result<Vec<Tensor>> {
        let (c, _) = self.comm(group, "all_gather")?;
        self.check(&c, group, &Spec::AllGather {}.sig().shape(x.shape()))?;
        // Each rank's part takes at least one slot (NCCL refuses empty buffers).
        let slot = x.numel().max(1);
        let dev = x.device();
        let send = self.input("all_gather", &[x])?;
        let mut recv = self.output("all_gather", slot * group.size(), &dev)?;
        c.all_gather(&send, &mut recv)
            .map_err(|e| self.err("all_gather", e))?;
        self.finish("all_gather", recv, x.shape(), group.size(), slot, &dev)
    }

    async fn reduce_scatter(&self, xs: &[Tensor], op: ReduceOp, group: &Group) -> Result<Tensor> {
        let (c, _) = self.comm(group, "reduce_scatter")?;
        let shape = list_shape("reduce_scatter", xs, group.size());
        let sig = shape
            .as_ref()
            .map(|s| Spec::ReduceScatter { op }.sig().shape(s))
            .map_err(Clone::clone);
        self.check_args(&c, group, sig)?;
        let shape = shape?;
        let n = xs[0].numel();
        let dev = xs[0].device();
        let refs: Vec<&Tensor> = xs.iter().collect();
        let send = self.input("reduce_scatter", &refs)?;
        let mut recv = self.output("reduce_scatter", n, &dev)?;
        if n > 0 {
            c.reduce_scatter(&send, &mut recv, &to_nccl(op))
                .map_err(|e| self.err("reduce_scatter", e))?;
        }
        self.finish_one("reduce_scatter", recv, &shape, &dev)
    }

    async fn all_to_all(&self, xs: &[Tensor], group: &Group) -> Result<Vec<Tensor>> {
        let (c, me) = self.comm(group, "all_to_all")?;
        let shape = list_shape("all_to_all", xs, group.size());
        let sig = shape
            .as_ref()
            .map(|s| Spec::AllToAll {}.sig().shape(s))
            .map_err(Clone::clone);
        self.check_args(&c, group, sig)?;
        let shape = shape?;
        let n = xs[0].numel();
        let dev = xs[0].device();
        let peers: Vec<usize> = (0..group.size()).filter(|&r| r != me).collect();
        let bufs: Vec<(usize, DevBuf)> = peers
            .iter()
            .map(|&p| Ok((p, self.input("all_to_all", &[&xs[p]])?)))
            .collect::<Result<_>>()?;
        let sends: Vec<(usize, Part<'_>)> = bufs
            .iter()
            .map(|(p, b)| Ok((*p, Part::new(b, 0, n)?)))
            .collect::<Result<_>>()?;
        let want: Vec<(usize, usize)> = peers.iter().map(|&p| (p, n)).collect();
        let mut recvs = self.recv_bufs("all_to_all", &want, &dev)?;
        self.exchange("all_to_all", &c, &sends, &mut recvs)?;
        let mut got = recvs.into_iter();
        let mut out = Vec::with_capacity(group.size());
        for r in 0..group.size() {
            if r == me {
                // Like every other part of the result, the own part lives on the input's device.
                out.push(xs[me].to_device(&dev)?);
            } else if let Some((_, _, b)) = got.next() {
                out.push(self.finish_one("all_to_all", b, &shape, &dev)?);
            }
        }
        Ok(out)
    }

    async fn all_to_all_single(
        &self,
        x: &Tensor,
        in_splits: &[usize],
        out_splits: &[usize],
        group: &Group,
    ) -> Result<Tensor> {
        let (c, me) = self.comm(group, "all_to_all_single")?;
        let g = group.size();
        let rows = x.shape().first().copied().unwrap_or(0);
        let row: usize = x.shape().iter().skip(1).product();
        let sig = if in_splits.len() != g || out_splits.len() != g {
            Err(Error::invalid(
                "all_to_all_single",
                format!("splits must have {g} entries (group size)"),
            ))
        } else if in_splits.iter().sum::<usize>() != rows {
            Err(Error::invalid(
                "all_to_all_single",
                format!("in_splits {in_splits:?} do not add up to the {rows} rows of the input"),
            ))
        } else {
            Ok(CallSig::new(Kind::AllToAllSingle).extra(vec![row as u64]))
        };
        self.check_args(&c, group, sig)?;
        let dev = x.device();
        let send = self.input("all_to_all_single", &[x])?;
        let mut starts = Vec::with_capacity(g);
        let mut s = 0;
        for &k in in_splits {
            starts.push(s);
            s += k * row;
        }
        let peers: Vec<usize> = (0..g).filter(|&r| r != me).collect();
        let sends: Vec<(usize, Part<'_>)> = peers
            .iter()
            .map(|&p| Ok((p, Part::new(&send, starts[p], in_splits[p] * row)?)))
            .collect::<Result<_>>()?;
        let want: Vec<(usize, usize)> = peers.iter().map(|&p| (p, out_splits[p] * row)).collect();
        let mut recvs = self.recv_bufs("all_to_all_single", &want, &dev)?;
        self.exchange("all_to_all_single", &c, &sends, &mut recvs)?;
        // Checked after the exchange, so that the peers' calls complete (NCCL cannot time out).
        if in_splits[me] != out_splits[me] {
            return Err(Error::invalid(
                "all_to_all_single",
                format!(
                    "rank sends itself {} rows but expects {}",
                    in_splits[me], out_splits[me]
                ),
            ));
        }
        let mut parts = Vec::with_capacity(g);
        let mut got = recvs.iter();
        for r in 0..g {
            if r == me {
                parts.push(Part::new(&send, starts[me], in_splits[me] * row)?);
            } else if let Some((_, n, b)) = got.next() {
                parts.push(Part::new(b, 0, *n)?);
            }
        }
        let mut shape = x.shape().to_vec();
        if shape.is_empty() {
            shape.push(0);
        }
        shape[0] = out_splits.iter().sum();
        self.finish_concat("all_to_all_single", &parts, &shape, &dev)
    }

    async fn send(&self, x: &Tensor, dst: usize, group: &Group) -> Result<()> {
        group.check_rank("send", "dst", dst)?;
        let (c, _) = self.comm(group, "send")?;
        let b = self.input("send", &[x])?;
        self.exchange("send", &c, &[(dst, Part::new(&b, 0, x.numel())?)], &mut [])
    }

    async fn recv(&self, shape: &[usize], src: usize, group: &Group) -> Result<Tensor> {
        group.check_rank("recv", "src", src)?;
        let (c, _) = self.comm(group, "recv")?;
        let n: usize = shape.iter().product();
        let dev = self.opts.device.clone();
        let mut recv = self.recv_bufs("recv", &[(src, n)], &dev)?;
        self.exchange("recv", &c, &[], &mut recv)?;
        let (_, _, b) = recv
            .pop()
            .ok_or_else(|| self.err("recv", "no receive buffer"))?;
        self.finish_one("recv", b, shape, &dev)
    }

    async fn permute(&self, x: &Tensor, pairs: &[(usize, usize)], group: &Group) -> Result<Tensor> {
        let (c, me) = self.comm(group, "permute")?;
        let sig = check_pairs("permute", pairs, group.size()).map(|()| {
            let extra: Vec<u64> = pairs
                .iter()
                .flat_map(|&(a, b)| [a as u64, b as u64])
                .collect();
            CallSig::new(Kind::Permute).shape(x.shape()).extra(extra)
        });
        self.check_args(&c, group, sig)?;
        let n = x.numel();
        let dev = x.device();
        let to: Vec<usize> = pairs.iter().filter(|p| p.0 == me).map(|p| p.1).collect();
        let from: Vec<usize> = pairs.iter().filter(|p| p.1 == me).map(|p| p.0).collect();
        let send = if to.iter().any(|&d| d != me) {
            Some(self.input("permute", &[x])?)
        } else {
            None
        };
        let sends: Vec<(usize, Part<'_>)> = match &send {
            Some(b) => to
                .iter()
                .filter(|&&d| d != me)
                .map(|&d| Ok((d, Part::new(b, 0, n)?)))
                .collect::<Result<_>>()?,
            None => Vec::new(),
        };
        let want: Vec<(usize, usize)> =
            from.iter().filter(|&&s| s != me).map(|&s| (s, n)).collect();
        let mut recvs = self.recv_bufs("permute", &want, &dev)?;
        self.exchange("permute", &c, &sends, &mut recvs)?;
        if let Some((_, _, b)) = recvs.into_iter().next() {
            return self.finish_one("permute", b, x.shape(), &dev);
        }
        if to == [me] {
            return Ok(x.clone());
        }
        // Nobody sends to this rank: zeros (what the in-process group gives).
        Tensor::zeros(x.shape()).to_device(&dev)
    }

    async fn barrier(&self, group: &Group) -> Result<()> {
        let (c, _) = self.comm(group, "barrier")?;
        self.check(&c, group, &Spec::Barrier {}.sig())?;
        let send = self.upload("barrier", &[0.0])?;
        let mut recv = self.zeros("barrier", 1)?;
        c.all_reduce(&send, &mut recv, &nc::ReduceOp::Sum)
            .map_err(|e| self.err("barrier", e))?;
        self.stream
            .synchronize()
            .map_err(|e| self.err("barrier", e))
    }

    async fn abort(&self, reason: &str) {
        // NCCL cannot tell the peers; dropping the communicators aborts them locally, and the
        // peers' pending calls fail when NCCL notices (or hang: NCCL has no receive timeout).
        let _ = reason;
        self.comms.borrow_mut().clear();
    }
}

/// Scatter's two sides.
impl NcclComm {
    /// The root's side: check the list, send every peer the shape head, then its tensor.
    fn scatter_from_root(
        &self,
        c: &Comm,
        group: &Group,
        root: usize,
        xs: Option<&[Tensor]>,
    ) -> Result<Tensor> {
        let args = xs
            .ok_or_else(|| {
                Error::invalid(
                    "scatter",
                    format!("the root (group rank {root}) must pass the list"),
                )
            })
            .and_then(|xs| Ok((xs, list_shape("scatter", xs, group.size())?)));
        let (xs, shape) = match args {
            Ok(a) => a,
            Err(e) => {
                self.check_args(c, group, Err(e.clone()))?;
                return Err(e);
            }
        };
        self.check(c, group, &Spec::Scatter { root }.sig().shape(&shape))?;
        let peers: Vec<usize> = (0..group.size()).filter(|&r| r != root).collect();
        self.send_head(c, &peers, &shape)?;
        let n = xs[root].numel();
        let bufs: Vec<(usize, DevBuf)> = peers
            .iter()
            .map(|&p| Ok((p, self.input("scatter", &[&xs[p]])?)))
            .collect::<Result<_>>()?;
        let sends: Vec<(usize, Part<'_>)> = bufs
            .iter()
            .map(|(p, b)| Ok((*p, Part::new(b, 0, n)?)))
            .collect::<Result<_>>()?;
        self.exchange("scatter", c, &sends, &mut [])?;
        Ok(xs[root].clone())
    }

    /// Tell the `peers` the shape (a fixed-size head: NCCL needs equal counts on both sides). A
    /// shape the head cannot hold is sent as the marker `HEAD_REFUSED`, so every rank fails here
    /// instead of waiting for data; the root fails after sending it.
    fn send_head(&self, c: &Comm, peers: &[usize], shape: &[usize]) -> Result<()> {
        let (head, fits) = shape_head(shape);
        let head = DevBuf::Cuda(self.upload("scatter", &head)?);
        let heads: Vec<(usize, Part<'_>)> = peers
            .iter()
            .map(|&p| Ok((p, Part::new(&head, 0, HEAD)?)))
            .collect::<Result<_>>()?;
        self.exchange("scatter", c, &heads, &mut [])?;
        if !fits {
            return Err(Error::invalid(
                "scatter",
                format!(
                    "shape {shape:?} cannot be sent to the other ranks: at most {} dimensions of at most {} elements",
                    HEAD - 1,
                    u32::MAX
                ),
            ));
        }
        Ok(())
    }

    /// A receiver's side: the head from `root`, then a tensor of the shape it names.
    fn scatter_from_peer(&self, c: &Comm, root: usize) -> Result<Tensor> {
        let shape = self.recv_head(c, root)?;
        let n: usize = shape.iter().product();
        let dev = self.opts.device.clone();
        let mut recv = self.recv_bufs("scatter", &[(root, n)], &dev)?;
        self.exchange("scatter", c, &[], &mut recv)?;
        let (_, _, b) = recv
            .pop()
            .ok_or_else(|| self.err("scatter", "no receive buffer"))?;
        self.finish_one("scatter", b, &shape, &dev)
    }

    /// The shape `root` sent in its head (an error when it sent `HEAD_REFUSED`).
    fn recv_head(&self, c: &Comm, root: usize) -> Result<Vec<usize>> {
        let mut head = [(root, HEAD, DevBuf::Cuda(self.zeros("scatter", HEAD)?))];
        self.exchange("scatter", c, &[], &mut head)?;
        let head = match &head[0].2 {
            DevBuf::Cuda(b) => self.download("scatter", b, HEAD)?,
            DevBuf::Shared(_) => {
                return Err(self.err("scatter", "the shape head was not a CUDA buffer"));
            }
        };
        read_head(&head, root)
    }
}

/// Scatter's head for `shape`, and whether the shape fits it. The numbers travel as the bits of
/// u32s in f32 slots (exact at any size); a shape that does not fit is sent as `HEAD_REFUSED`.
fn shape_head(shape: &[usize]) -> (Vec<f32>, bool) {
    let fits = shape.len() < HEAD && shape.iter().all(|&d| u32::try_from(d).is_ok());
    let mut head = vec![f32::from_bits(0); HEAD];
    head[0] = f32::from_bits(if fits {
        shape.len() as u32
    } else {
        HEAD_REFUSED
    });
    if fits {
        for (h, &d) in head[1..].iter_mut().zip(shape) {
            *h = f32::from_bits(d as u32);
        }
    }
    (head, fits)
}

/// The shape in a head from [`shape_head`] (`root` names the sender in the error).
fn read_head(head: &[f32], root: usize) -> Result<Vec<usize>> {
    let ndim = head.first().map_or(HEAD_REFUSED, |h| h.to_bits());
    match head.get(1..1 + ndim as usize) {
        Some(dims) if ndim != HEAD_REFUSED => {
            Ok(dims.iter().map(|d| d.to_bits() as usize).collect())
        }
        _ => Err(Error::invalid(
            "scatter",
            format!(
                "the root (group rank {root}) passed a shape that cannot be sent: more than {} dimensions, or one over {} elements",
                HEAD - 1,
                u32::MAX
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shape_travels_in_the_scatter_head() {
        for shape in [
            vec![],
            vec![0],
            vec![2, 3],
            vec![1; HEAD - 1],
            vec![u32::MAX as usize],
        ] {
            let (head, fits) = shape_head(&shape);
            assert!(fits, "{shape:?}");
            assert_eq!(head.len(), HEAD);
            assert_eq!(read_head(&head, 0).unwrap(), shape);
        }
    }

    #[test]
    fn a_shape_the_head_cannot_hold_is_refused_on_both_sides() {
        for shape in [vec![1; HEAD], vec![u32::MAX as usize + 1]] {
            let (head, fits) = shape_head(&shape);
            assert!(!fits, "{shape:?}");
            let err = read_head(&head, 3).unwrap_err().to_string();
            assert!(err.contains("group rank 3"), "{err}");
        }
    }
}
