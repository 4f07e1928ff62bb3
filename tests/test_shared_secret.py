"""moecomm.auth, the shared secret on HTTP: where it comes from (value, file, environment, in that
order), how a Bearer header is read, and that nothing but the exact secret matches."""

from __future__ import annotations

import os

import pytest
from moecomm.auth import (
    GENERATED_BYTES,
    MAX_SECRET_CHARS,
    SecretError,
    SharedSecret,
    bearer_token,
    constant_time_equal,
    generate,
    read_secret_file,
)

ENV = "TEST_AUTH_SECRET"  # not MOECOMM_*: docs/env.md lists only real variables


def test_resolve_takes_the_value_then_the_file_then_the_environment(tmp_path, monkeypatch):
    f = tmp_path / "secret"
    f.write_text("  from-file\n")
    monkeypatch.setenv(ENV, "from-env")
    assert SharedSecret.resolve("from-flag", env=ENV).value == "from-flag"
    s = SharedSecret.resolve(file=str(f), env=ENV)
    assert s.value == "from-file" and str(f) in s.source
    s = SharedSecret.resolve(env=ENV)
    assert s.value == "from-env" and s.source == f"${ENV}"
    monkeypatch.delenv(ENV)
    assert SharedSecret.resolve(env=ENV) is None
    assert SharedSecret.resolve() is None
    with pytest.raises(SecretError, match="not both"):
        SharedSecret.resolve("x", file=str(f))


@pytest.mark.parametrize(
    ("content", "message"), [("", "is empty"), ("  \n", "is empty"), (None, "cannot read")]
)
def test_a_bad_secret_file_is_a_clear_error(tmp_path, content, message):
    f = tmp_path / "secret"
    if content is not None:
        f.write_text(content)
    with pytest.raises(SecretError, match=message) as info:
        read_secret_file(str(f), "--pd-secret-file")
    assert "--pd-secret-file" in str(info.value) and str(f) in str(info.value)


@pytest.mark.parametrize("bad", ["", "   ", "a\nb", "a\x00b", "x" * (MAX_SECRET_CHARS + 1)])
def test_unusable_secrets_are_refused(bad):
    with pytest.raises(SecretError):
        SharedSecret(bad, "--api-key")


def test_only_the_exact_secret_matches():
    s = SharedSecret("s3cret-value")
    assert s.matches("s3cret-value") and s.matches(b"s3cret-value")
    for wrong in ("s3cret-valu", "s3cret-value ", "S3CRET-VALUE", "", None, "x" * 4096):
        assert not s.matches(wrong), wrong
    assert s.matches_bearer("Bearer s3cret-value")
    assert s.matches_bearer(b"bearer   s3cret-value ")  # scheme without case, spaces trimmed
    for header in (None, "", "s3cret-value", "Basic s3cret-value", "Bearer", "Bearer wrong"):
        assert not s.matches_bearer(header), header
    assert s.headers() == {"Authorization": "Bearer s3cret-value"}
    assert s.matches_bearer(s.headers()["Authorization"])


def test_bearer_token_reads_the_credential():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token(b"BEARER abc") == "abc"
    assert bearer_token("Bearer a b") == "a b"
    assert bearer_token("Token abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None


def test_the_secret_never_shows_in_repr():
    s = SharedSecret("do-not-print-me", "--api-key")
    assert "do-not-print-me" not in repr(s) and "--api-key" in repr(s)
    with pytest.raises(TypeError):
        hash(s)


def test_generated_secrets_are_long_random_and_usable():
    a, b = generate(), generate()
    assert a != b and len(a) == 2 * GENERATED_BYTES
    assert SharedSecret(a).matches(a)
    assert constant_time_equal(a, a.encode()) and not constant_time_equal(a, b)


def test_the_environment_is_read_when_asked_not_at_import(monkeypatch):
    monkeypatch.setenv(ENV, "later")
    assert SharedSecret.resolve(env=ENV).value == os.environ[ENV]
