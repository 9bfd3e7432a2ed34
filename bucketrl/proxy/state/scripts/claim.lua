-- KEYS: stream state counters entry remaining attempts settled meta p_meta bseq doomed pace channel owner request
--       redropped rebuilt
-- ARGV: group consumer n epoch idle_ms max_staleness min_version train_version sync_every groups_per_step
--       request_id request_ttl_s hold_rebuilt release_id...
local stream, group, consumer = KEYS[1], ARGV[1], ARGV[2]
local n, epoch, idle_ms, ms = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local hold = ARGV[13] == '1'
if redis.call('HEXISTS', KEYS[8], 'ready') == 0 then return {'notready'} end
local cur = tonumber(redis.call('HGET', KEYS[2], 'trainer_epoch') or '0')
if epoch ~= cur then return {'fenced', cur} end
ensure_group(stream, group)
if epoch > tonumber(redis.call('HGET', KEYS[8], 'epoch') or '0') then
  release_pending(stream, group, consumer, idle_ms)
  redis.call('HSET', KEYS[8], 'epoch', epoch)
end
-- deliveries the trainer gives back untrained (held back, or re-queued by a rebuild and not in its lineage):
-- re-claimable now, by anyone, and no longer handed over below the floor (the trainer said it never trained them)
for i = 14, #ARGV do
  local d = ARGV[i]
  local id = redis.call('HGET', KEYS[4], d)
  if id and redis.call('HGET', KEYS[14], d) == ARGV[4] then
    redis.call('HDEL', KEYS[14], d)
    redis.call('HDEL', KEYS[17], d)
    redis.call('XCLAIM', stream, group, consumer, 0, id, 'IDLE', idle_ms + 1, 'JUSTID')
  end
end
-- a replayed claim (same request id: the answer of the first was lost) gets the first one's deliveries again
if ARGV[11] ~= '' and redis.call('EXISTS', KEYS[15]) == 1 then
  local out = {}
  for _, x in ipairs(redis.call('LRANGE', KEYS[15], 0, -1)) do
    -- '!' marks a delivery the first attempt handed over below the floor (rebuilt_stale)
    local d, flag = x, 0
    if string.sub(x, 1, 1) == '!' then d, flag = string.sub(x, 2), 1 end
    local id = redis.call('HGET', KEYS[4], d)
    if id and redis.call('HGET', KEYS[14], d) == ARGV[4] then
      local e = redis.call('XRANGE', stream, id, id)[1]
      if e then
        local f, v, w = e[2], '0', ''
        for i = 1, #f, 2 do
          if f[i] == 'v' then v = f[i + 1] elseif f[i] == 'w' then w = f[i + 1] end
        end
        table.insert(out, {id, d, v, w, tonumber(redis.call('HGET', KEYS[6], d) or '1'), flag})
      end
    end
  end
  return {'ok', 0, last_id(stream), out, {}, 0, {}}
end
-- the run's rule (latest - max_staleness) or the trainer's own floor (ARGV[7], 0 = none), whichever is higher
local latest = tonumber(redis.call('HGET', KEYS[2], 'latest_version') or '0')
local min_version = math.max(latest - ms, tonumber(ARGV[7]))
local out, finished, redropped = {}, {}, {}
local dropped, handed = 0, 0
local function take(entries, redelivered)
  for _, e in ipairs(entries) do
    if type(e) == 'table' and type(e[2]) == 'table' then
      local id, f, d, v, w = e[1], e[2], '', '0', ''
      for i = 1, #f, 2 do
        if f[i] == 'd' then d = f[i + 1] elseif f[i] == 'v' then v = f[i + 1] elseif f[i] == 'w' then w = f[i + 1] end
      end
      -- re-queued by a rebuild (and not given back since): the trainer's lineage may have trained it already
      local rebuilt = redis.call('HEXISTS', KEYS[17], d) == 1
      if redelivered and redis.call('HGET', KEYS[14], d) == ARGV[4] then
        -- this live epoch holds it (trained, waiting for its checkpoint's ack): never hand it back to it;
        -- XAUTOCLAIM reset its idle time, so it is looked at again only after another timeout
      elseif tonumber(v) < min_version and rebuilt and hold then
        -- below the floor, but only the trainer knows whether it trained it: handed over flagged, never trained;
        -- it acks it (trained before the wipe: counted acked) or releases it (then dropped below)
        redis.call('HSET', KEYS[14], d, ARGV[4])
        table.insert(out, {id, d, v, w, redis.call('HINCRBY', KEYS[6], d, 1), 1})
        handed = handed + 1
      elseif tonumber(v) < min_version then
        redis.call('XACK', stream, group, id)
        redis.call('XDEL', stream, id)
        redis.call('HDEL', KEYS[4], d)
        redis.call('HDEL', KEYS[6], d)
        redis.call('HDEL', KEYS[14], d)
        redis.call('HDEL', KEYS[17], d)
        dropped = dropped + 1
        settle(KEYS[5], KEYS[7], d, finished)
        if rebuilt then
          -- (a claim without hold_rebuilt, from an older trainer) the trainer may have trained it already; its
          -- ack moves it to acked
          redis.call('HSET', KEYS[16], d, 1)
          table.insert(redropped, d)
        end
      else
        redis.call('HSET', KEYS[14], d, ARGV[4])
        table.insert(out, {id, d, v, w, redis.call('HINCRBY', KEYS[6], d, 1), 0})
      end
    end
  end
end
-- (a) redeliveries: walk the pending list once (XAUTOCLAIM scans a bounded slice per call)
local start = '0-0'
for _ = 1, 100000 do
  if #out >= n then break end
  local res = redis.call('XAUTOCLAIM', stream, group, consumer, idle_ms, start, 'COUNT', n - #out)
  take(res[2], true)
  start = res[1]
  if start == '0-0' then break end
end
-- (b) then new entries; stale ones are dropped, so read on until n are delivered or none is left
for _ = 1, 100000 do
  if #out >= n then break end
  local got = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n - #out, 'STREAMS', stream, '>')
  if not got then break end
  local before = #out + dropped
  take(got[1][2], false)
  if #out + dropped == before then break end
end
if dropped > 0 then redis.call('HINCRBY', KEYS[3], 'dropped_stale_total', dropped) end
-- the trainer's pace (admission control, state/prompts.py): the version of the step the next queued group
-- joins and how many groups that step still takes; this claim fills its step, or the next step takes them all
local changed = #out + dropped > 0
local tv = tonumber(ARGV[8])
if tv > 0 then
  local at, room = tv, n - (#out - handed)
  if room <= 0 then at, room = tv + 1, tonumber(ARGV[10]) end
  local prev = redis.call('HMGET', KEYS[12], 'at', 'room', 'sync')
  if tonumber(prev[1]) ~= at or tonumber(prev[2]) ~= room or prev[3] ~= ARGV[9] then
    redis.call('HSET', KEYS[12], 'at', at, 'room', room, 'sync', ARGV[9])
    changed = true
  end
end
if changed then redis.call('PUBLISH', KEYS[13], '1') end
if ARGV[11] ~= '' and #out > 0 then
  for _, e in ipairs(out) do redis.call('RPUSH', KEYS[15], (e[6] == 1 and '!' or '') .. e[2]) end
  redis.call('EXPIRE', KEYS[15], ARGV[12])
end
return {'ok', dropped, last_id(stream), out, finished, persist_need(KEYS[10], KEYS[9], finished, KEYS[11], dropped > 0),
        redropped}
