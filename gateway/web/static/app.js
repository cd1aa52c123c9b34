// Strata chat page. Plain DOM code: model and document text only ever reach the page through
// textContent / createTextNode, never innerHTML, so markup in an answer is shown, not run.
"use strict";

(() => {
  const KEY_STORE = "strata.apiKey";
  const $ = (id) => document.getElementById(id);

  const state = {
    key: localStorage.getItem(KEY_STORE) || "",
    admin: false,
    model: null,
    session: null, // id of the open session
    sessions: [],
    collections: [],
    attached: new Set(),
    controller: null, // AbortController of the stream in flight
    polls: new Map(), // document id -> timer
    operatorTimer: null,
    lastTokens: new Map(), // lane -> [time, generation tokens]
  };

  // ------------------------------------------------------------------ DOM helpers

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    for (const c of children) node.append(typeof c === "string" ? document.createTextNode(c) : c);
    return node;
  }

  // ------------------------------------------------------------------ errors in plain words

  class ApiError extends Error {
    constructor(status, body) {
      const err = (body && body.error) || {};
      super(err.message || `HTTP ${status}`);
      this.status = status;
      this.code = err.code || null;
      this.type = err.type || null;
    }
  }

  function plainWords(e, retryAfter) {
    if (e.name === "AbortError") return null;
    if (!(e instanceof ApiError)) return `Could not reach the gateway (${e.message}).`;
    const code = e.code || "";
    if (code === "context_length_exceeded")
      return "This message does not fit the model's context window. Shorten it, lower max tokens, "
        + "or start a new session. (" + e.message + ")";
    if (e.status === 429)
      return "Rate limited: too many requests or tokens for this key right now. Try again"
        + (retryAfter ? ` in ${retryAfter} s.` : " shortly.");
    if (e.status === 401) return "The API key was not accepted. Enter a valid key.";
    if (e.status === 403) return "This key is not allowed to do that.";
    if (e.status === 503 || e.status === 502 || e.status === 504 || /lane/.test(code))
      return "No lane is available to answer right now (the model servers are busy, starting or down). "
        + "Try again in a moment. (" + e.message + ")";
    return e.message;
  }

  function showError(text) {
    const box = $("error");
    if (!text) { box.hidden = true; box.textContent = ""; return; }
    box.textContent = text;
    box.hidden = false;
  }

  // ------------------------------------------------------------------ API

  async function api(method, path, body, opts) {
    const headers = { Authorization: "Bearer " + state.key };
    const init = { method, headers, signal: opts && opts.signal };
    if (body instanceof FormData) init.body = body;
    else if (body !== undefined) { headers["Content-Type"] = "application/json"; init.body = JSON.stringify(body); }
    const r = await fetch(path, init);
    if (opts && opts.raw) return r;
    const data = await r.json().catch(() => null);
    if (!r.ok) {
      const e = new ApiError(r.status, data);
      e.retryAfter = r.headers.get("Retry-After");
      throw e;
    }
    return data;
  }

  async function guarded(fn) {
    try { showError(null); return await fn(); } catch (e) { showError(plainWords(e, e.retryAfter)); return undefined; }
  }

  // ------------------------------------------------------------------ key

  function openKeyPanel(message) {
    $("key-panel").hidden = false;
    $("key-input").value = state.key;
    $("key-status").textContent = message || "";
    $("key-input").focus();
  }

  async function checkKey() {
    $("key-status").textContent = "Checking...";
    try {
      const models = await api("GET", "/v1/models");
      state.model = models.data.length ? models.data[0].id : null;
      $("model-name").textContent = state.model ? `${state.model} - window ${models.data[0].max_model_len}` : "";
    } catch (e) {
      if (e instanceof ApiError && e.status === 503) state.model = null; // key fine, no lane yet
      else { openKeyPanel(plainWords(e)); return false; }
    }
    const r = await api("GET", "/v1/admin/lanes", undefined, { raw: true }).catch(() => null);
    state.admin = !!(r && r.ok);
    $("tab-operator").hidden = !state.admin;
    $("key-status").textContent = state.admin ? "Key accepted (admin)." : "Key accepted.";
    $("key-panel").hidden = true;
    return true;
  }

  async function start() {
    document.body.dataset.state = "loading"; // "ready" once the key's sessions and collections are shown
    if (!state.key) { openKeyPanel("Enter an API key to start."); return; }
    if (!(await checkKey())) return;
    // another key sees other sessions and collections: nothing of the previous key's is kept
    state.session = null;
    state.attached.clear();
    for (const t of state.polls.values()) clearTimeout(t);
    state.polls.clear();
    showError(null);
    await Promise.all([loadSessions(), loadCollections()]);
    if (state.sessions.length) await openSession(state.sessions[0].id);
    else renderMessages([]);
    $("prompt").focus();
    document.body.dataset.state = "ready";
  }

  // ------------------------------------------------------------------ sessions

  async function loadSessions() {
    const data = await guarded(() => api("GET", "/v1/sessions"));
    if (!data) return;
    state.sessions = data.data;
    renderSessions();
  }

  function sessionTitle(s) {
    return s.title || `Session ${s.id.slice(5, 11)}`;
  }

  function renderSessions() {
    const list = $("session-list");
    list.replaceChildren();
    for (const s of state.sessions) {
      const li = el("li", { class: "session-item" + (s.id === state.session ? " current" : ""), "data-id": s.id });
      li.append(
        el("button", { type: "button", class: "open", title: sessionTitle(s), onclick: () => openSession(s.id),
          "aria-current": s.id === state.session ? "true" : "false" }, sessionTitle(s)),
        el("button", { type: "button", class: "act rename", title: "Rename", onclick: () => renameSession(s) }, "rename"),
        el("button", { type: "button", class: "act export", title: "Export as JSON", onclick: () => exportSession(s) },
          "export"),
        el("button", { type: "button", class: "act delete", title: "Delete", onclick: () => deleteSession(s) }, "delete"),
      );
      list.append(li);
    }
  }

  async function newSession(title) {
    const s = await guarded(() => api("POST", "/v1/sessions", title ? { title } : {}));
    if (!s) return null;
    state.sessions.unshift(s);
    state.session = s.id;
    renderSessions();
    renderMessages([]);
    return s;
  }

  async function openSession(id) {
    if (state.controller) return; // never switch under a stream
    const s = await guarded(() => api("GET", `/v1/sessions/${encodeURIComponent(id)}`));
    if (!s) return;
    state.session = s.id;
    renderSessions();
    renderMessages(s.turns);
    closeMenu();
    $("prompt").focus();
  }

  async function renameSession(s) {
    const title = window.prompt("New title", sessionTitle(s));
    if (title === null) return;
    const out = await guarded(() => api("PATCH", `/v1/sessions/${encodeURIComponent(s.id)}`,
      { title: title.trim() || null }));
    if (out) { Object.assign(s, out); renderSessions(); }
  }

  async function exportSession(s) {
    const data = await guarded(() => api("GET", `/v1/sessions/${encodeURIComponent(s.id)}/export`));
    if (!data) return;
    const url = URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" }));
    const a = el("a", { href: url, download: `${s.id}.json` });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  }

  async function deleteSession(s) {
    if (!window.confirm(`Delete "${sessionTitle(s)}" and its history?`)) return;
    const out = await guarded(() => api("DELETE", `/v1/sessions/${encodeURIComponent(s.id)}`));
    if (!out) return;
    state.sessions = state.sessions.filter((x) => x.id !== s.id);
    if (state.session === s.id) { state.session = null; renderMessages([]); }
    renderSessions();
  }

  // ------------------------------------------------------------------ markdown (safe subset)

  // Inline: `code`, **bold**, *italic*. Everything else is text.
  function inline(text, parent) {
    const re = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\s][^*\n]*\*)/g;
    let last = 0;
    for (let m = re.exec(text); m; m = re.exec(text)) {
      if (m.index > last) parent.append(document.createTextNode(text.slice(last, m.index)));
      const t = m[0];
      if (m[1]) parent.append(el("code", { text: t.slice(1, -1) }));
      else if (m[2]) parent.append(el("strong", { text: t.slice(2, -2) }));
      else parent.append(el("em", { text: t.slice(1, -1) }));
      last = m.index + t.length;
    }
    if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
    return parent;
  }

  function renderMarkdown(src, target) {
    target.replaceChildren();
    const lines = src.split("\n");
    let para = [];
    let list = null;
    const flush = () => {
      if (para.length) { target.append(inline(para.join("\n"), el("p"))); para = []; }
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*```\s*([\w+.-]*)\s*$/);
      if (fence) {
        flush(); list = null;
        const body = [];
        for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) body.push(lines[i]);
        const code = el("code", { text: body.join("\n") });
        if (fence[1]) code.dataset.lang = fence[1];
        target.append(el("pre", {}, code));
        continue;
      }
      const h = line.match(/^(#{1,6})\s+(.*)$/);
      const li = line.match(/^\s*(?:[-*+]|(\d+)[.)])\s+(.*)$/);
      if (h) {
        flush(); list = null;
        target.append(inline(h[2], el("h" + Math.min(6, h[1].length + 2))));
      } else if (li) {
        flush();
        const kind = li[1] ? "ol" : "ul";
        if (!list || list.tagName.toLowerCase() !== kind) { list = el(kind); target.append(list); }
        list.append(inline(li[2], el("li")));
      } else if (!line.trim()) {
        flush(); list = null;
      } else {
        list = null;
        para.push(line);
      }
    }
    flush();
  }

  // ------------------------------------------------------------------ messages

  function addMessage(role, text, complete) {
    const box = el("div", { class: `msg ${role}` + (complete === false ? " incomplete" : "") });
    const body = el("div", { class: "body" });
    box.append(body);
    if (role === "assistant") renderMarkdown(text, body); else body.textContent = text;
    $("messages").append(box);
    box.scrollIntoView({ block: "end" });
    return box;
  }

  function renderMessages(turns) {
    $("messages").replaceChildren();
    for (const t of turns) {
      if (t.role !== "user" && t.role !== "assistant") continue;
      const box = addMessage(t.role, t.content, t.complete);
      if (t.role === "assistant" && t.complete === false) box.append(el("div", { class: "meta", text: "incomplete" }));
    }
  }

  function renderCitations(box, citations) {
    if (!citations || !citations.length) return;
    const ol = el("ol");
    for (const c of citations) {
      const where = [c.page ? `page ${c.page}` : null, c.heading && c.heading.length ? c.heading.join(" / ") : null]
        .filter(Boolean).join(", ");
      ol.append(el("li", { value: String(c.index), title: `score ${c.score}` },
        `${c.document}` + (where ? ` (${where})` : "")));
    }
    box.append(el("div", { class: "citations", "aria-label": "Sources" }, el("strong", { text: "Sources" }), ol));
  }

  // ------------------------------------------------------------------ chat (streaming)

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    $("prompt").setAttribute("aria-busy", busy ? "true" : "false");
  }

  async function send() {
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    if (!state.key) { openKeyPanel("Enter an API key first."); return; }
    showError(null);
    if (!state.session && !(await newSession(text.slice(0, 60)))) return;
    $("prompt").value = "";
    const userBox = addMessage("user", text);
    const box = addMessage("assistant", "");
    const body = box.querySelector(".body");
    box.setAttribute("aria-busy", "true");
    const ctl = new AbortController();
    state.controller = ctl;
    setBusy(true);
    let answer = "";
    let usage = null;
    let citations = null;
    let lane = null;
    let stopped = false;
    const maxTokens = parseInt($("max-tokens").value, 10);
    const req = {
      messages: [{ role: "user", content: text }], stream: true, session_id: state.session,
      stream_options: { include_usage: true },
    };
    if (state.model) req.model = state.model;
    if (maxTokens > 0) req.max_tokens = maxTokens;
    const temperature = parseFloat($("temperature").value);
    if (temperature >= 0) req.temperature = temperature;
    if (state.attached.size) req.collections = [...state.attached];
    try {
      const r = await api("POST", "/v1/chat/completions", req, { raw: true, signal: ctl.signal });
      lane = r.headers.get("X-Strata-Lane");
      if (!r.ok) {
        const e = new ApiError(r.status, await r.json().catch(() => null));
        e.retryAfter = r.headers.get("Retry-After");
        throw e;
      }
      const reader = r.body.getReader();
      const dec = new TextDecoder();
      let buf = "";
      let done = false;
      while (!done) {
        const chunk = await reader.read();
        if (chunk.done) break;
        buf += dec.decode(chunk.value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const event = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data:")) continue; // comments (": ping") and other fields
            const payload = line.slice(5).trim();
            if (payload === "[DONE]") { done = true; break; }
            const obj = JSON.parse(payload);
            if (obj.error) throw new ApiError(obj.error.code === "rate_limit_exceeded" ? 429 : 502, obj);
            if (obj.usage) usage = obj.usage;
            if (obj.citations) citations = obj.citations;
            for (const ch of obj.choices || []) {
              const piece = ch.delta && ch.delta.content;
              if (piece) { answer += piece; renderMarkdown(answer, body); box.scrollIntoView({ block: "end" }); }
            }
          }
        }
      }
    } catch (e) {
      if (e.name === "AbortError") stopped = true;
      else showError(plainWords(e, e.retryAfter));
    } finally {
      state.controller = null;
      setBusy(false);
      box.removeAttribute("aria-busy");
    }
    renderMarkdown(answer, body);
    if (stopped) box.classList.add("incomplete");
    renderCitations(box, citations);
    const meta = [];
    if (lane) meta.push(`lane ${lane}`);
    if (usage) meta.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
    if (stopped) meta.push("stopped");
    if (meta.length) box.append(el("div", { class: "meta", text: meta.join(" - ") }));
    $("last-info").textContent = meta.join(" - ");
    if (!answer && !stopped && $("error").hidden === false) {
      // nothing was answered or stored: take the message back so it can be edited and resent
      box.remove();
      userBox.remove();
      if (!$("prompt").value) $("prompt").value = text;
    }
    bumpSession();
    $("prompt").focus();
  }

  function bumpSession() {
    const i = state.sessions.findIndex((s) => s.id === state.session);
    if (i > 0) { state.sessions.unshift(...state.sessions.splice(i, 1)); renderSessions(); }
  }

  function stop() {
    if (state.controller) state.controller.abort(); // closes the connection: the gateway cancels upstream
  }

  // ------------------------------------------------------------------ collections and uploads

  async function loadCollections() {
    const data = await guarded(() => api("GET", "/v1/collections"));
    if (!data) return;
    state.collections = data.data;
    renderCollections();
    for (const c of state.collections) loadDocuments(c);
  }

  function renderCollections() {
    const list = $("collection-list");
    list.replaceChildren();
    for (const c of state.collections) {
      const id = `coll-${c.id}`;
      const check = el("input", { type: "checkbox", id, "data-id": c.id });
      check.checked = state.attached.has(c.id);
      check.addEventListener("change", () => {
        if (check.checked) state.attached.add(c.id); else state.attached.delete(c.id);
      });
      const file = el("input", { type: "file", "aria-label": `Upload a document to ${c.name}`,
        accept: ".pdf,.docx,.txt,.md,.html,.htm" });
      file.addEventListener("change", () => { if (file.files.length) upload(c, file.files[0]); file.value = ""; });
      list.append(el("li", { class: "coll-item", "data-id": c.id },
        el("div", {}, check, " ", el("label", { for: id, text: c.name })),
        file,
        el("div", { class: "docs", id: `docs-${c.id}` })));
    }
  }

  async function loadDocuments(c) {
    const data = await guarded(() => api("GET", `/v1/collections/${encodeURIComponent(c.id)}/documents`));
    if (!data) return;
    for (const d of data.data) showDocument(d);
  }

  function percent(d) {
    const p = Number(d.progress) || 0;
    return d.status === "ready" ? 100 : Math.max(0, Math.min(100, p > 1 ? p : p * 100));
  }

  function showDocument(d) {
    const holder = $(`docs-${d.collection_id}`);
    if (!holder) return;
    let row = holder.querySelector(`[data-doc="${CSS.escape(d.id)}"]`);
    if (!row) {
      row = el("div", { class: "doc", "data-doc": d.id }, el("span", { class: "name" }), " ",
        el("span", { class: "status" }), el("progress", { max: "100", value: "0" }));
      holder.append(row);
    }
    row.querySelector(".name").textContent = d.name;
    row.querySelector(".status").textContent = d.status + (d.reason ? `: ${d.reason}` : "");
    row.dataset.status = d.status;
    const bar = row.querySelector("progress");
    bar.value = percent(d);
    bar.setAttribute("aria-label", `${d.name}: ${d.status}`);
    bar.hidden = d.status === "ready" || d.status === "failed";
    if (!bar.hidden) pollDocument(d);
  }

  function pollDocument(d) {
    if (state.polls.has(d.id)) return;
    const timer = setTimeout(async () => {
      state.polls.delete(d.id);
      const path = `/v1/collections/${encodeURIComponent(d.collection_id)}/documents/${encodeURIComponent(d.id)}`;
      try { showDocument(await api("GET", path)); } catch (e) { showError(plainWords(e)); }
    }, 500);
    state.polls.set(d.id, timer);
  }

  function upload(c, file) {
    // XMLHttpRequest for the upload's own progress; the document's processing is polled after
    const form = new FormData();
    form.append("file", file, file.name);
    const holder = $(`docs-${c.id}`);
    const bar = el("progress", { max: "100", value: "0", "aria-label": `uploading ${file.name}` });
    const row = el("div", { class: "doc uploading" }, el("span", { text: file.name }), " ",
      el("span", { class: "status", text: "uploading" }), bar);
    holder.append(row);
    const xhr = new XMLHttpRequest();
    xhr.open("POST", `/v1/collections/${encodeURIComponent(c.id)}/documents`);
    xhr.setRequestHeader("Authorization", "Bearer " + state.key);
    xhr.upload.addEventListener("progress", (ev) => { if (ev.lengthComputable) bar.value = (100 * ev.loaded) / ev.total; });
    xhr.addEventListener("load", () => {
      row.remove();
      let data = null;
      try { data = JSON.parse(xhr.responseText); } catch (_) { /* shown below */ }
      if (xhr.status >= 200 && xhr.status < 300 && data) showDocument(data);
      else showError(plainWords(new ApiError(xhr.status, data)));
    });
    xhr.addEventListener("error", () => { row.remove(); showError("The upload failed: the gateway could not be reached."); });
    xhr.send(form);
  }

  async function createCollection(name) {
    const c = await guarded(() => api("POST", "/v1/collections", { name }));
    if (!c) return;
    state.collections.push(c);
    state.attached.add(c.id);
    renderCollections();
  }

  // ------------------------------------------------------------------ operator view

  function fmt(v, digits) {
    return v === null || v === undefined ? "-" : Number(v).toFixed(digits);
  }

  function frameText(f) {
    const s = f && f.last_step;
    if (!s || s.wall === undefined) return "-";
    const ms = (x) => (x === undefined ? null : (x * 1000).toFixed(1));
    const parts = [`${ms(s.wall)} ms wall`];
    if (s.total !== undefined) {
      parts.push(`${f.last_step_tokens} tok`);
      for (const k of ["attn", "experts", "dense", "output"]) if (s[k] !== undefined) parts.push(`${k} ${ms(s[k])}`);
    }
    return parts.join(", ");
  }

  async function refreshOperator() {
    let data;
    try { data = await api("GET", "/v1/admin/overview"); } catch (e) {
      $("operator-status").textContent = plainWords(e) || "";
      return;
    }
    const rows = $("lane-rows");
    rows.replaceChildren();
    for (const l of data.lanes) {
      const f = l.figures || {};
      const prev = state.lastTokens.get(l.name);
      let tps = null;
      if (f.generation_tokens !== null && f.generation_tokens !== undefined) {
        if (prev && data.time > prev[0]) tps = Math.max(0, (f.generation_tokens - prev[1]) / (data.time - prev[0]));
        state.lastTokens.set(l.name, [data.time, f.generation_tokens]);
      }
      const st = l.draining ? "draining" : l.ready ? "ready" : (l.health || "down");
      const device = l.device ? l.device + (l.gpu_info && l.gpu_info.name ? ` (${l.gpu_info.name})` : "") : "-";
      const cores = l.cores ? `${l.cores.length} (${l.cores.join(",")})` : "-";
      rows.append(el("tr", { "data-lane": l.name },
        el("td", { text: l.name }),
        el("td", { class: l.ready ? "state-ready" : "state-down", text: st + (l.error ? ` - ${l.error}` : "") }),
        el("td", { text: device }), el("td", { text: cores }),
        el("td", { text: fmt(f.running, 0) }), el("td", { text: fmt(f.waiting, 0) }),
        el("td", { text: tps === null ? "..." : tps.toFixed(1) }),
        el("td", { text: frameText(f) })));
    }
    $("operator-status").textContent = "Updated " + new Date(data.time * 1000).toLocaleTimeString();
  }

  function showView(which) {
    const op = which === "operator";
    $("chat-view").hidden = op;
    $("operator-view").hidden = !op;
    $("tab-chat").setAttribute("aria-pressed", String(!op));
    $("tab-operator").setAttribute("aria-pressed", String(op));
    clearInterval(state.operatorTimer);
    state.operatorTimer = null;
    if (op) { refreshOperator(); state.operatorTimer = setInterval(refreshOperator, 2000); }
    else $("prompt").focus();
  }

  // ------------------------------------------------------------------ phone-width menu

  function closeMenu() {
    $("sidebar").classList.remove("open");
    $("menu-toggle").setAttribute("aria-expanded", "false");
  }

  // ------------------------------------------------------------------ wiring

  function wire() {
    $("key-button").addEventListener("click", () => {
      if ($("key-panel").hidden) openKeyPanel(); else $("key-panel").hidden = true;
    });
    $("key-form").addEventListener("submit", async (ev) => {
      ev.preventDefault();
      state.key = $("key-input").value.trim();
      localStorage.setItem(KEY_STORE, state.key);
      await start();
    });
    $("key-forget").addEventListener("click", () => {
      localStorage.removeItem(KEY_STORE);
      state.key = "";
      state.session = null;
      state.sessions = [];
      renderSessions();
      renderMessages([]);
      openKeyPanel("Key forgotten.");
    });
    $("session-new").addEventListener("click", async () => { await newSession(); closeMenu(); $("prompt").focus(); });
    $("collection-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const name = $("collection-name").value.trim();
      if (name) { createCollection(name); $("collection-name").value = ""; }
    });
    $("composer").addEventListener("submit", (ev) => { ev.preventDefault(); send(); });
    $("prompt").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); send(); }
    });
    $("stop").addEventListener("click", stop);
    document.addEventListener("keydown", (ev) => { if (ev.key === "Escape" && state.controller) stop(); });
    $("tab-chat").addEventListener("click", () => showView("chat"));
    $("tab-operator").addEventListener("click", () => showView("operator"));
    $("menu-toggle").addEventListener("click", () => {
      const open = $("sidebar").classList.toggle("open");
      $("menu-toggle").setAttribute("aria-expanded", String(open));
    });
  }

  wire();
  start();
})();
