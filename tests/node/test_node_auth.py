"""The Authorizer: ACLs that cannot be dodged (wildcards, literal %u / %c, first match, the $ rule),
logins off the event loop, no user enumeration by timing, failed-login rate limits, bearer tokens,
and the refusal of an open HTTP listener off loopback."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moorline.node.edge.auth as auth
import moorline.node.edge.credentials as credentials
from moorline.config import AclRule, AuthConfig, ConfigError, NodeConfig
from moorline.mqtt.topics import matches
from moorline.node.edge.auth import Authorizer, Login, Principal, intersect_filters

pytestmark = pytest.mark.timeout(120)

ALICE = Principal("alice", "alice-phone")


def acl(*rules: tuple[str, str, bool], **cfg: object) -> Authorizer:
    """Rules as (action, pattern, allow)."""
    return Authorizer(AuthConfig(acl=[AclRule(a, p, allow) for a, p, allow in rules], **cfg),  # type: ignore[arg-type]
                      loopback_only=True)


# --- ACLs ----------------------------------------------------------------------------------------

def test_wildcards_that_dodged_a_deny_are_granted_and_filtered_per_topic() -> None:
    a = acl(("subscribe", "secret/#", False), ("subscribe", "#", True))
    for flt in ("+/x", "+/+", "+", "#", "+/#"):
        assert a.can_subscribe(ALICE, flt), flt  # also reaches readable topics: granted ...
        assert a.read_check_needed(ALICE, flt), flt  # ... and every message is checked at delivery
    for topic in ("secret", "secret/x", "secret/x/y"):
        assert not a.can_read(ALICE, topic), topic
    for topic in ("public/x", "x", "a/b/c"):
        assert a.can_read(ALICE, topic), topic
    for flt in ("secret/#", "secret/+", "secret/x", "secret/+/y"):
        assert not a.can_subscribe(ALICE, flt), flt  # wholly inside the deny
    assert not a.read_check_needed(ALICE, "public/#") and a.can_subscribe(ALICE, "public/#")


def test_no_allow_rule_overlapping_the_filter_refuses_it() -> None:
    a = acl(("subscribe", "public/#", True), ("subscribe", "test/nosubscribe", False), ("subscribe", "test/#", True))
    assert not a.can_subscribe(ALICE, "private/+")
    assert not a.can_subscribe(ALICE, "test/nosubscribe")  # the Paho suite's refused topic
    assert a.can_subscribe(ALICE, "test/+") and a.read_check_needed(ALICE, "test/+")
    assert a.can_subscribe(ALICE, "#") and a.read_check_needed(ALICE, "#")
    assert not a.read_check_needed(ALICE, "public/+/x")


def test_first_matching_rule_decides() -> None:
    a = acl(("subscribe", "secret/public", True), ("subscribe", "secret/#", False), ("all", "#", True))
    assert a.can_read(ALICE, "secret/public")
    assert not a.can_read(ALICE, "secret/x")
    assert a.can_read(ALICE, "other")
    assert a.can_subscribe(ALICE, "secret/+") and a.read_check_needed(ALICE, "secret/+")
    assert not a.can_subscribe(ALICE, "secret/x/#")  # inside the deny, and the earlier allow is not in it
    # The same rules in the other order: the deny comes first, so secret/public is denied too.
    b = acl(("subscribe", "secret/#", False), ("subscribe", "secret/public", True), ("all", "#", True))
    assert not b.can_read(ALICE, "secret/public")
    assert not b.can_subscribe(ALICE, "secret/public") and not b.can_subscribe(ALICE, "secret/+")
    # publish rules are separate: "all" counts for both
    assert a.can_publish(ALICE, "secret/x") and not acl(("subscribe", "#", True)).can_publish(ALICE, "x")


def test_an_allow_shadowed_by_an_earlier_deny_grants_nothing() -> None:
    a = acl(("subscribe", "a/+/x", False), ("subscribe", "+/b/x", True))
    assert not a.can_subscribe(ALICE, "a/b/+")  # its one readable candidate, a/b/x, is denied first
    assert a.can_subscribe(ALICE, "+/b/+")  # c/b/x is readable


@pytest.mark.parametrize("client_id", ["+", "#", "a/b", "", "+/#"])
def test_substituted_client_ids_are_literal_and_never_wildcards(client_id: str) -> None:
    a = acl(("all", "c/%c/#", True))
    who = Principal("u", client_id)
    assert not a.can_publish(who, "c/x/y") and not a.can_publish(who, "c/a/b/y")
    assert not a.can_read(who, "c/x/y") and not a.can_read(who, "c/a/b")
    assert not a.can_subscribe(who, "c/+/#") and not a.can_subscribe(who, "#")
    assert not a.can_subscribe(who, f"c/{client_id}/#" if client_id in ("+", "#", "a/b") else "c/x")
    # a plain id keeps its own subtree, and only that
    me = Principal("u", "dev1")
    assert a.can_publish(me, "c/dev1/t") and a.can_read(me, "c/dev1") and not a.can_read(me, "c/dev2/t")
    assert a.can_subscribe(me, "c/dev1/#") and not a.read_check_needed(me, "c/dev1/+")
    assert a.can_subscribe(me, "c/+/t") and a.read_check_needed(me, "c/+/t")  # reaches c/dev1/t, filtered


def test_a_void_deny_denies_nothing_but_widens_nothing_either() -> None:
    a = acl(("publish", "c/%c/#", False), ("publish", "c/#", True))
    assert not a.can_publish(Principal("u", "dev1"), "c/dev1/t")
    assert a.can_publish(Principal("u", "dev1"), "c/dev2/t")
    # client id "+" would have turned the deny into c/+/# and denied everyone's subtrees: it is void
    assert a.can_publish(Principal("u", "+"), "c/dev2/t")


def test_substitution_is_one_pass_and_never_reaches_dollar_topics() -> None:
    a = acl(("all", "u/%u", True), ("subscribe", "%u/#", True))
    tricky = Principal("%c", "x")
    assert a.can_publish(tricky, "u/%c") and not a.can_publish(tricky, "u/x")
    assert not a.can_read(Principal("$SYS", "c"), "$SYS/broker/clients")
    assert a.can_read(Principal("bob", "c"), "bob/x")
    assert not a.can_read(Principal(None, "c"), "u/") and not a.can_read(Principal(None, "c"), "/x")


def test_dollar_topics_need_an_explicit_dollar_grant_and_sys_is_the_brokers() -> None:
    none = acl()
    assert none.can_publish(ALICE, "a/b") and not none.can_publish(ALICE, "$foo/x")
    assert not none.can_publish(ALICE, "$SYS/x") and not none.can_publish(ALICE, "$SYS")
    assert none.can_read(ALICE, "$SYS/x") and not none.read_check_needed(ALICE, "#")
    a = acl(("publish", "#", True), ("publish", "+/#", True), ("publish", "$dev/#", True), ("publish", "$SYS/#", True),
            ("publish", "$%u/#", True))
    assert a.can_publish(ALICE, "x/y")
    assert not a.can_publish(ALICE, "$foo/x")  # no leading wildcard matches a $-topic
    assert a.can_publish(ALICE, "$dev/x")
    assert not a.can_publish(ALICE, "$SYS/x") and not a.can_publish(ALICE, "$SYS")  # whatever the ACL says
    assert a.can_publish(ALICE, "$SYSTEM/x") is False and a.can_publish(ALICE, "$alice/x")


def test_invalid_patterns_are_a_config_error() -> None:
    for bad in ("a/#/b", "a+", "", "$share/g/x"):
        with pytest.raises(ConfigError):
            acl(("all", bad, True))


def test_decision_caches_stay_bounded_and_right() -> None:
    a = acl(("subscribe", "x/#", False), ("all", "#", True), acl_cache_entries=50)
    for i in range(500):
        who = Principal(f"u{i % 7}", "c")
        assert a.can_read(who, f"t/{i}") and not a.can_read(who, f"x/{i}")
        assert a.can_publish(who, f"x/{i}")
        assert a._cached <= 51


# --- the ACL against a dumb reference --------------------------------------------------------------

LEVELS = ["a", "b", "", "$x"]
TOPIC_LEVELS = [*LEVELS, "c"]  # "c" appears in no pattern: it stands for every other level
pattern_level = st.sampled_from([*LEVELS, "+"])


@st.composite
def filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(pattern_level, min_size=1, max_size=3))
    if draw(st.booleans()):
        levels.append("#")
    return "/".join(levels) or "/"  # "" is no filter


def all_topics(max_levels: int = 5) -> list[str]:
    out: list[str] = []
    for n in range(1, max_levels + 1):
        out.extend("/".join(t) for t in itertools.product(TOPIC_LEVELS, repeat=n))
    return out


TOPICS = all_topics()
rules_st = st.lists(st.tuples(st.sampled_from(["publish", "subscribe", "all"]), filters(), st.booleans()),
                    min_size=1, max_size=5)


def reference(rules: list[tuple[str, str, bool]], action: str, topic: str) -> bool:
    for a, pattern, allow in rules:
        if a in (action, "all") and matches(pattern, topic):
            if action == "publish" and topic.startswith("$") and not pattern.startswith("$"):
                return False
            return allow and not (action == "publish" and (topic == "$SYS" or topic.startswith("$SYS/")))
    return False


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rules=rules_st, subscriptions=st.lists(filters(), min_size=1, max_size=6))
def test_acl_agrees_with_a_reference_over_enumerated_topics(rules: list[tuple[str, str, bool]],
                                                            subscriptions: list[str]) -> None:
    a = acl(*rules)
    readable = {t for t in TOPICS if reference(rules, "subscribe", t)}
    for t in TOPICS:
        assert a.can_read(ALICE, t) == (t in readable), t
        assert a.can_publish(ALICE, t) == reference(rules, "publish", t), t
    for flt in subscriptions:
        reached = [t for t in TOPICS if matches(flt, t)]
        if not a.can_subscribe(ALICE, flt):
            assert not [t for t in reached if t in readable], f"{flt} refused, yet it reaches readable topics"
        if not a.read_check_needed(ALICE, flt):
            assert all(t in readable for t in reached), f"{flt} said to need no checks, yet reaches denied topics"
        if "+" not in flt and "#" not in flt:
            assert a.can_subscribe(ALICE, flt) == (flt in readable)


@settings(max_examples=300, deadline=None)
@given(x=filters(), y=filters())
def test_filter_intersection_is_exact(x: str, y: str) -> None:
    both = {t for t in TOPICS if matches(x, t) and matches(y, t)}
    meet = intersect_filters(x, y)
    if meet is None:
        assert not both
    else:
        assert {t for t in TOPICS if matches(meet, t)} == both
    assert auth.filter_covered(x, y) == all(matches(x, t) for t in TOPICS if matches(y, t))


# --- logins -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def password_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "passwd"
    credentials.set_password(path, "alice", "wonderland")
    credentials.set_password(path, "bob", "builder")
    return path


def authorizer(password_file: Path, clock: Callable[[], float] = time.monotonic, **cfg: object) -> Authorizer:
    return Authorizer(AuthConfig(allow_anonymous=False, password_file=str(password_file), **cfg),  # type: ignore[arg-type]
                      loopback_only=True, clock=clock)


def test_logins_hash_off_the_event_loop(password_file: Path) -> None:
    a = authorizer(password_file, login_cache_entries=0, max_failed_logins=100)

    async def body() -> list[int]:
        ticks = 0
        at_completion: list[int] = []

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        async def login(i: int) -> None:
            assert await a.authenticate("alice", b"wonderland" if i % 2 else b"nope", "10.0.0.1") in (
                Login.OK, Login.BAD_CREDENTIALS)
            at_completion.append(ticks)

        t = asyncio.create_task(ticker())
        await asyncio.gather(*(login(i) for i in range(6)))
        t.cancel()
        return at_completion

    at_completion = asyncio.run(body())
    assert a.hashes_run == 6
    # A hash on the loop would let the ticker run only between logins (0 ticks before the first one).
    assert at_completion[0] >= 3, at_completion


def test_hashes_run_at_most_max_parallel_at_a_time(password_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    running = 0
    most = 0
    lock = threading.Lock()

    def slow_verify(password: bytes, encoded: str) -> bool:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.03)
        with lock:
            running -= 1
        return False

    monkeypatch.setattr(auth, "verify_password", slow_verify)
    a = authorizer(password_file, max_parallel_hashes=2, max_failed_logins=100)

    async def body() -> None:
        await asyncio.gather(*(a.authenticate("alice", b"x", f"10.0.0.{i}") for i in range(10)))

    asyncio.run(body())
    assert most == 2 and a.hashes_run == 10


def test_unknown_users_and_missing_passwords_pay_the_same_scrypt(password_file: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    a = authorizer(password_file, max_failed_logins=100)
    calls: list[str] = []
    real = auth.verify_password

    def spy(password: bytes, encoded: str) -> bool:
        calls.append(encoded)
        return real(password, encoded)

    monkeypatch.setattr(auth, "verify_password", spy)
    assert credentials.parse_scrypt(a.dummy_hash)[:3] == credentials.parse_scrypt(a.users["alice"])[:3]  # same N, r, p

    async def body() -> list[Login]:
        return [await a.authenticate("mallory", b"wonderland", "10.0.0.1"),
                await a.authenticate("alice", None, "10.0.0.1"),
                await a.authenticate("alice", b"\xff\xfe", "10.0.0.1"),
                await a.authenticate("alice", b"wonderland", "10.0.0.1")]

    assert asyncio.run(body()) == [Login.BAD_CREDENTIALS] * 3 + [Login.OK]
    assert calls == [a.dummy_hash, a.users["alice"], a.users["alice"], a.users["alice"]]


def test_failed_logins_are_rate_limited_per_address(password_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    a = authorizer(password_file, clock=lambda: now[0], max_failed_logins=3, failed_login_window_s=30.0)

    async def body() -> None:
        for _ in range(3):
            assert await a.authenticate("alice", b"wrong", "10.0.0.1") is Login.BAD_CREDENTIALS
        hashed = a.hashes_run
        # even the right password is not checked now: no hash, no answer to learn from
        assert await a.authenticate("alice", b"wonderland", "10.0.0.1") is Login.RATE_LIMITED
        assert await a.authenticate("mallory", b"x", "10.0.0.1") is Login.RATE_LIMITED
        assert a.hashes_run == hashed
        assert await a.connack_refusal("alice", b"wonderland", "10.0.0.1", v5=True) == 0x9F
        assert await a.connack_refusal("alice", b"wonderland", "10.0.0.1", v5=False) == 0x87  # 3.1.1 code 5
        # another address is not affected
        assert await a.authenticate("alice", b"wonderland", "10.0.0.2") is Login.OK
        assert await a.connack_refusal("bob", b"x", "10.0.0.2", v5=True) == 0x86
        # the bucket refills: one failure's worth after window / max_failed_logins
        now[0] += 10.0
        assert await a.authenticate("alice", b"wonderland", "10.0.0.1") is Login.OK
        assert a.refused["RATE_LIMITED"] == 4 and a.refused["BAD_CREDENTIALS"] == 4

    asyncio.run(body())


def test_loopback_peers_are_not_rate_limited_unless_configured(password_file: Path) -> None:
    async def failures(a: Authorizer, host: str) -> list[Login]:
        return [await a.authenticate("alice", b"wrong", host) for _ in range(4)]

    exempt = authorizer(password_file, max_failed_logins=2)
    for host in ("127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.1"):
        assert asyncio.run(failures(exempt, host)) == [Login.BAD_CREDENTIALS] * 4, host
    limited = authorizer(password_file, max_failed_logins=2, limit_loopback_logins=True)
    assert asyncio.run(failures(limited, "127.0.0.1")) == [Login.BAD_CREDENTIALS] * 2 + [Login.RATE_LIMITED] * 2


def test_logins_without_a_secret_are_never_rate_limited(password_file: Path) -> None:
    anonymous_ok = Authorizer(AuthConfig(max_failed_logins=1), loopback_only=True)

    async def body() -> None:
        # A password without a password file is accepted on an open node (issue 36 item 8), unproven.
        assert await anonymous_ok.login("x", b"a password, but no password file", "10.1.1.1") == (Login.OK, False)
        assert not anonymous_ok.limiter.blocked("10.1.1.1")
        assert await anonymous_ok.authenticate(None, None, "10.1.1.1") is Login.OK  # nothing to guess
        assert await anonymous_ok.authenticate("name-only", None, "10.1.1.1") is Login.OK

    asyncio.run(body())


def test_concurrent_logins_from_one_address_never_queue_more_hashes_than_the_budget(
        password_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def slow_failure(password: bytes, encoded: str) -> bool:
        time.sleep(0.01)
        return False

    monkeypatch.setattr(auth, "verify_password", slow_failure)
    a = authorizer(password_file, max_failed_logins=4)

    async def body() -> list[Login]:
        return list(await asyncio.gather(*(a.authenticate("alice", b"guess", "10.0.0.9") for _ in range(50))))

    results = asyncio.run(body())
    assert results.count(Login.BAD_CREDENTIALS) == 4 and a.hashes_run == 4
    assert results.count(Login.RATE_LIMITED) == 46


def test_verified_logins_are_remembered_bounded(password_file: Path) -> None:
    a = authorizer(password_file, login_cache_entries=1)

    async def body() -> None:
        assert await a.authenticate("alice", b"wonderland", "h") is Login.OK
        assert await a.authenticate("alice", b"wonderland", "h") is Login.OK
        assert a.hashes_run == 1  # the reconnect cost no scrypt
        assert await a.authenticate("alice", b"Wonderland", "h") is Login.BAD_CREDENTIALS  # never a near match
        assert await a.authenticate("bob", b"builder", "h") is Login.OK
        assert await a.authenticate("alice", b"wonderland", "h") is Login.OK
        assert a.hashes_run == 4  # one entry: bob's pushed alice's out
        assert b"wonderland" not in b"".join(a._verified)

    asyncio.run(body())


def test_a_client_gone_before_its_turn_costs_no_hash(password_file: Path) -> None:
    a = authorizer(password_file)

    async def body() -> Login:
        return await a.authenticate("alice", b"wonderland", "h", still_wanted=lambda: False)

    assert asyncio.run(body()) is Login.BAD_CREDENTIALS and a.hashes_run == 0
    assert not a.limiter.blocked("h") and a.limiter._tokens("h", time.monotonic()) == a.limiter.burst


def test_anonymous_logins() -> None:
    open_node = Authorizer(AuthConfig(), loopback_only=True)
    closed = Authorizer(AuthConfig(), loopback_only=False)

    async def body() -> None:
        assert await open_node.authenticate(None, None, "h") is Login.OK
        assert await open_node.authenticate("anyone", None, "h") is Login.OK  # no password file: just a name
        assert await open_node.login("anyone", b"pw", "h") == (Login.OK, False)  # issue 36.8: a name, unproven
        assert await closed.authenticate("anyone", b"pw", "h") is Login.BAD_CREDENTIALS
        assert await closed.authenticate(None, None, "h") is Login.BAD_CREDENTIALS
        assert await closed.connack_refusal(None, None, "h", v5=True) == 0x87

    asyncio.run(body())


def test_bearer_tokens_are_stored_hashed(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    first = credentials.new_token(path, "spark")
    other = credentials.new_token(path, "ops")
    second = credentials.new_token(path, "spark")  # replaces the first
    assert first.encode() not in path.read_bytes() and second.encode() not in path.read_bytes()
    a = Authorizer(AuthConfig(token_file=str(path), admin_users=["spark"]), loopback_only=True)
    assert a.authenticate_token(second, "h") == (Login.OK, "spark")
    assert a.authenticate_token(other, "h") == (Login.OK, "ops")
    assert a.authenticate_token(first, "h") == (Login.BAD_CREDENTIALS, None)
    assert a.is_admin(Principal("spark", "")) and not a.is_admin(Principal("ops", ""))
    assert not a.is_admin(Principal(None, ""))
    path.write_text("spark:deadbeef\n")
    with pytest.raises(ConfigError):
        Authorizer(AuthConfig(token_file=str(path)), loopback_only=True)


def test_password_file_entries_are_checked_when_read(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    for bad in ("alice:scrypt$16384$8$1$zz$00", "alice:scrypt$3$8$1$00$" + "00" * 32, "alice:plain", ":scrypt$1"):
        path.write_text(bad + "\n")
        with pytest.raises(ConfigError):
            credentials.read_password_file(path)


# --- HTTP off loopback ---------------------------------------------------------------------------------

def _cfg(tmp_path: Path, http: str, **auth_cfg: object) -> NodeConfig:
    cfg = NodeConfig(data_dir=str(tmp_path / "data"))
    cfg.listeners.http = http
    cfg.listeners.mqtt = "127.0.0.1:0"
    for k, v in auth_cfg.items():
        setattr(cfg.auth, k, v)
    return cfg


def test_http_off_loopback_without_auth_refuses_to_start(tmp_path: Path, password_file: Path) -> None:
    from moorline.node.edge.server import http_auth_required, serve

    with pytest.raises(ConfigError, match="without authentication"):
        asyncio.run(serve(_cfg(tmp_path, "0.0.0.0:0")))
    assert not (tmp_path / "data").exists(), "something was created before the refusal"
    with pytest.raises(ConfigError, match="allow_anonymous = true"):
        http_auth_required(_cfg(tmp_path, "0.0.0.0:0", allow_anonymous=True, password_file=str(password_file)),
                           "0.0.0.0", False)
    assert http_auth_required(_cfg(tmp_path, "0.0.0.0:0", password_file=str(password_file)), "0.0.0.0", False)
    assert not http_auth_required(_cfg(tmp_path, "127.0.0.1:0"), "127.0.0.1", True)
    assert http_auth_required(_cfg(tmp_path, "127.0.0.1:0", allow_anonymous=False), "127.0.0.1", True)
    # MQTT off loopback, HTTP on it: anonymous clients are not allowed, so HTTP wants credentials too
    assert http_auth_required(_cfg(tmp_path, "127.0.0.1:0"), "127.0.0.1", False)
