//! The single-device reference (`program::one_device`): the whole problem on one tape, every
//! collective written as local arithmetic, no dual run. Checked by hand on small cases (so the
//! reference is itself right), then used as an oracle: distgrad's distributed gradients equal it
//! on every lesson at worlds up to 8, on the shipped programs and on random programs of every
//! collective, subgroup, reduce op and both objectives; a lesson's wrong dual does not.

use std::path::Path;

use distgrad::collective::CommOptions;
use distgrad::lesson;
use distgrad::program::{OneDevice, Plan, Program, RandomOptions, one_device, random_program};

fn reference(plan: &Plan) -> OneDevice {
    let inputs: Vec<Vec<_>> = (0..plan.world()).map(|r| plan.inputs(r).to_vec()).collect();
    futures::executor::block_on(one_device(plan, &inputs)).unwrap_or_else(|e| panic!("{e}"))
}

fn plan(json: &str) -> Plan {
    Program::parse(json).unwrap().plan(None).unwrap()
}

/// Distgrad's gradients against one device's, within `tol` (relative to the largest magnitude of
/// the two, at least 1); the first difference found, if any.
fn differs(plan: &Plan, tol: f32) -> Option<String> {
    let runs = distgrad::program::run_local(
        plan,
        CommOptions {
            timeout: std::time::Duration::from_secs(10),
            ..CommOptions::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let one = reference(plan);
    let names = plan.input_names();
    for (r, (run, want)) in runs.iter().zip(&one.grads).enumerate() {
        for (i, (got, want)) in run.grads.iter().zip(want).enumerate() {
            match (got, want) {
                (Some(g), Some(w)) => {
                    for (k, (a, b)) in g.iter().zip(w).enumerate() {
                        let scale = a.abs().max(b.abs()).max(1.0);
                        if !((a - b).abs() <= tol * scale || (a.is_nan() && b.is_nan())) {
                            return Some(format!(
                                "rank {r} d/d{}[{k}]: distgrad {a}, one device {b}",
                                names[i]
                            ));
                        }
                    }
                }
                (None, None) => {}
                (g, w) => {
                    return Some(format!(
                        "rank {r} d/d{}: distgrad {g:?}, one device {w:?}",
                        names[i]
                    ));
                }
            }
        }
    }
    None
}

#[test]
fn hand_derived_all_reduce_sum_under_both_objectives() {
    // Rank r holds x_r = [r + 1, 2(r + 1)]; s = all_reduce(SUM, x); loss = sum(s ⊙ s).
    // s = [6, 12] on 3 ranks. Sum of rank losses: F = 3·sum(s²), dF/dx_r = 3·2s = [36, 72].
    // Replicated: the loss is invariant, counted once: F = sum(s²), dF/dx_r = 2s = [12, 24].
    for (objective, want, f) in [
        ("sum_of_rank_losses", [36.0, 72.0], 3.0 * 180.0),
        ("replicated", [12.0, 24.0], 180.0),
    ] {
        let p = plan(&format!(
            r#"{{"world": 3, "objective": "{objective}",
                "inputs": [{{"name": "x", "shape": [2], "value": [1, 2], "per_rank": [1, 2]}}],
                "steps": [{{"collective": "all_reduce", "in": ["x"], "out": "s"}},
                          {{"op": "mul", "in": ["s", "s"], "out": "q"}},
                          {{"op": "sum", "in": ["q"], "out": "loss"}}],
                "loss": "loss"}}"#
        ));
        let one = reference(&p);
        assert_eq!(one.objective, f, "{objective}");
        for r in 0..3 {
            assert_eq!(
                one.grads[r][0].as_deref(),
                Some(&want[..]),
                "{objective} rank {r}"
            );
        }
    }
}

#[test]
fn hand_derived_max_with_a_tie_and_prod_with_a_zero() {
    // x = [3, 1] on rank 0, [3, 5] on rank 1, [1, 5] on rank 2: the maximum [3, 5] is held by
    // two ranks in each coordinate, which share the gradient: loss = sum(m) on rank 0 only
    // (the others' losses are sums too: F = 3·sum(m)), dF/dx = 3·½ where a rank holds it.
    let p = plan(
        r#"{"world": 3,
            "inputs": [{"name": "x", "shape": [2], "values": [[3, 1], [3, 5], [1, 5]]}],
            "steps": [{"collective": "all_reduce", "op": "max", "in": ["x"], "out": "m"},
                      {"op": "sum", "in": ["m"], "out": "loss"}],
            "loss": "loss"}"#,
    );
    let one = reference(&p);
    assert_eq!(one.objective, 24.0);
    let g: Vec<_> = one.grads.iter().map(|r| r[0].clone().unwrap()).collect();
    assert_eq!(g, vec![vec![1.5, 0.0], vec![1.5, 1.5], vec![0.0, 1.5]]);
    // PROD with a zero on rank 0: dF/dx_r = N · the product of the others (exact, no division).
    let p = plan(
        r#"{"world": 3,
            "inputs": [{"name": "x", "shape": [1], "values": [[0], [2], [3]]}],
            "steps": [{"collective": "all_reduce", "op": "prod", "in": ["x"], "out": "m"},
                      {"op": "sum", "in": ["m"], "out": "loss"}],
            "loss": "loss"}"#,
    );
    let g: Vec<_> = reference(&p)
        .grads
        .iter()
        .map(|r| r[0].clone().unwrap())
        .collect();
    assert_eq!(g, vec![vec![18.0], vec![0.0], vec![0.0]]);
}

#[test]
fn hand_derived_send_recv_and_a_rooted_subgroup() {
    // Rank 0 sends x0 to rank 1, which computes loss = sum(3 · x0): dF/dx0 = 3 on rank 0; rank 1's
    // own input takes no part (0).
    let p = plan(
        r#"{"world": 2,
            "inputs": [{"name": "x", "shape": [2], "values": [[1, 2], [5, 6]]}],
            "steps": [{"collective": "send", "dst": 1, "in": ["x"], "ranks": [0], "group": [0, 1]},
                      {"collective": "recv", "src": 0, "shape": [2], "out": "h", "ranks": [1], "group": [0, 1]},
                      {"op": "scale", "by": 3, "in": ["h"], "out": "y", "ranks": [1]},
                      {"op": "sum", "in": ["y"], "out": "loss", "ranks": [1]}],
            "loss": "loss"}"#,
    );
    let one = reference(&p);
    assert_eq!(one.objective, 9.0);
    assert_eq!(one.grads[0][0].as_deref(), Some(&[3.0, 3.0][..]));
    assert_eq!(one.grads[1][0].as_deref(), Some(&[0.0, 0.0][..]));
    // Broadcast on group [1, 2] from group rank 0 (global 1): each rank's loss is sum(b), so rank
    // 1 (the root) gets 2 (itself and rank 2), rank 2 gets 0; rank 0 is outside (its loss is
    // its own x: 1).
    let p = plan(
        r#"{"world": 3,
            "inputs": [{"name": "x", "shape": [1], "values": [[1], [2], [3]]}],
            "steps": [{"collective": "broadcast", "root": 0, "in": ["x"], "out": "b", "ranks": [1, 2], "group": [1, 2]},
                      {"op": "sum", "in": ["b"], "out": "loss", "ranks": [1, 2]},
                      {"op": "sum", "in": ["x"], "out": "loss", "ranks": [0]}],
            "loss": "loss"}"#,
    );
    let g: Vec<_> = reference(&p)
        .grads
        .iter()
        .map(|r| r[0].clone().unwrap())
        .collect();
    assert_eq!(g, vec![vec![1.0], vec![2.0], vec![0.0]]);
}

#[test]
fn a_program_that_deadlocks_is_refused_with_the_waiting_ranks() {
    // Both ranks receive first: on real ranks this waits forever (until the timeout).
    let p = plan(
        r#"{"world": 2,
            "inputs": [{"name": "x", "shape": [1]}],
            "steps": [{"collective": "recv", "src": 0, "shape": [1], "out": "a", "ranks": [1], "group": [0, 1]},
                      {"collective": "recv", "src": 1, "shape": [1], "out": "a", "ranks": [0], "group": [0, 1]},
                      {"collective": "send", "dst": 1, "in": ["x"], "ranks": [0], "group": [0, 1]},
                      {"collective": "send", "dst": 0, "in": ["x"], "ranks": [1], "group": [0, 1]},
                      {"op": "sum", "in": ["a"], "out": "loss"}],
            "loss": "loss"}"#,
    );
    let inputs: Vec<Vec<_>> = (0..2).map(|r| p.inputs(r).to_vec()).collect();
    let e = futures::executor::block_on(one_device(&p, &inputs))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("wait") && e.contains("rank 0") && e.contains("rank 1"),
        "{e}"
    );
}

fn lessons_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/www/lessons"))
}

#[test]
fn every_lesson_matches_one_device_and_wrong_duals_do_not() {
    let mut checked = 0;
    let mut wrong_differs = Vec::new();
    for entry in std::fs::read_dir(lessons_dir()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        if name == "index" {
            continue;
        }
        let l = lesson::parse(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for world in l.min_world.max(2)..=8 {
            let p = l
                .plan_for(world)
                .unwrap_or_else(|e| panic!("{name} at {world}: {e}"));
            let wrong = p.program().steps.iter().any(|s| s.dual.is_some());
            let mut l_right = l.clone();
            for s in &mut l_right.program.steps {
                s.dual = None;
            }
            let right = l_right.plan_for(world).unwrap();
            if let Some(d) = differs(&right, 1e-5) {
                panic!("{name} at {world} ranks: {d}");
            }
            checked += 1;
            // Wrong duals differ from one device wherever they are wrong (at 1 rank, and for
            // the subgroup root only on subgroups, they agree: the lessons say so).
            if wrong && world >= 3 && differs(&p, 1e-3).is_some() {
                wrong_differs.push(format!("{name}@{world}"));
            }
        }
    }
    assert!(checked >= 28 * 6, "{checked}");
    for name in [
        "wrong_all_reduce_max",
        "wrong_all_reduce_prod",
        "wrong_replicated_sum",
        "wrong_broadcast_subgroup",
        "wrong_tp_forgot_reduce",
    ] {
        assert!(
            (3..=8).all(|w| wrong_differs.contains(&format!("{name}@{w}"))),
            "{name}: {wrong_differs:?}"
        );
    }
}

#[test]
fn shipped_programs_match_one_device() {
    let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/www/programs"));
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "json") || path.ends_with("index.json") {
            continue;
        }
        let work = lesson::Work::parse(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let p = work.program_for(work.world()).unwrap().plan(None).unwrap();
        if let Some(d) = differs(&p, 1e-5) {
            panic!("{}: {d}", path.display());
        }
        n += 1;
    }
    assert!(n > 0);
}

/// Random programs (every collective, subgroups, uneven splits, send / recv, both objectives,
/// worlds 1..=8): distgrad's gradients equal one device's. Bounded: 300 seeds (moved with
/// DISTGRAD_PROGRAM_SEED, as the gradient check's property test).
#[test]
fn random_programs_match_one_device() {
    let first: u64 = std::env::var("DISTGRAD_PROGRAM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let (mut checked, mut failures) = (0, Vec::new());
    for seed in first..first + 300 {
        let p = random_program(seed, &RandomOptions::default());
        let Ok(plan) = p.plan(None) else {
            continue;
        };
        checked += 1;
        if let Some(d) = differs(&plan, 1e-4) {
            failures.push(format!(
                "seed {seed}: {d}\n{}",
                serde_json::to_string(&p).unwrap_or_default()
            ));
        }
    }
    println!("random programs: {checked} compared with one device");
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    assert!(checked >= 240, "{checked}");
}
