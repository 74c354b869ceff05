"""The Lua scripts that keep a Redis line, and how a call to each is laid out.

Each key's line is four Redis keys in one hash slot (KEYS, in this order:
line, q, lease, info), and a fifth for the members that left before they
came (gone); see :mod:`inturn.backends.redis` for what they hold. Every
change to a line is one of these scripts, so it is atomic.

A member that waits for latest work shared across processes (``across=
"processes"``, see ``_latest.py``) carries a *post* at the end of its info,
`` @<clock> <monotonic ns> <Redis µs> <fresh>``: when its process's newest
work was called, on its host's clock and converted to Redis's; and the line
keeps what ran last as its ``ran`` field, ``<clock> <monotonic ns> <Redis µs>
<ok>``. A call's time is sent as ``<clock> <monotonic ns> <age µs>`` (how long
before the call was written it was made), and the script that stores it
converts the age to Redis's clock.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Hashable
from typing import Final, final

from ..._order import portable_name
from ._resp import bulk

# KEYS: line, q, lease, info, gone. Shared by every script: the clock, dropping
# expired members, granting a free key to the head, and deleting or
# refreshing the line's keys.
#
# Each redis.call costs a script about a microsecond besides its command's own
# work, and a release's script is on the way of every hand-off: so a script
# calls Redis for what it does not know yet, never twice for the same thing
# (the holder, whether the key is free, whether the line is empty).
#
# The line's keys' TTL (three leases) is set by every enqueue and renewal:
# every member renews its lease every third of one, so a line that has a
# member that lives keeps its keys; a line whose members all died loses them
# within three leases. A release that hands the key on leaves the TTLs as they
# are (the new holder renews them); one that empties the line deletes its keys.
_PRELUDE = """
local line, q, lease, info, gone = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])

-- A call's time as sent, '<clock> <monotonic ns> <age µs>', as stored: its age on Redis's
-- clock, '<clock> <monotonic ns> <Redis µs>' (the monotonic ns are never a Lua number: they
-- may pass 2^53).
local function stamped(sent)
  local clock, mono, age = string.match(sent, '^(%S+) (%d+) (%-?%d+)$')
  return clock .. ' ' .. mono .. ' ' .. string.format('%.0f', now_us - tonumber(age))
end

-- Drop the members whose lease expired; how many there were.
local function purge()
  local expired = redis.call('ZRANGEBYSCORE', lease, '-inf', now)
  for _, m in ipairs(expired) do
    redis.call('ZREM', q, m)
    redis.call('ZREM', lease, m)
    redis.call('HDEL', info, m)
    if redis.call('HGET', line, 'holder') == m then
      redis.call('HDEL', line, 'holder')
    end
  end
  return #expired
end

-- The key is free: hand it to the head of the line (told on its channel, unless it
-- is me); the head and its token, or nil if nobody waits.
local function hand_on(channels, me)
  local head = redis.call('ZRANGE', q, 0, 0)[1]
  if not head then return nil end
  redis.call('ZREM', q, head)
  local token = math.max(tonumber(redis.call('HGET', line, 'token') or '0') + 1, now_us)
  token = string.format('%.0f', token)
  redis.call('HSET', line, 'holder', head, 'token', token, 'since', now)
  if head ~= me then
    redis.call('PUBLISH', channels .. string.match(head, '^[^/]+'), head .. ' ' .. token)
  end
  return head, token
end

local function grant(channels, me)
  if redis.call('HEXISTS', line, 'holder') == 0 then hand_on(channels, me) end
end

local function refresh(ttl)
  for _, k in ipairs({line, q, lease, info}) do redis.call('PEXPIRE', k, ttl) end
end

local function finish(ttl)
  if redis.call('HEXISTS', line, 'holder') == 0 and redis.call('ZCARD', q) == 0 then
    redis.call('DEL', line, q, lease, info)
  else
    refresh(ttl)
  end
end
"""

# ARGV: member, lease ms, ttl ms, channel prefix, info, the key as given, and for latest
# work its call's time (see the module; else ''), posted at the end of its info.
# Returns one integer: the token (above 0) when the key was free, else minus
# the place in line; 0 when the member left before it came (its leave ran
# first: see _LEAVE). One integer, not a pair: it is every turn's reply, and a
# reader parses one element instead of three (redis-py's parser, on the public
# wire and a thread's connection, pays for each). A token is Redis's clock in
# microseconds, exact as a Lua number (a double) for ages yet. Latest work that
# starts a line anew gets its token alone in a list: nothing ran in the line,
# nobody waits behind it, so it need not judge.
_ENQUEUE = (
    _PRELUDE
    + """
local member, lease_ms, ttl, channels = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
if redis.call('ZSCORE', gone, member) then
  redis.call('ZREM', gone, member)
  return 0
end
local about = ARGV[5]
if ARGV[7] ~= '' then about = about .. ' @' .. stamped(ARGV[7]) .. ' 0' end
if redis.call('EXISTS', line, q) == 0 then
  -- the line starts anew (its keys come and go together): the key is free
  local token = string.format('%.0f', now_us)
  redis.call('HSET', line, 'seq', 1, 'holder', member, 'token', token, 'since', now, 'key', ARGV[6])
  redis.call('ZADD', lease, now + lease_ms, member)
  redis.call('HSET', info, member, about)
  finish(ttl)
  if ARGV[7] ~= '' then return {tonumber(token)} end  -- latest work: nothing to judge
  return tonumber(token)
end
purge()
local holder, token = redis.call('HGET', line, 'holder'), nil
if holder ~= member then
  local seq = redis.call('HINCRBY', line, 'seq', 1)
  redis.call('ZADD', q, 'NX', seq, member)
  redis.call('ZADD', lease, now + lease_ms, member)
  redis.call('HSET', info, member, about)
  redis.call('HSETNX', line, 'key', ARGV[6])
  if not holder then holder, token = hand_on(channels, member) end
end
refresh(ttl)  -- (never empty: member is in it)
if holder == member then
  return tonumber(token or redis.call('HGET', line, 'token'))
end
return -(redis.call('ZRANK', q, member) + 1)
"""
)

# ARGV: member, ttl ms, channel prefix, whether its enqueue may still come
# ('1': no answer to it was read), and for latest work that ran, its call's time and
# whether it returned ('<time> <0|1>', see the module; else ''), which the line keeps as
# what ran if the member still holds the key. Releases the key, or leaves the line.
# Returns 1: was the holder; 2: was waiting; 3: had released already (a
# retried call); 0: was in neither place (its lease ran out, or its enqueue
# has not come yet). A leave that may have overtaken its enqueue (sent on
# another connection: Redis runs the connections' calls in any order) and
# finds the member in neither place marks it gone, for a ttl: the enqueue,
# if it comes, then does nothing (see _ENQUEUE). Expired marks are dropped.
_LEAVE = (
    _PRELUDE
    + """
local member, ttl, channels = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local holder = redis.call('HGET', line, 'holder')
if ARGV[5] ~= '' and holder == member then
  -- (only while it holds the key: a holder whose lease ran out may have run its work after
  -- newer work ran; a line that ends below is deleted with it: nobody is left to judge)
  local sent, ok = string.match(ARGV[5], '^(.*) ([01])$')
  redis.call('HSET', line, 'ran', stamped(sent) .. ' ' .. ok)
end
if holder == member and redis.call('EXISTS', q) == 0
    and tonumber(redis.call('ZSCORE', lease, member) or 0) > now then
  -- the holder leaves, its lease good, nobody waits: the line ends
  redis.call('DEL', line, lease, info)
  return 1
end
if purge() > 0 then holder = redis.call('HGET', line, 'holder') end
local status = 0
if holder == member then
  redis.call('HDEL', line, 'holder')
  redis.call('HSET', line, 'last', member)
  holder = false
  status = 1
elseif redis.call('ZREM', q, member) == 1 then
  status = 2
elseif redis.call('HGET', line, 'last') == member then
  status = 3
elseif ARGV[4] == '1' then
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', gone, '-inf', now)) do
    redis.call('ZREM', gone, m)
  end
  redis.call('ZADD', gone, now + ttl, member)
  redis.call('PEXPIRE', gone, ttl)
end
redis.call('ZREM', lease, member)
redis.call('HDEL', info, member)
if not holder and hand_on(channels, '') then
  return status  -- the key is handed on: the line goes on, its TTLs kept by its members
end
finish(ttl)
return status
"""
)

# ARGV: member, lease ms, ttl ms, channel prefix. Returns {1, token}: holds
# the key; {2, 0}: waits; {0, 0}: in the line no more (its lease ran out).
_RENEW = (
    _PRELUDE
    + """
local member, lease_ms, ttl, channels = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
purge()
if redis.call('HGET', line, 'holder') ~= member and not redis.call('ZSCORE', q, member) then
  grant(channels, '')
  finish(ttl)
  return {0, 0}
end
redis.call('ZADD', lease, 'XX', now + lease_ms, member)
grant(channels, member)
finish(ttl)
if redis.call('HGET', line, 'holder') == member then
  return {1, redis.call('HGET', line, 'token')}
end
return {2, 0}
"""
)


# ARGV: member, ttl ms, channel prefix. The holder's turn of latest work has come: what
# it judges by (see _latest.py): {Redis's clock in µs, what ran ('' if nothing did), the
# post of each member behind it in line, in order}; {} if member no longer holds the key
# (its lease ran out: the key goes to the next in line).
_JUDGE = (
    _PRELUDE
    + """
local member, ttl, channels = ARGV[1], tonumber(ARGV[2]), ARGV[3]
purge()
if redis.call('HGET', line, 'holder') ~= member then
  grant(channels, '')
  finish(ttl)
  return {}
end
local reply = {string.format('%.0f', now_us), redis.call('HGET', line, 'ran') or ''}
for _, m in ipairs(redis.call('ZRANGE', q, 0, -1)) do
  local post = string.match(redis.call('HGET', info, m) or '', ' @(.*)$')
  if post then reply[#reply + 1] = post end
end
return reply
"""
)

# ARGV: member, lease ms, ttl ms, channel prefix, its call's time (see the module). The
# holder's turn of latest work joins the line again, at its end, with a fresh post of
# that time, and hands the key on. Returns as the enqueue: the token if the key came
# back to it at once (nobody waits now), else minus its place in line; 0 if member no
# longer held the key (its lease ran out).
_AGAIN = (
    _PRELUDE
    + """
local member, lease_ms, ttl, channels = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
purge()
if redis.call('HGET', line, 'holder') ~= member then
  grant(channels, '')
  finish(ttl)
  return 0
end
redis.call('HDEL', line, 'holder')
redis.call('ZADD', q, redis.call('HINCRBY', line, 'seq', 1), member)
redis.call('ZADD', lease, now + lease_ms, member)
local about = string.match(redis.call('HGET', info, member) or '', '^(.-) @') or ''
redis.call('HSET', info, member, about .. ' @' .. stamped(ARGV[5]) .. ' 1')
local head, token = hand_on(channels, member)
refresh(ttl)
if head == member then return tonumber(token) end
return -(redis.call('ZRANK', q, member) + 1)
"""
)

# KEYS: the probe, a key of the namespace's that it never leaves behind. ARGV:
# this process's channel. Once per connection, tries each command the other
# scripts call, so that a permission this user lacks is named at the first
# call, not when a rare path (a lapsed lease) needs it. Returns {run_id,
# refused...}: the server's run_id ('' where this user may not call INFO;
# another one means Redis was restarted or failed over, and every lease it held
# may be gone), then what the user may not do, in Redis 7.2's words (a command
# refused for another reason, READONLY or OOM, is the calls' to report).
_HELLO = """
local probe = KEYS[1]
local reply, seen = {''}, {}
local function try(...)
  local r = redis.pcall(...)
  if type(r) ~= 'table' or not r.err then return end
  local e = r.err
  if not (e:find('ACL', 1, true) or e:find('user executing', 1, true)
          or e:find('permission', 1, true)) then return end
  local what
  if e:find('the channel', 1, true) then
    what = 'no permissions to access one of the channels'
  elseif e:find('of the keys', 1, true) then
    what = 'no permissions to access one of the keys'
  else
    what = "no permissions to run the '" .. string.lower((...)) .. "' command"
  end
  if not seen[what] then
    seen[what] = true
    reply[#reply + 1] = what
  end
end
try('PUBLISH', ARGV[1], '')
try('TIME')
try('EXISTS', probe)
try('HSET', probe, 'f', '1')
try('PEXPIRE', probe, 60000)
try('HSETNX', probe, 'f', '1')
try('HINCRBY', probe, 'n', 1)
try('HGET', probe, 'f')
try('HEXISTS', probe, 'f')
try('HGETALL', probe)
try('HDEL', probe, 'f', 'n')
try('DEL', probe)
try('ZADD', probe, 0, 'm')
try('PEXPIRE', probe, 60000)
try('ZSCORE', probe, 'm')
try('ZRANK', probe, 'm')
try('ZRANGE', probe, 0, 0)
try('ZRANGEBYSCORE', probe, '-inf', 0)
try('ZCARD', probe)
try('ZREM', probe, 'm')
try('DEL', probe)
local info = redis.pcall('INFO', 'server')
if type(info) == 'string' then reply[1] = string.match(info, 'run_id:(%x+)') or '' end
return reply
"""

# KEYS: line, q, lease, info. Changes nothing: the line as it is now, for
# lines(): {now ms, line (flat hash), waiters in order, leases (flat, with
# scores), info (flat hash)}, the same over RESP2 and RESP3.
_LOOK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {tostring(now), redis.call('HGETALL', KEYS[1]), redis.call('ZRANGE', KEYS[2], 0, -1),
        redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES'), redis.call('HGETALL', KEYS[4])}
"""


@final
class Line:
    """One key's line in Redis: the names of its keys (KEYS, in the scripts' order), and
    what every call on it repeats, packed: the keys, and the key as given (the enqueue's
    last argument)."""

    __slots__ = ("given", "names", "packed")

    def __init__(self, namespace: str, key: Hashable) -> None:
        name = portable_name(key)
        digest = hashlib.sha256(name).hexdigest()[:40]
        prefix = f"inturn:{{{namespace}:{digest}}}:"
        #: line, q, lease, info, gone: one hash slot (the hash tag), so a cluster takes them.
        self.names = tuple(prefix + part for part in ("line", "q", "lease", "info", "gone"))
        #: The names as a script call's keys (on one server's connection; a cluster's client
        #: packs them itself).
        self.packed = b"".join([bulk(name.encode()) for name in self.names])
        self.given = bulk(name)

    def __repr__(self) -> str:
        return f"<Line {self.names[0][: -len('line')]}>"


class Script:
    """One script: its number, body, SHA-1 (to call it by), and its counts of KEYS and ARGV."""

    __slots__ = ("args", "body", "index", "keys", "sha")

    def __init__(self, index: int, body: str, keys: int, args: int) -> None:
        self.index = index
        self.body = body.encode()
        self.sha = hashlib.sha1(self.body).hexdigest().encode()
        self.keys = keys
        self.args = args

    def __repr__(self) -> str:
        return f"<Script {self.index} {self.sha.decode()[:8]}>"


ENQUEUE: Final = Script(0, _ENQUEUE, 5, 7)
LEAVE: Final = Script(1, _LEAVE, 5, 5)
RENEW: Final = Script(2, _RENEW, 5, 4)
HELLO: Final = Script(3, _HELLO, 1, 1)
LOOK: Final = Script(4, _LOOK, 4, 0)
JUDGE: Final = Script(5, _JUDGE, 5, 3)
AGAIN: Final = Script(6, _AGAIN, 5, 5)
#: Every script, by number.
SCRIPTS: Final = (ENQUEUE, LEAVE, RENEW, HELLO, LOOK, JUDGE, AGAIN)


def _head(verb: bytes, script: Script) -> bytes:
    """A script call's command up to its keys: the verb, the SHA or body, the count of keys."""
    name = script.sha if verb == b"EVALSHA" else script.body
    return (
        b"*%d\r\n" % (3 + script.keys + script.args)
        + bulk(verb)
        + bulk(name)
        + bulk(b"%d" % script.keys)
    )


#: By script number: its call by SHA; then (number + len(SCRIPTS)) with its body (EVAL,
#: which loads it: for a server whose scripts were flushed). A call is its head, then
#: its keys and arguments packed (``Calls``).
HEADS: Final = tuple(_head(b"EVALSHA", s) for s in SCRIPTS) + tuple(
    _head(b"EVAL", s) for s in SCRIPTS
)


#: A command called in a script: redis.call('NAME' or redis.pcall('NAME.
_CALLED = re.compile(r"redis\.p?call\('([A-Z]+)'")
#: Every command the scripts call (the greeting tries each, INFO aside).
CALLED: Final = frozenset(_CALLED.findall("".join(s.body.decode() for s in SCRIPTS)))


def called_at(sha: str, line: int) -> list[str]:
    """The commands that line ``line`` (from 1) of the script whose SHA-1 is ``sha`` calls,
    in order; [] for a script or line not known here."""
    for script in SCRIPTS:
        if script.sha.decode() == sha:
            lines = script.body.decode().splitlines()
            return _CALLED.findall(lines[line - 1]) if 0 < line <= len(lines) else []
    return []
