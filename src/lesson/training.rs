//! A `program` lesson with `"steps"`: the program trained data-parallel. Every rank runs the
//! program forward and backward on its own inputs (its data), the gradients of the trainable
//! inputs (those with gradient) are averaged over the ranks with one all_reduce(AVG), and every
//! rank takes the same step `p -= lr · g`: the replicas stay identical (the same hash on every
//! rank) while the loss falls.

use super::*;
use crate::program::run_rank;

/// Train the lesson's program for `steps` steps at learning rate `lr` (see the module docs).
pub(super) async fn run<T: Transport>(
    comm: &P2p<T>,
    lesson: &Lesson,
    plan: &Plan,
    steps: usize,
    lr: f32,
) -> Result<Vec<RankStep>> {
    let t = Trainer::new(lesson, plan, lr)?;
    let mut inputs: Vec<Tensor> = plan.inputs(comm.rank()).to_vec();
    let mut out = vec![t.start(comm.rank(), &inputs)?];
    for k in 1..=steps {
        out.push(t.step(comm, k, &mut inputs).await?);
    }
    Ok(out)
}

/// A training run's fixed parts: what is trained and how fast.
struct Trainer<'a> {
    lesson: &'a Lesson,
    plan: &'a Plan,
    /// The trainable inputs (with gradient), by index in the program.
    trainable: Vec<usize>,
    lr: f32,
}

impl<'a> Trainer<'a> {
    /// The parameters: the inputs with gradient, held by every rank and equal everywhere (else
    /// the replicas would start apart).
    fn new(lesson: &'a Lesson, plan: &'a Plan, lr: f32) -> Result<Self> {
        let inputs = &plan.program().inputs;
        let trainable: Vec<usize> = (0..inputs.len()).filter(|&i| inputs[i].grad).collect();
        if trainable.is_empty() {
            return Err(lesson.error("training needs an input with gradient (a parameter)".into()));
        }
        if let Some(&i) = trainable.iter().find(|&&i| !plan.same_on_every_rank(i)) {
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
            lr,
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

    /// The parameters as shown, and the hash of all of them (equal on every rank).
    fn shown(&self, inputs: &[Tensor]) -> Result<Vec<Named>> {
        let program = self.plan.program();
        let mut v = Vec::with_capacity(self.trainable.len() + 1);
        let mut all = Vec::new();
        for &i in &self.trainable {
            v.push(Named::tensors(
                &program.inputs[i].name,
                vec![TensorJson::from_tensor(&inputs[i])?],
            ));
            all.extend(inputs[i].try_to_vec()?);
        }
        v.push(Named::text("replica hash", crate::train::param_hash(&all)));
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
        Ok(step(
            format!(
                "rank {me}: parameters {} (the same on every rank){own}",
                self.names()
            ),
            Phase::Input,
            Vec::new(),
            self.shown(inputs)?,
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
        let mut g = Vec::new();
        for &i in &self.trainable {
            match &run.grads[i] {
                Some(x) => g.extend_from_slice(x),
                None => g.extend(std::iter::repeat_n(0.0, inputs[i].numel())),
            }
        }
        let (group, device) = (comm.world(), comm.options().device.clone());
        let len = g.len();
        let g = Tensor::from_vec(g, &[len])?.to_device(&device)?;
        let g = comm
            .all_reduce(&g, ReduceOp::Avg, &group)
            .await?
            .read()
            .await?;
        let local = Tensor::from_vec(vec![loss], &[1])?.to_device(&device)?;
        let group_loss = comm.all_reduce(&local, ReduceOp::Avg, &group).await?;
        comm.take_calls();
        self.update(inputs, &g)?;
        let mut values = vec![
            Named::tensors(
                "loss",
                vec![TensorJson::from_tensor(&Tensor::vector(&[loss]))?],
            ),
            Named::tensors("group loss", vec![read(&group_loss).await?]),
        ];
        values.extend(self.shown(inputs)?);
        Ok(step(
            format!(
                "step {k}: gradients on each rank's data, all_reduce(AVG) of them, {} -= {}·g",
                self.names(),
                self.lr
            ),
            Phase::Train,
            arrows(Kind::AllReduce, comm.world_size(), 0, &[]),
            values,
        ))
    }

    /// `p -= lr · g` for every parameter, `g` their gradients one after the other.
    fn update(&self, inputs: &mut [Tensor], g: &[f32]) -> Result<()> {
        let mut at = 0;
        for &i in &self.trainable {
            let p = inputs[i].try_to_vec()?;
            let next: Vec<f32> = p
                .iter()
                .zip(&g[at..at + p.len()])
                .map(|(w, d)| w - self.lr * d)
                .collect();
            at += p.len();
            inputs[i] = Tensor::from_vec(next, inputs[i].shape())?;
        }
        Ok(())
    }
}
