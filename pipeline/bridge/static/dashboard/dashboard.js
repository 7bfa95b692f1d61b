// The sluice dashboard: polls /dashboard/data (this process's sluice_* samples) every 2 s and turns
// successive snapshots into rates and histogram percentiles over the last 30 s, as Prometheus's rate()
// and histogram_quantile() would. No data is drawn by hand: every chart is a Chart.js chart.
"use strict";

const POLL_MS = 2000;
const WINDOW_S = 30;
const POINTS = 90; // 3 minutes of points
const STAGE_ORDER = ["bridge", "ingest", "guard", "cache", "route", "prefill", "generate", "decode", "postguard", "emit"];
const COLORS = ["#3366cc", "#dc3912", "#ff9900", "#109618", "#990099", "#0099c6", "#dd4477", "#66aa00", "#b82e2e", "#316395"];
const token = new URLSearchParams(location.hash.slice(1)).get("token");
const snapshots = []; // {at, samples}
const state = { polls: 0, errors: [], charts: {} };
window.sluiceDashboard = state;

function samplesOf(snap, name) { return snap.samples[name] || []; }

function total(snap, name, match = () => true) {
  return samplesOf(snap, name).reduce((acc, [labels, v]) => acc + (match(labels) ? v : 0), 0);
}

function byLabel(snap, name, label, match = () => true) {
  const out = {};
  for (const [labels, v] of samplesOf(snap, name)) {
    if (match(labels)) out[labels[label]] = (out[labels[label]] || 0) + v;
  }
  return out;
}

function buckets(snap, base, match = () => true) {
  const out = new Map();
  for (const [labels, v] of samplesOf(snap, base + "_bucket")) {
    if (!match(labels)) continue;
    const le = labels.le === "+Inf" ? Infinity : Number(labels.le);
    out.set(le, (out.get(le) || 0) + v);
  }
  return out;
}

// Prometheus's histogram_quantile over cumulative bucket counts (linear within a bucket).
function quantile(q, counts) {
  const les = [...counts.keys()].sort((a, b) => a - b);
  if (!les.length) return null;
  const n = counts.get(Infinity) ?? counts.get(les[les.length - 1]);
  if (!n) return null;
  const rank = q * n;
  let prevLe = 0, prevCount = 0;
  for (const le of les) {
    const c = counts.get(le);
    if (c >= rank) {
      if (le === Infinity) return prevLe;
      return prevLe + (le - prevLe) * ((rank - prevCount) / Math.max(c - prevCount, 1e-12));
    }
    prevLe = le; prevCount = c;
  }
  return prevLe;
}

function windowStart(now) {
  for (const snap of snapshots) if (now.at - snap.at <= WINDOW_S) return snap;
  return snapshots[0];
}

function deltaBuckets(now, then, base) {
  const a = buckets(now, base), b = then === now ? new Map() : buckets(then, base);
  const out = new Map();
  for (const [le, c] of a) out.set(le, c - (b.get(le) || 0));
  return out;
}

function stageRank(stage) {
  const kind = stage.split(".")[0];
  const i = STAGE_ORDER.indexOf(kind);
  return i < 0 ? STAGE_ORDER.length : i;
}

function sortStages(stages) {
  return [...stages].sort((a, b) => stageRank(a) - stageRank(b) || a.localeCompare(b));
}

function lineChart(id, title, unit) {
  return new Chart(document.getElementById(id), {
    type: "line",
    data: { labels: [], datasets: [] },
    options: {
      animation: false, responsive: true, maintainAspectRatio: false, spanGaps: true,
      scales: { y: { beginAtZero: true, title: { display: !!unit, text: unit } } },
      plugins: { legend: { position: "bottom", labels: { boxWidth: 10 } }, title: { display: false, text: title } },
      elements: { point: { radius: 0 } },
    },
  });
}

function barChart(id, options = {}) {
  return new Chart(document.getElementById(id), {
    type: "bar",
    data: { labels: [], datasets: [] },
    options: Object.assign({
      animation: false, responsive: true, maintainAspectRatio: false,
      plugins: { legend: { position: "bottom", labels: { boxWidth: 10 } } },
      scales: { y: { beginAtZero: true } },
    }, options),
  });
}

function setDataset(chart, label, index, values, extra = {}) {
  let ds = chart.data.datasets.find((d) => d.label === label);
  if (!ds) {
    const color = COLORS[index % COLORS.length];
    ds = Object.assign({ label, data: [], borderColor: color, backgroundColor: color + "cc", borderWidth: 1.5 }, extra);
    chart.data.datasets.push(ds);
  }
  ds.data = values;
}

function pushPoint(chart, time, values) { // values: {label: number|null}
  chart.data.labels.push(time);
  const n = chart.data.labels.length;
  Object.keys(values).forEach((label, i) => {
    let ds = chart.data.datasets.find((d) => d.label === label);
    if (!ds) {
      setDataset(chart, label, chart.data.datasets.length, new Array(n - 1).fill(null));
      ds = chart.data.datasets[chart.data.datasets.length - 1];
    }
  });
  for (const ds of chart.data.datasets) ds.data.push(values[ds.label] ?? null);
  if (n > POINTS) {
    chart.data.labels.shift();
    for (const ds of chart.data.datasets) ds.data.shift();
  }
}

function setup() {
  state.charts = {
    throughput: lineChart("throughput", "requests/s", "req/s"),
    ttft: lineChart("ttftChart", "TTFT", "s"),
    e2e: lineChart("e2eChart", "e2e", "s"),
    stages: barChart("stages", { scales: { x: { stacked: true }, y: { stacked: true, beginAtZero: true, title: { display: true, text: "ms" } } } }),
    lag: barChart("lag"),
    cache: new Chart(document.getElementById("cache"), {
      type: "doughnut", data: { labels: [], datasets: [{ data: [], backgroundColor: COLORS }] },
      options: { animation: false, responsive: true, maintainAspectRatio: false, plugins: { legend: { position: "right" } } },
    }),
    guard: barChart("guard"),
    spend: barChart("spendChart", { indexAxis: "y", scales: { x: { beginAtZero: true } } }),
    waterfall: barChart("waterfall", { indexAxis: "y", scales: { x: { beginAtZero: true, title: { display: true, text: "ms" } } },
                                       plugins: { legend: { display: false } } }),
  };
}

function render(now) {
  const then = windowStart(now);
  const prev = snapshots.length > 1 ? snapshots[snapshots.length - 2] : null;
  const time = new Date(now.at * 1000).toLocaleTimeString();
  const c = state.charts;

  // Throughput: requests finished per second, by outcome, since the previous poll.
  if (prev) {
    const dt = Math.max(now.at - prev.at, 1e-3);
    const a = byLabel(now, "sluice_requests_total", "outcome"), b = byLabel(prev, "sluice_requests_total", "outcome");
    const rates = {};
    for (const k of Object.keys(a)) rates[k] = (a[k] - (b[k] || 0)) / dt;
    rates.all = Object.values(rates).reduce((x, y) => x + y, 0);
    pushPoint(c.throughput, time, rates);
    document.getElementById("rps").textContent = rates.all.toFixed(1);
  }

  // Latency percentiles over the window (cumulative until the window has two snapshots).
  for (const [chart, base, figure] of [[c.ttft, "sluice_time_to_first_token_seconds", "ttft"], [c.e2e, "sluice_e2e_request_latency_seconds", null]]) {
    const counts = deltaBuckets(now, then, base);
    const point = { p50: quantile(0.5, counts), p95: quantile(0.95, counts), p99: quantile(0.99, counts) };
    pushPoint(chart, time, point);
    if (figure) document.getElementById(figure).textContent = point.p50 == null ? "–" : (point.p50 * 1000).toFixed(0) + " ms";
  }

  // Per stage: mean queue and handler time over the window (all time if the window saw nothing).
  const stages = sortStages(new Set([...Object.keys(byLabel(now, "sluice_handle_seconds_count", "stage")),
                                     ...Object.keys(byLabel(now, "sluice_stage_queue_time_seconds_count", "stage"))]));
  const mean = (base, stage) => {
    const m = (l) => l.stage === stage;
    let s = total(now, base + "_sum", m) - (then === now ? 0 : total(then, base + "_sum", m));
    let n = total(now, base + "_count", m) - (then === now ? 0 : total(then, base + "_count", m));
    if (n <= 0) { s = total(now, base + "_sum", m); n = total(now, base + "_count", m); }
    return n > 0 ? (1000 * s) / n : 0;
  };
  c.stages.data.labels = stages;
  setDataset(c.stages, "queue", 0, stages.map((s) => mean("sluice_stage_queue_time_seconds", s)));
  setDataset(c.stages, "handler", 1, stages.map((s) => mean("sluice_handle_seconds", s)));

  const lag = byLabel(now, "sluice_consumer_lag", "stage");
  const lagStages = sortStages(Object.keys(lag));
  c.lag.data.labels = lagStages;
  setDataset(c.lag, "unread messages", 2, lagStages.map((s) => lag[s]));

  const cache = byLabel(now, "sluice_cache_lookups_total", "result");
  c.cache.data.labels = Object.keys(cache);
  c.cache.data.datasets[0].data = Object.values(cache);
  const hits = (cache.hit_exact || 0) + (cache.hit_semantic || 0);
  const lookups = Object.entries(cache).filter(([k]) => k !== "trap").reduce((x, [, v]) => x + v, 0);
  document.getElementById("hit").textContent = lookups ? ((100 * hits) / lookups).toFixed(0) + "%" : "–";

  const guard = byLabel(now, "sluice_guard_refusals_total", "reason");
  c.guard.data.labels = Object.keys(guard);
  setDataset(c.guard, "refusals", 1, Object.values(guard));

  const spend = byLabel(now, "sluice_cost_total", "tenant");
  c.spend.data.labels = Object.keys(spend);
  setDataset(c.spend, "spend", 3, Object.values(spend));
  const spent = Object.values(spend).reduce((x, y) => x + y, 0);
  document.getElementById("spend").textContent = spent ? spent.toPrecision(3) : "0";

  renderWaterfall(now);
  for (const chart of Object.values(c)) chart.update("none");
}

function renderWaterfall(now) {
  const chart = state.charts.waterfall, note = document.getElementById("waterfallNote");
  const trace = now.waterfall;
  if (trace && trace.stages.length) {
    chart.data.labels = [trace.root, ...trace.stages.map((s) => `${s.stage} (${s.messages})`)];
    setDataset(chart, "stage", 0, [[0, trace.total_ms], ...trace.stages.map((s) => [s.start_ms, s.end_ms])]);
    note.textContent = `From the last trace: each stage from its first message to its last (messages handled in brackets); total ${trace.total_ms.toFixed(0)} ms.`;
    return;
  }
  const last = now.requests[now.requests.length - 1];
  if (!last) return;
  let at = 0;
  const rows = Object.entries(last.timings).filter(([k]) => k !== "total").map(([k, ms]) => { const row = [k, at, at + ms]; at += ms; return row; });
  chart.data.labels = rows.map((r) => r[0]);
  setDataset(chart, "stage", 0, rows.map((r) => [r[1], r[2]]));
  note.textContent = "No trace recorded here (sampling off?): the stages' own times from the last answer, laid end to end.";
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const reply = await fetch("/dashboard/data", { headers: token ? { authorization: "Bearer " + token } : {}, cache: "no-store" });
    if (!reply.ok) throw new Error(`/dashboard/data answered ${reply.status}`);
    const snap = await reply.json();
    snapshots.push(snap);
    while (snapshots.length > 2 && snap.at - snapshots[0].at > WINDOW_S + 5) snapshots.shift();
    render(snap);
    state.polls += 1;
    status.textContent = "live · " + new Date(snap.at * 1000).toLocaleTimeString();
    status.className = "";
  } catch (err) {
    state.errors.push(String(err));
    status.textContent = String(err);
    status.className = "error";
  }
}

setup();
poll();
setInterval(poll, POLL_MS);
