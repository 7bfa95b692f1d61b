-- Undo `admit.lua` for one member in one scope (a later scope refused the request), called only where
-- that admission added the member (never for one it found: that entry is another call's).
-- KEYS[1] request log, KEYS[2] token log, KEYS[3] tokens in the log. ARGV: window ms, member, tokens.
-- window.lua comes first: now, weight(), settle(), touch().
local window, tokens = tonumber(ARGV[1]), tonumber(ARGV[3])
settle(KEYS[2], KEYS[3], now - window)
redis.call('ZREM', KEYS[1], ARGV[2])
if tokens > 0 and redis.call('ZREM', KEYS[2], ARGV[2] .. ':p|' .. tokens) == 1 then
  redis.call('DECRBY', KEYS[3], tokens)
end
touch(window, 3)
return 1
