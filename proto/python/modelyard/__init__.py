"""Modelyard's contracts and the code every process shares.

- `modelyard.inference.v1`, `modelyard.kserve.v2`: generated from proto/ (the client library).
- `modelyard.tensors`: numpy arrays <-> our API's tensors (needs numpy; clients and the service).
- `modelyard.common`: what the service, sidecar and gateway processes share (settings, logging,
  metrics endpoint, process lifecycle, header names, health names, error reasons).

Nothing here imports a process package (service, sidecar, gateway); `make lint` enforces it.
"""
