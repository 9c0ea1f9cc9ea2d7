"""``benchmarks/gpu_device.sh``'s transfers to and from the device machine.

``wheel``: a wheel that reaches the device machine in parts, one a call
(``benchmarks/wheel_parts.sh``), is installed by the call that brings its last part and
only if its bytes are the ones cut here; a part short stages and installs nothing.
``cache``: the compile caches come back in parts and unpack on a fresh machine, and
caches larger than a call brings back are cut off, leaving no parts."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_device.sh"
STAGE = Path("/tmp/wheel_stage")


@pytest.fixture
def wheel(tmp_path):
    """A small ``vllm`` wheel cut into three parts as wheel_parts.sh lays them out:
    (its name, the parts' folders, its version)."""
    version = f"9.9.9+t{uuid.uuid4().hex[:8]}"
    name = f"vllm-{version}-py3-none-any.whl"
    info = f"vllm-{version}.dist-info"
    body = tmp_path / name
    with zipfile.ZipFile(body, "w") as z:
        z.writestr("vllm/__init__.py", f"__version__ = {version!r}\n" + "# padding\n" * 400)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    data = body.read_bytes()
    folder = tmp_path / "vw"
    (folder / "s").mkdir(parents=True)
    third = len(data) // 3 + 1
    parts = []
    for i in range(3):
        part = folder / f"w{i:02d}"
        part.mkdir()
        (part / f"w{i:02d}").write_bytes(data[i * third:(i + 1) * third])
        parts.append(part)
    digest = hashlib.sha256(data).hexdigest()
    (folder / "s" / "wheel.tsv").write_text(f"{name}\t{digest}\t3\n")
    yield name, parts, version
    shutil.rmtree(STAGE / name, ignore_errors=True)
    Path(f"/tmp/{name}").unlink(missing_ok=True)


def device(*args, out, **env):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
                               "OUT": str(out), **env}, timeout=120)


def test_the_call_with_the_last_part_installs_the_wheel(wheel, tmp_path):
    name, parts, version = wheel
    site = tmp_path / "site"
    for i, part in enumerate(parts[:-1]):
        done = device("wheel", part, site, out=tmp_path / "out")
        assert done.returncode == 0, done.stderr
        assert f"{i + 1} of 3 parts staged" in done.stdout
        assert not site.exists()
    done = device("wheel", parts[-1], site, out=tmp_path / "out")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"vllm {version}" in done.stdout
    assert (site / "vllm" / "__init__.py").exists()


def test_a_part_that_differs_installs_nothing(wheel, tmp_path):
    name, parts, _ = wheel
    first = parts[0] / "w00"
    first.write_bytes(b"\0" + first.read_bytes()[1:])
    site = tmp_path / "site"
    for part in parts:
        done = device("wheel", part, site, out=tmp_path / "out")
    assert done.returncode == 1
    assert f"wheel {name}: its bytes differ from its sha256" in done.stdout
    assert not site.exists()


def test_compile_caches_come_back_in_parts_and_unpack_on_another_machine(tmp_path):
    machine = tmp_path / "machine"
    kernel = machine / "tmp" / "torchinductor_root" / "ab" / "kernel.py"
    kernel.parent.mkdir(parents=True)
    kernel.write_text("def kernel(): pass\n" * 1000)
    (machine / "root" / ".cache" / "vllm").mkdir(parents=True)
    (machine / "root" / ".cache" / "vllm" / "graph.bin").write_bytes(bytes(range(256)) * 64)
    saved = device("cache", "save", out=tmp_path / "out", CACHE_ROOT=str(machine))
    parts = sorted((tmp_path / "out" / "cache").glob("c.tgz.*"))
    assert saved.returncode == 0 and parts and "bytes" in saved.stdout, saved.stdout + saved.stderr

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    restored = device("cache", "restore", tmp_path / "out" / "cache", out=tmp_path / "out", CACHE_ROOT=str(fresh))
    assert restored.returncode == 0, restored.stderr
    assert (fresh / "tmp" / "torchinductor_root" / "ab" / "kernel.py").read_text() == kernel.read_text()
    assert (fresh / "root" / ".cache" / "vllm" / "graph.bin").read_bytes() == bytes(range(256)) * 64


def test_compile_caches_larger_than_what_comes_back_are_cut_off_and_leave_no_parts(tmp_path):
    machine = tmp_path / "machine"
    cache = machine / "root" / ".triton" / "cache"
    cache.mkdir(parents=True)
    for i in range(4):  # 80 MB that gzip cannot shrink: over the 60 MB a call brings back
        (cache / f"blob{i}").write_bytes(os.urandom(20_000_000))
    saved = device("cache", "save", out=tmp_path / "out", CACHE_ROOT=str(machine))
    assert saved.returncode == 0 and "too large to come back" in saved.stdout, saved.stdout + saved.stderr
    assert not (tmp_path / "out" / "cache").exists()
    (tmp_path / "empty_machine").mkdir()
    empty = device("cache", "save", out=tmp_path / "out", CACHE_ROOT=str(tmp_path / "empty_machine"))
    assert empty.stdout.strip() == "compile caches: none"
