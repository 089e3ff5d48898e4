// rolloutlog's analyst dashboard: plain JavaScript over the REST API (no framework, no build).
// Every number shown comes from one API reply; nothing is computed on the server for the page.
// The pages and the router; base.js (DOM, formats, the API) and charts.js load before it.
"use strict";

const REFRESH_MS = 3000;
const PAGE = 100;
// What a fork's source is called when the service leaves its name out (the token holds no role
// on it).
const HIDDEN_SOURCE = "a run out of this token's scope";

// -- the page -----------------------------------------------------------------------------------

const app = document.getElementById("app");
let timer = null;
let generation = 0;

function crumbs(parts) {
  const nav = document.getElementById("crumbs");
  nav.replaceChildren(...parts.flatMap((p, i) => [i ? " / " : "", p.href ? el("a", { href: p.href }, p.label) : p.label]));
}

function showError(error) {
  if (error instanceof ApiError && (error.status === 401 || error.status === 403)) {
    app.replaceChildren(el("p", { class: "error", "data-testid": "auth-error" },
      error.code === "forbidden" && error.details.run  // a token scoped to other runs
        ? `${error.message}. This token reads other runs only: enter one that holds this run above.`
        : `${error.message}. Enter an analyst token above (it stays in this tab's sessionStorage).`));
    document.getElementById("token").focus();
    return;
  }
  app.replaceChildren(el("p", { class: "error", "data-testid": "error" }, String(error.message || error)));
}

function setLive(text) {
  document.getElementById("live-status").textContent = text;
}

async function route() {
  generation += 1;
  const mine = generation;
  if (timer) clearTimeout(timer);
  const parts = location.pathname.replace(/\/+$/, "").split("/").slice(2).map(decodeURIComponent);
  let view;
  if (parts.length === 0) view = runsView();
  else if (parts[0] === "runs" && parts.length === 2) view = runView(parts[1]);
  else if (parts[0] === "runs" && parts[2] === "episodes" && parts.length === 4) view = episodeView(parts[1], parts[3]);
  else { showError(new Error(`no page ${location.pathname}`)); return; }
  const tick = async () => {
    if (mine !== generation) return;
    try {
      await view.refresh();
      setLive(`updated ${new Date().toLocaleTimeString()}`);
    } catch (error) {
      showError(error);
      return;
    }
    if (view.live) timer = setTimeout(tick, REFRESH_MS);
  };
  try {
    await view.render();
  } catch (error) {
    showError(error);
    return;
  }
  if (view.live) timer = setTimeout(tick, REFRESH_MS);
}

// -- health -------------------------------------------------------------------------------------

// What holds a run back, on any replica: one row per partition and the replica that holds it.
function heldBackTable(health) {
  const blockers = health.held_back || [];
  if (!blockers.length) return el("p", { class: "muted", "data-testid": "held-back-none" }, "Nothing holds the run back.");
  return el("table", { "data-testid": "held-back" },
    el("thead", {}, el("tr", {}, ["partition", "replica", "state", "lag", "since", "reason"].map((h) => el("th", {}, h)))),
    el("tbody", {}, blockers.map((b) => el("tr", { "data-partition": b.partition },
      td(field("partition", b.partition), { class: "num" }),
      td(field("replica", b.replica ?? "nobody")),
      td(badge(b.state)),
      td(field("lag", fmt.n(b.lag)), { class: "num" }),
      td(fmt.time(b.since)),
      td(b.reason)))));
}

function heldBackSummary(health) {
  const blockers = health.held_back || [];
  if (!blockers.length) return "nothing holds the run back";
  return "held back by " + blockers.map((b) => `partition ${b.partition} (${b.replica ?? "nobody"}: ${b.state})`).join(", ");
}

// -- runs ---------------------------------------------------------------------------------------

function runsView() {
  const params = new URLSearchParams(location.search);
  const after = params.get("after");
  crumbs([{ label: "runs" }]);
  const body = el("tbody");
  const pager = el("div", { class: "pager" });
  const render = async () => {
    app.replaceChildren(el("h1", {}, "Runs"),
      el("table", { "data-testid": "runs" },
        el("thead", {}, el("tr", {}, ["run", "health", "live episodes", "episodes", "latest checkpoint",
          "checkpoints", "restores", "participants", "projector lag", "partitions"].map((h) => el("th", {}, h)))),
        body),
      pager);
    await refresh();
  };
  const refresh = async () => {
    const query = new URLSearchParams({ limit: String(PAGE) });
    if (after) query.set("after", after);
    const page = await api(`/v1/runs?${query}`);
    const lags = await Promise.all(page.runs.map((r) => api(`/v1/runs/${enc(r.run)}/projector`).catch(() => null)));
    const lagOf = new Map(page.runs.map((r, i) => [r.run, lags[i]]));
    body.replaceChildren(...forkTree(page.runs).map(({ run: r, depth }) => {
      const lag = lagOf.get(r.run);
      const origin = r.forked_from;
      const health = r.health
        ? el("span", { title: heldBackSummary(r.health) }, badge(r.health.status))
        : el("span", { class: "muted" }, "–");
      const checkpoints = Object.values(r.counts.checkpoints || {}).reduce((a, b) => a + b, 0);
      return el("tr", { "data-run": r.run, "data-depth": String(depth) },
        td(el("span", { class: `fork-depth-${Math.min(depth, 6)}` },
          depth ? el("span", { class: "muted" }, "↳ ") : "",
          el("a", { href: `/ui/runs/${enc(r.run)}` }, r.run),
          origin ? el("span", { class: "muted" }, " forked from ",
            field("forked_from", forkedFrom(origin))) : "")),
        td(health),
        td(field("live_episodes", fmt.n(r.counts.live_episodes)), { class: "num" }),
        td(field("episodes", fmt.n(r.counts.episodes)), { class: "num" }),
        td(field("latest_checkpoint_id", r.latest_checkpoint_id ?? "–")),
        td(field("checkpoints", fmt.n(checkpoints)), { class: "num" }),
        td(field("restores", fmt.n(r.counts.restores)), { class: "num" }),
        td(field("participants", fmt.n(r.counts.participants)), { class: "num" }),
        td(field("lag", lag ? fmt.n(lag.lag) : "–"), { class: "num" }),
        td(r.partitions, { class: "num" }));
    }));
    pager.replaceChildren(page.next_after ? el("a", { href: `/ui?after=${enc(page.next_after)}` }, "next page →") : "");
    if (!page.runs.length) body.replaceChildren(el("tr", {}, el("td", { colspan: 10, class: "muted" }, "No runs yet.")));
  };
  return { render, refresh, live: true };
}

// Runs in page order, each fork right after its source (indented by its depth) when the source
// is on the page too.
function forkTree(runs) {
  const names = new Set(runs.map((r) => r.run));
  const children = new Map();
  const roots = [];
  for (const r of runs) {
    const source = r.forked_from && names.has(r.forked_from.run) ? r.forked_from.run : null;
    if (source === null) roots.push(r);
    else children.set(source, [...(children.get(source) || []), r]);
  }
  const out = [];
  const visit = (r, depth) => {
    out.push({ run: r, depth });
    for (const child of children.get(r.run) || []) visit(child, depth + 1);
  };
  roots.forEach((r) => visit(r, 0));
  return out;
}

// A fork's source as SOURCE@CHECKPOINT; the service leaves the name out (null) to a token that
// holds no role on the source.
function forkedFrom(origin) {
  return origin.run === null ? `checkpoint ${origin.checkpoint_id} of ${HIDDEN_SOURCE}`
    : `${origin.run}@${origin.checkpoint_id}`;
}

function lineage(run, info) {
  const parts = [];
  const origin = info.forked_from;
  if (origin) {
    parts.push(el("p", {}, "Forked from ",
      origin.run === null
        ? el("span", { class: "muted", "data-field": "forked_from" }, HIDDEN_SOURCE)
        : el("a", { href: `/ui/runs/${enc(origin.run)}`, "data-field": "forked_from" }, origin.run),
      ` at checkpoint ${origin.checkpoint_id}`,
      origin.at ? el("span", { class: "muted" }, ` (${fmt.time(origin.at)})`) : ""));
  }
  if ((info.forks || []).length) {
    parts.push(el("p", {}, "Forks: ", ...info.forks.flatMap((f, i) => [i ? ", " : "",
      el("a", { href: `/ui/runs/${enc(f.run)}`, "data-fork": f.run }, f.run),
      el("span", { class: "muted" }, ` (checkpoint ${f.checkpoint_id})`)])));
  }
  return parts;
}

// -- one run --------------------------------------------------------------------------------------

function runView(run) {
  crumbs([{ label: "runs", href: "/ui" }, { label: run }]);
  const base = `/v1/runs/${enc(run)}`;
  const samples = [];  // (time, log records) for events/s
  const summary = el("div", { class: "cards", "data-testid": "summary" });
  const healthBox = el("div", { "data-testid": "health" });
  const lineageBox = el("div", { "data-testid": "lineage" });
  const durations = chartBox("Checkpoint durations by stage (ms)", "chart-durations");
  const durationLegend = el("div");
  durations.box.append(durationLegend);
  const rate = chartBox("Events appended per second", "chart-rate");
  const lagChart = chartBox("Projector lag per partition (records)", "chart-lag");
  const checkpointsBox = el("div", { "data-testid": "checkpoints" });
  const restoresBox = el("div", { "data-testid": "restores" });
  const planBox = el("div", { "data-testid": "plan" });
  const participantsBox = el("div", { "data-testid": "participants" });
  const episodesBox = el("div", { "data-testid": "episodes" });
  const quarantineBox = el("div", { "data-testid": "quarantine" });
  let checkpointsBefore = [];  // stack of `before` cursors for paging back
  let episodesAfter = [null];
  let plan = { restore: null, action: "", search: "", entries: [], shown: PAGE };

  const renderSummary = (info, stats, lag) => {
    const rateNow = samples.length >= 2
      ? (samples[samples.length - 1].records - samples[samples.length - 2].records) /
        Math.max(samples[samples.length - 1].t - samples[samples.length - 2].t, 1e-3)
      : null;
    summary.replaceChildren(
      card("live episodes", "live_episodes", fmt.n(info.counts.live_episodes)),
      card("episodes recorded", "episodes", fmt.n(info.counts.episodes)),
      card("latest checkpoint", "latest_checkpoint_id", info.latest_checkpoint_id ?? "–"),
      card("restores", "restores", fmt.n(info.counts.restores)),
      card("participants", "participants", fmt.n(info.counts.participants)),
      card("log records", "log_records", fmt.n(lag.log_records)),
      card("projector lag", "lag", fmt.n(lag.lag)),
      card("events/s", "events_per_s", rateNow === null ? "–" : rateNow.toFixed(1)),
      card("last checkpoint", "duration_ms_last", fmt.ms(stats.checkpoints.duration_ms_last)));
    lineageBox.replaceChildren(...lineage(run, info));
    const health = info.health || null;
    healthBox.replaceChildren(...(health
      ? [el("p", {}, "Health: ", badge(health.status), health.error ? ` ${health.error}` : "",
        health.since ? el("span", { class: "muted" }, ` since ${fmt.time(health.since)}`) : "",
        health.replica ? el("span", { class: "muted" }, ` (asked replica ${health.replica})`) : ""),
      heldBackTable(health)]
      : [el("p", { class: "muted" }, "Health: not reported by this service.")]));
  };

  const renderCharts = (checkpoints, lag) => {
    const done = checkpoints.filter((c) => Object.keys(c.timings_ms || {}).length).slice().reverse();
    const stages = stagesOf(done);
    drawBars(durations.area, done.map((c) => ({ label: `#${c.checkpoint_id}`, parts: c.timings_ms })), stages, "ms");
    durationLegend.replaceChildren(legend(stages));
    const points = [];
    for (let i = 1; i < samples.length; i++) {
      const dt = Math.max(samples[i].t - samples[i - 1].t, 1e-3);
      points.push({ x: samples[i].t, y: (samples[i].records - samples[i - 1].records) / dt });
    }
    drawLine(rate.area, points, "ev/s");
    drawBars(lagChart.area, lag.partitions.map((p) => ({ label: `p${p.partition}`, parts: { lag: p.lag } })), ["lag"], "rec");
  };

  const renderCheckpoints = (checkpoints, before) => {
    const stages = stagesOf(checkpoints);
    const scale = Math.max(1e-9, ...checkpoints.map((c) => totalMs(c.timings_ms || {})));
    const rows = checkpoints.map((c) => el("tr", { "data-checkpoint": c.checkpoint_id },
      td(c.checkpoint_id, { class: "num" }),
      td(badge(c.status)),
      td(c.trigger || "–"),
      td(fmt.time(c.requested_at)),
      td(field("total_ms", fmt.ms(totalMs(c.timings_ms || {}))), { class: "num" }),
      td(stageBar(c.timings_ms || {}, stages, 0, scale)),
      td(stages.map((s) => `${s} ${fmt.ms((c.timings_ms || {})[s])}`).join(" · "), { class: "muted" }),
      td(field("continue", fmt.n(c.counts.continue)), { class: "num" }),
      td(field("restart", fmt.n(c.counts.restart)), { class: "num" }),
      td(field("finished", fmt.n(c.counts.finished)), { class: "num" }),
      td(fmt.bytes(c.size_bytes), { class: "num" }),
      td(c.reason || "")));
    const next = checkpoints.length === PAGE ? checkpoints[checkpoints.length - 1].checkpoint_id : null;
    checkpointsBox.replaceChildren(
      legend(stages),
      table(["id", "status", "trigger", "requested", { label: "duration", num: true }, "stages", "stage times",
        { label: "continue", num: true }, { label: "restart", num: true }, { label: "finished", num: true },
        { label: "size", num: true }, "reason"], rows.length ? rows : [el("tr", {}, el("td", { colspan: 12, class: "muted" }, "No checkpoints yet."))]),
      el("div", { class: "pager" },
        before !== null ? el("button", { onclick: () => { checkpointsBefore.pop(); refreshCheckpoints(); } }, "← newer") : "",
        next !== null ? el("button", { onclick: () => { checkpointsBefore.push(next); refreshCheckpoints(); } }, "older →") : ""));
  };

  const currentBefore = () => (checkpointsBefore.length ? checkpointsBefore[checkpointsBefore.length - 1] : null);

  const refreshCheckpoints = async () => {
    const before = currentBefore();
    const query = new URLSearchParams({ limit: String(PAGE) });
    if (before !== null) query.set("before", String(before));
    const reply = await api(`${base}/checkpoints?${query}`);
    renderCheckpoints(reply.checkpoints, before);
    return reply.checkpoints;
  };

  const renderPlan = () => {
    if (plan.restore === null) { planBox.replaceChildren(); return; }
    const needle = plan.search.trim();
    const matching = plan.entries.filter((e) => !needle || e.episode.includes(needle));
    const rows = matching.slice(0, plan.shown).map((e) => el("tr", { "data-episode": e.episode },
      td(el("a", { href: `/ui/runs/${enc(run)}/episodes/${enc(e.episode)}` }, e.episode)),
      td(badge(e.action)),
      td(`${e.previous_attempt} → ${e.attempt}`),
      td(e.capture_key),
      td(e.reason || (e.action === "excluded" ? "excluded by the restore request" : ""))));
    planBox.replaceChildren(
      el("h2", {}, `Plan of restore ${plan.restore}`),
      el("div", { class: "toolbar" },
        el("label", {}, "action ",
          el("select", { "data-testid": "plan-action", onchange: (ev) => { plan.action = ev.target.value; loadPlan(plan.restore); } },
            ["", "continue", "restart", "excluded"].map((a) => el("option", { value: a, selected: a === plan.action }, a || "all")))),
        el("label", {}, "episode ",
          el("input", { "data-testid": "plan-search", value: plan.search, placeholder: "search",
            oninput: (ev) => { plan.search = ev.target.value; plan.shown = PAGE; renderPlan(); } })),
        el("span", { class: "muted" }, field("plan_count", fmt.n(matching.length)), " episodes")),
      table(["episode", "action", "attempts", "capture key", "reason"], rows),
      matching.length > plan.shown ? el("button", { onclick: () => { plan.shown += PAGE * 5; renderPlan(); } }, "show more") : "");
  };

  const loadPlan = async (restoreId) => {
    const query = plan.action ? `?action=${plan.action}` : "";
    const reply = await api(`${base}/restores/${restoreId}/episodes${query}`);
    plan = { ...plan, restore: restoreId, entries: reply.episodes, shown: PAGE };
    renderPlan();
  };

  const renderRestores = (restores) => {
    const rows = restores.map((r) => el("tr", { "data-restore": r.restore_id },
      td(r.restore_id, { class: "num" }),
      td(r.checkpoint_id, { class: "num" }),
      td(fmt.time(r.committed_at)),
      td(field("continue", fmt.n(r.counts.continue)), { class: "num" }),
      td(field("restart", fmt.n(r.counts.restart)), { class: "num" }),
      td(field("excluded", fmt.n(r.counts.excluded)), { class: "num" }),
      td(fmt.ms(totalMs(r.timings_ms || {})), { class: "num" }),
      td(el("button", { "data-testid": `show-plan-${r.restore_id}`, onclick: () => { plan.search = ""; plan.action = ""; loadPlan(r.restore_id); } }, "plan"))));
    restoresBox.replaceChildren(table(["id", "checkpoint", "committed", { label: "continue", num: true },
      { label: "restart", num: true }, { label: "excluded", num: true }, { label: "duration", num: true }, ""],
    rows.length ? rows : [el("tr", {}, el("td", { colspan: 8, class: "muted" }, "No restores yet."))]));
  };

  const renderParticipants = (participants) => {
    participantsBox.replaceChildren(table(["id", "kind", { label: "epoch", num: true }, "registered", "last seen"],
      participants.map((p) => el("tr", { "data-participant": p.id }, td(p.id), td(p.kind), td(p.epoch, { class: "num" }),
        td(fmt.time(p.registered_at)), td(fmt.time(p.last_seen_at))))));
  };

  const refreshEpisodes = async () => {
    const after = episodesAfter[episodesAfter.length - 1];
    const query = new URLSearchParams({ limit: String(PAGE) });
    if (after) query.set("after", after);
    const reply = await api(`${base}/episodes?${query}`);
    const rows = reply.episodes.map((e) => el("tr", { "data-episode": e.episode },
      td(el("a", { href: `/ui/runs/${enc(run)}/episodes/${enc(e.episode)}` }, e.episode)),
      td(badge(e.status)), td(e.live ? "live" : ""), td(e.current_attempt, { class: "num" }),
      td(fmt.time(e.started_at)), td(fmt.time(e.finished_at))));
    episodesBox.replaceChildren(
      el("form", { class: "toolbar", onsubmit: (ev) => { ev.preventDefault(); const v = ev.target.elements.episode.value.trim(); if (v) location.href = `/ui/runs/${enc(run)}/episodes/${enc(v)}`; } },
        el("input", { name: "episode", placeholder: "go to episode id" }), el("button", { type: "submit" }, "open")),
      table(["episode", "status", "", { label: "attempt", num: true }, "started", "finished"], rows),
      el("div", { class: "pager" },
        episodesAfter.length > 1 ? el("button", { onclick: () => { episodesAfter.pop(); refreshEpisodes(); } }, "← previous") : "",
        reply.next_after ? el("button", { onclick: () => { episodesAfter.push(reply.next_after); refreshEpisodes(); } }, "next →") : ""));
  };

  const refreshQuarantine = async () => {
    if (!(await hasRoute("/v1/runs/{run}/quarantine"))) {
      quarantineBox.replaceChildren(el("p", { class: "muted" }, "This service does not list quarantined records."));
      return;
    }
    const reply = await api(`${base}/quarantine`);
    quarantineBox.replaceChildren(reply.records.length
      ? table(["partition", "offset", "reason", "size", "first bytes", "recorded"], reply.records.map((q) => el("tr", {},
        td(q.partition, { class: "num" }), td(q.offset, { class: "num" }), td(q.reason), td(fmt.bytes(q.size), { class: "num" }),
        td(el("code", {}, q.first_bytes)), td(fmt.time(q.recorded_at)))))
      : el("p", { class: "muted", "data-field": "quarantined" }, "No quarantined records."));
  };

  const refresh = async () => {
    const [info, stats, lag] = await Promise.all([api(base), api(`${base}/stats`), api(`${base}/projector`)]);
    samples.push({ t: lag.at, records: lag.log_records });
    if (samples.length > 120) samples.shift();
    renderSummary(info, stats, lag);
    const checkpoints = await refreshCheckpoints();
    const latest = currentBefore() === null ? checkpoints : (await api(`${base}/checkpoints?limit=${PAGE}`)).checkpoints;
    renderCharts(latest, lag);
    renderRestores((await api(`${base}/restores?limit=${PAGE}`)).restores);
    renderParticipants((await api(`${base}/participants`)).participants);
  };

  const render = async () => {
    app.replaceChildren(
      el("h1", {}, `Run ${run}`), lineageBox, healthBox, summary,
      el("h2", {}, "Charts"), el("div", { class: "charts" }, durations.box, rate.box, lagChart.box),
      el("h2", {}, "Checkpoints"), checkpointsBox,
      el("h2", {}, "Restores"), restoresBox, planBox,
      el("h2", {}, "Participants"), participantsBox,
      el("h2", {}, "Episodes"), episodesBox,
      el("h2", {}, "Quarantined records"), quarantineBox);
    await refresh();
    await refreshEpisodes();
    await refreshQuarantine();
  };
  return { render, refresh, live: true };
}

// -- one episode ----------------------------------------------------------------------------------

function episodeView(run, episode) {
  crumbs([{ label: "runs", href: "/ui" }, { label: run, href: `/ui/runs/${enc(run)}` }, { label: episode }]);
  const base = `/v1/runs/${enc(run)}/episodes/${enc(episode)}`;
  const payload = el("div", { "data-testid": "payload" });
  let after = [null];

  const showPayload = async (offset) => {
    const reply = await api(`${base}/events/${offset}`);
    payload.replaceChildren(el("h2", {}, `Event at offset ${offset} (partition ${reply.partition})`),
      el("pre", {}, JSON.stringify(reply.event, null, 2)));
    payload.scrollIntoView();
  };

  const render = async () => {
    const cursor = after[after.length - 1];
    const query = new URLSearchParams({ limit: "200" });
    if (cursor !== null) query.set("after", String(cursor));
    const h = await api(`${base}?${query}`);
    const attempts = table(["attempt", "capture key", "began with", "by", "events", "offsets", "why", "resumed from"],
      h.attempts.map((a) => el("tr", { "data-attempt": a.attempt },
        td(a.attempt, { class: "num" }), td(a.capture_key), td(a.began_with || "–"), td(a.started_by || "–"),
        td(field("events", a.events), { class: "num" }),
        td(a.first_offset === null ? "–" : `${a.first_offset}–${a.last_offset}`),
        td(a.why),
        td(a.resumed_from
          ? `cut @${a.resumed_from.cut_offset}; boundary @${a.resumed_from.boundary_offset ?? "–"} (stage ${a.resumed_from.stage ?? "–"}, step ${a.resumed_from.step ?? "–"}, next ${a.resumed_from.next ?? "–"})`
          : "–"))), { "data-testid": "attempts" });
    const checkpoints = table(["checkpoint", "attempt", "action", "cut", "last stage", "size"],
      h.checkpoints.map((c) => el("tr", {}, td(c.checkpoint_id, { class: "num" }), td(c.attempt, { class: "num" }), td(badge(c.action)),
        td(`p${c.cut.partition} @${c.cut.offset}`), td(c.last_stage || "–"), td(fmt.bytes(c.size_bytes), { class: "num" }))),
      { "data-testid": "manifest-entries" });
    const restores = table(["restore", "checkpoint", "action", "attempts", "why"],
      h.restores.map((r) => el("tr", {}, td(r.restore_id, { class: "num" }), td(r.checkpoint_id, { class: "num" }), td(badge(r.action)),
        td(`${r.previous_attempt} → ${r.attempt}`), td(r.explanation))), { "data-testid": "plan-entries" });
    const ledger = h.ledger.length
      ? table(["offset", "attempt", "call", "parent", "tokens (prev → cum)", "policy", "digest"],
        h.ledger.map((l) => el("tr", {}, td(l.offset, { class: "num" }), td(l.attempt, { class: "num" }), td(l.call_id), td(l.parent_call_id || "(root)"),
          td(`${l.prev_len} → ${l.cum_len}`), td(l.policy_version, { class: "num" }), td(el("code", {}, String(l.digest || "").slice(0, 12))))),
        { "data-testid": "ledger" })
      : el("p", { class: "muted", "data-testid": "ledger" }, "No ledger rows.");
    const calls = h.generation_calls.length
      ? table(["call", "attempt", "parent", "chunks", "last start", "offsets", "state"],
        h.generation_calls.map((c) => el("tr", {}, td(c.call_id), td(c.attempt, { class: "num" }), td(c.parent_call_id || "(root)"),
          td(c.chunks, { class: "num" }), td(c.last_start, { class: "num" }), td(`${c.first_offset}–${c.last_offset}`),
          td(c.done ? "done" : "cut in flight"))), { "data-testid": "generation" })
      : el("p", { class: "muted", "data-testid": "generation" }, "No generation chunks.");
    const current = h.current_attempt;
    const events = table(["offset", "attempt", "type", "participant", "step", "stage", "size", "payload", ""],
      h.events.map((e) => el("tr", { "data-offset": e.offset, class: e.attempt < current ? "dead" : null },
        td(e.offset, { class: "num" }), td(e.attempt, { class: "num" }), td(e.type), td(e.participant ? `${e.participant} (${e.kind})` : "–"),
        td(e.step ?? "–"), td(e.stage || e.data.session_id || e.data.call_id || "–"), td(fmt.bytes(e.size_bytes), { class: "num" }),
        td(e.payload_bytes ? fmt.bytes(e.payload_bytes) : "–", { class: "num" }),
        td(el("button", { "data-testid": `event-${e.offset}`, onclick: () => showPayload(e.offset).catch(showError) }, "view")))),
      { "data-testid": "timeline" });
    app.replaceChildren(
      el("h1", {}, `Episode ${episode}`),
      el("div", { class: "cards", "data-testid": "summary" },
        card("status", "status", h.status || "–"),
        card("current attempt", "current_attempt", h.current_attempt),
        card("capture key", "capture_key", h.capture_key),
        card("partition", "partition", h.partition),
        card("events", "event_count", fmt.n(h.event_count))),
      el("h2", {}, "Attempts"), attempts,
      el("h2", {}, "In each checkpoint's manifest"), h.checkpoints.length ? checkpoints : el("p", { class: "muted" }, "In no kept manifest."),
      el("h2", {}, "In each restore's plan"), h.restores.length ? restores : el("p", { class: "muted" }, "In no restore's plan."),
      el("h2", {}, "Ledger lineage"), ledger,
      el("h2", {}, "Generation calls (a call not done at a cut is its generation cut)"), calls,
      el("h2", {}, "Event timeline"), el("p", { class: "muted" }, "Faded rows belong to an attempt a restore replaced."), events,
      el("div", { class: "pager" },
        after.length > 1 ? el("button", { onclick: () => { after.pop(); render().catch(showError); } }, "← earlier") : "",
        h.next_after !== null ? el("button", { onclick: () => { after.push(h.next_after); render().catch(showError); } }, "later →") : ""),
      payload);
  };
  return { render, refresh: render, live: false };
}

// -- start ----------------------------------------------------------------------------------------

document.getElementById("token-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const input = document.getElementById("token");
  if (input.value) sessionStorage.setItem(TOKEN_KEY, input.value);
  input.value = "";
  route();
});
document.getElementById("forget").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  route();
});
route();
