// sdopt: shows the profile that SDOptProfileReport sends (the "sdopt.report" websocket event), and the
// checks that SDOptDoctor sends ("sdopt.doctor"), as HTML tables on the node. Only the frontend's public
// API: app, api and LGraphNode.addDOMWidget.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const NODE = "SDOptProfileReport";
const DOCTOR = "SDOptDoctor";
const EVENTS = { "sdopt.report": NODE, "sdopt.doctor": DOCTOR };
const WIDGET = "sdopt_report";
const PROPERTY = "sdopt_report"; // the last report, saved with the workflow so the table survives a reload
const MIN_WIDTH = 560;
const CHART_HEIGHT = 600;
const MEMORY = { vram_allocated: "VRAM", ram_rss: "RAM" };

const STYLE = `
.sdopt-report { box-sizing: border-box; width: 100%; height: 100%; overflow: hidden auto; padding: 6px 8px;
  border-radius: 6px; background: var(--comfy-input-bg, #222); color: var(--input-text, #ddd);
  font: 12px/1.45 system-ui, sans-serif; user-select: text; cursor: auto; }
/* flow-root: the last paragraph's margin counts in the measured height */
.sdopt-report > div { display: flow-root; }
.sdopt-report p { margin: 0 0 4px; overflow-wrap: anywhere; }
.sdopt-report .sdopt-muted { color: var(--descrip-text, #999); }
.sdopt-report .sdopt-cached { padding: 4px 6px; border-radius: 4px; background: #7a5c00; color: #fff; font-weight: 600; }
.sdopt-report ul { margin: 0 0 6px; padding-left: 18px; }
.sdopt-report li { overflow-wrap: anywhere; }
.sdopt-report table { width: 100%; border-collapse: collapse; margin: 2px 0 8px; }
.sdopt-report caption { caption-side: top; text-align: left; font-weight: 600; padding: 2px 0; }
.sdopt-report th, .sdopt-report td { padding: 2px 6px; text-align: left; vertical-align: top;
  border-bottom: 1px solid var(--border-color, #444); overflow-wrap: break-word; }
.sdopt-report th { font-weight: 600; color: var(--descrip-text, #aaa); }
.sdopt-report tr.sdopt-has-note td { border-bottom: none; }
.sdopt-report tr.sdopt-note td { padding-left: 18px; color: var(--descrip-text, #999); overflow-wrap: anywhere; }
.sdopt-report .sdopt-num { text-align: right; font-variant-numeric: tabular-nums; }
.sdopt-report td.sdopt-num { white-space: nowrap; }
.sdopt-report .sdopt-fallback td { color: #e8a33d; }
.sdopt-report .sdopt-status-warn td, .sdopt-report .sdopt-status-unavailable td { color: #e8a33d; }
.sdopt-report .sdopt-status-failed td { color: #ff6b6b; }
.sdopt-report a, .sdopt-report button { color: inherit; font: inherit; font-size: 12px; margin-right: 10px; }
.sdopt-report button { padding: 0 6px; cursor: pointer; background: transparent; border: 1px solid var(--border-color, #555); border-radius: 4px; }
`;

function h(tag, attrs, ...children) {
  const element = Object.assign(document.createElement(tag), attrs);
  element.append(...children.flat().filter((c) => c != null).map((c) => (c instanceof Node ? c : String(c))));
  return element;
}

const fixed = (x, digits) => (typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "–");
const mib = (bytes) =>
  typeof bytes === "number" ? (bytes / 2 ** 20).toLocaleString("en-US", { minimumFractionDigits: 1, maximumFractionDigits: 1 }) : "–";

// columns: [header, value(row), numeric?]; note(row): text for a full-width line under the row (long notes
// would otherwise squeeze their column to a few characters).
function table(caption, columns, rows, { rowClass, note } = {}) {
  const body = rows.flatMap((row) => {
    const text = note?.(row);
    const cells = h("tr", { className: `${rowClass?.(row) ?? ""} ${text ? "sdopt-has-note" : ""}` },
      columns.map(([, value, num]) => h("td", { className: num ? "sdopt-num" : "" }, value(row))));
    return text ? [cells, h("tr", { className: `sdopt-note ${rowClass?.(row) ?? ""}` }, h("td", { colSpan: columns.length }, text))] : [cells];
  });
  return h("table", {},
    h("caption", {}, caption),
    h("thead", {}, h("tr", {}, columns.map(([name, , num]) => h("th", { className: num ? "sdopt-num" : "" }, name)))),
    h("tbody", {}, body));
}

function viewUrl(file) {
  const query = new URLSearchParams({ filename: file.filename, subfolder: file.subfolder ?? "", type: file.type ?? "output" });
  return api.apiURL(`/view?${query}`);
}

// What dynamic VRAM (comfy-aimdo) mapped past PyTorch's allocator, as the markdown table shows it.
function outsideAllocator(entry) {
  return entry.peak_outside_allocator_bytes == null ? "" : ` + ${mib(entry.peak_outside_allocator_bytes)} dynamic VRAM`;
}

function renderReport(data) {
  const report = data?.report;
  if (!report) return [h("p", { className: "sdopt-muted" }, "No profile yet: queue the prompt (with sdopt Profiler on the sampler's MODEL input).")];
  const runs = report.runs ?? [];
  const kind = MEMORY[runs[0]?.memory_kind] ?? (String(report.device).startsWith("cpu") ? "RAM" : "VRAM");
  const parts = [h("p", { className: "sdopt-muted" },
    `device ${report.device} · torch ${report.torch} · ComfyUI ${report.comfyui ?? "?"}` + (report.memory_mode ? ` (${report.memory_mode})` : ""))];
  if (report.cached) parts.push(h("p", { className: "sdopt-cached" }, "Cached: ComfyUI reused the sampling result; these are the last real figures."));
  if (report.notes?.length) parts.push(h("ul", {}, report.notes.map((note) => h("li", {}, note))));
  if (runs.length) {
    parts.push(table("Sampling runs", [
      ["run", (r) => r.label],
      ["steps", (r) => r.steps?.length ?? "–", true],
      ["first step s", (r) => fixed(r.first_step_s, 3), true],
      ["steady it/s", (r) => fixed(r.steady_it_per_s, 2) + (r.steady_steps?.length === 1 && r.steady_steps[0] === 0 ? " (first step only)" : ""), true],
      ["warm-up steps", (r) => (r.steps ?? []).filter((s) => s.warmup && Object.keys(s.warmup).length)
        .map((s) => `${s.index}: ` + Object.entries(s.warmup).map(([kind, sec]) => `${kind} ${fixed(sec, 1)} s`).join(", ")).join("; ") || "–"],
      ["sampler total s", (r) => fixed(r.sampler_total_s, 3), true],
      ["peak memory MiB", (r) => `${mib(r.peak_memory_bytes)} ${MEMORY[r.memory_kind] ?? r.memory_kind ?? ""}${outsideAllocator(r)}`, true],
      ["model", (r) => r.model_family ?? "–"],
    ], runs));
  } else {
    parts.push(h("p", {}, "No sampling run was profiled (is sdopt Profiler on the sampler's MODEL input?)."));
  }
  const records = [
    ...runs.flatMap((run) => (run.optimizations ?? []).map((o) => ({ ...o, run: run.label }))),
    ...(report.optimizations ?? []).map((o) => ({ ...o, run: "(outside sampling)" })),
  ];
  if (records.length) {
    parts.push(table("Optimizations: requested and active", [
      ["run", (o) => o.run], ["node", (o) => o.node], ["requested", (o) => o.requested], ["active", (o) => o.active],
    ], records, { note: (o) => o.note, rowClass: (o) => (/fallback/i.test(o.note ?? "") ? "sdopt-fallback" : "") }));
  }
  if (report.nodes?.length) {
    parts.push(table("Nodes", [
      ["node", (n) => n.id], ["class", (n) => n.class_type],
      ["seconds", (n) => fixed(n.seconds, 3), true],
      [`peak ${kind} MiB`, (n) => mib(n.peak_memory_bytes) + outsideAllocator(n), true],
    ], report.nodes));
  }
  const links = h("p", {});
  if (data.json) links.append(h("a", { href: viewUrl(data.json), target: "_blank", rel: "noopener" }, "JSON report"));
  if (data.chart) links.append(h("a", { href: viewUrl(data.chart), target: "_blank", rel: "noopener" }, "chart"));
  if (data.table) {
    const copy = h("button", { type: "button", title: "Copy the tables as markdown" }, "copy markdown");
    copy.onclick = () => navigator.clipboard?.writeText(data.table).then(() => (copy.textContent = "copied"));
    links.append(copy);
  }
  parts.push(links);
  return parts;
}

function renderDoctor(data) {
  const checks = data?.checks;
  if (!checks) return [h("p", { className: "sdopt-muted" }, "Queue the prompt to check this machine.")];
  const parts = [h("p", {}, data.summary ?? "")];
  parts.push(table("What sdopt can run here", [
    ["check", (c) => c.check], ["status", (c) => c.status], ["result", (c) => c.result], ["fix", (c) => c.fix || "–"],
  ], checks, { note: (c) => `tried: ${c.tried}`, rowClass: (c) => `sdopt-status-${c.status}` }));
  const links = h("p", {});
  if (data.json) links.append(h("a", { href: viewUrl(data.json), target: "_blank", rel: "noopener" }, "JSON"));
  if (data.table) {
    const copy = h("button", { type: "button", title: "Copy the table as markdown" }, "copy markdown");
    copy.onclick = () => navigator.clipboard?.writeText(data.table).then(() => (copy.textContent = "copied"));
    links.append(copy);
  }
  parts.push(links);
  return parts;
}

const RENDER = { [NODE]: renderReport, [DOCTOR]: renderDoctor };
const nodeClass = (node) => node.comfyClass ?? node.type;

function ensureWidget(node) {
  const existing = node.widgets?.find((w) => w.name === WIDGET);
  if (existing) return existing;
  const element = h("div", { className: "sdopt-report" });
  const content = h("div", {});
  element.append(content);
  // The widget is as tall as its content (measured once it is laid out), so nothing is clipped
  // and the space left below goes to the chart preview.
  let height = 60;
  let widget = null; // measure() may run inside addDOMWidget, before the assignment
  const measure = () => {
    // Keep the last height while the element is hidden (0 × 0) or not yet given its width (1.27 lays it
    // out at width 0 first, where every word wraps and the content looks 1000 px tall).
    if (content.offsetWidth >= 150) height = content.offsetHeight + 12 + 2 * (widget?.margin ?? 10); // padding, margin
    return height;
  };
  widget = node.addDOMWidget(WIDGET, "sdopt_report", element, {
    serialize: false,
    getMinHeight: measure,
    getMaxHeight: measure,
    getHeight: measure,
  });
  widget.serialize = false; // keeps it out of widgets_values (the litegraph flag; options.serialize is the prompt's)
  widget.sdoptContent = content;
  // Content grows when the node is narrowed (wrapping) or a new report comes: grow the node with it.
  new ResizeObserver(() => node.graph && fitNode(node, 0)).observe(content);
  return widget;
}

// Only grows the node: a size the user chose (larger) stays.
function fitNode(node, extraHeight) {
  const [width, height] = node.computeSize();
  const size = [Math.max(node.size[0], width), Math.max(node.size[1], height + extraHeight)];
  if (size[0] !== node.size[0] || size[1] !== node.size[1]) {
    node.setSize(size);
    node.setDirtyCanvas?.(true, true);
  }
}

// fresh: a report just arrived. Its chart comes after it (the node's "executed" message) and gets
// CHART_HEIGHT below the table unless the node is already that tall.
function show(node, data, fresh = false) {
  const widget = ensureWidget(node);
  widget.sdoptContent.replaceChildren(...RENDER[nodeClass(node)](data));
  if ((data?.report || data?.checks) && node.size[0] < MIN_WIDTH) node.setSize([MIN_WIDTH, node.size[1]]);
  requestAnimationFrame(() => fitNode(node, fresh && data?.chart ? CHART_HEIGHT : 0));
}

// The event names the node by execution id: "12", or "7:12" for node 12 inside subgraph node 7.
function findNode(executionId) {
  let graph = app.rootGraph ?? app.graph;
  let node = null;
  for (const id of String(executionId).split(":")) {
    node = graph?.getNodeById(Number(id)) ?? graph?.getNodeById(id);
    graph = node?.subgraph;
  }
  return node;
}

app.registerExtension({
  name: "sdopt.ProfileReport",
  setup() {
    document.head.append(h("style", { id: "sdopt-style" }, STYLE));
    for (const [event, type] of Object.entries(EVENTS)) {
      api.addEventListener(event, ({ detail }) => {
        const node = detail && findNode(detail.node);
        if (!node || nodeClass(node) !== type) return; // the prompt's tab is not the one shown
        const { node: _id, path: _path, ...kept } = detail;
        node.properties[PROPERTY] = kept;
        show(node, node.properties[PROPERTY], true);
        // Tell the workflow's change tracker, so the saved (and reload-persisted) workflow has the report.
        app.canvas?.emitBeforeChange?.();
        app.canvas?.emitAfterChange?.();
      });
    }
  },
  beforeRegisterNodeDef(nodeType, nodeData) {
    if (!(nodeData.name in RENDER)) return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = onNodeCreated?.apply(this, arguments);
      show(this, this.properties?.[PROPERTY]);
      return result;
    };
    // Loading a workflow, switching tabs, reloading, pasting: the properties carry the last report.
    const onConfigure = nodeType.prototype.onConfigure;
    nodeType.prototype.onConfigure = function () {
      const result = onConfigure?.apply(this, arguments);
      show(this, this.properties?.[PROPERTY]);
      return result;
    };
  },
});
