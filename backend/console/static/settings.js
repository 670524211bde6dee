// The settings page (the seed's config.html): the chat and guardrail models this browser's
// requests ask for, chosen from what the bridge's model provider lists. Kept in localStorage
// ("bridge.settings"); the chat page sends them with every turn (null: the server's default).
import { announce, api, can, el, lacksScope, saveSettings, settings, startPage } from "/console/common.js";

const PROVIDERS = { openai: "OpenAI-compatible", ollama: "Ollama", none: "none (offline mode)" };

startPage("Settings", async (main, me) => {
  if (!can(me, "chat:use")) {
    lacksScope(main, "chat:use");
    return;
  }
  const status = el("p", { class: "hint", role: "status", text: "Asking the bridge for its models…" });
  main.replaceChildren(el("h1", { text: "Settings" }), status);
  let listing;
  try {
    listing = await api("/api/chat/models");
  } catch (error) {
    status.className = "error";
    status.textContent = `Could not read the models: ${error.message}`;
    return;
  }
  status.remove();
  main.append(form(listing));
});

function form(listing) {
  const saved = settings();
  const chat = modelSelect("chat-model", listing.models, listing.defaults.chat, saved.chat_model);
  const guard = modelSelect("guardrail-model", listing.models, listing.defaults.guardrail, saved.guardrail_model);
  const message = el("p", { id: "settings-saved", class: "ok", role: "status" });
  const provider = PROVIDERS[listing.provider] || listing.provider;

  const node = el(
    "form",
    { class: "card settings", "aria-labelledby": "models-title" },
    el("h2", { id: "models-title", text: "Models for this browser" }),
    el("p", { class: "hint", text: `Provider: ${provider}. Saved in this browser and sent with each chat request; other browsers and devices keep the server's models.` }),
    listing.error ? el("p", { class: "notice", text: `The provider listed no models: ${listing.error}` }) : null,
    field("chat-model", "Chat model", chat, "Writes the answers and the conversation summary.", listing.defaults.chat),
    field("guardrail-model", "Guardrail model", guard, "Decides whether a question is about dentistry.", listing.defaults.guardrail),
    message,
    el(
      "div",
      { class: "row" },
      el("button", { type: "submit", text: "Save" }),
      el("button", {
        type: "button",
        class: "secondary",
        text: "Use the server's defaults",
        on: {
          click: () => {
            chat.value = "";
            guard.value = "";
            node.requestSubmit();
          },
        },
      }),
    ),
  );
  node.addEventListener("submit", (event) => {
    event.preventDefault();
    const values = { chat_model: chat.value || null, guardrail_model: guard.value || null };
    saveSettings(values);
    const said = `Saved: chat model ${values.chat_model || "server default"}, guardrail model ${values.guardrail_model || "server default"}.`;
    message.textContent = said;
    announce(said);
  });
  return node;
}

function field(id, label, control, help, serverDefault) {
  const helpText = serverDefault ? `${help} Server default: ${serverDefault}.` : help;
  control.setAttribute("aria-describedby", `${id}-help`);
  return el(
    "div",
    { class: "field" },
    el("label", { for: id, text: label }),
    control,
    el("p", { id: `${id}-help`, class: "hint", text: helpText }),
  );
}

/** A select of "server default" and the listed models; a saved model the provider no longer
 *  lists stays selectable (marked), so saving again does not silently drop it. */
function modelSelect(id, models, serverDefault, chosen) {
  const select = el("select", { id, name: id });
  const defaultLabel = serverDefault ? `Server default (${serverDefault})` : "Server default";
  select.append(el("option", { value: "", text: defaultLabel }));
  for (const name of models) select.append(el("option", { value: name, text: name }));
  if (chosen && !models.includes(chosen)) {
    select.append(el("option", { value: chosen, text: `${chosen} (saved; not listed now)` }));
  }
  select.value = chosen || "";
  return select;
}
