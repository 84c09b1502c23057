//! Wrong duals on purpose (`"dual"` on a program step, `DualRule`): each gives the gradient
//! its library gave, derived here by hand from the inputs; the distributed gradient check fails
//! every one of them and passes distgrad's on the same inputs, in worlds 2..8; a rule is refused
//! where it would not change the backward; and the wrong-vs-right lessons say so, rank by rank.

use std::process::Command;

use distgrad::backend::Device;
use distgrad::collective::CommOptions;
use distgrad::gradcheck::{Options, gradcheck_program};
use distgrad::lesson::{self, Lesson, Phase};
use distgrad::program::{Program, run_local};

/// `m = all_reduce(op, x)` (with its dual `rule`), then `loss_r = sum(m ⊙ c_r)` with constant
/// weights `c_r`, on `world` ranks; `x_r = x0 + r·dx`, `c_r = c0 + r·dc`.
fn reduce_program(
    world: usize,
    op: &str,
    rule: &str,
    x: ([f32; 3], [f32; 3]),
    c: ([f32; 3], [f32; 3]),
) -> Program {
    let text = serde_json::json!({
        "world": world,
        "inputs": [
            {"name": "x", "shape": [3], "value": x.0, "per_rank": x.1},
            {"name": "c", "shape": [3], "value": c.0, "per_rank": c.1, "grad": false}
        ],
        "steps": [
            {"collective": "all_reduce", "op": op, "in": ["x"], "out": "m", "dual": rule},
            {"op": "mul", "in": ["m", "c"], "out": "p"},
            {"op": "sum", "in": ["p"], "out": "loss"}
        ],
        "loss": "loss"
    });
    Program::parse(&text.to_string()).unwrap()
}

fn per_rank(v: ([f32; 3], [f32; 3]), r: usize) -> [f32; 3] {
    std::array::from_fn(|i| v.0[i] + r as f32 * v.1[i])
}

/// Every rank's gradient of x.
fn grads(p: &Program) -> Vec<Vec<f32>> {
    let plan = p.plan(None).unwrap();
    run_local(&plan, CommOptions::default())
        .unwrap()
        .into_iter()
        .map(|r| r.grads[0].clone().unwrap())
        .collect()
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert!(
            (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
            "{what}: {a:?} vs {b:?}"
        );
    }
}

fn verdict(p: &Program) -> &'static str {
    let plan = p.plan(None).unwrap();
    gradcheck_program(&plan, &Options::default())
        .unwrap()
        .verdict()
}

// Tie-free in every world up to 8: x's elements differ across ranks, c's cotangents too.
const X: ([f32; 3], [f32; 3]) = ([0.5, -1.0, 2.0], [0.7, 1.1, -0.6]);
const C: ([f32; 3], [f32; 3]) = ([1.0, -0.5, 2.0], [-0.3, 0.4, 0.25]);

/// all_reduce(MAX / MIN): the seed's dual gives every rank the extreme of the cotangents (the
/// op repeated); distgrad's gives the holder of the extreme the sum of them.
#[test]
fn seed_max_and_min_hand_derived_and_failed_by_the_check() {
    for op in ["max", "min"] {
        for world in 2..=8 {
            let xs: Vec<[f32; 3]> = (0..world).map(|r| per_rank(X, r)).collect();
            let cs: Vec<[f32; 3]> = (0..world).map(|r| per_rank(C, r)).collect();
            let pick = |a: f32, b: f32| if op == "max" { a.max(b) } else { a.min(b) };
            let seed = grads(&reduce_program(world, op, "seed", X, C));
            let right = grads(&reduce_program(world, op, "distgrad", X, C));
            for r in 0..world {
                let want_seed: Vec<f32> = (0..3)
                    .map(|i| cs.iter().map(|c| c[i]).reduce(pick).unwrap())
                    .collect();
                let want_right: Vec<f32> = (0..3)
                    .map(|i| {
                        let extreme = xs.iter().map(|x| x[i]).reduce(pick).unwrap();
                        if xs[r][i] == extreme {
                            cs.iter().map(|c| c[i]).sum()
                        } else {
                            0.0
                        }
                    })
                    .collect();
                close(
                    &seed[r],
                    &want_seed,
                    &format!("{op} seed, rank {r} of {world}"),
                );
                close(
                    &right[r],
                    &want_right,
                    &format!("{op} distgrad, rank {r} of {world}"),
                );
            }
            assert_eq!(verdict(&reduce_program(world, op, "seed", X, C)), "FAIL");
            assert_eq!(
                verdict(&reduce_program(world, op, "distgrad", X, C)),
                "PASS"
            );
        }
    }
}

/// all_reduce(PROD) with a zero on rank 0: dividing the product by the input gives NaN there,
/// the product of the others does not.
#[test]
fn divide_prod_with_a_zero_is_nan_where_the_others_product_is_not() {
    let x = ([0.0, 1.5, -0.5], [1.0, 0.25, 0.3]);
    let c = ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0]);
    for world in 2..=8 {
        let xs: Vec<[f32; 3]> = (0..world).map(|r| per_rank(x, r)).collect();
        let wrong = grads(&reduce_program(world, "prod", "divide", x, c));
        let right = grads(&reduce_program(world, "prod", "distgrad", x, c));
        for r in 0..world {
            // dF/dx_r = (Σ_s c_s) · Π_{s≠r} x_s = world · Π_{s≠r} x_s.
            let want: Vec<f32> = (0..3)
                .map(|i| {
                    world as f32
                        * (0..world)
                            .filter(|&s| s != r)
                            .map(|s| xs[s][i])
                            .product::<f32>()
                })
                .collect();
            close(
                &right[r],
                &want,
                &format!("prod distgrad, rank {r} of {world}"),
            );
            if r == 0 {
                assert!(wrong[0][0].is_nan(), "0/0 on rank 0: {:?}", wrong[0]);
                close(&wrong[0][1..], &want[1..], "divide off the zero");
            } else {
                close(
                    &wrong[r],
                    &want,
                    &format!("prod divide, rank {r} of {world}"),
                );
            }
        }
        assert_eq!(
            verdict(&reduce_program(world, "prod", "divide", x, c)),
            "FAIL"
        );
        assert_eq!(
            verdict(&reduce_program(world, "prod", "distgrad", x, c)),
            "PASS"
        );
    }
}

/// The replicated objective counts the invariant loss once; the seed's dual sums its gradient
/// over the ranks: exactly N times distgrad's, which is s.
#[test]
fn seed_under_the_replicated_objective_is_n_times_too_large() {
    for world in 1..=8 {
        let text = serde_json::json!({
            "world": world, "objective": "replicated",
            "inputs": [{"name": "x", "shape": [2], "value": [1, 2], "per_rank": [1, 0]}],
            "steps": [
                {"collective": "all_reduce", "op": "sum", "in": ["x"], "out": "s", "dual": "seed"},
                {"op": "square", "in": ["s"], "out": "q"},
                {"op": "sum", "in": ["q"], "out": "t"},
                {"op": "scale", "by": 0.5, "in": ["t"], "out": "loss"}],
            "loss": "loss"});
        let wrong_p = Program::parse(&text.to_string()).unwrap();
        let mut right_p = wrong_p.clone();
        right_p.steps[0].dual = None;
        // s = Σ_r x_r = [Σ (1 + r), 2·world].
        let w = world as f32;
        let s = [w + w * (w - 1.0) / 2.0, 2.0 * w];
        let (wrong, right) = (grads(&wrong_p), grads(&right_p));
        for r in 0..world {
            close(
                &right[r],
                &s,
                &format!("replicated distgrad, rank {r} of {world}"),
            );
            close(
                &wrong[r],
                &[w * s[0], w * s[1]],
                &format!("replicated seed, rank {r} of {world}"),
            );
        }
        // One rank: the sum over one rank is the identity, the seed is right there.
        let want = if world == 1 { "PASS" } else { "FAIL" };
        assert_eq!(verdict(&wrong_p), want, "world {world}");
        assert_eq!(verdict(&right_p), "PASS");
    }
}

/// broadcast on a subgroup whose root's global rank is not its group rank: PyTorch #130515's
/// comparison zeroes the root's gradient; on the whole world (group rank = global rank) it is
/// harmless, which is why it went unnoticed.
#[test]
fn global_root_zeroes_the_subgroup_roots_gradient() {
    let program = |world: usize, group: Vec<usize>, root: usize, rule: &str| {
        let text = serde_json::json!({
            "world": world,
            "inputs": [{"name": "x", "shape": [2], "value": [1, 2], "per_rank": [1, -1]}],
            "steps": [
                {"collective": "broadcast", "root": root, "group": group, "in": ["x"], "out": "b", "dual": rule},
                {"op": "square", "in": ["b"], "out": "q", "ranks": group},
                {"op": "sum", "in": ["q"], "out": "t", "ranks": group},
                {"op": "scale", "by": 0.5, "in": ["t"], "out": "loss", "ranks": group}],
            "loss": "loss"});
        Program::parse(&text.to_string()).unwrap()
    };
    for world in 3..=8 {
        // Ranks 1..world-1; the root is group rank `root`, global rank 1 + root.
        let group: Vec<usize> = (1..world).collect();
        for root in [0, world - 2] {
            let root_global = group[root];
            let x_root = [1.0 + root_global as f32, 2.0 - root_global as f32];
            // dF/dx_root = Σ over the group's ranks of b = (world − 1) · x_root.
            let k = (world - 1) as f32;
            let right = grads(&program(world, group.clone(), root, "distgrad"));
            let wrong = grads(&program(world, group.clone(), root, "global_root"));
            for r in 0..world {
                let want = if r == root_global {
                    vec![k * x_root[0], k * x_root[1]]
                } else {
                    vec![0.0, 0.0]
                };
                close(&right[r], &want, &format!("distgrad rank {r} of {world}"));
                // The one rank whose group rank equals the root's global rank keeps a zero (it
                // is not the root); the root drops its sum.
                close(&wrong[r], &[0.0, 0.0], &format!("global_root rank {r}"));
            }
            assert_eq!(
                verdict(&program(world, group.clone(), root, "global_root")),
                "FAIL"
            );
            assert_eq!(
                verdict(&program(world, group.clone(), root, "distgrad")),
                "PASS"
            );
        }
    }
    // The whole world: group ranks are global ranks, the wrong comparison happens to be right.
    for world in 2..=5 {
        let all: Vec<usize> = (0..world).collect();
        let p = program(world, all, world - 1, "global_root");
        assert_eq!(verdict(&p), "PASS", "world {world}");
    }
}

/// reduce(op): the seed's backward broadcasts the root's cotangent whatever the op: right for
/// SUM, wrong for AVG (no 1/N), MAX, MIN and PROD.
#[test]
fn seed_reduce_ignores_the_op() {
    for (op, want) in [
        ("sum", "PASS"),
        ("avg", "FAIL"),
        ("max", "FAIL"),
        ("min", "FAIL"),
        ("prod", "FAIL"),
    ] {
        for world in [2, 3, 5] {
            let root = world - 1;
            let text = serde_json::json!({
                "world": world,
                "inputs": [{"name": "x", "shape": [2], "value": [0.5, 1.5], "per_rank": [0.3, -0.2]}],
                "steps": [
                    {"collective": "reduce", "op": op, "root": root, "in": ["x"], "out": "y", "dual": "seed"},
                    {"op": "square", "in": ["y"], "out": "q", "ranks": [root]},
                    {"op": "sum", "in": ["q"], "out": "loss", "ranks": [root]}],
                "loss": "loss"});
            let p = Program::parse(&text.to_string()).unwrap();
            assert_eq!(verdict(&p), want, "reduce({op}) seed on {world} ranks");
            let mut right = p.clone();
            right.steps[0].dual = None;
            assert_eq!(verdict(&right), "PASS", "reduce({op}) on {world} ranks");
        }
    }
}

/// A rule is refused where it would not change the backward (a lesson cannot call the right
/// dual wrong), on a local step, and by an unknown name, each saying what is allowed.
#[test]
fn rules_are_refused_where_they_change_nothing() {
    let plan = |step: serde_json::Value| {
        let text = serde_json::json!({
            "world": 3,
            "inputs": [{"name": "x", "shape": [2]}],
            "steps": [step, {"op": "sum", "in": ["y"], "out": "loss"}],
            "loss": "loss"});
        Program::parse(&text.to_string()).and_then(|p| p.plan(None).map(|_| ()))
    };
    let err = |step: serde_json::Value| plan(step).unwrap_err().to_string();
    let e = err(
        serde_json::json!({"collective": "all_reduce", "op": "sum", "in": ["x"], "out": "y", "dual": "divide"}),
    );
    assert!(
        e.contains("\"divide\" dual is for all_reduce(op=prod)") && e.contains("step 0"),
        "{e}"
    );
    let e = err(
        serde_json::json!({"collective": "all_gather", "in": ["x"], "out": "y", "dual": "seed"}),
    );
    assert!(
        e.contains("\"seed\" dual is for all_reduce and reduce"),
        "{e}"
    );
    let e = err(
        serde_json::json!({"collective": "all_reduce", "op": "max", "in": ["x"], "out": "y", "dual": "global_root"}),
    );
    assert!(e.contains("\"global_root\" dual is for broadcast"), "{e}");
    let e = err(serde_json::json!({"op": "relu", "in": ["x"], "out": "y", "dual": "seed"}));
    assert!(e.contains("\"dual\" is for a collective step"), "{e}");
    let e = err(
        serde_json::json!({"collective": "all_reduce", "op": "max", "in": ["x"], "out": "y", "dual": "pytorch"}),
    );
    assert!(
        e.contains("the dual rules: distgrad, seed, divide, global_root"),
        "{e}"
    );
    // distgrad's own dual may be named anywhere.
    plan(serde_json::json!({"collective": "all_reduce", "op": "max", "in": ["x"], "out": "y", "dual": "distgrad"}))
        .unwrap();
    // A rule inside a "for" block is checked the same way once expanded.
    let text = serde_json::json!({
        "world": 3,
        "inputs": [{"name": "x", "shape": [2]}],
        "steps": [
            {"for": "s", "from": 0, "to": 0, "steps": [
                {"collective": "all_reduce", "op": "max", "in": ["x"], "out": "y", "dual": "seed"}]},
            {"op": "sum", "in": ["y"], "out": "loss"}],
        "loss": "loss"});
    let p = Program::parse(&text.to_string()).unwrap();
    assert_eq!(verdict(&p), "FAIL");
}

fn lesson_file(name: &str) -> Lesson {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/www/lessons/").to_string() + name + ".json";
    lesson::parse(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The wrong-vs-right lessons: both backward passes, their difference, and the check's verdicts
/// (the lesson's and, independently, `gradcheck_program` on the same plans) at 2..8 ranks.
#[test]
fn the_lessons_show_the_check_deciding() {
    let cases = [
        ("wrong_all_reduce_max", "FAIL", "the seed's dual"),
        ("wrong_max_tie", "INCONCLUSIVE", "the seed's dual"),
        ("wrong_all_reduce_prod", "FAIL", "the dividing dual"),
        ("wrong_replicated_sum", "FAIL", "the seed's dual"),
        ("wrong_broadcast_subgroup", "FAIL", "the global-root dual"),
    ];
    for (name, wrong_verdict, label) in cases {
        let l = lesson_file(name);
        assert_eq!(l.view, lesson::View::CompareDuals, "{name}");
        for world in l.min_world.max(2)..=8 {
            let t =
                futures::executor::block_on(lesson::run_simulated(&l, world, &Device::Cpu, &[]))
                    .unwrap_or_else(|e| panic!("{name} at {world}: {e}"));
            let last = t.steps.last().unwrap();
            assert_eq!(last.phase, Phase::Result);
            assert!(
                last.label
                    .ends_with(&format!("{label} {wrong_verdict}, distgrad's dual PASS")),
                "{name} at {world}: {}",
                last.label
            );
            let backward: Vec<&str> = t
                .steps
                .iter()
                .filter(|s| s.phase == Phase::Backward)
                .map(|s| s.label.as_str())
                .collect();
            assert_eq!(
                backward,
                [
                    format!("backward with {label}"),
                    "backward with distgrad's dual".to_string()
                ],
                "{name}"
            );
            // Under the replicated objective distgrad's dual of the all_reduce runs nothing, and
            // draws no message back; the seed's all_reduces.
            if name == "wrong_replicated_sum" {
                let back: Vec<_> = t
                    .steps
                    .iter()
                    .filter(|s| s.phase == Phase::Backward)
                    .collect();
                assert_eq!(back[1].collective.as_deref(), Some("nothing"));
                assert!(back[1].arrows.is_empty(), "{:?}", back[1].arrows);
                assert_eq!(back[0].arrows.len(), world * (world - 1));
            }
            // Independently of the lesson: the check on the plans it ran.
            let plan = l.plan_for(world).unwrap();
            let report = gradcheck_program(&plan, &Options::default()).unwrap();
            assert_eq!(report.verdict(), wrong_verdict, "{name} at {world}");
            let mut right = plan.program().clone();
            right.steps.iter_mut().for_each(|s| s.dual = None);
            let right = right.plan(Some(world)).unwrap();
            let report = gradcheck_program(&right, &Options::default()).unwrap();
            assert_eq!(report.verdict(), "PASS", "{name} at {world}");
            // Every rank's line says its own verdict.
            let lines: Vec<String> = last.ranks.iter().map(|r| r[0].show()).collect();
            assert!(
                lines.iter().any(|s| s.starts_with(wrong_verdict)),
                "{name} at {world}: {lines:?}"
            );
        }
    }
    // Below its min_world the subgroup lesson says why it cannot run.
    let l = lesson_file("wrong_broadcast_subgroup");
    let e = futures::executor::block_on(lesson::run_simulated(&l, 2, &Device::Cpu, &[]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("needs at least 3 ranks; this group has 2"),
        "{e}"
    );
    // A compare_duals lesson without a wrong dual is refused.
    let e = lesson::parse(
        r#"{"format": "lesson", "name": "x", "title": "t", "why": "w", "kind": "program",
            "compare_duals": true, "program": {"world": 2, "inputs": [{"name": "x", "shape": [1]}],
            "steps": [{"collective": "all_reduce", "op": "max", "in": ["x"], "out": "m"},
                      {"op": "sum", "in": ["m"], "out": "loss"}], "loss": "loss"}}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("needs a collective step with a wrong \"dual\""),
        "{e}"
    );
}

/// `distgrad gradcheck` fails a program with a wrong dual (exit status 1, FAIL) and passes it
/// with the dual left out.
#[test]
fn gradcheck_cli_fails_a_wrong_dual() {
    let dir = std::env::temp_dir().join(format!("distgrad-wrong-duals-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let wrong = reduce_program(3, "max", "seed", X, C);
    let mut right = wrong.clone();
    right.steps[0].dual = None;
    for (p, want_ok, verdict) in [(&wrong, false, "FAIL"), (&right, true, "PASS")] {
        let f = dir.join(format!("{verdict}.json"));
        std::fs::write(&f, serde_json::to_string(p).unwrap()).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_distgrad"))
            .args(["gradcheck", f.to_str().unwrap()])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.success(), want_ok, "{text}");
        assert!(text.trim_end().ends_with(verdict), "{text}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `forget_reduce`: the backward without its reduce. all_gather of x_r then loss_r = Σ_i x_i·w_r[i]
/// (w_r = [1 + r, 2 + r, ...]): distgrad's dF/dx_r = Σ_s w_s[r] (every rank's loss uses x_r, the
/// reduce_scatter sums them), the forgetting dual's w_r[r] (own loss only). all_reduce(SUM) of x
/// then loss_r = sum(m ⊙ c_r): distgrad's Σ_s c_s, the forgetting dual's c_r. The check fails
/// both and passes distgrad's, at worlds 2..8; at 1 rank there is nothing to forget.
#[test]
fn forget_reduce_hand_derived_and_failed_by_the_check() {
    for world in 1..=8usize {
        let gather = |rule: &str| {
            let text = serde_json::json!({
                "world": world,
                "inputs": [
                    {"name": "x", "shape": [1], "value": [0.5], "per_rank": [0.25]},
                    {"name": "w", "shape": [world],
                     "value": (1..=world).map(|i| i as f32).collect::<Vec<_>>(),
                     "per_rank": vec![1.0; world], "grad": false}
                ],
                "steps": [
                    {"collective": "all_gather", "in": ["x"], "out": "xs", "dual": rule},
                    {"op": "concat", "dim": 0, "in": ["xs.*"], "out": "X"},
                    {"op": "mul", "in": ["X", "w"], "out": "p"},
                    {"op": "sum", "in": ["p"], "out": "loss"}
                ],
                "loss": "loss"
            });
            Program::parse(&text.to_string()).unwrap()
        };
        // w_s[r] = (r + 1) + s.
        let w = |s: usize, r: usize| (r + 1 + s) as f32;
        let (right, wrong) = (grads(&gather("distgrad")), grads(&gather("forget_reduce")));
        for r in 0..world {
            let sum: f32 = (0..world).map(|s| w(s, r)).sum();
            close(
                &right[r],
                &[sum],
                &format!("all_gather distgrad, world {world} rank {r}"),
            );
            close(
                &wrong[r],
                &[w(r, r)],
                &format!("all_gather forget, world {world} rank {r}"),
            );
        }
        let c = ([1.0, -2.0, 0.5], [1.0, 1.0, -1.0]);
        let x = ([0.3, 0.1, -0.2], [0.1, 0.2, 0.3]);
        let wrong = grads(&reduce_program(world, "sum", "forget_reduce", x, c));
        for (r, g) in wrong.iter().enumerate() {
            close(
                g,
                &per_rank(c, r),
                &format!("all_reduce forget, world {world} rank {r}"),
            );
        }
        if world >= 2 {
            assert_eq!(verdict(&gather("forget_reduce")), "FAIL", "world {world}");
            assert_eq!(verdict(&gather("distgrad")), "PASS", "world {world}");
            assert_eq!(
                verdict(&reduce_program(world, "sum", "forget_reduce", x, c)),
                "FAIL",
                "world {world}"
            );
        }
    }
}
