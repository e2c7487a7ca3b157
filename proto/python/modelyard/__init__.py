"""Modelyard: one namespace for the contracts, the shared process code and the processes.

Contracts (what a client needs):
- `modelyard.inference.v1`, `modelyard.kserve.v2`: generated from proto/ (the client library).
- `modelyard.tensors`: numpy arrays <-> our API's tensors (needs numpy); `modelyard.flat`:
  FlatBuffers tensors.
- `modelyard.common`: header names, health names, error reasons, the name rule.

Processes (each with its own install extra): `modelyard.service`, `modelyard.sidecar`,
`modelyard.gateway`, `modelyard.deploy` (the local stack) and `modelyard.envoy` (Envoy's config),
over `modelyard.process`, the code they share at run time. `modelyard.cli` is the `modelyard`
command. Neither the contracts nor modelyard.process import a process; `make lint` enforces it.
"""
