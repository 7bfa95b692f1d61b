-- Takes or renews a job's lease. KEYS[1] the lease key. ARGV: owner, TTL ms. Returns 1 when `owner`
-- holds it now, 0 while another owner does.
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if holder then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
