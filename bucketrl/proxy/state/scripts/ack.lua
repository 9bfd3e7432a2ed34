-- KEYS: stream state counters entry remaining attempts settled p_meta queue_meta bseq doomed owner redropped
--       rebuilt trained_by
-- ARGV: group epoch counter delivery_id...   (epoch 0 = unfenced internal use)
if redis.call('HEXISTS', KEYS[9], 'ready') == 0 then return {'notready'} end
local stream, group, epoch = KEYS[1], ARGV[1], tonumber(ARGV[2])
if epoch > 0 then
  local cur = tonumber(redis.call('HGET', KEYS[2], 'trainer_epoch') or '0')
  if epoch ~= cur then return {'fenced', cur} end
end
local n, finished = 0, {}
for i = 4, #ARGV do
  local d = ARGV[i]
  local id = redis.call('HGET', KEYS[4], d)
  if id then
    if ARGV[3] == 'acked_total' then
      -- trained: counted for the worker that submitted it (its entry's 'w'), the generators' share of the run
      local e = redis.call('XRANGE', stream, id, id)[1]
      if e then
        for j = 1, #e[2], 2 do
          if e[2][j] == 'w' then redis.call('HINCRBY', KEYS[15], e[2][j + 1], 1) end
        end
      end
    end
    redis.call('XACK', stream, group, id)
    redis.call('XDEL', stream, id)
    redis.call('HDEL', KEYS[4], d)
    redis.call('HDEL', KEYS[6], d)
    redis.call('HDEL', KEYS[12], d)
    redis.call('HDEL', KEYS[13], d)
    redis.call('HDEL', KEYS[14], d)
    n = n + 1
    settle(KEYS[5], KEYS[7], d, finished)
  elseif ARGV[3] == 'acked_total' and redis.call('HDEL', KEYS[13], d) == 1 then
    -- a re-queued group dropped as stale after a rebuild that the trainer had trained: it was acked, not
    -- dropped (it is settled already; only the counters move)
    redis.call('HINCRBY', KEYS[3], 'dropped_stale_total', -1)
    n = n + 1
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[3], ARGV[3], n) end
return {'ok', n, persist_need(KEYS[10], KEYS[8], finished, KEYS[11], n > 0), finished}
