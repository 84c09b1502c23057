// End-to-end test of programs and the gradient check in the page: every shipped program in 3 tabs
// (and in single-tab mode) against the native CLI.
//
//   node tests/browser/programs.mjs --bin <distgrad binary> --dist <built web app> [--out <dir>]
//
// The expected numbers come from the native binary, not from the page: `distgrad run <program>
// --world 3 --json` (every rank's loss and gradients) and `distgrad gradcheck <program> --world 3
// --json` (the check's report). A program the native plan refuses for 3 ranks (exit 2) must be
// refused by the page too, before anything runs. For each program one tab asks (through the page's
// own controls for the first, `window.distgrad.runProgram` / `checkProgram` for the rest), and
// every tab must then show the same result: losses and gradients within 1e-4 relative of the
// native run, and the gradient check's verdict, rows (rank, input, coordinates checked, failures,
// kinks) and objective value as the native check's. Tabs compute on the CPU here (bitwise the
// native backend's kernels, so the check's verdicts match); one program runs on WebGPU as well.
// A bad program pasted in one tab is a notice there and runs nowhere. Screenshots go to
// <out>/programs/. Fails on any console error or uncaught exception.

import { spawnSync } from 'node:child_process';
import { readFileSync, mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { chromium } from 'playwright-core';
import { parseArgs, sleep, startRelay, stateOf, waitFor as waitForAll, watch } from './common.mjs';

const args = parseArgs(process.argv.slice(2));
const BIN = args.bin;
const DIST = args.dist ?? 'dist';
const OUT = join(args.out ?? 'target/browser-test-output', 'programs');
const PROGRAMS = 'www/programs';
const CHROMIUM = process.env.CHROMIUM ?? '/usr/bin/chromium';
const WORLD = 3;
if (!BIN) {
  console.error('usage: programs.mjs --bin <distgrad> --dist <dir> [--out <dir>]');
  process.exit(2);
}
mkdirSync(OUT, { recursive: true });
const failures = [];
const fail = (msg) => { failures.push(msg); console.log(`  FAIL ${msg}`); };
const log = (msg) => console.log(`[programs] ${msg}`);

/** Equal within 1e-4 relative (null = non-finite, equal only to null). */
function near(a, b) {
  if (a === null || b === null || a === undefined || b === undefined) return a === b;
  return Math.abs(a - b) <= 1e-4 * Math.max(1, Math.abs(a), Math.abs(b));
}

// A page's run ({kind: "run", ranks: [...]}) against `distgrad run --json` ([{rank, loss, weight, grads}]).
function diffRuns(got, want) {
  if (got?.kind !== 'run') return `not a run result: ${JSON.stringify(got)?.slice(0, 200)}`;
  if (got.ranks.length !== want.length) return `${got.ranks.length} ranks, expected ${want.length}`;
  for (const [r, w] of want.entries()) {
    const g = got.ranks[r];
    if (g.rank !== w.rank) return `entry ${r} is rank ${g.rank}`;
    if (!near(g.loss, w.loss)) return `rank ${r}: loss ${g.loss}, expected ${w.loss}`;
    if (!near(g.weight, w.weight)) return `rank ${r}: weight ${g.weight}, expected ${w.weight}`;
    if (g.grads.length !== w.grads.length) return `rank ${r}: ${g.grads.length} gradients, expected ${w.grads.length}`;
    for (const [i, wg] of w.grads.entries()) {
      const gg = g.grads[i];
      if ((wg === null) !== (gg === null)) return `rank ${r} input ${i}: gradient ${JSON.stringify(gg)}, expected ${JSON.stringify(wg)}`;
      if (wg === null) continue;
      if (gg.length !== wg.length) return `rank ${r} input ${i}: ${gg.length} elements, expected ${wg.length}`;
      for (const [e, x] of wg.entries())
        if (!near(gg[e], x)) return `rank ${r} input ${i}[${e}] = ${gg[e]}, expected ${x}`;
    }
  }
  return null;
}

// A page's check against `distgrad gradcheck --json`.
function diffCheck(got, want) {
  if (got?.kind !== 'check') return `not a check result: ${JSON.stringify(got)?.slice(0, 200)}`;
  for (const k of ['verdict', 'world', 'objective', 'evaluations'])
    if (got[k] !== want[k]) return `${k} ${got[k]}, expected ${want[k]}`;
  if (JSON.stringify(got.mode) !== JSON.stringify(want.mode)) return `mode ${JSON.stringify(got.mode)}, expected ${JSON.stringify(want.mode)}`;
  if (!near(got.value, want.value)) return `F = ${got.value}, expected ${want.value}`;
  if (got.rows.length !== want.rows.length) return `${got.rows.length} rows, expected ${want.rows.length}`;
  for (const [i, w] of want.rows.entries()) {
    const g = got.rows[i];
    for (const k of ['rank', 'input', 'checked', 'failed', 'kinks', 'inconclusive'])
      if (g[k] !== w[k]) return `row ${i} (rank ${w.rank}, ${w.input}): ${k} ${g[k]}, expected ${w[k]}`;
  }
  if (got.kinks.length !== want.kinks.length) return `${got.kinks.length} kinks, expected ${want.kinks.length}`;
  return null;
}

const waitFor = (pages, pred, ms, what) => waitForAll(pages, pred, ms, what, (s) => [s.phase, s.program_runs]);

const resultOf = async (page) => JSON.parse(await page.evaluate(() => window.distgrad.programResult()));


/** The native CLI's JSON for `args`, or {refused: stderr} when it exits with 2 (a bad program). */
function native(cliArgs) {
  const r = spawnSync(BIN, cliArgs, { encoding: 'utf8' });
  if (r.status === 2) return { refused: r.stderr.trim() };
  if (r.status !== 0 && r.status !== 1 && r.status !== 3) throw new Error(`distgrad ${cliArgs.join(' ')}: exit ${r.status}: ${r.stderr}`);
  return JSON.parse(r.stdout);
}

async function main() {
  const index = JSON.parse(readFileSync(join(PROGRAMS, 'index.json'), 'utf8')).programs;
  const texts = Object.fromEntries(index.map(({ name }) => [name, readFileSync(join(PROGRAMS, `${name}.json`), 'utf8')]));
  log(`native results: distgrad run / gradcheck <program> --world ${WORLD} --json, for ${index.length} programs`);
  const expected = {};
  for (const { name } of index) {
    const file = join(PROGRAMS, `${name}.json`);
    const run = native(['run', file, '--world', String(WORLD), '--json']);
    const check = run.refused ? run : native(['gradcheck', file, '--world', String(WORLD), '--json']);
    expected[name] = { run, check };
    log(`  ${name}: ${run.refused ? `refused for ${WORLD} ranks` : `gradcheck ${check.verdict}, ${check.evaluations} runs`}`);
  }
  if (!index.some(({ name }) => expected[name].run.refused)) fail('no shipped program is refused for 3 ranks: the refusal path is not tested');
  const relay = await startRelay(BIN, DIST);
  const base = `http://${relay.host}/`;
  const browser = await chromium.launch({
    executablePath: CHROMIUM,
    headless: true,
    args: ['--no-sandbox', '--no-first-run', '--disable-background-networking', '--disable-component-update', '--disable-sync', '--enable-unsafe-webgpu', '--use-webgpu-adapter=swiftshader'],
  });
  const errors = [];
  const figures = {};
  try {
    const ctx = await browser.newContext({ viewport: { width: 1280, height: 900 } });
    const first = index[0].name;
    // Rank 0 opens a room with ?program=, so its editor holds that example; the others join by
    // the share link, which carries the program too.
    const pages = [];
    for (let i = 0; i < WORLD; i++) {
      const p = await ctx.newPage();
      watch(p, `tab ${i}`, errors);
      pages.push(p);
    }
    await pages[0].goto(`${base}?room=programs&world=${WORLD}&net=channel&device=cpu&program=${first}`);
    const share = (await waitFor([pages[0]], (s) => !!s.share, 30000, 'share link'))[0].share;
    if (!share.includes(`program=${first}`)) fail(`the share link does not carry the program: ${share}`);
    // The share link leaves the compute backend to each student's machine; these tabs pick the CPU.
    await Promise.all(pages.slice(1).map((p) => p.goto(`${share}&device=cpu`)));
    const states = await waitFor(pages, (s) => s.phase === 'ready', 60000, 'joining');
    const byRank = [];
    states.forEach((s, i) => { byRank[s.rank] = pages[i]; });
    log(`${WORLD} tabs ready (compute: ${states[0].device})`);
    for (const [r, p] of byRank.entries()) {
      const shown = await p.inputValue('#program-text');
      if (JSON.stringify(JSON.parse(shown)) !== JSON.stringify(JSON.parse(texts[first]))) fail(`tab of rank ${r}: ?program=${first} did not load the example into the editor`);
    }

    let runs = 0;
    for (const [k, { name }] of index.entries()) {
      const want = expected[name];
      if (want.run.refused) {
        // Asked from rank 2: refused there before anything runs; no tab runs it.
        const err = await byRank[2].evaluate((t) => window.distgrad.runProgram(t).then(() => null, (e) => String(e)), texts[name]);
        if (!err) fail(`${name}: the page ran a program the native plan refuses (${want.run.refused})`);
        else log(`${name}: refused for ${WORLD} ranks, as natively: ${err}`);
        await sleep(300);
        const after = await Promise.all(byRank.map(stateOf));
        if (after.some((s) => s.program_runs !== runs)) fail(`${name}: a refused program ran on some tab`);
        continue;
      }
      // The first program through the page's own controls (rank 1's tab), the rest through the API.
      runs++;
      let t0 = Date.now();
      if (k === 0) {
        await byRank[1].click('#program-run');
      } else {
        await byRank[2].evaluate((t) => window.distgrad.runProgram(t), texts[name]);
      }
      await waitFor(byRank, (s) => s.program_runs === runs, 60000, `run ${name}`);
      const runMs = Date.now() - t0;
      for (const [r, p] of byRank.entries()) {
        const d = diffRuns(await resultOf(p), want.run);
        if (d) fail(`run ${name}, tab of rank ${r} vs distgrad run: ${d}`);
      }
      const table = await byRank[0].textContent('#program-result');
      const loss = want.run.find((x) => x.loss !== null);
      if (loss && !table.includes(loss.loss.toFixed(6).slice(0, 6))) fail(`run ${name}: rank ${loss.rank}'s loss ${loss.loss} is not in the page's table`);
      // The check: the first with the page's button (rank 0's tab), the rest through the API.
      runs++;
      t0 = Date.now();
      if (k === 0) {
        await byRank[0].click('#program-check');
      } else {
        await byRank[1].evaluate((t) => window.distgrad.checkProgram(t), texts[name]);
      }
      await waitFor(byRank, (s) => s.program_runs === runs, 240000, `check ${name}`);
      const checkMs = Date.now() - t0;
      const reports = await Promise.all(byRank.map(resultOf));
      for (const [r, rep] of reports.entries()) {
        const d = diffCheck(rep, want.check);
        if (d) fail(`check ${name}, tab of rank ${r} vs distgrad gradcheck: ${d}`);
      }
      const shown = await byRank[2].textContent('#program-result');
      if (!shown.includes(want.check.verdict)) fail(`check ${name}: the verdict ${want.check.verdict} is not shown`);
      figures[name] = { run_ms: runMs, check_ms: checkMs, evaluations: want.check.evaluations, verdict: want.check.verdict };
      log(`${name}: run on ${WORLD} tabs ${runMs} ms; gradcheck ${want.check.verdict} (${want.check.evaluations} runs of all ranks) in ${checkMs} ms, as natively`);
      await byRank[0].screenshot({ path: join(OUT, `${name}-check.png`), fullPage: true });
    }

    // A bad program pasted into rank 1's editor: a notice there, nothing runs anywhere.
    await byRank[1].fill('#program-text', '{"world": 3, "inputs": [], "steps": [{"op": "nope"}], "loss": "l"}');
    await byRank[1].click('#program-run');
    await sleep(500);
    const notice = await byRank[1].textContent('#notice');
    if (!/program not run/.test(notice)) fail(`a bad program gave no notice: "${notice}"`);
    else log(`bad program: "${notice.slice(0, 160)}"`);
    if ((await Promise.all(byRank.map(stateOf))).some((s) => s.program_runs !== runs)) fail('a bad program ran on some tab');

    // Single-tab mode, on WebGPU (SwiftShader): the first program's run and check.
    const sim = await ctx.newPage();
    watch(sim, 'single tab', errors);
    await sim.goto(`${base}?sim=${WORLD}&program=${first}`);
    const simState = (await waitFor([sim], (s) => s.phase === 'ready', 60000, 'single tab'))[0];
    await sim.click('#program-run');
    await waitFor([sim], (s) => s.program_runs === 1, 60000, 'single tab run');
    let d = diffRuns(await resultOf(sim), expected[first].run);
    if (d) fail(`single tab (${simState.device}) run ${first}: ${d}`);
    await sim.click('#program-check');
    await waitFor([sim], (s) => s.program_runs === 2, 240000, 'single tab check');
    d = diffCheck(await resultOf(sim), expected[first].check);
    if (d) fail(`single tab (${simState.device}) check ${first}: ${d}`);
    log(`single tab (${simState.device}): ${first} run and check as natively`);
    await sim.screenshot({ path: join(OUT, 'single-tab-check.png'), fullPage: true });
    await Promise.all([...pages, sim].map((p) => p.close()));
  } finally {
    await browser.close();
    relay.proc.kill();
  }
  for (const e of errors) fail(e);
  console.log(`[programs] figures ${JSON.stringify(figures)}`);
  if (failures.length) {
    console.log(`[programs] ${failures.length} failure(s)`);
    process.exit(1);
  }
  console.log('[programs] all passed');
}

main().catch((e) => {
  console.error(`[programs] ${e.stack ?? e}`);
  process.exit(1);
});
