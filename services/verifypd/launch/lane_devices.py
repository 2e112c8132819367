"""`serve --lane-devices prefill=cuda:0,verify=cuda:1,draft=cuda:1`: a device per split lane process.

Parsed by argparse (`parse_lane_devices`: syntax, lane names) and checked against this machine before
anything starts (`lane_devices_error`: the devices exist, the flags fit together), each failure one
line naming the flag. Each lane process gets its device as its own `--device` (lanes/processes.py),
and sees every GPU of the host: CUDA_VISIBLE_DEVICES is not narrowed per child, because the peer
KV transport maps the owner's pool from another GPU, which must be visible to the prefill lane.
Torch is imported only to count the devices.
"""

from __future__ import annotations

import argparse
import re

from verifypd.domain.drafts import DraftSpecError, parse_draft

LANE_NAMES = ("prefill", "draft", "verify")  # the lanes of verifypd.lanes.processes, by name
_DEVICE = re.compile(r"^(cpu|cuda:\d+|\d+)$")


def parse_lane_devices(text: str) -> dict[str, str]:
    """ "prefill=cuda:0,verify=1" -> {"prefill": "cuda:0", "verify": "cuda:1"} (argparse type)."""
    devices: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lane, sep, device = part.partition("=")
        lane, device = lane.strip(), device.strip()
        if not sep or lane not in LANE_NAMES:
            names = ", ".join(LANE_NAMES)
            raise argparse.ArgumentTypeError(f"expected LANE=DEVICE with LANE one of {names}; got {part!r}")
        if not _DEVICE.match(device):
            raise argparse.ArgumentTypeError(f"{lane}: expected cpu, cuda:N or N; got {device!r}")
        if lane in devices:
            raise argparse.ArgumentTypeError(f"{lane} is named twice")
        devices[lane] = f"cuda:{device}" if device.isdigit() else device
    if not devices:
        raise argparse.ArgumentTypeError("name at least one lane, e.g. prefill=cuda:0,verify=cuda:1")
    return devices


def lane_devices_error(
    devices: dict[str, str], topology: str, tensor_parallel: int, draft: str, cuda_count: int | None = None
) -> str | None:
    """Why these --lane-devices cannot run here (one line, naming the flag); None: they can.
    `cuda_count`: the CUDA devices of this machine (None: ask torch)."""
    if not devices:
        return None
    if topology != "split":
        return "--lane-devices places the lane processes of --topology split; colocated lanes share one device"
    if tensor_parallel != 1:
        return "--lane-devices with --tensor-parallel: the ranks take consecutive GPUs from --device; give one of them"
    try:
        feature_draft = parse_draft(draft).kind == "eagle"
    except DraftSpecError:
        feature_draft = False  # the --draft check reports it
    if feature_draft:  # the lanes refuse it too; said here before any model loads
        return (
            f"--lane-devices with --draft {draft}: a feature draft reads the target's hidden states in "
            "the target's process, so it runs colocated only"
        )
    wanted = sorted({int(d.split(":")[1]) for d in devices.values() if d.startswith("cuda:")})
    if not wanted:
        return None
    if cuda_count is None:
        import torch

        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [n for n in wanted if n >= cuda_count]
    if missing:
        lane = next(lane for lane, d in devices.items() if d == f"cuda:{missing[0]}")
        have = f"cuda:0..cuda:{cuda_count - 1}" if cuda_count else "no CUDA device"
        return f"--lane-devices {lane}=cuda:{missing[0]}: this machine has {have}"
    return None
