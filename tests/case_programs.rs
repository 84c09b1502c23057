//! A `distgrad vjp` case is a one-collective program ([`distgrad::vjp::Case::program`]), and
//! that program is what `vjp` runs: for every collective, reduce op, roots other than 0, worlds
//! 1..8 and subgroups, the program's gradients and `vjp`'s outputs and gradients are bit for bit
//! those of the case's collective called directly on a tape (`dist::call`, backward seeded with
//! the case's cotangents: no program involved), its loss is `Σ <y, c>` of the outputs and
//! cotangents, and the distributed gradient check passes on it; the CLI prints it
//! (`vjp --print-program`) in a form `distgrad run` takes.

use std::process::Command;

use distgrad::collective::Spec;
use distgrad::gradcheck::{Options, gradcheck_program};
use distgrad::program::{Program, run_local};
use distgrad::vjp::{self, COLLECTIVES, Case, CaseOutput, TensorJson};
use distgrad::{CommOptions, Communicator, ReduceOp, Tape, Tensor, Var, dist};

/// The reference: the case's collective called directly on a tape on in-process ranks, backward
/// seeded with the case's cotangents (ones without), outputs and input gradients per global rank
/// (empty lists outside the group). `dual` is left empty.
fn direct(c: &Case) -> CaseOutput {
    let world = c.world;
    let group: Vec<usize> = c.group.clone().unwrap_or_else(|| (0..world).collect());
    let op =
        c.op.as_deref()
            .map_or(Ok(ReduceOp::Sum), ReduceOp::parse)
            .expect("op");
    let root = c.root.unwrap_or(0);
    let spec = |g: usize| match c.collective.as_str() {
        "broadcast" => Spec::Broadcast { root },
        "reduce" => Spec::Reduce { root, op },
        "all_reduce" => Spec::AllReduce { op },
        "gather" => Spec::Gather { root },
        "scatter" => Spec::Scatter { root },
        "all_gather" => Spec::AllGather {},
        "reduce_scatter" => Spec::ReduceScatter { op },
        "all_to_all" => Spec::AllToAll {},
        "permute" => Spec::Permute {
            perm: c.perm.clone().expect("perm"),
        },
        "all_to_all_single" => Spec::AllToAllSingle {
            in_splits: c.in_splits.as_ref().expect("in_splits")[g].clone(),
            out_splits: c.out_splits.as_ref().expect("out_splits")[g].clone(),
        },
        other => panic!("no reference for {other}"),
    };
    let tensor = |t: &TensorJson| {
        let data: Vec<f32> = t.data.iter().map(|x| x.expect("finite")).collect();
        Tensor::from_vec(data, &t.shape).expect("tensor")
    };
    let (group, spec, tensor) = (&group, &spec, &tensor);
    let results = distgrad::run_local(world, CommOptions::default(), |comm| async move {
        let me = comm.rank();
        let g = if group.len() == world {
            comm.world()
        } else {
            comm.new_group(group)?
        };
        if g.rank().is_none() {
            return Ok((Vec::new(), Vec::new()));
        }
        let tape = Tape::new();
        let xs: Vec<Var> = c.inputs[me].iter().map(|t| tape.var(tensor(t))).collect();
        let ys = dist::call(&comm, &tape, &spec(me), &xs, &g).await?;
        let seeds: Vec<(Var, Tensor)> = match &c.cotangents {
            Some(cots) => ys
                .iter()
                .cloned()
                .zip(cots[me].iter().map(tensor))
                .collect(),
            None => ys
                .iter()
                .map(|y| Ok((y.clone(), y.value().full_like(1.0)?)))
                .collect::<distgrad::Result<_>>()?,
        };
        let grads = tape.backward_from(&seeds, &comm).await?;
        let mut outs = Vec::new();
        for y in &ys {
            outs.push(TensorJson::read(&y.value()).await?);
        }
        let mut gs = Vec::new();
        for x in &xs {
            gs.push(TensorJson::read(&grads.wrt(x)?).await?);
        }
        Ok((outs, gs))
    });
    let (outputs, grads) = results
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("{}: rank {r}: {e}", label(c))))
        .unzip();
    CaseOutput {
        dual: String::new(),
        outputs,
        grads,
    }
}

/// `vjp` (which runs the case's program) and the direct reference agree bit for bit.
fn same_as_direct(c: &Case, got: &CaseOutput, want: &CaseOutput) {
    let bits = |l: &Vec<Vec<TensorJson>>| -> Vec<Vec<(Vec<usize>, Vec<u32>)>> {
        l.iter()
            .map(|ts| {
                ts.iter()
                    .map(|t| {
                        let d = t.data.iter().map(|x| x.unwrap_or(f32::NAN).to_bits());
                        (t.shape.clone(), d.collect())
                    })
                    .collect()
            })
            .collect()
    };
    assert_eq!(
        bits(&got.outputs),
        bits(&want.outputs),
        "{}: outputs",
        label(c)
    );
    assert_eq!(bits(&got.grads), bits(&want.grads), "{}: grads", label(c));
}

/// Every example case: each collective at each world, each op where it takes one, roots 0 and
/// the last group rank, and a subgroup of world 5.
fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for which in COLLECTIVES {
        let ops: Vec<ReduceOp> = if which.takes_op() {
            ReduceOp::ALL.to_vec()
        } else {
            vec![ReduceOp::Sum]
        };
        for world in [1, 2, 3, 4, 5, 8] {
            let roots: Vec<usize> = if which.takes_root() {
                vec![0, world - 1]
            } else {
                vec![0]
            };
            for &op in &ops {
                for &root in &roots {
                    out.push(vjp::example_case(which, world, op, root, None).expect("example"));
                }
            }
        }
        let op = *ops.last().expect("an op");
        let root = if which.takes_root() { 2 } else { 0 };
        out.push(vjp::example_case(which, 5, op, root, Some(vec![4, 1, 3])).expect("subgroup"));
    }
    out
}

fn label(c: &Case) -> String {
    format!(
        "{} world {} op {:?} root {:?} group {:?}",
        c.collective, c.world, c.op, c.root, c.group
    )
}

/// Compare the program's run with the case's answer on every rank.
fn same_answer(c: &Case, program: &Program, want: &CaseOutput) {
    let plan = program
        .plan(None)
        .unwrap_or_else(|e| panic!("{}: {e}", label(c)));
    let runs = run_local(&plan, CommOptions::default()).expect("run");
    for (g, run) in runs.iter().enumerate() {
        // Gradients: the case's inputs come first in the program, in order.
        for (k, grad) in want.grads[g].iter().enumerate() {
            let got = run.grads[k]
                .as_ref()
                .unwrap_or_else(|| panic!("{}: rank {g} input {k} has no gradient", label(c)));
            let want: Vec<u32> = grad
                .data
                .iter()
                .map(|x| x.unwrap_or(f32::NAN).to_bits())
                .collect();
            let got: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
            assert_eq!(got, want, "{}: rank {g} input {k}", label(c));
        }
        // Slots this rank does not hold have no gradient.
        for k in want.grads[g].len()..c.inputs.iter().map(Vec::len).max().unwrap_or(0) {
            assert!(run.grads[k].is_none(), "{}: rank {g} slot {k}", label(c));
        }
        // The loss is <y, c> where the rank has outputs.
        let outs = &want.outputs[g];
        match run.loss {
            None => assert!(outs.is_empty(), "{}: rank {g} has outputs", label(c)),
            Some(l) => {
                let cots = &c.cotangents.as_ref().expect("example cotangents")[g];
                let dot: f64 = outs
                    .iter()
                    .zip(cots)
                    .flat_map(|(y, t)| y.data.iter().zip(&t.data))
                    .map(|(y, t)| f64::from(y.unwrap_or(0.0)) * f64::from(t.unwrap_or(0.0)))
                    .sum();
                assert!(
                    (f64::from(l) - dot).abs() <= 1e-5 * dot.abs().max(1.0),
                    "{}: rank {g} loss {l}, <y, c> = {dot}",
                    label(c)
                );
            }
        }
    }
}

#[test]
fn every_example_case_is_a_program_with_the_same_gradients() {
    let all = cases();
    assert!(all.len() > 100, "{} cases", all.len());
    for c in &all {
        let want = direct(c);
        let got = vjp::run_case(c).unwrap_or_else(|e| panic!("{}: {e}", label(c)));
        same_as_direct(c, &got, &want);
        let program = c.program().unwrap_or_else(|e| panic!("{}: {e}", label(c)));
        // One collective step, then only local steps.
        let collectives = serde_json::to_value(&program.steps)
            .expect("steps")
            .as_array()
            .expect("list")
            .iter()
            .filter(|s| s.get("collective").is_some())
            .count();
        assert_eq!(collectives, 1, "{}", label(c));
        // What the CLI prints reads back as the same program.
        let text = serde_json::to_string(&program).expect("serialize");
        assert_eq!(
            Program::parse(&text).expect("parse"),
            program,
            "{}",
            label(c)
        );
        same_answer(c, &program, &want);
    }
}

/// Without cotangents a case seeds ones: the program's loss is then the plain sum of the outputs.
#[test]
fn a_case_without_cotangents_is_the_sum_of_its_outputs() {
    for which in COLLECTIVES {
        let mut c = vjp::example_case(which, 3, ReduceOp::Max, 1, None).expect("example");
        c.cotangents = None;
        let want = direct(&c);
        same_as_direct(&c, &vjp::run_case(&c).expect("case"), &want);
        let program = c.program().expect("program");
        assert!(
            program.inputs.iter().all(|i| i.grad),
            "{}: no cotangent constants",
            label(&c)
        );
        // Compare against ones as cotangents.
        let mut with_ones = c.clone();
        with_ones.cotangents = Some(
            want.outputs
                .iter()
                .map(|outs| {
                    outs.iter()
                        .map(|o| vjp::TensorJson {
                            shape: o.shape.clone(),
                            data: vec![Some(1.0); o.data.len()],
                        })
                        .collect()
                })
                .collect(),
        );
        same_answer(&with_ones, &program, &want);
    }
}

/// The finite-difference check agrees with backward on the case programs (worlds up to 4, every
/// collective and op; the example values have no ties).
#[test]
fn case_programs_pass_the_gradient_check() {
    let mut checked = 0;
    for c in cases().iter().filter(|c| c.world <= 4) {
        let program = c.program().expect("program");
        let plan = program.plan(None).expect("plan");
        let r = gradcheck_program(&plan, &Options::default()).expect("check");
        assert!(r.passed, "{}:\n{}", label(c), r.render());
        assert!(r.kinks.is_empty(), "{}: no ties\n{}", label(c), r.render());
        checked += r.rows.iter().map(|row| row.checked).sum::<usize>();
    }
    assert!(checked > 500, "{checked} coordinates");
}

#[test]
fn the_cli_prints_a_case_as_a_program() {
    let bin = env!("CARGO_BIN_EXE_distgrad");
    let dir = std::env::temp_dir().join(format!("distgrad-case-programs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("scatter.json");
    // Runs the binary, expecting success.
    let ok = |args: &[&str]| {
        let out = Command::new(bin).args(args).output().expect("run distgrad");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {err}");
        out
    };
    let out = ok(&[
        "vjp",
        "scatter",
        "--world",
        "3",
        "--root",
        "2",
        "--print-program",
    ]);
    std::fs::write(&path, &out.stdout).expect("write");
    let text = String::from_utf8(out.stdout).expect("utf-8");
    assert!(text.contains("\"ranks\": [\n        2\n      ]"), "{text}");
    // distgrad run: the root's gradients are the cotangents [1, r + 1] of rank r, the others
    // hold no input.
    let out = ok(&["run", path.to_str().expect("path"), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(
        v[2]["grads"],
        serde_json::json!([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0], null])
    );
    assert_eq!(v[0]["grads"], serde_json::json!([null, null, null, null]));
    let _ = std::fs::remove_dir_all(&dir);
}
