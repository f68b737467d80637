// "Copy as curl" and "Copy as Python (openai)": the exact request the playground would send next.

import { url } from "./api.js";

function shellQuote(s) {
  return `'${s.replace(/'/g, "'\\''")}'`;
}

export function curl(body, withKey) {
  const lines = [`curl -N ${shellQuote(url("v1/chat/completions"))}`, "  -H 'Content-Type: application/json'"];
  if (withKey) lines.push("  -H \"Authorization: Bearer $DEEPINFER_API_KEY\"");
  lines.push(`  -d ${shellQuote(JSON.stringify(body, null, 2))}`);
  return lines.join(" \\\n");
}

/** A Python literal of a JSON value (true/false/null spelt as Python spells them). */
function py(v, indent = "") {
  if (v === null) return "None";
  if (v === true) return "True";
  if (v === false) return "False";
  if (typeof v === "string" || typeof v === "number") return JSON.stringify(v);
  const inner = indent + "    ";
  if (Array.isArray(v)) {
    if (!v.length) return "[]";
    return `[\n${v.map((x) => inner + py(x, inner)).join(",\n")},\n${indent}]`;
  }
  const keys = Object.keys(v);
  if (!keys.length) return "{}";
  return `{\n${keys.map((k) => `${inner}${JSON.stringify(k)}: ${py(v[k], inner)}`).join(",\n")},\n${indent}}`;
}

export function python(body, withKey) {
  const known = ["model", "messages", "temperature", "max_tokens", "stream", "stop", "tools", "response_format"];
  const args = [];
  const extra = {};
  for (const [k, v] of Object.entries(body)) {
    if (known.includes(k)) args.push(`    ${k}=${py(v, "    ")},`);
    else extra[k] = v;
  }
  if (Object.keys(extra).length) args.push(`    extra_body=${py(extra, "    ")},`);
  const key = withKey ? 'os.environ["DEEPINFER_API_KEY"]' : '"unused"';
  return [
    "import os",
    "",
    "from openai import OpenAI",
    "",
    `client = OpenAI(base_url=${JSON.stringify(url("v1"))}, api_key=${key})`,
    "stream = client.chat.completions.create(",
    ...args,
    ")",
    "for chunk in stream:",
    "    if chunk.choices and chunk.choices[0].delta.content:",
    '        print(chunk.choices[0].delta.content, end="", flush=True)',
    "print()",
  ].join("\n");
}
