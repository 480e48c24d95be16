"""The per-address connection rate limiter of the MQTT listener (listeners.max_connection_rate_per_address)."""

from __future__ import annotations

from moorline.node.edge.server import ConnectionRateLimiter, rate_key


def test_burst_then_the_rate() -> None:
    limiter = ConnectionRateLimiter(rate=2.0, burst=3, max_addresses=10)
    assert [limiter.allow("10.0.0.1", 0.0) for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("10.0.0.2", 0.0)  # another address has its own bucket
    assert not limiter.allow("10.0.0.1", 0.4)  # 0.8 of a token back
    assert limiter.allow("10.0.0.1", 0.6)  # a refused attempt took nothing: 1.2 tokens by now
    assert not limiter.allow("10.0.0.1", 0.6)
    assert [limiter.allow("10.0.0.1", 100.0) for _ in range(4)] == [True, True, True, False]  # never above burst


def test_the_table_is_bounded_and_forgets_the_least_recently_seen() -> None:
    limiter = ConnectionRateLimiter(rate=1.0, burst=1, max_addresses=3)
    for host in ("a", "b", "c"):
        assert limiter.allow(host, 0.0)
    assert not limiter.allow("a", 0.0)  # "a" is now the most recently seen
    assert limiter.allow("d", 0.0)  # "b" goes
    assert len(limiter) == 3
    assert limiter.allow("b", 0.0)  # forgotten: a full bucket again ("c" goes)
    assert not limiter.allow("a", 0.0) and not limiter.allow("d", 0.0)


def test_ipv6_is_counted_per_64() -> None:
    assert rate_key("2001:db8:1:2:aaaa::1") == rate_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::"
    assert rate_key("2001:db8:1:3::1") != rate_key("2001:db8:1:2::1")
    assert rate_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert rate_key("192.0.2.7") == "192.0.2.7"
    assert rate_key("not-an-ip") == "not-an-ip"
