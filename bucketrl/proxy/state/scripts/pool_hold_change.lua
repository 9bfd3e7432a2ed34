-- A conditional change of a run's pool hold (the pool hash's 'paused': 0 ok, 1 paused, 2 finished), atomic so
-- that a pause landing meanwhile is never overwritten.
-- KEYS: pool. ARGV: new value, 'if' or 'unless', the value the current one is compared with.
-- Returns 1 when it changed. Back to 0 (ok) drops last_granted: the run starts again at the pool's position.
local cur = redis.call('HGET', KEYS[1], 'paused') or '0'
local match = cur == ARGV[3]
if (ARGV[2] == 'if') ~= match or cur == ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'paused', ARGV[1])
if ARGV[1] == '0' then redis.call('HDEL', KEYS[1], 'last_granted') end
return 1
