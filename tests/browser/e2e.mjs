// End-to-end test of the web app: browser tabs as ranks, checked against the native in-process run.
//
//   node tests/browser/e2e.mjs --bin <distgrad binary> --dist <built web app> --net relay|webrtc|channel|auto
//        [--device gpu|cpu|auto] [--ports 1|0]
//
// Starts `distgrad relay --static <dist>` on an ephemeral loopback port, opens 4 tabs of headless
// Chromium (WebGPU on SwiftShader), and checks:
//   1. every collective (every reduce op, roots != 0, subgroups) forward + backward in all tabs equals
//      `distgrad vjp <case> --json` (the native in-process run), and the dual the tabs ran is the same;
//   2. the page's Run button (request -> rank 0 -> every rank) runs on every tab;
//   3. a native `distgrad worker` and 3 tabs in one room (mixed group) give the native result, for a
//      vjp case and for a program (`worker --program` beside the page's `runProgramHere`), and the
//      program's gradient check across them (`--gradcheck` / `checkProgramHere`) is the native one
//      (with --net webrtc, channel or auto the tabs' pairs with the worker fall back to the relay and
//      say so; channel and auto, the page's default: the tabs, all in one browser, find each other
//      on BroadcastChannels and send on the MessageChannels the port hub hands them (--ports 0: on
//      the BroadcastChannels); auto: then the worker's pairs try WebRTC);
//   4. closing one tab mid-run makes every other tab show an error within 5 s;
//   5. a clean leave keeps the data already sent: a tab sends 16 MiB and leaves at once, and the
//      receiving tab gets every value (3 rounds, over the --net route).
// --device is the page's compute choice (default auto: the page's own, which takes the CPU over a
// software WebGPU adapter such as this SwiftShader and must say so; gpu: WebGPU on SwiftShader).
// Prints figures (not asserted): page load to ready, 4-tab all_reduce of 1 MiB forward + backward,
// the .wasm size. --net webrtc must run inside a loopback-only network namespace (scripts/test-all.sh
// uses `unshare -n`), so that ICE never tries another interface. Exits non-zero on any failure.

import { spawn, execFileSync } from 'node:child_process';
import { readdirSync, readFileSync, statSync, mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { randomBytes } from 'node:crypto';
import { chromium } from 'playwright-core';
import { parseArgs, sleep, startRelay, startStun, close, stateOf } from './common.mjs';

const args = parseArgs(process.argv.slice(2));
const BIN = args.bin;
const DIST = args.dist ?? 'dist';
const NET = args.net ?? 'relay';
const OUT = args.out ?? 'target/browser-test-output';
const CHROMIUM = process.env.CHROMIUM ?? '/usr/bin/chromium';
const WORLD = 4;
if (!BIN || !['relay', 'webrtc', 'channel', 'auto'].includes(NET)) {
  console.error('usage: e2e.mjs --bin <distgrad> --dist <dir> --net relay|webrtc|channel|auto [--device gpu|cpu|auto] [--ports 1|0]');
  process.exit(2);
}
mkdirSync(OUT, { recursive: true });

const failures = [];
const fail = (msg) => {
  failures.push(msg);
  console.log(`  FAIL ${msg}`);
};
const log = (msg) => console.log(`[e2e ${NET}, device ${DEVICE}] ${msg}`);
// The page's URL parameter for this run's data path (auto is the page's default), and the path
// expected between two tabs (auto: all tabs are in this one browser).
const DEVICE = args.device ?? 'auto';
if (!['gpu', 'cpu', 'auto'].includes(DEVICE)) {
  console.error('--device must be gpu, cpu or auto');
  process.exit(2);
}
// --ports 0: tabs of this browser keep their BroadcastChannel (the page's `ports=0`) instead of the
// MessageChannel the port hub hands them.
const PORTS = (args.ports ?? '1') !== '0';
const NET_PARAM = (NET === 'auto' ? '' : `&net=${NET}`) + (DEVICE === 'auto' ? '' : `&device=${DEVICE}`)
  + (PORTS ? '' : '&ports=0');
const TAB_LINK = NET === 'auto' || NET === 'channel' ? (PORTS ? 'port' : 'channel') : NET;
const withTimeout = (p, ms, what) =>
  Promise.race([p, sleep(ms).then(() => { throw new Error(`${what}: no answer within ${ms} ms`); })]);

// ---------- native reference ----------
function distgrad(argv, input) {
  return execFileSync(BIN, argv, { input, encoding: 'utf8', maxBuffer: 64 << 20 });
}

function suite() {
  const cases = [];
  const add = (name, extra) => cases.push({ name, argv: ['vjp', name, '--world', String(WORLD), ...extra] });
  add('broadcast', ['--root', '2']);
  for (const op of ['sum', 'avg', 'prod', 'min', 'max']) add('reduce', ['--root', '1', '--op', op]);
  add('gather', ['--root', '3']);
  add('scatter', ['--root', '1']);
  add('all_gather', []);
  add('reduce_scatter', ['--op', 'sum']);
  add('reduce_scatter', ['--op', 'max']);
  add('all_to_all', []);
  add('all_to_all_single', []);
  for (const op of ['sum', 'avg', 'prod', 'min', 'max']) add('all_reduce', ['--op', op]);
  add('permute', []);
  add('all_reduce', ['--op', 'max', '--group', '1,2,3']);
  add('reduce', ['--op', 'prod', '--root', '1', '--group', '0,2,3']);
  add('broadcast', ['--root', '1', '--group', '3,1']);
  return cases.map((c) => {
    const caseJson = distgrad([...c.argv, '--print-case']);
    const expected = JSON.parse(distgrad(['vjp', '-', '--json'], caseJson));
    return { label: c.argv.slice(1).filter((a) => a !== '--world' && a !== String(WORLD)).join(' '), caseJson, expected };
  });
}


function sameTensors(got, want) {
  if (got.length !== want.length) return `${got.length} tensors, expected ${want.length}`;
  for (let i = 0; i < got.length; i++) {
    if (JSON.stringify(got[i].shape) !== JSON.stringify(want[i].shape))
      return `tensor ${i}: shape ${JSON.stringify(got[i].shape)}, expected ${JSON.stringify(want[i].shape)}`;
    for (let j = 0; j < want[i].data.length; j++)
      if (!close(got[i].data[j], want[i].data[j]))
        return `tensor ${i}[${j}] = ${got[i].data[j]}, expected ${want[i].data[j]}`;
  }
  return null;
}

function checkRank(label, r, got, expected) {
  const o = sameTensors(got.outputs, expected.outputs[r]);
  if (o) return fail(`${label}: rank ${r} output: ${o}`);
  const g = sameTensors(got.grads, expected.grads[r]);
  if (g) return fail(`${label}: rank ${r} gradient: ${g}`);
  if (got.dual.length && got.dual.join(' + ') !== expected.dual)
    return fail(`${label}: rank ${r} ran backward "${got.dual.join(' + ')}", native ran "${expected.dual}"`);
  return true;
}

// ---------- relay and browser ----------

const chromeArgs = [
  '--no-sandbox', '--no-first-run', '--disable-background-networking', '--disable-component-update',
  '--disable-sync', '--enable-unsafe-webgpu', '--use-webgpu-adapter=swiftshader',
  '--allow-loopback-in-peer-connection', '--use-fake-ui-for-media-stream',
];

async function openTabs(ctx, url, n, errors) {
  const pages = [];
  for (let i = 0; i < n; i++) {
    const page = await ctx.newPage();
    await page.setViewportSize({ width: 1280, height: 800 });
    page.on('pageerror', (e) => errors.push(`tab ${i}: uncaught ${e.message}`));
    page.on('console', (m) => {
      if (m.type() === 'error') errors.push(`tab ${i}: console error: ${m.text()}`);
    });
    pages.push(page);
  }
  // Navigate all at once: the room fills only when every tab has joined.
  await Promise.all(pages.map((p) => p.goto(url)));
  return pages;
}


async function waitReady(pages, ms) {
  const t0 = Date.now();
  for (;;) {
    const states = await Promise.all(pages.map(stateOf));
    const failed = states.find((s) => s.phase === 'failed');
    if (failed) throw new Error(`a tab failed while joining: ${failed.error}`);
    if (states.every((s) => s.phase === 'ready')) return states;
    if (Date.now() - t0 > ms) throw new Error(`tabs not ready within ${ms} ms: ${states.map((s) => s.phase).join(', ')}`);
    await sleep(100);
  }
}

async function runEverywhere(pages, caseJson) {
  return Promise.all(pages.map((p) => p.evaluate((j) => window.distgrad.runCase(j), caseJson).then(JSON.parse)));
}

const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];

async function main() {
  log('native reference: distgrad vjp for every case');
  const cases = suite();
  // Over WebRTC the relay hands the tabs a STUN server (a loopback one started here) with the
  // welcome; the tabs' peer connections must really query it, and still link.
  const stun = NET === 'webrtc' ? await startStun() : null;
  const relay = await startRelay(BIN, DIST, stun ? ['--ice-server', `stun:127.0.0.1:${stun.port}`] : []);
  const base = `http://${relay.host}/`;
  log(`relay + web app at ${base}`);
  const browser = await chromium.launch({ executablePath: CHROMIUM, headless: true, args: chromeArgs });
  const figures = {};
  try {
    const ctx = await browser.newContext();
    await ctx.grantPermissions(['microphone']).catch(() => {});
    const errors = [];

    // ---- 1. four tabs, every collective ----
    const room = `e2e-${NET}-${process.pid}`;
    // Room tokens must be strong (128 bits: the relay refuses weaker ones it did not make).
    const url = `${base}?room=${room}&world=${WORLD}&token=${randomBytes(16).toString('hex')}${NET_PARAM}`;
    const tLoad = Date.now();
    const pages = await openTabs(ctx, url, WORLD, errors);
    const states = await waitReady(pages, 60000);
    figures.page_load_to_ready_ms = median(states.map((s) => s.ready_ms));
    log(`4 tabs ready in ${Date.now() - tLoad} ms (page load to ready, median over tabs: ${figures.page_load_to_ready_ms.toFixed(0)} ms); compute: ${states[0].device}`);
    const ranks = states.map((s) => s.rank).sort();
    if (JSON.stringify(ranks) !== JSON.stringify([0, 1, 2, 3])) fail(`ranks ${ranks}`);
    // The compute backend the page took, and why (this Chromium's only WebGPU adapter is SwiftShader).
    // The line speaks to a student; the adapter's own name is in its tooltip (state.adapter).
    const wantDevice = { gpu: /^WebGPU: software-only, on the CPU/, cpu: /^CPU \(you chose it: \?device=cpu\)/, auto: /^CPU: this browser's WebGPU is software-only/ }[DEVICE];
    for (const s of states) if (!wantDevice.test(s.device)) fail(`device=${DEVICE}: the page says "${s.device}", expected ${wantDevice}`);
    for (const s of states) if (DEVICE !== 'cpu' && !/Cpu/.test(s.adapter)) fail(`device=${DEVICE}: the adapter "${s.adapter}" should be SwiftShader's (Cpu)`);
    for (const s of states) {
      const others = s.links.filter((l, r) => r !== s.rank);
      const want = TAB_LINK;
      if (!others.every((l) => l === want)) fail(`rank ${s.rank} links ${JSON.stringify(s.links)}, expected all ${want} (${s.fallbacks.join('; ')})`);
    }
    // Tab order != rank order: index pages by rank.
    const byRank = [];
    states.forEach((s, i) => { byRank[s.rank] = pages[i]; });
    let checked = 0;
    for (const c of cases) {
      const got = await withTimeout(runEverywhere(byRank, c.caseJson), 30000, c.label);
      let ok = true;
      got.forEach((g, r) => { ok = checkRank(c.label, r, g, c.expected) === true && ok; });
      if (ok) checked++;
    }
    log(`${checked}/${cases.length} cases: every tab's outputs, gradients and dual equal the native run`);

    // ---- 2. the Run button on rank 2 runs all_reduce(max) on every tab ----
    const before = await Promise.all(byRank.map(stateOf));
    const tab = byRank[2];
    await tab.selectOption('#collective', 'all_reduce');
    await tab.selectOption('#op', 'max');
    await tab.click('#run');
    const want = cases.find((c) => c.label === 'all_reduce --op max');
    const t0 = Date.now();
    for (;;) {
      const now = await Promise.all(byRank.map(stateOf));
      if (now.every((s, r) => s.runs > before[r].runs)) {
        now.forEach((s, r) => checkRank('Run button all_reduce max', r, s.last, want.expected));
        const shown = await byRank[0].textContent('#result');
        if (!shown.includes(want.expected.dual)) fail(`rank 0's page does not name the backward collective "${want.expected.dual}": ${shown}`);
        log('Run button on rank 2: every tab ran all_reduce(max) and shows its result');
        break;
      }
      if (Date.now() - t0 > 20000) { fail('Run button: not every tab ran within 20 s'); break; }
      await sleep(100);
    }
    await byRank[0].screenshot({ path: join(OUT, `rank-page-${NET}.png`) });

    // ---- figures: 1 MiB all_reduce forward + backward ----
    const bench = async (numel) => {
      const r = await Promise.all(byRank.map((p) => p.evaluate((n) => window.distgrad.benchAllReduce(n), numel).then(JSON.parse)));
      // x[i] = i % 7 on every rank: sum(y) = WORLD * sum(i % 7); every gradient element = WORLD.
      let xs = 0;
      for (let i = 0; i < numel; i++) xs += i % 7;
      r.forEach((x, rank) => {
        if (x.y_sum !== WORLD * xs) fail(`all_reduce of ${numel} floats: rank ${rank} sum(y) = ${x.y_sum}, expected ${WORLD * xs}`);
        if (x.grad_sum !== WORLD * numel) fail(`all_reduce of ${numel} floats: rank ${rank} sum(grad) = ${x.grad_sum}, expected ${WORLD * numel}`);
      });
      return Math.max(...r.map((x) => x.ms));
    };
    // 8 MiB: ring chunks of 2 MiB, fragmented on every path (relay frames <= 1 MiB, data channel
    // messages <= 256 KiB); checked element by element through the checksums.
    const big = await bench(2 << 20);
    log(`4-tab all_reduce of 8 MiB forward + backward over ${NET}: ${big.toFixed(0)} ms, values checked`);
    const times = [];
    for (let i = 0; i < 5; i++) times.push(await bench(262144));
    figures[`all_reduce_1MiB_fwd_bwd_ms_${NET}`] = median(times);
    log(`4-tab all_reduce of 1 MiB forward + backward over ${NET}: median ${median(times).toFixed(1)} ms (slowest tab, 5 runs: ${times.map((t) => t.toFixed(0)).join(', ')})`);

    // ---- the room benchmark (rank 2 asks; every tab shows rank 0's table) ----
    {
      const before = await Promise.all(byRank.map(stateOf));
      await byRank[2].evaluate(() => window.distgrad.benchRoom());
      const t0 = Date.now();
      for (;;) {
        const st = await Promise.all(byRank.map(stateOf));
        if (st.some((s) => s.phase === 'failed')) { fail(`room benchmark: a tab failed: ${st.find((s) => s.phase === 'failed').error}`); break; }
        if (st.every((s, i) => s.bench_runs === before[i].bench_runs + 1)) break;
        if (Date.now() - t0 > 60000) { fail('room benchmark: not done on every tab within 60 s'); break; }
        await sleep(100);
      }
      const tables = await Promise.all(byRank.map((p) => p.evaluate(() => window.distgrad.benchResult()).then(JSON.parse)));
      const t = tables[0];
      if (tables.some((x) => JSON.stringify(x) !== JSON.stringify(t))) fail('room benchmark: the tabs show different tables');
      const pos = (x) => typeof x === 'number' && x > 0 && Number.isFinite(x);
      if (!t || t.round_trip_ms.length !== WORLD - 1 || !t.round_trip_ms.every((r) => pos(r.ms))) fail(`room benchmark: round trips ${JSON.stringify(t?.round_trip_ms)}`);
      // The relay serves the page cross-origin isolated, so its clock steps by 5 µs, not 100 µs.
      else if (t.cross_origin_isolated !== true || !(t.timer_step_ms > 0 && t.timer_step_ms <= 0.02)) fail(`room benchmark: cross-origin isolated ${t.cross_origin_isolated}, timer step ${t.timer_step_ms} ms`);
      else if (!pos(t.raw_mibs_0_to_1) || !pos(t.exchange_ms)) fail(`room benchmark: raw throughput ${t.raw_mibs_0_to_1}, exchange ${t.exchange_ms}`);
      // Per device: 4 B with the room's small algorithm (the star) and with the exchange beside it,
      // then 1 MiB (the ring).
      else if (t.all_reduce_fwd_bwd.length !== (t.device === 'gpu' ? 6 : 3) || !t.all_reduce_fwd_bwd.every((r) => pos(r.ms) && pos(r.busbw_mibs))) fail(`room benchmark: rows ${JSON.stringify(t.all_reduce_fwd_bwd)}`);
      else if (JSON.stringify(t.all_reduce_fwd_bwd.filter((r) => r.device === t.device).map((r) => [r.bytes, r.algo, r.room_algo])) !== JSON.stringify([[4, 'star', true], [4, 'exchange', false], [1048576, 'ring', true]])) fail(`room benchmark: the rows' sizes and algorithms ${JSON.stringify(t.all_reduce_fwd_bwd.map((r) => [r.bytes, r.device, r.algo, r.room_algo]))}`);
      else {
        // Each ratio is its figure over its own link's, measured in the same run. (`near` is false
        // for a missing ratio: NaN compares false.)
        const near = (got, want) => Math.abs(got - want) <= 1e-9 * Math.abs(want);
        for (const r of t.all_reduce_fwd_bwd) {
          if (!near(r.round_trips, r.ms / t.mean_round_trip_ms)) fail(`room benchmark: ${r.bytes} B: round trips ${r.round_trips} != ${r.ms} / ${t.mean_round_trip_ms}`);
          if (!near(r.of_exchange, r.ms / (2 * t.exchange_ms))) fail(`room benchmark: ${r.bytes} B: of_exchange ${r.of_exchange} != ${r.ms} / (2 * ${t.exchange_ms})`);
          if (!near(r.of_raw, r.busbw_mibs / t.raw_mibs_0_to_1)) fail(`room benchmark: ${r.bytes} B: of_raw ${r.of_raw} != ${r.busbw_mibs} / ${t.raw_mibs_0_to_1}`);
        }
        // On a WebGPU tab every size also runs with CPU tensors: of_cpu is the ratio of the two.
        for (const r of t.all_reduce_fwd_bwd) {
          const cpu = t.all_reduce_fwd_bwd.find((c) => c.bytes === r.bytes && c.algo === r.algo && c.device === 'cpu');
          if (!cpu || !near(r.of_cpu, r.ms / cpu.ms)) fail(`room benchmark: ${r.bytes} B ${r.algo} on ${r.device}: of_cpu ${r.of_cpu} != ${r.ms} / ${cpu?.ms}`);
          // A small row over the exchange measured beside it (same device); none for the large one.
          const ex = t.all_reduce_fwd_bwd.find((c) => c.bytes === 4 && c.algo === 'exchange' && c.device === r.device);
          if (r.bytes === 4 ? !ex || !near(r.of_exchange_algo, r.ms / ex.ms) : r.of_exchange_algo !== null) fail(`room benchmark: ${r.bytes} B ${r.algo} on ${r.device}: of_exchange_algo ${r.of_exchange_algo} (exchange ${ex?.ms} ms)`);
        }
        const [small, smallEx, large] = t.all_reduce_fwd_bwd.filter((r) => r.device === t.device);
        figures[`room_bench_${NET}`] = { round_trip_ms: t.mean_round_trip_ms, raw_mibs: t.raw_mibs_0_to_1, small_algo: small.algo, small_ms: small.ms, small_round_trips: small.round_trips, exchange_ms: t.exchange_ms, small_of_exchange: small.of_exchange, small_exchange_algo_ms: smallEx.ms, small_of_exchange_algo: small.of_exchange_algo, large_ms: large.ms, large_busbw_mibs: large.busbw_mibs, large_of_raw: large.of_raw, small_of_cpu: small.of_cpu, large_of_cpu: large.of_cpu };
        log(`room benchmark over ${NET} (median of ${t.reps} after ${t.warmup} / ${t.warmup_large} warm-up runs): round trip ${t.mean_round_trip_ms.toFixed(2)} ms, raw 0→1 ${t.raw_mibs_0_to_1.toFixed(0)} MiB/s; raw exchange (4 B every tab to every other) ${t.exchange_ms.toFixed(2)} ms; all_reduce fwd+bwd 4 B (${small.algo}) ${small.ms.toFixed(2)} ms = ${small.round_trips.toFixed(1)} round trips = ${small.of_exchange.toFixed(1)} x 2 raw exchanges = ${small.of_exchange_algo.toFixed(2)}x the exchange algorithm's ${smallEx.ms.toFixed(2)} ms beside it; 1 MiB ${large.ms.toFixed(1)} ms, bus ${large.busbw_mibs.toFixed(0)} MiB/s = ${large.of_raw.toFixed(2)} of the raw link; tensors on ${t.device}: ${small.of_cpu.toFixed(2)}x / ${large.of_cpu.toFixed(2)}x the CPU path's time`);
        // The 1 MiB row's "ms" cell, read from the page. The page rounds with Rust's `{:.2}`
        // (ties to even: 51.625 shows as 51.62), JavaScript's toFixed rounds ties up (51.63), so the
        // cell is compared as a number to within half its last digit, not as text.
        const shown = await byRank[1].evaluate(({ bytes, dev }) => {
          const row = [...document.querySelectorAll('#bench-result tbody tr')].find((tr) => tr.querySelector('th')?.textContent === `${bytes} B` && tr.querySelector('td')?.textContent === dev);
          return { head: document.querySelector('#bench-result')?.textContent ?? '', ms: row ? row.querySelectorAll('td')[2].textContent : null };
        }, { bytes: large.bytes, dev: large.device === 'gpu' ? 'WebGPU' : 'CPU' });
        if (!shown.head.includes('round trips') || shown.ms === null || !(Math.abs(Number(shown.ms) - large.ms) <= 0.005 + 1e-9)) fail(`room benchmark: the table does not show ${large.ms} ms for ${large.bytes} B (its cell: ${shown.ms}): ${shown.head.slice(0, 200)}`);
      }
    }

    // ---- 3. mixed group: a native worker and three tabs (a rooted collective, and the small
    // all_reduce, whose algorithm the worker and the tabs must agree on: the star) ----
    for (const [k, label] of ['reduce --root 1 --op max', 'all_reduce --op sum'].entries()) {
      const c = cases.find((x) => x.label === label);
      const caseFile = join(OUT, `mixed-case-${NET}-${k}.json`);
      writeFileSync(caseFile, c.caseJson);
      const mroom = `mixed-${k}-${NET}-${process.pid}`;
      const token = randomBytes(16).toString('hex');
      const worker = spawn(BIN, ['worker', '--relay', `ws://${relay.host}/ws`, '--room', mroom, '--world', String(WORLD), '--rank', '3',
        '--token', token, '--case', caseFile, '--json', '--timeout-secs', '60'], { stdio: ['ignore', 'pipe', 'inherit'] });
      let wout = '';
      worker.stdout.on('data', (d) => { wout += d; });
      const wdone = new Promise((r) => worker.on('exit', r));
      const mpages = await openTabs(ctx, `${base}?room=${mroom}&world=${WORLD}&token=${token}${NET_PARAM}`, 3, errors);
      const ms = await waitReady(mpages, 60000);
      if (NET !== 'relay') {
        for (const s of ms) {
          const tabs = s.links.filter((l, r) => r !== s.rank && r !== 3);
          if (!tabs.every((l) => l === TAB_LINK)) fail(`mixed: rank ${s.rank} should reach the other tabs over ${TAB_LINK}: ${JSON.stringify(s.links)}`);
          if (s.links[3] !== 'relay' || !s.fallbacks.some((f) => f.startsWith('rank 3'))) fail(`mixed: rank ${s.rank} should say it fell back to the relay for the native rank 3: ${JSON.stringify(s)}`);
        }
        const text = await mpages[0].textContent('#links');
        if (!text.includes('Fell back to the relay')) fail(`mixed: the page does not say which pairs fell back: ${text}`);
      }
      const got = await withTimeout(Promise.all(mpages.map((p) => p.evaluate((j) => window.distgrad.runCase(j), c.caseJson).then(JSON.parse))), 60000, 'mixed group');
      got.forEach((g, i) => checkRank(`mixed group ${label}`, ms[i].rank, g, c.expected));
      const code = await withTimeout(wdone, 30000, 'native worker exit');
      if (code !== 0) fail(`mixed: native worker exited ${code}`);
      else checkRank(`mixed group ${label} (native worker)`, 3, JSON.parse(wout.trim().split('\n').pop()), c.expected);
      log(`mixed group (native worker = rank 3, three tabs), ${label}: every rank equals the native in-process run`);
      await Promise.all(mpages.map((p) => p.close()));
    }

    // ---- 3b. mixed group, one program: `distgrad worker --program` as rank 3 and three tabs run the
    // shipped ring program (a "for" block of sends and recvs) and then check its gradients, against
    // `distgrad run` / `distgrad gradcheck` on in-process ranks ----
    for (const check of [false, true]) {
      const what = check ? 'gradcheck' : 'run';
      const file = 'www/programs/ring.json';
      const text = readFileSync(file, 'utf8');
      const want = JSON.parse(execFileSync(BIN, check
        ? ['gradcheck', file, '--world', String(WORLD), '--json']
        : ['run', file, '--world', String(WORLD), '--json'], { encoding: 'utf8' }));
      const mroom = `mixed-program-${what}-${NET}-${process.pid}`;
      const token = randomBytes(16).toString('hex');
      const wargs = ['worker', '--relay', `ws://${relay.host}/ws`, '--room', mroom, '--world', String(WORLD), '--rank', '3',
        '--token', token, '--program', file, '--timeout-secs', '60'];
      if (check) wargs.push('--gradcheck', '--report-json');
      const worker = spawn(BIN, wargs, { stdio: ['ignore', 'pipe', 'inherit'] });
      let wout = '';
      worker.stdout.on('data', (d) => { wout += d; });
      const wdone = new Promise((r) => worker.on('exit', r));
      const mpages = await openTabs(ctx, `${base}?room=${mroom}&world=${WORLD}&token=${token}${NET_PARAM}`, 3, errors);
      const ms = await waitReady(mpages, 60000);
      const fn = check ? 'checkProgramHere' : 'runProgramHere';
      const got = await withTimeout(Promise.all(mpages.map((p) => p.evaluate(([f, j]) => window.distgrad[f](j), [fn, text]).then(JSON.parse))), 120000, `mixed ${what}`);
      const code = await withTimeout(wdone, 30000, 'native worker exit');
      if (code !== 0) { fail(`mixed ${what}: native worker exited ${code}`); continue; }
      const native = JSON.parse(wout.trim().split('\n').pop());
      const near = (a, b) => a === b || (a !== null && b !== null && Math.abs(a - b) <= 1e-4 * Math.max(1, Math.abs(a), Math.abs(b)));
      const byRank = [];
      ms.forEach((st, i) => { byRank[st.rank] = got[i]; });
      byRank[3] = native;
      for (const [r, g] of byRank.entries()) {
        const who = r === 3 ? 'rank 3 (native worker)' : `rank ${r} (tab)`;
        if (!check) {
          const w = want[r];
          const same = near(g.loss, w.loss) && g.grads.length === w.grads.length
            && g.grads.every((x, i) => x.length === w.grads[i].length && x.every((v, k) => near(v, w.grads[i][k])));
          if (!same) fail(`mixed run: ${who}: ${JSON.stringify(g)}, in-process ${JSON.stringify(w)}`);
        } else {
          // Every rank of the check holds the same report; its verdict and rows are the in-process check's.
          const rows = (x) => JSON.stringify(x.rows.map((q) => [q.rank, q.input, q.checked, q.failed, q.kinks]));
          if (g.verdict !== want.verdict || g.evaluations !== want.evaluations || rows(g) !== rows(want) || !near(g.value, want.value))
            fail(`mixed gradcheck: ${who}: ${g.verdict}, ${g.evaluations} runs, F = ${g.value}, rows ${rows(g)}; in-process ${want.verdict}, ${want.evaluations} runs, F = ${want.value}, rows ${rows(want)}`);
        }
      }
      log(`mixed group, one program (native worker = rank 3, three tabs): ring.json ${check ? `gradcheck ${want.verdict} (${want.evaluations} runs of all ranks), the same report on every rank` : 'losses and gradients'} = the in-process ${what}`);
      await Promise.all(mpages.map((p) => p.close()));
    }

    // ---- 4. closing a tab mid-run: the others show an error within 5 s ----
    {
      const runs = byRank.slice(0, 3).map((p) => p.evaluate(() => window.distgrad.benchAllReduce(4 << 20)).catch((e) => String(e)));
      await sleep(300);
      const tClose = Date.now();
      await byRank[3].close();
      const seen = new Array(3).fill(null);
      while (seen.some((x) => x === null) && Date.now() - tClose < 10000) {
        const st = await Promise.all(byRank.slice(0, 3).map(stateOf));
        st.forEach((s, i) => { if (s.error && seen[i] === null) seen[i] = { ms: Date.now() - tClose, error: s.error }; });
        await sleep(50);
      }
      await Promise.race([Promise.all(runs), sleep(5000)]);
      seen.forEach((s, r) => {
        if (!s) fail(`rank ${r}: no error shown within 10 s of closing rank 3's tab`);
        else if (s.ms > 5000) fail(`rank ${r}: error shown after ${s.ms} ms (> 5 s)`);
      });
      const shown = await byRank[0].textContent('#error');
      if (!/rank 3/.test(shown)) fail(`the error does not name the lost rank: ${shown}`);
      const worst = Math.max(...seen.filter(Boolean).map((s) => s.ms));
      log(`closed rank 3's tab mid-run: ranks 0-2 showed an error within ${worst} ms: "${seen[0]?.error}"`);
      figures.error_after_close_ms = worst;
      await byRank[0].screenshot({ path: join(OUT, `tab-closed-${NET}.png`) });
    }
    // ---- 5. a clean leave keeps the data already sent: rank 0 sends 16 MiB to rank 1 and leaves at
    // once (its goodbye follows the data on the link); rank 1 must receive every value ----
    {
      const ROUNDS = 3;
      const NUMEL = 4 << 20;
      const times = [];
      for (let round = 0; round < ROUNDS; round++) {
        const lroom = `leave-${NET}-${process.pid}-${round}`;
        const ltoken = randomBytes(16).toString('hex');
        const lpages = await openTabs(ctx, `${base}?room=${lroom}&world=2&token=${ltoken}${NET_PARAM}`, 2, errors);
        const ls = await waitReady(lpages, 60000);
        const [p0, p1] = ls[0].rank === 0 ? lpages : [lpages[1], lpages[0]];
        const recv = p1.evaluate(([n]) => window.distgrad.recvFrom(0, n), [NUMEL]).then(JSON.parse, (e) => ({ error: String(e) }));
        const sent = await p0.evaluate(([n]) => window.distgrad.sendAndLeave(1, n), [NUMEL]).catch((e) => `error: ${e}`);
        if (!sent.startsWith('sent')) fail(`leave round ${round}: the sender failed: ${sent}`);
        const got = await withTimeout(recv, 60000, `leave round ${round}: the receive`);
        if (got.error) fail(`leave round ${round} over ${NET}: the receiver lost data already sent: ${got.error}`);
        else if (got.received !== NUMEL || got.mismatches !== 0) fail(`leave round ${round}: received ${got.received} values, ${got.mismatches} wrong`);
        else times.push(got.ms);
        await Promise.all(lpages.map((p) => p.close()));
      }
      log(`clean leave over ${NET}: ${times.length}/${ROUNDS} rounds of 16 MiB sent then left at once, every value received (${times.map((t) => t.toFixed(0)).join(', ')} ms)`);
    }
    // ---- 6. mismatched calls: one tab runs another call than the others. Every tab must fail with
    // the mismatch (its own, or the abort of the rank that saw it), never wait for its timeout.
    // The small all_reduce is the star through rank 0, whose calls are checked at its ends: the odd
    // tab is rank 2 (neither the root nor next to it) with another op, then rank 0 (the root)
    // with another collective ----
    {
      const sum = cases.find((x) => x.label === 'all_reduce --op sum').caseJson;
      const variants = [
        { odd: 2, label: 'all_reduce --op max', call: 'all_reduce(op=max' },
        { odd: 0, label: 'broadcast --root 2', call: 'broadcast(root=2' },
      ];
      for (const v of variants) {
        const odd = cases.find((x) => x.label === v.label).caseJson;
        const xroom = `mismatch-${v.odd}-${NET}-${process.pid}`;
        const xtoken = randomBytes(16).toString('hex');
        const xpages = await openTabs(ctx, `${base}?room=${xroom}&world=${WORLD}&token=${xtoken}${NET_PARAM}`, WORLD, errors);
        const xs = await waitReady(xpages, 60000);
        const t0 = Date.now();
        const res = await withTimeout(Promise.all(xpages.map((p, i) => p.evaluate((j) => window.distgrad.runCase(j), xs[i].rank === v.odd ? odd : sum)
          .then((out) => ({ rank: xs[i].rank, out, ms: Date.now() - t0 }), (e) => ({ rank: xs[i].rank, error: String(e), ms: Date.now() - t0 })))), 30000, `mismatch (odd rank ${v.odd})`);
        let named = 0;
        for (const r of res) {
          if (!r.error) fail(`mismatch, odd rank ${v.odd}: rank ${r.rank} succeeded: ${r.out}`);
          else if (/timed out|timeout/i.test(r.error) || !/collective mismatch|aborted by rank \d+: .*mismatch/.test(r.error)) fail(`mismatch, odd rank ${v.odd}: rank ${r.rank} failed with something else than the mismatch: ${r.error}`);
          else if (r.error.includes('collective mismatch') && r.error.includes(v.call) && r.error.includes('all_reduce(op=sum')) named++;
        }
        if (!named) fail(`mismatch, odd rank ${v.odd}: no tab's error names both calls (${v.call}…, all_reduce(op=sum…): ${res.map((r) => r.error).join(' | ')}`);
        log(`mismatched calls (rank ${v.odd}: ${v.label}, the others all_reduce --op sum, the star): every tab failed with the mismatch within ${Math.max(...res.map((r) => r.ms))} ms, ${named} naming both calls`);
        await Promise.all(xpages.map((p) => p.close()));
      }
    }
    if (stun) {
      const n = stun.requests();
      if (n === 0) fail('the relay\'s STUN server (--ice-server) got no Binding request from the tabs');
      else log(`ICE servers: the tabs' peer connections sent ${n} Binding requests to the relay's STUN server (--ice-server stun:127.0.0.1:${stun.port}), answered, and linked over WebRTC`);
    }
    const unexpected = errors.filter((e) => !/left the room|failed|disconnected|lost|closed|Aborted|abort|mismatch/i.test(e));
    if (unexpected.length) fail(`console errors: ${unexpected.join(' | ')}`);
  } finally {
    await browser.close();
    relay.proc.kill('SIGINT');
    stun?.close();
  }
  const wasm = readdirSync(DIST).find((f) => f.endsWith('.wasm'));
  if (wasm) figures.wasm_bytes = statSync(join(DIST, wasm)).size;
  log(`figures: ${JSON.stringify(figures)}`);
  log(`release .wasm: ${(figures.wasm_bytes / 1048576).toFixed(2)} MiB (budget < 2 MB before gzip: tests/browser/startup.mjs checks it)`);
  if (failures.length) {
    console.log(`[e2e ${NET}] ${failures.length} failure(s)`);
    process.exit(1);
  }
  log('all checks passed');
}

main().catch((e) => {
  console.error(`[e2e ${NET}] error: ${e.stack ?? e}`);
  process.exit(1);
});
