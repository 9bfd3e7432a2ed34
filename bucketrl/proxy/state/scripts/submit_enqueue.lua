-- KEYS: idem state stream counters entry remaining p_open p_inflight p_owner p_meta queue_meta bseq write_lock
--       tokens_recent trained_by
-- ARGV: batch_id group version max_staleness capacity worker idem_ttl idem_value n_groups lock_token tokens pid...
-- (tokens: the batch's generated tokens, counted with accepted_total: exactly once, what pool fair share reads)
-- (the batch's write lock is released here when the object stays: enqueued, or a duplicate's)
if redis.call('HEXISTS', KEYS[11], 'ready') == 0 or redis.call('HEXISTS', KEYS[10], 'ready') == 0 then
  return {'notready'}
end
local batch, group, version = ARGV[1], ARGV[2], tonumber(ARGV[3])
local ms, cap, worker, n = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[9])
local function unlock()
  if redis.call('GET', KEYS[13]) == ARGV[10] then redis.call('DEL', KEYS[13]) end
end
local existing = redis.call('GET', KEYS[1])
if existing then
  unlock()
  return {'duplicate', existing}
end
local latest = tonumber(redis.call('HGET', KEYS[2], 'latest_version') or '0')
if version > latest then return {'newer', latest} end
if version < latest - ms then
  redis.call('HINCRBY', KEYS[4], 'rejected_stale_total', n)
  return {'stale', latest}
end
-- Exactly once per prompt: a prompt no longer open was completed by another accepted batch (or never issued).
-- It happens after a Redis wipe (the rebuild reissues prompts leased after the last snapshot while their first
-- holder still runs) or when a lease expired and was reissued: the batch is refused whole, trained never.
local done = {}
for i = 12, #ARGV do
  if redis.call('SISMEMBER', KEYS[7], ARGV[i]) == 0 then table.insert(done, ARGV[i]) end
end
if #done > 0 then
  redis.call('HINCRBY', KEYS[4], 'rejected_repeated_total', n)
  redis.call('HINCRBY', KEYS[4], 'prompts_refused_repeated_total', #done)
  return {'repeated', unpack(done)}
end
ensure_group(KEYS[3], group)
local q = queued_groups(KEYS[3], group)
if q + n > cap then
  redis.call('HINCRBY', KEYS[4], 'backpressure_total', 1)
  redis.call('HINCRBY', KEYS[4], 'submit_backpressure_total', 1)
  return {'full', q}
end
for g = 0, n - 1 do
  local d = batch .. ':' .. g
  local id = redis.call('XADD', KEYS[3], '*', 'd', d, 'v', version, 'w', worker)
  redis.call('HSET', KEYS[5], d, id)
end
redis.call('HSET', KEYS[6], batch, n)
redis.call('HINCRBY', KEYS[4], 'accepted_total', n)
redis.call('HINCRBY', KEYS[4], 'tokens_generated_total', tonumber(ARGV[11]))
-- The same tokens by 10 s slot: the share a run got recently (pool status), not only since it began.
local slot = math.floor(tonumber(redis.call('TIME')[1]) / 10)
redis.call('HINCRBY', KEYS[14], slot, tonumber(ARGV[11]))
-- Pruned down to the last 7 slots once 13 have built up: once a minute, not on every submit (status reads 6).
if redis.call('HLEN', KEYS[14]) > 12 then
  for _, f in ipairs(redis.call('HKEYS', KEYS[14])) do
    if tonumber(f) < slot - 6 then redis.call('HDEL', KEYS[14], f) end
  end
end
redis.call('EXPIRE', KEYS[14], 300)
local completed, repeated = 0, 0
for i = 12, #ARGV do
  local pid = ARGV[i]
  if redis.call('SREM', KEYS[7], pid) == 1 then
    redis.call('ZREM', KEYS[8], pid)
    redis.call('HDEL', KEYS[9], pid)
    completed = completed + 1
  else
    repeated = repeated + 1
  end
end
redis.call('HINCRBY', KEYS[10], 'seq', 1)
redis.call('HINCRBY', KEYS[4], 'prompts_completed_total', completed)
if repeated > 0 then redis.call('HINCRBY', KEYS[4], 'prompts_repeated_total', repeated) end
redis.call('SET', KEYS[1], ARGV[8], 'EX', ARGV[7])
unlock()
-- the run's trained groups and this worker's: its share of the training (generator admission control)
local acked = tonumber(redis.call('HGET', KEYS[4], 'acked_total') or '0')
return {'ok', completed, repeated, acked, tonumber(redis.call('HGET', KEYS[15], worker) or '0')}
