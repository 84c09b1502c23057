//! A program cannot exhaust a tab or a process (issue #40 item 1): every value a step makes is
//! held to the element cap, all values together and all local arithmetic together to the
//! program's caps, size arithmetic cannot overflow, and a rank makes only its own inputs (a tab
//! does not build every rank's). Each case asks for far more than the machine has: before these
//! checks, planning or running it aborted the process (4 TiB for one `add`), panicked on wasm32
//! (`m·n` overflowing a 32-bit usize), or made every rank's inputs in every tab.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use distgrad::program::{MAX_ARITHMETIC, MAX_ELEMENTS, MAX_NUMEL, Program};

/// Counts the bytes this thread allocates (tests run on threads of their own).
struct Counting;

thread_local! {
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATED.try_with(|a| a.set(a.get() + layout.size()));
        // SAFETY: the caller's layout, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: allocated by `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

fn allocated() -> usize {
    ALLOCATED.with(Cell::get)
}

fn refused(json: &str, world: usize, want: &str) {
    let e = Program::parse(json)
        .unwrap_or_else(|e| panic!("{json}: {e}"))
        .plan(Some(world))
        .expect_err(json)
        .to_string();
    assert!(e.contains(want), "{json}: expected {want:?} in: {e}");
}

#[test]
fn values_past_the_caps_are_refused_before_anything_runs() {
    let cap = format!("more than {MAX_NUMEL} elements");
    // A broadcast add of [2^20, 1] and [1, 2^20]: 2^40 elements (4 TiB of f32).
    refused(
        r#"{"world": 1, "inputs": [{"name": "a", "shape": [1048576, 1]}, {"name": "b", "shape": [1, 1048576]}],
            "steps": [{"op": "add", "in": ["a", "b"], "out": "c"}, {"op": "sum", "in": ["c"], "out": "loss"}],
            "loss": "loss"}"#,
        1,
        &cap,
    );
    // [65536, 1] x [1, 65536]: 2^32 elements, m·n overflows a 32-bit usize.
    refused(
        r#"{"world": 1, "inputs": [{"name": "a", "shape": [65536, 1]}, {"name": "b", "shape": [1, 65536]}],
            "steps": [{"op": "matmul", "in": ["a", "b"], "out": "c"}, {"op": "sum", "in": ["c"], "out": "loss"}],
            "loss": "loss"}"#,
        1,
        &cap,
    );
    // A recv of a shape nobody could send.
    refused(
        r#"{"world": 2, "inputs": [{"name": "x", "shape": [1]}],
            "steps": [{"collective": "send", "dst": 1, "in": ["x"], "ranks": [0]},
                      {"collective": "recv", "src": 0, "shape": [1099511627776], "out": "y", "ranks": [1]},
                      {"op": "sum", "in": ["x"], "out": "loss"}],
            "loss": "loss"}"#,
        2,
        &cap,
    );
    // Every value under the cap, all of them together over it: 2^26 elements on each of 4
    // ranks, then a copy of it.
    refused(
        r#"{"world": 4, "inputs": [{"name": "x", "shape": [67108864]}],
            "steps": [{"op": "scale", "by": 2, "in": ["x"], "out": "y"}, {"op": "sum", "in": ["y"], "out": "loss"}],
            "loss": "loss"}"#,
        4,
        &format!("more than {MAX_ELEMENTS} elements"),
    );
    // Small values, too much arithmetic: [4096, 4096] x [4096, 4096] is 2^36 multiply-adds.
    refused(
        r#"{"world": 1, "inputs": [{"name": "a", "shape": [4096, 4096]}],
            "steps": [{"op": "matmul", "in": ["a", "a"], "out": "c"}, {"op": "sum", "in": ["c"], "out": "loss"}],
            "loss": "loss"}"#,
        1,
        &format!("more than {MAX_ARITHMETIC} operations"),
    );
    // Split sizes whose sum overflows: refused, not a panic.
    refused(
        r#"{"world": 2, "inputs": [{"name": "x", "shape": [2, 1]}],
            "steps": [{"collective": "all_to_all_single", "in": ["x"], "out": "y",
                       "in_splits": [[18446744073709551615, 3], [1, 1]]},
                      {"op": "sum", "in": ["x"], "out": "loss"}],
            "loss": "loss"}"#,
        2,
        "overflow",
    );
}

/// A rank makes only its own inputs, when it first asks: checking a program for 8 ranks with a
/// 2^24-element input (64 MiB a rank) makes none, and rank 3's make rank 3's only.
#[test]
fn a_rank_makes_only_its_own_inputs() {
    let p = Program::parse(
        r#"{"world": 8, "inputs": [{"name": "x", "shape": [16777216]}],
            "steps": [{"op": "sum", "in": ["x"], "out": "loss"}], "loss": "loss"}"#,
    )
    .expect("program");
    let per_rank = 4usize << 24;
    let before = allocated();
    let plan = p.plan(None).expect("plan");
    let planned = allocated() - before;
    assert!(
        planned < per_rank / 16,
        "checking the program allocated {planned} bytes"
    );
    let x = plan.inputs(3)[0].to_vec();
    let made = allocated() - before;
    assert_eq!(x.len(), 1 << 24);
    // Rank 3's values (and the generator's temporaries and this copy), not 8 ranks' 512 MiB.
    assert!(
        (per_rank..=4 * per_rank).contains(&made),
        "rank 3's inputs took {made} bytes (one rank's: {per_rank})"
    );
    // Each rank's own values, the same as when every rank's were made at once.
    assert_ne!(plan.inputs(2)[0].to_vec()[..8], x[..8]);
}

/// A program whose outer block visits a nested block `visits` times, the nested block carrying
/// about 4 MiB of steps but running none of them (`from` 1 `to` 0).
fn nested_heavy(visits: usize) -> String {
    let steps: Vec<serde_json::Value> = (0..110_000)
        .map(|i| serde_json::json!({"op": "relu", "in": ["x"], "out": format!("y{i:06}")}))
        .collect();
    serde_json::json!({
        "world": 2,
        "inputs": [{"name": "x", "shape": [1]}],
        "steps": [
            {"for": "s", "from": 1, "to": visits, "steps": [
                {"for": "t", "from": 1, "to": 0, "steps": steps}]},
            {"op": "sum", "in": ["x"], "out": "loss"}],
        "loss": "loss"})
    .to_string()
}

/// `"for"` blocks are charged what they cost (#40 item 2): a nested block is read once and
/// charged its size on every visit. Before, every visit of the outer block cloned the nested
/// block's 4 MiB and serialised it again, charging nothing for it: 200 visits were accepted
/// after copying some 1.6 GB, and 50,000 (the issue's case) hung every tab of the room.
#[test]
fn nested_blocks_are_charged_their_size_on_every_visit() {
    // What planning the nested block costs once (one visit, within the budget).
    let p = Program::parse(&nested_heavy(1)).unwrap();
    let before = allocated();
    p.plan(Some(2)).unwrap();
    let once = allocated() - before;
    for visits in [200, 50_000] {
        let text = nested_heavy(visits);
        assert!(text.len() > 4 << 20, "{} bytes", text.len());
        let p = Program::parse(&text).unwrap();
        let before = allocated();
        let e = p.plan(Some(2)).unwrap_err().to_string();
        let used = allocated() - before;
        println!(
            "{visits} visits of a {} MiB nested block: refused, {} MiB allocated (one visit: {} MiB)",
            text.len() >> 20,
            used >> 20,
            once >> 20
        );
        assert!(e.contains("grows beyond"), "{visits} visits: {e}");
        assert!(
            e.contains("step 0 (for s), its step 0 with s = "),
            "the error names the visit: {e}"
        );
        // Reading the nested block once, and no more for its further visits (before: a copy and
        // a serialisation of 4 MiB each).
        assert!(
            used < once + (16 << 20),
            "{visits} visits: planning allocated {} MiB, one visit {} MiB",
            used >> 20,
            once >> 20
        );
    }
    // A nested block small enough is expanded as before: 4 × 3 steps.
    let small = r#"{"world": 2, "inputs": [{"name": "x", "shape": [1]}], "steps": [
        {"for": "s", "from": 1, "to": 4, "steps": [
            {"for": "t", "from": 1, "to": 3, "steps": [
                {"op": "relu", "in": ["x"], "out": "y{s}_{t}"}]}]},
        {"op": "sum", "in": ["y4_3"], "out": "loss"}], "loss": "loss"}"#;
    let p = Program::parse(small).unwrap().expanded(2).unwrap();
    assert_eq!(p.steps.len(), 13);
}
