-- Sets fields of a key that exists (a request the pipeline admitted) and refreshes the TTL; a missing key
-- stays missing, so a write for an id nobody admitted leaves nothing behind.
-- KEYS[1] the state hash. ARGV: TTL ms, then field, value pairs. Returns 1 when written, 0 when absent.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if #ARGV > 1 then redis.call('HSET', KEYS[1], unpack(ARGV, 2)) end
if redis.call('PTTL', KEYS[1]) < ARGV[1] / 2 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end  -- see redis_store.py
return 1
