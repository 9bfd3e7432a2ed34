if redis.call('GET', KEYS[2]) ~= ARGV[2] then return 'lost' end
local cur = tonumber(redis.call('HGET', KEYS[1], 'trainer_epoch') or '0')
local epoch = tonumber(ARGV[1])
if epoch >= 0 and epoch ~= cur then return 'fenced' end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 'ok'
