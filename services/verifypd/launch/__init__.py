"""Process launch: the `serve` / `lane` / `generate --server` commands.

cli.py                registers the three commands on verifypd.cli's parser
serve.py              `serve`: checks its arguments, resolves them into CoreOptions, spawns the engine
                      core with them (verifypd.core.process), then serves the gateway
lane.py               `lane`: one lane server of the split topology
generate_remote.py    `generate --server`: one prompt sent to a running server
signals.py            how serve and lane wait for SIGTERM/SIGINT
serve_args.py         the arguments of serve and lane and what they resolve to (EngineOptions, CoreOptions)
lane_devices.py       `serve --lane-devices`: a device per split lane process, parsed and checked

Lane processes and their supervision live in verifypd.lanes (processes.py, supervisor.py): the
engine core runs them.
"""
