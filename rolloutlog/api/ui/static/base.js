// rolloutlog's analyst dashboard, the first of its scripts (index.html loads base.js, charts.js,
// app.js in that order): building the DOM, formatting numbers and times, and the REST API
// read with the tab's token.
"use strict";

const TOKEN_KEY = "rolloutlog.token";

// -- helpers ----------------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "onclick" || key === "oninput" || key === "onchange" || key === "onsubmit") {
      node.addEventListener(key.slice(2), value);
    } else {
      node.setAttribute(key, value === true ? "" : String(value));
    }
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
  }
  return node;
}

const fmt = {
  n: (v) => (v === null || v === undefined ? "–" : Number(v).toLocaleString("en-US")),
  ms: (v) => (v === null || v === undefined ? "–" : `${Number(v).toFixed(1)} ms`),
  time: (v) => (v ? new Date(v * 1000).toISOString().replace("T", " ").slice(0, 19) : "–"),
  bytes: (v) => {
    if (v === null || v === undefined) return "–";
    const units = ["B", "kB", "MB", "GB"];
    let value = Number(v);
    let unit = 0;
    while (value >= 1000 && unit < units.length - 1) { value /= 1000; unit += 1; }
    return `${unit ? value.toFixed(1) : value} ${units[unit]}`;
  },
};

function badge(text) {
  return el("span", { class: `badge ${text}` }, text);
}

function field(name, value) {
  // data-field marks a number the browser tests compare with the API's reply.
  return el("span", { "data-field": name }, value);
}

function card(label, name, value) {
  return el("div", { class: "card" }, el("div", { class: "value" }, field(name, value)),
    el("div", { class: "label" }, label));
}

function table(headers, rows, attrs) {
  return el("table", attrs || {},
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", { class: h.num ? "num" : null }, h.label || h)))),
    el("tbody", {}, rows));
}

function td(value, attrs) {
  return el("td", attrs || {}, value);
}

function enc(part) {
  return encodeURIComponent(part);
}

// -- the API ----------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, body) {
    super(body && body.error ? `${body.error.code}: ${body.error.message}` : `HTTP ${status}`);
    this.status = status;
    this.code = body && body.error ? body.error.code : null;
    this.details = (body && body.error && body.error.details) || {};
  }
}

async function api(path) {
  const headers = { Accept: "application/json" };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  const reply = await fetch(path, { headers });
  const body = await reply.json().catch(() => null);
  if (!reply.ok) throw new ApiError(reply.status, body);
  return body;
}

let schemaPaths = null;

async function hasRoute(path) {
  // Routes other work adds later (the quarantine listing) are used only once the service
  // documents them, so that an older service is never asked for a missing route.
  if (schemaPaths === null) {
    const schema = await fetch("/openapi.json").then((r) => r.json());
    schemaPaths = new Set(Object.keys(schema.paths || {}));
  }
  return schemaPaths.has(path);
}
