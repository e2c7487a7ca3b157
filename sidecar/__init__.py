"""The sidecar: beside each service instance, it dyes calls stable or canary, guards each
upstream x model x version with an adaptive circuit breaker, and traces the path."""
