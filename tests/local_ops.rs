//! Local ops of the tape: finite differences for every primitive, broadcasting, fan-out
//! accumulation, no-grad regions, and a tiny model that trains.

use distgrad::{CommOptions, Error, Tape, Tensor, Var, run_local};

/// Deterministic values in [-1, 1).
fn vals(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Backward on one rank (no collectives involved) of `f`'s scalar output.
fn grads_of(
    inputs: &[Tensor],
    f: &(dyn Fn(&[Var]) -> distgrad::Result<Var> + Sync),
) -> (f32, Vec<Tensor>) {
    let inputs = inputs.to_vec();
    let res = run_local(1, CommOptions::default(), |comm| {
        let inputs = inputs.clone();
        async move {
            let tape = Tape::new();
            let vs: Vec<Var> = inputs.iter().map(|t| tape.var(t.clone())).collect();
            let out = f(&vs)?;
            let g = tape.backward(&out, &comm).await?;
            Ok((
                out.value().item()?,
                vs.iter()
                    .map(|v| g.wrt(v))
                    .collect::<distgrad::Result<Vec<_>>>()?,
            ))
        }
    });
    res.into_iter().next().unwrap().unwrap()
}

/// Compare the tape's gradient with central differences (in f64 around f32 evaluations).
fn check_fd(name: &str, inputs: &[Tensor], f: &(dyn Fn(&[Var]) -> distgrad::Result<Var> + Sync)) {
    let (_, grads) = grads_of(inputs, f);
    let eps = 1e-2f32;
    for (k, x) in inputs.iter().enumerate() {
        for i in 0..x.numel() {
            let at = |d: f32| {
                let mut ins = inputs.to_vec();
                let mut v = x.to_vec();
                v[i] += d;
                ins[k] = Tensor::from_vec(v, x.shape()).unwrap();
                grads_of(&ins, f).0 as f64
            };
            let fd = (at(eps) - at(-eps)) / (2.0 * eps as f64);
            let g = grads[k].to_vec()[i] as f64;
            assert!(
                (fd - g).abs() <= 2e-2 * (1.0 + fd.abs()),
                "{name}: d/d input{k}[{i}]: finite difference {fd}, tape {g}"
            );
        }
    }
}

fn t(seed: u64, shape: &[usize]) -> Tensor {
    Tensor::from_vec(vals(seed, shape.iter().product()), shape).unwrap()
}

/// A fixed cotangent-like weighting so that each op's every output element matters.
fn weigh(v: &Var, seed: u64) -> distgrad::Result<Var> {
    let w = v.tape().constant(t(seed, &v.shape()));
    v.mul(&w)?.sum()
}

#[test]
fn finite_differences_of_every_local_op() {
    check_fd("add (broadcast row)", &[t(1, &[2, 3]), t(2, &[3])], &|v| {
        weigh(&v[0].add(&v[1])?, 9)
    });
    check_fd(
        "sub (broadcast col)",
        &[t(3, &[2, 3]), t(4, &[2, 1])],
        &|v| weigh(&v[0].sub(&v[1])?, 9),
    );
    check_fd("mul (scalar)", &[t(5, &[2, 2]), t(6, &[])], &|v| {
        weigh(&v[0].mul(&v[1])?, 9)
    });
    check_fd("scale", &[t(7, &[3])], &|v| weigh(&v[0].scale(-2.5)?, 9));
    check_fd("matmul", &[t(8, &[2, 3]), t(9, &[3, 2])], &|v| {
        weigh(&v[0].matmul(&v[1])?, 9)
    });
    check_fd("sum", &[t(10, &[2, 2])], &|v| v[0].sum()?.scale(3.0));
    check_fd("mean", &[t(11, &[5])], &|v| v[0].mean()?.scale(3.0));
    // keep inputs away from relu's kink at 0 (|x| >= 0.1 > eps)
    let away: Vec<f32> = vals(12, 6)
        .into_iter()
        .map(|x| if x.abs() < 0.1 { 0.5 } else { x })
        .collect();
    check_fd("relu", &[Tensor::from_vec(away, &[6]).unwrap()], &|v| {
        weigh(&v[0].relu()?, 9)
    });
    check_fd("tanh", &[t(13, &[4])], &|v| weigh(&v[0].tanh()?, 9));
    check_fd("reshape", &[t(14, &[2, 3])], &|v| {
        weigh(&v[0].reshape(&[3, 2])?, 9)
    });
    check_fd("slice", &[t(15, &[3, 4])], &|v| {
        weigh(&v[0].slice(1, 1, 2)?, 9)
    });
    check_fd("concat", &[t(16, &[2, 1]), t(17, &[2, 3])], &|v| {
        weigh(&Var::concat(&[v[0].clone(), v[1].clone()], 1)?, 9)
    });
    check_fd("mse", &[t(18, &[4]), t(19, &[4])], &|v| {
        v[0].mse_loss(&v[1])
    });
}

#[test]
fn hand_derived_local_gradients() {
    // y = sum(x * x + 3x) so dy/dx = 2x + 3
    let x = Tensor::vector(&[1.0, -2.0, 0.5]);
    let (y, g) = grads_of(&[x], &|v| {
        let c = v[0].tape().constant(Tensor::scalar(3.0));
        v[0].mul(&v[0])?.add(&v[0].mul(&c)?)?.sum()
    });
    assert_eq!(y, 1.0 + 3.0 + 4.0 - 6.0 + 0.25 + 1.5);
    assert_eq!(g[0].to_vec(), vec![5.0, -1.0, 4.0]);
    // loss = mean((w x - t)^2) with w = 2, x = [1, 2], t = [1, 1]: residuals [1, 3],
    // dloss/dw = mean(2 r x) = (2*1*1 + 2*3*2)/2 = 7
    let (l, g) = grads_of(&[Tensor::scalar(2.0)], &|v| {
        let x = v[0].tape().constant(Tensor::vector(&[1.0, 2.0]));
        let target = v[0].tape().constant(Tensor::vector(&[1.0, 1.0]));
        v[0].mul(&x)?.mse_loss(&target)
    });
    assert_eq!(l, 5.0);
    assert_eq!(g[0].to_vec(), vec![7.0]);
}

#[test]
fn no_grad_regions_and_constants_record_nothing() {
    let tape = Tape::new();
    let x = tape.var(Tensor::vector(&[1.0, 2.0]));
    let c = tape.constant(Tensor::vector(&[3.0, 4.0]));
    let _ = c.mul(&c).unwrap(); // constants only: not recorded
    assert_eq!(tape.len(), 0);
    {
        let _guard = tape.no_grad();
        assert!(!tape.is_recording());
        let y = x.mul(&x).unwrap();
        assert!(!y.requires_grad());
        assert_eq!(tape.len(), 0);
    }
    assert!(tape.is_recording());
    let y = x.mul(&c).unwrap();
    assert!(y.requires_grad());
    assert_eq!(tape.len(), 1);
}

#[test]
fn vars_of_another_tape_are_an_error() {
    let a = Tape::new();
    let b = Tape::new();
    let x = a.var(Tensor::scalar(1.0));
    let y = b.var(Tensor::scalar(2.0));
    assert!(matches!(x.add(&y), Err(Error::ForeignVar { op: "add" })));
}

#[test]
fn shape_errors_are_errors() {
    let tape = Tape::new();
    let x = tape.var(Tensor::zeros(&[2, 3]));
    let y = tape.var(Tensor::zeros(&[4]));
    assert!(
        x.add(&y)
            .unwrap_err()
            .to_string()
            .contains("do not broadcast")
    );
    assert!(x.matmul(&y).is_err());
    assert!(x.reshape(&[5]).is_err());
    assert!(x.slice(1, 2, 2).is_err());
    assert!(Tensor::from_vec(vec![1.0], &[2]).is_err());
}

#[test]
fn a_small_model_trains() {
    // Fit y = 2 x0 - x1 + 0.5 with a 2-16-1 tanh MLP by gradient descent; the loss must fall 20x.
    let xs: Vec<f32> = vals(21, 64);
    let ys: Vec<f32> = xs.chunks(2).map(|p| 2.0 * p[0] - p[1] + 0.5).collect();
    let res = run_local(1, CommOptions::default(), |comm| {
        let (xs, ys) = (xs.clone(), ys.clone());
        async move {
            let mut w1 =
                Tensor::from_vec(vals(22, 32).iter().map(|v| v * 0.5).collect(), &[2, 16])?;
            let mut b1 = Tensor::zeros(&[16]);
            let mut w2 =
                Tensor::from_vec(vals(23, 16).iter().map(|v| v * 0.5).collect(), &[16, 1])?;
            let mut losses = Vec::new();
            for _ in 0..300 {
                let tape = Tape::new();
                let (pw1, pb1, pw2) = (
                    tape.var(w1.clone()),
                    tape.var(b1.clone()),
                    tape.var(w2.clone()),
                );
                let x = tape.constant(Tensor::from_vec(xs.clone(), &[32, 2])?);
                let y = tape.constant(Tensor::from_vec(ys.clone(), &[32, 1])?);
                let h = x.matmul(&pw1)?.add(&pb1)?.tanh()?;
                let loss = h.matmul(&pw2)?.mse_loss(&y)?;
                losses.push(loss.value().item()?);
                let g = tape.backward(&loss, &comm).await?;
                w1 = w1.sub(&g.wrt(&pw1)?.scale(0.1)?)?;
                b1 = b1.sub(&g.wrt(&pb1)?.scale(0.1)?)?;
                w2 = w2.sub(&g.wrt(&pw2)?.scale(0.1)?)?;
            }
            Ok(losses)
        }
    });
    let losses = res.into_iter().next().unwrap().unwrap();
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(last < first / 20.0, "loss {first} -> {last}");
}
