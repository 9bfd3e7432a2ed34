local p = ARGV[1]
local lk = p .. 'lease:' .. ARGV[3]
-- A replay (same request id, so the same lease id) answers the lease its first attempt created, even one
-- released or expired since: one lease per request, never a second one that only waits to expire.
if redis.call('EXISTS', lk) == 1 then
  return {'ok', redis.call('HGET', lk, 'version'), redis.call('HGET', lk, 'expires_at')}
end
local v = tonumber(ARGV[2])
local latest = tonumber(redis.call('HGET', KEYS[1], 'latest_version') or '0')
if v == 0 then v = latest end
if v == 0 then return {'none', '0', '0'} end
local st = redis.call('HGET', p .. 'version:' .. v, 'state')
if not st then
  if v > latest then return {'unknown', tostring(v), tostring(latest)} end
  return {'gone', tostring(v), tostring(latest)}
end
if st ~= 'live' then return {'gone', tostring(v), tostring(latest)} end
local exp = now + tonumber(ARGV[5])
local sexp = string.format('%.6f', exp)
redis.call('ZADD', p .. 'leases', sexp, ARGV[3])
redis.call('ZADD', p .. 'vleases:' .. v, sexp, ARGV[3])
redis.call('HSET', lk, 'version', v, 'worker_id', ARGV[4], 'expires_at', sexp)
redis.call('PEXPIRE', lk, math.floor(tonumber(ARGV[5]) * 1000) + 600000)  -- the hash outlives the expiry 10 min: a late renew says 'expired' (410)
return {'ok', tostring(v), sexp}
