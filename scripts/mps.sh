#!/usr/bin/env bash
# Runs the split lanes of one GPU under the CUDA MPS daemon (docs/split.md).
#   scripts/mps.sh start    # start the daemon for this GPU (CUDA_VISIBLE_DEVICES, default 0)
#   scripts/mps.sh status   # is it running
#   scripts/mps.sh stop     # quit the daemon (start lanes again afterwards)
# Processes started while the daemon runs (with the same CUDA_MPS_PIPE_DIRECTORY) share one GPU
# context: their kernels can run concurrently instead of time-slicing. Start it before the lanes.
set -euo pipefail
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/nvidia-mps-log}
case "${1:-}" in
  start)
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d
    echo "MPS daemon started (pipe dir $CUDA_MPS_PIPE_DIRECTORY)";;
  status)
    if echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then echo running; else echo "not running"; exit 1; fi;;
  stop)
    echo quit | nvidia-cuda-mps-control && echo "MPS daemon stopped";;
  *)
    echo "usage: scripts/mps.sh start|status|stop" >&2; exit 2;;
esac
