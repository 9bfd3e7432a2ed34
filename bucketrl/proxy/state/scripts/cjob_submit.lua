-- KEYS: job queued seq channel ; ARGV: request_id request_json version ttl_s
-- A job already known answers its state ({0, state}; {-1, state}: the same id names another request).
local st = redis.call('HMGET', KEYS[1], 'state', 'request')
if st[1] then
  if st[2] ~= ARGV[2] then return {-1, st[1]} end
  return {0, st[1]}
end
local seq = redis.call('INCR', KEYS[3])
redis.call('HSET', KEYS[1], 'state', 'queued', 'request', ARGV[2], 'version', ARGV[3], 'seq', seq)
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[4])))
redis.call('ZADD', KEYS[2], seq, ARGV[1])
redis.call('PUBLISH', KEYS[4], ARGV[1])
return {1, 'queued'}
