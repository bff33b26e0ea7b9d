"""`umakit compare` on recorded bench JSON fixtures (fixture numbers are illustrative)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from umakit.cli.main import main
from umakit.bench import load_record
from umakit.bench.compare import compare, limiting_link
from umakit.errors import InvalidArgumentError

FIXTURES = Path(__file__).parents[1] / "support" / "fixtures"
MAC, PC = FIXTURES / "bench_mac.json", FIXTURES / "bench_pc_offload.json"


def test_measured_then_predicted_columns():
    cols = compare([load_record(MAC), load_record(PC)])
    assert [c.kind for c in cols[:2]] == ["measured", "measured"]
    assert all(c.kind == "predicted" for c in cols[2:]) and len(cols) == 6
    assert cols[0].limiting_link == "unified memory" and cols[1].limiting_link == "PCIe"
    assert cols[0].decode_tps == 310.0 and cols[1].achieved_gbps == 17.0
    m2 = next(c for c in cols[2:] if "M2 Ultra" in c.label)
    assert m2.limiting_link == "unified memory" and m2.fits and m2.peak_gbps == 800


def test_limiting_link_without_offload_on_nvidia_is_vram():
    rec = load_record(PC)
    del rec["offload"]
    assert limiting_link(rec) == "VRAM"


def test_different_models_are_refused(tmp_path):
    other = json.loads(PC.read_text())
    other["model"]["name"] = "something-else"
    path = tmp_path / "o.json"
    path.write_text(json.dumps(other))
    with pytest.raises(InvalidArgumentError, match="different models or quantizations"):
        compare([load_record(MAC), load_record(path)])


def test_cli_table_labels_and_units():
    r = CliRunner().invoke(main, ["compare", str(MAC), str(PC)])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("SmolLM2-135M-Instruct")
    assert "MEASURED" in r.stdout and "PREDICTED" in r.stdout
    assert any(line.startswith("decode tok/s") and "310.0" in line and "150.0" in line for line in lines)
    assert any(line.startswith("limiting link") and "PCIe" in line and "unified memory" in line for line in lines)
    assert "Only one machine measured" not in r.stdout


def test_cli_single_record_says_the_rest_is_predicted(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "c.png"
    r = CliRunner().invoke(main, ["compare", str(MAC), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert "Only one machine measured: the other columns are predicted ceilings" in r.stdout
    assert png.stat().st_size > 1000


def test_cli_missing_file_is_one_line():
    r = CliRunner().invoke(main, ["compare", "/no/such.json"])
    assert r.exit_code == 2 and "does not exist" in r.output
