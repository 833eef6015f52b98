// Renders the per-rank program data that ssmshard/views/program_data.py writes into the page.
// Everything is generic over tags: a block kind or collective kind this script has never heard
// of still renders, with a colour derived from its name.
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("ssmshard-data").textContent);
  const KIND_COLOURS = {mamba1: "#2e90fa", mamba2: "#1570ef", attention: "#dd2590", mlp: "#7a5af8",
                        embed: "#12b76a", norm: "#98a2b3", head: "#f79009", glue: "#d0d5dd"};
  const SYNC_COLOURS = {all_reduce: "#b42318", all_gather: "#175cd3", reduce_scatter: "#6941c6",
                        all_to_all: "#c4320a", broadcast: "#087443", shift: "#344054"};

  function hashHue(text) {
    let h = 0;
    for (const c of text) h = (h * 31 + c.charCodeAt(0)) >>> 0;
    return h % 360;
  }
  const colour = (table, name) => table[name] || `hsl(${hashHue(name)}, 60%, 42%)`;

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }
  const shape = (dims) => "(" + dims.join(", ") + (dims.length === 1 ? ",)" : ")");
  const bytes = (n) => (n === null || n === undefined) ? "?" : n.toLocaleString("en-US");

  function weightChip(w) {
    const chip = el("span", "weight" + (w.placement.startsWith("S(") ? " sharded" : ""), w.name);
    chip.dataset.tip = [w.fqn, `placement   ${w.placement}`, `global      ${shape(w.shape)} ${w.dtype}`,
                        `local       ${shape(w.local_shape)}`, `this rank   ${w.held}`].join("\n");
    return chip;
  }

  function collectiveMark(c) {
    const mark = el("div", "collective", `${c.sync} · ${bytes(c.bytes_per_token)} B/token`);
    mark.dataset.sync = c.sync;
    mark.style.setProperty("--sync", colour(SYNC_COLOURS, c.sync));
    const lines = [`${c.sync} after ${c.role || "?"} (${c.name})`, `dtype ${c.dtype}`,
                   `${bytes(c.bytes_per_token)} bytes per token`];
    for (const [k, v] of Object.entries(c.extra)) lines.push(`${k} = ${v}`);
    mark.dataset.tip = lines.join("\n");
    return mark;
  }

  function opsList(block) {
    const details = el("details", "ops");
    details.appendChild(el("summary", null, `${block.nodes.length} ops`));
    details.addEventListener("toggle", () => {  // built on first open: large programs stay light
      if (!details.open || details.querySelector("ul")) return;
      const list = el("ul");
      for (const n of block.nodes) {
        const extra = Object.entries(n.extra).map(([k, v]) => ` ${k}=${v}`).join("");
        const placed = n.placement ? ` [${n.placement}]` : "";
        list.appendChild(el("li", null, `${n.name}: ${n.op} (${n.role})${placed}${extra}`));
      }
      details.appendChild(list);
    });
    return details;
  }

  function blockElement(block) {
    const small = block.nodes.length <= 2 && !block.weights.length && !block.collectives.length;
    const node = el("div", "block" + (small ? " small" : ""));
    node.dataset.kind = block.kind;
    node.style.setProperty("--kind", colour(KIND_COLOURS, block.kind));
    const head = el("div", "block-head");
    head.append(el("span", "kind", block.kind), el("span", "site", block.site));
    node.appendChild(head);
    if (block.roles.length) node.appendChild(el("div", "meta", block.roles.join(", ")));
    if (block.weights.length) {
      const weights = el("div", "weights");
      block.weights.forEach((w) => weights.appendChild(weightChip(w)));
      node.appendChild(weights);
    }
    for (const [name, values] of Object.entries(block.tags)) {
      if (name !== "sync_id") node.appendChild(el("span", "tag", `${name}: ${values.join(", ")}`));
    }
    block.collectives.forEach((c) => node.appendChild(collectiveMark(c)));
    node.appendChild(opsList(block));
    return node;
  }

  function legend(rank) {
    const box = document.getElementById("legend");
    box.replaceChildren();
    const kinds = new Set(), syncs = new Set();
    rank.rows.forEach((r) => r.blocks.forEach((b) => {
      kinds.add(b.kind);
      b.collectives.forEach((c) => syncs.add(c.sync));
    }));
    const swatch = (label, fill) => {
      const s = el("span", "swatch");
      const i = el("i");
      i.style.background = fill;
      s.append(i, document.createTextNode(label));
      box.appendChild(s);
    };
    kinds.forEach((k) => swatch(k, colour(KIND_COLOURS, k)));
    syncs.forEach((k) => swatch(k + " (collective)", colour(SYNC_COLOURS, k)));
  }

  function render(index) {
    const rank = DATA.ranks[index];
    const main = document.getElementById("program");
    main.replaceChildren();
    for (const row of rank.rows) {
      const line = el("section", "row");
      line.appendChild(el("div", "row-label", row.label));
      const blocks = el("div", "blocks");
      row.blocks.forEach((b) => blocks.appendChild(blockElement(b)));
      line.appendChild(blocks);
      main.appendChild(line);
    }
    document.getElementById("totals").textContent =
      `rank ${rank.rank} of tp=${rank.tp}: ${rank.collectives} collectives, ` +
      `${bytes(rank.bytes_per_token)} bytes per token in all`;
    legend(rank);
    document.body.dataset.rank = String(rank.rank);
  }

  function tooltips() {
    const tip = document.getElementById("tip");
    document.addEventListener("mouseover", (event) => {
      const target = event.target.closest("[data-tip]");
      if (!target) { tip.hidden = true; return; }
      tip.textContent = target.dataset.tip;
      tip.hidden = false;
      const box = target.getBoundingClientRect();
      tip.style.left = Math.min(box.left, window.innerWidth - 470) + "px";
      tip.style.top = (box.bottom + 6) + "px";
    });
  }

  document.getElementById("title").textContent = DATA.title;
  document.title = DATA.title;
  const select = document.getElementById("rank");
  DATA.ranks.forEach((r, i) => select.appendChild(new Option(`${r.rank} of ${r.tp}`, String(i))));
  const wanted = Number((location.hash.match(/rank=(\d+)/) || [])[1] || 0);
  select.value = String(wanted < DATA.ranks.length ? wanted : 0);
  select.addEventListener("change", () => {
    render(Number(select.value));
    history.replaceState(null, "", "#rank=" + select.value);
  });
  tooltips();
  render(Number(select.value));
})();
