// EdgeCache live pages: draws the server-built Plotly figures and extends them as runs
// arrive over the WebSocket (static/js/site.js dispatches each event as "edgecache:live"),
// without reloading. Traces are found by name. DOM is built with textContent, never innerHTML.
(function () {
  "use strict";
  const dataNode = document.getElementById("chart-data");
  const charts = dataNode ? JSON.parse(dataNode.textContent || "{}") || {} : {};
  const WINDOW = charts.window || 200;
  // The labels of a run's stacked parts in order (table 3's groups, then "other"), from the page
  // (dashboard.pages.charts.COMPONENTS); each run brings its values (run.time_sums, rounded as shown).
  const stackNode = document.getElementById("chart-stack");
  const STACK = stackNode ? JSON.parse(stackNode.textContent || "[]") : [];
  function partsOf(run, which) {
    const sum = (run.time_sums || {})[which] || { parts: [] };
    return STACK.map((label) => { const part = sum.parts.find((p) => p.label === label); return part ? part.ms : 0; });
  }
  // Per device: its runs and hits by tier in the range; the hit-ratio chart's tiers (the server's words).
  const tierCounts = charts.tierCounts || {};
  const HIT_TIERS = charts.hitTiers || [];
  // The toolbar shows on hover only, above the plot area (titles sit below it: see fitLayout).
  const config = { responsive: true, displaylogo: false, displayModeBar: "hover" };

  // -- small DOM helpers ---------------------------------------------------------------------------
  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (key) {
      if (key === "class") node.className = attrs[key];
      else if (key === "text") node.textContent = attrs[key] == null ? "" : String(attrs[key]);
      else if (key.slice(0, 5) === "data-") node.dataset[key.slice(5).replace(/-([a-z])/g, (_, c) => c.toUpperCase())] = attrs[key];
      else node.setAttribute(key, attrs[key]);
    });
    (children || []).forEach(function (child) {
      if (child == null) return;
      node.appendChild(typeof child === "string" ? document.createTextNode(child) : child);
    });
    return node;
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
  function fmt(ms) { return (Number(ms) || 0).toFixed(1); }
  function show(value) { return value == null ? "" : String(value); }
  function truncate(value, n) { value = show(value); return value.length > n ? value.slice(0, n - 1) + "…" : value; }
  function errorText(run) { return run.error_message || run.error || ""; }

  // -- charts: titles wrapped to the width they get, below the hover toolbar ------------------------
  function wrap(text, perLine) {
    const words = String(text).split(" ");
    const lines = [];
    let line = "";
    words.forEach(function (word) {
      if (line && (line + " " + word).length > perLine) { lines.push(line); line = word; } else { line = line ? line + " " + word : word; }
    });
    if (line) lines.push(line);
    return lines;
  }
  // Titles and legends get room of their own, at any width: the title sits at the top of the
  // chart (below the hover toolbar), wrapped, and the chart grows by its extra lines; a horizontal
  // legend sits at the bottom, below the x-axis title, and the chart grows by its height (measured
  // once drawn: fitLegend). The plot area keeps its height instead of being squeezed.
  const TOOLBAR_PX = 40; // the hover toolbar (about 25 px) and a gap: titles start below it
  const AXIS_PX = 52; // tick labels and the x-axis title, below the plot
  function fitLayout(node, layout) {
    layout = Object.assign({}, layout);
    const width = node.clientWidth || 600;
    if (width < 520) {
      layout.margin = Object.assign({}, layout.margin, { l: 45, r: 10 });
      layout.legend = Object.assign({}, layout.legend, { font: { size: 10 } });
    }
    const base = layout.height || 320;
    let extra = 0;
    const title = layout.title && typeof layout.title === "object" ? Object.assign({}, layout.title) : null;
    if (title && title.text) {
      const size = width < 520 ? 12 : (title.font && title.font.size) || 14;
      const usable = width - ((layout.margin && layout.margin.l) || 55) - 10; // the title starts at the plot's left edge
      const lines = wrap(title.text.replace(/<br>/g, " "), Math.max(16, Math.floor(usable / (size * 0.6))));
      const lineHeight = Math.round(size * 1.35);
      title.text = lines.join("<br>");
      title.font = Object.assign({}, title.font, { size: size });
      Object.assign(title, { yref: "container", y: 1, yanchor: "top", pad: { t: TOOLBAR_PX, b: 0, l: 0, r: 0 } });
      layout.title = title;
      layout.margin = Object.assign({}, layout.margin, { t: TOOLBAR_PX + lines.length * lineHeight + 12 });
      extra += (lines.length - 1) * lineHeight;
    }
    const legend = layout.legend || {};
    if (legend.orientation === "h") {
      const height = parseFloat(node.dataset.legendHeight || "0") || 0; // measured on the last drawing
      layout.legend = Object.assign({}, legend, { yref: "container", y: 0, yanchor: "bottom", x: 0, xanchor: "left" });
      layout.margin = Object.assign({}, layout.margin, { b: AXIS_PX + height + 8 });
      extra += height;
    }
    layout.height = base + extra;
    node.dataset.baseHeight = String(base);
    if (window.matchMedia && window.matchMedia("(prefers-color-scheme: dark)").matches) {
      const grid = { gridcolor: "#2c3344", zerolinecolor: "#344054", linecolor: "#344054" };
      layout.paper_bgcolor = "rgba(0,0,0,0)";
      layout.plot_bgcolor = "rgba(0,0,0,0)";
      layout.font = Object.assign({}, layout.font, { color: "#e4e7ec" });
      layout.xaxis = Object.assign({}, layout.xaxis, grid);
      layout.yaxis = Object.assign({}, layout.yaxis, grid);
    }
    return layout;
  }
  // Once drawn, the legend's real height: drawn again with room for it when the guess was off.
  function fitLegend(node, layout) {
    const full = node && node._fullLayout;
    if (!full || !full.legend || full.legend.orientation !== "h" || !full.showlegend) return;
    const measured = Math.ceil(full.legend._height || 0);
    const guessed = parseFloat(node.dataset.legendHeight || "0") || 0;
    if (Math.abs(measured - guessed) <= 2) return;
    node.dataset.legendHeight = String(measured);
    Plotly.relayout(node, { "margin.b": AXIS_PX + measured + 8, height: full.height + measured - guessed });
  }
  function plot(node, fig, fresh) {
    const layout = fitLayout(node, fig.layout);
    return (fresh ? Plotly.newPlot : Plotly.react)(node, fig.data, layout, config).then(() => fitLegend(node, layout));
  }
  function draw(id, fig) {
    const node = document.getElementById(id);
    if (node && fig && window.Plotly) plot(node, fig, true);
    return node;
  }
  const elBreakdown = draw("chart-breakdown", charts.breakdown);
  const elTimeline = draw("chart-timeline", charts.timeline);
  const elTbt = draw("chart-tbt", charts.tbt);
  const elHits = draw("chart-hits", charts.hits);
  const elBytes = draw("chart-bytes", charts.bytes);
  const elBreakeven = draw("chart-breakeven", charts.breakeven);
  // Pages of fixed figures (the Lab page): each chart names its figure in charts.figures.
  document.querySelectorAll(".chart[data-figure]").forEach((node) => draw(node.id, (charts.figures || {})[node.dataset.figure]));

  function traceIndex(node, name, template) {
    let index = node.data.findIndex((trace) => trace.name === name);
    if (index < 0) {
      Plotly.addTraces(node, Object.assign({ name: name, x: [], y: [] }, template));
      index = node.data.length - 1;
    }
    return index;
  }
  // A chart drawn empty ("No runs in this time range yet", no axes) gets its axes at its first point.
  function notEmpty(node) {
    if (node && node.layout && node.layout.meta && node.layout.meta.empty) {
      Plotly.relayout(node, { "xaxis.visible": true, "yaxis.visible": true, annotations: [], meta: {} });
    }
  }

  // -- one colour per device on every chart (the server's choice; a new device takes a free one) ---
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  const colors = charts.colors || {};
  function colorOf(device, given) {
    if (!colors[device]) {
      const used = Object.values(colors);
      colors[device] = given || PALETTE.find((c) => used.indexOf(c) < 0) || PALETTE[used.length % PALETTE.length];
    }
    return colors[device];
  }

  // -- each chart's data as CSV or JSON: the points it draws (live ones too), not a picture ------
  function chartRows(node) {
    const rows = [];
    (node.data || []).forEach(function (trace) {
      const xs = trace.x || [], ys = trace.y || [];
      if (trace.z) { // a heatmap: one row per cell, its row's label as the series
        ys.forEach((label, i) => xs.forEach((x, j) => rows.push({ series: label, x: x, y: (trace.z[i] || [])[j] })));
        return;
      }
      for (let i = 0; i < xs.length; i++) rows.push({ series: trace.name, x: xs[i], y: ys[i] });
    });
    return rows;
  }
  function csvCell(value) {
    let text = value == null ? "" : String(value);
    if (/^[=+\-@\t\r]/.test(text)) text = "'" + text; // a spreadsheet shows it, never runs it
    return /[",\n]/.test(text) ? '"' + text.replace(/"/g, '""') + '"' : text;
  }
  function download(name, type, body) {
    const link = el("a", { href: URL.createObjectURL(new Blob([body], { type: type })), download: name });
    document.body.appendChild(link);
    link.click();
    setTimeout(function () { URL.revokeObjectURL(link.href); link.remove(); }, 1000);
  }
  function chartFileName(node, ext) {
    const range = charts.range ? "-" + charts.range : "";
    return "edgecache-" + (node.dataset.title || node.id) + range + "." + ext;
  }
  document.querySelectorAll(".chart").forEach(function (node) {
    if (!node.id) return;
    const csv = el("button", { type: "button", class: "secondary small", id: node.id + "-csv", text: "CSV" });
    const json = el("button", { type: "button", class: "secondary small", id: node.id + "-json", text: "JSON" });
    csv.addEventListener("click", function () {
      const lines = ["series,x,y"].concat(chartRows(node).map((r) => [r.series, r.x, r.y].map(csvCell).join(",")));
      download(chartFileName(node, "csv"), "text/csv", lines.join("\n") + "\n");
    });
    json.addEventListener("click", function () {
      const title = node.layout && node.layout.title ? String(node.layout.title.text || "").replace(/<br>/g, " ") : "";
      download(chartFileName(node, "json"), "application/json", JSON.stringify({ chart: node.dataset.title || node.id, title: title, range: charts.range || null, points: chartRows(node) }, null, 1));
    });
    node.parentNode.insertBefore(el("div", { class: "chart-tools muted small" }, ["data: ", csv, " ", json]), node.nextSibling);
  });

  // -- time range and pause (the dashboard): figures from the server, downsampled there -----------
  const controls = document.getElementById("chart-controls");
  let paused = false, missed = 0;
  function chartStatus(text) { const node = document.getElementById("chart-status"); if (node) node.textContent = text; }
  // A count of runs as the server says it (dashboard.pages.stats.runs_label): "38 runs (3 failed, 1 cancelled)".
  function runsLabel(c) {
    const total = Number(c.runs) || 0;
    const ended = ["failed", "cancelled"].filter((k) => c[k]).map((k) => c[k] + " " + k);
    return total + (total === 1 ? " run" : " runs") + (ended.length ? " (" + ended.join(", ") + ")" : "");
  }
  // The line beside Pause, as the server writes it (dashboard.views.home.chart_status).
  function describe(data) {
    const c = data.counts || { runs: data.runs, answered: data.runs };
    let text = runsLabel(c) + (data.rangeWords ? " " + data.rangeWords : "");
    if (c.failed || c.cancelled) text += "; the charts draw the " + (c.answered || 0) + " answered";
    if (data.granularity && data.granularity !== "run") text += ", averaged per " + data.granularity;
    if (data.devices_drawn < data.devices_ran) text += "; the " + data.devices_drawn + " busiest of " + data.devices_ran + " boards drawn";
    return text;
  }
  function redraw(node, fig) { if (node && fig) plot(node, fig, false); }
  function loadRange(range) {
    if (!controls) return Promise.resolve();
    chartStatus("loading…");
    return fetch(controls.dataset.url + "?range=" + encodeURIComponent(range), { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then((r) => r.json())
      .then(function (data) {
        ["range", "runs", "counts", "rangeWords", "granularity", "devices_drawn", "devices_ran"].forEach((key) => { charts[key] = data[key]; });
        Object.keys(tierCounts).forEach((k) => delete tierCounts[k]);
        Object.assign(tierCounts, data.tierCounts || {});
        Object.assign(colors, data.colors || {});
        redraw(elBreakdown, data.breakdown); redraw(elTimeline, data.timeline); redraw(elTbt, data.tbt);
        redraw(elHits, data.hits); redraw(elBytes, data.bytes);
        controls.querySelectorAll("[data-range]").forEach(function (button) {
          const on = button.dataset.range === data.range;
          button.classList.toggle("active", on);
          button.setAttribute("aria-pressed", String(on));
        });
        const url = new URL(window.location.href);
        url.searchParams.set("range", data.range);
        window.history.replaceState(null, "", url);
        chartStatus(describe(data));
      })
      .catch(function (err) { chartStatus("could not load the charts: " + err); });
  }
  if (controls) {
    controls.querySelectorAll("[data-range]").forEach(function (button) {
      button.addEventListener("click", function () { loadRange(button.dataset.range); });
    });
    const pause = document.getElementById("chart-pause");
    pause.addEventListener("click", function () {
      paused = !paused;
      pause.textContent = paused ? "Resume" : "Pause";
      pause.setAttribute("aria-pressed", String(paused));
      document.body.classList.toggle("charts-paused", paused);
      if (paused) { missed = 0; chartStatus("paused: the charts hold still"); }
      else loadRange(charts.range || "24h"); // catch up with what arrived meanwhile
    });
  }

  // -- runs tables ---------------------------------------------------------------------------------
  function runRow(run) {
    const b = run.breakdown || {};
    // As the server writes it (H:i:s, its time zone), not the browser's locale ("8:15:56 PM").
    const when = window.EdgeCache && window.EdgeCache.clock ? window.EdgeCache.clock(run.created) : show(run.created).slice(11, 19);
    // A cancelled run was served in part: its times were measured, and shown (no failure).
    const failed = run.error && !run.cancelled;
    const answer = run.cancelled
      ? el("span", {}, [el("span", { class: "badge cancelled", text: "cancelled" }), " " + truncate(run.text || "", 40)])
      : failed
        ? el("span", { class: "error", title: show(run.error), text: truncate(errorText(run), 200) })
        : document.createTextNode(truncate(run.text || "", 40));
    const whenCell = run.url ? el("a", { href: run.url, text: when }) : document.createTextNode(when);
    return el("tr", { "data-request": show(run.request_id), class: run.cancelled ? "cancelled" : failed ? "failed" : "" }, [
      el("td", {}, [whenCell]),
      el("td", { text: run.device }),
      el("td", { text: truncate(run.title, 50) }),
      el("td", {}, [answer]),
      el("td", { text: failed ? "" : b.case }),
      el("td", { text: failed ? "–" : show(b.matched_tokens) + "/" + show(b.prompt_tokens) }),
      el("td", { text: failed ? "–" : fmt(b.ttft_ms) }),
      el("td", { text: failed ? "–" : fmt(b.ttlt_ms) }),
      el("td", { text: failed ? "" : run.served_from_label }),
    ]);
  }

  // -- device cards and rows: runs, hit ratio, median TTFT ----------------------------------------
  function updateFigures(name, figures) {
    if (!figures) return;
    document.querySelectorAll("[data-device]").forEach(function (holder) {
      if (holder.dataset.device !== name) return;
      const runs = holder.querySelector('[data-role="runs"]');
      if (runs) runs.textContent = figures.runs_label || runsLabel(figures); // the server's words (dashboard.pages.stats.runs_label)
      const hits = holder.querySelector('[data-role="hit-ratio"]');
      if (hits) hits.textContent = figures.hit_ratio == null ? "–" : Number(figures.hit_ratio).toFixed(2);
      const ttft = holder.querySelector('[data-role="median-ttft"]');
      if (ttft) ttft.textContent = figures.median_ttft_ms == null ? "–" : Math.round(figures.median_ttft_ms) + " ms";
    });
  }

  function onRun(run) {
    const b = run.breakdown || {};
    const label = run.device + " #" + run.id;
    if (paused) {
      missed += 1;
      chartStatus("paused: " + missed + (missed === 1 ? " new run" : " new runs") + " not drawn yet");
    }
    if (!paused && controls && charts.counts) {
      // The count beside Pause follows the runs as they arrive, failed and cancelled ones counted
      // as the cards count them (a bucketed range counts runs too).
      const outcome = !run.error ? "answered" : run.cancelled ? "cancelled" : "failed";
      charts.counts.runs += 1;
      charts.counts[outcome] = (charts.counts[outcome] || 0) + 1;
      if (!run.error) charts.runs += 1;
      chartStatus(describe(charts));
    }
    if (!run.error && !paused) {
      if (elBreakdown && elBreakdown.data) {
        const parts = partsOf(run, "ttlt");
        Plotly.extendTraces(elBreakdown, { x: STACK.map(() => [label]), y: parts.map((ms) => [ms]) }, STACK.map((_, i) => i), 50);
        notEmpty(elBreakdown);
      }
      const color = colorOf(run.device, run.device_color);
      if (elTimeline && elTimeline.data) {
        const ttft = traceIndex(elTimeline, run.device + " TTFT", { mode: "lines+markers", line: { color: color } });
        const ttlt = traceIndex(elTimeline, run.device + " TTLT", { mode: "lines+markers", line: { dash: "dot", color: color } });
        Plotly.extendTraces(elTimeline, { x: [[run.created], [run.created]], y: [[b.ttft_ms], [b.ttlt_ms]] }, [ttft, ttlt], WINDOW);
        notEmpty(elTimeline);
      }
      if (elTbt && elTbt.data && b.tbt_p50_ms > 0) {
        const p50 = traceIndex(elTbt, run.device + " TBT p50", { mode: "lines+markers", line: { color: color } });
        const p99 = traceIndex(elTbt, run.device + " TBT p99", { mode: "lines+markers", line: { dash: "dot", color: color } });
        Plotly.extendTraces(elTbt, { x: [[run.created], [run.created]], y: [[b.tbt_p50_ms], [b.tbt_p99_ms]] }, [p50, p99], WINDOW);
        notEmpty(elTbt);
      }
      if (elHits && elHits.data && HIT_TIERS.length) {
        // Every run moves each of its device's tier lines (the share of its runs each tier served).
        const counts = tierCounts[run.device] || (tierCounts[run.device] = { runs: 0 });
        counts.runs += 1;
        if (run.hit_tier) counts[run.hit_tier] = (counts[run.hit_tier] || 0) + 1;
        const indices = HIT_TIERS.map((t) => traceIndex(elHits, run.device + " " + t.label, {
          mode: "lines+markers", line: { color: color, dash: t.dash }, legendgroup: run.device, hovertemplate: t.hovertemplate,
        }));
        Plotly.extendTraces(elHits, { x: HIT_TIERS.map(() => [run.created]), y: HIT_TIERS.map((t) => [(counts[t.tier] || 0) / counts.runs]) }, indices, WINDOW);
        notEmpty(elHits);
      }
      if (elBytes && elBytes.data) {
        const i = traceIndex(elBytes, run.device, { mode: "markers", marker: { color: color } });
        Plotly.extendTraces(elBytes, { x: [[run.created]], y: [[(b.state_bytes || 0) / 1e6]] }, [i], WINDOW);
        notEmpty(elBytes);
      }
      if (elBreakeven && document.body.dataset.device === run.device) refreshBreakeven();
    }
    updateFigures(run.device, run.device_figures);
    const body = document.getElementById("runs-body");
    if (body && (!document.body.dataset.device || document.body.dataset.device === run.device)) {
      const empty = body.querySelector("tr.empty");
      if (empty) body.removeChild(empty);
      body.insertBefore(runRow(run), body.firstChild);
      while (body.children.length > 20) body.removeChild(body.lastChild);
    }
    const card = document.querySelector('#answers [data-request="' + run.request_id + '"]');
    if (card) fillAnswer(card, run);
    else remember(run);
  }

  // A board can answer (an error, at once) before the page has its card: kept a little while.
  const early = new Map();
  function remember(run) {
    if (!run.request_id) return;
    early.set(run.request_id, run);
    if (early.size > 100) early.delete(early.keys().next().value);
  }

  let breakevenTimer = null;
  function refreshBreakeven() {
    if (breakevenTimer) return;
    breakevenTimer = setTimeout(function () {
      breakevenTimer = null;
      fetch(document.body.dataset.breakevenUrl, { credentials: "same-origin" })
        .then((r) => r.json())
        .then(function (fig) {
          plot(elBreakeven, fig, false);
          const verdict = document.getElementById("breakeven-verdict");
          if (verdict && fig.verdict) verdict.textContent = fig.verdict;
        });
    }, 500);
  }

  // A device the page did not list yet (registered meanwhile): a card on the dashboard.
  function onDevice(device) {
    const grid = document.getElementById("device-cards");
    if (!grid || !device.name || grid.dataset.full) return;  // a large fleet: the page shows counts, not a card each
    const known = Array.from(grid.querySelectorAll("[data-device]")).some((card) => card.dataset.device === device.name);
    if (known) return;
    const state = window.EdgeCache ? window.EdgeCache.deviceState(device) : ["offline", "offline"];
    const placeholder = grid.querySelector(".no-devices");
    if (placeholder) grid.removeChild(placeholder);
    grid.appendChild(el("a", { class: "card device-card", href: "/devices/" + encodeURIComponent(device.name) + "/", "data-device": device.name, "data-status": state[0] }, [
      el("h3", {}, [device.name + " ", el("span", { class: "badge " + (state[0] === "online" ? "ok" : "off"), "data-role": "online", text: state[1] })]),
      el("p", { class: "muted", text: show(device.link) }),
      el("p", {}, [el("span", { "data-role": "runs", text: "0 runs" }), " · hit ratio ", el("span", { "data-role": "hit-ratio", text: "–" }),
        " · median TTFT ", el("span", { "data-role": "median-ttft", text: "–" })]),
    ]));
  }

  // -- answer cards on the Run page ----------------------------------------------------------------
  const STAGES = {
    queued: "queued: waiting for the board…",
    started: "on the board: looking up the cache…",
    fetching: "fetching: cached ranges loading from the cache box…",
    prefilling: "prefilling: computing the prompt's uncached tokens…",
    decoding: "decoding: tokens as they are chosen",
    finishing: "answered: recording the run…",
    cancelling: "cancelling: the board stops at its next token…",
    waiting: "waiting: its board went quiet…",
    "cancel-failed": "could not cancel",
  };
  function setStage(card, stage, words) {
    card.dataset.stage = stage;
    const node = card.querySelector('[data-role="stage"]');
    if (node) node.textContent = words || STAGES[stage] || stage;
    if (stage === "finishing") {
      const button = card.querySelector(".cancel-run");
      if (button) button.remove();
    }
  }
  function stopCard(card) {
    if (card._hintTimer) clearTimeout(card._hintTimer);
    if (card._elapsedTimer) clearInterval(card._elapsedTimer);
  }
  // A response of JSON lines, each handed to ``each`` as it arrives.
  function readLines(response, each) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    function pump() {
      return reader.read().then(function (chunk) {
        buffer += decoder.decode(chunk.value || new Uint8Array(), { stream: !chunk.done });
        let end;
        while ((end = buffer.indexOf("\n")) >= 0) {
          const text = buffer.slice(0, end);
          buffer = buffer.slice(end + 1);
          if (text.trim()) { try { each(JSON.parse(text)); } catch (err) { /* a line cut by a dropped connection */ } }
        }
        return chunk.done ? null : pump();
      });
    }
    return pump();
  }

  function fillAnswer(card, run) {
    const b = run.breakdown || {};
    const x = run.explanation || {};
    stopCard(card);
    card.classList.remove("pending");
    card.classList.add(run.error && !run.cancelled ? "failed" : "done");
    clear(card);
    card.appendChild(el("h3", {}, [run.device + " ", run.url ? el("a", { href: run.url, class: "muted small", text: "run #" + run.id }) : null]));
    if (run.title) card.appendChild(el("p", { class: "muted prompt-title", text: "answers: " + run.title }));
    if (typeof onChatRecord === "function") onChatRecord(run);
    const moved = b.resent_from;
    if (moved && moved.from) {
      // Its first board went quiet mid-answer: this board went on from the tokens already shown.
      card.appendChild(el("p", { class: "moved-note", text: "board changed: " + moved.from + " stopped answering; " + run.device + " went on" +
        (b.continued_tokens ? " from its " + show(b.continued_tokens) + " token" + (b.continued_tokens === 1 ? "" : "s") : "") }));
    }
    if (run.error && !run.cancelled) {
      card.appendChild(el("p", { class: "error", title: show(run.error), text: errorText(run) }));
      // A run given up on keeps what was answered before its board went quiet.
      if (run.text) card.appendChild(el("p", { class: "answer partial", text: run.text }));
      return;
    }
    if (run.cancelled) {
      // Cancel keeps what was answered: the partial answer, marked.
      card.classList.add("cancelled");
      card.appendChild(el("p", { class: "cancelled-note" }, [el("span", { class: "badge cancelled", text: "cancelled" }),
        " " + show(b.generated_tokens) + " token" + (b.generated_tokens === 1 ? "" : "s") + " answered before the board stopped" +
          (b.ttft_ms > 0 ? " · TTFT " + fmt(b.ttft_ms) + " ms" : "")]));
      card.appendChild(el("p", { class: "answer", text: run.text }));
      return;
    }
    card.appendChild(el("p", { class: "answer", text: run.text }));
    if (x.verdict) card.appendChild(el("p", { class: "verdict " + (x.right === true ? "right" : x.right === false ? "wrong" : ""), text: x.verdict }));
    card.appendChild(el("p", {}, [
      el("strong", { text: b.case }),
      // Where the prompt came from, in the server's words (the board's context, its RAM tier, the cache box, computed).
      ": " + show(run.served_from) + (b.cachebox && b.cachebox !== "ok" ? " (cache box " + show(b.cachebox) + ")" : "") +
        " · TTFT " + fmt(b.ttft_ms) + " ms · TTLT " + fmt(b.ttlt_ms) + " ms" +
        (b.tbt_p50_ms > 0 ? " · between tokens p50 " + fmt(b.tbt_p50_ms) + " ms, p99 " + fmt(b.tbt_p99_ms) + " ms" : ""),
    ]));
    (x.why || []).forEach((sentence) => card.appendChild(el("p", { class: "why", text: sentence })));
    if (Array.isArray(b.modules_hit)) {
      // A schema run: its modules came from the cache box, the text around them was computed.
      const modules = b.modules_hit.length ? " (modules " + b.modules_hit.join(", ") + " from the cache box)" : " (no module from the cache box)";
      card.appendChild(el("p", { class: "matched", text: "matched " + show(b.matched_tokens) + " of " + show(b.prompt_tokens) + " prompt tokens" + modules }));
    }
    // TTFT and TTLT as the sums they are, in the server's words (inference.serving.breakdown.time_sums).
    ["ttft", "ttlt"].forEach(function (which) {
      const sum = (run.time_sums || {})[which];
      if (sum) card.appendChild(el("p", { class: "muted time-sum", "data-sum": which, text: sum.sentence + " (ms)" }));
    });
    if (run.expected_answer && !x.verdict) card.appendChild(el("p", { text: "expected answer: " + run.expected_answer }));
  }

  // A field's name as the page shows it (its label: "Max tokens", not max_tokens).
  function fieldLabel(name) {
    const label = document.querySelector('label[for="id_' + name + '"]');
    const text = label ? label.textContent.trim().replace(/:$/, "") : "";
    if (text) return text;
    // A group of boxes (devices): the label just before it (Django's as_p puts it in a paragraph of
    // its own: a <div> may not sit in a <p>), or its fieldset's legend.
    const field = document.getElementById("id_" + name);
    const before = field && field.previousElementSibling;
    const caption = (before && (before.matches("label") ? before : before.querySelector("label:not([for])"))) ||
      (field && field.closest("fieldset") && field.closest("fieldset").querySelector("legend"));
    return caption && caption.textContent.trim() ? caption.textContent.trim().replace(/:$/, "") : name.replace(/_/g, " ");
  }

  function errorsText(errors) {
    return Object.keys(errors || {})
      .map((k) => (k === "__all__" ? "" : fieldLabel(k) + ": ") + errors[k].map((e) => e.message).join(" "))
      .join(" · ");
  }

  // The run form: send with fetch, then wait for each device's answer on the socket.
  const form = document.getElementById("run-form");
  let onChatRecord = null; // the chat's hook for a run's record (set below on the Run page)
  if (form) {
    const sources = form.querySelectorAll('input[name="source"]');
    function showSource() {
      const chosen = (form.querySelector('input[name="source"]:checked') || {}).value || "chat";
      form.querySelectorAll("[data-source]").forEach((div) => { div.hidden = div.dataset.source !== chosen; });
    }
    sources.forEach((radio) => radio.addEventListener("change", showSource));
    showSource();
    const feedback = document.getElementById("run-feedback");
    const warning = document.getElementById("run-offline-warning");
    const answers = document.getElementById("answers");
    const expires = parseInt(form.dataset.taskExpires || "600", 10);
    // How a board is started (dashboard/pages/board_start.py): the page gives what comes before --name
    // (for staff, with the cache box's address as other machines reach it).
    const startPrefix = (answers && answers.dataset.startPrefix) || ".venv-board/bin/edgecache-board";
    function startCommand(name) { return startPrefix + (name.charAt(0) === "-" ? " --name=" : " --name ") + name; }
    function startBox(name) {
      // Each word kept whole: the line wraps at spaces, never inside a name (as the pages' unbroken_words).
      const words = [];
      startCommand(name).split(" ").forEach(function (word, index) { if (index) words.push(" "); words.push(el("span", { class: "word", text: word })); });
      const box = el("span", { class: "copyable" }, [el("code", { class: "command" }, words)]);
      if (window.EdgeCache && window.EdgeCache.copyButton) box.appendChild(window.EdgeCache.copyButton("Copy the start command"));
      return box;
    }

    function chosenDevices() {
      return Array.from(form.querySelectorAll('input[name="devices"]:checked')).map(function (box) {
        const choice = box.closest("[data-device]");
        return { name: choice ? choice.dataset.device : box.value, status: choice ? choice.dataset.status : "online", label: choice ? (choice.querySelector('[data-role="online"]') || {}).textContent : "" };
      });
    }
    function hideWarning() { if (warning) { warning.hidden = true; clear(warning); } }

    function waitingCard(item, device) {
      const hintAfter = parseInt(answers.dataset.hintAfter || "30", 10);
      const cancel = el("button", { type: "button", class: "secondary small cancel-run", text: "Cancel" });
      const card = el("div", { class: "card answer-card pending", "data-request": item.request_id, "data-device": item.device, "data-stage": "queued" }, [
        el("h3", { text: item.device }),
        item.title ? el("p", { class: "muted prompt-title", text: "answers: " + item.title }) : null,
        item.routing && item.routing.board ? el("p", { class: "muted routing", text: "sent to any board: the router chose " + item.routing.board +
          (item.routing.expected_ms != null ? ", expecting " + Math.round(item.routing.expected_ms) + " ms to the first token" : "") }) : null,
        el("p", { class: "stage" }, [
          el("span", { class: "muted waiting", "data-role": "stage", text: STAGES.queued }),
          el("span", { class: "muted", "data-role": "elapsed", text: "0.0 s" }),
          cancel,
        ]),
      ]);
      cancel.addEventListener("click", function () { cancelRun(card); });
      const started = performance.now();
      card._elapsedTimer = setInterval(function () {
        const elapsed = card.querySelector('[data-role="elapsed"]');
        if (elapsed) elapsed.textContent = ((performance.now() - started) / 1000).toFixed(1) + " s";
      }, 100);
      if (device && device.status !== "online") {
        card.appendChild(el("p", { class: "warning", text: item.device + " (" + (device.label || "not running") + "): the run waits in its queue until its board starts, and expires after " + expires + " s." }));
      }
      card._hintTimer = setTimeout(function () {
        if (!card.classList.contains("pending") || card.dataset.stage !== "queued") return; // the board has it
        card.appendChild(el("p", { class: "hint" }, [
          "no answer after " + hintAfter + " s: is the board running? Start it on the board with",
          startBox(item.device),
          "(the run expires after " + expires + " s without a board)",
        ]));
      }, hintAfter * 1000);
      return card;
    }

    function cardOf(requestId) { return answers.querySelector('.answer-card[data-request="' + requestId + '"]'); }

    function cancelRun(card) {
      const body = new FormData();
      body.append("csrfmiddlewaretoken", (form.querySelector("[name=csrfmiddlewaretoken]") || {}).value || "");
      body.append("request_id", card.dataset.request);
      const button = card.querySelector(".cancel-run");
      if (button) { button.disabled = true; button.textContent = "Cancelling…"; }
      fetch(form.dataset.cancelUrl, { method: "POST", body: body, headers: { Accept: "application/json" }, credentials: "same-origin" })
        .then((r) => r.json().then((res) => ({ ok: r.ok, res: res })))
        .then(function (answer) {
          if (!answer.ok) { setStage(card, "cancel-failed", errorsText(answer.res.errors)); return; }
          if (card.classList.contains("pending")) setStage(card, "cancelling");
        })
        .catch(function (err) { setStage(card, "cancel-failed", "could not cancel: " + err); });
    }

    // One streamed event of a run (its board's stage, a token, its end) onto its card.
    function onStreamEvent(event) {
      const card = cardOf(event.request_id);
      if (!card || !card.classList.contains("pending")) return; // the record came first: it is final
      // Stages only move forward: queued, started, fetching, prefilling (a run may skip some), then decoding.
      const ORDER = ["queued", "started", "fetching", "prefilling"];
      if (event.event === "stage" && ORDER.indexOf(event.stage) > ORDER.indexOf(card.dataset.stage) && ORDER.indexOf(card.dataset.stage) >= 0) setStage(card, event.stage);
      else if (event.event === "token") {
        if (card.dataset.stage !== "decoding" && card.dataset.stage !== "cancelling") setStage(card, "decoding");
        let answer = card.querySelector(".answer.streaming");
        if (!answer) { answer = el("p", { class: "answer streaming", "aria-live": "polite" }); card.appendChild(answer); }
        answer.textContent += event.text || "";
        card.dataset.tokens = String((parseInt(card.dataset.tokens || "0", 10) || 0) + 1);
      } else if (event.event === "done") setStage(card, "finishing", event.finish_reason === "cancelled" ? "cancelled: recording the run…" : null);
      else if (event.event === "error" || event.event === "lost") setStage(card, "finishing", event.error);
      else if (event.event === "stage" && event.stage === "waiting") setStage(card, "waiting", event.reason);
      else if (event.event === "resent") {
        // The board changed: the card says so, and the answer goes on where it stopped.
        const from = event.from || card.dataset.device;
        card.dataset.device = event.device;
        const title = card.querySelector("h3");
        if (title) title.textContent = event.device;
        card.insertBefore(el("p", { class: "moved-note", text: "board changed: " + from + " stopped answering; " + event.device + " goes on" +
          (event.tokens ? " from the " + event.tokens + " token" + (event.tokens === 1 ? "" : "s") + " shown" : "") }), card.querySelector(".stage"));
        setStage(card, "queued", "sent to " + event.device + ": waiting for it…");
      }
    }

    // -- the chat: the conversation so far is kept in the form (``history``, JSON) and drawn as
    // bubbles; each answer streams into the last bubble; its final text (what the board answered,
    // so the board's prepared next turn matches it) joins the conversation, cancelled or not.
    const chatLog = document.getElementById("chat-log");
    const historyField = document.getElementById("id_history");
    const messageField = document.getElementById("id_message");
    let chatTurn = null; // {user, bubble, request}: the turn waiting for its answer
    function turns() { try { const list = JSON.parse((historyField && historyField.value) || "[]"); return Array.isArray(list) ? list : []; } catch (err) { return []; } }
    function setTurns(list) { if (historyField) historyField.value = list.length ? JSON.stringify(list) : ""; }
    function bubble(role, text, extra) { return el("div", Object.assign({ class: "chat-msg " + role, "data-role": role, text: text }, extra || {})); }
    function drawChat() {
      if (!chatLog) return;
      clear(chatLog);
      turns().forEach((turn) => chatLog.appendChild(bubble(turn.role, turn.content)));
    }
    drawChat();
    const newChat = document.getElementById("chat-new");
    if (newChat) newChat.addEventListener("click", function () {
      setTurns([]); drawChat(); chatTurn = null;
      if (messageField) { messageField.value = ""; messageField.dispatchEvent(new Event("input")); messageField.focus(); }
    });
    if (messageField) messageField.addEventListener("keydown", function (event) {
      // Enter sends (as in llama.cpp's web UI); Shift+Enter starts a new line.
      if (event.key === "Enter" && !event.shiftKey && !event.ctrlKey && !event.metaKey && !event.isComposing) {
        event.preventDefault();
        if (form.requestSubmit) form.requestSubmit(document.getElementById("run-submit")); else document.getElementById("run-submit").click();
      }
    });
    function chatSource() { return ((form.querySelector('input[name="source"]:checked') || {}).value || "chat") === "chat"; }
    function startTurn() {
      const user = messageField ? messageField.value : "";
      const reply = bubble("assistant", "", { class: "chat-msg assistant pending", "aria-busy": "true" });
      chatTurn = { user: user, bubble: reply, request: null, userBubble: bubble("user", user) };
      chatLog.appendChild(chatTurn.userBubble);
      chatLog.appendChild(reply);
      chatLog.scrollTop = chatLog.scrollHeight;
    }
    function dropTurn() {
      if (!chatTurn) return;
      chatTurn.userBubble.remove(); chatTurn.bubble.remove(); chatTurn = null;
    }
    function endTurn(requestId, text, how) {
      if (!chatTurn || chatTurn.request !== requestId) return;
      const turn = chatTurn;
      chatTurn = null;
      turn.bubble.classList.remove("pending");
      turn.bubble.removeAttribute("aria-busy");
      if (how === "error") {
        turn.bubble.classList.add("failed");
        turn.bubble.textContent = text;
        if (messageField && !messageField.value) messageField.value = turn.user; // send it again when ready
        setTimeout(function () { turn.userBubble.remove(); }, 0);
        return;
      }
      turn.bubble.textContent = text;
      if (how === "cancelled") {
        turn.bubble.classList.add("cancelled");
        turn.bubble.appendChild(el("span", { class: "meta", text: "cancelled" }));
      }
      if (text.trim()) setTurns(turns().concat([{ role: "user", content: turn.user }, { role: "assistant", content: text }]));
    }
    function onChatEvent(event) {
      if (!chatTurn || chatTurn.request !== event.request_id) return;
      if (event.event === "token") { chatTurn.bubble.textContent += event.text || ""; chatLog.scrollTop = chatLog.scrollHeight; }
      else if (event.event === "done") endTurn(event.request_id, event.text != null ? event.text : chatTurn.bubble.textContent, event.finish_reason === "cancelled" ? "cancelled" : "done");
      else if (event.event === "error") endTurn(event.request_id, event.error || "failed", "error");
    }
    onChatRecord = function (run) {
      if (!chatTurn || chatTurn.request !== run.request_id) return;
      if (run.cancelled) endTurn(run.request_id, run.text || "", "cancelled");
      else if (run.error) endTurn(run.request_id, run.error_message || run.error, "error");
      else endTurn(run.request_id, run.text || "", "done");
    };

    function send(devices) {
      hideWarning();
      const chatting = chatSource() && chatLog;
      if (chatting && chatTurn) {
        feedback.textContent = "wait for the answer (or cancel it) before the next message";
        feedback.className = "error";
        return;
      }
      if (chatting) startTurn();
      feedback.textContent = "sending…";
      feedback.className = "muted";
      const title = describePrompt();
      fetch(form.action || window.location.href, { method: "POST", body: new FormData(form), headers: { Accept: "application/x-ndjson" }, credentials: "same-origin" })
        .then(function (r) {
          if (!r.ok) {
            if (chatting) dropTurn();
            return r.json().then(function (body) {
              feedback.textContent = errorsText(body.errors) || "not sent";
              feedback.className = "error";
            });
          }
          return readLines(r, function (event) {
            if (event.event === "dispatched") {
              feedback.className = "muted";
              feedback.textContent = "sent to " + event.dispatched.map((d) => d.device).join(", ");
              if (chatting && chatTurn && event.dispatched.length) {
                chatTurn.request = event.dispatched[0].request_id;
                chatTurn.bubble.dataset.request = chatTurn.request;
                if (messageField) { messageField.value = ""; messageField.dispatchEvent(new Event("input")); }
              }
              event.dispatched.forEach(function (item) {
                const device = devices.find((d) => d.name === item.device);
                const card = waitingCard(Object.assign({ title: title }, item), device);
                answers.insertBefore(card, answers.firstChild);
                if (early.has(item.request_id)) { fillAnswer(card, early.get(item.request_id)); early.delete(item.request_id); }
              });
            } else if (event.event === "refused") {
              if (chatting && chatTurn && !chatTurn.request) dropTurn();
              feedback.textContent = errorsText(event.errors) || "not sent";
              feedback.className = "error";
            } else { onChatEvent(event); onStreamEvent(event); }
          });
        })
        .catch(function (err) { if (chatting && chatTurn && !chatTurn.request) dropTurn(); feedback.textContent = "could not send: " + err; feedback.className = "error"; });
    }

    // The prompt as its card names it: the text's start, the MMLU question, the saved prompt's name.
    function describePrompt() {
      const source = (form.querySelector('input[name="source"]:checked') || {}).value || "chat";
      const value = (id) => ((document.getElementById(id) || {}).value || "");
      const option = (id) => { const select = document.getElementById(id); return select && select.selectedIndex >= 0 ? select.options[select.selectedIndex].text : ""; };
      if (source === "chat") return "Chat: " + truncate(value("id_message").replace(/\s+/g, " ").trim(), 74);
      if (source === "mmlu") return "MMLU " + option("id_topic") + ", question " + value("id_question");
      if (source === "saved") return option("id_saved_prompt");
      if (source === "pml") return truncate(value("id_pml").replace(/\s+/g, " "), 80);
      return truncate(value("id_text").replace(/\s+/g, " ").trim(), 80);
    }

    // Ctrl+Enter (⌘+Enter) sends from anywhere in the form.
    form.addEventListener("keydown", function (event) {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        if (form.requestSubmit) form.requestSubmit(document.getElementById("run-submit")); else document.getElementById("run-submit").click();
      }
    });

    form.addEventListener("submit", function (event) {
      event.preventDefault();
      const devices = chosenDevices();
      const away = devices.filter((d) => d.status !== "online");
      if (!away.length || !warning) { send(devices); return; }
      // Warn first: a run sent to a board that is not running waits until it starts (or expires).
      clear(warning);
      warning.appendChild(el("p", {}, [
        "Not running: " + away.map((d) => d.name + " (" + d.label + ")").join(", ") + ". A run sent to a board that is not running waits in its queue until the board starts, and expires after " +
          expires + " s. Start it on the board (a new board: with --token TOKEN, from its registration) with",
        startBox(away[0].name),
      ]));
      const sendAnyway = el("button", { type: "button", id: "run-send-anyway", text: "Send anyway" });
      const cancel = el("button", { type: "button", class: "secondary", id: "run-cancel", text: "Cancel" });
      sendAnyway.addEventListener("click", function () { send(devices); });
      cancel.addEventListener("click", hideWarning);
      warning.appendChild(el("p", {}, [sendAnyway, " ", cancel]));
      warning.hidden = false;
      feedback.textContent = "";
    });
    form.addEventListener("change", function (event) { if (event.target && event.target.name === "devices") hideWarning(); });
  }

  // -- schema encoding: a progress bar per board, filled as modules are encoded --------------------
  function encodeBar(request, device) {
    const area = document.getElementById("encode-progress");
    if (!area) return null;
    let bar = area.querySelector('[data-request="' + request + '"]');
    if (!bar) {
      bar = el("div", { class: "encode-bar", "data-request": request }, [
        el("span", { class: "label", text: device + ": waiting for the board…" }),
        el("progress", { max: "1", value: "0" }),
      ]);
      area.appendChild(bar);
    }
    return bar;
  }
  function onEncode(kind, data) {
    if (String(document.body.dataset.schema) !== String(data.schema_id)) return;
    const bar = encodeBar(data.request_id, data.device);
    if (!bar) return;
    const progress = bar.querySelector("progress");
    const label = bar.querySelector(".label");
    if (kind === "encode.progress") {
      if (bar.classList.contains("done") || bar.classList.contains("failed")) return; // the report came first
      progress.max = data.total; progress.value = data.done;
      bar.dataset.total = data.total;
      if (data.done >= data.total) {
        // Every piece is encoded or was cached already: done, whatever the report's delay.
        bar.classList.add("encoded");
        label.textContent = data.device + ": " + data.done + "/" + data.total + " done";
      } else {
        label.textContent = data.device + ": " + data.done + "/" + data.total + " (" + data.piece + ")";
      }
    } else {
      const total = parseInt(bar.dataset.total || "0", 10) || data.stored + data.skipped;
      progress.max = Math.max(total, 1); progress.value = progress.max;
      bar.classList.add(data.error ? "failed" : "done");
      label.textContent = data.device + (data.error ? ": failed: " + data.error
        : ": " + total + "/" + total + " done: " + data.stored + " stored, " + data.skipped + " already cached");
    }
  }
  const encodeForm = document.getElementById("encode-form");
  if (encodeForm) {
    const encodeErrors = document.getElementById("encode-errors");
    encodeForm.addEventListener("submit", function (event) {
      event.preventDefault();
      if (encodeErrors) { encodeErrors.textContent = ""; encodeErrors.hidden = true; } // a new submit: old errors go
      fetch(encodeForm.action, { method: "POST", body: new FormData(encodeForm), headers: { Accept: "application/json" }, credentials: "same-origin" })
        .then((r) => r.json().then((body) => ({ ok: r.ok, body: body })))
        .then(function (res) {
          if (!res.ok) {
            if (encodeErrors) { encodeErrors.textContent = errorsText(res.body.errors) || "Choose at least one device."; encodeErrors.hidden = false; }
            return;
          }
          res.body.dispatched.forEach((item) => encodeBar(item.request_id, item.device));
        })
        .catch(function (err) { if (encodeErrors) { encodeErrors.textContent = "could not send: " + err; encodeErrors.hidden = false; } });
    });
  }

  // -- the Queue page: its tables follow runs sent, answered and ended, and boards going up or down --
  // (the server renders them; the fresh tables replace the old ones, no innerHTML).
  const queueTables = document.getElementById("queue-tables");
  let queueTimer = null;
  function refreshQueue() {
    if (!queueTables || queueTimer) return;
    queueTimer = setTimeout(function () {
      queueTimer = null;
      fetch(window.location.href, { credentials: "same-origin", headers: { Accept: "text/html" } })
        .then((r) => r.text())
        .then(function (text) {
          const fresh = new DOMParser().parseFromString(text, "text/html").getElementById("queue-tables");
          const current = document.getElementById("queue-tables");
          if (fresh && current) current.replaceWith(document.importNode(fresh, true));
        })
        .catch(function () { /* the next event or tick tries again */ });
    }, 1000);
  }
  if (queueTables) setInterval(refreshQueue, 15000);

  document.addEventListener("edgecache:live", function (e) {
    const event = e.detail || {};
    if (event.event === "run" || event.event === "run.dispatched" || event.event === "device") refreshQueue();
    if (event.event === "run") onRun(event.data || {});
    else if (event.event === "device") onDevice(event.data || {});
    else if (event.event === "encode.progress" || event.event === "encode.done") onEncode(event.event, event.data || {});
  });
})();
