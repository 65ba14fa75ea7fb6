"""The model-independent core of the runtime engine: KV block bookkeeping with prefix caching,
the continuous-batching scheduler, the sampler and speculative verification (docs/engine.md)."""
