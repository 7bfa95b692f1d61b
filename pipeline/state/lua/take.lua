-- Makes ARGV[2] the key's owner (field "owner", store.OWNER) whoever held it, refreshes the TTL, and
-- returns the fields as they were just before, as HGETALL does (field, value, ...; {} when absent).
-- KEYS[1] the state hash. ARGV: TTL ms, owner.
local before = redis.call('HGETALL', KEYS[1])
redis.call('HSET', KEYS[1], 'owner', ARGV[2])
if redis.call('PTTL', KEYS[1]) < ARGV[1] / 2 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end  -- see redis_store.py
return before
