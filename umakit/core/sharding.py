"""The ways one model is split across the ranks of a distributed run (`umakit.backends.distributed` runs them).

Kept apart from the engines so that the CLI can offer ``--parallel`` without importing any of them.
"""

TENSOR = "tensor"  # every layer split across the ranks
PIPELINE = "pipeline"  # each rank holds a run of whole layers
MODES = (TENSOR, PIPELINE)
