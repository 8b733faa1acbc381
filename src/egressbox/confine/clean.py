"""Clean copies of the tools' configuration files: what a preset grants, credentials removed.

A package manager's or git's configuration often holds a credential next to settings a build
needs: a token in ``http.extraheader``, a password in an index URL, a registry token in
``~/.cargo/config.toml``. The child gets a copy of each file with every credential taken
out, bound read-only over the original's path (confine/world.py ``files``); the original is
masked. Pure functions here (text in, text out); `gather` (the one function with I/O) reads
the host's files for runner/assemble.py.

What is removed, by format:

- everywhere: the user and password of every URL (``https://user:tok@host`` -> ``https://
  host``; a bare login name such as ``ssh://git@host`` stays, see `_keep_user`), the value of
  query parameters named like a secret (``?token=...``), anaconda.org's ``/t/<token>`` path
  segment, and any entry whose key names a secret (token, password, secret, auth,
  credential...) or whose value looks like a known token (``ghp_...``, ``Bearer ...``);
- git config: ``[credential]`` sections (a helper is a command that fetches tokens),
  ``http.extraheader``, ``core.sshCommand`` (egressbox's GIT_SSH_COMMAND wins over it anyway)
  and ``core.askPass``; ``include.path`` / ``includeIf.*.path`` stay only when the caller
  cleans the included file too;
- pip.conf: the index URLs' userinfo, ``client-cert`` (it names a key file);
- TOML (uv.toml, cargo's config.toml): parsed and written back without the removed keys
  (``token``, ``credential-provider``...); comments are not kept;
- .condarc (YAML): line by line, a removed key takes its indented block with it.

A file that cannot be read as its format is never granted whole: `UncleanableError`. After
cleaning, the text is searched once more for what must not be there (`residue`); anything
found makes it UncleanableError too.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

# Key names that name a secret (matched anywhere in the name, case-insensitive). `auth` but
# not `author` (git's author.name); askpass and sshcommand name commands that fetch or use
# credentials.
SECRET_KEY = re.compile(
    r"token|passw|secret|credential|extraheader|auth(?!or)|askpass|sshcommand|private.?key"
    r"|api.?key|client.?cert|cookie",
    re.IGNORECASE,
)
# Values that are credentials whatever their key (the well-known prefixes of GitHub, GitLab,
# Slack, OpenAI/Anthropic, npm, PyPI, AWS and Hugging Face tokens; HTTP authorization texts;
# PEM private keys).
TOKEN_VALUE = re.compile(
    r"\bgh[opusr]_[A-Za-z0-9]{20,}|\bgithub_pat_\w{20,}|\bglpat-[\w-]{20,}"
    r"|\bxox[abposr]-[\w-]{10,}|\bsk-[\w-]{20,}|\bnpm_[A-Za-z0-9]{30,}|\bpypi-[\w-]{20,}"
    r"|\b(?:AKIA|ASIA|A3T[A-Z0-9])[A-Z0-9]{16}\b|\bhf_[A-Za-z0-9]{30,}"
    r"|(?i:\bbearer\s+[\w.~+/=-]{8,}|\bbasic\s+[A-Za-z0-9+/]{8,}={0,2}|\bauthorization\s*:)"
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----"
)
# scheme://userinfo@ : greedy up to the last '@' before the path (a password may hold '@',
# quotes and the like: the match rather takes too much than leaves a piece of a password).
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<info>[^\s/?#]*)@")
_QUERY_SECRET = re.compile(
    r"(?P<name>[?&;][^=&#\s\"']*?(?:token|key|secret|passw|sig|auth)[^=&#\s\"']*=)"
    r"[^&#\s\"']*",
    re.IGNORECASE,
)
# anaconda.org's channel token: https://conda.anaconda.org/t/<token>/channel
_CONDA_TOKEN = re.compile(r"(?P<host>://[^\s/\"']+)/t/[^/\s\"']+")
# A login name with no password: kept (ssh://git@host needs it). Lower case, short, and not a
# hex string (an old GitHub token is 40 hex digits used as the user name).
_LOGIN = re.compile(r"[a-z_][a-z0-9._-]{0,31}")
_HEX = re.compile(r"[0-9a-f]{16,}")
_SSH_SCHEMES = ("ssh", "git+ssh", "ssh+git", "sftp")
# Git's include depth (config.c MAX_INCLUDE_DEPTH).
MAX_INCLUDE_DEPTH = 10
# A configuration file is a few KiB; larger ones are not copied (they are not config files).
MAX_CONFIG_BYTES = 1 << 20
# Files taken from one directory preset (~/.config/git...), and how deep it is walked.
MAX_DIR_FILES = 256
MAX_DIR_DEPTH = 4


class UncleanableError(ValueError):
    """The text is not the format its name says, or a credential could not be removed."""


class Cleaned(NamedTuple):
    text: str
    removed: tuple[str, ...]  # what was removed, by name (never a value)


# -- what every format shares ----------------------------------------------------------------


def _keep_user(scheme: str, info: str) -> bool:
    """An ssh URL's login name (``ssh://git@host``): no password, and not token-like. Over
    HTTP a user name alone serves only a credential helper's lookup, and is removed."""
    return (
        scheme.lower().rstrip(":/") in _SSH_SCHEMES
        and bool(_LOGIN.fullmatch(info))
        and not _HEX.search(info)
    )


def strip_urls(text: str, removed: list[str]) -> str:
    """Userinfo, secret query values and conda tokens out of every URL in `text`."""

    def userinfo(match: re.Match[str]) -> str:
        if _keep_user(match["scheme"], match["info"]):
            return match[0]
        removed.append("a URL's user and password")
        return match["scheme"]

    def query(match: re.Match[str]) -> str:
        removed.append("a URL's secret query value")
        return match["name"]

    def conda(match: re.Match[str]) -> str:
        removed.append("a channel URL's token")
        return match["host"]

    text = _USERINFO.sub(userinfo, text)
    text = _QUERY_SECRET.sub(query, text)
    return _CONDA_TOKEN.sub(conda, text)


def residue(text: str) -> str:
    """What a clean copy must not hold, named ("" when nothing is left)."""
    for match in _USERINFO.finditer(text):
        if not _keep_user(match["scheme"], match["info"]):
            return "a URL with a user and password"
    if any(m.group(0) != m["name"] for m in _QUERY_SECRET.finditer(text)):
        return "a URL with a secret query value"
    if TOKEN_VALUE.search(text):
        return "a value that looks like a token"
    return ""


def _checked(text: str, removed: list[str]) -> Cleaned:
    left = residue(text)
    if left:
        raise UncleanableError(f"{left} is still there after cleaning")
    return Cleaned(text, tuple(dict.fromkeys(removed)))


def clean_text(text: str) -> Cleaned:
    """A file of lines with no keys (git's ignore and attributes): URLs cleaned, lines holding
    a token dropped."""
    removed: list[str] = []
    kept = []
    for raw in text.splitlines(keepends=True):
        line = strip_urls(raw, removed)
        if TOKEN_VALUE.search(line):
            removed.append("a line holding a token")
            continue
        kept.append(line)
    return _checked("".join(kept), removed)


# -- git config -------------------------------------------------------------------------------

_GIT_HEADER = re.compile(r'\s*\[\s*(?P<name>[A-Za-z0-9.-]+)(?:\s+"(?:[^"\\\n]|\\.)*")?\s*\]')
_GIT_KEY = re.compile(r"\s*(?P<key>[A-Za-z][A-Za-z0-9-]*)\s*(?:=(?P<value>.*))?$", re.DOTALL)
_COMMENT = re.compile(r"\s*(?:[#;].*)?$", re.DOTALL)
_INCLUDE_SECTIONS = ("include", "includeif")


def _git_lines(text: str) -> Iterator[tuple[int, str]]:
    """Logical lines (a value continued with a trailing backslash joins the next line)."""
    start, pending = 1, ""
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        if not pending:
            start = number
        pending += line
        body = line.rstrip("\r\n")
        trailing = len(body) - len(body.rstrip("\\"))
        if trailing % 2 == 0:
            yield start, pending
            pending = ""
    if pending:
        yield start, pending


def _git_value(raw: str) -> str:
    """A value without quotes and its trailing comment (enough to judge it; never written)."""
    out, quoted = [], False
    index = 0
    while index < len(raw):
        char = raw[index]
        if char == "\\" and index + 1 < len(raw):
            out.append(raw[index + 1])
            index += 2
            continue
        if char == '"':
            quoted = not quoted
        elif char in "#;" and not quoted:
            break
        else:
            out.append(char)
        index += 1
    return "".join(out).strip()


def clean_git(text: str, include: Callable[[str], bool] | None = None) -> Cleaned:
    """A git config without credentials; `include(path)` says whether an include stays (the
    caller cleans the included file too); without it every include is dropped."""
    removed: list[str] = []
    out: list[str] = []
    section = ""
    for number, line in _git_lines(text):
        header = _GIT_HEADER.match(line)
        rest = line
        if header:
            section = header["name"].lower()
            rest = line[header.end() :]
            _git_header(line[: header.end()], section, out, removed)
        elif TOKEN_VALUE.search(line) and _COMMENT.fullmatch(line):
            removed.append("a comment holding a token")
            continue
        if _COMMENT.fullmatch(rest):
            if not header:
                out.append(strip_urls(line, removed))
            continue
        kept = _git_entry(section, rest, include, removed)
        if kept is None:
            raise UncleanableError(f"line {number} is not git config syntax")
        out.append(kept)
    return _checked("".join(out), removed)


def _git_header(text: str, section: str, out: list[str], removed: list[str]) -> None:
    if section != "credential":
        out.append(strip_urls(text, removed) + "\n")
    elif "credential" not in removed:
        removed.append("credential")


def _git_entry(
    section: str, line: str, include: Callable[[str], bool] | None, removed: list[str]
) -> str | None:
    """The key's line cleaned, "" when it goes, None when it is not a key line."""
    key = _GIT_KEY.fullmatch(line)
    if key is None:
        return None
    base = section.split(".", maxsplit=1)[0]
    name = f"{base}.{key['key'].lower()}"
    if not section:
        raise UncleanableError(f"{name.lstrip('.')} is outside every section")
    if base == "credential" or SECRET_KEY.search(name):
        removed.append(name)  # a credential.* entry: a helper that fetches tokens, a user
        return ""
    line = strip_urls(line, removed)
    value = _git_value(line[line.index("=") + 1 :] if key["value"] is not None else "")
    if base in _INCLUDE_SECTIONS and name.endswith(".path"):
        if include is not None and include(value):
            return line
        removed.append(f"{base}.path {value}")
        return ""
    if TOKEN_VALUE.search(value):
        removed.append(f"{name} (its value looks like a token)")
        return ""
    return line


# -- INI (pip.conf) ---------------------------------------------------------------------------

_INI_HEADER = re.compile(r"\s*\[(?P<name>[^\]]+)\]\s*$")
_INI_KEY = re.compile(r"(?P<key>[^=:\s][^=:]*?)\s*(?:[=:]|$)")


def clean_ini(text: str) -> Cleaned:
    """pip's configuration (ConfigParser syntax): secret keys and their continuation lines
    dropped, URLs cleaned."""
    import configparser  # here: only a run that copies a pip.conf pays for the import

    parser = configparser.RawConfigParser(strict=False, allow_no_value=True)
    try:
        parser.read_string(text)
    except configparser.Error as exc:
        raise UncleanableError(str(exc).splitlines()[0]) from None
    removed: list[str] = []
    out: list[str] = []
    dropping = False  # the lines that continue a dropped key's value go with it
    for raw in text.splitlines(keepends=True):
        line = strip_urls(raw, removed)
        if raw[:1] in (" ", "\t") and raw.strip() and not raw.lstrip().startswith(("#", ";")):
            dropping = dropping or bool(TOKEN_VALUE.search(line))
            if not dropping:
                out.append(line)
            continue
        dropping = False
        key = None if _COMMENT.fullmatch(raw) or _INI_HEADER.match(raw) else _INI_KEY.match(raw)
        if key is not None and (SECRET_KEY.search(key["key"]) or TOKEN_VALUE.search(line)):
            removed.append(key["key"].strip())
            dropping = True
        elif TOKEN_VALUE.search(line):
            removed.append("a comment holding a token")
        else:
            out.append(line)
    return _checked("".join(out), removed)


# -- TOML (uv.toml, cargo's config.toml) ---------------------------------------------------


def clean_toml(text: str) -> Cleaned:
    """Parsed, cleaned as data, and written back (comments are not kept)."""
    import tomllib  # here: only a run that copies a TOML file pays for the import

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UncleanableError(str(exc)) from None
    removed: list[str] = []
    cleaned = _clean_table(data, "", removed)
    return _checked(dump_toml(cleaned), removed)


def _clean_table(table: dict[str, object], where: str, removed: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in table.items():
        name = f"{where}{key}"
        if SECRET_KEY.search(key):
            removed.append(name)
            continue
        kept, clean = _clean_value(value, name, removed)
        if kept:
            out[key] = clean
    return out


def _clean_value(value: object, name: str, removed: list[str]) -> tuple[bool, object]:
    if isinstance(value, str):
        value = strip_urls(value, removed)
        if TOKEN_VALUE.search(value):
            removed.append(f"{name} (its value looks like a token)")
            return False, None
        return True, value
    if isinstance(value, dict):
        return True, _clean_table(value, name + ".", removed)
    if isinstance(value, list):
        items = [_clean_value(item, name, removed) for item in value]
        return True, [clean for kept, clean in items if kept]
    return True, value


def dump_toml(data: dict[str, object]) -> str:
    """TOML text for what tomllib.loads returns (tables, arrays of tables, inline values)."""
    lines: list[str] = []
    _dump_table(data, (), lines, header="")
    return "\n".join(lines) + ("\n" if lines else "")


def _is_table_array(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _dump_table(
    table: dict[str, object], path: tuple[str, ...], lines: list[str], header: str
) -> None:
    if header:
        lines.append(header)
    nested: list[tuple[str, object]] = []
    for key, value in table.items():
        if isinstance(value, dict) or _is_table_array(value):
            nested.append((key, value))
        else:
            lines.append(f"{_toml_key(key)} = {_toml_inline(value)}")
    for key, value in nested:
        sub = (*path, key)
        dotted = ".".join(_toml_key(k) for k in sub)
        if isinstance(value, dict):
            _dump_table(value, sub, lines, header=f"[{dotted}]")
            continue
        for item in value if isinstance(value, list) else ():
            if isinstance(item, dict):
                _dump_table(item, sub, lines, header=f"[[{dotted}]]")


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f"}
_ESCAPES["\r"] = "\\r"


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    out = []
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _toml_inline(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str | float) or hasattr(value, "isoformat"):  # dates and times
        return _toml_scalar(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_inline(v) for v in value) + "]"
    if isinstance(value, dict):
        pairs = ", ".join(f"{_toml_key(k)} = {_toml_inline(v)}" for k, v in value.items())
        return "{ " + pairs + " }" if pairs else "{}"
    raise UncleanableError(f"a TOML value of type {type(value).__name__}")


def _toml_scalar(value: object) -> str:
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, float):
        return _toml_float(value)
    return str(value.isoformat())  # type: ignore[attr-defined]


def _toml_float(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


# -- YAML (.condarc) --------------------------------------------------------------------------

_YAML_KEY = re.compile(r"(?P<indent>\s*(?:-\s+)?)(?P<key>[^\s:#{}\[\],][^:#{}\[\],]*?)\s*:(?:\s|$)")
_YAML_SECRET_ANYWHERE = re.compile(
    r"(?:^|[\s{,'\"])[\w.-]*(?:" + SECRET_KEY.pattern + r")[\w.-]*['\"]?\s*:", re.IGNORECASE
)


def clean_yaml(text: str) -> Cleaned:
    """Line by line: a secret key's line and its more indented block go; URLs are cleaned.

    No YAML parser is at hand at run time, so what this cannot follow (a secret key inside a
    flow mapping, a key after a tab) leaves a residue and the file is UncleanableError.
    """
    removed: list[str] = []
    out: list[str] = []
    block: int | None = None  # the indentation of a dropped key: deeper lines go with it
    for raw in text.splitlines(keepends=True):
        indent = len(raw) - len(raw.lstrip(" -"))
        if block is not None and raw.strip() and indent > block:
            continue
        block = None
        key = _YAML_KEY.match(raw)
        if key is not None and SECRET_KEY.search(key["key"]):
            removed.append(key["key"].strip())
            block = len(key["indent"])
            continue
        line = strip_urls(raw, removed)
        if TOKEN_VALUE.search(line):
            removed.append("a line holding a token")
            continue
        out.append(line)
    cleaned = "".join(out)
    if _YAML_SECRET_ANYWHERE.search(cleaned):
        raise UncleanableError("a secret key this reader cannot remove (flow mapping or quoting)")
    return _checked(cleaned, removed)


# -- which format a path is -------------------------------------------------------------------

GIT, INI, TOML, YAML, TEXT = "git", "ini", "toml", "yaml", "text"
CLEANERS: dict[str, Callable[[str], Cleaned]] = {
    GIT: clean_git,
    INI: clean_ini,
    TOML: clean_toml,
    YAML: clean_yaml,
    TEXT: clean_text,
}
# By the file's name relative to its preset entry's home-relative path; None: not copied.
_BY_NAME = {
    ".gitconfig": GIT,
    ".config/git/config": GIT,
    ".config/git/ignore": TEXT,
    ".config/git/attributes": TEXT,
    ".config/pip/pip.conf": INI,
    ".pip/pip.conf": INI,
    ".config/uv/uv.toml": TOML,
    ".cargo/config.toml": TOML,
    ".cargo/config": TOML,
    ".condarc": YAML,
    ".config/conda/.condarc": YAML,
    ".config/conda/condarc": YAML,
    ".conda/.condarc": YAML,
    ".conda/condarc": YAML,
}
_SYSTEM = {
    "/etc/gitconfig": GIT,
    "/etc/pip.conf": INI,
    "/etc/xdg/pip/pip.conf": INI,
    "/etc/uv/uv.toml": TOML,
    "/etc/xdg/uv/uv.toml": TOML,
    "/etc/conda/.condarc": YAML,
    "/etc/conda/condarc": YAML,
}
# System-wide files of the same tools, cleaned too when /etc is in view.
SYSTEM_TOOL_CONFIG = tuple(_SYSTEM)


def kind_of(path: str, home: str) -> str | None:
    if path in _SYSTEM:
        return _SYSTEM[path]
    prefix = home.rstrip("/") + "/"
    if not path.startswith(prefix):
        return None
    return _BY_NAME.get(path[len(prefix) :])


# -- gathering the host's files (the I/O) --------------------------------------------------------


class CleanCopies(NamedTuple):
    """What the child sees in place of the tools' configuration files."""

    files: tuple[tuple[str, str], ...]  # (path, clean text): bound read-only over the path
    originals: tuple[str, ...]  # masked (world) or denied (Landlock): never in the view
    notes: tuple[str, ...]  # "PATH: not granted: why" (warnings)
    cleaned: tuple[str, ...]  # "PATH without WHAT" (said when the run announces its roots)


class _Gather:
    def __init__(self, home: str, deny: Sequence[str], passed: Iterable[str]) -> None:
        self.home = home
        self.deny = tuple(deny)
        self.passed = frozenset(passed)
        self.files: dict[str, str] = {}
        self.originals: list[str] = []
        self.notes: list[str] = []
        self.cleaned: list[str] = []

    def result(self) -> CleanCopies:
        return CleanCopies(
            tuple(self.files.items()),
            tuple(dict.fromkeys(self.originals)),
            tuple(self.notes),
            tuple(self.cleaned),
        )

    def entry(self, path: str) -> None:
        if os.path.isdir(path):
            for found in _walk(path):
                self.one(found, kind_of(found, self.home), depth=0)
        elif os.path.lexists(path):
            self.one(path, kind_of(path, self.home), depth=0)

    def one(self, path: str, kind: str | None, depth: int) -> bool:
        """Copy `path` cleaned; False when the child gets nothing there."""
        if path in self.files or path in self.passed:
            return True
        self.originals.append(path)
        if _denied(path, self.deny):
            return False  # a credential store: masked, said elsewhere
        if kind is None:
            self.notes.append(f"{path}: not granted: egressbox cannot clean this file's format")
            return False
        try:
            text = _read(path, self.home, self.deny)
            cleaner = CLEANERS[kind]
            if kind == GIT:
                done = clean_git(text, lambda inc: self.include(path, inc, depth))
            else:
                done = cleaner(text)
        except (OSError, UnicodeDecodeError, UncleanableError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self.notes.append(f"{path}: not granted: {why}")
            return False
        self.files[path] = done.text
        if done.removed:
            self.cleaned.append(f"{path} without {', '.join(done.removed)}")
        return True

    def include(self, parent: str, raw: str, depth: int) -> bool:
        """Keep an include whose target is absent or copied clean as well."""
        if depth + 1 >= MAX_INCLUDE_DEPTH:
            return False
        if raw.startswith("~/"):
            target = self.home + raw[1:]
        else:
            target = os.path.join(os.path.dirname(parent), raw)
        target = os.path.normpath(target)
        if not os.path.lexists(target):
            return True
        return self.one(target, GIT, depth + 1)


def _walk(top: str) -> Iterator[str]:
    count = 0
    for directory, dirs, names in os.walk(top):
        if directory[len(top) :].count("/") >= MAX_DIR_DEPTH:
            dirs[:] = []
        for name in sorted(names):
            count += 1
            if count > MAX_DIR_FILES:
                return
            yield os.path.join(directory, name)


def _denied(path: str, deny: Iterable[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in deny)


def _read(path: str, home: str, deny: Sequence[str]) -> str:
    """The file's text; refused when it leads where the child may not look.

    A configuration file may be a link (dotfile managers): its target must be a regular file,
    off the credential list, and under the home directory or readable by every user (a link
    planted as ~/.gitconfig -> /etc/shadow must not make a root invoker copy the shadow file).
    """
    real = os.path.realpath(path)
    if _denied(real, deny):
        raise UncleanableError("it leads to a credential store")
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UncleanableError("not a regular file")
        if not real.startswith(home.rstrip("/") + "/") and not st.st_mode & stat.S_IROTH:
            raise UncleanableError(f"it leads to {real}, outside the home and not world-readable")
        if st.st_size > MAX_CONFIG_BYTES:
            raise UncleanableError(f"larger than {MAX_CONFIG_BYTES} bytes")
        data = handle.read(MAX_CONFIG_BYTES + 1)
    return data.decode("utf-8")


def gather(
    entries: Iterable[str], *, home: str, deny: Sequence[str], passed: Iterable[str] = ()
) -> CleanCopies:
    """Clean copies of the files at `entries` (files, or directories walked) that exist;
    `passed` files (--grant-file) are left as they are."""
    work = _Gather(home, deny, passed)
    for entry in entries:
        work.entry(entry)
    return work.result()
