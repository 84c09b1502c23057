//! A `program` lesson with `"compare_duals": true`: a wrong gradient beside the right one on the
//! same inputs. Its program names a wrong backward on some collective step (`"dual": "seed"`,
//! see [`DualRule`]); the lesson runs the forward pass once, the backward pass with the wrong
//! dual as written and with distgrad's, shows both gradients and their difference, and lets the
//! distributed gradient check (central differences of the whole program across the ranks)
//! decide which is right, rank by rank.

use super::steps::{backward_arrows, combined_grads, forward_steps, input_grads};
use super::*;
use crate::autograd::DualRule;
use crate::gradcheck::{self, Report};
use crate::program::trace_rank;

/// Run the lesson's program with its wrong duals and with distgrad's (see the module docs).
pub(super) async fn run<T: Transport>(comm: &P2p<T>, lesson: &Lesson) -> Result<Vec<RankStep>> {
    let world = comm.world_size();
    let wrong_plan = lesson.plan_for(world)?;
    let rules = wrong_rules(wrong_plan.program());
    let mut right = wrong_plan.program().clone();
    for s in &mut right.steps {
        s.dual = None;
    }
    let right_plan = lesson.plan_program(&right, world)?;
    let views = wrong_plan.views();
    let collectives: Vec<_> = views
        .iter()
        .rev()
        .filter(|v| v.collective.is_some())
        .collect();
    let me = comm.rank();
    let mut steps = Vec::new();
    let mut grads = Vec::with_capacity(2);
    let wrong_name = rules
        .iter()
        .map(|r| r.label())
        .collect::<Vec<_>>()
        .join(" + ");
    for (plan, who) in [
        (&wrong_plan, wrong_name.as_str()),
        (&right_plan, "distgrad's dual"),
    ] {
        comm.take_calls();
        let run = trace_rank(
            comm,
            plan,
            || {
                comm.take_calls();
            },
            &mut |_| {},
        )
        .await?;
        let ran = recorded(comm);
        if steps.is_empty() {
            steps = forward_steps(plan, &views, &run, me).await?;
        }
        let mut values = input_grads(plan.program(), "dF/d", &run.grads).await?;
        // What this rank's backward ran (ranks outside a subgroup run nothing; the step names
        // what its members ran).
        values.push(if ran.is_empty() {
            Named::tensors("backward ran", Vec::new())
        } else {
            Named::text("backward ran", ran.join(" + "))
        });
        let mut b = step(
            format!("backward with {who}"),
            Phase::Backward,
            backward_arrows(&collectives, me, &ran),
            values,
        );
        b.collective = (!ran.is_empty()).then(|| ran.join(" + "));
        steps.push(b);
        grads.push(run.grads);
    }
    let diffs = combined_grads(
        wrong_plan.program(),
        "wrong − right, ",
        [&grads[0], &grads[1]],
        Tensor::sub,
    )
    .await?;
    steps.push(step(
        "the difference: the wrong gradient minus the right one".into(),
        Phase::Result,
        Vec::new(),
        diffs,
    ));
    // The check decides: every rank runs it (it reruns the whole program many times).
    let o = gradcheck::Options::default();
    let wrong_report = gradcheck::check_program_on(comm, &wrong_plan, &o).await?;
    let right_report = gradcheck::check_program_on(comm, &right_plan, &o).await?;
    steps.push(step(
        format!(
            "the gradient check (central differences of the whole program): {wrong_name} {}, distgrad's dual {}",
            wrong_report.verdict(),
            right_report.verdict()
        ),
        Phase::Result,
        Vec::new(),
        vec![
            Named::text(&wrong_name, rank_summary(&wrong_report, me)),
            Named::text("distgrad's dual", rank_summary(&right_report, me)),
        ],
    ));
    Ok(steps)
}

/// The wrong rules a program's steps name, each once, in order.
fn wrong_rules(p: &Program) -> Vec<DualRule> {
    let mut rules = Vec::new();
    for d in p.steps.iter().filter_map(|s| s.dual) {
        if d != DualRule::Distgrad && !rules.contains(&d) {
            rules.push(d);
        }
    }
    rules
}

/// What the check found for rank `rank`'s inputs, in a line: the verdict and the coordinate
/// that decided it.
fn rank_summary(report: &Report, rank: usize) -> String {
    let rows: Vec<_> = report.rows.iter().filter(|r| r.rank == rank).collect();
    // Four decimals read as the page's tables do (the finite differences carry f32 noise).
    let num = |x: f64| {
        if x.is_nan() {
            "NaN".to_string()
        } else {
            format!("{}", (x * 1e4).round() / 1e4)
        }
    };
    if let Some(r) = rows.iter().find(|r| r.failed > 0) {
        let worst = r
            .worst
            .map(|(e, b, n)| {
                format!(
                    ": {}[{e}] backward {} vs numeric {}",
                    r.input,
                    num(b),
                    num(n)
                )
            })
            .unwrap_or_default();
        return format!("FAIL ({} of {} coordinates){worst}", r.failed, r.checked);
    }
    let kinks: Vec<_> = report.kinks.iter().filter(|k| k.rank == rank).collect();
    if let Some(k) = kinks.iter().find(|k| !k.within) {
        return format!(
            "INCONCLUSIVE: {}[{}] is at a tie (slopes {} and {}, backward {}): where ranks tie the objective has no derivative, and a check per coordinate cannot confirm which subgradient backward chose",
            k.input,
            k.elem,
            num(k.slopes.0),
            num(k.slopes.1),
            num(k.backward)
        );
    }
    let checked: usize = rows.iter().map(|r| r.checked).sum();
    match kinks.first() {
        Some(k) => format!(
            "PASS ({checked} coordinates; {}[{}] at a kink, backward {} between the slopes {} and {})",
            k.input,
            k.elem,
            num(k.backward),
            num(k.slopes.0),
            num(k.slopes.1)
        ),
        None if checked == 0 => "nothing to check on this rank".into(),
        None => format!("PASS ({checked} coordinates within tolerance)"),
    }
}
