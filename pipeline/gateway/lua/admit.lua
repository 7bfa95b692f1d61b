-- Admit one request in one scope, atomically, on Redis's own clock (a sliding window log).
-- KEYS[1] request log (zset member -> ms), KEYS[2] token log (zset "member:p|n" -> ms),
-- KEYS[3] tokens in the token log (integer), KEYS[4] spend (float, no TTL: budgets do not expire; only
-- read here, and written by charge.lua only for a scope with a budget).
-- All four share one hash tag, so the script runs on one Redis Cluster slot.
-- ARGV: window ms, rpm, tpm, budget (0 = none), member (request id), prompt tokens.
-- Returns {admitted 1/0, resource, limit, remaining, retry-after ms (-1: never)}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
local rpm, tpm, budget = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local member, tokens = ARGV[5], tonumber(ARGV[6])
local cutoff = now - window

local function touch()  -- every rate-limit key has a TTL, at least the window (set about once a second)
  for i = 1, 3 do
    if redis.call('PTTL', KEYS[i]) < window then redis.call('PEXPIRE', KEYS[i], window + 1000) end
  end
end
local function weight(entry) return tonumber(string.match(entry, '|(%d+)$')) end

redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', cutoff)
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', cutoff)
if #expired > 0 then
  local freed = 0
  for _, entry in ipairs(expired) do freed = freed + weight(entry) end
  redis.call('DECRBY', KEYS[3], freed)
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', cutoff)
end
if redis.call('ZSCORE', KEYS[1], member) then touch() return {1, '', 0, 0, 0} end  -- a redelivery

if budget > 0 and tonumber(redis.call('GET', KEYS[4]) or '0') >= budget then
  touch() return {0, 'budget', 0, 0, -1}
end
local count = redis.call('ZCARD', KEYS[1])
if rpm > 0 and count >= rpm then
  local oldest = redis.call('ZRANGE', KEYS[1], count - rpm, count - rpm, 'WITHSCORES')
  touch() return {0, 'requests', rpm, 0, tonumber(oldest[2]) + window - now}
end
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
if tpm > 0 and used + tokens > tpm then
  local remaining = math.max(tpm - used, 0)
  if tokens > tpm then touch() return {0, 'tokens', tpm, remaining, -1} end
  local need, retry = used + tokens - tpm, window
  local entries = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
  for i = 1, #entries, 2 do
    need = need - weight(entries[i])
    if need <= 0 then retry = tonumber(entries[i + 1]) + window - now break end
  end
  touch() return {0, 'tokens', tpm, remaining, retry}
end

redis.call('ZADD', KEYS[1], now, member)
if tokens > 0 then
  redis.call('ZADD', KEYS[2], now, member .. ':p|' .. tokens)
  redis.call('INCRBY', KEYS[3], tokens)
end
touch()
local left = -1
if rpm > 0 then left = rpm - count - 1 end
return {1, '', rpm, left, 0}
