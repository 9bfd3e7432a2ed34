local p = ARGV[1]
redis.call('ZREMRANGEBYSCORE', p .. 'leases', '-inf', now)
if redis.call('EXISTS', KEYS[4]) == 1 then return {} end
local latest = tonumber(redis.call('HGET', KEYS[1], 'latest_version') or '0')
local cutoff = latest - tonumber(ARGV[2])
local marked = {}
if cutoff <= 1 then return marked end
local cands = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. cutoff, 'LIMIT', 0, tonumber(ARGV[3]))
for _, v in ipairs(cands) do
  local vk = p .. 'vleases:' .. v
  redis.call('ZREMRANGEBYSCORE', vk, '-inf', now)
  if redis.call('ZCARD', vk) == 0 then
    redis.call('HSET', p .. 'version:' .. v, 'state', 'deleting')
    redis.call('ZREM', KEYS[2], v)
    redis.call('SADD', KEYS[3], v)
    redis.call('DEL', vk)
    table.insert(marked, v)
  end
end
return marked
