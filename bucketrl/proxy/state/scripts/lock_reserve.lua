local cur = tonumber(redis.call('HGET', KEYS[1], 'trainer_epoch') or '0')
local epoch = tonumber(ARGV[1])
if epoch >= 0 and epoch ~= cur then return {'fenced', cur} end
local latest = tonumber(redis.call('HGET', KEYS[1], 'latest_version') or '0')
local want = tonumber(ARGV[4])
if want > 0 and want ~= latest + 1 then return {'conflict', latest} end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[2] then return {'busy', latest} end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return {'ok', latest}
