-- KEYS: cursor inflight owner reissue open meta stream counters queue_meta state pace request spec pool
-- ARGV: ttl_s n spec_digest worker size limit group version groups_per_step max_staleness slack request_id budget
-- A held run (paused, finished, or its budget_tokens generated: state/pool.py) answers {-3, why}: queued, never failed.
-- spec_digest: the sha1 of the spec the caller's numbers come from ('' = unchecked); another stored spec
-- (changed, or gone) refuses with -2 before anything is done.
-- Lease times are Redis TIME: every replica agrees on when a lease expires, whatever its own clock says.
if ARGV[3] ~= '' and redis.sha1hex(redis.call('GET', KEYS[13]) or '') ~= ARGV[3] then
  return {-2}
end
if redis.call('HEXISTS', KEYS[6], 'ready') == 0 or redis.call('HEXISTS', KEYS[9], 'ready') == 0 then
  return {-1}
end
local t = redis.call('TIME')
local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
local exp = string.format('%.6f', tonumber(now) + tonumber(ARGV[1]))
local n, worker = tonumber(ARGV[2]), ARGV[4]
-- a replay (same request id; the first answer was lost): the prompts that lease handed out this worker still holds
if ARGV[12] ~= '' then
  local prev = redis.call('LRANGE', KEYS[12], 0, -1)
  if #prev > 0 then
    local result = {1, tonumber(redis.call('HGET', KEYS[6], 'seq') or '0'), tonumber(redis.call('GET', KEYS[1]) or '0'),
                    tonumber(redis.call('HGET', KEYS[6], 'persisted_reserved') or '0'), prev[1]}
    for i = 2, #prev do
      if redis.call('HGET', KEYS[3], prev[i]) == worker and redis.call('ZSCORE', KEYS[2], prev[i]) then
        table.insert(result, prev[i])
      end
    end
    return result
  end
end
local hold = redis.call('HGET', KEYS[14], 'paused')
if hold == '1' then return {-3, 'paused'} end
if hold == '2' then return {-3, 'finished'} end
if ARGV[13] ~= '' and tonumber(redis.call('HGET', KEYS[8], 'tokens_generated_total') or '0') >= tonumber(ARGV[13]) then
  return {-3, 'budget'}
end
local size, limit, group = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
-- 1. expired leases go back on the reissue list (unless their group arrived meanwhile)
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. now, 'LIMIT', 0, 10000)
local lost = 0
for _, pid in ipairs(expired) do
  redis.call('ZREM', KEYS[2], pid)
  redis.call('HDEL', KEYS[3], pid)
  if redis.call('SISMEMBER', KEYS[5], pid) == 1 then
    redis.call('RPUSH', KEYS[4], pid)
    lost = lost + 1
  end
end
-- work lost in flight (the worker died, or was preempted without a notice): the run's cost counts it as waste
if lost > 0 then redis.call('HINCRBY', KEYS[8], 'prompts_expired_total', lost) end
-- 2. admission control: the work limit, then the trainer's pace against the caller's version
local inflight = redis.call('ZCARD', KEYS[2])
local queued = queued_groups(KEYS[7], group)
local ahead = inflight + queued
local room = limit - ahead
local pace = redis.call('HMGET', KEYS[11], 'at', 'room', 'sync')
local at = tonumber(pace[1])
local latest = tonumber(redis.call('HGET', KEYS[10], 'latest_version') or '0')
local version = tonumber(ARGV[8])
if version <= 0 or version > latest then version = latest end
local paced = 0
if at and room > 0 then
  local gps, ms = tonumber(ARGV[9]), tonumber(ARGV[10])
  -- the step taking the next group trains with version `at` and takes pace.room more groups; each later step
  -- publishes at most one version per `sync` steps; the caller's groups must be trained within ms of `version`,
  -- less ARGV[11] versions of slack (BUCKETRL_PACE_SLACK_VERSIONS, default 1)
  local spare = ms - (at - version) - tonumber(ARGV[11])
  local fits = 0
  if spare >= 0 then fits = tonumber(pace[2]) + spare * tonumber(pace[3]) * gps - ahead end
  if fits < room then
    room, paced = fits, 1
    -- never starve an empty pipeline (the slack alone can refuse groups that would be trained in time), but
    -- never grant groups certain to be dropped: when the caller's version is more than max_staleness behind
    -- `at`, the version the next step trains with, it waits for that version (strict on-policy: the trainer is
    -- about to publish it) or asks again with a newer one
    if room <= 0 and ahead == 0 and at - version <= ms then room = math.min(limit, gps) end
  end
end
if room <= 0 then
  return {0, inflight, queued, paced, at or 0, version, latest}
end
local grant = math.min(n, room)
local out = {}
-- 3. reissues first (skip ones completed or leased again meanwhile)
while #out < grant do
  local pid = redis.call('LPOP', KEYS[4])
  if not pid then break end
  if redis.call('SISMEMBER', KEYS[5], pid) == 1 and not redis.call('ZSCORE', KEYS[2], pid) then
    table.insert(out, pid)
  end
end
-- 4. then never-issued positions from the cursor
local cursor = tonumber(redis.call('GET', KEYS[1]) or '0')
local fresh = 0
while #out < grant do
  local pid = string.format('%d-%d', math.floor(cursor / size), cursor % size)
  redis.call('SADD', KEYS[5], pid)
  table.insert(out, pid)
  cursor = cursor + 1
  fresh = fresh + 1
end
if fresh > 0 then redis.call('SET', KEYS[1], cursor) end
for _, pid in ipairs(out) do
  redis.call('ZADD', KEYS[2], exp, pid)
  redis.call('HSET', KEYS[3], pid, worker)
end
local seq = redis.call('HINCRBY', KEYS[6], 'seq', 1)
local reserved = tonumber(redis.call('HGET', KEYS[6], 'persisted_reserved') or '0')
local result = {1, seq, cursor, reserved, exp}
for _, pid in ipairs(out) do table.insert(result, pid) end
if ARGV[12] ~= '' then
  redis.call('RPUSH', KEYS[12], exp, unpack(out))
  redis.call('EXPIRE', KEYS[12], math.ceil(tonumber(ARGV[1])))
end
return result
