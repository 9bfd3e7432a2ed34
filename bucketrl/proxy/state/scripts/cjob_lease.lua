-- KEYS: queued leased state seq ; ARGV: ttl_s max_jobs worker loaded_csv base scan job_prefix
-- base '0': the caller serves no base-model job (version 0); they are left for another
-- The job hashes are named from ARGV[7] .. request_id (they are not known before the queue is read: one
-- Redis, no cluster). Returns {lease_id, request_json, ...}. Lease times are Redis TIME, like every lease.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local exp = string.format('%.6f', now + tonumber(ARGV[1]))
local prefix = ARGV[7]
-- 1. an expired lease's job goes back first in line (its seq less 1e15: before every job never leased)
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. string.format('%.6f', now), 'LIMIT', 0, 1000)
for _, rid in ipairs(expired) do
  redis.call('ZREM', KEYS[2], rid)
  local st = redis.call('HMGET', prefix .. rid, 'state', 'seq')
  if st[1] == 'leased' then
    redis.call('HSET', prefix .. rid, 'state', 'queued')
    redis.call('ZADD', KEYS[1], tonumber(st[2]) - 1e15, rid)
  end
end
-- 2. published versions only (a job of a future version waits); the caller's loaded versions (and the base
-- model, version 0) first, then any
local latest = tonumber(redis.call('HGET', KEYS[3], 'latest_version') or '0')
local loaded = {['0'] = true}
for v in string.gmatch(ARGV[4], '[^,]+') do loaded[v] = true end
local first, second = {}, {}
for _, rid in ipairs(redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[6]) - 1)) do
  local v = redis.call('HGET', prefix .. rid, 'version')
  if not v then
    redis.call('ZREM', KEYS[1], rid)  -- the job expired (its ttl_s passed)
  elseif tonumber(v) <= latest and (v ~= '0' or ARGV[5] == '1') then
    if loaded[v] then table.insert(first, rid) else table.insert(second, rid) end
  end
end
for _, rid in ipairs(second) do table.insert(first, rid) end
local out = {}
local max = tonumber(ARGV[2])
for i = 1, math.min(#first, max) do
  local rid = first[i]
  local lease = 'cjl' .. redis.call('INCR', KEYS[4])
  redis.call('HSET', prefix .. rid, 'state', 'leased', 'lease_id', lease, 'worker', ARGV[3])
  redis.call('ZREM', KEYS[1], rid)
  redis.call('ZADD', KEYS[2], exp, rid)
  table.insert(out, lease)
  table.insert(out, redis.call('HGET', prefix .. rid, 'request'))
end
return out
