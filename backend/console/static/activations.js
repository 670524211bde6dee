// The activations page: devices waiting for activation (GET /api/provisioning/pending), approved
// by typing the code the device shows (POST /api/provisioning/approve), a waiting request
// rejected (DELETE /api/provisioning/pending/{code}), and the approved devices with revoking
// (POST /api/provisioning/devices/{id}/revoke). Every action needs `admin`; the server checks it
// again. The lists are read again every REFRESH_MS while the tab is visible.
import { ago, announce, api, can, el, startPage } from "/console/common.js";
import { strings } from "/console/i18n.js";
import TEXT_TABLE from "/console/text/activations.js";

const REFRESH_MS = 5000;

// Every string of the page: /console/text/activations.js, in the chosen language.
const TEXT = strings(TEXT_TABLE);

startPage(TEXT.title, async (main, me) => {
  await new ActivationsPage(main, can(me, "admin")).start();
});

class ActivationsPage {
  constructor(main, admin) {
    this.main = main;
    this.admin = admin;
  }

  async start() {
    this.pendingStatus = el("p", { id: "pending-status", class: "hint", role: "status" });
    this.pendingBox = el("div", { id: "pending-list" });
    this.devicesStatus = el("p", { id: "devices-status", class: "hint" });
    this.devicesBox = el("div", { id: "approved-list" });
    this.main.replaceChildren(
      el("h1", { text: TEXT.title }),
      ...(this.admin ? [] : [el("p", { id: "activations-denied", class: "notice", role: "status", text: TEXT.lacksAdmin })]),
      this.approveForm(),
      el(
        "section",
        { "aria-labelledby": "pending-title" },
        el(
          "div",
          { class: "row heading" },
          el("h2", { id: "pending-title", tabindex: "-1", text: TEXT.pendingTitle }),
          el("button", { type: "button", class: "secondary", disabled: !this.admin, text: TEXT.refresh, on: { click: () => this.refresh() } }),
        ),
        this.pendingStatus,
        this.pendingBox,
      ),
      el("section", { "aria-labelledby": "approved-title" }, el("h2", { id: "approved-title", tabindex: "-1", text: TEXT.devicesTitle }), this.devicesStatus, this.devicesBox),
    );
    if (!this.admin) return;
    await this.refresh();
    setInterval(() => {
      // Not while a confirm step is open or the focus is in a list: redrawing would lose it.
      const busy = this.main.querySelector(".confirm") || document.activeElement?.closest(".table-wrap");
      if (document.visibilityState === "visible" && !busy) this.refresh();
    }, REFRESH_MS);
  }

  approveForm() {
    const code = el("input", {
      id: "approve-code",
      type: "text",
      inputmode: "numeric",
      autocomplete: "off",
      required: true,
      pattern: "[0-9]{6}",
      maxlength: "6",
      class: "code-input",
      "aria-describedby": "approve-help",
    });
    const transport = el("select", { id: "approve-transport" }, TEXT.transports.map(([value, label]) => el("option", { value, text: label })));
    const said = el("p", { id: "approve-result", role: "status" });
    const submit = el("button", { type: "submit", text: TEXT.approve });
    const form = el(
      "form",
      { class: "card", "aria-labelledby": "approve-title", novalidate: true },
      el("h2", { id: "approve-title", text: TEXT.approveTitle }),
      el("p", { id: "approve-help", class: "hint", text: TEXT.approveHelp }),
      el(
        "fieldset",
        { class: "plain", disabled: !this.admin },
        el(
          "div",
          { class: "row inline-form" },
          el("div", { class: "field" }, el("label", { for: "approve-code", text: TEXT.code }), code),
          el("div", { class: "field" }, el("label", { for: "approve-transport", text: TEXT.transport }), transport),
          submit,
        ),
      ),
      said,
    );
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      if (!this.admin) return;
      const value = code.value.trim();
      if (!/^[0-9]{6}$/.test(value)) {
        said.className = "error";
        said.textContent = TEXT.badCode;
        code.setAttribute("aria-invalid", "true");
        code.focus();
        return;
      }
      code.removeAttribute("aria-invalid");
      submit.disabled = true;
      submit.textContent = TEXT.approving;
      try {
        const body = { target: value, transport: transport.value || null };
        const device = await api("/api/provisioning/approve", { method: "POST", body });
        said.className = "ok";
        said.textContent = TEXT.approved(device);
        code.value = "";
        await this.refresh();
      } catch (error) {
        said.className = "error";
        said.textContent = TEXT.notApproved(error.message);
        code.focus();
      } finally {
        submit.disabled = false;
        submit.textContent = TEXT.approve;
      }
    });
    return form;
  }

  async refresh() {
    let pending;
    let devices;
    try {
      [pending, devices] = await Promise.all([api("/api/provisioning/pending"), api("/api/provisioning/devices")]);
    } catch (error) {
      this.pendingStatus.className = "error";
      this.pendingStatus.textContent = TEXT.notListed(error.message);
      return;
    }
    this.showPending(pending.pending);
    this.showDevices(devices.devices);
  }

  showPending(rows) {
    this.pendingStatus.className = "hint";
    this.pendingStatus.textContent = rows.length ? TEXT.pendingCount(rows.length) : TEXT.pendingNone;
    if (!rows.length) {
      this.pendingBox.replaceChildren();
      return;
    }
    const body = rows.map((request) => {
      const action = el("td", {});
      action.append(this.actionButton(action, {
        label: TEXT.reject,
        aria: TEXT.rejectLabel(request.code, request.device_id),
        question: TEXT.rejectConfirm(request.device_id),
        yes: TEXT.rejectYes(request.code),
        run: () => api(`/api/provisioning/pending/${encodeURIComponent(request.code)}`, { method: "DELETE" }),
        said: TEXT.rejected(request.code, request.device_id),
        focus: "pending-title",
      }));
      return el(
        "tr",
        { "data-code": request.code },
        el("th", { scope: "row" }, el("code", { class: "code", text: request.code })),
        el("td", {}, el("code", { text: request.device_id }), request.candidates > 1 ? el("span", { class: "badge warn", text: TEXT.candidates(request.candidates) }) : null),
        el("td", { class: "wide" }, el("code", { text: request.client_id })),
        el("td", { text: request.board || "" }),
        el("td", { text: request.firmware || "" }),
        el("td", { class: "wide", text: request.remote || "" }),
        el("td", { text: ago(request.created_at), title: request.created_at }),
        el("td", { class: "wide", text: ago(request.last_seen), title: request.last_seen }),
        action,
      );
    });
    this.pendingBox.replaceChildren(tableOf("pending", TEXT.pendingCaption, TEXT.pendingColumns, new Set([2, 4, 5, 7]), body));
  }

  showDevices(rows) {
    this.devicesStatus.textContent = rows.length ? "" : TEXT.devicesNone;
    if (!rows.length) {
      this.devicesBox.replaceChildren();
      return;
    }
    const body = rows.map((device) => {
      const action = el("td", {});
      if (device.status === "approved") {
        action.append(this.actionButton(action, {
          label: TEXT.revoke,
          aria: TEXT.revokeLabel(device.device_id),
          question: TEXT.revokeConfirm(device.device_id),
          yes: TEXT.revokeYes(device.device_id),
          run: () => api(`/api/provisioning/devices/${encodeURIComponent(device.device_id)}/revoke`, { method: "POST" }),
          said: TEXT.revokedSaid(device.device_id),
          focus: "approved-title",
        }));
      }
      const approved = device.approved_at ? TEXT.by(ago(device.approved_at), device.approved_by || "") : "";
      return el(
        "tr",
        { "data-device-id": device.device_id, class: device.status === "approved" ? null : "revoked" },
        el("th", { scope: "row" }, el("code", { text: device.device_id })),
        el("td", { class: "wide" }, el("code", { text: device.client_id || "" })),
        el("td", { text: TEXT.status(device.status) }),
        el("td", { class: "wide num", text: String(device.generation) }),
        el("td", { class: "wide", text: device.transport || TEXT.defaultTransport }),
        el("td", { text: approved }),
        action,
      );
    });
    this.devicesBox.replaceChildren(tableOf("approved", TEXT.devicesCaption, TEXT.devicesColumns, new Set([1, 3, 4]), body));
  }

  /** A row's action button with its confirm step in the same cell. */
  actionButton(cell, action) {
    const button = el("button", {
      type: "button",
      class: "secondary",
      text: action.label,
      "aria-label": action.aria,
      disabled: !this.admin,
      on: { click: () => this.confirm(cell, action) },
    });
    return button;
  }

  confirm(cell, action) {
    const problem = el("p", { class: "error", role: "alert" });
    const back = () => {
      const button = this.actionButton(cell, action);
      cell.replaceChildren(button);
      button.focus();
    };
    const yes = el("button", { type: "button", class: "danger", text: action.yes });
    const no = el("button", { type: "button", class: "secondary", text: TEXT.cancel, on: { click: back } });
    yes.addEventListener("click", async () => {
      yes.disabled = true;
      try {
        await action.run();
      } catch (error) {
        yes.disabled = false;
        problem.textContent = TEXT.failed(error.message);
        return;
      }
      announce(action.said);
      cell.replaceChildren();
      await this.refresh();
      document.getElementById(action.focus)?.focus();
    });
    const box = el("div", { class: "confirm", role: "group", "aria-label": action.aria }, el("p", { text: action.question }), el("div", { class: "row" }, yes, no), problem);
    box.addEventListener("keydown", (event) => {
      if (event.key === "Escape") back();
    });
    cell.replaceChildren(box);
    yes.focus();
  }
}

function tableOf(name, caption, columns, wide, body) {
  return el(
    "div",
    { class: "table-wrap", tabindex: "0", role: "region", "aria-label": caption },
    el(
      "table",
      { class: name },
      el("caption", { class: "visually-hidden", text: caption }),
      el("thead", {}, el("tr", {}, columns.map((text, index) => el("th", { scope: "col", class: wide.has(index) ? "wide" : null, text })))),
      el("tbody", {}, body),
    ),
  );
}
