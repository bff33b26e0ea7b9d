"""`umakit plan --nodes N --link NAME`: one model over several machines, tensor and pipeline parallel.

Arithmetic on a finished `umakit.plan.planner.Plan`, nothing measured. Decode is
bandwidth-bound: a step takes what each node reads over its memory bandwidth
plus what the step waits on the link. Tensor parallel splits every layer's
matrices (and KV heads) over the nodes and all-reduces the hidden state twice
per layer (after attention, after the MLP); pipeline parallel gives each node
contiguous layers and passes the hidden state from stage to stage, so a single
stream visits every node in turn: it gains memory, not speed.
"""

from __future__ import annotations

from dataclasses import dataclass

from umakit.errors import InvalidArgumentError
from umakit.hardware import DeviceInfo
from umakit.plan.planner import PCIE_EFFECTIVE_GBPS, Plan

ACTIVATION_BYTES = 2  # the hidden state crosses the link in the GPU's half precision
UMAKIT_MESSAGES = 2  # per token: rank 0's "next step" message and the sampled token's broadcast (one hop each)


@dataclass(frozen=True)
class Link:
    """A link between nodes: what one message costs."""

    name: str
    gbps: float  # effective GB/s (10^9 bytes/s), one direction
    latency_us: float  # one small message, end to end, software included
    source: str


# Nominal rates are the standards'; effective rates and latencies are typical figures for the software that
# drives them (TCP for the ring backend, RDMA verbs for JACCL, NCCL for NVLink and PCIe). They are estimates:
# measure yours with `umakit bench --parallel tensor` (its communication time per token).
LINKS = {link.name: link for link in (
    # Thunderbolt 4: 40 Gb/s (Intel/USB-IF TB4 spec). MLX's ring backend runs TCP over the Thunderbolt bridge
    # (ml-explore.github.io/mlx/build/html/usage/distributed.html); TCP there reaches roughly half the line rate.
    Link("tb4-ring", 2.5, 60.0, "TB4 40 Gb/s; TCP ring (MLX ring backend), ~half of line rate, ~60 us a message"),
    # Thunderbolt 5: 80 Gb/s both ways (120 Gb/s boost one way), Apple's Mac Studio (M3 Ultra) and M4 Pro/Max specs.
    Link("tb5-ring", 5.0, 50.0, "TB5 80 Gb/s; TCP ring (MLX ring backend), ~half of line rate, ~50 us a message"),
    # RDMA over Thunderbolt 5 (macOS 26.2+, Apple TN3205), MLX's JACCL backend, which MLX's docs call the low-latency
    # backend "necessary for things like tensor parallelism".
    Link("tb5-rdma", 8.0, 8.0, "TB5 80 Gb/s; RDMA (MLX JACCL backend, Apple TN3205), ~8 us a message"),
    # Ethernet: IEEE 802.3 line rates (10/25/100 Gb/s = 1.25/3.125/12.5 GB/s), TCP's framing taking ~6%.
    Link("10gbe", 1.17, 30.0, "10 GbE (IEEE 802.3ae) over TCP, ~30 us a message"),
    Link("25gbe", 2.9, 25.0, "25 GbE (IEEE 802.3by) over TCP, ~25 us a message"),
    Link("100gbe", 11.0, 10.0, "100 GbE (IEEE 802.3ba) with RoCE RDMA, ~10 us a message"),
    # NVLink 4 (H100 SXM): 900 GB/s bidirectional per GPU (NVIDIA H100 datasheet), 450 GB/s each way.
    Link("nvlink", 450.0, 5.0, "NVLink 4 (H100 SXM datasheet: 900 GB/s both ways); NCCL, ~5 us a message"),
    # PCIe peer to peer, x16: the effective rates umakit's offload plan uses (plan.PCIE_EFFECTIVE_GBPS).
    Link("pcie4-p2p", PCIE_EFFECTIVE_GBPS[4], 10.0, "PCIe 4.0 x16 peer to peer (32 GB/s nominal); NCCL, ~10 us"),
    Link("pcie5-p2p", PCIE_EFFECTIVE_GBPS[5], 10.0, "PCIe 5.0 x16 peer to peer (64 GB/s nominal); NCCL, ~10 us"),
)}
DEFAULT_LINK = "tb5-rdma"


@dataclass(frozen=True)
class ParallelPlan:
    """One mode (tensor or pipeline) of a model over ``nodes`` copies of one device."""

    mode: str
    nodes: int
    device: str
    link: str
    node_bytes: int  # the fullest node's resident bytes: weights, KV cache, working memory
    fits: bool
    node_read_bytes: int  # what the busiest node reads per token
    link_bytes_per_token: int  # what one node sends per token
    messages_per_token: int  # link hops a token waits on, in sequence
    compute_s: float  # per token, reading memory (summed over stages for pipeline)
    link_s: float  # per token, waiting on the link
    ceiling_tps: float
    single_node_tps: float  # the same device alone, were it to hold the model

    @property
    def link_share(self) -> float:
        return self.link_s / (self.compute_s + self.link_s)


def find_link(name: str) -> Link:
    if name not in LINKS:
        raise InvalidArgumentError(f"unknown link {name!r}; choose from {', '.join(LINKS)}")
    return LINKS[name]


def _bytes_of(plan: Plan, name: str, read: bool = False) -> int:
    c = next(c for c in plan.categories if c.name == name)
    return c.read_bytes_per_step if read else c.bytes


def tensor_parallel(plan: Plan, hidden_size: int, nodes: int, device: DeviceInfo, link: Link) -> ParallelPlan:
    """Every layer's matrices and KV heads split over ``nodes``; embeddings, head and norms on every node."""
    split = _bytes_of(plan, "attention") + _bytes_of(plan, "mlp")
    whole = plan.weight_bytes - split
    split_read = _bytes_of(plan, "attention", True) + _bytes_of(plan, "mlp", True)
    node_bytes = round(split / nodes + whole + plan.kv_bytes / nodes + plan.working_bytes)
    node_read = round(split_read / nodes + (plan.weight_read_bytes_per_step - split_read) + plan.kv_bytes / nodes)
    # A ring all-reduce of the hidden state: 2(N-1) hops, each carrying 1/N of it.
    message = hidden_size * ACTIVATION_BYTES * plan.batch
    reduces = 2 * plan.num_layers
    hops = reduces * 2 * (nodes - 1) + UMAKIT_MESSAGES
    sent = round(reduces * 2 * (nodes - 1) / nodes * message)
    return _finish("tensor", plan, nodes, device, link, node_bytes, node_read, sent, hops,
                   node_read / (device.peak_bandwidth_gbps * 1e9))


def pipeline_parallel(plan: Plan, hidden_size: int, nodes: int, device: DeviceInfo, link: Link) -> ParallelPlan:
    """Contiguous layers per node; the first holds the embedding, the last the head; the token loops back."""
    embedding, head = _bytes_of(plan, "embedding"), _bytes_of(plan, "head")
    layers = plan.weight_bytes - embedding - head  # the layers' weights (and the final norm)
    node_bytes = round(layers / nodes + max(embedding, head) + plan.kv_bytes / nodes + plan.working_bytes)
    step_read = plan.weight_read_bytes_per_step + plan.kv_bytes
    message = hidden_size * ACTIVATION_BYTES * plan.batch
    # One stream: the stages run one after another, so the whole model is read once per token, in turn.
    return _finish("pipeline", plan, nodes, device, link, node_bytes, round(step_read / nodes), message, nodes,
                   step_read / (device.peak_bandwidth_gbps * 1e9))


def _finish(mode, plan, nodes, device, link, node_bytes, node_read, sent, hops, compute_s) -> ParallelPlan:
    link_s = hops * link.latency_us * 1e-6 + sent / (link.gbps * 1e9)
    single = (plan.weight_read_bytes_per_step + plan.kv_bytes) / (device.peak_bandwidth_gbps * 1e9)
    return ParallelPlan(mode=mode, nodes=nodes, device=device.name, link=link.name, node_bytes=node_bytes,
                        fits=node_bytes <= device.usable_bytes, node_read_bytes=node_read,
                        link_bytes_per_token=sent, messages_per_token=hops, compute_s=compute_s, link_s=link_s,
                        ceiling_tps=1 / (compute_s + link_s), single_node_tps=1 / single)


def plan_parallel(plan: Plan, config: dict, nodes: int, link: str = DEFAULT_LINK) -> list[ParallelPlan]:
    """Tensor and pipeline parallel over ``nodes`` of each of the plan's devices, joined by ``link``."""
    if nodes < 2:
        raise InvalidArgumentError(f"--nodes must be at least 2, got {nodes}")
    chosen = find_link(link)
    hidden = int(config.get("text_config", config)["hidden_size"])
    out = []
    for d in plan.devices:
        out.append(tensor_parallel(plan, hidden, nodes, d.device, chosen))
        out.append(pipeline_parallel(plan, hidden, nodes, d.device, chosen))
    return out
