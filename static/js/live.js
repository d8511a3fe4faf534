// EdgeCache live pages: draws the server-built Plotly figures and extends them as runs
// arrive over the WebSocket, without reloading. Traces are found by name.
(function () {
  "use strict";
  const dataNode = document.getElementById("chart-data");
  const charts = dataNode ? JSON.parse(dataNode.textContent || "{}") || {} : {};
  const WINDOW = charts.window || 200;
  // [field, label] pairs in stack order, from the page (inference.breakdown.STACK).
  const stackNode = document.getElementById("chart-stack");
  const STACK = (stackNode ? JSON.parse(stackNode.textContent || "[]") : []).map((pair) => pair[0]);
  const hitCounts = charts.hitCounts || {};
  const config = { responsive: true, displaylogo: false };

  function draw(id, fig) {
    const el = document.getElementById(id);
    if (el && fig && window.Plotly) Plotly.newPlot(el, fig.data, fig.layout, config);
    return el;
  }
  const elBreakdown = draw("chart-breakdown", charts.breakdown);
  const elTimeline = draw("chart-timeline", charts.timeline);
  const elHits = draw("chart-hits", charts.hits);
  const elBytes = draw("chart-bytes", charts.bytes);
  const elBreakeven = draw("chart-breakeven", charts.breakeven);

  function traceIndex(el, name, template) {
    let index = el.data.findIndex((trace) => trace.name === name);
    if (index < 0) {
      Plotly.addTraces(el, Object.assign({ name: name, x: [], y: [] }, template));
      index = el.data.length - 1;
    }
    return index;
  }

  function text(value) {
    const span = document.createElement("span");
    span.textContent = value == null ? "" : String(value);
    return span.innerHTML;
  }

  function fmt(ms) { return (ms || 0).toFixed(1); }

  function runRow(run) {
    const b = run.breakdown || {};
    const tr = document.createElement("tr");
    tr.dataset.request = run.request_id;
    const when = new Date(run.created).toLocaleTimeString();
    const answer = run.error ? '<span class="error">' + text(run.error) + "</span>" : text((run.text || "").slice(0, 40));
    tr.innerHTML = "<td>" + text(when) + "</td><td>" + text(run.device) + "</td><td>" + text((run.title || "").slice(0, 50)) +
      "</td><td>" + answer + "</td><td>" + text(b.case) + "</td><td>" + text(b.matched_tokens) + "/" + text(b.prompt_tokens) +
      "</td><td>" + fmt(b.ttft_ms) + "</td><td>" + fmt(b.ttlt_ms) + "</td><td>" + text(b.cachebox) + "</td>";
    return tr;
  }

  function onRun(run) {
    const b = run.breakdown || {};
    const label = run.device + " #" + run.id;
    if (!run.error) {
      if (elBreakdown && elBreakdown.data) {
        Plotly.extendTraces(elBreakdown, { x: STACK.map(() => [label]), y: STACK.map((f) => [b[f] || 0]) }, STACK.map((_, i) => i), 50);
      }
      if (elTimeline && elTimeline.data) {
        const ttft = traceIndex(elTimeline, run.device + " TTFT", { mode: "lines+markers" });
        const ttlt = traceIndex(elTimeline, run.device + " TTLT", { mode: "lines+markers", line: { dash: "dot" } });
        Plotly.extendTraces(elTimeline, { x: [[run.created], [run.created]], y: [[b.ttft_ms], [b.ttlt_ms]] }, [ttft, ttlt], WINDOW);
      }
      if (elHits && elHits.data) {
        const counts = hitCounts[run.device] || [0, 0];
        counts[0] += b.case === "partial" || b.case === "full" ? 1 : 0;
        counts[1] += 1;
        hitCounts[run.device] = counts;
        const i = traceIndex(elHits, run.device, { mode: "lines+markers" });
        Plotly.extendTraces(elHits, { x: [[run.created]], y: [[counts[0] / counts[1]]] }, [i], WINDOW);
      }
      if (elBytes && elBytes.data) {
        const i = traceIndex(elBytes, run.device, { mode: "markers" });
        Plotly.extendTraces(elBytes, { x: [[run.created]], y: [[(b.state_bytes || 0) / 1e6]] }, [i], WINDOW);
      }
      if (elBreakeven && document.body.dataset.device === run.device) refreshBreakeven();
    }
    const body = document.getElementById("runs-body");
    if (body) {
      body.insertBefore(runRow(run), body.firstChild);
      while (body.children.length > 20) body.removeChild(body.lastChild);
    }
    const card = document.querySelector('#answers [data-request="' + run.request_id + '"]');
    if (card) fillAnswer(card, run);
  }

  let breakevenTimer = null;
  function refreshBreakeven() {
    if (breakevenTimer) return;
    breakevenTimer = setTimeout(function () {
      breakevenTimer = null;
      fetch(document.body.dataset.breakevenUrl, { credentials: "same-origin" })
        .then((r) => r.json())
        .then((fig) => Plotly.react(elBreakeven, fig.data, fig.layout, config));
    }, 500);
  }

  function onDevice(device) {
    document.querySelectorAll('[data-device="' + device.name + '"] [data-role="online"], [data-role="online"][data-device="' + device.name + '"]').forEach(function (badge) {
      badge.textContent = device.revoked ? "revoked" : device.online ? "online" : "offline";
      badge.className = "badge " + (device.online ? "ok" : "off");
    });
  }

  function fillAnswer(card, run) {
    const b = run.breakdown || {};
    card.classList.remove("pending");
    card.classList.add(run.error ? "failed" : "done");
    const parts = STACK.map((f) => f.replace("_ms", "") + " " + fmt(b[f])).join(" · ");
    card.innerHTML = "<h3>" + text(run.device) + "</h3>" +
      (run.error ? '<p class="error">' + text(run.error) + "</p>" :
        '<p class="answer">' + text(run.text) + "</p>" +
        "<p><strong>" + text(b.case) + "</strong>: " + text(b.matched_tokens) + "/" + text(b.prompt_tokens) +
        " prompt tokens from the cache box (" + text(b.cachebox) + ") · TTFT " + fmt(b.ttft_ms) + " ms · TTLT " + fmt(b.ttlt_ms) + " ms</p>" +
        '<p class="muted">' + parts + " (ms)</p>" +
        (run.expected_answer ? "<p>expected answer: " + text(run.expected_answer) + "</p>" : ""));
  }

  // The run form: send with fetch, then wait for each device's answer on the socket.
  const form = document.getElementById("run-form");
  if (form) {
    const sources = form.querySelectorAll('input[name="source"]');
    function showSource() {
      const chosen = (form.querySelector('input[name="source"]:checked') || {}).value || "text";
      form.querySelectorAll("[data-source]").forEach((div) => { div.hidden = div.dataset.source !== chosen; });
    }
    sources.forEach((radio) => radio.addEventListener("change", showSource));
    showSource();
    form.addEventListener("submit", function (event) {
      event.preventDefault();
      const feedback = document.getElementById("run-feedback");
      feedback.textContent = "sending…";
      fetch(form.action || window.location.href, { method: "POST", body: new FormData(form), headers: { Accept: "application/json" }, credentials: "same-origin" })
        .then((r) => r.json().then((body) => ({ ok: r.ok, body: body })))
        .then(function (res) {
          if (!res.ok) {
            const errors = res.body.errors || {};
            feedback.textContent = Object.keys(errors).map((k) => (k === "__all__" ? "" : k + ": ") + errors[k].map((e) => e.message).join(" ")).join(" · ");
            feedback.className = "error";
            return;
          }
          feedback.className = "muted";
          feedback.textContent = "sent to " + res.body.dispatched.map((d) => d.device).join(", ");
          const answers = document.getElementById("answers");
          res.body.dispatched.forEach(function (item) {
            const card = document.createElement("div");
            card.className = "card answer-card pending";
            card.dataset.request = item.request_id;
            card.innerHTML = "<h3>" + text(item.device) + "</h3><p class=\"muted\">waiting for the board…</p>";
            answers.insertBefore(card, answers.firstChild);
          });
        })
        .catch(function (err) { feedback.textContent = "could not send: " + err; feedback.className = "error"; });
    });
  }

  // Schema encoding: a progress bar per board, filled as modules are encoded.
  function encodeBar(request, device) {
    const area = document.getElementById("encode-progress");
    if (!area) return null;
    let bar = area.querySelector('[data-request="' + request + '"]');
    if (!bar) {
      bar = document.createElement("div");
      bar.className = "encode-bar";
      bar.dataset.request = request;
      bar.innerHTML = "<span class=\"label\">" + text(device) + ": waiting for the board…</span><progress max=\"1\" value=\"0\"></progress>";
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
      progress.max = data.total; progress.value = data.done;
      label.textContent = data.device + ": " + data.done + "/" + data.total + " (" + data.piece + ")";
    } else {
      progress.value = progress.max;
      bar.classList.add(data.error ? "failed" : "done");
      label.textContent = data.device + (data.error ? ": failed: " + data.error : ": done, " + data.stored + " stored, " + data.skipped + " already cached");
    }
  }
  const encodeForm = document.getElementById("encode-form");
  if (encodeForm) {
    encodeForm.addEventListener("submit", function (event) {
      event.preventDefault();
      fetch(encodeForm.action, { method: "POST", body: new FormData(encodeForm), headers: { Accept: "application/json" }, credentials: "same-origin" })
        .then((r) => r.json().then((body) => ({ ok: r.ok, body: body })))
        .then(function (res) {
          if (!res.ok) {
            const area = document.getElementById("encode-progress");
            const errors = res.body.errors || {};
            area.textContent = Object.keys(errors).map((k) => (k === "__all__" ? "" : k + ": ") + errors[k].map((e) => e.message).join(" ")).join(" · ") || "Choose at least one device.";
            area.className = "error";
            return;
          }
          document.getElementById("encode-progress").className = "";
          res.body.dispatched.forEach((item) => encodeBar(item.request_id, item.device));
        });
    });
  }

  // The socket, reconnecting with backoff; the badge in the header tells whether it is live.
  const badge = document.getElementById("live-status");
  let delay = 500;
  function connect() {
    const socket = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/ws/live/");
    socket.onopen = function () { delay = 500; if (badge) { badge.textContent = "live"; badge.className = "badge ok"; } };
    socket.onmessage = function (message) {
      const event = JSON.parse(message.data);
      if (event.event === "run") onRun(event.data);
      else if (event.event === "device") onDevice(event.data);
      else if (event.event === "encode.progress" || event.event === "encode.done") onEncode(event.event, event.data);
    };
    socket.onclose = function () {
      if (badge) { badge.textContent = "offline"; badge.className = "badge off"; }
      setTimeout(connect, delay);
      delay = Math.min(delay * 2, 10000);
    };
  }
  if (badge) connect();
})();
