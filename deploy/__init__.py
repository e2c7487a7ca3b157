"""`make up` / `modelyard up`: the whole stack (service, sidecar, gateway, Envoy) on this machine."""
