"""Process launch: the `serve` / `lane` / `generate --server` commands.

cli.py          the commands: `serve` resolves its arguments into CoreOptions and spawns the engine
                core with them (verifypd.core.process), then serves the gateway
serve_args.py   the arguments of serve and lane and what they resolve to (EngineOptions, CoreOptions)
lane_devices.py `serve --lane-devices`: a device per split lane process, parsed and checked

Lane processes and their supervision live in verifypd.lanes (processes.py, supervisor.py): the
engine core runs them.
"""
