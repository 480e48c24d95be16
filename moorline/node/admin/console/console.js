// moorline web console: plain JS, no build step, nothing loaded from elsewhere (docs/console.md).
// Data: GET /v1/me once, then the node's server-sent events (/v1/console/stream) for the overview
// and shards, and the admin API (/v1/sessions, /v1/groups, /v1/drops) when a page is opened.
"use strict";

const state = { me: null, snap: null, history: [], stream: null, page: null, interval: 1 };

// --- helpers ------------------------------------------------------------------------------------
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function fmtNum(n, digits) {
  if (n === null || n === undefined) return "–";
  if (Math.abs(n) >= 1e6) return (n / 1e6).toFixed(1) + "M";
  if (Math.abs(n) >= 1e4) return (n / 1e3).toFixed(1) + "k";
  return digits === undefined ? String(Math.round(n * 10) / 10) : n.toFixed(digits);
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function fmtDuration(s) {
  if (s === null || s === undefined) return "–";
  s = Math.floor(s);
  const d = Math.floor(s / 86400), hh = Math.floor(s % 86400 / 3600), m = Math.floor(s % 3600 / 60);
  if (d) return `${d}d ${hh}h`;
  if (hh) return `${hh}h ${m}m`;
  if (m) return `${m}m ${s % 60}s`;
  return `${s}s`;
}

function fmtAgo(ms) {
  if (!ms) return "–";
  return fmtDuration((Date.now() - ms) / 1000) + " ago";
}

function toast(text, error) {
  const el = document.getElementById("toast");
  el.textContent = text;
  el.className = "toast" + (error ? " error" : "");
  el.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { el.hidden = true; }, 5000);
}

async function api(method, path, send) {
  const headers = { Accept: "application/json" };
  if (send !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, { method, credentials: "same-origin", headers,
    body: send === undefined ? undefined : JSON.stringify(send) });
  let body = null;
  try { body = await resp.json(); } catch (e) { body = null; }
  if (!resp.ok && resp.status !== 202) {
    // the server's refusal in its words: the error, and its reasons when it gives them (a forget's 409)
    const why = body && body.error ? body.error : "";
    const reasons = body && Array.isArray(body.reasons) ? ": " + body.reasons.join("; ") : "";
    const err = new Error(`${method} ${path}: ${resp.status} ${why}${reasons}`);
    err.status = resp.status;
    throw err;
  }
  return body;
}

function replaceRows(tbody, rows, empty, cols) {
  tbody.replaceChildren(...(rows.length ? rows : [h("tr", {}, h("td", { colspan: cols, class: "muted" }, empty))]));
}

// --- sparklines ---------------------------------------------------------------------------------
function sparkline(series, colors, width, height) {
  const svgNS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNS, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  let max = 1;
  for (const s of series) for (const v of s) max = Math.max(max, v);
  series.forEach((s, i) => {
    if (s.length < 2) return;
    const step = width / (s.length - 1);
    const pts = s.map((v, j) => `${(j * step).toFixed(1)},${(height - 2 - (v / max) * (height - 6)).toFixed(1)}`);
    const area = document.createElementNS(svgNS, "path");
    area.setAttribute("d", `M0,${height} L${pts.join(" L")} L${width},${height} Z`);
    area.setAttribute("fill", colors[i]);
    area.setAttribute("fill-opacity", "0.12");
    svg.append(area);
    const line = document.createElementNS(svgNS, "polyline");
    line.setAttribute("points", pts.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", colors[i]);
    line.setAttribute("stroke-width", "1.6");
    line.setAttribute("vector-effect", "non-scaling-stroke");
    svg.append(line);
  });
  return svg;
}

function swatch(color) {
  const b = h("b", {}, "■ ");
  b.style.color = color;  // through the CSSOM: the page's Content-Security-Policy refuses style attributes
  return b;
}

function chartCard(id, label, keys, colors, unit) {
  const pts = state.history;
  const last = pts.length ? pts[pts.length - 1] : null;
  const legend = keys.map((k, i) => h("span", {}, swatch(colors[i]), k, " ",
    last ? fmtNum(last[k]) : "–", "  "));
  return h("div", { class: "card", "data-chart": id },
    h("div", { class: "chart-head" }, h("span", { class: "chart-label" }, label),
      h("span", { class: "chart-value" }, last ? fmtNum(last[keys[0]]) : "–", h("small", {}, " " + unit))),
    sparkline(keys.map((k) => pts.map((p) => p[k] || 0)), colors, 300, 64),
    h("div", { class: "legend" }, legend));
}

// --- pages --------------------------------------------------------------------------------------
function renderOverview() {
  const snap = state.snap;
  if (!snap) return;
  document.getElementById("self-name").textContent = snap.node;
  document.getElementById("meta-leader").textContent =
    `metadata leader: ${snap.metadata_leader || "none"} · ${snap.shards.length} shards`;
  const leaders = {};
  for (const s of snap.shards) if (s.leader) leaders[s.leader] = (leaders[s.leader] || 0) + 1;
  const members = {};
  for (const m of snap.members || []) members[m.name] = m;
  const cards = snap.nodes.map((n) => {
    const up = n.reachable;
    const member = members[n.id];
    const rows = [
      ["state", up ? "up" : "down"],
      ...(member ? [["membership", member.state]] : []),
      ["address", n.address || "–"],
      ...(snap.nodes.some((x) => x.zone) ? [["zone", n.zone || "–"]] : []),
      ["shard leaders", String(leaders[n.id] || 0)],
      ["groups led", String(n.groups_led)],
      ["uptime", n.self ? fmtDuration(snap.uptime_s) : "–"],
      ["disk used", n.self ? fmtBytes(snap.disk_bytes) : "–"],
      ["MQTT clients", n.self ? String(snap.connections) : "–"],
    ];
    return h("div", { class: "card" + (up ? "" : " down"), "data-node": n.id, "data-state": up ? "up" : "down" },
      h("h3", {}, n.id, h("span", { class: "badge " + (up ? "up" : "down") }, up ? "up" : "down"),
        n.self ? h("span", { class: "badge self" }, "this node") : null),
      h("dl", { class: "kv" }, rows.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
      clusterActions(n, member));
  });
  document.getElementById("nodes").replaceChildren(...cards);
  const charts = [
    chartCard("in", "messages in", ["in"], ["#4fb3ff"], "msg/s"),
    chartCard("out", "delivered", ["out"], ["#b48cff"], "msg/s"),
    chartCard("acks", "accepted / refused", ["accepted", "refused"], ["#3ecf8e", "#ff5c5c"], "msg/s"),
    h("div", { class: "card", "data-chart": "p99" },
      h("div", { class: "chart-head" }, h("span", { class: "chart-label" }, "p99 ack latency"),
        h("span", { class: "chart-value" }, snap.p99_ack_ms === null ? "–" : fmtNum(snap.p99_ack_ms),
          h("small", {}, " ms"))),
      h("p", { class: "muted" }, snap.p99_ack_ms === null ? "no acknowledgement in the last minute" : "")),
  ];
  document.getElementById("charts").replaceChildren(...charts);
}

// Cluster actions (admin only, where the member table provides them): drain a live member, forget
// a dead one. Each asks for confirmation in the page (#confirm) before it is sent.
function clusterActions(n, member) {
  if (!state.me || !state.me.admin || !member || member.state === "forgotten" || member.state === "left") return null;
  const buttons = [];
  if (n.reachable) {
    buttons.push(h("button", { class: "danger admin-action", "data-action": "drain", "data-target": n.id,
      onclick: () => clusterAct("POST", "/v1/drain", { node: n.id },
        `Drain ${n.id}? It hands over its leaderships, moves its clients to other nodes and stops (exit 0).` +
        (n.self ? " It serves this console: the page stops updating." : "")) }, "Drain"));
  } else {
    buttons.push(h("button", { class: "danger admin-action", "data-action": "forget", "data-target": n.id,
      onclick: () => clusterAct("POST", `/v1/cluster/members/${encodeURIComponent(n.id)}/forget`, {},
        `Forget ${n.id}? Its replicas are removed from every shard and made elsewhere; ` +
        "it can never rejoin with its data directory.") }, "Forget"));
  }
  return h("div", { class: "actions" }, buttons);
}

function askConfirm(question) {
  const box = document.getElementById("confirm");
  document.getElementById("confirm-text").textContent = question;
  box.hidden = false;
  return new Promise((resolve) => {
    const done = (yes) => { box.hidden = true; resolve(yes); };
    document.getElementById("confirm-yes").onclick = () => done(true);
    document.getElementById("confirm-no").onclick = () => done(false);
  });
}

// The answer stays on the page (#action-result) until the next action: a refusal (a forget that
// would leave a shard without a live majority: 409 with the reasons) is read, not missed.
async function clusterAct(method, path, body, question) {
  if (!(await askConfirm(question))) return;
  const out = document.getElementById("action-result");
  try {
    const r = await api(method, path, body);
    out.textContent = `${method} ${path}: ${JSON.stringify(r)}`;
    out.className = "note good";
    out.dataset.status = "ok";
    toast(`${method} ${path}: ${JSON.stringify(r)}`);
  } catch (e) {
    out.textContent = e.message;
    out.className = "note red";
    out.dataset.status = String(e.status || "error");
    toast(e.message, true);
  }
  out.hidden = false;
}

function renderShards() {
  const snap = state.snap;
  if (!snap) return;
  const up = new Set(snap.nodes.filter((n) => n.reachable).map((n) => n.id));
  let leaderless = 0, below = 0;
  const rows = snap.shards.map((s) => {
    const live = s.voters.filter((v) => up.has(v)).length;
    // below target: the member table says so (voters on members not gone), or voters are down
    const isBelow = s.target !== null && (s.health === "below target" || live < s.target);
    const isBad = !s.leader || isBelow || !s.available;
    if (!s.leader) leaderless++;
    if (isBelow) below++;
    // commit - match per replica: known on the leader's node only ("·" elsewhere)
    const reps = Object.entries(s.replicas).sort().map(([name, r]) => {
      const lag = r.match === null || r.match === undefined ? null : Math.max(0, s.commit - r.match);
      const cls = !up.has(name) ? "red" : lag === 0 ? "lag0" : lag === null ? "muted" : "lagN";
      return h("span", { class: cls }, `${name} ${lag === null ? "·" : lag}  `);
    });
    const mine = Object.values(s.replicas).find((r) => r.applied !== undefined);
    const appliedLag = mine ? Math.max(0, s.commit - mine.applied) : null;
    return h("tr", { class: isBad ? "bad" : "", "data-shard": s.shard, "data-leader": s.leader || "",
      "data-below": isBelow ? "1" : "0", "data-health": s.health || "" },
      h("td", {}, s.shard),
      h("td", { class: s.leader ? "" : "red" }, s.leader || "no leader"),
      h("td", {}, s.voters.join(", ")),
      h("td", {}, s.learners.join(", ") || "–"),
      h("td", { class: isBelow ? "red" : "" }, s.target === null ? "–" : `${live}/${s.target}`),
      h("td", {}, s.term), h("td", {}, s.commit), h("td", { class: "mono" }, reps),
      h("td", { class: appliedLag ? "lagN" : "lag0" }, appliedLag === null ? "–" : appliedLag),
      h("td", {}, fmtNum(s.messages)), h("td", {}, fmtBytes(s.bytes)), h("td", {}, s.low_water),
      h("td", {}, s.next_offset));
  });
  replaceRows(document.querySelector("#shards-table tbody"), rows, "no shards", 13);
  const summary = document.getElementById("shard-summary");
  const parts = [];
  if (leaderless) parts.push(`${leaderless} without a leader`);
  if (below) parts.push(`${below} below their replica target`);
  summary.textContent = parts.length ? parts.join(", ") : "every shard led, every voter up";
  summary.className = parts.length ? "red" : "good";
}

// Connected clients on every node (GET /v1/clients asks the other members over the cluster link);
// the nodes that did not answer are named above the table, never silently left out.
async function loadClients() {
  const q = document.getElementById("client-q").value;
  const tbody = document.querySelector("#clients-table tbody");
  const missing = document.getElementById("client-missing");
  try {
    const page = await api("GET", "/v1/clients?" + new URLSearchParams({ q, limit: "200" }));
    document.getElementById("client-count").textContent =
      `${page.total} client${page.total === 1 ? "" : "s"}${page.total > page.items.length ? ` (first ${page.items.length})` : ""}`;
    const notes = (page.unreachable || []).map((u) => `${u.node}: ${u.error}`);
    if (page.partial && page.partial.length) notes.push(`cut short (too many rows): ${page.partial.join(", ")}`);
    missing.textContent = notes.length ? "Not listed: " + notes.join("; ") : "";
    missing.hidden = !notes.length;
    missing.dataset.nodes = (page.unreachable || []).map((u) => u.node).join(",");
    const rows = page.items.map((c) => h("tr", { "data-client": c.client_id, "data-node": c.node },
      h("td", { class: "mono" }, c.client_id), h("td", {}, c.user || "–"), h("td", {}, c.node),
      h("td", { class: "mono" }, c.address), h("td", {}, c.protocol), h("td", {}, fmtAgo(c.since_ms)),
      h("td", {}, state.me && state.me.admin ? h("button", { class: "danger admin-action", "data-action": "disconnect",
        "data-target": c.client_id, onclick: () => disconnectClient(c) }, "Disconnect") : null)));
    replaceRows(tbody, rows, "no connected clients match", 7);
  } catch (e) {
    replaceRows(tbody, [], String(e.message), 7);
  }
}

async function disconnectClient(c) {
  const question = `Disconnect ${c.client_id} from ${c.node}? Its connection is closed (MQTT 5 clients are ` +
    "sent DISCONNECT 0x98, Administrative action); it may reconnect, and its session stays.";
  if (!(await askConfirm(question))) return;
  try {
    const r = await api("DELETE", "/v1/clients/" + encodeURIComponent(c.client_id));
    toast(`${c.client_id} disconnected on ${r.node}`);
  } catch (e) {
    toast(e.message, true);
  }
  loadClients();
}

async function loadSessions() {
  const q = document.getElementById("session-q").value;
  const connected = document.getElementById("session-connected").checked;
  const params = new URLSearchParams({ q, limit: "200" });
  if (connected) params.set("connected", "true");
  const tbody = document.querySelector("#sessions-table tbody");
  try {
    const page = await api("GET", "/v1/sessions?" + params);
    document.getElementById("session-count").textContent =
      `${page.total} session${page.total === 1 ? "" : "s"}${page.total > page.items.length ? ` (first ${page.items.length})` : ""}`;
    const rows = page.items.map((s) => h("tr", { class: "clickable", "data-client": s.client_id,
      onclick: () => showSession(s.client_id) },
      h("td", { class: "mono" }, s.client_id), h("td", {}, s.user || "–"),
      h("td", { class: s.connected ? "good" : "muted" }, s.connected ? "connected" : "disconnected"),
      h("td", {}, s.owner_node || "–"), h("td", {}, s.epoch), h("td", {}, s.expiry_s + " s"),
      h("td", {}, s.subscriptions), h("td", {}, s.inflight),
      h("td", {}, s.connected ? "now" : fmtAgo(s.last_seen_ms))));
    replaceRows(tbody, rows, "no sessions match", 9);
  } catch (e) {
    replaceRows(tbody, [], String(e.message), 9);
  }
}

async function showSession(cid) {
  const box = document.getElementById("session-detail");
  let s;
  try {
    s = await api("GET", "/v1/sessions/" + encodeURIComponent(cid));
  } catch (e) {
    toast(e.message, true);
    return;
  }
  const subs = s.subscriptions_list.map((x) => h("tr", {}, h("td", { class: "mono" }, x.filter), h("td", {}, x.qos),
    h("td", {}, x.no_local ? "yes" : "no"), h("td", {}, x.subscription_id === null ? "–" : x.subscription_id)));
  const actions = [];
  if (state.me && state.me.admin) {
    if (s.connected) {  // on whichever node serves it: DELETE /v1/clients asks that node
      actions.push(h("button", { class: "danger admin-action", "data-action": "disconnect",
        onclick: () => act("DELETE", "/v1/clients/" + encodeURIComponent(cid),
          `Disconnect client ${cid}? (MQTT 5 DISCONNECT 0x98)`) }, "Disconnect client"));
    }
    actions.push(h("button", { class: "danger admin-action", "data-action": "end-session",
      onclick: () => act("DELETE", "/v1/sessions/" + encodeURIComponent(cid),
        `End session ${cid} as its expiry would (its will is published)?`) }, "End session"));
  }
  box.replaceChildren(
    h("h3", {}, "Session ", h("span", { class: "mono" }, s.client_id)),
    h("dl", { class: "kv narrow" },
      [["user", s.user || "–"], ["state", s.connected ? "connected" : "disconnected"],
        ["owner node", s.owner_node || "–"], ["epoch", s.epoch], ["session shard", s.shard],
        ["expiry", s.expiry_s + " s"], ["owed messages", `${s.owed} (${fmtBytes(s.owed_bytes)})`],
        ["in flight", s.inflight], ["QoS 2 received, unreleased", s.inbound_qos2],
        ["will", s.will ? `${s.will.topic} (delay ${s.will.delay_s} s)` : "–"],
        ["last seen", s.connected ? "now" : fmtAgo(s.last_seen_ms)]]
        .flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, String(v))])),
    h("h3", { class: "spaced" }, "Subscriptions"),
    h("table", { class: "grid" }, h("thead", {}, h("tr", {}, h("th", {}, "filter"), h("th", {}, "QoS"),
      h("th", {}, "no local"), h("th", {}, "subscription id"))), h("tbody", {}, subs)),
    actions.length ? h("div", { class: "actions" }, actions) : null);
  box.dataset.client = s.client_id;
  box.hidden = false;
}

async function act(method, path, question) {
  if (!window.confirm(question)) return;
  try {
    const r = await api(method, path);
    toast(`${method} ${path}: ${JSON.stringify(r)}`);
  } catch (e) {
    toast(e.message, true);
  }
  document.getElementById("session-detail").hidden = true;
  loadSessions();
}

async function loadGroups() {
  const tbody = document.querySelector("#groups-table tbody");
  try {
    const page = await api("GET", "/v1/groups?limit=500");
    const rows = page.items.map((g) => h("tr", { class: g.members.length ? "" : "bad" },
      h("td", {}, g.group), h("td", { class: "mono" }, g.filter),
      h("td", {}, g.members.length ? g.members.join(", ") : "none"),
      h("td", { class: g.backlog > 0 && !g.members.length ? "red" : "" }, g.backlog), h("td", {}, g.in_flight)));
    replaceRows(tbody, rows, "no $share groups", 5);
  } catch (e) {
    replaceRows(tbody, [], e.message, 5);
  }
}

async function loadDrops() {
  const tbody = document.querySelector("#drops-table tbody");
  try {
    const body = await api("GET", "/v1/drops");
    const drops = body.drops.slice(-300).reverse();
    const rows = drops.map((d) => h("tr", {}, h("td", {}, d.reason), h("td", { class: "mono" }, d.guid),
      h("td", {}, d.shard), h("td", {}, d.offset), h("td", { class: "mono" }, d.session || "–"),
      h("td", { class: "mono" }, d.subscription)));
    replaceRows(tbody, rows, "no drops recorded", 6);
  } catch (e) {
    replaceRows(tbody, [], e.message, 6);
  }
}

// --- live stream --------------------------------------------------------------------------------
function startStream() {
  if (state.stream || !state.me || !state.me.admin) return;
  const es = new EventSource("/v1/console/stream");
  state.stream = es;
  const dot = document.getElementById("live");
  es.addEventListener("open", () => { dot.className = "dot on"; });
  es.addEventListener("error", () => {
    dot.className = "dot off";
    if (es.readyState === EventSource.CLOSED) {  // refused (e.g. 429: http.max_console_streams), not retried
      toast("live updates refused by the node (too many consoles open?): reload to try again", true);
      state.stream = null;
    }
  });
  es.addEventListener("snapshot", (ev) => {
    const snap = JSON.parse(ev.data);
    if (snap.history) {
      state.history = snap.history;
      state.interval = snap.interval_s;
    } else if (snap.rates && (!state.history.length || state.history[state.history.length - 1].t !== snap.rates.t)) {
      state.history.push(snap.rates);
      const keep = Math.max(2, Math.round(300 / state.interval));
      if (state.history.length > keep) state.history.splice(0, state.history.length - keep);
    }
    state.snap = snap;
    document.body.dataset.updated = String(snap.t);
    if (state.page === "overview") renderOverview();
    if (state.page === "shards") renderShards();
  });
}

// --- routing ------------------------------------------------------------------------------------
function show(page) {
  const admin = state.me && state.me.admin;
  const adminPages = ["overview", "shards", "groups", "drops"];
  if (!page) page = admin ? "overview" : "sessions";
  if (adminPages.includes(page) && !admin) page = "denied";
  state.page = page;
  for (const el of document.querySelectorAll(".page")) el.hidden = el.id !== "page-" + page;
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.dataset.page === page);
  document.body.dataset.page = page;
  if (page === "overview") renderOverview();
  if (page === "shards") renderShards();
  if (page === "clients") loadClients();
  if (page === "sessions") loadSessions();
  if (page === "groups") loadGroups();
  if (page === "drops") loadDrops();
}

async function main() {
  try {
    state.me = await api("GET", "/v1/me");
  } catch (e) {
    document.getElementById("whoami").textContent = "not signed in";
    toast(e.message, true);
    return;
  }
  document.getElementById("whoami").textContent =
    `${state.me.user || "anonymous"}${state.me.admin ? " (admin)" : ""} @ ${state.me.node}`;
  document.body.dataset.admin = state.me.admin ? "1" : "0";
  if (!state.me.admin) {
    for (const a of document.querySelectorAll("#nav a[data-admin]")) a.remove();
  }
  document.getElementById("client-search").addEventListener("submit", (ev) => { ev.preventDefault(); loadClients(); });
  document.getElementById("session-search").addEventListener("submit", (ev) => { ev.preventDefault(); loadSessions(); });
  window.addEventListener("hashchange", () => show(location.hash.slice(1)));
  startStream();
  show(location.hash.slice(1));
  document.body.dataset.ready = "1";
}

document.addEventListener("DOMContentLoaded", main);
