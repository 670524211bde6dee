// The chat page (the front page): conversations, answers streamed from
// POST /api/chat/stream, device tool events inline, sources, a risky tool's confirmation.
import {
  ApiError,
  announce,
  api,
  apiStream,
  can,
  el,
  firstPage,
  formatMs,
  lacksScope,
  readSSE,
  settings,
  startPage,
} from "/console/common.js";
import { locale, strings } from "/console/i18n.js";
import TEXT from "/console/text/chat.js";

const T = strings(TEXT);

// The open conversation survives a reload of this tab (its messages are re-read from the API).
const CONVERSATION_ITEM = "bridge.chat.conversation";
const DEVICE_ITEM = "bridge.chat.device";
const LANGUAGES = { en: T.english, vi: T.vietnamese };
// The stored answer ends with its sources section: a heading, then "N. title - link" lines.
const SOURCE_HEADINGS = ["Sources:", "Nguồn tham khảo:"];
const SOURCE_LINE = /^\d+\. (.*) - (\S+)$/;

// The question the bridge appends to an answer that waits for a confirmation (backend/chat/
// confirm.py): the page asks with its own box and buttons instead, so it is not said twice.
const QUESTION_STARTS = ["This needs your confirmation:", "Thao tác này cần bạn xác nhận:", "Did you want me to", "Bạn muốn tôi"];
// A tool event for a call held back until the user confirms it (backend/chat/tools.py).
const NOT_RUN_YET = /^not run yet\b/;

const state = {
  me: null,
  conversationId: sessionStorage.getItem(CONVERSATION_ITEM),
  busy: false,
  controller: null, // aborts the answer being streamed (the Stop button)
  pinned: true, // the log follows new text while its end is in view
  nodes: {},
};

startPage(T.title, async (main, me) => {
  state.me = me;
  if (!can(me, "chat:use")) {
    // A key for another part of the console (devices only, say) lands there, not here.
    const other = location.pathname === "/" ? firstPage(me) : null;
    if (other && other !== "/") {
      location.replace(other);
      return;
    }
    lacksScope(main, "chat:use");
    return;
  }
  main.replaceChildren(layout());
  // The message box is usable at once for a new conversation; a stored one is read first, so
  // that a message typed meanwhile is not wiped by the history arriving after it.
  const lists = Promise.all([loadConversations(), loadDevices()]);
  if (state.conversationId) await openConversation(state.conversationId, { quiet: true });
  state.nodes.input.disabled = false;
  state.nodes.send.disabled = false;
  await lists;
});

// ---- layout ------------------------------------------------------------------------------------

function layout() {
  const n = state.nodes;
  n.list = el("ul", { class: "conversations", "aria-labelledby": "conversations-title" });
  n.listStatus = el("p", { class: "hint", role: "status" });
  const aside = el(
    "nav",
    { class: "card chat-side", "aria-labelledby": "conversations-title" },
    el("h2", { id: "conversations-title", text: T.conversations }),
    el("button", { type: "button", id: "new-conversation", text: T.newConversation, on: { click: newConversation } }),
    n.listStatus,
    n.list,
  );

  n.title = el("h1", { id: "chat-title", text: T.newConversation });
  n.device = el("select", { id: "chat-device", "aria-describedby": "chat-device-help" });
  n.device.append(el("option", { value: "", text: T.noDevice }));
  n.device.addEventListener("change", () => sessionStorage.setItem(DEVICE_ITEM, n.device.value));
  const devicePicker = el(
    "div",
    { class: "device-picker" },
    el("label", { for: "chat-device", text: T.device }),
    n.device,
    el("span", { id: "chat-device-help", class: "hint", text: T.deviceHelp }),
  );
  // role=log: new messages are read as they are added; an answer being streamed is aria-busy,
  // so a screen reader reads it once it is complete rather than word by word.
  n.log = el("div", {
    id: "chat-log",
    class: "chat-log",
    role: "log",
    "aria-live": "polite",
    "aria-relevant": "additions text",
    "aria-labelledby": "chat-title",
    tabindex: "0",
  });
  n.empty = el("p", { class: "hint", text: T.empty });
  n.log.append(n.empty);
  // The log keeps its end in view while the reader is there: a line added or grown (a token,
  // the badges, a confirmation) is never left below the visible part.
  n.log.addEventListener("scroll", () => {
    state.pinned = n.log.scrollHeight - n.log.scrollTop - n.log.clientHeight < 24;
  });
  new MutationObserver(() => keepPinned()).observe(n.log, { childList: true, subtree: true, characterData: true });

  n.input = el("textarea", {
    id: "chat-input",
    rows: "2",
    maxlength: "4000",
    required: true,
    disabled: true,
    "aria-describedby": "chat-input-help",
  });
  n.input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      n.form.requestSubmit();
    }
  });
  n.send = el("button", { type: "submit", id: "chat-send", text: T.send, disabled: true });
  // While an answer streams the message box stays usable (the next message can be written);
  // Stop ends the answer.
  n.stop = el("button", { type: "button", id: "chat-stop", class: "secondary", text: T.stop, hidden: true, on: { click: stop } });
  n.help = el("span", { id: "chat-input-help", class: "hint", text: T.inputHelp });
  n.form = el(
    "form",
    { class: "chat-form", "aria-label": T.sendForm },
    el("label", { for: "chat-input", text: T.message }),
    n.input,
    n.help,
    el("div", { class: "row" }, n.send, n.stop),
  );
  n.form.addEventListener("submit", (event) => {
    event.preventDefault();
    if (state.busy) {
      announce(T.stillComing);
      return;
    }
    const text = n.input.value.trim();
    if (text) send(text);
  });

  const chat = el("section", { class: "chat-main", "aria-labelledby": "chat-title" }, n.title, devicePicker, n.log, n.form);
  return el("div", { class: "chat-layout" }, aside, chat);
}

// ---- conversations -----------------------------------------------------------------------------

async function loadConversations() {
  const n = state.nodes;
  try {
    const page = await api("/v1/conversations?limit=50");
    n.list.replaceChildren(...page.data.map(conversationItem));
    const current = page.data.find((item) => item.id === state.conversationId);
    if (current) n.title.textContent = current.title || T.conversation;
    n.listStatus.textContent = page.data.length ? "" : T.noConversations;
  } catch (error) {
    n.listStatus.textContent = T.cannotList(error.message);
  }
  markCurrent();
}

function conversationItem(conversation) {
  const label = conversation.title || conversation.id;
  const when = new Date(conversation.updated_at).toLocaleString(locale());
  return el(
    "li",
    {},
    el(
      "button",
      {
        type: "button",
        class: "conversation",
        "data-id": conversation.id,
        on: { click: () => openConversation(conversation.id) },
      },
      el("span", { class: "conversation-title", text: label }),
      el("span", { class: "hint", text: T.messagesWhen(conversation.message_count, when) }),
    ),
  );
}

function markCurrent() {
  for (const button of state.nodes.list.querySelectorAll("button.conversation")) {
    const current = button.dataset.id === state.conversationId;
    button.setAttribute("aria-current", current ? "true" : "false");
  }
}

function setConversation(id) {
  state.conversationId = id;
  if (id) sessionStorage.setItem(CONVERSATION_ITEM, id);
  else sessionStorage.removeItem(CONVERSATION_ITEM);
  markCurrent();
}

function newConversation() {
  if (state.busy) return;
  setConversation(null);
  state.nodes.title.textContent = T.newConversation;
  state.nodes.log.replaceChildren(state.nodes.empty);
  state.nodes.input.focus();
  announce(T.newConversation);
}

async function openConversation(id, { quiet = false } = {}) {
  if (state.busy) return;
  const n = state.nodes;
  let conversation;
  try {
    conversation = await api(`/v1/conversations/${encodeURIComponent(id)}`);
  } catch (error) {
    if (error instanceof ApiError && error.status === 404) {
      setConversation(null); // deleted elsewhere: start afresh
      return;
    }
    n.log.replaceChildren(el("p", { class: "error", role: "alert", text: T.cannotOpen(error.message) }));
    return;
  }
  setConversation(conversation.id);
  n.title.textContent = conversation.title || T.conversation;
  if (conversation.device_id) selectDevice(conversation.device_id);
  n.log.replaceChildren(...conversation.messages.map(storedMessage));
  if (!conversation.messages.length) n.log.append(n.empty);
  state.pinned = true;
  keepPinned();
  if (!quiet) {
    announce(T.opened(n.title.textContent, conversation.messages.length));
    n.input.focus();
  }
}

function storedMessage(message) {
  if (message.role === "user") return userBubble(message.content);
  const meta = message.metadata || {};
  const { text, sources } = splitSources(message.content, meta.sources || []);
  const bubble = assistantBubble();
  bubble.raw = text;
  renderText(bubble);
  if (meta.tools && meta.tools.length) {
    bubble.tools.append(el("li", { class: "tool-event", text: T.toolsUsed(meta.tools.join(", ")) }));
  }
  showSources(bubble, sources);
  showMeta(bubble, { language: meta.language, offline: meta.offline });
  return bubble.node;
}

/** The answer text and its sources from a stored answer (the section is part of the text). */
function splitSources(content, links) {
  if (!links.length) return { text: content, sources: [] };
  const at = content.lastIndexOf("\n\n");
  const block = at >= 0 ? content.slice(at + 2).split("\n") : [];
  if (!block.length || !SOURCE_HEADINGS.includes(block[0].trim())) return { text: content, sources: [] };
  const sources = block.slice(1).map((line) => {
    const match = SOURCE_LINE.exec(line.trim());
    return match ? { title: match[1], link: match[2] } : { title: line, link: "" };
  });
  return { text: content.slice(0, at), sources };
}

// ---- devices -----------------------------------------------------------------------------------

async function loadDevices() {
  const select = state.nodes.device;
  if (!can(state.me, "devices:read")) {
    select.disabled = true;
    select.title = T.noDevicesScope;
    return;
  }
  try {
    const page = await api("/api/devices?online=true&limit=500");
    for (const device of page.devices) {
      const name = device.server_info && device.server_info.name;
      const label = name ? `${device.device_id} (${name})` : device.device_id;
      const known = [...select.options].find((option) => option.value === device.device_id);
      if (known) known.textContent = label; // put there by the open conversation
      else select.append(el("option", { value: device.device_id, text: label }));
    }
  } catch (error) {
    select.title = T.cannotListDevices(error.message);
  }
  if (!select.value) selectDevice(sessionStorage.getItem(DEVICE_ITEM) || "");
}

function selectDevice(deviceId) {
  const select = state.nodes.device;
  if (!deviceId) {
    select.value = "";
    return;
  }
  if (![...select.options].some((option) => option.value === deviceId)) {
    select.append(el("option", { value: deviceId, text: T.notOnline(deviceId) }));
  }
  select.value = deviceId;
}

// ---- a turn ------------------------------------------------------------------------------------

function userBubble(text) {
  return el("div", { class: "message user" }, el("h3", { class: "visually-hidden", text: T.you }), el("p", { class: "text", text }));
}

function assistantBubble() {
  const text = el("div", { class: "text md" });
  const tools = el("ul", { class: "tools", "aria-label": T.deviceTools });
  const sources = el("div", { class: "sources" });
  const meta = el("p", { class: "meta" });
  const extra = el("div", { class: "extra" });
  const node = el(
    "div",
    { class: "message assistant" },
    el("h3", { class: "visually-hidden", text: T.assistant }),
    tools,
    text,
    sources,
    meta,
    extra,
  );
  return { node, text, tools, sources, meta, extra, pending: new Map(), raw: "", queued: false };
}

async function send(text) {
  if (state.busy) return;
  const n = state.nodes;
  n.empty.remove();
  n.log.querySelectorAll(".confirm").forEach((box) => box.remove());
  n.log.append(userBubble(text));
  n.input.value = "";
  const bubble = assistantBubble();
  bubble.node.setAttribute("aria-busy", "true");
  n.log.append(bubble.node);
  state.pinned = true;
  keepPinned();
  const controller = new AbortController();
  setBusy(true, controller);

  // A new conversation gets its id here: without one, a turn naming a device would continue
  // that device's own conversation instead of starting a new one.
  if (!state.conversationId) setConversation(newConversationId());
  const body = { message: text, conversation_id: state.conversationId, ...chosenModels() };
  if (n.device.value) body.device_id = n.device.value;
  let done = null;
  try {
    const response = await apiStream("/api/chat/stream", { body, signal: controller.signal });
    const id = response.headers.get("X-Conversation-Id");
    if (id) setConversation(id);
    await readSSE(response, ({ data }) => {
      if (data && data.type === "done") done = data;
      onEvent(bubble, data);
    });
  } catch (error) {
    if (controller.signal.aborted) {
      bubble.extra.append(el("p", { class: "hint stopped", text: T.stopped }));
      announce(T.answerStopped);
    } else {
      bubble.extra.append(el("p", { class: "error", role: "alert", text: T.requestFailed(error.message) }));
    }
  } finally {
    renderText(bubble, done && done.metadata && done.metadata.confirmation);
    bubble.node.setAttribute("aria-busy", "false");
    setBusy(false, null);
  }
  if (done) {
    if (done.conversation_id) setConversation(done.conversation_id);
    finish(bubble, done.metadata || {});
    await loadConversations();
  } else if (controller.signal.aborted) {
    await loadConversations();
  }
}

function stop() {
  if (state.controller) state.controller.abort();
}

/** Keeps the end of the log in view while the reader has not scrolled up. */
function keepPinned() {
  const log = state.nodes.log;
  if (log && state.pinned) log.scrollTop = log.scrollHeight;
}

/** "web-" and 24 random hex digits (crypto.randomUUID needs a secure context; this does not). */
function newConversationId() {
  const bytes = crypto.getRandomValues(new Uint8Array(12));
  return `web-${[...bytes].map((byte) => byte.toString(16).padStart(2, "0")).join("")}`;
}

/** The models this browser chose on the settings page (omitted: the server's). */
function chosenModels() {
  const chosen = settings();
  const body = {};
  if (chosen.chat_model) body.chat_model = chosen.chat_model;
  if (chosen.guardrail_model) body.guardrail_model = chosen.guardrail_model;
  return body;
}

function setBusy(busy, controller) {
  const n = state.nodes;
  const hadFocus = document.activeElement === n.stop;
  state.busy = busy;
  state.controller = controller;
  n.send.disabled = busy;
  n.send.textContent = busy ? T.answering : T.send;
  n.stop.hidden = !busy;
  if (!busy && (hadFocus || document.activeElement === document.body)) n.input.focus();
}

function onEvent(bubble, data) {
  if (!data || typeof data !== "object") return;
  if (data.type === "token") {
    bubble.raw += data.token;
    queueText(bubble);
  } else if (data.type === "mcp_tool") {
    toolEvent(bubble, data);
  } else if (data.type === "sources") {
    showSources(bubble, data.items || []);
  } else if (data.type === "error") {
    bubble.extra.append(el("p", { class: "error", role: "alert", text: data.error || T.bridgeError }));
  }
}

function toolEvent(bubble, data) {
  const status = data.status;
  let item = bubble.pending.get(data.tool);
  if (status === "started" || !item) {
    item = el("li", { class: "tool-event" });
    bubble.tools.append(item);
  }
  // A risky call held back for the user is waiting, not failed: the box below asks.
  const waiting = status === "error" && NOT_RUN_YET.test(data.error || "");
  const shown = waiting ? "waiting" : status;
  item.dataset.status = shown;
  item.className = `tool-event ${shown}`;
  const parts = [el("span", { class: "tool-name", text: data.tool })];
  if (waiting) {
    bubble.pending.delete(data.tool);
    parts.push(el("span", { class: "badge waiting", text: T.waiting }));
  } else if (status === "started") {
    bubble.pending.set(data.tool, item);
    item.dataset.arguments = JSON.stringify(data.arguments || {});
    parts.push(el("span", { class: "badge", text: T.running }));
  } else {
    bubble.pending.delete(data.tool);
    const label = status === "completed" ? (data.is_error ? T.toolError : T.done) : T.failed;
    parts.push(el("span", { class: `badge ${status === "completed" && !data.is_error ? "online" : "warn"}`, text: label }));
    if (data.duration_ms !== null && data.duration_ms !== undefined) {
      parts.push(el("span", { class: "duration hint", text: formatMs(data.duration_ms) }));
    }
  }
  const args = item.dataset.arguments;
  if (args && args !== "{}") parts.push(el("code", { class: "arguments", text: args }));
  if (status === "completed") {
    const result = (data.result || []).map((part) => part.text || "").join("\n");
    parts.push(el("pre", { class: "result", text: result }));
  } else if (status === "error" && !waiting) {
    parts.push(el("p", { class: "error", text: data.error }));
  }
  item.replaceChildren(...parts);
}

function showSources(bubble, items) {
  if (!items.length) return;
  const list = el("ol", {});
  for (const item of items) {
    const href = safeLink(item.link);
    const title = item.title || item.link;
    list.append(el("li", {}, href ? el("a", { href, rel: "noopener noreferrer", target: "_blank", text: title }) : el("span", { text: title })));
  }
  bubble.sources.replaceChildren(el("h4", { text: T.sources }), list);
}

/** The link when it is http(s); anything else (javascript:, data:) is shown, never followed. */
function safeLink(link) {
  try {
    const url = new URL(link);
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  } catch {
    return null;
  }
}

function showMeta(bubble, { language, offline, offlineReason }) {
  const badges = [];
  if (language) badges.push(el("span", { class: "badge language", text: T.answerLanguage(LANGUAGES[language] || language) }));
  if (offline) {
    badges.push(el("span", { class: "badge warn offline-badge", title: offlineReason || null, text: T.offline }));
  }
  bubble.meta.replaceChildren(...badges);
}

function finish(bubble, metadata) {
  showMeta(bubble, { language: metadata.language, offline: metadata.offline, offlineReason: metadata.offline_reason });
  if (metadata.offline && metadata.offline_reason) {
    bubble.meta.append(el("span", { class: "hint", text: ` ${metadata.offline_reason}` }));
  }
  if (metadata.confirmation) askConfirmation(bubble, metadata.confirmation);
  announce(metadata.offline ? T.completeOffline : T.complete);
}

function askConfirmation(bubble, confirmation) {
  const args = Object.entries(confirmation.arguments || {});
  const what = args.length
    ? [T.withSettings, ...args.flatMap(([name, value], at) => [at ? ", " : "", `${name} `, el("code", { text: typeof value === "string" ? value : JSON.stringify(value) })])]
    : [T.withNoSettings];
  const title = el("p", { class: "confirm-title" }, el("span", { class: "badge waiting", text: T.waiting }), T.nothingRun);
  const confirm = el("button", { type: "button", class: "danger", text: T.confirm, on: { click: () => answerConfirmation(box, "yes") } });
  const cancel = el("button", { type: "button", class: "secondary", text: T.cancel, on: { click: () => answerConfirmation(box, "no") } });
  const box = el(
    "div",
    { class: "confirm", role: "group", "aria-label": T.confirmation, tabindex: "-1" },
    title,
    el("p", {}, T.wantsTool(el("code", { text: confirmation.tool }), what)),
    el("p", { class: "hint", text: T.confirmHint }),
    el("div", { class: "row" }, confirm, cancel),
  );
  bubble.extra.append(box);
  state.pinned = true;
  keepPinned();
  box.scrollIntoView({ block: "nearest" });
  box.focus({ preventScroll: true });
  announce(T.toolWaiting(confirmation.tool));
}

function answerConfirmation(box, answer) {
  if (state.busy) return;
  box.remove();
  send(answer);
}

// ---- Markdown ----------------------------------------------------------------------------------
// A small Markdown subset (paragraphs, bold, italic, inline code, code blocks, lists, links),
// built as DOM nodes from text: no HTML of the model's reaches the page, and only http(s) links
// become links.

function queueText(bubble) {
  if (bubble.queued) return;
  bubble.queued = true;
  requestAnimationFrame(() => {
    bubble.queued = false;
    renderText(bubble);
  });
}

function renderText(bubble, confirmation = null) {
  if (confirmation) bubble.raw = withoutQuestion(bubble.raw, confirmation);
  bubble.text.replaceChildren(...markdown(bubble.raw));
}

/** The answer without the bridge's question about a pending call (the box asks it). */
function withoutQuestion(text, confirmation) {
  const at = text.lastIndexOf("\n\n");
  const last = (at >= 0 ? text.slice(at + 2) : text).trim();
  const asks = QUESTION_STARTS.some((start) => last.startsWith(start)) || last.includes(confirmation.tool);
  if (!asks) return text;
  return at >= 0 ? text.slice(0, at) : "";
}

const BULLET = /^\s{0,3}[-*+]\s+(.*)$/;
const NUMBERED = /^\s{0,3}(\d{1,9})[.)]\s+(.*)$/;
const FENCE = /^\s{0,3}(```|~~~)/;
const HEADING = /^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$/;

/** Block-level Markdown: a list of nodes. */
function markdown(text) {
  const lines = String(text || "").replace(/\r\n?/g, "\n").split("\n");
  const blocks = [];
  let paragraph = [];
  const flush = () => {
    if (!paragraph.length) return;
    const p = el("p");
    paragraph.forEach((line, index) => {
      if (index) p.append(el("br"));
      p.append(...inline(line));
    });
    blocks.push(p);
    paragraph = [];
  };
  for (let i = 0; i < lines.length; i += 1) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      flush();
      const code = [];
      for (i += 1; i < lines.length && !lines[i].trim().startsWith(fence[1]); i += 1) code.push(lines[i]);
      blocks.push(el("pre", { class: "code" }, el("code", { text: code.join("\n") })));
      continue;
    }
    const list = BULLET.test(line) ? BULLET : NUMBERED.test(line) ? NUMBERED : null;
    if (list) {
      flush();
      const numbered = list === NUMBERED;
      const first = numbered ? Number(NUMBERED.exec(line)[1]) : 1;
      const node = el(numbered ? "ol" : "ul", { start: numbered && first !== 1 ? String(first) : null });
      let item = null;
      for (; i < lines.length; i += 1) {
        const match = list.exec(lines[i]);
        if (match) {
          item = el("li", {}, ...inline(numbered ? match[2] : match[1]));
          node.append(item);
        } else if (item && /^\s{2,}\S/.test(lines[i]) && !BULLET.test(lines[i]) && !NUMBERED.test(lines[i])) {
          item.append(el("br"), ...inline(lines[i].trim())); // a wrapped item goes on
        } else break;
      }
      i -= 1;
      blocks.push(node);
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      flush();
      blocks.push(el("p", { class: "md-heading" }, el("strong", {}, ...inline(heading[1]))));
      continue;
    }
    if (!line.trim()) flush();
    else paragraph.push(line);
  }
  flush();
  return blocks;
}

// Code spans, bold, italic, [links](url) and bare http(s) addresses; the rest is text.
const INLINE = new RegExp(
  [
    "(`+)([^`]|[^`][\\s\\S]*?[^`])\\1(?!`)", // 1, 2: code
    "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*", // 3: bold
    "(?<![\\w])__(?=\\S)([\\s\\S]*?\\S)__(?![\\w])", // 4: bold
    "\\*(?=[^\\s*])([\\s\\S]*?[^\\s*])\\*", // 5: italic
    "(?<![\\w])_(?=[^\\s_])([\\s\\S]*?[^\\s_])_(?![\\w])", // 6: italic
    "\\[([^\\[\\]]+)\\]\\(\\s*(\\S+?)\\s*\\)", // 7, 8: link
    "(https?:\\/\\/[^\\s<>()\\[\\]]*[^\\s<>()\\[\\].,;:!?'\"])", // 9: bare address
  ].join("|"),
  "g",
);

function inline(text, depth = 0) {
  const nodes = [];
  let last = 0;
  INLINE.lastIndex = 0;
  const matches = [...text.matchAll(INLINE)];
  for (const match of matches) {
    if (match.index > last) nodes.push(document.createTextNode(text.slice(last, match.index)));
    last = match.index + match[0].length;
    nodes.push(inlineNode(match, depth));
  }
  if (last < text.length) nodes.push(document.createTextNode(text.slice(last)));
  return nodes;
}

function inlineNode(match, depth) {
  const inner = (value) => (depth < 4 ? inline(value, depth + 1) : [document.createTextNode(value)]);
  if (match[2] !== undefined) return el("code", { text: match[2] });
  if (match[3] !== undefined || match[4] !== undefined) return el("strong", {}, ...inner(match[3] ?? match[4]));
  if (match[5] !== undefined || match[6] !== undefined) return el("em", {}, ...inner(match[5] ?? match[6]));
  if (match[7] !== undefined) {
    const href = safeLink(match[8]);
    // Only http(s) is followed; anything else (javascript:, data:) stays text, as written.
    if (!href) return document.createTextNode(match[0]);
    return el("a", { href, rel: "noopener noreferrer", target: "_blank" }, ...inner(match[7]));
  }
  const href = safeLink(match[9]);
  return href ? el("a", { href, rel: "noopener noreferrer", target: "_blank", text: match[9] }) : document.createTextNode(match[9]);
}
