-- A fenced write of a position that never moves back: while the key's "owner" field (store.OWNER) equals
-- ARGV[2], sets the ARGV[5] field, value pairs that follow in any case, and, if the field ARGV[3] holds
-- less than ARGV[4] (absent: 0), sets it to ARGV[4] with the pairs after those; at or past it, writes
-- only the first pairs. The TTL is refreshed either way.
-- KEYS[1] the state hash. ARGV: TTL ms, owner, field, position, count of pairs written in any case,
-- those pairs, then the pairs written with the position.
-- Returns 1 (the key holds this position or a later one), 0 when fenced off.
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[2] then return 0 end
local always = 6 + 2 * tonumber(ARGV[5])
if always > 6 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 6, always - 1))
end
if tonumber(redis.call('HGET', KEYS[1], ARGV[3]) or '0') < tonumber(ARGV[4]) then
  redis.call('HSET', KEYS[1], ARGV[3], ARGV[4], unpack(ARGV, always))
end
if redis.call('PTTL', KEYS[1]) < ARGV[1] / 2 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end  -- see redis_store.py
return 1
