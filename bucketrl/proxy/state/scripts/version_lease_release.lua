local p = ARGV[1]
local lk = p .. 'lease:' .. ARGV[2]
local v = redis.call('HGET', lk, 'version')
if not v then return {'unknown', '0'} end
-- A replayed release answers what the first one did (the hash stays, marked, until its grace ends; a
-- replayed create then answers this ended lease rather than creating a new one).
local done = redis.call('HGET', lk, 'released')
if done then return {done, v} end
local exp = tonumber(redis.call('HGET', lk, 'expires_at'))
redis.call('ZREM', p .. 'leases', ARGV[2])
redis.call('ZREM', p .. 'vleases:' .. v, ARGV[2])
local out = 'ok'
if exp <= now then out = 'expired' end
redis.call('HSET', lk, 'released', out, 'expires_at', string.format('%.6f', math.min(exp, now)))
return {out, v}
