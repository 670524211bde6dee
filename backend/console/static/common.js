// Shared by every console page: the key, API calls, server-sent events, the page frame.
// The key lives in sessionStorage only: never in a URL, a cookie or localStorage.

import { LANGUAGES, language, locale, markLanguage, setLanguage, strings } from "/console/i18n.js";
import TEXT from "/console/text/common.js";

const T = strings(TEXT);
const KEY_ITEM = "bridge.key";
const SETTINGS_ITEM = "bridge.settings";

export function getKey() {
  return sessionStorage.getItem(KEY_ITEM);
}

export function setKey(key) {
  sessionStorage.setItem(KEY_ITEM, key);
  whoamiCache = null;
}

export function clearKey() {
  sessionStorage.removeItem(KEY_ITEM);
  whoamiCache = null;
}

/** An API error in the bridge's (OpenAI's) shape: {"error": {message, type, param, code}}. */
export class ApiError extends Error {
  constructor(status, message, code = null, param = null) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
    this.param = param;
  }
}

async function errorOf(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not JSON: the status says enough
  }
  const error = body && typeof body === "object" ? body.error : null;
  const message = (error && error.message) || `${response.status} ${response.statusText}`;
  if (response.status === 401) {
    window.dispatchEvent(new CustomEvent("bridge:unauthorized"));
  }
  return new ApiError(response.status, message, error && error.code, error && error.param);
}

function request(method, body, signal, headers) {
  const init = { method, signal, headers: { ...headers } };
  const key = getKey();
  if (key) init.headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  return init;
}

/** JSON in, JSON out (null for 204); throws ApiError. */
export async function api(path, { method = "GET", body, signal, headers = {} } = {}) {
  const response = await fetch(path, request(method, body, signal, headers));
  if (!response.ok) throw await errorOf(response);
  if (response.status === 204) return null;
  return response.json();
}

/** The Response of a streamed route (checked ok), for readSSE. */
export async function apiStream(path, { method = "POST", body, signal, headers = {} } = {}) {
  const response = await fetch(path, request(method, body, signal, headers));
  if (!response.ok) throw await errorOf(response);
  return response;
}

/** Reads a text/event-stream body; calls onEvent({event, data, id}) per event. */
export async function readSSE(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const event = parseEvent(block);
      if (event) onEvent(event);
    }
  }
}

function parseEvent(block) {
  let event = "message";
  let id = null;
  const data = [];
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") event = value;
    else if (field === "data") data.push(value);
    else if (field === "id") id = value;
  }
  if (!data.length) return null;
  const text = data.join("\n");
  let parsed = text;
  try {
    parsed = JSON.parse(text);
  } catch {
    // not JSON (the OpenAI stream's [DONE]): the text itself
  }
  return { event, data: parsed, id };
}

let whoamiCache = null;

/** Who the key is: {key_id, name, scopes, device_ids, is_admin}. Cached per key. */
export function whoami() {
  if (!whoamiCache) {
    whoamiCache = api("/api/whoami").catch((error) => {
      whoamiCache = null;
      throw error;
    });
  }
  return whoamiCache;
}

// As the server has it: a key that may call devices may read them.
const IMPLIED_BY = { "devices:read": ["devices:call"] };

export function can(me, scope) {
  if (!me) return false;
  if (me.is_admin || me.scopes.includes("admin")) return true;
  return [scope, ...(IMPLIED_BY[scope] || [])].some((held) => me.scopes.includes(held));
}

/** The chat and guardrail models this browser asked for (null: the server's default). */
export function settings() {
  try {
    const stored = JSON.parse(localStorage.getItem(SETTINGS_ITEM) || "{}");
    return { chat_model: stored.chat_model || null, guardrail_model: stored.guardrail_model || null };
  } catch {
    return { chat_model: null, guardrail_model: null };
  }
}

export function saveSettings(values) {
  localStorage.setItem(SETTINGS_ITEM, JSON.stringify(values));
}

/**
 * A DOM element. attrs: class, text, on: {event: handler}, anything else as an attribute
 * (true: present, false/null/undefined: absent). Children: nodes or strings (as text).
 */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "text") node.textContent = value;
    else if (name === "class") node.className = value;
    else if (name === "on") {
      for (const [event, handler] of Object.entries(value)) node.addEventListener(event, handler);
    } else if (name === "value") node.value = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/** Says `text` to screen readers (a polite live region shared by the page). */
export function announce(text) {
  const region = document.getElementById("announcer");
  if (!region) return;
  region.textContent = "";
  // A new text node after a tick: screen readers announce a change, not a repeat.
  setTimeout(() => {
    region.textContent = text;
  }, 50);
}

const NAV = [
  { path: "/", label: T.navChat, scope: "chat:use" },
  { path: "/conversations", label: T.navConversations, scope: "chat:use" },
  { path: "/settings", label: T.navSettings, scope: "chat:use" },
  { path: "/devices", label: T.navDevices, scope: "devices:read" },
  { path: "/talk", label: T.navTalk, scope: "console:talk" },
  { path: "/mcp-servers", label: T.navMcpServers, scope: "devices:read" },
  { path: "/firmware", label: T.navFirmware, scope: "admin" },
  { path: "/activations", label: T.navActivations, scope: "admin" },
  { path: "/keys", label: T.navKeys, scope: "admin" },
  { path: "/audit", label: T.navAudit, scope: "devices:read" },
];

function header(me) {
  const top = document.getElementById("top");
  top.replaceChildren();
  top.append(el("a", { class: "skip", href: "#main", text: T.skip }));
  top.append(el("span", { class: "brand", text: "esp32-mcp-bridge" }));
  if (!me) {
    top.append(languageSwitch());
    return;
  }
  const links = NAV.filter((item) => can(me, item.scope)).map((item) =>
    el(
      "li",
      {},
      el("a", {
        href: item.path,
        text: item.label,
        "aria-current": location.pathname === item.path ? "page" : null,
      }),
    ),
  );
  top.append(el("nav", { "aria-label": T.navLabel }, el("ul", {}, links)));
  const who = me.is_admin ? T.adminToken : T.keyNamed(me.name || me.key_id);
  top.append(
    el(
      "div",
      { class: "identity" },
      el("span", { text: who }),
      el("button", { type: "button", class: "link", text: T.logOut, on: { click: logOut } }),
    ),
  );
  top.append(languageSwitch());
}

/** The language switch of the header: a labelled select; a change reloads the page in it. */
function languageSwitch() {
  const select = el(
    "select",
    { id: "language-switch", on: { change: () => setLanguage(select.value) } },
    LANGUAGES.map(([code, name]) => el("option", { value: code, lang: code, text: name })),
  );
  select.value = language();
  return el("div", { class: "language-switch" }, el("label", { for: "language-switch", text: T.language }), select);
}

function logOut() {
  clearKey();
  location.reload();
}

// Where `serve` keeps the admin token (backend/auth.py ADMIN_TOKEN_FILE, in the data directory),
// and a key for every console page: chat, devices (and their tools), talk.
const ADMIN_TOKEN_FILE = "admin.token";
const CONSOLE_KEY_COMMAND =
  'esp32-bridge keys create "web console" --scope chat:use --scope devices:read --scope devices:call --scope console:talk';

function loginForm(main, title, problem, onKey) {
  const input = el("input", {
    id: "api-key",
    type: "password",
    autocomplete: "off",
    spellcheck: "false",
    required: true,
    "aria-describedby": "api-key-help",
  });
  const error = el("p", { id: "login-error", class: "error", role: "alert" });
  if (problem) error.textContent = problem;
  const form = el(
    "form",
    { class: "card login", "aria-labelledby": "login-title" },
    el("h1", { id: "login-title", text: T.loginTitle(title) }),
    el("label", { for: "api-key", text: T.keyLabel }),
    input,
    el(
      "div",
      { id: "api-key-help", class: "hint" },
      el("p", { text: T.keyKept }),
      el(
        "p",
        {},
        T.tokenFile(el("code", { text: ADMIN_TOKEN_FILE }), el("code", { text: `~/.local/share/esp32-bridge/${ADMIN_TOKEN_FILE}` })),
      ),
      el("p", {}, T.createKey, el("code", { id: "api-key-command", text: CONSOLE_KEY_COMMAND })),
    ),
    error,
    el("button", { type: "submit", text: T.logIn }),
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const key = input.value.trim();
    if (key) onKey(key);
  });
  main.replaceChildren(form);
  input.focus();
}

/**
 * Draws the frame (header, navigation) and the login form until a key is accepted, then
 * calls render(main, me). A 401 from any later call brings the login form back.
 */
export function startPage(title, render) {
  markLanguage();
  document.title = `${title} · esp32-mcp-bridge`;
  const main = document.getElementById("main");
  if (!document.getElementById("announcer")) {
    document.body.append(el("div", { id: "announcer", class: "visually-hidden", "aria-live": "polite" }));
  }
  let rendered = false;

  async function enter(problem) {
    if (!getKey()) {
      header(null);
      loginForm(main, title, problem, (key) => {
        setKey(key);
        enter(null);
      });
      return;
    }
    let me;
    try {
      me = await whoami();
    } catch (error) {
      if (error instanceof ApiError && error.status === 401) {
        clearKey();
        enter(T.keyRefused);
      } else {
        main.replaceChildren(el("p", { class: "error", role: "alert", text: T.noAnswer(error.message) }));
      }
      return;
    }
    header(me);
    main.replaceChildren();
    rendered = true;
    await render(main, me);
  }

  window.addEventListener("bridge:unauthorized", () => {
    if (!rendered) return;
    rendered = false;
    clearKey();
    enter(T.keyStopped);
  });
  enter(null);
}

/** The first console page (in the navigation's order) this key may use, null for none: where
 * a key lands when the page it opened is not for it (a devices-only key on the chat page). */
export function firstPage(me) {
  const page = NAV.find((item) => can(me, item.scope));
  return page ? page.path : null;
}

/** A notice that the key cannot use this page, naming the scope it lacks. */
export function lacksScope(main, scope) {
  main.replaceChildren(el("p", { class: "notice", role: "status" }, T.lacksScope(scope)));
}

/** "1.2 s", "850 ms" (in Vietnamese "1,2 giây"). */
export function formatMs(ms) {
  if (ms === null || ms === undefined) return "";
  return ms >= 1000 ? T.seconds((ms / 1000).toFixed(1)) : T.milliseconds(String(Math.round(ms)));
}

/** "3 min ago" for an ISO time, or the time itself when older than a day. */
export function ago(iso) {
  if (!iso) return T.never;
  const seconds = (Date.now() - Date.parse(iso)) / 1000;
  if (!Number.isFinite(seconds)) return iso;
  if (seconds < 60) return T.justNow;
  if (seconds < 3600) return T.minutesAgo(Math.floor(seconds / 60));
  if (seconds < 86400) return T.hoursAgo(Math.floor(seconds / 3600));
  return new Date(iso).toLocaleString(locale());
}
