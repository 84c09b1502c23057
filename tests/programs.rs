//! Programs and the distributed gradient check: the shipped programs pass; numbers derived by hand;
//! a program equals the same computation written with the Rust API; a gradient known to be wrong
//! FAILS (coordinates and random directions); kinks are reported; every kind of bad program is a
//! clear error before anything runs; the CLI's exit codes.

use std::process::Command;

#[path = "common_gpu/mod.rs"]
mod common_gpu;

use distgrad::gradcheck::{CheckInput, Mode, Options, gradcheck, gradcheck_program};
use distgrad::program::{Program, run_local};
use distgrad::{CommOptions, Communicator, ReduceOp, Tensor, dist};

fn program(json: &str) -> Program {
    Program::parse(json).unwrap_or_else(|e| panic!("parse: {e}\n{json}"))
}

fn shipped() -> Vec<(String, Program)> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/www/programs");
    let mut out: Vec<(String, Program)> = std::fs::read_dir(dir)
        .expect("www/programs")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .filter(|p| !p.ends_with("index.json"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("read");
            (p.display().to_string(), program(&text))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(out.len() >= 5, "the shipped programs are found");
    out
}

/// The page's examples list (`www/programs/index.json`) names every shipped program once, with
/// its title.
#[test]
fn the_pages_program_list_names_every_shipped_program() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/www/programs/index.json"
    ))
    .expect("www/programs/index.json");
    let index: serde_json::Value = serde_json::from_str(&text).expect("index.json is JSON");
    let mut listed: Vec<(String, String)> = index["programs"]
        .as_array()
        .expect("a list of programs")
        .iter()
        .map(|e| {
            (
                e["name"].as_str().expect("name").to_string(),
                e["title"].as_str().expect("title").to_string(),
            )
        })
        .collect();
    listed.sort();
    let mut files: Vec<(String, String)> = shipped()
        .into_iter()
        .map(|(path, p)| {
            let name = std::path::Path::new(&path)
                .file_stem()
                .and_then(|s| s.to_str())
                .expect("file name")
                .to_string();
            (name, p.title.unwrap_or_default())
        })
        .collect();
    files.sort();
    assert_eq!(listed, files);
}

#[test]
fn every_shipped_program_passes_under_both_objectives_where_it_can() {
    for (path, p) in shipped() {
        let plan = p.plan(None).unwrap_or_else(|e| panic!("{path}: {e}"));
        let r = gradcheck_program(&plan, &Options::default()).expect("runs");
        assert!(r.passed, "{path}:\n{}", r.render());
        assert_eq!(r.mode, Mode::Coordinates, "{path}");
        let checked: usize = r.rows.iter().map(|row| row.checked).sum();
        assert!(checked > 0, "{path}: something was compared");
        // Under the replicated objective, a program either passes too or is refused before it
        // runs, with the reason (a rank-limited step on an invariant value).
        let mut q = p.clone();
        q.objective = distgrad::program::ObjectiveName::Replicated;
        match q.plan(None) {
            Ok(plan) => {
                let r = gradcheck_program(&plan, &Options::default()).expect("runs");
                assert!(r.passed, "{path} (replicated):\n{}", r.render());
            }
            Err(e) => assert!(
                e.to_string().contains("replicated objective"),
                "{path}: {e}"
            ),
        }
    }
}

#[test]
fn max_tie_by_hand() {
    // x0 = [2, -1], x1 = [1, 0.5], x2 = [2, 0.25]; m = all_reduce(MAX) = [2, 0.5]; loss_r = m . x_r.
    // F = m . S with S = sum of x_r = [5, -0.25]. dF/dx_r = m + (dm/dx_r)^T S:
    //   element 0: ranks 0 and 2 tie at the max, each gets half: 2 + 0.5 * 5 = 4.5; rank 1: 2.
    //   element 1: rank 1 holds the max: 0.5 + (-0.25) = 0.25; ranks 0 and 2: 0.5.
    // losses: 4 - 0.5 = 3.5; 2 + 0.25 = 2.25; 4 + 0.125 = 4.125.
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/www/programs/max_tie.json"
    ))
    .expect("read");
    let plan = program(&text).plan(None).expect("plan");
    let runs = run_local(&plan, CommOptions::default()).expect("run");
    let losses: Vec<f32> = runs.iter().map(|r| r.loss.expect("loss")).collect();
    assert_eq!(losses, vec![3.5, 2.25, 4.125]);
    let grads: Vec<Vec<f32>> = runs
        .iter()
        .map(|r| r.grads[0].clone().expect("grad"))
        .collect();
    assert_eq!(grads, vec![vec![4.5, 0.5], vec![2.0, 0.25], vec![4.5, 0.5]]);
    // The check says the tie is a kink (slopes 2 and 7 on either side), with backward within.
    let r = gradcheck_program(&plan, &Options::default()).expect("check");
    assert!(r.passed, "{}", r.render());
    let mut at: Vec<(usize, usize)> = r.kinks.iter().map(|k| (k.rank, k.elem)).collect();
    at.sort();
    assert_eq!(at, vec![(0, 0), (2, 0)], "{}", r.render());
    for k in &r.kinks {
        assert!(k.within);
        assert!(
            (k.slopes.0 - 2.0).abs() < 1e-2 && (k.slopes.1 - 7.0).abs() < 2e-2,
            "{k:?}"
        );
    }
    assert!(r.render().contains("not differentiable at 2 coordinate(s)"));
}

/// Inputs held by some ranks only (`"ranks"`) and of a different shape per rank (`"shapes"`),
/// with numbers worked out by hand.
#[test]
fn one_program_for_every_world() {
    // x_r = [r] (value 0 plus r · 1), g = all_gather(x), v = concat(g.*) = [0, 1, .., n-1] on every
    // rank, loss_r = sum(v²) = Σ k². F = n Σ k², so dF/dx_r = 2 n r.
    let p = program(
        r#"{"world": 3,
            "inputs": [{"name": "x", "shape": [1], "value": [0], "per_rank": [1]}],
            "steps": [{"collective": "all_gather", "in": ["x"], "out": "g"},
                      {"op": "concat", "dim": 0, "in": ["g.*"], "out": "v"},
                      {"op": "square", "in": ["v"], "out": "q"},
                      {"op": "sum", "in": ["q"], "out": "loss"}],
            "loss": "loss"}"#,
    );
    for n in [1usize, 2, 3, 5, 8] {
        let plan = p.plan(Some(n)).expect("plan");
        let runs = run_local(&plan, CommOptions::default()).expect("run");
        let sq: usize = (0..n).map(|k| k * k).sum();
        for (r, run) in runs.iter().enumerate() {
            assert_eq!(run.loss, Some(sq as f32), "world {n} rank {r}");
            assert_eq!(
                run.grads,
                vec![Some(vec![(2 * n * r) as f32])],
                "world {n} rank {r}"
            );
        }
        let r = gradcheck_program(&plan, &Options::default()).expect("check");
        assert!(r.passed, "world {n}: {}", r.render());
    }
    // The parts of a subgroup's list: one per member.
    let p = program(
        r#"{"world": 4,
            "inputs": [{"name": "x", "shape": [1], "value": [1], "per_rank": [1]}],
            "steps": [{"collective": "all_gather", "in": ["x"], "out": "g", "group": [3, 1]},
                      {"op": "concat", "dim": 0, "in": ["g.*", "x"], "out": "v", "ranks": [1, 3]},
                      {"op": "sum", "in": ["v"], "out": "loss", "ranks": [1, 3]}],
            "loss": "loss"}"#,
    );
    let plan = p.plan(None).expect("plan");
    let runs = run_local(&plan, CommOptions::default()).expect("run");
    // [x_3, x_1, x_r]: 4 + 2 + x_r.
    assert_eq!(runs[1].loss, Some(8.0));
    assert_eq!(runs[3].loss, Some(10.0));
    assert_eq!(runs[0].loss, None);
}

/// `"for"` blocks, by hand: a ring written once for every world (rank s sends x_s to s + 1, the
/// last rank to 0), and blocks that nest.
#[test]
fn for_blocks_by_hand() {
    // x_r = r + 1; rank s receives p_s = x_{s-1} (cyclic) and loss_s = x_s · p_s, so
    // F = Σ_s x_s x_{s-1} and dF/dx_r = x_{r-1} + x_{r+1} (cyclic; at world 2 both are x_{1-r}).
    let p = program(
        r#"{"world": 3,
            "inputs": [{"name": "x", "shape": [1], "value": [1], "per_rank": [1]}],
            "steps": [
              {"for": "s", "from": 0, "to": "last", "steps": [
                {"collective": "send", "dst": "s+1", "in": ["x"], "ranks": ["s"], "if": "s < last"},
                {"collective": "send", "dst": 0, "in": ["x"], "ranks": ["s"], "if": "s == last"}]},
              {"for": "s", "from": 0, "to": "last", "steps": [
                {"collective": "recv", "src": "s-1", "shape": [1], "out": "p", "ranks": ["s"], "if": "s > 0"},
                {"collective": "recv", "src": "last", "shape": [1], "out": "p", "ranks": [0], "if": "s == 0"}]},
              {"op": "mul", "in": ["x", "p"], "out": "loss"}],
            "loss": "loss"}"#,
    );
    for n in [2usize, 3, 4, 7, 8] {
        let plan = p.plan(Some(n)).expect("plan");
        assert_eq!(plan.program().steps.len(), 2 * n + 1, "world {n}");
        let runs = run_local(&plan, CommOptions::default()).expect("run");
        let x = |r: usize| (r % n + 1) as f32;
        for (r, run) in runs.iter().enumerate() {
            let prev = x((r + n - 1) % n);
            assert_eq!(run.loss, Some(x(r) * prev), "world {n} rank {r}");
            let want = prev + x((r + 1) % n);
            assert_eq!(run.grads, vec![Some(vec![want])], "world {n} rank {r}");
        }
        let r = gradcheck_program(&plan, &Options::default()).expect("check");
        assert!(r.passed, "world {n}: {}", r.render());
    }
    // Nested blocks: rank s sends x_s to every other rank t (names carry both variables); rank t
    // keeps what it got from rank 0 (or, on rank 0, from rank 1) as q. Expanded: 2·n·(n−1) steps.
    let p = program(
        r#"{"world": 3,
            "inputs": [{"name": "x", "shape": [1], "value": [1], "per_rank": [1]}],
            "steps": [
              {"for": "s", "from": 0, "to": "last", "steps": [
                {"for": "t", "from": 0, "to": "last", "steps": [
                  {"collective": "send", "dst": "t", "in": ["x"], "ranks": ["s"], "if": "s != t"},
                  {"collective": "recv", "src": "s", "shape": [1], "out": "y{s}_{t}", "ranks": ["t"], "if": "s != t"}]}]},
              {"for": "t", "from": 1, "to": "last", "steps": [
                {"op": "scale", "by": 1, "in": ["y0_{t}"], "out": "q", "ranks": ["t"]}]},
              {"op": "scale", "by": 1, "in": ["y1_0"], "out": "q", "ranks": [0]},
              {"op": "mul", "in": ["q", "x"], "out": "loss"}],
            "loss": "loss"}"#,
    );
    for n in [2usize, 3, 5] {
        let plan = p.plan(Some(n)).expect("plan");
        assert_eq!(
            plan.program().steps.len(),
            2 * n * (n - 1) + n + 1,
            "world {n}"
        );
        let runs = run_local(&plan, CommOptions::default()).expect("run");
        // loss_0 = x_1 x_0 = 2, loss_t = x_0 x_t = t + 1; dF/dx_0 = x_1 + Σ_{t>0} x_t, dF/dx_1 = x_0
        // + x_0, dF/dx_t = x_0 for t > 1.
        for (t, run) in runs.iter().enumerate() {
            let want_loss = if t == 0 { 2.0 } else { (t + 1) as f32 };
            assert_eq!(run.loss, Some(want_loss), "world {n} rank {t}");
            let want = match t {
                0 => 2.0 + (1..n).map(|k| (k + 1) as f32).sum::<f32>(),
                1 => 2.0,
                _ => 1.0,
            };
            assert_eq!(run.grads, vec![Some(vec![want])], "world {n} rank {t}");
        }
    }
    // A program with blocks writes back as it was written.
    let text = serde_json::to_string(&p).expect("serialize");
    assert_eq!(program(&text), p);
}

#[test]
fn per_rank_inputs_by_hand() {
    // scatter from root 2 of the list s0, s1, s2 that only rank 2 holds: rank j gets s_j, its
    // loss is sum(y^2), so F = |s0|^2 + |s1|^2 + |s2|^2 and dF/ds_j = 2 s_j, on rank 2 alone.
    let p = program(
        r#"{"world": 3,
            "inputs": [{"name": "s0", "shape": [2], "ranks": [2], "values": [[1, 2]]},
                       {"name": "s1", "shape": [2], "ranks": [2], "values": [[3, 4]]},
                       {"name": "s2", "shape": [2], "ranks": [2], "values": [[5, 6]]}],
            "steps": [{"collective": "scatter", "root": 2, "in": ["s0", "s1", "s2"], "out": "y"},
                      {"op": "square", "in": ["y"], "out": "q"},
                      {"op": "sum", "in": ["q"], "out": "loss"}],
            "loss": "loss"}"#,
    );
    let plan = p.plan(None).expect("plan");
    assert!(plan.holds(2, 0) && !plan.holds(0, 0) && !plan.holds(1, 2));
    let runs = run_local(&plan, CommOptions::default()).expect("run");
    let losses: Vec<f32> = runs.iter().map(|r| r.loss.expect("loss")).collect();
    assert_eq!(losses, vec![5.0, 25.0, 61.0]);
    for (r, run) in runs.iter().enumerate().take(2) {
        assert_eq!(run.grads, vec![None, None, None], "rank {r} holds nothing");
    }
    assert_eq!(
        runs[2].grads,
        vec![
            Some(vec![2.0, 4.0]),
            Some(vec![6.0, 8.0]),
            Some(vec![10.0, 12.0])
        ]
    );
    let r = gradcheck_program(&plan, &Options::default()).expect("check");
    assert!(r.passed, "{}", r.render());
    let rows: Vec<(usize, &str, usize)> = r
        .rows
        .iter()
        .map(|row| (row.rank, row.input.as_str(), row.checked))
        .collect();
    assert_eq!(rows, vec![(2, "s0", 2), (2, "s1", 2), (2, "s2", 2)]);

    // Rank r holds r + 1 rows of x; all_to_all_single: rank 0 keeps its row, rank 1 sends one
    // row to 1 and one to 2, rank 2 one row to each rank. Received: rank 0 [1, 4], rank 1 [2, 5],
    // rank 2 [3, 6]; loss sum(y^2): 17, 29, 45; every row is sent once, so dF/dx = 2x.
    let p = program(
        r#"{"world": 3,
            "inputs": [{"name": "x", "shapes": [[1, 1], [2, 1], [3, 1]],
                        "values": [[1], [2, 3], [4, 5, 6]]}],
            "steps": [{"collective": "all_to_all_single",
                       "in_splits": [[1, 0, 0], [0, 1, 1], [1, 1, 1]], "in": ["x"], "out": "y"},
                      {"op": "square", "in": ["y"], "out": "q"},
                      {"op": "sum", "in": ["q"], "out": "loss"}],
            "loss": "loss"}"#,
    );
    let plan = p.plan(None).expect("plan");
    let runs = run_local(&plan, CommOptions::default()).expect("run");
    let losses: Vec<f32> = runs.iter().map(|r| r.loss.expect("loss")).collect();
    assert_eq!(losses, vec![17.0, 29.0, 45.0]);
    let grads: Vec<Vec<f32>> = runs
        .iter()
        .map(|r| r.grads[0].clone().expect("grad"))
        .collect();
    assert_eq!(
        grads,
        vec![vec![2.0], vec![4.0, 6.0], vec![8.0, 10.0, 12.0]]
    );
    let r = gradcheck_program(&plan, &Options::default()).expect("check");
    assert!(r.passed, "{}", r.render());
    let checked: Vec<usize> = r.rows.iter().map(|row| row.checked).collect();
    assert_eq!(checked, vec![1, 2, 3], "{}", r.render());
    // The same in random directions (each rank's direction as long as its own input).
    let o = Options {
        directions: Some(4),
        ..Options::default()
    };
    let r = gradcheck_program(&plan, &o).expect("check");
    assert!(r.passed, "{}", r.render());
    // The format round-trips.
    let text = serde_json::to_string(&p).expect("serialize");
    assert_eq!(program(&text), p);
}

/// The same computation as a program and with the Rust API: identical losses and gradients.
#[test]
fn program_equals_the_rust_api() {
    let text = r#"{"world": 3, "inputs": [{"name": "x", "shape": [2]}, {"name": "w", "shape": [2], "seed": 5}],
      "steps": [
        {"op": "mul", "in": ["x", "w"], "out": "p"},
        {"collective": "all_gather", "in": ["p"], "out": "g", "group": [2, 0]},
        {"op": "add", "in": ["g.0", "g.1"], "out": "s", "ranks": [0, 2]},
        {"collective": "broadcast", "root": 1, "in": ["x"], "out": "b"},
        {"op": "tanh", "in": ["b"], "out": "t"},
        {"op": "sum", "in": ["t"], "out": "loss", "ranks": [1]},
        {"op": "mul", "in": ["s", "t"], "out": "st", "ranks": [0, 2]},
        {"op": "sum", "in": ["st"], "out": "loss", "ranks": [0, 2]}]
      , "loss": "loss"}"#;
    let plan = program(text).plan(None).expect("plan");
    let runs = run_local(&plan, CommOptions::default()).expect("run");
    let by_api = distgrad::run_local(3, CommOptions::default(), |comm| {
        let plan = &plan;
        async move {
            let me = comm.rank();
            let tape = distgrad::Tape::new();
            let x = tape.var(plan.inputs(me)[0].clone());
            let w = tape.var(plan.inputs(me)[1].clone());
            let p = x.mul(&w)?;
            let g = comm.new_group(&[2, 0])?;
            let gathered = if g.rank().is_some() {
                Some(dist::all_gather(&comm, &p, &g).await?)
            } else {
                None
            };
            let b = dist::broadcast(&comm, &x, 1, &comm.world()).await?;
            let t = b.tanh()?;
            let loss = match gathered {
                Some(gs) => gs[0].add(&gs[1])?.mul(&t)?.sum()?,
                None => t.sum()?,
            };
            let grads = tape.backward(&loss, &comm).await?;
            Ok((
                loss.value().to_vec()[0],
                grads.wrt(&x)?.to_vec(),
                grads.wrt(&w)?.to_vec(),
            ))
        }
    });
    for (r, (run, api)) in runs.iter().zip(by_api).enumerate() {
        let (loss, gx, gw) = api.expect("api rank");
        assert_eq!(run.loss, Some(loss), "rank {r}");
        assert_eq!(run.grads[0].as_deref(), Some(gx.as_slice()), "rank {r} x");
        assert_eq!(run.grads[1].as_deref(), Some(gw.as_slice()), "rank {r} w");
    }
}

/// A gradient known to be wrong: `loss = sum(all_reduce(x) * stop_gradient(x))` where the second
/// factor is a constant copy, so backward misses a term. The check must FAIL, in both modes.
#[test]
fn a_wrong_gradient_fails() {
    let values: Vec<Tensor> = (0..3)
        .map(|r| Tensor::vector(&[1.0 + r as f32, -0.5 * r as f32]))
        .collect();
    let inputs = [CheckInput::per_rank("x", values)];
    let broken =
        async |comm: &distgrad::LocalComm, tape: &distgrad::Tape, xs: Vec<distgrad::Var>| {
            let s = dist::all_reduce(comm, &xs[0], ReduceOp::Sum, &comm.world()).await?;
            let detached = tape.constant(xs[0].value());
            Ok(Some(s.mul(&detached)?.sum()?))
        };
    let r = gradcheck(3, &Options::default(), &inputs, broken).expect("runs");
    assert!(!r.passed, "{}", r.render());
    assert!(r.rows.iter().all(|row| row.failed > 0), "{}", r.render());
    assert!(r.render().contains("FAIL"));
    let o = Options {
        directions: Some(4),
        ..Options::default()
    };
    let r = gradcheck(3, &o, &inputs, broken).expect("runs");
    assert!(!r.passed, "{}", r.render());
    assert_eq!(r.directions.len(), 4);
    // The same without the detach passes, in both modes.
    let right =
        async |comm: &distgrad::LocalComm, _tape: &distgrad::Tape, xs: Vec<distgrad::Var>| {
            let s = dist::all_reduce(comm, &xs[0], ReduceOp::Sum, &comm.world()).await?;
            Ok(Some(s.mul(&xs[0])?.sum()?))
        };
    for o in [Options::default(), o] {
        let r = gradcheck(3, &o, &inputs, right).expect("runs");
        assert!(r.passed, "{}", r.render());
    }
}

#[test]
fn large_programs_switch_to_directions_and_say_so() {
    let text = r#"{"world": 2, "inputs": [{"name": "x", "shape": [40, 40]}],
      "steps": [{"op": "tanh", "in": ["x"], "out": "t"},
                {"collective": "all_reduce", "in": ["t"], "out": "s"},
                {"op": "mul", "in": ["s", "x"], "out": "p"},
                {"op": "sum", "in": ["p"], "out": "loss"}], "loss": "loss"}"#;
    let plan = program(text).plan(None).expect("plan");
    let r = gradcheck_program(&plan, &Options::default()).expect("check");
    assert_eq!(
        r.mode,
        Mode::Directions {
            count: 16,
            forced: true
        }
    );
    assert!(r.passed, "{}", r.render());
    assert!(r.render().contains("too many coordinates"));
}

/// Every kind of bad program is an error before anything runs, naming the step and the ranks.
#[test]
fn bad_programs_are_clear_errors() {
    let cases: &[(&str, &str)] = &[
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [2], "per_rank": [1, 1]}], "steps": [{"op": "sum", "in": ["x"], "out": "loss"}], "loss": "loss"}"#,
            "\"per_rank\" adds r times itself to \"value\" on rank r: give \"value\" too",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [2], "value": [1, 1], "per_rank": [1]}], "steps": [{"op": "sum", "in": ["x"], "out": "loss"}], "loss": "loss"}"#,
            "\"per_rank\" needs 2 finite values (one per value), got 1",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [2], "value": [1, 1], "per_rank": [1, 1], "replicated": true}], "steps": [{"op": "sum", "in": ["x"], "out": "loss"}], "loss": "loss"}"#,
            "and not \"replicated\"",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [2], "value": [2e38, 1], "per_rank": [2e38, 0]}], "steps": [{"op": "sum", "in": ["x"], "out": "loss"}], "loss": "loss"}"#,
            "input \"x\" on rank 1: value 0 is not finite",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [2]}], "steps": [{"op": "concat", "dim": 0, "in": ["x.*"], "out": "c"}, {"op": "sum", "in": ["c"], "out": "loss"}], "loss": "loss"}"#,
            "step 0 (concat [x.*] -> c): `x.*` names the parts of a list output",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [2]}], "steps": [{"op": "tanh", "in": ["y"], "out": "t"}], "loss": "t"}"#,
            "`y` is not defined on rank 0",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [2]}], "steps": [{"op": "tanhh", "in": ["x"], "out": "t"}], "loss": "t"}"#,
            "unknown variant `tanhh`",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [2]}], "steps": [{"collective": "all_gather", "root": 1, "in": ["x"], "out": "t"}], "loss": "t"}"#,
            "unknown field `root`",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [2]}], "steps": [{"collective": "send", "dst": 1, "in": ["x"], "ranks": [0]}, {"op": "sum", "in": ["x"], "out": "loss"}], "loss": "loss"}"#,
            "sends 1 message(s) to group rank 1 (steps [0]), which receives 0",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [2]}], "steps": [{"collective": "send", "dst": 1, "in": ["x"], "ranks": [0]}, {"collective": "recv", "src": 0, "shape": [3], "out": "r", "ranks": [1]}, {"op": "sum", "in": ["x"], "out": "loss"}], "loss": "loss"}"#,
            "step 0 sends a [2] tensor that step 1 receives as [3]",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [2]}], "steps": [{"op": "tanh", "in": ["x"], "out": "t"}], "loss": "t"}"#,
            "it must have one element",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [3, 1]}], "steps": [{"collective": "all_to_all_single", "in_splits": [[1, 1], [2, 1]], "in": ["x"], "out": "y"}, {"op": "sum", "in": ["y"], "out": "loss"}], "loss": "loss"}"#,
            "sends in_splits [1, 1] (2 rows) of a tensor of shape [3, 1]",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [2]}], "steps": [{"collective": "reduce", "root": 2, "in": ["x"], "out": "y"}], "loss": "y"}"#,
            "root 2 is not a group rank (group size 2)",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [2]}], "steps": [{"collective": "all_reduce", "in": ["x"], "out": "y", "ranks": [0]}], "loss": "y"}"#,
            "runs on every member of its group",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [2], "values": [[1, 2]]}], "steps": [], "loss": "x"}"#,
            "\"values\" needs one list per rank (2), got 1",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [2]}], "steps": [{"op": "matmul", "in": ["x", "x"], "out": "y"}], "loss": "y"}"#,
            "matmul needs [m, k] x [k, n], got [2] x [2]",
        ),
        (
            r#"{"world": 2, "objective": "replicated", "inputs": [{"name": "x", "shape": [2], "replicated": true}], "steps": [{"op": "sum", "in": ["x"], "out": "s"}, {"collective": "all_reduce", "in": ["s"], "out": "loss"}, {"op": "scale", "by": 2, "in": ["loss"], "out": "l2", "ranks": [0]}], "loss": "l2"}"#,
            "rank 1 does not",
        ),
        (
            r#"{"world": 0, "inputs": [], "steps": [], "loss": "x"}"#,
            "world must be 1..=64",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x"}], "steps": [], "loss": "x"}"#,
            "input \"x\": give \"shape\" (every rank) or \"shapes\" (one per rank that holds it)",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [1], "shapes": [[1], [1]]}], "steps": [], "loss": "x"}"#,
            "give \"shape\" (every rank) or \"shapes\"",
        ),
        (
            r#"{"world": 3, "inputs": [{"name": "x", "shapes": [[1], [2]], "ranks": [0]}], "steps": [], "loss": "x"}"#,
            "\"shapes\" needs one shape per rank that holds it (1), got 2",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [1], "ranks": [0, 2]}], "steps": [], "loss": "x"}"#,
            "input \"x\": \"ranks\" [0, 2]: ranks must be distinct and below world 2",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [1], "ranks": [1], "values": [[1], [2]]}], "steps": [], "loss": "x"}"#,
            "\"values\" needs one list per rank of \"ranks\" (1), got 2",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shapes": [[1], [2]], "values": [[1], [2]]}], "steps": [], "loss": "x"}"#,
            "input \"x\" on rank 1: shape [2] needs 2 values, got 1",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [1], "ranks": [0], "replicated": true}], "steps": [], "loss": "x"}"#,
            "a replicated input is the same on every rank; it takes neither",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [2], "ranks": [0]}], "steps": [{"op": "sum", "in": ["x"], "out": "loss"}], "loss": "loss"}"#,
            "`x` is not defined on rank 1 (an input, on other ranks)",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shapes": [[2], [3]]}], "steps": [{"collective": "all_reduce", "in": ["x"], "out": "y"}], "loss": "y"}"#,
            "shapes must agree across the group",
        ),
        (r#"[1, 2]"#, "program JSON"),
        // "for" blocks: every error names the block, the step in it and the variable's value.
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"op": "sum", "in": ["x"], "out": "loss", "if": "1 > 0"}], "loss": "loss"}"#,
            "\"if\" is for the steps of a \"for\" block",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"for": "s", "from": 0, "steps": []}], "loss": "x"}"#,
            "the \"for\" block over `s` needs \"to\" (inclusive)",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"for": "last", "from": 0, "to": 1, "steps": []}], "loss": "x"}"#,
            "`last` is not a variable name",
        ),
        (
            r#"{"world": 2, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"for": "s", "from": 0, "to": 1, "steps": [], "step": []}], "loss": "x"}"#,
            "unknown field `step` in the \"for\" block over `s`",
        ),
        (
            r#"{"world": 3, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"for": "s", "from": 0, "to": "last", "steps": [{"collective": "send", "dst": "s-1", "in": ["x"], "ranks": ["s"]}]}], "loss": "x"}"#,
            "step 0 (for s), its step 0 with s = 0: \"dst\": `s-1` is -1, below 0",
        ),
        (
            r#"{"world": 3, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"for": "s", "from": 0, "to": "t", "steps": []}], "loss": "x"}"#,
            "step 0 (for s): \"to\": in `t`: unknown variable `t`",
        ),
        (
            r#"{"world": 3, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"for": "s", "from": 0, "to": 1, "steps": [{"op": "tanh", "in": ["x"], "out": "y{s", "ranks": ["s"]}]}], "loss": "x"}"#,
            "\"out\": `y{s`: a `{` without its `}`",
        ),
        (
            r#"{"world": 3, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"for": "s", "from": 0, "to": 1, "steps": [{"op": "tanh", "in": ["x"], "out": "y{s}", "ranks": ["s"], "if": "s"}]}], "loss": "x"}"#,
            "a condition compares two expressions",
        ),
        (
            r#"{"world": 3, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"for": "s", "from": 0, "to": 1, "steps": [{"for": "s", "from": 0, "to": 1, "steps": []}]}], "loss": "x"}"#,
            "`s` is already a variable of an enclosing block",
        ),
        (
            r#"{"world": 3, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"for": "s", "from": 0, "to": 400, "steps": [{"for": "t", "from": 0, "to": 400, "steps": [{"op": "tanh", "in": ["x"], "out": "y{s}_{t}"}]}]}], "loss": "x"}"#,
            "the program grows beyond 100000 steps",
        ),
        (
            r#"{"world": 3, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"for": "s", "from": 0, "to": "1000000000000", "steps": [{"for": "t", "from": 0, "to": 9, "steps": []}]}], "loss": "x"}"#,
            "the program grows beyond 100000 steps and block repetitions",
        ),
        (
            r#"{"world": 3, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"for": "s", "from": 0, "to": "last", "steps": [{"op": "tanh", "in": ["x"], "out": "y", "ranks": ["s+1"]}]}], "loss": "x"}"#,
            "step 0 (for s), its step 0 with s = 2 (tanh [x] -> y): \"ranks\" [3]: ranks must be distinct and below world 3",
        ),
        (
            r#"{"world": 3, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"for": "s", "from": 0, "to": "last", "steps": [{"collective": "send", "dst": "s+1", "in": ["x"], "ranks": ["s"], "if": "s < last"}, {"collective": "recv", "src": "s-1", "shape": [2], "out": "r", "ranks": ["s"], "if": "s > 0"}]}], "loss": "x"}"#,
            "step 0 (for s), its step 0 with s = 0 sends a [1] tensor that step 0 (for s), its step 1 with s = 1 receives as [2]",
        ),
        (
            r#"{"world": 3, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"for": "s", "from": 0, "to": "last", "steps": [{"collective": "send", "dst": "s+1", "in": ["x"], "ranks": ["s"], "if": "s < last"}]}], "loss": "x"}"#,
            "group rank 0 sends 1 message(s) to group rank 1 (step 0 (for s), its step 0 with s = 0), which receives 0",
        ),
        (
            r#"{"world": 3, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"for": "s", "from": 0, "to": "last", "steps": [{"collective": "send", "dst": "((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((s))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))", "in": ["x"], "ranks": ["s"]}]}], "loss": "x"}"#,
            "longer than 256 bytes",
        ),
        (
            r#"{"world": 3, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"for": "s", "from": -9223372036854775808, "to": 0, "steps": []}], "loss": "x"}"#,
            "is not an integer of at most 2^40 in size",
        ),
        (
            r#"{"world": 3, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"for": "s", "from": 0, "to": 1099511627776, "steps": [{"op": "tanh", "in": ["x"], "out": "y", "if": "0 > 1"}]}], "loss": "x"}"#,
            "the program grows beyond 100000 steps and block repetitions",
        ),
        (
            r#"{"world": 3, "inputs": [{"name": "x", "shape": [1]}], "steps": [{"for": "s", "from": 0, "to": 1, "steps": [{"op": "tanh", "in": ["x"], "out": "y{s}", "if": "(s > 0) && s < 2"}]}], "loss": "x"}"#,
            "no parentheses around comparisons",
        ),
    ];
    for (json, want) in cases {
        let e = match Program::parse(json).and_then(|p| p.plan(None)) {
            Ok(_) => panic!("accepted: {json}"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(want), "want {want:?} in: {e}\nprogram: {json}");
    }
    // Names bound on some ranks only: using one where it does not exist is refused.
    let json = r#"{"world": 3, "inputs": [{"name": "x", "shape": [2, 3]}], "steps": [
        {"op": "slice", "dim": 1, "start": 0, "len": 2, "in": ["x"], "out": "a", "ranks": [1]},
        {"op": "slice", "dim": 1, "start": 0, "len": 1, "in": ["x"], "out": "a2", "ranks": [0, 2]},
        {"op": "reshape", "shape": [2, 2], "in": ["a"], "out": "v", "ranks": [1]},
        {"op": "concat", "dim": 1, "in": ["a2", "a2"], "out": "v2", "ranks": [0, 2]},
        {"collective": "all_reduce", "in": ["v"], "out": "s"}], "loss": "s"}"#;
    let e = program(json)
        .plan(None)
        .expect_err("v is not on rank 0")
        .to_string();
    assert!(e.contains("`v` is not defined on rank 0"), "{e}");
    let json = r#"{"world": 2, "inputs": [{"name": "x", "shape": [2, 3]}], "steps": [
        {"op": "slice", "dim": 1, "start": 0, "len": 2, "in": ["x"], "out": "a", "ranks": [1]},
        {"op": "slice", "dim": 1, "start": 0, "len": 1, "in": ["x"], "out": "a", "ranks": [0, 1]}], "loss": "a"}"#;
    let e = program(json)
        .plan(None)
        .expect_err("a is bound twice on rank 1")
        .to_string();
    assert!(e.contains("`a` is already defined on this rank"), "{e}");
    let json = r#"{"world": 2, "inputs": [{"name": "x", "shape": [2]}, {"name": "y", "shape": [3]}], "steps": [
        {"op": "sum", "in": ["x"], "out": "sx", "ranks": [0]},
        {"op": "tanh", "in": ["x"], "out": "v", "ranks": [0]},
        {"op": "tanh", "in": ["y"], "out": "w", "ranks": [1]},
        {"collective": "send", "dst": 1, "in": ["v"], "ranks": [0]},
        {"collective": "recv", "src": 0, "shape": [2], "out": "r", "ranks": [1]},
        {"collective": "all_gather", "in": ["x"], "out": "g"},
        {"op": "add", "in": ["g.0", "g.1"], "out": "q"},
        {"collective": "reduce_scatter", "in": ["q", "x"], "out": "rs"},
        {"op": "sum", "in": ["rs"], "out": "loss"}], "loss": "loss"}"#;
    assert!(
        program(json).plan(None).is_ok(),
        "a valid rank-dependent program"
    );
}

#[test]
fn gradcheck_cli_exit_codes_and_table() {
    let bin = env!("CARGO_BIN_EXE_distgrad");
    let prog = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/www/programs/mlp_all_reduce.json"
    );
    let out = Command::new(bin)
        .args(["gradcheck", prog])
        .output()
        .expect("run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("rank | input | checked | max abs err"),
        "{text}"
    );
    assert!(text.trim_end().ends_with("PASS"), "{text}");
    // Zero tolerance: f32 rounding alone fails it, exit code 1.
    let out = Command::new(bin)
        .args(["gradcheck", prog, "--rtol", "0", "--atol", "0"])
        .output()
        .expect("run");
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .trim_end()
            .ends_with("FAIL")
    );
    // A bad program: exit code 2 and the reason.
    let bad = std::env::temp_dir().join(format!("distgrad-bad-{}.json", std::process::id()));
    std::fs::write(
        &bad,
        r#"{"world": 2, "inputs": [], "steps": [], "loss": "nope"}"#,
    )
    .expect("write");
    let out = Command::new(bin)
        .args(["gradcheck"])
        .arg(&bad)
        .output()
        .expect("run");
    let _ = std::fs::remove_file(&bad);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("loss `nope` is defined on no rank"));
    // `run` prints every rank's loss and gradients.
    let out = Command::new(bin)
        .args(["run", prog, "--world", "2"])
        .output()
        .expect("run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("d F / d x") && text.contains("world=2"),
        "{text}"
    );
}

/// The property test: random programs (every collective, subgroups in any order, every reduce
/// op, uneven splits, send / recv, both objectives, worlds 1..=8) gradchecked on in-process ranks.
/// Bounded: a fixed range of seeds (moved with DISTGRAD_PROGRAM_SEED), each printed with its
/// program on failure. Nothing may FAIL; INCONCLUSIVE (an exact tie of max / min across ranks,
/// where a check per coordinate cannot decide) is counted and allowed.
#[test]
fn random_programs_gradcheck() {
    use distgrad::program::{RandomOptions, random_program};
    let first: u64 = std::env::var("DISTGRAD_PROGRAM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let count = 600;
    let o = Options {
        comm: CommOptions {
            timeout: std::time::Duration::from_secs(10),
            ..CommOptions::default()
        },
        ..Options::default()
    };
    let (mut passed, mut refused, mut inconclusive) = (0, 0, Vec::new());
    let mut failures = Vec::new();
    let mut kinds = std::collections::BTreeSet::new();
    for seed in first..first + count {
        let p = random_program(seed, &RandomOptions::default());
        let plan = match p.plan(None) {
            Ok(plan) => plan,
            Err(_) => {
                refused += 1;
                continue;
            }
        };
        for s in &p.steps {
            let v = serde_json::to_value(s).expect("step");
            if let Some(k) = v.get("collective").and_then(|k| k.as_str()) {
                kinds.insert(k.to_string());
            }
        }
        match gradcheck_program(&plan, &o) {
            Ok(r) if r.verdict() == "PASS" => passed += 1,
            Ok(r) if r.passed => inconclusive.push(seed),
            Ok(r) => failures.push(format!(
                "seed {seed}:\n{}\n{}",
                serde_json::to_string(&p).unwrap_or_default(),
                r.render()
            )),
            Err(e) => failures.push(format!(
                "seed {seed}: {e}\n{}",
                serde_json::to_string(&p).unwrap_or_default()
            )),
        }
    }
    println!(
        "random programs {first}..{}: {passed} passed, {} inconclusive {inconclusive:?}, {refused} refused by the plan, {} failed; collectives seen: {kinds:?}",
        first + count,
        inconclusive.len(),
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    assert!(
        passed >= count * 8 / 10,
        "most generated programs must be checkable: {passed} of {count}"
    );
    for k in [
        "all_reduce",
        "broadcast",
        "reduce",
        "all_gather",
        "gather",
        "scatter",
        "reduce_scatter",
        "all_to_all",
        "all_to_all_single",
        "permute",
        "send",
        "recv",
    ] {
        assert!(kinds.contains(k), "the generator made no {k}: {kinds:?}");
    }
}

fn cli(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_distgrad"))
        .args(args)
        .output()
        .expect("run distgrad");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The same programs, the same numbers, bit for bit: in-process ranks (`run`), worker processes
/// through a relay and over direct TCP links (`demo --program`).
#[test]
fn programs_run_the_same_over_every_transport() {
    for (path, _) in shipped() {
        let (code, local, err) = cli(&["run", &path, "--json"]);
        assert_eq!(code, Some(0), "{path}: {err}");
        let runs: serde_json::Value = serde_json::from_str(&local).expect("JSON");
        assert!(runs.as_array().is_some_and(|a| !a.is_empty()), "{path}");
        for t in ["relay", "direct"] {
            let (code, out, err) = cli(&["demo", "--program", &path, "--transport", t, "--json"]);
            assert_eq!(code, Some(0), "{path} over {t}: {err}");
            assert_eq!(out, local, "{path}: {t} vs in-process");
        }
    }
}

/// `gradcheck --transport relay|direct`: every worker process runs the whole check over its
/// links and prints the report; it is the in-process report, character for character.
#[test]
fn gradcheck_over_processes_gives_the_in_process_report() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/www/programs/");
    for name in [
        "max_tie.json",
        "pipeline_send_recv.json",
        "tensor_parallel.json",
    ] {
        let path = format!("{dir}{name}");
        let (code, local, err) = cli(&["gradcheck", &path]);
        assert_eq!(code, Some(0), "{name}: {err}");
        for t in ["relay", "direct"] {
            let (code, out, err) = cli(&["gradcheck", &path, "--transport", t]);
            assert_eq!(code, Some(0), "{name} over {t}: {err}");
            assert_eq!(out, local, "{name}: {t} vs in-process");
            if t == "direct" && name != "pipeline_send_recv.json" {
                assert!(err.contains("direct links to ranks"), "{err}");
            }
        }
    }
    // A failing check fails the same way over processes (exit code 1).
    let path = format!("{dir}mlp_all_reduce.json");
    let (code, out, _) = cli(&[
        "gradcheck",
        &path,
        "--transport",
        "relay",
        "--rtol",
        "0",
        "--atol",
        "0",
    ]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.trim_end().ends_with("FAIL"));
}

/// Every command that takes a program takes a lesson file (its program: a collective lesson's
/// example case for the world asked): `gradcheck`, `run --print-program`, `demo --program`, and
/// the lesson's program printed by `run --print-program` checks the same as the lesson itself.
#[test]
fn commands_that_take_a_program_take_a_lesson() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/www/lessons/");
    for name in ["all_reduce_max", "tensor_parallel", "data_parallel"] {
        let path = format!("{dir}{name}.json");
        let (code, report, err) = cli(&["gradcheck", &path, "--world", "4"]);
        assert_eq!(code, Some(0), "{name}: {err}");
        assert!(report.trim_end().ends_with("PASS"), "{name}: {report}");
        let (code, printed, err) = cli(&["run", &path, "--world", "4", "--print-program"]);
        assert_eq!(code, Some(0), "{name}: {err}");
        let file =
            std::env::temp_dir().join(format!("distgrad-{name}-{}.json", std::process::id()));
        std::fs::write(&file, &printed).expect("write");
        let file = file.to_string_lossy().into_owned();
        let (code, again, err) = cli(&["gradcheck", &file]);
        assert_eq!(code, Some(0), "{name}: {err}");
        assert_eq!(
            again, report,
            "{name}: the printed program checks as the lesson"
        );
        let (code, local, err) = cli(&["run", &file, "--json"]);
        assert_eq!(code, Some(0), "{name}: {err}");
        let (code, demo, err) =
            cli(&["demo", "--program", &path, "--program-world", "4", "--json"]);
        assert_eq!(code, Some(0), "{name}: {err}");
        assert_eq!(
            demo, local,
            "{name}: the lesson's program and the printed one run alike"
        );
        std::fs::remove_file(&file).ok();
    }
}

/// `gradcheck --json`: the report as JSON, the same verdict and rows as the table (independently
/// read back from the table's text), the same exit code, and the same JSON from worker processes.
#[test]
fn gradcheck_json_is_the_report() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/www/programs/");
    let path = format!("{dir}max_tie.json");
    let (code, table, err) = cli(&["gradcheck", &path]);
    assert_eq!(code, Some(0), "{err}");
    let (code, out, err) = cli(&["gradcheck", &path, "--json"]);
    assert_eq!(code, Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON value");
    assert_eq!(v["verdict"], "PASS");
    assert_eq!(v["world"], 3);
    assert_eq!(v["objective"], "sum_of_rank_losses");
    assert_eq!(v["mode"]["kind"], "coordinates");
    let rows = v["rows"].as_array().expect("rows");
    assert!(!rows.is_empty());
    for row in rows {
        let (rank, input) = (&row["rank"], row["input"].as_str().expect("input"));
        assert!(
            table.lines().any(|l| {
                let cols: Vec<&str> = l.split('|').map(str::trim).collect();
                cols.len() > 2
                    && *rank == cols[0].parse::<u64>().unwrap_or(u64::MAX)
                    && cols[1] == input
            }),
            "row ({rank}, {input}) is in the table:\n{table}"
        );
        assert_eq!(row["failed"], 0);
    }
    // max_tie has a tie of MAX across ranks: the kinks are listed.
    assert!(!v["kinks"].as_array().expect("kinks").is_empty(), "{out}");
    assert!(table.contains("kink"), "{table}");
    let evaluations = v["evaluations"].as_u64().expect("evaluations");
    assert!(table.contains(&format!("{evaluations} runs")), "{table}");

    let (code, relay, err) = cli(&["gradcheck", &path, "--json", "--transport", "relay"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(relay, out, "worker processes print the same JSON");

    // A failing check: exit code 1 with --json too.
    let path = format!("{dir}mlp_all_reduce.json");
    let (code, out, _) = cli(&["gradcheck", &path, "--json", "--rtol", "0", "--atol", "0"]);
    assert_eq!(code, Some(1), "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["verdict"], "FAIL");
    let (code, _, err) = cli(&["gradcheck", "--random", "2", "--json"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--json prints one program's report"), "{err}");
}

/// Every shipped program on GPU ranks (lavapipe in CI): inputs go where the communicator puts
/// what it receives, so a rank that receives a tensor and computes with its own inputs has both
/// on one device (a `recv` on a GPU rank used to meet a host input in `matmul`); losses and
/// gradients equal the CPU ranks' within f32 rounding, and the gradient check passes there too.
#[test]
fn shipped_programs_run_and_check_on_gpu_ranks() {
    let Some(gpu) = common_gpu::gpu() else {
        return;
    };
    let on_gpu = CommOptions {
        device: distgrad::backend::Device::Gpu(gpu.clone()),
        ..CommOptions::default()
    };
    for (path, p) in shipped() {
        let plan = p.plan(None).unwrap_or_else(|e| panic!("{path}: {e}"));
        let cpu = run_local(&plan, CommOptions::default()).expect("CPU ranks");
        let gpu_runs = run_local(&plan, on_gpu.clone()).unwrap_or_else(|e| panic!("{path}: {e}"));
        for (r, (c, g)) in cpu.iter().zip(&gpu_runs).enumerate() {
            let near = |a: f32, b: f32| (a - b).abs() <= 1e-4 * a.abs().max(b.abs()).max(1.0);
            assert_eq!(c.loss.is_some(), g.loss.is_some(), "{path} rank {r}");
            if let (Some(a), Some(b)) = (c.loss, g.loss) {
                assert!(near(a, b), "{path} rank {r}: loss {a} on CPU, {b} on GPU");
            }
            for (i, (a, b)) in c.grads.iter().zip(&g.grads).enumerate() {
                let (Some(a), Some(b)) = (a, b) else {
                    assert_eq!(a.is_some(), b.is_some(), "{path} rank {r} input {i}");
                    continue;
                };
                assert!(
                    a.iter().zip(b).all(|(x, y)| near(*x, *y)),
                    "{path} rank {r} input {i}: {a:?} on CPU, {b:?} on GPU"
                );
            }
        }
        let o = Options {
            comm: on_gpu.clone(),
            ..Options::default()
        };
        let report = gradcheck_program(&plan, &o).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(report.passed, "{path} on GPU ranks:\n{}", report.render());
    }
}
