"""Admission control (bounded per-priority queues, deadlines, cancellation) and dynamic batching."""
