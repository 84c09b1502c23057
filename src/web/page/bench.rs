//! The benchmark behind `window.distgrad.benchAllReduce`.

use super::*;

pub(super) async fn bench_all_reduce(numel: usize) -> Result<String> {
    let app = app()?;
    let _busy = app.busy.lock().await;
    let comm = app
        .comm
        .as_ref()
        .ok_or_else(|| Error::Input("no group in single-tab mode".into()))?;
    let x = Tensor::from_vec((0..numel).map(|i| (i % 7) as f32).collect(), &[numel])?
        .to_device(&app.device)?;
    let t0 = now_ms();
    let tape = Tape::new();
    let xv = tape.var(x);
    let group = comm.world();
    let y = dist::all_reduce(comm, &xv, ReduceOp::Sum, &group).await?;
    let loss = y.sum()?;
    let grads = tape.backward(&loss, comm).await?;
    let g = grads.wrt(&xv)?;
    let first = g.slice(0, 0, 1)?.read().await?;
    let ms = now_ms() - t0;
    comm.take_calls();
    // Checksums outside the timed part: every output element is world * (i % 7), every gradient
    // element is world (d/dx of sum(all_reduce(x)) on every rank, summed over ranks).
    let sum = |v: Vec<f32>| v.iter().map(|&x| f64::from(x)).sum::<f64>();
    Ok(serde_json::json!({
        "numel": numel,
        "bytes": numel * 4,
        "ms": ms,
        "grad0": first.first().copied(),
        "y_sum": sum(y.value().read().await?),
        "grad_sum": sum(g.read().await?),
    })
    .to_string())
}
