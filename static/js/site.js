// EdgeCache, every page: the live socket (and the header badge that tells whether it is up),
// device status badges, the collapsing navigation, character counters and the register form's
// link presets. Pages with charts or forms add static/js/live.js, which listens to
// "edgecache:live" events this script dispatches. DOM is built with textContent only.
(function () {
  "use strict";

  // -- navigation: collapses into a menu button on narrow screens ------------------------------
  const toggle = document.getElementById("nav-toggle");
  const nav = document.getElementById("site-nav");
  if (toggle && nav) {
    toggle.addEventListener("click", function () {
      const open = toggle.getAttribute("aria-expanded") !== "true";
      toggle.setAttribute("aria-expanded", String(open));
      document.body.classList.toggle("nav-open", open);
    });
  }

  // -- device status words: online, offline since …, never started, revoked --------------------
  // Dates as the server writes them (Y-m-d H:i, in its time zone), whatever the browser's zone.
  const zoneMeta = document.querySelector('meta[name="edgecache-time-zone"]');
  let serverZone;
  try { serverZone = zoneMeta && zoneMeta.content ? new Intl.DateTimeFormat("en-CA", { timeZone: zoneMeta.content }).resolvedOptions().timeZone : undefined; } catch (err) { serverZone = undefined; }
  const partsOf = new Intl.DateTimeFormat("en-CA", { timeZone: serverZone, year: "numeric", month: "2-digit", day: "2-digit", hour: "2-digit", minute: "2-digit", second: "2-digit", hourCycle: "h23" });
  function parts(iso) {
    const date = new Date(iso);
    if (isNaN(date.getTime())) return null;
    const part = {};
    partsOf.formatToParts(date).forEach((p) => { part[p.type] = p.value; });
    return part;
  }
  function when(iso) { const p = parts(iso); return p ? p.year + "-" + p.month + "-" + p.day + " " + p.hour + ":" + p.minute : ""; }
  function clock(iso) { const p = parts(iso); return p ? p.hour + ":" + p.minute + ":" + p.second : ""; }
  function deviceState(device) {
    if (device.revoked) return ["revoked", "revoked"];
    if (device.online) return ["online", "online"];
    if (!device.last_seen) return ["never", "never started"];
    return ["offline", "offline since " + when(device.last_seen)];
  }
  function onDevice(device) {
    const state = deviceState(device);
    document.querySelectorAll("[data-device]").forEach(function (holder) {
      if (holder.dataset.device !== device.name) return;
      holder.dataset.status = state[0];
      if (device.last_seen) holder.dataset.lastSeen = device.last_seen;
      const badges = holder.matches('[data-role="online"]') ? [holder] : Array.from(holder.querySelectorAll('[data-role="online"]'));
      badges.forEach(function (badge) {
        badge.textContent = state[1];
        badge.className = "badge " + (state[0] === "online" ? "ok" : "off");
      });
      holder.querySelectorAll('[data-role="last-seen"]').forEach(function (cell) { cell.textContent = device.last_seen ? when(device.last_seen) : "never"; });
      if (device.memory) holder.querySelectorAll('[data-role="memory"]').forEach(function (cell) { cell.textContent = device.memory; });
    });
  }
  window.EdgeCache = { deviceState: deviceState, when: when, clock: clock };

  // -- the socket: every logged-in page connects; the badge says whether updates arrive --------
  const badge = document.getElementById("live-status");
  let delay = 500;
  function setBadge(live) {
    if (!badge) return;
    badge.textContent = live ? "live" : "offline";
    badge.className = "badge " + (live ? "ok" : "off");
  }
  function connect() {
    const socket = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/ws/live/");
    socket.onopen = function () {
      delay = 500;
      setBadge(true);
      // What changed while the socket was down (or not yet open): the state of every device shown.
      const names = Array.from(new Set(Array.from(document.querySelectorAll("[data-device]")).map((node) => node.dataset.device).filter(Boolean)));
      if (names.length) socket.send(JSON.stringify({ sync: names.slice(0, 500) }));
    };
    socket.onmessage = function (message) {
      let event;
      try { event = JSON.parse(message.data); } catch (err) { return; }
      if (event.event === "device") onDevice(event.data || {});
      document.dispatchEvent(new CustomEvent("edgecache:live", { detail: event }));
    };
    socket.onclose = function () {
      setBadge(false);
      setTimeout(connect, delay);
      delay = Math.min(delay * 2, 10000);
    };
  }
  if (badge && "WebSocket" in window) connect();

  // -- character counters: the limit the server applies, shown (no silent cut by the browser) ---
  function formatCount(n) { return n.toLocaleString("en-US"); }
  // Characters as the server counts them (Python's len: code points), not JavaScript's UTF-16
  // units: an emoji is one character, not two. The box's value has LF line endings already.
  function countChars(text) {
    const pairs = text.match(/[\uD800-\uDBFF][\uDC00-\uDFFF]/g);
    return text.length - (pairs ? pairs.length : 0);
  }
  document.querySelectorAll("[data-maxlength]").forEach(function (field) {
    const limit = parseInt(field.dataset.maxlength, 10);
    if (!limit) return;
    const counter = document.createElement("span");
    counter.className = "char-count muted";
    counter.id = (field.id || field.name) + "-count";
    counter.setAttribute("aria-live", "polite");
    field.setAttribute("aria-describedby", ((field.getAttribute("aria-describedby") || "") + " " + counter.id).trim());
    field.insertAdjacentElement("afterend", counter);
    function update() {
      const n = countChars(field.value);
      const over = n > limit;
      counter.textContent = formatCount(n) + " / " + formatCount(limit) + " characters" + (over ? ": too long, shorten it by " + formatCount(n - limit) : "");
      counter.classList.toggle("error", over);
      field.classList.toggle("too-long", over);
    }
    field.addEventListener("input", update);
    update();
  });

  // -- register a device: a link preset fills bandwidth and round-trip time on screen ----------
  const presetsNode = document.getElementById("link-presets");
  const preset = document.getElementById("id_link_preset");
  if (presetsNode && preset) {
    const presets = JSON.parse(presetsNode.textContent || "{}") || {};
    const bandwidth = document.getElementById("id_link_bandwidth_mbps");
    const rtt = document.getElementById("id_link_rtt_ms");
    let filling = false;
    function fill() {
      if (!(preset.value in presets)) return; // "custom": the fields are the user's
      const profile = presets[preset.value];
      filling = true;
      if (bandwidth) bandwidth.value = profile ? profile.bandwidth_mbps : "";
      if (rtt) rtt.value = profile ? profile.rtt_ms : "";
      filling = false;
    }
    preset.addEventListener("change", fill);
    [bandwidth, rtt].forEach(function (field) {
      if (!field) return;
      field.addEventListener("input", function () { if (!filling) preset.value = "custom"; });
    });
    if (!bandwidth || (bandwidth.value === "" && (!rtt || rtt.value === ""))) fill();
  }

  // -- copy buttons: a button[data-copy] in a .copyable box puts the box's command or key on the
  // clipboard (the Clipboard API; where it is missing or refused, a hidden textarea and "copy";
  // where that fails too, the text is selected for Ctrl+C). The box's status line says which.
  function copyByCommand(text) {
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed"; area.style.top = "0"; area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    let copied = false;
    try { copied = document.execCommand("copy"); } catch (err) { copied = false; }
    document.body.removeChild(area);
    return copied;
  }
  function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) {
      return navigator.clipboard.writeText(text).catch(function () { if (!copyByCommand(text)) throw new Error("refused"); });
    }
    return copyByCommand(text) ? Promise.resolve() : Promise.reject(new Error("refused"));
  }
  function copyButton(label) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "secondary small copy-button";
    button.setAttribute("data-copy", "");
    button.setAttribute("aria-label", label || "Copy");
    button.textContent = "Copy";
    const status = document.createElement("span");
    status.className = "copy-status muted small";
    status.setAttribute("role", "status");
    status.setAttribute("aria-live", "polite");
    const both = document.createDocumentFragment();
    both.appendChild(button);
    both.appendChild(status);
    return both;
  }
  window.EdgeCache.copyButton = copyButton;
  document.addEventListener("click", function (event) {
    const button = event.target.closest && event.target.closest("button[data-copy]");
    if (!button) return;
    const box = button.closest(".copyable");
    const source = box && box.querySelector("pre, code");
    if (!source) return;
    const status = box.querySelector(".copy-status");
    const say = function (words) { if (status) status.textContent = words; };
    copyText(source.textContent).then(function () { say("Copied"); }, function () {
      const range = document.createRange();
      range.selectNodeContents(source);
      const selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
      say("Selected: press Ctrl+C (⌘C) to copy");
    });
  });
})();
