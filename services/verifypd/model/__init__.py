"""The engine's GPU part: weights, KV pool tensors, our paged-KV Llama forward, sampling."""
