// The gateway's browser page: models over gRPC-Web (a client generated from our protos by
// `buf generate`), a generation streamed from the gateway's SSE endpoint with fetch and a
// streaming body reader, so the server's error message and reason reach the page (EventSource
// cannot read an error's body). A dropped connection resumes from the last event id, as
// EventSource would.
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createGrpcWebTransport } from "@connectrpc/connect-web";
import { type Model, ModelService, ModelState } from "./gen/modelyard/inference/v1/model_service_pb";
import { readEvents, type SseState } from "./sse";
import { type ApiError, describe, fromResponse } from "./words";

const $ = <T extends HTMLElement>(id: string) => document.getElementById(id) as T;

const models = createClient(ModelService, createGrpcWebTransport({ baseUrl: location.origin }));
const RESUME_ATTEMPTS = 5; // reconnects in a row without a new event before giving up

// A decoder, as the service's Generate requires one (service/generation/layout.py): input_ids and
// attention_mask in, logits out. The panel lists every model; the generate box offers these.
function isDecoder(model: Model): boolean {
  const inputs = new Set(model.inputs.map((t) => t.name));
  return inputs.has("input_ids") && inputs.has("attention_mask") && model.outputs.some((t) => t.name === "logits");
}

async function listModels(): Promise<void> {
  const panel = $<HTMLUListElement>("models");
  const note = $("models-note");
  const select = $<HTMLSelectElement>("model");
  panel.dataset.state = "loading";
  try {
    const { models: list } = await models.listModels({});
    note.textContent = "";
    panel.replaceChildren();
    const chosen = select.value;
    const decoders = list.filter(isDecoder);
    for (const model of list) {
      const ready = model.versions.filter((v) => v.state === ModelState.READY).map((v) => v.version);
      const item = document.createElement("li");
      item.className = "model";
      item.dataset.name = model.name;
      item.textContent = `${model.name}: versions ${ready.join(", ") || "none ready"}${isDecoder(model) ? " (decoder)" : ""}`;
      panel.append(item);
    }
    if (decoders.length) {
      select.replaceChildren(
        ...decoders.map((model) => {
          const option = document.createElement("option");
          option.value = option.textContent = model.name;
          return option;
        }),
      );
      const keep = decoders.find((m) => m.name === chosen) ?? decoders.find((m) => m.name === "codelm");
      if (keep) select.value = keep.name;
    }
    panel.dataset.state = "loaded";
  } catch (err) {
    panel.dataset.state = "error";
    panel.replaceChildren();
    note.textContent = modelsFailure(err);
  }
}

function modelsFailure(err: unknown): string {
  const error = ConnectError.from(err);
  // The gateway alone answers gRPC-Web with 404 (seen as UNIMPLEMENTED): only Envoy translates it.
  if (error.code === Code.Unimplemented || /HTTP 404/.test(error.rawMessage)) {
    return (
      "The models list needs gRPC-Web, which Envoy serves, not the gateway on this port. " +
      'Open this page through Envoy: `make up` prints its address as "browser page" ' +
      "(http://127.0.0.1:8080/ by default). Generating text works here too."
    );
  }
  return `The models could not be listed: ${error.rawMessage || error.message}`;
}

// --- generation -------------------------------------------------------------------------------

let running: AbortController | null = null;

function setStatus(state: string, summary: string, detail = ""): void {
  const status = $("status");
  status.dataset.state = state;
  status.replaceChildren(summary);
  if (detail) {
    const small = document.createElement("span");
    small.className = "detail";
    small.textContent = detail;
    status.append(" ", small);
  }
}

function setRunning(on: boolean): void {
  $<HTMLButtonElement>("generate").disabled = on;
  $<HTMLButtonElement>("stop").disabled = !on;
  $("output").setAttribute("aria-busy", String(on));
}

// The JSON body: numbers where the field holds one; otherwise what was typed, so the server names
// the field in its refusal; an empty field is left to the server's default.
function requestBody(): string {
  const body: Record<string, unknown> = { prompt: $<HTMLTextAreaElement>("prompt").value };
  for (const [field, id] of [
    ["max_tokens", "max-tokens"],
    ["temperature", "temperature"],
  ]) {
    const input = $<HTMLInputElement>(id);
    const text = input.value.trim();
    if (text !== "") body[field] = Number.isFinite(input.valueAsNumber) ? input.valueAsNumber : text;
    else if (input.validity.badInput) body[field] = "not a number";
  }
  return JSON.stringify(body);
}

class Failed extends Error {
  constructor(readonly error: ApiError) {
    super(error.message);
  }
}

async function generate(event: Event): Promise<void> {
  event.preventDefault();
  if (running) {
    // One generation at a time: a new one never silently replaces the running one.
    $("stop").focus();
    return;
  }
  const controller = new AbortController();
  running = controller;
  setRunning(true);
  const output = $("output");
  output.textContent = "";
  output.dataset.events = "0";
  $("version").textContent = "-";
  $("dye").textContent = "-";
  setStatus("streaming", "Generating...");
  const path = `/v1/models/${encodeURIComponent($<HTMLSelectElement>("model").value)}/generate`;
  const body = requestBody();
  const state: SseState = { lastId: "", retryMs: null };
  let tokens = 0;
  let attempts = 0;
  try {
    for (;;) {
      const resuming = state.lastId !== "";
      let response: Response;
      try {
        response = await fetch(
          path,
          resuming
            ? { method: "GET", headers: { "Last-Event-ID": state.lastId }, signal: controller.signal }
            : { method: "POST", headers: { "content-type": "application/json" }, body, signal: controller.signal },
        );
      } catch (err) {
        if (controller.signal.aborted) throw err;
        if (!resuming) throw new Failed(unreachable(err));
        if (++attempts > RESUME_ATTEMPTS) throw new Failed(unreachable(err));
        await reconnectPause(state, controller.signal);
        continue;
      }
      if (response.status === 204) {
        setStatus("done", `Done: ${tokens} tokens.`); // the stream had ended: nothing more to send
        return;
      }
      if (!response.ok || !response.body) throw new Failed(fromResponse(response.status, await response.text()));
      const seenBefore = state.lastId;
      try {
        for await (const sse of readEvents(response.body, state)) {
          if (controller.signal.aborted) break; // stopped: events already received are not shown
          const data = JSON.parse(sse.data);
          if (sse.event === "token") {
            attempts = 0;
            output.textContent += data.text;
            tokens += data.token_ids.length;
            output.dataset.events = String(Number(output.dataset.events || 0) + 1);
            $("version").textContent = data.model_version;
            if (data.model_dye) $("dye").textContent = data.model_dye;
            if ($("status").dataset.state !== "streaming") setStatus("streaming", "Generating...");
          } else if (sse.event === "done") {
            $("version").textContent = data.model_version;
            $("dye").textContent = data.model_dye || "none";
            const first = Number(data.time_to_first_token_ms).toFixed(1);
            setStatus("done", `Done: ${data.finish_reason}, ${tokens} tokens, first token after ${first} ms.`);
            return;
          } else if (sse.event === "error") {
            throw new Failed(data as ApiError); // the generation failed after it started
          }
        }
      } catch (err) {
        if (err instanceof Failed || controller.signal.aborted) throw err;
        // A broken connection mid-stream: resume below.
      }
      if (controller.signal.aborted) throw controller.signal.reason;
      // The body ended without `done` or `error`: the connection dropped. Resume from the last
      // event (EventSource's behaviour), unless nothing at all arrived to resume from.
      if (!state.lastId) throw new Failed(unreachable(new Error("the stream closed before its first event")));
      if (state.lastId === seenBefore && ++attempts > RESUME_ATTEMPTS) {
        throw new Failed(unreachable(new Error("the stream keeps closing without new events")));
      }
      await reconnectPause(state, controller.signal);
    }
  } catch (err) {
    if (controller.signal.aborted) {
      setStatus("stopped", `Stopped after ${tokens} tokens.`);
    } else if (err instanceof Failed) {
      const { summary, detail } = describe(err.error);
      setStatus("error", summary, detail);
    } else {
      setStatus("error", "The page failed to read the answer.", String(err));
    }
  } finally {
    if (running === controller) running = null;
    setRunning(false);
  }
}

function unreachable(err: unknown): ApiError {
  return {
    status: 0,
    code: "UNAVAILABLE",
    reason: "unreachable",
    message: `could not reach the server (${err instanceof Error ? err.message : String(err)})`,
  };
}

async function reconnectPause(state: SseState, signal: AbortSignal): Promise<void> {
  setStatus("streaming", "Connection lost: resuming from the last token...");
  await new Promise<void>((resolve) => {
    const timer = setTimeout(resolve, Math.min(state.retryMs ?? 1000, 5000));
    signal.addEventListener("abort", () => {
      clearTimeout(timer);
      resolve();
    });
  });
  if (signal.aborted) throw signal.reason;
}

function stop(): void {
  running?.abort();
}

$("form").addEventListener("submit", (e) => void generate(e));
$("stop").addEventListener("click", stop);
$("refresh").addEventListener("click", () => void listModels());
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
    e.preventDefault();
    $<HTMLFormElement>("form").requestSubmit();
  }
});
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && running) {
    e.preventDefault();
    stop();
  }
});
void listModels();
