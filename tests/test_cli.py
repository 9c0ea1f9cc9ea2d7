import subprocess
import sys

import pytest

from slotroute.cli import main


def slotroute(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slotroute.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_top_level_help_lists_every_subcommand():
    out = slotroute("--help")
    assert out.returncode == 0
    assert "bench" in out.stdout and "demo" in out.stdout


@pytest.mark.parametrize(("command", "option"), [("bench", "--preset"), ("demo", "--model")])
def test_subcommand_help_shows_the_subcommands_own_options(command, option):
    out = slotroute(command, "--help")
    assert out.returncode == 0, out.stderr
    assert f"slotroute {command}" in out.stdout and option in out.stdout


def test_unknown_subcommand_is_an_error_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["serve-everything"])
    assert excinfo.value.code == 2
    assert "bench" in capsys.readouterr().err


def test_bench_help_does_not_import_torch_or_vllm():
    code = (
        "import sys; from slotroute.cli import main\n"
        "try: main(['bench', '--help'])\n"
        "except SystemExit: pass\n"
        "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules), file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stderr.strip().endswith("[]")


@pytest.mark.parametrize(("met", "check", "status"), [(False, True, 1), (False, False, 0), (True, True, 0)])
def test_bench_check_exits_1_only_when_a_target_is_missed(monkeypatch, met, check, status):
    import argparse

    from slotroute.tools import bench

    row = bench.Row("store", 1e-6, 384, 1e-6, 2e-6, ">= 2x baseline", met)
    monkeypatch.setattr(bench, "bench_preset", lambda spec, rounds, progress: [row])
    monkeypatch.setattr(bench, "demand_paging_report", lambda spec: "")
    monkeypatch.setattr(bench, "first_write_report", lambda spec, rounds: "")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--preset", "qwen3-30b-a3b", "--rounds", "1"] + (["--check"] if check else []))
    assert bench.run(args) == status
