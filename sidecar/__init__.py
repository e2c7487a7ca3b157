"""The sidecar: beside each service instance, it dyes calls stable or canary, guards each
upstream x model x version with an adaptive circuit breaker, and traces the path."""

# sidecar/ installs as modelyard.sidecar (pyproject.toml's package-dir). Under another name (its
# folder's, with the repository root on the path) it would be a second copy of the code and its state.
if __name__ != "modelyard.sidecar":
    raise ImportError(f"{__name__}: import modelyard.sidecar (sidecar/ is not a package of its own)")
