//! The teaching demo's lessons (`www/lessons/*.json`): every file parses and runs on 2..8 ranks,
//! hand-derived values for the lessons that teach a number, the same trace whether the ranks are
//! interleaved on one task (the page's single-tab mode, `distgrad run`) or are threads, and the
//! `distgrad run` command.

use std::path::Path;
use std::process::Command;

use distgrad::backend::Device;
use distgrad::lesson::{self, Lesson, Phase, Trace};
use distgrad::vjp;

fn lessons_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/www/lessons"))
}

fn load(name: &str) -> Lesson {
    let text = std::fs::read_to_string(lessons_dir().join(format!("{name}.json"))).unwrap();
    lesson::parse(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn all_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(lessons_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".json") && n != "index.json")
        .map(|n| n.trim_end_matches(".json").to_string())
        .collect();
    names.sort();
    names
}

fn simulate(l: &Lesson, world: usize) -> Trace {
    futures::executor::block_on(lesson::run_simulated(l, world, &Device::Cpu, &[]))
        .unwrap_or_else(|e| panic!("{} on {world} ranks: {e}", l.name))
}

/// Values of `name` at `step` on `rank`, flattened.
fn vals(t: &Trace, step: usize, rank: usize, name: &str) -> Vec<f32> {
    t.steps[step].ranks[rank]
        .iter()
        .find(|n| n.name == name)
        .unwrap_or_else(|| panic!("no {name} at step {step}"))
        .tensors
        .iter()
        .flat_map(|x| x.data.iter().map(|v| v.unwrap()))
        .collect()
}

#[test]
fn index_lists_every_lesson_file_and_names_match() {
    #[derive(serde::Deserialize)]
    struct Entry {
        name: String,
        title: String,
        #[serde(default)]
        min_world: Option<usize>,
    }
    #[derive(serde::Deserialize)]
    struct Index {
        lessons: Vec<Entry>,
    }
    let idx: Index =
        serde_json::from_str(&std::fs::read_to_string(lessons_dir().join("index.json")).unwrap())
            .unwrap();
    let mut listed: Vec<String> = idx.lessons.iter().map(|e| e.name.clone()).collect();
    listed.sort();
    assert_eq!(listed, all_names());
    for e in &idx.lessons {
        let l = load(&e.name);
        assert_eq!(l.name, e.name, "file name and \"name\" differ");
        assert_eq!(l.title, e.title, "{}: index title differs", e.name);
        assert_eq!(
            l.min_world,
            e.min_world.unwrap_or(1),
            "{}: index min_world differs",
            e.name
        );
        assert!(!l.why.is_empty());
    }
    // The issue's list: a lesson per collective, all_reduce with each op, objectives, DP, TP.
    for want in [
        "broadcast",
        "reduce",
        "gather",
        "scatter",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "all_reduce_sum",
        "all_reduce_avg",
        "all_reduce_prod",
        "all_reduce_min",
        "all_reduce_max",
        "permute",
        "objectives",
        "data_parallel",
        "tensor_parallel",
    ] {
        assert!(listed.iter().any(|n| n == want), "missing lesson {want}");
    }
}

#[test]
fn every_lesson_runs_on_2_to_8_ranks_with_consistent_steps() {
    for name in all_names() {
        let l = load(&name);
        // A lesson on a subgroup of ranks 1 and 2 needs 3 ranks (its "min_world"; below it the
        // lesson refuses, tested in tests/wrong_duals.rs).
        for world in l.min_world.max(2)..=8 {
            let t = simulate(&l, world);
            assert_eq!(t.world, world);
            assert!(t.steps.len() >= 4, "{name}");
            for (k, st) in t.steps.iter().enumerate() {
                assert_eq!(st.ranks.len(), world, "{name} step {k}");
                for &(a, b) in &st.arrows {
                    assert!(
                        a < world && b < world && a != b,
                        "{name} step {k}: arrow {a}->{b}"
                    );
                }
                // Every rank reports the same value names at a step.
                let names: Vec<&str> = st.ranks[0].iter().map(|n| n.name.as_str()).collect();
                for r in &st.ranks {
                    assert_eq!(r.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), names);
                }
            }
            // The backward steps name the collective the backward pass really ran.
            for st in t.steps.iter().filter(|s| s.phase == Phase::Backward) {
                assert!(st.collective.is_some(), "{name}: {}", st.label);
            }
        }
    }
}

#[test]
fn collective_lessons_equal_distgrad_vjp_and_name_the_dual() {
    // A collective lesson's values are exactly the vjp case's, and the backward step names the
    // dual of the dual table.
    let duals = [
        ("broadcast", "reduce(op=sum, root=1)"),
        ("reduce", "broadcast(root=1)"),
        ("gather", "scatter(root=2)"),
        ("scatter", "gather(root=0)"),
        ("all_gather", "reduce_scatter(op=sum)"),
        ("reduce_scatter", "all_gather"),
        ("all_to_all", "all_to_all"),
        ("all_reduce_sum", "all_reduce(op=sum)"),
        ("all_reduce_avg", "all_reduce(op=avg)"),
        ("all_reduce_max", "all_reduce(op=sum)"),
        ("permute", "permute"),
    ];
    for (name, dual) in duals {
        let l = load(name);
        let t = simulate(&l, 3);
        assert_eq!(t.steps[3].collective.as_deref(), Some(dual), "{name}");
        let case = lesson::lesson_case(&l, 3).unwrap();
        let out = vjp::run_case(&case).unwrap();
        for r in 0..3 {
            assert_eq!(
                t.steps[1].ranks[r][0].tensors, out.outputs[r],
                "{name} y rank {r}"
            );
            assert_eq!(
                t.steps[3].ranks[r][0].tensors, out.grads[r],
                "{name} dx rank {r}"
            );
        }
        // Backward arrows are the forward arrows reversed.
        let rev: Vec<(usize, usize)> = t.steps[1].arrows.iter().map(|&(a, b)| (b, a)).collect();
        assert_eq!(t.steps[3].arrows, rev, "{name}");
    }
}

#[test]
fn hand_derived_all_gather_and_all_reduce_max() {
    // all_gather of x_r = [r+1, 2(3-r)] with cotangents [1, r+1] on every slot: the gradient of
    // every rank's x is the sum over ranks of their cotangents = [3, 1+2+3].
    let t = simulate(&load("all_gather"), 3);
    for r in 0..3 {
        assert_eq!(
            vals(&t, 0, r, "x"),
            [r as f32 + 1.0, 2.0 * (3.0 - r as f32)]
        );
        assert_eq!(vals(&t, 1, r, "y"), [1.0, 6.0, 2.0, 4.0, 3.0, 2.0]);
        assert_eq!(vals(&t, 3, r, "dL/dx"), [3.0, 6.0]);
    }
    // all_reduce(MAX): y = [3, 6]; element 0's max is on rank 2, element 1's on rank 0; each gets
    // the summed cotangent [3, 6] for its element.
    let t = simulate(&load("all_reduce_max"), 3);
    assert_eq!(vals(&t, 1, 1, "y"), [3.0, 6.0]);
    assert_eq!(vals(&t, 3, 0, "dL/dx"), [0.0, 6.0]);
    assert_eq!(vals(&t, 3, 1, "dL/dx"), [0.0, 0.0]);
    assert_eq!(vals(&t, 3, 2, "dL/dx"), [3.0, 0.0]);
}

#[test]
fn objectives_differ_by_exactly_the_world_size() {
    let l = load("objectives");
    for n in 1..=6usize {
        let t = simulate(&l, n);
        // x_r = [r+1, 2]: s = [n(n+1)/2, 2n]; per-rank-sum objective: N·s; replicated: s.
        let s = [(n * (n + 1) / 2) as f32, 2.0 * n as f32];
        // Steps: 0 inputs, 1-4 forward (all_reduce, square, sum, scale), 5 the cotangents and
        // 6 the backward under the sum of rank losses, 7 and 8 under the replicated loss, 9 the
        // ratios.
        assert_eq!(t.steps.len(), 10);
        let loss = 0.5 * (s[0] * s[0] + s[1] * s[1]);
        for r in 0..n {
            assert_eq!(vals(&t, 0, r, "x"), [r as f32 + 1.0, 2.0]);
            assert_eq!(vals(&t, 1, r, "s"), s);
            assert_eq!(vals(&t, 4, r, "loss"), [loss]);
            // d(½·sum(s²))/ds = s per rank under both; the loss's own cotangent 1.
            for k in [5, 7] {
                assert_eq!(vals(&t, k, r, "dL/ds"), s);
                assert_eq!(vals(&t, k, r, "dL/dloss"), [1.0]);
            }
            assert_eq!(vals(&t, 6, r, "dL/dx"), [n as f32 * s[0], n as f32 * s[1]]);
            assert_eq!(vals(&t, 8, r, "dL/dx"), s);
            assert_eq!(vals(&t, 9, r, "ratio x"), [n as f32, n as f32]);
            assert_eq!(vals(&t, 9, r, "ratio s"), [1.0, 1.0]);
            assert_eq!(vals(&t, 9, r, "ratio loss"), [1.0]);
            // The kinds are the replicated objective's: s and the loss are invariant.
            let kind = |k: usize, name: &str| {
                t.steps[k].ranks[r]
                    .iter()
                    .find(|v| v.name == name)
                    .and_then(|v| v.kind.clone())
            };
            assert_eq!(kind(1, "s").as_deref(), Some("invariant"));
            assert_eq!(kind(4, "loss").as_deref(), Some("invariant"));
        }
        assert_eq!(t.steps[6].collective.as_deref(), Some("all_reduce(op=sum)"));
        assert_eq!(t.steps[8].collective.as_deref(), Some("nothing"));
    }
}

#[test]
fn tensor_parallel_hand_derived_and_backward_is_reduce_scatter() {
    // X rows [1,1], [2,0], [3,-1]; W columns [1,1], [1,2], [1,3]. Y_r = X·W_r, loss_r = ½|Y_r|²,
    // dX = Σ_r Y_r W_rᵀ (row r to rank r), dW_r = Xᵀ Y_r.
    // A program lesson: 0 inputs, 1 all_gather, 2 concat, 3 matmul, 4 square, 5 sum, 6 scale,
    // 7 cotangents, 8 backward through the all_gather, 9 the inputs' gradients.
    let t = simulate(&load("tensor_parallel"), 3);
    assert_eq!(t.steps.len(), 10);
    assert_eq!(vals(&t, 0, 1, "X_r"), [2.0, 0.0]);
    assert_eq!(vals(&t, 0, 2, "W_r"), [1.0, 3.0]);
    assert_eq!(vals(&t, 2, 1, "X"), [1.0, 1.0, 2.0, 0.0, 3.0, -1.0]);
    assert_eq!(vals(&t, 3, 0, "Y_r"), [2.0, 2.0, 2.0]);
    assert_eq!(vals(&t, 3, 1, "Y_r"), [3.0, 2.0, 1.0]);
    assert_eq!(vals(&t, 3, 2, "Y_r"), [4.0, 2.0, 0.0]);
    assert_eq!(vals(&t, 6, 2, "loss_r"), [10.0]);
    assert_eq!(vals(&t, 9, 0, "dF/dX_r"), [9.0, 20.0]);
    assert_eq!(vals(&t, 9, 1, "dF/dX_r"), [6.0, 12.0]);
    assert_eq!(vals(&t, 9, 2, "dF/dX_r"), [3.0, 4.0]);
    assert_eq!(vals(&t, 9, 0, "dF/dW_r"), [12.0, 0.0]);
    assert_eq!(vals(&t, 9, 2, "dF/dW_r"), [8.0, 4.0]);
    // The backward step of the all_gather gets rank 1's partial dF/dX = Y_1 W_1ᵀ for every row.
    assert_eq!(vals(&t, 8, 1, "dF/drows"), [3.0, 6.0, 2.0, 4.0, 1.0, 2.0]);
    assert_eq!(t.steps[1].collective.as_deref(), Some("all_gather"));
    assert_eq!(
        t.steps[8].collective.as_deref(),
        Some("reduce_scatter(op=sum)")
    );
    // The same program in any world: rank r holds [1 + r, 1 - r] and [1, 1 + r].
    let t = simulate(&load("tensor_parallel"), 5);
    assert_eq!(vals(&t, 0, 4, "X_r"), [5.0, -3.0]);
    assert_eq!(vals(&t, 2, 0, "X").len(), 10);
}

#[test]
fn pipeline_parallel_hand_derived_and_backward_runs_send_recv() {
    // x = [1, -2] on stage 0; stage r: w_r = [1 - r/4, 1/2 + r/4], h_r = tanh(w_r ⊙ h_{r-1})
    // (h_{-1} = x); L = ½|h_last|² on the last stage. Backward by hand: g_last = h_last; through
    // stage r with input a_r: dL/dw_r = g_r ⊙ (1 - h_r²) ⊙ a_r, and g_{r-1} = g_r ⊙ (1 - h_r²) ⊙
    // w_r (sent back). Computed here in f64, independently of the tape and of the program.
    let close = |got: &[f32], want: &[f64], what: &str| {
        assert_eq!(got.len(), want.len(), "{what}: got {got:?}, want {want:?}");
        for (g, w) in got.iter().zip(want) {
            assert!(
                (*g as f64 - w).abs() <= 1e-6 * (1.0 + w.abs()),
                "{what}: got {got:?}, want {want:?}"
            );
        }
    };
    let l = load("pipeline_parallel");
    assert_eq!(
        l.view,
        lesson::View::Steps,
        "the pipeline is a program lesson"
    );
    for world in [1, 2, 3, 5, 8] {
        let t = simulate(&l, world);
        let last = world - 1;
        let w = |r: usize| [1.0 - 0.25 * r as f64, 0.5 + 0.25 * r as f64];
        let mut a = vec![[1.0f64, -2.0]];
        let mut h = Vec::new();
        for r in 0..world {
            let hr = [(w(r)[0] * a[r][0]).tanh(), (w(r)[1] * a[r][1]).tanh()];
            h.push(hr);
            a.push(hr);
        }
        let loss = 0.5 * (h[last][0].powi(2) + h[last][1].powi(2));
        let mut g = vec![[0.0f64; 2]; world];
        let mut dw = vec![[0.0f64; 2]; world];
        let mut back = vec![[0.0f64; 2]; world];
        g[last] = h[last];
        for r in (0..world).rev() {
            let d = |k: usize| g[r][k] * (1.0 - h[r][k] * h[r][k]);
            dw[r] = [d(0) * a[r][0], d(1) * a[r][1]];
            back[r] = [d(0) * w(r)[0], d(1) * w(r)[1]];
            if r > 0 {
                g[r - 1] = back[r];
            }
        }
        let find = |prefix: &str| -> usize {
            let hits: Vec<usize> = (0..t.steps.len())
                .filter(|&k| t.steps[k].label.starts_with(prefix))
                .collect();
            assert_eq!(hits.len(), 1, "world {world}: one step {prefix:?}");
            hits[0]
        };
        // Only the stage that runs a step shows its value there.
        let only = |k: usize, rank: usize, name: &str, want: &[f64], ctx: &str| {
            for r in 0..world {
                let got = vals(&t, k, r, name);
                if r == rank {
                    close(&got, want, ctx);
                } else {
                    assert!(got.is_empty(), "{ctx}: rank {r} shows {name} = {got:?}");
                }
            }
        };
        for s in 0..world {
            let ctx = format!("world {world} stage {s}");
            let k = find(&format!("forward: tanh [p{s}] -> h{s}"));
            only(k, s, &format!("h{s}"), &h[s], &ctx);
            if s < last {
                // Stage s sends h_s on; stage s + 1 receives it, later in the program.
                let k = find(&format!("forward: send(dst={}) [h{s}]", s + 1));
                assert_eq!(t.steps[k].arrows, vec![(s, s + 1)], "{ctx}");
                let kr = find(&format!("forward: recv(src={s}) [] -> h{s}"));
                assert!(kr > k, "{ctx}: the recv comes after the send");
                only(kr, s + 1, &format!("h{s}"), &h[s], &ctx);
                // Backward: the dual of stage s+1's recv sends dF/dh_s back (from stage s+1);
                // the dual of stage s's send receives it (arrow s+1 → s).
                let br = find(&format!("backward through recv(src={s})"));
                only(br, s + 1, &format!("dF/dh{s}"), &back[s + 1], &ctx);
                let bs = find(&format!("backward through send(dst={})", s + 1));
                assert!(bs > br, "{ctx}: backward runs from the last stage down");
                only(bs, s, &format!("dF/dh{s}"), &g[s], &ctx);
                assert_eq!(t.steps[bs].arrows, vec![(s + 1, s)], "{ctx}");
                for (k, ran_on) in [(br, s + 1), (bs, s)] {
                    for r in 0..world {
                        let text = t.steps[k].ranks[r]
                            .iter()
                            .find(|v| v.name == "backward ran")
                            .and_then(|v| v.text.clone());
                        let want = (r == ran_on).then(|| "send/recv".to_string());
                        assert_eq!(text, want, "{ctx}: step {k} rank {r}");
                    }
                    assert_eq!(t.steps[k].collective.as_deref(), Some("send/recv"), "{ctx}");
                }
            }
        }
        // No point-to-point step in a world of one.
        assert_eq!(
            t.steps
                .iter()
                .filter(|s| s.phase == Phase::Backward)
                .count(),
            2 * last,
            "world {world}"
        );
        only(find("forward: scale [S] -> L"), last, "L", &[loss], "loss");
        let res = t.steps.len() - 1;
        for (r, want) in dw.iter().enumerate() {
            close(
                &vals(&t, res, r, "dF/dw"),
                want,
                &format!("world {world} dF/dw{r}"),
            );
        }
        only(res, 0, "dF/dx", &back[0], &format!("world {world} dF/dx"));
    }
}

#[test]
fn long_message_lists_wrap_in_the_terminal() {
    // all_gather on 64 ranks: 4032 arrows per collective step, wrapped at 100 columns, none lost.
    let t = simulate(&load("all_gather"), 64);
    let text = lesson::render(&t);
    let want: usize = t.steps.iter().map(|s| s.arrows.len()).sum();
    assert!(want >= 2 * 64 * 63, "{want} arrows");
    let lines: Vec<&str> = text.lines().filter(|l| l.contains('→')).collect();
    assert_eq!(
        lines.iter().map(|l| l.matches('→').count()).sum::<usize>(),
        want
    );
    for l in &lines {
        assert!(
            l.chars().count() <= 100,
            "{} columns: {l}",
            l.chars().count()
        );
    }
}

#[test]
fn data_parallel_replicas_stay_identical_and_the_loss_falls() {
    let l = load("data_parallel");
    for n in [1, 3, 5] {
        let t = simulate(&l, n);
        let lesson::View::Train { steps, lr, .. } = l.view else {
            panic!("data_parallel trains");
        };
        assert_eq!(t.steps.len(), steps + 1);
        for st in &t.steps {
            let hashes: Vec<&str> = st
                .ranks
                .iter()
                .map(|v| {
                    v.iter()
                        .find(|x| x.name == "replica hash")
                        .and_then(|x| x.text.as_deref())
                        .unwrap()
                })
                .collect();
            assert!(hashes.windows(2).all(|w| w[0] == w[1]), "{}", st.label);
        }
        let first = vals(&t, 1, 0, "group loss")[0];
        let last = vals(&t, steps, 0, "group loss")[0];
        assert!(last < 0.02 && last < first / 50.0, "{first} -> {last}");
        // The group loss is the mean of the ranks' losses.
        let mean: f32 = (0..n).map(|r| vals(&t, steps, r, "loss")[0]).sum::<f32>() / n as f32;
        assert!(
            (mean - last).abs() <= 1e-6 * mean.max(1.0),
            "{mean} vs {last}"
        );
        // Converges near the generating weights (2, -1, 0.5).
        let w = vals(&t, steps, 0, "w");
        assert!(
            (w[0] - 2.0).abs() < 0.2 && (w[1] + 1.0).abs() < 0.2 && (w[2] - 0.5).abs() < 0.1,
            "{w:?}"
        );
        // A single-device reference: full-batch gradient descent on every rank's data together
        // (the mean squared error over all n·8 samples, its gradient written out in f64) takes
        // the same steps as the ranks with their averaged gradients.
        let plan = l.program.plan(Some(n)).expect("plan");
        let (mut rows, mut ys) = (Vec::new(), Vec::new());
        for r in 0..n {
            let ins = plan.inputs(r);
            let (x, noise) = (ins[0].to_vec(), ins[1].to_vec());
            for i in 0..8 {
                let row = [f64::from(x[2 * i]), f64::from(x[2 * i + 1]), 1.0];
                ys.push(2.0 * row[0] - row[1] + 0.5 + f64::from(noise[i]));
                rows.push(row);
            }
        }
        let m = rows.len() as f64;
        let mut wr = [0.0f64; 3];
        for k in 1..=steps {
            let mut g = [0.0f64; 3];
            for (row, y) in rows.iter().zip(&ys) {
                let e = row.iter().zip(&wr).map(|(a, b)| a * b).sum::<f64>() - y;
                for j in 0..3 {
                    g[j] += 2.0 * e * row[j] / m;
                }
            }
            for j in 0..3 {
                wr[j] -= f64::from(lr) * g[j];
            }
            let got = vals(&t, k, 0, "w");
            for j in 0..3 {
                assert!(
                    (f64::from(got[j]) - wr[j]).abs() < 1e-4,
                    "world {n} step {k}: ranks {got:?}, one device {wr:?}"
                );
            }
        }
    }
}

/// The trace with its events' times zeroed.
fn untimed(mut t: lesson::Trace) -> lesson::Trace {
    for record in t
        .steps
        .iter_mut()
        .flat_map(|s| &mut s.calls)
        .flat_map(|c| &mut c.ranks)
    {
        record.total_us = 0.0;
        for e in &mut record.events {
            e.t_us = 0.0;
        }
    }
    t
}

#[test]
fn interleaved_and_threaded_ranks_give_the_same_trace() {
    for name in [
        "all_gather",
        "all_reduce_prod",
        "data_parallel",
        "tensor_parallel",
    ] {
        let l = load(name);
        let a = simulate(&l, 4);
        let results = distgrad::run_local(4, distgrad::CommOptions::recorded(), |comm| {
            let l = &l;
            async move { lesson::rank_trace(&comm, l, None).await }
        });
        let traces = results.into_iter().map(|r| r.unwrap()).collect();
        let b = futures::executor::block_on(lesson::assemble(&l, traces)).unwrap();
        // The events' times differ between runs; all else must not.
        assert_eq!(untimed(a), untimed(b), "{name}");
    }
}

#[test]
fn an_edited_input_must_keep_the_shape() {
    let l = load("all_reduce_sum");
    let bad = vec![vjp::TensorJson {
        shape: vec![3],
        data: vec![Some(1.0); 3],
    }];
    let e = futures::executor::block_on(lesson::run_simulated(&l, 2, &Device::Cpu, &[Some(bad)]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("shapes"), "{e}");
    let good = vec![vjp::TensorJson {
        shape: vec![2],
        data: vec![Some(10.0), Some(-1.0)],
    }];
    let t = futures::executor::block_on(lesson::run_simulated(&l, 2, &Device::Cpu, &[Some(good)]))
        .unwrap();
    // rank 0 now [10, -1], rank 1 [2, 2]: sum [12, 1]
    assert_eq!(vals(&t, 1, 1, "y"), [12.0, 1.0]);
}

/// `distgrad run --print-program`: the program a lesson (or a program file) runs for the world,
/// expanded, which `distgrad run -` runs with the lesson's own numbers.
#[test]
fn run_prints_the_program_a_lesson_runs() {
    use std::io::Write;
    let bin = env!("CARGO_BIN_EXE_distgrad");
    let print = |file: &str, world: &str| -> serde_json::Value {
        let out = Command::new(bin)
            .args(["run", file, "--world", world, "--print-program"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("a program as JSON")
    };
    let run_stdin = |program: &serde_json::Value| -> serde_json::Value {
        let mut child = Command::new(bin)
            .args(["run", "-", "--json"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(program.to_string().as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    // The pipeline lesson at 4 stages: its "for" blocks expanded (recv, mul, tanh, send per stage
    // but the first's recv and the last's send, then the loss's 3 steps), world 4.
    let dir = lessons_dir();
    let pipe = dir.join("pipeline_parallel.json");
    let p = print(pipe.to_str().unwrap(), "4");
    assert_eq!(p["world"], 4);
    let steps = p["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 4 * 4 - 2 + 3);
    assert!(
        steps
            .iter()
            .all(|s| s.get("for").is_none() && s.get("if").is_none())
    );
    assert_eq!(steps[3]["collective"], "recv");
    assert_eq!(steps[3]["src"], 0);
    assert_eq!(steps[3]["out"], "h0");
    assert_eq!(steps[3]["ranks"], serde_json::json!([1]));
    // Run as a program, it gives the lesson's gradients on every stage.
    let runs = run_stdin(&p);
    let t = simulate(&load("pipeline_parallel"), 4);
    let res = t.steps.len() - 1;
    for r in 0..4 {
        let got: Vec<f32> = runs[r]["grads"][1]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(got, vals(&t, res, r, "dF/dw"), "rank {r}");
    }
    // A collective lesson's program is `distgrad vjp`'s case as a program.
    let p = print(dir.join("reduce.json").to_str().unwrap(), "5");
    let l = load("reduce");
    let case = lesson::lesson_case(&l, 5).unwrap();
    let want = serde_json::to_value(case.program().unwrap()).unwrap();
    assert_eq!(p, want);
}

#[test]
fn distgrad_run_prints_the_trace() {
    let bin = env!("CARGO_BIN_EXE_distgrad");
    let file = lessons_dir().join("all_gather.json");
    let out = Command::new(bin).arg("run").arg(&file).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("step 3 [Backward] backward: reduce_scatter(op=sum)"),
        "{text}"
    );
    assert!(text.contains("rank 2: dL/dx = [3, 6]"), "{text}");
    let out = Command::new(bin)
        .arg("run")
        .arg(&file)
        .args(["--world", "4", "--json"])
        .output()
        .unwrap();
    let t: Trace = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(untimed(t), untimed(simulate(&load("all_gather"), 4)));
    // Errors: exit code 2 and a message, no panic.
    let out = Command::new(bin)
        .args(["run", "/nonexistent.json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nonexistent"));
    let out = Command::new(bin)
        .arg("run")
        .arg(lessons_dir().join("broadcast.json"))
        .args(["--world", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("world must be"));
}

/// `program_tie`: every rank holds x = [1, 2], so every rank ties for the maximum. By hand:
/// m = [1, 2] on every rank, each rank's loss sum(m ⊙ x) = 5, and with the tie split equally
/// dF/dx_r = m + (Σ_s x_s)/N = 2x = [2, 4] on every rank, for any N. The steps: inputs, the
/// three program steps, cotangents, the backward pass through the all_reduce (its dual ran an
/// all_reduce: the sum of the cotangents, masked by the tie), the inputs' gradients.
#[test]
fn program_tie_hand_derived() {
    let l = load("program_tie");
    for world in [1, 2, 3, 5] {
        let t = simulate(&l, world);
        assert_eq!(t.steps.len(), 7, "{world}");
        assert_eq!(t.steps[1].collective.as_deref(), Some("all_reduce(op=max)"));
        assert_eq!(t.steps[1].arrows.len(), world * (world - 1));
        assert_eq!(t.steps[5].phase, Phase::Backward);
        assert_eq!(t.steps[6].phase, Phase::Result);
        for r in 0..world {
            assert_eq!(vals(&t, 0, r, "x"), [1.0, 2.0]);
            assert_eq!(vals(&t, 1, r, "m"), [1.0, 2.0]);
            assert_eq!(vals(&t, 3, r, "loss"), [5.0]);
            assert_eq!(vals(&t, 4, r, "dF/dloss"), [1.0]);
            for k in [5, 6] {
                assert_eq!(
                    vals(&t, k, r, "dF/dx"),
                    [2.0, 4.0],
                    "world {world} rank {r}"
                );
            }
        }
        if world > 1 {
            let ran = t.steps[5].collective.clone().unwrap_or_default();
            assert!(ran.contains("all_reduce"), "{ran}");
        }
    }
}

/// `program_parameter_server`: w0 = broadcast(w from rank 0), l_r = mean((x_r·w0 − t_r)²),
/// loss = reduce(SUM, l) on rank 0. By hand: dF/dw on rank 0 is Σ_r (2/numel)·x_rᵀ(x_r·w0 − t_r)
/// (broadcast's dual sums every rank's gradient there), zero on the other ranks (their w was
/// overwritten); the loss exists on rank 0 only and equals Σ_r l_r.
#[test]
fn program_parameter_server_hand_derived() {
    let l = load("program_parameter_server");
    let world = 3;
    let t = simulate(&l, world);
    let plan = l.program.plan(Some(world)).expect("plan");
    let get = |r: usize, i: usize| plan.inputs(r)[i].to_vec();
    let w0 = get(0, 0);
    let mut grad = [0.0f64; 3];
    let mut total = 0.0f64;
    for r in 0..world {
        let (x, tt) = (get(r, 1), get(r, 2));
        for row in 0..2 {
            let y: f64 = (0..3)
                .map(|k| f64::from(x[row * 3 + k]) * f64::from(w0[k]))
                .sum();
            let e = y - f64::from(tt[row]);
            total += e * e / 2.0;
            for k in 0..3 {
                grad[k] += 2.0 / 2.0 * e * f64::from(x[row * 3 + k]);
            }
        }
    }
    let close = |a: f32, b: f64| (f64::from(a) - b).abs() <= 1e-5 * b.abs().max(1.0);
    let loss = vals(&t, 4, 0, "loss");
    assert!(close(loss[0], total), "{loss:?} vs {total}");
    assert!(
        vals(&t, 4, 1, "loss").is_empty(),
        "the loss lives on rank 0 only"
    );
    // Steps: inputs, 4 program steps, cotangents, backward through the reduce, then through the
    // broadcast, the inputs' gradients.
    assert_eq!(t.steps.len(), 9);
    let g0 = vals(&t, 8, 0, "dF/dw");
    for k in 0..3 {
        assert!(
            close(g0[k], grad[k]),
            "dF/dw[{k}] = {} vs {}",
            g0[k],
            grad[k]
        );
    }
    for r in 1..world {
        assert_eq!(
            vals(&t, 8, r, "dF/dw"),
            [0.0; 3],
            "rank {r}'s own w was overwritten"
        );
    }
    // Through the reduce (its dual is a broadcast of the loss's cotangent from rank 0: every
    // rank's dF/dl = 1), then through the broadcast (its dual reduces to rank 0: there dF/dw is
    // the sum, as above).
    assert_eq!(t.steps[6].arrows, [(0, 1), (0, 2)]);
    let ran = t.steps[6].collective.clone().unwrap_or_default();
    assert!(ran.starts_with("broadcast"), "{ran}");
    for r in 0..world {
        assert_eq!(vals(&t, 6, r, "dF/dl"), [1.0], "rank {r}");
    }
    assert_eq!(t.steps[7].arrows, [(1, 0), (2, 0)]);
    let ran = t.steps[7].collective.clone().unwrap_or_default();
    assert!(ran.starts_with("reduce"), "{ran}");
    assert_eq!(vals(&t, 7, 0, "dF/dw"), g0);
    // The broadcast's messages go out from rank 0, the reduce's come in to it.
    assert_eq!(t.steps[1].arrows, [(0, 1), (0, 2)]);
    assert_eq!(t.steps[4].arrows, [(1, 0), (2, 0)]);
}

/// `program_pipeline`: rank 1's recv gets rank 0's activation a; backward through the recv is
/// rank 1's cotangent dF/dr = (1 − tanh²(r·w₁))·w₁ᵀ (by hand, from the trace's r and rank 1's w),
/// and backward through the send delivers exactly that to rank 0 as dF/da, along the message
/// reversed (1→0); a third rank holds nothing and runs nothing.
#[test]
fn program_pipeline_hand_derived() {
    let l = load("program_pipeline");
    let t = simulate(&l, 3);
    // inputs, 7 program steps, cotangents, backward through recv, through send, result.
    assert_eq!(t.steps.len(), 12);
    assert_eq!(t.steps[3].arrows, [(0, 1)]);
    assert_eq!(
        vals(&t, 4, 1, "r"),
        vals(&t, 3, 0, "a"),
        "recv gets what send sent"
    );
    let r = vals(&t, 4, 1, "r");
    let w = vals(&t, 0, 1, "w");
    let mut want = [0.0f64; 6];
    for i in 0..2 {
        for j in 0..3 {
            let y: f64 = (0..3)
                .map(|k| f64::from(r[i * 3 + k]) * f64::from(w[k * 3 + j]))
                .sum();
            let dy = 1.0 - y.tanh().powi(2);
            for k in 0..3 {
                want[i * 3 + k] += dy * f64::from(w[k * 3 + j]);
            }
        }
    }
    let got = vals(&t, 9, 1, "dF/dr");
    for (g, w) in got.iter().zip(want) {
        assert!((f64::from(*g) - w).abs() < 1e-5, "{got:?} vs {want:?}");
    }
    assert_eq!(t.steps[10].arrows, [(1, 0)]);
    assert_eq!(
        vals(&t, 10, 0, "dF/da"),
        got,
        "the cotangent travels back to rank 0"
    );
    assert!(vals(&t, 10, 2, "dF/da").is_empty());
    assert!(vals(&t, 11, 2, "dF/dx").iter().all(|&v| v == 0.0));
}

#[test]
fn a_training_lesson_says_what_it_cannot_train() {
    let text = |inputs: &str, lr: f32, extra: &str| {
        format!(
            r#"{{"name": "t", "title": "t", "why": "w", "kind": "program", "steps": 3, "lr": {lr}{extra},
                "program": {{"world": 2, "inputs": [{inputs}],
                             "steps": [{{"op": "square", "in": ["w"], "out": "q"}},
                                       {{"op": "sum", "in": ["q"], "out": "loss"}}],
                             "loss": "loss"}}}}"#
        )
    };
    let lesson = |inputs: &str, lr: f32| {
        lesson::parse(&text(inputs, lr, "")).unwrap_or_else(|e| panic!("{e}"))
    };
    // What the file itself gets wrong is refused as it is read.
    let refused = |t: String| lesson::parse(&t).expect_err("refused").to_string();
    let err = |l: &Lesson| {
        futures::executor::block_on(lesson::run_simulated(l, 2, &Device::Cpu, &[]))
            .expect_err("refused")
            .to_string()
    };
    // Generated per rank: the replicas would start apart.
    let e = err(&lesson(r#"{"name": "w", "shape": [2]}"#, 0.3));
    assert!(
        e.contains("parameter \"w\" must start equal on every rank"),
        "{e}"
    );
    let e = err(&lesson(
        r#"{"name": "w", "shape": [2], "grad": false}"#,
        0.3,
    ));
    assert!(e.contains("training needs an input with gradient"), "{e}");
    let w = r#"{"name": "w", "shape": [2], "value": [1, 2]}"#;
    let e = refused(text(w, -1.0, ""));
    assert!(e.contains("\"lr\" must be a positive number"), "{e}");
    let e = refused(text(w, 0.3, r#", "compare_objectives": true"#));
    assert!(e.contains("do not go together"), "{e}");
    // Replicated values train: w -= 0.25 · 2w halves w every step (both ranks' gradients 2w).
    let t = simulate(
        &lesson(r#"{"name": "w", "shape": [2], "value": [1, 2]}"#, 0.25),
        2,
    );
    assert_eq!(vals(&t, 3, 1, "w"), [0.125, 0.25]);
}

/// A lesson is a program with its narrative: every shipped lesson, collective ones included,
/// has a program whose gradients pass the distributed gradient check at worlds 2, 3 and 5 (the
/// collective lessons' programs are their example cases made for each world).
#[test]
fn every_lesson_is_a_program_whose_gradients_check() {
    use distgrad::gradcheck::{Options, gradcheck_program};
    for name in all_names() {
        let l = load(&name);
        // The wrong-vs-right lessons' programs run a wrong dual on purpose: tests/wrong_duals.rs
        // checks that the check fails them and passes them with distgrad's.
        if l.view == lesson::View::CompareDuals {
            continue;
        }
        // A training lesson that runs a wrong dual (a tensor-parallel layer forgetting its
        // reduce) must fail the check.
        let wrong = l.program.steps.iter().any(|s| s.dual.is_some());
        for world in [2, 3, 5].into_iter().filter(|&w| w >= l.min_world) {
            let plan = l
                .plan_for(world)
                .unwrap_or_else(|e| panic!("{name} on {world} ranks: {e}"));
            assert_eq!(plan.world(), world);
            let report = gradcheck_program(&plan, &Options::default())
                .unwrap_or_else(|e| panic!("{name} on {world} ranks: {e}"));
            assert_eq!(
                report.verdict(),
                if wrong { "FAIL" } else { "PASS" },
                "{name} on {world} ranks:\n{}",
                report.render()
            );
        }
    }
}

/// Files say what they are (`"format"`); files written before the field are read as they were
/// (a `"kind"` makes a lesson), and a file whose format and contents disagree is refused with
/// a message saying so.
#[test]
fn files_are_recognised_by_their_declared_format() {
    use distgrad::lesson::Work;
    let program = r#"{"world": 2, "inputs": [{"name": "x", "shape": [1]}],
                      "steps": [{"op": "sum", "in": ["x"], "out": "loss"}], "loss": "loss"}"#;
    let with = |text: &str, field: &str| text.replacen('{', &format!("{{{field}, "), 1);
    let collective = r#"{"name": "c", "title": "t", "why": "w", "kind": "collective",
                         "collective": "all_reduce", "op": "max", "world": 4}"#;
    for (text, lesson) in [
        (program.to_string(), false),
        (with(program, r#""format": "program""#), false),
        (collective.to_string(), true),
        (with(collective, r#""format": "lesson""#), true),
    ] {
        match Work::parse(&text).unwrap_or_else(|e| panic!("{text}: {e}")) {
            Work::Program(p) => {
                assert!(!lesson, "{text}");
                assert_eq!(p.world, 2);
            }
            Work::Lesson(l) => {
                assert!(lesson, "{text}");
                assert_eq!(l.world, 4);
                // The short form is a one-collective program for the lesson's world.
                assert_eq!(l.program.world, 4);
                assert_eq!(
                    l.program,
                    lesson::lesson_case(&l, 4).unwrap().program().unwrap()
                );
            }
        }
    }
    let refused = |text: String, want: &str| {
        let e = Work::parse(&text).expect_err(&text).to_string();
        assert!(e.contains(want), "{text}: expected {want:?} in {e}");
    };
    refused(
        with(program, r#""format": "lesson""#),
        "lesson JSON: unknown field `inputs`",
    );
    refused(
        with(collective, r#""format": "program""#),
        "program JSON: unknown field `name`",
    );
    refused(
        with(program, r#""format": "recipe""#),
        "unknown variant `recipe`",
    );
    assert!(
        distgrad::program::Program::parse(&with(program, r#""format": "lesson""#))
            .expect_err("a lesson")
            .to_string()
            .contains("is a lesson, not a program")
    );
    // A kind's fields belong to it.
    refused(
        with(collective, r#""steps": 3"#),
        "are for kind \"program\"",
    );
    let inner = format!(r#""program": {program}"#);
    refused(
        with(collective, &inner),
        "\"program\" is for kind \"program\" only",
    );
    let program_lesson =
        format!(r#"{{"name": "p", "title": "t", "why": "w", "kind": "program", {inner}}}"#);
    assert!(matches!(Work::parse(&program_lesson), Ok(Work::Lesson(_))));
    refused(
        with(&program_lesson, r#""op": "max""#),
        "the short form of kind \"collective\"",
    );
}

/// The lesson step view's markup, read natively (the page puts the same on screen): a row per
/// rank with its values, this tab's marked, the dual that ran, and for training the replicas'
/// hashes compared.
#[test]
fn the_step_view_shows_every_rank_and_what_ran() {
    use distgrad::web::lesson_view::{step_note, step_table};
    let t = simulate(&load("all_reduce_max"), 3);
    let back = t
        .steps
        .iter()
        .find(|s| s.phase == Phase::Backward)
        .expect("a backward step");
    let table = step_table(back, Some(1)).into_string();
    // all_reduce(MAX) of [r+1, 2(3-r)]: the maxima are on rank 2 (element 0) and rank 0
    // (element 1); each gets the summed cotangent [1+1+1, 1+2+3].
    for row in [
        r#"<tr><th scope="row">0</th><td><code>[0, 6]</code></td></tr>"#,
        r#"<tr class="me"><th scope="row">1 (you)</th><td><code>[0, 0]</code></td></tr>"#,
        r#"<tr><th scope="row">2</th><td><code>[3, 0]</code></td></tr>"#,
    ] {
        assert!(table.contains(row), "{row} not in {table}");
    }
    assert_eq!(
        step_note(back, false).into_string(),
        "backward ran: <strong>all_reduce(op=sum)</strong>"
    );
    let t = simulate(&load("data_parallel"), 2);
    let note = step_note(t.steps.last().expect("a step"), true).into_string();
    assert!(note.contains("all replicas identical ✓"), "{note}");
}

/// Values carry their kind (#37 item 4): under the replicated objective every value of the
/// Megatron MLP lesson is labelled invariant or varying, z_r (each rank's part of the sum the
/// all_reduce completes) unreduced; the step that uses the invariant x as a per-rank value says
/// x was made varying there, and its backward is the all_reduce of dF/dx (Megatron's f), while
/// the all_reduce's own backward runs nothing (g). Gradients derived by hand at 2..6 ranks.
#[test]
fn megatron_mlp_kinds_and_the_hidden_all_reduce() {
    let l = load("megatron_mlp");
    for world in 2..=6 {
        let t = simulate(&l, world);
        let kind = |step: usize, name: &str| -> Vec<Option<String>> {
            t.steps[step]
                .ranks
                .iter()
                .map(|vals| vals.iter().find(|n| n.name == name).unwrap().kind.clone())
                .collect()
        };
        let all = |k: &str| vec![Some(k.to_string()); world];
        assert_eq!(kind(0, "x"), all("invariant"));
        assert_eq!(kind(0, "W1_r"), all("varying"));
        assert_eq!(kind(1, "a_r"), all("varying"));
        assert_eq!(kind(3, "z_r"), all("unreduced"));
        assert_eq!(kind(4, "y"), all("invariant"));
        assert_eq!(kind(7, "loss"), all("invariant"));
        assert!(
            t.steps[1].label.contains("made varying here: x"),
            "{}",
            t.steps[1].label
        );
        // Backward: the all_reduce's dual is the identity (no messages), the matmul's is the
        // all_reduce of dF/dx.
        let back: Vec<&lesson::Step> = t
            .steps
            .iter()
            .filter(|s| s.phase == Phase::Backward)
            .collect();
        assert_eq!(back.len(), 2);
        assert_eq!(back[0].collective.as_deref(), Some("nothing"));
        assert!(back[0].arrows.is_empty(), "{:?}", back[0].arrows);
        assert!(
            back[1].label.contains("x was made varying"),
            "{}",
            back[1].label
        );
        assert_eq!(back[1].collective.as_deref(), Some("all_reduce(op=sum)"));
        // By hand: a_r = x·W1_r, h_r = relu(a_r), z_r = h_r·W2_r, y = Σ z_r, F = ½·|y|²;
        // dF/dx = Σ_r [a_r > 0]·(y·W2_rᵀ)·W1_rᵀ, dF/dW2_r = h_rᵀ·y.
        let x = [0.5f64, -1.0];
        let w1 = |r: usize| [1.0 + 0.25 * r as f64, -0.5 + 0.5 * r as f64];
        let w2 = |r: usize| [0.5 - 0.25 * r as f64, 1.0 + 0.1 * r as f64];
        let a = |r: usize| x[0] * w1(r)[0] + x[1] * w1(r)[1];
        let h = |r: usize| a(r).max(0.0);
        let y: Vec<f64> = (0..2)
            .map(|j| (0..world).map(|r| h(r) * w2(r)[j]).sum())
            .collect();
        let mut dx = [0.0; 2];
        for r in 0..world {
            let dh = y[0] * w2(r)[0] + y[1] * w2(r)[1];
            let da = if a(r) > 0.0 { dh } else { 0.0 };
            dx[0] += da * w1(r)[0];
            dx[1] += da * w1(r)[1];
        }
        let last = t.steps.len() - 1;
        for r in 0..world {
            let got = vals(&t, last, r, "dF/dx");
            for (g, w) in got.iter().zip(dx) {
                assert!(
                    (f64::from(*g) - w).abs() < 1e-4,
                    "world {world} rank {r}: {got:?} vs {dx:?}"
                );
            }
            let got = vals(&t, last, r, "dF/dW2_r");
            for (g, w) in got.iter().zip([h(r) * y[0], h(r) * y[1]]) {
                assert!(
                    (f64::from(*g) - w).abs() < 1e-4,
                    "world {world} rank {r}: dW2 {got:?}"
                );
            }
        }
    }
}

/// Every lesson but the training ones carries one device's gradients for the whole problem
/// beside the ranks', and says how far apart they are: distgrad's equal it (exactly, or within
/// float rounding) at every world; a wrong dual does not, from 3 ranks on. The page's table of it
/// names every rank.
#[test]
fn every_lesson_shows_one_device_beside_the_ranks() {
    use distgrad::web::lesson_view::one_device_table;
    for name in all_names() {
        let l = load(&name);
        for world in l.min_world.max(2)..=8 {
            let t = simulate(&l, world);
            let o = t
                .one_device
                .as_ref()
                .expect("every lesson has one device's view");
            assert_eq!(o.ranks.len(), world, "{name} at {world}: {}", o.label);
            let text = lesson::render(&t);
            assert!(
                text.contains(&o.label),
                "{name}: distgrad run does not print it"
            );
            // A training lesson: one device trains the whole problem; the group's loss follows
            // it, unless the lesson runs a wrong dual.
            if l.trains() {
                let wrong = l.program.steps.iter().any(|s| s.dual.is_some());
                let follows = o.label.ends_with("equals it at every step")
                    || o.label.ends_with("(float rounding)");
                assert_eq!(follows, !wrong, "{name} at {world}: {}", o.label);
                let steps = t.steps.len() - 1;
                assert_eq!(o.curve.len(), steps, "{name} at {world}");
                continue;
            }
            for part in o.label.split(": ").nth(1).unwrap().split("; ") {
                let right = part.starts_with("distgrad");
                let agrees =
                    part.ends_with("equals it exactly") || part.ends_with("(float rounding)");
                if right {
                    assert!(agrees, "{name} at {world}: {}", o.label);
                } else if world >= 3 && name != "wrong_max_tie" {
                    assert!(
                        !agrees,
                        "{name} at {world}: a wrong dual agrees: {}",
                        o.label
                    );
                }
            }
            // The columns line up: every rank names the same values.
            let names: Vec<_> = o.ranks[0].iter().map(|n| &n.name).collect();
            assert!(
                o.ranks
                    .iter()
                    .all(|r| r.iter().map(|n| &n.name).collect::<Vec<_>>() == names)
            );
            let html = one_device_table(o, Some(1)).into_string();
            assert!(
                html.contains("1 (you)") && html.contains(&o.label[..20]),
                "{html}"
            );
        }
    }
}

/// Hand-derived: all_reduce(MAX) on 4 ranks, the lesson's inputs x_r = [r + 1, 8 − 2r] and
/// cotangents c_r = [1, r + 1]: one device's gradient goes to the rank holding each maximum, the
/// sum of all 4 ranks' cotangents there: rank 3 gets 1+1+1+1 = 4 in the first coordinate, rank 0
/// gets 1+2+3+4 = 10 in the second.
#[test]
fn one_device_hand_derived_for_all_reduce_max() {
    let t = simulate(&load("all_reduce_max"), 4);
    assert_eq!(t.steps[0].ranks[0][0].show(), "[1, 8]");
    assert_eq!(t.steps[0].ranks[3][0].show(), "[4, 2]");
    assert_eq!(t.steps[2].ranks[3][0].show(), "[1, 4]");
    let o = t.one_device.expect("one device");
    let g = |r: usize| o.ranks[r][0].show();
    assert_eq!(
        [g(0), g(1), g(2), g(3)],
        ["[0, 10]", "[0, 0]", "[0, 0]", "[4, 0]"].map(String::from)
    );
    assert!(
        o.label.ends_with("distgrad equals it exactly"),
        "{}",
        o.label
    );
    // The page's table: a row per rank and gradient, the differences beside one device's.
    let html = distgrad::web::lesson_view::one_device_table(&o, None).into_string();
    for want in [
        "<th scope=\"col\">one device</th>",
        "<th scope=\"col\">distgrad − one device</th>",
        "[0, 10]",
        "dL/dx",
    ] {
        assert!(html.contains(want), "{want} not in {html}");
    }
}
