-- Sets one field only if it is absent, and then refreshes the TTL; a failed claim writes nothing.
-- KEYS[1] the state hash. ARGV: TTL ms, field, value. Returns 1 when this call set the field, else 0.
if redis.call('HSETNX', KEYS[1], ARGV[2], ARGV[3]) == 0 then return 0 end
if redis.call('PTTL', KEYS[1]) < ARGV[1] / 2 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end  -- see redis_store.py
return 1
