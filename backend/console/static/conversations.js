// The conversations page (scope chat:use): the stored conversations, paged (GET
// /v1/conversations), searched by title and message text (`q`), renamed (PATCH), deleted with a
// confirm step (DELETE), and exported as JSON or Markdown: a download built here from GET
// /v1/conversations/{id}. Conversation text comes from users and the model: it is only ever
// set as text (textContent), and escaped in the Markdown export.
import { announce, api, can, el, startPage } from "/console/common.js";
import { language, strings } from "/console/i18n.js";
import TEXT from "/console/text/conversations.js";

const T = strings(TEXT);
const PAGE_SIZE = 20;
const SEARCH_DELAY_MS = 250;
const MAX_TITLE = 200; // backend/chat/memory.py MAX_TITLE_LENGTH
const MAX_SEARCH = 200; // backend/chat/memory.py MAX_SEARCH_LENGTH

startPage(T.title, async (main, me) => {
  if (!can(me, "chat:use")) {
    main.replaceChildren(el("h1", { text: T.title }), el("p", { class: "notice", role: "status", text: T.lacksScope }));
    return;
  }
  await new ConversationsPage(main).start();
});

function when(iso) {
  const moment = new Date(iso);
  if (Number.isNaN(moment.getTime())) return String(iso || "");
  return new Intl.DateTimeFormat(language(), { dateStyle: "medium", timeStyle: "short" }).format(moment);
}

function titleOf(conversation) {
  return conversation.title || T.untitled;
}

class ConversationsPage {
  constructor(main) {
    this.main = main;
    this.offset = 0;
    this.query = "";
    this.controller = null;
    this.timer = null;
  }

  async start() {
    this.heading = el("h1", { id: "conversations-title", tabindex: "-1", text: T.title });
    this.status = el("p", { id: "conversations-status", class: "hint", role: "status", text: T.loading });
    this.list = el("ul", { id: "conversation-list", class: "conversation-list", "aria-label": T.listLabel });
    this.pager = el("nav", { class: "row pager", "aria-label": T.pages });
    this.main.replaceChildren(this.heading, this.searchForm(), this.status, this.list, this.pager);
    await this.refresh();
  }

  // ---- searching and paging ------------------------------------------------------------------

  searchForm() {
    this.search = el("input", {
      id: "conversation-search",
      type: "search",
      maxlength: String(MAX_SEARCH),
      autocomplete: "off",
      "aria-describedby": "conversation-search-help",
      on: { input: () => this.searchSoon() },
    });
    const clear = el("button", {
      type: "button",
      class: "secondary",
      text: T.clear,
      on: {
        click: () => {
          this.search.value = "";
          this.searchNow();
          this.search.focus();
        },
      },
    });
    const form = el(
      "form",
      { role: "search", class: "card conversation-search" },
      el("label", { id: "conversation-search-label", for: "conversation-search", text: T.searchLabel }),
      el("div", { class: "row" }, this.search, el("button", { type: "submit", text: T.search }), clear),
      el("p", { id: "conversation-search-help", class: "hint", text: T.searchHelp }),
    );
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.searchNow();
    });
    return form;
  }

  searchSoon() {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.searchNow(), SEARCH_DELAY_MS);
  }

  searchNow() {
    clearTimeout(this.timer);
    const query = this.search.value.trim();
    if (query === this.query) return;
    this.query = query;
    this.offset = 0;
    this.refresh();
  }

  async refresh() {
    if (this.controller) this.controller.abort();
    const controller = new AbortController();
    this.controller = controller;
    const params = new URLSearchParams({ limit: String(PAGE_SIZE), offset: String(this.offset) });
    if (this.query) params.set("q", this.query);
    this.list.setAttribute("aria-busy", "true");
    let page;
    try {
      page = await api(`/v1/conversations?${params}`, { signal: controller.signal });
    } catch (error) {
      if (controller.signal.aborted) return;
      this.status.className = "error";
      this.status.textContent = T.notListed(error.message);
      this.list.removeAttribute("aria-busy");
      return;
    }
    if (controller !== this.controller) return;
    this.controller = null;
    if (!page.data.length && this.offset > 0) {
      // The last item of the last page went (deleted elsewhere, or here): show the page before.
      this.offset = Math.max(0, this.offset - PAGE_SIZE);
      return this.refresh();
    }
    this.show(page);
  }

  show(page) {
    this.list.removeAttribute("aria-busy");
    this.status.className = "hint";
    const first = page.total ? page.offset + 1 : 0;
    const last = page.offset + page.data.length;
    if (!page.total) this.status.textContent = this.query ? T.noMatch(this.query) : T.none;
    else if (this.query) this.status.textContent = T.countMatching(first, last, page.total, this.query);
    else this.status.textContent = T.count(first, last, page.total);
    this.list.replaceChildren(...page.data.map((conversation, index) => new ConversationItem(this, conversation, page.offset + index).element()));
    this.showPager(page);
  }

  showPager(page) {
    const pages = Math.max(1, Math.ceil(page.total / PAGE_SIZE));
    const number = Math.floor(page.offset / PAGE_SIZE) + 1;
    if (pages <= 1) {
      this.pager.replaceChildren();
      return;
    }
    const go = (offset, focus) => async () => {
      this.offset = offset;
      await this.refresh();
      const button = this.pager.querySelector(`button[data-go="${focus}"]`);
      if (button && !button.disabled) button.focus();
      else this.heading.focus();
    };
    this.pager.replaceChildren(
      el("button", {
        type: "button",
        class: "secondary",
        "data-go": "previous",
        text: T.previous,
        disabled: number <= 1,
        on: { click: go(Math.max(0, page.offset - PAGE_SIZE), "previous") },
      }),
      el("span", { class: "hint", text: T.page(number, pages) }),
      el("button", {
        type: "button",
        class: "secondary",
        "data-go": "next",
        text: T.next,
        disabled: page.next_offset === null || page.next_offset === undefined,
        on: { click: go(page.next_offset, "next") },
      }),
    );
  }
}

// ---- one conversation ----------------------------------------------------------------------------

class ConversationItem {
  constructor(page, conversation, index) {
    this.page = page;
    this.conversation = conversation;
    this.index = index;
    this.id = `conversation-${index}`;
  }

  element() {
    this.title = el("h2", { id: `${this.id}-title`, class: "conversation-title", text: titleOf(this.conversation) });
    this.titleBox = el("div", { class: "title-box" }, this.title);
    this.meta = el("p", { class: "hint conversation-meta" });
    this.actions = el("div", { class: "row actions" });
    this.said = el("p", { class: "hint", role: "status" });
    this.fill();
    this.item = el(
      "li",
      { class: "card conversation", "data-id": this.conversation.id, "aria-labelledby": `${this.id}-title` },
      this.titleBox,
      this.meta,
      this.actions,
      this.said,
    );
    return this.item;
  }

  fill() {
    const c = this.conversation;
    const parts = [T.messages(c.message_count), T.updated(when(c.updated_at))];
    if (c.device_id) parts.push(T.device(c.device_id));
    this.meta.textContent = parts.join(" · ");
    this.title.textContent = titleOf(c);
    this.actions.replaceChildren(...this.buttons());
  }

  buttons() {
    const title = titleOf(this.conversation);
    this.renameButton = el("button", {
      type: "button",
      class: "secondary",
      "data-action": "rename",
      text: T.rename,
      "aria-label": T.renameLabel(title),
      on: { click: () => this.askTitle() },
    });
    this.deleteButton = el("button", {
      type: "button",
      class: "secondary danger-text",
      "data-action": "delete",
      text: T.delete,
      "aria-label": T.deleteLabel(title),
      on: { click: () => this.askDelete() },
    });
    return [
      this.renameButton,
      el("button", {
        type: "button",
        class: "secondary",
        "data-action": "export-json",
        text: T.exportJson,
        "aria-label": T.exportJsonLabel(title),
        on: { click: () => this.export("json") },
      }),
      el("button", {
        type: "button",
        class: "secondary",
        "data-action": "export-markdown",
        text: T.exportMarkdown,
        "aria-label": T.exportMarkdownLabel(title),
        on: { click: () => this.export("md") },
      }),
      this.deleteButton,
    ];
  }

  // ---- renaming ------------------------------------------------------------------------------

  askTitle() {
    const inputId = `${this.id}-new-title`;
    const input = el("input", {
      id: inputId,
      type: "text",
      required: true,
      maxlength: String(MAX_TITLE),
      autocomplete: "off",
      value: this.conversation.title,
      "aria-describedby": `${inputId}-help ${inputId}-error`,
    });
    const problem = el("p", { id: `${inputId}-error`, class: "error", role: "alert" });
    const save = el("button", { type: "submit", text: T.save });
    const back = (focusRename = true) => {
      this.titleBox.replaceChildren(this.title);
      if (focusRename) this.renameButton.focus();
    };
    const form = el(
      "form",
      { class: "rename" },
      el("label", { for: inputId, text: T.newTitle }),
      el("div", { class: "row" }, input, save, el("button", { type: "button", class: "secondary", text: T.cancel, on: { click: () => back() } })),
      el("p", { id: `${inputId}-help`, class: "hint", text: T.newTitleHelp }),
      problem,
    );
    form.addEventListener("keydown", (event) => {
      if (event.key === "Escape") back();
    });
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const title = input.value.trim();
      problem.textContent = "";
      if (!title) {
        problem.textContent = T.emptyTitle;
        input.focus();
        return;
      }
      save.disabled = true;
      save.textContent = T.saving;
      try {
        this.conversation = await api(`/v1/conversations/${encodeURIComponent(this.conversation.id)}`, {
          method: "PATCH",
          body: { title },
        });
      } catch (error) {
        problem.textContent = T.notRenamed(error.message);
        save.disabled = false;
        save.textContent = T.save;
        input.focus();
        return;
      }
      this.fill();
      back();
      announce(T.renamed(titleOf(this.conversation)));
    });
    this.titleBox.replaceChildren(form);
    input.focus();
    input.select();
  }

  // ---- deleting ------------------------------------------------------------------------------

  askDelete() {
    const title = titleOf(this.conversation);
    const problem = el("p", { class: "error", role: "alert" });
    const yes = el("button", { type: "button", class: "danger", text: T.confirmButton(title) });
    const back = () => {
      this.actions.replaceChildren(...this.buttons());
      this.deleteButton.focus();
    };
    const no = el("button", { type: "button", class: "secondary", text: T.cancel, on: { click: back } });
    yes.addEventListener("click", async () => {
      yes.disabled = true;
      try {
        await api(`/v1/conversations/${encodeURIComponent(this.conversation.id)}`, { method: "DELETE" });
      } catch (error) {
        if (error.status !== 404) {
          // 404: already gone (another tab): the refresh below shows it so
          yes.disabled = false;
          problem.textContent = T.notDeleted(error.message);
          return;
        }
      }
      announce(T.deleted(title));
      await this.page.refresh();
      this.page.heading.focus();
    });
    const box = el(
      "div",
      { class: "confirm", role: "group", "aria-label": T.deleteLabel(title) },
      el("p", { text: T.confirmDelete(title, this.conversation.message_count) }),
      el("div", { class: "row" }, yes, no),
      problem,
    );
    box.addEventListener("keydown", (event) => {
      if (event.key === "Escape") back();
    });
    this.actions.replaceChildren(box);
    yes.focus();
  }

  // ---- exporting -----------------------------------------------------------------------------

  async export(kind) {
    this.said.className = "hint";
    this.said.textContent = T.loading;
    let full;
    try {
      full = await api(`/v1/conversations/${encodeURIComponent(this.conversation.id)}`);
    } catch (error) {
      this.said.className = "error";
      this.said.textContent = T.notExported(error.message);
      return;
    }
    const base = `conversation-${safeFileName(full.id)}`;
    const file = kind === "json" ? `${base}.json` : `${base}.md`;
    const text = kind === "json" ? `${JSON.stringify(full, null, 2)}\n` : markdownOf(full);
    const type = kind === "json" ? "application/json" : "text/markdown";
    download(file, text, type);
    this.said.textContent = T.exported(file);
  }
}

// ---- the downloads ---------------------------------------------------------------------------------

function safeFileName(id) {
  return String(id).replace(/[^A-Za-z0-9._-]/g, "_").slice(0, 100);
}

function download(name, text, type) {
  const url = URL.createObjectURL(new Blob([text], { type: `${type};charset=utf-8` }));
  const link = el("a", { href: url, download: name, class: "visually-hidden", tabindex: "-1" });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
}

// Markdown's inline punctuation: escaped everywhere (CommonMark takes a backslash before any
// ASCII punctuation), so text from users and the model shows as typed: no heading, emphasis,
// link, image, code, table, raw HTML or entity made from it.
const MARKDOWN_INLINE = /[\\`*_{}[\]()#!|<>~&]/g;

/** One line of text as Markdown that renders to exactly that text. */
function escapeLine(line) {
  const indent = line.match(/^[ \t]*/)[0];
  const rest = line
    .slice(indent.length)
    .replace(MARKDOWN_INLINE, "\\$&")
    .replace(/^([-+=])/, "\\$1") // a list item, or a setext heading's underline
    .replace(/^(\d+)\./, "$1\\."); // an ordered list item
  // Leading spaces as no-break spaces: four spaces would start a code block.
  return "\u00a0".repeat(indent.replace(/\t/g, "    ").length) + rest;
}

/** Text (any number of lines) as Markdown paragraphs: its line breaks kept as hard breaks. */
export function escapeMarkdown(text) {
  const lines = String(text ?? "").replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  lines.forEach((line, index) => {
    const escaped = escapeLine(line);
    const nextBlank = index + 1 < lines.length && lines[index + 1].trim() !== "";
    out.push(escaped.trim() && nextBlank ? `${escaped}\\` : escaped);
  });
  return out.join("\n");
}

function markdownOf(conversation) {
  const lines = [`# ${escapeMarkdown(titleOf(conversation))}`, ""];
  const facts = [[T.mdConversation, conversation.id]];
  if (conversation.device_id) facts.push([T.mdDevice, conversation.device_id]);
  facts.push([T.mdCreated, when(conversation.created_at)], [T.mdUpdated, when(conversation.updated_at)]);
  for (const [term, value] of facts) lines.push(`- ${escapeMarkdown(term)}: ${escapeMarkdown(value)}`);
  lines.push("");
  if (conversation.summary) lines.push(`## ${escapeMarkdown(T.mdSummary)}`, "", escapeMarkdown(conversation.summary), "");
  if (!conversation.messages.length) lines.push(escapeMarkdown(T.mdNoMessages), "");
  for (const message of conversation.messages) {
    const who = message.role === "assistant" ? T.mdAssistant : T.mdUser;
    lines.push(`## ${escapeMarkdown(who)} · ${escapeMarkdown(when(message.created_at))}`, "", escapeMarkdown(message.content), "");
  }
  return lines.join("\n");
}
