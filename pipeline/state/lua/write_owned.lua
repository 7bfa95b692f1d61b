-- A fenced write: sets the fields and refreshes the TTL only while the key's "owner" field
-- (store.OWNER) equals ARGV[2]; a missing key has no owner, so it is never written.
-- KEYS[1] the state hash. ARGV: TTL ms, owner, then field, value pairs (none: only the TTL).
-- Returns 1 when written, 0 when fenced off.
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[2] then return 0 end
if #ARGV > 2 then redis.call('HSET', KEYS[1], unpack(ARGV, 3)) end
if redis.call('PTTL', KEYS[1]) < ARGV[1] / 2 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end  -- see redis_store.py
return 1
