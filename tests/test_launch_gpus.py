"""Tests of the launcher's GPU assignment (`tf_hetbatch.launch.gpus`): the `gpus` setting
parsed and checked, `nvidia-smi -L` read, and each worker process's CUDA_VISIBLE_DEVICES."""

import io
import logging
import os
import textwrap

import pytest

from tf_hetbatch.launch import launch
from tf_hetbatch.launch import __main__ as cli
from tf_hetbatch.launch.gpus import (GpuPlan, VisibleGpus, assign_gpus, cuda_visible_entries,
                                     parse_nvidia_smi_list, visible_gpus)
from helpers import our_children

FOUR = VisibleGpus(("0", "1", "2", "3"), "test list")

# `nvidia-smi -L` on a machine with a plain GPU and a GPU in MIG mode (driver >= 470 form),
# and a MIG line as drivers before 470 print it.
SMI = """\
GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-aaaa1111-0000-0000-0000-000000000000)
GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-bbbb2222-0000-0000-0000-000000000000)
  MIG 3g.20gb     Device  0: (UUID: MIG-cccc3333-0000-0000-0000-000000000000)
  MIG 1g.5gb      Device  1: (UUID: MIG-dddd4444-0000-0000-0000-000000000000)
GPU 2: A100-SXM4-40GB (UUID: GPU-eeee5555-0000-0000-0000-000000000000)
  MIG 1g.5gb Device 0: (UUID: MIG-GPU-eeee5555-0000-0000-0000-000000000000/7/0)
"""


def detect(entries=("0", "1", "2", "3"), source="test list"):
    calls = []

    def run():
        calls.append(1)
        return VisibleGpus(tuple(entries), source)
    run.calls = calls
    return run


def worker_values(plan: GpuPlan, n):
    return [plan.env_value("worker", i) for i in range(n)]


@pytest.mark.parametrize("setting, n, expected", [
    ("0,1|2,3", 2, ["0,1", "2,3"]),
    ("0|1|", 3, ["0", "1", ""]),
    ("|", 2, ["", ""]),
    (" 3 , 0 | none | 2", 3, ["3,0", "", "2"]),
    ("0|0", 2, ["0", "0"]),                       # sharing a GPU, when asked for
    ([[0, 1], [], None], 3, ["0,1", "", ""]),
    ("none", 3, ["", "", ""]),
    ("2", 1, ["2"]),
])
def test_explicit_groups_give_each_worker_its_gpus(setting, n, expected):
    plan = assign_gpus(setting, n, detect())
    assert worker_values(plan, n) == expected
    # The launcher's own list maps positions to entries (here: its CUDA_VISIBLE_DEVICES).
    shifted = assign_gpus(setting, n, detect(("4", "5", "GPU-x", "7")))
    mapping = {"0": "4", "1": "5", "2": "GPU-x", "3": "7"}
    assert worker_values(shifted, n) == [",".join(mapping[v] for v in e.split(",") if v)
                                         for e in expected]


def test_default_is_one_gpu_per_worker_and_cpu_only_beyond_the_count(caplog):
    plan = assign_gpus(None, 3, detect(("GPU-a", "GPU-b", "GPU-c", "GPU-d")))
    assert worker_values(plan, 3) == ["GPU-a", "GPU-b", "GPU-c"]
    with caplog.at_level(logging.WARNING, logger="tf_hetbatch.launch.gpus"):
        plan = assign_gpus("auto", 3, detect(("0",)))
    assert worker_values(plan, 3) == ["0", "", ""]
    assert "workers 1, 2 run CPU-only" in caplog.text and "'0|0'" in caplog.text
    assert plan.lines(ps_mode=False) == ["worker 0: GPU 0", "worker 1: no GPU "
                                         "(CUDA_VISIBLE_DEVICES='')", "worker 2: no GPU "
                                         "(CUDA_VISIBLE_DEVICES='')"]


def test_without_gpus_or_with_all_the_environment_is_left_alone():
    for setting, run in [(None, detect(())), ("all", detect()), ("auto", detect(()))]:
        plan = assign_gpus(setting, 2, run)
        assert plan.groups is None and worker_values(plan, 2) == [None, None]
        assert plan.env_value("chief", 0) is None
        assert len(plan.lines(ps_mode=True)) == 1
    # 'all' and 'none' need no look-up (no nvidia-smi call).
    run = detect()
    assign_gpus("all", 2, run), assign_gpus("none", 2, run)
    assert run.calls == []


def test_with_parameter_servers_chief_and_ps_get_no_gpu():
    plan = assign_gpus("0|1,2", 2, detect())
    assert plan.env_value("chief", 0) == "" and plan.env_value("ps", 0) == ""
    assert plan.lines(ps_mode=True) == [
        "worker 0: GPU 0", "worker 1: GPUs 1,2", "chief and ps: no GPU (CUDA_VISIBLE_DEVICES='')"]
    plan = assign_gpus("0|1", 2, detect(("GPU-a", "GPU-b")))
    assert plan.lines(ps_mode=False) == ["worker 0: GPU 0 (CUDA_VISIBLE_DEVICES=GPU-a)",
                                         "worker 1: GPU 1 (CUDA_VISIBLE_DEVICES=GPU-b)"]


@pytest.mark.parametrize("setting, n, words", [
    ("0,1|x", 2, ["group 1", "'x'", "not a GPU index", "gpus='0,1|x'", "Fix"]),
    ("0|1|", 2, ["3 groups for 2 workers", "one group per worker", "gpus='0|1|'", "'0|1'"]),
    ("0", 2, ["1 group for 2 workers", "Fix"]),
    ("0|4", 2, ["group 1 names GPU '4'", "4 GPUs (from test list), numbered 0-3",
                "use indices 0-3"]),
    ("0|-1", 2, ["GPU '-1'", "numbered 0-3"]),
    ("1,1|2", 2, ["group 0 names a GPU twice", "[1, 1]"]),
    ([[0], [9]], 2, ["group 1 names GPU 9"]),
])
def test_bad_settings_fail_naming_the_value_and_the_fix(setting, n, words):
    with pytest.raises(ValueError) as info:
        assign_gpus(setting, n, detect())
    for word in words:
        assert word in str(info.value)


def test_explicit_groups_without_visible_gpus_say_so():
    with pytest.raises(ValueError) as info:
        assign_gpus("0|1", 2, detect((), "no nvidia-smi on PATH"))
    assert "sees no GPU (no nvidia-smi on PATH)" in str(info.value)
    assert "'none'" in str(info.value)
    assert worker_values(assign_gpus("|", 2, detect(())), 2) == ["", ""]


def test_env_setting_cuda_visible_devices_and_gpus_conflict():
    assert assign_gpus(None, 2, detect(), env_sets_cuda=True).groups is None
    with pytest.raises(ValueError, match="drop one of them"):
        assign_gpus("0|1", 2, detect(), env_sets_cuda=True)
    with pytest.raises(TypeError, match="gpus"):
        assign_gpus(3, 2, detect())
    with pytest.raises(TypeError, match="group 0"):
        assign_gpus(["0", "1"], 2, detect())


def test_nvidia_smi_list_and_cuda_visible_devices_are_read_as_cuda_does():
    assert parse_nvidia_smi_list(SMI) == (
        "GPU-aaaa1111-0000-0000-0000-000000000000", "MIG-cccc3333-0000-0000-0000-000000000000",
        "MIG-dddd4444-0000-0000-0000-000000000000",
        "MIG-GPU-eeee5555-0000-0000-0000-000000000000/7/0")
    assert parse_nvidia_smi_list("GPU 0: Tesla T4\nGPU 1: Tesla T4\n") == ("0", "1")
    assert parse_nvidia_smi_list("No devices were found\n") == ()
    assert cuda_visible_entries("2, 3,GPU-x") == ("2", "3", "GPU-x")
    assert cuda_visible_entries("") == () and cuda_visible_entries("-1") == ()
    assert cuda_visible_entries("1,-1,2") == ("1",)
    smi_calls = []

    def smi():
        smi_calls.append(1)
        return SMI, "nvidia-smi -L"
    # An existing CUDA_VISIBLE_DEVICES is the list (nvidia-smi is not asked) ...
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "6,7"}, smi).entries == ("6", "7")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, smi).entries == ()
    assert smi_calls == []
    # ... else nvidia-smi -L's, and none when it is missing or fails.
    assert len(visible_gpus({}, smi).entries) == 4
    assert visible_gpus({}, lambda: (None, "no nvidia-smi on PATH")) == \
        VisibleGpus((), "no nvidia-smi on PATH")


def test_bad_gpus_fail_before_any_process_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    script = tmp_path / "w.py"
    script.write_text("print('never runs')\n")
    with pytest.raises(ValueError, match="gpus='0|x'"):
        launch([str(script)], 2, gpus="0|x")
    with pytest.raises(SystemExit) as info:
        cli.main(["--workers", "2", "--gpus", "0|1|", str(script)])
    assert info.value.code == 2
    assert "3 groups for 2 workers" in capsys.readouterr().err
    assert our_children() == []


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_each_launched_worker_sees_its_own_gpus(tmp_path, monkeypatch, caplog):
    # The launcher's CUDA_VISIBLE_DEVICES is its visible list: positions map to its entries.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,GPU-x,7")
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent("""
        import json, os
        i = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        print(f"sees {os.environ.get('CUDA_VISIBLE_DEVICES')!r}")
    """))
    out = io.StringIO()
    with caplog.at_level(logging.INFO, logger="tf_hetbatch.launch"):
        result = launch([str(script)], 3, gpus="2,0||1", timeout=40, stdout=out,
                        stderr=io.StringIO())
    assert result.ok, result.message
    lines = out.getvalue().splitlines()
    for i, seen in enumerate(["7,5", "", "GPU-x"]):
        assert f"[worker {i}] sees {seen!r}" in lines, lines
    assert "worker 0: GPUs 2,0 (CUDA_VISIBLE_DEVICES=7,5)" in caplog.text
    assert "worker 1: no GPU" in caplog.text
    assert our_children() == []
