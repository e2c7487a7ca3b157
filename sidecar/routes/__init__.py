"""The sidecar's route configuration: the live route table and its sources (route_table), the route
file and its schema (file; routes.schema.json beside this package), and the state file that keeps
admin changes and rollouts across restarts (state_file, its document checked by saved)."""
