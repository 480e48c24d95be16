"""Authentication (password and token files, see ``credentials``), failed-login rate limits, and
topic ACLs.

Both credential files are read again on SIGHUP and when they change (``auth.credentials_poll_s``); a
file that no longer parses keeps the previous users and tokens (logged). scrypt runs on a small
thread pool, never on the event loop, at most ``auth.max_parallel_hashes`` at a time; an unknown
user is checked against a dummy hash of the same cost, so timing does not tell which users exist.

**Proven identities.** A username is *proven* when a password file checked its password, a verified
client certificate gave it (``tls.use_identity_as_username``), or an HTTP bearer token named it. On a
node that accepts anonymous clients and has no password file, a CONNECT carrying a username (with or
without a password) is accepted, but the username is only a label: it matches no ``user =`` ACL rule,
substitutes into no ``%u`` pattern (the rule is void, as for anonymous clients), gives no admin role,
and, where the node proves identities some other way (certificates), owns sessions and de-duplicates
as the anonymous principal does, so it never reaches a proven user's sessions or messages.

ACL rules (``[[auth.acl]]``) are topic filters; ``%u`` (username) and ``%c`` (client id) are
substituted **literally**: a substituted value that is empty, contains ``/``, ``+`` or ``#``, or would
make the pattern begin with ``$`` voids the rule for that principal (it matches nothing, allow or
deny), so an id never widens a pattern or adds levels. For a concrete topic the first matching rule
of the action (``publish``, or ``subscribe`` for reading; ``all`` counts for both) decides; no
matching rule means deny once any rule exists, allow when there is none.

- Publishing a topic that begins with ``$`` needs an allowing rule whose own pattern begins with
  ``$``; ``$SYS`` and ``$SYS/...`` are the broker's and never publishable by clients.
- Reading is filtered at delivery: ``can_subscribe`` grants a wildcard filter that overlaps readable
  topics even when it also overlaps denied ones, ``read_check_needed`` says whether delivery must
  ask ``can_read`` per message, and ``can_read`` decides one concrete topic.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from moorline.config import AclRule, AuthConfig, ConfigError
from moorline.mqtt.reasons import ReasonCode as RC
from moorline.mqtt.topics import is_wildcard, matches, validate_topic_filter
from moorline.node.edge.credentials import (
    dummy_hash_like,
    hash_token,
    read_password_file,
    read_token_file,
    verify_password,
)

log = logging.getLogger("moorline.auth")


# --- topic filter algebra (sets of topics; $-topics are not matched by a leading wildcard) ---------

_ANY = "\x00any"  # inside a '#' region
_END = "\x00end"  # past the last level of a filter without '#'


def intersect_filters(a: str, b: str) -> str | None:
    """The filter matching exactly the topics both ``a`` and ``b`` match, or None if there are none.

    Filters are canonical over an unbounded alphabet of levels, so ``covers(p, f)`` is
    ``intersect_filters(p, f) == f``."""
    la, lb = a.split("/"), b.split("/")
    ha, hb = la[-1] == "#", lb[-1] == "#"
    if ha:
        la.pop()
    if hb:
        lb.pop()
    out: list[str] = []
    for i in range(max(len(la), len(lb))):
        x = la[i] if i < len(la) else (_ANY if ha else _END)
        y = lb[i] if i < len(lb) else (_ANY if hb else _END)
        if x is _END or y is _END:
            # One filter's topics end here: the other must allow ending here ('#' matches its parent).
            if x in (_END, _ANY) and y in (_END, _ANY):
                return "/".join(out)
            return None
        x_wild, y_wild = x in ("+", _ANY), y in ("+", _ANY)
        if x_wild and y_wild:
            out.append("+")
        elif x_wild or y_wild:
            literal = y if x_wild else x
            if i == 0 and literal.startswith("$"):
                return None  # a leading wildcard never matches a $-topic (MQTT-4.7.2-1)
            out.append(literal)
        elif x == y:
            out.append(x)
        else:
            return None
    if ha and hb:
        out.append("#")
    return "/".join(out)


def filter_covered(pattern: str, topic_filter: str) -> bool:
    """True when every topic ``topic_filter`` can match is also matched by ``pattern``."""
    return intersect_filters(pattern, topic_filter) == topic_filter


def filters_overlap(a: str, b: str) -> bool:
    return intersect_filters(a, b) is not None


# --- principals, logins, rate limits --------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Principal:
    username: str | None
    client_id: str
    # The username was proven (password file, certificate, token); an unproven one is a label only
    # (module docstring): it carries no user's rights.
    proven: bool = True

    @property
    def rights_name(self) -> str | None:
        """The username ACL rules and the admin role see: None for an unproven one."""
        return self.username if self.proven else None


class Login(enum.Enum):
    OK = "ok"
    BAD_CREDENTIALS = "bad credentials"
    RATE_LIMITED = "too many failed logins from this address"


class FailedLoginLimiter:
    """A token bucket per source address: ``burst`` failures, refilled at ``burst / window_s`` a
    second. A login being verified holds a token (given back if it succeeds), so one address never
    has more than ``burst`` hashes queued or running. At most ``max_addresses`` are tracked; the
    least recently seen is forgotten first."""

    def __init__(self, burst: int, window_s: float, max_addresses: int, clock: Callable[[], float]) -> None:
        self.burst = float(burst)
        self.rate = burst / window_s
        self.max_addresses = max_addresses
        self.clock = clock
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()  # address -> [tokens, as of]

    def _tokens(self, address: str, now: float) -> float:
        b = self._buckets.get(address)
        if b is None:
            return self.burst
        return min(self.burst, b[0] + (now - b[1]) * self.rate)

    def blocked(self, address: str) -> bool:
        return self._tokens(address, self.clock()) < 1.0

    def take(self, address: str) -> bool:
        """Use one token; False (and nothing used) when the address has none left."""
        now = self.clock()
        tokens = self._tokens(address, now)
        if tokens < 1.0:
            return False
        if address not in self._buckets and len(self._buckets) >= self.max_addresses:
            self._buckets.popitem(last=False)
        self._buckets[address] = [tokens - 1.0, now]
        self._buckets.move_to_end(address)
        return True

    def give_back(self, address: str) -> None:
        b = self._buckets.get(address)
        if b is not None:
            b[0] = min(self.burst, b[0] + 1.0)


class _Unlimited:
    """The limiter of exempt (loopback) addresses."""

    def blocked(self, address: str) -> bool:
        return False

    def take(self, address: str) -> bool:
        return True

    def give_back(self, address: str) -> None:
        pass


_UNLIMITED = _Unlimited()


def is_loopback_address(host: str) -> bool:
    """A peer on this machine (also an IPv4-mapped IPv6 one): a TLS terminator or bridge forwarding
    many clients, or a test, is not one attacker; ``auth.limit_loopback_logins`` limits them too."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


# --- ACL rules, compiled per principal ------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Rule:
    pattern: str  # substituted
    allow: bool
    grants_dollar: bool  # the configured pattern itself begins with '$'


@dataclass(slots=True)
class _PrincipalAcl:
    publish: tuple[_Rule, ...]
    read: tuple[_Rule, ...]
    publish_cache: dict[str, bool] = field(default_factory=dict)
    read_cache: dict[str, bool] = field(default_factory=dict)


_PLACEHOLDER = re.compile("%[uc]")


class _Void(Exception):
    pass


def substitute(pattern: str, who: Principal) -> str | None:
    """``pattern`` with ``%u`` / ``%c`` replaced in one pass (a username ``%c`` stays literal), or
    None when a value would not be one literal level, or would move the pattern into ``$``."""
    if "%" not in pattern:
        return pattern

    def value(m: re.Match[str]) -> str:
        v = who.username if m.group() == "%u" else who.client_id
        if not v or "/" in v or "+" in v or "#" in v:
            raise _Void
        return v

    try:
        out = _PLACEHOLDER.sub(value, pattern)
    except _Void:
        return None
    if out.startswith("$") and not pattern.startswith("$"):
        return None
    return out


def is_reserved_topic(topic: str) -> bool:
    """``$SYS`` belongs to the broker: no client publishes there, whatever the ACL says."""
    return topic.startswith("$SYS") and (len(topic) == 4 or topic[4] == "/")


def identities_proven(auth: AuthConfig, certificate_identities: bool) -> bool:
    """Does this node prove who a user is (a password file, client certificates as logins, or bearer
    tokens)? Then sessions belong to their user: ``auth.session_takeover_across_users`` defaults to
    off (node.py), so one user never takes over another's session by client id."""
    return bool(auth.password_file or auth.token_file or certificate_identities)


class Authorizer:
    def __init__(self, cfg: AuthConfig, loopback_only: bool, clock: Callable[[], float] = time.monotonic,
                 certificate_identities: bool = False) -> None:
        self.cfg = cfg
        self.allow_anonymous = cfg.allow_anonymous if cfg.allow_anonymous is not None else loopback_only
        self.users: dict[str, str] = {}
        self.tokens: dict[str, str] = {}
        self.dummy_hash = ""
        self._file_stamps: dict[str, tuple[int, int, int] | None] = {}
        self.reloads = 0
        self._load_credentials()
        self.proves_identities = identities_proven(cfg, certificate_identities)
        self.admin_users = frozenset(cfg.admin_users)
        self.rules: list[AclRule] = list(cfg.acl)
        for rule in self.rules:
            bare = _PLACEHOLDER.sub("x", rule.pattern)
            if not validate_topic_filter(bare) or bare.startswith("$share/"):
                raise ConfigError(f"acl pattern {rule.pattern!r} is not a valid topic filter")
        self._acl_cache_entries = cfg.acl_cache_entries
        self._principals: dict[Principal, _PrincipalAcl] = {}
        self._cached = 0
        self._limit_loopback = cfg.limit_loopback_logins
        self.limiter = FailedLoginLimiter(cfg.max_failed_logins, cfg.failed_login_window_s, cfg.login_rate_addresses,
                                          clock)
        self._max_parallel = cfg.max_parallel_hashes
        self._hash_slots: asyncio.Semaphore | None = None  # made on the loop that first needs it
        self._executor: ThreadPoolExecutor | None = None
        self._verified: OrderedDict[bytes, None] = OrderedDict()  # keyed hashes of (user, password) that passed
        self._verified_max = cfg.login_cache_entries
        self._cache_key = os.urandom(32)  # per process: the cache never holds anything a password could be read from
        self.hashes_run = 0  # password verifications started (known and unknown users alike)
        self.refused: dict[str, int] = {}  # refused logins by Login.name (metrics)

    # --- credentials files, reloaded -----------------------------------------------------------
    @staticmethod
    def _stamp(path: str) -> tuple[int, int, int] | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _load_credentials(self) -> None:
        """Read the password and token files (ConfigError, nothing changed, when one does not parse)."""
        cfg = self.cfg
        stamps = {f: self._stamp(f) for f in (cfg.password_file, cfg.token_file) if f}
        users = read_password_file(Path(cfg.password_file)) if cfg.password_file else {}
        tokens = read_token_file(Path(cfg.token_file)) if cfg.token_file else {}
        # Unknown users are checked against this, with the parameters the real hashes use.
        dummy = dummy_hash_like(next(iter(users.values()))) if users else ""
        self.users, self.tokens, self.dummy_hash = users, tokens, dummy
        self._verified = OrderedDict()  # a changed or removed password no longer logs in from the cache
        self._file_stamps = stamps

    def credentials_changed(self) -> bool:
        return any(self._stamp(f) != stamp for f, stamp in self._file_stamps.items())

    def reload(self, why: str) -> bool:
        """Read the password and token files again (SIGHUP, or a change seen by ``watch_credentials``).
        A file that does not parse keeps the previous users and tokens and is logged; True when read."""
        try:
            self._load_credentials()
        except ConfigError as exc:
            # Not read again until it changes once more (a bad file is logged once, not every poll).
            self._file_stamps = {f: self._stamp(f) for f in self._file_stamps}
            log.error("%s: password/token files not reloaded, the previous ones stay in use: %s", why, exc)
            return False
        self.reloads += 1
        log.info("%s: password/token files reloaded (%d users, %d tokens)", why, len(self.users), len(self.tokens))
        return True

    async def watch_credentials(self, interval_s: float) -> None:
        """Reload the password and token files when one changes (checked every ``interval_s``)."""
        while True:
            await asyncio.sleep(interval_s)
            if self._file_stamps and self.credentials_changed():
                self.reload("file changed")

    def _limiter_for(self, peer_host: str) -> FailedLoginLimiter | _Unlimited:
        if self._limit_loopback or not is_loopback_address(peer_host):
            return self.limiter
        return _UNLIMITED

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # --- authentication -----------------------------------------------------------------------
    async def authenticate(self, username: str | None, password: bytes | None, peer_host: str,
                           still_wanted: Callable[[], bool] | None = None) -> Login:
        """Check a login (MQTT CONNECT or HTTP Basic). scrypt runs on a thread, bounded; a source
        address past its failed-login budget is refused without any check. ``still_wanted`` is asked
        once a hashing slot is free, so a client that went away costs no hash."""
        return (await self.login(username, password, peer_host, still_wanted))[0]

    async def login(self, username: str | None, password: bytes | None, peer_host: str,
                    still_wanted: Callable[[], bool] | None = None) -> tuple[Login, bool]:
        """``authenticate``, and whether the username is proven (checked against the password file)."""
        login, proven = await self._authenticate(username, password, peer_host, still_wanted)
        if login is not Login.OK:
            self.refused[login.name] = self.refused.get(login.name, 0) + 1
        return login, proven

    async def _authenticate(self, username: str | None, password: bytes | None, peer_host: str,
                            still_wanted: Callable[[], bool] | None) -> tuple[Login, bool]:
        # Accepted without checking any secret: nothing to guess, so never rate-limited. Without a
        # password file a username (with or without a password) is a label, not a proven identity.
        anonymous = username is None or not self.users
        if anonymous and self.allow_anonymous:
            return Login.OK, False
        limiter = self._limiter_for(peer_host)
        if limiter.blocked(peer_host):
            return Login.RATE_LIMITED, False
        users = self.users
        encoded = users.get(username) if username is not None else None
        if username is None or (encoded is None and not users):
            # Anonymous where it is not allowed, or a password without a password file to check it.
            limiter.take(peer_host)
            return Login.BAD_CREDENTIALS, False
        key = None
        if encoded is not None and password is not None and self._verified_max:
            key = hmac.new(self._cache_key, username.encode() + b"\x00" + password, hashlib.sha256).digest()
            if key in self._verified:
                self._verified.move_to_end(key)
                return Login.OK, True
        if not limiter.take(peer_host):
            return Login.RATE_LIMITED, False
        verified = await self._verify(password if password is not None else b"", encoded or self.dummy_hash,
                                      still_wanted)
        if verified is None:  # the client went away before its turn: nothing was checked
            limiter.give_back(peer_host)
            return Login.BAD_CREDENTIALS, False
        if not (verified and encoded is not None and password is not None):
            return Login.BAD_CREDENTIALS, False
        if self.users.get(username) != encoded:  # the file was reloaded while hashing: that hash is gone
            return Login.BAD_CREDENTIALS, False
        limiter.give_back(peer_host)
        if key is not None:
            self._verified[key] = None
            if len(self._verified) > self._verified_max:
                self._verified.popitem(last=False)
        return Login.OK, True

    async def _verify(self, password: bytes, encoded: str, still_wanted: Callable[[], bool] | None) -> bool | None:
        if self._hash_slots is None:
            self._hash_slots = asyncio.Semaphore(self._max_parallel)
        async with self._hash_slots:
            if still_wanted is not None and not still_wanted():
                return None
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._max_parallel, thread_name_prefix="moorline-scrypt")
            self.hashes_run += 1
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, verify_password, password, encoded)

    def authenticate_token(self, token: str, peer_host: str) -> tuple[Login, str | None]:
        """An HTTP bearer token: ``(Login.OK, user)`` or a refusal. Cheap (one sha256); a wrong token
        uses up the address's failed-login budget like a wrong password."""
        user = None
        limiter = self._limiter_for(peer_host)
        if limiter.blocked(peer_host):
            login = Login.RATE_LIMITED
        else:
            user = self.tokens.get(hash_token(token))
            login = Login.OK if user is not None else Login.BAD_CREDENTIALS
            if user is None:
                limiter.take(peer_host)
        if login is not Login.OK:
            self.refused[login.name] = self.refused.get(login.name, 0) + 1
        return login, user

    async def connack_refusal(self, username: str | None, password: bytes | None, peer_host: str, v5: bool,
                              still_wanted: Callable[[], bool] | None = None) -> int | None:
        return (await self.connect_login(username, password, peer_host, v5, still_wanted))[0]

    async def connect_login(self, username: str | None, password: bytes | None, peer_host: str, v5: bool,
                            still_wanted: Callable[[], bool] | None = None) -> tuple[int | None, bool]:
        """The CONNACK reason code refusing this login (None to accept it), and whether the username
        is proven. v5: 0x86 bad user name or password, 0x87 not authorized (anonymous), 0x9F
        connection rate exceeded; 3.1.1 has no rate code, so a rate-limited login gets 0x87 there
        (return code 5, not authorized)."""
        login, proven = await self.login(username, password, peer_host, still_wanted)
        if login is Login.OK:
            return None, proven
        if login is Login.RATE_LIMITED:
            return (RC.CONNECTION_RATE_EXCEEDED if v5 else RC.NOT_AUTHORIZED), False
        return (RC.BAD_USERNAME_OR_PASSWORD if username is not None else RC.NOT_AUTHORIZED), False

    def owner_name(self, who: Principal) -> str:
        """The name sessions belong to and publishes are de-duplicated under: the username; for an
        unproven one on a node that proves identities, "" (the anonymous principal's), so a claimed
        name never reaches the proven user's sessions or de-duplication keys."""
        if who.username is None or (not who.proven and self.proves_identities):
            return ""
        return who.username

    def is_admin(self, who: Principal) -> bool:
        name = who.rights_name
        return name is not None and name in self.admin_users

    # --- ACLs ---------------------------------------------------------------------------------
    def _acl(self, who: Principal) -> _PrincipalAcl:
        acl = self._principals.get(who)
        if acl is None:
            publish: list[_Rule] = []
            read: list[_Rule] = []
            rights = who if who.proven else Principal(None, who.client_id)  # an unproven name is no user's
            for r in self.rules:
                if r.user is not None and r.user != rights.username:
                    continue
                if r.client_id is not None and r.client_id != who.client_id:
                    continue
                pattern = substitute(r.pattern, rights)
                if pattern is None:
                    continue  # void for this principal: matches nothing, allows and denies nothing
                rule = _Rule(pattern, r.allow, r.pattern.startswith("$"))
                if r.action in ("publish", "all"):
                    publish.append(rule)
                if r.action in ("subscribe", "all"):
                    read.append(rule)
            acl = _PrincipalAcl(tuple(publish), tuple(read))
            self._count_cached()
            self._principals[who] = acl
        return acl

    def _count_cached(self) -> None:
        self._cached += 1
        if self._cached > self._acl_cache_entries:
            self._principals.clear()  # callers holding an entry keep a valid one; it just is not shared
            self._cached = 1

    def can_publish(self, who: Principal, topic: str) -> bool:
        if not self.rules:
            return topic[:1] != "$"
        acl = self._acl(who)
        cached = acl.publish_cache.get(topic)
        if cached is not None:
            return cached
        allowed = False
        if not is_reserved_topic(topic):
            dollar = topic[:1] == "$"
            for rule in acl.publish:
                if matches(rule.pattern, topic):
                    allowed = rule.allow and (not dollar or rule.grants_dollar)
                    break
        self._count_cached()
        acl.publish_cache[topic] = allowed
        return allowed

    def can_read(self, who: Principal, topic: str) -> bool:
        """May a message on ``topic`` be delivered to (or fetched by) ``who``: the first matching
        subscribe rule decides; with rules present, no match denies."""
        if not self.rules:
            return True
        acl = self._acl(who)
        cached = acl.read_cache.get(topic)
        if cached is not None:
            return cached
        allowed = False
        for rule in acl.read:
            if matches(rule.pattern, topic):
                allowed = rule.allow
                break
        self._count_cached()
        acl.read_cache[topic] = allowed
        return allowed

    def can_subscribe(self, who: Principal, topic_filter: str) -> bool:
        """False only when no topic the filter can match is readable: the filter lies inside a
        denying pattern that no earlier allowing rule overlaps, or every allowing rule's overlap with
        it lies inside an earlier denying pattern (or there is none). A wildcard filter that reaches
        denied and readable topics alike is granted; delivery filters it (``read_check_needed``)."""
        if not self.rules:
            return True
        if not is_wildcard(topic_filter):
            return self.can_read(who, topic_filter)
        denies: list[str] = []
        for rule in self._acl(who).read:
            if rule.allow:
                part = intersect_filters(rule.pattern, topic_filter)
                if part is not None and not any(filter_covered(d, part) for d in denies):
                    return True
            else:
                if filter_covered(rule.pattern, topic_filter):
                    return False
                denies.append(rule.pattern)
        return False

    def read_check_needed(self, who: Principal, topic_filter: str) -> bool:
        """False when every topic the filter can match is readable, so delivery can skip ``can_read``
        (always so without rules); True when some may not be."""
        if not self.rules:
            return False
        allows: list[str] = []
        for rule in self._acl(who).read:
            if rule.allow:
                if filter_covered(rule.pattern, topic_filter):
                    return False
                allows.append(rule.pattern)
            else:
                part = intersect_filters(rule.pattern, topic_filter)
                if part is not None and not any(filter_covered(a, part) for a in allows):
                    return True
        return True
