-- KEYS: cursor inflight owner open meta queue_meta counters remaining settled doomed redropped cost_usage
-- (nothing while the state is not ready: never persist a wiped Redis)
if redis.call('HEXISTS', KEYS[5], 'ready') == 0 or redis.call('HEXISTS', KEYS[6], 'ready') == 0 then return false end
local cursor = tonumber(redis.call('GET', KEYS[1]) or '0')
local seq = tonumber(redis.call('HGET', KEYS[5], 'seq') or '0')
local reserved = tonumber(redis.call('HGET', KEYS[5], 'persisted_reserved') or '0')
local open = redis.call('SMEMBERS', KEYS[4])
local leased = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
local owners = {}
for i = 1, #leased, 2 do table.insert(owners, redis.call('HGET', KEYS[3], leased[i]) or '') end
return {cursor, seq, reserved, open, leased, owners, redis.call('HGETALL', KEYS[7]), redis.call('HGETALL', KEYS[8]),
        redis.call('HGETALL', KEYS[9]), redis.call('HKEYS', KEYS[10]), redis.call('HKEYS', KEYS[11]),
        redis.call('HGETALL', KEYS[12])}
