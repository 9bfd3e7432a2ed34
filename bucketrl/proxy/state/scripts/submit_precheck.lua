-- KEYS: idem state cursor stream lease queue_meta prompts_meta spec write_lock ; ARGV: group token ttl_ms
-- Also takes the batch's write lock (for ttl_ms) when the batch is new and the run is there and ready: the
-- caller then writes without another round trip (it releases the lock if it refuses the batch after all).
local ready = redis.call('HEXISTS', KEYS[6], 'ready') + redis.call('HEXISTS', KEYS[7], 'ready')
local seen = redis.call('GET', KEYS[1]) or ''
local spec = redis.call('GET', KEYS[8]) or ''
local locked = 0
if seen == '' and spec ~= '' and ready == 2 then
  local holder = redis.call('GET', KEYS[9])
  if holder == ARGV[2] then
    locked = 1
  elseif not holder then
    redis.call('SET', KEYS[9], ARGV[2], 'PX', ARGV[3])
    locked = 1
  end
end
return {seen, tonumber(redis.call('HGET', KEYS[2], 'latest_version') or '0'),
        tonumber(redis.call('GET', KEYS[3]) or '0'), queued_groups(KEYS[4], ARGV[1]),
        redis.call('HGET', KEYS[5], 'version') or '', ready, spec, locked,
        redis.call('HGET', KEYS[2], 'max_new_tokens_bound') or ''}
