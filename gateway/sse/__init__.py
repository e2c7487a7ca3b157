"""The SSE API: `/v1/models/{model}/generate`, generation as resumable server-sent events."""
