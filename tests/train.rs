//! `distgrad train`: the data-parallel step written with replicated parameters gets its gradient
//! all_reduce from the dual of "make varying"; checked against gradients computed rank by rank on a
//! plain local tape, and replicas stay bitwise identical on 1..5 ranks.

use distgrad::backend::Device;
use distgrad::train::{TrainConfig, initial_params, shard, train};
use distgrad::{CommOptions, Tape, Tensor};

/// Rank `r`'s local gradient (no collectives: one process, one tape) at the initial parameters.
fn local_grads(r: usize, n: usize) -> Vec<Vec<f32>> {
    let out = distgrad::run_local(1, CommOptions::default(), |c| async move {
        let (x, y) = shard(r, n, &Device::Cpu)?;
        let tape = Tape::new();
        let vars = initial_params()
            .into_iter()
            .map(|(v, s)| Ok(tape.var(Tensor::from_vec(v, &s)?)))
            .collect::<distgrad::Result<Vec<_>>>()?;
        let (xv, yv) = (tape.constant(x), tape.constant(y));
        let h = xv.matmul(&vars[0])?.add(&vars[1])?.tanh()?;
        let loss = h.matmul(&vars[2])?.add(&vars[3])?.mse_loss(&yv)?;
        let g = tape.backward(&loss, &c).await?;
        vars.iter()
            .map(|v| Ok(g.wrt(v)?.to_vec()))
            .collect::<distgrad::Result<Vec<_>>>()
    });
    out.into_iter().next().unwrap().unwrap()
}

#[test]
fn one_step_equals_the_mean_of_the_ranks_local_gradients() {
    let (world, n, lr) = (3, 16, 0.5);
    let cfg = TrainConfig {
        steps: 1,
        lr,
        shard: n,
    };
    let reports = distgrad::run_local(world, CommOptions::default(), |comm| {
        let cfg = &cfg;
        async move { train(&comm, cfg, &Device::Cpu, |_, _| {}).await }
    });
    let locals: Vec<Vec<Vec<f32>>> = (0..world).map(|r| local_grads(r, n)).collect();
    let init: Vec<f32> = initial_params().into_iter().flat_map(|(v, _)| v).collect();
    // Flatten each rank's gradients in parameter order, then average over the ranks.
    let flat: Vec<Vec<f32>> = locals.iter().map(|l| l.concat()).collect();
    let want: Vec<f32> = init
        .iter()
        .enumerate()
        .map(|(k, p)| p - lr * flat.iter().map(|f| f[k]).sum::<f32>() / world as f32)
        .collect();
    for rep in reports {
        let rep = rep.unwrap();
        assert_eq!(rep.params.len(), want.len());
        for (i, (g, w)) in rep.params.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                "param {i}: {g} vs {w}"
            );
        }
    }
}

#[test]
fn replicas_stay_identical_and_the_loss_falls() {
    for world in 1..=5 {
        let cfg = TrainConfig {
            steps: 150,
            lr: 0.2,
            shard: 32,
        };
        let reports: Vec<_> = distgrad::run_local(world, CommOptions::default(), |comm| {
            let cfg = &cfg;
            async move { train(&comm, cfg, &Device::Cpu, |_, _| {}).await }
        })
        .into_iter()
        .map(Result::unwrap)
        .collect();
        for r in &reports[1..] {
            assert_eq!(r.hashes, reports[0].hashes, "world {world}");
            assert_eq!(r.losses, reports[0].losses, "world {world}");
        }
        let l = &reports[0].losses;
        assert!(
            l[l.len() - 1] < l[0] / 5.0,
            "world {world}: {} -> {}",
            l[0],
            l[l.len() - 1]
        );
    }
}

#[test]
fn distgrad_train_cli() {
    let bin = env!("CARGO_BIN_EXE_distgrad");
    let out = std::process::Command::new(bin)
        .args(["train", "--world", "3", "--steps", "50"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("replicas identical on every rank: yes"),
        "{text}"
    );
    let out = std::process::Command::new(bin)
        .args(["train", "--backend", "mpi"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("[possible values: local, nccl]"));
    // Without the feature, or without CUDA, the NCCL backend says why and exits 2 (no panic).
    let out = std::process::Command::new(bin)
        .args(["train", "--backend", "nccl", "--world", "1", "--steps", "2"])
        .env_remove("RANK")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        eprintln!("NCCL present: the nccl backend trained on this machine");
    } else {
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.contains("native-nccl")
                || err.contains("libcuda")
                || err.contains("libnccl")
                || err.contains("GPU"),
            "{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}
