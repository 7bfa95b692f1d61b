-- Admit one request in one scope, atomically, on Redis's own clock (a sliding window log).
-- KEYS[1] request log (zset member -> ms), KEYS[2] token log (zset "member:p|n" -> ms),
-- KEYS[3] tokens in the token log (integer), KEYS[4] spend (float, no TTL: budgets do not expire; only
-- read here, and written by charge.lua only for a scope with a budget).
-- All four share one hash tag, so the script runs on one Redis Cluster slot.
-- ARGV: window ms, rpm, tpm, budget (0 = none), member (request id), tokens reserved (the prompt's
-- estimate and the request's max_tokens: charge.lua replaces them by what the request used).
-- Returns {status, resource, limit, remaining, retry-after ms (-1: never)}; status 0 refused, 1 admitted
-- and the member added, 2 admitted and the member found already (a redelivery, or another request under
-- an id in use: its caller must not undo the entry, which is the first request's).
-- window.lua comes first: now, weight(), settle(), touch().
local window = tonumber(ARGV[1])
local rpm, tpm, budget = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local member, tokens = ARGV[5], tonumber(ARGV[6])
local cutoff = now - window

redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', cutoff)
local used = settle(KEYS[2], KEYS[3], cutoff)
if redis.call('ZSCORE', KEYS[1], member) then touch(window, 3) return {2, '', 0, 0, 0} end  -- recorded already

if budget > 0 and tonumber(redis.call('GET', KEYS[4]) or '0') >= budget then
  touch(window, 3) return {0, 'budget', 0, 0, -1}
end
local count = redis.call('ZCARD', KEYS[1])
if rpm > 0 and count >= rpm then
  local oldest = redis.call('ZRANGE', KEYS[1], count - rpm, count - rpm, 'WITHSCORES')
  touch(window, 3) return {0, 'requests', rpm, 0, tonumber(oldest[2]) + window - now}
end
if tpm > 0 and used + tokens > tpm then
  local remaining = math.max(tpm - used, 0)
  if tokens > tpm then touch(window, 3) return {0, 'tokens', tpm, remaining, -1} end
  local need, retry = used + tokens - tpm, window
  local entries = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
  for i = 1, #entries, 2 do
    need = need - weight(entries[i])
    if need <= 0 then retry = tonumber(entries[i + 1]) + window - now break end
  end
  touch(window, 3) return {0, 'tokens', tpm, remaining, retry}
end

redis.call('ZADD', KEYS[1], now, member)
if tokens > 0 then
  redis.call('ZADD', KEYS[2], now, member .. ':p|' .. tokens)
  redis.call('INCRBY', KEYS[3], tokens)
end
touch(window, 3)
local left = -1
if rpm > 0 then left = rpm - count - 1 end
return {1, '', rpm, left, 0}
