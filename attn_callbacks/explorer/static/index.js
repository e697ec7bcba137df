// The "Attention" tab: search any tracked token of a run and see whom it attends to, who attends to it, a heatmap of
// its neighbourhood and how its row moved across epochs. TensorBoard loads this module in a same-origin iframe
// (data/plugin_entry.html, whose <base href="plugin/attention_explorer/"> makes fetch("runs") reach the plugin's
// routes) and calls render(). Plain ES module, no build step and no dependencies: the page's CSP allows scripts from
// the plugin's own routes only. Labels are arbitrary strings (a token may be "<b>"), so they reach the DOM as text
// only, never as markup.
//
// A token is a vocabulary id. In a cross-attention module (query stream != key stream) the same id names two
// different tokens, one per axis, so there a token also has a side: "query" (its row) or "key" (its column).

const PLUGIN = "attention_explorer";
// TensorBoard's hash (its tf_storage) is "<tab>&key=value&...". It keeps keys it does not know whenever it rewrites
// the hash (it parses the current hash each time), and namespaces a plugin's keys "p.<plugin>.<key>".
const HASH_PREFIX = `p.${PLUGIN}.`;
const URL_KEYS = ["run", "view", "head", "epoch", "step", "token", "side", "size", "map", "colour"];
const DEFAULT_SIZE = 24;
const MAX_SIZE = 128; // an SVG of 128² cells still draws in well under a second
const HISTORY_KEYS = 5;
const REFRESH_MS = 30000;
const ID_SEARCH = /^#(\d+)$/; // "#12" searches the token with id 12
const SCRUB_DELAY_MS = 120;
const HOW_TO =
  "an AttentionMonitor with a TensorBoardLogger writes it into <run>/plugins/attention_explorer/ at each monitored " +
  "validation epoch (explorer=True is the default; explorer_size sets how many tokens it keeps).";
// prettier-ignore
const VIRIDIS = [
  "#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b", "#fde725",
];
const SERIES = ["#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f"];
const SVG_NS = "http://www.w3.org/2000/svg";

const STYLE = `
:root { --bg: #fff; --fg: #212121; --muted: #616161; --line: #e0e0e0; --panel: #fafafa; --accent: #f57c00;
  --empty: #eeeeee; --error: #c62828; --error-bg: #ffebee; --info-bg: #fff8e1; --bar: #90caf9; color-scheme: light; }
:root.dark { --bg: #303030; --fg: #eee; --muted: #aaa; --line: #555; --panel: #3a3a3a; --accent: #ffb74d;
  --empty: #262626; --error: #ef9a9a; --error-bg: #4a2626; --info-bg: #4a4126; --bar: #1e5a8c; color-scheme: dark; }
[hidden] { display: none !important; }
html, body { margin: 0; background: var(--bg); color: var(--fg); font: 13px/1.4 Roboto, "Helvetica Neue", sans-serif; }
.explorer { padding: 12px 16px 32px; }
.controls { display: flex; flex-wrap: wrap; gap: 8px 18px; align-items: center; padding-bottom: 10px;
  border-bottom: 1px solid var(--line); }
.control { display: flex; align-items: center; gap: 6px; }
.control label { color: var(--muted); }
select, input { font: inherit; color: var(--fg); background: var(--bg); border: 1px solid var(--line);
  border-radius: 3px; padding: 2px 4px; }
select#view { max-width: 360px; }
input#epoch { width: 160px; }
input#token { width: 240px; font-size: 14px; padding: 4px 6px; }
input#size { width: 56px; }
output { color: var(--muted); min-width: 11em; }
.search { display: flex; align-items: center; gap: 10px; margin: 12px 0 6px; flex-wrap: wrap; }
.hint, .muted { color: var(--muted); }
.message { margin: 8px 0; padding: 8px 12px; border-radius: 3px; background: var(--info-bg); }
.message.error { background: var(--error-bg); color: var(--error); }
.message:empty { display: none; }
.layout { display: grid; grid-template-columns: minmax(480px, 580px) minmax(0, 1fr); gap: 18px; align-items: start; }
@media (max-width: 1000px) { .layout { grid-template-columns: minmax(0, 1fr); } }
h2 { font-size: 14px; font-weight: 500; margin: 14px 0 6px; }
h3 { font-size: 13px; font-weight: 500; margin: 0 0 4px; }
h2 small, h3 small { color: var(--muted); font-weight: normal; }
.summary { margin: 4px 0 8px; }
.summary strong { font-size: 15px; }
.lists { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 12px; }
.list { max-height: max(200px, 30vh); overflow-y: auto; border: 1px solid var(--line); border-radius: 3px;
  background: var(--panel); }
.head-row, ol.ranked li { display: grid; grid-template-columns: 1.8em minmax(3em, 1fr) 4.4em 3.2em 3.4em; gap: 4px;
  align-items: center; padding: 1px 6px; }
.head-row { color: var(--muted); font-size: 11px; border-bottom: 1px solid var(--line); position: sticky; top: 0;
  background: var(--panel); z-index: 2; }
.head-row span:nth-child(n+3) { text-align: right; }
ol.ranked { list-style: none; margin: 0; padding: 0; counter-reset: rank; }
ol.ranked li { position: relative; counter-increment: rank; }
ol.ranked li::before { content: counter(rank); color: var(--muted); text-align: right; padding-right: 4px; }
ol.ranked li .bar { position: absolute; left: 0; top: 1px; bottom: 1px; background: var(--bar); opacity: 0.45; }
ol.ranked li > * { position: relative; }
ol.ranked .num { text-align: right; font-variant-numeric: tabular-nums; }
ol.ranked .lift, ol.ranked .count { color: var(--muted); }
button.token { font: inherit; color: inherit; background: none; border: 0; padding: 0; cursor: pointer;
  text-align: left; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
button.token:hover { text-decoration: underline; }
.empty-list { padding: 6px 8px; color: var(--muted); }
.heatmap-tools { display: flex; gap: 14px; align-items: center; flex-wrap: wrap; margin-bottom: 6px; }
svg text { fill: var(--fg); font-size: 11px; }
svg .axis-label { cursor: pointer; }
svg .axis-label:hover { text-decoration: underline; }
svg .axis { stroke: var(--line); }
svg .tick { fill: var(--muted); font-size: 10px; }
svg rect.cell:hover { stroke: var(--fg); stroke-width: 1; }
svg .outline { fill: none; stroke: var(--accent); stroke-width: 2.5; pointer-events: none; }
svg .marker { stroke: var(--muted); stroke-dasharray: 3 3; }
.legend { display: flex; align-items: center; gap: 6px; color: var(--muted); font-size: 11px; margin-top: 4px; }
.legend .ramp { width: 160px; height: 10px; border-radius: 2px; }
ul.series { list-style: none; padding: 0; margin: 4px 0 0; display: flex; flex-wrap: wrap; gap: 4px 14px; }
ul.series .swatch { display: inline-block; width: 14px; height: 3px; vertical-align: middle; margin-right: 5px; }
.tooltip { position: fixed; z-index: 10; pointer-events: none; background: var(--bg); color: var(--fg);
  border: 1px solid var(--line); box-shadow: 0 2px 6px rgba(0, 0, 0, 0.25); padding: 5px 8px; border-radius: 3px;
  font-size: 12px; white-space: pre; }
`;

const state = {
  runs: [], // [{run, views}], views null for a run TensorBoard lists without explorer data
  run: null,
  view: null,
  head: "mean",
  index: -1, // into the view's epochs
  token: null, // a vocabulary id
  side: null, // null in self-attention; "query" or "key" in cross-attention
  size: DEFAULT_SIZE,
  map: "around", // the heatmap around the searched token, or "top": the most frequent tokens
  colour: "p",
  labels: null, // the shown epoch's tokens, see tokensOf()
  heat: null, // the last heatmap answer, redrawn when the theme or the colour changes
  notice: null, // what of the link could not be followed
};
const ui = {};
let generation = 0; // bumped per load: answers to an older load are dropped
let controller = null;
let scrubTimer = 0;
// Where the pointer last was in this frame (null: outside it): a heatmap redrawn under a still pointer (a click on a
// cell, a scrub with the keys) gets the tooltip of the cell now under it, not the old one's.
let pointer = null;
document.addEventListener("pointermove", (event) => (pointer = { clientX: event.clientX, clientY: event.clientY }));
document.documentElement.addEventListener("pointerleave", () => (pointer = null));
const labelCache = new Map();

export function render() {
  if (ui.root) return;
  document.head.append(h("style", {}, STYLE));
  buildPage();
  followTheme();
  let width = 0;
  new ResizeObserver(() => {
    // The cells follow the panel's width; small changes (a scrollbar) are not worth a redraw.
    if (Math.abs(ui.heatmap.clientWidth - width) < 24) return;
    width = ui.heatmap.clientWidth;
    redrawHeatmap();
  }).observe(ui.heatmap);
  const host = hostWindow();
  // An address edited by hand changes the parent's hash only; our own replaceState writes fire no event.
  (host || window).addEventListener("hashchange", () => followLocation());
  if (host && window.frameElement) {
    // TensorBoard's reload button and auto-reload call reload() on the plugin's element: this iframe.
    window.frameElement.reload = () => refreshRuns();
  } else {
    setInterval(() => document.visibilityState === "visible" && refreshRuns(), REFRESH_MS);
  }
  start();
}

// ------------------------------------------------------------------------------------------------------------ DOM
function h(tag, attrs = {}, ...children) {
  return fill(document.createElement(tag), attrs, children);
}

function svg(tag, attrs = {}, ...children) {
  return fill(document.createElementNS(SVG_NS, tag), attrs, children);
}

function fill(element, attrs, children) {
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) element.addEventListener(key.slice(2), value);
    else element.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined && child !== false) element.append(child);
  }
  return element;
}

// A <label for> rather than a wrapping label: a wrapping one would add the selected option to the accessible name.
function control(id, text, input, ...after) {
  return h("span", { class: "control" }, h("label", { for: id }, text), input, ...after);
}

function buildPage() {
  // Disabled until the runs are listed, so that nothing is chosen against an empty state.
  ui.run = h("select", { id: "run", disabled: true, onchange: () => chooseRun(ui.run.value) });
  ui.view = h("select", { id: "view", disabled: true, onchange: () => chooseView(ui.view.value) });
  ui.head = h("select", { id: "head", disabled: true, onchange: () => ((state.head = ui.head.value), load()) });
  ui.epoch = h("input", { id: "epoch", type: "range", min: 0, max: 0, step: 1, value: 0, disabled: true });
  ui.epoch.addEventListener("input", () => scrub(false));
  ui.epoch.addEventListener("change", () => scrub(true));
  ui.epochText = h("output", { for: "epoch" });
  ui.streams = h("span", { class: "muted" });
  ui.token = h("input", {
    id: "token",
    type: "search",
    list: "tokens",
    disabled: true, // until an epoch's tokens are known
    autocomplete: "off",
    spellcheck: "false",
    placeholder: "search a token (label or #id)",
  });
  ui.token.addEventListener("change", () => commitToken());
  ui.token.addEventListener("input", (event) => {
    // Picking a datalist suggestion fires an input event without an inputType: take it at once.
    if (!event.inputType || event.inputType === "insertReplacementText") commitToken();
  });
  ui.tokens = h("datalist", { id: "tokens" });
  ui.tokenHint = h("span", { class: "hint" });
  ui.message = h("div", { class: "message", role: "status", "aria-live": "polite" });
  ui.summary = h("div", { class: "summary", "aria-live": "polite" });
  ui.attendsTo = h("div", { class: "list" });
  ui.attendedBy = h("div", { class: "list" });
  ui.history = h("div", {});
  ui.size = h("input", { id: "size", type: "number", min: 2, max: MAX_SIZE, value: DEFAULT_SIZE });
  ui.size.addEventListener("change", () => {
    state.size = clampSize(ui.size.value);
    load();
  });
  ui.map = h(
    "select",
    { id: "map", onchange: () => ((state.map = ui.map.value), load()) },
    h("option", { value: "around" }, "the token's neighbourhood"),
    h("option", { value: "top" }, "the most frequent tokens"),
  );
  ui.colour = h(
    "select",
    { id: "colour", onchange: () => ((state.colour = ui.colour.value), writeLocation(), redrawHeatmap()) },
    h("option", { value: "p" }, "P"),
    h("option", { value: "lift" }, "lift (log scale)"),
  );
  ui.heatTitle = h("h2", {});
  ui.heatmap = h("div", {});
  ui.tooltip = h("div", { class: "tooltip", role: "tooltip", hidden: true });
  ui.lists = h(
    "div",
    { class: "lists" },
    h("div", {}, h("h3", {}, "attends to ", h("small", {}, "its row: P[token, key]")), ui.attendsTo),
    h("div", {}, h("h3", {}, "attended by ", h("small", {}, "its column: P[query, token]")), ui.attendedBy),
  );
  ui.root = h(
    "main",
    { class: "explorer" },
    h(
      "div",
      { class: "controls" },
      control("run", "run", ui.run),
      control("view", "module", ui.view),
      control("head", "head", ui.head),
      control("epoch", "epoch", ui.epoch, ui.epochText),
      ui.streams,
    ),
    h("div", { class: "search" }, control("token", "token", ui.token), ui.tokens, ui.tokenHint),
    ui.message,
    h(
      "div",
      { class: "layout" },
      h("section", { "aria-label": "token details" }, ui.summary, ui.lists, ui.history),
      h(
        "section",
        { "aria-label": "heatmap panel" },
        ui.heatTitle,
        h(
          "div",
          { class: "heatmap-tools" },
          control("map", "heatmap of", ui.map),
          control("size", "size", ui.size),
          control("colour", "colour by", ui.colour),
        ),
        ui.heatmap,
      ),
    ),
    ui.tooltip,
  );
  document.body.append(ui.root);
}

// ------------------------------------------------------------------------------------------------------ formatting
function formatP(p) {
  if (p === null || p === undefined) return "–";
  if (p === 0) return "0%";
  return p < 1e-6 ? "<0.0001%" : `${(p * 100).toPrecision(3)}%`; // float32 sums leave crumbs of that size
}

function formatLift(lift) {
  return lift === null || lift === undefined ? "–" : lift.toFixed(2);
}

function formatCount(count) {
  return count === null || count === undefined ? "–" : Math.round(count).toLocaleString("en-US");
}

// Whitespace tokens would print as nothing.
// Right-to-left letters and bidi controls: a label holding any is isolated, so that it cannot reorder the text
// around it (a U+202E in a label would otherwise reverse the counts printed after it).
const BIDI = /[\u0590-\u08ff\u200e\u200f\u202a-\u202e\u2066-\u2069\ufb1d-\ufdff\ufe70-\ufefc]/;

function shown(label, length = Infinity) {
  if (label === null || label === undefined) return "?";
  const text = cut(visible(label), length);
  return BIDI.test(text) ? `\u2068${text}\u2069` : text;
}

// A label with its invisible parts drawn: line breaks, tabs, edge spaces, the empty label.
function visible(label) {
  if (label === "") return "∅";
  return label
    .replace(/\n/g, "↵")
    .replace(/\r/g, "␍")
    .replace(/\t/g, "⇥")
    .replace(/^ +| +$/g, (spaces) => "␣".repeat(spaces.length));
}

function cut(text, length) {
  const chars = Array.from(text); // code points: an emoji is never split in two
  return chars.length <= length ? text : `${chars.slice(0, length - 1).join("")}…`;
}

function clampSize(value) {
  const size = Math.round(Number(value));
  return Number.isFinite(size) ? Math.min(MAX_SIZE, Math.max(2, size)) : DEFAULT_SIZE;
}

function message(text, kind = "info") {
  ui.message.textContent = text || "";
  ui.message.className = `message ${kind}`;
  ui.message.setAttribute("role", kind === "error" ? "alert" : "status");
}

function errorBox(error) {
  return h("p", { class: "message error", role: "alert" }, error.message);
}

// ---------------------------------------------------------------------------------------------- URL and theme
// Inside TensorBoard the address the user copies is the parent's (a same-origin page); opened on its own, the page
// keeps the state in its own hash.
function hostWindow() {
  if (window.parent === window) return null;
  try {
    return window.parent.tensorboard && typeof window.parent.location.hash === "string" ? window.parent : null;
  } catch {
    return null; // a page of another origin embeds this one
  }
}

// TensorBoard's format: the part without "=" is the tab (kept raw, as TensorBoard keeps it), the others key=value,
// each URI-encoded.
function splitHash(hash) {
  let tab = null;
  const params = new Map();
  for (const part of hash.replace(/^#/, "").split("&")) {
    if (!part) continue;
    const pieces = part.split("=");
    try {
      if (pieces.length === 1) tab = pieces[0];
      else if (pieces.length === 2) params.set(decodeURIComponent(pieces[0]), decodeURIComponent(pieces[1]));
    } catch {
      // a malformed escape: TensorBoard cannot read that part either
    }
  }
  return { tab, params };
}

function joinHash(tab, params) {
  const parts = [...params].map(([key, value]) => `${encodeURIComponent(key)}=${encodeURIComponent(value)}`);
  return [tab ?? "", ...parts].join("&").replace(/^&/, "");
}

function readLocation() {
  const host = hostWindow();
  const { params } = splitHash((host || window).location.hash);
  const prefix = host ? HASH_PREFIX : "";
  const wanted = {};
  for (const key of URL_KEYS) {
    if (params.has(prefix + key)) wanted[key] = params.get(prefix + key);
  }
  return wanted;
}

// The state as URL values; defaults are left out, so that a link stays short.
function locationValues() {
  const values = new Map();
  const view = currentView();
  const epoch = currentEpoch();
  if (state.run !== null) values.set("run", state.run);
  if (state.view !== null) values.set("view", state.view);
  if (state.head !== "mean") values.set("head", state.head);
  if (epoch) {
    values.set("epoch", String(epoch.epoch));
    // The step only where the epoch alone is ambiguous: a validate() call can add a second entry for one epoch.
    if (view.epochs.filter((other) => other.epoch === epoch.epoch).length > 1) values.set("step", String(epoch.step));
  }
  if (state.token !== null) values.set("token", String(state.token));
  if (state.side === "key") values.set("side", "key");
  if (state.size !== DEFAULT_SIZE) values.set("size", String(state.size));
  if (state.map !== "around") values.set("map", state.map);
  if (state.colour !== "p") values.set("colour", state.colour);
  return values;
}

function writeLocation() {
  const host = hostWindow();
  const target = host || window;
  const { tab, params } = splitHash(target.location.hash);
  // While another tab shows (TensorBoard keeps this iframe), the address is that tab's.
  if (host && tab && tab !== PLUGIN) return;
  const prefix = host ? HASH_PREFIX : "";
  for (const key of URL_KEYS) params.delete(prefix + key);
  for (const [key, value] of locationValues()) params.set(prefix + key, value);
  const hash = joinHash(host ? tab || PLUGIN : null, params);
  if (hash === target.location.hash.replace(/^#/, "")) return;
  const url = new URL(target.location.href);
  url.hash = hash;
  // replaceState: no history entry per click, and no hashchange for TensorBoard's listeners to react to.
  target.history.replaceState(target.history.state, "", url.href);
}

function followLocation() {
  const wanted = readLocation();
  const now = Object.fromEntries(locationValues());
  const same = URL_KEYS.every(
    (key) => (wanted[key] ?? null) === (now[key] ?? null) || (key === "step" && !wanted.step),
  );
  if (same || !state.runs.length) return;
  applyWanted(wanted);
  load();
}

function followTheme() {
  const apply = (dark) => {
    if (document.documentElement.classList.contains("dark") === dark) return;
    document.documentElement.classList.toggle("dark", dark);
    redrawHeatmap(); // its colours are computed, not styled
  };
  const host = hostWindow();
  if (host && host.document.body) {
    const body = host.document.body;
    const update = () => apply(body.classList.contains("dark-mode"));
    new MutationObserver(update).observe(body, { attributes: true, attributeFilter: ["class"] });
    update();
  } else {
    const query = window.matchMedia("(prefers-color-scheme: dark)");
    query.addEventListener("change", (event) => apply(event.matches));
    apply(query.matches);
  }
}

function isDark() {
  return document.documentElement.classList.contains("dark");
}

// ---------------------------------------------------------------------------------------------------------- data
class ServerError extends Error {}

async function getJson(route, params = {}, signal = undefined) {
  const query = new URLSearchParams(
    Object.entries(params).filter(([, value]) => value !== null && value !== undefined),
  );
  const url = query.toString() ? `${route}?${query}` : route;
  let response;
  try {
    response = await fetch(url, { signal, credentials: "same-origin" });
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ServerError(`the TensorBoard server did not answer ${route} (${error.message}): is it still running?`);
  }
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not JSON: TensorBoard's own error pages are plain text
  }
  if (!response.ok) {
    throw new ServerError(body && typeof body.error === "string" ? body.error : `${response.status} from ${route}`);
  }
  if (body === null) throw new ServerError(`${route} did not answer JSON`);
  return body;
}

async function fetchRuns() {
  const [explorer, all] = await Promise.all([
    getJson("runs"),
    getJson("../../runs").catch(() => []), // TensorBoard's own list: also the runs without explorer data
  ]);
  const withData = new Map(explorer.runs.map((run) => [run.run, run.views]));
  const names = [...new Set([...withData.keys(), ...(Array.isArray(all) ? all : [])])].sort();
  return names.map((run) => ({ run, views: withData.get(run) ?? null }));
}

function currentRun() {
  return state.runs.find((run) => run.run === state.run) ?? null;
}

function currentView() {
  const run = currentRun();
  return run && run.views ? (run.views.find((view) => view.view === state.view) ?? null) : null;
}

function currentEpoch() {
  const view = currentView();
  return view && view.epochs ? (view.epochs[state.index] ?? null) : null;
}

function isCross(view = currentView()) {
  return Boolean(view && view.streams && view.streams[0] !== view.streams[1]);
}

function tokenKey(id, side) {
  return side ? `${side}:${id}` : String(id);
}

function currentToken() {
  return state.token === null ? null : (state.labels?.byKey.get(tokenKey(state.token, state.side)) ?? null);
}

// ------------------------------------------------------------------------------------------------------- state
async function start() {
  message("loading…");
  try {
    state.runs = await fetchRuns();
  } catch (error) {
    message(`could not list the runs: ${error.message}`, "error");
    return;
  }
  applyWanted(readLocation());
  load();
}

// New epochs arrive while a fit runs: follow the newest when the newest was shown, else stay on the shown one.
async function refreshRuns() {
  let runs;
  try {
    runs = await fetchRuns();
  } catch {
    return; // the next refresh tries again; what is shown stays valid
  }
  const before = currentEpoch();
  const wasLast = Boolean(currentView()) && state.index === currentView().epochs.length - 1;
  state.runs = runs;
  const view = currentView();
  if (!view) {
    applyWanted(Object.fromEntries(locationValues()));
    load();
    return;
  }
  const same = before ? view.epochs.findIndex((e) => e.epoch === before.epoch && e.step === before.step) : -1;
  state.index = wasLast || same < 0 ? view.epochs.length - 1 : same;
  const after = currentEpoch();
  if (!before || after.v !== before.v || after.step !== before.step) load();
  else renderControls();
}

// Take the link's state where the data has it; say what could not be followed.
function applyWanted(wanted) {
  const notes = [];
  const withData = state.runs.filter((run) => run.views);
  const named = state.runs.find((run) => run.run === wanted.run);
  if (wanted.run !== undefined && !named) notes.push(`run "${wanted.run}" is not in this TensorBoard`);
  state.run = named ? named.run : withData.length ? withData[0].run : (state.runs[0]?.run ?? null);
  const views = currentRun()?.views ?? [];
  const view = views.find((item) => item.view === wanted.view);
  if (wanted.view !== undefined && views.length && !view) notes.push(`module "${wanted.view}" is not in this run`);
  state.view = view ? view.view : views.length ? views[0].view : null;
  const heads = currentView()?.heads ?? 0;
  const head = wanted.head ?? "mean";
  state.head = head === "mean" || (/^\d+$/.test(head) && Number(head) < heads) ? head : "mean";
  if (head !== state.head) notes.push(`head ${head} is not stored (${heads} heads), so the mean is shown`);
  const epochs = currentView()?.epochs ?? [];
  state.index = epochs.length - 1;
  if (wanted.epoch !== undefined && epochs.length) {
    const step = wanted.step;
    const matches = epochs
      .map((epoch, index) => ({ epoch, index }))
      .filter(({ epoch }) => String(epoch.epoch) === wanted.epoch && (!step || String(epoch.step) === step));
    if (matches.length) state.index = matches[matches.length - 1].index;
    else notes.push(`epoch ${wanted.epoch} is not in this module's data, so the last one is shown`);
  }
  if (wanted.token !== undefined) state.token = /^\d+$/.test(wanted.token) ? Number(wanted.token) : null;
  state.side = isCross() ? (wanted.side === "key" ? "key" : "query") : null;
  if (wanted.size !== undefined) state.size = clampSize(wanted.size);
  if (wanted.map === "top" || wanted.map === "around") state.map = wanted.map;
  if (wanted.colour === "p" || wanted.colour === "lift") state.colour = wanted.colour;
  state.notice = notes.length ? `This link's ${notes.join("; ")}.` : null;
}

function chooseRun(run) {
  switchTo(run, state.view);
}

function chooseView(view) {
  switchTo(state.run, view);
}

// The user switched run or module: keep what still applies, and say nothing of what does not (a module or epoch
// missing from the new choice is expected). The token stays only where its stream is still on an axis: an id of
// another vocabulary names another token.
function switchTo(run, view) {
  const epoch = currentEpoch();
  const streams = currentView()?.streams;
  const stream = state.token === null || !streams ? null : streams[state.side === "key" ? 1 : 0];
  applyWanted({ run, view, head: state.head, ...(epoch ? { epoch: String(epoch.epoch) } : {}) });
  const now = currentView()?.streams;
  if (stream !== null && now) {
    if (now[0] === stream) state.side = isCross() ? "query" : null;
    else if (now[1] === stream && isCross()) state.side = "key";
    else state.token = null;
  }
  state.notice = null;
  load();
}

function scrub(now) {
  state.index = Number(ui.epoch.value);
  renderEpochText();
  clearTimeout(scrubTimer);
  // Dragging fires input at every position: load once the thumb rests.
  if (now) load();
  else scrubTimer = setTimeout(load, SCRUB_DELAY_MS);
}

function renderControls() {
  const runs = state.runs.map((run) =>
    h("option", { value: run.run }, run.views ? run.run : `${run.run} (no explorer data)`),
  );
  ui.run.replaceChildren(...runs);
  ui.run.value = state.run ?? "";
  ui.run.disabled = state.runs.length === 0;
  const views = currentRun()?.views ?? [];
  ui.view.replaceChildren(...views.map((view) => h("option", { value: view.view }, view.view)));
  ui.view.value = state.view ?? "";
  ui.view.disabled = views.length === 0;
  const view = currentView();
  const heads = view?.heads ?? 0;
  ui.head.replaceChildren(
    h("option", { value: "mean" }, "mean"),
    ...Array.from({ length: heads }, (_, head) => h("option", { value: String(head) }, `head ${head}`)),
  );
  ui.head.value = state.head;
  ui.head.disabled = heads === 0;
  ui.head.title = heads === 0 && view ? "per_head=False: only the head mean is stored" : "";
  const epochs = view?.epochs ?? [];
  ui.epoch.max = Math.max(0, epochs.length - 1);
  ui.epoch.value = Math.max(0, state.index);
  ui.epoch.disabled = epochs.length <= 1;
  renderEpochText();
  ui.streams.textContent = view && view.streams ? `queries: ${view.streams[0]} · keys: ${view.streams[1]}` : "";
  ui.size.value = state.size;
  // The neighbourhood needs a token, and one id for both axes: in cross-attention an id names two tokens.
  const around = state.token !== null && !isCross();
  ui.map.value = around ? state.map : "top";
  ui.map.disabled = !around;
  ui.map.title = isCross()
    ? "cross-attention: an id names a query token and a key token, so the map shows the most frequent ones"
    : "";
  ui.colour.value = state.colour;
  ui.lists.hidden = state.token === null;
}

function renderEpochText() {
  const view = currentView();
  const index = Number(ui.epoch.value);
  const epoch = view?.epochs?.[index];
  const text = epoch ? `epoch ${epoch.epoch} · step ${epoch.step} (${index + 1} of ${view.epochs.length})` : "";
  ui.epochText.textContent = text;
  ui.epoch.setAttribute("aria-valuetext", text || "no epoch");
}

// ------------------------------------------------------------------------------------------------------ loading
function clearPanels() {
  ui.summary.replaceChildren();
  ui.attendsTo.replaceChildren();
  ui.attendedBy.replaceChildren();
  ui.history.replaceChildren();
  ui.heatmap.replaceChildren();
  ui.heatTitle.textContent = "";
  ui.tokens.replaceChildren();
  ui.token.disabled = true;
  ui.lists.hidden = true;
  state.heat = null;
}

// The state's empty or error state, or null when there is an epoch to show.
function emptyState() {
  const run = currentRun();
  if (!state.runs.some((item) => item.views)) {
    return [`No run in this TensorBoard has explorer data yet: ${HOW_TO}`, "info"];
  }
  if (!run || !run.views) return [`this run${run ? ` ("${run.run}")` : ""} has no explorer data: ${HOW_TO}`, "info"];
  const view = currentView();
  if (view && view.error) return [`the explorer data of module "${view.view}" cannot be read: ${view.error}`, "error"];
  if (!currentEpoch()) return [`module "${state.view}" has no epoch yet: ${HOW_TO}`, "info"];
  return null;
}

async function load() {
  const gen = ++generation;
  controller?.abort();
  controller = new AbortController();
  const signal = controller.signal;
  clearTimeout(scrubTimer);
  renderControls();
  writeLocation();
  const empty = emptyState();
  if (empty) {
    clearPanels();
    message(...empty);
    return;
  }
  message(state.notice || "", "info");
  state.notice = null; // said once: the next change is the user's own

  const params = epochParams();
  const { token, side } = state;
  const around = token !== null && !isCross() && state.map === "around" ? token : null;
  // In cross-attention an id names one token per axis: the side says which one this is.
  const rowBased = token !== null && side !== "key";
  const asked = [
    labelsOf(params, signal),
    getJson("heatmap", { ...params, size: state.size, around }, signal),
    token === null ? null : getJson("token", { ...params, token, side }, signal),
    rowBased ? getJson("history", { ...params, v: null, token, keys: HISTORY_KEYS }, signal) : null,
  ];
  const [labels, heat, answer, history] = await Promise.allSettled(asked);
  if (gen !== generation) return;
  if (labels.status === "rejected") {
    // The epoch itself is unreadable: one message, not one per panel.
    clearPanels();
    message(labels.reason.message, "error");
    return;
  }
  state.labels = labels.value;
  renderSuggestions();
  if (token === null) {
    const stored = `${state.labels.byKey.size} tokens are stored at this epoch`;
    ui.summary.replaceChildren(h("p", { class: "muted" }, `Search a token above: ${stored}.`));
    ui.history.replaceChildren();
  } else {
    renderToken(answer);
    renderHistory(history);
  }
  renderHeatmap(heat);
}

function epochParams() {
  const epoch = currentEpoch();
  return { run: state.run, view: state.view, epoch: epoch.epoch, step: epoch.step, head: state.head, v: epoch.v };
}

async function labelsOf(params, signal) {
  const asked = { ...params };
  delete asked.head; // the labels are the same for every head: one cached answer
  const key = JSON.stringify(asked);
  if (!labelCache.has(key)) labelCache.set(key, tokensOf(await getJson("labels", asked, signal), isCross()));
  return labelCache.get(key);
}

// Every stored token of one epoch, the rows first (most frequent first). In self-attention a token is one id on
// both axes; in cross-attention each axis has its own tokens.
function tokensOf(body, cross) {
  const byKey = new Map();
  body.query_ids.forEach((id, i) => {
    const token = { id, side: cross ? "query" : null, label: body.query_labels[i], count: body.query_count[i] };
    byKey.set(tokenKey(id, token.side), token);
  });
  body.key_ids.forEach((id, i) => {
    const key = tokenKey(id, cross ? "key" : null);
    if (!byKey.has(key)) byKey.set(key, { id, side: cross ? "key" : null, label: body.key_labels[i], count: null });
  });
  const seen = new Map();
  for (const token of byKey.values()) seen.set(token.label, (seen.get(token.label) ?? 0) + 1);
  // A suggestion must name one token and survive the search box, which drops line breaks: a label two tokens share,
  // one that reads as "#id" (the search for that id), and one with invisible parts get the id (and the axis).
  for (const token of byKey.values()) {
    const which = token.side ? ` (${token.side} #${token.id})` : ` #${token.id}`;
    const plain = seen.get(token.label) === 1 && visible(token.label) === token.label && !ID_SEARCH.test(token.label);
    token.text = plain ? token.label : `${visible(token.label)}${which}`;
  }
  const byText = new Map([...byKey.values()].map((token) => [token.text, token]));
  return { byKey, byText, rows: body.query_ids.length, cols: body.key_ids.length };
}

function renderSuggestions() {
  const cross = isCross();
  const options = [...state.labels.byKey.values()].map((token) => {
    const what = token.count === null ? "key only" : `${formatCount(token.count)} queries`;
    return h("option", { value: token.text }, `#${token.id} · ${cross ? `${token.side} · ` : ""}${what}`);
  });
  ui.tokens.replaceChildren(...options);
  ui.token.disabled = false;
  const token = currentToken();
  if (document.activeElement !== ui.token) {
    ui.token.value = token ? token.text : state.token === null ? "" : `#${state.token}`;
  }
  const { rows, cols } = state.labels;
  const stored = cross ? `${rows} query and ${cols} key tokens` : `${state.labels.byKey.size} tokens`;
  ui.tokenHint.textContent = `${stored} stored at this epoch: pick a suggestion, or type #id`;
}

// A typed text -> {id, side}: a suggestion, "#id", or a label regardless of case and surrounding spaces.
function resolveToken(text) {
  const labels = state.labels;
  const side = isCross() ? "query" : null; // an id alone names the query token
  const known = labels.byText.get(text);
  if (known) return { id: known.id, side: known.side };
  const id = text.trim().match(ID_SEARCH);
  if (id) {
    const number = Number(id[1]);
    const key = labels.byKey.has(tokenKey(number, side)) || !isCross() ? side : "key";
    return { id: number, side: key };
  }
  const folded = text.trim().toLowerCase();
  for (const token of labels.byKey.values()) {
    if (token.label.trim().toLowerCase() === folded) return { id: token.id, side: token.side };
  }
  return null;
}

function commitToken() {
  const text = ui.token.value;
  if (text === "") {
    if (state.token !== null) chooseToken(null, null);
    return;
  }
  if (!state.labels) return;
  const token = resolveToken(text);
  if (!token) {
    const stored = `the explorer keeps the ${state.labels.byKey.size} most frequent tokens`;
    const why = `No token "${text}" is stored at this epoch: ${stored} (explorer_size sets how many).`;
    ui.summary.replaceChildren(h("p", { class: "message", "data-unknown": text }, why));
    return;
  }
  if (token.id !== state.token || token.side !== state.side) chooseToken(token.id, token.side);
}

function chooseToken(id, side) {
  state.token = id;
  state.side = isCross() ? (side ?? "query") : null;
  const token = currentToken();
  ui.token.value = token ? token.text : id === null ? "" : `#${id}`;
  load();
}

// --------------------------------------------------------------------------------------------------- token view
function tokenButton(id, label, side) {
  const title = `${label} (#${id}${side ? `, ${side}` : ""}): search it`;
  return h("button", { class: "token", type: "button", title, onclick: () => chooseToken(id, side) }, shown(label));
}

function renderToken(result) {
  if (result.status === "rejected") {
    ui.summary.replaceChildren(errorBox(result.reason));
    ui.attendsTo.replaceChildren();
    ui.attendedBy.replaceChildren();
    return;
  }
  const answer = result.value;
  const epoch = currentEpoch();
  const view = currentView();
  const side = state.side;
  // In cross-attention the other half of the answer is the other axis's token with the same id: drop it.
  const attendsTo = side === "key" ? null : answer.attends_to;
  const attendedBy = side === "query" ? null : answer.attended_by;
  const known = currentToken();
  if ((side === null && attendsTo === null && attendedBy === null) || (side && (attendsTo ?? attendedBy) === null)) {
    const where = side ? `${side} token` : "token";
    const stored = `the explorer keeps its ${state.labels.rows} most frequent query tokens (explorer_size: how many)`;
    const text = `The ${where} #${answer.token.id} is not stored at epoch ${epoch.epoch}: ${stored}.`;
    ui.summary.replaceChildren(h("p", { class: "message", "data-missing": answer.token.id }, text));
    ui.attendsTo.replaceChildren(...list("attends to", null, "not stored"));
    ui.attendedBy.replaceChildren(...list("attended by", null, "not stored"));
    return;
  }
  const label = known ? known.label : answer.token.label;
  const facts = [];
  if (side === "key") {
    facts.push(h("span", {}, `a key token (${view.streams[1]})`));
  } else if (answer.token.count !== null) {
    facts.push(h("span", { "data-query-count": answer.token.count }, `${formatCount(answer.token.count)} queries`));
  } else {
    facts.push(h("span", {}, "not a stored query token: no row"));
  }
  if (side !== "key" && answer.rest !== null) {
    const rest = `${formatP(answer.rest)} of its attention goes to keys outside the ${state.labels.cols} stored`;
    facts.push(h("span", { "data-rest": answer.rest }, rest));
  }
  const attrs = { "data-token": answer.token.id, "data-label": label ?? "", "data-epoch": epoch.epoch };
  ui.summary.replaceChildren(
    h("strong", { ...attrs, "data-step": epoch.step, "data-head": state.head, "data-side": side }, shown(label)),
    h("span", { class: "muted" }, ` #${answer.token.id} at epoch ${epoch.epoch} · `),
    ...facts.flatMap((fact, i) => (i ? [" · ", fact] : [fact])),
  );
  const cross = view.streams;
  const noRow = side === "key" ? `a key token: the queries here are ${cross[0]} tokens` : "not a stored query token";
  const noColumn = side === "query" ? `a query token: the keys here are ${cross[1]} tokens` : "not a stored key token";
  ui.attendsTo.replaceChildren(...list("attends to", attendsTo, noRow, side ? "key" : null));
  ui.attendedBy.replaceChildren(...list("attended by", attendedBy, noColumn, side ? "query" : null));
}

// A ranked list; the exact values stay on each entry (data-p, data-lift, data-count) beside the rounded ones.
function list(name, entries, missing, side = null) {
  const ol = h("ol", { class: "ranked", "aria-label": name, "data-stored": entries !== null });
  const header = h(
    "div",
    { class: "head-row", "aria-hidden": "true" },
    ...["#", "token", "P", "lift", "pairs"].map((text) => h("span", {}, text)),
  );
  if (entries === null) return [header, ol, h("div", { class: "empty-list" }, missing)];
  if (!entries.length) return [header, ol, h("div", { class: "empty-list" }, "no pair seen at this epoch")];
  const top = Math.max(...entries.map((entry) => entry.p), 1e-12);
  for (const entry of entries) {
    const item = h(
      "li",
      {
        "data-id": entry.id,
        "data-label": entry.label,
        "data-p": entry.p,
        "data-lift": entry.lift ?? "",
        "data-count": entry.count,
        title: `${entry.label} (#${entry.id}): P ${entry.p}, lift ${entry.lift}, ${entry.count} pairs`,
      },
      h("span", { class: "bar", style: `width: ${((100 * entry.p) / top).toFixed(1)}%` }),
      tokenButton(entry.id, entry.label, side),
      h("span", { class: "num p" }, formatP(entry.p)),
      h("span", { class: "num lift" }, formatLift(entry.lift)),
      h("span", { class: "num count" }, formatCount(entry.count)),
    );
    ol.append(item);
  }
  return [header, ol];
}

// ---------------------------------------------------------------------------------------------------- heatmap
function renderHeatmap(result) {
  if (result.status === "rejected") {
    state.heat = null;
    ui.heatTitle.textContent = "heatmap";
    ui.heatmap.replaceChildren(errorBox(result.reason));
    return;
  }
  state.heat = result.value;
  redrawHeatmap();
}

function interpolate(stops, t) {
  const x = Math.min(1, Math.max(0, t)) * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(x));
  const [a, b] = [stops[i], stops[i + 1]].map((hex) => [1, 3, 5].map((k) => parseInt(hex.slice(k, k + 2), 16)));
  return `rgb(${a.map((c, k) => Math.round(c + (b[k] - c) * (x - i))).join(",")})`;
}

function liftStops() {
  return ["#2166ac", "#67a9cf", isDark() ? "#4a4a4a" : "#f7f7f7", "#ef8a62", "#b2182b"];
}

function cellColour(p, lift, count, top) {
  if (!count) return null;
  if (state.colour === "p") return interpolate(VIRIDIS, p / top);
  if (lift === null) return null;
  return interpolate(liftStops(), (Math.log2(Math.max(lift, 1e-9)) + 3) / 6); // 1/8 .. 8, 1 in the middle
}

// The searched token's row and column, looked up here: in the most frequent tokens the route outlines nothing, and
// in cross-attention its id names another token on the other axis.
function outline(data) {
  if (state.token === null) return { row: null, col: null };
  const row = state.side === "key" ? -1 : data.rows.findIndex((token) => token.id === state.token);
  const col = state.side === "query" ? -1 : data.cols.findIndex((token) => token.id === state.token);
  return { row: row < 0 ? null : row, col: col < 0 ? null : col };
}

function redrawHeatmap() {
  const data = state.heat;
  if (!data) return;
  const n = data.rows.length;
  const m = data.cols.length;
  const epoch = currentEpoch();
  const cross = isCross();
  const { row, col } = outline(data);
  // A token the epoch does not store has no neighbourhood: the route answers the most frequent tokens then.
  const around = state.token !== null && !cross && state.map === "around" && row !== null;
  const focus = currentToken()?.label ?? `#${state.token}`;
  const head = state.head === "mean" ? "head mean" : `head ${state.head}`;
  ui.heatTitle.replaceChildren(
    around
      ? `heatmap around "${shown(focus)}": the queries attending to it most (rows), the keys it attends to most`
      : `heatmap of the ${n === m ? n : `${n} × ${m}`} most frequent tokens`,
    h("small", {}, ` · P[query, key] at epoch ${epoch.epoch}, ${head}`),
  );
  let top = 0;
  data.p.forEach((row, i) => row.forEach((p, j) => data.count[i][j] > 0 && (top = Math.max(top, p))));
  top = top || 1;
  const [left, upper] = [110, 80];
  // As large as the panel allows (a hidden iframe measures 0: then as for a 700 px panel).
  const room = (ui.heatmap.clientWidth || 700) - left - 60;
  const cell = Math.max(6, Math.min(24, Math.floor(room / Math.max(m, 1)), Math.floor(640 / Math.max(n, 1))));
  const width = left + m * cell + 60; // room for the last column's slanted label
  const height = upper + n * cell + 2;
  const empty = getComputedStyle(document.documentElement).getPropertyValue("--empty").trim() || "#eee";
  const grid = svg("g", { transform: `translate(${left},${upper})` });
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < m; j++) {
      const [p, lift, count] = [data.p[i][j], data.lift[i][j], data.count[i][j]];
      const size = Math.max(1, cell - 1);
      grid.append(
        svg("rect", {
          class: "cell",
          x: j * cell,
          y: i * cell,
          width: size,
          height: size,
          fill: cellColour(p, lift, count, top) ?? empty,
          "data-row": i,
          "data-col": j,
          "data-query": data.rows[i].id,
          "data-key": data.cols[j].id,
          "data-p": p,
          "data-lift": lift ?? "",
          "data-count": count,
        }),
      );
    }
  }
  const labelled = cell >= 9;
  const querySide = cross ? "query" : null;
  const keySide = cross ? "key" : null;
  data.rows.forEach((row, i) => {
    const at = { x: -5, y: i * cell + cell / 2, "text-anchor": "end", "dominant-baseline": "central" };
    const onclick = () => chooseToken(row.id, querySide);
    const text = svg("text", { class: "axis-label", ...at, "data-id": row.id, onclick });
    text.append(labelled ? shown(row.label, 15) : "", svg("title", {}, `${row.label} (#${row.id}), query`));
    grid.append(text);
  });
  data.cols.forEach((col, j) => {
    const at = { transform: `translate(${j * cell + cell / 2},-5) rotate(-60)`, "dominant-baseline": "central" };
    const onclick = () => chooseToken(col.id, keySide);
    const text = svg("text", { class: "axis-label", ...at, "data-id": col.id, onclick });
    text.append(labelled ? shown(col.label, 15) : "", svg("title", {}, `${col.label} (#${col.id}), key`));
    grid.append(text);
  });
  if (row !== null) {
    const box = { x: -1, y: row * cell - 1, width: m * cell + 1, height: cell + 1 };
    grid.append(svg("rect", { class: "outline", "data-outline": "row", ...box }));
  }
  if (col !== null) {
    const box = { x: col * cell - 1, y: -1, width: cell + 1, height: n * cell + 1 };
    grid.append(svg("rect", { class: "outline", "data-outline": "col", ...box }));
  }
  const size = { width, height, viewBox: `0 0 ${width} ${height}`, "data-rows": n, "data-cols": m };
  const picture = svg("svg", { role: "img", "aria-label": "heatmap", ...size }, grid);
  picture.addEventListener("pointermove", (event) => heatTooltip(event, data));
  picture.addEventListener("pointerleave", () => (ui.tooltip.hidden = true));
  picture.addEventListener("click", (event) => {
    const target = event.target.closest?.("rect.cell");
    if (target) chooseToken(Number(target.dataset.query), querySide);
  });
  const stops = state.colour === "lift" ? liftStops() : VIRIDIS;
  const legend = h(
    "div",
    { class: "legend" },
    state.colour === "lift" ? "lift ≤ 1/8" : "P 0",
    h("span", { class: "ramp", style: `background: linear-gradient(to right, ${stops.join(", ")})` }),
    state.colour === "lift" ? "≥ 8 (1: white)" : formatP(top),
    h("span", {}, " · grey: no pair seen · click a cell to search its query token"),
  );
  ui.heatmap.replaceChildren(picture, legend);
  const under = pointer && document.elementFromPoint(pointer.clientX, pointer.clientY);
  if (under && picture.contains(under)) heatTooltip({ ...pointer, target: under }, data);
  else ui.tooltip.hidden = true;
}

function heatTooltip(event, data) {
  const target = event.target.closest?.("rect.cell");
  if (!target) {
    ui.tooltip.hidden = true;
    return;
  }
  const [i, j] = [Number(target.dataset.row), Number(target.dataset.col)];
  const [row, col] = [data.rows[i], data.cols[j]];
  const [p, lift, count] = [formatP(data.p[i][j]), formatLift(data.lift[i][j]), formatCount(data.count[i][j])];
  ui.tooltip.textContent =
    `query ${shown(row.label)} (#${row.id}) → key ${shown(col.label)} (#${col.id})\n` +
    `P ${p} · lift ${lift} · ${count} pairs`;
  ui.tooltip.hidden = false;
  const box = ui.tooltip.getBoundingClientRect();
  const x = event.clientX + 14 + box.width > window.innerWidth ? event.clientX - 14 - box.width : event.clientX + 14;
  const y = event.clientY + 14 + box.height > window.innerHeight ? event.clientY - 14 - box.height : event.clientY + 14;
  ui.tooltip.style.left = `${Math.max(0, x)}px`;
  ui.tooltip.style.top = `${Math.max(0, y)}px`;
}

// ------------------------------------------------------------------------------------------------------ drift
function renderHistory(result) {
  const current = currentEpoch();
  // Nothing was asked (a key token has no row), or the token has no row at this epoch.
  if (result.status === "fulfilled" && (result.value === null || !result.value.keys.length)) {
    const why = state.side === "key" ? "a key token has no row to follow" : "it is not a stored query token here";
    const title = h("h2", {}, "across epochs");
    ui.history.replaceChildren(title, h("p", { class: "muted" }, `${why}: its row's history needs one`));
    return;
  }
  if (result.status === "rejected") {
    ui.history.replaceChildren(h("h2", {}, "across epochs"), errorBox(result.reason));
    return;
  }
  const data = result.value;
  const at = data.epochs.findIndex((epoch, i) => epoch === current.epoch && data.steps[i] === current.step);
  const what = `P of its top ${data.keys.length} keys at epoch ${current.epoch}, and its row's drift`;
  const title = h("h2", {}, "across epochs ", h("small", {}, what));
  const width = 560;
  const height = 160;
  const pad = { left: 52, right: 14, top: 10, bottom: 26 };
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  const count = data.epochs.length;
  const x = (i) => pad.left + (count === 1 ? plotW / 2 : (i * plotW) / (count - 1));
  const top = Math.max(...data.p.flat().filter((v) => v !== null), 1e-9) * 1.08;
  const y = (v) => pad.top + plotH * (1 - v / top);
  const { chart, tick } = chartFrame("P across epochs", width, height, pad, y);
  chart.append(
    svg("line", { class: "axis", x1: pad.left, x2: width - pad.right, y1: y(0), y2: y(0) }),
    svg("line", { class: "axis", x1: pad.left, x2: pad.left, y1: pad.top, y2: y(0) }),
    ...[0, top / 2, top].map((v) => svg("text", tick(v), formatP(v))),
  );
  const every = Math.max(1, Math.ceil(count / 10)); // at most about ten epoch labels
  data.epochs.forEach((epoch, i) => {
    if (i % every === 0 || i === count - 1) {
      chart.append(svg("text", { class: "tick", x: x(i), y: height - 8, "text-anchor": "middle" }, String(epoch)));
    }
  });
  if (at >= 0) chart.append(svg("line", { class: "marker", x1: x(at), x2: x(at), y1: pad.top, y2: y(0) }));
  const keySide = isCross() ? "key" : null;
  data.keys.forEach((key, k) => {
    const colour = SERIES[k % SERIES.length];
    let path = "";
    let drawing = false; // a key not stored at an epoch breaks its line there
    data.p[k].forEach((v, i) => {
      if (v !== null) path += `${drawing ? "L" : "M"}${x(i).toFixed(1)},${y(v).toFixed(1)}`;
      drawing = v !== null;
    });
    const values = JSON.stringify(data.p[k]);
    chart.append(
      svg("path", {
        d: path,
        fill: "none",
        stroke: colour,
        "stroke-width": 2,
        "data-key": key.id,
        "data-values": values,
      }),
    );
    data.p[k].forEach((v, i) => {
      if (v === null) return;
      const dot = svg("circle", { cx: x(i), cy: y(v), r: i === at ? 4 : 2.5, fill: colour, "data-p": v });
      dot.append(svg("title", {}, `${key.label} at epoch ${data.epochs[i]}: P ${formatP(v)}`));
      chart.append(dot);
    });
  });
  const legend = h(
    "ul",
    { class: "series" },
    ...data.keys.map((key, k) =>
      h(
        "li",
        {},
        h("span", { class: "swatch", style: `background: ${SERIES[k % SERIES.length]}` }),
        tokenButton(key.id, key.label, keySide),
      ),
    ),
  );
  ui.history.replaceChildren(title, chart, legend, driftChart(data, at, x, width, pad));
}

// An SVG chart of the given accessible name, and where a value's tick label goes on its y axis.
function chartFrame(name, width, height, pad, y) {
  const frame = { width: "100%", viewBox: `0 0 ${width} ${height}`, style: `max-width: ${width}px` };
  const chart = svg("svg", { role: "img", "aria-label": name, ...frame });
  const tick = (v) => ({ class: "tick", x: pad.left - 5, y: y(v), "text-anchor": "end", "dominant-baseline": "central" });
  return { chart, tick };
}

function driftChart(data, at, x, width, pad) {
  const height = 84;
  const plotH = height - pad.top - 24;
  const drifts = data.js.filter((v) => v !== null);
  const what = "Jensen–Shannon divergence of its row from the epoch before (nats, at most ln 2 ≈ 0.693)";
  const caption = h("h3", {}, "drift ", h("small", {}, what));
  if (!drifts.length) return h("div", {}, caption, h("p", { class: "muted" }, "the drift needs two epochs of its row"));
  const top = Math.max(...drifts, 1e-6) * 1.1;
  const y = (v) => pad.top + plotH * (1 - v / top);
  const { chart, tick } = chartFrame("drift", width, height, pad, y);
  chart.append(
    svg("line", { class: "axis", x1: pad.left, x2: width - pad.right, y1: y(0), y2: y(0) }),
    svg("text", tick(top), top.toFixed(3)),
    svg("text", tick(0), "0"),
  );
  const barWidth = Math.max(3, Math.min(18, (width - pad.left - pad.right) / Math.max(1, data.js.length) / 2));
  data.js.forEach((v, i) => {
    if (v === null) return;
    const box = { x: x(i) - barWidth / 2, y: y(v), width: barWidth, height: Math.max(0.5, y(0) - y(v)) };
    const fill = i === at ? "var(--accent)" : "var(--bar)";
    const bar = svg("rect", { ...box, fill, "data-epoch": data.epochs[i], "data-js": v });
    bar.append(svg("title", {}, `epoch ${data.epochs[i]}: JS ${v.toFixed(4)} from epoch ${data.epochs[i - 1]}`));
    chart.append(bar);
    chart.append(
      svg("text", { class: "tick", x: x(i), y: height - 8, "text-anchor": "middle" }, String(data.epochs[i])),
    );
  });
  return h("div", {}, caption, chart);
}
