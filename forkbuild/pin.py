"""The pin: which upstream sdist the fork is built from."""

import dataclasses
import os
import re

from . import ForkBuildError

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

PIN_FILE = "pin.toml"


@dataclasses.dataclass(frozen=True)
class Pin:
    name: str
    version: str
    sdist: str
    sha256: str
    url: str
    release: int
    mirrors: tuple = ()

    @property
    def fork_version(self):
        return f"{self.version}+fork.{self.release}"

    @property
    def tree_name(self):
        """Top-level directory inside the sdist."""
        return self.sdist[:-len(".tar.gz")]


def load(root):
    path = os.path.join(root, PIN_FILE)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ForkBuildError(f"{path}: no pin file; it names the upstream sdist the fork is built from") from None
    except tomllib.TOMLDecodeError as e:
        raise ForkBuildError(f"{path}: not valid TOML: {e}") from None
    try:
        up, fork = data["upstream"], data["fork"]
        pin = Pin(name=up["name"], version=up["version"], sdist=up["sdist"], sha256=up["sha256"].lower(),
                  url=up["url"], release=int(fork["release"]),
                  mirrors=tuple(tuple(m.split(":", 1)) for m in up.get("mirrors", ())))
    except (KeyError, TypeError, ValueError) as e:
        raise ForkBuildError(f"{path}: missing or malformed entry {e}") from None
    if not re.fullmatch(r"[0-9a-f]{64}", pin.sha256):
        raise ForkBuildError(f"{path}: sha256 must be 64 hex digits, got {pin.sha256!r}")
    if not pin.sdist.endswith(".tar.gz"):
        raise ForkBuildError(f"{path}: sdist must be a .tar.gz file name, got {pin.sdist!r}")
    if pin.release < 1:
        raise ForkBuildError(f"{path}: fork release must be >= 1")
    return pin


def write(root, pin):
    """Rewrite pin.toml for a new upstream base, keeping its comments."""
    path = os.path.join(root, PIN_FILE)
    with open(path) as f:
        text = f.read()
    for key in ("version", "sdist", "sha256", "url"):
        text = re.sub(rf'(?m)^{key} = ".*"$', f'{key} = "{getattr(pin, key)}"', text, count=1)
    text = re.sub(r"(?m)^release = \d+$", f"release = {pin.release}", text, count=1)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
