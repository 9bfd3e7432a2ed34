-- A finished run's pool hold lifted (a trainer registered again, to train past its max_steps); a pause stays.
-- KEYS: pool. Returns 1 when it was finished.
if redis.call('HGET', KEYS[1], 'paused') == '2' then
  redis.call('HSET', KEYS[1], 'paused', '0')
  redis.call('HDEL', KEYS[1], 'last_granted')
  return 1
end
return 0
