"""What a torch engine holds, in bytes: the weights resident on its device (streamed layers and routed experts
kept in host memory left out, a tied table counted once) and the `WeightInfo` the protocol reports of them."""

from __future__ import annotations

from typing import Iterator

from torch import nn

from umakit.backends import common
from umakit.backends.base import WeightInfo
from umakit.backends.torch import quant
from umakit.backends.torch.load.loader import layer_of, named_tensors


def resident_tensor_bytes(model: nn.Module, experts) -> Iterator[tuple[str, int]]:
    """(name, bytes) of every weight ``model`` holds on its device for good; ``experts``: its `ExpertStreamer`,
    or None."""
    seen: set[int] = set()
    streamer = model.streamer
    for name, t in named_tensors(model):
        if streamer is not None and layer_of(name) in streamer.position:
            continue  # views into the streaming ring
        if experts is not None and layer_of(name) in experts.position and ".switch_mlp." in name:
            continue  # routed experts held in host memory
        if t.data_ptr() in seen:
            continue  # a tied head shares the embedding's storage
        seen.add(t.data_ptr())
        yield name, t.numel() * t.element_size()
    for name, m in model.named_modules():
        if isinstance(m, quant.Fp16Linear):  # FBGEMM's packed weights are not tensors
            yield name, m.packed_nbytes


def weight_info(model: nn.Module, experts, params: int, kv_bytes_per_token: int, quantization: dict | None,
                execution: str, offload) -> WeightInfo:
    """``model``'s `WeightInfo`: its resident bytes by category, plus the host copies of what streams."""
    by_cat: dict[str, int] = {}
    resident = list(resident_tensor_bytes(model, experts))
    for name, n in resident:
        by_cat[common.category(name)] = by_cat.get(common.category(name), 0) + n
    streamer = model.streamer
    if streamer is not None:  # the host copies of the streamed layers
        for cat, n in streamer.bytes_by_category.items():
            by_cat[cat] = by_cat.get(cat, 0) + n
    routed = sum(n for name, n in resident if common.is_routed_expert(name))
    if experts is not None:
        by_cat["mlp"] = by_cat.get("mlp", 0) + experts.host_bytes
        routed += experts.host_bytes
    a = model.args
    return common.weight_info(by_cat, params, a.vocab_size, kv_bytes_per_token, quantization, execution,
                              offload.streamed_bytes if offload is not None else 0,
                              routed, a.num_experts_per_tok / a.num_experts if a.num_experts else 1.0)
