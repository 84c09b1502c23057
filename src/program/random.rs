//! Random programs (in the spirit of JAX's `sample_shmap`): compositions of local ops and every
//! kind of collective over worlds 1..=8, subgroups in any rank order, every reduce op, uneven
//! splits, send / recv, both objective conventions. A generated program may still be refused by
//! [`Program::plan`] (the replicated objective forbids some rank-limited steps); callers skip those.
//!
//! Every value of a generated program exists on every rank with one shape, so any value can feed
//! the next step: a collective's output is given on the ranks outside its group (or off its
//! root) by a local step of the same shape on those ranks.

use super::{Input, LocalOp, ObjectiveName, Program, Step, StepKind};
use crate::collective::{ReduceOp, Spec};

/// What to generate.
#[derive(Debug, Clone)]
pub struct RandomOptions {
    /// Largest world (at least 1).
    pub max_world: usize,
    /// Largest number of generated operations.
    pub max_ops: usize,
    /// The objective convention (`None`: either).
    pub objective: Option<ObjectiveName>,
}

impl Default for RandomOptions {
    fn default() -> Self {
        RandomOptions {
            max_world: 8,
            max_ops: 6,
            objective: None,
        }
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
    fn pick<T: Clone>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())].clone()
    }
    fn shuffle<T>(&mut self, xs: &mut [T]) {
        for i in (1..xs.len()).rev() {
            let j = self.below(i + 1);
            xs.swap(i, j);
        }
    }
}

struct Gen {
    rng: Rng,
    world: usize,
    steps: Vec<Step>,
    /// Live values: (name, shape), each on every rank.
    pool: Vec<(String, Vec<usize>)>,
    fresh: usize,
}

fn local(op: LocalOp, ins: &[&str], out: &str, ranks: Option<Vec<usize>>) -> Step {
    Step {
        kind: StepKind::Local(op),
        inputs: ins.iter().map(|s| s.to_string()).collect(),
        out: Some(out.to_string()),
        ranks,
        group: None,
        dual: None,
    }
}

impl Gen {
    /// A live value of `shape`, at random (the pool always holds the one just made).
    fn same_shape(&mut self, shape: &[usize]) -> String {
        let same: Vec<String> = self
            .pool
            .iter()
            .filter(|(_, s)| s.as_slice() == shape)
            .map(|(n, _)| n.clone())
            .collect();
        self.rng.pick(&same)
    }

    fn name(&mut self) -> String {
        self.fresh += 1;
        format!("v{}", self.fresh)
    }

    fn others(&self, of: &[usize]) -> Option<Vec<usize>> {
        let o: Vec<usize> = (0..self.world).filter(|r| !of.contains(r)).collect();
        (!o.is_empty()).then_some(o)
    }

    fn collective(
        &mut self,
        spec: Spec,
        ins: Vec<String>,
        out: Option<String>,
        group: &[usize],
        ranks: Option<Vec<usize>>,
    ) {
        let all = group.len() == self.world && group.iter().enumerate().all(|(i, &r)| i == r);
        self.steps.push(Step {
            kind: StepKind::Collective { spec, splits: None },
            inputs: ins,
            out,
            ranks,
            group: (!all).then(|| group.to_vec()),
            dual: None,
        });
    }

    /// `out` on `ranks` as a same-shape function of `x` (fills a value where a collective gave
    /// none).
    fn fill(&mut self, x: &str, out: &str, ranks: Option<Vec<usize>>) {
        if let Some(r) = ranks {
            let op = if self.rng.coin() {
                LocalOp::Tanh {}
            } else {
                LocalOp::Scale { by: 0.5 }
            };
            self.steps.push(local(op, &[x], out, Some(r)));
        }
    }

    /// `out = concat(x, x, ...)` (k times, dim 0) on `ranks`.
    fn fill_concat(&mut self, x: &str, k: usize, out: &str, ranks: Option<Vec<usize>>) {
        if let Some(r) = ranks {
            let ins = vec![x; k];
            self.steps
                .push(local(LocalOp::Concat { dim: 0 }, &ins, out, Some(r)));
        }
    }

    fn group(&mut self) -> Vec<usize> {
        let mut ranks: Vec<usize> = (0..self.world).collect();
        if self.world > 1 && self.rng.below(3) == 0 {
            // A subgroup, in a shuffled order (group rank i = ranks[i]).
            self.rng.shuffle(&mut ranks);
            ranks.truncate(self.rng.range(1, self.world));
        } else if self.rng.below(4) == 0 {
            self.rng.shuffle(&mut ranks);
        }
        ranks
    }

    fn op(&mut self) -> ReduceOp {
        self.rng.pick(&ReduceOp::ALL)
    }

    /// One generated operation, adding a value to the pool.
    fn step(&mut self) {
        let (x, shape) = self.rng.pick(&self.pool);
        let out = self.name();
        let made = match self.rng.below(12) {
            0 | 1 => self.unary(&x, &out, shape),
            2 => self.binary(&x, &out, shape),
            3 if shape.len() == 2 => self.matmul(&x, &out, &shape),
            3 | 4 => self.all_reduce(&x, &out, shape),
            5 => self.rooted(&x, &out, shape),
            6 if !shape.is_empty() => self.gathered(&x, &out, &shape),
            6 | 7 => self.spread(&x, &out, shape),
            8 if shape.len() == 2 => self.uneven_rows(&x, &out, &shape),
            8 | 9 => self.permuted(&x, &out, shape),
            _ if self.world > 1 => self.sent(&x, &out, shape),
            _ => {
                self.steps.push(local(LocalOp::Tanh {}, &[&x], &out, None));
                shape
            }
        };
        self.pool.push((out, made));
    }

    /// `out = f(x)` elementwise; each of these returns the new value's shape.
    fn unary(&mut self, x: &str, out: &str, shape: Vec<usize>) -> Vec<usize> {
        let op = self.rng.pick(&[
            LocalOp::Tanh {},
            LocalOp::Scale { by: -1.5 },
            LocalOp::Square {},
        ]);
        self.steps.push(local(op, &[x], out, None));
        shape
    }

    /// A binary op with another value of the same shape.
    fn binary(&mut self, x: &str, out: &str, shape: Vec<usize>) -> Vec<usize> {
        let y = self.same_shape(&shape);
        let op = self
            .rng
            .pick(&[LocalOp::Add {}, LocalOp::Sub {}, LocalOp::Mul {}]);
        self.steps.push(local(op, &[x, &y], out, None));
        shape
    }

    /// `out = x · xᵀ` (the transpose as a reshape of the values).
    fn matmul(&mut self, x: &str, out: &str, shape: &[usize]) -> Vec<usize> {
        let t = self.name();
        self.steps.push(local(
            LocalOp::Reshape {
                shape: vec![shape[1], shape[0]],
            },
            &[x],
            &t,
            None,
        ));
        self.steps
            .push(local(LocalOp::Matmul {}, &[x, &t], out, None));
        vec![shape[0], shape[0]]
    }

    fn all_reduce(&mut self, x: &str, out: &str, shape: Vec<usize>) -> Vec<usize> {
        let g = self.group();
        let spec = Spec::AllReduce { op: self.op() };
        self.collective(spec, vec![x.to_string()], Some(out.to_string()), &g, None);
        let rest = self.others(&g);
        self.fill(x, out, rest);
        shape
    }

    /// A broadcast from, or a reduce to, a root of a group.
    fn rooted(&mut self, x: &str, out: &str, shape: Vec<usize>) -> Vec<usize> {
        let g = self.group();
        let root = self.rng.below(g.len());
        let ins = vec![x.to_string()];
        if self.rng.coin() {
            self.collective(
                Spec::Broadcast { root },
                ins,
                Some(out.to_string()),
                &g,
                None,
            );
            let rest = self.others(&g);
            self.fill(x, out, rest);
        } else {
            let spec = Spec::Reduce {
                root,
                op: self.op(),
            };
            self.collective(spec, ins, Some(out.to_string()), &g, None);
            let rest = self.others(&[g[root]]);
            self.fill(x, out, rest);
        }
        shape
    }

    /// all_gather, or gather to a root, joined along dim 0.
    fn gathered(&mut self, x: &str, out: &str, shape: &[usize]) -> Vec<usize> {
        let g = self.group();
        let n = g.len();
        let list = self.name();
        let parts: Vec<String> = (0..n).map(|k| format!("{list}.{k}")).collect();
        let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
        let (holders, spec) = if self.rng.coin() {
            (g.clone(), Spec::AllGather {})
        } else {
            let root = self.rng.below(n);
            (vec![g[root]], Spec::Gather { root })
        };
        self.collective(spec, vec![x.to_string()], Some(list.clone()), &g, None);
        self.steps.push(local(
            LocalOp::Concat { dim: 0 },
            &refs,
            out,
            Some(holders.clone()),
        ));
        let rest = self.others(&holders);
        self.fill_concat(x, n, out, rest);
        let mut s = shape.to_vec();
        if let Some(d) = s.first_mut() {
            *d *= n;
        }
        s
    }

    /// scatter / reduce_scatter / all_to_all of a list made from x.
    fn spread(&mut self, x: &str, out: &str, shape: Vec<usize>) -> Vec<usize> {
        let g = self.group();
        let n = g.len();
        let ins = vec![x.to_string(); n];
        let o = Some(out.to_string());
        match self.rng.below(3) {
            0 => {
                let root = self.rng.below(n);
                self.collective(Spec::Scatter { root }, ins, o, &g, None);
            }
            1 => {
                let spec = Spec::ReduceScatter { op: self.op() };
                self.collective(spec, ins, o, &g, None);
            }
            _ => {
                let list = self.name();
                self.collective(Spec::AllToAll {}, ins, Some(list.clone()), &g, None);
                let parts: Vec<String> = (0..n).map(|k| format!("{list}.{k}")).collect();
                // Sum the received parts back to x's shape.
                let mut acc = parts[0].clone();
                for p in &parts[1..] {
                    let t = self.name();
                    self.steps
                        .push(local(LocalOp::Add {}, &[&acc, p], &t, Some(g.clone())));
                    acc = t;
                }
                self.steps.push(local(
                    LocalOp::Scale { by: 1.0 },
                    &[&acc],
                    out,
                    Some(g.clone()),
                ));
            }
        }
        let rest = self.others(&g);
        self.fill(x, out, rest);
        shape
    }

    /// An uneven all_to_all_single over the rows, summed to a scalar.
    fn uneven_rows(&mut self, x: &str, out: &str, shape: &[usize]) -> Vec<usize> {
        let g = self.group();
        let n = g.len();
        let rows = shape[0];
        let splits: Vec<Vec<usize>> = (0..n)
            .map(|_| {
                let mut s = vec![0; n];
                for _ in 0..rows {
                    let j = self.rng.below(n);
                    s[j] += 1;
                }
                s
            })
            .collect();
        let y = self.name();
        self.steps.push(Step {
            kind: StepKind::Collective {
                spec: Spec::AllToAllSingle {
                    in_splits: vec![],
                    out_splits: vec![],
                },
                splits: Some(super::Splits {
                    in_splits: splits,
                    out_splits: None,
                }),
            },
            inputs: vec![x.to_string()],
            out: Some(y.clone()),
            ranks: None,
            group: Some(g.clone()),
            dual: None,
        });
        let t = self.name();
        self.steps
            .push(local(LocalOp::Tanh {}, &[&y], &t, Some(g.clone())));
        self.steps
            .push(local(LocalOp::Sum {}, &[&t], out, Some(g.clone())));
        if let Some(rest) = self.others(&g) {
            self.steps
                .push(local(LocalOp::Sum {}, &[x], out, Some(rest)));
        }
        vec![]
    }

    /// A permutation (partial) of the group.
    fn permuted(&mut self, x: &str, out: &str, shape: Vec<usize>) -> Vec<usize> {
        let g = self.group();
        let n = g.len();
        let mut dst: Vec<usize> = (0..n).collect();
        self.rng.shuffle(&mut dst);
        let pairs: Vec<(usize, usize)> =
            (0..n).zip(dst).filter(|_| self.rng.below(4) != 0).collect();
        let spec = Spec::Permute { perm: pairs };
        self.collective(spec, vec![x.to_string()], Some(out.to_string()), &g, None);
        let rest = self.others(&g);
        self.fill(x, out, rest);
        shape
    }

    /// send / recv between two ranks of a group.
    fn sent(&mut self, x: &str, out: &str, shape: Vec<usize>) -> Vec<usize> {
        let mut g = self.group();
        if g.len() < 2 {
            g = (0..self.world).collect();
        }
        let (s, d) = (self.rng.below(g.len()), self.rng.below(g.len() - 1));
        let d = if d >= s { d + 1 } else { d };
        let ins = vec![x.to_string()];
        self.collective(Spec::Send { dst: d }, ins, None, &g, Some(vec![g[s]]));
        let recv = Spec::Recv {
            src: s,
            shape: shape.clone(),
        };
        self.collective(recv, vec![], Some(out.to_string()), &g, Some(vec![g[d]]));
        let rest = self.others(&[g[d]]);
        self.fill(x, out, rest);
        shape
    }
}

/// A random program from `seed` (the same seed gives the same program).
pub fn random_program(seed: u64, o: &RandomOptions) -> Program {
    let mut rng = Rng(seed ^ 0x0D15_76AD);
    let world = rng.range(1, o.max_world.max(1));
    let objective = o.objective.unwrap_or_else(|| {
        if rng.below(3) == 0 {
            ObjectiveName::Replicated
        } else {
            ObjectiveName::SumOfRankLosses
        }
    });
    let n_inputs = rng.range(1, 2);
    let inputs: Vec<Input> = (0..n_inputs)
        .map(|i| {
            let shape = if rng.coin() {
                vec![rng.range(1, 3), rng.range(1, 2)]
            } else {
                vec![rng.range(1, 3)]
            };
            Input {
                name: format!("x{i}"),
                shape: Some(shape),
                shapes: None,
                ranks: None,
                values: None,
                value: None,
                per_rank: None,
                seed: Some(seed.wrapping_add(i as u64)),
                range: None,
                grad: true,
                replicated: rng.below(3) == 0,
            }
        })
        .collect();
    let mut g = Gen {
        rng,
        world,
        steps: Vec::new(),
        pool: inputs
            .iter()
            .map(|i| (i.name.clone(), i.shape.clone().unwrap_or_default()))
            .collect(),
        fresh: 0,
    };
    let ops = g.rng.range(1, o.max_ops.max(1));
    for _ in 0..ops {
        g.step();
    }
    // The loss: the sum of the last value times a value of the same shape.
    let (last, shape) = g.pool.last().cloned().unwrap_or_default();
    let other = g.same_shape(&shape);
    let p = g.name();
    g.steps
        .push(local(LocalOp::Mul {}, &[&last, &other], &p, None));
    g.steps.push(local(LocalOp::Sum {}, &[&p], "loss", None));
    Program {
        format: None,
        title: Some(format!("random program {seed}")),
        world,
        objective,
        inputs,
        steps: g.steps,
        loss: "loss".into(),
    }
}
