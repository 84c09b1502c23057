//! The benchmark behind `window.distgrad.benchAllReduce`.

use bytes::Bytes;
use wasm_bindgen::JsValue;

use crate::backend::Device;
use crate::collective::{AllReduceAlgo, Communicator, Group, P2p, ReduceOp, SmallAllReduce};
use crate::error::{Error, Result};
use crate::transport::browser::BrowserTransport;
use crate::transport::{Channel, Tag, Transport};
use crate::{Tape, Tensor, dist};

use super::dom::{esc, now_ms, set_html, set_text};
use super::lessons::exchange;
use super::{App, app, state};

pub(super) async fn bench_all_reduce(numel: usize) -> Result<String> {
    let app = app()?;
    let _busy = app.busy.lock().await;
    let comm = app.group()?;
    let x = Tensor::from_vec((0..numel).map(|i| (i % 7) as f32).collect(), &[numel])?
        .to_device(&app.device)?;
    let t0 = now_ms();
    let tape = Tape::new();
    let xv = tape.var(x);
    let group = comm.world();
    let y = dist::all_reduce(comm, &xv, ReduceOp::Sum, &group).await?;
    let loss = y.sum()?;
    let grads = tape.backward(&loss, comm).await?;
    let g = grads.wrt(&xv)?;
    finished(&loss.value()).await?;
    let ms = now_ms() - t0;
    let first = g.slice(0, 0, 1)?.read().await?;
    comm.take_calls();
    // Checksums outside the timed part: every output element is world * (i % 7), every gradient
    // element is world (d/dx of sum(all_reduce(x)) on every rank, summed over ranks).
    let sum = |v: Vec<f32>| v.iter().map(|&x| f64::from(x)).sum::<f64>();
    Ok(serde_json::json!({
        "numel": numel,
        "bytes": numel * 4,
        "ms": ms,
        "grad0": first.first().copied(),
        "y_sum": sum(y.value().read().await?),
        "grad_sum": sum(g.read().await?),
    })
    .to_string())
}

/// Wait until every step of a forward + backward has finished, the device's included: the loss's
/// device buffer is read back (made first, from its host copy, when the sum ran on the host), after
/// everything else was submitted, and a device runs its queue in order. (Reading its host copy, or
/// the gradient's, which came out of a collective, would not wait for the GPU.)
async fn finished(loss: &Tensor) -> Result<()> {
    loss.without_host_copy().read().await.map(drop)
}

/// Group id of the room benchmark's raw messages (no communicator group reaches it).
const BENCH_GROUP: u32 = u32::MAX - 2;
/// Repetitions of each timed measurement (the median is reported).
const BENCH_REPS: usize = 15;
/// Untimed repetitions before each measurement of small messages (as nccl-tests' warm-up
/// iterations): the page's code and the links settle (the browser compiles hot WebAssembly again,
/// optimized, after the first runs; measured: the first ~20 small all_reduces take 3-5x the
/// later ones).
const BENCH_WARMUP: usize = 30;
/// Untimed repetitions before the large all_reduce (each is long enough to settle on its own).
const BENCH_WARMUP_LARGE: usize = 3;
/// Bytes rank 0 streams to rank 1 for the raw throughput, in messages of [`BENCH_CHUNK`].
const BENCH_STREAM: usize = 4 << 20;
const BENCH_CHUNK: usize = 256 << 10;
/// Elements of the small and the large all_reduce.
const BENCH_SIZES: [usize; 2] = [1, 1 << 18];

/// The timed repetitions: those after the first `warmup`.
fn timed(mut v: Vec<f64>, warmup: usize) -> Vec<f64> {
    v.drain(..warmup.min(v.len()));
    v
}

/// The smallest step of `performance.now()` seen over a few steps, in ms: 0.1 in a page that is
/// not cross-origin isolated (Chromium coarsens its clock there), 0.005 in one that is (the relay
/// serves the page with the headers for it). Every figure of the room benchmark is a multiple of
/// it; a round trip of a few steps is only that precise.
fn timer_step_ms() -> f64 {
    let mut step = f64::INFINITY;
    let mut last = now_ms();
    let mut seen = 0;
    // Bounded: a clock that never moves (none does) ends after this many reads.
    for _ in 0..1_000_000 {
        let t = now_ms();
        if t > last {
            step = step.min(t - last);
            last = t;
            seen += 1;
            if seen == 20 {
                break;
            }
        }
    }
    step
}

/// `window.crossOriginIsolated` (false where the browser has no such property).
fn cross_origin_isolated() -> bool {
    web_sys::window()
        .and_then(|w| js_sys::Reflect::get(&w, &JsValue::from_str("crossOriginIsolated")).ok())
        .is_some_and(|v| v.as_bool() == Some(true))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The room benchmark, run by every tab when rank 0 announces it (`run` counts the benchmarks,
/// the same on every tab, so the tabs' raw messages match): raw round trips from rank 0 to every
/// peer, rank 0's raw throughput to rank 1 and a raw exchange (every rank 4 bytes to every other)
/// over the same links the collectives use, then a SUM all_reduce forward + backward of 4 B and
/// 1 MiB (on a WebGPU tab also with CPU tensors: the GPU path as a multiple of the CPU path; the
/// 4 B one with each small all_reduce algorithm, the room's and the other, so each is a multiple
/// of the exchange measured beside it); each collective figure beside its link's (the small one
/// in round trips and in raw exchanges, the large one's bus bandwidth as a fraction of the raw
/// throughput). Every tab gets rank 0's table.
pub(super) async fn bench_room(app: &App, run: u64) -> Result<serde_json::Value> {
    let comm = app.comm.as_ref().ok_or_else(|| {
        Error::Input("the room benchmark needs tabs (not single-tab mode)".into())
    })?;
    let group = comm.world();
    comm.barrier(&group).await?;
    let mut raw = Raw {
        t: comm.transport(),
        me: comm.rank(),
        world: comm.world_size(),
        run,
        next: 0,
    };
    let round_trip_ms = round_trips(&mut raw).await?;
    let raw_mibs = throughput(&mut raw).await?;
    comm.barrier(&group).await?;
    let exchange_ms = raw_exchange(&mut raw).await?;
    let links = LinkFigures {
        round_trip_ms,
        raw_mibs,
        exchange_ms,
    };
    let all_reduce = all_reduce_figures(app, comm, &group).await?;
    // Rank 0's table goes to every tab.
    let table = if raw.me == 0 {
        table(app, raw.world, &links, &all_reduce)
    } else {
        serde_json::Value::Null
    };
    share_table(app, comm, &table).await
}

/// What the raw measurements share: the links, this tab's place, and the numbering of their
/// messages, the same on every tab (`run` keeps benchmarks apart), so each send meets its receive.
struct Raw<'a> {
    t: &'a BrowserTransport,
    me: usize,
    world: usize,
    run: u64,
    /// The number of the next message.
    next: u64,
}

impl Raw<'_> {
    /// Number the next `n` messages: the first one's number.
    fn reserve(&mut self, n: u64) -> u64 {
        let k = self.next;
        self.next += n;
        k
    }

    fn tag(&self, k: u64) -> Tag {
        Tag {
            group: BENCH_GROUP,
            seq: self.run * 1_000_000 + k,
            channel: Channel::Data,
        }
    }
}

/// Raw round trips: rank 0 and each peer in turn, 4 bytes each way. Rank 0's medians per peer
/// (the other tabs' list is empty).
async fn round_trips(raw: &mut Raw<'_>) -> Result<Vec<serde_json::Value>> {
    let (t, me) = (raw.t, raw.me);
    let mut rtt = Vec::new();
    for peer in 1..raw.world {
        let mut times = Vec::with_capacity(BENCH_WARMUP + BENCH_REPS);
        for _ in 0..BENCH_WARMUP + BENCH_REPS {
            let k = raw.reserve(2);
            let ping = Bytes::from_static(&[1, 2, 3, 4]);
            if me == 0 {
                let t0 = now_ms();
                t.send(peer, raw.tag(k), ping).await?;
                t.recv(peer, raw.tag(k + 1)).await?;
                times.push(now_ms() - t0);
            } else if me == peer {
                let got = t.recv(0, raw.tag(k)).await?;
                t.send(0, raw.tag(k + 1), got).await?;
            }
        }
        if me == 0 {
            rtt.push(serde_json::json!({"peer": peer, "ms": median(timed(times, BENCH_WARMUP))}));
        }
    }
    Ok(rtt)
}

/// Raw throughput rank 0 → rank 1: the stream, then a 1-byte answer once all arrived. Rank 0's
/// MiB/s (None on the other tabs, and with one rank).
async fn throughput(raw: &mut Raw<'_>) -> Result<Option<f64>> {
    if raw.world < 2 {
        return Ok(None);
    }
    let t = raw.t;
    let chunks = BENCH_STREAM / BENCH_CHUNK;
    let k = raw.reserve(chunks as u64 + 1);
    if raw.me == 0 {
        let chunk = Bytes::from(vec![7u8; BENCH_CHUNK]);
        let t0 = now_ms();
        for c in 0..chunks {
            t.send(1, raw.tag(k + c as u64), chunk.clone()).await?;
        }
        t.recv(1, raw.tag(k + chunks as u64)).await?;
        let s = (now_ms() - t0) / 1000.0;
        return Ok(Some(BENCH_STREAM as f64 / (1 << 20) as f64 / s));
    }
    if raw.me == 1 {
        for c in 0..chunks {
            t.recv(0, raw.tag(k + c as u64)).await?;
        }
        t.send(0, raw.tag(k + chunks as u64), Bytes::from_static(&[0]))
            .await?;
    }
    Ok(None)
}

/// Raw exchange: every rank sends 4 bytes to every other and waits for all of theirs (the
/// messages of a small all_reduce, without the collective around them). The median in ms (None
/// with one rank).
async fn raw_exchange(raw: &mut Raw<'_>) -> Result<Option<f64>> {
    let (t, me, world) = (raw.t, raw.me, raw.world);
    let mut times = Vec::with_capacity(BENCH_WARMUP + BENCH_REPS);
    for _ in 0..BENCH_WARMUP + BENCH_REPS {
        let k = raw.reserve(1);
        let tag = raw.tag(k);
        let t0 = now_ms();
        for p in (0..world).filter(|&p| p != me) {
            t.send(p, tag, Bytes::from_static(&[1, 2, 3, 4])).await?;
        }
        for p in (0..world).filter(|&p| p != me) {
            t.recv(p, tag).await?;
        }
        times.push(now_ms() - t0);
    }
    Ok((world > 1).then(|| median(timed(times, BENCH_WARMUP))))
}

/// The raw links' figures beside which the all_reduce rows are read (rank 0's).
struct LinkFigures {
    /// `{"peer", "ms"}` per peer of rank 0.
    round_trip_ms: Vec<serde_json::Value>,
    raw_mibs: Option<f64>,
    exchange_ms: Option<f64>,
}

/// One all_reduce row: elements, device ([`device_label`]), algorithm, median ms.
type Row = (usize, &'static str, &'static str, f64);

/// The all_reduce rows, and which of their algorithms the room itself uses.
struct AllReduceFigures {
    rows: Vec<Row>,
    /// The small size's algorithm in the room (the other small one is measured as a baseline).
    room_small: SmallAllReduce,
    /// The large size's algorithm, as `P2p::all_reduce` chooses it.
    large_algo: &'static str,
}

/// The collectives, each repetition started together: on the tab's device, and on a GPU tab
/// also on the CPU backend over the same links, so the GPU path's cost is a ratio too. The
/// devices take turns repetition by repetition, so whatever else the machine does meanwhile
/// (the browser optimizing the page's code in the background, other tabs) weighs on both rows.
async fn all_reduce_figures(
    app: &App,
    comm: &P2p<BrowserTransport>,
    group: &Group,
) -> Result<AllReduceFigures> {
    let mut devices = vec![app.device.clone()];
    if !matches!(app.device, Device::Cpu) {
        devices.push(Device::Cpu);
    }
    let configured = comm.small_all_reduce();
    let (room_small, small_algos) = small_algos(configured, comm.world_size());
    // The large size's algorithm, as `P2p::all_reduce` chooses it.
    let large_algo = match comm.options().all_reduce {
        AllReduceAlgo::Auto if comm.transport().shares_memory() => AllReduceAlgo::Shared.name(),
        AllReduceAlgo::Auto => AllReduceAlgo::Ring.name(),
        a => a.name(),
    };
    let mut rows = Vec::new();
    for numel in BENCH_SIZES {
        let small = numel == BENCH_SIZES[0];
        let warmup = if small {
            BENCH_WARMUP
        } else {
            BENCH_WARMUP_LARGE
        };
        let algos = if small {
            &small_algos[..]
        } else {
            &small_algos[..1]
        };
        let runs: Vec<(Tensor, &Device, SmallAllReduce)> = devices
            .iter()
            .flat_map(|dev| algos.iter().map(move |&a| (dev, a)))
            .map(|(dev, a)| {
                Ok((
                    Tensor::from_vec(vec![1.0; numel], &[numel])?.to_device(dev)?,
                    dev,
                    a,
                ))
            })
            .collect::<Result<_>>()?;
        let times = time_all_reduces(comm, group, &runs, warmup, configured).await?;
        for ((_, dev, algo), times) in runs.iter().zip(times) {
            rows.push((
                numel,
                device_label(dev),
                if small { algo.name() } else { large_algo },
                median(timed(times, warmup)),
            ));
        }
    }
    Ok(AllReduceFigures {
        rows,
        room_small,
        large_algo,
    })
}

/// The room's small all_reduce algorithm and the ones the small size runs with, the room's
/// first: the other one too, in the same turns (from 3 ranks: two exchange whatever the
/// setting, so there is no other to measure).
fn small_algos(configured: SmallAllReduce, world: usize) -> (SmallAllReduce, Vec<SmallAllReduce>) {
    if world > 2 {
        let others = SmallAllReduce::ALL.into_iter().filter(|&a| a != configured);
        (
            configured,
            std::iter::once(configured).chain(others).collect(),
        )
    } else {
        (SmallAllReduce::Exchange, vec![SmallAllReduce::Exchange])
    }
}

/// SUM all_reduce forward + backward of each run's tensor with its small algorithm, the runs
/// taking turns repetition by repetition, every repetition started together: each run's times
/// in ms, warm-up included. The room's setting (`configured`) is back afterwards, failed or not.
async fn time_all_reduces(
    comm: &P2p<BrowserTransport>,
    group: &Group,
    runs: &[(Tensor, &Device, SmallAllReduce)],
    warmup: usize,
    configured: SmallAllReduce,
) -> Result<Vec<Vec<f64>>> {
    let mut times = vec![Vec::with_capacity(warmup + BENCH_REPS); runs.len()];
    let timed_runs = async {
        for _ in 0..warmup + BENCH_REPS {
            for ((x, _, algo), times) in runs.iter().zip(&mut times) {
                comm.set_small_all_reduce(*algo);
                comm.barrier(group).await?;
                let t0 = now_ms();
                let tape = Tape::new();
                let xv = tape.var(x.clone());
                let y = dist::all_reduce(comm, &xv, ReduceOp::Sum, group).await?;
                let loss = y.sum()?;
                tape.backward(&loss, comm).await?.wrt(&xv)?;
                finished(&loss.value()).await?;
                times.push(now_ms() - t0);
            }
        }
        Ok::<(), Error>(())
    }
    .await;
    comm.set_small_all_reduce(configured);
    timed_runs?;
    comm.take_calls();
    Ok(times)
}

/// Rank 0's table: the links' figures, and each all_reduce row beside them.
fn table(
    app: &App,
    world: usize,
    links: &LinkFigures,
    all_reduce: &AllReduceFigures,
) -> serde_json::Value {
    let rtt = &links.round_trip_ms;
    let mean_rtt =
        rtt.iter().filter_map(|r| r["ms"].as_f64()).sum::<f64>() / rtt.len().max(1) as f64;
    let rows: Vec<serde_json::Value> = all_reduce
        .rows
        .iter()
        .map(|&row| row_json(row, world, mean_rtt, links, all_reduce))
        .collect();
    serde_json::json!({
        "world": world,
        "links": state(|s| s.links.clone()),
        "round_trip_ms": rtt,
        "mean_round_trip_ms": mean_rtt,
        "exchange_ms": links.exchange_ms,
        "raw_mibs_0_to_1": links.raw_mibs,
        "device": device_label(&app.device),
        "timer_step_ms": timer_step_ms(),
        "cross_origin_isolated": cross_origin_isolated(),
        "all_reduce_fwd_bwd": rows,
        "reps": BENCH_REPS,
        "warmup": BENCH_WARMUP,
        "warmup_large": BENCH_WARMUP_LARGE,
    })
}

/// One all_reduce row of the table: its time, and as multiples of the CPU's, of the exchange
/// algorithm's, of the raw round trip (`mean_rtt`) and exchange, and of the raw throughput.
fn row_json(
    (numel, device, algo, ms): Row,
    world: usize,
    mean_rtt: f64,
    links: &LinkFigures,
    all_reduce: &AllReduceFigures,
) -> serde_json::Value {
    let rows = &all_reduce.rows;
    let bytes = numel * 4;
    let cpu_ms = rows
        .iter()
        .find(|c| c.0 == numel && c.1 == "cpu" && c.2 == algo)
        .map(|c| c.3);
    // A small row over the exchange's beside it (same size and device).
    let exchange_algo_ms = rows
        .iter()
        .find(|c| c.0 == numel && c.1 == device && c.2 == SmallAllReduce::Exchange.name())
        .map(|c| c.3);
    // Bus bandwidth of an all_reduce (nccl-tests): 2(n−1)/n of the bytes per rank,
    // twice (forward and backward).
    let bus = 2.0 * 2.0 * (world as f64 - 1.0) / world as f64 * bytes as f64;
    let busbw = bus / (1 << 20) as f64 / (ms / 1000.0);
    serde_json::json!({
        "bytes": bytes,
        "device": device,
        "algo": algo,
        // The algorithm the room uses for this size (the other small one is a baseline).
        "room_algo": algo == all_reduce.large_algo || algo == all_reduce.room_small.name(),
        "ms": ms,
        "of_cpu": cpu_ms.map(|c| ms / c),
        "of_exchange_algo": exchange_algo_ms.map(|e| ms / e),
        "round_trips": ms / mean_rtt,
        // forward and backward: two exchanges' worth of messages
        "of_exchange": links.exchange_ms.map(|e| ms / (2.0 * e)),
        "busbw_mibs": busbw,
        "of_raw": links.raw_mibs.map(|r| busbw / r),
    })
}

/// Rank 0's table on every tab: sent as text and parsed alike on every tab (rank 0 included),
/// so every tab holds the same numbers to the last bit.
async fn share_table(
    app: &App,
    comm: &P2p<BrowserTransport>,
    table: &serde_json::Value,
) -> Result<serde_json::Value> {
    let all = exchange(app, comm, table.to_string()).await?;
    let text = all
        .into_iter()
        .next()
        .ok_or_else(|| Error::Input("no table from rank 0".into()))?;
    serde_json::from_str(&text).map_err(|e| Error::Input(format!("rank 0's table: {e}")))
}

/// How the benchmark table names a device: `"cpu"` or `"gpu"`.
fn device_label(d: &Device) -> &'static str {
    if matches!(d, Device::Cpu) {
        "cpu"
    } else {
        "gpu"
    }
}

/// The benchmark table as the page shows it.
pub(super) fn show_bench(v: &serde_json::Value) {
    let num = |x: &serde_json::Value, digits: usize| {
        x.as_f64()
            .map_or_else(|| "—".to_string(), |f| format!("{f:.digits$}"))
    };
    let mut html = format!(
        "<p>Links: {} (rank 0's view). Raw: round trip {} ms on average (",
        esc(&v["links"]
            .as_array()
            .map(|l| {
                l.iter()
                    .filter_map(|x| x.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default()),
        num(&v["mean_round_trip_ms"], 2)
    );
    let per: Vec<String> = v["round_trip_ms"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| format!("0↔{}: {} ms", r["peer"], num(&r["ms"], 2)))
        .collect();
    html.push_str(&esc(&per.join(", ")));
    html.push_str(&format!(
        "), every tab 4 B to every other {} ms, rank 0 → 1 {} MiB/s. The page's clock steps by {} µs \
         ({}).</p>",
        num(&v["exchange_ms"], 2),
        num(&v["raw_mibs_0_to_1"], 0),
        v["timer_step_ms"]
            .as_f64()
            .map_or_else(|| "—".to_string(), |f| format!("{:.0}", f * 1000.0)),
        if v["cross_origin_isolated"].as_bool() == Some(true) {
            "cross-origin isolated"
        } else {
            "not cross-origin isolated: the browser coarsens it"
        }
    ));
    html.push_str(
        "<table class=\"values\"><thead><tr><th scope=\"col\">all_reduce(SUM), forward + backward</th>\
         <th scope=\"col\">tensors on</th><th scope=\"col\">algorithm</th><th scope=\"col\">ms (median)</th><th scope=\"col\">× the exchange's</th><th scope=\"col\">× the CPU's</th><th scope=\"col\">round trips</th><th scope=\"col\">× 2 raw exchanges</th>\
         <th scope=\"col\">bus bandwidth MiB/s</th><th scope=\"col\">of the raw link</th></tr></thead><tbody>",
    );
    let rows = v["all_reduce_fwd_bwd"]
        .as_array()
        .map_or(&[][..], Vec::as_slice);
    // Whether another small algorithm than the room's was measured beside it (3 tabs or more).
    let compared = rows.iter().any(|r| r["room_algo"].as_bool() == Some(false));
    for r in rows {
        // The algorithm; the room's marked where the other small one is measured beside it.
        let algo = r["algo"].as_str().unwrap_or("—");
        let algo = if compared
            && r["room_algo"].as_bool() == Some(true)
            && r["of_exchange_algo"].is_number()
        {
            format!("{algo} (the room's)")
        } else {
            algo.to_string()
        };
        html.push_str(&format!(
            "<tr><th scope=\"row\">{} B</th><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            r["bytes"],
            if r["device"] == "gpu" { "WebGPU" } else { "CPU" },
            esc(&algo),
            num(&r["ms"], 2),
            num(&r["of_exchange_algo"], 2),
            num(&r["of_cpu"], 2),
            num(&r["round_trips"], 1),
            num(&r["of_exchange"], 1),
            num(&r["busbw_mibs"], 1),
            num(&r["of_raw"], 2)
        ));
    }
    html.push_str("</tbody></table>");
    set_html("bench-result", &html);
}

/// The value of element `i` of what [`send_and_leave`] sends from rank `src` (exact in f32).
fn leave_pattern(src: usize, i: usize) -> f32 {
    ((i % 4093) + 8 * src) as f32
}

/// `sendAndLeave(dst, numel)`: send `numel` values to rank `dst`, then leave the room at once
/// (the goodbye on every link after the data, as a closing tab does). A clean leave must never
/// cost the receiver data already sent: [`recv_from`] on `dst` gets all of it.
pub(super) async fn send_and_leave(dst: usize, numel: usize) -> Result<String> {
    let app = app()?;
    let _busy = app.busy.lock().await;
    let comm = app.group()?;
    let me = comm.rank();
    let x = Tensor::from_vec((0..numel).map(|i| leave_pattern(me, i)).collect(), &[numel])?;
    comm.send(&x, dst, &comm.world()).await?;
    comm.transport().close();
    state(|s| s.phase = "left".into());
    set_text("phase", "left the room (sendAndLeave)");
    Ok(format!("sent {numel} values to rank {dst} and left"))
}

/// `recvFrom(src, numel)`: receive `numel` values from rank `src` and compare them with what
/// [`send_and_leave`] sends: JSON with the count and the mismatches.
pub(super) async fn recv_from(src: usize, numel: usize) -> Result<String> {
    let app = app()?;
    let _busy = app.busy.lock().await;
    let comm = app.group()?;
    let t0 = now_ms();
    let got = comm
        .recv(&[numel], src, &comm.world())
        .await?
        .read()
        .await?;
    let ms = now_ms() - t0;
    let mismatches = got
        .iter()
        .enumerate()
        .filter(|&(i, &v)| v != leave_pattern(src, i))
        .count();
    Ok(serde_json::json!({"received": got.len(), "mismatches": mismatches, "ms": ms}).to_string())
}
