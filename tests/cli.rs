//! The CLI: `distgrad vjp` (JSON round trip, hand-checked numbers, every built-in example, clear
//! errors with exit code 2 and no panic on bad input) and `distgrad bench --processes`.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use serde_json::{Value, json};

fn distgrad(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_distgrad"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn distgrad");
    if let Some(s) = stdin {
        // The program may refuse its arguments and exit before reading: a closed pipe is fine.
        match child.stdin.take().unwrap().write_all(s.as_bytes()) {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => panic!("writing stdin: {e}"),
            _ => {}
        }
    }
    drop(child.stdin.take());
    child.wait_with_output().expect("wait distgrad")
}

fn ok_json(args: &[&str], stdin: Option<&str>) -> Value {
    let out = distgrad(args, stdin);
    assert!(
        out.status.success(),
        "distgrad {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON output")
}

/// `v` without the events' times (`t_us`, `total_us`), which differ between runs.
fn untimed(mut v: Value) -> Value {
    fn strip(v: &mut Value) {
        match v {
            Value::Object(m) => {
                m.remove("t_us");
                m.remove("total_us");
                m.values_mut().for_each(strip);
            }
            Value::Array(a) => a.iter_mut().for_each(strip),
            _ => {}
        }
    }
    strip(&mut v);
    v
}

fn data(v: &Value) -> Vec<f64> {
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

#[test]
fn hand_checked_reduce_scatter_on_a_subgroup() {
    // world 4, group [3, 0, 2] (group ranks 0,1,2 = global 3,0,2); global rank 1 takes no part.
    // Group rank j's output = sum over group ranks r of input_r[j].
    //   global 3 (gr 0): [1],[2],[3]; global 0 (gr 1): [10],[20],[30]; global 2 (gr 2): [100],[200],[300]
    //   outputs: gr 0 (global 3) = 111, gr 1 (global 0) = 222, gr 2 (global 2) = 333
    // Backward = all_gather of cotangents: d/d input_r[j] = cot of group rank j.
    //   cotangents: global 3 -> 5, global 0 -> 7, global 2 -> 9, so every rank's grads = [5],[7],[9]
    let t = |x: f64| json!({"shape": [1], "data": [x]});
    let case = json!({
        "collective": "reduce_scatter", "world": 4, "op": "sum", "group": [3, 0, 2],
        "inputs": [[t(10.0), t(20.0), t(30.0)], [], [t(100.0), t(200.0), t(300.0)], [t(1.0), t(2.0), t(3.0)]],
        "cotangents": [[t(7.0)], [], [t(9.0)], [t(5.0)]]
    });
    let out = ok_json(&["vjp", "-", "--json"], Some(&case.to_string()));
    assert_eq!(out["dual"], "all_gather");
    assert_eq!(data(&out["outputs"][3][0]), vec![111.0]);
    assert_eq!(data(&out["outputs"][0][0]), vec![222.0]);
    assert_eq!(data(&out["outputs"][2][0]), vec![333.0]);
    assert_eq!(out["outputs"][1], json!([]));
    for g in [0, 2, 3] {
        let grads: Vec<f64> = (0..3).map(|j| data(&out["grads"][g][j])[0]).collect();
        assert_eq!(grads, vec![5.0, 7.0, 9.0], "global rank {g}");
    }
    assert_eq!(out["grads"][1], json!([]));
}

#[test]
fn hand_checked_all_reduce_max_with_tie() {
    // x = [3, 7], [7, 1], [7, 2]: max = [7, 7]. Element 0: ranks 1 and 2 tie -> each gets half of the
    // summed cotangent (1+2+3 = 6 -> 3). Element 1: rank 0 alone -> 6.
    let t = |a: f64, b: f64| json!({"shape": [2], "data": [a, b]});
    let case = json!({
        "collective": "all_reduce", "world": 3, "op": "max",
        "inputs": [[t(3.0, 7.0)], [t(7.0, 1.0)], [t(7.0, 2.0)]],
        "cotangents": [[t(1.0, 1.0)], [t(2.0, 2.0)], [t(3.0, 3.0)]]
    });
    let out = ok_json(&["vjp", "-", "--json"], Some(&case.to_string()));
    for r in 0..3 {
        assert_eq!(data(&out["outputs"][r][0]), vec![7.0, 7.0]);
    }
    assert_eq!(data(&out["grads"][0][0]), vec![0.0, 6.0]);
    assert_eq!(data(&out["grads"][1][0]), vec![3.0, 0.0]);
    assert_eq!(data(&out["grads"][2][0]), vec![3.0, 0.0]);
}

#[test]
fn printed_case_round_trips_through_a_file_and_stdin() {
    let case = distgrad(&["vjp", "all_gather", "--world", "3", "--print-case"], None);
    assert!(case.status.success());
    let case_text = String::from_utf8(case.stdout).unwrap();
    let direct = ok_json(&["vjp", "all_gather", "--world", "3", "--json"], None);
    let via_stdin = ok_json(&["vjp", "-", "--json"], Some(&case_text));
    assert_eq!(direct, via_stdin);
    let dir = std::env::temp_dir().join(format!("distgrad-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("case.json");
    std::fs::write(&path, &case_text).unwrap();
    let via_file = ok_json(&["vjp", path.to_str().unwrap(), "--json"], None);
    assert_eq!(direct, via_file);
    assert_eq!(direct["dual"], "reduce_scatter(op=sum)");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn every_builtin_example_runs_for_every_op_and_odd_worlds() {
    let collectives = [
        "broadcast",
        "reduce",
        "gather",
        "scatter",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "all_reduce",
        "permute",
        "all_to_all_single",
    ];
    for c in collectives {
        for world in ["1", "3", "8"] {
            let ops: &[&str] = if matches!(c, "reduce" | "all_reduce" | "reduce_scatter") {
                &["sum", "avg", "prod", "min", "max"]
            } else {
                &["sum"]
            };
            for op in ops {
                let root = if world == "1" { "0" } else { "1" };
                let out = distgrad(
                    &["vjp", c, "--world", world, "--op", op, "--root", root],
                    None,
                );
                let text = String::from_utf8_lossy(&out.stdout);
                assert!(
                    out.status.success(),
                    "{c} {op} world {world}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                assert!(text.contains("backward (dual):"), "{c}: {text}");
                assert_eq!(
                    text.lines().filter(|l| l.contains(" | ")).count(),
                    world.parse::<usize>().unwrap() + 1
                );
            }
        }
    }
}

#[test]
fn bad_input_is_a_clear_error_with_exit_code_2() {
    let cases: &[(&str, &str)] = &[
        ("{", "case JSON"),
        (
            r#"{"collective":"all_sum","world":2,"inputs":[[],[]]}"#,
            "unknown collective \"all_sum\"",
        ),
        (
            r#"{"collective":"all_reduce","world":0,"inputs":[]}"#,
            "world must be",
        ),
        (
            r#"{"collective":"all_reduce","world":2,"inputs":[[{"shape":[2],"data":[1]}],[{"shape":[2],"data":[1,2]}]]}"#,
            "needs 2 elements, got 1",
        ),
        (
            r#"{"collective":"broadcast","world":2,"root":2,"inputs":[[{"shape":[1],"data":[1]}],[{"shape":[1],"data":[1]}]]}"#,
            "root 2 is not a group rank",
        ),
        (
            r#"{"collective":"all_reduce","world":2,"op":"mean","inputs":[[{"shape":[1],"data":[1]}],[{"shape":[1],"data":[1]}]]}"#,
            "unknown reduce op",
        ),
        (
            r#"{"collective":"all_reduce","world":2,"inputs":[[{"shape":[1],"data":[null]}],[{"shape":[1],"data":[1]}]]}"#,
            "is null",
        ),
        (
            r#"{"collective":"all_reduce","world":2,"inputs":[[{"shape":[1],"data":[1]}],[{"shape":[2],"data":[1,2]}]]}"#,
            "shapes must agree across the group: group rank 0 (rank 0) passes [1], group rank 1 (rank 1) passes [2]",
        ),
        (
            r#"{"collective":"scatter","world":2,"inputs":[[],[]]}"#,
            "scatter takes 2 tensor(s) here, got 0",
        ),
        (
            r#"{"collective":"permute","world":2,"perm":[[0,1],[1,1]],"inputs":[[{"shape":[1],"data":[1]}],[{"shape":[1],"data":[1]}]]}"#,
            "destination twice",
        ),
        (
            r#"{"collective":"all_reduce","world":2,"group":[0,0],"inputs":[[],[]]}"#,
            "ranks must be distinct",
        ),
        (
            r#"{"collective":"all_reduce","world":2,"inputs":[[{"shape":[1],"data":[1e39]}],[{"shape":[1],"data":[1]}]]}"#,
            "beyond the f32 range",
        ),
        ("[1, 2]", "a case is one JSON object"),
    ];
    for (input, want) in cases {
        let out = distgrad(&["vjp", "-"], Some(input));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{input}: {err}");
        assert!(err.contains(want), "{input}: expected {want:?} in {err}");
        assert!(!err.contains("panicked"), "{input}: {err}");
    }
    let out = distgrad(&["vjp", "no-such-thing"], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a file"));
    let out = distgrad(&["vjp", "/nonexistent/case.json"], None);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no such case file"), "{err}");
}

/// Flags that do not apply are not silently dropped: with a case file they are refused (the file
/// sets world, op and root); on a built-in example that does not use them, a note says so.
#[test]
fn flags_that_do_not_apply_are_refused_or_noted() {
    let case = distgrad(&["vjp", "all_reduce", "--world", "2", "--print-case"], None);
    let text = String::from_utf8_lossy(&case.stdout).to_string();
    for flags in [&["--world", "5"][..], &["--op", "max"], &["--root", "1"]] {
        let args: Vec<&str> = ["vjp", "-"]
            .into_iter()
            .chain(flags.iter().copied())
            .collect();
        let out = distgrad(&args, Some(&text));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains("built-in examples"), "{flags:?}: {err}");
    }
    let out = distgrad(&["vjp", "broadcast", "--op", "max", "--root", "1"], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("broadcast takes no reduce op; --op ignored"),
        "{err}"
    );
    // A mistyped collective with flags is still an unknown collective, not a case file.
    let out = distgrad(&["vjp", "allreduce", "--world", "2"], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("unknown collective"), "{err}");
    let out = distgrad(&["vjp", "all_gather", "--root", "1"], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("all_gather has no root; --root ignored"),
        "{err}"
    );
}

/// A result that overflows to infinity reads `inf` in the table (not `nan`) and `null` in JSON
/// (which has no infinity); large values print in exponent form.
#[test]
fn infinities_print_as_inf() {
    let case = json!({
        "collective": "all_reduce",
        "world": 2,
        "inputs": [[{"shape": [2], "data": [3e38, -3e38]}], [{"shape": [2], "data": [3e38, -3e38]}]]
    })
    .to_string();
    let out = distgrad(&["vjp", "-"], Some(&case));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("[inf, -inf]"), "{text}");
    assert!(text.contains("[3e38, -3e38]"), "{text}");
    let j = ok_json(&["vjp", "-", "--json"], Some(&case));
    assert_eq!(j["outputs"][0][0]["data"], json!([null, null]), "{j}");
}

/// Other bad command lines: exit code 2 and a message naming the problem, no panic.
#[test]
fn bad_command_lines_say_what_is_wrong() {
    for (args, want) in [
        (&["bench", "foo"][..], "invalid value 'foo' for '[WHAT]'"),
        (&["bench", "--max-bytes", "0"], "holds no payload size"),
        (
            &["bench", "--min-bytes", "2048", "--max-bytes", "1024"],
            "holds no payload size",
        ),
        (&["train", "--steps", "0"], "--steps must be at least 1"),
        (
            &["run", "www/lessons/index.json"],
            "the index of the lessons",
        ),
        (
            &["run", "www/lessons/all_gather.json", "--device", "tpu"],
            "[possible values: cpu, gpu, auto]",
        ),
        (
            &["bench", "kernels", "--elements", "0"],
            "expected a positive count such as 1024, 16M or 1G, got \"0\"",
        ),
        (
            &["bench", "kernels", "--elements", "12Q"],
            "expected a positive count",
        ),
        (
            &["bench", "--transport", "relay", "--device", "gpu"],
            "--device gpu is for in-process ranks",
        ),
        (
            &["bench", "--device", "tpu"],
            "[possible values: cpu, gpu, auto]",
        ),
        // Every choice flag is checked by clap, which lists the choices.
        (
            &["bench", "--transport", "relay-udp"],
            "[possible values: local, relay, relay-tcp, relay-ws, relay-buffered, direct, nccl]",
        ),
        (
            &["bench", "--ops", "all_reduce,allgather"],
            "[possible values: all_reduce, all_gather, broadcast]",
        ),
        (
            &["bench", "--algo", "tree"],
            "[possible values: auto, ring, pairwise, shared]",
        ),
        (
            &["bench", "--small-algo", "tree"],
            "[possible values: exchange, star]",
        ),
        (
            &["train", "--backend", "mpi"],
            "[possible values: local, nccl]",
        ),
        (
            &["train", "--data-path", "zero-copy"],
            "[possible values: staging, shared]",
        ),
        (
            &["vjp", "all_reduce", "--op", "mean"],
            "[possible values: sum, avg, prod, min, max]",
        ),
        (
            &["demo", "--collective", "allreduce"],
            "[possible values: broadcast, reduce, gather, scatter, all_gather",
        ),
        (
            &["demo", "--transport", "mpi"],
            "[possible values: relay, direct, local]",
        ),
    ] {
        let out = distgrad(args, None);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: expected {want:?} in {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// The bench's size ladder ends at the top of the range instead of overflowing (a huge
/// --max-bytes looped forever, or panicked in a debug build).
#[test]
fn bench_sizes_stop_at_the_top_of_the_range() {
    let top = distgrad::bench::sizes(usize::MAX / 2, usize::MAX);
    assert_eq!(top, vec![usize::MAX / 2]);
    assert_eq!(distgrad::bench::sizes(4, 64), vec![4, 16, 64]);
    assert!(distgrad::bench::sizes(2048, 1024).is_empty());
}

/// `distgrad run ... | head -1`: the reader goes away mid-output and the program ends quietly,
/// killed by SIGPIPE like other command-line tools, not with a panic. (The trace of a 64-rank
/// all_gather is far larger than a pipe's buffer, so the write after the close happens.)
#[cfg(unix)]
#[test]
fn a_closed_stdout_ends_the_program_quietly() {
    use std::io::Read as _;
    use std::os::unix::process::ExitStatusExt as _;
    let mut child = Command::new(env!("CARGO_BIN_EXE_distgrad"))
        .args(["run", "www/lessons/all_gather.json", "--world", "64"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn distgrad");
    let mut first = [0u8; 64];
    child
        .stdout
        .take()
        .unwrap()
        .read_exact(&mut first)
        .expect("the first bytes of the trace");
    // The read end is closed here (dropped above).
    let out = child.wait_with_output().expect("wait distgrad");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "ended by SIGPIPE ({}): {err}",
        out.status
    );
}

#[test]
fn the_gpu_backend_gives_the_same_answers() {
    // Every reducing collective and op, through the CLI, on the GPU and on the CPU reference.
    // Without an adapter: skipped (unless DISTGRAD_REQUIRE_GPU=1, as in CI with lavapipe).
    for c in [
        "all_reduce",
        "reduce",
        "reduce_scatter",
        "all_gather",
        "scatter",
    ] {
        for op in ["sum", "avg", "prod", "min", "max"] {
            if op != "sum" && matches!(c, "all_gather" | "scatter") {
                continue;
            }
            let args = [
                "vjp", c, "--world", "3", "--op", op, "--root", "1", "--json",
            ];
            let cpu = ok_json(&args, None);
            let gpu_args: Vec<&str> = args.iter().copied().chain(["--device", "gpu"]).collect();
            let out = distgrad(&gpu_args, None);
            if !out.status.success() {
                let err = String::from_utf8_lossy(&out.stderr);
                if err.contains("no GPU adapter")
                    && std::env::var("DISTGRAD_REQUIRE_GPU").as_deref() != Ok("1")
                {
                    println!("skipped: no GPU adapter ({err})");
                    return;
                }
                panic!("{c} {op} on the GPU failed: {err}");
            }
            let gpu: Value = serde_json::from_slice(&out.stdout).expect("JSON output");
            assert_eq!(
                gpu, cpu,
                "{c} op={op}: GPU answer differs from the CPU reference"
            );
        }
    }
}

/// `distgrad run --device gpu`: a lesson's trace on the GPU equals the CPU's where the lesson's
/// ops are bit-exact on both (the reduce-into of all_reduce max, the copies of all_gather), and
/// is within float tolerance for the pipeline (tanh differs in the last bits).
#[test]
fn lessons_run_on_the_gpu_too() {
    let trace = |lesson: &str, device: &str| -> Option<Value> {
        let path = format!("www/lessons/{lesson}.json");
        let out = distgrad(&["run", &path, "--json", "--device", device], None);
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            if device == "gpu"
                && err.contains("no GPU adapter")
                && std::env::var("DISTGRAD_REQUIRE_GPU").as_deref() != Ok("1")
            {
                println!("skipped: no GPU adapter ({err})");
                return None;
            }
            panic!("run {lesson} --device {device}: {err}");
        }
        Some(serde_json::from_slice(&out.stdout).expect("JSON trace"))
    };
    for lesson in ["all_reduce_max", "all_gather"] {
        let Some(gpu) = trace(lesson, "gpu") else {
            return;
        };
        // The same trace, the recorded events' times aside.
        let cpu = untimed(trace(lesson, "cpu").unwrap());
        assert!(untimed(gpu) == cpu, "{lesson}: the GPU's trace differs");
    }
    let (Some(gpu), Some(cpu)) = (
        trace("pipeline_parallel", "gpu"),
        trace("pipeline_parallel", "cpu"),
    ) else {
        return;
    };
    fn numbers(v: &Value, out: &mut Vec<f64>) {
        match v {
            Value::Number(n) => out.extend(n.as_f64()),
            Value::Array(a) => a.iter().for_each(|x| numbers(x, out)),
            Value::Object(o) => o.values().for_each(|x| numbers(x, out)),
            _ => {}
        }
    }
    let (mut g, mut c) = (Vec::new(), Vec::new());
    numbers(&untimed(gpu), &mut g);
    numbers(&untimed(cpu), &mut c);
    assert_eq!(g.len(), c.len(), "the same trace shape");
    assert!(!g.is_empty());
    for (a, b) in g.iter().zip(&c) {
        assert!(
            (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
            "pipeline: GPU {a} vs CPU {b}"
        );
    }
}

/// Rows of a `bench` table: (op, size text, busbw).
fn bench_rows(stdout: &str) -> Vec<(String, String, f64)> {
    stdout
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let busbw = f.get(5)?.parse().ok()?;
            Some((f[0].to_string(), format!("{} {}", f[1], f[2]), busbw))
        })
        .collect()
}

#[test]
fn bench_runs_its_ranks_as_processes_through_a_relay() {
    // 3 ranks (odd), every op, sizes 4 B .. 4 KiB, each rank its own process; the small
    // all_reduces through rank 0 and back, as a room's ranks run them (the flag reaches every
    // rank's process, or the ranks' calls would disagree and the bench fail).
    let out = distgrad(
        &[
            "bench",
            "--processes",
            "--small-algo",
            "star",
            "--transport",
            "relay",
            "--world",
            "3",
            "--min-bytes",
            "4",
            "--max-bytes",
            "4096",
        ],
        None,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("transport=relay (processes,"),
        "the header says how the ranks ran: {stdout}"
    );
    assert!(
        stdout.contains("# all_reduce: the star through rank 0 below 64 KiB per rank"),
        "the header names the small all_reduce's algorithm: {stdout}"
    );
    let rows = bench_rows(&stdout);
    // all_gather's size is what each rank ends with (3 ranks' parts).
    let per_rank = ["4 B", "16 B", "64 B", "256 B", "1 KiB", "4 KiB"];
    let gathered = ["12 B", "48 B", "192 B", "768 B", "3 KiB", "12 KiB"];
    for (op, want) in [
        ("all_reduce", per_rank),
        ("all_gather", gathered),
        ("broadcast", per_rank),
    ] {
        let sizes: Vec<&str> = rows
            .iter()
            .filter(|r| r.0 == op)
            .map(|r| r.1.as_str())
            .collect();
        assert_eq!(
            sizes, want,
            "{op}: one row per size, from rank 0's process: {stdout}"
        );
    }
    assert!(
        rows.iter().all(|r| r.2 >= 0.0 && r.2.is_finite()),
        "{stdout}"
    );
    assert!(
        stdout.contains("# 16-byte all_reduce latency on rank 0: p50"),
        "{stdout}"
    );
    // Ranks as processes need a relay between them.
    let out = distgrad(&["bench", "--processes", "--transport", "local"], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("--processes needs a transport through a relay")
    );
}

/// True when a command failed only for want of a GPU adapter and the run does not require one
/// (then the test says it skipped); false when it succeeded.
fn skipped_without_gpu(out: &Output, what: &str) -> bool {
    if out.status.success() {
        return false;
    }
    let err = String::from_utf8_lossy(&out.stderr);
    if err.contains("no GPU adapter") && std::env::var("DISTGRAD_REQUIRE_GPU").as_deref() != Ok("1")
    {
        println!("skipped: no GPU adapter ({err})");
        return true;
    }
    panic!("{what} failed: {err}");
}

/// `bench kernels --elements`: one table per size, each row a kernel with its GB/s, its ratio to
/// the device's own copy measured in the same run, and the CPU loop's figures at small sizes.
#[test]
fn the_kernel_bench_prints_a_table_per_size() {
    let out = distgrad(&["bench", "kernels", "--elements", "4K,8k"], None);
    if skipped_without_gpu(&out, "bench kernels") {
        return;
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    for size in ["## 4096 f32 per input (16 KiB per buffer)", "## 8192 f32"] {
        assert!(stdout.contains(size), "{size:?} in {stdout}");
    }
    let names = [
        "device copy (baseline)",
        "copy kernel",
        "reduce-into, 1 input",
        "reduce-into, 4 inputs",
        "reduce-into, 4 in 1 pass",
        "1 pass, grid-stride",
        "1 pass, runs",
        "sum-to-scalar",
        "sum, interleaved",
        "sum, runs",
    ];
    for name in names {
        let n = stdout
            .lines()
            .filter(|l| l.trim_start().starts_with(name))
            .count();
        assert_eq!(n, 2, "{name:?}: one row per size in {stdout}");
    }
    for line in stdout
        .lines()
        .filter(|l| names.iter().any(|n| l.trim_start().starts_with(n)))
    {
        // The last five columns: GPU GB/s, x copy, x CUDA ("-" without CUDA), CPU GB/s,
        // GPU/CPU (the CPU is measured at 4K).
        let f: Vec<&str> = line.split_whitespace().rev().take(5).collect();
        for (i, x) in f.iter().enumerate() {
            if i == 2 && *x == "-" {
                continue;
            }
            let v: f64 = x.parse().unwrap_or_else(|_| panic!("a number in {line:?}"));
            // Printed with two decimals: a tiny ratio (a debug build's CPU loop) reads 0.00.
            assert!(v.is_finite() && v >= 0.0, "{line}");
        }
    }
    let copy = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("device copy"))
        .expect("copy row");
    assert_eq!(
        copy.split_whitespace().nth(4),
        Some("1.00"),
        "the baseline is 1.00x itself: {copy}"
    );
}

/// `bench --device gpu`: the in-process all_reduce with the tensors on the GPU says how many
/// bytes each call read back from the device.
#[test]
fn the_collective_bench_runs_with_tensors_on_the_gpu() {
    let args = [
        "bench",
        "--world",
        "3",
        "--ops",
        "all_reduce",
        "--min-bytes",
        "1024",
        "--max-bytes",
        "4096",
        "--device",
        "gpu",
    ];
    let out = distgrad(&args, None);
    if skipped_without_gpu(&out, "bench --device gpu") {
        return;
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("# tensors on "), "{stdout}");
    assert!(stdout.contains("read back/call"), "{stdout}");
    let rows: Vec<_> = bench_rows(&stdout)
        .into_iter()
        .filter(|r| r.0 == "all_reduce")
        .collect();
    let sizes: Vec<&str> = rows.iter().map(|r| r.1.as_str()).collect();
    assert_eq!(sizes, ["1 KiB", "4 KiB"], "{stdout}");
    // Each row ends with the bytes read back per call: a size such as "0 B" or "1 KiB".
    for line in stdout
        .lines()
        .filter(|l| l.trim_start().starts_with("all_reduce"))
    {
        let f: Vec<&str> = line.split_whitespace().collect();
        let unit = f[f.len() - 1];
        assert!(
            matches!(unit, "B" | "KiB" | "MiB") && f[f.len() - 2].parse::<u64>().is_ok(),
            "{line}"
        );
    }
}

/// A bare `distgrad` (a bare `cargo run`) is a short demo, not a usage error: it says what it ran
/// and why (this test build has no NCCL, so the in-process demo, naming what the GPU path needs),
/// shows one collective's forward and backward with its dual, trains with identical replicas,
/// and ends with what to try next.
#[test]
fn a_bare_run_is_a_demo_that_says_what_it_ran() {
    let out = distgrad(&[], None);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "the demo runs on 4 in-process ranks",
        "this build has no NCCL; the GPU path needs `cargo run --release --features native-nccl`",
        "backward (dual): all_reduce(op=sum)",
        // Hand-checked: inputs [1,8],[2,6],[3,4],[4,2] sum to [10, 20] on every rank; the
        // cotangents [1,1],[1,2],[1,3],[1,4] sum to the gradient [4, 10] on every rank.
        "0    | [1, 8] | [10, 20] | [1, 1]     | [4, 10]",
        "3    | [4, 2] | [10, 20] | [1, 4]     | [4, 10]",
        "replicas identical on every rank: yes",
        "Try next",
        "distgrad train --backend nccl",
    ] {
        assert!(stdout.contains(want), "{want:?} in {stdout}");
    }
}

/// A program: one all_reduce(SUM) of `numel` elements, then loss = sum(s²).
fn all_reduce_program(world: usize, numel: usize) -> String {
    json!({
        "format": "program", "world": world,
        "inputs": [{"name": "x", "shape": [numel]}],
        "steps": [
            {"collective": "all_reduce", "op": "sum", "in": ["x"], "out": "s"},
            {"op": "square", "in": ["s"], "out": "q"},
            {"op": "sum", "in": ["q"], "out": "loss"}
        ],
        "loss": "loss"
    })
    .to_string()
}

#[test]
fn run_events_prints_the_algorithm_round_by_round() {
    // Ring all_reduce of 8 elements (32 B) on 4 ranks: 2(n-1) = 6 rounds, each rank sends
    // 2(n-1)/n · 32 = 48 B; its dual (all_reduce SUM) the same in backward.
    let prog = all_reduce_program(4, 8);
    let v = ok_json(
        &["run", "-", "--events", "--json", "--algorithm", "ring"],
        Some(&prog),
    );
    assert_eq!(v["world"], 4);
    assert_eq!(v["algorithm"], "ring");
    let calls = v["calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2, "{v}");
    for (c, phase) in calls.iter().zip(["forward", "backward"]) {
        assert_eq!(c["phase"], phase);
        assert_eq!(c["collective"], "all_reduce(op=sum)");
        assert_eq!(c["algorithm"], "ring");
        let ranks = c["ranks"].as_array().unwrap();
        assert_eq!(ranks.len(), 4);
        for r in ranks {
            let sent: u64 = r["events"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["action"] == "send")
                .map(|e| e["bytes"].as_u64().unwrap())
                .sum();
            assert_eq!(sent, 48, "{r}");
            let rounds = r["events"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["action"] == "send")
                .map(|e| e["round"].as_u64().unwrap())
                .max();
            assert_eq!(rounds, Some(5));
        }
    }
    let out = distgrad(
        &["run", "-", "--events", "--algorithm", "ring"],
        Some(&prog),
    );
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("all_reduce(op=sum) [8] over ranks [0, 1, 2, 3]: ring, 6 rounds"));
    // Round 0: rank 0 sends its chunk 0 to rank 1, which folds it into its own.
    assert!(text.contains("round 0: 0→1 chunk 0/4 [0..2) 8 B"), "{text}");
    assert!(text.contains("fold: rank 0 chunk 3/4 [6..8)   rank 1 chunk 0/4 [0..2)"));
    assert!(text.contains("backward (each collective's dual)"));

    // The same program where the ring cannot run says why.
    let small = all_reduce_program(4, 2);
    let out = distgrad(
        &["run", "-", "--events", "--algorithm", "ring"],
        Some(&small),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("exchange (the ring needs at least one element per rank (2 < 4))"),
        "{text}"
    );

    // The star at 5 ranks: 2(n-1) = 8 messages in 2 rounds, all through rank 0.
    let v = ok_json(
        &[
            "run",
            "-",
            "--events",
            "--json",
            "--algorithm",
            "star",
            "--world",
            "5",
        ],
        Some(&all_reduce_program(5, 3)),
    );
    let sends: Vec<(u64, u64)> = v["calls"][0]["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| {
            let rank = r["rank"].as_u64().unwrap();
            r["events"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["action"] == "send")
                .map(move |e| (rank, e["peer"].as_u64().unwrap()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(sends.len(), 8, "{sends:?}");
    assert!(sends.iter().all(|&(a, b)| a == 0 || b == 0), "{sends:?}");
}

#[test]
fn run_events_refuses_what_cannot_be_chosen() {
    let prog = all_reduce_program(3, 3);
    for (args, says) in [
        (
            vec!["run", "-", "--events", "--algorithm", "tree"],
            "the tree algorithm is not chosen",
        ),
        (
            vec!["run", "-", "--events", "--algorithm", "butterfly"],
            "unknown algorithm \"butterfly\"",
        ),
        (
            vec!["run", "-", "--algorithm", "ring", "--print-program"],
            "cannot be used with",
        ),
    ] {
        let out = distgrad(&args, Some(&prog));
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

#[test]
fn run_events_of_a_pipeline_pairs_each_send_with_its_recv() {
    let v = ok_json(
        &[
            "run",
            "www/programs/pipeline_send_recv.json",
            "--events",
            "--json",
        ],
        None,
    );
    let calls = v["calls"].as_array().unwrap();
    assert!(!calls.is_empty());
    for c in calls {
        assert_eq!(c["algorithm"], "point_to_point");
        // One call across ranks: the sender's record and the receiver's.
        let ranks = c["ranks"].as_array().unwrap();
        assert_eq!(ranks.len(), 2, "{c}");
        let actions: Vec<&str> = ranks
            .iter()
            .map(|r| r["events"][0]["action"].as_str().unwrap())
            .collect();
        assert!(
            actions.contains(&"send") && actions.contains(&"recv"),
            "{c}"
        );
    }
}
