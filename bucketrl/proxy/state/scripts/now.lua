-- Redis TIME as seconds (every replica agrees on it, whatever its own clock says)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
