-- Charge tokens (and spend) to one scope after a request ended; never refuses; once per member.
-- KEYS[1] token log, KEYS[2] tokens in the log, KEYS[3] spend. ARGV: window ms, member, tokens, spend.
-- Spend is 0 for a scope without a budget, which keeps none: its spend key is never written (a key with
-- no TTL per JWT subject ever seen, which volatile-lru could never evict). It has no TTL otherwise.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window, tokens = tonumber(ARGV[1]), tonumber(ARGV[3])
local added = redis.call('ZADD', KEYS[1], 'NX', now, ARGV[2] .. ':c|' .. tokens)
if added == 1 then
  redis.call('INCRBY', KEYS[2], tokens)
  if tonumber(ARGV[4]) > 0 then redis.call('INCRBYFLOAT', KEYS[3], ARGV[4]) end
end
for i = 1, 2 do  -- as admit.lua's touch()
  if redis.call('PTTL', KEYS[i]) < window then redis.call('PEXPIRE', KEYS[i], window + 1000) end
end
return added
