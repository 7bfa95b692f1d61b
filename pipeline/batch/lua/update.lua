-- Stores a job's record if its stored status is one of the expected ones (compare-and-set).
-- KEYS[1] the job hash (fields status, record), KEYS[2] its counts hash, KEYS[3] its outcomes hash.
-- ARGV: expected statuses separated by spaces, the new status, the new record, a TTL in ms (0: the keys
-- keep the expiry create.lua and record.lua gave them; set when the job ends). Returns 1 when stored, 0
-- when the status was another.
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return 0 end
local found = false
for status in string.gmatch(ARGV[1], '%S+') do
  if status == current then found = true end
end
if not found then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'record', ARGV[3])
local ttl = tonumber(ARGV[4])
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
  redis.call('PEXPIRE', KEYS[3], ttl)
end
return 1
