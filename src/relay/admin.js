// The relay's admin page: polls /admin/api/status with the admin token (from the link's
// #token=…, or typed in; kept for this tab only) and offers to close a room or remove a member.
'use strict';

const $ = (id) => document.getElementById(id);
let token = sessionStorage.getItem('distgrad-admin-token') || '';
const fromLink = new URLSearchParams(location.hash.slice(1)).get('token');
if (fromLink) {
  token = fromLink;
  sessionStorage.setItem('distgrad-admin-token', token);
  history.replaceState(null, '', location.pathname);
}

const mib = (b) => `${(b / 1048576).toFixed(1)} MiB`;
const age = (s) => (s < 120 ? `${s} s` : s < 7200 ? `${Math.floor(s / 60)} min` : `${Math.floor(s / 3600)} h`);

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

function gauge(label, used, max, shown) {
  const d = el('div');
  d.append(el('div', `${label}: ${shown}`));
  const bar = el('div', undefined, 'bar');
  const fill = el('span', undefined, used > 0.8 * max ? 'high' : '');
  fill.style.width = `${Math.min(100, (100 * used) / Math.max(1, max))}%`;
  bar.append(fill);
  d.append(bar);
  return d;
}

async function call(method, path) {
  const r = await fetch(path, { method, headers: { Authorization: `Bearer ${token}` } });
  const body = await r.text();
  if (r.status === 401) {
    $('login').style.display = 'block';
    throw new Error('the admin token is missing or wrong');
  }
  if (!r.ok) throw new Error(body || `HTTP ${r.status}`);
  return JSON.parse(body);
}

async function act(method, path, what) {
  try {
    await call(method, path);
    $('error').textContent = '';
  } catch (e) {
    $('error').textContent = `${what}: ${e.message}`;
  }
  refresh();
}

function render(s) {
  const use = $('use');
  use.replaceChildren(
    gauge('memory for queued data', s.memory.queued_bytes, s.memory.budget_bytes,
      `${mib(s.memory.queued_bytes)} of ${mib(s.memory.budget_bytes)}`),
    gauge('connections', s.connections.open, s.connections.max,
      `${s.connections.open} of ${s.connections.max} (from ${s.connections.addresses} address${s.connections.addresses === 1 ? '' : 'es'}; at most ${s.connections.max_per_addr} each)`),
    gauge('rooms', s.rooms.open, s.rooms.max, `${s.rooms.open} of ${s.rooms.max} (at most ${s.rooms.max_per_addr} per address)`),
  );
  const body = $('rooms').tBodies[0];
  body.replaceChildren();
  for (const r of s.rooms.list) {
    const tr = el('tr');
    tr.dataset.room = r.name;
    tr.append(el('td', r.name));
    tr.append(el('td', `${r.members.length} of ${r.world}${r.started ? ', running' : ', waiting'}`));
    tr.append(el('td', r.creator ?? '?', 'wide'));
    tr.append(el('td', age(r.age_s), 'num'));
    const ms = el('td');
    for (const m of r.members) {
      const line = el('div');
      line.dataset.rank = m.rank;
      line.append(`rank ${m.rank} · ${m.addr ?? '?'} · ${age(m.age_s)}${m.queued_bytes ? ` · ${mib(m.queued_bytes)} queued` : ''} `);
      const b = el('button', 'Remove');
      b.title = `remove rank ${m.rank} from room ${r.name}`;
      b.onclick = () => act('POST', `/admin/api/remove?room=${encodeURIComponent(r.name)}&rank=${m.rank}`, `removing rank ${m.rank}`);
      line.append(b);
      ms.append(line);
    }
    tr.append(ms);
    const close = el('button', 'Close room');
    close.onclick = () => act('POST', `/admin/api/close?room=${encodeURIComponent(r.name)}`, `closing ${r.name}`);
    const c = el('td');
    c.append(close);
    tr.append(c);
    body.append(tr);
  }
  $('none').hidden = s.rooms.list.length > 0;
}

async function refresh() {
  if (!token) {
    $('login').style.display = 'block';
    return;
  }
  try {
    render(await call('GET', '/admin/api/status'));
    $('login').style.display = 'none';
    if (!$('error').textContent.includes(':')) $('error').textContent = '';
  } catch (e) {
    $('error').textContent = e.message;
  }
}

$('login').onsubmit = (ev) => {
  ev.preventDefault();
  token = $('token').value.trim();
  sessionStorage.setItem('distgrad-admin-token', token);
  $('error').textContent = '';
  refresh();
};

refresh();
setInterval(refresh, 2000);
