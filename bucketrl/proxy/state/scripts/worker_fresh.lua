local last = redis.call('HGET', KEYS[1], ARGV[1])
if last then
  local sep = string.find(last, ' ', 1, true)
  if string.sub(last, 1, sep - 1) == ARGV[2] and tonumber(string.sub(last, sep + 1)) >= tonumber(ARGV[3]) then
    return 0
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. ARGV[3])
return 1
