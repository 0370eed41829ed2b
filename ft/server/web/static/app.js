// The chat page: a conversation with the served model over the OpenAI API of the same origin.
//
// It streams /v1/chat/completions (fetch + ReadableStream, server-sent events), renders the
// answer with markdown.js (text nodes only), and stops an answer by aborting the fetch: the
// connection closes and the server's request scope frees the request. With --api-key it asks
// for the key, keeps it in sessionStorage (localStorage when asked to remember it) and sends it
// as `Authorization: Bearer`. No markup is ever built from strings (the page's CSP enforces it).

import { renderMarkdown } from "./markdown.js";

const KEY_NAME = "ft.apiKey";
const RETRY_MS = 2000;
const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"), newChat: $("new-chat"), status: $("status"), system: $("system"),
  temperature: $("temperature"), maxTokens: $("max-tokens"), forgetKey: $("forget-key"),
  keyPanel: $("key-panel"), keyReason: $("key-reason"), apiKey: $("api-key"),
  rememberKey: $("remember-key"), messages: $("messages"), composer: $("composer"),
  prompt: $("prompt"), send: $("send"), stop: $("stop"),
};
const chat = { history: [], controller: null, ready: false, retry: null };

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function storedKey() {
  return sessionStorage.getItem(KEY_NAME) ?? localStorage.getItem(KEY_NAME);
}

function apiHeaders(json) {
  const headers = {};
  if (json) headers["Content-Type"] = "application/json";
  const key = storedKey();
  // Header values are byte strings: send the key's UTF-8 bytes, as the server compares them.
  if (key) headers.Authorization = `Bearer ${String.fromCharCode(...new TextEncoder().encode(key))}`;
  return headers;
}

/** The server's `{error: {message, code}}`, or the bare status (a proxy's HTML page, say). */
async function errorOf(response) {
  try {
    const { error } = await response.json();
    return { message: String(error?.message ?? `HTTP ${response.status}`), code: error?.code ?? null };
  } catch {
    return { message: `HTTP ${response.status}`, code: null };
  }
}

function setStatus(text, kind = "") {
  ui.status.textContent = text;
  ui.status.dataset.kind = kind;
}

function setBusy(busy) {
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
  ui.send.disabled = busy || !chat.ready;
}

function askForKey(reason) {
  chat.ready = false;
  setBusy(false);
  ui.keyReason.textContent = reason;
  ui.keyPanel.hidden = false;
  ui.apiKey.focus();
  setStatus("API key needed", "error");
}

/** Fills the model picker; until the server lists a model (it loads, it failed, a proxy in
 * front answers for it while it restarts) the page says why and asks again. */
async function loadModels() {
  clearTimeout(chat.retry); // one polling loop, however often the key is changed
  let models;
  try {
    const response = await fetch("/v1/models", { headers: apiHeaders(false) });
    if (response.status === 401) {
      askForKey(storedKey() ? "The server refused this API key." : "This server needs an API key.");
      return;
    }
    if (!response.ok) {
      const { message, code } = await errorOf(response);
      if (code === "model_loading") setStatus("the model is loading…");
      else setStatus(`models: ${message}; retrying`, "error");
      chat.retry = setTimeout(loadModels, code === "model_loading" ? 1000 : RETRY_MS);
      return;
    }
    models = (await response.json()).data;
    if (!Array.isArray(models) || !models.length) throw new Error("the server lists no model");
  } catch (e) {
    setStatus(`cannot list the models (${e.message}); retrying`, "error");
    chat.retry = setTimeout(loadModels, RETRY_MS);
    return;
  }
  const previous = ui.model.value;
  ui.model.replaceChildren(...models.map((m) => new Option(modelLabel(m), String(m.id))));
  if (models.some((m) => m.id === previous)) ui.model.value = previous;
  ui.model.disabled = false;
  ui.forgetKey.hidden = !storedKey();
  chat.ready = true;
  setBusy(chat.controller !== null);
  setStatus("ready", "ok");
}

/** A picker entry: the model's id, and its state when a server with several models says it is
 * not loaded (`unloaded` models load when asked; `failed` ones answer with their error). */
function modelLabel(model) {
  const state = model.status?.value;
  return state && state !== "loaded" ? `${model.id} (${state})` : String(model.id);
}

/** Relabels the picker with the models' states now (after an answer: a server with several
 * models may have loaded, swapped or unloaded some); a failure leaves the labels as they were. */
async function refreshModelStates() {
  try {
    const response = await fetch("/v1/models", { headers: apiHeaders(false) });
    if (!response.ok) return;
    const byId = new Map((await response.json()).data.map((m) => [String(m.id), m]));
    for (const option of ui.model.options) {
      const model = byId.get(option.value);
      if (model) option.textContent = modelLabel(model);
    }
  } catch {
    // the next answer asks again
  }
}

/** The `data:` payloads of a server-sent event stream, as they arrive. */
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) !== -1) {
        const frame = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = frame.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
        if (data.length) yield data.join("\n"); // comments (`: heartbeat`) carry no data
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

/** A message in the conversation view; an assistant's answer re-renders as it streams. */
class MessageView {
  constructor(role, text = "") {
    this.element = document.createElement("article");
    this.element.className = `message ${role}`;
    this.element.dataset.role = role;
    this.body = document.createElement("div");
    this.body.className = "body";
    this.meta = document.createElement("div");
    this.meta.className = "meta";
    this.element.append(this.body, this.meta);
    this.content = "";
    this.reasoning = "";
    this.pending = false;
    this.details = null;
    this.thought = null;
    if (role === "user") this.body.textContent = text;
    ui.messages.append(this.element);
  }

  update(content, reasoning) {
    this.content = content;
    this.reasoning = reasoning;
    if (!this.pending) {
      this.pending = true;
      requestAnimationFrame(() => this.render());
    }
  }

  render() {
    this.pending = false;
    // The reasoning's <details> is made once and kept: the reader may open it mid-stream.
    if (this.reasoning && !this.details) {
      this.details = document.createElement("details");
      const summary = document.createElement("summary");
      summary.textContent = "Reasoning";
      this.thought = document.createElement("div");
      this.thought.className = "reasoning";
      this.details.append(summary, this.thought);
    }
    if (this.details) this.thought.textContent = this.reasoning;
    // Follow the answer only for a reader at the end; one who scrolled up to read stays there.
    const view = ui.messages;
    const following = view.scrollHeight - view.scrollTop - view.clientHeight < 40;
    this.body.replaceChildren(...(this.details ? [this.details] : []), renderMarkdown(this.content));
    if (following) view.scrollTop = view.scrollHeight;
  }

  finish(state, facts) {
    this.render();
    this.element.dataset.state = state;
    this.meta.textContent = facts;
  }
}

function requestBody(history) {
  const messages = [];
  const system = ui.system.value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history);
  const body = { model: ui.model.value, messages, stream: true, stream_options: { include_usage: true } };
  const temperature = ui.temperature.valueAsNumber;
  if (Number.isFinite(temperature)) body.temperature = temperature;
  const maxTokens = ui.maxTokens.valueAsNumber;
  if (Number.isInteger(maxTokens) && maxTokens > 0) body.max_tokens = maxTokens;
  return body;
}

function describe(timing, state, error) {
  const facts = [];
  if (timing.first !== null) facts.push(`TTFT ${((timing.first - timing.sent) / 1000).toFixed(2)} s`);
  const tokens = timing.usage?.completion_tokens ?? timing.chunks;
  const decodeS = (timing.ended - timing.first) / 1000;
  if (timing.first !== null && tokens > 1 && decodeS > 0) {
    const rate = (tokens - 1) / decodeS;
    facts.push(`${timing.usage ? "" : "≈"}${rate.toFixed(1)} tokens/s`);
    facts.push(`${timing.usage ? "" : "≈"}${tokens} tokens`);
  }
  if (state === "stopped") facts.push("stopped");
  else if (timing.finish) facts.push(`finish: ${timing.finish}`);
  if (error) facts.push(`error: ${error}`);
  return facts.join(" · ");
}

async function send() {
  const text = ui.prompt.value.trim();
  if (!text || chat.controller || !chat.ready) return;
  ui.prompt.value = "";
  const history = chat.history; // New chat replaces it: this answer then belongs to no chat
  history.push({ role: "user", content: text });
  new MessageView("user", text);
  const view = new MessageView("assistant");
  view.element.dataset.state = "streaming";
  ui.messages.scrollTop = ui.messages.scrollHeight; // a new question shows its answer
  const controller = new AbortController();
  chat.controller = controller;
  setBusy(true);
  const timing = { sent: performance.now(), first: null, ended: 0, chunks: 0, usage: null, finish: null };
  let content = "";
  let reasoning = "";
  let state = "done";
  let error = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: apiHeaders(true), body: JSON.stringify(requestBody(history)), signal: controller.signal,
    });
    if (!response.ok) throw new ApiError(response.status, (await errorOf(response)).message);
    let complete = false;
    for await (const data of sseData(response.body)) {
      if (data === "[DONE]") {
        complete = true;
        break;
      }
      const event = JSON.parse(data);
      if (event.error) throw new ApiError(0, event.error.message);
      if (event.usage) timing.usage = event.usage;
      const choice = event.choices?.[0];
      if (!choice) continue;
      const piece = choice.delta?.content ?? "";
      const thought = choice.delta?.reasoning_content ?? "";
      if (piece || thought) {
        timing.first ??= performance.now();
        timing.chunks += 1;
        content += piece;
        reasoning += thought;
        view.update(content, reasoning);
      }
      if (choice.finish_reason) timing.finish = choice.finish_reason;
    }
    // A connection closed cleanly mid-answer (a proxy's timeout, a restart) is no answer.
    if (!complete) throw new Error("the stream ended before the answer did");
  } catch (e) {
    if (controller.signal.aborted) {
      state = "stopped";
    } else {
      state = "error";
      error = e.message;
      if (e.status === 401) askForKey("The server refused the API key.");
    }
  } finally {
    timing.ended = performance.now();
    chat.controller = null;
  }
  if (state !== "error" && content) {
    history.push({ role: "assistant", content });
  } else {
    history.pop(); // no answer: keep the turns alternating for the next request
  }
  view.finish(state, describe(timing, state, error));
  setBusy(false);
  refreshModelStates();
  if (state !== "error") ui.prompt.focus();
}

function newChat() {
  chat.controller?.abort();
  chat.history = [];
  ui.messages.replaceChildren();
  ui.prompt.focus();
}

ui.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  send();
});
ui.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
ui.stop.addEventListener("click", () => chat.controller?.abort());
ui.newChat.addEventListener("click", newChat);
ui.keyPanel.addEventListener("submit", (e) => {
  e.preventDefault();
  const key = ui.apiKey.value.trim();
  if (!key) return;
  sessionStorage.removeItem(KEY_NAME);
  localStorage.removeItem(KEY_NAME);
  (ui.rememberKey.checked ? localStorage : sessionStorage).setItem(KEY_NAME, key);
  ui.apiKey.value = "";
  ui.keyPanel.hidden = true;
  setStatus("connecting…");
  loadModels();
});
ui.forgetKey.addEventListener("click", () => {
  sessionStorage.removeItem(KEY_NAME);
  localStorage.removeItem(KEY_NAME);
  ui.forgetKey.hidden = true;
  loadModels();
});

loadModels();
