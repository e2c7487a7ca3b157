"""The HTTP side for browsers and HTTP clients: SSE transcoding of Generate, an OpenAI-compatible API,
KServe V2 over REST, a small browser page. Calls the sidecar over gRPC; imports only the contracts
(modelyard.*).

One package per API, each mounted in the root application (app.py) as a sub-application of its
own (mount.py), and none importing another (import-linter):
- sse/: app.py (routes, errors.py's body), protocol.py (the request model and event shapes),
  serving.py (start or resume a stream), response.py (an SSE connection on a stream);
- openai/: app.py (routes, OpenAI's error object), protocol.py (request and response models),
  serving.py (the endpoints, the streamed chunks; chat messages go to the service, which renders
  them with the model's own template);
- kserve/: app.py (routes, KServe's error body), protocol.py (request and response models),
  tensors.py (JSON elements <-> raw bytes), serving.py (the endpoints).
Shared by them: http.py (the one intake: bounded strict JSON, typed and ranged fields, names),
upstream.py (the channel, forwarded and returned headers), errors.py (gRPC outcomes -> HTTP),
streams.py (generation streams and their resume buffer), streamed_response.py (the one
streamed response), metrics.py, listener.py (the connection guard), settings.py, tls.py.
"""

# gateway/ installs as modelyard.gateway (pyproject.toml's package-dir). Under another name (its
# folder's, with the repository root on the path) it would be a second copy of the code and its state.
if __name__ != "modelyard.gateway":
    raise ImportError(f"{__name__}: import modelyard.gateway (gateway/ is not a package of its own)")
