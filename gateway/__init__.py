"""The HTTP side for browsers and HTTP clients: SSE transcoding of Generate, an OpenAI-compatible API,
a small browser page. Calls the sidecar over gRPC; imports only the contracts (modelyard.*)."""
