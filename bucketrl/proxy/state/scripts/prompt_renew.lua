-- KEYS: inflight owner ; ARGV: ttl_s worker pid...   (an expired lease cannot be revived; Redis TIME)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local exp = string.format('%.6f', now + tonumber(ARGV[1]))
local out = {exp}
for i = 3, #ARGV do
  local pid = ARGV[i]
  local score = redis.call('ZSCORE', KEYS[1], pid)
  if score and tonumber(score) > now and redis.call('HGET', KEYS[2], pid) == ARGV[2] then
    redis.call('ZADD', KEYS[1], exp, pid)
    table.insert(out, pid)
  end
end
return out
