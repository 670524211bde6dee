// The firmware page: the published releases per board (GET /api/firmware), a new image uploaded
// with its progress (PUT /api/firmware/{board}/{version}, the file as the body), a release
// unpublished with a confirm step (DELETE /api/firmware/{board}/{version}), and which device
// runs which version (GET /api/devices: what each reported at its OTA check). The release
// actions need `admin`; the server checks it again. The bridge offers the newest release of a
// board to every device of that board at once: there is no staged rollout to show.
import { ApiError, announce, api, can, el, getKey, startPage } from "/console/common.js";
import { language, strings } from "/console/i18n.js";
import TEXT from "/console/text/firmware.js";

const T = strings(TEXT);
const MAX_BYTES = 32 << 20; // the bridge's cap on an upload (backend/provisioning/releases.py)
const BOARD = /^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$/;
const VERSION = /^[0-9]{1,9}(\.[0-9]{1,9}){0,3}$/;

startPage(T.title, async (main, me) => {
  await new FirmwarePage(main, can(me, "admin"), can(me, "devices:read")).start();
});

/** Dot-separated integers, or null (as backend/provisioning/ota.py parse_version). */
function parseVersion(text) {
  return typeof text === "string" && VERSION.test(text) ? text.split(".").map(Number) : null;
}

/** -1, 0 or 1; missing parts count as 0. Both must parse. */
function compareVersions(a, b) {
  const width = Math.max(a.length, b.length);
  for (let i = 0; i < width; i++) {
    const x = a[i] || 0;
    const y = b[i] || 0;
    if (x !== y) return x < y ? -1 : 1;
  }
  return 0;
}

function formatSize(bytes) {
  const number = (value) => new Intl.NumberFormat(language(), { maximumFractionDigits: 1 }).format(value);
  if (bytes >= 1 << 20) return `${number(bytes / (1 << 20))} MiB`;
  if (bytes >= 1 << 10) return `${number(bytes / (1 << 10))} KiB`;
  return `${number(bytes)} B`;
}

function formatTime(iso) {
  const time = Date.parse(iso);
  return Number.isFinite(time) ? new Date(time).toLocaleString(language()) : iso || "";
}

/** PUT the file as the body, reporting progress (0..1); resolves to the JSON answer. */
function putFile(path, file, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("PUT", path);
    const key = getKey();
    if (key) xhr.setRequestHeader("Authorization", `Bearer ${key}`);
    xhr.setRequestHeader("Content-Type", "application/octet-stream");
    xhr.responseType = "json";
    xhr.upload.addEventListener("progress", (event) => {
      if (event.lengthComputable && event.total) onProgress(event.loaded / event.total);
    });
    xhr.addEventListener("load", () => {
      if (xhr.status >= 200 && xhr.status < 300) {
        resolve(xhr.response);
        return;
      }
      const error = xhr.response && typeof xhr.response === "object" ? xhr.response.error : null;
      if (xhr.status === 401) window.dispatchEvent(new CustomEvent("bridge:unauthorized"));
      const message = (error && error.message) || `${xhr.status} ${xhr.statusText}`;
      reject(new ApiError(xhr.status, message, error && error.code));
    });
    xhr.addEventListener("error", () => reject(new Error(T.networkError)));
    xhr.send(file);
  });
}

class FirmwarePage {
  constructor(main, admin, reader) {
    this.main = main;
    this.admin = admin;
    this.reader = reader;
    this.releases = [];
  }

  async start() {
    this.releaseStatus = el("p", { id: "releases-status", class: "hint", role: "status" });
    this.releaseBox = el("div", { id: "releases-list" });
    this.deviceStatus = el("p", { id: "devices-status", class: "hint", role: "status" });
    this.deviceBox = el("div", { id: "firmware-devices" });
    this.main.replaceChildren(
      el("h1", { text: T.title }),
      el("p", { class: "hint", text: T.intro }),
      el("p", { id: "no-rollout", class: "hint", text: T.noRollout }),
      ...(this.admin ? [] : [el("p", { id: "firmware-denied", class: "notice", role: "status", text: T.lacksAdmin })]),
      this.uploadForm(),
      this.releasesSection(),
      this.devicesSection(),
    );
    await this.refresh();
  }

  async refresh() {
    if (this.admin) await this.loadReleases();
    await this.loadDevices();
  }

  // ---- uploading --------------------------------------------------------------------------

  uploadForm() {
    const max = formatSize(MAX_BYTES);
    const field = (id, label, input, help) =>
      el("div", { class: "field" }, el("label", { for: id, text: label }), input, el("p", { id: `${id}-help`, class: "hint", text: help }));
    this.boardList = el("datalist", { id: "known-boards" });
    const board = el("input", {
      id: "fw-board",
      type: "text",
      required: true,
      maxlength: "64",
      autocomplete: "off",
      spellcheck: "false",
      list: "known-boards",
      "aria-describedby": "fw-board-help",
    });
    const version = el("input", {
      id: "fw-version",
      type: "text",
      required: true,
      maxlength: "40",
      inputmode: "decimal",
      autocomplete: "off",
      spellcheck: "false",
      "aria-describedby": "fw-version-help",
    });
    const file = el("input", { id: "fw-file", type: "file", required: true, accept: ".bin,.bundle,application/octet-stream", "aria-describedby": "fw-file-help" });
    const progress = el("progress", { id: "upload-progress", max: "100", value: "0" });
    const progressText = el("span", { id: "upload-progress-text", class: "hint" });
    const progressBox = el("div", { class: "row upload-progress", hidden: true }, el("label", { for: "upload-progress", text: T.progress }), progress, progressText);
    const result = el("p", { id: "upload-result", role: "status" });
    const error = el("p", { id: "upload-error", class: "error", role: "alert" });
    const submit = el("button", { type: "submit", id: "upload-button", text: T.upload });
    const fields = el(
      "fieldset",
      { class: "plain", disabled: !this.admin, "aria-describedby": this.admin ? null : "firmware-denied" },
      el("div", { class: "inline-form row" }, field("fw-board", T.board, board, T.boardHelp), field("fw-version", T.version, version, T.versionHelp)),
      field("fw-file", T.file, file, T.fileHelp(max)),
      this.boardList,
      progressBox,
      error,
      result,
      submit,
    );
    const form = el("form", { class: "card", "aria-labelledby": "upload-title", novalidate: true }, el("h2", { id: "upload-title", text: T.uploadTitle }), fields);
    const invalid = (input, message) => {
      input.setAttribute("aria-invalid", "true");
      error.textContent = message;
      input.focus();
    };
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      if (!this.admin || submit.disabled) return;
      error.textContent = "";
      result.textContent = "";
      for (const input of [board, version, file]) input.removeAttribute("aria-invalid");
      const boardName = board.value.trim();
      const versionName = version.value.trim();
      const image = file.files[0];
      if (!BOARD.test(boardName) || boardName.includes("..")) return invalid(board, T.badBoard);
      if (!VERSION.test(versionName)) return invalid(version, T.badVersion);
      if (!image) return invalid(file, T.noFile);
      if (!image.size) return invalid(file, T.emptyFile);
      if (image.size > MAX_BYTES) return invalid(file, T.tooBig(max));
      submit.disabled = true;
      submit.textContent = T.uploading;
      progress.value = 0;
      progressText.textContent = T.progressText(0);
      progressBox.hidden = false;
      const path = `/api/firmware/${encodeURIComponent(boardName)}/${encodeURIComponent(versionName)}`;
      try {
        const release = await putFile(path, image, (share) => {
          const percent = Math.floor(share * 100);
          progress.value = percent;
          progressText.textContent = percent >= 100 ? T.checking : T.progressText(percent);
        });
        form.reset();
        const said = T.published(release.board, release.version, formatSize(release.size));
        result.textContent = said;
        announce(said);
        await this.refresh();
      } catch (problem) {
        error.textContent = T.notPublished(problem.message);
      } finally {
        progressBox.hidden = true;
        submit.disabled = false;
        submit.textContent = T.upload;
      }
    });
    return form;
  }

  // ---- the releases -----------------------------------------------------------------------

  releasesSection() {
    const refresh = el("button", { type: "button", class: "secondary", text: T.refresh, disabled: !this.admin, on: { click: () => this.refresh() } });
    return el(
      "section",
      { "aria-labelledby": "releases-title" },
      el("div", { class: "row heading" }, el("h2", { id: "releases-title", tabindex: "-1", text: T.releasesTitle }), refresh),
      this.releaseStatus,
      this.releaseBox,
    );
  }

  async loadReleases() {
    try {
      this.releases = (await api("/api/firmware")).releases;
    } catch (error) {
      this.releaseStatus.className = "error";
      this.releaseStatus.textContent = T.notListed(error.message);
      return;
    }
    const boards = new Set(this.releases.map((release) => release.board));
    this.boardList.replaceChildren(...[...boards].sort().map((name) => el("option", { value: name })));
    this.releaseStatus.className = "hint";
    this.releaseStatus.textContent = this.releases.length ? `${T.releasesCount(this.releases.length, boards.size)}. ${T.downloadsHint}` : "";
    this.releaseBox.replaceChildren(this.releases.length ? this.releasesTable() : el("p", { class: "muted", text: T.releasesNone }));
  }

  /** The newest release of each board (what the OTA check offers), by board. */
  newest() {
    const best = new Map();
    for (const release of this.releases) {
      const version = parseVersion(release.version);
      const held = best.get(release.board);
      if (version && (!held || compareVersions(version, parseVersion(held.version)) > 0)) best.set(release.board, release);
    }
    return best;
  }

  releasesTable() {
    const newest = this.newest();
    const sorted = [...this.releases].sort(
      (a, b) => a.board.localeCompare(b.board) || compareVersions(parseVersion(b.version) || [], parseVersion(a.version) || []),
    );
    const wide = new Set([3, 4]);
    return el(
      "div",
      { class: "table-wrap", tabindex: "0", role: "region", "aria-label": T.releasesCaption },
      el(
        "table",
        { class: "releases" },
        el("caption", { class: "visually-hidden", text: T.releasesCaption }),
        el("thead", {}, el("tr", {}, T.releasesColumns.map((text, index) => el("th", { scope: "col", class: wide.has(index) ? "wide" : index === 2 || index === 5 ? "num" : null, text })))),
        el("tbody", {}, sorted.map((release) => this.releaseRow(release, newest.get(release.board) === release))),
      ),
    );
  }

  releaseRow(release, isNewest) {
    const action = el("td", {}, this.unpublishButton(release));
    return el(
      "tr",
      { "data-release": `${release.board}/${release.version}` },
      el("th", { scope: "row" }, el("code", { text: release.board })),
      el("td", {}, release.version, isNewest ? [" ", el("span", { class: "badge online", text: T.newest })] : null),
      el("td", { class: "num", text: formatSize(release.size) }),
      el("td", { class: "wide" }, el("code", { title: T.sha(release.sha256), text: release.sha256.slice(0, 12) })),
      el("td", { class: "wide", text: formatTime(release.published_at) }),
      el("td", { class: "num", text: String(release.downloads ?? 0) }),
      action,
    );
  }

  unpublishButton(release) {
    return el("button", {
      type: "button",
      class: "secondary",
      text: T.unpublish,
      disabled: !this.admin,
      "aria-label": T.unpublishLabel(release.board, release.version),
      on: { click: (event) => this.askUnpublish(release, event.target.closest("td")) },
    });
  }

  /** The confirm step, in the row: "Yes, unpublish" (focused) or "Cancel" (Escape). */
  askUnpublish(release, cell) {
    const { board, version } = release;
    const problem = el("p", { class: "error", role: "alert" });
    const yes = el("button", { type: "button", class: "danger", text: T.unpublishYes(board, version) });
    const back = () => {
      const button = this.unpublishButton(release);
      cell.replaceChildren(button);
      button.focus();
    };
    const no = el("button", { type: "button", class: "secondary", text: T.cancel, on: { click: back } });
    yes.addEventListener("click", async () => {
      yes.disabled = true;
      try {
        await api(`/api/firmware/${encodeURIComponent(board)}/${encodeURIComponent(version)}`, { method: "DELETE" });
      } catch (error) {
        yes.disabled = false;
        problem.textContent = T.notUnpublished(error.message);
        return;
      }
      announce(T.unpublished(board, version));
      await this.refresh();
      document.getElementById("releases-title").focus();
    });
    const box = el(
      "div",
      { class: "confirm", role: "group", "aria-label": T.unpublishLabel(board, version) },
      el("p", { text: T.unpublishConfirm(board, version) }),
      el("div", { class: "row" }, yes, no),
      problem,
    );
    box.addEventListener("keydown", (event) => {
      if (event.key === "Escape") back();
    });
    cell.replaceChildren(box);
    yes.focus();
  }

  // ---- the devices ------------------------------------------------------------------------

  devicesSection() {
    return el(
      "section",
      { "aria-labelledby": "devices-title" },
      el("h2", { id: "devices-title", text: T.devicesTitle }),
      el("p", { class: "hint", text: T.devicesHelp }),
      this.deviceStatus,
      this.deviceBox,
    );
  }

  async loadDevices() {
    if (!this.reader) {
      this.deviceBox.replaceChildren(el("p", { id: "devices-denied", class: "notice", text: T.lacksDevicesRead }));
      return;
    }
    let devices;
    try {
      devices = (await api("/api/devices?limit=1000")).devices;
    } catch (error) {
      this.deviceStatus.className = "error";
      this.deviceStatus.textContent = T.notListed(error.message);
      return;
    }
    this.deviceStatus.className = "hint";
    this.deviceStatus.textContent = devices.length ? T.devicesCount(devices.length) : "";
    for (const device of devices) {
      const board = device.ota && device.ota.board_type;
      if (board && ![...this.boardList.options].some((option) => option.value === board)) this.boardList.append(el("option", { value: board }));
    }
    this.deviceBox.replaceChildren(devices.length ? this.devicesTable(devices) : el("p", { class: "muted", text: T.devicesNone }));
  }

  devicesTable(devices) {
    const newest = this.admin ? this.newest() : null;
    const columns = newest ? T.devicesColumns : T.devicesColumns.slice(0, 4);
    return el(
      "div",
      { class: "table-wrap", tabindex: "0", role: "region", "aria-label": T.devicesCaption },
      el(
        "table",
        { class: "fw-devices" },
        el("caption", { class: "visually-hidden", text: T.devicesCaption }),
        el("thead", {}, el("tr", {}, columns.map((text, index) => el("th", { scope: "col", class: index === 1 ? "wide" : null, text })))),
        el("tbody", {}, devices.map((device) => this.deviceRow(device, newest))),
      ),
    );
  }

  deviceRow(device, newest) {
    const ota = device.ota || {};
    const board = ota.board_type || null;
    const firmware = ota.firmware_version || (device.server_info && device.server_info.version) || null;
    const reported = (value) => (value ? el("code", { text: value }) : el("span", { class: "muted", text: T.notReported }));
    const cells = [
      el("th", { scope: "row" }, el("code", { text: device.device_id })),
      el("td", { class: "wide" }, el("span", { class: `badge ${device.state === "offline" ? "offline" : "online"}`, text: T.states[device.state] || device.state })),
      el("td", {}, reported(board)),
      el("td", {}, reported(firmware)),
    ];
    if (newest) cells.push(el("td", {}, this.offerOf(newest.get(board), firmware)));
    return el("tr", { "data-device-id": device.device_id }, cells);
  }

  /** What the OTA check would offer this device: the newest release when strictly newer. */
  offerOf(release, firmware) {
    if (!release) return el("span", { class: "muted", text: T.noRelease });
    const available = parseVersion(release.version);
    const running = parseVersion(firmware);
    if (!available || !running) return el("span", { class: "muted", text: T.notComparable(release.version) });
    if (compareVersions(available, running) > 0) return el("span", { class: "badge warn", text: T.updateOffered(release.version) });
    return el("span", { class: "ok", text: T.upToDate(release.version) });
  }
}
