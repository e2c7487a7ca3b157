"""Progressive rollouts in one sidecar: the pure policy (steps, gates, the state machine), its
driver (the clock, the evidence, the route weight, the state file), and `modelyard canary`, the
admin client. The fleet controller (modelyard.sidecar.fleet) reuses the policy."""
