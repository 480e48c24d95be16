"""Credentials at rest: password hashes and the password and token files.

Password file lines: ``user:scrypt$N$r$p$<salt hex>$<hash hex>`` (``moorline passwd``), or a
Mosquitto password file's lines (``mosquitto_passwd``: ``user:$7$<iterations>$<salt b64>$<hash b64>``,
PBKDF2-HMAC-SHA512, and the older ``user:$6$<salt b64>$<hash b64>``, one SHA-512 of password + salt);
token file lines: ``user:sha256$<hex of sha256(token)>`` (``moorline token``). Plain-text secrets are
never stored; files are written 0600, created exclusively, never through a symlink. Pure functions
and file IO only: who may log in and what they may do is ``auth.Authorizer``'s.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

from moorline.config import ConfigError

log = logging.getLogger("moorline.auth")
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 1 << 14, 8, 1
_MAX_SCRYPT_N = 1 << 20  # a password file asking for more would let one login take seconds and GiBs


# --- passwords and tokens -------------------------------------------------------------------------

def hash_password(password: str | bytes, salt: bytes | None = None, n: int = _SCRYPT_N, r: int = _SCRYPT_R,
                  p: int = _SCRYPT_P) -> str:
    secret = password.encode() if isinstance(password, str) else password
    salt = salt if salt is not None else os.urandom(16)
    digest = hashlib.scrypt(secret, salt=salt, n=n, r=r, p=p, dklen=32, maxmem=_maxmem(n, r))
    return f"scrypt${n}${r}${p}${salt.hex()}${digest.hex()}"


def _maxmem(n: int, r: int) -> int:
    return 128 * r * n + (1 << 20)  # OpenSSL's default limit (32 MiB) refuses N > 2**14 at r = 8


def parse_scrypt(encoded: str) -> tuple[int, int, int, bytes, bytes]:
    """``(N, r, p, salt, digest)`` of an encoded hash; ValueError when it is not one."""
    scheme, n, r, p, salt_hex, hash_hex = encoded.split("$")
    if scheme != "scrypt":
        raise ValueError(f"unknown scheme {scheme!r}")
    ni, ri, pi = int(n), int(r), int(p)
    if ni < 2 or ni & (ni - 1) or ni > _MAX_SCRYPT_N or not 1 <= ri <= 64 or not 1 <= pi <= 16:
        raise ValueError("scrypt parameters out of range")
    salt, digest = bytes.fromhex(salt_hex), bytes.fromhex(hash_hex)
    if not 16 <= len(digest) <= 64:
        raise ValueError("hash length out of range")
    return ni, ri, pi, salt, digest


_MAX_PBKDF2_ITERATIONS = 10_000_000  # as _MAX_SCRYPT_N: no file line may make one login take minutes


def parse_mosquitto(encoded: str) -> tuple[str, int, bytes, bytes]:
    """``(scheme, iterations, salt, digest)`` of a ``mosquitto_passwd`` hash: ``$7$`` (PBKDF2-HMAC-SHA512)
    or ``$6$`` (SHA-512 of password + salt, iterations 1); ValueError when it is not one."""
    parts = encoded.split("$")
    try:
        if len(parts) == 5 and parts[0] == "" and parts[1] == "7":
            iterations = int(parts[2])
            salt, digest = base64.b64decode(parts[3], validate=True), base64.b64decode(parts[4], validate=True)
            if not 1 <= iterations <= _MAX_PBKDF2_ITERATIONS:
                raise ValueError("PBKDF2 iterations out of range")
            scheme = "7"
        elif len(parts) == 4 and parts[0] == "" and parts[1] == "6":
            iterations = 1
            salt, digest = base64.b64decode(parts[2], validate=True), base64.b64decode(parts[3], validate=True)
            scheme = "6"
        else:
            raise ValueError("not a mosquitto_passwd hash ($7$ or $6$)")
    except binascii.Error as exc:
        raise ValueError(f"bad base64: {exc}") from exc
    if len(digest) != 64 or not salt:
        raise ValueError("a SHA-512 hash is 64 bytes and the salt is not empty")
    return scheme, iterations, salt, digest


def parse_password_hash(encoded: str) -> None:
    """ValueError unless ``encoded`` is one of the accepted hashes (scrypt, mosquitto's $7$ or $6$)."""
    if encoded.startswith("$"):
        parse_mosquitto(encoded)
    else:
        parse_scrypt(encoded)


def verify_password(password: str | bytes, encoded: str) -> bool:
    """scrypt or PBKDF2: call it off the event loop (``Authorizer.authenticate`` does)."""
    secret = password.encode() if isinstance(password, str) else password
    try:
        if encoded.startswith("$"):
            scheme, iterations, msalt, mdigest = parse_mosquitto(encoded)
            if scheme == "7":
                mgot = hashlib.pbkdf2_hmac("sha512", secret, msalt, iterations, len(mdigest))
            else:
                mgot = hashlib.sha512(secret + msalt).digest()
            return hmac.compare_digest(mgot, mdigest)
        n, r, p, salt, digest = parse_scrypt(encoded)
    except ValueError:
        return False
    got = hashlib.scrypt(secret, salt=salt, n=n, r=r, p=p, dklen=len(digest), maxmem=_maxmem(n, r))
    return hmac.compare_digest(got, digest)


def dummy_hash_like(encoded: str) -> str:
    """A hash of a random password with the cost ``encoded`` has: unknown users are checked against
    it, so how long a login takes does not tell whether the user exists."""
    secret = os.urandom(16)
    if encoded.startswith("$"):
        scheme, iterations, salt, _ = parse_mosquitto(encoded)
        if scheme == "7":
            digest = hashlib.pbkdf2_hmac("sha512", secret, salt, iterations, 64)
            return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"
        digest = hashlib.sha512(secret + salt).digest()
        return f"$6${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"
    n, r, p = parse_scrypt(encoded)[:3]
    return hash_password(secret, n=n, r=r, p=p)


def _read_lines(path: Path, what: str) -> list[tuple[int, str, str]]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from exc
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            user, sep, encoded = line.partition(":")
            out.append((lineno, user if sep else "", encoded))
    return out


def read_password_file(path: Path) -> dict[str, str]:
    users: dict[str, str] = {}
    for lineno, user, encoded in _read_lines(path, "password file"):
        try:
            if not user:
                raise ValueError("no user")
            parse_password_hash(encoded)
        except ValueError as exc:
            raise ConfigError(f"{path}:{lineno}: expected 'user:scrypt$N$r$p$salt$hash' (use 'moorline passwd') "
                              f"or a mosquitto_passwd line ('user:$7$...' or 'user:$6$...'): {exc}") from exc
        users[user] = encoded
    return users


def _write_secret_file(path: Path, entries: dict[str, str]) -> None:
    """Replace ``path`` atomically. The temporary file is created with mode 0600 from the start and
    ``O_EXCL | O_NOFOLLOW`` under a random name: a file or symlink planted at a predictable name
    cannot receive the secrets, and no other user can read them while they are written."""
    data = "".join(f"{u}:{h}\n" for u, h in sorted(entries.items())).encode()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(16):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(f"cannot write {path}: {exc}") from exc
        break
    else:  # pragma: no cover - 16 random names all taken
        raise ConfigError(f"cannot create a temporary file beside {path}")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def set_password(path: Path, user: str, password: str) -> None:
    if not user or ":" in user:
        raise ConfigError("a user name is non-empty and has no ':'")
    users = read_password_file(path) if path.exists() else {}
    users[user] = hash_password(password)
    _write_secret_file(path, users)


def hash_token(token: str) -> str:
    # Tokens are 256 random bits, so one fast hash is enough: there is nothing to guess.
    return "sha256$" + hashlib.sha256(token.encode()).hexdigest()


def read_token_file(path: Path) -> dict[str, str]:
    """``{token hash: user}``."""
    tokens: dict[str, str] = {}
    for lineno, user, encoded in _read_lines(path, "token file"):
        scheme, _, hexdigest = encoded.partition("$")
        if not user or scheme != "sha256" or len(hexdigest) != 64 or not all(ch in "0123456789abcdef"
                                                                               for ch in hexdigest):
            raise ConfigError(f"{path}:{lineno}: expected 'user:sha256$<64 hex>' (use 'moorline token')")
        tokens[encoded] = user
    return tokens


def new_token(path: Path, user: str) -> str:
    """Give ``user`` a fresh token (replacing an earlier one) and return it: it is stored hashed only."""
    if not user or ":" in user:
        raise ConfigError("a user name is non-empty and has no ':'")
    by_user = {u: h for h, u in read_token_file(path).items()} if path.exists() else {}
    token = secrets.token_urlsafe(32)
    by_user[user] = hash_token(token)
    _write_secret_file(path, by_user)
    return token
