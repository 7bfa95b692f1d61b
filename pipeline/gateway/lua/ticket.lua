-- Keep a request's ticket (what its charge needs at the end) unless one is kept already: a ticket is
-- never replaced, so a second request under the id of a running one cannot change or shorten its charge.
-- KEYS[1] the ticket (`sluice:ticket:{<member>}`). ARGV[1] the ticket, ARGV[2] its TTL in ms.
-- Returns 1 if written, 0 if one was kept.
if redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2], 'NX') then return 1 end
return 0
