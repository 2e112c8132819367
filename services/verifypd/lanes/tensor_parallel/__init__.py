"""The rank processes of a tensor-parallel target (`--tensor-parallel N`): rank 0 drives, followers replay.

ranks.py     spawning and joining the follower ranks
follower.py  a follower rank's process (`python -m verifypd.lanes.tensor_parallel.follower`)
calls.py     the calls rank 0 sends its followers (torch-free wire format)
"""
