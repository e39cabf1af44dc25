"""The GPU suite (python -m bench.gpu) runs in its CPU mode, so it works between GPU runs; the steps that carry
it to a GPU machine name exactly the wheels the device lacks."""

import json
import math
import os
import re

from bench import gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_THE_DEVICE = {"torch", "torchvision", "opencv-python-headless", "numpy", "tqdm", "pyyaml", "matplotlib"}


def test_the_quick_suite_writes_every_measurement_as_numbers(tmp_path, capsys):
    assert gpu.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["header"]["torch"] and report["quick"] is True
    assert set(report["results"]) == set(gpu.MEASUREMENTS)
    for name, result in report["results"].items():
        assert "failed" not in result, (name, result.get("failed"), result.get("trace"))
        assert result["rows"], name
        for row in result["rows"]:
            assert "failed" not in row, (name, row)
            figures = {k: v for k, v in row.items() if k.endswith("_mib") or k.startswith("estimate_over")}
            assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in figures.values()), (name, row)
    counts = report["results"]["cuda_tests"]["rows"][0]
    assert counts["tests_skipped"] > 0 and counts["tests_passed"] == 0  # no CUDA here: every CUDA test skips
    ratios = [row["estimate_over_measured"] for row in report["results"]["presets"]["rows"]]
    assert all(0.5 < r < 2.0 for r in ratios), ratios  # the estimate is near the real step, not just a number
    backed_off = report["results"]["oom_backoff"]["rows"][0]
    assert backed_off["finished"] is True and backed_off["settled_batch"] < backed_off["batch"]
    streaming = report["results"]["inference"]["rows"][-1]
    assert streaming["run"].startswith("streaming 2000 vs 200 frames") and 0.9 < streaming["peak_ratio"] < 1.1
    markdown = (tmp_path / "gpu.md").read_text()
    assert markdown.startswith("# GPU suite\n\ndevice: CPU") and all(
        f"## {name}" in markdown for name in gpu.MEASUREMENTS
    )
    printed = capsys.readouterr().out
    assert all(re.search(rf"^{name}: \d+ rows \(", printed, re.M) for name in gpu.MEASUREMENTS)


def test_a_failing_measurement_is_recorded_with_its_reason_and_the_suite_goes_on(tmp_path, monkeypatch):
    def broken(suite):
        raise RuntimeError("CUDA out of memory (simulated)\nwith a second line")

    monkeypatch.setitem(gpu.MEASUREMENTS, "broken", broken)
    assert gpu.main(["--quick", "--out", str(tmp_path), "--only", "broken,cuda_tests"]) == 0
    results = json.loads((tmp_path / "gpu.json").read_text())["results"]
    assert results["broken"]["failed"] == "CUDA out of memory (simulated) with a second line"
    assert results["cuda_tests"]["rows"]  # the next one ran
    assert "failed: CUDA out of memory (simulated) with a second line" in (tmp_path / "gpu.md").read_text()


def test_the_carrying_steps_name_the_wheels_the_device_lacks():
    """bench/README.md lists the wheels to carry: every requirement the device machine does not have, no more."""
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        required = {re.split(r"[<>=!~\[ ]", line.strip())[0].lower() for line in f if line.strip()[:1].isalpha()}
    with open(os.path.join(ROOT, "bench", "README.md")) as f:
        text = f.read()
    listed = set(re.search(r"^Wheels such a machine lacks: (.+)$", text, re.M).group(1).replace(",", " ").split())
    assert listed == required - ON_THE_DEVICE
    for wheel in listed:  # each is downloaded and installed by the steps
        assert f"download {wheel} " in text and f"--find-links .whl {wheel}" in text


def test_the_report_is_written_after_each_measurement_and_presets_can_be_chosen(tmp_path, monkeypatch, capsys):
    seen = {}

    def second(suite):  # by now the first measurement is on disk: a run stopped here keeps it
        seen["on_disk"] = json.loads((tmp_path / "gpu.json").read_text())["results"]
        seen["presets"] = suite.presets()
        return [{"x": 1}]

    monkeypatch.setitem(gpu.MEASUREMENTS, "second", second)
    assert (
        gpu.main(["--quick", "--out", str(tmp_path), "--only", "cuda_tests,second", "--presets", "gtx1650.yaml"]) == 0
    )
    assert list(seen["on_disk"]) == ["cuda_tests"] and seen["on_disk"]["cuda_tests"]["rows"]
    assert seen["presets"] == ["gtx1650.yaml"]
    try:
        gpu.main(["--quick", "--out", str(tmp_path), "--presets", "rtx9090.yaml"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("an unknown preset ran")
    assert "--presets: rtx9090.yaml: no such preset in configs/" in capsys.readouterr().err
