// The page's one script. Everything it does the page also does without it (the form is a plain
// GET form); it adds: the fields of the question not asked are hidden and not sent, and a job
// file dropped (or chosen) fills the form: a planner JSON request, or a result holding one, here;
// any other file through POST /v1/check, whose answer carries the request as our schema reads it.
"use strict";

const form = () => document.getElementById("form");
const say = (text) => { document.getElementById("drop-status").textContent = text; };

function currentAsk() {
  const checked = form().querySelector("input[name=ask]:checked");
  return checked ? checked.value : "plan";
}

function showAsk() {
  const ask = currentAsk();
  for (const field of form().querySelectorAll(".field[data-asks]")) {
    const on = field.dataset.asks.split(" ").includes(ask);
    field.classList.toggle("hidden-by-ask", !on);
    for (const control of field.querySelectorAll("input, select, textarea")) control.disabled = !on;
  }
  for (const name of ["tp", "pp", "cp", "ep"]) {
    const box = form().elements.namedItem(name);
    if (box) box.placeholder = ask === "plan" ? "planner chooses" : "1";
  }
}

function fieldNames() {
  return new Set([...form().querySelectorAll("[data-default]")].map((c) => c.name));
}

function asksOf(name) {
  const control = form().querySelector(`[data-default][name="${CSS.escape(name)}"]`);
  return control ? control.closest(".field").dataset.asks.split(" ") : [];
}

function shown(value) {
  if (value === null || value === undefined) return "";
  // a list of names (fused_kernels) is the form's comma-separated text; an object (model_config) its JSON
  if (Array.isArray(value) && value.every((v) => typeof v !== "object")) return value.join(",");
  if (typeof value === "object") return JSON.stringify(value, null, 1);
  return String(value);
}

// A request object (JSON names; model_config_ is the Python name of model_config) fills the form:
// every field first back to its default, then the request's values; the question is the one
// whose request has every field given (an estimate for a file read by /v1/check).
function fill(request, ask) {
  const given = Object.entries(request).map(([k, v]) => [k === "model_config_" ? "model_config" : k, v]);
  const names = fieldNames();
  if (!ask) {
    const set = given.filter(([, v]) => v !== null && v !== undefined).map(([k]) => k);
    ask = ["plan", "estimate"].find((a) => set.every((k) => !names.has(k) || asksOf(k).includes(a))) || currentAsk();
  }
  form().querySelector(`input[name=ask][value="${ask}"]`).checked = true;
  for (const control of form().querySelectorAll("[data-default]")) {
    if (control.type === "checkbox") control.checked = control.dataset.default === "true";
    else control.value = control.dataset.default;
  }
  if (!given.some(([k, v]) => k === "model" && v)) form().elements.namedItem("model").value = "";
  for (const [name, value] of given) {
    const control = form().querySelector(`[data-default][name="${CSS.escape(name)}"]`);
    if (!control) continue;
    if (control.type === "checkbox") control.checked = value === true || value === "true";
    else if (shown(value) !== control.dataset.schemaDefault) control.value = shown(value);  // a degree of 1: the planner's
    control.closest("details")?.setAttribute("open", "");
  }
  showAsk();
}

async function checkFile(name, text) {
  // The cluster fields CheckRequest takes besides the files, read from the server's own schema.
  const body = { files: [{ name, text }] };
  try {
    const schema = await (await fetch("/openapi.json")).json();
    const props = schema.components?.schemas?.CheckRequest?.properties || {};
    for (const control of form().querySelectorAll("[data-default]")) {
      if (control.name in props && control.name !== "files" && control.value !== control.dataset.default
          && control.value !== "" && control.type !== "checkbox") body[control.name] = control.value;
    }
  } catch (e) { /* no schema: the files alone */ }
  const response = await fetch("/v1/check", { method: "POST", headers: { "Content-Type": "application/json" },
                                               body: JSON.stringify(body) });
  if (response.status === 404 || response.status === 405) {
    say(`${name}: this server has no POST /v1/check, so only a planner JSON request can be dropped here.`);
    return;
  }
  const answer = await response.json().catch(() => ({}));
  if (!response.ok) {
    const detail = Array.isArray(answer.detail)
      ? answer.detail.map((d) => `${(d.loc || []).slice(1).join(".") || "file"}: ${d.msg}`).join("; ")
      : answer.detail || response.statusText;
    say(`${name}: /v1/check refused it (${response.status}): ${detail}`);
    return;
  }
  if (!answer.request) { say(`${name}: /v1/check answered without a request to fill the form with.`); return; }
  fill(answer.request, "estimate");
  const notes = [].concat(answer.notes || [], answer.warnings || []).filter((n) => typeof n === "string");
  say(`${name}: read by /v1/check; the form holds the job as the planner reads it.` + (notes.length ? " " + notes.join(" ") : ""));
  form().requestSubmit();
}

async function takeFile(file) {
  const text = await file.text();
  let parsed = null;
  try { parsed = JSON.parse(text); } catch (e) { parsed = null; }
  const request = parsed && typeof parsed === "object" && !Array.isArray(parsed)
    ? (parsed.request && typeof parsed.request === "object" ? parsed.request : parsed) : null;
  const names = fieldNames();
  if (request && Object.keys(request).length &&
      Object.keys(request).every((k) => names.has(k === "model_config_" ? "model_config" : k) || k === "ask")) {
    const { ask, ...fields } = request;
    fill(fields, ask);
    say(`${file.name}: a planner request; the form is filled from it.`);
    form().requestSubmit();
    return;
  }
  say(`${file.name}: not a planner request; asking /v1/check to read it ...`);
  await checkFile(file.name, text);
}

document.addEventListener("DOMContentLoaded", () => {
  for (const radio of form().querySelectorAll("input[name=ask]")) radio.addEventListener("change", showAsk);
  showAsk();
  const zone = document.getElementById("drop");
  // a file dropped anywhere on the page is taken (the browser would otherwise open it in place)
  document.addEventListener("dragover", (e) => { e.preventDefault(); zone.classList.add("over"); });
  document.addEventListener("dragleave", (e) => { if (!e.relatedTarget) zone.classList.remove("over"); });
  document.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("over");
    const file = e.dataTransfer.files[0];
    if (file) takeFile(file).catch((err) => say(`${file.name}: ${err}`));
  });
  document.getElementById("job-file").addEventListener("change", (e) => {
    const file = e.target.files[0];
    if (file) takeFile(file).catch((err) => say(`${file.name}: ${err}`));
  });
});
