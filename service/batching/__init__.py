"""Dynamic batching: requests to one model version queue, batch, run together and part again."""
