// gpumem report: runs first, in <head>: records script errors, unhandled rejections and console.error
// into the data-errors attribute of the html element and the errors pre element, where a reader and headless tests see them.
window.__errors = [];
function __record(msg) {
  window.__errors.push(String(msg));
  document.documentElement.setAttribute("data-errors", String(window.__errors.length));
  const p = document.getElementById("errors");
  if (p) { p.hidden = false; p.textContent = window.__errors.join("\n"); }
}
window.onerror = (msg, src, line, col, err) => { __record(`${msg} (line ${line}:${col})`); };
window.addEventListener("unhandledrejection", e => __record("unhandled rejection: " + e.reason));
const __consoleError = console.error.bind(console);
console.error = (...a) => { __record("console.error: " + a.join(" ")); __consoleError(...a); };
