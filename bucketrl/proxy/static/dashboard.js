// bucketrl dashboard: polls the proxy's viewer routes and draws line charts on plain <canvas>.
//
// Data: GET /v1/runs/{run}/metrics/recent (every metrics push of every worker, oldest first) and
// GET /v1/runs/{run}/status (queue, versions, workers), GET /v1/pool (every run sharing the generator pool: its
// share, the fraction of the tokens it got, queue, live versions and slots, budget, hold). Queue depth is not a pushed metric, so its chart
// is the history of status polls since the page opened. No libraries, no CDN: the proxy serves this file.
// window.bucketrlDashboard exposes what was drawn (points per chart and per series, polls, last error) for tests.
"use strict";

(() => {
  const POLL_MS = 2000;
  const FIRST_FETCH = 5000; // pushes fetched when the page (re)starts a run
  const NEXT_FETCH = 500; // pushes fetched per poll afterwards (merged by worker and timestamp)
  const MAX_STATUS_SAMPLES = 3600;
  const MAX_VERSION_ROWS = 12;
  const COLORS = ["#4fb3ff", "#ffb84f", "#5fd38d", "#ff6b6b", "#c792ea", "#7fdbca", "#f78c6c", "#c3e88d"];

  // Each series reads one metric from the pushes of one role (optionally one line per worker), or a field
  // of the status history. x is the trainer step or seconds since the first data point.
  // Charts are laid out in two grids, one per x-axis convention (trainer step, wall-clock seconds), so every
  // row of charts shares one x axis whatever the window width.
  const CHARTS = [
    {
      id: "reward", title: "Reward (training batches) and eval reward (held-out)", x: "step", yMin: 0, yMax: 1,
      series: [
        { role: "trainer", metric: "reward", label: "batch mean" },
        { role: "trainer", metric: "reward", label: "rolling mean (10 steps)", rolling: 10, width: 2.5 },
        { role: "trainer", metric: "eval/reward", label: "eval (held-out)", width: 2.5, dots: true },
      ],
    },
    {
      id: "step_time", title: "Step time (s)", x: "step", yMin: 0,
      series: [
        { role: "trainer", metric: "perf/step_s", label: "step" },
        { role: "trainer", metric: "perf/fwd_bwd_s", label: "forward + backward" },
      ],
    },
    {
      id: "staleness", title: "Staleness (versions behind)", x: "step", yMin: 0,
      series: [
        { role: "trainer", metric: "sample/staleness_mean", label: "mean" },
        { role: "trainer", metric: "sample/staleness_max", label: "max", dash: [5, 3] },
      ],
    },
    {
      id: "ratio", title: "Policy ratio and clipped fraction", x: "step",
      series: [
        { role: "trainer", metric: "ratio", label: "ratio" },
        { role: "trainer", metric: "clip_ratio/region_mean", label: "clipped fraction" },
      ],
    },
    {
      id: "length", title: "Completion length (tokens)", x: "step", yMin: 0,
      series: [{ role: "trainer", metric: "completions/mean_length", label: "mean" }],
    },
    {
      // Multi-turn episodes hold environment tokens the forward sees but the loss never trains.
      id: "tokens", title: "Tokens per step: trained vs in context", x: "step", yMin: 0,
      series: [
        { role: "trainer", metric: "train/tokens_context", label: "in context" },
        { role: "trainer", metric: "train/tokens", label: "trained" },
        { role: "trainer", metric: "train/tokens_env", label: "environment", dash: [5, 3] },
      ],
    },
    {
      id: "fractions", title: "Completions truncated (max_new_tokens) and without a reward (fraction)", x: "step",
      yMin: 0, yMax: 1,
      series: [
        { role: "trainer", metric: "completions/clipped_ratio", label: "truncated" },
        { role: "trainer", metric: "reward/unscorable_frac", label: "unscorable" },
      ],
    },
    {
      id: "entropy_kl", title: "Entropy and KL to the base model (per token)", x: "step", yMin: 0,
      series: [
        { role: "trainer", metric: "entropy", label: "entropy" },
        { role: "trainer", metric: "kl", label: "KL (kl_coef > 0)" },
      ],
    },
    {
      id: "wait", title: "Rollout wait (trainer) vs backpressure (generators), s", x: "time", yMin: 0,
      series: [
        { role: "trainer", metric: "perf/rollout_wait_s", label: "trainer rollout wait" },
        { role: "generator", metric: "rollout/backpressure_s", label: "backpressure", perWorker: true },
      ],
    },
    {
      id: "queue", title: "Queue depth (groups)", x: "time", yMin: 0,
      series: [
        { status: "queue", label: "queued groups" },
        { status: "inflight", label: "prompts in flight" },
        { status: "capacity", label: "capacity", dash: [4, 4] },
      ],
    },
    {
      // The run's cost so far over its steps (status.cost, docs/cost.md): list-price estimates unless overridden.
      id: "cost", title: "$ per trainer step (run so far)", x: "time", yMin: 0,
      series: [{ status: "usd_per_step", label: "$ per step" }],
    },
    {
      id: "sync", title: "Weight sync (s)", x: "time", yMin: 0,
      series: [
        { role: "trainer", metric: "perf/weight_sync_s", label: "trainer publish" },
        { role: "generator", metric: "sync/adapter_load_s", label: "adapter load", perWorker: true },
      ],
    },
    {
      id: "throughput", title: "Generator throughput (tokens/s)", x: "time", yMin: 0,
      series: [{ role: "generator", metric: "rollout/generated_tok_s", label: "", perWorker: true }],
    },
    {
      // Multi-turn runs only (run spec env): per episode, since each generator's previous push.
      id: "episodes", title: "Episodes: model turns and tool calls per episode, share of time outside the engine",
      x: "time", yMin: 0,
      series: [
        { role: "generator", metric: "episode/turns_mean", label: "turns", perWorker: true },
        { role: "generator", metric: "episode/tool_calls_mean", label: "tool calls", perWorker: true, dash: [5, 3] },
        { role: "generator", metric: "episode/env_time_frac", label: "env time fraction", perWorker: true, dash: [2, 2] },
      ],
    },
  ];
  const MAX_SAMPLE_ROWS = 12;
  const MAX_EVAL_ROWS = 12;

  const state = {
    run: null,
    token: "",
    pushes: [], // {worker_id, role, ts, step, metrics}, sorted by ts
    seen: new Set(),
    statusHistory: [], // {ts, queue, capacity, inflight}
    fetchedOnce: false,
  };
  const exposed = { charts: {}, series: {}, polls: 0, lastError: null, run: null };
  window.bucketrlDashboard = exposed;

  const $ = (id) => document.getElementById(id);

  // ---- token and run selection ------------------------------------------------------------------

  function initToken() {
    const hash = new URLSearchParams(window.location.hash.slice(1));
    if (hash.get("token")) {
      localStorage.setItem("bucketrl.token", hash.get("token"));
      history.replaceState(null, "", window.location.pathname + window.location.search);
    }
    state.token = localStorage.getItem("bucketrl.token") || "";
    $("token").value = state.token;
    $("token").addEventListener("change", () => {
      state.token = $("token").value.trim();
      localStorage.setItem("bucketrl.token", state.token);
      poll();
    });
  }

  async function api(path) {
    const headers = state.token ? { Authorization: "Bearer " + state.token } : {};
    const resp = await fetch(path, { headers, cache: "no-store" });
    if (!resp.ok) {
      let message = resp.status + " " + resp.statusText;
      try {
        const body = await resp.json();
        if (body && body.error) message = resp.status + " " + body.error.code + ": " + body.error.message;
      } catch (_) { /* not JSON */ }
      throw new Error(message);
    }
    return resp.json();
  }

  async function initRuns() {
    const wanted = new URLSearchParams(window.location.search).get("run");
    let runs = [];
    try {
      runs = (await api("/ui/api/runs")).runs;
    } catch (err) {
      setConn(false, "runs: " + err.message);
    }
    if (wanted && !runs.includes(wanted)) runs.unshift(wanted);
    const select = $("run");
    select.innerHTML = "";
    for (const r of runs) {
      const opt = document.createElement("option");
      opt.value = r;
      opt.textContent = r;
      select.appendChild(opt);
    }
    setRun(wanted || runs[0] || null);
    select.addEventListener("change", () => setRun(select.value));
  }

  function setRun(run) {
    state.run = run;
    exposed.run = run;
    state.pushes = [];
    state.seen = new Set();
    state.statusHistory = [];
    state.fetchedOnce = false;
    if (run) {
      $("run").value = run;
      const url = new URL(window.location.href);
      url.searchParams.set("run", run);
      history.replaceState(null, "", url.pathname + url.search);
    }
  }

  function setConn(ok, text) {
    const el = $("conn");
    el.textContent = text;
    el.className = "conn " + (ok ? "ok" : "err");
  }

  // ---- polling --------------------------------------------------------------------------------------

  let polling = false;
  async function poll() {
    if (polling) return;
    polling = true;
    try {
      if (!state.run) {
        setConn(false, "no run yet (start one, or open /ui?run=<run>)");
        return;
      }
      const base = "/v1/runs/" + encodeURIComponent(state.run);
      const count = state.fetchedOnce ? NEXT_FETCH : FIRST_FETCH;
      // The pool answer is optional (a proxy older than the pool answers 404): the run's own view still draws.
      const [pushes, status, pool] = await Promise.all([
        api(base + "/metrics/recent?count=" + count), api(base + "/status"), api("/v1/pool").catch(() => null),
      ]);
      state.fetchedOnce = true;
      mergePushes(pushes);
      recordStatus(status);
      render(status);
      renderPool(pool, status.pool);
      exposed.polls += 1;
      exposed.lastError = null;
      setConn(true, "live · " + new Date().toLocaleTimeString());
    } catch (err) {
      exposed.lastError = String(err.message || err);
      setConn(false, exposed.lastError);
    } finally {
      polling = false;
    }
  }

  function mergePushes(pushes) {
    let added = false;
    for (const p of pushes) {
      const key = p.worker_id + "|" + p.ts;
      if (state.seen.has(key)) continue;
      state.seen.add(key);
      state.pushes.push(p);
      added = true;
    }
    if (added) state.pushes.sort((a, b) => a.ts - b.ts);
  }

  function recordStatus(s) {
    state.statusHistory.push({
      ts: Date.now() / 1000,
      queue: s.queue.groups,
      capacity: s.queue.capacity,
      inflight: s.prompts_inflight,
      usd_per_step: s.cost ? s.cost.usd_per_step : null,
    });
    if (state.statusHistory.length > MAX_STATUS_SAMPLES) state.statusHistory.shift();
  }

  // ---- series extraction ----------------------------------------------------------------------------

  function t0() {
    let t = Infinity;
    if (state.pushes.length) t = state.pushes[0].ts;
    if (state.statusHistory.length) t = Math.min(t, state.statusHistory[0].ts);
    return Number.isFinite(t) ? t : 0;
  }

  function rolling(points, n) {
    const out = [];
    let sum = 0;
    for (let i = 0; i < points.length; i++) {
      sum += points[i][1];
      if (i >= n) sum -= points[i - n][1];
      out.push([points[i][0], sum / Math.min(i + 1, n)]);
    }
    return out;
  }

  function seriesFor(chart) {
    const origin = t0();
    const out = [];
    for (const s of chart.series) {
      if (s.status) {
        const known = state.statusHistory.filter((h) => h[s.status] !== null && h[s.status] !== undefined);
        out.push({ label: s.label, dash: s.dash, points: known.map((h) => [h.ts - origin, h[s.status]]) });
        continue;
      }
      const byWorker = new Map();
      for (const p of state.pushes) {
        if (p.role !== s.role || !(s.metric in p.metrics)) continue;
        const x = chart.x === "step" ? p.step : p.ts - origin;
        if (x === null || x === undefined) continue;
        const key = s.perWorker ? p.worker_id : "";
        if (!byWorker.has(key)) byWorker.set(key, []);
        byWorker.get(key).push([x, p.metrics[s.metric]]);
      }
      for (const [worker, pts] of byWorker) {
        pts.sort((a, b) => a[0] - b[0]);
        const label = s.perWorker ? [s.label, shortId(worker)].filter(Boolean).join(" ") : s.label;
        out.push({ label, width: s.width, dash: s.dash, dots: s.dots, points: s.rolling ? rolling(pts, s.rolling) : pts });
      }
    }
    return out;
  }

  function shortId(id) {
    return id.length > 22 ? id.slice(0, 10) + "…" + id.slice(-10) : id;
  }

  // ---- drawing --------------------------------------------------------------------------------------

  function niceTicks(lo, hi, count) {
    if (!(hi > lo)) return [lo];
    const raw = (hi - lo) / count;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
    const ticks = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(+v.toPrecision(12));
    return ticks;
  }

  function fmt(v) {
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(1);
    return +v.toPrecision(4) + "";
  }

  function drawChart(canvas, chart, series) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth;
    const h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    const g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const css = getComputedStyle(document.documentElement);
    const muted = css.getPropertyValue("--muted").trim() || "#888";
    const grid = css.getPropertyValue("--grid").trim() || "#333";
    g.font = "11px system-ui, sans-serif";

    const all = series.flatMap((s) => s.points).filter((p) => Number.isFinite(p[0]) && Number.isFinite(p[1]));
    if (!all.length) {
      g.fillStyle = muted;
      g.fillText("waiting for data…", w / 2 - 45, h / 2);
      return 0;
    }
    let [xmin, xmax] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
    let [ymin, ymax] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
    if (chart.yMin !== undefined) ymin = Math.min(ymin, chart.yMin);
    if (chart.yMax !== undefined) ymax = Math.max(ymax, chart.yMax);
    if (xmax === xmin) { xmin -= 1; xmax += 1; }
    if (ymax === ymin) { ymin -= 0.5; ymax += 0.5; }
    const pad = (ymax - ymin) * 0.05;
    if (chart.yMax === undefined) ymax += pad;
    if (chart.yMin === undefined) ymin -= pad;

    const m = { l: 46, r: 10, t: 6, b: 30 };
    const pw = w - m.l - m.r;
    const ph = h - m.t - m.b;
    const X = (x) => m.l + ((x - xmin) / (xmax - xmin)) * pw;
    const Y = (y) => m.t + ph - ((y - ymin) / (ymax - ymin)) * ph;

    g.strokeStyle = grid;
    g.fillStyle = muted;
    g.lineWidth = 1;
    for (const t of niceTicks(ymin, ymax, 4)) {
      g.beginPath(); g.moveTo(m.l, Y(t)); g.lineTo(m.l + pw, Y(t)); g.stroke();
      g.fillText(fmt(t), 4, Y(t) + 4);
    }
    for (const t of niceTicks(xmin, xmax, 6)) {
      g.beginPath(); g.moveTo(X(t), m.t); g.lineTo(X(t), m.t + ph); g.stroke();
      g.fillText(fmt(t), X(t) - 8, m.t + ph + 13);
    }
    g.fillText(chart.x === "step" ? "trainer step" : "seconds", m.l + pw - 60, h - 3);

    let legendX = m.l + 6;
    series.forEach((s, i) => {
      const color = COLORS[i % COLORS.length];
      g.strokeStyle = color;
      g.lineWidth = s.width || 1.5;
      g.setLineDash(s.dash || []);
      g.beginPath();
      s.points.forEach((p, j) => (j ? g.lineTo(X(p[0]), Y(p[1])) : g.moveTo(X(p[0]), Y(p[1]))));
      g.stroke();
      g.fillStyle = color;
      if (s.dots) {
        for (const p of s.points) g.fillRect(X(p[0]) - 3, Y(p[1]) - 3, 6, 6);
      } else if (s.points.length === 1) {
        g.fillRect(X(s.points[0][0]) - 2, Y(s.points[0][1]) - 2, 4, 4);
      }
      g.setLineDash([]);
      if (s.label) {
        g.fillStyle = color;
        g.fillRect(legendX, h - 11, 10, 3);
        g.fillText(s.label, legendX + 13, h - 6);
        legendX += 20 + g.measureText(s.label).width;
      }
    });
    return all.length;
  }

  function ensureCanvases() {
    if ($("charts-step").childElementCount) return;
    for (const chart of CHARTS) {
      const root = $(chart.x === "step" ? "charts-step" : "charts-time");
      const div = document.createElement("div");
      div.className = "chart";
      div.innerHTML = '<h3></h3><canvas id="chart-' + chart.id + '"></canvas>';
      div.querySelector("h3").textContent = chart.title;
      root.appendChild(div);
    }
  }

  // ---- cards and tables -----------------------------------------------------------------------------

  function lastMetric(role, name) {
    for (let i = state.pushes.length - 1; i >= 0; i--) {
      const p = state.pushes[i];
      if (p.role === role && name in p.metrics) return p.metrics[name];
    }
    return undefined;
  }

  function text(id, v) {
    $(id).textContent = v === undefined || v === null ? "–" : v;
  }

  function render(status) {
    ensureCanvases();
    for (const chart of CHARTS) {
      const series = seriesFor(chart);
      exposed.charts[chart.id] = drawChart($("chart-" + chart.id), chart, series);
      exposed.series[chart.id] = Object.fromEntries(series.map((s) => [s.label, s.points.length]));
    }
    const rewards = state.pushes.filter((p) => p.role === "trainer" && "reward" in p.metrics).slice(-10);
    const meanReward = rewards.length ? rewards.reduce((a, p) => a + p.metrics.reward, 0) / rewards.length : undefined;
    text("c-step", status.trainer.step);
    text("c-version", status.latest_version);
    text("c-reward", meanReward === undefined ? undefined : meanReward.toFixed(3));
    const stale = lastMetric("trainer", "sample/staleness_mean");
    text("c-stale", stale === undefined ? undefined : stale.toFixed(2));
    text("c-queue", status.queue.groups + " / " + status.queue.capacity);
    text("c-inflight", status.prompts_inflight);
    text("c-cost", status.cost ? "$" + status.cost.usd_total.toPrecision(3) : undefined);
    // The run's place on a shared generator pool (status.pool, docs/pool.md); null from an older proxy.
    const pool = status.pool;
    const recent = pool && pool.tokens_recent !== undefined ? " (" + pool.tokens_recent + " last 60 s)" : "";
    text("c-pool", pool ? "×" + pool.share + " · " + pool.tokens_generated + " tok" + recent + " · " + pool.hold : undefined);
    let toks = 0;
    for (const w of status.workers) {
      const v = (status.metrics[w.worker_id] || {})["rollout/generated_tok_s"];
      if (w.role === "generator" && Number.isFinite(v)) toks += v;
    }
    text("c-toks", toks ? toks.toFixed(0) : undefined);

    const wbody = $("workers").querySelector("tbody");
    wbody.innerHTML = "";
    for (const w of status.workers) {
      const row = wbody.insertRow();
      const step = (status.metrics[w.worker_id] || {})._step;
      // Notes: a configuration error, the first reward error of each kind (textContent: never markup).
      const notes = Object.entries(w.notes || {}).map(([k, v]) => k + ": " + v).join("\n");
      const cells = [w.worker_id, w.role, w.phase || "–", w.loaded_versions.join(", ") || "–",
        w.last_seen_s.toFixed(1) + " s", step ?? "–", notes];
      for (const v of cells) {
        row.insertCell().textContent = v;
      }
      if (notes) row.classList.add("has-notes");
    }
    const vbody = $("versions").querySelector("tbody");
    vbody.innerHTML = "";
    const newest = [...status.versions].sort((a, b) => b.version - a.version);
    for (const v of newest.slice(0, MAX_VERSION_ROWS)) {
      const row = vbody.insertRow();
      for (const c of ["v" + v.version, v.leases, new Date(v.published_at * 1000).toLocaleTimeString()]) {
        row.insertCell().textContent = c;
      }
    }
    renderEval(status.eval || []);
    renderSamples(status.samples || []);
    if (newest.length > MAX_VERSION_ROWS) {
      const rest = newest.slice(MAX_VERSION_ROWS);
      const leased = rest.reduce((a, v) => a + v.leases, 0);
      vbody.insertRow().insertCell().textContent = "… " + rest.length + " older (" + leased + " leases)";
    }
  }

  function fixed(v, digits) {
    return v === null || v === undefined ? "–" : Number(v).toFixed(digits);
  }

  function pct(v) {
    return v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %";
  }

  function budgetText(r) {
    if (!r || r.budget_tokens === null || r.budget_tokens === undefined) return "none";
    const used = r.budget_used ?? r.tokens_generated / r.budget_tokens;
    return r.tokens_generated + " of " + r.budget_tokens + " (" + (100 * used).toFixed(0) + " %)";
  }

  function slotsText(r) {
    if (r.slots_per_generator === null || r.slots_per_generator === undefined) return "–";
    return r.adapters_loaded + " / " + r.generators * r.slots_per_generator + " (" + r.generators + " gen)";
  }

  // The run's fraction and budget cards, and the table of every run on the pool (shown when two or more share it).
  function renderPool(pool, own) {
    const run = state.run;
    const fracs = pool ? [pool.recent_fraction[run], pool.token_fraction[run]] : [undefined, undefined];
    text("c-fraction", fracs[1] === undefined ? undefined : pct(fracs[0]) + " · " + pct(fracs[1]));
    text("c-budget", own ? budgetText(own) : undefined);
    const runs = pool ? pool.runs : [];
    const body = $("pool").querySelector("tbody");
    body.innerHTML = "";
    for (const r of runs) {
      const row = body.insertRow();
      const queue = r.queue_capacity === null || r.queue_capacity === undefined
        ? r.queue_groups ?? "–" : r.queue_groups + " / " + r.queue_capacity;
      const versions = (r.live_versions || []).map((v) => "v" + v).join(", ") || "–";
      const cells = [r.run, "×" + r.share, pct(pool.recent_fraction[r.run]), pct(pool.token_fraction[r.run]),
        r.tokens_generated, queue, r.prompts_inflight, versions, slotsText(r), budgetText(r), r.hold];
      for (const c of cells) row.insertCell().textContent = c;
      if (r.run === run) row.classList.add("current");
      if (r.hold !== "ok") row.classList.add("held");
    }
    $("pool-section").hidden = runs.length < 2;
    exposed.poolRows = runs.length;
  }

  function renderEval(evals) {
    const body = $("eval").querySelector("tbody");
    body.innerHTML = "";
    for (const e of [...evals].reverse().slice(0, MAX_EVAL_ROWS)) {
      const row = body.insertRow();
      const cells = ["v" + e.version, e.prompts, fixed(e.reward_mean, 3), fixed(e.pass_at_1, 3),
        fixed(e.pass_at_k, 3) + " (k=" + e.k + ")", fixed(e.mean_length, 1), fixed(100 * e.unscorable_frac, 1) + " %"];
      for (const c of cells) row.insertCell().textContent = c;
    }
    $("eval-section").hidden = evals.length === 0;
    exposed.evalRows = Math.min(evals.length, MAX_EVAL_ROWS);
  }

  function renderSamples(samples) {
    const body = $("samples").querySelector("tbody");
    body.innerHTML = "";
    for (const smp of samples.slice(0, MAX_SAMPLE_ROWS)) {
      const row = body.insertRow();
      for (const c of ["v" + smp.version, fixed(smp.reward, 3), smp.prompt, smp.completion]) {
        row.insertCell().textContent = c; // textContent: model output is never parsed as HTML
      }
    }
    exposed.sampleRows = Math.min(samples.length, MAX_SAMPLE_ROWS);
  }

  // ---- start ----------------------------------------------------------------------------------------

  async function start() {
    initToken();
    ensureCanvases();
    await initRuns();
    await poll();
    setInterval(poll, POLL_MS);
    window.addEventListener("resize", () => state.run && poll());
  }

  start();
})();
