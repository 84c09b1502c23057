//! The algorithm view's data and markup, from real runs: what each rank holds round by round,
//! read off the events alone, against what each algorithm must do (the ring's chunk `me + 1` is
//! complete on rank `me` after n − 1 rounds and everywhere after 2(n − 1); a tree broadcast
//! at most doubles the ranks holding the root's data each round (exactly on a power of two); the star's root holds everyone's after
//! round one), and the drawing: one arrow per message of the round, labelled with its chunk.

use distgrad::CommOptions;
use distgrad::collective::events::Algorithm;
use distgrad::lesson::Phase;
use distgrad::lesson::algorithm::{CallAcross, Events, run_simulated};
use distgrad::program::Program;
use distgrad::web::algorithm_view::{call_svg, caption, contributors, messages_text};

/// One collective of `numel` elements per rank then `loss = sum(y²)` (lists: `n` entries).
fn program(world: usize, step: &str, shape: &[usize]) -> Program {
    let json = format!(
        r#"{{"format": "program", "world": {world},
            "inputs": [{{"name": "x", "shape": {shape:?}}}],
            "steps": [{step}, {{"op": "square", "in": ["y"], "out": "q"}},
                      {{"op": "sum", "in": ["q"], "out": "loss"}}],
            "loss": "loss"}}"#
    );
    Program::parse(&json).unwrap()
}

fn events(p: &Program, world: usize, algorithm: Option<Algorithm>) -> Events {
    let plan = p.plan(Some(world)).unwrap();
    let mut opts = CommOptions::recorded();
    if let Some(a) = algorithm {
        opts = opts.with_algorithm(a).unwrap();
    }
    futures::executor::block_on(run_simulated(&plan, opts)).unwrap()
}

fn forward(e: &Events) -> &CallAcross {
    e.calls.iter().find(|c| c.phase == Phase::Forward).unwrap()
}

const ALL_REDUCE: &str = r#"{"collective": "all_reduce", "op": "sum", "in": ["x"], "out": "y"}"#;

fn all(n: usize) -> u64 {
    (1u64 << n) - 1
}

#[test]
fn the_ring_completes_chunk_me_plus_1_on_rank_me_after_n_minus_1_rounds() {
    for n in [2, 3, 4, 5, 8] {
        let e = events(&program(n, ALL_REDUCE, &[2 * n]), n, Some(Algorithm::Ring));
        let call = forward(&e);
        assert_eq!(call.algorithm, Algorithm::Ring);
        assert_eq!(call.cells(), n);
        let h = call.holdings().unwrap();
        assert_eq!(h.len(), 2 * (n - 1) + 1);
        let (start, half, end) = (&h[0], &h[n - 1], &h[2 * (n - 1)]);
        for (r, ((start, half), end)) in start.iter().zip(half).zip(end).enumerate() {
            // Before: every rank holds its own value of every chunk.
            assert!(start.iter().all(|&c| c == 1 << r), "n={n} rank {r}");
            // After the reduce-scatter half: chunk r+1 is complete on rank r, and no other.
            let done: Vec<usize> = (0..n).filter(|&c| half[c] == all(n)).collect();
            assert_eq!(done, vec![(r + 1) % n], "n={n} rank {r}");
            // After the all-gather half: everything everywhere.
            assert!(end.iter().all(|&c| c == all(n)), "n={n} rank {r}");
        }
        // After round k of the reduce-scatter, a chunk being reduced holds k + 2 ranks' values.
        for k in 0..n - 1 {
            let most = (0..n)
                .flat_map(|r| h[k + 1][r].iter())
                .map(|c| c.count_ones())
                .max();
            assert_eq!(most, Some(k as u32 + 2), "n={n} round {k}");
        }
    }
}

#[test]
fn a_tree_broadcast_at_most_doubles_the_ranks_that_hold_the_root_s_data_each_round() {
    for n in [2, 3, 5, 8] {
        for root in [0, n - 1] {
            let step = format!(
                r#"{{"collective": "broadcast", "root": {root}, "in": ["x"], "out": "y"}}"#
            );
            let e = events(&program(n, &step, &[2]), n, None);
            let call = forward(&e);
            assert_eq!(call.algorithm, Algorithm::Tree);
            let h = call.holdings().unwrap();
            assert_eq!(h.len() as u32, n.next_power_of_two().trailing_zeros() + 1);
            let mut before = 0;
            for (k, state) in h.iter().enumerate() {
                let holding = (0..n).filter(|&r| state[r][0] != 0).count();
                // At most doubling each round (exactly, where n is a power of two); all at the end.
                let ctx = format!("n={n} root={root} after {k} rounds");
                assert!(holding > before && holding <= 2 * before.max(1), "{ctx}");
                if n.is_power_of_two() {
                    assert_eq!(holding, 1 << k, "{ctx}");
                }
                assert!(state.iter().all(|c| c[0] == 0 || c[0] == 1 << root));
                before = holding;
            }
            assert_eq!(before, n);
        }
    }
}

#[test]
fn the_star_s_root_holds_everyone_s_after_round_one() {
    let n = 5;
    let e = events(&program(n, ALL_REDUCE, &[3]), n, Some(Algorithm::Star));
    let call = forward(&e);
    let h = call.holdings().unwrap();
    assert_eq!(h.len(), 3);
    assert_eq!(h[1][0][0], all(n));
    assert!((1..n).all(|r| h[1][r][0] == 1 << r));
    assert!((0..n).all(|r| h[2][r][0] == all(n)));
}

#[test]
fn gathers_and_scatters_hold_their_entries() {
    let n = 4;
    let ag = r#"{"collective": "all_gather", "in": ["x"], "out": "l"}, {"op": "concat", "dim": 0, "in": ["l.0", "l.1", "l.2", "l.3"], "out": "y"}"#;
    for a in [Some(Algorithm::Ring), Some(Algorithm::Exchange)] {
        let e = events(&program(n, ag, &[2]), n, a);
        let call = forward(&e);
        assert_eq!(call.cells(), n);
        let h = call.holdings().unwrap();
        // Rank r starts with entry r and ends with every entry j holding rank j's value.
        for r in 0..n {
            let first: Vec<u64> = (0..n).map(|j| if j == r { 1 << r } else { 0 }).collect();
            assert_eq!(h[0][r], first, "{a:?}");
            let last: Vec<u64> = (0..n).map(|j| 1 << j).collect();
            assert_eq!(h.last().unwrap()[r], last, "{a:?}");
        }
    }
}

#[test]
fn the_drawing_has_one_arrow_per_message_labelled_with_its_chunk() {
    let n = 4;
    let e = events(&program(n, ALL_REDUCE, &[8]), n, Some(Algorithm::Ring));
    let call = forward(&e);
    for k in 0..call.rounds() {
        let svg = call_svg(call, Some(k), 480.0).into_string();
        assert_eq!(svg.matches("class=\"algo-msg\"").count(), n, "round {k}");
        // Round 0: rank r sends chunk r.
        if k == 0 {
            for c in 0..n {
                assert!(svg.contains(&format!(">c{c}</text>")), "{svg}");
            }
        }
        assert_eq!(svg.matches("class=\"algo-cell\"").count(), n * n);
        let text = messages_text(call, k);
        assert_eq!(text.len(), n);
    }
    // The result (no round): no arrows, every cell full.
    let svg = call_svg(call, None, 480.0).into_string();
    assert_eq!(svg.matches("class=\"algo-msg\"").count(), 0);
    assert_eq!(svg.matches(">all</text>").count(), n * n);
    assert!(caption(call, Some(0)).contains("round 1 of 6"));
    assert!(caption(call, Some(0)).starts_with("forward: all_reduce(op=sum) by ring"));
    assert_eq!(messages_text(call, 0)[0], "0→1 chunk 0/4 [0..2) (8 B)");
}

#[test]
fn contributors_read_short() {
    assert_eq!(contributors(0, 4), "·");
    assert_eq!(contributors(0b101, 4), "0+2");
    assert_eq!(contributors(0b1111, 4), "all");
    assert_eq!(contributors(0b1111, 8), "4 of 8");
    assert_eq!(contributors(1, 1), "0");
}
