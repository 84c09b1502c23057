// Values carry their kind (#37 item 4) in a real browser, single-tab mode: the Megatron MLP lesson
// at 3, 4 and 8 ranks and at a phone's width, stepped with the page's Step button. Checks: the
// trace equals `distgrad run megatron_mlp --world n --json`; the table's headers say each value's
// kind (x · invariant, W1_r · varying, z_r · unreduced, y · invariant); the step that uses the
// invariant x as a per-rank value says it was made varying, and its backward ran all_reduce;
// the all_reduce's own backward ran nothing and draws no arrow. A screenshot of every step at 4
// ranks and at a phone's width goes to <out>.
//
//   node tests/browser/kinds.mjs --bin target/debug/distgrad --dist dist --out <dir>
import { execFileSync } from 'node:child_process';
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { checkScript, parseArgs, waitFor, watch } from './common.mjs';

const args = parseArgs(process.argv.slice(2));
const OUT = join(args.out ?? '/tmp', 'kinds');
const LESSON = 'megatron_mlp';
mkdirSync(OUT, { recursive: true });
const plain = (t) => JSON.stringify(t.steps.map((s) => ({ label: s.label, phase: s.phase, collective: s.collective, arrows: s.arrows, ranks: s.ranks })));

/** Headers of the values table at the step shown. */
const headers = (page) => page.$$eval('#lesson-table th', (ths) => ths.map((t) => t.textContent.trim()));

async function check({ base, fail, log, errors }, ctx, n, name, shots) {
  const page = await ctx.newPage();
  watch(page, `${name}`, errors);
  await page.goto(`${base}?sim=${n}&lesson=${LESSON}&step=0`);
  await waitFor([page], (s) => s.lesson === LESSON && s.phase === 'ready' && s.lesson_steps > 0, 60000, name);
  const trace = JSON.parse(await page.evaluate(() => window.distgrad.lessonTrace()));
  const cli = JSON.parse(execFileSync(args.bin, ['run', `www/lessons/${LESSON}.json`, '--world', String(n), '--json'], { encoding: 'utf8' }));
  if (plain(trace) !== plain(cli)) fail(`${name}: the page's trace differs from distgrad run --json`);
  const want = { 0: ['x · invariant', 'W1_r · varying', 'W2_r · varying'], 3: ['z_r · unreduced'], 4: ['y · invariant'] };
  for (let k = 0; k < trace.steps.length; k++) {
    if (k > 0) {
      await page.click('#step');
      await waitFor([page], (s) => s.lesson_step === k, 10000, `${name} step ${k}`);
    }
    const h = await headers(page);
    for (const w of want[k] ?? []) if (!h.includes(w)) fail(`${name} step ${k}: headers ${JSON.stringify(h)} lack "${w}"`);
    const label = await page.textContent('#lesson-step');
    if (k === 1 && !label.includes('made varying here: x')) fail(`${name} step 1: "${label}"`);
    const st = trace.steps[k];
    if (st.phase === 'backward' && st.label.startsWith('backward through all_reduce')) {
      if (st.collective !== 'nothing' || st.arrows.length) fail(`${name}: the all_reduce's backward ran ${st.collective} with ${st.arrows.length} arrows`);
      const drawn = await page.locator('#diagram .arrow').count();
      if (drawn) fail(`${name} step ${k}: ${drawn} arrows drawn where backward ran nothing`);
    }
    if (st.phase === 'backward' && st.label.includes('x was made varying') && st.collective !== 'all_reduce(op=sum)') fail(`${name}: f's backward ran ${st.collective}`);
    if (shots) await page.screenshot({ path: join(OUT, `${name}-s${k}.png`), fullPage: true });
    if (shots && k === 10) await page.locator('#lesson-panel').screenshot({ path: join(OUT, `${name}-s${k}-panel.png`) });
  }
  const wide = await page.evaluate(() => document.documentElement.scrollWidth);
  const vw = page.viewportSize().width;
  if (wide > vw) fail(`${name}: the page is ${wide} px wide at ${vw} (scrolls sideways)`);
  log(`${name}: ${trace.steps.length} steps, kinds in the headers, == distgrad run --json`);
  await page.close();
}

await checkScript('kinds', args, OUT, async (t) => {
  const ctx = await t.browser.newContext({ viewport: { width: 1280, height: 800 } });
  for (const n of [3, 4, 8]) await check(t, ctx, n, `megatron-${n}`, n === 4);
  await ctx.close();
  const phone = await t.browser.newContext({ viewport: { width: 390, height: 844 }, deviceScaleFactor: 2 });
  await check(t, phone, 4, 'megatron-4-phone', true);
  await phone.close();
});
