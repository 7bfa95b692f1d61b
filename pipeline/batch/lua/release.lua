-- Gives a lease up, only if `owner` holds it. KEYS[1] the lease key. ARGV: owner.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
