// The batches view: OpenAI batches and Anthropic message batches through the public routes, each with its
// progress (completed, failed, total), rate and ETA, a cancel button and its output and error files; then the
// files with their sizes and the quota in use. Refreshed every 2 s while shown.

import { json, call, el, bytes, duration } from "./api.js";
import { latest } from "./status.js";

let timer = null;
const $ = (id) => document.getElementById(id);

export function start() {
  if (timer) return;
  const tick = async () => {
    if (!document.hidden) await refresh().catch((e) => { $("b-empty").hidden = false; $("b-empty").textContent = e.message; });
    timer = setTimeout(tick, 2000);
  };
  tick();
}

export function stop() {
  clearTimeout(timer);
  timer = null;
}

$("b-refresh").addEventListener("click", () => refresh());

/** One shape for both APIs' batches. */
function openai(b) {
  const c = b.request_counts || { total: 0, completed: 0, failed: 0 };
  return {
    id: b.id, kind: "OpenAI", status: b.status, total: c.total, completed: c.completed, failed: c.failed,
    since: b.in_progress_at || b.created_at, running: ["validating", "in_progress", "finalizing"].includes(b.status),
    cancel: `v1/batches/${encodeURIComponent(b.id)}/cancel`, endpoint: b.endpoint,
    files: [["output", b.output_file_id], ["errors", b.error_file_id]].filter(([, f]) => f)
      .map(([label, f]) => [label, `v1/files/${encodeURIComponent(f)}/content`, `${f}.jsonl`]),
  };
}

function anthropic(b) {
  const c = b.request_counts;
  const failed = c.errored + c.canceled + c.expired;
  return {
    id: b.id, kind: "Anthropic", status: b.processing_status, total: failed + c.succeeded + c.processing,
    completed: c.succeeded, failed, since: Date.parse(b.created_at) / 1000, running: b.processing_status === "in_progress",
    cancel: `v1/messages/batches/${encodeURIComponent(b.id)}/cancel`, endpoint: "/v1/messages",
    files: b.results_url ? [["results", `v1/messages/batches/${encodeURIComponent(b.id)}/results`, `${b.id}.jsonl`]] : [],
  };
}

async function refresh() {
  const [oa, an, files] = await Promise.all([
    json("v1/batches?limit=100"),
    json("v1/messages/batches?limit=100"),
    json("v1/files?limit=100").catch(() => ({ data: [] })),
  ]);
  const all = [...oa.data.map(openai), ...an.data.map(anthropic)];
  $("b-list").replaceChildren(...all.map(item));
  $("b-empty").hidden = all.length > 0;
  renderFiles(files.data || []);
}

function item(b) {
  const done = b.completed + b.failed;
  const pct = b.total ? Math.round((100 * done) / b.total) : b.running ? 0 : 100;
  const elapsed = Date.now() / 1000 - b.since;
  const rate = done > 0 && elapsed > 0 ? done / elapsed : 0;
  const eta = b.running && rate > 0 ? duration((b.total - done) / rate) : "–";
  const bar = el("div", {
    class: "bar", role: "progressbar", "aria-valuemin": "0", "aria-valuemax": "100", "aria-valuenow": String(pct),
    "aria-label": `${b.id} progress`,
  });
  const ok = el("span", { class: "done" });
  ok.style.width = `${b.total ? (100 * b.completed) / b.total : 0}%`;
  const bad = el("span", { class: "failed" });
  bad.style.left = ok.style.width;
  bad.style.width = `${b.total ? (100 * b.failed) / b.total : 0}%`;
  bar.append(ok, bad);
  const actions = el("div", { class: "row" });
  if (b.running) {
    actions.append(el("button", { type: "button", text: "Cancel", "aria-label": `Cancel ${b.id}`, onclick: async (e) => {
      e.target.disabled = true;
      await call(b.cancel, { method: "POST" });
      refresh();
    } }));
  }
  for (const [label, path, name] of b.files) {
    actions.append(el("button", { type: "button", text: `Download ${label}`, onclick: () => download(path, name) }));
  }
  return el(
    "li",
    { "data-batch": b.id },
    el("div", { class: "row" }, el("strong", { text: b.id }), el("span", { class: "muted", text: `${b.kind} · ${b.endpoint} · ${b.status}` })),
    bar,
    el("p", { class: "muted", text: `${b.completed} completed, ${b.failed} failed of ${b.total} (${pct} %) · ${rate.toFixed(2)}/s · ETA ${eta}` }),
    actions,
  );
}

/** A file behind the key: fetched with it, then saved from a local object URL. */
async function download(path, name) {
  const resp = await call(path);
  const blob = await resp.blob();
  const a = el("a", { href: URL.createObjectURL(blob), download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 10000);
}

function renderFiles(files) {
  const used = files.reduce((a, f) => a + (f.bytes || 0), 0);
  const store = latest() && latest().store;
  const cap = store && store.files_max_bytes;
  $("f-quota").textContent = `${files.length} files, ${bytes(used)} listed` +
    (store && store.files ? ` · ${bytes(store.files_bytes)} stored of ${cap ? bytes(cap) : "no cap"}` : "");
  $("f-list").replaceChildren(...files.map((f) => el(
    "tr", {},
    el("td", { text: f.id }),
    el("td", { text: f.filename || "" }),
    el("td", { text: f.purpose || "" }),
    el("td", { text: bytes(f.bytes) }),
    el("td", {}, el("button", { type: "button", text: "Download", onclick: () => download(`v1/files/${encodeURIComponent(f.id)}/content`, f.filename || f.id) })),
  )));
}
