"""Code the service, sidecar and gateway processes share at run time, and clients never need:
settings, logging, lifecycle and start-up errors, TLS reloading, authentication, the gRPC server's
connection options, the HTTP metrics server, child processes, tracing. Imports no process package."""
