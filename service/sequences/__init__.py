"""Stateful models: Triton's sequence batcher (config `sequence_batching`)."""
