"""The cloud verifier: a grpc.aio server that checks drafts against the target model.

- `server`: start/stop, TLS, health, metrics, drain, the servicer (protobuf <-> plain values,
  plus the caller's right to the session it names).
- `guard`: the interceptor every call passes: bearer tokens, the caller's tenant, bytes that do
  not decode, handler bugs (one-line statuses, rate-limited logs).
- `auth`: the token file (hashed at rest, reloaded when it changes). `admission`: per-tenant
  limits and admission control (RESOURCE_EXHAUSTED with a retry hint).
- `engine`: the logic of a round and of the cloud-only stream, as plain methods that raise
  `RequestError` (a gRPC status code and a message a person can act on).
- `sessions`: per-session committed sequence, seeded RNG, last reply (idempotent retries),
  LRU/TTL eviction under a bound.
- `backends/`: where target logits come from (llama.cpp, vLLM, synthetic).
"""
