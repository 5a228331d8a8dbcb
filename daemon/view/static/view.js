// codespec view: the page's script. Reads records and status from the daemon's event
// stream (or, in an export, from window.CODESPEC_VIEW) and draws the requests, their time
// bars and the running charts (uPlot). No network access beyond the daemon's own page.
(function () {
  "use strict";

  var SOURCES = ["prefill", "bonus", "ngram:index", "ngram:context", "ngram:prediction",
                 "ngram:recent", "lookahead", "eagle"];
  var LABELS = {
    "prefill": "prefill (target)", "bonus": "bonus (target)", "ngram:index": "index n-gram",
    "ngram:context": "context n-gram", "ngram:prediction": "prediction",
    "ngram:recent": "recent outputs", "lookahead": "lookahead", "eagle": "EAGLE",
    "lookahead:pool": "lookahead (pool)", "lookahead:window": "lookahead (window)",
    "target": "target (no step noted)"
  };
  var COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#db2777", "#0891b2"];
  var SHOWN = 50;  // request cards kept in the DOM
  var STEPS = 300;  // steps in the draft-length chart
  var INDEX_POINTS = 600;  // status samples in the index-size chart
  var INTEGER_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000];

  var state = { records: [], status: null, ring: 200, index: [], dirty: false, charts: [] };

  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function pct(xs, q) {
    if (!xs.length) return 0;
    var s = xs.slice().sort(function (a, b) { return a - b; });
    return s[Math.min(s.length - 1, Math.floor(q * s.length))];
  }

  function ms(x) { return (Math.round(x * 10) / 10) + " ms"; }

  function legend() {
    var box = document.getElementById("legend");
    SOURCES.forEach(function (s) {
      var item = el("span", { "class": "item" });
      item.appendChild(el("span", { "class": "swatch", "data-source": s }));
      item.appendChild(el("span", null, LABELS[s]));
      box.appendChild(item);
    });
    ["queue", "prefill", "draft", "verify", "detokenize"].forEach(function (k) {
      var item = el("span", { "class": "item" });
      item.appendChild(el("span", { "class": "swatch seg-swatch", "style": "background:" +
        getComputedStyle(segProbe(k)).backgroundColor }));
      item.appendChild(el("span", null, "time: " + k));
      box.appendChild(item);
    });
  }

  function segProbe(kind) {
    var probe = document.getElementById("seg-probe-" + kind);
    if (!probe) {
      probe = el("span", { "class": "seg", "data-kind": kind, "id": "seg-probe-" + kind,
                           "style": "display:none" });
      document.body.appendChild(probe);
    }
    return probe;
  }

  // -- one request ------------------------------------------------------------------------
  function tokensOf(rec) {
    var pre = el("pre");
    var lines = rec.prompt_tail.split("\n");
    pre.appendChild(el("span", { "class": "ctx" }, lines.slice(-6).join("\n")));
    pre.appendChild(el("span", { "class": "cursor" }));
    var lastOfStep = {};
    rec.tokens.forEach(function (t, i) { if (t[2] >= 0) lastOfStep[t[2]] = i; });
    rec.tokens.forEach(function (t, i) {
      var span = el("span", { "class": "tok" + (t[3] ? " cut" : ""), "data-source": t[1],
                              "data-step": String(t[2]),
                              "title": LABELS[t[1]] || t[1] }, t[0]);
      pre.appendChild(span);
      var step = t[2] >= 0 && lastOfStep[t[2]] === i ? rec.steps[t[2]] : null;
      if (step && step.rejected) {
        pre.appendChild(el("span", { "class": "rej", "data-step": String(t[2]),
                                     "title": "rejected draft (" + step.source + ")" },
                           step.rejected));
      }
    });
    return pre;
  }

  function barOf(rec) {
    var bar = el("div", { "class": "bar" });
    var total = Math.max(rec.times.final_ms, 0.001);
    rec.bars.forEach(function (b) {
      var left = 100 * b[1] / total, width = 100 * Math.max(0, b[2] - b[1]) / total;
      bar.appendChild(el("span", { "class": "seg", "data-kind": b[0],
        "style": "left:" + left + "%;width:" + width + "%",
        "title": b[0] + " " + ms(b[2] - b[1]) }));
    });
    return bar;
  }

  function card(rec) {
    var shown = rec.tokens.filter(function (t) { return !t[3]; }).length;
    var div = el("div", { "class": "req", "data-seq": String(rec.seq), "data-uri": rec.uri,
                          "data-tokens": String(shown), "data-forwards": String(rec.forwards) });
    var turn = rec.turns[0] || { speculation: rec.requested, max_draft: 0, active: 0 };
    var tpf = rec.forwards ? (shown / rec.forwards).toFixed(2) : "0";
    var head = el("div", { "class": "head" });
    head.appendChild(el("b", null, "#" + rec.seq + " " + rec.kind));
    head.appendChild(document.createTextNode(
      " · " + (rec.uri || "(no document)") + " · " + turn.speculation +
      (turn.max_draft ? " (draft ≤ " + turn.max_draft + ", " + turn.active + " active)" : "") +
      " · " + rec.finish + " · prompt " + rec.prompt_tokens + " tokens (" + rec.cached_tokens +
      " cached) · " + shown + " tokens in " + rec.forwards + " forwards (" + tpf +
      " per forward)"));
    div.appendChild(head);
    div.appendChild(barOf(rec));
    var t = rec.times;
    div.appendChild(el("div", { "class": "times" }, "queue " + ms(t.queue_ms) + " · prefill " +
      ms(t.prefill_ms) + " · first line " + ms(t.first_ms) + " · final " + ms(t.final_ms) +
      (rec.turns.length > 1 ? " · " + rec.turns.length + " turns" : "")));
    div.appendChild(tokensOf(rec));
    return div;
  }

  function drawRequests() {
    var box = document.getElementById("requests");
    var have = {};
    Array.prototype.forEach.call(box.children, function (c) { have[c.dataset.seq] = c; });
    var recent = state.records.slice(-SHOWN).reverse();
    var keep = {};
    recent.forEach(function (rec, i) {
      var node = have[rec.seq] || card(rec);
      keep[rec.seq] = true;
      if (box.children[i] !== node) box.insertBefore(node, box.children[i] || null);
    });
    Object.keys(have).forEach(function (k) { if (!keep[k]) box.removeChild(have[k]); });
  }

  // -- charts -----------------------------------------------------------------------------
  function panel(title, id) {
    var div = el("div", { "class": "chart", "id": id });
    div.appendChild(el("div", { "class": "title" }, title));
    return div;
  }

  function plot(div, xs, series, opts) {
    if (!xs.length) {
      div.appendChild(el("div", { "class": "empty" }, "no data yet"));
      return;
    }
    var width = Math.max(300, div.clientWidth - 10);
    var cfg = {
      width: width, height: 160, legend: { show: true },
      scales: { x: { time: false } },
      axes: [{ label: opts.x || "", incrs: opts.bars ? undefined : INTEGER_STEPS },
             { label: opts.y || "" }],
      series: [{ label: opts.x || "x" }].concat(series.map(function (s, i) {
        var out = { label: s.label, stroke: COLORS[i % COLORS.length], width: 1.5,
                    spanGaps: false, points: { show: xs.length < 60 } };
        if (opts.bars) {
          out.fill = COLORS[i % COLORS.length] + "88";
          out.paths = uPlot.paths.bars({ size: [0.9, 40] });
          out.points = { show: false };
        }
        return out;
      }))
    };
    state.charts.push(new uPlot(cfg, [xs].concat(series.map(function (s) { return s.data; })),
                                div));
  }

  function sourcesDrafted(recs) {
    var seen = {};
    recs.forEach(function (r) { Object.keys(r.drafted).forEach(function (s) { seen[s] = 1; }); });
    return Object.keys(seen).sort();
  }

  function drawCharts() {
    state.charts.forEach(function (c) { c.destroy(); });
    state.charts = [];
    var box = document.getElementById("charts");
    box.textContent = "";
    var recs = state.records, seqs = recs.map(function (r) { return r.seq; });
    var st = state.status || {};
    var spec = st.speculation || {};

    var p1 = panel("Tokens per forward", "chart-tpf");
    box.appendChild(p1);
    plot(p1, seqs, [{ label: "tokens / forward", data: recs.map(function (r) {
      var n = r.tokens.filter(function (t) { return !t[3]; }).length;
      return r.forwards ? n / r.forwards : null; }) }], { x: "request" });

    var srcs = sourcesDrafted(recs);
    var p2 = panel("Acceptance by proposer (accepted / drafted)", "chart-acceptance");
    box.appendChild(p2);
    plot(p2, srcs.length ? seqs : [], srcs.map(function (s) {
      return { label: LABELS[s] || s, data: recs.map(function (r) {
        var d = r.drafted[s] || 0;
        return d ? (r.accepted[s] || 0) / d : null; }) };
    }), { x: "request" });

    var steps = [];
    recs.forEach(function (r) { r.steps.forEach(function (s) { steps.push(s); }); });
    steps = steps.slice(-STEPS);
    var last = steps.length ? steps[steps.length - 1] : null;
    var p3 = panel("Policy: draft length per step; in charge now: " +
                   (last ? (last.choice || last.source) : "—"), "chart-policy");
    box.appendChild(p3);
    plot(p3, steps.map(function (_, i) { return i; }), [
      { label: "draft nodes", data: steps.map(function (s) { return s.nodes; }) },
      { label: "accepted", data: steps.map(function (s) { return s.accepted; }) }
    ], { x: "step" });

    var p4 = panel("Load back-off: drafts shorten at " + (spec.shorten_at || "?") +
                   " active, stop at " + (spec.off_at || "?") + "; now " +
                   (st.in_flight || 0) + " in flight", "chart-backoff");
    box.appendChild(p4);
    plot(p4, seqs, [
      { label: "active requests", data: recs.map(function (r) { return (r.turns[0] || {}).active || 0; }) },
      { label: "max draft", data: recs.map(function (r) { return (r.turns[0] || {}).max_draft || 0; }) }
    ], { x: "request" });

    drawLatency(box, recs);
    drawCache(box, recs, seqs, st);
    drawIndex(box, st);
  }

  function drawLatency(box, recs) {
    var comp = recs.filter(function (r) { return r.kind === "complete"; });
    var firsts = (comp.length ? comp : recs).map(function (r) { return r.times.first_ms; });
    var p = panel("Typing latency: first line p50 " + ms(pct(firsts, 0.5)) + ", p99 " +
                  ms(pct(firsts, 0.99)) + " (" + firsts.length + " requests)", "chart-latency");
    box.appendChild(p);
    var top = Math.max.apply(null, firsts.concat([1])), bins = 20, w = top / bins;
    var xs = [], counts = [];
    for (var i = 0; i < bins; i++) { xs.push(Math.round((i + 0.5) * w)); counts.push(0); }
    firsts.forEach(function (f) { counts[Math.min(bins - 1, Math.floor(f / w))] += 1; });
    plot(p, firsts.length ? xs : [], [{ label: "requests", data: counts }],
         { x: "first line, ms", bars: true });
  }

  function drawCache(box, recs, seqs, st) {
    var hits = recs.filter(function (r) { return r.cached_tokens > 0; }).length;
    var p = panel("KV slots (" + (st.kv_slots || "?") + "): hit " + hits + " / miss " +
                  (recs.length - hits), "chart-kv");
    p.dataset.hits = String(hits);
    p.dataset.misses = String(recs.length - hits);
    box.appendChild(p);
    plot(p, seqs, [
      { label: "prompt tokens", data: recs.map(function (r) { return r.prompt_tokens; }) },
      { label: "cached", data: recs.map(function (r) { return r.cached_tokens; }) }
    ], { x: "request" });
  }

  function drawIndex(box, st) {
    var idx = st.index || { documents: 0, tokens: 0, bytes: 0 };
    var p = panel("Index: " + idx.documents + " documents, " + idx.tokens + " tokens, " +
                  (idx.bytes / 1e6).toFixed(1) + " MB", "chart-index");
    box.appendChild(p);
    var t0 = state.index.length ? state.index[0][0] : 0;
    plot(p, state.index.map(function (x) { return Math.round(x[0] - t0); }),
         [{ label: "tokens", data: state.index.map(function (x) { return x[1]; }) }],
         { x: "seconds" });
  }

  function drawSummary() {
    var st = state.status;
    if (!st) return;
    document.getElementById("summary").textContent = (st.model || "") + " · " + st.served +
      " served · " + st.in_flight + " in flight · " + state.records.length + " recorded (ring " +
      state.ring + ")";
  }

  function render() {
    state.dirty = false;
    drawSummary();
    drawRequests();
    drawCharts();
    document.body.dataset.records = String(state.records.length);
  }

  function add(data) {
    if (data.ring) state.ring = data.ring;
    if (data.reset) state.records = [];  // a (re)connected stream starts with every record
    (data.records || []).forEach(function (r) { state.records.push(r); });
    if (state.records.length > state.ring) state.records.splice(0, state.records.length - state.ring);
    if (data.status) {
      state.status = data.status;
      state.index.push([data.status.time, data.status.index.tokens]);
      if (state.index.length > INDEX_POINTS) state.index.shift();
    }
    if (!state.dirty) {
      state.dirty = true;
      setTimeout(render, 100);  // one redraw for a burst of messages
    }
  }

  legend();
  var conn = document.getElementById("conn");
  if (window.CODESPEC_VIEW) {
    conn.textContent = "export";
    document.body.dataset.mode = "export";
    add(window.CODESPEC_VIEW);
    render();  // at once: a screenshot or a print of the file needs no timer to run first
  } else {
    var es = new EventSource("events");
    es.onopen = function () { conn.textContent = "live"; conn.className = "live"; };
    es.onerror = function () { conn.textContent = "disconnected (retrying)"; conn.className = "lost"; };
    es.onmessage = function (e) { add(JSON.parse(e.data)); };
  }
})();
