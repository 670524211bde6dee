// The MCP servers page: the external MCP servers (GET /api/mcp/servers), configured ones and those
// that dialed in, each with its kind, state, since when, last error, calls, instance, bound
// devices, and its tools in an expandable section. Read again every REFRESH_MS while the tab is
// visible, updated in place: an open tool list, the focus and a selection stay where they are.
import { api, can, el, lacksScope, startPage } from "/console/common.js";
import { language, strings } from "/console/i18n.js";
import TEXT from "/console/text/mcp-servers.js";

const T = strings(TEXT);
const REFRESH_MS = 4000;
const STATE_CLASS = { ready: "online", connecting: "warn", "backing-off": "warn", failed: "failed", stopped: "offline" };

startPage(T.title, async (main, me) => {
  if (!can(me, "devices:read")) {
    lacksScope(main, "devices:read");
    return;
  }
  await new ServersPage(main).start();
});

function formatTime(iso) {
  const time = Date.parse(iso);
  return Number.isFinite(time) ? new Date(time).toLocaleString(language()) : iso || "";
}

class ServersPage {
  constructor(main) {
    this.main = main;
    this.cards = new Map(); // server name (and instance) -> ServerCard
    this.serial = 0;
    this.loading = false;
  }

  async start() {
    this.status = el("p", { id: "servers-status", class: "hint" });
    this.problem = el("p", { id: "servers-error", class: "error", role: "alert" });
    this.configured = el("div", { id: "configured-servers", class: "servers" });
    this.dialin = el("div", { id: "dialin-servers", class: "servers" });
    this.configuredNone = el("p", { class: "muted", text: T.configuredNone });
    this.dialinNone = el("p", { class: "muted", text: T.dialinNone });
    this.main.replaceChildren(
      el("h1", { text: T.title }),
      el("p", { class: "hint", text: T.intro }),
      this.status,
      this.problem,
      el("section", { "aria-labelledby": "configured-title" }, el("h2", { id: "configured-title", text: T.configuredTitle }), this.configuredNone, this.configured),
      el("section", { "aria-labelledby": "dialin-title" }, el("h2", { id: "dialin-title", text: T.dialinTitle }), this.dialinNone, this.dialin),
    );
    await this.refresh();
    setInterval(() => {
      if (document.visibilityState === "visible") this.refresh();
    }, REFRESH_MS);
  }

  async refresh() {
    if (this.loading) return;
    this.loading = true;
    let servers;
    try {
      servers = (await api("/api/mcp/servers")).servers;
    } catch (error) {
      const said = T.notListed(error.message);
      if (this.problem.textContent !== said) this.problem.textContent = said;
      return;
    } finally {
      this.loading = false;
    }
    this.problem.textContent = "";
    const seen = new Set();
    const lists = { configured: [], dialin: [] };
    for (const server of servers) {
      const key = `${server.instance || ""}\u0000${server.name}`;
      seen.add(key);
      let card = this.cards.get(key);
      if (!card) {
        card = new ServerCard(++this.serial);
        this.cards.set(key, card);
      }
      card.update(server);
      lists[server.kind === "dialin" ? "dialin" : "configured"].push(card.root);
    }
    for (const [key, card] of this.cards) {
      if (!seen.has(key)) {
        card.root.remove();
        this.cards.delete(key);
      }
    }
    place(this.configured, lists.configured);
    place(this.dialin, lists.dialin);
    this.configuredNone.hidden = lists.configured.length > 0;
    this.dialinNone.hidden = lists.dialin.length > 0;
    const ready = servers.filter((server) => server.state === "ready").length;
    const summary = servers.length ? T.count(servers.length, ready) : T.none;
    setText(this.status, `${summary} ${T.updated(new Date().toLocaleTimeString(language()))}`);
  }
}

/** Puts `nodes` in `parent` in this order, moving only those out of place (a moved node would
 * lose the focus). */
function place(parent, nodes) {
  nodes.forEach((node, index) => {
    if (parent.children[index] !== node) parent.insertBefore(node, parent.children[index] || null);
  });
}

function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

/** One server: a card with its facts and its tools in a <details>, updated in place. */
class ServerCard {
  constructor(serial) {
    const id = `server-${serial}`;
    this.title = el("h3", { id: `${id}-title` });
    this.badge = el("span", { class: "badge" });
    this.facts = el("dl", { class: "facts" });
    this.summary = el("summary", {});
    this.toolRows = el("tbody", {});
    this.toolsNone = el("p", { class: "muted", text: T.toolsNone });
    this.caption = el("caption", { class: "visually-hidden" });
    this.toolsTable = el(
      "div",
      { class: "table-wrap" },
      el("table", { class: "tools" }, this.caption, el("thead", {}, el("tr", {}, T.toolColumns.map((text) => el("th", { scope: "col", text })))), this.toolRows),
    );
    this.details = el("details", { class: "tools", id: `${id}-tools` }, this.summary, this.toolsNone, this.toolsTable);
    this.root = el(
      "section",
      { class: "card server", "aria-labelledby": `${id}-title` },
      el("div", { class: "row server-head" }, this.title, this.badge),
      this.facts,
      this.details,
    );
    this.factsKey = null;
    this.toolsKey = null;
  }

  update(server) {
    this.root.dataset.server = server.name;
    this.root.dataset.state = server.state;
    setText(this.title, server.name);
    setText(this.badge, T.states[server.state] || server.state);
    this.badge.className = `badge state ${STATE_CLASS[server.state] || ""}`.trim();
    const facts = this.factsOf(server);
    const factsKey = JSON.stringify(facts);
    if (factsKey !== this.factsKey) {
      this.factsKey = factsKey;
      this.facts.replaceChildren(
        ...facts.flatMap(([key, name, value, cls]) => [el("dt", { text: name }), el("dd", { "data-fact": key, class: cls || null }, value)]),
      );
    }
    const tools = server.tools || [];
    setText(this.summary, T.tools(tools.length));
    const toolsKey = JSON.stringify(tools);
    if (toolsKey !== this.toolsKey) {
      this.toolsKey = toolsKey;
      setText(this.caption, T.toolsCaption(server.name));
      this.toolsNone.hidden = tools.length > 0;
      this.toolsTable.hidden = tools.length === 0;
      this.toolRows.replaceChildren(...tools.map((tool) => this.toolRow(tool)));
    }
  }

  /** [key, label, text, class] of the facts shown, those the server has. */
  factsOf(server) {
    const facts = [["kind", T.kind, T.kinds[server.kind] || server.kind]];
    if (server.target) facts.push(["target", T.target, server.target, "mono"]);
    let since = formatTime(server.since);
    if (server.state === "backing-off" && typeof server.next_attempt_in_s === "number") {
      since += ` (${T.nextAttempt(Math.ceil(server.next_attempt_in_s))})`;
    }
    facts.push(["since", T.since, since]);
    facts.push(["last-error", T.lastError, server.last_error || T.noError, server.last_error ? "error" : "muted"]);
    facts.push(["calls", T.calls, T.callsValue(server.calls, server.pending)]);
    if (typeof server.connects === "number") facts.push(["connects", T.connects, String(server.connects)]);
    if (server.instance) facts.push(["instance", T.instance, server.instance, "mono"]);
    const bound = server.bound_device_ids;
    facts.push(["devices", T.boundDevices, bound === null || bound === undefined ? T.allDevices : bound.length ? bound.join(", ") : T.noDevices]);
    return facts;
  }

  toolRow(tool) {
    return el(
      "tr",
      { "data-tool": tool.name },
      el("th", { scope: "row" }, el("code", { text: tool.name })),
      el("td", { class: tool.description ? null : "muted", text: tool.description || T.noDescription }),
      el("td", {}, tool.risky ? el("span", { class: "badge warn", text: T.risky }) : el("span", { class: "muted", text: T.notRisky })),
    );
  }
}
