// The keys page: the API keys (GET /api/keys), a new key with a scope picker built from the
// scopes the bridge knows (GET /api/scopes), its token shown once with a copy button, and
// revoking with a confirm step. Every action needs `admin`; the server checks it again.
import { ago, announce, api, can, el, startPage } from "/console/common.js";
import { strings } from "/console/i18n.js";
import TEXT_TABLE from "/console/text/keys.js";

// Every string of the page: /console/text/keys.js, in the chosen language.
const TEXT = strings(TEXT_TABLE);

startPage(TEXT.title, async (main, me) => {
  const admin = can(me, "admin");
  const page = new KeysPage(main, admin);
  await page.start();
});

class KeysPage {
  constructor(main, admin) {
    this.main = main;
    this.admin = admin;
    this.showRevoked = false;
  }

  async start() {
    this.status = el("p", { id: "keys-status", class: "hint", role: "status" });
    this.listBox = el("div", { id: "keys-list" });
    this.secretBox = el("div", { id: "new-key" });
    this.main.replaceChildren(
      el("h1", { text: TEXT.title }),
      ...(this.admin ? [] : [el("p", { id: "keys-denied", class: "notice", role: "status", text: TEXT.lacksAdmin })]),
    );
    let scopes = [];
    try {
      scopes = (await api("/api/scopes")).scopes;
    } catch (error) {
      this.status.className = "error";
      this.status.textContent = error.message;
    }
    this.main.append(this.secretBox, this.createForm(scopes), this.listSection());
    if (this.admin) await this.refresh();
  }

  // ---- creating ---------------------------------------------------------------------------

  createForm(scopes) {
    const name = el("input", {
      id: "key-name",
      type: "text",
      required: true,
      maxlength: "100",
      autocomplete: "off",
      "aria-describedby": "key-name-help",
    });
    const boxes = scopes.map((scope, index) =>
      el("input", { type: "checkbox", id: `scope-${index}`, name: "scope", value: scope.name, "aria-describedby": `scope-${index}-help` }),
    );
    const devices = el("input", {
      id: "key-devices",
      type: "text",
      autocomplete: "off",
      spellcheck: "false",
      "aria-describedby": "key-devices-help",
    });
    const error = el("p", { id: "create-error", class: "error", role: "alert" });
    const submit = el("button", { type: "submit", text: TEXT.create });
    const fields = el(
      "fieldset",
      { class: "plain", disabled: !this.admin },
      el("div", { class: "field" }, el("label", { for: "key-name", text: TEXT.name }), name, el("p", { id: "key-name-help", class: "hint", text: TEXT.nameHelp })),
      el(
        "fieldset",
        { "aria-describedby": "scopes-help" },
        el("legend", { text: TEXT.scopes }),
        el("p", { id: "scopes-help", class: "hint", text: TEXT.scopesHelp }),
        el(
          "div",
          { class: "scopes" },
          scopes.map((scope, index) =>
            el(
              "div",
              { class: "scope" },
              boxes[index],
              el("label", { for: `scope-${index}`, text: scope.name }),
              el("p", { id: `scope-${index}-help`, class: "hint", text: TEXT.scopeHelp(scope.name, scope.description) }),
            ),
          ),
        ),
      ),
      el("div", { class: "field" }, el("label", { for: "key-devices", text: TEXT.devices }), devices, el("p", { id: "key-devices-help", class: "hint", text: TEXT.devicesHelp })),
      error,
      submit,
    );
    const form = el("form", { class: "card", "aria-labelledby": "create-title" }, el("h2", { id: "create-title", text: TEXT.createTitle }), fields);
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      if (!this.admin) return;
      const chosen = boxes.filter((box) => box.checked).map((box) => box.value);
      error.textContent = "";
      if (!chosen.length) {
        error.textContent = TEXT.pickScope;
        boxes[0]?.focus();
        return;
      }
      const ids = devices.value.split(/[\s,]+/).filter(Boolean);
      const body = { name: name.value.trim(), scopes: chosen };
      if (ids.length) body.device_ids = ids;
      submit.disabled = true;
      submit.textContent = TEXT.creating;
      try {
        const created = await api("/api/keys", { method: "POST", body });
        form.reset();
        this.showSecret(created);
        await this.refresh();
      } catch (problem) {
        error.textContent = TEXT.notCreated(problem.message);
      } finally {
        submit.disabled = false;
        submit.textContent = TEXT.create;
      }
    });
    return form;
  }

  /** The new key's token, once: a read-only field, a copy button, and "done" to hide it. */
  showSecret(created) {
    const token = el("input", { id: "new-key-token", type: "text", readonly: true, value: created.token, spellcheck: "false" });
    const said = el("p", { id: "copy-status", class: "hint", role: "status" });
    const heading = el("h2", { id: "new-key-title", tabindex: "-1", text: TEXT.createdTitle(created.name) });
    const copy = async () => {
      try {
        await navigator.clipboard.writeText(created.token);
        said.textContent = TEXT.copied;
      } catch {
        token.focus();
        token.select();
        said.textContent = TEXT.copyByHand;
      }
    };
    const done = () => {
      this.secretBox.replaceChildren();
      document.getElementById("key-name")?.focus();
    };
    this.secretBox.replaceChildren(
      el(
        "section",
        { class: "card secret", "aria-labelledby": "new-key-title" },
        heading,
        el("p", { class: "hint", text: TEXT.createdHelp }),
        el("label", { for: "new-key-token", text: TEXT.token }),
        el("div", { class: "row" }, token, el("button", { type: "button", text: TEXT.copy, on: { click: copy } })),
        said,
        el("button", { type: "button", class: "secondary", text: TEXT.done, on: { click: done } }),
      ),
    );
    heading.focus();
    announce(TEXT.created(created.name));
  }

  // ---- the list and revoking --------------------------------------------------------------

  listSection() {
    const toggle = el("input", {
      id: "show-revoked",
      type: "checkbox",
      disabled: !this.admin,
      on: {
        change: () => {
          this.showRevoked = toggle.checked;
          this.refresh();
        },
      },
    });
    return el(
      "section",
      { "aria-labelledby": "list-title" },
      el("div", { class: "row heading" }, el("h2", { id: "list-title", text: TEXT.listTitle }), el("div", { class: "row" }, toggle, el("label", { for: "show-revoked", text: TEXT.showRevoked }))),
      this.status,
      this.listBox,
    );
  }

  async refresh() {
    let keys;
    try {
      keys = (await api(`/api/keys?revoked=${this.showRevoked}`)).keys;
    } catch (error) {
      this.status.className = "error";
      this.status.textContent = TEXT.notListed(error.message);
      return;
    }
    this.status.className = "hint";
    this.status.textContent = TEXT.count(keys.filter((key) => key.active).length, keys.length);
    this.listBox.replaceChildren(keys.length ? this.table(keys) : el("p", { class: "muted", text: TEXT.none }));
  }

  table(keys) {
    const wide = new Set([1, 3, 5]);
    return el(
      "div",
      { class: "table-wrap", tabindex: "0", role: "region", "aria-label": TEXT.caption },
      el(
        "table",
        { class: "keys" },
        el("caption", { class: "visually-hidden", text: TEXT.caption }),
        el("thead", {}, el("tr", {}, TEXT.columns.map((text, index) => el("th", { scope: "col", class: wide.has(index) ? "wide" : null, text })))),
        el("tbody", {}, keys.map((key) => this.row(key))),
      ),
    );
  }

  row(key) {
    const action = el("td", {});
    if (key.active) action.append(this.revokeButton(key, action));
    return el(
      "tr",
      { "data-key-id": key.id, class: key.active ? null : "revoked" },
      el("th", { scope: "row", text: key.name }),
      el("td", { class: "wide" }, el("code", { text: key.id })),
      el("td", {}, key.scopes.map((scope) => el("span", { class: "badge", text: scope })), " "),
      el("td", { class: "wide", text: key.device_ids ? key.device_ids.join(", ") : TEXT.allDevices }),
      el("td", { text: ago(key.created_at) }),
      el("td", { class: "wide", text: key.last_used_at ? ago(key.last_used_at) : TEXT.never }),
      el("td", { text: key.active ? TEXT.active : TEXT.revoked(ago(key.revoked_at)) }),
      action,
    );
  }

  revokeButton(key, cell) {
    return el("button", {
      type: "button",
      class: "secondary",
      text: TEXT.revoke,
      "aria-label": TEXT.revokeLabel(key.name),
      on: { click: () => this.askRevoke(key, cell) },
    });
  }

  /** The confirm step, in the row: "Yes, revoke" (focused) or "Cancel". */
  askRevoke(key, cell) {
    const problem = el("p", { class: "error", role: "alert" });
    const yes = el("button", { type: "button", class: "danger", text: TEXT.confirmButton(key.name) });
    const back = () => {
      const button = this.revokeButton(key, cell);
      cell.replaceChildren(button);
      button.focus();
    };
    const no = el("button", { type: "button", class: "secondary", text: TEXT.cancel, on: { click: back } });
    yes.addEventListener("click", async () => {
      yes.disabled = true;
      try {
        await api(`/api/keys/${encodeURIComponent(key.id)}`, { method: "DELETE" });
      } catch (error) {
        yes.disabled = false;
        problem.textContent = TEXT.notRevoked(error.message);
        return;
      }
      announce(TEXT.revokedSaid(key.name));
      await this.refresh();
      document.getElementById("list-title").setAttribute("tabindex", "-1");
      document.getElementById("list-title").focus();
    });
    const box = el("div", { class: "confirm", role: "group", "aria-label": TEXT.revokeLabel(key.name) }, el("p", { text: TEXT.confirm(key.name, key.id) }), el("div", { class: "row" }, yes, no), problem);
    box.addEventListener("keydown", (event) => {
      if (event.key === "Escape") back();
    });
    cell.replaceChildren(box);
    yes.focus();
  }
}
