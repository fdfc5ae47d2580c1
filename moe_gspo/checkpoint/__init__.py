"""Checkpoints and what reads them: atomic, verified, rotating, resharding checkpoints (safetensors + JSON, nothing
unpickled), the run directory's lock, the disk-space check, and the export of a checkpoint as a Hugging Face folder.

    store.py          Checkpoints: save / latest / load of a run's sharded checkpoints
    sharded_state.py  the policy's and optimizer's state as megatron sharded tensors (any TP x EP x DP layout)
    sharded_io.py     those tensors to and from safetensors files, verified, with no code read from disk
    disk_space.py     a save that would not fit is refused before it starts; a full disk is one line
    run_lock.py       one run per directory
    export.py         `moe-gspo export`: a checkpoint as a Hugging Face folder, read in one process
"""
