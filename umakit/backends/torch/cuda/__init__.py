"""CUDA fast paths of the torch engine: the Triton dequantize-matvec (matvec.py) and the decode step as a CUDA
graph (graphs.py)."""
