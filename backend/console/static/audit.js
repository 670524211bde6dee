// The audit log page: device tool calls (GET /api/audit), newest first, filtered by device,
// actor, tool, outcome and time range, a page of N rows at a time ("Older" follows the API's
// next_before cursor, "Newer" goes back the cursors already seen). The filters are kept in the
// page's URL, so a filtered view can be linked. The whole log needs `admin`; a key with
// devices:read may read the rows of the devices it covers, one device at a time.
import { api, can, el, formatMs, startPage } from "/console/common.js";
import { strings } from "/console/i18n.js";
import TEXT_TABLE from "/console/text/audit.js";

const PAGE_SIZES = [25, 50, 100, 200];
const OUTCOMES = ["ok", "tool_error", "error", "refused"];

// Every string of the page: /console/text/audit.js, in the chosen language.
const TEXT = strings(TEXT_TABLE);

startPage(TEXT.title, async (main, me) => {
  await new AuditPage(main, me).start();
});

/** "2026-11-29T15:30" for a datetime-local input, from an ISO time; "" when none. */
function localInput(iso) {
  if (!iso) return "";
  const date = new Date(iso);
  if (Number.isNaN(date.getTime())) return "";
  const pad = (n) => String(n).padStart(2, "0");
  return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())}T${pad(date.getHours())}:${pad(date.getMinutes())}`;
}

/** An ISO time (UTC) from a datetime-local input's value, in the browser's zone; null: none. */
function isoOf(value) {
  if (!value) return null;
  const date = new Date(value);
  return Number.isNaN(date.getTime()) ? null : date.toISOString();
}

class AuditPage {
  constructor(main, me) {
    this.main = main;
    this.admin = can(me, "admin");
    this.reader = can(me, "devices:read");
    this.allowed = this.admin || this.reader;
    this.cursors = [null]; // the `before` of each page seen: [0] is the newest page
    this.pageIndex = 0;
  }

  async start() {
    this.status = el("p", { id: "audit-status", class: "hint", role: "status" });
    this.results = el("div", { id: "audit-results" });
    this.newer = el("button", { type: "button", class: "secondary", text: TEXT.newer, disabled: true, on: { click: () => this.move(-1) } });
    this.older = el("button", { type: "button", class: "secondary", text: TEXT.older, disabled: true, on: { click: () => this.move(1) } });
    let notice = null;
    if (!this.allowed) notice = el("p", { id: "audit-denied", class: "notice", role: "status", text: TEXT.lacks });
    else if (!this.admin) notice = el("p", { id: "audit-device-only", class: "notice", text: TEXT.deviceOnly });
    this.main.replaceChildren(
      el("h1", { text: TEXT.title }),
      ...(notice ? [notice] : []),
      this.filterForm(),
      this.status,
      this.results,
      el("nav", { class: "row pager", "aria-label": TEXT.pager }, this.newer, this.older),
    );
    if (this.allowed && (this.admin || this.inputs.device_id.value)) await this.load();
  }

  filterForm() {
    const params = new URLSearchParams(location.search);
    const text = (id, name, label, help) => {
      const input = el("input", {
        id,
        name,
        type: "text",
        autocomplete: "off",
        spellcheck: "false",
        value: params.get(name) || "",
        required: name === "device_id" && !this.admin,
        "aria-describedby": help ? `${id}-help` : null,
      });
      return [input, el("div", { class: "field" }, el("label", { for: id, text: label }), input, help ? el("p", { id: `${id}-help`, class: "hint", text: help }) : null)];
    };
    const [device, deviceField] = text("filter-device", "device_id", TEXT.device);
    const [actor, actorField] = text("filter-actor", "actor", TEXT.actor, TEXT.actorHelp);
    const [tool, toolField] = text("filter-tool", "tool", TEXT.tool);
    const outcome = el(
      "select",
      { id: "filter-outcome", name: "outcome" },
      el("option", { value: "", text: TEXT.anyOutcome }),
      OUTCOMES.map((value) => el("option", { value, text: TEXT.outcomes[value] })),
    );
    outcome.value = OUTCOMES.includes(params.get("outcome")) ? params.get("outcome") : "";
    const since = el("input", { id: "filter-since", name: "since", type: "datetime-local", value: localInput(params.get("since")) });
    const until = el("input", { id: "filter-until", name: "until", type: "datetime-local", value: localInput(params.get("until")) });
    const limit = el("select", { id: "filter-limit", name: "limit" }, PAGE_SIZES.map((n) => el("option", { value: String(n), text: String(n) })));
    limit.value = PAGE_SIZES.includes(Number(params.get("limit"))) ? params.get("limit") : "50";
    this.inputs = { device_id: device, actor, tool, outcome, since, until, limit };
    this.formError = el("p", { id: "filter-error", class: "error", role: "alert" });
    const labelled = (id, label, control) => el("div", { class: "field" }, el("label", { for: id, text: label }), control);
    const form = el(
      "form",
      { class: "card", "aria-labelledby": "filters-title" },
      el("h2", { id: "filters-title", text: TEXT.filtersTitle }),
      el(
        "fieldset",
        { class: "plain", disabled: !this.allowed },
        el(
          "div",
          { class: "row filters" },
          deviceField,
          actorField,
          toolField,
          labelled("filter-outcome", TEXT.outcome, outcome),
          labelled("filter-since", TEXT.since, since),
          labelled("filter-until", TEXT.until, until),
          labelled("filter-limit", TEXT.pageSize, limit),
        ),
        this.formError,
        el(
          "div",
          { class: "row" },
          el("button", { type: "submit", text: TEXT.apply }),
          el("button", {
            type: "button",
            class: "secondary",
            text: TEXT.clear,
            on: {
              click: () => {
                for (const input of Object.values(this.inputs)) if (input !== limit) input.value = "";
                form.requestSubmit();
              },
            },
          }),
        ),
      ),
    );
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      if (!this.allowed) return;
      if (!form.reportValidity()) return;
      this.cursors = [null];
      this.pageIndex = 0;
      this.load();
    });
    return form;
  }

  /** The query of the filters (without the cursor), or null when they make no sense. */
  query() {
    const query = new URLSearchParams();
    for (const name of ["device_id", "actor", "tool", "outcome"]) {
      const value = this.inputs[name].value.trim();
      if (value) query.set(name, value);
    }
    const since = isoOf(this.inputs.since.value);
    const until = isoOf(this.inputs.until.value);
    if (since && until && since >= until) return null;
    if (since) query.set("since", since);
    if (until) query.set("until", until);
    query.set("limit", this.inputs.limit.value);
    return query;
  }

  async load() {
    const query = this.query();
    this.formError.textContent = "";
    if (!query) {
      this.formError.textContent = TEXT.badRange;
      this.inputs.since.focus();
      return;
    }
    history.replaceState(null, "", `${location.pathname}?${query}`);
    const before = this.cursors[this.pageIndex];
    if (before !== null) query.set("before", String(before));
    this.status.className = "hint";
    this.status.textContent = TEXT.loading;
    this.newer.disabled = true;
    this.older.disabled = true;
    let page;
    try {
      page = await api(`/api/audit?${query}`);
    } catch (error) {
      this.status.className = "error";
      this.status.textContent = TEXT.notRead(error.message);
      this.results.replaceChildren();
      return;
    }
    const size = Number(this.inputs.limit.value);
    this.cursors.length = this.pageIndex + 1;
    if (page.next_before !== null) this.cursors.push(page.next_before);
    this.newer.disabled = this.pageIndex === 0;
    this.older.disabled = page.next_before === null;
    if (!page.entries.length) {
      this.status.textContent = TEXT.none;
      this.results.replaceChildren();
    } else {
      const first = this.pageIndex * size + 1;
      this.status.textContent = TEXT.page(this.pageIndex + 1, first, first + page.entries.length - 1, page.next_before !== null);
      this.results.replaceChildren(table(page.entries));
    }
  }

  async move(step) {
    const target = this.pageIndex + step;
    if (target < 0 || target >= this.cursors.length) return;
    this.pageIndex = target;
    const button = step > 0 ? this.older : this.newer;
    await this.load();
    // Focus stays on the pager: on the button pressed, or the other one once that is disabled.
    (button.disabled ? (step > 0 ? this.newer : this.older) : button).focus();
  }
}

function table(entries) {
  const wide = new Set([5, 6]);
  return el(
    "div",
    { class: "table-wrap", tabindex: "0", role: "region", "aria-label": TEXT.caption },
    el(
      "table",
      { class: "audit" },
      el("caption", { class: "visually-hidden", text: TEXT.caption }),
      el("thead", {}, el("tr", {}, TEXT.columns.map((text, index) => el("th", { scope: "col", class: wide.has(index) ? "wide" : null, text })))),
      el(
        "tbody",
        {},
        entries.map((entry) =>
          el(
            "tr",
            { "data-id": String(entry.id), "data-outcome": entry.outcome, "data-device-id": entry.device_id },
            el("td", {}, el("time", { datetime: entry.at, text: new Date(entry.at).toLocaleString() })),
            el("td", {}, el("code", { text: entry.device_id })),
            el("td", {}, el("code", { text: entry.tool })),
            el("td", { text: entry.actor || TEXT.deviceActor }),
            el("td", {
              class: entry.outcome === "ok" ? "ok" : "warn",
              text: (TEXT.outcomes[entry.outcome] || entry.outcome) + (entry.confirmed ? TEXT.confirmed : "") + (entry.error ? `: ${entry.error}` : ""),
            }),
            el("td", { class: "num wide", text: formatMs(entry.duration_ms) + (entry.bytes !== null && entry.bytes !== undefined ? `, ${TEXT.bytes(entry.bytes)}` : "") }),
            el("td", { class: "wide" }, el("code", { title: entry.arguments_sha256, text: entry.arguments_sha256.slice(0, 12) })),
          ),
        ),
      ),
    ),
  );
}
