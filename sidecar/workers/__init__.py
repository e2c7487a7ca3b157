"""`--workers N`: N sidecar processes on one port behind one supervisor (docs/sidecar.md)."""
