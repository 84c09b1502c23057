// Shared by the end-to-end scripts: arguments, the relay process, numeric comparison, page state.
import { spawn } from 'node:child_process';
import { createSocket } from 'node:dgram';
import { chromium } from 'playwright-core';

/** `--key value` pairs of the command line as an object. */
export function parseArgs(argv) {
  const out = {};
  argv.forEach((a, i) => { if (a.startsWith('--')) out[a.slice(2)] = argv[i + 1]; });
  return out;
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/**
 * `distgrad relay --static <dist> --client-tokens` on an ephemeral loopback port (`extra`: more
 * flags; the tests open rooms by URL with a token of their own, as a scripted setup may); resolves to
 * {proc, host}.
 */
export function startRelay(bin, dist, extra = []) {
  return new Promise((resolve, reject) => {
    const p = spawn(bin, ['relay', '--addr', '127.0.0.1:0', '--static', dist, '--client-tokens', ...extra], { stdio: ['ignore', 'pipe', 'inherit'] });
    let out = '';
    p.stdout.on('data', (d) => {
      out += d;
      const m = out.match(/listening on ws:\/\/([0-9.:]+)\/ws/);
      if (m) resolve({ proc: p, host: m[1] });
    });
    p.on('exit', (code) => reject(new Error(`relay exited (${code}) before listening: ${out}`)));
  });
}

/** Equal within 1e-5 relative (null = non-finite, equal only to null). */
export function close(a, b) {
  if (a === null || b === null) return a === b;
  return Math.abs(a - b) <= 1e-5 * Math.max(1, Math.abs(a), Math.abs(b));
}

/** The page's `window.distgrad.state()`, parsed ({} before the page has installed it). */
export const stateOf = async (page) => JSON.parse(await page.evaluate(() => (window.distgrad ? window.distgrad.state() : '{}')));

/**
 * Wait until every page's state satisfies `pred` (polled every 100 ms); throws when a tab failed or
 * after `ms` milliseconds, listing `brief(state)` of every tab.
 */
export async function waitFor(pages, pred, ms, what, brief = (s) => s.phase) {
  const t0 = Date.now();
  for (;;) {
    const states = await Promise.all(pages.map(stateOf));
    const bad = states.find((s) => s.phase === 'failed');
    if (bad) throw new Error(`${what}: a tab failed: ${bad.error}`);
    if (states.every(pred)) return states;
    if (Date.now() - t0 > ms) throw new Error(`${what}: not reached within ${ms} ms (${JSON.stringify(states.map(brief))})`);
    await sleep(100);
  }
}

/** Headless Chromium (`$CHROMIUM`, default /usr/bin/chromium) with WebGPU on (SwiftShader here). */
export function launchChromium() {
  return chromium.launch({
    executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium',
    headless: true,
    args: ['--no-sandbox', '--no-first-run', '--disable-background-networking', '--disable-component-update', '--disable-sync', '--enable-unsafe-webgpu'],
  });
}

/**
 * The frame of a check script labelled `tag`: a relay serving `args.dist` (from `args.bin`, with
 * the flags `relayFlags`) and one browser; `body({base, browser, fail, log, errors})` runs the
 * checks (`errors`: where `watch` collects the pages' errors, each a failure). Then everything is
 * closed, `out` (where the screenshots went) is said, and the process exits 1 on any failure.
 */
export async function checkScript(tag, args, out, body, relayFlags = []) {
  const failures = [];
  const errors = [];
  const fail = (m) => { failures.push(m); console.log(`[${tag}] FAIL ${m}`); };
  const log = (m) => console.log(`[${tag}] ${m}`);
  const relay = await startRelay(args.bin, args.dist ?? 'dist', relayFlags);
  const browser = await launchChromium();
  try {
    await body({ base: `http://${relay.host}/`, browser, fail, log, errors });
  } catch (e) {
    fail(e.stack ?? String(e));
  } finally {
    await browser.close();
    relay.proc.kill();
  }
  for (const e of errors) fail(e);
  if (out) log(`screenshots in ${out}`);
  if (failures.length) {
    log(`${failures.length} failure(s)`);
    process.exit(1);
  }
  log('all checks passed');
}

/** Collect `page`'s uncaught exceptions and console errors into `errors`, labelled `name`. */
export function watch(page, name, errors) {
  page.on('pageerror', (e) => errors.push(`${name}: uncaught ${e.message}`));
  page.on('console', (m) => { if (m.type() === 'error') errors.push(`${name}: console error: ${m.text()}`); });
}

/**
 * A minimal STUN server (RFC 5389 Binding only) on a loopback UDP port: answers every Binding
 * request with the sender's address (XOR-MAPPED-ADDRESS) and counts the requests. Resolves to
 * {port, requests(), close()}.
 */
export function startStun() {
  return new Promise((resolve, reject) => {
    const sock = createSocket('udp4');
    let requests = 0;
    sock.on('message', (msg, from) => {
      // Header: type (0x0001 Binding request), length, magic cookie 0x2112A442, transaction id.
      if (msg.length < 20 || msg.readUInt16BE(0) !== 0x0001 || msg.readUInt32BE(4) !== 0x2112a442) return;
      requests += 1;
      const res = Buffer.alloc(32);
      res.writeUInt16BE(0x0101, 0); // Binding success
      res.writeUInt16BE(12, 2); // one attribute of 4 + 8 bytes
      msg.copy(res, 4, 4, 20); // cookie and transaction id
      res.writeUInt16BE(0x0020, 20); // XOR-MAPPED-ADDRESS
      res.writeUInt16BE(8, 22);
      res.writeUInt8(0x01, 25); // IPv4
      res.writeUInt16BE(from.port ^ 0x2112, 26);
      const ip = from.address.split('.').reduce((a, b) => ((a << 8) | Number(b)) >>> 0, 0);
      res.writeUInt32BE((ip ^ 0x2112a442) >>> 0, 28);
      sock.send(res, from.port, from.address);
    });
    sock.on('error', reject);
    sock.bind(0, '127.0.0.1', () => resolve({ port: sock.address().port, requests: () => requests, close: () => sock.close() }));
  });
}

/**
 * Open `lesson` in single-tab mode with n simulated ranks at step 0 (in browser context `ctx`,
 * errors collected into `errors`); resolves to the page once the lesson is shown.
 */
export async function openLesson({ base, errors }, ctx, lesson, n) {
  const page = await ctx.newPage();
  watch(page, `${lesson} n=${n}`, errors);
  await page.goto(`${base}?sim=${n}&lesson=${lesson}&step=0`);
  await waitFor([page], (s) => s.lesson === lesson && s.phase === 'ready' && s.lesson_steps > 0, 120000, `${lesson} at ${n} ranks`);
  return page;
}
