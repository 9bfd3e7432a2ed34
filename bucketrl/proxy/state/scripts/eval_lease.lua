-- KEYS: results cursor leased done request ; ARGV: version ttl_s n size with_request
-- Returns {} or {version, index...}. A replay (the request key exists) answers its first attempt's lease.
-- Times are Redis TIME, like every lease (issue 10 item 10).
local seen = redis.call('GET', KEYS[5])
if seen then return cjson.decode(seen) end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return {} end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local exp = string.format('%.6f', now + tonumber(ARGV[2]))
local n, size = tonumber(ARGV[3]), tonumber(ARGV[4])
local out = {}
local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. string.format('%.6f', now), 'LIMIT', 0, 10000)
for _, idx in ipairs(expired) do
  if #out >= n then break end
  if redis.call('SISMEMBER', KEYS[4], idx) == 0 then
    table.insert(out, tonumber(idx))
    redis.call('ZADD', KEYS[3], exp, idx)
  else
    redis.call('ZREM', KEYS[3], idx)
  end
end
local cursor = tonumber(redis.call('GET', KEYS[2]) or '0')
while #out < n and cursor < size do
  table.insert(out, cursor)
  redis.call('ZADD', KEYS[3], exp, cursor)
  cursor = cursor + 1
end
redis.call('SET', KEYS[2], cursor)
if #out == 0 then return out end
table.insert(out, 1, tonumber(ARGV[1]))
if ARGV[5] == '1' then redis.call('SET', KEYS[5], cjson.encode(out), 'EX', math.ceil(tonumber(ARGV[2]))) end
return out
