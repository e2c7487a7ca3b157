"""What the service, sidecar and gateway processes share. Imports no process package."""
