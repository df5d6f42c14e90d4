/* The session page's token view: one page of one chain at a time from /ui/api/sessions/<id>/tokens.
   Each token is shaded by its behaviour probability exp(logprob) (red = unlikely, green = likely); prompt
   tokens are grey; a solid underline marks tokens trained (loss mask 1), a dotted one tokens generated but
   trained elsewhere (or not at all); a purple mark shows a weight-version change inside a reply; at a new
   chain the drift report puts its tokens beside those of the turn it left, the first divergent one boxed. */
"use strict";
(() => {
  const view = document.getElementById("token-view");
  if (!view) return;
  const sid = document.getElementById("session-meta").dataset.session;
  const box = document.getElementById("tokens"), pager = document.getElementById("token-pager");
  const driftBox = document.getElementById("drift"), title = document.getElementById("token-title");
  let state = null;

  const shown = t => t.replace(/\n/g, "↵\n").replace(/\t/g, "⇥");
  function span(text, cls, tip, bg) {
    const s = document.createElement("span");
    s.className = "tok " + cls;
    s.textContent = shown(text);
    if (tip) s.title = tip;
    if (bg) s.style.background = bg;
    return s;
  }
  const shade = lp => `hsl(${Math.round(120 * Math.exp(lp))}, 70%, ${82 + 6 * Math.exp(lp)}%)`;
  function mark(cls, text, tip) {
    const m = document.createElement("span");
    m.className = cls; m.textContent = text; if (tip) m.title = tip;
    return m;
  }

  function renderDrift(d, texts) {
    driftBox.replaceChildren();
    if (!d) return;
    const wrap = document.createElement("div");
    wrap.className = "drift";
    wrap.id = "drift-report";
    const head = mark("", `New chain at turn ${d.seq} (${d.reason}): its prompt leaves turn ${d.against_seq}'s tokens at token ${d.index}` +
      (d.index >= d.theirs_len ? " (after all of them)" : d.index >= d.ours_len ? " (it is a prefix of them)" : ""));
    head.style.gridColumn = "1 / 3";
    wrap.appendChild(head);
    for (const [label, ids, text] of [[`this chain (turn ${d.seq})`, d.ours, texts.ours], [`turn ${d.against_seq}`, d.theirs, texts.theirs]]) {
      wrap.appendChild(mark("dim", label));
      const row = document.createElement("div");
      row.className = "tokens";
      ids.forEach((id, j) => {
        const at = d.context_start + j;
        row.appendChild(span(text[j], at === d.index ? "prompt diverge" : "prompt",
          `#${id} at ${at}` + (at === d.index ? " — first divergent token" : "")));
      });
      if (!ids.length || d.context_start + ids.length <= d.index) row.appendChild(mark("dim", " (ends here)"));
      wrap.appendChild(row);
    }
    driftBox.appendChild(wrap);
  }

  function render(d) {
    state = d;
    const frag = document.createDocumentFragment();
    const starts = new Map(), replies = new Map(), bounds = new Map();
    d.turns.forEach(t => { starts.set(t.start, t); replies.set(t.completion_start, t); });
    d.boundaries.forEach(b => bounds.set(b.index, b));
    for (let j = 0; j < d.ids.length; j++) {
      const i = d.offset + j;
      if (starts.has(i)) frag.appendChild(mark("turnmark", `turn ${starts.get(i).seq}`, "prompt of this turn (delta on its parent)"));
      if (replies.has(i)) frag.appendChild(mark("turnmark", `reply ${replies.get(i).seq}`));
      if (bounds.has(i)) { const b = bounds.get(i); frag.appendChild(mark("vmark", `v${b.from}→v${b.to}`, "weights published mid-reply")); }
      const lp = d.logprobs[j];
      let cls = lp === null ? "prompt" : d.mask[j] ? "trained" : "untrained";
      if (d.drift && i === d.drift.index && lp === null) cls += " diverge";
      const tip = `#${d.ids[j]} · token ${i}` + (lp === null ? " · prompt" :
        ` · logprob ${lp} · p ${Math.exp(lp).toFixed(3)} · v${d.versions[j]} · mask ${d.mask[j]}`);
      frag.appendChild(span(d.text[j], cls, tip, lp === null ? null : shade(lp)));
    }
    box.replaceChildren(frag);
    renderDrift(d.drift && d.drift.index >= 0 ? d.drift : null, d.drift_text || {ours: [], theirs: []});
    const pages = Math.max(1, Math.ceil(d.total / d.limit)), at = Math.floor(d.offset / d.limit) + 1;
    title.textContent = `chain ending at ${d.leaf_id.slice(0, 18)}… · tokens ${d.offset}–${d.offset + d.ids.length} of ${d.total}`;
    pager.replaceChildren();
    const go = (label, offset, id) => {
      const b = document.createElement("button");
      b.type = "button"; b.textContent = label; b.id = id;
      b.disabled = offset === null;
      if (offset !== null) b.addEventListener("click", () => load({chain: d.leaf_id, offset}));
      pager.appendChild(b);
    };
    go("« start", d.offset > 0 ? 0 : null, "tok-first");
    go("‹ earlier", d.offset > 0 ? Math.max(0, d.offset - d.limit) : null, "tok-prev");
    pager.appendChild(mark("dim", `page ≈${at} of ${pages}`));
    go("later ›", d.offset + d.ids.length < d.total ? d.offset + d.ids.length : null, "tok-next");
    go("end »", d.offset + d.ids.length < d.total ? Math.max(0, d.total - d.limit) : null, "tok-last");
    box.dataset.offset = d.offset;
    box.dataset.chain = d.leaf_id;
    box.dataset.ready = "1";
  }

  async function load(q) {
    box.dataset.ready = "";
    view.hidden = false;
    const params = new URLSearchParams(q);
    const d = await UI.getJSON(`/ui/api/sessions/${encodeURIComponent(sid)}/tokens?${params}`);
    render(d);
  }

  document.addEventListener("click", ev => {
    const b = ev.target.closest("button.show-tokens");
    if (!b) return;
    const q = b.dataset.turn ? {turn: b.dataset.turn} : {chain: b.dataset.chain};
    history.replaceState(null, "", "#tokens=" + (b.dataset.turn ? "turn:" + b.dataset.turn : "chain:" + b.dataset.chain));
    load(q).then(() => view.scrollIntoView());
  });
  async function loadChains() {
    const d = await UI.getJSON(`/ui/api/sessions/${encodeURIComponent(sid)}/chains`);
    const body = document.getElementById("chains-body");
    body.replaceChildren(...d.data.map(c => {
      const tr = document.createElement("tr");
      tr.dataset.chain = c.leaf_id;
      const cells = [c.leaf_id.slice(0, 18) + "…", c.turns.map(t => t.seq).join(", "), c.tokens, c.eval ? "– (eval: never trained)" : c.trained,
        c.boundaries.map(b => `turn ${b.seq}: v${b.from}→v${b.to}`).join("; ") || "–",
        c.drift ? `${c.drift.reason} at token ${c.drift.index} (vs turn ${c.drift.against_seq})` : "first turn"];
      cells.forEach((v, i) => { const td = document.createElement("td"); td.textContent = String(v); if (i === 2 || i === 3) td.className = "num"; if (i === 0) td.className = "mono"; tr.appendChild(td); });
      const td = document.createElement("td"), b = document.createElement("button");
      b.type = "button"; b.className = "show-tokens"; b.dataset.chain = c.leaf_id; b.textContent = "tokens";
      td.appendChild(b); tr.appendChild(td);
      return tr;
    }));
  }
  loadChains();
  document.addEventListener("rollway:turns", () => loadChains());
  // #tokens=last | #tokens=turn:<id> | #tokens=chain:<leaf id>: open the token view on load.
  const m = location.hash.match(/^#tokens=(last|turn:(.+)|chain:(.+))$/);
  if (m) {
    const q = m[1] === "last" ? {turn: "last"} : m[2] ? {turn: decodeURIComponent(m[2])} : {chain: decodeURIComponent(m[3])};
    load(q).then(() => view.scrollIntoView());
  }
})();
