// The page's room benchmark, repeated: the figures behind docs/benchmarks.md's browser table and the notes
// on the browser data path.
//
//   node tests/browser/bench.mjs --bin <distgrad binary> --dist <built web app>
//        [--net channel|relay|webrtc|auto] [--device cpu|gpu|auto] [--world 4] [--runs 5] [--json FILE]
//        [--ports 1|0|both]   (0: tabs of this browser keep their BroadcastChannels, the page's
//        ports=0; both: a room of each, run alternately, with each run's ratio between the two)
//
// Starts `distgrad relay --static <dist>` on an ephemeral loopback port, opens `--world` tabs of
// headless Chromium (WebGPU on SwiftShader) in one room, and has rank 0 run the room benchmark
// `--runs` times (each: raw round trips, raw throughput and a raw exchange over the room's links,
// then the SUM all_reduce forward + backward of 4 B and 1 MiB, every figure the median of the
// page's repetitions after its warm-up). Prints every run's row and, per figure, the median over
// the runs; every collective figure is also printed as a ratio to the raw figure of the same run
// (round trips, raw exchanges, the CPU path), since this machine's speed drifts from run to run.
// Asserts nothing but that every run completed. --net webrtc must run in a loopback-only network
// namespace (see e2e.mjs).

import { randomBytes } from 'node:crypto';
import { writeFileSync } from 'node:fs';
import { chromium } from 'playwright-core';
import { parseArgs, sleep, startRelay, stateOf, waitFor } from './common.mjs';

const args = parseArgs(process.argv.slice(2));
const BIN = args.bin;
const DIST = args.dist ?? 'dist';
const NET = args.net ?? 'channel';
const DEVICE = args.device ?? 'auto';
const WORLD = Number(args.world ?? 4);
const RUNS = Number(args.runs ?? 5);
const CHROMIUM = process.env.CHROMIUM ?? '/usr/bin/chromium';
if (!BIN || !['relay', 'webrtc', 'channel', 'auto'].includes(NET) || !['gpu', 'cpu', 'auto'].includes(DEVICE)
    || !(WORLD >= 2 && WORLD <= 8) || !(RUNS >= 1 && RUNS <= 50)) {
  console.error('usage: bench.mjs --bin <distgrad> --dist <dir> [--net channel|relay|webrtc|auto] [--device cpu|gpu|auto] [--world 2..8] [--runs 1..50] [--json FILE]');
  process.exit(2);
}
const chromeArgs = [
  '--no-sandbox', '--no-first-run', '--disable-background-networking', '--disable-component-update',
  '--disable-sync', '--enable-unsafe-webgpu', '--use-webgpu-adapter=swiftshader',
  '--allow-loopback-in-peer-connection',
];
const median = (v) => { const s = [...v].sort((a, b) => a - b); const m = s.length >> 1; return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2; };
const f = (x, d) => (typeof x === 'number' && Number.isFinite(x) ? x.toFixed(d) : '—');

// The rooms to run in: one, or with --ports both one whose tabs use the port hub's MessageChannels
// and one whose tabs keep their BroadcastChannels, run alternately (each run's ratio between the two
// is then measured on the same machine at the same time).
const PORTS = args.ports ?? '1';
if (!['1', '0', 'both'].includes(PORTS)) {
  console.error('--ports must be 1, 0 or both');
  process.exit(2);
}
const ROOMS = PORTS === 'both' ? ['1', '0'] : [PORTS];
const roomLabel = (ports) => (ports === '0' ? 'ports=0' : 'ports');

async function openRoom(ctx, relay, ports) {
  const params = (NET === 'auto' ? '' : `&net=${NET}`) + (DEVICE === 'auto' ? '' : `&device=${DEVICE}`)
    + (ports === '0' ? '&ports=0' : '');
  const url = `http://${relay.host}/?room=bench-${process.pid}-${ports}&world=${WORLD}&token=${randomBytes(16).toString('hex')}${params}`;
  const pages = [];
  for (let i = 0; i < WORLD; i++) pages.push(await ctx.newPage());
  await Promise.all(pages.map((p) => p.goto(url)));
  const states = await waitFor(pages, (s) => s.phase === 'ready', 90000, 'tabs ready');
  const byRank = [];
  states.forEach((s, i) => { byRank[s.rank] = pages[i]; });
  console.log(`[bench ${NET}, ${roomLabel(ports)}, device ${DEVICE}] ${WORLD} tabs ready; compute: ${states[0].device}; links of rank 0: ${JSON.stringify(states.find((s) => s.rank === 0).links)}`);
  // Between tabs of this browser the link must be the one this room is for, or its figures would
  // be labelled with the wrong link.
  if (NET === 'channel' || NET === 'auto') {
    const want = ports === '0' ? 'channel' : 'port';
    const bad = states.find((s) => s.links.some((l, r) => r !== s.rank && l !== want));
    if (bad) throw new Error(`${roomLabel(ports)} room: rank ${bad.rank}'s links are ${JSON.stringify(bad.links)}, expected ${want}`);
  }
  return byRank;
}

async function benchOnce(byRank, run, label) {
  const before = await Promise.all(byRank.map(stateOf));
  await byRank[0].evaluate(() => window.distgrad.benchRoom());
  const t0 = Date.now();
  for (;;) {
    const st = await Promise.all(byRank.map(stateOf));
    const bad = st.find((s) => s.phase === 'failed');
    if (bad) throw new Error(`run ${run} (${label}): a tab failed: ${bad.error}`);
    if (st.every((s, i) => s.bench_runs === before[i].bench_runs + 1)) break;
    if (Date.now() - t0 > 120000) throw new Error(`run ${run} (${label}): not done within 120 s`);
    await sleep(100);
  }
  const t = JSON.parse(await byRank[0].evaluate(() => window.distgrad.benchResult()));
  const row = { run, round_trip_ms: t.mean_round_trip_ms, exchange_ms: t.exchange_ms, raw_mibs: t.raw_mibs_0_to_1, timer_step_ms: t.timer_step_ms };
  // The small size runs with the room's algorithm (small_<device>_*) and with the other one as a
  // baseline (small_<algo>_<device>_*, with of_exchange_algo: the room's over the exchange's).
  for (const r of t.all_reduce_fwd_bwd) {
    const k = r.bytes === 4 ? (r.room_algo ? `small_${r.device}` : `small_${r.algo}_${r.device}`) : `large_${r.device}`;
    Object.assign(row, {
      [`${k}_ms`]: r.ms, [`${k}_round_trips`]: r.round_trips, [`${k}_of_exchange`]: r.of_exchange,
      [`${k}_of_raw`]: r.of_raw, [`${k}_of_cpu`]: r.of_cpu,
    });
    if (r.bytes === 4 && r.room_algo) Object.assign(row, { [`${k}_algo_${r.algo}_of_exchange_algo`]: r.of_exchange_algo });
  }
  console.log(`run ${run}${ROOMS.length > 1 ? ` ${label}` : ''}: clock step ${f(1000 * row.timer_step_ms, 0)} µs, round trip ${f(row.round_trip_ms, 2)} ms, raw exchange ${f(row.exchange_ms, 2)} ms, raw ${f(row.raw_mibs, 0)} MiB/s | `
    + t.all_reduce_fwd_bwd.map((r) => `${r.bytes === 4 ? '4 B' : '1 MiB'} ${r.device} ${r.algo}${r.room_algo ? '' : ' (baseline)'} ${f(r.ms, 2)} ms (${f(r.round_trips, 1)} rt, ${f(r.of_exchange, 2)} x 2 exch, ${f(r.of_cpu, 2)} x cpu${r.bytes === 4 ? `, ${f(r.of_exchange_algo, 2)} x the exchange algorithm` : ''})`).join('; '));
  return row;
}

function medians(rows) {
  const keys = Object.keys(rows[0]).filter((k) => k !== 'run');
  return Object.fromEntries(keys.map((k) => [k, median(rows.map((r) => r[k]).filter((x) => typeof x === 'number'))]));
}

async function main() {
  const relay = await startRelay(BIN, DIST);
  const browser = await chromium.launch({ executablePath: CHROMIUM, headless: true, args: chromeArgs });
  const rows = Object.fromEntries(ROOMS.map((p) => [p, []]));
  try {
    const ctx = await browser.newContext();
    const rooms = {};
    for (const p of ROOMS) rooms[p] = await openRoom(ctx, relay, p);
    for (let run = 0; run < RUNS; run++) {
      // Which room goes first alternates, so neither always runs on a machine the other warmed.
      const order = run % 2 ? [...ROOMS].reverse() : ROOMS;
      for (const p of order) rows[p].push(await benchOnce(rooms[p], run, roomLabel(p)));
    }
  } finally {
    await browser.close();
    relay.proc.kill();
  }
  const out = { net: NET, device: DEVICE, world: WORLD };
  for (const p of ROOMS) {
    const med = medians(rows[p]);
    console.log(`median of ${RUNS} runs (${NET}, ${roomLabel(p)}, device ${DEVICE}, ${WORLD} tabs):`);
    for (const [k, v] of Object.entries(med)) console.log(`  ${k}: ${f(v, 3)}`);
    out[roomLabel(p)] = { runs: rows[p], median: med };
  }
  if (ROOMS.length > 1) {
    // Each run's MessageChannel figures over the BroadcastChannel figures of the same run, and the
    // small all_reduce in BroadcastChannel round trips of that run.
    const [a, b] = [rows['1'], rows['0']];
    const num = (x) => typeof x === 'number' && Number.isFinite(x);
    const ratio = (k) => a.map((r, i) => (num(r[k]) && num(b[i][k]) ? r[k] / b[i][k] : NaN)).filter(Number.isFinite);
    const keys = Object.keys(a[0]).filter((k) => k.endsWith('_ms') || k === 'raw_mibs');
    console.log(`MessageChannel / BroadcastChannel, per run (median, range over ${RUNS} runs):`);
    out.ratio = {};
    for (const k of keys) {
      const v = ratio(k);
      if (!v.length) continue;
      out.ratio[k] = { median: median(v), min: Math.min(...v), max: Math.max(...v) };
      console.log(`  ${k}: ${f(median(v), 2)} (${f(Math.min(...v), 2)}-${f(Math.max(...v), 2)})`);
    }
    const inBc = a.map((r, i) => (num(r.small_cpu_ms) && num(b[i].round_trip_ms) ? r.small_cpu_ms / b[i].round_trip_ms : NaN)).filter(Number.isFinite);
    if (inBc.length) {
      out.small_cpu_in_bc_round_trips = median(inBc);
      console.log(`  4 B cpu all_reduce fwd+bwd over MessageChannels in BroadcastChannel round trips of the same run: ${f(median(inBc), 1)} (${f(Math.min(...inBc), 1)}-${f(Math.max(...inBc), 1)})`);
    }
  }
  if (args.json) writeFileSync(args.json, JSON.stringify(out, null, 1));
}

main().catch((e) => { console.error(`bench failed: ${e.stack ?? e}`); process.exit(1); });
