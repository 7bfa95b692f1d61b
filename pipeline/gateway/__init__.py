"""The gateway: who may send a request, how much, from where, and what it costs. Ingest asks it
before admitting a request; emit tells it what a finished request used.

    config          GatewaySettings and its parts (read from `[gateway]` in sluice.toml)
    keys            API keys: generation, SHA-256 hashing, records, the KeyStore protocol, memory store
    redis_keys      the Redis KeyStore (a record replaced by compare and set on its version: lua/update_key.lua)
    jwt_auth        JWT bearer tokens verified with PyJWT against a JWKS (pinned algorithms, iss, aud, exp, nbf)
    network         CIDR allow/deny lists, geo-block lists, user-agent deny patterns
    principal       the bridge's principal tokens: a key's hash or a JWT's claims, signed for one request,
                    sent to Kafka instead of the raw credential
    limits          the Limiter protocol (sliding-window requests and tokens per minute, tokens reserved at
                    admission and replaced by those used at the end, budgets), memory limiter
    redis_limits    the Redis Limiter: one atomic Lua script per scope (`lua/*.lua`), Redis's clock, hash tags
    gateway         Gateway: authenticate, authorise, check the network rules, admit; charge at the end
    build           builds the Gateway a stage uses from settings (Redis or memory stores)
    keys_cli        `sluice keys create|rotate|revoke|list`

Errors: `StoreUnavailable` (errors.py) is what a Redis store raises when Redis is away; the gateway
applies `on_redis_down` ("open" or "closed") and counts each such decision in
`sluice_gateway_degraded_total`. Refusals are `pipeline.errors.StageError` with their codes.
"""
