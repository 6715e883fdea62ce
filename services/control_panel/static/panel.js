// The FlashMoE control panel page: polls the panel's JSON API, draws the charts (uPlot, served
// by the panel from /static/vendor; the page still works, numbers only, without it), the
// per-layer heat map, and the config table whose live fields can be changed with the token.
"use strict";

const state = { chartUpdates: 0, historyPoints: 0, lastTune: null, charts: {} };
window.flashmoePanel = state;

const CHARTS = [
  { id: "rates", title: "Hit rate, stall-free rate, prediction recall", range: [0, 1],
    series: [["hit_rate", "hit rate", "#2563eb"], ["stall_free_rate", "stall-free", "#16a34a"],
             ["recall", "recall", "#9333ea"]] },
  { id: "tokens", title: "Tokens/s", series: [["tokens_per_s", "tokens/s", "#0f766e"]] },
  { id: "ssd", title: "SSD MB/s", series: [["ssd_mb_per_s", "MB/s", "#c2410c"]] },
  { id: "learner", title: "Learner CPU, ms per token",
    series: [["learner_cpu_ms_per_token", "ms/token", "#b45309"]] },
  { id: "drifts", title: "Drift events (total)", series: [["drifts", "drifts", "#be123c"]] },
];
const FIGURES = [["hit_rate", "hit rate", 3], ["stall_free_rate", "stall-free", 3],
                 ["tokens_per_s", "tokens/s", 2], ["ssd_mb_per_s", "SSD MB/s", 1],
                 ["learner_cpu_ms_per_token", "learner ms/token", 2], ["recall", "recall", 3],
                 ["drifts", "drifts", 0], ["policy", "policy"]];

const $ = (sel) => document.querySelector(sel);
const esc = (text) => String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
const hasUPlot = typeof window.uPlot === "function";

function note(el, text, kind) {
  el.hidden = !text;
  el.textContent = text || "";
  el.className = "note" + (kind ? " " + kind : "");
}

async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function format(value, digits) {
  if (value === null || value === undefined) return "–";
  return typeof value === "number" && digits !== undefined ? value.toFixed(digits) : String(value);
}

// --- live figures and charts ---------------------------------------------------------------

function makeCharts() {
  const box = $("#charts");
  for (const spec of CHARTS) {
    const div = document.createElement("div");
    div.className = "chart";
    div.id = "chart-" + spec.id;
    div.innerHTML = `<h3>${spec.title}</h3>`;
    box.appendChild(div);
    if (!hasUPlot) continue;
    const opts = {
      width: 440, height: 190,
      scales: { x: { time: true }, y: spec.range ? { range: spec.range } : { auto: true } },
      series: [{}, ...spec.series.map(([, label, stroke]) => ({ label, stroke, width: 2,
                                                                  spanGaps: false }))],
      legend: { live: false },
    };
    state.charts[spec.id] = new uPlot(opts, [[], ...spec.series.map(() => [])], div);
  }
  if (!hasUPlot) {
    note($("#chart-note"), "The chart library (uPlot) is not installed: run scripts/setup.sh " +
         "(it installs uPlot from npm; the panel serves it, no CDN). Figures are shown as " +
         "numbers only.");
  }
}

async function refreshHistory() {
  const history = await getJSON("/api/history");
  state.historyPoints = history.t.length;
  for (const spec of CHARTS) {
    const data = [history.t, ...spec.series.map(([key]) => history[key])];
    if (state.charts[spec.id]) {
      state.charts[spec.id].setData(data);
    } else {
      const last = history[spec.series[0][0]].slice(-1)[0];
      let p = $("#chart-" + spec.id + " p");
      if (!p) { p = document.createElement("p"); $("#chart-" + spec.id).appendChild(p); }
      p.textContent = "latest: " + format(last, 3);
    }
  }
  state.chartUpdates += 1;
}

async function refreshStats() {
  const stats = await getJSON("/api/stats");
  const up = Object.keys(stats.services), down = Object.keys(stats.unavailable);
  $("#status").textContent = `${up.length} service(s) answering` +
    (stats.tuned && Object.keys(stats.tuned).length ?
     ` · tuned: ${Object.entries(stats.tuned).map(([k, v]) => `${k}=${v}`).join(", ")}` : "");
  $("#services").innerHTML = up.map((s) => `<span class="svc">● ${esc(s)}</span>`).join("") +
    down.map((s) => `<span class="svc down" title="${esc(stats.unavailable[s])}">○ ${esc(s)}` +
                    "</span>").join("");
  $("#figures").innerHTML = FIGURES.map(([key, label, digits]) =>
    `<div class="figure" id="figure-${key}">${label}` +
    `<b>${esc(format(stats.rates[key], digits))}</b></div>`)
    .join("");
}

// --- heat map --------------------------------------------------------------------------------

async function refreshHeatmap() {
  const data = await getJSON("/api/residency");
  const canvas = $("#heatmap");
  if (!data.available) {
    note($("#heatmap-note"), "Residency not reported: " + data.reason);
    canvas.hidden = true;
    return;
  }
  note($("#heatmap-note"), "");
  canvas.hidden = false;
  const rows = data.layers.length, cols = data.experts_per_layer;
  const cell = Math.max(4, Math.min(16, Math.floor(940 / cols)));
  canvas.width = cols * cell + 40;
  canvas.height = rows * cell + 4;
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.font = "9px sans-serif";
  data.popularity.forEach((row, i) => {
    const top = Math.max(...row, 1e-9);
    ctx.fillStyle = "#6b7280";
    ctx.fillText(String(data.layers[i]), 2, i * cell + cell - 2);
    row.forEach((value, j) => {
      const heat = value / top;
      ctx.fillStyle = `rgb(${255 - 200 * heat}, ${255 - 120 * heat}, 255)`;
      ctx.fillRect(36 + j * cell, i * cell + 2, cell - 1, cell - 1);
      if (data.resident[i][j]) {
        ctx.strokeStyle = "#c2410c";
        ctx.strokeRect(36.5 + j * cell, i * cell + 2.5, cell - 2, cell - 2);
      }
    });
  });
}

// --- configuration and tuning ---------------------------------------------------------------

function rangeText(field) {
  if (field.choices) return field.choices.join(" | ");
  if (field.lo !== null && field.hi !== null) return `${field.lo} … ${field.hi}`;
  return field.type;
}

function inputFor(field) {
  let input;
  if (field.choices) {
    input = document.createElement("select");
    for (const choice of field.choices) {
      const option = document.createElement("option");
      option.value = option.textContent = choice;
      option.selected = String(choice) === String(field.value);
      input.appendChild(option);
    }
  } else if (field.type === "bool") {
    input = document.createElement("input");
    input.type = "checkbox";
    input.checked = !!field.value;
  } else {
    input = document.createElement("input");
    input.type = field.type === "int" || field.type === "float" ? "number" : "text";
    if (field.lo !== null) input.min = field.lo;
    if (field.hi !== null) input.max = field.hi;
    if (field.type === "float") input.step = "any";
    input.value = field.value;
  }
  input.name = field.key;
  return input;
}

function valueOf(field, input) {
  if (field.type === "bool") return input.checked;
  if (field.type === "int") return parseInt(input.value, 10);
  if (field.type === "float") return parseFloat(input.value);
  if (field.choices && typeof field.choices[0] === "number") return Number(input.value);
  return input.value;
}

async function tuneField(field, input) {
  const token = $("#token").value.trim();
  sessionStorage.setItem("flashmoe-token", token);
  const change = { [field.key]: valueOf(field, input) };
  const response = await fetch("/api/config", {
    method: "PUT",
    headers: { "content-type": "application/json", authorization: "Bearer " + token },
    body: JSON.stringify({ changes: change }),
  });
  const body = await response.json();
  state.lastTune = { status: response.status, body };
  let text;
  if (response.ok) {
    const who = body.applied[field.key] || [];
    text = `applied ${field.key} = ${JSON.stringify(change[field.key])} (${who.join(", ")})`;
  } else if (response.status === 401) {
    text = "refused (401): " + body.detail;
  } else if (response.status === 422) {
    text = "invalid (422): " + body.detail.map((e) => e.message || e.msg).join("; ");
  } else if (response.status === 409) {
    text = "refused (409): " + Object.values(body.detail.refused).join("; ");
  } else {
    text = `HTTP ${response.status}: ${JSON.stringify(body.detail || body)}`;
  }
  note($("#tune-result"), text, response.ok ? "ok" : "error");
  await refreshConfig();
}

async function refreshConfig() {
  const config = await getJSON("/api/config");
  $("#config-source").textContent = config.source;
  const body = $("#config tbody");
  body.innerHTML = "";
  for (const field of config.fields) {
    const tr = document.createElement("tr");
    tr.className = field.live ? "live" : "fixed";
    tr.dataset.key = field.key;
    tr.title = field.live ? "" : (field.fixed_because || "restart the services to change it");
    const cells = [field.key, JSON.stringify(field.value), rangeText(field),
                   field.live ? "yes" : "no"];
    cells.forEach((text, i) => {
      const td = document.createElement("td");
      td.textContent = text;
      if (i === 0) td.className = "key";
      tr.appendChild(td);
    });
    const change = document.createElement("td");
    change.className = "change";
    if (field.live) {
      const input = inputFor(field);
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = "Set";
      button.name = "set-" + field.key;
      button.addEventListener("click", () => tuneField(field, input).catch(showError));
      change.append(input, " ", button);
    }
    tr.appendChild(change);
    const doc = document.createElement("td");
    doc.className = "doc";
    doc.textContent = field.doc;
    tr.appendChild(doc);
    body.appendChild(tr);
  }
}

function showError(err) {
  $("#status").textContent = "panel unreachable: " + err.message;
}

async function tick() {
  try {
    await refreshStats();
    await refreshHistory();
  } catch (err) {
    showError(err);
  }
}

makeCharts();
$("#token").value = sessionStorage.getItem("flashmoe-token") || "";
$("#token-form").addEventListener("submit", (e) => e.preventDefault());
refreshConfig().catch(showError);
tick();
setInterval(tick, 1000);
refreshHeatmap().catch(() => {});
setInterval(() => refreshHeatmap().catch(() => {}), 5000);
