local seen = redis.call('GET', KEYS[2])
if seen then return {tonumber(seen), 0} end
local epoch = redis.call('HINCRBY', KEYS[1], 'trainer_epoch', 1)
redis.call('HSET', KEYS[1], 'updated_at', ARGV[1])
redis.call('SET', KEYS[2], epoch, 'EX', ARGV[2])
return {epoch, 1}
