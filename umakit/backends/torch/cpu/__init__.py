"""The CPU decode step in one C++ call through torch's own kernels (`fused`), and its one-time build (`build`,
torch.utils.cpp_extension) of ``csrc/fused_decode.cpp``."""
