-- Shared by admit.lua, charge.lua and release.lua: redis_limits.py sends it in front of each.
-- Redis's clock, an entry's weight, one scope's token log kept in step with its running total, and TTLs.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function weight(entry) return tonumber(string.match(entry, '|(%d+)$')) end

-- Drops the entries of token log `tok` at or before `cutoff`, and from its total `sum`; returns the total.
-- A total that cannot be right is recomputed from the log's weights: missing or negative beside a log
-- with entries, or not 0 beside an empty log. One of the two keys was evicted (volatile-lru) or lost, and
-- a total left so stayed wrong for as long as traffic kept the keys alive: negative, it admitted more
-- than the limit; never decremented, it refused every request (for the global scope, everyone's).
local function settle(tok, sum, cutoff)
  local total = tonumber(redis.call('GET', sum))
  local expired = redis.call('ZRANGEBYSCORE', tok, '-inf', cutoff)
  if #expired > 0 then
    local freed = 0
    for _, entry in ipairs(expired) do freed = freed + weight(entry) end
    redis.call('ZREMRANGEBYSCORE', tok, '-inf', cutoff)
    if total then total = redis.call('DECRBY', sum, freed) end
  end
  local size = redis.call('ZCARD', tok)
  if (size > 0 and (total == nil or total < 0)) or (size == 0 and (total or 0) ~= 0) then
    total = 0
    for _, entry in ipairs(redis.call('ZRANGE', tok, 0, -1)) do total = total + weight(entry) end
    redis.call('SET', sum, total, 'KEEPTTL')
  end
  return total or 0
end

-- Every rate-limit key has a TTL of at least the window (set about once a second): KEYS[1..n].
local function touch(window, n)
  for i = 1, n do
    if redis.call('PTTL', KEYS[i]) < window then redis.call('PEXPIRE', KEYS[i], window + 1000) end
  end
end
