// A small line chart on a canvas: one or two series over the last five minutes, y from 0 to a rounded maximum.
// Colours come from the page's CSS variables, so light and dark follow the system setting.

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

/** Draw `series` ([{values: [number|null], color: "--var"}]) on `canvas`; `seconds` is the window length. */
export function draw(canvas, series, seconds) {
  const style = getComputedStyle(document.documentElement);
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width;
  const h = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(w * ratio)) canvas.width = Math.round(w * ratio);
  if (canvas.height !== Math.round(h * ratio)) canvas.height = Math.round(h * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const left = 44, bottom = 18, top = 6, right = 6;
  const pw = w - left - right, ph = h - top - bottom;
  let max = 0;
  for (const s of series) for (const v of s.values) if (v != null && v > max) max = v;
  max = niceMax(max);
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = style.getPropertyValue("--muted");
  ctx.strokeStyle = style.getPropertyValue("--line");
  ctx.lineWidth = 1;
  for (let i = 0; i <= 2; i += 1) {
    const y = top + ph - (ph * i) / 2;
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + pw, y); ctx.stroke();
    const label = (max * i) / 2;
    ctx.fillText(label >= 100 ? label.toFixed(0) : String(+label.toPrecision(3)), 2, y + 4);
  }
  ctx.fillText(`-${Math.round(seconds / 60) || 1} min`, left, h - 4);
  ctx.fillText("now", left + pw - 22, h - 4);
  const n = Math.max(seconds, 2);
  for (const s of series) {
    ctx.strokeStyle = style.getPropertyValue(s.color);
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let pen = false;
    const offset = n - s.values.length;
    const dots = [];
    s.values.forEach((v, i) => {
      if (v == null) { pen = false; return; }
      const x = left + (pw * (offset + i)) / (n - 1);
      const y = top + ph - (ph * v) / max;
      if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      // A second with samples between two without has no line to draw: it gets a dot.
      if (!pen && s.values[i + 1] == null) dots.push([x, y]);
      pen = true;
    });
    ctx.stroke();
    ctx.fillStyle = ctx.strokeStyle;
    for (const [x, y] of dots) ctx.fillRect(x - 1.5, y - 1.5, 3, 3);
  }
  canvas.dataset.max = String(max);
  canvas.dataset.points = String(series.reduce((a, s) => a + s.values.filter((v) => v).length, 0));
}
