//! A `program` lesson with `"steps"`: the program trained data-parallel. Every rank runs the
//! program forward and backward on its own inputs (its data), the gradients of the trainable
//! inputs (those with gradient) are averaged over the ranks with one all_reduce(AVG), and every
//! rank takes the same step `p -= lr · g`: the replicas stay identical (the same hash on every
//! rank) while the loss falls. With `"sharded": true` the parameters are held as the program
//! holds them (each rank its own shard): each rank steps its own with its own gradient, and the
//! program's collectives (and their duals) carry all the communication; the hash is then of the
//! parameters marked `"replicated"` (none in a purely sharded layer).

use super::*;
use crate::program::run_rank;

/// How a lesson trains (its [`View::Train`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct How {
    /// Training steps.
    pub(super) steps: usize,
    /// Learning rate.
    pub(super) lr: f32,
    /// Parameters as the program holds them, each rank stepping its own (no averaging).
    pub(super) sharded: bool,
}

/// Train the lesson's program (see the module docs).
pub(super) async fn run<T: Transport>(
    comm: &P2p<T>,
    lesson: &Lesson,
    plan: &Plan,
    how: How,
) -> Result<Vec<RankStep>> {
    let t = Trainer::new(lesson, plan, how)?;
    let mut inputs: Vec<Tensor> = plan.inputs(comm.rank()).to_vec();
    let mut out = vec![t.start(comm.rank(), &inputs)?];
    for k in 1..=how.steps {
        out.push(t.step(comm, k, &mut inputs).await?);
    }
    Ok(out)
}

/// The trainable inputs of `plan` (those with gradient), by index: what both the ranks and one
/// device step.
pub(super) fn trainable(plan: &Plan) -> Vec<usize> {
    let inputs = &plan.program().inputs;
    (0..inputs.len()).filter(|&i| inputs[i].grad).collect()
}

/// A training run's fixed parts: what is trained and how fast.
struct Trainer<'a> {
    lesson: &'a Lesson,
    plan: &'a Plan,
    /// The trainable inputs (with gradient), by index in the program.
    trainable: Vec<usize>,
    how: How,
}

impl<'a> Trainer<'a> {
    /// The parameters: the inputs with gradient, held by every rank and equal everywhere (else
    /// the replicas would start apart).
    fn new(lesson: &'a Lesson, plan: &'a Plan, how: How) -> Result<Self> {
        let inputs = &plan.program().inputs;
        let trainable = trainable(plan);
        if trainable.is_empty() {
            return Err(lesson.error("training needs an input with gradient (a parameter)".into()));
        }
        if let Some(&i) = trainable
            .iter()
            .find(|&&i| !how.sharded && !plan.same_on_every_rank(i))
        {
            return Err(lesson.error(format!(
                "parameter {:?} must start equal on every rank (give it a \"value\" or make it \
                 \"replicated\"; data without gradient may differ per rank)",
                inputs[i].name
            )));
        }
        Ok(Trainer {
            lesson,
            plan,
            trainable,
            how,
        })
    }

    /// The parameters' names.
    fn names(&self) -> String {
        let inputs = &self.plan.program().inputs;
        let names: Vec<&str> = self
            .trainable
            .iter()
            .map(|&i| inputs[i].name.as_str())
            .collect();
        names.join(", ")
    }

    /// The parameters as shown (nothing where this rank holds none), and the hash of those
    /// every rank holds alike (all of them, data-parallel; sharded, those marked
    /// `"replicated"`): equal on every rank. A sharded layer with no replicated parameter has no
    /// hash.
    fn shown(&self, me: usize, inputs: &[Tensor]) -> Result<Vec<Named>> {
        let program = self.plan.program();
        let mut v = Vec::with_capacity(self.trainable.len() + 1);
        let mut all = Vec::new();
        let mut replicated = false;
        for &i in &self.trainable {
            if !self.plan.holds(me, i) {
                v.push(Named::tensors(&program.inputs[i].name, Vec::new()));
                continue;
            }
            v.push(Named::tensors(
                &program.inputs[i].name,
                vec![TensorJson::from_tensor(&inputs[i])?],
            ));
            if !self.how.sharded || program.inputs[i].replicated {
                all.extend(inputs[i].try_to_vec()?);
                replicated = true;
            }
        }
        if replicated {
            v.push(Named::text("replica hash", crate::train::param_hash(&all)));
        }
        Ok(v)
    }

    /// The first step: the parameters, and which inputs are this rank's own data.
    fn start(&self, me: usize, inputs: &[Tensor]) -> Result<RankStep> {
        let data: Vec<&str> = self
            .plan
            .program()
            .inputs
            .iter()
            .filter(|i| !i.grad)
            .map(|i| i.name.as_str())
            .collect();
        let own = if data.is_empty() {
            String::new()
        } else {
            format!("; its own data {}", data.join(", "))
        };
        let held = if self.how.sharded {
            "each rank its own shard"
        } else {
            "the same on every rank"
        };
        Ok(step(
            format!("rank {me}: parameters {} ({held}){own}", self.names()),
            Phase::Input,
            Vec::new(),
            self.shown(me, inputs)?,
        ))
    }

    /// Training step `k`: forward and backward on this rank's data, the parameters' gradients
    /// averaged over the ranks in one bucket, every rank's `p -= lr · g`.
    async fn step<T: Transport>(
        &self,
        comm: &P2p<T>,
        k: usize,
        inputs: &mut [Tensor],
    ) -> Result<RankStep> {
        let run = run_rank(comm, self.plan, Some(inputs), true).await?;
        let loss = run.loss.ok_or_else(|| {
            self.lesson.error(format!(
                "rank {} has no loss `{}` to train on",
                comm.rank(),
                self.plan.program().loss
            ))
        })?;
        let me = comm.rank();
        let mut g = Vec::new();
        for &i in &self.trainable {
            match &run.grads[i] {
                Some(x) => g.extend_from_slice(x),
                None => g.extend(std::iter::repeat_n(0.0, inputs[i].numel())),
            }
        }
        let (group, device) = (comm.world(), comm.options().device.clone());
        // Data-parallel: the replicas' gradients averaged in one bucket; sharded: each rank's
        // own, as its program's duals left it.
        let g = if self.how.sharded {
            g
        } else {
            let len = g.len();
            let g = Tensor::from_vec(g, &[len])?.to_device(&device)?;
            comm.all_reduce(&g, ReduceOp::Avg, &group)
                .await?
                .read()
                .await?
        };
        let local = Tensor::from_vec(vec![loss], &[1])?.to_device(&device)?;
        let group_loss = comm.all_reduce(&local, ReduceOp::Avg, &group).await?;
        comm.take_calls();
        self.update(me, inputs, &g)?;
        let mut values = vec![
            Named::tensors(
                "loss",
                vec![TensorJson::from_tensor(&Tensor::vector(&[loss]))?],
            ),
            Named::tensors("group loss", vec![read(&group_loss).await?]),
        ];
        values.extend(self.shown(me, inputs)?);
        let (label, arrows) = if self.how.sharded {
            (
                format!(
                    "step {k}: forward and backward through the program's collectives, each rank {} -= {}·g on its own shard",
                    self.names(),
                    self.how.lr
                ),
                Vec::new(),
            )
        } else {
            (
                format!(
                    "step {k}: gradients on each rank's data, all_reduce(AVG) of them, {} -= {}·g",
                    self.names(),
                    self.how.lr
                ),
                arrows(Kind::AllReduce, comm.world_size(), 0, &[]),
            )
        };
        Ok(step(label, Phase::Train, arrows, values))
    }

    /// `p -= lr · g` for every parameter this rank holds, `g` their gradients one after the
    /// other.
    fn update(&self, me: usize, inputs: &mut [Tensor], g: &[f32]) -> Result<()> {
        let mut at = 0;
        for &i in &self.trainable {
            if !self.plan.holds(me, i) {
                at += inputs[i].numel();
                continue;
            }
            let p = inputs[i].try_to_vec()?;
            let next: Vec<f32> = p
                .iter()
                .zip(&g[at..at + p.len()])
                .map(|(w, d)| w - self.how.lr * d)
                .collect();
            at += p.len();
            inputs[i] = Tensor::from_vec(next, inputs[i].shape())?;
        }
        Ok(())
    }
}
