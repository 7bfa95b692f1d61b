-- Records one line's outcome once and counts it. KEYS[1] the job's outcomes hash, KEYS[2] its counts
-- hash, KEYS[3] the job hash. ARGV: line key, the encoded outcome, the counter ("completed" or "failed").
-- Returns 1 when this call recorded it; 0 when an outcome was already there (a line that ran twice: the
-- first one stays) or the job has ended (a paused worker's late answer: its files are written).
-- The outcomes and counts hashes, made by the first record, expire with the job hash.
local status = redis.call('HGET', KEYS[3], 'status')
if not status or status == 'completed' or status == 'failed' or status == 'expired' or status == 'cancelled' then
  return 0
end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
if redis.call('PTTL', KEYS[1]) == -1 then
  local ttl = redis.call('PTTL', KEYS[3])
  if ttl > 0 then
    redis.call('PEXPIRE', KEYS[1], ttl)
    redis.call('PEXPIRE', KEYS[2], ttl)
  end
end
return 1
