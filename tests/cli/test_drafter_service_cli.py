"""``stree drafter-service`` is private by default and refuses half-given TLS or an unnamed drafter set."""

from __future__ import annotations

from stree.cli import build_parser, main
from stree.proto.rpc import api_key_from_env


def _args(*argv):
    return build_parser().parse_args(["drafter-service", *argv])


def test_binds_loopback_unless_told_and_bind_is_an_alias():
    assert _args().host == "127.0.0.1"
    assert _args("--bind", "0.0.0.0").host == "0.0.0.0"
    assert _args("--host", "::1").host == "::1"


def test_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.setenv("STREE_API_KEY", "from-env")
    assert api_key_from_env(None) == "from-env"
    assert api_key_from_env("flag") == "flag"
    monkeypatch.setenv("STREE_API_KEY", "")
    assert api_key_from_env(None) is None


def test_bad_combinations_are_clear_errors(capsys):
    assert main(["drafter-service", "--no-supervise", "--drafters", "ngram", "--tls-cert", "c.pem"]) == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    assert main(["drafter-service", "--no-supervise"]) == 2
    assert "name the drafters to serve with --drafters" in capsys.readouterr().err
