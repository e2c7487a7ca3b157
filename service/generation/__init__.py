"""Text generation with decoder language models: KV-cache decoding, continuous batching, sampling."""
