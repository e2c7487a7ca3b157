"""Fleet rollouts: one progressive canary across every sidecar of a fleet (docs/fleet-rollouts.md).

The controller (`python -m modelyard.rollouts`, `modelyard rollouts`) runs the sidecar's own rollout
policy (modelyard.sidecar.rollout.policy) on the fleet's metrics from Prometheus (gates.py) and pushes each
step's weight to every sidecar's admin endpoint (pods.py); its state survives restarts (store.py,
kube.py), and two replicas elect one leader. ownership.py is the sidecar's side: a weight a
controller set carries its owner and a lease, and a change by hand meanwhile is refused.
"""
