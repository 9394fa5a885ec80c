"""`paved batches`: an API key that cannot be sent in an HTTP header is a usage error (exit 2)
whose message never repeats the key. One with a newline was sent to httpx, whose refusal
("Illegal header value b'Bearer <key>'") was printed as the error; a non-ASCII one escaped as
a UnicodeEncodeError traceback. A --poll that time.sleep refuses is a usage error too."""

from __future__ import annotations

import socket

import pytest

from paved.cli.main import main

SECRET = "sk-do-not-print-0123456789"  # noqa: S105 - a test key


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on: no request may get that far anyway."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "key",
    [f"{SECRET}\nX-Injected: 1", f"{SECRET}\rX", f"{SECRET}é", f"{SECRET} two", f"{SECRET}\x01"],
)
def test_an_unsendable_api_key_is_exit_2_without_the_key(key, closed_port, monkeypatch, capsys):
    monkeypatch.setenv("PAVED_API_KEY", key)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert main(["batches", "list", "--gateway", f"http://127.0.0.1:{closed_port}"]) == 2
    out, err = capsys.readouterr()
    assert "API key" in err
    assert SECRET not in out + err


@pytest.mark.parametrize("poll", ["-1", "nan", "inf", "0", "x"])
def test_a_bad_poll_interval_is_exit_2(poll, tmp_path, closed_port, monkeypatch, capsys):
    monkeypatch.setenv("PAVED_API_KEY", SECRET)
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n')
    argv = ["batches", "create", str(src), "--wait", "--poll", poll]
    assert main([*argv, "--gateway", f"http://127.0.0.1:{closed_port}"]) == 2
    assert "--poll" in capsys.readouterr().err
