-- Weighted fair share over generated tokens: the order in which a pool lease tries the candidate runs.
-- KEYS: per run i, 3 keys: counters, pool, prompts inflight
-- ARGV: active_window_s, then per run i, 3 values: share, budget ('' = none), tokens per group before any
-- Returns {now, order, holds, scores}: order = candidate indices (1-based) of the runs to try, fewest
-- (tokens generated + credit + tokens of the prompts in flight) per share first; holds[i] = 'ok' | 'paused' | 'finished' |
-- 'budget'; scores[i] as strings (a Lua number would reach the caller truncated to an integer).
-- A run that got no lease within the window (new, resumed, or starved by its own admission control) and lags
-- the least-served active run is credited up to it: it starts at its share of what comes next instead of
-- taking the whole pool until it has caught up on a past it was not part of (virtual time, as in WF2Q).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local window = tonumber(ARGV[1])
local n = #KEYS / 3
local holds, scores, shares, active, credits = {}, {}, {}, {}, {}
local vmin = nil
for i = 1, n do
  local c, p, f = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local share, budget, est = tonumber(ARGV[3 * i - 1]), ARGV[3 * i], tonumber(ARGV[3 * i + 1])
  local tok = tonumber(redis.call('HGET', c, 'tokens_generated_total') or '0')
  local groups = tonumber(redis.call('HGET', c, 'accepted_total') or '0')
  local pool = redis.call('HMGET', p, 'paused', 'credit', 'last_granted')
  local hold = 'ok'
  if pool[1] == '1' then
    hold = 'paused'
  elseif pool[1] == '2' then
    hold = 'finished'
  elseif budget ~= '' and tok >= tonumber(budget) then
    hold = 'budget'
  end
  if groups > 0 then est = tok / groups end
  credits[i] = tonumber(pool[2] or '0')
  scores[i] = (tok + credits[i] + redis.call('ZCARD', f) * est) / share
  holds[i], shares[i] = hold, share
  active[i] = pool[3] and (now - tonumber(pool[3]) <= window)
  if hold == 'ok' and active[i] and (vmin == nil or scores[i] < vmin) then vmin = scores[i] end
end
local order = {}
for i = 1, n do
  if holds[i] == 'ok' then
    if vmin ~= nil and not active[i] and scores[i] < vmin then
      credits[i] = credits[i] + (vmin - scores[i]) * shares[i]
      redis.call('HSET', KEYS[3 * i - 1], 'credit', string.format('%.3f', credits[i]))
      scores[i] = vmin
    end
    table.insert(order, i)
  end
end
-- Ties: a run not served within the window first (a credited run ties the active one it was lifted to).
table.sort(order, function(a, b)
  if scores[a] ~= scores[b] then return scores[a] < scores[b] end
  if (not active[a]) ~= (not active[b]) then return not active[a] end
  return a < b
end)
local out = {}
for i = 1, n do out[i] = string.format('%.3f', scores[i]) end
return {string.format('%.6f', now), order, holds, out}
