// Errors in plain words: what happened, for a person, by the API's x-error-reason
// (modelyard.common.reasons); the server's own message is shown beside it, unchanged.

export interface ApiError {
  status: number;
  code: string;
  reason: string;
  message: string;
}

// Reasons whose server message already says it plainly (it names the field or the model).
const AS_SAID = new Set([
  "invalid_argument",
  "model_not_found",
  "version_not_found",
  "failed_precondition",
  "unsupported",
  "too_large",
]);

const PLAIN: Record<string, string> = {
  unavailable:
    "The model server stopped answering during this generation (it may have crashed or restarted). The text so far is kept; try again in a moment.",
  draining: "The server is restarting or shutting down. Try again in a moment.",
  queue_full: "The server is busy: too many generations are waiting. Try again in a moment.",
  tenant_limit: "You have reached your request limit. Try again in a moment.",
  breaker_open: "This model version is failing and is being given a rest. Try again in a moment.",
  deadline: "The generation took longer than its time limit.",
  reader_stalled: "This page stopped reading the stream for too long, so the server ended it.",
  model_failed: "The model failed while running this request.",
  internal: "The server failed with an internal error (a bug). The error id below is in its log.",
  resume_too_old: "The connection was lost for too long: the rest of the text is no longer kept.",
  stream_not_found: "The connection was lost for too long: the server no longer keeps this generation.",
  unreachable: "The page could not reach the server (the network or the gateway is down). Try again in a moment.",
  unauthenticated: "The server wants credentials this page does not have.",
  permission_denied: "You are not allowed to use this model.",
};

/** One sentence for a person, then the server's message and reason as details. */
export function describe(error: ApiError): { summary: string; detail: string } {
  const said = error.message || "(no message)";
  const answer = `HTTP ${error.status || "-"}, reason ${error.reason || error.code || "none"}`;
  if (AS_SAID.has(error.reason)) return { summary: `Refused: ${said}`, detail: `(${answer})` };
  const plain = PLAIN[error.reason];
  if (!plain) return { summary: `The request failed: ${said}`, detail: `(${answer})` };
  return { summary: plain, detail: `Server said: ${said} (${answer})` };
}

/** An answer that was not the API's JSON error body (a proxy's page, a gateway that is down). */
export function fromResponse(status: number, text: string): ApiError {
  try {
    const body = JSON.parse(text);
    const error = body?.error;
    if (error && typeof error.message === "string") {
      return {
        status,
        code: String(error.code ?? ""),
        reason: String(error.reason ?? error.type ?? ""),
        message: error.message,
      };
    }
  } catch {
    // not JSON: below
  }
  const reason = status === 502 || status === 503 || status === 504 ? "unavailable" : "";
  return { status, code: "", reason, message: text.trim().slice(0, 300) || `HTTP ${status}` };
}
