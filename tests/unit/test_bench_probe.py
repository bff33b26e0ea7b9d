"""`umakit bench --probe`: the local device's bandwidth measured again on demand and cached."""

import json

from click.testing import CliRunner

from umakit.hardware import probes


def test_bench_probe_remeasures_and_caches(tmp_path, monkeypatch):
    from umakit.cli.bench_cmd import bench

    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path))
    figure = [13.0]  # a busy machine, then a quiet one
    monkeypatch.setattr(probes, "cpu_gbps", lambda index=0: figure[0])
    monkeypatch.setattr(probes, "h2d_gbps", lambda index=0, kind="cpu", pinned=True: 9.0)
    monkeypatch.setattr(probes.time, "sleep", lambda s: None)
    first = CliRunner().invoke(bench, ["--probe", "--device", "cpu"])
    assert first.exit_code == 0, first.output
    assert "peak bandwidth 13.0 GB/s (measured); host link 9.0 GB/s (measured)" in first.output
    figure[0] = 24.5
    second = CliRunner().invoke(bench, ["--probe", "--device", "cpu"])  # measured again, not read back
    assert second.exit_code == 0 and "peak bandwidth 24.5 GB/s (measured)" in second.output
    (entry,) = json.loads((tmp_path / "hardware.json").read_text())["entries"].values()
    assert entry["peak_bandwidth_gbps"] == 24.5
