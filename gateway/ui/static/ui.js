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
    (typeof v === "number" ? (Math.abs(v) >= 1e4 ? Math.round(v).toLocaleString() : +v.toPrecision(d) + "") : String(v));
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

  function ticks(lo, hi, n = 4) {
    if (hi === lo) { hi = lo + 1; }
    const step0 = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(step0)));
    const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= step0) || step0;
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
    return out;
  }
  const clock = t => { const d = new Date(t * 1000); return d.toTimeString().slice(0, 5); };

  /** A line chart into `fig` (a <figure>): series [{name, points: [[x, y]], dots, step, color}]. */
  function lineChart(fig, series, opts = {}) {
    const W = 520, H = 210, L = 44, R = 10, T = 22, B = 26;
    fig.querySelectorAll("svg, .none").forEach(n => n.remove());
    const pts = series.flatMap(s => s.points).filter(p => p[1] !== null && Number.isFinite(p[1]));
    if (!pts.length) { fig.appendChild(el("div", {class: "none"}, opts.empty || "nothing recorded yet")); return; }
    let x0 = Math.min(...pts.map(p => p[0])), x1 = Math.max(...pts.map(p => p[0]));
    let y0 = opts.yMin ?? Math.min(...pts.map(p => p[1])), y1 = opts.yMax ?? Math.max(...pts.map(p => p[1]));
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
    const X = x => L + (x - x0) / (x1 - x0) * (W - L - R), Y = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
    const svg = svgEl("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": fig.querySelector("figcaption")?.textContent || "chart"});
    for (const v of ticks(y0, y1)) {
      svg.appendChild(svgEl("line", {x1: L, x2: W - R, y1: Y(v), y2: Y(v), class: "grid"}));
      svg.appendChild(svgEl("text", {x: L - 4, y: Y(v) + 3, "text-anchor": "end"}, fmt(v)));
    }
    for (const v of ticks(x0, x1, 5)) {
      svg.appendChild(svgEl("text", {x: X(v), y: H - 8, "text-anchor": "middle"}, opts.xTime ? clock(v) : fmt(v)));
    }
    svg.appendChild(svgEl("line", {x1: L, x2: L, y1: T, y2: H - B, class: "axis"}));
    svg.appendChild(svgEl("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis"}));
    const legend = svgEl("g", {class: "legend"});
    series.forEach((s, i) => {
      const color = s.color || COLORS[i % COLORS.length];
      const p = s.points.filter(q => q[1] !== null && Number.isFinite(q[1]));
      if (s.dots) p.forEach(q => svg.appendChild(svgEl("circle", {cx: X(q[0]), cy: Y(q[1]), r: 2.2, fill: color, opacity: 0.45})));
      if (!s.dots || s.line) {
        let d = "";
        p.forEach((q, j) => {
          if (j && s.step) d += `H${X(q[0]).toFixed(1)}`;
          d += `${j ? "L" : "M"}${X(q[0]).toFixed(1)},${Y(q[1]).toFixed(1)}`;
        });
        svg.appendChild(svgEl("path", {d, fill: "none", stroke: color, "stroke-width": 1.8}));
        if (p.length === 1) svg.appendChild(svgEl("circle", {cx: X(p[0][0]), cy: Y(p[0][1]), r: 3, fill: color}));
      }
      if (!s.hideLegend) {
        const lx = L + 8 + i * 120;
        legend.appendChild(svgEl("rect", {x: lx, y: 6, width: 10, height: 10, fill: color}));
        legend.appendChild(svgEl("text", {x: lx + 14, y: 15}, s.name));
      }
    });
    svg.appendChild(legend);
    fig.appendChild(svg);
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
      const tc = d.train_reward_by_clock.map(p => [p.t, p.mean]);
      lineChart($("chart-train-clock"), [{name: "raw", dots: true, points: tc, color: "#9aa6b8"}, {name: "EMA", points: ema(tc)}], {xTime: true});
      lineChart($("chart-train-version"), [{name: "mean reward", points: d.train_reward_by_version.map(p => [p.version, p.mean])}], {empty: "no trained group yet"});
      const ev = Object.entries(d.eval_by_version).filter(([k]) => k !== "unknown").map(([k, v]) => [+k, v]).sort((a, b) => a[0] - b[0]);
      lineChart($("chart-eval-version"), [{name: "mean", points: ev.map(([k, v]) => [k, v.mean_reward])},
        {name: "pass@k", points: ev.map(([k, v]) => [k, v.pass_at_k])}], {empty: "no eval group with an eval_version yet"});
      lineChart($("chart-eval-clock"), [{name: "mean", points: d.eval_by_clock.map(p => [p.t, p.mean])},
        {name: "pass@k", points: d.eval_by_clock.map(p => [p.t, p.pass_at_k])}], {xTime: true, empty: "no eval group yet"});
      lineChart($("chart-throughput"), [{name: "sessions/s", points: d.throughput.map(p => [p.t, p.per_s])}], {xTime: true, yMin: 0});
      const bars = Object.entries(g).map(([k, v]) => ({label: k, value: v, color: {trained: "#2c7fb8", complete: "#1e7f3c", open: "#2456c9", leased: "#a15c00", dropped: "#b3261e"}[k]}));
      Object.entries(d.dropped).forEach(([k, v]) => bars.push({label: "dropped: " + k, value: v, color: "#e5837c"}));
      barChart($("chart-groups"), bars);
      const m = name => d.steps.filter(s => typeof s.metrics[name] === "number").map(s => [s.step, s.metrics[name]]);
      lineChart($("chart-loss"), ["loss", "kl", "entropy"].map(n => ({name: n, points: m(n)})).filter(s => s.points.length), {empty: "no trainer step reported yet"});
      const sk = d.steps.length ? Object.keys(d.steps[d.steps.length - 1].metrics).filter(k => k.includes("stale")) : [];
      lineChart($("chart-staleness"), sk.map(k => ({name: k, points: m(k)})), {empty: "the trainer reported no staleness yet", yMin: 0});
      const bt = document.querySelector("#backends tbody");
      bt.replaceChildren(...(d.backends.length ? d.backends.map(b => {
        const tr = el("tr");
        [b.id, b.url, b.healthy ? "healthy" : "down", b.in_flight, b.weight_version ?? "?"].forEach(v => tr.appendChild(el("td", {}, String(v))));
        tr.children[2].className = b.healthy ? "good" : "error";
        return tr;
      }) : [(() => { const tr = el("tr"); tr.appendChild(el("td", {colspan: 5, class: "empty"}, "no backend (a viewer over a finished store)")); return tr; })()]));
      const q = d.lease_queue;
      document.getElementById("queue").textContent = `${q.complete} complete groups wait for a trainer; ${q.leased} leased in ${q.leases.length} lease(s).`;
      document.querySelector("#leases tbody").replaceChildren(...q.leases.map(l => {
        const tr = el("tr");
        [l.id, l.groups, l.trainer_version, fmt(l.expires_at - d.now, 2) + " s"].forEach(v => tr.appendChild(el("td", {}, String(v))));
        return tr;
      }));
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
  return {getJSON, el, fmt, poll, lineChart, barChart, ema};
})();
