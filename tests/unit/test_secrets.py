"""fairbatch_common/secrets.py: a secret from ``NAME`` or from the file ``NAME_FILE`` names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fairbatch_common import secrets as secrets_module
from fairbatch_common.secrets import SecretFileError, env_secret

NAME = "FAIRBATCH_AGENT_TOKEN"


def _file(tmp_path: Path, content: bytes) -> str:
    path = tmp_path / "secret"
    path.write_bytes(content)
    return str(path)


def test_neither_set_is_none() -> None:
    assert env_secret({}, NAME) is None
    assert env_secret({"OTHER": "x", "OTHER_FILE": "/nonexistent"}, NAME) is None


def test_the_plain_variable() -> None:
    assert env_secret({NAME: "tok-1"}, NAME) == "tok-1"
    assert env_secret({NAME: "tok-1\n"}, NAME) == "tok-1\n"  # a variable is taken as it is
    assert env_secret({NAME: ""}, NAME) is None  # empty counts as unset
    assert env_secret({NAME: "", NAME + "_FILE": ""}, NAME) is None


@pytest.mark.parametrize(("content", "secret"), [
    (b"tok-1", "tok-1"),
    (b"tok-1\n", "tok-1"),
    (b"tok-1\r\n", "tok-1"),
    (b"tok-1\n\n", "tok-1\n"),  # one newline only
    (b"tok-1\r\n\r\n", "tok-1\r\n"),
    (b"tok-1\r", "tok-1\r"),  # a lone CR is no newline
    (b" tok 1 \n", " tok 1 "),  # other whitespace is kept
    (b"line1\nline2\n", "line1\nline2"),
    ("pä$$\n".encode(), "pä$$"),
])  # fmt: skip
def test_the_file(tmp_path: Path, content: bytes, secret: str) -> None:
    path = _file(tmp_path, content)
    assert env_secret({NAME + "_FILE": path}, NAME) == secret
    assert env_secret({NAME: "", NAME + "_FILE": path}, NAME) == secret  # an empty NAME falls back to the file


@pytest.mark.parametrize("content", [b"", b"\n", b"\r\n"])
def test_an_empty_file_is_none(tmp_path: Path, content: bytes) -> None:
    assert env_secret({NAME + "_FILE": _file(tmp_path, content)}, NAME) is None


def test_the_variable_wins_over_the_file(tmp_path: Path) -> None:
    environ = {NAME: "from-env", NAME + "_FILE": _file(tmp_path, b"from-file\n")}
    assert env_secret(environ, NAME) == "from-env"
    # ... even when the file cannot be read: it is not opened at all
    assert env_secret({NAME: "from-env", NAME + "_FILE": str(tmp_path / "missing")}, NAME) == "from-env"


def test_a_missing_file_raises_naming_the_variable_and_the_path(tmp_path: Path) -> None:
    path = str(tmp_path / "missing")
    with pytest.raises(SecretFileError) as info:
        env_secret({NAME + "_FILE": path}, NAME)
    assert isinstance(info.value, ValueError)
    assert str(info.value) == f"FAIRBATCH_AGENT_TOKEN_FILE={path}: cannot read the secret file (No such file or directory)"
    assert (info.value.variable, info.value.path) == ("FAIRBATCH_AGENT_TOKEN_FILE", path)


def test_a_directory_raises(tmp_path: Path) -> None:
    with pytest.raises(SecretFileError, match=r"^FAIRBATCH_AGENT_TOKEN_FILE=.*: cannot read the secret file \(Is a directory\)$"):
        env_secret({NAME + "_FILE": str(tmp_path)}, NAME)


def test_an_unreadable_file_raises_without_its_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _file(tmp_path, b"s3cret-content\n")
    if os.geteuid() == 0:  # root reads a 0o000 file: the permission error is made by hand
        def refuse(file: str, *args: object, **kwargs: object) -> None:
            raise PermissionError(13, "Permission denied", file)

        monkeypatch.setattr(secrets_module, "open", refuse, raising=False)
    os.chmod(path, 0o000)
    try:
        with pytest.raises(SecretFileError) as info:
            env_secret({NAME + "_FILE": path}, NAME)
    finally:
        os.chmod(path, 0o600)
    assert str(info.value) == f"FAIRBATCH_AGENT_TOKEN_FILE={path}: cannot read the secret file (Permission denied)"
    assert "s3cret" not in str(info.value) and info.value.__cause__ is None


def test_a_file_that_is_not_utf8_raises_without_its_content(tmp_path: Path) -> None:
    path = _file(tmp_path, b"\xffs3cret\n")
    with pytest.raises(SecretFileError) as info:
        env_secret({NAME + "_FILE": path}, NAME)
    assert str(info.value) == f"FAIRBATCH_AGENT_TOKEN_FILE={path}: cannot read the secret file (not UTF-8 text)"
    assert "s3cret" not in str(info.value) and "xff" not in str(info.value) and info.value.__cause__ is None
