"""A quantization method of umakit's own registered with transformers, so that ``from_pretrained`` loads a
checkpoint transformers cannot read into umakit's forms: its quantizer's hooks swap modules for holders of the
checkpoint's tensors before the weights load (the loader fills them by name), and for the torch engine's
execution forms after. mapped.py (MLX's layout) and mxfp4.py (gpt-oss's MXFP4 experts) each register one."""

from __future__ import annotations

from typing import Callable

from torch import nn


def register(method: str, before: Callable[[nn.Module, object], None], after: Callable[[nn.Module, object], None],
             described: Callable[[object], dict] = lambda config: {}):
    """The config class of ``method``, registered with the installed transformers once: made with keyword fields
    (its attributes), handed to ``before(model, config)`` and ``after(model, config)``; ``described(config)``:
    what its ``to_dict`` shows beside the method."""
    from transformers.quantizers import auto
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    if method in auto.AUTO_QUANTIZER_MAPPING:
        return auto.AUTO_QUANTIZATION_CONFIG_MAPPING[method]

    @auto.register_quantization_config(method)
    class Config(QuantizationConfigMixin):
        def __init__(self, **fields):
            self.quant_method = method
            self.__dict__.update(fields)

        def to_dict(self):
            return {"quant_method": method, **described(self)}

        def __deepcopy__(self, memo):
            return self  # the load's own state (its holders, an open packing), shared by the model's config copies

    @auto.register_quantizer(method)
    class Quantizer(HfQuantizer):
        requires_calibration = False

        def validate_environment(self, *args, **kwargs):
            return None

        def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
            return False

        def _process_model_before_weight_loading(self, model, **kwargs):
            before(model, self.quantization_config)

        def _process_model_after_weight_loading(self, model, **kwargs):
            after(model, self.quantization_config)
            return model

        def is_serializable(self):
            return False

        @property
        def is_trainable(self) -> bool:
            return False

    return Config


def put(model: nn.Module, path: str, module: nn.Module) -> None:
    """Set the submodule at ``path`` to ``module``."""
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)
