// Calls to this server: relative URLs (so --root-path works behind a proxy), the key from this tab's
// sessionStorage, and a prompt for the key on a 401.

const KEY = "deepinfer-console-key";
let asking = null;

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

/** The absolute URL of a server path ("v1/models"), as the page was reached. */
export function url(path) {
  return new URL(path, document.baseURI).href;
}

export function headers(extra = {}) {
  const h = { ...extra };
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

/** Ask for the key (one dialog however many calls wait for it); resolves once one is entered. */
export function askForKey(message) {
  if (asking) return asking;
  const dialog = document.getElementById("key-dialog");
  const form = document.getElementById("key-form");
  const input = document.getElementById("key-input");
  document.getElementById("key-error").textContent = message || "";
  asking = new Promise((resolve) => {
    form.addEventListener(
      "submit",
      () => {
        sessionStorage.setItem(KEY, input.value.trim());
        input.value = "";
        asking = null;
        resolve();
      },
      { once: true },
    );
  });
  if (!dialog.open) dialog.showModal();
  input.focus();
  return asking;
}

/** fetch() with the key; a 401 asks for the key and tries again. */
export async function call(path, init = {}) {
  for (;;) {
    const resp = await fetch(url(path), { ...init, headers: headers(init.headers) });
    if (resp.status !== 401) return resp;
    const had = apiKey();
    await askForKey(had ? "That key was refused." : "");
  }
}

/** The JSON of a call; an Error with the server's message (as text, never HTML) otherwise. */
export async function json(path, init = {}) {
  const resp = await call(path, init);
  const body = await resp.json().catch(() => null);
  if (!resp.ok) throw new Error(errorText(resp.status, body));
  return body;
}

export function errorText(status, body) {
  const msg = body && body.error && (body.error.message || body.error.type);
  return `${status}: ${msg || "request failed"}`;
}

/** A DOM element with text content only: nothing from the server is ever parsed as HTML. */
export function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") e.textContent = v;
    else if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) if (c != null) e.append(c);
  return e;
}

export function bytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function duration(s) {
  if (!isFinite(s)) return "–";
  if (s < 60) return `${Math.round(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
}
