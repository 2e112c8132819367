"""What every benchmark result records: the command, git revision, date and device."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys


def git_revision() -> str:
    """VERIFYPD_GIT_REV wins: a copied tree's own git metadata can name another commit."""
    try:
        return (
            os.environ.get("VERIFYPD_GIT_REV")
            or subprocess.check_output(
                ["git", "rev-parse", "HEAD"],
                text=True,
                stderr=subprocess.DEVNULL,
                cwd=os.path.dirname(os.path.abspath(__file__)),
            ).strip()
        )  # this tree's, from any working directory
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"cpu: {cpu} ({os.cpu_count()} cores)"


def metadata() -> dict:
    return {
        "command": " ".join(["python"] + sys.argv),
        "git_revision": git_revision(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_name(),
    }


def write_result(out_dir: str | None, name: str, result: dict) -> None:
    """Writes `result` (with metadata()) as OUT_DIR/NAME_<device>.json, device "cpu" or the GPU's last
    word (e.g. h200); no-op without a directory."""
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    device = result["device"]
    path = os.path.join(out_dir, f"{name}_{'cpu' if device.startswith('cpu') else device.split()[-1].lower()}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)
