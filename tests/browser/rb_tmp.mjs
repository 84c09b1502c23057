import { chromium } from 'playwright-core';
import { startRelay, sleep, stateOf } from './common.mjs';
const BIN = process.argv[2], NET = process.argv[3] ?? 'channel';
const relay = await startRelay(BIN, 'dist');
const browser = await chromium.launch({ executablePath: '/usr/bin/chromium', headless: true, args: ['--no-sandbox'] });
const ctx = await browser.newContext();
const pages = [];
for (let i = 0; i < 4; i++) pages.push(await ctx.newPage());
const url = `http://${relay.host}/?room=rb&world=4&token=0123456789abcdef0123456789abcdef&net=${NET}&device=cpu`;
await Promise.all(pages.map((p) => p.goto(url)));
for (;;) { const st = await Promise.all(pages.map(stateOf)); if (st.every((s) => s.phase === 'ready')) break; await sleep(100); }
for (let k = 0; k < 4; k++) {
  const before = await Promise.all(pages.map(stateOf));
  await pages[0].evaluate(() => window.distgrad.benchRoom());
  for (;;) { const st = await Promise.all(pages.map(stateOf)); if (st.every((s, i) => s.bench_runs === before[i].bench_runs + 1)) break; await sleep(100); }
  const t = JSON.parse(await pages[0].evaluate(() => window.distgrad.benchResult()));
  const s = t.all_reduce_fwd_bwd[0];
  console.log(`rtt ${t.mean_round_trip_ms.toFixed(2)} exchange ${t.exchange_ms.toFixed(2)} small ${s.ms.toFixed(2)} ms = ${s.round_trips.toFixed(1)} rtt = ${s.of_exchange.toFixed(2)} x2 exch; large ${t.all_reduce_fwd_bwd[1].ms.toFixed(1)}`);
}
await browser.close(); relay.proc.kill('SIGINT');
