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

# common/ installs as modelyard (pyproject.toml's package-dir). Under another name (its
# folder's, with the repository root on the path) it would be a second copy of the code and its state.
if __name__ != "modelyard":
    raise ImportError(f"{__name__}: import modelyard (common/ is not a package of its own)")
