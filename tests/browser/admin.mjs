// A teacher's controls (docs/teaching.md, `distgrad relay --admin-token`): the admin page asks for
// the token (a wrong one is refused, saying so), then lists the class's rooms with their members
// and the relay's use against its budgets; "Remove" takes one student's tab out of its room (the
// tab is told why) and "Close room" ends a room (its tabs told). Two rooms of app tabs: a full one
// of 2 and a waiting one of 1 of 2. Screenshots (desktop and a phone's width) go to <out>.
// Also: a shared link cannot redirect a tab (#40 item 6): `?relay=` naming another relay asks the
// student first (declined: the tab says why and connects nowhere; accepted: the page's
// Content-Security-Policy still refuses the connection), and naming the page's own relay asks
// nothing.
//
//   node tests/browser/admin.mjs --bin target/debug/distgrad --dist dist --out <dir>
import { randomBytes } from 'node:crypto';
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { checkScript, parseArgs, stateOf, waitFor, watch } from './common.mjs';

const args = parseArgs(process.argv.slice(2));
const OUT = join(args.out ?? '/tmp', 'admin');
mkdirSync(OUT, { recursive: true });
const TOKEN = randomBytes(16).toString('hex');

/**
 * Like `watch`, except the 401 a deliberately wrong token draws (the browser logs every failed
 * request as a console error).
 */
function watchAdmin(page, name, errors) {
  page.on('pageerror', (e) => errors.push(`${name}: uncaught ${e.message}`));
  page.on('console', (m) => {
    if (m.type() === 'error' && !/status of 401 \(Unauthorized\)/.test(m.text())) errors.push(`${name}: console error: ${m.text()}`);
  });
}

/** The admin table's rows: room name -> the ranks listed. */
const rows = (page) => page.evaluate(() => Object.fromEntries([...document.querySelectorAll('#rooms tbody tr')]
  .map((tr) => [tr.dataset.room, [...tr.querySelectorAll('[data-rank]')].map((d) => Number(d.dataset.rank))])));

async function until(page, pred, ms, what, fail) {
  const t0 = Date.now();
  for (;;) {
    const r = await rows(page);
    if (pred(r)) return r;
    if (Date.now() - t0 > ms) {
      fail(`${what}: the admin table shows ${JSON.stringify(r)}`);
      return r;
    }
    await new Promise((res) => setTimeout(res, 200));
  }
}

await checkScript('admin', args, OUT, async ({ base, browser, fail, log, errors }) => {
  // ---- a class: room "full" (2 of 2) and room "waiting" (1 of 2), each tab a student ----
  const classCtx = await browser.newContext();
  const tok = () => randomBytes(16).toString('hex');
  const [fullTok, waitTok] = [tok(), tok()];
  const full = [];
  for (let r = 0; r < 2; r++) {
    const p = await classCtx.newPage();
    await p.goto(`${base}?room=full&world=2&token=${fullTok}`);
    full.push(p);
  }
  await waitFor(full, (s) => s.phase === 'ready', 60000, 'room "full"');
  const waiting = await classCtx.newPage();
  await waiting.goto(`${base}?room=waiting&world=2&token=${waitTok}`);
  await waiting.waitForFunction(() => window.distgrad && JSON.parse(window.distgrad.state()).rank === 0, null, { timeout: 60000 });

  for (const [label, viewport] of [['desktop', { width: 1280, height: 800 }], ['phone', { width: 390, height: 844 }]]) {
    const ctx = await browser.newContext({ viewport });
    const page = await ctx.newPage();
    watchAdmin(page, `admin ${label}`, errors);
    // ---- no token: the form; a wrong token: refused, saying so; the right one: the table ----
    await page.goto(`${base}admin`);
    await page.waitForSelector('#login', { state: 'visible', timeout: 10000 });
    await page.fill('#token', 'not-the-token-not-the-token');
    await page.click('#login button');
    await page.waitForFunction(() => /token is missing or wrong/.test(document.querySelector('#error').textContent), null, { timeout: 10000 })
      .catch(() => fail(`${label}: a wrong token is not refused on the page`));
    await page.fill('#token', TOKEN);
    await page.click('#login button');
    const r = await until(page, (t) => t.full?.length === 2 && t.waiting?.length === 1, 10000, `${label}: the rooms`, fail);
    log(`${label}: rooms ${JSON.stringify(r)}`);
    const text = await page.textContent('#use');
    for (const want of [/memory for queued data: [\d.]+ MiB of [\d.]+ MiB/, /connections: \d+ of \d+/, /rooms: 2 of 256/]) {
      if (!want.test(text)) fail(`${label}: the use line lacks ${want}: "${text}"`);
    }
    const wide = await page.evaluate(() => document.documentElement.scrollWidth);
    if (wide > viewport.width) fail(`${label}: the admin page is ${wide} px wide (scrolls sideways)`);
    await page.screenshot({ path: join(OUT, `admin-${label}.png`), fullPage: true });
    await ctx.close();
  }

  // ---- the link the relay prints (#token=…): straight to the table; remove, then close ----
  const ctx = await browser.newContext();
  const page = await ctx.newPage();
  watch(page, 'admin by link', errors);
  await page.goto(`${base}admin#token=${TOKEN}`);
  await until(page, (t) => t.full?.length === 2, 10000, 'the printed link', fail);
  if ((await page.evaluate(() => location.hash)) !== '') fail('the token stays in the address bar');
  await page.click('#rooms tr[data-room="full"] [data-rank="1"] button');
  await until(page, (t) => t.full && !t.full.includes(1), 10000, 'after removing rank 1 of "full"', fail);
  const removed = await waitForFailure(full[1]);
  if (!/removed by the relay's admin/.test(removed)) fail(`the removed tab says "${removed}"`);
  const peer = await waitForFailure(full[0]);
  if (!/rank 1/.test(peer) || !/removed by the relay's admin/.test(peer)) fail(`its peer says "${peer}"`);
  await page.click('#rooms tr[data-room="waiting"] button:has-text("Close room")');
  await until(page, (t) => !t.waiting, 10000, 'after closing "waiting"', fail);
  const closed = await waitForFailure(waiting);
  if (!/room closed by the relay's admin/.test(closed)) fail(`the closed room's tab says "${closed}"`);
  log(`removed: "${removed}"; its peer: "${peer}"; closed: "${closed}"`);
  await ctx.close();
  await classCtx.close();

  // ---- ?relay=: the page's own relay as is; another only if confirmed, and then the CSP ----
  const host = new URL(base).host;
  const linkCtx = await browser.newContext();
  const dialogs = [];
  const open = async (relay, answer) => {
    const p = await linkCtx.newPage();
    p.on('dialog', (d) => { dialogs.push(d.message()); (answer ? d.accept() : d.dismiss()).catch(() => {}); });
    const refused = [];
    p.on('console', (m) => { if (/Content Security Policy/.test(m.text())) refused.push(m.text()); });
    await p.goto(`${base}?room=link-${dialogs.length}-${answer}&world=2&token=${tok()}&relay=${encodeURIComponent(relay)}`);
    return { p, refused };
  };
  const own = await open(`ws://${host}/ws`, false);
  await own.p.waitForFunction(() => window.distgrad && JSON.parse(window.distgrad.state()).rank === 0, null, { timeout: 60000 })
    .catch(() => fail('a link naming the page\'s own relay did not join'));
  if (dialogs.length) fail(`the page's own relay asked: ${dialogs}`);
  const declined = await open('ws://127.0.0.2:9/ws', false);
  const said = await waitForFailure(declined.p);
  if (dialogs.length !== 1 || !/another relay:\s+ws:\/\/127\.0\.0\.2:9\/ws/.test(dialogs[0])) fail(`another relay: the question was ${JSON.stringify(dialogs)}`);
  if (!/not this page's relay .* and not confirmed/.test(said)) fail(`declined: the tab says "${said}"`);
  const accepted = await open('ws://127.0.0.2:9/ws', true);
  const after = await waitForFailure(accepted.p);
  if (dialogs.length !== 2) fail(`accepted: ${dialogs.length} questions`);
  if (!accepted.refused.length) fail(`accepted: the Content-Security-Policy did not refuse the connection (tab: "${after}")`);
  log(`?relay= own: no question; another: asked, declined -> "${said}"; accepted -> blocked by the CSP ("${accepted.refused[0]?.slice(0, 90)}…")`);
  await linkCtx.close();
}, ['--admin-token', TOKEN]);

/** The error a tab shows once it failed ('' if it does not within 15 s). */
async function waitForFailure(page) {
  const t0 = Date.now();
  while (Date.now() - t0 < 15000) {
    const s = await stateOf(page);
    if (s.phase === 'failed') return s.error ?? '';
    await new Promise((res) => setTimeout(res, 200));
  }
  return '';
}
