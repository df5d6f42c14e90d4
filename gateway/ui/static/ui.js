/* rollway viewer: the pages' live refresh and the overview's SVG charts. Vanilla JS, no build step. */
"use strict";
const UI = (() => {
  const SVG = "http://www.w3.org/2000/svg";
  const COLORS = ["#2456c9", "#1e7f3c", "#b3261e", "#a15c00", "#6a2fb5", "#00838f", "#5b6472"];

  async function getJSON(url) {
    const r = await fetch(url, {credentials: "same-origin", headers: {Accept: "application/json"}});
    if (!r.ok) throw new Error(`${r.status} ${url}`);
    return r.json();
  }
  async function getText(url) {
    const r = await fetch(url, {credentials: "same-origin", headers: {Accept: "text/html-fragment"}});
    if (!r.ok) throw new Error(`${r.status} ${url}`);
    return r.text();
  }
  function live(ok) {
    const dot = document.getElementById("live");
    if (dot) { dot.className = "live " + (ok ? "on" : "err"); dot.title = (ok ? "live, refreshed " : "refresh failed ") + new Date().toLocaleTimeString(); }
  }
  /** Call `fn` now and then every `ms` while the tab is visible. */
  function poll(fn, ms) {
    const tick = async () => {
      if (document.visibilityState === "visible") {
        try { await fn(); live(true); } catch (e) { live(false); }
      }
      setTimeout(tick, ms);
    };
    tick();
  }
  const fmt = (v, d = 3) => v === null || v === undefined || Number.isNaN(v) ? "–" :
    (typeof v === "number" ? (Math.abs(v) >= 1e15 ? v.toPrecision(Math.max(d, 6)) : Math.abs(v) >= 1e4 ? Math.round(v).toLocaleString() : +v.toPrecision(d) + "") : String(v));
  /** "1 turn", "2 turns". */
  const plural = (n, w) => `${n} ${w}${n === 1 ? "" : "s"}`;
  const el = (tag, attrs = {}, text) => {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const svgEl = (tag, attrs = {}, text) => {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  };

  /** Round tick values between lo and hi: at most ~2n of them, and always a finite loop, whatever the values
   *  (1e16 and 1e16 + 4: a step of 1 is below the float spacing there; ticks are counted, never accumulated). */
  function ticks(lo, hi, n = 4) {
    if (!(hi > lo)) return [lo];
    const step0 = (hi / 2 - lo / 2) / n * 2;  // halves: hi - lo overflows for -1e308 .. 1e308
    if (!Number.isFinite(step0) || step0 <= 0) return [lo, hi];
    const mag = Math.pow(10, Math.floor(Math.log10(step0)));
    const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= step0) || step0;
    const first = Math.ceil(lo / step), out = [];
    for (let i = 0; i <= 2 * n + 2; i++) {
      const v = step >= 1 ? (first + i) * step : +((first + i) * step).toPrecision(15);
      if (v > hi + step * 1e-9 || !Number.isFinite(v)) break;
      if (!out.length || v !== out[out.length - 1]) out.push(v);
    }
    return out.length ? out : [lo, hi];
  }
  const clock = t => { const d = new Date(t * 1000); return d.toTimeString().slice(0, 8); };
  /** A tick label with as many digits as the axis's step needs (1e16 + 2 and 1e16 + 4 differ). */
  function tickLabel(v, step) {
    if (v === 0 || !Number.isFinite(v)) return String(v);
    const a = Math.abs(v);
    if (a >= 1e-3 && a < 1e6 && !(step > 0 && step < a * 1e-4)) return fmt(v, 4);
    const digits = step > 0 ? Math.min(17, Math.max(1, Math.ceil(Math.log10(a / step)) + 2)) : 3;
    if (a >= 1e-3 && a < 1e17) return v.toPrecision(digits).replace(/(\.\d*?)0+$/, "$1").replace(/\.$/, "");
    return v.toExponential(digits - 1).replace(/\.?0+e/, "e");
  }
  function quantile(sorted, q) {
    const i = (sorted.length - 1) * q, lo = Math.floor(i), hi = Math.ceil(i);
    return sorted[lo] + (sorted[hi] - sorted[lo]) * (i - lo);
  }
  /** The y range: every point's, or with `robust` (TensorBoard's "ignore outliers in chart scaling") the 5th to
   *  95th percentile widened by a quarter of that span on each side, never past the data: points outside are
   *  drawn as marks on the edge, their values in their tooltips. Only where that gains a third of the height
   *  or more: a falling loss keeps its first steps in view. */
  function yRange(ys, robust) {
    let y0 = Math.min(...ys), y1 = Math.max(...ys);
    if (robust && ys.length >= 8) {
      const s = [...ys].sort((a, b) => a - b), lo = quantile(s, 0.05), hi = quantile(s, 0.95);
      const pad = (hi / 2 - lo / 2) / 2;  // a quarter of hi - lo, overflow-safe
      const a = Math.max(y0, lo - pad), b = Math.min(y1, hi + pad);
      if (hi > lo && (y1 / 2 - y0 / 2) > 1.5 * (b / 2 - a / 2)) { y0 = a; y1 = b; }
    }
    return [y0, y1];
  }
  function widen(a, b) {  // an empty range made drawable (and kept finite at +-1.8e308)
    if (a !== b) return [a, b];
    const d = Math.max(Math.abs(a) * 0.01, 0.5);
    return [Math.max(a - d, -Number.MAX_VALUE), Math.min(b + d, Number.MAX_VALUE)];
  }

  /** A line chart into `fig` (a <figure>): series [{name, points: [[x, y, label?]], dots, step, color}].
   *  Hover: a crosshair and each series' value at the nearest x. Drag across: zoom into that x range (the y
   *  range follows what is in view); double-click or "reset zoom": back. opts: xTime, xLabel, yMin, robust,
   *  empty. What it plots is kept on the figure (data-points, data-xrange, data-yrange) for tests. */
  function lineChart(fig, series, opts = {}) {
    const W = 520, H = 220, L = 58, R = 12, T = 24, B = 30;
    fig._chart = [series, opts];
    fig.querySelectorAll("svg, .none, .tip, .chart-note").forEach(n => n.remove());
    const ok = p => p[1] !== null && p[1] !== undefined && Number.isFinite(p[1]) && Number.isFinite(p[0]);
    const all = series.map(s => ({...s, points: s.points.filter(ok)}));
    fig.dataset.points = JSON.stringify(all.map(s => ({name: s.name, points: s.points.map(p => [p[0], p[1]])})));
    const pts = all.flatMap(s => s.points);
    if (!pts.length) { fig.appendChild(el("div", {class: "none"}, opts.empty || "nothing recorded yet")); return; }
    let [x0, x1] = widen(Math.min(...pts.map(p => p[0])), Math.max(...pts.map(p => p[0])));
    if (fig._zoom) [x0, x1] = fig._zoom;
    const inView = pts.filter(p => p[0] >= x0 && p[0] <= x1);
    let [y0, y1] = yRange((inView.length ? inView : pts).map(p => p[1]), opts.robust && !fig._full);
    if (opts.yMin !== undefined && opts.yMin <= y0) y0 = opts.yMin;
    [y0, y1] = widen(y0, y1);
    fig.dataset.xrange = JSON.stringify([x0, x1]);
    fig.dataset.yrange = JSON.stringify([y0, y1]);
    const sx = x1 / 2 - x0 / 2, sy = y1 / 2 - y0 / 2;  // halves: finite for any finite ends
    const X = x => L + (x / 2 - x0 / 2) / sx * (W - L - R), Y = y => H - B - (y / 2 - y0 / 2) / sy * (H - T - B);
    const cy = y => Math.min(H - B, Math.max(T, Y(y)));
    const svg = svgEl("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": fig.querySelector("figcaption")?.textContent || "chart"});
    const clipId = `clip-${fig.id || Math.random().toString(36).slice(2)}`;
    const defs = svgEl("defs"), clip = svgEl("clipPath", {id: clipId});
    clip.appendChild(svgEl("rect", {x: L, y: T - 2, width: W - L - R, height: H - T - B + 4}));
    defs.appendChild(clip); svg.appendChild(defs);
    const yt = ticks(y0, y1), xt = ticks(x0, x1, 5), ys = yt.length > 1 ? yt[1] - yt[0] : 0, xs = xt.length > 1 ? xt[1] - xt[0] : 0;
    for (const v of yt) {
      svg.appendChild(svgEl("line", {x1: L, x2: W - R, y1: Y(v), y2: Y(v), class: "grid"}));
      svg.appendChild(svgEl("text", {x: L - 4, y: Y(v) + 3, "text-anchor": "end"}, tickLabel(v, ys)));
    }
    const short = x1 - x0 < 600;  // a run of minutes: its ticks need seconds
    for (const v of xt) svg.appendChild(svgEl("text", {x: X(v), y: H - 16, "text-anchor": "middle"}, opts.xTime ? (short ? clock(v) : clock(v).slice(0, 5)) : tickLabel(v, xs)));
    svg.appendChild(svgEl("text", {x: W - R, y: H - 3, "text-anchor": "end", class: "xlabel"}, opts.xLabel || (opts.xTime ? "wall clock (local time)" : "")));
    svg.appendChild(svgEl("line", {x1: L, x2: L, y1: T, y2: H - B, class: "axis"}));
    svg.appendChild(svgEl("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis"}));
    const plot = svgEl("g", {"clip-path": `url(#${clipId})`}), legend = svgEl("g", {class: "legend"});
    const off = [];
    all.forEach((s, i) => {
      const color = s.color || COLORS[i % COLORS.length];
      s.color = color;
      const p = s.points.filter(q => q[0] >= x0 && q[0] <= x1);
      if (s.dots) p.forEach(q => plot.appendChild(svgEl("circle", {cx: X(q[0]), cy: cy(q[1]), r: 2.2, fill: color, opacity: 0.45})));
      if (!s.dots || s.line) {
        let d = "";
        s.points.forEach((q, j) => {
          if (j && s.step) d += `H${X(q[0]).toFixed(1)}`;
          d += `${j ? "L" : "M"}${X(q[0]).toFixed(1)},${cy(q[1]).toFixed(1)}`;
        });
        plot.appendChild(svgEl("path", {d, fill: "none", stroke: color, "stroke-width": 1.8}));
        if (p.length <= 12) p.forEach(q => plot.appendChild(svgEl("circle", {cx: X(q[0]), cy: cy(q[1]), r: 2.6, fill: color})));
      }
      for (const q of p) {
        if (q[1] > y1 || q[1] < y0) {
          off.push([s.name, q]);
          const up = q[1] > y1, x = X(q[0]), y = up ? T + 1 : H - B - 1;
          const mark = svgEl("path", {d: up ? `M${x - 4},${y + 7}L${x + 4},${y + 7}L${x},${y}Z` : `M${x - 4},${y - 7}L${x + 4},${y - 7}L${x},${y}Z`, fill: color, class: "outlier"});
          mark.appendChild(svgEl("title", {}, `${s.name}: ${fmt(q[1], 6)} at ${opts.xTime ? clock(q[0]) : fmt(q[0], 6)} (off the scale)`));
          svg.appendChild(mark);
        }
      }
      if (!s.hideLegend) {
        const lx = L + 8 + i * 118;
        legend.appendChild(svgEl("rect", {x: lx, y: 6, width: 10, height: 10, fill: color}));
        legend.appendChild(svgEl("text", {x: lx + 14, y: 15}, s.name));
      }
    });
    svg.appendChild(plot);
    svg.appendChild(legend);
    const cross = svgEl("line", {y1: T, y2: H - B, class: "cross", visibility: "hidden"});
    const band = svgEl("rect", {y: T, height: H - T - B, class: "band", visibility: "hidden"});
    const overlay = svgEl("rect", {x: L, y: T, width: W - L - R, height: H - T - B, class: "overlay", fill: "transparent"});
    svg.append(cross, band, overlay);
    fig.appendChild(svg);
    if (off.length || fig._zoom || fig._full) {
      const note = el("div", {class: "chart-note"});
      if (off.length) {
        const top = off.reduce((a, b) => Math.abs(b[1][1]) > Math.abs(a[1][1]) ? b : a);
        note.appendChild(el("span", {class: "off"}, `${off.length} point${off.length === 1 ? "" : "s"} off the scale (▲▼; e.g. ${top[0]} ${fmt(top[1][1], 4)}) `));
      }
      if (opts.robust && (off.length || fig._full)) {
        const b = el("button", {type: "button", class: "link full"}, fig._full ? "scale to the bulk" : "scale to every point");
        b.addEventListener("click", () => { fig._full = !fig._full; lineChart(fig, ...fig._chart); });
        note.appendChild(b);
      }
      if (fig._zoom) {
        const b = el("button", {type: "button", class: "link unzoom"}, "reset zoom");
        b.addEventListener("click", () => { fig._zoom = null; lineChart(fig, ...fig._chart); });
        note.appendChild(b);
      }
      fig.appendChild(note);
    }
    const tip = el("div", {class: "tip", hidden: ""});
    fig.appendChild(tip);
    const atPx = px => { const f = (Math.min(Math.max(px, L), W - R) - L) / (W - L - R); return x0 + f * sx + f * sx; };
    const toX = ev => {  // client px -> the data's x
      const r = svg.getBoundingClientRect(), px = (ev.clientX - r.left) * W / r.width;
      return [px, atPx(px)];
    };
    let drag = null;
    overlay.addEventListener("mousemove", ev => {
      const [px, x] = toX(ev);
      if (drag !== null) {
        band.setAttribute("x", Math.min(drag, px)); band.setAttribute("width", Math.abs(px - drag));
        band.setAttribute("visibility", "visible");
      }
      const rows = [];
      let near = null;
      for (const s of all) {
        const vis = s.points.filter(q => q[0] >= x0 && q[0] <= x1);
        if (!vis.length) continue;
        const q = vis.reduce((a, b) => Math.abs(b[0] - x) < Math.abs(a[0] - x) ? b : a);
        if (near === null || Math.abs(q[0] - x) < Math.abs(near - x)) near = q[0];
        rows.push([s, q]);
      }
      if (near === null) return;
      cross.setAttribute("x1", X(near)); cross.setAttribute("x2", X(near)); cross.setAttribute("visibility", "visible");
      tip.replaceChildren(el("div", {class: "tip-x"}, `${opts.xLabel || (opts.xTime ? "time" : "x")} ${opts.xTime ? clock(near) : fmt(near, 8)}`),
        ...rows.filter(([, q]) => q[0] === near).map(([s, q]) => {
          const row = el("div");
          row.appendChild(el("i", {style: `background:${s.color}`}));
          row.appendChild(document.createTextNode(`${s.name}: ${fmt(q[1], 6)}${q[2] ? " · " + q[2] : ""}`));
          return row;
        }));
      tip.hidden = false;
      const r = svg.getBoundingClientRect(), left = (X(near) / W) * r.width;
      tip.style.left = `${Math.min(left + 12, r.width - 170)}px`;
    });
    overlay.addEventListener("mouseleave", () => { tip.hidden = true; cross.setAttribute("visibility", "hidden"); });
    overlay.addEventListener("mousedown", ev => { drag = toX(ev)[0]; ev.preventDefault(); });
    overlay.addEventListener("mouseup", ev => {
      if (drag === null) return;
      const [px] = toX(ev), a = Math.min(drag, px), b = Math.max(drag, px);
      drag = null; band.setAttribute("visibility", "hidden");
      if (b - a < 6) return;
      const xa = atPx(a), xb = atPx(b);
      if (xb > xa) { fig._zoom = [xa, xb]; lineChart(fig, ...fig._chart); }
    });
    overlay.addEventListener("dblclick", () => { if (fig._zoom) { fig._zoom = null; lineChart(fig, ...fig._chart); } });
  }

  /** Horizontal bars into `fig`: [{label, value, color}]. */
  function barChart(fig, bars) {
    fig.querySelectorAll("svg, .none").forEach(n => n.remove());
    if (!bars.length) { fig.appendChild(el("div", {class: "none"}, "no groups yet")); return; }
    const W = 520, row = 22, H = bars.length * row + 8, L = 170, max = Math.max(...bars.map(b => b.value), 1);
    const svg = svgEl("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "groups by state"});
    bars.forEach((b, i) => {
      const y = 4 + i * row, w = (W - L - 60) * b.value / max;
      svg.appendChild(svgEl("text", {x: L - 6, y: y + 14, "text-anchor": "end"}, b.label));
      svg.appendChild(svgEl("rect", {x: L, y: y + 3, width: Math.max(w, 1), height: row - 7, fill: b.color || COLORS[0], rx: 2}));
      svg.appendChild(svgEl("text", {x: L + w + 5, y: y + 14, "data-bar": b.label}, String(b.value)));
    });
    fig.appendChild(svg);
  }

  function ema(points, alpha = 0.3) {
    let acc = null;
    return points.map(([x, y]) => { acc = acc === null ? y : alpha * y + (1 - alpha) * acc; return [x, acc]; });
  }

  // --- pages -------------------------------------------------------------------------------------

  /** The figures the trainer reports per step (POST /v1/training/steps), each on its own chart and axis. */
  const STEP_CHARTS = [
    ["chart-loss", ["loss"]], ["chart-kl", ["kl"]], ["chart-entropy", ["entropy"]],
    ["chart-grad-norm", ["grad_norm"]], ["chart-lr", ["lr"]], ["chart-clip", ["clip_frac"]],
    ["chart-tokens-per-s", ["tokens_per_s"]],
  ];
  let leaseOffset = 0;

  function leaseTable(q, now) {
    const ago = s => s < 90 ? `${Math.round(s)} s` : s < 5400 ? `${Math.round(s / 60)} min` : `${(s / 3600).toFixed(1)} h`;
    const seen = q.trainer_last_seen === null ? "never" : `${ago(now - q.trainer_last_seen)} ago`;
    document.getElementById("queue").textContent =
      `${plural(q.complete, "complete group")} wait for a trainer; ${plural(q.leased, "group")} leased: ${plural(q.held, "held lease")}` +
      (q.lapsed ? `, ${plural(q.lapsed, "lapsed lease")} (expired: the gateway returns their groups to the queue at the next lease)` : "") +
      `. Trainer last seen (lease, publish or step report): ${seen}.` +
      (q.view_only ? " This is rollway view over a stored run: no trainer talks to it, and nothing here renews a lease." : "");
    document.querySelector("#leases tbody").replaceChildren(...(q.leases.length ? q.leases.map(l => {
      const tr = el("tr", {"data-lease": l.id, class: "lease-" + l.status});
      const when = l.status === "held" ? `held, expires in ${ago(l.expires_at - now)}` : `lapsed ${ago(now - l.expires_at)} ago`;
      [l.id, l.groups, l.trainer_version, when].forEach(v => tr.appendChild(el("td", {}, String(v))));
      return tr;
    }) : [(() => { const tr = el("tr"); tr.appendChild(el("td", {colspan: 4, class: "empty"}, "no lease held")); return tr; })()]));
    const pager = document.getElementById("lease-pager");
    pager.replaceChildren();
    if (q.offset > 0 || q.offset + q.leases.length < q.total) {
      const newer = el("button", {type: "button", class: "link", id: "leases-newer"}, "‹ newer"), older = el("button", {type: "button", class: "link", id: "leases-older"}, "older ›");
      newer.disabled = q.offset === 0; older.disabled = q.offset + q.leases.length >= q.total;
      newer.addEventListener("click", () => showLeases(Math.max(0, q.offset - q.limit)));
      older.addEventListener("click", () => showLeases(q.offset + q.limit));
      pager.append(newer, el("span", {}, ` ${q.offset + 1}–${q.offset + q.leases.length} of ${q.total} `), older);
    }
  }
  async function showLeases(offset) {
    leaseOffset = offset;
    const d = await getJSON(`/ui/api/leases?offset=${offset}`);
    leaseTable({...d, complete: lastQueue.complete, leased: lastQueue.leased, view_only: lastQueue.view_only}, d.now);
  }
  let lastQueue = {complete: 0, leased: 0};

  function overview() {
    const tile = (label, value, id) => `<div class="tile" id="tile-${id}"><b>${fmt(value)}</b><span>${label}</span></div>`;
    poll(async () => {
      const d = await getJSON("/ui/api/overview");
      const g = d.groups, lastRate = d.throughput.length ? d.throughput[d.throughput.length - 1].per_s : null;
      const stale = d.dropped.stale || 0, filtered = d.dropped.filtered || 0;
      document.getElementById("ov-version").textContent = `weights v${d.version}`;
      document.getElementById("tiles").innerHTML = [
        tile("weight version", d.version, "version"), tile("groups complete", g.complete || 0, "complete"),
        tile("groups trained", g.trained || 0, "trained"), tile("groups open", g.open || 0, "open"),
        tile("filtered", filtered, "filtered"), tile("stale", stale, "stale"),
        tile("sessions finished", d.sessions.finished || 0, "finished"), tile("samples/s (last)", lastRate, "rate"),
      ].join("");
      const $ = id => document.getElementById(id);
      lineChart($("chart-versions"), [{name: "version", step: true, points: d.versions.map(v => [v.published_at, v.version])}], {xTime: true, empty: "no publish yet"});
      const metric = name => d.steps.filter(s => typeof s.metrics[name] === "number").map(s => [s.step, s.metrics[name], `v${s.version}`]);
      lineChart($("chart-train-step"), [{name: "reward_mean", points: metric("reward_mean")}], {xLabel: "trainer step", empty: "no trainer step reported yet"});
      const tc = d.train_reward_by_clock.map(p => [p.t, p.mean, plural(p.sessions, "session")]);
      lineChart($("chart-train-clock"), [{name: "bucket mean", dots: true, points: tc, color: "#9aa6b8"}, {name: "EMA (α 0.3)", points: ema(tc)}], {xTime: true});
      lineChart($("chart-train-version"), [{name: "mean reward", points: d.train_reward_by_version.map(p => [p.version, p.mean, plural(p.sessions, "session")])}], {xLabel: "weight version", empty: "no trained group yet"});
      const ev = Object.entries(d.eval_by_version).filter(([k]) => k !== "unknown").map(([k, v]) => [+k, v]).sort((a, b) => a[0] - b[0]);
      lineChart($("chart-eval-version"), [{name: "mean", points: ev.map(([k, v]) => [k, v.mean_reward, plural(v.groups, "group")])},
        {name: "pass@k", points: ev.map(([k, v]) => [k, v.pass_at_k])}], {xLabel: "eval_version", empty: "no eval group with an eval_version yet"});
      const er = d.eval_by_clock.map(p => ({...p, label: `${p.version === null ? "no eval_version" : "eval_version " + p.version} · ${plural(p.groups, "group")}, ${plural(p.sessions, "session")}`}));
      lineChart($("chart-eval-clock"), [{name: "mean", points: er.map(p => [p.t, p.mean, p.label])},
        {name: "pass@k", points: er.map(p => [p.t, p.pass_at_k, p.label])}], {xTime: true, empty: "no eval group yet"});
      lineChart($("chart-throughput"), [{name: "sessions/s", points: d.throughput.map(p => [p.t, p.per_s])}], {xTime: true, yMin: 0, robust: true});
      const bars = Object.entries(g).map(([k, v]) => ({label: k, value: v, color: {trained: "#2c7fb8", complete: "#1e7f3c", open: "#2456c9", leased: "#a15c00", dropped: "#b3261e"}[k]}));
      Object.entries(d.dropped).forEach(([k, v]) => bars.push({label: "dropped: " + k, value: v, color: "#e5837c"}));
      barChart($("chart-groups"), bars);
      for (const [id, names] of STEP_CHARTS) {
        lineChart($(id), names.map(n => ({name: n, points: metric(n)})), {xLabel: "trainer step", robust: true, empty: `the trainer reported no ${names[0]} yet`});
      }
      const stepOf = new Map(d.steps.map(s => [s.version, s.step]));
      lineChart($("chart-length"), [{name: "loss tokens / session", points: d.response_length.filter(p => stepOf.has(p.version)).map(p => [stepOf.get(p.version), p.mean, `v${p.version}, ${plural(p.sessions, "session")}`])}],
        {xLabel: "trainer step", robust: true, empty: "no trained session reported yet"});
      lineChart($("chart-staleness"), ["staleness_max", "staleness_mean"].map(k => ({name: k, points: metric(k)})), {xLabel: "trainer step", empty: "the trainer reported no staleness yet", yMin: 0, robust: true});
      const bt = document.querySelector("#backends tbody");
      bt.replaceChildren(...(d.backends.length ? d.backends.map(b => {
        const tr = el("tr");
        [b.id, b.url, b.healthy ? "healthy" : "down", b.in_flight, b.weight_version ?? "?"].forEach(v => tr.appendChild(el("td", {}, String(v))));
        tr.children[2].className = b.healthy ? "good" : "error";
        return tr;
      }) : [(() => { const tr = el("tr"); tr.appendChild(el("td", {colspan: 5, class: "empty"}, "no backend (a viewer over a finished store)")); return tr; })()]));
      lastQueue = {...d.lease_queue, view_only: d.view_only};
      if (leaseOffset === 0) leaseTable({...d.lease_queue, view_only: d.view_only}, d.now);
    }, 5000);
  }

  function colorRewards(root = document) {
    const cells = [...root.querySelectorAll("[data-reward]")].filter(c => c.dataset.reward !== "");
    const vals = cells.map(c => +c.dataset.reward);
    if (!vals.length) return;
    let lo = Math.min(...vals, 0), hi = Math.max(...vals, 1);
    for (const c of cells) {
      const f = (+c.dataset.reward - lo) / (hi - lo || 1);
      c.style.background = `hsl(${Math.round(120 * f)}, 65%, ${80 - 8 * Math.abs(f - 0.5)}%)`;
    }
  }

  function refreshFragment(targetId) {
    const url = new URL(location.href);
    url.searchParams.set("fragment", "1");
    poll(async () => {
      const html = await getText(url.toString());
      const target = document.getElementById(targetId);
      if (target.innerHTML !== html) { target.innerHTML = html; colorRewards(target); }
    }, 5000);
  }

  function session() {
    const meta = document.getElementById("session-meta"), sid = meta.dataset.session;
    let turns = +meta.dataset.turns;
    poll(async () => {
      const s = await getJSON(`/ui/api/sessions/${encodeURIComponent(sid)}/summary`);
      document.getElementById("session-state").textContent = s.state;
      document.getElementById("session-reward").textContent = fmt(s.reward);
      document.getElementById("session-turns").textContent = s.turn_count;
      if (s.turn_count !== turns) {
        turns = s.turn_count;
        document.getElementById("turns").innerHTML = await getText(`${location.pathname}?fragment=1`);
        document.dispatchEvent(new Event("rollway:turns"));  // the token view reloads its chains
      }
    }, 3000);
    document.getElementById("copy-json").addEventListener("click", async () => {
      const status = document.getElementById("copy-status");
      const text = JSON.stringify(await getJSON(`/ui/api/sessions/${encodeURIComponent(sid)}`), null, 2);
      try { await navigator.clipboard.writeText(text); }
      catch (e) {
        const ta = el("textarea"); ta.value = text; document.body.appendChild(ta); ta.select();
        document.execCommand("copy"); ta.remove();
      }
      status.textContent = `copied ${text.length.toLocaleString()} characters`;
    });
    document.getElementById("turns").addEventListener("click", async ev => {
      const b = ev.target.closest("button.more");
      if (!b) return;
      const t = await getJSON(`/ui/api/sessions/${encodeURIComponent(sid)}/turns/${encodeURIComponent(b.dataset.turn)}`);
      const msgs = t.request.messages || [], i = +b.dataset.index;
      const m = i < msgs.length ? msgs[i] : t.reply;
      let v = m[b.dataset.field];
      if (Array.isArray(v)) v = v.map(p => p.text || "").join("");
      const pre = b.previousElementSibling;
      pre.textContent = v; b.remove();
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    const page = document.body.dataset.page;
    colorRewards();
    if (page === "overview") overview();
    if (page === "groups") refreshFragment("groups-rows");
    if (page === "group") refreshFragment("group-cards");
    if (page === "session") session();
  });
  return {getJSON, el, fmt, poll, lineChart, barChart, ema, ticks};
})();
