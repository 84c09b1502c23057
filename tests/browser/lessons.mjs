// End-to-end test of the teaching demo: every lesson in 3 tabs (and in single-tab mode) against
// `distgrad run`'s trace.
//
//   node tests/browser/lessons.mjs --bin <distgrad binary> --dist <built web app> [--out <dir>]
//
// For every lesson in www/lessons/index.json: rank 1's tab starts it (the request goes through rank 0
// to every tab); every tab must then hold the same trace, equal (numbers within 1e-5 relative; the
// replica hashes only across tabs, since WebGPU's float rounding may differ from the CPU's in the last
// bit) to `distgrad run <lesson> --world 3 --json`; the values of the step shown must be in the page's
// table; Step / Back / Play / Reset pressed on one tab must move every tab to the same step. A
// 1280x800 screenshot per lesson (and a phone-width one of one lesson) goes to <out>/lessons/.
// The room mixes backends: the tab that made it takes the page's automatic choice (the CPU, since
// this Chromium's only WebGPU adapter is the software SwiftShader, and it must say so), the two that
// follow the share link add &device=gpu (WebGPU). The same lessons run in single-tab mode
// (?sim=3&device=gpu), and some in a browser without WebGPU (CPU fallback, labelled). Fails on any console error or uncaught exception.

import { execFileSync } from 'node:child_process';
import { readFileSync, mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { chromium } from 'playwright-core';
import { parseArgs, sleep, startRelay, close, stateOf, waitFor as waitForAll, watch } from './common.mjs';

const args = parseArgs(process.argv.slice(2));
const BIN = args.bin;
const DIST = args.dist ?? 'dist';
const OUT = join(args.out ?? 'target/browser-test-output', 'lessons');
const LESSONS = args.lessons ?? 'www/lessons';
const CHROMIUM = process.env.CHROMIUM ?? '/usr/bin/chromium';
const WORLD = 3;
if (!BIN) {
  console.error('usage: lessons.mjs --bin <distgrad> --dist <dir> [--out <dir>]');
  process.exit(2);
}
mkdirSync(OUT, { recursive: true });
const failures = [];
const fail = (msg) => { failures.push(msg); console.log(`  FAIL ${msg}`); };
const log = (msg) => console.log(`[lessons] ${msg}`);


/** A step's recorded calls without their times and call numbers (a room's tabs count the calls
 * of every lesson they ran before). */
const untimedCalls = (st) => JSON.stringify((st.calls ?? []).map((c) => ({
  ...c,
  ranks: c.ranks.map(({ total_us: _t, call: _c, ...r }) => ({ ...r, events: r.events.map(({ t_us: _u, ...e }) => e) })),
})));

/** Where two lists of every rank's values differ (`where`: what they are), or null. */
function diffValues(got, want, where, hashes) {
  for (const [r, wvals] of want.entries()) {
    const gvals = got[r];
    if (!gvals || gvals.length !== wvals.length) return `${where} rank ${r}: ${gvals?.length} values, expected ${wvals.length}`;
    for (const [i, wv] of wvals.entries()) {
      const gv = gvals[i];
      if (gv.name !== wv.name) return `${where} rank ${r}: value ${gv.name}, expected ${wv.name}`;
      if (wv.text !== undefined) {
        if (hashes && gv.text !== wv.text) return `${where} rank ${r} ${wv.name}: ${gv.text}, expected ${wv.text}`;
        continue;
      }
      for (const [j, wt] of wv.tensors.entries()) {
        const gt = gv.tensors[j];
        if (!gt || JSON.stringify(gt.shape) !== JSON.stringify(wt.shape)) return `${where} rank ${r} ${wv.name}: shape differs`;
        for (const [e, x] of wt.data.entries())
          if (!close(gt.data[e], x)) return `${where} rank ${r} ${wv.name}[${e}] = ${gt.data[e]}, expected ${x}`;
      }
    }
  }
  return null;
}

// Compare two traces; hashes (text values) are compared only when `hashes` is true.
function diffTrace(got, want, hashes) {
  if (got.steps.length !== want.steps.length) return `${got.steps.length} steps, expected ${want.steps.length}`;
  for (const [k, ws] of want.steps.entries()) {
    const gs = got.steps[k];
    if (gs.label !== ws.label) return `step ${k}: label "${gs.label}", expected "${ws.label}"`;
    if ((gs.collective ?? null) !== (ws.collective ?? null)) return `step ${k}: collective ${gs.collective}, expected ${ws.collective}`;
    if (JSON.stringify(gs.arrows) !== JSON.stringify(ws.arrows)) return `step ${k}: arrows differ`;
    // The algorithm view's events (times aside), where the native run recorded them with the
    // same algorithm: lessons that name theirs (a room's own choice for small all_reduces, the
    // star, is not the CLI's exchange).
    if (want.algorithm_named && untimedCalls(gs) !== untimedCalls(ws)) return `step ${k}: the recorded events differ`;
    const d = diffValues(gs.ranks, ws.ranks, `step ${k}`, hashes);
    if (d) return d;
  }
  // One device's gradients beside the ranks' (src/lesson/one_device.rs): the same values, and the
  // same verdict on each gradient compared (a tab on the GPU may differ from the CLI by rounding).
  const [go, wo] = [got.one_device ?? null, want.one_device ?? null];
  if ((go === null) !== (wo === null)) return `one device: ${go ? 'shown' : 'missing'}, expected ${wo ? 'shown' : 'none'}`;
  if (wo) {
    const agrees = (label) => label.split('; ').map((p) => /equals it exactly$|\(float rounding\)$/.test(p));
    if (hashes ? go.label !== wo.label : JSON.stringify(agrees(go.label)) !== JSON.stringify(agrees(wo.label))) return `one device: "${go.label}", expected "${wo.label}"`;
    const d = diffValues(go.ranks, wo.ranks, 'one device', hashes);
    if (d) return d;
  }
  return null;
}


const waitFor = (pages, pred, ms, what) => waitForAll(pages, pred, ms, what, (s) => [s.phase, s.lesson, s.lesson_step, s.lesson_runs]);

const traceOf = async (page) => JSON.parse(await page.evaluate(() => window.distgrad.lessonTrace()));


// The values of step k for rank r as the page formats them must appear in the page's table.
async function checkShown(page, trace, k, label) {
  const text = await page.textContent('#lesson-table');
  const fmt = (t) => {
    // As the tables print a value (src/vjp/table.rs): exponent form where |x| >= 1e7 or < 1e-4.
    const num = (x) => {
      if (x === null) return 'nan';
      const a = Math.abs(x);
      return a !== 0 && Number.isFinite(a) && (a < 1e-4 || a >= 1e7) ? x.toExponential() : String(x);
    };
    const v = t.data.map(num);
    if (t.shape.length === 0 && v.length === 1) return v[0];
    if (t.shape.length === 1) return `[${v.join(', ')}]`;
    return `[${t.shape.join(', ')}]:[${v.join(', ')}]`;
  };
  for (const vals of trace.steps[k].ranks) {
    for (const n of vals) {
      const shown = n.text ?? (n.tensors.length ? n.tensors.map(fmt).join(' ') : '-');
      if (!text.includes(shown)) return fail(`${label}: step ${k}: "${n.name} = ${shown}" not shown in the table`);
    }
  }
  const step = await page.textContent('#lesson-step');
  if (!step.includes(trace.steps[k].label)) fail(`${label}: step label "${trace.steps[k].label}" not shown: ${step}`);
}

async function main() {
  const index = JSON.parse(readFileSync(join(LESSONS, 'index.json'), 'utf8')).lessons;
  log(`native traces: distgrad run <lesson> --world ${WORLD} --json, for ${index.length} lessons`);
  const expected = Object.fromEntries(index.map((l) => [l.name, JSON.parse(execFileSync(BIN, ['run', join(LESSONS, `${l.name}.json`), '--world', String(WORLD), '--json'], { encoding: 'utf8' }))]));
  // Lessons that name their algorithm: their events must be the same in the tabs.
  for (const l of index) expected[l.name].algorithm_named = !!JSON.parse(readFileSync(join(LESSONS, `${l.name}.json`), 'utf8')).algorithm;
  const relay = await startRelay(BIN, DIST);
  const base = `http://${relay.host}/`;
  const browser = await chromium.launch({
    executablePath: CHROMIUM,
    headless: true,
    args: ['--no-sandbox', '--no-first-run', '--disable-background-networking', '--disable-component-update', '--disable-sync', '--enable-unsafe-webgpu', '--use-webgpu-adapter=swiftshader'],
  });
  const errors = [];
  try {
    const ctx = await browser.newContext({ viewport: { width: 1280, height: 800 } });
    // The lobby: the first tab creates a room of 3 ranks; the others open its share link.
    const pages = [];
    for (let i = 0; i < WORLD; i++) {
      const p = await ctx.newPage();
      watch(p, `tab ${i}`, errors);
      pages.push(p);
    }
    // The lobby's data-path choice: the default (auto) needs no parameter; BroadcastChannel goes
    // into the room's URL.
    await pages[0].goto(base);
    await waitFor([pages[0]], (s) => s.phase === 'lobby', 30000, 'lobby');
    if (await pages[0].inputValue('#new-net') !== 'auto') fail('the lobby does not default to the automatic choice');
    await pages[0].click('#create-form button[type=submit]');
    await pages[0].waitForURL(/room=/);
    if (pages[0].url().includes('net=')) fail(`the lobby's default choice put a net parameter in ${pages[0].url()}`);
    await pages[0].goto(base);
    await waitFor([pages[0]], (s) => s.phase === 'lobby', 30000, 'lobby');
    await pages[0].selectOption('#new-net', 'channel');
    await pages[0].click('#create-form button[type=submit]');
    await pages[0].waitForURL(/room=/);
    if (!pages[0].url().includes('net=channel')) fail(`the lobby's BroadcastChannel choice is not in ${pages[0].url()}`);
    // The lessons run over the relay: the lobby keeps the URL's choice.
    await pages[0].goto(`${base}?net=relay`);
    await waitFor([pages[0]], (s) => s.phase === 'lobby', 30000, 'lobby');
    if (await pages[0].inputValue('#new-net') !== 'relay') fail('the lobby does not show the net=relay of its URL');
    await pages[0].fill('#new-world', String(WORLD));
    await pages[0].click('#create-form button[type=submit]');
    await pages[0].waitForURL(/room=/);
    const share = (await waitFor([pages[0]], (s) => !!s.share, 30000, 'share link'))[0].share;
    if (!share.includes(`world=${WORLD}`) || !share.includes('token=') || !share.includes('net=relay')) fail(`share link ${share}`);
    await Promise.all(pages.slice(1).map((p) => p.goto(`${share}&device=gpu`)));
    const states = await waitFor(pages, (s) => s.phase === 'ready', 60000, 'joining');
    if (!/^CPU: this browser's WebGPU is software-only/.test(states[0].device)) fail(`the room's first tab should take the CPU over SwiftShader and say why: "${states[0].device}"`);
    for (const s of states.slice(1)) if (!/^WebGPU: /.test(s.device)) fail(`a tab joined with device=gpu says "${s.device}"`);
    const byRank = [];
    states.forEach((s, i) => { byRank[s.rank] = pages[i]; });
    log(`3 tabs ready (compute: ${states.map((s) => s.device).join(' | ')})`);
    let runs = 0;
    for (const { name } of index) {
      // Rank 1 starts the lesson with the page's own controls.
      await byRank[1].selectOption('#lesson', name);
      await byRank[1].click('#lesson-start');
      runs++;
      await waitFor(byRank, (s) => s.lesson === name && s.lesson_runs === runs, 60000, `lesson ${name}`);
      const traces = await Promise.all(byRank.map(traceOf));
      for (const [r, t] of traces.entries()) {
        const d = diffTrace(t, expected[name], false);
        if (d) fail(`lesson ${name}, tab of rank ${r} vs distgrad run: ${d}`);
        if (r > 0) {
          const same = diffTrace(t, traces[0], true);
          if (same) fail(`lesson ${name}: tabs of rank 0 and ${r} show different traces: ${same}`);
        }
      }
      await checkShown(byRank[2], traces[2], 0, `lesson ${name}`);
      // Step twice on rank 2, back once on rank 0: every tab follows.
      const last = traces[0].steps.length - 1;
      await byRank[2].click('#step');
      if (last >= 2) {
        await waitFor(byRank, (s) => s.lesson_step === 1, 10000, `${name}: step`);
        await byRank[2].click('#step');
        await waitFor(byRank, (s) => s.lesson_step === 2, 10000, `${name}: step`);
        await byRank[0].click('#back');
      }
      await waitFor(byRank, (s) => s.lesson_step === 1, 10000, `${name}: back`);
      // The algorithm view's rounds: Round ▶ on rank 2 moves every tab's view.
      if (expected[name].algorithm_named) {
        await byRank[2].click('#algo-next');
        const want = `round 1 of ${2 * (WORLD - 1)}`;
        const t0 = Date.now();
        for (;;) {
          const caps = await Promise.all(byRank.map((p) => p.textContent('#algo-caption')));
          if (caps.every((c) => c.includes(want))) break;
          if (Date.now() - t0 > 10000) { fail(`${name}: Round ▶ on rank 2: captions ${JSON.stringify(caps)}`); break; }
          await sleep(100);
        }
      }
      await checkShown(byRank[1], traces[1], 1, `lesson ${name}`);
      // Keyboard: → on rank 1 steps every tab.
      await byRank[1].focus('#step');
      await byRank[1].keyboard.press('ArrowRight');
      const want = Math.min(2, last);
      await waitFor(byRank, (s) => s.lesson_step === want, 10000, `${name}: arrow key`);
      // Play to the end (from rank 1), then the final step is shown everywhere.
      await byRank[1].click('#play');
      await waitFor(byRank, (s) => s.lesson_step === last && !s.playing, 5000 + 1500 * (last + 1), `${name}: play`);
      await checkShown(byRank[0], traces[0], last, `lesson ${name}`);
      await byRank[0].screenshot({ path: join(OUT, `${name}.png`) });
      if (name === 'all_gather') {
        const shown = await byRank[0].textContent('#lesson-note');
        if (!shown.includes('reduce_scatter')) fail(`all_gather's last step does not name reduce_scatter: ${shown}`);
        await byRank[0].setViewportSize({ width: 390, height: 844 });
        await byRank[0].screenshot({ path: join(OUT, `${name}-phone.png`), fullPage: true });
        const wide = await byRank[0].evaluate(() => document.documentElement.scrollWidth);
        if (wide > 400) fail(`phone width: the page is ${wide}px wide at a 390px viewport`);
        await byRank[0].setViewportSize({ width: 1280, height: 800 });
      }
      await byRank[0].click('#reset');
      await waitFor(byRank, (s) => s.lesson_step === 0, 10000, `${name}: reset`);
      log(`lesson ${name}: ${traces[0].steps.length} steps, 3 tabs == distgrad run, controls in sync`);
    }
    // Editing an input: rank 2 changes its x in the all_reduce(MAX) lesson; every tab reruns.
    {
      await byRank[2].selectOption('#lesson', 'all_reduce_max');
      await byRank[2].click('#lesson-start');
      runs++;
      await waitFor(byRank, (s) => s.lesson === 'all_reduce_max' && s.lesson_runs === runs, 30000, 'edit: start');
      await byRank[2].fill('#edit-x', '10, -5');
      await byRank[2].click('#edit-form button[type=submit]');
      runs++;
      await waitFor(byRank, (s) => s.lesson_runs === runs, 30000, 'edit: rerun');
      const t = await traceOf(byRank[0]);
      const y = t.steps[1].ranks[0][0].tensors[0].data;
      // inputs: rank0 [1, 6], rank1 [2, 4], rank2 now [10, -5]: max = [10, 6]
      if (JSON.stringify(y) !== JSON.stringify([10, 6])) fail(`edited input: all_reduce(max) output ${JSON.stringify(y)}, expected [10,6]`);
      const g = t.steps[3].ranks.map((v) => v[0].tensors[0].data);
      // cotangents [1, r+1] summed over ranks = [3, 6]: element 0 to rank 2, element 1 to rank 0
      if (JSON.stringify(g) !== JSON.stringify([[0, 6], [0, 0], [3, 0]])) fail(`edited input: gradients ${JSON.stringify(g)}, expected [[0,6],[0,0],[3,0]]`);
      log('edited input on rank 2: every tab reran all_reduce(max) with it (hand-checked values)');
    }
    await Promise.all(pages.map((p) => p.close()));

    // ---- single-tab mode ----
    const sim = await ctx.newPage();
    watch(sim, 'single tab', errors);
    await sim.goto(`${base}?sim=${WORLD}&device=gpu`);
    await waitFor([sim], (s) => s.phase === 'ready', 30000, 'single-tab mode');
    // Single-tab mode opens the first lesson by itself.
    await waitFor([sim], (s) => s.lesson === index[0].name && s.lesson_runs === 1, 30000, 'single-tab: the first lesson opens');
    let simRuns = 1;
    for (const [i, { name }] of index.entries()) {
      if (i > 0) {
        await sim.selectOption('#lesson', name);
        await sim.click('#lesson-start');
        simRuns++;
      }
      await waitFor([sim], (s) => s.lesson === name && s.lesson_runs === simRuns, 30000, `single-tab ${name}`);
      const t = await traceOf(sim);
      const d = diffTrace(t, expected[name], false);
      if (d) fail(`single-tab lesson ${name} vs distgrad run: ${d}`);
      await checkShown(sim, t, 0, `single-tab ${name}`);
    }
    await sim.screenshot({ path: join(OUT, 'single-tab.png') });
    log(`single-tab mode (?sim=${WORLD}&device=gpu): all ${index.length} lessons == distgrad run`);

    // A link to a lesson step (what a teacher shares): that lesson opens at that step.
    await sim.goto(`${base}?sim=${WORLD}&lesson=all_reduce_max&step=2`);
    const [linked] = await waitFor([sim], (s) => s.lesson === 'all_reduce_max' && s.lesson_runs === 1 && s.lesson_step === 2, 30000, 'linked lesson step');
    const stepText = await sim.textContent('#lesson-step');
    if (!/^Step 2 of /.test(stepText)) fail(`a link to step 2 shows "${stepText}"`);
    await checkShown(sim, await traceOf(sim), 2, 'linked lesson step');
    log(`?lesson=all_reduce_max&step=2 opens it at step 2 ("${stepText.slice(0, 40)}"), first lesson on screen ${linked.first_lesson_ms.toFixed(0)} ms after navigation`);

    // ---- no WebGPU: a browser without an adapter runs on the labelled CPU fallback ----
    const plain = await chromium.launch({
      executablePath: CHROMIUM,
      headless: true,
      args: ['--no-sandbox', '--no-first-run', '--disable-background-networking', '--disable-component-update', '--disable-sync'],
    });
    try {
      const p = await plain.newPage({ viewport: { width: 1280, height: 800 } });
      watch(p, 'no-WebGPU tab', errors);
      await p.goto(`${base}?sim=${WORLD}`);
      const [s] = await waitFor([p], (x) => x.phase === 'ready' && x.lesson_runs === 1, 30000, 'no-WebGPU page (its first lesson open)');
      const shown = await p.textContent('#device');
      if (!/CPU fallback/.test(s.device) || !/CPU fallback/.test(shown)) fail(`without WebGPU the page should say "CPU fallback": ${shown}`);
      let n = 1;
      for (const name of ['all_reduce_max', 'data_parallel', 'tensor_parallel']) {
        await p.selectOption('#lesson', name);
        await p.click('#lesson-start');
        n++;
        await waitFor([p], (x) => x.lesson === name && x.lesson_runs === n, 30000, `no-WebGPU ${name}`);
        // On the CPU backend the page computes exactly what `distgrad run` does: hashes included.
        const d = diffTrace(await traceOf(p), expected[name], true);
        if (d) fail(`no-WebGPU lesson ${name} vs distgrad run: ${d}`);
      }
      await p.screenshot({ path: join(OUT, 'cpu-fallback.png') });
      log(`without WebGPU: "${shown}", lessons bit-identical to distgrad run`);
    } finally {
      await plain.close();
    }
  } finally {
    await browser.close();
    relay.proc.kill('SIGINT');
  }
  if (errors.length) fail(`console errors / exceptions: ${errors.join(' | ')}`);
  log(`screenshots in ${OUT}`);
  if (failures.length) {
    console.log(`[lessons] ${failures.length} failure(s)`);
    process.exit(1);
  }
  log('all checks passed');
}

main().catch((e) => {
  console.error(`[lessons] error: ${e.stack ?? e}`);
  process.exit(1);
});
