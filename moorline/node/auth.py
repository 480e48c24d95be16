"""Authentication (password file with salted scrypt hashes) and topic ACLs.

Password file lines: ``user:scrypt$N$r$p$<salt hex>$<hash hex>``. Plain-text passwords are
never stored. ACL patterns are topic filters with ``%u`` (username) and ``%c`` (client id)
substituted; the first matching rule decides, and no matching rule means allow only when the
ACL list is empty.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from moorline.config import AclRule, AuthConfig, ConfigError
from moorline.mqtt.topics import matches

_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 1 << 14, 8, 1


def hash_password(password: str, salt: bytes | None = None) -> str:
    salt = salt if salt is not None else os.urandom(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P, dklen=32)
    return f"scrypt${_SCRYPT_N}${_SCRYPT_R}${_SCRYPT_P}${salt.hex()}${digest.hex()}"


def verify_password(password: str, encoded: str) -> bool:
    try:
        scheme, n, r, p, salt_hex, hash_hex = encoded.split("$")
    except ValueError:
        return False
    if scheme != "scrypt":
        return False
    digest = hashlib.scrypt(
        password.encode(), salt=bytes.fromhex(salt_hex), n=int(n), r=int(r), p=int(p), dklen=len(hash_hex) // 2
    )
    return hmac.compare_digest(digest.hex(), hash_hex)


def read_password_file(path: Path) -> dict[str, str]:
    users: dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read password file {path}: {exc}") from exc
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, encoded = line.partition(":")
        if not sep or not encoded.startswith("scrypt$"):
            raise ConfigError(f"{path}:{lineno}: expected 'user:scrypt$...' (use 'moorline passwd')")
        users[user] = encoded
    return users


def set_password(path: Path, user: str, password: str) -> None:
    users = read_password_file(path) if path.exists() else {}
    users[user] = hash_password(password)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(f"{u}:{h}\n" for u, h in sorted(users.items())))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def filter_covered(pattern: str, topic_filter: str) -> bool:
    """True when every topic ``topic_filter`` can match is also matched by ``pattern``."""
    p_levels = pattern.split("/")
    f_levels = topic_filter.split("/")
    for i, p in enumerate(p_levels):
        if p == "#":
            return True
        if i >= len(f_levels):
            return False
        f = f_levels[i]
        if f == "#":
            return False
        if p == "+":
            continue
        if f == "+" or f != p:
            return False
    return len(f_levels) == len(p_levels)


@dataclass(frozen=True, slots=True)
class Principal:
    username: str | None
    client_id: str


class Authorizer:
    def __init__(self, cfg: AuthConfig, loopback_only: bool) -> None:
        self.allow_anonymous = cfg.allow_anonymous if cfg.allow_anonymous is not None else loopback_only
        self.users = read_password_file(Path(cfg.password_file)) if cfg.password_file else {}
        self.rules: list[AclRule] = list(cfg.acl)

    def authenticate(self, username: str | None, password: bytes | None) -> bool:
        if username is None:
            return self.allow_anonymous
        encoded = self.users.get(username)
        if encoded is None:
            # Unknown user: accepted only as anonymous would be, and only without a password.
            return self.allow_anonymous and not self.users and password is None
        if password is None:
            return False
        try:
            return verify_password(password.decode("utf-8"), encoded)
        except UnicodeDecodeError:
            return False

    def _rules_for(self, who: Principal, action: str) -> list[AclRule]:
        out = []
        for r in self.rules:
            if r.action not in (action, "all"):
                continue
            if r.user is not None and r.user != who.username:
                continue
            if r.client_id is not None and r.client_id != who.client_id:
                continue
            out.append(r)
        return out

    def _subst(self, pattern: str, who: Principal) -> str:
        return pattern.replace("%u", who.username or "").replace("%c", who.client_id)

    def can_publish(self, who: Principal, topic: str) -> bool:
        if not self.rules:
            return True
        for r in self._rules_for(who, "publish"):
            if matches(self._subst(r.pattern, who), topic):
                return r.allow
        return False

    def can_subscribe(self, who: Principal, topic_filter: str) -> bool:
        if not self.rules:
            return True
        for r in self._rules_for(who, "subscribe"):
            pat = self._subst(r.pattern, who)
            if r.allow and filter_covered(pat, topic_filter):
                return True
            if not r.allow and (filter_covered(topic_filter, pat) or filter_covered(pat, topic_filter)):
                return False
        return False
