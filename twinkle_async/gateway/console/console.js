// The Twinkle Async console: one page, drawn from the gateway's JSON routes.
// Every text from the server is set with textContent, never parsed as HTML.
"use strict";

const S = { kind: null, tenant: "", csrf: "" };
const main = document.getElementById("main");

// -- helpers ------------------------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(el.dataset, value);
    else el.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function show(...nodes) {
  main.replaceChildren(...nodes.filter((node) => node !== null && node !== undefined && node !== false));
}

function toast(text, bad) {
  const el = h("div", { class: bad ? "toast bad" : "toast", role: "status" }, text);
  document.body.append(el);
  setTimeout(() => el.remove(), bad ? 6000 : 2500);
}

async function api(method, url, body) {
  const init = { method, credentials: "same-origin", headers: { "X-Console-CSRF": S.csrf } };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(url, init);
  const text = await response.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (err) { data = { detail: text }; }
  if (!response.ok) {
    if (response.status === 401 && S.kind) { S.kind = null; route(); }
    const detail = data && (data.detail || (data.error && data.error.message));
    throw new Error(detail || `${response.status} ${response.statusText}`);
  }
  return data;
}

const when = (ts) => (ts ? new Date(typeof ts === "number" ? ts * 1000 : ts).toISOString().replace("T", " ").slice(0, 19) : "—");
const num = (x, digits) => (x === null || x === undefined ? "—" : typeof x === "number" ? x.toLocaleString("en-US", { maximumFractionDigits: digits ?? 4 }) : String(x));
function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function table(columns, rows, empty) {
  if (!rows.length) return h("p", { class: "muted" }, empty || "Nothing yet.");
  return h("table", {},
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", { class: c.num ? "num" : null }, c.title)))),
    h("tbody", {}, rows.map((row) => h("tr", {}, columns.map((c) => h("td", { class: c.num ? "num" : null }, c.cell(row)))))));
}

async function guarded(fn) {
  try { await fn(); } catch (err) { show(h("p", { class: "error" }, err.message)); }
}

// -- session ------------------------------------------------------------------------------------

async function loadSession() {
  const response = await fetch("/console/session", { credentials: "same-origin" });
  Object.assign(S, response.ok ? await response.json() : { kind: null });
}

function loginView() {
  const key = h("input", { type: "password", id: "key", autocomplete: "off", placeholder: "tml-… or the admin key" });
  const error = h("p", { class: "error", id: "login-error" });
  const form = h("form", { class: "card login", id: "login" },
    h("h1", {}, "Log in"),
    h("p", { class: "muted" }, "A tenant's API key opens its runs; the admin key opens the operator's view. The key is sent once, in the request body, and kept by no page."),
    key, h("button", { class: "primary", type: "submit" }, "Log in"), error);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.textContent = "";
    const response = await fetch("/console/login", {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json" }, body: JSON.stringify({ key: key.value }),
    });
    const data = await response.json().catch(() => ({}));
    key.value = "";
    if (!response.ok) { error.textContent = data.detail || "login failed"; return; }
    Object.assign(S, data);
    location.hash = S.kind === "admin" ? "#/operator" : "#/runs";
    route();
  });
  show(form);
  key.focus();
}

async function logout() {
  await fetch("/console/logout", { method: "POST", credentials: "same-origin" });
  Object.assign(S, { kind: null, tenant: "", csrf: "" });
  location.hash = "";
  route();
}

function chrome(active) {
  const links = S.kind === "admin"
    ? [["#/operator", "Operator"]]
    : [["#/runs", "Runs"], ["#/checkpoints", "Checkpoints"], ["#/playground", "Playground"], ["#/usage", "Usage"]];
  document.getElementById("nav").replaceChildren(
    ...(S.kind ? links.map(([href, text]) => h("a", { href, class: active === href ? "on" : null }, text)) : []));
  document.getElementById("who").replaceChildren(
    ...(S.kind ? [S.kind === "admin" ? "operator" : `tenant ${S.tenant}`, h("button", { id: "logout", onclick: logout }, "Log out")] : []));
}

// -- tenant: runs -------------------------------------------------------------------------------

async function runsView() {
  const data = await api("GET", "/console/api/runs");
  const status = (r) => h("span", { class: `status-${r.status}` }, r.status);
  show(
    h("h1", {}, "Training runs"),
    data.total > data.shown ? h("p", { class: "muted" }, `The ${data.shown} most recently active of ${data.total}.`) : null,
    table([
      { title: "Run", cell: (r) => h("a", { href: `#/run/${encodeURIComponent(r.run_id)}`, class: "mono" }, r.run_id) },
      { title: "Status", cell: status },
      { title: "Base model", cell: (r) => h("span", { class: "mono" }, r.base_model) },
      { title: "Rank", num: true, cell: (r) => r.rank },
      { title: "Steps", num: true, cell: (r) => r.steps },
      { title: "Last loss", num: true, cell: (r) => num(r.last_loss) },
      { title: "Checkpoints", num: true, cell: (r) => r.checkpoints },
      { title: "Last activity", cell: (r) => when(r.last_activity) },
    ], data.runs, "No training runs yet: train one with the SDK."));
}

let chart = null;

function drawChart(container, entries, metric) {
  const points = entries.filter((e) => e.metrics[metric] !== undefined && e.metrics[metric] !== null)
    .map((e) => [e.step, e.metrics[metric]]);
  container.dataset.metric = metric;
  container.dataset.points = JSON.stringify(points);
  if (chart) { chart.destroy(); chart = null; }
  container.replaceChildren();
  if (!points.length) { container.append(h("p", { class: "muted" }, `No ${metric} recorded yet.`)); return; }
  const width = Math.max(400, container.clientWidth || 900);
  chart = new uPlot({
    width, height: 300,
    scales: { x: { time: false } },
    axes: [{ label: "step (request seq)", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000] }, { label: metric, size: 70 }],
    series: [{ label: "step" }, { label: metric, stroke: "#3d5afe", width: 2, points: { show: points.length < 60 } }],
  }, [points.map((p) => p[0]), points.map((p) => p[1])], container);
}

async function runView(runId) {
  const [run, history, ckpts] = await Promise.all([
    api("GET", `/api/v1/training_runs/${encodeURIComponent(runId)}`),
    api("GET", `/api/v1/training_runs/${encodeURIComponent(runId)}/metrics`),
    api("GET", `/api/v1/training_runs/${encodeURIComponent(runId)}/checkpoints`),
  ]);
  const entries = history.steps;
  const names = [...new Set(entries.flatMap((e) => Object.keys(e.metrics)))].sort();
  const metric = names.includes("loss:sum") ? "loss:sum" : names[0];
  const container = h("div", { class: "chart", id: "metric-chart" });
  const picker = h("select", { id: "metric" }, names.map((n) => h("option", { value: n, selected: n === metric }, n)));
  picker.addEventListener("change", () => drawChart(container, entries, picker.value));
  show(
    h("h1", {}, "Run ", h("span", { class: "mono" }, run.training_run_id)),
    h("div", { class: "card" },
      h("div", { class: "row" },
        h("span", {}, "Base model ", h("span", { class: "mono" }, run.base_model)),
        h("span", { class: "pill" }, `rank ${run.lora_rank}`),
        run.corrupted ? h("span", { class: "error" }, "failed") : null,
        h("span", { class: "muted" }, `last request ${when(run.last_request_time)}`)),
      h("div", { class: "row" }, h("label", {}, "Metric", picker),
        h("span", { class: "muted" }, `${entries.length} entries`)),
      container),
    h("h2", {}, "Checkpoints"),
    checkpointTable(ckpts.checkpoints, () => runView(runId)),
    h("h2", {}, "Latest entries"),
    table([
      { title: "Step", num: true, cell: (e) => e.step },
      { title: "Kind", cell: (e) => e.kind },
      { title: "Time", cell: (e) => when(e.time) },
      { title: "Metrics", cell: (e) => h("span", { class: "mono" }, Object.entries(e.metrics).map(([k, v]) => `${k}=${num(v)}`).join("  ")) },
    ], entries.slice(-20).reverse(), "No metrics yet."));
  drawChart(container, entries, metric);
}

// -- tenant: checkpoints ------------------------------------------------------------------------

function checkpointUrl(c) {
  const [, run, kind, name] = c.tinker_path.match(/^tinker:\/\/([^/]+)\/([^/]+)\/(.+)$/) || [];
  return `/api/v1/training_runs/${encodeURIComponent(run)}/checkpoints/${encodeURIComponent(kind)}/${encodeURIComponent(name)}`;
}

function checkpointTable(ckpts, reload) {
  const act = (label, fn, cls) => h("button", { class: cls, onclick: async () => {
    try { await fn(); toast(`${label}: done`); await reload(); } catch (err) { toast(`${label}: ${err.message}`, true); }
  } }, label);
  const ttlInput = (c) => h("input", { type: "number", min: "1", step: "1", placeholder: "hours", title: "hours from now (empty: never expires)", class: "ttl", dataset: { path: c.tinker_path } });
  return table([
    { title: "Checkpoint", cell: (c) => h("span", { class: "mono" }, c.tinker_path) },
    { title: "Type", cell: (c) => c.checkpoint_type },
    { title: "Size", num: true, cell: (c) => bytes(c.size_bytes) },
    { title: "Saved", cell: (c) => when(c.time) },
    { title: "Expires", cell: (c) => (c.expires_at ? when(c.expires_at) : "never") },
    { title: "Published", cell: (c) => (c.public ? h("span", { class: "pill" }, "public") : "no") },
    { title: "Actions", cell: (c) => {
      const ttl = ttlInput(c);
      return h("div", { class: "actions", dataset: { path: c.tinker_path } },
        c.public ? act("Unpublish", () => api("DELETE", `${checkpointUrl(c)}/publish`))
          : act("Publish", () => api("POST", `${checkpointUrl(c)}/publish`)),
        h("span", { class: "ttl-set" }, ttl, act("Set TTL", () => api("PUT", `${checkpointUrl(c)}/ttl`,
          { ttl_seconds: ttl.value ? Math.round(Number(ttl.value) * 3600) : null }))),
        act("Download", async () => {
          const link = await api("GET", `/console/api/download?path=${encodeURIComponent(c.tinker_path)}`);
          location.assign(link.url);
        }),
        c.checkpoint_type === "sampler" ? h("a", { href: `#/playground/${encodeURIComponent(c.tinker_path)}` }, h("button", {}, "Try")) : null,
        act("Delete", async () => {
          if (!confirm(`Delete ${c.tinker_path}? This cannot be undone.`)) throw new Error("kept");
          await api("DELETE", checkpointUrl(c));
        }, "danger"));
    } },
  ], ckpts, "No checkpoints yet.");
}

async function checkpointsView() {
  const data = await api("GET", "/api/v1/checkpoints?limit=200");
  show(h("h1", {}, "Checkpoints"),
    data.cursor && data.cursor.total_count > data.checkpoints.length
      ? h("p", { class: "muted" }, `The newest ${data.checkpoints.length} of ${data.cursor.total_count}.`) : null,
    checkpointTable(data.checkpoints, checkpointsView));
}

// -- tenant: playground -------------------------------------------------------------------------

async function playgroundView(preset) {
  const models = await api("GET", "/v1/models");
  const ids = models.data.map((m) => m.id);
  if (preset && !ids.includes(preset)) ids.unshift(preset);
  const model = h("select", { id: "pg-model" }, ids.map((id) => h("option", { value: id, selected: id === preset }, id)));
  const mode = h("select", { id: "pg-mode" }, h("option", { value: "completion" }, "completion"), h("option", { value: "chat" }, "chat"));
  const prompt = h("textarea", { id: "pg-prompt", placeholder: "A prompt" });
  const maxTokens = h("input", { id: "pg-max-tokens", type: "number", min: "1", max: "4096", value: "32" });
  const temperature = h("input", { id: "pg-temperature", type: "number", min: "0", max: "2", step: "0.1", value: "0" });
  const answer = h("pre", { class: "answer", id: "pg-answer" });
  const usage = h("p", { class: "muted", id: "pg-usage" });
  const go = h("button", { class: "primary", id: "pg-sample" }, "Sample");
  go.addEventListener("click", async () => {
    go.disabled = true;
    answer.textContent = "…";
    answer.classList.remove("error");
    delete answer.dataset.finish;
    try {
      const chat = mode.value === "chat";
      const body = { model: model.value, max_tokens: Number(maxTokens.value), temperature: Number(temperature.value), stream: true };
      if (chat) body.messages = [{ role: "user", content: prompt.value }]; else body.prompt = prompt.value;
      // streamed: the text appears as the sampler draws it
      let finish = null;
      answer.textContent = "";
      await streamEvents(chat ? "/v1/chat/completions" : "/v1/completions", body, (event) => {
        if (event.error) throw new Error(event.error.message);
        for (const choice of event.choices || []) {
          answer.textContent += (chat ? choice.delta.content : choice.text) || "";
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        if (event.usage) usage.textContent = `${event.usage.prompt_tokens} prompt tokens, ${event.usage.completion_tokens} sampled; finish: ${finish}`;
      });
      answer.dataset.finish = finish;
    } catch (err) {
      answer.textContent = err.message;
      answer.classList.add("error");
    } finally {
      go.disabled = false;
    }
  });
  show(h("h1", {}, "Playground"),
    h("div", { class: "card" },
      h("div", { class: "row" }, h("label", {}, "Model or sampler checkpoint", model), h("label", {}, "Mode", mode),
        h("label", {}, "Max tokens", maxTokens), h("label", {}, "Temperature", temperature)),
      prompt, h("div", { class: "row" }, go), answer, usage));
}

async function streamEvents(url, body, onEvent) {
  const response = await fetch(url, {
    method: "POST", credentials: "same-origin",
    headers: { "X-Console-CSRF": S.csrf, "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  if (!response.ok) {
    const data = await response.json().catch(() => ({}));
    throw new Error(data.detail || `${response.status} ${response.statusText}`);
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    buffered += decoder.decode(value || new Uint8Array(), { stream: !done });
    let end;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      const line = buffered.slice(0, end).trim();
      buffered = buffered.slice(end + 2);
      if (line.startsWith("data: ") && line !== "data: [DONE]") onEvent(JSON.parse(line.slice(6)));
    }
    if (done) return;
  }
}

// -- tenant: usage ------------------------------------------------------------------------------

async function usageView() {
  const data = await api("GET", "/api/v1/usage?days=14");
  const cur = data.currency || "";
  const cost = (x) => `${num(x, 4)} ${cur}`;
  const p = data.prices || {};
  show(h("h1", {}, "Usage"),
    h("p", { class: "muted", id: "prices" },
      `Prices per million tokens: training ${num(p.train)} ${cur}, forward ${num(p.forward)} ${cur}, sampling ${num(p.sample)} ${cur}.`),
    h("h2", {}, "By day"),
    table([
      { title: "Day (UTC)", cell: (d) => d.day },
      { title: "Trained tokens", num: true, cell: (d) => num(d.tokens_trained) },
      { title: "Forward tokens", num: true, cell: (d) => num(d.tokens_forward) },
      { title: "Sampled tokens", num: true, cell: (d) => num(d.sampled_tokens) },
      { title: "Cost", num: true, cell: (d) => cost(d.cost) },
    ], data.days || []),
    h("h2", {}, "By run"),
    data.runs_truncated ? h("p", { class: "muted" }, "The most recently active runs only.") : null,
    h("div", { id: "usage-runs" }, table([
      { title: "Run", cell: (r) => h("a", { href: `#/run/${encodeURIComponent(r.run_id)}`, class: "mono" }, r.run_id) },
      { title: "Base model", cell: (r) => h("span", { class: "mono" }, r.base_model) },
      { title: "Trained tokens", num: true, cell: (r) => num(r.tokens_trained) },
      { title: "Forward tokens", num: true, cell: (r) => num(r.tokens_forward) },
      { title: "Optimizer steps", num: true, cell: (r) => num(r.optim_steps) },
      { title: "Cost", num: true, cell: (r) => cost(r.cost) },
    ], data.runs || [])));
}

// -- operator -----------------------------------------------------------------------------------

let refresher = null;  // the operator's workers table, read again every few seconds

function workersTable(workers) {
  return table([
    { title: "Worker", cell: (w) => h("span", { class: "mono" }, w.worker_id) },
    { title: "Role", cell: (w) => w.role },
    { title: "Base model", cell: (w) => h("span", { class: "mono" }, w.base_model) },
    { title: "Slots used", num: true, cell: (w) => w.slots_used },
    { title: "Slots free", num: true, cell: (w) => w.slots_free },
    { title: "Queue depth", num: true, cell: (w) => w.queue_depth },
    { title: "Tokens/s (1 min)", num: true, cell: (w) => (w.tokens_per_s === null ? "…" : num(w.tokens_per_s, 1)) },
    { title: "State", cell: (w) => (w.stale ? h("span", { class: "error" }, "stale") : "live") },
  ], workers.workers, "No worker has reported in.");
}

async function operatorView() {
  const [workers, tenants, keys, queues, errors] = await Promise.all([
    api("GET", "/console/api/workers"),
    api("GET", "/admin/v1/tenants"),
    api("GET", "/admin/v1/keys"),
    api("GET", "/admin/v1/queues"),
    api("GET", "/console/api/errors"),
  ]);
  const quotas = await Promise.all(tenants.tenants.map((t) => api("GET", `/admin/v1/quotas/${encodeURIComponent(t.name)}`).catch(() => null)));
  let prices = null;
  try { prices = await api("GET", "/admin/v1/prices"); } catch (err) { prices = null; }
  const limits = (q) => (q ? Object.entries(q.limits).map(([k, v]) => `${k}=${v === null ? "∞" : v}${k in q.overrides ? "*" : ""}`).join("  ") : "—");
  show(h("h1", {}, "Operator"),
    h("h2", {}, "Workers"),
    h("div", { id: "workers" }, workersTable(workers)),
    h("h2", {}, "Pools and queues"),
    h("div", { id: "queues" }, table([
      { title: "Pool", cell: (p) => h("span", { class: "mono" }, p.pool) },
      { title: "Backlog (jobs not finished)", num: true, cell: (p) => p.backlog },
    ], queues.pools, "No pools."),
    table([
      { title: "Stream", cell: (s) => s.stream },
      { title: "Messages", num: true, cell: (s) => s.messages },
      { title: "Bytes", num: true, cell: (s) => bytes(s.bytes) },
      { title: "Consumers", num: true, cell: (s) => s.consumers },
    ], queues.streams)),
    h("h2", {}, "Tenants"),
    h("div", { id: "tenants" }, table([
      { title: "Tenant", cell: (t) => t.name },
      { title: "Live keys", num: true, cell: (t) => (t.bootstrap ? "from flags" : t.keys) },
      { title: "Quotas (* set for this tenant)", cell: (t) => h("span", { class: "mono" }, limits(quotas[tenants.tenants.indexOf(t)])) },
    ], tenants.tenants, "No tenants.")),
    h("h2", {}, "Keys"),
    table([
      { title: "Key id", cell: (k) => h("span", { class: "mono" }, k.key_id) },
      { title: "Tenant", cell: (k) => k.tenant },
      { title: "Prefix", cell: (k) => h("span", { class: "mono" }, k.prefix || "") },
      { title: "Label", cell: (k) => k.label || "" },
      { title: "Revoked", cell: (k) => (k.revoked_at ? when(k.revoked_at) : "") },
    ], keys.keys, "No keys."),
    prices ? pricesForm(prices) : null,
    h("h2", {}, "Recent errors"),
    h("div", { id: "errors" }, table([
      { title: "Time", cell: (e) => when(e.time) },
      { title: "Tenant", cell: (e) => e.tenant },
      { title: "Request", cell: (e) => h("span", { class: "mono" }, `${e.request_type} ${e.request_id}`) },
      { title: "Category", cell: (e) => e.category },
      { title: "Error", cell: (e) => e.error },
    ], errors.errors, "No failed requests since this gateway started.")));
  refresher = setInterval(async () => {
    const place = document.getElementById("workers");
    if (!place) return;
    try { place.replaceChildren(workersTable(await api("GET", "/console/api/workers"))); } catch (err) { /* shown at the next look */ }
  }, 5000);
}

function pricesForm(prices) {
  const field = (name, title) => h("label", {}, title, h("input", { type: "number", min: "0", step: "any", id: `price-${name}`, value: prices[name] ?? 0 }));
  const currency = h("input", { id: "price-currency", value: prices.currency || "USD", size: 5 });
  const save = h("button", { class: "primary", id: "price-save" }, "Save prices");
  save.addEventListener("click", async () => {
    const body = { currency: currency.value };
    for (const name of ["train", "forward", "sample"]) body[name] = Number(document.getElementById(`price-${name}`).value);
    try { await api("PUT", "/admin/v1/prices", body); toast("prices saved"); } catch (err) { toast(err.message, true); }
  });
  return h("div", {}, h("h2", {}, "Prices (per million tokens)"),
    h("div", { class: "card row" }, field("train", "Training"), field("forward", "Forward"), field("sample", "Sampling"),
      h("label", {}, "Currency", currency), save));
}

// -- routing ------------------------------------------------------------------------------------

async function route() {
  if (refresher) { clearInterval(refresher); refresher = null; }
  if (!S.kind) { chrome(null); loginView(); return; }
  const hash = location.hash || (S.kind === "admin" ? "#/operator" : "#/runs");
  const [, page, arg] = hash.match(/^#\/([^/]*)\/?(.*)$/) || [];
  const param = arg ? decodeURIComponent(arg) : "";
  chrome(`#/${page === "run" ? "runs" : page}`);
  show(h("p", { class: "muted" }, "Loading…"));
  await guarded(async () => {
    if (S.kind === "admin") return operatorView();
    if (page === "run" && param) return runView(param);
    if (page === "checkpoints") return checkpointsView();
    if (page === "playground") return playgroundView(param);
    if (page === "usage") return usageView();
    return runsView();
  });
  document.body.dataset.ready = hash;
}

window.addEventListener("hashchange", route);
loadSession().then(route);
