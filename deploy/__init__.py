"""`make up` / `modelyard up`: the whole stack (service, sidecar, gateway, Envoy) on this machine."""

# deploy/ installs as modelyard.deploy (pyproject.toml's package-dir). Under another name (its
# folder's, with the repository root on the path) it would be a second copy of the code and its state.
if __name__ != "modelyard.deploy":
    raise ImportError(f"{__name__}: import modelyard.deploy (deploy/ is not a package of its own)")
