-- KEYS: job queued leased channel ; ARGV: request_id result_json
-- 1: this result answers the job; 0: it was answered before (the first result wins); -1: no such job.
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return -1 end
if st == 'done' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'done', 'result', ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('PUBLISH', KEYS[4], ARGV[1])
return 1
