"""load/pages.py: a packed layer's pages in the checkpoint's map are let go of, and read back the same."""

import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from umakit.backends.torch.load.pages import SourcePages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise on /proc's maps: Linux")


def resident_kb(path) -> int:
    """This process's resident KB of its maps of ``path``."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(maxsplit=1)[0] and not line.startswith(("Rss", "Size")):
            inside = line.rstrip("\n").endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


class Layer(nn.Module):
    def __init__(self, **tensors):
        super().__init__()
        for name, t in tensors.items():
            self.register_buffer(name, t)


def test_a_layers_mapped_pages_are_let_go_of_and_read_back_the_same(tmp_path):
    path = tmp_path / "model.safetensors"
    weight = torch.randint(0, 255, (1024, 1024), dtype=torch.uint8)
    save_file({"weight": weight, "scales": torch.randn(1024, 32)}, str(path))
    with safe_open(str(path), framework="pt") as f:
        layer = Layer(weight=f.get_tensor("weight"), scales=f.get_tensor("scales"))
    assert int(layer.weight.sum()) == int(weight.sum())  # every page read
    before = resident_kb(path)
    assert before >= 1024
    dropped = SourcePages().let_go(layer)
    assert dropped >= 1024 * 1024 - 2 * 4096  # the whole pages inside the tensors
    assert resident_kb(path) <= before - 1000
    assert torch.equal(layer.weight, weight)  # read again from the file


def test_anonymous_memory_is_never_let_go_of():
    layer = Layer(weight=torch.randint(0, 255, (1024, 1024), dtype=torch.uint8))
    kept = layer.weight.clone()
    assert SourcePages().let_go(layer) == 0
    assert torch.equal(layer.weight, kept)
