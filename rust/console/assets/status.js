// The status view: polls /console/status every second (only while the view is shown and the tab visible) and
// draws it. Nothing here shows prompt or output text: the endpoint carries none.

import { json, el, bytes } from "./api.js";
import { draw } from "./chart.js";

const WINDOW_S = 300;
let timer = null;
let last = null;

const $ = (id) => document.getElementById(id);
const ms = (v) => (v == null ? "–" : v < 10 ? `${v.toFixed(2)} ms` : `${Math.round(v)} ms`);

export function start() {
  if (timer) return;
  const tick = async () => {
    if (!document.hidden) {
      try {
        last = await json("console/status");
        render(last);
      } catch (e) {
        $("health").textContent = "unreachable";
        $("health").className = "pill bad";
      }
    }
    timer = setTimeout(tick, 1000);
  };
  tick();
}

export function stop() {
  clearTimeout(timer);
  timer = null;
}

/** The last status read (the batches view shows the files quota from it). */
export function latest() {
  return last;
}

function render(s) {
  $("model").textContent = `${s.model} · ${s.engine} · v${s.version}`;
  const health = $("health");
  health.textContent = s.draining ? "draining" : s.healthy ? "healthy" : "unavailable";
  health.className = `pill ${s.healthy ? "ok" : "bad"}`;
  const p = s.parallel;
  $("s-layout").textContent = `DP ${p.dp} · EP ${p.ep} · CP ${p.cp}`;
  $("s-engine").textContent = `${s.engine}, context ${s.max_model_len}`;
  $("s-slots").textContent = `${s.slots.used} / ${s.slots.total}`;
  $("s-queue").textContent = `${s.slots.queued} waiting · ${s.slots.batch} batch lines`;
  const w = s.window;
  $("s-tps").textContent = w.summary.tokens_per_s.toFixed(1);
  $("s-rps").textContent = `${w.summary.requests_per_s.toFixed(2)} requests/s`;
  $("s-ttft").textContent = `${ms(w.summary.ttft_p50_ms)} / ${ms(w.summary.ttft_p95_ms)}`;
  $("s-itl").textContent = `ITL ${ms(w.summary.itl_p50_ms)} / ${ms(w.summary.itl_p95_ms)}`;
  const st = s.store;
  if (!st) {
    $("s-store").textContent = "off";
    $("s-files").textContent = "";
  } else {
    $("s-store").textContent = `${bytes(st.bytes)} / ${st.max_bytes ? bytes(st.max_bytes) : "no cap"}`;
    $("s-files").textContent = st.files
      ? `files ${bytes(st.files_bytes)} / ${st.files_max_bytes ? bytes(st.files_max_bytes) : "no cap"}`
      : "no files dir";
  }
  draw($("c-tokens"), [{ values: w.tokens, color: "--accent" }], WINDOW_S);
  draw($("c-requests"), [{ values: w.requests, color: "--accent" }], WINDOW_S);
  draw($("c-ttft"), [{ values: w.ttft_p50, color: "--accent" }, { values: w.ttft_p95, color: "--accent2" }], WINDOW_S);
  draw($("c-itl"), [{ values: w.itl_p50, color: "--accent" }, { values: w.itl_p95, color: "--accent2" }], WINDOW_S);
  $("s-ranks").replaceChildren(
    ...s.ranks.map((r) =>
      el(
        "tr",
        {},
        el("td", { text: String(r.rank) }),
        el("td", { text: r.state, class: `state-${r.state}` }),
        el("td", { text: String(r.in_flight) }),
        el("td", { text: `${(r.kv_usage * 100).toFixed(1)} %` }),
        el("td", { text: `${r.heartbeat_age_s} s` }),
      ),
    ),
  );
  const rows = [];
  for (const [kind, counts] of [["refused", s.refused], ["aborted", s.aborted]]) {
    for (const [code, n] of Object.entries(counts)) {
      rows.push(el("tr", {}, el("td", { text: code }), el("td", { text: kind }), el("td", { text: String(n) })));
    }
  }
  if (!rows.length) rows.push(el("tr", {}, el("td", { text: "none", colspan: "3", class: "muted" })));
  $("s-errors").replaceChildren(...rows);
}
