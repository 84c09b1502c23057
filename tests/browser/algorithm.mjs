// The algorithm view (src/web/algorithm_view.rs) in a real browser, single-tab mode: the ring
// all_reduce lesson at 3, 4 and 8 ranks and the tree broadcast at 5, stepped round by round with
// the page's own buttons. Checks, per round: the caption names the round of the right count
// (2(n−1) for the ring, ⌈log2 n⌉ for the tree), one arrow per message of the round (n for the
// ring), and the page's events equal `distgrad run <lesson> --world n --events --json` (the same
// messages, rounds, bytes and chunks; times aside); and that the algorithm list runs the lesson
// again with another algorithm (the star: 2 rounds). A screenshot at every round goes to <out>,
// at 1280x800 and, for 4 ranks, at a phone's width.
//
//   node tests/browser/algorithm.mjs --bin target/debug/distgrad --dist dist --out <dir>
import { execFileSync } from 'node:child_process';
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { checkScript, parseArgs, sleep, waitFor, watch } from './common.mjs';

const args = parseArgs(process.argv.slice(2));
const OUT = join(args.out ?? '/tmp', 'algorithm');
mkdirSync(OUT, { recursive: true });
// Set by checkScript below: the page's address, and where failures and the pages' errors go.
let base;
let fail;
let log;
let errors;

/** A call's events without times: what must agree between the page and the CLI. */
const untimed = (call) => JSON.stringify({
  collective: call.collective,
  algorithm: call.algorithm,
  ranks: call.ranks.map((r) => ({ rank: r.rank, events: r.events.map(({ t_us: _t, ...e }) => e) })),
});

/** `distgrad run <lesson> --world n --events --json` (with `--algorithm a` if given). */
function cliEvents(lesson, n, algorithm) {
  const extra = algorithm ? ['--algorithm', algorithm] : [];
  const out = execFileSync(args.bin, ['run', `www/lessons/${lesson}.json`, '--world', String(n), '--events', '--json', ...extra], { encoding: 'utf8' });
  return JSON.parse(out).calls;
}

/** Open `lesson` at step `step` in single-tab mode with n ranks; the page. */
async function open(ctx, lesson, n, step) {
  const page = await ctx.newPage();
  watch(page, `${lesson} n=${n}`, errors);
  await page.goto(`${base}?sim=${n}&lesson=${lesson}&step=${step}`);
  await waitFor([page], (s) => s.lesson === lesson && s.lesson_step === step && s.phase === 'ready', 60000, `${lesson} at ${n} ranks`);
  return page;
}

/** The page's trace's calls at `step`. */
const callsAt = async (page, step) => JSON.parse(await page.evaluate(() => window.distgrad.lessonTrace())).steps[step].calls ?? [];

/** The algorithm view's caption once it contains `text` (the round goes through the page's bus),
 * or as it is after 10 s. */
async function captionWith(page, text) {
  const t0 = Date.now();
  for (;;) {
    const c = await page.textContent('#algo-caption');
    if (c.includes(text) || Date.now() - t0 > 10000) return c;
    await sleep(50);
  }
}

/**
 * Step the algorithm view through every round of the step shown: `rounds` rounds, `arrows(k)`
 * arrows in round k; a screenshot of rounds `shots` says (true, false, or a function of k),
 * named `<name>-r<k>.png`.
 */
async function walk(page, name, rounds, arrows, shots) {
  if (await page.isHidden('#algo')) { fail(`${name}: the algorithm view is hidden`); return; }
  for (let k = 0; k < rounds; k++) {
    await page.click('#algo-next');
    const caption = await captionWith(page, `round ${k + 1} of ${rounds}`);
    if (!caption.includes(`round ${k + 1} of ${rounds}`)) fail(`${name}: round ${k + 1}: caption "${caption}"`);
    const got = await page.locator('#algo-svg .algo-msg').count();
    if (got !== arrows(k)) fail(`${name}: round ${k + 1}: ${got} arrows, expected ${arrows(k)}`);
    const listed = await page.locator('#algo-messages li').count();
    if (listed !== got) fail(`${name}: round ${k + 1}: ${listed} messages listed, ${got} drawn`);
    const shoot = typeof shots === 'function' ? shots(k) : !!shots;
    if (shoot) await page.locator('#algo').screenshot({ path: join(OUT, `${name}-r${k + 1}.png`) });
  }
  // One more: the result, every cell full.
  await page.click('#algo-next');
  const caption = await captionWith(page, 'result');
  if (!caption.includes('result')) fail(`${name}: after the last round the caption says "${caption}"`);
}

await checkScript('algorithm', args, OUT, async (t) => {
  ({ base, fail, log, errors } = t);
  const { browser } = t;
  const ctx = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  for (const n of [3, 4, 8]) {
    const page = await open(ctx, 'ring_all_reduce', n, 1);
    const cli = cliEvents('ring_all_reduce', n);
    const forward = await callsAt(page, 1);
    const backward = await callsAt(page, 4);
    if (forward.length !== 1 || backward.length !== 1) fail(`ring n=${n}: calls forward ${forward.length}, backward ${backward.length}`);
    else {
      if (untimed(forward[0]) !== untimed(cli[0])) fail(`ring n=${n}: the page's forward events differ from distgrad run --events`);
      if (untimed(backward[0]) !== untimed(cli[1])) fail(`ring n=${n}: the page's backward events differ from distgrad run --events`);
    }
    await walk(page, `ring-${n}`, 2 * (n - 1), () => n, n === 4 ? true : (k) => k === 0);
    const full = await page.locator('#algo-svg text', { hasText: /^all$/ }).count();
    if (full !== n * n) fail(`ring n=${n}: ${full} cells say "all" at the end, expected ${n * n}`);
    await page.screenshot({ path: join(OUT, `ring-${n}-result.png`), fullPage: true });
    // The dual in backward: the same ring, on step 4.
    await page.click('#step'); await page.click('#step'); await page.click('#step');
    await waitFor([page], (s) => s.lesson_step === 4, 10000, 'backward step');
    await walk(page, `ring-${n}-backward`, 2 * (n - 1), () => n, n === 4);
    // Another algorithm from the list: every tab runs the lesson again, the star at the same step.
    if (n === 4) {
      await page.selectOption('#algo-choice', 'star');
      await waitFor([page], (s) => s.lesson_runs === 2 && s.lesson_step === 4, 30000, 'the star');
      const star = await callsAt(page, 4);
      if (star[0]?.algorithm !== 'star') fail(`star chosen: the backward call took ${star[0]?.algorithm}`);
      if (untimed(star[0]) !== untimed(cliEvents('ring_all_reduce', n, 'star')[1])) fail('star: the page\'s events differ from distgrad run --events --algorithm star');
      await walk(page, 'star-4-backward', 2, () => n - 1, true);
    }
    log(`ring all_reduce at ${n} ranks: ${2 * (n - 1)} rounds forward and backward, events == distgrad run --events`);
    await page.close();
  }
  // The tree broadcast at 5 ranks: ⌈log2 5⌉ = 3 rounds; 4 messages in all.
  {
    const n = 5;
    const page = await open(ctx, 'broadcast', n, 1);
    const cli = cliEvents('broadcast', n);
    const [call] = await callsAt(page, 1);
    if (!call || untimed(call) !== untimed(cli[0])) fail('broadcast n=5: the page\'s events differ from distgrad run --events');
    const perRound = [0, 1, 2].map((k) => call.ranks.flatMap((r) => r.events).filter((e) => e.action === 'send' && e.round === k && !e.confirm).length);
    if (perRound.reduce((a, b) => a + b, 0) !== n - 1) fail(`broadcast n=5: ${perRound} messages per round`);
    await walk(page, 'broadcast-5', 3, (k) => perRound[k], true);
    log(`tree broadcast at 5 ranks: 3 rounds, ${perRound.join('+')} messages`);
    await page.close();
  }
  await ctx.close();
  // A phone's width: the ring at 4 ranks.
  const phone = await browser.newContext({ viewport: { width: 390, height: 844 }, deviceScaleFactor: 2 });
  const page = await open(phone, 'ring_all_reduce', 4, 1);
  await walk(page, 'ring-4-phone', 6, () => 4, false);
  await page.click('#algo-next');
  await captionWith(page, 'round 1 of 6');
  await page.locator('#algo').screenshot({ path: join(OUT, 'ring-4-phone-r1.png') });
  const wide = await page.evaluate(() => document.documentElement.scrollWidth);
  if (wide > 390) fail(`phone width: the page is ${wide} px wide (scrolls sideways)`);
  await phone.close();
});
