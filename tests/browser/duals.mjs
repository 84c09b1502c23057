// The wrong-vs-right lessons (src/lesson/duals.rs) in a real browser, single-tab mode: each
// lesson at 3, 4 and 8 ranks, its trace equal to `distgrad run <lesson> --world n --json` (the
// same gradients, the same verdicts of the gradient check, which the page runs itself), the last
// step's text saying which dual failed and which passed; stepped through with the page's Step
// button with a screenshot of every step (all_reduce MAX at 3, 4 and 8 ranks and at a phone's
// width); and the subgroup lesson in a room of 2 saying it needs 3 ranks without failing the room.
//
//   node tests/browser/duals.mjs --bin target/debug/distgrad --dist dist --out <dir>
import { execFileSync } from 'node:child_process';
import { mkdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { checkScript, openLesson, parseArgs, sleep, waitFor, watch } from './common.mjs';

const args = parseArgs(process.argv.slice(2));
const OUT = join(args.out ?? '/tmp', 'duals');
mkdirSync(OUT, { recursive: true });

const LESSONS = {
  wrong_all_reduce_max: 'the seed\'s dual FAIL',
  wrong_max_tie: 'the seed\'s dual INCONCLUSIVE',
  wrong_all_reduce_prod: 'the dividing dual FAIL',
  wrong_replicated_sum: 'the seed\'s dual FAIL',
  wrong_broadcast_subgroup: 'the global-root dual FAIL',
};
const index = JSON.parse(readFileSync('www/lessons/index.json', 'utf8')).lessons;

/** A trace without what may differ between runs (times, events). */
const plain = (t) => JSON.stringify(t.steps.map((s) => ({ label: s.label, phase: s.phase, collective: s.collective, ranks: s.ranks })));

const open = openLesson;

/** Step through every step with the Step button; a screenshot of each as `<name>-s<k>.png`. */
async function walk(page, name, steps, shots) {
  for (let k = 0; k < steps; k++) {
    if (k > 0) {
      await page.click('#step');
      await waitFor([page], (s) => s.lesson_step === k, 10000, `${name} step ${k}`);
    }
    if (shots) await page.screenshot({ path: join(OUT, `${name}-s${k}.png`), fullPage: true });
  }
}

await checkScript('duals', args, OUT, async (t) => {
  const { base, browser, fail, log, errors } = t;
  for (const name of Object.keys(LESSONS)) if (!index.some((l) => l.name === name)) fail(`${name} is not in www/lessons/index.json`);
  const ctx = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  for (const [lesson, verdict] of Object.entries(LESSONS)) {
    for (const n of [3, 4, 8]) {
      const page = await open(t, ctx, lesson, n);
      const trace = JSON.parse(await page.evaluate(() => window.distgrad.lessonTrace()));
      const cli = JSON.parse(execFileSync(args.bin, ['run', `www/lessons/${lesson}.json`, '--world', String(n), '--json'], { encoding: 'utf8' }));
      if (plain(trace) !== plain(cli)) fail(`${lesson} n=${n}: the page's trace differs from distgrad run --json`);
      const last = trace.steps[trace.steps.length - 1];
      if (!last.label.endsWith(`${verdict}, distgrad's dual PASS`)) fail(`${lesson} n=${n}: last step "${last.label}"`);
      const shots = lesson === 'wrong_all_reduce_max';
      await walk(page, `${lesson}-${n}`, trace.steps.length, shots);
      // The verdicts on screen, at the last step.
      if (shots && n === 4) await page.locator('#lesson-panel').screenshot({ path: join(OUT, `${lesson}-${n}-panel.png`) });
      const text = await page.textContent("#lesson-panel");
      if (!text.includes(verdict.split(' ').pop()) || !text.includes('PASS')) fail(`${lesson} n=${n}: the verdicts are not on screen`);
      log(`${lesson} at ${n} ranks: ${trace.steps.length} steps, "${last.label}", == distgrad run --json`);
      await page.close();
    }
  }
  // The subgroup lesson in a room of 2: a notice, and the room still works (another lesson runs).
  {
    const page = await ctx.newPage();
    watch(page, 'subgroup n=2', errors);
    await page.goto(`${base}?sim=2&lesson=wrong_broadcast_subgroup&step=0`);
    const t0 = Date.now();
    let notice = '';
    while (Date.now() - t0 < 60000) {
      notice = (await page.textContent('#notice')) ?? '';
      if (notice.includes('needs at least 3 ranks')) break;
      await sleep(100);
    }
    if (!notice.includes('needs at least 3 ranks and this room has 2')) fail(`subgroup at 2 ranks: notice "${notice}"`);
    const option = await page.textContent('#lesson option[value="wrong_broadcast_subgroup"]');
    if (!option.includes('(3 ranks or more)')) fail(`the lesson list says "${option}"`);
    await page.screenshot({ path: join(OUT, 'subgroup-2-refused.png'), fullPage: true });
    await page.selectOption('#lesson', 'wrong_all_reduce_max');
    await page.click('#lesson-start');
    await waitFor([page], (s) => s.lesson === 'wrong_all_reduce_max' && s.phase === 'ready', 60000, 'another lesson after the refusal');
    if (await page.isVisible('#notice')) fail(`the refusal's notice stays after another lesson ran: "${await page.textContent('#notice')}"`);
    log('the subgroup lesson at 2 ranks: refused with a notice; the room runs another lesson');
    await page.close();
  }
  await ctx.close();
  // A phone's width: all_reduce MAX at 4 ranks, every step.
  const phone = await browser.newContext({ viewport: { width: 390, height: 844 }, deviceScaleFactor: 2 });
  const page = await open(t, phone, 'wrong_all_reduce_max', 4);
  const steps = JSON.parse(await page.evaluate(() => window.distgrad.lessonTrace())).steps.length;
  await walk(page, 'wrong_all_reduce_max-4-phone', steps, true);
  const wide = await page.evaluate(() => document.documentElement.scrollWidth);
  if (wide > 390) fail(`phone width: the page is ${wide} px wide (scrolls sideways)`);
  await phone.close();
});
