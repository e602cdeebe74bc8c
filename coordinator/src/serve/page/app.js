// charm's page: a chat over /v1/chat/completions and a dashboard over /v1/status.
// Plain script, no dependencies. Model output is only ever put in text nodes.
'use strict';

const $ = (id) => document.getElementById(id);

// ---------- storage ----------

function load(key, fallback) {
  try {
    const v = localStorage.getItem(key);
    return v === null ? fallback : JSON.parse(v);
  } catch (_) {
    return fallback;
  }
}

function save(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch (_) {
    // storage full or disabled: the page still works, it just forgets
  }
}

// ---------- the API, with the key ----------

let apiKey = load('charm.key', '');
let modelName = '';
let keyWaiters = [];

class Unauthorized extends Error {}

async function api(path, init = {}) {
  const headers = Object.assign({ 'Content-Type': 'application/json' }, init.headers || {});
  if (apiKey) headers.Authorization = 'Bearer ' + apiKey;
  const r = await fetch(path, Object.assign({}, init, { headers }));
  if (r.status === 401) {
    askKey(apiKey !== '');
    throw new Unauthorized('API key needed');
  }
  return r;
}

function askKey(wrong) {
  const d = $('key-dialog');
  $('key-error').hidden = !wrong;
  if (!d.open) d.showModal();
  $('key-input').focus();
}

function keyGiven(ev) {
  ev.preventDefault();
  apiKey = $('key-input').value.trim();
  save('charm.key', apiKey);
  $('key-input').value = '';
  $('key-dialog').close();
  start();
  const w = keyWaiters;
  keyWaiters = [];
  w.forEach((f) => f());
}

async function start() {
  try {
    const r = await api('/v1/models');
    const j = await r.json();
    modelName = (j.data && j.data[0] && j.data[0].id) || '';
    $('model-name').textContent = modelName;
    document.body.dataset.ready = 'true';
    route();
  } catch (e) {
    if (!(e instanceof Unauthorized)) $('conn').textContent = 'server unreachable';
  }
}

// ---------- server-sent events over fetch (so the key can go in a header) ----------

async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.search(/\r?\n\r?\n/)) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut).replace(/^\r?\n\r?\n/, '');
      let event = 'message';
      const data = [];
      for (const line of block.split(/\r?\n/)) {
        if (line.startsWith('event:')) event = line.slice(6).trim();
        else if (line.startsWith('data:')) data.push(line.slice(5).replace(/^ /, ''));
      }
      if (data.length && onEvent(event, data.join('\n')) === false) return;
    }
  }
}

// ---------- Markdown, built as elements (never parsed as HTML) ----------

function addText(parent, text) {
  const parts = text.split('\n');
  parts.forEach((p, i) => {
    if (i > 0) parent.appendChild(document.createElement('br'));
    if (p) parent.appendChild(document.createTextNode(p));
  });
}

const INLINE = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*(\S[\s\S]*?)\*\*|\*(\S[^*]*?)\*|\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g;

function inline(parent, text) {
  let last = 0;
  let m;
  const re = new RegExp(INLINE.source, 'g');
  while ((m = re.exec(text)) !== null) {
    addText(parent, text.slice(last, m.index));
    if (m[1]) {
      const c = document.createElement('code');
      c.textContent = m[2];
      parent.appendChild(c);
    } else if (m[3] !== undefined) {
      const b = document.createElement('strong');
      inline(b, m[3]);
      parent.appendChild(b);
    } else if (m[4] !== undefined) {
      const i = document.createElement('em');
      inline(i, m[4]);
      parent.appendChild(i);
    } else {
      const a = document.createElement('a');
      a.href = m[6];
      a.rel = 'noopener noreferrer';
      a.target = '_blank';
      inline(a, m[5]);
      parent.appendChild(a);
    }
    last = re.lastIndex;
  }
  addText(parent, text.slice(last));
}

const LIST_ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/;

function markdown(parent, src) {
  const lines = src.split('\n');
  let i = 0;
  const blockStart = (l) => /^\s*(```|~~~)/.test(l) || /^#{1,6}\s/.test(l) || LIST_ITEM.test(l) || /^\s*>/.test(l);
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*(```+|~~~+)\s*([\w+#.-]*)/);
    if (fence) {
      const code = [];
      i++;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) code.push(lines[i++]);
      i++;
      const pre = document.createElement('pre');
      const c = document.createElement('code');
      if (fence[2]) c.dataset.lang = fence[2];
      c.textContent = code.join('\n');
      pre.appendChild(c);
      parent.appendChild(pre);
      continue;
    }
    if (!line.trim()) {
      i++;
      continue;
    }
    const h = line.match(/^(#{1,6})\s+(.*)$/);
    if (h) {
      const el = document.createElement('h' + Math.min(6, h[1].length + 2));
      inline(el, h[2]);
      parent.appendChild(el);
      i++;
      continue;
    }
    if (/^\s*(---+|\*\*\*+|___+)\s*$/.test(line)) {
      parent.appendChild(document.createElement('hr'));
      i++;
      continue;
    }
    if (/^\s*>/.test(line)) {
      const quoted = [];
      while (i < lines.length && /^\s*>/.test(lines[i])) quoted.push(lines[i++].replace(/^\s*>\s?/, ''));
      const q = document.createElement('blockquote');
      markdown(q, quoted.join('\n'));
      parent.appendChild(q);
      continue;
    }
    const item = line.match(LIST_ITEM);
    if (item) {
      const ordered = /\d/.test(item[1]);
      const list = document.createElement(ordered ? 'ol' : 'ul');
      while (i < lines.length) {
        const m = lines[i].match(LIST_ITEM);
        if (!m || /\d/.test(m[1]) !== ordered) break;
        const li = document.createElement('li');
        inline(li, m[2]);
        list.appendChild(li);
        i++;
      }
      parent.appendChild(list);
      continue;
    }
    const para = [];
    while (i < lines.length && lines[i].trim() && (para.length === 0 || !blockStart(lines[i]))) para.push(lines[i++]);
    const p = document.createElement('p');
    inline(p, para.join('\n'));
    parent.appendChild(p);
  }
}

// ---------- conversations ----------

let conversations = load('charm.conversations', []);
let currentId = load('charm.current', null);
let controller = null;

function defaults() {
  return { system: '', temperature: 0.7, top_p: 1, max_tokens: 512, extra: '' };
}

function settings() {
  return Object.assign(defaults(), load('charm.settings', {}));
}

function current() {
  let c = conversations.find((x) => x.id === currentId);
  if (!c) {
    // (an empty conversation is not kept beside the new one)
    conversations = conversations.filter((x) => x.messages.length > 0);
    c = { id: String(Date.now()) + Math.random().toString(36).slice(2, 6), title: 'New chat', messages: [] };
    conversations.unshift(c);
    currentId = c.id;
    persist();
  }
  return c;
}

function persist() {
  save('charm.conversations', conversations);
  save('charm.current', currentId);
}

function renderConversations() {
  const ul = $('conversations');
  ul.replaceChildren();
  for (const c of conversations) {
    const li = document.createElement('li');
    if (c.id === currentId) li.className = 'current';
    const open = document.createElement('button');
    open.type = 'button';
    open.className = 'open';
    open.textContent = c.title;
    open.addEventListener('click', () => {
      if (controller) return;
      // (an empty conversation left for another is not kept)
      conversations = conversations.filter((x) => x.messages.length > 0 || x.id === c.id);
      currentId = c.id;
      persist();
      renderChat();
    });
    const del = document.createElement('button');
    del.type = 'button';
    del.className = 'delete';
    del.title = 'Delete';
    del.textContent = '\u00d7';
    del.addEventListener('click', () => {
      if (controller) return;
      conversations = conversations.filter((x) => x.id !== c.id);
      if (currentId === c.id) currentId = conversations.length ? conversations[0].id : null;
      persist();
      renderChat();
    });
    li.append(open, del);
    ul.appendChild(li);
  }
}

// The reasoning part of an answer: the server's `reasoning_content`, or a `<think>` block at
// the start of the content.
function splitThink(m) {
  let reasoning = m.reasoning || '';
  let content = m.content || '';
  const t = content.match(/^\s*<think>([\s\S]*?)(<\/think>|$)/);
  if (t) {
    reasoning += t[1];
    content = content.slice(t[0].length);
  }
  return { reasoning: reasoning.trim(), content };
}

function messageElement(m) {
  const div = document.createElement('div');
  div.className = 'msg ' + m.role;
  div.dataset.role = m.role;
  if (m.state) div.dataset.state = m.state;
  fillMessage(div, m);
  return div;
}

function fillMessage(div, m) {
  div.replaceChildren();
  if (m.state) div.dataset.state = m.state;
  if (m.role === 'user') {
    const body = document.createElement('div');
    body.className = 'content';
    addText(body, m.content);
    div.appendChild(body);
    return;
  }
  const { reasoning, content } = splitThink(m);
  if (reasoning) {
    const d = document.createElement('details');
    d.className = 'reasoning';
    const s = document.createElement('summary');
    s.textContent = m.state === 'streaming' && !content ? 'Thinking\u2026' : 'Reasoning';
    const r = document.createElement('div');
    addText(r, reasoning);
    d.append(s, r);
    div.appendChild(d);
  }
  const body = document.createElement('div');
  body.className = 'content';
  markdown(body, content);
  div.appendChild(body);
  const foot = document.createElement('div');
  foot.className = 'stats';
  const parts = [];
  if (m.stats) {
    const st = m.stats;
    if (st.tokens !== undefined) parts.push(st.tokens + ' tokens');
    if (st.tps !== undefined) parts.push(st.tps.toFixed(1) + ' tok/s');
    if (st.ttft !== undefined) parts.push('first token ' + Math.round(st.ttft) + ' ms');
  }
  if (m.dropped) parts.push(m.dropped + ' earlier messages left out to fit the context');
  if (m.state === 'stopped') parts.push('stopped');
  if (m.state === 'error') parts.push('error: ' + (m.error || 'failed'));
  if (m.state === 'streaming') parts.push('\u2026');
  foot.textContent = parts.join(' \u00b7 ');
  div.appendChild(foot);
}

function renderChat() {
  renderConversations();
  const box = $('messages');
  box.replaceChildren();
  const c = current();
  for (const m of c.messages) box.appendChild(messageElement(m));
  box.scrollTop = box.scrollHeight;
}

function busy(on) {
  $('send').disabled = on;
  $('stop').disabled = !on;
  document.body.dataset.busy = on ? 'true' : 'false';
}

async function send(text) {
  const s = settings();
  let extra = {};
  if (s.extra.trim()) {
    try {
      extra = JSON.parse(s.extra);
    } catch (e) {
      showSettingsError('Extra request fields: ' + e.message);
      return;
    }
  }
  const c = current();
  if (!c.messages.length) c.title = text.slice(0, 40);
  const history = [];
  if (s.system.trim()) history.push({ role: 'system', content: s.system });
  for (const m of c.messages) {
    if (m.role === 'user' || (m.role === 'assistant' && m.state !== 'error')) {
      history.push({ role: m.role, content: splitThink(m).content });
    }
  }
  history.push({ role: 'user', content: text });
  c.messages.push({ role: 'user', content: text });
  const a = { role: 'assistant', content: '', reasoning: '', state: 'streaming' };
  c.messages.push(a);
  persist();
  renderChat();
  const el = $('messages').lastElementChild;
  controller = new AbortController();
  busy(true);
  const t0 = performance.now();
  let first = null;
  let usage = null;
  let pending = false;
  const redraw = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      fillMessage(el, a);
      $('messages').scrollTop = $('messages').scrollHeight;
    });
  };
  try {
    const fitted = await fit(history, Number(s.max_tokens) || defaults().max_tokens);
    if (fitted.dropped) a.dropped = fitted.dropped;
    const body = Object.assign(
      {
        model: modelName || undefined,
        messages: history,
        stream: true,
        stream_options: { include_usage: true },
        temperature: Number(s.temperature),
        top_p: Number(s.top_p),
        max_tokens: fitted.max_tokens,
      },
      extra,
    );
    const r = await api('/v1/chat/completions', {
      method: 'POST',
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!r.ok) {
      const j = await r.json().catch(() => null);
      throw new Error((j && j.error && j.error.message) || r.status + ' ' + r.statusText);
    }
    await readEvents(r, (_, data) => {
      if (data === '[DONE]') return false;
      const j = JSON.parse(data);
      if (j.error) throw new Error(j.error.message || 'generation failed');
      if (j.usage) usage = j.usage;
      const d = j.choices && j.choices[0] && j.choices[0].delta;
      if (d) {
        if (d.reasoning_content) a.reasoning += d.reasoning_content;
        if (d.content) a.content += d.content;
        if ((d.content || d.reasoning_content) && first === null) first = performance.now();
        redraw();
      }
      return true;
    });
    a.state = 'done';
  } catch (e) {
    if (e.name === 'AbortError') {
      a.state = 'stopped';
    } else {
      a.state = 'error';
      a.error = e.message;
    }
  }
  const end = performance.now();
  a.stats = {};
  if (first !== null) a.stats.ttft = first - t0;
  if (usage) {
    a.stats.tokens = usage.completion_tokens;
    if (first !== null && usage.completion_tokens > 1 && end > first) {
      a.stats.tps = (usage.completion_tokens - 1) / ((end - first) / 1000);
    }
  }
  controller = null;
  busy(false);
  persist();
  fillMessage(el, a);
}

// The conversation as it fits the model's context (the server counts it, `/tokenize`): while
// less than a quarter of the context (at least 64 tokens, at most `want`) is left for the answer,
// the oldest turn is left out of the request (the page keeps it); max tokens is then `want`
// capped at what is left.
async function fit(history, want) {
  let dropped = 0;
  for (;;) {
    const r = await api('/tokenize', {
      method: 'POST',
      body: JSON.stringify({ model: modelName || undefined, messages: history }),
    });
    if (!r.ok) return { max_tokens: want, dropped };
    const j = await r.json();
    const room = j.max_model_len - j.count;
    const floor = Math.min(want, Math.max(64, Math.floor(j.max_model_len / 4)));
    const first = history.findIndex((m) => m.role !== 'system');
    const last = history.length - 1;
    if (room >= floor || first < 0 || first >= last) {
      return { max_tokens: Math.max(1, Math.min(want, room)), dropped };
    }
    const n = history[first + 1].role === 'assistant' && first + 1 < last ? 2 : 1;
    history.splice(first, n);
    dropped += n;
  }
}

function showSettingsError(text) {
  const e = $('settings-error');
  e.textContent = text;
  e.hidden = !text;
  if (text) $('settings').open = true;
}

function bindSettings() {
  const s = settings();
  const fields = {
    'set-system': 'system',
    'set-temperature': 'temperature',
    'set-top-p': 'top_p',
    'set-max-tokens': 'max_tokens',
    'set-extra': 'extra',
  };
  for (const [id, key] of Object.entries(fields)) {
    $(id).value = s[key];
    $(id).addEventListener('input', () => {
      const now = settings();
      now[key] = $(id).value;
      save('charm.settings', now);
      if (key === 'extra') showSettingsError('');
    });
  }
}

// ---------- dashboard ----------

let statusRun = null;

function bytes(n) {
  if (n === null || n === undefined) return '\u2013';
  const u = ['B', 'KB', 'MB', 'GB', 'TB'];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) {
    n /= 1024;
    i++;
  }
  return (i ? n.toFixed(1) : String(n)) + ' ' + u[i];
}

function fill(dl, rows) {
  dl.replaceChildren();
  for (const [k, v] of rows) {
    const dt = document.createElement('dt');
    dt.textContent = k;
    const dd = document.createElement('dd');
    dd.textContent = v;
    dl.append(dt, dd);
  }
}

const COLOURS = ['#4f9dff', '#f5a623', '#7ed321', '#bd10e0', '#50e3c2', '#d0021b', '#f8e71c', '#9013fe', '#8a8f98'];

function colour(i) {
  return COLOURS[i % COLOURS.length];
}

function showStatus(d) {
  document.body.dataset.statusAt = String(Date.now());
  const pct = (x) => (100 * x).toFixed(1) + '%';
  const m = d.model;
  fill($('d-model'), [
    ['name', m.name],
    ['architecture', m.architecture],
    ['layers (MoE)', m.layers + ' (' + m.moe_layers + ')'],
    ['experts per layer / token', m.experts_per_layer + ' / ' + m.experts_per_token],
    ['context', m.context + ' tokens'],
    ['up for', d.uptime_seconds + ' s'],
  ]);
  const s = d.server;
  const rows = [
    ['requests', s.requests + ' (' + s.cancelled + ' cancelled, ' + s.rejected + ' refused)'],
    ['queue depth', String(s.queue_depth)],
    ['batch', s.batch_size + ' of ' + s.max_batch + ' sequences (peak ' + s.batch_size_peak + ')'],
    ['tokens generated', String(s.generated_tokens)],
    ['time to first token', s.time_to_first_token_ms.toFixed(0) + ' ms mean'],
    ['prefix tokens reused', String(s.prefix_tokens_reused)],
    ['KV log', bytes(s.kv_log_bytes)],
  ];
  if (d.speculative.enabled || d.speculative.drafted > 0) {
    rows.push(['speculative acceptance', pct(d.speculative.acceptance) + ' of ' + d.speculative.drafted + ' drafted']);
  }
  fill($('d-server'), rows);
  const x = d.experts;
  const t = d.throughput;
  const lastRate = t.length ? t[t.length - 1] : null;
  const xr = [
    ['cache hit rate', pct(x.hit_rate) + ' of ' + x.uses + ' uses'],
    ['disk reads', x.disk_reads + ' (' + bytes(x.disk_bytes_read) + ')'],
    ['disk read rate', lastRate ? bytes(Math.round(lastRate.disk_bytes_per_second)) + '/s' : '\u2013'],
    ['expert cache', x.cache_bytes ? bytes(x.cache_bytes) : 'all in RAM'],
    ['streamed from disk', x.streamed ? 'yes' : 'no'],
  ];
  if (x.vram_experts > 0) {
    xr.push(['on the GPU', x.vram_hits + ' uses; ' + x.vram_experts + ' experts in ' + bytes(x.vram_bytes) + ' of VRAM, ' + x.vram_moves + ' moved in']);
  }
  if (d.cluster) {
    xr.push(['computed here (no live holder)', String(d.cluster.local_runs)]);
    xr.push(['placements', String(d.cluster.placements)]);
    xr.push(['bytes on the wire', bytes(d.cluster.wire_bytes)]);
  }
  fill($('d-experts'), xr);
  chart(t);
  workers(d.workers);
  if (d.heat) heat(d.heat);
}

function chart(t) {
  const c = $('d-chart');
  const g = c.getContext('2d');
  g.clearRect(0, 0, c.width, c.height);
  const v = t.map((s) => s.tokens_per_second);
  const max = Math.max(1, ...v);
  g.strokeStyle = '#4f9dff';
  g.lineWidth = 2;
  g.beginPath();
  v.forEach((y, i) => {
    const px = (i / Math.max(1, 59)) * (c.width - 4) + 2;
    const py = c.height - 4 - (y / max) * (c.height - 8);
    if (i === 0) g.moveTo(px, py);
    else g.lineTo(px, py);
  });
  g.stroke();
  const now = v.length ? v[v.length - 1] : 0;
  const mean = v.length ? v.reduce((a, b) => a + b, 0) / v.length : 0;
  $('d-rate').textContent = 'now ' + now.toFixed(1) + ' tok/s, minute mean ' + mean.toFixed(1) + ', peak ' + Math.max(0, ...v).toFixed(1);
}

function workers(list) {
  const tbody = $('d-workers').querySelector('tbody');
  tbody.replaceChildren();
  $('d-no-workers').hidden = list.length > 0;
  $('d-workers').hidden = list.length === 0;
  for (const w of list) {
    const tr = document.createElement('tr');
    tr.dataset.worker = w.name;
    tr.dataset.up = w.up ? 'true' : 'false';
    const ms = (x) => (x === null || x === undefined ? '\u2013' : x.toFixed(2) + ' ms');
    const cells = [
      w.name,
      w.up ? 'up' : 'down' + (w.error ? ': ' + w.error : ''),
      w.addr,
      ms(w.round_trip_ms),
      ms(w.heartbeat_ms),
      String(w.requests),
      String(w.failures),
      bytes(w.bytes_sent) + ' / ' + bytes(w.bytes_received),
      String(w.experts),
      w.ram_bytes ? bytes(w.ram_bytes) : '\u2013',
    ];
    cells.forEach((text, i) => {
      const td = document.createElement('td');
      td.textContent = text;
      if (i === 1) td.className = w.up ? 'up' : 'down';
      tr.appendChild(td);
    });
    tbody.appendChild(tr);
  }
}

let heatData = null;

function heat(h) {
  heatData = h;
  const legend = $('d-legend');
  legend.replaceChildren();
  h.locations.forEach((name, i) => {
    const s = document.createElement('span');
    s.className = 'swatch';
    s.style.background = colour(i);
    const l = document.createElement('span');
    l.textContent = name;
    legend.append(s, l);
  });
  const c = $('d-heat');
  const rows = h.layers.length;
  const cols = rows ? h.layers[0].uses.length : 0;
  if (!rows || !cols) return;
  const cw = Math.max(2, Math.min(24, Math.floor(c.parentElement.clientWidth / cols) || 2));
  const ch = Math.max(3, Math.min(18, Math.floor(480 / rows)));
  c.width = cols * cw;
  c.height = rows * ch;
  c.dataset.cell = cw + 'x' + ch;
  const g = c.getContext('2d');
  g.fillStyle = '#111';
  g.fillRect(0, 0, c.width, c.height);
  h.layers.forEach((l, r) => {
    const max = Math.max(1, ...l.uses);
    l.uses.forEach((u, e) => {
      const where = l.where[e] || [0];
      g.globalAlpha = u ? 0.25 + 0.75 * (Math.log1p(u) / Math.log1p(max)) : 0.08;
      g.fillStyle = colour(where[0]);
      g.fillRect(e * cw, r * ch, cw - (cw > 3 ? 1 : 0), ch - 1);
      if (where.length > 1 && cw >= 4) {
        g.globalAlpha = 1;
        g.fillStyle = '#fff';
        g.fillRect(e * cw, r * ch, Math.max(1, cw / 3), Math.max(1, ch / 3));
      }
    });
  });
  g.globalAlpha = 1;
}

function heatTip(ev) {
  if (!heatData || !heatData.layers.length) return;
  const c = $('d-heat');
  const [cw, ch] = (c.dataset.cell || '1x1').split('x').map(Number);
  const rect = c.getBoundingClientRect();
  const e = Math.floor(((ev.clientX - rect.left) * (c.width / rect.width)) / cw);
  const r = Math.floor(((ev.clientY - rect.top) * (c.height / rect.height)) / ch);
  const l = heatData.layers[r];
  if (!l || e < 0 || e >= l.uses.length) return;
  const at = (l.where[e] || []).map((i) => heatData.locations[i]).join(', ');
  $('d-heat-tip').textContent = 'layer ' + l.layer + (l.mtp ? ' (MTP head)' : '') + ', expert ' + e + ': ' + l.uses[e] + ' picks; on ' + at;
}

async function statusLoop(run) {
  while (statusRun === run) {
    try {
      const r = await api('/v1/status/events', { signal: run.signal });
      if (!r.ok || !r.body) throw new Error('no stream');
      $('conn').textContent = 'live';
      document.body.dataset.statusMode = 'events';
      await readEvents(r, (ev, data) => {
        if (ev === 'status') showStatus(JSON.parse(data));
        return statusRun === run;
      });
    } catch (e) {
      if (run.signal.aborted || e instanceof Unauthorized) return;
    }
    // the stream failed or ended: poll until it can be opened again
    try {
      const r = await api('/v1/status', { signal: run.signal });
      if (r.ok) {
        showStatus(await r.json());
        $('conn').textContent = 'polling';
        document.body.dataset.statusMode = 'polling';
      } else {
        $('conn').textContent = 'status ' + r.status;
      }
    } catch (e) {
      if (run.signal.aborted || e instanceof Unauthorized) return;
      $('conn').textContent = 'server unreachable';
    }
    await new Promise((ok) => setTimeout(ok, 2000));
  }
}

function startStatus() {
  if (statusRun) return;
  statusRun = new AbortController();
  statusLoop(statusRun);
}

function stopStatus() {
  if (statusRun) statusRun.abort();
  statusRun = null;
  $('conn').textContent = '';
}

// ---------- views ----------

function route() {
  const dash = location.hash === '#dashboard';
  $('view-chat').hidden = dash;
  $('view-dashboard').hidden = !dash;
  $('tab-chat').className = dash ? '' : 'active';
  $('tab-dashboard').className = dash ? 'active' : '';
  document.body.dataset.view = dash ? 'dashboard' : 'chat';
  if (dash && document.body.dataset.ready === 'true') startStatus();
  if (!dash) stopStatus();
}

document.addEventListener('DOMContentLoaded', () => {
  bindSettings();
  renderChat();
  $('composer').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const text = $('prompt').value;
    if (!text.trim() || controller) return;
    $('prompt').value = '';
    if (document.body.dataset.ready === 'true') send(text);
    else keyWaiters.push(() => send(text));
  });
  $('prompt').addEventListener('keydown', (ev) => {
    if (ev.key === 'Enter' && !ev.shiftKey) {
      ev.preventDefault();
      $('composer').requestSubmit();
    }
  });
  $('stop').addEventListener('click', () => {
    if (controller) controller.abort();
  });
  $('new-chat').addEventListener('click', () => {
    if (controller) return;
    currentId = null;
    current();
    renderChat();
  });
  $('forget-key').addEventListener('click', () => {
    apiKey = '';
    save('charm.key', '');
    stopStatus();
    document.body.dataset.ready = 'false';
    start();
  });
  $('key-form').addEventListener('submit', keyGiven);
  $('d-heat').addEventListener('mousemove', heatTip);
  window.addEventListener('hashchange', route);
  route();
  start();
});
