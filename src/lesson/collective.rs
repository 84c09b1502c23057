//! The `collective` lesson: inputs, the collective's arrows forward, cotangents, the same arrows
//! reversed backward (and what the backward pass really ran), gradients.

use super::*;

pub(super) async fn run<T: Transport>(
    comm: &P2p<T>,
    form: &CollectiveForm,
    own_input: Option<Vec<TensorJson>>,
) -> Result<Vec<RankStep>> {
    let me = comm.rank();
    let world = comm.world_size();
    let mut case = form.case(world)?;
    if let Some(x) = own_input {
        let want: Vec<&Vec<usize>> = case.inputs[me].iter().map(|t| &t.shape).collect();
        let got: Vec<&Vec<usize>> = x.iter().map(|t| &t.shape).collect();
        if want != got {
            return Err(Error::Input(format!(
                "rank {me}: edited input has shapes {got:?}, the lesson needs {want:?}"
            )));
        }
        case.inputs[me] = x;
    }
    let which = vjp::parse_collective(&case.collective)?;
    let perm = case.perm.clone().unwrap_or_default();
    let fwd = arrows(which, world, case.root.unwrap_or(0), &perm);
    let mut name = which.name().to_string();
    let mut args = Vec::new();
    if let Some(op) = &case.op {
        args.push(format!("op={op}"));
    }
    if let Some(r) = case.root {
        args.push(format!("root={r}"));
    }
    if !args.is_empty() {
        name = format!("{name}({})", args.join(", "));
    }
    let r = vjp::rank_result(comm, &vjp::Prepared::new(&case)?).await?;
    let cot = case
        .cotangents
        .as_ref()
        .map(|c| c[me].clone())
        .unwrap_or_default();
    let dual = if r.dual.is_empty() {
        "nothing".to_string()
    } else {
        r.dual.join(" + ")
    };
    let mut f = step(
        format!("forward: {name}"),
        Phase::Forward,
        fwd.clone(),
        vec![Named::tensors("y", r.outputs)],
    );
    f.collective = Some(name);
    f.events = r.events.0;
    let mut b = step(
        format!("backward: {dual}"),
        Phase::Backward,
        reversed(&fwd),
        vec![Named::tensors("dL/dx", r.grads)],
    );
    b.collective = Some(dual);
    b.events = r.events.1;
    Ok(vec![
        step(
            "inputs".into(),
            Phase::Input,
            Vec::new(),
            vec![Named::tensors("x", case.inputs[me].clone())],
        ),
        f,
        step(
            "cotangents dL/dy".into(),
            Phase::Cotangent,
            Vec::new(),
            vec![Named::tensors("dL/dy", cot)],
        ),
        b,
    ])
}
