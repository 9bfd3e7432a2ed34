local p = ARGV[1]
local lk = p .. 'lease:' .. ARGV[2]
local v = redis.call('HGET', lk, 'version')
if not v then return {'unknown', '0', '0'} end
local exp = tonumber(redis.call('HGET', lk, 'expires_at'))
if exp <= now or redis.call('HEXISTS', lk, 'released') == 1 then
  redis.call('ZREM', p .. 'leases', ARGV[2])
  redis.call('ZREM', p .. 'vleases:' .. v, ARGV[2])
  return {'expired', v, string.format('%.6f', exp)}
end
local new = string.format('%.6f', now + tonumber(ARGV[3]))
redis.call('ZADD', p .. 'leases', new, ARGV[2])
redis.call('ZADD', p .. 'vleases:' .. v, new, ARGV[2])
redis.call('HSET', lk, 'expires_at', new)
redis.call('PEXPIRE', lk, math.floor(tonumber(ARGV[3]) * 1000) + 600000)  -- the hash outlives the expiry 10 min: a late renew says 'expired' (410)
return {'ok', v, new}
