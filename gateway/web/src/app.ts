// The gateway's browser page: models over gRPC-Web (a client generated from our protos by
// `buf generate`), a generation streamed with EventSource from the gateway's SSE endpoint.
import { createClient } from "@connectrpc/connect";
import { createGrpcWebTransport } from "@connectrpc/connect-web";
import { ModelService, ModelState } from "./gen/modelyard/inference/v1/model_service_pb";

const $ = <T extends HTMLElement>(id: string) => document.getElementById(id) as T;

const models = createClient(ModelService, createGrpcWebTransport({ baseUrl: location.origin }));

async function listModels(): Promise<void> {
  const panel = $<HTMLUListElement>("models");
  const select = $<HTMLSelectElement>("model");
  try {
    const { models: list } = await models.listModels({});
    panel.replaceChildren();
    select.replaceChildren();
    for (const model of list) {
      const ready = model.versions.filter((v) => v.state === ModelState.READY).map((v) => v.version);
      const item = document.createElement("li");
      item.className = "model";
      item.dataset.name = model.name;
      item.textContent = `${model.name}  versions ${ready.join(", ") || "none ready"}`;
      panel.append(item);
      const option = document.createElement("option");
      option.value = option.textContent = model.name;
      select.append(option);
    }
    const preferred = list.find((m) => m.name === "codelm");
    if (preferred) select.value = preferred.name;
    panel.dataset.state = "loaded";
  } catch (err) {
    panel.dataset.state = "error";
    panel.textContent = `gRPC-Web ListModels failed: ${err}`;
  }
}

let source: EventSource | null = null;

function generate(event: Event): void {
  event.preventDefault();
  source?.close();
  const output = $("output");
  const status = $("status");
  output.textContent = "";
  output.dataset.events = "0";
  $("version").textContent = "-";
  $("dye").textContent = "-";
  const params = new URLSearchParams({
    prompt: $<HTMLTextAreaElement>("prompt").value,
    max_tokens: $<HTMLInputElement>("max-tokens").value,
    temperature: $<HTMLInputElement>("temperature").value,
  });
  const model = encodeURIComponent($<HTMLSelectElement>("model").value);
  status.dataset.state = "streaming";
  status.textContent = "streaming...";
  let tokens = 0;
  const es = new EventSource(`/v1/models/${model}/generate?${params}`);
  source = es;
  es.addEventListener("token", (e) => {
    const data = JSON.parse((e as MessageEvent).data);
    output.textContent += data.text;
    tokens += data.token_ids.length;
    output.dataset.events = String(Number(output.dataset.events || 0) + 1);
    $("version").textContent = data.model_version;
    if (data.model_dye) $("dye").textContent = data.model_dye;
  });
  es.addEventListener("done", (e) => {
    const data = JSON.parse((e as MessageEvent).data);
    es.close(); // the end: without this EventSource would reconnect (and be told 204)
    $("version").textContent = data.model_version;
    $("dye").textContent = data.model_dye || "none";
    status.dataset.state = "done";
    status.textContent = `done: ${data.finish_reason}, ${tokens} tokens, first token after ${data.time_to_first_token_ms.toFixed(1)} ms`;
  });
  es.addEventListener("error", (e) => {
    const data = (e as MessageEvent).data;
    if (data) {
      // An `event: error` from the gateway: the generation failed after it started.
      es.close();
      const error = JSON.parse(data);
      status.dataset.state = "error";
      status.textContent = `error ${error.status} ${error.code} (${error.reason}): ${error.message}`;
    } else if (es.readyState === EventSource.CLOSED) {
      status.dataset.state = "error";
      status.textContent = "the stream could not be opened";
    } else {
      status.textContent = "reconnecting (resuming from the last event)...";
    }
  });
}

$("form").addEventListener("submit", generate);
$("refresh").addEventListener("click", () => void listModels());
void listModels();
