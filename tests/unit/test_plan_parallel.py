"""`umakit plan --nodes N --link NAME`: the tensor/pipeline arithmetic and its CLI."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from umakit.plan import planner as P
from umakit.plan import parallel as PP
from umakit.cli.main import main
from umakit.errors import InvalidArgumentError


@pytest.fixture(scope="module")
def big():
    config = P.load_preset("llama-3.1-70b")
    plan = P.plan_model(config, name="70b", devices=P.resolve_devices(["M2 Ultra 192GB"]), context=4096)
    return config, plan


def test_tensor_parallel_halves_the_layers_and_pays_two_all_reduces_per_layer(big):
    config, plan = big
    tp, pp = PP.plan_parallel(plan, config, 2, "tb5-ring")
    assert tp.mode == "tensor" and pp.mode == "pipeline"
    assert tp.messages_per_token == 4 * plan.num_layers + PP.UMAKIT_MESSAGES  # 2 all-reduces x 2 ring hops
    assert tp.link_bytes_per_token == 2 * plan.num_layers * config["hidden_size"] * PP.ACTIVATION_BYTES
    assert plan.total_bytes / 2 < tp.node_bytes < plan.total_bytes  # the embeddings and head stay whole
    assert tp.node_read_bytes < 0.55 * plan.step_read_bytes
    assert tp.ceiling_tps > tp.single_node_tps  # each node reads half: faster, less the link's share
    assert 0 < tp.link_share < 1


def test_a_single_stream_gains_memory_not_speed_from_pipelining(big):
    config, plan = big
    pp = PP.plan_parallel(plan, config, 4, "10gbe")[1]
    assert pp.messages_per_token == 4
    assert pp.node_bytes < plan.total_bytes / 2
    assert pp.ceiling_tps < pp.single_node_tps
    assert pp.ceiling_tps == pytest.approx(pp.single_node_tps, rel=0.01)


def test_latency_costs_tensor_parallel_more_than_bandwidth(big):
    config, plan = big
    ring = PP.plan_parallel(plan, config, 2, "tb5-ring")[0]
    rdma = PP.plan_parallel(plan, config, 2, "tb5-rdma")[0]
    assert rdma.ceiling_tps > ring.ceiling_tps
    assert ring.link_share > 2 * rdma.link_share


def test_the_whole_model_fits_only_when_split():
    config = P.load_preset("llama-3.1-405b")
    plan = P.plan_model(config, bits=4, devices=P.resolve_devices(["M2 Ultra 192GB"]), context=4096)
    assert not plan.devices[0].fits
    assert all(p.fits for p in PP.plan_parallel(plan, config, 2, "tb5-rdma"))


def test_unknown_links_and_single_nodes_are_refused(big):
    config, plan = big
    with pytest.raises(InvalidArgumentError, match="unknown link 'carrier-pigeon'; choose from tb4-ring"):
        PP.plan_parallel(plan, config, 2, "carrier-pigeon")
    with pytest.raises(InvalidArgumentError, match="--nodes must be at least 2"):
        PP.plan_parallel(plan, config, 1)


def test_cli_prints_both_modes_and_writes_them_in_json():
    args = ["plan", "--preset", "llama-3.1-70b", "--device", "M2 Ultra 192GB", "--nodes", "2", "--link", "tb4-ring"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "2 nodes over tb4-ring" in r.output
    assert "tensor" in r.output and "pipeline" in r.output and "gains memory, not speed" in r.output
    r = CliRunner().invoke(main, [*args, "--json"])
    modes = [p["mode"] for p in json.loads(r.output)["parallel"]]
    assert modes == ["tensor", "pipeline"]
    r = CliRunner().invoke(main, ["plan", "--preset", "llama-3.1-70b", "--link", "tb4-ring"])
    assert r.exit_code != 0 and "give --nodes too" in r.output
