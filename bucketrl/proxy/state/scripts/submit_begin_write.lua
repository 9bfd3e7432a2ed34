local seen = redis.call('GET', KEYS[1])
if seen then return {'duplicate', seen} end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {'ok'} end
return {'busy'}
