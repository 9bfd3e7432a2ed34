-- KEYS: results done sums leased ; ARGV: version index size then field/increment pairs
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return {0, -1} end
local idx, size = tonumber(ARGV[2]), tonumber(ARGV[3])
if idx >= size then return {0, -2} end
local added = redis.call('SADD', KEYS[2], ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[2])
if added == 1 then
  for i = 4, #ARGV, 2 do redis.call('HINCRBYFLOAT', KEYS[3], ARGV[i], ARGV[i + 1]) end
end
return {added, redis.call('SCARD', KEYS[2])}
