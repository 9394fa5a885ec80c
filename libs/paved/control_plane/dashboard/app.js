// The control plane's dashboard. Polls GET /dashboard/api/summary with the admin key and acts
// through the control plane's own /v1 endpoints. No framework, no external URL: data reaches
// the page through textContent only (never innerHTML), charts are SVG built here.
"use strict";

(function () {
  const KEY = "paved.adminKey";
  const POLL_MS = 1500;
  const HISTORY = 240; // points kept for the charts (~6 minutes at POLL_MS)
  const SVG = "http://www.w3.org/2000/svg";
  const COLORS = ["#0b5cad", "#d9480f", "#2b8a3e", "#862e9c", "#c2255c", "#5c940d", "#1098ad", "#e67700"];

  const $ = (id) => document.getElementById(id);
  const history = []; // {t, shares: {series: percent}, queue: {model: waiting}}
  const rendered = {}; // section -> the JSON it was last rendered from
  let timer = null;
  let summary = null;

  // ---- key and requests ------------------------------------------------------------------
  function key() { return sessionStorage.getItem(KEY); }

  async function api(method, path, body) {
    const opts = { method, headers: { Authorization: "Bearer " + key() } };
    if (body !== undefined) {
      opts.headers["Content-Type"] = "application/json";
      opts.body = JSON.stringify(body);
    }
    const r = await fetch(path, opts);
    let data = null;
    try { data = await r.json(); } catch (e) { data = null; }
    if (r.status === 401) {
      signOut("The admin key was rejected; sign in again.");
      throw new Error("unauthorized");
    }
    if (!r.ok) {
      const msg = data && data.error ? data.error.message : "HTTP " + r.status;
      throw new Error(msg);
    }
    return data;
  }

  function setStatus(text) { $("status").textContent = text; }
  function toast(text) {
    $("toast").textContent = text;
    clearTimeout(toast.t);
    toast.t = setTimeout(() => { $("toast").textContent = ""; }, 8000);
  }

  function signOut(message) {
    sessionStorage.removeItem(KEY);
    clearTimeout(timer);
    timer = null;
    $("app").hidden = true;
    $("login").hidden = false;
    $("signout").hidden = true;
    $("login-error").textContent = message || "";
    setStatus("Not signed in");
    $("admin-key").focus();
  }

  async function signIn(candidate) {
    sessionStorage.setItem(KEY, candidate);
    try {
      await poll(true);
    } catch (e) {
      if (e.message !== "unauthorized") {
        signOut("Cannot reach the control plane: " + e.message);
      }
      return;
    }
    $("login").hidden = true;
    $("app").hidden = false;
    $("signout").hidden = false;
    $("login-error").textContent = "";
  }

  // ---- DOM helpers -------------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "text") node.textContent = v;
      else if (k === "onclick") node.addEventListener("click", v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return node;
  }
  function td(text, cls) { return el("td", { text: text === null || text === undefined ? "–" : text, class: cls }); }
  function stateCell(state) { return el("td", {}, el("span", { class: "state state-" + state, text: state })); }
  function num(v, digits) { return typeof v === "number" ? v.toFixed(digits === undefined ? 0 : digits) : "–"; }
  function pct(v) { return typeof v === "number" ? Math.round(v * 100) + "%" : "–"; }
  function time(iso) { return iso ? new Date(iso).toLocaleTimeString("en-GB") : "–"; }
  function tick(v) { return Number.isInteger(v) ? String(v) : v.toFixed(1); }

  // Re-render a section only when its data changed: a focused button is not replaced under the user.
  function once(name, data, render) {
    const json = JSON.stringify(data);
    if (rendered[name] === json) return;
    rendered[name] = json;
    render(data);
  }
  function fill(tableId, rows) {
    const body = $(tableId).querySelector("tbody");
    body.replaceChildren(...rows);
  }

  // ---- confirmation dialog -----------------------------------------------------------------
  // Resolves to the values of its inputs on Confirm, null on Cancel or Escape.
  function confirmAction(title, body, inputs) {
    const dialog = $("confirm");
    $("confirm-h").textContent = title;
    $("confirm-body").replaceChildren(...(Array.isArray(body) ? body : [el("p", { text: body })]));
    const extra = (inputs || []).map((inp) => {
      const id = "confirm-in-" + inp.name;
      return [el("label", { for: id, text: inp.label }), el("input", { id, name: inp.name, type: inp.type || "text", value: inp.value, min: inp.min, max: inp.max, required: true })];
    });
    $("confirm-extra").replaceChildren(...extra.flat());
    return new Promise((resolve) => {
      dialog.addEventListener("close", function done() {
        dialog.removeEventListener("close", done);
        if (dialog.returnValue !== "ok") return resolve(null);
        const values = {};
        for (const inp of inputs || []) values[inp.name] = $("confirm-in-" + inp.name).value;
        resolve(values);
      });
      dialog.returnValue = "";
      dialog.showModal();
      (extra.length ? extra[0][1] : $("confirm-cancel")).focus();
    });
  }

  async function act(title, body, run, inputs) {
    const values = await confirmAction(title, body, inputs);
    if (values === null) return;
    try {
      const result = await run(values);
      toast(title + ": done" + (result ? " — " + result : ""));
      await poll(true);
    } catch (e) {
      if (e.message !== "unauthorized") toast(title + " failed: " + e.message);
    }
  }

  // ---- actions -----------------------------------------------------------------------------
  function startRollout(ev) {
    ev.preventDefault();
    const model = $("ro-model").value;
    const version = $("ro-version").value;
    let params;
    try { params = JSON.parse($("ro-params").value || "{}"); } catch (e) {
      toast("Params must be a JSON object: " + e.message);
      return;
    }
    if (!model || !version) { toast("Choose a model and a version first."); return; }
    act("Start rollout", `Roll ${model} forward to version ${version}? Traffic moves through the rollout's phases.`,
      async () => {
        const r = await api("POST", "/v1/rollouts", { model_id: model, version, params });
        return "rollout " + r.id;
      });
  }

  function rollBack(r) {
    act("Roll back", `Abort rollout ${r.id} (${r.model_id} → ${r.to_version})? Traffic returns to ${r.from_version || "nothing"} first.`,
      async () => { await api("POST", `/v1/rollouts/${encodeURIComponent(r.id)}/abort`); return "rollout " + r.id + " rolling back"; });
  }

  function scale(d) {
    act("Scale", `Set the replicas per region of ${d.model_id}@${d.version} (bounds ${d.min_replicas}–${d.max_replicas}).`,
      async (v) => {
        const n = parseInt(v.replicas, 10);
        if (!(n >= 0)) throw new Error("replicas must be a whole number >= 0");
        await api("PATCH", `/v1/deployments/${encodeURIComponent(d.model_id)}/${encodeURIComponent(d.version)}`, { replicas: n });
        return `${d.model_id}@${d.version} to ${n}`;
      },
      [{ name: "replicas", label: "Replicas per region", type: "number", value: d.replicas, min: d.min_replicas, max: d.max_replicas }]);
  }

  function pin(d) {
    act("Pin", `Make ${d.version} the version the bare alias ${d.model_id} follows?`,
      async () => {
        await api("PUT", `/v1/models/${encodeURIComponent(d.model_id)}/current`, { version: d.version });
        return `${d.model_id} follows ${d.version}`;
      });
  }

  async function gc() {
    let plan;
    try { plan = await api("POST", "/v1/gc", { dry_run: true }); } catch (e) {
      if (e.message !== "unauthorized") toast("GC dry run failed: " + e.message);
      return;
    }
    if (!plan.removed.length) { toast("Garbage collection: nothing to remove under the default policy."); return; }
    const list = el("ul", {}, ...plan.removed.map((x) => el("li", { text: `${x.model_id}@${x.version}: ${x.reason}` })));
    act("Garbage-collect", [el("p", { text: "Remove these inactive versioned deployments?" }), list],
      async () => { const r = await api("POST", "/v1/gc", { dry_run: false }); return r.removed.length + " removed"; });
  }

  // ---- rendering ---------------------------------------------------------------------------
  // A link to the model's recorded series in Prometheus (when the control plane knows one).
  function graphsCell(model) {
    const link = summary && summary.prometheus && summary.prometheus.graphs ? summary.prometheus.graphs[model] : null;
    if (!link || !/^https?:\/\//.test(link)) return td(null);
    return el("td", {}, el("a", { href: link, target: "_blank", rel: "noopener noreferrer", "aria-label": `Graphs of ${model} in Prometheus`, text: "Graphs" }));
  }
  function renderDeployments(deployments) {
    fill("deployments", deployments.map((d) => {
      const desired = Object.entries(d.desired || {}).map(([r, n]) => `${r}: ${n}`).join(", ") || "–";
      const buttons = [el("button", { type: "button", "aria-label": `Scale ${d.model_id}@${d.version}`, onclick: () => scale(d), text: "Scale…" })];
      if (d.strategy === "versioned" && d.state === "active" && !d.current) {
        buttons.push(el("button", { type: "button", "aria-label": `Pin ${d.model_id} to ${d.version}`, onclick: () => pin(d), text: "Pin…" }));
      }
      return el("tr", { "data-model": d.model_id, "data-version": d.version },
        td(d.model_id), td(d.version + (d.current ? " (current)" : "")), td(d.strategy), stateCell(d.state),
        td(desired), td(`${d.min_replicas}–${d.max_replicas}`), td(!(d.autoscale && d.autoscale.enabled) ? "off"
          : d.autoscale.scale_to_zero_after_s ? `on, to zero after ${d.autoscale.scale_to_zero_after_s} s idle` : "on"),
        el("td", {}, ...buttons), graphsCell(d.model_id));
    }));
    // The rollout form: models, and the versions of the chosen model that are not serving.
    const models = [...new Set(deployments.map((d) => d.model_id))].sort();
    const sel = $("ro-model");
    const chosen = sel.value;
    sel.replaceChildren(...models.map((m) => el("option", { value: m, text: m })));
    if (models.includes(chosen)) sel.value = chosen;
    renderVersions();
  }

  function renderVersions() {
    const model = $("ro-model").value;
    const versions = (summary ? summary.deployments : []).filter((d) => d.model_id === model && d.state !== "active").map((d) => d.version);
    const sel = $("ro-version");
    const chosen = sel.value;
    sel.replaceChildren(...versions.map((v) => el("option", { value: v, text: v })));
    if (versions.includes(chosen)) sel.value = chosen;
  }

  function newWeight(r) {
    const regions = (r.state && r.state.regions) || {};
    const parts = Object.entries(regions).map(([name, rs]) => `${name}: ${rs.weight === null || rs.weight === undefined ? "–" : rs.weight + "%"}`);
    return parts.join(", ") || "–";
  }

  function renderRollouts(rollouts) {
    fill("rollouts", rollouts.map((r) => {
      const actions = el("td", {});
      if (r.status === "running") {
        actions.append(el("button", { type: "button", class: "danger", "aria-label": `Roll back rollout ${r.id}`, onclick: () => rollBack(r), text: "Roll back…" }));
      }
      return el("tr", { "data-rollout": r.id, "data-status": r.status, "data-phase": r.phase },
        td(r.id), td(r.model_id), td(`${r.from_version || "(none)"} → ${r.to_version}`), stateCell(r.status),
        td(r.phase), td(newWeight(r)), td(r.reason), actions);
    }));
  }

  function renderRolloutAudit(s) {
    const latest = s.rollouts[0];
    const events = latest ? s.audit.filter((e) => e.rollout_id === latest.id) : [];
    $("rollout-audit").replaceChildren(...(events.length
      ? events.map((e) => el("li", { "data-kind": e.kind, text: `${time(e.at)} ${e.kind}: ${e.message}` }))
      : [el("li", { text: "No rollout yet." })]));
  }

  function renderReplicas(replicas) {
    fill("replicas", replicas.map((r) => {
      const g = r.gauges || {};
      return el("tr", { "data-replica": r.id, "data-state": r.state, title: r.reason || r.url },
        td(`${r.model_id}@${r.version}`), td(r.region), stateCell(r.state),
        td(num(g.waiting), "num"), td(num(g.running), "num"), td(pct(g.kv_usage), "num"));
    }));
  }

  function renderTraffic(traffic) {
    const rows = [];
    const held = (summary && summary.gateway && summary.gateway.held) || {};
    for (const t of traffic) {
      if (t.zero) {
        // Scaled to zero: the alias stays routed with no backend; requests are held while it wakes.
        const n = held[t.alias] || 0;
        const what = t.zero === "waking" ? "waking" : "scaled to zero";
        rows.push(el("tr", { "data-alias": t.alias, "data-zero": t.zero },
          td(t.alias), td("–"), td("–"), td(0, "num"), td("–", "num"),
          el("td", { class: "num" }, el("span", { class: "state state-" + t.zero, text: n ? `${what} (${n} held)` : what }))));
        continue;
      }
      for (const v of t.versions) {
        const share = Math.round(v.share * 100);
        rows.push(el("tr", { "data-alias": t.alias, "data-region": t.region, "data-version": v.version },
          td(t.alias + (t.current ? ` (current ${t.current})` : "")), td(t.region), td(v.version),
          td(v.backends, "num"), td(num(v.weight, 1), "num"),
          el("td", { class: "num share", "data-share": share, text: share + "%" })));
      }
    }
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 6, text: "No routes published yet." })));
    fill("traffic", rows);
  }

  function renderAutoscale(events) {
    $("autoscale").replaceChildren(...(events.length
      ? events.slice().reverse().map((e) => el("li", { text: `${time(e.at)} ${e.message}` }))
      : [el("li", { text: "No autoscaler decisions yet (autoscaling is per deployment)." })]));
  }

  function renderUsage(g) {
    if (!g.configured) {
      $("usage-note").textContent = "No gateway metrics configured (start the control plane with --gateway-metrics URL).";
      fill("tenants", []);
      fill("cache", []);
      fill("queue", []);
      $("hit-rate").textContent = "–";
      return;
    }
    const errs = (g.errors || []).map((e) => `${e.url}: ${e.error}`).join("; ");
    $("usage-note").textContent = `From ${g.urls.length} gateway${g.urls.length === 1 ? "" : "s"}` + (errs ? ` (unreadable: ${errs})` : "") + ".";
    fill("tenants", g.tenants.length ? g.tenants.map((t) => el("tr", { "data-tenant": t.tenant },
      td(t.tenant || "(none)"), td(num(t.requests), "num"), td(num(t.errors), "num")))
      : [el("tr", {}, el("td", { colspan: 3, text: "No requests yet." }))]);
    const cache = Object.entries(g.cache);
    fill("cache", cache.length ? cache.map(([k, v]) => el("tr", { "data-result": k }, td(k), td(num(v), "num")))
      : [el("tr", {}, el("td", { colspan: 2, text: "No cache lookups yet." }))]);
    $("hit-rate").textContent = g.cache_hit_rate === null ? "– (no lookups)" : pct(g.cache_hit_rate);
    const queue = g.queue || [];
    fill("queue", queue.length ? queue.map((q) => el("tr", { "data-model": q.model, "data-tenant": q.tenant },
      td(q.model), td(q.tenant || "(none)"), td(num(q.waiting), "num"),
      td(q.mean_wait_s === null ? "–" : `${q.mean_wait_s.toFixed(3)} s`, "num")))
      : [el("tr", {}, el("td", { colspan: 4, text: "Nothing queued yet." }))]);
  }

  function duration(s) {
    if (typeof s !== "number") return "–";
    if (s < 120) return Math.round(s) + " s";
    if (s < 7200) return Math.round(s / 60) + " min";
    return (s / 3600).toFixed(1) + " h";
  }

  // Completed (green) then failed (red) over the batch's total; the numbers are in the label.
  function progressBar(b) {
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", "0 0 100 10");
    svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("aria-hidden", "true");
    const rect = (cls, x, w) => {
      const r = document.createElementNS(SVG, "rect");
      for (const [k, v] of Object.entries({ class: cls, x, y: 0, width: w, height: 10 })) r.setAttribute(k, String(v));
      svg.append(r);
    };
    // A few failed lines in a large batch still show: at least 2 % of the bar, taken from the
    // completed part.
    const failed = b.failed > 0 ? Math.max(b.failed_share * 100, 2) : 0;
    const done = Math.min(b.completed_share * 100, 100 - failed);
    rect("bar-rest", 0, 100);
    rect("bar-completed", 0, done.toFixed(2));
    rect("bar-failed", done.toFixed(2), failed.toFixed(2));
    const settled = Math.min(b.total, b.completed + b.failed);
    return el("div", {
      class: "progress", role: "progressbar",
      "aria-valuemin": 0, "aria-valuemax": b.total, "aria-valuenow": settled,
      "aria-label": `Batch ${b.id}: ${b.completed} completed, ${b.failed} failed of ${b.total}`,
      "data-completed": b.completed, "data-failed": b.failed, "data-total": b.total,
    }, svg, el("span", { text: Math.floor(b.done * 100) + "%" }),
    b.failed > 0 ? el("span", { class: "error", text: `${b.failed} failed` }) : "");
  }

  function renderBatches(g) {
    if (!g || !g.configured) {
      $("batches-note").textContent = "No gateway admin API configured (start the control plane with --gateway-admin URL or --gateway-metrics URL).";
      fill("batches", [el("tr", {}, el("td", { colspan: 10, text: "No batches to show." }))]);
      return;
    }
    const errs = (g.errors || []).map((e) => `${e.url}: ${e.error}`).join("; ");
    $("batches-note").textContent = `From ${g.urls.length} gateway${g.urls.length === 1 ? "" : "s"}, newest first` + (errs ? ` (unreadable: ${errs})` : "") + ".";
    fill("batches", g.batches.length ? g.batches.map((b) => el("tr", { "data-batch": b.id, "data-status": b.status, "data-tenant": b.tenant },
      td(b.id), td(b.tenant), td(b.model), td(b.endpoint), stateCell(b.status), el("td", {}, progressBar(b)),
      td(b.completed, "num"), td(b.failed, "num"), td(b.total, "num"),
      td(b.age_s !== null ? duration(b.age_s) : (b.finished_at ? "finished " + time(b.finished_at * 1000) : "–"))))
      : [el("tr", {}, el("td", { colspan: 10, text: "No batches yet." }))]);
  }

  function renderAudit(audit) {
    fill("audit", audit.slice(-100).reverse().map((e) => el("tr", { "data-kind": e.kind },
      td(time(e.at)), td(e.kind), td(e.model_id ? `${e.model_id}${e.version ? "@" + e.version : ""}` : "–"), td(e.message))));
  }

  // ---- charts ------------------------------------------------------------------------------
  function record(s) {
    const shares = {};
    for (const t of s.traffic) for (const v of t.versions) shares[`${t.alias} ${t.region} ${v.version}`] = v.share * 100;
    const queue = {};
    for (const r of s.replicas) {
      if (r.state !== "ready") continue;
      queue[r.model_id] = (queue[r.model_id] || 0) + (r.gauges && typeof r.gauges.waiting === "number" ? r.gauges.waiting : 0);
    }
    history.push({ t: Date.now(), shares, queue });
    while (history.length > HISTORY) history.shift();
  }

  // A line chart of named series over `history`; `pick(point)` -> {series: value}.
  function lineChart(container, pick, yMax, unit, label) {
    const W = 560, H = 180, L = 40, R = 8, T = 8, B = 22;
    const names = [...new Set(history.flatMap((p) => Object.keys(pick(p))))].sort();
    const top = Math.max(yMax || 0, ...history.flatMap((p) => Object.values(pick(p))), 1);
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", `0 0 ${W} ${H + 18 * Math.ceil(names.length / 3)}`);
    svg.setAttribute("role", "img");
    const last = history.length ? pick(history[history.length - 1]) : {};
    const now = names.map((n) => `${n}: ${typeof last[n] === "number" ? Math.round(last[n]) + unit : "–"}`).join(", ");
    svg.setAttribute("aria-label", `${label}. Latest: ${now || "no data"}`);
    const add = (tag, attrs, text) => {
      const n = document.createElementNS(SVG, tag);
      for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, String(v));
      if (text !== undefined) n.textContent = text;
      svg.append(n);
      return n;
    };
    const x = (i) => L + (history.length <= 1 ? 0 : (i / (history.length - 1)) * (W - L - R));
    const y = (v) => T + (1 - v / top) * (H - T - B);
    for (const f of [0, 0.5, 1]) {
      add("line", { x1: L, x2: W - R, y1: y(top * f), y2: y(top * f), stroke: "#d0d7de", "stroke-width": 1 });
      add("text", { x: L - 4, y: y(top * f) + 4, "text-anchor": "end", "font-size": 10, fill: "#57606a" }, tick(top * f) + unit);
    }
    if (history.length) {
      const secs = Math.round((history[history.length - 1].t - history[0].t) / 1000);
      add("text", { x: L, y: H - 6, "font-size": 10, fill: "#57606a" }, `-${secs} s`);
      add("text", { x: W - R, y: H - 6, "font-size": 10, fill: "#57606a", "text-anchor": "end" }, "now");
    }
    names.forEach((name, k) => {
      const color = COLORS[k % COLORS.length];
      const pts = [];
      history.forEach((p, i) => { const v = pick(p)[name]; if (typeof v === "number") pts.push([x(i), y(v)]); });
      if (pts.length) {
        add("polyline", { points: pts.map(([a, b]) => `${a.toFixed(1)},${b.toFixed(1)}`).join(" "), fill: "none", stroke: color, "stroke-width": 2, "data-series": name });
        // The latest value as a dot: a series that just appeared is one point, not yet a line.
        const [lx0, ly0] = pts[pts.length - 1];
        add("circle", { cx: lx0.toFixed(1), cy: ly0.toFixed(1), r: 3.5, fill: color });
      }
      const lx = L + (k % 3) * 180, ly = H + 12 + 18 * Math.floor(k / 3);
      add("rect", { x: lx, y: ly - 9, width: 10, height: 10, fill: color });
      add("text", { x: lx + 14, y: ly, "font-size": 11, fill: "#1b1f24" }, name);
    });
    if (!names.length) add("text", { x: L + 8, y: H / 2, "font-size": 12, fill: "#57606a" }, "No data yet.");
    container.replaceChildren(svg);
  }

  function renderCharts() {
    lineChart($("weights-chart"), (p) => p.shares, 100, "%", "Traffic share per alias, region and version");
    lineChart($("queue-chart"), (p) => p.queue, 1, "", "Requests waiting per model");
  }

  // ---- the poll loop -----------------------------------------------------------------------
  async function poll(throwErrors) {
    clearTimeout(timer);
    try {
      const s = await api("GET", "/dashboard/api/summary");
      summary = s;
      record(s);
      once("deployments", s.deployments, renderDeployments);
      once("rollouts", s.rollouts, renderRollouts);
      once("rollout-audit", [s.rollouts[0], s.audit.length && s.audit[s.audit.length - 1].id], () => renderRolloutAudit(s));
      once("replicas", s.replicas, renderReplicas);
      once("traffic", [s.traffic, s.gateway && s.gateway.held], () => renderTraffic(s.traffic));
      once("autoscale", s.autoscale, renderAutoscale);
      once("usage", s.gateway, renderUsage);
      once("batches", s.batches, renderBatches);
      once("audit", s.audit.length ? s.audit[s.audit.length - 1].id : 0, () => renderAudit(s.audit));
      $("routes-rev").textContent = s.routes_revision === null ? "none" : String(s.routes_revision);
      const ce = $("controller-error");
      ce.hidden = !s.controller_error;
      ce.textContent = s.controller_error ? "Controller error: " + s.controller_error : "";
      renderCharts();
      const running = s.rollouts.filter((r) => r.status === "running").length;
      setStatus(`Updated ${new Date().toLocaleTimeString("en-GB")} · ${s.deployments.length} deployments · ${running} rollout${running === 1 ? "" : "s"} running`);
    } catch (e) {
      if (throwErrors) throw e;
      if (e.message === "unauthorized") return;
      setStatus("Control plane unreachable (" + e.message + "); retrying");
    } finally {
      if (key()) timer = setTimeout(() => poll(false), POLL_MS);
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const value = $("admin-key").value.trim();
      $("admin-key").value = "";
      if (value) signIn(value);
    });
    $("signout").addEventListener("click", () => signOut(""));
    $("rollout-form").addEventListener("submit", startRollout);
    $("ro-model").addEventListener("change", renderVersions);
    $("gc-button").addEventListener("click", gc);
    if (key()) signIn(key()); else $("admin-key").focus();
  });
})();
