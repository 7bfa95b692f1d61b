-- Charge a request that ended to one scope: its reservation ("member:p|reserved", written by admit.lua)
-- is replaced by what it used ("member:c|tokens", at the time of the charge), so the unused part is
-- freed; spend is added once. Never refuses; once per member (a second call changes nothing).
-- KEYS[1] token log, KEYS[2] tokens in the log, KEYS[3] spend.
-- ARGV: window ms, member, tokens reserved, tokens used, spend.
-- Spend is 0 for a scope without a budget, which keeps none: its spend key is never written (a key with
-- no TTL per JWT subject ever seen, which volatile-lru could never evict). It has no TTL otherwise.
-- window.lua comes first: now, weight(), settle(), touch().
local window, member = tonumber(ARGV[1]), ARGV[2]
local reserved, tokens = tonumber(ARGV[3]), tonumber(ARGV[4])
settle(KEYS[1], KEYS[2], now - window)
local reservation, charged = member .. ':p|' .. reserved, member .. ':c|' .. tokens
local added = 0
if redis.call('ZSCORE', KEYS[1], reservation) then
  redis.call('ZREM', KEYS[1], reservation)
  added = redis.call('ZADD', KEYS[1], 'NX', now, charged)
  redis.call('INCRBY', KEYS[2], added * tokens - reserved)
elseif not redis.call('ZSCORE', KEYS[1], charged) then
  -- No reservation in the window: this request ran longer than the window, which counted its
  -- reservation in full, or it was charged already (with 0 below). A mark of weight 0 keeps it once.
  added = redis.call('ZADD', KEYS[1], 'NX', now, member .. ':c|0')
end
if added == 1 and tonumber(ARGV[5]) > 0 then redis.call('INCRBYFLOAT', KEYS[3], ARGV[5]) end
touch(window, 2)
return added
