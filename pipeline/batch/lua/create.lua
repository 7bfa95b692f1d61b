-- Creates a job, refused when its tenant has its most unfinished jobs. KEYS[1] the job hash, KEYS[2] the
-- tenant's list (sorted set: id by creation time), KEYS[3] the tenant's unfinished jobs (sorted set: id by
-- the end of its completion window), KEYS[4] the set of unfinished jobs. ARGV: id, status, record, when the
-- job's keys expire (ms since the epoch), now (s), the list's horizon (s: older entries are dropped), the
-- window's end (s), listed (1, or 0 for a direct job: in neither the list nor the counts), the most
-- unfinished jobs the tenant may have (0: no limit), the list's TTL (ms). Returns 1 when created, else 0.
if ARGV[8] == '1' then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[5])  -- window closed: the job ends now, if not yet
  local most = tonumber(ARGV[9])
  if most > 0 and redis.call('ZCARD', KEYS[3]) >= most then return 0 end
  redis.call('ZADD', KEYS[3], ARGV[7], ARGV[1])
  local last = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', KEYS[3], tonumber(last[2]) * 1000)
  redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[6])  -- their records have expired
  redis.call('PEXPIRE', KEYS[2], ARGV[10])
  redis.call('SADD', KEYS[4], ARGV[1])
end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'record', ARGV[3])
redis.call('PEXPIREAT', KEYS[1], ARGV[4])
return 1
