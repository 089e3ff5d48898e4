// The dashboard's charts (hand-written SVG: three small charts do not need a library), the
// stage colours they share with the checkpoint table's stage bars, and the stages' totals.
"use strict";

const STAGE_COLORS = ["#2f6fdf", "#1f8a4c", "#b7791f", "#8e44ad", "#c53030", "#16a2b8", "#6b7385"];

function chartBox(title, testid) {
  const box = el("div", { class: "chart", "data-testid": testid }, el("h3", {}, title));
  const area = svg("svg", { viewBox: "0 0 400 160", preserveAspectRatio: "none" });
  box.append(area);
  return { box, area };
}

function axisMax(values) {
  const max = Math.max(1, ...values);
  const pow = 10 ** Math.floor(Math.log10(max));
  return Math.ceil(max / pow) * pow;
}

function drawBars(area, bars, stages, unit) {
  // bars: [{label, parts: {stage: value}}], stacked in the order of `stages`.
  area.replaceChildren();
  const totals = bars.map((b) => stages.reduce((s, k) => s + (b.parts[k] || 0), 0));
  const top = axisMax(totals);
  const left = 40, bottom = 140, height = 125, width = 355;
  area.append(svg("text", { x: 2, y: 20 }, `${top} ${unit}`), svg("text", { x: 2, y: bottom }, `0`));
  area.append(svg("line", { x1: left, y1: bottom, x2: left + width, y2: bottom, stroke: "#dfe3ea" }));
  const step = width / Math.max(bars.length, 1);
  bars.forEach((bar, i) => {
    let y = bottom;
    stages.forEach((stage, s) => {
      const value = bar.parts[stage] || 0;
      const h = (value / top) * height;
      y -= h;
      area.append(svg("rect", { x: left + i * step + 1, y, width: Math.max(step - 2, 1), height: h,
        fill: STAGE_COLORS[s % STAGE_COLORS.length] }, svg("title", {}, `${bar.label} ${stage}: ${value.toFixed(1)} ${unit}`)));
    });
    if (bars.length <= 20) area.append(svg("text", { x: left + i * step + 2, y: 155 }, bar.label));
  });
}

function drawLine(area, points, unit) {
  area.replaceChildren();
  const left = 40, bottom = 140, height = 125, width = 355;
  const top = axisMax(points.map((p) => p.y));
  area.append(svg("text", { x: 2, y: 20 }, `${top.toFixed(top < 10 ? 1 : 0)} ${unit}`), svg("text", { x: 2, y: bottom }, "0"));
  area.append(svg("line", { x1: left, y1: bottom, x2: left + width, y2: bottom, stroke: "#dfe3ea" }));
  if (points.length < 2) {
    area.append(svg("text", { x: left + 10, y: 80 }, "collecting…"));
    return;
  }
  const x0 = points[0].x, span = Math.max(points[points.length - 1].x - x0, 1e-9);
  const path = points.map((p, i) => `${i ? "L" : "M"}${(left + ((p.x - x0) / span) * width).toFixed(1)},${(bottom - (p.y / top) * height).toFixed(1)}`).join(" ");
  area.append(svg("path", { d: path, fill: "none", stroke: STAGE_COLORS[0], "stroke-width": 2 }));
  area.append(svg("text", { x: left + width - 90, y: 12 }, `now ${points[points.length - 1].y.toFixed(1)} ${unit}`));
}

function legend(stages) {
  return el("div", { class: "legend" }, stages.map((s, i) => {
    const swatch = el("i");
    swatch.style.background = STAGE_COLORS[i % STAGE_COLORS.length];
    return el("span", {}, swatch, s);
  }));
}

function stageBar(timings, stages, total, scale) {
  const bar = el("div", { class: "stagebar", title: stages.map((s) => `${s}: ${fmt.ms(timings[s] || 0)}`).join(", ") });
  stages.forEach((stage, i) => {
    const part = el("span");
    part.style.width = `${((timings[stage] || 0) / scale) * 100}%`;
    part.style.background = STAGE_COLORS[i % STAGE_COLORS.length];
    bar.append(part);
  });
  return bar;
}

function totalMs(timings) {
  if (timings.total !== undefined) return timings.total;
  return Object.values(timings).reduce((a, b) => a + b, 0);
}

function stagesOf(items) {
  const stages = [];
  for (const item of items) {
    for (const key of Object.keys(item.timings_ms || {})) {
      if (key !== "total" && !stages.includes(key)) stages.push(key);
    }
  }
  return stages;
}
