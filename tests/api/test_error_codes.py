"""Every code the service can answer is documented in docs/api.md's Errors section."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import orjson

from rolloutlog import errors
from rolloutlog.api import _app

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _errors_section() -> str:
    text = DOCS.read_text()
    start = text.index("\n## Errors\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _answered_codes() -> set[str]:
    codes = {
        cls.code
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.RolloutlogError)
    }
    codes.update(_app._HTTP_CODES.values())  # HTTP-level refusals (no route, no method)
    codes.add("invalid_request")  # request validation, and other HTTP statuses
    return codes


def test_every_answered_code_is_documented() -> None:
    documented = set(re.findall(r"`([a-z_]+)`", _errors_section()))
    missing = _answered_codes() - documented
    assert not missing, f"codes answered but not in docs/api.md's Errors section: {missing}"


def test_every_error_class_has_its_own_code_and_a_status() -> None:
    for _, cls in inspect.getmembers(errors, inspect.isclass):
        if issubclass(cls, errors.RolloutlogError):
            assert re.fullmatch(r"[a-z_]+", cls.code), cls
            assert 400 <= cls.http_status < 600, cls


def test_start_up_mistakes_are_configuration_errors() -> None:
    from rolloutlog.log import open_log

    for url in ("nope://x", "kafka://", "kafka://h:1?bogus=1", "embedded://?synchronous=OFF"):
        try:
            open_log(url)
        except errors.ConfigurationError as e:
            assert e.code == "invalid_configuration"
            assert isinstance(e, errors.InvalidRequest)  # what callers caught before
        else:
            raise AssertionError(f"{url} was accepted")


def test_every_error_class_comes_back_from_the_wire() -> None:
    """``error_from_wire`` is the one decoder (trainer client and SDK): a reply rendered from any
    class comes back as that class, with its details."""
    for _, cls in inspect.getmembers(errors, inspect.isclass):
        if not issubclass(cls, errors.RolloutlogError) or cls in (
            errors.RolloutlogError,
            errors.ServiceError,
        ):
            continue
        sent = cls("why", run="r1")
        body = orjson.dumps(sent.to_dict())
        back = errors.error_from_wire(cls.http_status, body)
        assert type(back) is cls or back.code == cls.code, cls  # CatalogError/CatalogVersionError
        assert (back.message, back.details) == ("why", {"run": "r1"})
    unknown = errors.error_from_wire(502, b"<html>bad gateway</html>")
    assert isinstance(unknown, errors.ServiceError) and unknown.retriable
    assert unknown.details == {"body": "<html>bad gateway</html>"}
