"""Scheduling: the admission queue (priorities, bounded queues, deadlines) and the clock it runs on,
shared by batching, generation and the repository config."""
