-- KEYS: stream owner ; ARGV: group idle_ms (stream_id delivery_id)...
-- (claimed, but the bucket read failed: hand out again, to the same epoch too)
ensure_group(KEYS[1], ARGV[1])
local args = {KEYS[1], ARGV[1], 'requeue', 0}
for i = 3, #ARGV, 2 do
  table.insert(args, ARGV[i])
  redis.call('HDEL', KEYS[2], ARGV[i + 1])
end
table.insert(args, 'IDLE')
table.insert(args, tonumber(ARGV[2]) + 1)
table.insert(args, 'JUSTID')
return #redis.call('XCLAIM', unpack(args))
