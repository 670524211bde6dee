// The console's languages: English and Vietnamese. Every string a page shows lives in its text
// module (`/console/text/<page>.js`: `export default { en: {...}, vi: {...} }`, the same keys in
// both; a value is a string or a function of the values it shows). `strings(table)` gives the
// chosen language's strings; a key missing there falls back to English (tests/test_console_i18n.py
// fails on any). The language: the one chosen with the switch (kept in this browser), else the
// browser's first language when it is Vietnamese, else English.
const LANGUAGE_ITEM = "bridge.language";

export const LANGUAGES = [
  ["en", "English"],
  ["vi", "Tiếng Việt"],
];

export function language() {
  const chosen = localStorage.getItem(LANGUAGE_ITEM);
  if (LANGUAGES.some(([code]) => code === chosen)) return chosen;
  const preferred = navigator.languages && navigator.languages.length ? navigator.languages : [navigator.language];
  return String(preferred[0] || "en").toLowerCase().startsWith("vi") ? "vi" : "en";
}

export function setLanguage(code) {
  localStorage.setItem(LANGUAGE_ITEM, code);
  location.reload();
}

export function strings(table) {
  const chosen = table[language()] || {};
  return new Proxy(table.en, { get: (english, key) => (key in chosen ? chosen[key] : english[key]) });
}

/** The locale for dates and numbers: Vietnamese's, or the browser's own (undefined) in English. */
export function locale() {
  return language() === "vi" ? "vi-VN" : undefined;
}

// The page's <html lang>, for screen readers and hyphenation: set once by startPage.
export function markLanguage() {
  document.documentElement.lang = language();
}
