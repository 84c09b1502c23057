//! The `tensor_parallel` lesson: `Y = X·W` with X's rows and W's columns sharded; all_gather
//! forward, reduce_scatter backward.

use super::*;

pub(super) async fn run<T: Transport>(comm: &P2p<T>) -> Result<Vec<RankStep>> {
    let me = comm.rank();
    let n = comm.world_size();
    let device = comm.options().device.clone();
    let group = comm.world();
    let rf = me as f32;
    // X is n×2 with row r on rank r; W is 2×n with column r on rank r.
    let x_r = Tensor::from_vec(vec![rf + 1.0, 1.0 - rf], &[1, 2])?.to_device(&device)?;
    let w_r = Tensor::from_vec(vec![1.0, rf + 1.0], &[2, 1])?.to_device(&device)?;
    let all = arrows(Kind::AllGather, n, 0, &[]);
    let tape = Tape::new();
    let xv = tape.var(x_r.clone());
    let wv = tape.var(w_r.clone());
    let mut out = vec![step(
        "inputs: row r of X and column r of W on rank r".into(),
        Phase::Input,
        Vec::new(),
        vec![
            Named::tensors("X_r", vec![read(&x_r).await?]),
            Named::tensors("W_r", vec![read(&w_r).await?]),
        ],
    )];
    let rows = dist::all_gather(comm, &xv, &group).await?;
    let full = Var::concat(&rows, 0)?;
    let mut f = step(
        "forward: X = all_gather(X_r)".into(),
        Phase::Forward,
        all.clone(),
        vec![Named::tensors("X", vec![read(&full.value()).await?])],
    );
    f.collective = duals(comm);
    out.push(f);
    let y = full.matmul(&wv)?;
    let loss = y.square()?.sum()?.scale(0.5)?;
    out.push(step(
        "forward (local): Y_r = X·W_r, loss_r = 0.5·sum(Y_r²)".into(),
        Phase::Forward,
        Vec::new(),
        vec![
            Named::tensors("Y_r", vec![read(&y.value()).await?]),
            Named::tensors("loss_r", vec![read(&loss.value()).await?]),
        ],
    ));
    let grads = tape.backward(&loss, comm).await?;
    let dual = duals(comm);
    let mut b = step(
        format!(
            "backward: dL/dX_r = {} of the per-rank dY_r·W_rᵀ",
            dual.clone().unwrap_or_default()
        ),
        Phase::Backward,
        reversed(&all),
        vec![
            Named::tensors("dL/dX_r", vec![read(&grads.wrt(&xv)?).await?]),
            Named::tensors("dL/dW_r", vec![read(&grads.wrt(&wv)?).await?]),
        ],
    );
    b.collective = dual;
    out.push(b);
    Ok(out)
}
