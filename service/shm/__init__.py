"""System shared memory regions (Triton's shared-memory extension)."""
