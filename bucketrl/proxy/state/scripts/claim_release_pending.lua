-- KEYS: stream meta ; ARGV: group epoch idle_ms   (a new trainer epoch registered)
if redis.call('HEXISTS', KEYS[2], 'ready') == 0 then return 0 end  -- the epoch's first claim does it
ensure_group(KEYS[1], ARGV[1])
if tonumber(ARGV[2]) > tonumber(redis.call('HGET', KEYS[2], 'epoch') or '0') then
  release_pending(KEYS[1], ARGV[1], 'epoch-' .. ARGV[2], tonumber(ARGV[3]))
  redis.call('HSET', KEYS[2], 'epoch', ARGV[2])
  return 1
end
return 0
