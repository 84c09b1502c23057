//! The `objectives` lesson: one program differentiated under both objective conventions; the
//! gradients differ by exactly the world size.

use super::*;

pub(super) async fn run<T: Transport>(comm: &P2p<T>) -> Result<Vec<RankStep>> {
    let me = comm.rank();
    let n = comm.world_size();
    let device = comm.options().device.clone();
    let group = comm.world();
    let x0 = Tensor::from_vec(vec![me as f32 + 1.0, 2.0], &[2])?.to_device(&device)?;
    let all = arrows(Kind::AllReduce, n, 0, &[]);
    let mut out = vec![step(
        "inputs".into(),
        Phase::Input,
        Vec::new(),
        vec![Named::tensors("x", vec![read(&x0).await?])],
    )];
    let mut grads = Vec::new();
    for objective in [Objective::SumOfRankLosses, Objective::Replicated] {
        let tape = Tape::with_objective(objective);
        let x = tape.var(x0.clone());
        let s = dist::all_reduce(comm, &x, ReduceOp::Sum, &group).await?;
        comm.take_calls();
        let loss = s.square()?.sum()?.scale(0.5)?;
        if objective == Objective::SumOfRankLosses {
            let mut f = step(
                "forward: s = all_reduce(SUM, x); loss = 0.5·sum(s²)".into(),
                Phase::Forward,
                all.clone(),
                vec![
                    Named::tensors("s", vec![read(&s.value()).await?]),
                    Named::tensors("loss", vec![read(&loss.value()).await?]),
                ],
            );
            f.collective = Some("all_reduce(op=sum)".into());
            out.push(f);
        }
        let g = tape.backward(&loss, comm).await?.wrt(&x)?;
        let dual = duals(comm);
        let (label, arrows) = match objective {
            Objective::SumOfRankLosses => (
                "backward, objective = SUM of every rank's loss: dL/dx = N·s",
                reversed(&all),
            ),
            Objective::Replicated => (
                "backward, objective = the ONE replicated loss: dL/dx = s",
                Vec::new(),
            ),
        };
        let mut b = step(
            format!("{label} (ran: {})", dual.clone().unwrap_or_default()),
            Phase::Backward,
            arrows,
            vec![Named::tensors("dL/dx", vec![read(&g).await?])],
        );
        b.collective = dual;
        out.push(b);
        grads.push(g);
    }
    let ratio = grads[0].div(&grads[1])?;
    out.push(step(
        format!("the two gradients differ by the factor N = {n}"),
        Phase::Result,
        Vec::new(),
        vec![Named::tensors("ratio", vec![read(&ratio).await?])],
    ));
    Ok(out)
}
