// A device's name and notes (PUT /api/devices/{id}/notes), revoking its credentials (POST
// /api/provisioning/devices/{id}/revoke) and forgetting it (DELETE /api/devices/{id}, offline
// devices only), each removal with a confirm step: a section of the devices page's device detail,
// mounted by devices.js with `mountDeviceActions(detail)`. Every action needs `admin`: without
// it the controls are disabled with the reason, and the server refuses them anyway (403).
import { announce, api, can, el } from "/console/common.js";
import { strings } from "/console/i18n.js";
import TEXT from "/console/text/device-actions.js";

const T = strings(TEXT);
const MAX_NAME = 64; // backend/api/app.py MAX_DEVICE_NAME
const MAX_NOTES = 2000; // backend/api/app.py MAX_DEVICE_NOTES
const STYLE = "/console/device-actions.css";

function addStyle() {
  if (document.querySelector(`link[href="${STYLE}"]`)) return;
  document.head.append(el("link", { rel: "stylesheet", href: STYLE }));
}

/** Adds the section to `detail` (devices.js DeviceDetail, opened) and follows its row. */
export function mountDeviceActions(detail) {
  addStyle();
  const actions = new DeviceActions(detail);
  const section = actions.element();
  if (detail.facts && detail.facts.parentNode) detail.facts.after(section);
  else detail.box.append(section);
  // The detail hears the live row (a rename from another tab, the device going offline) and
  // that it was removed: this section follows both.
  const update = detail.update.bind(detail);
  detail.update = (row) => {
    update(row);
    actions.update(row);
  };
  const gone = detail.gone.bind(detail);
  detail.gone = () => {
    gone();
    actions.gone();
  };
  return actions;
}

class DeviceActions {
  constructor(detail) {
    this.detail = detail;
    this.deviceId = detail.deviceId;
    this.path = `/api/devices/${encodeURIComponent(detail.deviceId)}`;
    this.admin = can(detail.me, "admin");
    this.row = detail.row;
    this.removed = false;
  }

  element() {
    const denied = this.admin ? null : el("p", { id: "device-actions-denied", class: "notice", text: T.lacksAdmin });
    const described = (id) => [id, denied ? "device-actions-denied" : null].filter(Boolean).join(" ");
    this.name = el("input", {
      id: "device-name",
      type: "text",
      maxlength: String(MAX_NAME),
      autocomplete: "off",
      disabled: !this.admin,
      "aria-describedby": described("device-name-help"),
    });
    this.notes = el("textarea", {
      id: "device-notes",
      rows: "4",
      maxlength: String(MAX_NOTES),
      disabled: !this.admin,
      "aria-describedby": described("device-notes-help"),
    });
    this.save = el("button", { type: "submit", text: T.save, disabled: !this.admin });
    this.saved = el("p", { id: "device-notes-status", class: "hint", role: "status" });
    const form = el(
      "form",
      { class: "device-notes-form" },
      el("div", { class: "field" }, el("label", { for: "device-name", text: T.name }), this.name, el("p", { id: "device-name-help", class: "hint", text: T.nameHelp })),
      el("div", { class: "field" }, el("label", { for: "device-notes", text: T.notes }), this.notes, el("p", { id: "device-notes-help", class: "hint", text: T.notesHelp })),
      this.save,
      this.saved,
    );
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.store();
    });

    this.revokeBox = el("div", { class: "row removal" });
    this.forgetBox = el("div", { class: "row removal" });
    this.removalSaid = el("p", { id: "device-removal-status", class: "hint", role: "status" });
    this.forgetReason = el("p", { id: "device-forget-reason", class: "hint" });
    this.section = el(
      "section",
      { class: "device-actions", id: "device-actions", "aria-labelledby": "device-actions-title" },
      el("h3", { id: "device-actions-title", text: T.notesTitle }),
      denied,
      form,
      el("h3", { id: "device-removal-title", text: T.removalTitle }),
      el("p", { id: "device-revoke-help", class: "hint", text: T.revokeHelp }),
      this.revokeBox,
      el("p", { id: "device-forget-help", class: "hint", text: T.forgetHelp }),
      this.forgetReason,
      this.forgetBox,
      this.removalSaid,
    );
    this.fillFields(this.row);
    this.revokeBox.replaceChildren(this.revokeButton());
    this.forgetBox.replaceChildren(this.forgetButton());
    this.showForgetReason();
    return this.section;
  }

  // ---- following the row -----------------------------------------------------------------------

  fillFields(row) {
    // A field being edited keeps what is typed; the others show the stored value.
    for (const [field, value] of [
      [this.name, row.name],
      [this.notes, row.notes],
    ]) {
      const shown = value || "";
      const editing = field.dataset.stored !== undefined && field.value !== field.dataset.stored;
      if (!editing) field.value = shown;
      field.dataset.stored = shown;
    }
  }

  update(row) {
    this.row = row;
    if (this.removed) return;
    this.fillFields(row);
    const button = this.forgetBox.querySelector("button[data-action='forget']");
    if (button) button.disabled = !this.mayForget();
    this.showForgetReason();
  }

  gone() {
    this.removed = true;
    for (const control of this.section.querySelectorAll("input, textarea, button")) control.disabled = true;
  }

  mayForget() {
    return this.admin && !this.removed && this.row.state === "offline";
  }

  showForgetReason() {
    this.forgetReason.textContent = this.admin && this.row.state !== "offline" && !this.removed ? T.forgetOnline : "";
  }

  // ---- name and notes --------------------------------------------------------------------------

  async store() {
    if (!this.admin) return;
    this.save.disabled = true;
    this.save.textContent = T.saving;
    this.saved.className = "hint";
    this.saved.textContent = "";
    try {
      const row = await api(`${this.path}/notes`, { method: "PUT", body: { name: this.name.value, notes: this.notes.value } });
      this.name.dataset.stored = this.name.value = row.name || "";
      this.notes.dataset.stored = this.notes.value = row.notes || "";
      this.saved.textContent = T.saved;
      announce(T.saved);
    } catch (error) {
      this.saved.className = "error";
      this.saved.textContent = T.notSaved(error.message);
    } finally {
      this.save.disabled = !this.admin || this.removed;
      this.save.textContent = T.save;
    }
  }

  // ---- revoking and forgetting -----------------------------------------------------------------

  revokeButton() {
    return el("button", {
      type: "button",
      class: "secondary",
      "data-action": "revoke",
      text: T.revoke,
      disabled: !this.admin || this.removed,
      "aria-describedby": ["device-revoke-help", this.admin ? null : "device-actions-denied"].filter(Boolean).join(" "),
      on: { click: () => this.ask(this.revokeBox, "revoke") },
    });
  }

  forgetButton() {
    return el("button", {
      type: "button",
      class: "secondary",
      "data-action": "forget",
      text: T.forget,
      disabled: !this.mayForget(),
      "aria-describedby": ["device-forget-help", "device-forget-reason", this.admin ? null : "device-actions-denied"].filter(Boolean).join(" "),
      on: { click: () => this.ask(this.forgetBox, "forget") },
    });
  }

  /** The confirm step in place of the button: "Yes, ..." (focused) or Cancel (or Escape). */
  ask(box, action) {
    const id = this.deviceId;
    const revoking = action === "revoke";
    const problem = el("p", { class: "error", role: "alert" });
    const yes = el("button", { type: "button", class: "danger", text: revoking ? T.confirmRevokeButton(id) : T.confirmForgetButton(id) });
    const back = () => {
      const button = revoking ? this.revokeButton() : this.forgetButton();
      box.replaceChildren(button);
      button.focus();
    };
    const no = el("button", { type: "button", class: "secondary", text: T.cancel, on: { click: back } });
    yes.addEventListener("click", async () => {
      yes.disabled = true;
      try {
        if (revoking) await api(`/api/provisioning/devices/${encodeURIComponent(id)}/revoke`, { method: "POST" });
        else await api(this.path, { method: "DELETE" });
      } catch (error) {
        yes.disabled = false;
        problem.textContent = revoking ? T.notRevoked(error.message) : T.notForgotten(error.message);
        return;
      }
      const said = revoking ? T.revoked(id) : T.forgotten(id);
      this.removalSaid.textContent = said;
      announce(said);
      if (revoking) {
        back();
        return;
      }
      this.gone();
      box.replaceChildren(this.forgetButton());
      this.detail.heading.focus();
    });
    const group = el(
      "div",
      { class: "confirm", role: "group", "aria-label": revoking ? T.revoke : T.forget },
      el("p", { text: revoking ? T.confirmRevoke(id) : T.confirmForget(id) }),
      el("div", { class: "row" }, yes, no),
      problem,
    );
    group.addEventListener("keydown", (event) => {
      if (event.key !== "Escape") return;
      event.stopPropagation(); // backs out of this step only, not out of the device's detail
      back();
    });
    box.replaceChildren(group);
    yes.focus();
  }
}
