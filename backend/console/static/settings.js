// The settings page: the chat and guardrail models this browser's
// requests ask for, chosen from what the bridge's model provider lists. Kept in localStorage
// ("bridge.settings"); the chat page sends them with every turn (null: the server's default).
import { announce, api, can, el, lacksScope, saveSettings, settings, startPage } from "/console/common.js";
import { strings } from "/console/i18n.js";
import TEXT from "/console/text/settings.js";

const T = strings(TEXT);
// Ollama is a name: the same in every language.
const PROVIDERS = { openai: T.openaiCompatible, ollama: "Ollama", none: T.noProvider };

startPage(T.title, async (main, me) => {
  if (!can(me, "chat:use")) {
    lacksScope(main, "chat:use");
    return;
  }
  const status = el("p", { class: "hint", role: "status", text: T.asking });
  main.replaceChildren(el("h1", { text: T.title }), status);
  let listing;
  try {
    listing = await api("/api/chat/models");
  } catch (error) {
    status.className = "error";
    status.textContent = T.cannotRead(error.message);
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
    el("h2", { id: "models-title", text: T.modelsTitle }),
    el("p", { class: "hint", text: T.provider(provider) }),
    listing.error ? el("p", { class: "notice", text: T.noModels(listing.error) }) : null,
    field("chat-model", T.chatModel, chat, T.chatHelp, listing.defaults.chat),
    field("guardrail-model", T.guardrailModel, guard, T.guardrailHelp, listing.defaults.guardrail),
    message,
    el(
      "div",
      { class: "row" },
      el("button", { type: "submit", text: T.save }),
      el("button", {
        type: "button",
        class: "secondary",
        text: T.useDefaults,
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
    const said = T.saved(values.chat_model || T.serverDefaultWord, values.guardrail_model || T.serverDefaultWord);
    message.textContent = said;
    announce(said);
  });
  return node;
}

function field(id, label, control, help, serverDefault) {
  const helpText = serverDefault ? T.helpWithDefault(help, serverDefault) : help;
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
  const defaultLabel = serverDefault ? T.serverDefaultOf(serverDefault) : T.serverDefault;
  select.append(el("option", { value: "", text: defaultLabel }));
  for (const name of models) select.append(el("option", { value: name, text: name }));
  if (chosen && !models.includes(chosen)) {
    select.append(el("option", { value: chosen, text: T.notListed(chosen) }));
  }
  select.value = chosen || "";
  return select;
}
