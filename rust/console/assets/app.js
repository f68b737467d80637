// The console's shell: three views behind tabs (arrow keys move between them, the URL's hash keeps the view).

import * as status from "./status.js";
import * as batches from "./batches.js";
import * as playground from "./playground.js";

const VIEWS = { status, batches, playground };
const tabs = [...document.querySelectorAll('[role="tab"]')];

function show(name) {
  if (!VIEWS[name]) name = "status";
  for (const tab of tabs) {
    const on = tab.dataset.view === name;
    tab.setAttribute("aria-selected", String(on));
    tab.tabIndex = on ? 0 : -1;
    document.getElementById(`view-${tab.dataset.view}`).hidden = !on;
  }
  for (const [n, view] of Object.entries(VIEWS)) if (n !== name && view.stop) view.stop();
  VIEWS[name].start();
  // The header's model name and health come from the status poll; keep them fresh on every view.
  if (name !== "status") status.start();
}

for (const tab of tabs) {
  tab.addEventListener("click", () => { location.hash = tab.dataset.view; });
  tab.addEventListener("keydown", (e) => {
    const i = tabs.indexOf(tab);
    const next = e.key === "ArrowRight" ? i + 1 : e.key === "ArrowLeft" ? i - 1 : null;
    if (next == null) return;
    const t = tabs[(next + tabs.length) % tabs.length];
    t.focus();
    location.hash = t.dataset.view;
  });
}
window.addEventListener("hashchange", () => show(location.hash.slice(1)));
show(location.hash.slice(1));
