"""The cloud verifier: a grpc.aio server that checks drafts against the target model.

- `server`: start/stop, health, metrics, the servicer (protobuf <-> plain values only).
- `engine`: the logic of a round and of the cloud-only stream, as plain methods that raise
  `RequestError` (a gRPC status code and a message a person can act on).
- `sessions`: per-session committed sequence, seeded RNG, last reply (idempotent retries),
  LRU/TTL eviction under a bound.
- `backends/`: where target logits come from (llama.cpp, vLLM, synthetic).
"""
