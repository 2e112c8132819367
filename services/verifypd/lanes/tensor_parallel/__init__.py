"""The rank processes of a tensor-parallel target (`--tensor-parallel N`): rank 0 drives, followers replay.

assembly.py  rank 0's shard and started followers (load_tensor_parallel), a follower's options
ranks.py     spawning and joining the follower ranks
follower.py  a follower rank's process (`python -m verifypd.lanes.tensor_parallel.follower`)
calls.py     the calls rank 0 sends its followers (torch-free wire format)
all_reduce.py  --tp-all-reduce: the ranks agree on, map and self-check the custom all-reduce
"""
