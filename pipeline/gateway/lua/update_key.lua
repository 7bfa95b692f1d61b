-- Compare and set of one key record (KeyStore.update): written only over the version it was made from.
-- KEYS[1] the record (JSON, `sluice:keyrec:{<id>}`). ARGV[1] the version the stored record must have,
-- ARGV[2] the new record. A record written before records had versions reads as version 0.
-- Returns 1 if written (or already there: a retry of a call whose reply was lost), 0 if another
-- version, or none, is stored.
local stored = redis.call('GET', KEYS[1])
if stored == ARGV[2] then return 1 end
if not stored or tonumber(cjson.decode(stored).version or 0) ~= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
