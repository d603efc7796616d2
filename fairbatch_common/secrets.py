"""Secrets from the environment, or from a file the environment names (``NAME_FILE``).

The ``*_FILE`` convention of the official Docker images (postgres' ``POSTGRES_PASSWORD_FILE``, mysql's,
...): instead of the secret itself, a variable ``NAME_FILE`` gives the path of a file holding it, e.g. a
Kubernetes Secret mounted as a volume. The secret then stays out of the process environment (and of
``kubectl describe``, ``/proc/<pid>/environ`` and crash dumps of the environment); the Helm chart passes
``FAIRBATCH_AGENT_TOKEN_FILE``, ``FAIRBATCH_REDIS_PASSWORD_FILE`` and ``FAIRBATCH_ENGINE_API_KEY_FILE``.
"""

from __future__ import annotations

from collections.abc import Mapping

FILE_SUFFIX = "_FILE"


class SecretFileError(ValueError):
    """``NAME_FILE`` names a file that cannot be read as UTF-8 text. The message names the variable and
    the path, never the file's content."""

    def __init__(self, variable: str, path: str, reason: str) -> None:
        super().__init__(f"{variable}={path}: cannot read the secret file ({reason})")
        self.variable = variable
        self.path = path
        self.reason = reason


def env_secret(environ: Mapping[str, str], name: str) -> str | None:
    """The secret ``name`` from ``environ`` (e.g. ``os.environ``), or None when none is given.

    - ``environ[name]`` when it is set and non-empty (it wins over a file);
    - else, when ``environ[name + "_FILE"]`` is set and non-empty, the content of that file (read as
      UTF-8) with one trailing newline (``"\\n"`` or ``"\\r\\n"``) stripped, as ``echo secret > file`` or a
      Secret written by hand leaves it; anything else in the file (other whitespace, a second newline) is
      part of the secret. An empty file (or one holding a newline only) gives None;
    - else None (an empty variable counts as unset, as before the ``_FILE`` form).

    Raises :class:`SecretFileError` (a ``ValueError``) naming ``name + "_FILE"`` and the path when the
    file cannot be opened or read (missing, a directory, no permission) or is not UTF-8 text; its message
    never holds any of the file's content.
    """
    value = environ.get(name)
    if value:
        return value
    variable = name + FILE_SUFFIX
    path = environ.get(variable)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8", newline="") as f:  # newline="": keep "\r\n" to strip it whole
            text = f.read()
    except UnicodeDecodeError:
        raise SecretFileError(variable, path, "not UTF-8 text") from None  # its message quotes a byte
    except OSError as exc:
        raise SecretFileError(variable, path, exc.strerror or type(exc).__name__) from None
    if text.endswith("\r\n"):
        text = text[:-2]
    elif text.endswith("\n"):
        text = text[:-1]
    return text or None
