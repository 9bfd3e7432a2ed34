-- KEYS: meta lock ; ARGV: reserved seq token   (monotonic max; only while holding the lock)
if redis.call('GET', KEYS[2]) ~= ARGV[3] then return 0 end
local r = tonumber(redis.call('HGET', KEYS[1], 'persisted_reserved') or '0')
if tonumber(ARGV[1]) > r then redis.call('HSET', KEYS[1], 'persisted_reserved', ARGV[1]) end
local s = tonumber(redis.call('HGET', KEYS[1], 'persisted_seq') or '0')
if tonumber(ARGV[2]) > s then redis.call('HSET', KEYS[1], 'persisted_seq', ARGV[2]) end
return 1
