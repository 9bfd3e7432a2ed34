if redis.call('GET', KEYS[2]) ~= ARGV[3] then return {'lost', '0'} end
local cur = tonumber(redis.call('HGET', KEYS[1], 'trainer_epoch') or '0')
if tonumber(ARGV[1]) ~= cur then return {'fenced', tostring(cur)} end
local t = redis.call('TIME')
local now = string.format('%d.%06d', t[1], t[2])
redis.call('HSET', KEYS[3], 'sha256', ARGV[4], 'bytes', ARGV[5], 'created_at', now, 'epoch', ARGV[1])
redis.call('ZADD', KEYS[4], tonumber(ARGV[2]), ARGV[2])
redis.call('HSET', KEYS[1], 'trainer_step', ARGV[2], 'updated_at', now)
redis.call('DEL', KEYS[2])
return {'ok', now}
