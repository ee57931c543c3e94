// pagelab view: scrub through a run. Data: the JSON in #pagelab-data (viz/explorer.py); charts: uPlot.
"use strict";
const D = JSON.parse(document.getElementById("pagelab-data").textContent);
const P = D.palette;
const MAX_CELLS = 40000;  // block-map cells per allocator (a cell is a block, or several, or a run of slots)
const LANES = 40;         // request lanes drawn around the moment
const Y_AXIS_PX = 54;     // both charts' y axes: their plots line up, and a count like 1,177 fits
const MARKER_PX = 2;      // the time marker's width (explorer.css .marker)

function unpack(c) {
  const bin = atob(c.b), bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return c.t === "f8" ? new Float64Array(bytes.buffer) : c.t === "i8" ? new BigInt64Array(bytes.buffer)
    : new Int32Array(bytes.buffer);
}
function unpackAll(obj) {
  const out = {};
  for (const [k, v] of Object.entries(obj)) out[k] = v && v.b !== undefined ? unpack(v) : v;
  return out;
}
function hexRGB(hex) { return [1, 3, 5].map(i => parseInt(hex.slice(i, i + 2), 16)); }
function rgba32([r, g, b]) { return (255 << 24 | b << 16 | g << 8 | r) >>> 0; }
const OWNERS = P.owner_colors.map(h => rgba32(hexRGB(h)));
const FREE = rgba32(hexRGB(P.free)), WHITE = rgba32([255, 255, 255]);
const UNFILLED = rgba32(hexRGB(P.state_colors.internal_fragmentation));
const ownerColor = rid => OWNERS[(rid * P.owner_stride) % OWNERS.length];
function upperBound(a, x) {  // first index whose value is > x (a sorted)
  let lo = 0, hi = a.length;
  while (lo < hi) { const m = (lo + hi) >> 1; if (a[m] <= x) lo = m + 1; else hi = m; }
  return lo;
}
const fmt = t => t.toFixed(t >= 100 ? 2 : 4);
function el(tag, attrs, parent) {
  const e = Object.assign(document.createElement(tag), attrs);
  if (parent) parent.appendChild(e);
  return e;
}

function prepWindow(w) {
  const out = {start: w.start, end: w.end, tenures: unpackAll(w.tenures), memory: unpackAll(w.memory),
               requests: unpackAll(w.requests), transitions: unpackAll(w.transitions)};
  out.byRequest = new Map();
  // Tenures and transitions name a request by its row in the request table, not by the trace's id.
  out.requests.row.forEach((row, i) => out.byRequest.set(row, i));
  const rc = w.tenures.refcounts && unpackAll(w.tenures.refcounts);  // absent in older runs
  if (rc) {
    out.refs = {rc, span: new Map()};  // tenure -> [first, end) of its changes (sorted by tenure, time)
    rc.tenure.forEach((k, j) => { const s = out.refs.span.get(k); if (s) s[1] = j + 1; else out.refs.span.set(k, [j, j + 1]); });
  }
  return out;
}

// A tenure's owner count at t: its last change at or before t (1 before any); the peak without the table.
function refAt(w, i, t) {
  if (!w.refs) return w.tenures.max_ref_count[i];
  const s = w.refs.span.get(i);
  let ref = 1;
  if (s) for (let j = s[0]; j < s[1] && w.refs.rc.t_s[j] <= t; j++) ref = w.refs.rc.ref_count[j];
  return ref;
}

// The chart series: the whole-run summary, with each window's full-detail rows in place of its bins.
// A row holds from its t to the next row's; the last row's values are repeated where it ends, or the
// charts would stop where the last row starts (a one-step run would draw nothing).
function chartData(summary, windows, parts) {
  const t = [], rows = [];
  const names = [...P.states, "num_running", "num_waiting", ...parts];
  const push = (src, i) => { t.push(src.t[i]); rows.push(names.map(n => src[n][i])); };
  const inside = x => windows.some(w => x >= w.start && x < w.end);
  for (let i = 0; i < summary.t.length; i++) if (!inside(summary.t[i])) push(summary, i);
  for (const w of windows) for (let i = 0; i < w.memory.t.length; i++) push(w.memory, i);
  const order = t.map((_, i) => i).sort((a, b) => t[a] - t[b]);
  const ends = [summary, ...windows.map(w => w.memory)].map(s => s.t_end).filter(Number.isFinite);
  const last = order[order.length - 1], end = Math.max(...ends);
  if (last !== undefined && end > t[last]) { t.push(end); rows.push(rows[last]); order.push(t.length - 1); }
  return {t: order.map(i => t[i]), cols: names.map((_, k) => order.map(i => rows[i][k]))};
}

// About three integer ticks from 0 to the peak, the peak itself among them.
function countTicks(peak) {
  return [...new Set([0, Math.round(peak / 2), peak])];
}

// A state's colour crossed by diagonal lines of `lines`: how a part of that state is filled.
function hatchFill(u, color, lines) {
  const c = document.createElement("canvas");
  c.width = c.height = 6;
  const x = c.getContext("2d");
  x.fillStyle = color;
  x.fillRect(0, 0, 6, 6);
  x.strokeStyle = lines;
  x.beginPath(); x.moveTo(0, 6); x.lineTo(6, 0); x.stroke();
  return u.ctx.createPattern(c, "repeat");
}

class Column {
  constructor(a, root) {
    this.a = a;
    this.summary = unpackAll(a.summary);
    this.windows = a.windows.map(prepWindow);
    const box = el("section", {className: "alloc"}, root);
    const title = el("h2", {textContent: a.label}, box);
    title.style.color = a.color;
    this.memChart = el("div", {className: "chart"}, box);
    this.countChart = el("div", {className: "chart"}, box);
    this.note = el("p", {className: "note"}, box);
    this.map = el("canvas", {className: "map"}, box);
    this.tip = el("div", {className: "tip", textContent: "hover a block"}, box);
    this.lanes = el("canvas", {className: "lanes", width: 360, height: LANES * 6 + 14}, box);
    this.layout();
    this.makeCharts();
    this.map.addEventListener("mousemove", e => this.hover(e));
  }
  layout() {
    const a = this.a, bs = a.block_size;
    this.spc = a.paged ? bs * Math.ceil(Math.ceil(a.capacity / bs) / MAX_CELLS) : Math.ceil(a.capacity / MAX_CELLS);
    this.cells = Math.ceil(a.capacity / this.spc);
    this.cols = Math.ceil(Math.sqrt(this.cells));
    const rows = Math.ceil(this.cells / this.cols);
    Object.assign(this.map, {width: this.cols * 2, height: rows * 2});
    Object.assign(this.map.dataset, {cols: this.cols, slotsPerCell: this.spc, cells: this.cells});
    this.map.style.width = "360px";
    this.ctx = this.map.getContext("2d");
    this.img = this.ctx.createImageData(this.map.width, this.map.height);
    this.px = new Uint32Array(this.img.data.buffer);
    this.cellTenure = new Int32Array(this.cells);
  }
  makeCharts() {
    const parts = this.a.parts || [], d = chartData(this.summary, this.windows, parts), states = P.states;
    const cum = [];
    let acc = new Float64Array(d.t.length);
    states.forEach((_, k) => { acc = acc.map((v, i) => v + d.cols[k][i]); cum.push(Array.from(acc)); });
    // Stacked areas: each cumulative curve filled to zero, drawn top state first so the lower ones paint over.
    // A part of a state (padding, window_cached) is a hatched band from the foot of its state, drawn right
    // after that state so the states below paint over the rest of it.
    const series = [], data = [];
    for (let k = states.length - 1; k >= 0; k--) {
      const s = states[k];
      series.push({label: s.replace(/_/g, " "), stroke: P.state_colors[s], fill: P.state_colors[s], width: 0});
      data.push(cum[k]);
      parts.forEach((p, j) => {
        if (P.parts[p].of !== s) return;
        const foot = k > 0 ? cum[k - 1] : cum[0].map(() => 0), col = d.cols[states.length + 2 + j];
        series.push({label: P.parts[p].label, stroke: P.parts[p].hatch, width: 0,
                     fill: u => hatchFill(u, P.state_colors[s], P.parts[p].hatch)});
        data.push(foot.map((v, i) => v + col[i]));
      });
    }
    // Every chart spans the whole run, so the columns share one clock and a moment is at one x in all.
    const opts = (title, ser, h, y = {}) => ({title, width: 360, height: h, series: [{label: "s"}, ...ser],
      scales: {x: {time: false, range: () => [0, D.end]}, ...(y.range ? {y: {range: y.range}} : {})},
      axes: [{}, {size: Y_AXIS_PX, ...(y.splits ? {splits: y.splits} : {})}],
      legend: {show: false}, hooks: {draw: [u => this.shadeWindows(u)]}});
    this.mem = new uPlot(opts("memory by state (share of pool)", series, 130), [d.t, ...data], this.memChart);
    const counts = ["num_running", "num_waiting"].map(n => ({label: n.slice(4), stroke: P.queue_colors[n], width: 1}));
    const run = d.cols[states.length], wait = d.cols[states.length + 1];
    // uPlot spaces its own ticks for a taller chart: in this one a peak in the tens got the one tick 0.
    const peak = Math.max(1, Math.ceil([...run, ...wait].reduce((m, v) => Math.max(m, v), 0)));
    this.count = new uPlot(opts("running / waiting requests", counts, 130,
                                {range: () => [0, peak], splits: () => countTicks(peak)}), [d.t, run, wait], this.countChart);
    for (const u of [this.mem, this.count]) {
      u.marker = el("div", {className: "marker"}, u.over);
      u.over.addEventListener("click", () => view.setTime(u.posToVal(u.cursor.left, "x")));
    }
  }
  shadeWindows(u) {
    const ctx = u.ctx;
    ctx.save();
    ctx.fillStyle = "rgba(0,0,0,0.08)";
    for (const w of this.windows) {
      const x0 = u.valToPos(w.start, "x", true), x1 = u.valToPos(w.end, "x", true);
      ctx.fillRect(x0, u.bbox.top, Math.max(1, x1 - x0), u.bbox.height);
    }
    ctx.restore();
  }
  windowAt(t) { return this.windows.find(w => t >= w.start && t <= w.end); }
  paintCell(c, color, shared) {
    const x = (c % this.cols) * 2, y = Math.floor(c / this.cols) * 2, W = this.map.width, px = this.px;
    const i = y * W + x;
    px[i] = shared ? WHITE : color; px[i + 1] = color; px[i + W] = color; px[i + W + 1] = shared ? WHITE : color;
  }
  draw(t) {
    for (const u of [this.mem, this.count]) {
      const right = u.valToPos(D.end, "x") - MARKER_PX;
      u.marker.style.left = Math.min(Math.max(u.valToPos(t, "x"), 0), right) + "px";
    }
    const w = this.windowAt(t);
    this.current = w;
    this.px.fill(FREE);
    this.cellTenure.fill(-1);
    if (!w) {
      this.note.textContent = view.serve ? "loading this moment..." : "no detail here: the shaded windows have it " +
        "(pagelab view --window START:END, or --serve)";
      this.ctx.putImageData(this.img, 0, 0);
      this.drawLanes(t, null);
      return;
    }
    const T = w.tenures, spc = this.spc, n = upperBound(T.t_start_s, t);
    let held = 0;
    for (let i = 0; i < n; i++) {
      if (T.t_end_s[i] <= t) continue;
      const s = T.start[i], f = T.filled[i], end = s + T.size[i], color = ownerColor(T.request_id[i]);
      const shared = T.max_ref_count[i] > 1 && refAt(w, i, t) > 1, c0 = Math.floor(s / spc), cf = f > 0 ? Math.floor((s + f - 1) / spc) : c0 - 1;
      const c1 = Math.min(Math.floor((end - 1) / spc), this.cells - 1);
      for (let c = c0; c <= c1; c++) {
        this.paintCell(c, c <= cf ? color : UNFILLED, shared);
        this.cellTenure[c] = i;
      }
      held++;
    }
    this.ctx.putImageData(this.img, 0, 0);
    this.note.textContent = `${held.toLocaleString()} ${this.a.paged ? "block" : "region"}${held === 1 ? "" : "s"} held; ` +
      `cell = ${this.spc} slot${this.spc > 1 ? "s" : ""}`;
    this.map.dataset.time = t;
    this.t = t;
    this.drawLanes(t, w);
  }
  hover(e) {
    const r = this.map.getBoundingClientRect(), w = this.current;
    const x = Math.floor((e.clientX - r.left) / r.width * this.cols);
    const y = Math.floor((e.clientY - r.top) / r.height * (this.map.height / 2));
    const c = y * this.cols + x, i = c >= 0 && c < this.cells ? this.cellTenure[c] : -1;
    if (!w || i < 0) { this.tip.textContent = `slot ${c * this.spc}: free`; this.tip.dataset.request = ""; return; }
    const T = w.tenures, row = T.request_id[i], q = w.byRequest.get(row), R = w.requests;
    const rid = q === undefined ? `row ${row}` : String(R.request_id[q]);
    const what = this.a.paged ? `block ${T.start[i] / this.a.block_size}` : `region of ${T.size[i]} slots`;
    const req = q === undefined ? "" : ` · prompt ${R.prompt_len[q]}, output ${R.output_len[q]}, ` +
      `arrived ${fmt(R.arrival_s[q])} s, ${R.num_preemptions[q]} preemption(s)`;
    const seq = T.seq_id ? ` · sequence ${T.seq_id[i]}` : "";
    this.tip.textContent = `request ${rid}${seq} · ${what} at slot ${T.start[i]} · filled ${T.filled[i]} of ${T.size[i]} · ` +
      `ref count ${refAt(w, i, this.t)} (up to ${T.max_ref_count[i]})${T.prefix_key && T.prefix_key[i] ? ` · prefix key ${T.prefix_key[i]}` : ""} · ` +
      `held ${fmt(T.t_start_s[i])}–${fmt(T.t_end_s[i])} s${req}`;
    this.tip.dataset.request = rid;
  }
  drawLanes(t, w) {
    const ctx = this.lanes.getContext("2d"), W = this.lanes.width, H = this.lanes.height;
    ctx.clearRect(0, 0, W, H);
    if (!w) return;
    const R = w.requests, span = D.lane_span, x = v => (v - (t - span)) / (2 * span) * W, ph = P.phase_colors;
    const live = [];
    for (let i = 0; i < R.request_id.length && live.length < LANES; i++) {
      const end = isNaN(R.finish_s[i]) ? w.end : R.finish_s[i];
      if (R.arrival_s[i] <= t && end > t) live.push(i);
    }
    const lane = new Map();
    live.forEach((i, k) => {
      const y = 12 + k * 6, edges = [R.arrival_s[i], R.admitted_s[i], R.first_token_s[i], R.finish_s[i]];
      lane.set(R.row[i], y);
      ["waiting", "prefill", "decode"].forEach((p, j) => {
        if (isNaN(edges[j])) return;
        const end = isNaN(edges[j + 1]) ? w.end : edges[j + 1];
        ctx.fillStyle = ph[p];
        ctx.fillRect(x(edges[j]), y, Math.max(1, x(end) - x(edges[j])), 4);
      });
    });
    const TR = w.transitions;
    for (let k = 0; k < TR.t_s.length; k++) {
      const y = lane.get(TR.request_id[k]);
      if (y === undefined) continue;
      ctx.fillStyle = ph[["preempted", "swapped_out", "swapped_in"][TR.kind[k]]];
      ctx.fillRect(x(TR.t_s[k]) - 1, y - 1, 2, 6);
    }
    ctx.fillStyle = "#000";
    ctx.fillRect(W / 2, 11, 1, H - 11);  // below the caption
    ctx.font = "10px sans-serif";
    ctx.fillText(`the ${live.length} earliest requests in the server; ±${fmt(span)} s`, 2, 9);
  }
}

const view = {
  t: 0, frames: [], columns: [], serve: D.serve === true && location.protocol.startsWith("http"), pending: false,
  setTime(t) {
    this.t = Math.min(Math.max(t, 0), D.end);
    scrub.value = this.t;
    readout.textContent = `t = ${fmt(this.t)} s of ${fmt(D.end)} s`;
    const t0 = performance.now();
    for (const c of this.columns) c.draw(this.t);
    this.frames.push(performance.now() - t0);
    if (this.serve && !this.columns[0].windowAt(this.t)) this.load(this.t);
  },
  async load(t) {  // --serve: fetch a window around t from the run folder
    if (this.pending) return;
    this.pending = true;
    try {
      const got = await (await fetch(`window?t=${t}`)).json();
      got.allocators.forEach((w, k) => this.columns[k].windows.push(prepWindow(w)));
      for (const c of this.columns) { c.mem.redraw(false); c.count.redraw(false); }
    } finally { this.pending = false; }
    this.setTime(this.t);
  },
};
window.pagelabView = view;

const head = el("header", {}, document.body);
el("h1", {textContent: `pagelab run: ${D.label}`}, head);
const scrub = el("input", {type: "range", id: "scrub", min: 0, max: D.end, step: "any"}, head);
const readout = el("span", {id: "readout"}, head);
const legend = el("p", {className: "legend"}, head);
legend.innerHTML = P.states.map(s => `<i style="background:${P.state_colors[s]}"></i>${s.replace(/_/g, " ")}`).join(" ") +
  Object.values(P.parts || {}).map(q => ` <i class="part" style="background:repeating-linear-gradient(45deg,` +
    `${q.hatch} 0 1px,${P.state_colors[q.of]} 1px 4px)"></i>${q.label}`).join("") +
  ` · blocks: one blue per request, <i class="hatch"></i>shared, <i style="background:${P.state_colors.internal_fragmentation}"></i>` +
  `never filled, <i style="background:${P.free};border:1px solid #999"></i>free · lanes: ` +
  ["waiting", "prefill", "decode", "preempted", "swapped_out"].map(p => `<i style="background:${P.phase_colors[p]}"></i>${p.replace("_", " ")}`).join(" ");
const grid = el("main", {}, document.body);
view.columns = D.allocators.map(a => new Column(a, grid));
let queued = null;
scrub.addEventListener("input", () => {
  queued = +scrub.value;
  requestAnimationFrame(() => { if (queued !== null) { view.setTime(queued); queued = null; } });
});
view.setTime((D.windows[0][0] + D.windows[0][1]) / 2);
