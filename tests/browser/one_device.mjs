// One device beside the ranks (src/lesson/one_device.rs) in a real browser, single-tab mode: a
// lesson of each view (a collective, a program with steps, wrong vs right, both objectives) at 3,
// 4 and 8 ranks: the page's one-device values equal `distgrad run <lesson> --world n --json`'s,
// the table is shown with the last step only, and says that distgrad's gradients equal one
// device's (a wrong dual's do not); screenshots of the last step of the Megatron MLP at 3, 4 and
// 8 ranks and at a phone's width, which must not scroll sideways. The training lessons of a
// tensor-parallel layer (right, and forgetting its reduce): one device's loss curve equal to the
// CLI's, drawn dashed beside the group's, which follows it (right) or drifts (wrong); every step
// of the wrong one at 4 ranks and its last at 3, 8 and a phone's width in screenshots; the last
// step of the two-objectives lesson (every value's cotangent under each, divided) likewise.
//
//   node tests/browser/one_device.mjs --bin target/debug/distgrad --dist dist --out <dir>
import { execFileSync } from 'node:child_process';
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { checkScript, close, openLesson, parseArgs, waitFor } from './common.mjs';

const args = parseArgs(process.argv.slice(2));
const OUT = join(args.out ?? '/tmp', 'one_device');
mkdirSync(OUT, { recursive: true });

// Lesson → what the label must say of each gradient compared, in order.
const LESSONS = {
  all_reduce_max: [/^distgrad equals it exactly$/],
  megatron_mlp: [/^distgrad (equals it exactly|differs by at most .* \(float rounding\))$/],
  wrong_all_reduce_prod: [/^the dividing dual gives NaN where one device has a number$/, /^distgrad's dual equals it exactly$/],
  objectives: [/^distgrad \(sum of rank losses\) equals it exactly$/, /^distgrad \(one replicated loss\) equals it exactly$/],
};

const open = openLesson;

/** The lesson at n ranks in the page: its trace and one-device view, and `distgrad run`'s. */
async function both(t, ctx, lesson, n) {
  const page = await open(t, ctx, lesson, n);
  const trace = JSON.parse(await page.evaluate(() => window.distgrad.lessonTrace()));
  const cli = JSON.parse(execFileSync(args.bin, ['run', `www/lessons/${lesson}.json`, '--world', String(n), '--json'], { encoding: 'utf8' }));
  return { page, trace, got: trace.one_device, want: cli.one_device };
}

/** Step to the last step with the → key. */
async function toLast(page, steps, name) {
  for (let k = 1; k < steps; k++) {
    await page.focus('#step');
    await page.keyboard.press('ArrowRight');
    await waitFor([page], (s) => s.lesson_step === k, 10000, `${name} step ${k}`);
  }
}

// Training lessons → whether the group's loss must follow one device's.
const TRAINING = { tp_training: true, wrong_tp_forgot_reduce: false };

await checkScript('one_device', args, OUT, async (t) => {
  const { browser, fail, log } = t;
  const ctx = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  for (const [lesson, follows] of Object.entries(TRAINING)) {
    for (const n of [3, 4, 8]) {
      const name = `${lesson} n=${n}`;
      const { page, trace, got, want } = await both(t, ctx, lesson, n);
      if (!got || !want) { fail(`${name}: one device missing (page ${!!got}, CLI ${!!want})`); await page.close(); continue; }
      if (got.curve.length !== trace.steps.length - 1 || !want.curve.every((x, i) => close(got.curve[i], x))) fail(`${name}: the page's one-device curve differs from distgrad run's`);
      const said = /equals it at every step$|\(float rounding\)$/.test(got.label);
      if (said !== follows) fail(`${name}: label "${got.label}"`);
      // The group's loss beside one device's, step by step, as the page holds them.
      const group = trace.steps.slice(1).map((st) => st.ranks[0].find((v) => v.name === 'group loss').tensors[0].data[0]);
      const apart = Math.max(...group.map((g, i) => Math.abs(g - got.curve[i])));
      if (follows ? apart > 1e-4 : apart < 0.1) fail(`${name}: group and one device apart by ${apart}`);
      const wrongShots = lesson === 'wrong_tp_forgot_reduce';
      for (let k = 1; k < trace.steps.length; k++) {
        await page.focus('#step');
        await page.keyboard.press('ArrowRight');
        await waitFor([page], (s) => s.lesson_step === k, 10000, `${name} step ${k}`);
        if (wrongShots && n === 4 && (k <= 3 || k % 10 === 0)) await page.screenshot({ path: join(OUT, `${lesson}-${n}-s${k}.png`), fullPage: true });
      }
      const dashed = await page.locator('#lesson-plot .one-device-curve').count();
      if (dashed !== 1) fail(`${name}: ${dashed} one-device curves drawn at the last step`);
      if (!(await page.isVisible('#one-device'))) fail(`${name}: one device not shown at the last step`);
      if (wrongShots) {
        await page.screenshot({ path: join(OUT, `${lesson}-${n}-last.png`), fullPage: true });
        if (n === 4) await page.locator('#lesson-panel').screenshot({ path: join(OUT, `${lesson}-${n}-panel.png`) });
      }
      log(`${name}: "${got.label}", group vs one device apart by up to ${apart.toExponential(2)}`);
      await page.close();
    }
  }
  for (const [lesson, verdicts] of Object.entries(LESSONS)) {
    for (const n of [3, 4, 8]) {
      const name = `${lesson} n=${n}`;
      const { page, trace, got, want } = await both(t, ctx, lesson, n);
      if (!got || !want) { fail(`${name}: one device missing (page ${!!got}, CLI ${!!want})`); await page.close(); continue; }
      if (got.label !== want.label) fail(`${name}: label "${got.label}", distgrad run says "${want.label}"`);
      const parts = got.label.split(': ').slice(1).join(': ').split('; ');
      if (parts.length !== verdicts.length || !verdicts.every((re, i) => re.test(parts[i]))) fail(`${name}: label "${got.label}"`);
      want.ranks.forEach((vals, r) => vals.forEach((v, i) => v.tensors.forEach((tj, j) => tj.data.forEach((x, e) => {
        const y = got.ranks[r]?.[i]?.tensors?.[j]?.data?.[e];
        if (got.ranks[r][i].name !== v.name || !close(y, x)) fail(`${name}: rank ${r} ${v.name}[${e}] = ${y}, distgrad run says ${x}`);
      }))));
      if (got.ranks.length !== n) fail(`${name}: ${got.ranks.length} rows`);
      // Hidden until the last step, then shown with its label and a row per rank.
      if (await page.isVisible('#one-device')) fail(`${name}: one device shown at step 0`);
      await toLast(page, trace.steps.length, name);
      if (!(await page.isVisible('#one-device'))) fail(`${name}: one device not shown at the last step`);
      const text = await page.textContent('#one-device');
      if (!text.includes(parts[parts.length - 1]) || !text.includes(`${n - 1}`)) fail(`${name}: the table says "${text.slice(0, 200)}"`);
      if (lesson === 'objectives') await page.screenshot({ path: join(OUT, `${lesson}-${n}-last.png`), fullPage: true });
      if (lesson === 'megatron_mlp') {
        await page.screenshot({ path: join(OUT, `${lesson}-${n}-last.png`), fullPage: true });
        if (n === 4) await page.locator('#lesson-panel').screenshot({ path: join(OUT, `${lesson}-${n}-panel.png`) });
      }
      log(`${name}: "${got.label}", == distgrad run --json, shown at step ${trace.steps.length - 1}`);
      await page.close();
    }
  }
  await ctx.close();
  const phone = await browser.newContext({ viewport: { width: 390, height: 844 }, deviceScaleFactor: 2 });
  for (const lesson of ['megatron_mlp', 'wrong_tp_forgot_reduce', 'objectives']) {
    const page = await open(t, phone, lesson, 4);
    const steps = JSON.parse(await page.evaluate(() => window.distgrad.lessonTrace())).steps.length;
    await toLast(page, steps, `${lesson} phone`);
    await page.screenshot({ path: join(OUT, `${lesson}-4-phone-last.png`), fullPage: true });
    const wide = await page.evaluate(() => document.documentElement.scrollWidth);
    if (wide > 390) fail(`${lesson} at a phone's width: the page is ${wide} px wide (scrolls sideways)`);
    await page.close();
  }
  await phone.close();
});
