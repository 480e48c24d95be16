"""Config values are type-checked when read (issue 20 item 2): the file, MOORLINE_* environment
variables and command-line flags alike; a bad value stops startup with a message naming the key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moorline.config import ConfigError, env_overrides, load_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("text", "message"), [
    ('[auth]\nallow_anonymous = "no"\n', 'auth.allow_anonymous must be true or false, not "no"'),
    ('[mqtt]\npublish_timeout_s = "ten"\n', 'mqtt.publish_timeout_s must be a number, not "ten"'),
    ('[mqtt]\nmax_packet_size = "big"\n', 'mqtt.max_packet_size must be an integer, not "big"'),
    ("[mqtt]\nmax_packet_size = true\n", "mqtt.max_packet_size must be an integer, not true"),
    ("[session]\nmax_queued_messages = 1.5\n", "session.max_queued_messages must be an integer, not 1.5"),
    ("[mqtt]\nmax_pakcet_size = 1\n", "unknown configuration key mqtt.max_pakcet_size (did you mean mqtt.max_packet_size?)"),
    ('mqtt = "x"\n', '[mqtt] must be a table, not "x"'),
    ('[[auth.acl]]\naction = "publish"\n', "auth.acl[0] needs pattern"),
    ('[auth]\nacl = "x"\n', 'auth.acl must be a list, not "x"'),
])
def test_wrong_types_are_refused_with_the_key_named(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(f)
    assert str(exc.value) == message


def test_numbers_widen_and_right_types_pass(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[mqtt]\npublish_timeout_s = 3\n[auth]\nallow_anonymous = false\n")
    cfg = load_config(f)
    assert cfg.mqtt.publish_timeout_s == 3.0 and isinstance(cfg.mqtt.publish_timeout_s, float)
    assert cfg.auth.allow_anonymous is False


def test_environment_overrides_file_and_is_checked_too(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[mqtt]\nmax_packet_size = 2000\n")
    env = {"MOORLINE_MQTT__MAX_PACKET_SIZE": "4096", "MOORLINE_DATA_DIR": "/srv/m", "MOORLINE_E2E_BROKER": "x",
           "MOORLINE_AUTH__ALLOW_ANONYMOUS": "false"}
    cfg = load_config(f, environ=env)
    assert (cfg.mqtt.max_packet_size, cfg.data_dir, cfg.auth.allow_anonymous) == (4096, "/srv/m", False)
    cfg = load_config(f, {"mqtt.max_packet_size": 1024}, environ=env)  # flags win over both
    assert cfg.mqtt.max_packet_size == 1024
    with pytest.raises(ConfigError, match=r"mqtt.max_packet_size \(from MOORLINE_MQTT__MAX_PACKET_SIZE\) must be an integer"):
        env_overrides({"MOORLINE_MQTT__MAX_PACKET_SIZE": "big"})
    with pytest.raises(ConfigError, match="unknown configuration key mqtt.nope"):
        env_overrides({"MOORLINE_MQTT__NOPE": "1"})


def test_moorline_run_stops_on_a_bad_value_without_a_traceback(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[auth]\nallow_anonymous = "no"\n')
    r = subprocess.run([sys.executable, "-m", "moorline.cli", "run", "--config", str(f), "--data-dir",
                        str(tmp_path / "d")], capture_output=True, text=True, timeout=60, cwd=str(REPO),
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2
    assert 'configuration error: auth.allow_anonymous must be true or false, not "no"' in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "d").exists()
    r = subprocess.run([sys.executable, "-m", "moorline.cli", "run", "--data-dir", str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=60, cwd=str(REPO),
                       env={**os.environ, "PYTHONPATH": str(REPO), "MOORLINE_MQTT__MAX_PACKET_SIZE": "big"})
    assert r.returncode == 2 and "must be an integer" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("lease", [0.6, 1.0])
def test_an_owner_lease_shorter_than_the_close_margin_is_refused(tmp_path: Path, lease: float) -> None:
    # A client is closed 1 s before its node's lease would end unrenewed, and an open past that
    # point is not served: with a lease this short no session could ever be served.
    f = tmp_path / "c.toml"
    f.write_text(f"[session]\nowner_lease_s = {lease}\n")
    with pytest.raises(ConfigError, match=r"session.owner_lease_s must be 1.5 or more"):
        load_config(f).validate()


@pytest.mark.parametrize("value", [0, 3])
def test_an_entry_format_other_than_1_or_2_is_refused(tmp_path: Path, value: int) -> None:
    f = tmp_path / "c.toml"
    f.write_text(f"[cluster]\nentry_format = {value}\n")
    with pytest.raises(ConfigError, match=rf"cluster.entry_format must be 1 or 2, not {value}"):
        load_config(f).validate()


@pytest.mark.parametrize("value", ["some", "None", ""])
def test_shard_learners_other_than_all_or_none_is_refused(tmp_path: Path, value: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(f'[shard]\nlearners = "{value}"\n')
    with pytest.raises(ConfigError, match=rf"shard.learners must be 'all' .* or 'none' .*, not '{value}'"):
        load_config(f).validate()


@pytest.mark.parametrize("value", ["all", "none"])
def test_shard_learners_all_or_none_is_taken(tmp_path: Path, value: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(f'[shard]\nlearners = "{value}"\n')
    cfg = load_config(f)
    cfg.validate()
    assert cfg.shard.learners == value
    assert load_config(None).shard.learners == "all"  # the default: today's placement
