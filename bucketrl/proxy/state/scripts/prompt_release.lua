-- KEYS: inflight owner reissue open meta channel ; ARGV: worker pid...
local n = 0
for i = 2, #ARGV do
  local pid = ARGV[i]
  if redis.call('HGET', KEYS[2], pid) == ARGV[1] and redis.call('ZREM', KEYS[1], pid) == 1 then
    redis.call('HDEL', KEYS[2], pid)
    -- released prompts go to the FRONT: a graceful shutdown hands its work on first
    if redis.call('SISMEMBER', KEYS[4], pid) == 1 then redis.call('LPUSH', KEYS[3], pid) end
    n = n + 1
  end
end
if n > 0 then
  redis.call('HINCRBY', KEYS[5], 'seq', 1)
  redis.call('PUBLISH', KEYS[6], '1')
end
return n
