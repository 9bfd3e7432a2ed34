local function ensure_group(stream, group)
  if redis.call('EXISTS', stream) == 0 then
    redis.call('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
  end
end
local function last_id(stream)
  local info = redis.call('XINFO', 'STREAM', stream)
  for i = 1, #info, 2 do if info[i] == 'last-generated-id' then return info[i + 1] end end
  return '0-0'
end
-- a settled group (acked, dropped or lost): count its batch down; report finished batches (a partly settled
-- one keeps its settled groups in `settled`, which prompts.json records for a rebuild)
local function settle(remaining, settled, d, finished)
  local b, g = string.match(d, '^(.+):(%d+)$')
  local rem = redis.call('HINCRBY', remaining, b, -1)
  if rem <= 0 then
    redis.call('HDEL', remaining, b)
    redis.call('HDEL', settled, b)
    table.insert(finished, b)
  else
    redis.call('HSET', settled, b, (redis.call('HGET', settled, b) or '') .. g .. ',')
  end
end
-- Something was settled: the state's seq moves on, and prompts.json (which records the prompts, which groups
-- are settled and the lifetime counters: a rebuild restores all three from it) must reach that seq, and
-- before these finished batches' objects may be deleted. Returns that seq (0: nothing settled).
local function persist_need(bseq, p_meta, finished, doomed, changed)
  if not changed then return 0 end
  local s = redis.call('HINCRBY', p_meta, 'seq', 1)
  for _, b in ipairs(finished) do
    redis.call('HDEL', bseq, b)
    redis.call('HSET', doomed, b, s)
  end
  return s
end
-- every pending entry becomes re-claimable now (idle pushed past the timeout; delivery count unchanged)
local function release_pending(stream, group, consumer, idle_ms)
  local start = '-'
  while true do
    local p = redis.call('XPENDING', stream, group, start, '+', 500)
    if #p == 0 then break end
    local args = {stream, group, consumer, 0}
    for _, e in ipairs(p) do table.insert(args, e[1]) end
    table.insert(args, 'IDLE')
    table.insert(args, idle_ms + 1)
    table.insert(args, 'JUSTID')
    redis.call('XCLAIM', unpack(args))
    if #p < 500 then break end
    start = '(' .. p[#p][1]
  end
end
