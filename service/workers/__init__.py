"""Worker processes: N service processes share the gRPC port (SO_REUSEPORT), each with its own
ONNX Runtime sessions, under a supervisor (the parent) that restarts a worker that dies, fans
explicit model control out to every worker, joins their health and sums their metrics.

The parent imports no model runtime: it speaks to the workers over gRPC on unix sockets in a
private folder (protocol.py), and the workers to it."""
