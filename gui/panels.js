// Heatmap panels on a canvas: draws the spec figures/panels.py writes from a plotly figure (the attention Stages).
// Mounted once (Streamlit's components v2); each rerun hands it a new spec and it redraws: no plotly, no remount.
// Every label is written as text (fillText, textContent), never as HTML.

const TICK_GAP = 4;
const TITLE_GAP = 8;

function rgbOf(colour) {
  const m = /rgba?\(([^)]+)\)/.exec(colour);
  if (m) return m[1].split(",").slice(0, 3).map((v) => parseFloat(v));
  const h = colour.replace("#", "");
  const full = h.length === 3 ? h.split("").map((c) => c + c).join("") : h;
  return [0, 2, 4].map((i) => parseInt(full.slice(i, i + 2), 16));
}

function scaleOf(panel) {
  const stops = panel.colours.map(([at, colour]) => [at, rgbOf(colour)]);
  const span = panel.zmax - panel.zmin;
  return (v) => {
    const f = Math.min(1, Math.max(0, (v - panel.zmin) / span));
    let k = 1;
    while (k < stops.length - 1 && stops[k][0] < f) k++;
    const [a, ca] = stops[k - 1], [b, cb] = stops[k];
    const w = b > a ? (f - a) / (b - a) : 0;
    return [0, 1, 2].map((i) => Math.round(ca[i] + (cb[i] - ca[i]) * w));
  };
}

function formatValue(v) {  // plotly's %{z:.4g}, with its minus sign
  const s = Number(v).toPrecision(4);
  return v < 0 ? "−" + s.slice(1) : s;
}

function writeLines(box, lines, size, colour, family, weight = "400") {
  box.textContent = "";
  for (const line of lines) {
    const row = document.createElement("div");
    for (const run of line) {
      const span = document.createElement("span");
      span.textContent = run.t;
      span.style.fontWeight = run.b ? "700" : weight;
      if (run.i) span.style.fontStyle = "italic";
      span.style.fontSize = (run.s || size) + "px";
      if (run.c) span.style.color = run.c;
      row.appendChild(span);
    }
    if (!line.length) row.textContent = "\u00a0";  // an empty line keeps its height
    row.style.lineHeight = "1.25";
    box.appendChild(row);
  }
  box.style.fontFamily = family;
  box.style.fontSize = size + "px";
  box.style.color = colour;
}

// a label's box (rotated by `angle` about its anchor; `dx` where its text starts, `w` wide, `h` high) recorded when it
// reaches past the canvas: the page's tests read them (data-clipped), as they read a plotly chart's tick labels
function keep(view, label, x, y, angle, dx, w, h) {
  const c = Math.cos(angle), s = Math.sin(angle);
  const xs = [], ys = [];
  for (const [u, v] of [[dx, -h / 2], [dx + w, -h / 2], [dx, h / 2], [dx + w, h / 2]]) {
    xs.push(x + u * c - v * s);
    ys.push(y + u * s + v * c);
  }
  const over = Math.max(-Math.min(...xs), Math.max(...xs) - view.width, -Math.min(...ys), Math.max(...ys) - view.spec.height);
  if (over > 1) view.clipped.push(`${label} (${Math.round(over)} px out)`);
}

function makeView(parent) {
  const root = document.createElement("div");
  root.className = "panels";
  const canvas = document.createElement("canvas");
  const overlay = document.createElement("canvas");
  const text = document.createElement("div");
  text.className = "panels-text";
  const tip = document.createElement("div");
  tip.className = "panels-tip";
  overlay.style.pointerEvents = "none";  // the pointer's events reach the drawing under it (and the root's listener)
  root.append(canvas, overlay, text, tip);
  parent.appendChild(root);
  const view = { root, canvas, overlay, text, tip, spec: null, boxes: [], drawn: 0 };
  root.addEventListener("mousemove", (event) => {
    view.pointer = { clientX: event.clientX, clientY: event.clientY };
    hover(view, view.pointer);
  });
  root.addEventListener("mouseleave", () => { view.pointer = null; unhover(view); });
  view.resize = new ResizeObserver(() => { if (view.spec && view.root.clientWidth !== view.width) draw(view); });
  view.resize.observe(root);
  return view;
}

function sized(canvas, width, height) {
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * dpr);
  canvas.height = Math.round(height * dpr);
  canvas.style.width = width + "px";
  canvas.style.height = height + "px";
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, width, height);
  return g;
}

function draw(view) {
  const spec = view.spec;
  unhover(view);  // what the pointer showed belongs to the drawing before (hovered again below, where it rests)
  const width = Math.max(200, view.root.clientWidth || 900);
  const height = spec.height;
  view.width = width;
  view.root.style.height = height + "px";
  const g = sized(view.canvas, width, height);
  sized(view.overlay, width, height);
  const m = spec.margin;
  const left = m.l, top = m.t, pw = width - m.l - m.r, ph = height - m.t - m.b;
  const font = (size, weight) => `${weight || 400} ${size}px ${spec.font}`;
  view.text.textContent = "";
  view.boxes = [];
  view.clipped = [];
  g.fillStyle = "white";
  g.fillRect(0, 0, width, height);
  for (const p of spec.panels) {
    const x0 = left + p.domain[0] * pw, x1 = left + p.domain[1] * pw;
    const y0 = top + (1 - p.ydomain[1]) * ph, y1 = top + (1 - p.ydomain[0]) * ph;
    const rows = p.z.length, cols = rows ? p.z[0].length : 0;
    view.boxes.push({ p, x0, x1, y0, y1, rows, cols });
    g.fillStyle = spec.background;
    g.fillRect(x0, y0, x1 - x0, y1 - y0);
    if (!rows || !cols) continue;
    const colour = scaleOf(p);
    const cells = document.createElement("canvas");
    cells.width = cols;
    cells.height = rows;
    const cg = cells.getContext("2d");
    const image = cg.createImageData(cols, rows);
    const masked = p.masked ? rgbOf(p.masked) : null;
    for (let i = 0; i < rows; i++) {
      for (let j = 0; j < cols; j++) {
        const v = p.z[i][j], at = 4 * (i * cols + j);
        const c = v === null ? masked : colour(v);
        if (!c) continue;
        image.data[at] = c[0]; image.data[at + 1] = c[1]; image.data[at + 2] = c[2]; image.data[at + 3] = 255;
      }
    }
    cg.putImageData(image, 0, 0);
    g.imageSmoothingEnabled = false;
    g.drawImage(cells, x0, y0, x1 - x0, y1 - y0);
    const cw = (x1 - x0) / cols, rh = (y1 - y0) / rows;
    if (p.text) {
      g.font = font(p.text_size);
      g.textAlign = "center";
      g.textBaseline = "middle";
      for (let i = 0; i < rows; i++) {
        for (let j = 0; j < cols; j++) {
          const v = p.z[i][j];
          if (v === null || !p.text[i][j]) continue;
          const c = colour(v);
          // plotly's contrast: dark text on a light cell (brightness, 0 … 255, at least 128), white on a dark one
          g.fillStyle = (0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2]) >= 128 ? "#444" : "white";
          g.fillText(p.text[i][j], x0 + (j + 0.5) * cw, y0 + (i + 0.5) * rh);
        }
      }
    }
    // tick labels: x under the panel at the axis' angle, y to its left
    g.fillStyle = spec.muted;
    g.font = font(12);
    const angle = p.tickangle * Math.PI / 180;
    let below = 0;
    let last = -Infinity;  // where the last label drawn stands: one closer than a line of text would overlap it
    p.xticks.forEach((j, k) => {
      const label = p.xticktext[k] ?? p.x[j];
      const w = g.measureText(label).width;
      const at = x0 + (j + 0.5) * cw;
      if (at - last < (angle ? 13 / Math.abs(Math.sin(angle)) : w + 6)) return;  // hover still names every column
      last = at;
      g.save();
      g.translate(x0 + (j + 0.5) * cw, y1 + TICK_GAP);
      if (angle) {
        g.rotate(angle);
        g.textAlign = "right";
        g.textBaseline = "middle";
        g.fillText(label, 0, 0);
        keep(view, label, x0 + (j + 0.5) * cw, y1 + TICK_GAP, angle, -w, w, 12);
        below = Math.max(below, w * Math.abs(Math.sin(angle)) + 12 * Math.abs(Math.cos(angle)) / 2);
      } else {
        g.textAlign = "center";
        g.textBaseline = "top";
        g.fillText(label, 0, 0);
        keep(view, label, x0 + (j + 0.5) * cw, y1 + TICK_GAP + 6, 0, -w / 2, w, 12);
        below = Math.max(below, 12);
      }
      g.restore();
    });
    let aside = 0;
    g.textAlign = "right";
    g.textBaseline = "middle";
    p.yticks.forEach((i, k) => {
      const label = p.yticktext[k] ?? p.y[i];
      const w = g.measureText(label).width;
      aside = Math.max(aside, w);
      g.fillText(label, x0 - TICK_GAP, y0 + (i + 0.5) * rh);
      keep(view, label, x0 - TICK_GAP, y0 + (i + 0.5) * rh, 0, -w, w, 12);
    });
    g.font = font(13);
    if (p.xtitle) {
      g.textAlign = "center";
      g.textBaseline = "top";
      g.fillText(p.xtitle, (x0 + x1) / 2, y1 + TICK_GAP + below + TITLE_GAP);
      const w = g.measureText(p.xtitle).width;
      keep(view, p.xtitle, (x0 + x1) / 2, y1 + TICK_GAP + below + TITLE_GAP + 7, 0, -w / 2, w, 13);
    }
    if (p.ytitle) {
      g.save();
      g.translate(x0 - TICK_GAP - aside - TITLE_GAP, (y0 + y1) / 2);
      g.rotate(-Math.PI / 2);
      g.textAlign = "center";
      g.textBaseline = "bottom";
      g.fillText(p.ytitle, 0, 0);
      g.restore();
      const w = g.measureText(p.ytitle).width;
      keep(view, p.ytitle, x0 - TICK_GAP - aside - TITLE_GAP - 7, (y0 + y1) / 2, -Math.PI / 2, -w / 2, w, 13);
    }
    if (p.bar) drawBar(view, g, p, left + p.bar.x * pw, top + ph / 2, p.bar.len * ph, font);
  }
  for (const o of spec.outlines || []) {  // a rectangle over a panel's cells, in cell units (cell j spans j ± 0.5)
    const b = view.boxes[o.panel];
    if (!b || !b.rows || !b.cols) continue;
    const cw = (b.x1 - b.x0) / b.cols, rh = (b.y1 - b.y0) / b.rows;
    g.strokeStyle = o.colour;
    g.lineWidth = o.width;
    g.strokeRect(b.x0 + (o.x0 + 0.5) * cw, b.y0 + (o.y0 + 0.5) * rh, (o.x1 - o.x0) * cw, (o.y1 - o.y0) * rh);
  }
  for (const note of spec.notes) {
    const box = document.createElement("div");
    writeLines(box, note.lines, note.size, spec.colour, spec.font);
    if (note.wide_as) {  // a panel's title: its lines wrap at the words within the panel's width
      box.style.whiteSpace = "normal";
      box.style.width = note.wide_as * pw + "px";
    }
    box.style.left = left + note.x * pw + "px";
    box.style.top = top + (1 - note.y) * ph + "px";
    const dx = { left: "0", center: "-50%", right: "-100%" }[note.xanchor] || "-50%";
    const dy = { top: "0", middle: "-50%", bottom: "-100%" }[note.yanchor] || "-50%";
    box.style.transform = `translate(${dx}, ${dy})`;
    view.text.appendChild(box);
  }
  if (spec.title.lines.some((line) => line.length)) {
    const box = document.createElement("div");
    writeLines(box, spec.title.lines, spec.title.size, spec.colour, spec.font, "600");
    box.style.left = left + "px";
    box.style.top = (1 - spec.title.y) * height + "px";
    box.style.textAlign = "left";
    view.text.appendChild(box);
  }
  // what a screen reader says of the drawing: its title and each panel's title, as plain text
  const said = (lines) => lines.map((line) => line.map((run) => run.t).join("")).join(" ");
  view.root.setAttribute("role", "img");
  view.root.setAttribute("aria-label", [said(spec.title.lines), ...spec.notes.map((n) => said(n.lines))].join("; "));
  view.drawn += 1;
  view.root.__spec = spec;
  view.root.dataset.clipped = JSON.stringify(view.clipped);
  view.root.dataset.revision = spec.revision;  // written once the drawing is done: a page's tests wait for it
  view.root.dataset.drawn = String(view.drawn);
  if (view.pointer) hover(view, view.pointer);
}

function drawBar(view, g, p, x, middle, length, font) {
  const bar = p.bar, bottom = middle + length / 2, topY = middle - length / 2;
  const gradient = g.createLinearGradient(0, bottom, 0, topY);
  for (const [at, colour] of p.colours) gradient.addColorStop(at, colour);
  g.fillStyle = gradient;
  g.fillRect(x, topY, bar.thickness, length);
  g.fillStyle = view.spec.muted;
  g.font = font(bar.size);
  g.textAlign = "left";
  g.textBaseline = "middle";
  bar.ticks.forEach((v, k) => {
    const y = bottom - (v - p.zmin) / (p.zmax - p.zmin) * length;
    g.fillText(bar.labels[k], x + bar.thickness + 2, y);
    const w = g.measureText(bar.labels[k]).width;
    keep(view, bar.labels[k], x + bar.thickness + 2, y, 0, 0, w, bar.size);
  });
  const box = document.createElement("div");
  writeLines(box, bar.title, bar.size + 1, view.spec.colour, view.spec.font);
  box.style.left = x + "px";
  box.style.top = topY - 6 + "px";  // above the top tick's label, which is centred on the bar's end
  box.style.transform = "translate(0, -100%)";
  box.style.textAlign = "left";
  view.text.appendChild(box);
}

function unhover(view) {
  const g = view.overlay.getContext("2d");
  g.save();
  g.setTransform(1, 0, 0, 1, 0, 0);
  g.clearRect(0, 0, view.overlay.width, view.overlay.height);
  g.restore();
  view.tip.style.display = "none";
  view.root.dataset.hovered = "";
}

// the pointer on a cell: its row and column drawn across every panel of the same cells, and the tooltip reads the
// cell in each of them (the hovered panel's first) — a score followed through the stages
function hover(view, event) {
  const rect = view.root.getBoundingClientRect();
  const x = event.clientX - rect.left, y = event.clientY - rect.top;
  const box = view.boxes.find((b) => x >= b.x0 && x < b.x1 && y >= b.y0 && y < b.y1 && b.rows && b.cols);
  unhover(view);
  if (!box) return;
  const j = Math.floor((x - box.x0) / (box.x1 - box.x0) * box.cols);
  const i = Math.floor((y - box.y0) / (box.y1 - box.y0) * box.rows);
  if (box.p.z[i][j] === null) return;  // a grey cell holds no number: nothing to read, as plotly's hover
  const same = view.boxes.filter((b) => b.rows === box.rows && b.cols === box.cols);
  const g = view.overlay.getContext("2d");
  g.strokeStyle = "#202020";
  g.lineWidth = 1;
  g.beginPath();
  for (const b of same) {
    const cw = (b.x1 - b.x0) / b.cols, rh = (b.y1 - b.y0) / b.rows;
    g.moveTo(b.x0, b.y0 + (i + 0.5) * rh);
    g.lineTo(b.x1, b.y0 + (i + 0.5) * rh);
    g.moveTo(b.x0 + (j + 0.5) * cw, b.y0);
    g.lineTo(b.x0 + (j + 0.5) * cw, b.y1);
  }
  g.stroke();
  view.tip.textContent = "";
  const lines = [[`row ${box.p.y[i]}`, false], [`column ${box.p.x[j]}`, false]];
  for (const b of [box, ...same.filter((b) => b !== box)]) {
    const v = b.p.z[i][j];
    const value = v === null ? "no number (grey)" : formatValue(v);
    lines.push([b.p.name && same.length > 1 ? `${b.p.name}: ${value}` : value, b === box && same.length > 1]);
  }
  for (const [line, bold] of lines) {
    const row = document.createElement("div");
    row.textContent = line;
    if (bold) row.style.fontWeight = "700";
    view.tip.appendChild(row);
  }
  view.tip.style.display = "block";
  const right = x + 14 + view.tip.offsetWidth > view.width;
  view.tip.style.left = (right ? x - 14 - view.tip.offsetWidth : x + 14) + "px";
  view.tip.style.top = Math.max(0, Math.min(view.spec.height - view.tip.offsetHeight, y - view.tip.offsetHeight / 2)) + "px";
  view.root.dataset.hovered = `${view.boxes.indexOf(box)},${i},${j}`;
}

export default function (component) {
  const { data, parentElement } = component;
  let view = parentElement.__panelsView;
  if (!view) view = parentElement.__panelsView = makeView(parentElement);
  view.spec = data;
  view.root.__handed = data.revision;  // the drawing is this spec's once dataset.revision says so
  draw(view);
  // Streamlit runs the cleanup the last call returned when the element goes away
  return () => { view.resize.disconnect(); delete parentElement.__panelsView; };
}
