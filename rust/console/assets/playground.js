// The playground: a chat with the served model through /v1/chat/completions, streamed. The conversation lives in
// this page only. Model output reaches the page as text (textContent), never as HTML.

import { call, el, errorText, apiKey } from "./api.js";
import { events } from "./sse.js";
import { latest } from "./status.js";
import * as snippets from "./snippets.js";

const $ = (id) => document.getElementById(id);
const history = [];
let running = null;
let image = null;

export function start() {}

function tool() {
  const text = $("p-tool").value.trim();
  if (!text) return null;
  const t = JSON.parse(text);
  return t.type === "function" ? t : { type: "function", function: t };
}

function schema() {
  const text = $("p-schema").value.trim();
  if (!text) return null;
  return { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(text), strict: true } };
}

function userMessage(text) {
  if (!image) return { role: "user", content: text };
  return { role: "user", content: [{ type: "text", text }, { type: "image_url", image_url: { url: image } }] };
}

/** The request the next send makes (its history, this input, the settings). */
function body(text) {
  const status = latest();
  const messages = [];
  const system = $("p-system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history, userMessage(text));
  const b = {
    model: (status && status.model) || "default",
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("p-temp").value),
    max_tokens: Number($("p-max").value),
    thinking: { type: $("p-think").checked ? "enabled" : "disabled" },
  };
  const t = tool();
  if (t) b.tools = [t];
  const f = schema();
  if (f) b.response_format = f;
  return b;
}

function bubble(role, text) {
  const li = el("li", { class: role }, el("div", { class: "text", text }));
  $("p-log").append(li);
  return li;
}

async function send(e) {
  e.preventDefault();
  if (running) return;
  const text = $("p-input").value;
  if (!text.trim()) return;
  let request;
  try {
    request = body(text);
  } catch (err) {
    $("p-error").textContent = `Tool or schema: ${err.message}`;
    return;
  }
  $("p-error").textContent = "";
  const user = bubble("user", text);
  if (image) user.append(el("img", { src: image, alt: "attached image" }));
  $("p-input").value = "";
  const reasoning = el("div", { class: "reasoning" });
  const fold = el("details", { hidden: "" }, el("summary", { text: "Reasoning" }), reasoning);
  const answer = el("div", { class: "text" });
  const calls = el("pre", { class: "text tools", hidden: "" });
  const stats = el("p", { class: "muted stats", text: "waiting…" });
  const li = el("li", { class: "assistant" }, fold, answer, calls, stats);
  $("p-log").append(li);
  const controller = new AbortController();
  running = controller;
  $("p-send").disabled = true;
  $("p-stop").disabled = false;
  const t0 = performance.now();
  let first = null, tokens = null, content = "", finish = null;
  const toolCalls = [];
  try {
    const resp = await call("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(request),
      signal: controller.signal,
    });
    if (!resp.ok) throw new Error(errorText(resp.status, await resp.json().catch(() => null)));
    for await (const data of events(resp)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "stream error");
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const d = choice.delta || {};
      if ((d.content || d.reasoning_content || d.tool_calls) && first == null) first = performance.now();
      if (d.reasoning_content) {
        fold.hidden = false;
        reasoning.textContent += d.reasoning_content;
      }
      if (d.content) {
        content += d.content;
        answer.textContent = content;
      }
      for (const tc of d.tool_calls || []) {
        const slot = (toolCalls[tc.index] ||= { id: tc.id, type: "function", function: { name: "", arguments: "" } });
        if (tc.function && tc.function.name) slot.function.name += tc.function.name;
        if (tc.function && tc.function.arguments) slot.function.arguments += tc.function.arguments;
        calls.hidden = false;
        calls.textContent = toolCalls.map((c) => `${c.function.name}(${c.function.arguments})`).join("\n");
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    const msg = { role: "assistant", content };
    if (toolCalls.length) msg.tool_calls = toolCalls;
    history.push(userMessage(text), msg);
  } catch (err) {
    if (err.name === "AbortError") finish = "stopped";
    else $("p-error").textContent = err.message;
  } finally {
    running = null;
    $("p-send").disabled = false;
    $("p-stop").disabled = true;
    li.dataset.finish = finish || "error";
    const end = performance.now();
    const ttft = first == null ? null : first - t0;
    const parts = [];
    if (tokens != null) parts.push(`${tokens} tokens`);
    if (ttft != null) parts.push(`TTFT ${Math.round(ttft)} ms`);
    if (tokens && first != null && end > first) parts.push(`${(tokens / ((end - first) / 1000)).toFixed(1)} tokens/s`);
    if (finish) parts.push(finish);
    stats.textContent = parts.join(" · ");
  }
}

function copy(kind) {
  let request;
  try {
    request = body($("p-input").value);
  } catch (err) {
    $("p-error").textContent = `Tool or schema: ${err.message}`;
    return;
  }
  const text = kind === "curl" ? snippets.curl(request, !!apiKey()) : snippets.python(request, !!apiKey());
  const pre = $("p-snippet");
  pre.hidden = false;
  pre.textContent = text;
  if (navigator.clipboard) navigator.clipboard.writeText(text).catch(() => {});
}

$("p-form").addEventListener("submit", send);
$("p-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("p-form").requestSubmit();
});
$("p-stop").addEventListener("click", () => running && running.abort());
$("p-clear").addEventListener("click", () => {
  history.length = 0;
  $("p-log").replaceChildren();
});
$("p-curl").addEventListener("click", () => copy("curl"));
$("p-python").addEventListener("click", () => copy("python"));
$("p-image").addEventListener("change", () => {
  const file = $("p-image").files[0];
  if (!file) {
    image = null;
    $("p-preview").hidden = true;
    return;
  }
  const reader = new FileReader();
  reader.onload = () => {
    image = reader.result;
    $("p-preview").src = image;
    $("p-preview").hidden = false;
  };
  reader.readAsDataURL(file);
});
