-- Queued (never claimed) groups = stream length - pending entries; acked and dropped entries are XDELed.
local function queued_groups(stream, group)
  if redis.call('EXISTS', stream) == 0 then return 0 end
  return redis.call('XLEN', stream) - redis.call('XPENDING', stream, group)[1]
end
