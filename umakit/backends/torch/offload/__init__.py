"""Weights that live in host memory and cross to the device on every step (the plan: `umakit.plan.placement`).

- `layers`: whole layers streamed through a ring of device buffers;
- `experts`: a mixture-of-experts model's routed experts, the used ones copied in, with a device cache.
"""
