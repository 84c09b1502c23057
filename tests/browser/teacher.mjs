// What a teacher and a newcomer meet first (docs/teaching.md): the first screen says what the demo
// is and starts a lesson in one click; the lobby takes `?world=N` (what scripts/web.sh prints);
// a link to a lesson step opens that step, and the room's share link carries the lesson and step
// it was opened with; projector mode (a button, or ?projector=1) makes the text large, and its
// links keep it; the compute line speaks to a student and keeps the adapter's name in its
// tooltip; the program editor's help is a page of the app. Screenshots (the first screen, a lesson
// in projector mode, at a desktop's and a phone's width) go to <out>.
//
//   node tests/browser/teacher.mjs --bin target/debug/distgrad --dist dist --out <dir>
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { checkScript, parseArgs, stateOf, waitFor, watch } from './common.mjs';

const args = parseArgs(process.argv.slice(2));
const OUT = join(args.out ?? '/tmp', 'teacher');
mkdirSync(OUT, { recursive: true });

await checkScript('teacher', args, OUT, async ({ base, browser, fail, log, errors }) => {
  for (const [label, viewport] of [['desktop', { width: 1280, height: 800 }], ['phone', { width: 390, height: 844 }]]) {
    const ctx = await browser.newContext({ viewport });
    // ---- the first screen: what it is, one click to a lesson; ?world=4 fills the form ----
    const page = await ctx.newPage();
    watch(page, `lobby ${label}`, errors);
    await page.goto(`${base}?world=4`);
    await page.waitForSelector('#create:not([hidden])', { timeout: 30000 });
    const intro = await page.textContent('#create .intro');
    if (!/shows how gradients flow through collectives/.test(intro) || !/Every browser tab is\s+a rank/.test(intro)) fail(`${label}: the first screen says "${intro}"`);
    const world = await page.inputValue('#new-world');
    if (world !== '4') fail(`${label}: ?world=4 left the form's ranks at ${world}`);
    await page.screenshot({ path: join(OUT, `first-screen-${label}.png`), fullPage: true });
    await page.click('#try');
    await waitFor([page], (s) => s.lesson === 'all_reduce_sum' && s.phase === 'ready' && s.lesson_steps > 0, 60000, 'the one-click lesson');
    const s0 = await stateOf(page);
    if (s0.world !== 4 || !s0.sim || s0.lesson_step !== 0) fail(`${label}: one click opened world ${s0.world}, sim ${s0.sim}, step ${s0.lesson_step}`);
    // ---- the compute line: a student's words, the adapter in the tooltip ----
    const device = await page.textContent('#device');
    const tip = await page.getAttribute('#device', 'title');
    if (!/^CPU: this browser's WebGPU is software-only/.test(device)) fail(`${label}: compute line "${device}"`);
    if (!/^WebGPU adapter: .*Cpu/.test(tip ?? '')) fail(`${label}: compute line's tooltip "${tip}"`);
    if (/BrowserWebGpu|unnamed adapter/.test(device)) fail(`${label}: the compute line names the adapter: "${device}"`);
    // ---- a link to this step: opens the same step in a fresh tab ----
    await page.click('#step');
    await page.click('#step');
    await waitFor([page], (s) => s.lesson_step === 2, 10000, 'step 2');
    const href = await page.getAttribute('#step-link', 'href');
    if (!href.includes('?sim=4&lesson=all_reduce_sum&step=2')) fail(`${label}: step link ${href}`);
    const linked = await ctx.newPage();
    watch(linked, `step link ${label}`, errors);
    await linked.goto(href);
    await waitFor([linked], (s) => s.lesson === 'all_reduce_sum' && s.lesson_step === 2 && s.phase === 'ready', 60000, 'the step link');
    const stepText = await linked.textContent('#lesson-step');
    if (!stepText.startsWith('Step 2 of')) fail(`${label}: the step link shows "${stepText}"`);
    await linked.close();
    // ---- projector mode: the button, large text, links that keep it ----
    await page.click('#projector');
    const big = await page.evaluate(() => [document.documentElement.classList.contains('projector'), getComputedStyle(document.body).fontSize, getComputedStyle(document.querySelector('#lesson-title')).fontSize]);
    if (!big[0] || big[1] !== '22px' || parseFloat(big[2]) < 22) fail(`${label}: projector mode: class ${big[0]}, text ${big[1]}, lesson title ${big[2]}`);
    if ((await page.getAttribute('#projector', 'aria-pressed')) !== 'true') fail(`${label}: the projector button is not pressed`);
    const phref = await page.getAttribute('#step-link', 'href');
    if (!phref.endsWith('&projector=1')) fail(`${label}: in projector mode the step link is ${phref}`);
    await page.screenshot({ path: join(OUT, `projector-${label}.png`), fullPage: true });
    const wide = await page.evaluate(() => document.documentElement.scrollWidth);
    if (wide > viewport.width) fail(`${label}: projector mode is ${wide} px wide (scrolls sideways)`);
    await page.click('#projector');
    if (await page.evaluate(() => document.documentElement.classList.contains('projector'))) fail(`${label}: the projector button does not turn it off`);
    await page.close();
    await ctx.close();
  }
  // ---- ?projector=1 and a room's share link carrying the lesson and step ----
  {
    const ctx = await browser.newContext({ viewport: { width: 1280, height: 800 } });
    const page = await ctx.newPage();
    watch(page, 'room', errors);
    await page.goto(`${base}?world=2&lesson=broadcast&step=1&projector=1`);
    await page.waitForSelector('#create:not([hidden])', { timeout: 30000 });
    if (!(await page.evaluate(() => document.documentElement.classList.contains('projector')))) fail('?projector=1 did not turn projector mode on');
    await page.click('#create-form button[type=submit]');
    await page.waitForFunction(() => document.querySelector('#share')?.value?.includes('token='), null, { timeout: 30000 });
    const share = await page.inputValue('#share');
    for (const want of ['world=2', 'lesson=broadcast', 'step=1', 'projector=1']) if (!share.includes(want)) fail(`share link ${share} lacks ${want}`);
    const other = await ctx.newPage();
    watch(other, 'room rank 1', errors);
    await other.goto(share);
    await waitFor([page, other], (s) => s.lesson === 'broadcast' && s.lesson_step === 1 && s.phase === 'ready', 60000, 'the room at the linked step');
    log(`a room created from ?lesson=broadcast&step=1: share link ${share.replace(/token=[^&]+/, 'token=…')}; both tabs at step 1`);
    await ctx.close();
  }
  // ---- the program editor's help: a page of the app ----
  {
    const ctx = await browser.newContext();
    const page = await ctx.newPage();
    watch(page, 'help', errors);
    await page.goto(`${base}?sim=2`);
    await page.waitForSelector('a[href="program-help.html"]', { timeout: 30000 });
    const resp = await page.goto(`${base}program-help.html`);
    const h1 = await page.textContent('h1');
    if (resp.status() !== 200 || h1 !== 'How programs are written') fail(`the help page: HTTP ${resp.status()}, "${h1}"`);
    await ctx.close();
  }
  log('first screen, ?world, one-click lesson, step links, share links with the lesson, projector mode, compute line, help page');
});
