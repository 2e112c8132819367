"""Process launch and supervision: the `serve` / `lane` / `generate --server` commands.

cli.py          the commands (the gateway process of `serve` spawns the engine core)
serve_args.py   the arguments of serve and lane and the engine options they build
launcher.py     spawning lane processes for `serve --topology split`
supervisor.py   restarting lanes that die; crash-loop detection
"""
