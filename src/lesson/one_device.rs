//! Every rank's gradient beside the one a single device computes for the whole, unsharded
//! problem ([`crate::program::one_device`]: no collectives, no duals, ordinary autograd), and
//! their difference. A lesson's trace carries it ([`super::Trace::one_device`]); the page shows
//! it on the last step, `distgrad run` after the steps. A training lesson's is one device
//! training the whole problem from the same start, its loss per step beside the group's.

use super::trace::{Named, OneDeviceView, Phase, Step};
use super::{Lesson, View, lesson_case};
use crate::error::Result;
use crate::program::{ObjectiveName, OneDevice, Plan, one_device, one_device_with};
use crate::tensor::Tensor;
use crate::vjp::TensorJson;

/// A gradient of the trace set beside one device's: who computed it, at which step, under which
/// of the one-device runs.
struct Compared {
    /// In the label: `distgrad`, `the seed's dual`, `distgrad (one replicated loss)`.
    who: String,
    /// In the difference's name: `distgrad`, `the seed's dual` (the objective is in the run's).
    short: String,
    step: usize,
    run: usize,
}

/// The one-device view of a lesson's assembled `steps` on `world` ranks; a failure is said in
/// the label.
pub(super) async fn view(lesson: &Lesson, steps: &[Step], world: usize) -> OneDeviceView {
    let built = match lesson.view {
        View::Train {
            steps: n,
            lr,
            sharded,
        } => train(lesson, steps, world, n, lr, sharded).await,
        View::Collective(_) => collective(lesson, steps, world)
            .await
            .and_then(|r| lay_out(&r, steps, world, true)),
        View::Steps | View::CompareDuals => program(lesson, steps, world)
            .await
            .and_then(|r| lay_out(&r, steps, world, false)),
        View::CompareObjectives => objectives(lesson, steps, world)
            .await
            .and_then(|r| lay_out(&r, steps, world, false)),
    };
    built.unwrap_or_else(|e| OneDeviceView {
        label: format!("One device: not computed here ({e})"),
        ranks: Vec::new(),
        curve: Vec::new(),
    })
}

/// The name of a gradient in the lesson's steps, and of one device's run.
struct Runs {
    /// Per run: the plan, what its objective is called (empty with one run), its result.
    runs: Vec<(Plan, String, OneDevice)>,
    /// The gradients of the trace compared.
    compared: Vec<Compared>,
    /// How the trace names the gradient of input `x`: `<prefix>x`.
    prefix: &'static str,
}

impl Compared {
    /// distgrad's gradient at `step`, under one device's only run.
    fn distgrad(step: usize) -> Compared {
        Compared {
            who: "distgrad".into(),
            short: "distgrad".into(),
            step,
            run: 0,
        }
    }
}

/// Whether step `k` holds a value called `name` on some rank.
fn holds(steps: &[Step], k: usize, name: &str) -> bool {
    steps[k].ranks.iter().flatten().any(|n| n.name == name)
}

/// The last step holding `name`.
fn last_with(steps: &[Step], name: &str) -> Option<usize> {
    (0..steps.len()).rev().find(|&k| holds(steps, k, name))
}

/// The backward steps holding `name`, in order.
fn backward_with(steps: &[Step], name: &str) -> Vec<usize> {
    (0..steps.len())
        .filter(|&k| steps[k].phase == Phase::Backward && holds(steps, k, name))
        .collect()
}

/// How the trace names the gradient of the plan's first input with one: `<prefix><input>`.
fn first_grad(plan: &Plan, prefix: &str) -> String {
    plan.program()
        .inputs
        .iter()
        .find(|i| i.grad)
        .map(|i| format!("{prefix}{}", i.name))
        .unwrap_or_default()
}

/// A program lesson (its wrong duals too: one device has no duals, it runs the program as
/// written): distgrad's gradients, or the wrong dual's backward then distgrad's.
async fn program(lesson: &Lesson, steps: &[Step], world: usize) -> Result<Runs> {
    let plan = lesson.plan_for(world)?;
    let one = run(&plan).await?;
    let first = first_grad(&plan, "dF/d");
    let compared = if matches!(lesson.view, View::CompareDuals) {
        backward_with(steps, &first)
            .into_iter()
            .map(|step| {
                let who = steps[step].label.trim_start_matches("backward with ");
                Compared {
                    who: who.to_string(),
                    short: who.to_string(),
                    step,
                    run: 0,
                }
            })
            .collect()
    } else {
        last_with(steps, &first)
            .map(Compared::distgrad)
            .into_iter()
            .collect()
    };
    Ok(Runs {
        runs: vec![(plan, String::new(), one)],
        compared,
        prefix: "dF/d",
    })
}

/// A collective lesson: its case with the inputs the ranks ran (a rank may have edited its own).
async fn collective(lesson: &Lesson, steps: &[Step], world: usize) -> Result<Runs> {
    let mut case = lesson_case(lesson, world)?;
    for (r, x) in case.inputs.iter_mut().enumerate() {
        if let Some(n) = steps.first().and_then(|s| find(s, r, "x")) {
            *x = n.tensors.clone();
        }
    }
    let plan = case.program()?.plan(None)?;
    let one = run(&plan).await?;
    Ok(Runs {
        runs: vec![(plan, String::new(), one)],
        compared: last_with(steps, "dL/dx")
            .map(Compared::distgrad)
            .into_iter()
            .collect(),
        prefix: "dL/d",
    })
}

/// The two-objectives lesson: one device under each objective, beside the backward under each.
async fn objectives(lesson: &Lesson, steps: &[Step], world: usize) -> Result<Runs> {
    let mut runs = Vec::new();
    for (objective, said) in [
        (ObjectiveName::SumOfRankLosses, "sum of rank losses"),
        (ObjectiveName::Replicated, "one replicated loss"),
    ] {
        let mut p = lesson.program_for(world)?;
        p.objective = objective;
        let plan = lesson.plan_program(&p, world)?;
        let one = run(&plan).await?;
        runs.push((plan, said.to_string(), one));
    }
    let first = first_grad(&runs[0].0, "dL/d");
    let compared = backward_with(steps, &first)
        .into_iter()
        .zip(0..runs.len())
        .map(|(step, run)| Compared {
            who: format!("distgrad ({})", runs[run].1),
            short: "distgrad".into(),
            step,
            run,
        })
        .collect();
    Ok(Runs {
        runs,
        compared,
        prefix: "dL/d",
    })
}

/// One device's run of `plan` from every rank's inputs.
async fn run(plan: &Plan) -> Result<OneDevice> {
    let inputs: Vec<Vec<Tensor>> = (0..plan.world()).map(|r| plan.inputs(r).to_vec()).collect();
    one_device(plan, &inputs).await
}

/// Rank `r`'s value called `name` at step `s`.
fn find<'a>(s: &'a Step, r: usize, name: &str) -> Option<&'a Named> {
    s.ranks.get(r)?.iter().find(|n| n.name == name)
}

/// The rows of every rank, and the label with the largest differences. A collective lesson
/// (`listed`) names its inputs' gradients as one list `dL/dx`; a program lesson one value per input.
fn lay_out(runs: &Runs, steps: &[Step], world: usize, listed: bool) -> Result<OneDeviceView> {
    let mut rows: Vec<Vec<Named>> = vec![Vec::new(); world];
    // Per compared gradient: the largest difference, absolute and relative.
    let mut worst = vec![(0f32, 0f32); runs.compared.len()];
    for (k, (plan, said, one)) in runs.runs.iter().enumerate() {
        let suffix = if said.is_empty() {
            String::new()
        } else {
            format!(" ({said})")
        };
        let inputs: Vec<(usize, &str)> = plan
            .program()
            .inputs
            .iter()
            .enumerate()
            .filter(|(_, i)| i.grad)
            .map(|(i, inp)| (i, inp.name.as_str()))
            .collect();
        for (r, row) in rows.iter_mut().enumerate() {
            // Every rank a column per input (empty where it holds none), so the rows line up.
            let mine: Vec<(&str, Option<TensorJson>)> = inputs
                .iter()
                .map(|&(i, name)| {
                    let g = one
                        .grads
                        .get(r)
                        .and_then(|g| g.get(i))
                        .and_then(Option::as_ref);
                    let shape = plan.shape(r, name).map(<[usize]>::to_vec);
                    (name, g.zip(shape).map(|(g, shape)| json(shape, g)))
                })
                .collect();
            // (name in the trace, one device's tensors)
            let groups: Vec<(String, Vec<TensorJson>)> = if listed {
                vec![(
                    format!("{}x", runs.prefix),
                    mine.into_iter().filter_map(|(_, t)| t).collect(),
                )]
            } else {
                mine.into_iter()
                    .map(|(name, t)| (format!("{}{name}", runs.prefix), t.into_iter().collect()))
                    .collect()
            };
            for (name, one_t) in &groups {
                row.push(Named::tensors(
                    &format!("one device: {name}{suffix}"),
                    one_t.clone(),
                ));
                for (c, worst) in runs
                    .compared
                    .iter()
                    .zip(&mut worst)
                    .filter(|(c, _)| c.run == k)
                {
                    let theirs = find(&steps[c.step], r, name).map(|n| n.tensors.as_slice());
                    let diff = match theirs {
                        Some(t) if !t.is_empty() => difference(t, one_t, worst),
                        _ => Vec::new(),
                    };
                    let input = name.trim_start_matches(runs.prefix);
                    row.push(Named::tensors(
                        &format!("{} − one device: {input}", c.short),
                        diff,
                    ));
                }
            }
        }
    }
    let said: Vec<String> = runs
        .compared
        .iter()
        .zip(&worst)
        .map(|(c, &(abs, rel))| {
            if abs == 0.0 {
                format!("{} equals it exactly", c.who)
            } else if abs.is_nan() || rel.is_nan() {
                format!("{} gives NaN where one device has a number", c.who)
            } else if rel <= 1e-5 {
                format!("{} differs by at most {abs:.1e} (float rounding)", c.who)
            } else {
                format!("{} differs by up to {abs:.3}", c.who)
            }
        })
        .collect();
    Ok(OneDeviceView {
        curve: Vec::new(),
        label: format!(
            "One device, the whole problem (the collectives as plain sums and copies, no duals): {}",
            said.join("; ")
        ),
        ranks: rows,
    })
}

fn json(shape: Vec<usize>, data: &[f32]) -> TensorJson {
    TensorJson {
        shape,
        data: data.iter().map(|&v| (!v.is_nan()).then_some(v)).collect(),
    }
}

/// `a − b` tensor by tensor (`None`, NaN, where either is); the largest magnitude into `worst`,
/// absolute and relative to the values where they exceed 1 (NaN where one side is NaN and the
/// other not).
fn difference(a: &[TensorJson], b: &[TensorJson], worst: &mut (f32, f32)) -> Vec<TensorJson> {
    a.iter()
        .zip(b)
        .map(|(x, y)| TensorJson {
            shape: x.shape.clone(),
            data: x
                .data
                .iter()
                .zip(&y.data)
                .map(|(p, q)| match (p, q) {
                    (Some(p), Some(q)) => {
                        let d = p - q;
                        let rel = d.abs() / p.abs().max(q.abs()).max(1.0);
                        if !worst.0.is_nan() && (d.abs() > worst.0 || d.is_nan()) {
                            worst.0 = d.abs();
                        }
                        if !worst.1.is_nan() && (rel > worst.1 || rel.is_nan()) {
                            worst.1 = rel;
                        }
                        Some(d)
                    }
                    (None, None) => None,
                    _ => {
                        *worst = (f32::NAN, f32::NAN);
                        None
                    }
                })
                .collect(),
        })
        .collect()
}

/// One device trains the whole problem `n` steps at `lr` from the lesson's start, as the ranks
/// did (data-parallel: one shared copy of each parameter and the mean of the ranks' losses, i.e.
/// full-batch gradient descent; `sharded`: every rank's parameters as the program holds them),
/// its group loss per step beside the ranks' (`group loss` in the trace's steps 1..=n).
async fn train(
    lesson: &Lesson,
    steps: &[Step],
    world: usize,
    n: usize,
    lr: f32,
    sharded: bool,
) -> Result<OneDeviceView> {
    let plan = lesson.plan_for(world)?;
    let trainable = super::training::trainable(&plan);
    let mut inputs: Vec<Vec<Tensor>> = (0..world).map(|r| plan.inputs(r).to_vec()).collect();
    let mut curve = Vec::with_capacity(n);
    for _ in 0..n {
        let one = one_device_with(&plan, &inputs, !sharded).await?;
        let held: Vec<f32> = one.losses.iter().flatten().copied().collect();
        curve.push(held.iter().sum::<f32>() / held.len().max(1) as f32);
        for (r, row) in inputs.iter_mut().enumerate() {
            for &i in &trainable {
                let Some(g) = one
                    .grads
                    .get(r)
                    .and_then(|g| g.get(i))
                    .and_then(Option::as_ref)
                else {
                    continue;
                };
                let p = row[i].try_to_vec()?;
                let next: Vec<f32> = p.iter().zip(g).map(|(w, d)| w - lr * d).collect();
                row[i] = Tensor::from_vec(next, row[i].shape())?;
            }
        }
    }
    // The ranks' group loss per step, as rank 0 shows it.
    let theirs: Vec<Option<f32>> = steps
        .iter()
        .skip(1)
        .map(|s| {
            find(s, 0, "group loss")
                .and_then(|n| n.tensors.first())
                .and_then(|t| t.data.first().copied().flatten())
        })
        .collect();
    let mut worst = (0f32, 0f32);
    for (a, b) in theirs.iter().zip(&curve) {
        match a {
            Some(a) => {
                let d = (a - b).abs();
                worst.0 = worst.0.max(d);
                worst.1 = worst.1.max(d / a.abs().max(b.abs()).max(1e-3));
            }
            None => worst = (f32::NAN, f32::NAN),
        }
    }
    // The parameters after the last step, one device's and distgrad's minus them.
    let last = steps.last();
    let mut rows = vec![Vec::new(); world];
    for (r, row) in rows.iter_mut().enumerate() {
        for &i in &trainable {
            let name = &plan.program().inputs[i].name;
            let one_t = if plan.holds(r, i) {
                vec![TensorJson::from_tensor(&inputs[r][i])?]
            } else {
                Vec::new()
            };
            let theirs = last
                .and_then(|s| find(s, r, name))
                .map(|n| n.tensors.clone());
            let mut w = (0f32, 0f32);
            let diff = match theirs {
                Some(t) if !t.is_empty() && !one_t.is_empty() => difference(&t, &one_t, &mut w),
                _ => Vec::new(),
            };
            row.push(Named::tensors(&format!("one device: {name}"), one_t));
            row.push(Named::tensors(
                &format!("distgrad − one device: {name}"),
                diff,
            ));
        }
    }
    let how = if sharded {
        "every rank's parameters as the program holds them"
    } else {
        "one copy of the parameters, the mean of the ranks' losses: full-batch gradient descent"
    };
    let last_loss = curve.last().copied().unwrap_or(f32::NAN);
    let said = if worst.0 == 0.0 {
        "the ranks' group loss equals it at every step".to_string()
    } else if worst.0.is_nan() {
        "the ranks' group loss is missing at some step".to_string()
    } else if worst.1 <= 1e-4 {
        format!(
            "the ranks' group loss follows it within {:.1e} (float rounding)",
            worst.0
        )
    } else {
        format!(
            "the ranks' group loss drifts from it, by up to {:.3}",
            worst.0
        )
    };
    Ok(OneDeviceView {
        label: format!(
            "One device trains the whole problem from the same start ({how}): its loss at step {n} is {last_loss:.4}; {said}"
        ),
        ranks: rows,
        curve,
    })
}
