// The devices page: the live fleet from GET /api/fleet/events (no polling), a device's tools
// with a form per tool generated from its inputSchema, its voice language, and its recent audit
// rows.
//
// A fleet may hold 10,000 devices: every device is kept in a Map (id → entry) with its row
// element made only when first shown; the filtered list is an array of ids, shown one page of
// PAGE_SIZE rows at a time. A live change updates its row's cells in place and re-filters
// (once per animation frame) only when the device joins or leaves the filtered list.

import {
  ApiError,
  ago,
  announce,
  api,
  apiStream,
  can,
  el,
  formatMs,
  lacksScope,
  readSSE,
  startPage,
} from "/console/common.js";
import { strings } from "/console/i18n.js";
import TEXT from "/console/text/devices.js";
import { mountDeviceActions } from "/console/device-actions.js";

const T = strings(TEXT);

const PAGE_SIZE = 100; // rows in the DOM at once: a filter over 10,000 renders one page
const AUDIT_ROWS = 20;
const RETRY_MIN_MS = 1000;
const RETRY_MAX_MS = 15000;
const LIVE = new Set(["connecting", "initializing", "ready", "failed"]);
// A device's voice language (GET/PUT /api/devices/{id}/voice): the setting and its label.
const VOICE_LANGUAGES = [
  ["auto", T.voiceAuto],
  ["en", T.languageName("en")],
  ["vi", T.languageName("vi")],
];
// A read-only tool whose JSON answer holds the device's current settings (volume, brightness,
// theme): the tool forms start from its values.
const STATUS_TOOL = /(^|\.)get_device_status$/;
const VERBS = new Set(["self", "set", "get", "turn", "change"]);
// A device that appears offline is shown after this long, unless it comes online meanwhile: a
// connecting device's first row may say offline for an instant.
const NEW_OFFLINE_GRACE_MS = 1500;
const STATE_FILTERS = [
  ["all", T.filterAll],
  ["online", T.filterOnline],
  ["offline", T.filterOffline],
  ["ready", T.filterReady],
  ["connecting", T.filterConnecting],
  ["failed", T.filterFailed],
];

startPage(T.title, (main, me) => {
  if (!can(me, "devices:read")) {
    lacksScope(main, "devices:read");
    return;
  }
  new DevicesPage(main, me).start();
});

// ---- a row's fields ----------------------------------------------------------------------------

function boardOf(row) {
  return (row.server_info && row.server_info.name) || (row.ota && row.ota.board_type) || "";
}

function firmwareOf(row) {
  return (row.server_info && row.server_info.version) || (row.ota && row.ota.firmware_version) || "";
}

function isOnline(row) {
  return LIVE.has(row.state);
}

function lastSeenOf(row) {
  return isOnline(row) ? T.now : ago(row.last_seen);
}

function matchesState(row, wanted) {
  if (wanted === "all") return true;
  if (wanted === "online") return isOnline(row);
  if (wanted === "connecting") return row.state === "connecting" || row.state === "initializing";
  return row.state === wanted;
}

/** The lower-case text the search box looks in: id, client id, board, firmware, transport. */
function haystackOf(row) {
  return [row.device_id, row.client_id, boardOf(row), firmwareOf(row), row.transport]
    .filter(Boolean)
    .join(" ")
    .toLowerCase();
}

function stateBadge(row) {
  const badge = el("span", { class: `badge ${isOnline(row) ? "online" : "offline"}` });
  setBadge(badge, row);
  return badge;
}

function setBadge(badge, row) {
  badge.textContent = T.stateName(row.state);
  badge.className = `badge ${row.state === "failed" ? "warn" : isOnline(row) ? "online" : "offline"}`;
}

/** Insert `id` into the sorted array `ids` (ids sort as the server sorts them: by code unit). */
function insertSorted(ids, id) {
  if (!ids.length || ids[ids.length - 1] < id) {
    ids.push(id); // the snapshot comes sorted: append, no search and no splice
    return;
  }
  let low = 0;
  let high = ids.length;
  while (low < high) {
    const middle = (low + high) >>> 1;
    if (ids[middle] < id) low = middle + 1;
    else high = middle;
  }
  ids.splice(low, 0, id);
}

// ---- the page ----------------------------------------------------------------------------------

class DevicesPage {
  constructor(main, me) {
    this.main = main;
    this.me = me;
    this.entries = new Map(); // device id → {row, haystack, tr, cells}
    this.order = []; // every device id, sorted
    this.filtered = []; // the ids that pass the filters, sorted
    this.page = 0;
    this.query = "";
    this.stateFilter = "all";
    this.refilterQueued = false;
    this.statusQueued = false;
    this.online = 0; // how many entries are online, kept as rows change
    this.ready = false;
    this.retryMs = RETRY_MIN_MS;
    this.detail = null;
  }

  start() {
    this.build();
    this.connect();
    // "3 min ago" ages: refresh the shown rows' last-seen cells now and then.
    setInterval(() => this.refreshAges(), 30000);
  }

  build() {
    this.search = el("input", {
      id: "device-search",
      type: "search",
      autocomplete: "off",
      spellcheck: "false",
      placeholder: T.searchPlaceholder,
      on: { input: () => this.onFilter() },
    });
    this.stateSelect = el(
      "select",
      { id: "device-state", on: { change: () => this.onFilter() } },
      STATE_FILTERS.map(([value, label]) => el("option", { value, text: label })),
    );
    this.status = el("p", { id: "fleet-status", class: "muted", role: "status", text: T.connectingStatus });
    this.link = el("span", { class: "badge", id: "stream-state", text: T.linkConnecting });
    this.tbody = el("tbody", { id: "device-rows" });
    this.prev = el("button", { type: "button", class: "secondary", text: T.previous, on: { click: () => this.turn(-1) } });
    this.next = el("button", { type: "button", class: "secondary", text: T.next, on: { click: () => this.turn(1) } });
    this.pageLabel = el("span", { class: "muted" });
    this.detailBox = el("section", {
      id: "device-detail",
      class: "detail",
      "aria-label": T.selectedDevice,
      hidden: true,
      on: { keydown: (event) => event.key === "Escape" && this.detail && this.unselect() },
    });

    const filters = el(
      "form",
      { class: "filters row", role: "search", on: { submit: (event) => event.preventDefault() } },
      el("div", { class: "field" }, el("label", { for: "device-search", text: T.search }), this.search),
      el("div", { class: "field" }, el("label", { for: "device-state", text: T.state }), this.stateSelect),
    );
    const table = el(
      "table",
      { class: "fleet" },
      el("caption", { class: "visually-hidden", text: T.caption }),
      el(
        "thead",
        {},
        el(
          "tr",
          {},
          el("th", { scope: "col", text: T.device }),
          el("th", { scope: "col", text: T.state }),
          el("th", { scope: "col", class: "wide", text: T.transport }),
          el("th", { scope: "col", class: "wide", text: T.board }),
          el("th", { scope: "col", class: "wide", text: T.firmware }),
          el("th", { scope: "col", text: T.lastSeen }),
          el("th", { scope: "col", class: "num", text: T.tools }),
        ),
      ),
      this.tbody,
    );
    this.main.replaceChildren(
      el("div", { class: "row heading" }, el("h1", { text: T.title }), this.link),
      filters,
      this.status,
      el("div", { class: "fleet-layout" },
        el("div", { class: "fleet-list" },
          // Focusable: a table wider than a phone scrolls, and the keyboard must reach it.
          el("div", { class: "table-wrap", tabindex: "0", role: "region", "aria-label": T.deviceList }, table),
          el("nav", { class: "pager row", "aria-label": T.deviceListPages }, this.prev, this.pageLabel, this.next),
        ),
        this.detailBox,
      ),
    );
  }

  // ---- the event stream ------------------------------------------------------------------------

  async connect() {
    this.controller = new AbortController();
    window.addEventListener("pagehide", () => this.controller.abort(), { once: true });
    for (;;) {
      let snapshot = new Set();
      try {
        const response = await apiStream("/api/fleet/events", { method: "GET", signal: this.controller.signal });
        this.setLink(T.linkLive, "online");
        await readSSE(response, (event) => {
          snapshot = this.onEvent(event, snapshot);
        });
      } catch (error) {
        if (this.controller.signal.aborted) return;
        if (error instanceof ApiError && (error.status === 401 || error.status === 403)) {
          this.setLink(T.linkRefused, "warn");
          this.status.textContent = error.message;
          return; // a 401 brings the login form back (common.js)
        }
      }
      if (this.controller.signal.aborted) return;
      this.setLink(T.linkReconnecting, "warn");
      await new Promise((resolve) => setTimeout(resolve, this.retryMs));
      this.retryMs = Math.min(this.retryMs * 2, RETRY_MAX_MS);
    }
  }

  setLink(text, kind) {
    this.link.textContent = text;
    this.link.className = `badge ${kind}`;
  }

  /** One event of the stream; returns the set of ids the current snapshot listed. */
  onEvent({ event, data }, snapshot) {
    if (event === "snapshot") {
      for (const row of data.devices) {
        snapshot.add(row.device_id);
        this.upsert(row, false);
      }
    } else if (event === "ready") {
      // A reconnect's snapshot replaces the fleet: what it no longer lists is gone.
      for (const id of [...this.entries.keys()]) if (!snapshot.has(id)) this.remove(id, false);
      this.ready = true;
      this.retryMs = RETRY_MIN_MS;
      this.refilter();
    } else if (event === "devices") {
      for (const row of data.devices) this.upsert(row, this.ready);
    } else if (event === "removed") {
      for (const id of data.device_ids) this.remove(id, this.ready);
    }
    return snapshot;
  }

  upsert(row, live, waited = false) {
    const id = row.device_id;
    if (live && !waited && !this.entries.has(id) && !isOnline(row)) {
      this.holdNew(row);
      return;
    }
    this.dropHeld(id);
    let entry = this.entries.get(id);
    const before = entry ? this.passes(entry) : false;
    const wasOnline = entry ? isOnline(entry.row) : false;
    if (isOnline(row) !== wasOnline) this.online += isOnline(row) ? 1 : -1;
    if (!entry) {
      entry = { row, haystack: haystackOf(row), tr: null, cells: null };
      this.entries.set(id, entry);
      insertSorted(this.order, id);
    } else {
      entry.row = row;
      entry.haystack = haystackOf(row);
      if (entry.tr) this.fillRow(entry);
    }
    if (this.detail && this.detail.deviceId === id) this.detail.update(row);
    if (!live) return;
    if (before !== this.passes(entry)) this.queueRefilter();
    else this.queueStatus(); // the counts may have changed, the list did not
  }

  /** A device first seen offline in a live event: shown after a grace, if still offline. */
  holdNew(row) {
    this.held = this.held || new Map();
    const held = this.held.get(row.device_id);
    if (held) {
      held.row = row;
      return;
    }
    const entry = { row, timer: null };
    entry.timer = setTimeout(() => {
      this.held.delete(row.device_id);
      if (!this.entries.has(row.device_id)) this.upsert(entry.row, this.ready, true);
    }, NEW_OFFLINE_GRACE_MS);
    this.held.set(row.device_id, entry);
  }

  dropHeld(id) {
    const held = this.held && this.held.get(id);
    if (!held) return;
    clearTimeout(held.timer);
    this.held.delete(id);
  }

  remove(id, live) {
    this.dropHeld(id);
    const entry = this.entries.get(id);
    if (!entry) return;
    this.entries.delete(id);
    if (isOnline(entry.row)) this.online -= 1;
    const at = this.order.indexOf(id);
    if (at >= 0) this.order.splice(at, 1);
    if (this.detail && this.detail.deviceId === id) this.detail.gone();
    if (live) this.queueRefilter();
  }

  // ---- filtering and paging --------------------------------------------------------------------

  passes(entry) {
    return matchesState(entry.row, this.stateFilter) && (!this.query || entry.haystack.includes(this.query));
  }

  onFilter() {
    this.query = this.search.value.trim().toLowerCase();
    this.stateFilter = this.stateSelect.value;
    this.page = 0;
    this.refilter();
  }

  queueRefilter() {
    if (this.refilterQueued) return;
    this.refilterQueued = true;
    requestAnimationFrame(() => {
      this.refilterQueued = false;
      this.refilter();
    });
  }

  queueStatus() {
    if (this.statusQueued || this.refilterQueued) return;
    this.statusQueued = true;
    requestAnimationFrame(() => {
      this.statusQueued = false;
      this.renderStatus();
    });
  }

  refilter() {
    if (!this.ready) return;
    const entries = this.entries;
    this.filtered = this.order.filter((id) => this.passes(entries.get(id)));
    const pages = Math.max(1, Math.ceil(this.filtered.length / PAGE_SIZE));
    this.page = Math.min(this.page, pages - 1);
    this.renderPage();
  }

  turn(step) {
    this.page += step;
    this.renderPage();
    this.tbody.closest("table").scrollIntoView({ block: "start" });
  }

  renderPage() {
    const total = this.filtered.length;
    const pages = Math.max(1, Math.ceil(total / PAGE_SIZE));
    const start = this.page * PAGE_SIZE;
    const shown = this.filtered.slice(start, start + PAGE_SIZE);
    this.tbody.replaceChildren(...shown.map((id) => this.rowOf(this.entries.get(id))));
    if (!total) {
      const text = this.entries.size ? T.noMatch : T.noDevice;
      this.tbody.replaceChildren(el("tr", {}, el("td", { colspan: "7", class: "muted", text })));
    }
    this.renderStatus();
    this.pageLabel.textContent = total > PAGE_SIZE
      ? T.rows(start + 1, Math.min(start + PAGE_SIZE, total), total)
      : "";
    this.prev.disabled = this.page === 0;
    this.next.disabled = this.page >= pages - 1;
    this.prev.hidden = this.next.hidden = pages === 1;
  }

  renderStatus() {
    const total = this.filtered.length;
    const all = this.entries.size;
    const text = total === all
      ? T.fleetCount(all, this.online)
      : T.fleetMatch(total, all, this.online);
    if (this.status.textContent !== text) this.status.textContent = text;
  }

  rowOf(entry) {
    if (!entry.tr) {
      const id = entry.row.device_id;
      const open = el("button", {
        type: "button",
        class: "link device-id",
        "data-device-id": id,
        text: id,
        on: { click: () => this.select(id) },
      });
      const cells = {
        state: stateBadge(entry.row),
        transport: el("td", { class: "wide transport" }),
        board: el("td", { class: "wide" }),
        firmware: el("td", { class: "wide" }),
        seen: el("td"),
        tools: el("td", { class: "num" }),
      };
      entry.cells = cells;
      entry.tr = el(
        "tr",
        { "data-device-id": id },
        el("th", { scope: "row" }, open),
        el("td", {}, cells.state),
        cells.transport,
        cells.board,
        cells.firmware,
        cells.seen,
        cells.tools,
      );
      this.fillRow(entry);
    }
    entry.tr.classList.toggle("selected", Boolean(this.detail && this.detail.deviceId === entry.row.device_id));
    return entry.tr;
  }

  fillRow(entry) {
    const { row, cells } = entry;
    setBadge(cells.state, row);
    entry.tr.dataset.state = row.state;
    cells.transport.textContent = row.transport || "";
    cells.board.textContent = boardOf(row);
    cells.firmware.textContent = firmwareOf(row);
    cells.seen.textContent = lastSeenOf(row);
    cells.tools.textContent = String(row.tool_count);
  }

  refreshAges() {
    for (const tr of this.tbody.children) {
      const entry = this.entries.get(tr.dataset.deviceId);
      if (entry && entry.cells) entry.cells.seen.textContent = lastSeenOf(entry.row);
    }
  }

  // ---- one device ------------------------------------------------------------------------------

  select(id) {
    const entry = this.entries.get(id);
    if (!entry) return;
    if (this.detail) this.detail.close();
    for (const tr of this.tbody.querySelectorAll("tr.selected")) tr.classList.remove("selected");
    if (entry.tr) entry.tr.classList.add("selected");
    this.detail = new DeviceDetail(this.detailBox, this.me, entry.row, () => this.unselect());
    this.detail.open();
  }

  unselect() {
    const id = this.detail && this.detail.deviceId;
    this.detail = null;
    this.detailBox.hidden = true;
    this.detailBox.replaceChildren();
    const entry = id && this.entries.get(id);
    if (entry && entry.tr) {
      entry.tr.classList.remove("selected");
      entry.tr.querySelector("button").focus();
    }
  }
}

// ---- a device's detail: summary, tools, audit --------------------------------------------------

function callDeniedReason(me, deviceId) {
  if (me.is_admin) return null;
  if (!can(me, "devices:call")) return T.lacksCall;
  if (me.device_ids && !me.device_ids.includes(deviceId)) return T.otherDevice;
  return null;
}

class DeviceDetail {
  constructor(box, me, row, onClose) {
    this.box = box;
    this.me = me;
    this.row = row;
    this.deviceId = row.device_id;
    this.onClose = onClose;
    this.controller = new AbortController();
    this.denied = callDeniedReason(me, this.deviceId);
  }

  open() {
    const path = encodeURIComponent(this.deviceId);
    this.path = `/api/devices/${path}`;
    this.heading = el("h2", { id: "detail-title", tabindex: "-1", text: this.deviceId });
    this.facts = el("dl", { class: "facts" });
    this.toolsBox = el("div", { class: "tools", "aria-busy": "true" }, el("p", { class: "muted", text: T.loadingTools }));
    this.auditBox = el("div", { class: "audit" }, el("p", { class: "muted", text: T.loading }));
    this.voice = new VoiceLanguage(this);
    const parts = [
      el(
        "div",
        { class: "row detail-head" },
        this.heading,
        el("button", { type: "button", class: "secondary", text: T.close, on: { click: () => this.onClose() } }),
      ),
      this.facts,
      el("h3", { text: T.voice }),
      this.voice.element(),
      el("h3", { text: T.tools }),
      this.denied ? el("p", { class: "notice", id: "call-denied", text: this.denied }) : null,
      this.toolsBox,
      el("h3", { text: T.recentCalls(AUDIT_ROWS) }),
      this.auditBox,
    ];
    this.box.replaceChildren(...parts.filter(Boolean));
    mountDeviceActions(this);
    this.box.setAttribute("aria-labelledby", "detail-title");
    this.box.hidden = false;
    this.update(this.row);
    this.heading.focus();
    this.voice.load();
    this.loadTools();
    this.loadAudit();
  }

  close() {
    this.controller.abort();
  }

  update(row) {
    this.row = row;
    const facts = [
      [T.state, T.stateName(row.state) + (row.error ? ` (${row.error})` : "")],
      [T.transport, row.transport || "—"],
      [T.board, boardOf(row) || "—"],
      [T.firmware, firmwareOf(row) || "—"],
      [T.clientId, row.client_id || "—"],
      [T.connected, row.connected_at ? new Date(row.connected_at).toLocaleString() : "—"],
      [T.lastSeen, lastSeenOf(row)],
      [T.tools, String(row.tool_count)],
    ];
    this.facts.replaceChildren(...facts.flatMap(([term, value]) => [el("dt", { text: term }), el("dd", { text: value })]));
  }

  gone() {
    this.facts.replaceChildren(el("p", { class: "warn", role: "status", text: T.removed }));
  }

  async loadTools() {
    try {
      const listing = await api(`${this.path}/tools`, { signal: this.controller.signal });
      this.toolForms = listing.tools.map((tool, index) => new ToolForm(this, tool, index));
      const forms = this.toolForms.map((form) => form.element());
      const note = listing.cached
        ? el("p", { class: "hint", text: T.offlineTools })
        : null;
      this.toolsBox.replaceChildren(...(note ? [note] : []), ...forms);
      if (!forms.length) this.toolsBox.replaceChildren(el("p", { class: "muted", text: T.noTools }));
      if (!listing.cached) await this.prefill(listing.tools);
    } catch (error) {
      if (this.controller.signal.aborted) return;
      this.toolsBox.replaceChildren(el("p", { class: "error", role: "alert", text: T.toolsError(error.message) }));
    }
    this.toolsBox.removeAttribute("aria-busy");
  }

  /** Fills the tool forms from the status tool's answer (its current volume, brightness...). */
  async prefill(tools) {
    const status = tools.find((tool) => STATUS_TOOL.test(tool.name) && !requiredOf(tool).length);
    if (!status || this.denied) return;
    let values;
    try {
      const body = { name: status.name, arguments: {} };
      const result = await api(`${this.path}/tools/call`, { method: "POST", body, signal: this.controller.signal });
      const text = (result.content || []).find((item) => item && item.type === "text");
      if (result.isError || !text) return;
      values = JSON.parse(text.text);
    } catch {
      return; // no status, no prefill: the forms keep the schema's defaults
    }
    if (!values || typeof values !== "object") return;
    const leaves = leavesOf(values);
    for (const form of this.toolForms) form.prefill(leaves, status.name);
    this.loadAudit();
  }

  async loadAudit() {
    const query = `device_id=${encodeURIComponent(this.deviceId)}&limit=${AUDIT_ROWS}`;
    try {
      const page = await api(`/api/audit?${query}`, { signal: this.controller.signal });
      this.auditBox.replaceChildren(auditTable(page.entries));
    } catch (error) {
      if (this.controller.signal.aborted) return;
      this.auditBox.replaceChildren(el("p", { class: "error", text: T.auditError(error.message) }));
    }
  }
}

// ---- a device's voice language ---------------------------------------------------------------

/** The language a device's speech is heard in: a select (admin only) and what it means now. */
class VoiceLanguage {
  constructor(detail) {
    this.detail = detail;
    this.denied = detail.me.is_admin ? null : T.voiceDenied;
  }

  element() {
    this.select = el(
      "select",
      {
        id: "voice-language",
        disabled: true,
        "aria-describedby": "voice-effective",
        on: { change: () => this.save() },
      },
      VOICE_LANGUAGES.map(([value, label]) => el("option", { value, text: label })),
    );
    this.effective = el("p", { id: "voice-effective", class: "hint", "aria-live": "polite", text: T.loading });
    return el(
      "div",
      { class: "field voice" },
      el("label", { for: "voice-language", text: T.heardLabel }),
      this.select,
      this.effective,
    );
  }

  async load() {
    try {
      this.show(await api(`${this.detail.path}/voice`, { signal: this.detail.controller.signal }));
    } catch (error) {
      if (this.detail.controller.signal.aborted) return;
      this.effective.className = "error";
      this.effective.textContent = T.voiceError(error.message);
    }
  }

  show(voice) {
    this.saved = voice.language;
    this.select.value = voice.language;
    for (const option of this.select.options) {
      // A language this bridge cannot hear is shown, not offered (the voice-vi extra is missing).
      const missing = option.value !== "auto" && !voice.languages_available.includes(option.value);
      option.disabled = missing;
      if (missing) option.textContent = T.notInstalled(T.languageName(option.value));
    }
    this.select.disabled = Boolean(this.denied);
    const heard = T.heard(T.languageName(voice.effective));
    this.effective.className = "hint";
    this.effective.textContent = this.denied ? `${heard} ${this.denied}` : heard;
  }

  async save() {
    const language = this.select.value;
    this.select.disabled = true;
    try {
      this.show(await api(`${this.detail.path}/voice`, { method: "PUT", body: { language } }));
      announce(T.voiceSaved(this.effective.textContent));
    } catch (error) {
      this.select.value = this.saved;
      this.select.disabled = Boolean(this.denied);
      this.effective.className = "error";
      this.effective.textContent = T.notSaved(error.status, error.message);
    }
  }
}

function auditTable(entries) {
  if (!entries.length) return el("p", { class: "muted", text: T.noCalls });
  return el(
    "div",
    { class: "table-wrap", tabindex: "0", role: "region", "aria-label": T.recentCallsLabel },
    el(
      "table",
      { class: "audit-table" },
      el("caption", { class: "visually-hidden", text: T.recentCallsCaption }),
      el(
        "thead",
        {},
        el(
          "tr",
          {},
          [T.when, T.tool, T.who, T.outcome, T.duration].map((text) => el("th", { scope: "col", text })),
        ),
      ),
      el(
        "tbody",
        {},
        entries.map((entry) =>
          el(
            "tr",
            {},
            el("td", { text: ago(entry.at) }),
            el("td", {}, el("code", { text: entry.tool })),
            el("td", { text: entry.actor || T.deviceActor }),
            el("td", {
              class: entry.outcome === "ok" ? "ok" : "warn",
              text: T.outcomeName(entry.outcome) + (entry.confirmed ? T.confirmed : "") + (entry.error ? `: ${entry.error}` : ""),
            }),
            el("td", { class: "num", text: formatMs(entry.duration_ms) }),
          ),
        ),
      ),
    ),
  );
}

// ---- a tool's form, generated from its inputSchema ---------------------------------------------

function typeOf(schema) {
  if (Array.isArray(schema.enum) && schema.enum.length) return "enum";
  const type = Array.isArray(schema.type) ? schema.type.find((t) => t !== "null") : schema.type;
  return type || "json";
}

class ToolForm {
  constructor(detail, tool, index) {
    this.detail = detail;
    this.tool = tool;
    this.prefix = `tool-${index}`;
    this.fields = [];
  }

  element() {
    const tool = this.tool;
    const schema = tool.inputSchema && typeof tool.inputSchema === "object" ? tool.inputSchema : {};
    const properties = schema.properties && typeof schema.properties === "object" ? schema.properties : {};
    const required = new Set(Array.isArray(schema.required) ? schema.required : []);
    const inputs = Object.entries(properties).map(([name, property], index) =>
      this.field(name, property && typeof property === "object" ? property : {}, required.has(name), index),
    );
    const denied = this.detail.denied;
    this.button = el("button", {
      type: "submit",
      text: T.call,
      disabled: Boolean(denied),
      "aria-describedby": denied ? "call-denied" : null,
    });
    this.output = el("div", { class: "output", "aria-live": "polite" });
    this.form = el(
      "form",
      { class: "tool-form", "aria-labelledby": `${this.prefix}-name`, on: { submit: (event) => this.submit(event) } },
      ...inputs,
      el("div", { class: "row" }, this.button),
      this.output,
    );
    this.heading = el("h4", { id: `${this.prefix}-name` }, el("code", { text: tool.name }));
    this.article = el(
      "article",
      { class: "tool card", "data-tool": tool.name },
      this.heading,
      tool.description ? el("p", { class: "hint", text: tool.description }) : null,
      this.form,
    );
    if (isRisky(tool)) this.markRisky();
    return this.article;
  }

  /** A badge (words, not a colour only) saying the tool asks for a confirmation first. */
  markRisky() {
    if (this.article.classList.contains("risky")) return;
    this.article.classList.add("risky");
    this.heading.append(" ", el("span", { class: "badge risky-badge", text: T.risky }));
  }

  /** Sets each field the status answer has a value for (`leaves`: [{path, value}]). */
  prefill(leaves, statusName) {
    const words = wordsOf(this.tool.name);
    for (const field of this.fields) {
      const value = matchLeaf(leaves, field.name, words);
      if (value === undefined || !field.fill(value)) continue;
      const note = el("span", { class: "hint prefilled", text: T.prefilled(typeof value === "string" ? value : JSON.stringify(value), statusName) });
      field.input.closest(".field").append(note);
    }
  }

  field(name, property, isRequired, index) {
    const id = `${this.prefix}-arg-${index}`;
    const kind = typeOf(property);
    const help = property.description ? el("span", { class: "hint", id: `${id}-help`, text: property.description }) : null;
    const common = { id, name, required: isRequired, "aria-describedby": help ? `${id}-help` : null };
    let input;
    let read;
    let fill = () => false; // a JSON field is not prefilled
    if (kind === "boolean") {
      input = el("input", { ...common, type: "checkbox", required: false, checked: property.default === true });
      read = () => input.checked;
      fill = (value) => typeof value === "boolean" && ((input.checked = value), true);
    } else if (kind === "enum") {
      input = el(
        "select",
        common,
        isRequired ? null : el("option", { value: "", text: T.notSet }),
        property.enum.map((value, at) => el("option", { value: String(at), text: typeof value === "string" ? value : JSON.stringify(value) })),
      );
      const preset = property.enum.findIndex((value) => value === property.default);
      if (preset >= 0) input.value = String(preset);
      read = () => (input.value === "" ? undefined : property.enum[Number(input.value)]);
      fill = (value) => {
        const at = property.enum.findIndex((item) => item === value);
        if (at >= 0) input.value = String(at);
        return at >= 0;
      };
    } else if (kind === "integer" || kind === "number") {
      input = el("input", {
        ...common,
        type: "number",
        inputmode: kind === "integer" ? "numeric" : "decimal",
        step: kind === "integer" ? "1" : "any",
        min: property.minimum ?? null,
        max: property.maximum ?? null,
        value: property.default ?? null,
      });
      read = () => (input.value === "" ? undefined : Number(input.value));
      fill = (value) => {
        const fits = typeof value === "number" && (kind === "number" || Number.isInteger(value));
        if (fits) input.value = String(value);
        return fits;
      };
    } else if (kind === "string") {
      input = el("input", {
        ...common,
        type: "text",
        autocomplete: "off",
        maxlength: property.maxLength ?? null,
        value: property.default ?? null,
      });
      read = () => (input.value === "" && !isRequired ? undefined : input.value);
      fill = (value) => typeof value === "string" && ((input.value = value), true);
    } else {
      // A nested object or array, or a schema this form does not know: JSON as text.
      const preset = property.default !== undefined ? property.default : kind === "array" ? [] : kind === "object" ? {} : null;
      input = el("textarea", { ...common, rows: "3", spellcheck: "false", "data-json": "1" });
      input.value = preset === null ? "" : JSON.stringify(preset, null, 1);
      read = () => {
        if (input.value.trim() === "") return undefined;
        try {
          return JSON.parse(input.value);
        } catch {
          throw new FieldError(input, T.notJson(name));
        }
      };
    }
    this.fields.push({ name, read, input, fill });
    const label = el("label", { for: id }, name, isRequired ? el("span", { class: "muted", text: T.required }) : null);
    const range = kind === "integer" || kind === "number" ? rangeText(property) : "";
    return el(
      "div",
      { class: `field ${kind === "boolean" ? "check" : ""}` },
      kind === "boolean" ? [input, label] : [label, input],
      range ? el("span", { class: "hint", text: range }) : null,
      help,
    );
  }

  argumentsOf() {
    // No prototype: a property a device names "__proto__" is an argument like any other.
    const values = Object.create(null);
    for (const field of this.fields) {
      field.input.removeAttribute("aria-invalid");
      const value = field.read();
      if (value !== undefined) values[field.name] = value;
    }
    return values;
  }

  async submit(event) {
    event.preventDefault();
    if (this.detail.denied) return;
    if (!this.form.reportValidity()) return;
    let args;
    try {
      args = this.argumentsOf();
    } catch (error) {
      if (!(error instanceof FieldError)) throw error;
      error.input.setAttribute("aria-invalid", "true");
      error.input.focus();
      this.show(el("p", { class: "error", role: "alert", text: error.message }));
      return;
    }
    await this.call(args, false);
  }

  async call(args, confirm) {
    this.button.disabled = true;
    this.show(el("p", { class: "muted", text: confirm ? T.callingConfirmed : T.calling }));
    try {
      const body = { name: this.tool.name, arguments: args, ...(confirm ? { confirm: true } : {}) };
      const result = await api(`${this.detail.path}/tools/call`, { method: "POST", body });
      this.showResult(result);
      announce(T.callDone(this.tool.name, result.isError, formatMs(result.duration_ms)));
    } catch (error) {
      if (error instanceof ApiError && error.status === 428 && error.code === "confirmation_required") {
        this.markRisky();
        this.askConfirmation(args);
      } else {
        this.show(el("p", { class: "error", role: "alert", text: T.refused(error.status, error.message) }));
      }
    } finally {
      this.button.disabled = Boolean(this.detail.denied);
    }
    this.detail.loadAudit();
  }

  askConfirmation(args) {
    const confirmButton = el("button", {
      type: "button",
      class: "danger",
      text: T.confirmTool(this.tool.name),
      on: { click: () => this.call(args, true) },
    });
    const cancel = el("button", {
      type: "button",
      class: "secondary",
      text: T.cancel,
      on: {
        click: () => {
          this.show(el("p", { class: "muted", text: T.notCalled }));
          this.button.focus();
        },
      },
    });
    this.show(
      el(
        "div",
        { class: "confirm", role: "alert" },
        el("p", {}, el("code", { text: this.tool.name }), T.needsConfirmation),
        el("p", { class: "hint", text: T.confirmHint(this.tool.name) }),
        el("div", { class: "row" }, confirmButton, cancel),
      ),
    );
    confirmButton.focus();
  }

  showResult(result) {
    const parts = (result.content || []).map((item) =>
      item && item.type === "text"
        ? el("pre", { text: item.text })
        : el("pre", { text: JSON.stringify(item, null, 1) }),
    );
    this.show(
      el(
        "div",
        { class: `result ${result.isError ? "is-error" : ""}` },
        el("p", {
          class: result.isError ? "error" : "ok",
          text: T.result(result.isError, formatMs(result.duration_ms), result.duration_ms),
        }),
        parts,
      ),
    );
  }

  show(node) {
    this.output.replaceChildren(node);
  }
}

function rangeText(property) {
  const low = property.minimum;
  const high = property.maximum;
  if (low !== undefined && high !== undefined) return T.rangeBoth(low, high);
  if (low !== undefined) return T.rangeMin(low);
  if (high !== undefined) return T.rangeMax(high);
  return "";
}

class FieldError extends Error {
  constructor(input, message) {
    super(message);
    this.input = input;
  }
}

// ---- risky tools and the status tool's values ------------------------------------------------

// The bridge's confirmation rules decide, per device: the tool listing says `needs_confirmation`.
// A tool the bridge asks about anyway (the rules changed since the listing) gets the mark then.
function isRisky(tool) {
  return tool.needs_confirmation === true;
}

function requiredOf(tool) {
  const schema = tool.inputSchema && typeof tool.inputSchema === "object" ? tool.inputSchema : {};
  return Array.isArray(schema.required) ? schema.required : [];
}

/** The words of a tool's or key's name: "self.audio_speaker.set_volume" → audio, speaker, volume. */
function wordsOf(name) {
  return String(name).toLowerCase().split(/[._\s-]+/).filter((word) => word && !VERBS.has(word));
}

/** Every scalar of a JSON value with its path: {screen: {theme: "dark"}} → [{path, value}]. */
function leavesOf(value, path = [], out = []) {
  if (value && typeof value === "object" && !Array.isArray(value)) {
    if (path.length < 6) for (const [key, inner] of Object.entries(value)) leavesOf(inner, [...path, key], out);
  } else if (value === null || ["string", "number", "boolean"].includes(typeof value)) {
    out.push({ path, value });
  }
  return out;
}

/**
 * The status value for a field named `name` of a tool whose name has `toolWords`: a leaf of that
 * name whose parents name the tool's part ("screen" for self.screen.set_brightness). A tool that
 * names no part takes the only leaf of that name; an ambiguous match fills nothing.
 */
function matchLeaf(leaves, name, toolWords) {
  const key = name.toLowerCase();
  const parts = toolWords.filter((word) => !wordsOf(key).includes(word));
  const candidates = leaves.filter((leaf) => leaf.path.length && leaf.path[leaf.path.length - 1].toLowerCase() === key);
  const named = candidates.filter((leaf) => leaf.path.slice(0, -1).some((part) => wordsOf(part).some((word) => parts.includes(word))));
  if (named.length === 1) return named[0].value;
  if (!parts.length && candidates.length === 1) return candidates[0].value;
  return undefined;
}
