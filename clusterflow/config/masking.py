"""The one rule that hides secrets wherever a config value or a script argument is shown: the
dashboard's pages, answers and streams, ``clusterflow status`` (its text and ``--json``), the
messages that name a changed config key or a refused value, and the names of sweep members.
What is masked reads :data:`MASK` and never leaves the process that masks it.

A **name** (a config key, a flag, an environment variable, a header) names a secret when one of
its parts does. A name is cut into segments at ``.``, ``:`` and ``/``, and each segment into
words at ``_``, ``-``, spaces and camelCase (``trackers.wandb.apiKey``: ``trackers``,
``wandb``, ``api key``). A segment names a secret when

- a word holds one of :data:`STRONG` (``password``, ``passwd``, ``passphrase``, ``secret``,
  ``credential``, ``authorization``, and glued compounds such as ``apikey`` or ``authtoken``);
- its last word is one of :data:`LAST` (``token``, ``key``, ``pass``, ``auth``), or ``pwd``
  after another word (``db_pwd``; ``PWD`` alone is the working directory);
- two words in a row make a key or a token of a kind (:data:`KINDS`: ``api_key_hint``,
  ``access_token_ttl``).

Words are matched whole, so counts and sizes stay readable: ``max_tokens``, ``tokenizer``,
``key_dim``, ``keep_best``, ``pass_rate``, ``mining.k`` are not secrets. A value whose name
names a secret is masked whole, true and false excepted (a switch holds no secret).

Inside **text** (any string shown, a list's items, a value that parses as JSON):

- the user and password of a URL, ``scheme://USER:PASSWORD@host``; the password may hold ``/``
  and ``@`` (the userinfo ends at the last ``@`` of the word), a word whose ``://`` is
  followed by a ``/`` before any ``@`` and ``:`` holds no userinfo (``https://h/@user``);
- ``NAME=VALUE`` and ``NAME: VALUE`` where NAME names a secret, quoted or not (``DB_PASS=x``,
  ``export HF_TOKEN="a b"``, ``"password": "x"``, ``Authorization: Bearer x``), and
  ``Bearer TOKEN`` anywhere;
- a JSON object or list (a string that parses as one): masked as a mapping is;
- the words of a command line, as a script's arguments are (below).

In a **script's arguments** (``script.args``, any list of strings, the words of a text), a flag
that names a secret hides its value: ``--api-key VALUE`` (the next word, a ``-abc`` included;
only a ``--long`` flag after it is taken for the next flag), ``--api-key=VALUE``, and the short
flag ``-k`` as getopt reads it: ``-k VALUE``, ``-kVALUE`` and ``-k=VALUE`` (name a top-k flag
``--k`` or ``--topk``). Every other word is masked as text.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Iterable, Mapping

MASK = "••••••"
# A word holding one of these names a secret wherever it stands in its segment.
STRONG = (
    "password",
    "passwd",
    "passphrase",
    "secret",
    "credential",
    "authorization",
    "apikey",
    "apitoken",
    "accesskey",
    "accesstoken",
    "authtoken",
    "privatekey",
    "refreshtoken",
    "sessiontoken",
)
# The last word of a segment that names a secret (``hf_token``, ``api-key``, ``DB_PASS``).
LAST = ("token", "key", "pass", "auth")
# A tokenizer's tokens, not secrets: ``pad_token``, ``eos_token``.
TOKENIZER = ("pad", "bos", "eos", "unk", "mask", "sep", "cls", "special")
# ``pwd`` names a password after another word only: ``PWD`` alone is the working directory.
AFTER_A_WORD = ("pwd",)
# word + key/token anywhere in a segment: ``api_key_hint``, ``access_token_ttl``.
KINDS = ("api", "access", "private", "secret", "auth", "refresh", "session", "bearer", "client")
# The short flag that takes a key (``curl -k`` is a switch, shown masked all the same).
SHORT_FLAGS = ("k",)
# Nesting a value is looked into at most; deeper than this it is masked whole.
MAX_DEPTH = 64
# A string is tried as JSON up to this length.
JSON_CHARS = 1 << 20

_SEGMENTS = re.compile(r"[.:]+")
_WORD_CUTS = re.compile(r"[_\-\s]+")
# Words of letters: ``apiKey`` is ``api key``, ``HFToken`` ``hf token``, ``token2`` ``token``.
_CAMEL = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_NOT_SPACE = re.compile(r"\S*")
_BEARER = re.compile(r"(?P<head>\bbearer\s+)(?P<value>[^\s\"',;]+)", re.IGNORECASE)
# NAME followed by = or :, NAME quoted or not, not in the middle of another name.
_NAME_OP = re.compile(r"(?<![\w.\-])(?P<q>[\"']?)(?P<name>[A-Za-z_.\-][\w.\-]*)(?P=q)\s*[=:]\s*")
# What follows a secret's NAME=: an auth scheme and its credentials, a quoted text, or a word.
_VALUE = re.compile(
    r"(?:bearer|basic|token|digest|negotiate|bot)\s+[^\s\"']+"
    r"|\"(?:[^\"\\]|\\.)*\"?|'[^']*'?|[^\s;&|\"']+",
    re.IGNORECASE,
)
# A word of a command line: runs of quoted parts and other non-space characters.
_CMD_WORD = re.compile(r"(?:\"[^\"]*\"?|'[^']*'?|[^\s\"']+)+")
_FLAG = re.compile(r"--?[A-Za-z][\w.\-]*")


def _words(segment: str) -> list[str]:
    out = []
    for piece in _WORD_CUTS.split(segment):
        out += [w.lower() for w in _CAMEL.findall(piece)]
    return out


def _segment_is_secret(words: list[str]) -> bool:
    if not words:
        return False
    if any(s in w for w in words for s in STRONG):
        return True
    if words[-1] == "token" and len(words) > 1 and words[-2] in TOKENIZER:
        return False
    if words[-1] in LAST or (len(words) > 1 and words[-1] in AFTER_A_WORD):
        return True
    return any(a in KINDS and b in ("key", "token") for a, b in itertools.pairwise(words))


@functools.lru_cache(maxsize=4096)  # the same few hundred names, asked at every poll
def is_secret(name: str) -> bool:
    """Whether a config key (dotted), a flag (``--api-key``), an environment variable or a
    header names a secret."""
    return any(_segment_is_secret(_words(s)) for s in _SEGMENTS.split(name))


def _flag_name(word: str) -> str | None:
    """The name of a flag word (``--api-key`` and ``--api-key=x``: ``api-key``), else None."""
    if not _FLAG.match(word):
        return None
    return word.lstrip("-").partition("=")[0]


def is_secret_flag(flag: str) -> bool:
    """Whether an argument ``flag`` (``--api-key``, ``-k``, ``api_key`` of a ``key=value``
    argument) takes a secret."""
    if flag.startswith("-") and not flag.startswith("--") and flag[1:] in SHORT_FLAGS:
        return True
    return is_secret(flag.lstrip("-"))


def _mask_url(text: str) -> str:
    out, pos = [], 0
    for m in _SCHEME.finditer(text):
        if m.start() < pos:
            continue
        end = m.end()
        word = _NOT_SPACE.match(text, end)[0]
        at = len(word)
        while (at := word.rfind("@", 0, at)) > 0:
            info = word[:at]
            slash, colon = info.find("/"), info.find(":")
            if slash < 0 or 0 <= colon < slash:
                out += [text[pos:end], MASK]
                pos = end + at
                break
    return "".join(out) + text[pos:]


def _mask_assignments(text: str) -> str:
    out, pos = [], 0
    while (m := _NAME_OP.search(text, pos)) is not None:
        if not is_secret(m["name"]):
            out.append(text[pos : m.end("name")])
            pos = m.end("name")
            continue
        value = _VALUE.match(text, m.end())
        out += [text[pos : m.end()], MASK if value else ""]
        pos = value.end() if value else m.end()
    return "".join(out) + text[pos:]


def _mask_json(text: str) -> str | None:
    """``text`` as masked JSON when it parses as a JSON object or list (None: it does not)."""
    stripped = text.strip()
    if stripped[:1] not in ("{", "[") or len(stripped) > JSON_CHARS:
        return None
    try:
        parsed = json.loads(stripped)
    except (ValueError, RecursionError):
        return None
    masked = mask_value("", parsed)
    return text if masked == parsed else json.dumps(masked, ensure_ascii=False)


def mask_text(text: str) -> str:
    """``text`` with every secret inside it masked (see the module's rule)."""
    as_json = _mask_json(text)
    if as_json is not None:
        return as_json
    text = _mask_url(text)
    text = _BEARER.sub(lambda m: m["head"] + MASK, text)
    text = _mask_assignments(text)
    words = list(_CMD_WORD.finditer(text))
    masked = _mask_words([w[0] for w in words], as_text=True)
    out, pos = [], 0
    for w, new in zip(words, masked):
        out += [text[pos : w.start()], new]
        pos = w.end()
    return "".join(out) + text[pos:]


def _mask_words(words: list[str], as_text: bool = False) -> list[str]:
    """Each secret flag's value masked; the other words masked as text (``as_text``: they
    are words of a text already masked)."""
    out: list[str] = []
    hide_next = False
    for word in words:
        if hide_next and not word.startswith("--"):
            out.append(MASK)
            hide_next = False
            continue
        name = _flag_name(word)
        secret = name is not None and is_secret(name)
        short = word[:2] if word[:1] == "-" and word[1:2].isalpha() else ""
        if short[1:] in SHORT_FLAGS:  # -k VALUE, -kVALUE, -k=VALUE (and -key VALUE)
            rest = word[2:]
            out.append(f"{short}{'=' if rest[:1] == '=' else ''}{MASK}" if rest else word)
            # -key VALUE: a word (in lower case) naming a secret takes the next word too.
            hide_next = not rest or (secret and rest.islower() and "=" not in rest)
        elif secret:  # --api-key VALUE, --api-key=VALUE
            head, eq, _ = word.partition("=")
            out.append(f"{head}={MASK}" if eq else word)
            hide_next = not eq
        else:
            out.append(word if as_text else mask_text(word))
            hide_next = False
    return out


def mask_args(args: Iterable[object]) -> list[str]:
    """A script's arguments (or any list of words) as shown: each secret flag's value masked,
    secrets inside the other words masked as text."""
    return _mask_words([str(a) for a in args])


def mask_argument(flag: str, value: str) -> str:
    """The value a script's argument ``flag`` (``--api-key``, ``-k``, ``lr`` of ``lr=0.1``) is
    set to, as shown."""
    return MASK if is_secret_flag(flag) and value != "" else mask_text(value)


def mask_value(key: str, value: object, depth: int = 0) -> object:
    """``value`` of the config key ``key`` with its secrets masked, its shape kept: a value whose
    key names a secret becomes :data:`MASK` (empty values, true and false stay), a mapping's
    values are masked by their own keys, a list of strings as a script's arguments, text as
    text."""
    if value is None or isinstance(value, bool):
        return value
    if is_secret(key):
        return value if value in ("", [], {}) else MASK
    if depth >= MAX_DEPTH:
        return MASK
    if isinstance(value, Mapping):
        return {k: mask_value(str(k), v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, str) for v in value):
            return mask_args(value)
        return [mask_value("", v, depth + 1) for v in value]
    if isinstance(value, str):
        return mask_text(value)
    return value
