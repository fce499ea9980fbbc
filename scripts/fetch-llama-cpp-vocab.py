#!/usr/bin/env python3
"""Fetch llama.cpp's tokenizer test vocabularies and chat templates into kvgate's model cache.

The PyPI source package llama-cpp-python==0.3.36 vendors llama.cpp, whose models/ folder holds
vocabulary-only GGUF files (ggml-vocab-*.gguf) with llama.cpp's own test vectors (.inp/.out)
and models/templates/*.jinja, the chat templates of real models. kvgate's conformance tests
(runtime/tests/tokenizer_conformance.rs) read them from

    <cache>/llama-cpp-python-0.3.36/models/...

where <cache> is the folder `kvgate serve` fetches the default model into: $KVGATE_CACHE_DIR,
else $XDG_CACHE_HOME/kvgate, else ~/.cache/kvgate. The sdist is downloaded once with pip
(into <cache>/downloads), checked against its SHA-256 and the needed members extracted into a
temporary folder that is then renamed, so an interrupted run never leaves half a folder.
Running the script again when the folder exists does nothing.

pip prepares the sdist's metadata after downloading it, which installs its build backend;
`--only-binary cmake,ninja` lets those two come as wheels instead of building CMake from
source (tens of minutes) only to read a version number.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REQUIREMENT = "llama-cpp-python==0.3.36"
SDIST = "llama_cpp_python-0.3.36.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PREFIX = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
TARGET = "llama-cpp-python-0.3.36"


def cache_dir() -> Path:
    """The same resolution as runtime/src/provision.rs `cache_dir`."""
    explicit = os.environ.get("KVGATE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "kvgate"
    home = os.environ.get("HOME")
    if not home:
        sys.exit("fetch-llama-cpp-vocab: set KVGATE_CACHE_DIR, XDG_CACHE_HOME or HOME")
    return Path(home) / ".cache" / "kvgate"


def wanted(member: str) -> bool:
    """Vocabulary files with their vectors, the chat templates, and the C++ tests that
    document the expected behaviour."""
    if not member.startswith(PREFIX):
        return False
    rest = member[len(PREFIX):]
    return (
        rest.startswith("models/ggml-vocab-")
        or (rest.startswith("models/templates/") and rest.endswith(".jinja"))
        or rest in ("tests/test-chat-template.cpp", "tests/test-tokenizer-0.cpp")
    )


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    cache = cache_dir()
    target = cache / TARGET
    if (target / "models").is_dir():
        print(f"llama.cpp vocabularies: {target}")
        return
    downloads = cache / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    sdist = downloads / SDIST
    if not sdist.is_file():
        print(f"fetching {REQUIREMENT} (sdist, about 77 MB) with pip into {downloads} ...")
        subprocess.run(
            [
                sys.executable, "-m", "pip", "download", "--no-deps",
                "--disable-pip-version-check", "--no-binary", ":all:",
                "--only-binary", "cmake,ninja", "-d", str(downloads), REQUIREMENT,
            ],
            check=True,
        )
    digest = sha256(sdist)
    if digest != SHA256:
        sdist.unlink()
        sys.exit(f"fetch-llama-cpp-vocab: {sdist}: sha256 {digest}, expected {SHA256}; removed it, run again")
    partial = cache / f"{TARGET}.part.{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            if not member.isfile() or not wanted(member.name):
                continue
            dest = partial / member.name[len(PREFIX):]
            dest.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(member)
            if src is None:
                continue
            with src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out)
    try:
        partial.rename(target)
    except OSError:
        # A concurrent run finished first: its copy is the same files.
        shutil.rmtree(partial, ignore_errors=True)
        if not (target / "models").is_dir():
            raise
    print(f"llama.cpp vocabularies: {target}")


if __name__ == "__main__":
    main()
