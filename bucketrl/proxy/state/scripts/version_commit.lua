if redis.call('GET', KEYS[2]) ~= ARGV[3] then return {'lost', '0'} end
local cur = tonumber(redis.call('HGET', KEYS[1], 'trainer_epoch') or '0')
if tonumber(ARGV[1]) ~= cur then return {'fenced', tostring(cur)} end
local latest = tonumber(redis.call('HGET', KEYS[1], 'latest_version') or '0')
local n = tonumber(ARGV[2])
if n ~= latest + 1 then return {'conflict', tostring(latest)} end
local t = redis.call('TIME')
local now = string.format('%d.%06d', t[1], t[2])
redis.call('HSET', KEYS[3], 'sha256', ARGV[4], 'bytes', ARGV[5], 'published_at', now, 'epoch', ARGV[1],
  'state', 'live', 'dtype', ARGV[6])
redis.call('ZADD', KEYS[4], n, n)
redis.call('HSET', KEYS[1], 'latest_version', n, 'updated_at', now)
redis.call('DEL', KEYS[2])
redis.call('PUBLISH', KEYS[5], n)
return {'ok', now}
