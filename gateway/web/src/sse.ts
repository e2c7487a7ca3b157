// Server-sent events read from a fetch body (EventSource cannot read an error's body, so the page
// would only know "it failed"). The parser follows the HTML spec's event stream format: fields
// `id`, `event`, `data` (joined by newlines), `retry`; lines starting with ":" are comments.

export interface SseEvent {
  id: string; // the last id seen (the spec's "last event ID"), "" before any
  event: string; // "message" when the event names none
  data: string;
}

export interface SseState {
  lastId: string;
  retryMs: number | null;
}

export async function* readEvents(
  body: ReadableStream<Uint8Array>,
  state: SseState,
): AsyncGenerator<SseEvent> {
  const reader = body.getReader();
  const decoder = new TextDecoder(); // streaming: a character split across chunks waits for the rest
  let buffer = "";
  let event = "";
  let data: string[] = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return; // a last event without its blank line is dropped, as the spec says
      buffer += decoder.decode(value, { stream: true });
      let end: number;
      while ((end = lineEnd(buffer)) >= 0) {
        const line = buffer.slice(0, end);
        buffer = buffer.slice(buffer[end] === "\r" && buffer[end + 1] === "\n" ? end + 2 : end + 1);
        if (line === "") {
          if (data.length) yield { id: state.lastId, event: event || "message", data: data.join("\n") };
          event = "";
          data = [];
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let text = colon < 0 ? "" : line.slice(colon + 1);
        if (text.startsWith(" ")) text = text.slice(1);
        if (field === "event") event = text;
        else if (field === "data") data.push(text);
        else if (field === "id" && !text.includes("\0")) state.lastId = text;
        else if (field === "retry" && /^\d+$/.test(text)) state.retryMs = Number(text);
      }
    }
  } finally {
    reader.cancel().catch(() => undefined);
  }
}

// Index of the first line terminator (CR, LF or CRLF); -1 when none is complete yet (a CR at the
// very end may be the first half of a CRLF).
function lineEnd(text: string): number {
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (c === "\n") return i;
    if (c === "\r") return i + 1 < text.length ? i : -1;
  }
  return -1;
}
